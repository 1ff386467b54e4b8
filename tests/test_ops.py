import torch

from pointalign._ops import exclusive_cumsum_rows


def test_exclusive_cumsum_rows_matches_cumsum(rng):
    for shape in [(1, 3), (7, 3), (50, 3, 3), (13,)]:
        v = torch.randn(*shape, generator=rng, dtype=torch.float64)
        got = exclusive_cumsum_rows(v)
        want = torch.cat([torch.zeros_like(v[:1]), torch.cumsum(v, 0)], 0)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        # a segment's sum is the difference of two rows
        torch.testing.assert_close(got[5 if shape[0] > 5 else 1] - got[0],
                                   v[: 5 if shape[0] > 5 else 1].sum(0))


def test_run_totals_are_the_sums_of_consecutive_runs(device):
    """run_totals: each run's sum (empty runs included), as a per-run sum gives it."""
    import itertools

    from pointalign._ops import run_totals

    def run_sums(values, lengths):
        cuts = torch.tensor(list(itertools.accumulate(lengths, initial=0)), device=device)
        return run_totals(values, cuts).tolist()

    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 5, (1000,), generator=g)
    for lengths in ([1000], [0, 400, 0, 599, 1], [1] * 1000, [500, 500]):
        got = run_sums(values.to(device), lengths)
        parts = torch.split(values, lengths)
        assert got == [int(p.sum()) for p in parts]
    assert run_sums(torch.ones(3, dtype=torch.bool, device=device), [1, 2]) == [1, 2]
    assert run_sums(torch.zeros(0, device=device), []) == []
