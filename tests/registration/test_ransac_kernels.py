"""The ransac kernel family's entry points that register()'s global stage calls.

``feature_matches`` (the feature matches found once and passed forward, in place of the
thread-local ``shared_feature_knn`` context) and the compatibility graph's
``second_order`` / ``second_order_of_points`` / ``pair_lengths`` (moved here from
``registration/robust.py``), each against its reference on every backend. These belong
with the family's other tests (tests/kernels/test_ransac.py) once that file exists.
"""

import numpy as np
import pytest
import torch

from pointalign.kernels import ransac as KR
from pointalign.kernels.ransac import cpu as _ransac_cpu
from pointalign.kernels.ransac import reference as ref


def _features(n, m, dim, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, dim, generator=g, dtype=torch.float64).to(dtype),
            torch.rand(m, dim, generator=g, dtype=torch.float64).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_feature_matches_equal_separate_calls(backend, dtype, monkeypatch):
    """The matches of one call are those of the separate ``feature_knn`` calls, exactly
    (the same sums in the same order, the same tie rule), from one fused pass on "cpu"; on
    the GPU the same distances, and between tied points either index."""
    a, b = _features(40, 30, 8, 3, dtype)
    a, b = a.to(backend.device), b.to(backend.device)
    b[7] = b[3]  # a tie: the smaller index wins on both paths
    want = [KR.feature_knn(a, b, 1), KR.feature_knn(a, b, 2), KR.feature_knn(b, a, 1)]
    calls = []
    real = _ransac_cpu.feature_knn_both_cpu
    monkeypatch.setattr(_ransac_cpu, "feature_knn_both_cpu",
                        lambda *x: calls.append(1) or real(*x))
    m = KR.feature_matches(a, b, 2)
    got = [m.forward(1), m.forward(2), (m.back_dists, m.back_idx)]
    for (d, i), (wd, wi), pts in zip(got, want, (b, b, a), strict=True):
        assert torch.equal(d, wd)
        if backend.name == "triton":  # torch.topk's order among equal distances is its own
            assert torch.equal(pts[i], pts[wi])  # a different index only for a tied point
        else:
            assert torch.equal(i, wi)
    assert m.k == 2 and m.idx.dtype == torch.int64 and m.back_idx.shape == (30, 1)
    assert len(calls) == (1 if backend.name == "cpu" else 0)
    fwd = KR.feature_matches(a, b, 1, backward=False)  # forward only: no backward search
    assert fwd.back_idx is None and fwd.back_dists is None
    assert torch.equal(fwd.idx, want[0][1]) and torch.equal(fwd.dists, want[0][0])
    # against the plain float64 answer: a nearest row (the reference's tie order aside;
    # no near ties in these features beyond the exact one)
    truth = ((a[:, None].double() - b[None].double()) ** 2).sum(-1).cpu()
    assert torch.equal(truth.gather(1, m.idx[:, :1].cpu())[:, 0], truth.min(1).values)
    assert torch.equal(truth.gather(0, m.back_idx[:, 0].cpu()[None])[0], truth.min(0).values)


def test_feature_matches_check_and_bad_input():
    a, b = _features(12, 9, 4, 0)
    m = KR.feature_matches(a, b, 2)
    m.check(12, 9)
    with pytest.raises(ValueError, match=r"matches: expected forward matches of shape \(13, k\)"):
        m.check(13, 9)
    with pytest.raises(ValueError, match=r"matches: expected backward matches of shape \(8, 1\)"):
        m.check(12, 8)
    with pytest.raises(ValueError, match="feature_matches: k must be in"):
        KR.feature_matches(a, b, 10)
    with pytest.raises(ValueError, match="feature_matches: expected"):
        KR.feature_matches(a, b[:, :3], 1)


def test_rank_correspondences_reads_the_matches_it_is_given():
    from pointalign.registration.robust import rank_correspondences

    a, b = _features(60, 50, 6, 1)
    m = KR.feature_matches(a, b, 2)
    assert torch.equal(rank_correspondences(a, b, 20, matches=m), rank_correspondences(a, b, 20))
    with pytest.raises(ValueError, match="matches"):
        rank_correspondences(a, b, 20, matches=KR.feature_matches(a, b, 1, backward=False))


