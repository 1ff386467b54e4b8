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