def _compat(src: torch.Tensor, tgt: torch.Tensor, tau: float) -> torch.Tensor:
    A = ((torch.cdist(src, src) - torch.cdist(tgt, tgt)).abs() < tau).to(torch.float32)
    return A.fill_diagonal_(0)


@pytest.mark.parametrize("c", [3, 64, 130, 700])
def test_second_order_equals_reference(backend, c):
    """Exact integer counts on every backend (bit sets on "cpu", a float32 GEMM of 0/1
    entries with sums below 2²⁴ elsewhere)."""
    g = torch.Generator().manual_seed(c)
    src = torch.rand(c, 3, generator=g)
    tgt = src.clone()
    tgt[c // 3:] = torch.rand(c - c // 3, 3, generator=g)  # two thirds wrong matches
    A = _compat(src, tgt, 0.05).to(backend.device)
    S = KR.second_order(A)
    assert torch.equal(S, KR.second_order_reference(A))
    assert bool((S > 0).any()) or c == 3


def test_second_order_on_real_correspondences(backend, monkeypatch):
    """Two bunny scans paired by index: the entry point takes the kernel on "cpu"."""
    from pointalign import datasets

    p = datasets.load_bunny("bun000")[::40][:1000]
    q = datasets.load_bunny("bun045")[::40][:1000]
    A = _compat(q, p, 0.004).to(backend.device)
    calls = []
    real = _ransac_cpu.second_order_cpu
    monkeypatch.setattr(_ransac_cpu, "second_order_cpu", lambda a: calls.append(1) or real(a))
    S = KR.second_order(A)
    assert torch.equal(S, ref.second_order_reference(A))
    assert bool(calls) == (backend.name == "cpu")


@pytest.mark.parametrize("c", [3, 65, 700])
def test_second_order_of_points_equals_reference(backend, c, monkeypatch):
    """The fused kernel (lengths and A pair by pair, never stored) equals the reference.

    Bit for bit, with tau at a value some |ds − dt| takes exactly (the strict comparison
    decides those pairs) and at one that rounds to float32 (the comparison is PyTorch's).
    """
    g = torch.Generator().manual_seed(c)
    src = torch.rand(c, 3, generator=g) * 0.1
    tgt = src + torch.randn(c, 3, generator=g) * 0.004  # noisy correspondences
    tgt[: c // 3] = torch.rand(c // 3, 3, generator=g) * 0.1  # and wrong ones
    ds, dt = KR.pair_lengths(src), KR.pair_lengths(tgt)
    # the lengths themselves: sqrt((dx² + dy²) + dz²) rounded step by step (NumPy float32)
    d = src.numpy()[:, None] - src.numpy()[None]
    assert np.array_equal(ds.numpy(), np.sqrt((d[..., 0] ** 2 + d[..., 1] ** 2) + d[..., 2] ** 2))
    gap = (ds - dt).abs()
    tie = float(gap[0, 1]) if c > 3 else 0.7
    calls = []
    real = _ransac_cpu.second_order_points_cpu
    monkeypatch.setattr(_ransac_cpu, "second_order_points_cpu",
                        lambda *a: calls.append(1) or real(*a))
    for tau in (tie, 0.7 * float(gap.mean()) + 1e-9):
        A = ((ds - dt).abs() < tau).to(torch.float32).fill_diagonal_(0)
        want = ref.second_order_reference(A)
        assert 0 < int(A.sum()) < c * (c - 1) or c == 3
        assert torch.equal(ref.compatibility_reference(src, tgt, tau), A)
        assert torch.equal(ref.second_order_of_points_reference(src, tgt, tau), want)
        if backend.name == "cpu":
            assert torch.equal(real(src, tgt, tau), want)
        s, t = src.to(backend.device), tgt.to(backend.device)
        assert torch.equal(KR.second_order_of_points(s, t, tau).cpu(), want)
        # float64 ends: A by the reference, then the entry point's second order
        assert torch.equal(KR.second_order_of_points(s.double(), t.double(), tau).cpu(),
                           ref.second_order_of_points_reference(src.double(), tgt.double(),
                                                                tau))
    assert len(calls) == (2 if backend.name == "cpu" else 0)


def test_shared_context_is_gone():
    """The matches are passed forward; no thread-local context answers feature_knn."""
    assert not hasattr(KR, "shared_feature_knn") and not hasattr(KR, "SharedFeatureKnn")
