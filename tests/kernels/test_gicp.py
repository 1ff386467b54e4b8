"""The GICP kernel family: covariances vs a NumPy eigen-decomposition oracle, the Mahalanobis
normal equations vs a NumPy oracle, every backend vs the reference (numba here, Triton
through the interpreter in a child process and compiled on CUDA), the Gaussian voxel map
and its look-up (exact integers), the fallback rule, masking, bad input.

Bounds (derived, not fitted):

* covariances, float64: the closed-form eigenvector (Smith's angle, then a null vector)
  loses up to ~sqrt(u) of its angle where two eigenvalues nearly coincide, divided by the
  relative gap of the smallest one: ``|ΔC| <= 8 sqrt(u) / gap`` with
  ``gap = (λ₂ − λ₁) / λ₃`` (u = 2⁻⁵³); in float32 output one more rounding (2⁻²⁴).
* sums, float64 (numba vs reference): the same terms added in another order and grouping:
  ``|Δ| <= 4 n u Σ|terms|`` (n: pairs per batch entry).
* sums, float32 (Triton): each term carries the float32 inverse of the combined covariance
  (relative error ~κ u₃₂, κ = λ_max/λ_min <= 2/ε) plus the block sums in float32:
  ``|Δ| <= (8 κ + 2 BLOCK) u₃₂ Σ|terms|``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

from pointalign import datasets, transforms
from pointalign.kernels import gicp as kg
from pointalign.kernels import normal_eq as ne
from pointalign.kernels.gicp import reference as ref
from tests._interpreted import interpreted_fixture

U64 = 2.0 ** -53
U32 = 2.0 ** -24
KAPPA = 2 / ref.PLANE_EPS


# ---- oracles (NumPy, float64, loops) -----------------------------------------------------

def _cov_oracle(pts: np.ndarray, idx: np.ndarray, eps: float = ref.PLANE_EPS):
    """``(Q, 3, 3)`` plane covariances and ``(Q,)`` relative gaps (inf for the fallback)."""
    out = np.tile(np.eye(3), (idx.shape[0], 1, 1))
    gaps = np.full(idx.shape[0], np.inf)
    for i, row in enumerate(idx):
        nb = pts[row[row >= 0]].astype(np.float64)
        if nb.shape[0] < 3:
            continue
        d = nb - nb.mean(0)
        lam, V = np.linalg.eigh(d.T @ d / nb.shape[0])
        if not lam[1] > 1e-9 * lam[2]:  # no plane (the library's rule: e₂ > 1e-10 ‖C‖²)
            continue
        out[i] = V @ np.diag([eps, 1.0, 1.0]) @ V.T
        gaps[i] = (lam[1] - lam[0]) / lam[2]
    return out, gaps


def _weights(rho: torch.Tensor, kind: str, k: float) -> torch.Tensor:
    a = rho.abs()
    if kind == "none":
        return torch.ones_like(a)
    if kind == "huber":
        return torch.where(a <= k, 1.0, k / a.clamp_min(1e-300))
    if kind == "tukey":
        return torch.where(a < k, (1 - (a / k) ** 2) ** 2, 0.0)
    return 1 / (1 + (a / k) ** 2)


def _sums_oracle(x, sc, y, tc, idx, R, lengths, center, kind="none", k=1.0):
    """``(B, 30)`` sums and ``(B, 30)`` sums of |terms|, float64, with ``torch.linalg.inv``.

    Each pair's terms written out as matrices (``J = [−[x̃]×, I]``, ``H = w Jᵀ M J``,
    ``g = w Jᵀ M r``), independent of the reference's formulas.
    """
    f = torch.float64
    x, sc, y, tc, R, center = (torch.as_tensor(t).to(f) for t in (x, sc, y, tc, R, center))
    idx, lengths = torch.as_tensor(idx), torch.as_tensor(lengths)
    B, N, S = idx.shape
    xt = x - center[:, None]
    Cs = torch.einsum("bij,bnjk,blk->bnil", R, sc, R)
    ok = (torch.arange(N)[None, :, None] < lengths[:, None, None]) & (idx >= 0)
    j = idx.clamp_min(0)
    bi = torch.arange(B)[:, None, None]
    r = xt[:, :, None] - (y[bi, j] - center[:, None, None])
    C = torch.where(ok[..., None, None], tc[bi, j] + Cs[:, :, None], torch.eye(3, dtype=f))
    M = torch.linalg.inv(C)
    e = torch.einsum("...i,...ij,...j->...", r, M, r)
    w = _weights((ref.ROBUST_SCALE2 * e.clamp_min(0)).sqrt(), kind, k) * ok
    X = xt[:, :, None].expand(B, N, S, 3)
    z = torch.zeros_like(X[..., 0])
    neg_skew = -torch.stack([torch.stack([z, -X[..., 2], X[..., 1]], -1),
                             torch.stack([X[..., 2], z, -X[..., 0]], -1),
                             torch.stack([-X[..., 1], X[..., 0], z], -1)], -2)
    J = torch.cat([neg_skew, torch.eye(3, dtype=f).expand(B, N, S, 3, 3)], -1)
    H = w[..., None, None] * (J.transpose(-1, -2) @ M @ J)
    g = w[..., None] * (J.transpose(-1, -2) @ (M @ r[..., None]))[..., 0]
    terms = torch.cat([H[..., a, b, None] for a in range(6) for b in range(a, 6)]
                      + [g, (w * e)[..., None]], -1)                      # (B, N, S, 28)
    terms = terms * ok[..., None]
    n = ok.sum(-1)
    d2 = ((r * r).sum(-1) * ok).sum(-1) / n.clamp_min(1)
    extra = torch.stack([(n > 0).to(f), d2], -1).sum(1)                    # (B, 2)
    out = torch.cat([terms.sum((1, 2)), extra], 1)
    mag = torch.cat([terms.abs().sum((1, 2)), extra], 1)
    return out.numpy(), mag.numpy()


def _bunny_table(n: int = 400, k: int = 12, seed: int = 0):
    pts = datasets.random_subsample(datasets.load_bunny("bun000"), n, seed=seed)
    _, i = cKDTree(pts.numpy()).query(pts.numpy(), k)
    return pts, torch.from_numpy(i).to(torch.int64)


def _degenerate_table():
    """Rows with the fallback: < 3 neighbours, one point repeated, collinear points."""
    pts = torch.tensor([[0.0, 0, 0], [1, 0, 0], [2, 0, 0], [3, 0, 0], [0, 1, 0], [0, 0, 1],
                        [5, 5, 5]], dtype=torch.float64)
    idx = torch.tensor([[0, 1, -1, -1],      # two neighbours
                        [-1, -1, -1, -1],    # none
                        [6, 6, 6, 6],        # one point repeated
                        [0, 1, 2, 3],        # collinear
                        [0, 1, 4, -1],       # a plane (z = 0): the regular case
                        [0, 1, 4, 5]])       # a tetrahedron
    return pts, idx


# ---- covariances --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_covariances_match_numpy_eigh(backend, seed, dtype):
    pts, idx = _bunny_table(seed=seed)
    idx[::7, 5:] = -1                      # ragged rows
    pts = pts.to(dtype)
    got = kg.covariances(pts.to(backend.device), idx.to(backend.device)).cpu()
    assert got.dtype == dtype and got.shape == (400, 3, 3)
    want, gaps = _cov_oracle(pts.double().numpy(), idx.numpy())
    tol = 8 * math.sqrt(U64) / gaps + (4 * U32 if dtype == torch.float32 else 0.0)
    err = np.abs(got.double().numpy() - want).max((1, 2))
    assert (err <= np.minimum(tol, 1.0)).all(), (err / tol).max()
    assert torch.equal(got, got.transpose(1, 2))


def test_covariances_reference_matches_numpy_eigh(seed):
    pts, idx = _bunny_table(seed=seed)
    got = ref.covariances_reference(pts.double(), idx)
    want, gaps = _cov_oracle(pts.double().numpy(), idx.numpy())
    err = np.abs(got.numpy() - want).max((1, 2))
    assert (err <= 8 * math.sqrt(U64) / gaps).all()
    # plane-regularised: eigenvalues (ε, 1, 1)
    ev = torch.linalg.eigvalsh(got)
    torch.testing.assert_close(ev, torch.tensor([ref.PLANE_EPS, 1, 1],
                                                dtype=torch.float64).expand_as(ev),
                               atol=1e-12, rtol=0)


def test_covariances_fallback_rule(backend):
    pts, idx = _degenerate_table()
    got = kg.covariances(pts.to(backend.device), idx.to(backend.device)).cpu()
    assert torch.isfinite(got).all()
    eye = torch.eye(3, dtype=torch.float64)
    for row in range(4):
        assert torch.equal(got[row], eye), row
    n = torch.tensor([0.0, 0, 1], dtype=torch.float64)
    torch.testing.assert_close(got[4], eye - (1 - ref.PLANE_EPS) * torch.outer(n, n),
                               atol=1e-15, rtol=0)
    want, _ = _cov_oracle(pts.numpy(), idx.numpy())
    torch.testing.assert_close(got, torch.from_numpy(want), atol=1e-12, rtol=0)


def test_covariances_eps_and_bad_input():
    pts, idx = _bunny_table(n=50, k=5)
    C = kg.covariances(pts, idx, eps=0.25)
    torch.testing.assert_close(torch.linalg.eigvalsh(C.double())[:, 0],
                               torch.full((50,), 0.25, dtype=torch.float64), atol=1e-6,
                               rtol=0)
    with pytest.raises(ValueError, match="eps"):
        kg.covariances(pts, idx, eps=0.0)
    with pytest.raises(ValueError, match="nbr_idx"):
        kg.covariances(pts, idx.to(torch.int32))
    with pytest.raises(ValueError, match="points"):
        kg.covariances(pts[:, :2], idx)


@pytest.mark.parametrize("n, k", [(400, 20), (20, 20), (3, 3), (1000, 7)])
def test_knn_covariances_fused_equals_search_then_covariances(backend, seed, n, k):
    """The fused search + reduction gives the bits of the search's table then ``covariances``.

    Both visit the same tree with the same ordered keys and sum the same neighbours in the
    same order (plain float64 operations): equality, also with duplicated points (ties go
    to the smaller index on both sides). Backends without a fused kernel answer None.
    """
    from pointalign.kernels import knn

    g = torch.Generator().manual_seed(seed)
    pts = datasets.random_subsample(datasets.load_bunny("bun000"), n, seed=seed)
    pts[n // 2:n // 2 + n // 5] = pts[: n // 5]                 # duplicates: ties
    pts = pts + 1e-4 * torch.randn(n, 3, generator=g) * (torch.arange(n) % 3 == 0)[:, None]
    got = kg.knn_covariances(pts.to(backend.device), k)
    if backend.name == "torch":
        assert got is None
        return
    if backend.name == "triton":  # its own search (tests below): the exact k-NN
        _check_self_query_covariances(got.cpu(), pts, k)
        return
    assert got is not None and got.dtype == torch.float32 and got.shape == (n, 3, 3)
    _, idx = knn.host_tree(pts).knn_self(k)
    assert torch.equal(got, kg.covariances(pts, torch.from_numpy(idx)))
    # and the neighbourhoods are the exact k-NN (cKDTree oracle, compared as sets of rows)
    d_tree, _ = cKDTree(pts.double().numpy()).query(pts.double().numpy(), k)
    d_ours = np.sort(((pts[:, None].double() - pts[torch.from_numpy(idx)].double()) ** 2)
                     .sum(-1).sqrt().numpy(), 1)
    np.testing.assert_allclose(d_ours, d_tree, rtol=0, atol=4 * U32 * float(pts.abs().max()))


def _check_self_query_covariances(got, pts, k):
    """``got`` against the float64 oracle over each point's exact k-NN (brute force).

    A row whose k-th and (k+1)-th distances tie may keep either point: those rows are
    checked to be the oracle of *some* exact k-NN (their k-th distance equals the oracle's),
    the others against the oracle's covariance, within ``covariances``' float32 bound.
    """
    n = pts.shape[0]
    p64 = pts.double().numpy()
    dk, idx = cKDTree(p64).query(p64, min(k + 1, n))
    want, gaps = _cov_oracle(p64, idx[:, :k])
    tol = 8 * math.sqrt(U64) / gaps + 4 * U32
    clear = dk[:, k] > dk[:, k - 1] * (1 + 1e-5) if k < n else np.ones(n, bool)
    err = np.abs(got.double().numpy() - want).max((1, 2))
    assert (err[clear] <= np.minimum(tol, 1.0)[clear]).all(), (err / tol)[clear].max()
    assert clear.mean() > 0.5
    assert torch.isfinite(got).all() and torch.equal(got, got.transpose(1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(40000, 20), (5003, 7), (33, 32)])
def test_knn_covariances_triton_self_query(seed, n, k):
    """The Triton self-query (a k-d tree asked in tree order) on a real scan and a flat
    synthetic sheet, with trees of two leaf sizes, and through ``estimate_covariances``."""
    from pointalign.features.covariances import estimate_covariances
    from pointalign.search.kdtree import KDTreeIndex

    g = torch.Generator().manual_seed(seed)
    pts = datasets.random_subsample(datasets.load_bunny("bun000"), min(n, 40000), seed=seed)
    if seed % 2:
        pts = torch.rand(n, 3, generator=g) * torch.tensor([4.0, 1.0, 0.01])
    for leaf in (8, 16):
        tree = KDTreeIndex(pts.cuda(), leaf_size=leaf)
        got = kg.knn_covariances(pts.cuda(), k, tree=tree.arrays)
        _check_self_query_covariances(got.cpu(), pts, k)
        again = estimate_covariances(pts.cuda(), k, index=tree)
        assert torch.equal(again, got)
    _check_self_query_covariances(estimate_covariances(pts.cuda(), k).cpu(), pts, k)
    cov, order = kg.knn_covariances_ordered(pts.cuda(), k)
    _check_ordered(cov, order, kg.knn_covariances(pts.cuda(), k))
    # the tree's order is spatially coherent: consecutive points far nearer than at random
    p = pts.cuda()
    step = (p[order][1:] - p[order][:-1]).norm(dim=1).median()
    assert step < 0.5 * (p[1:] - p[:-1]).norm(dim=1).median() or seed % 2 == 0
    with pytest.raises(ValueError, match="tree"):
        kg.knn_covariances(pts[1:].cuda(), k, tree=tree.arrays)


@pytest.mark.gpu
def test_knn_covariances_triton_graph_per_size_class(seed):
    """Without a tree: one CUDA graph per size class, captured, then replayed for another
    cloud of the same class with the same answers as the eager program."""
    from pointalign.kernels import _loop

    _loop.clear_caches()
    a = datasets.random_subsample(datasets.load_bunny("bun000"), 25081, seed=seed).cuda()
    b = datasets.random_subsample(datasets.load_bunny("bun045"), 24650, seed=seed).cuda()
    assert kg.size_class(25081) == kg.size_class(24650) == 26624
    first = kg.knn_covariances(a, 20)
    kinds = [type(e.payload).__name__ for e in _loop._programs.entries.values()]
    assert kinds == ["tuple"], kinds  # captured, not "failed"
    replayed = kg.knn_covariances(b, 20)
    assert len(_loop._programs.entries) == 1
    for pts, got in ((a, first), (b, replayed)):
        _check_self_query_covariances(got.cpu(), pts.cpu(), 20)
    _loop.USE_GRAPHS, old = False, _loop.USE_GRAPHS
    try:
        eager = kg.knn_covariances(b, 20)
    finally:
        _loop.USE_GRAPHS = old
    torch.testing.assert_close(replayed, eager, atol=1e-6, rtol=0)


def test_size_class():
    for n in (1, 63, 64, 65, 100, 1000, 4097, 25081, 10**6):
        c = kg.size_class(n)
        assert c >= max(n, 64) and c <= max(64, n * 1.125 + 1)
        assert kg.size_class(c) == c
    with pytest.raises(ValueError, match="n"):
        kg.size_class(0)


def test_knn_covariances_interpreted_self_query(interpreted, seed):
    """The Triton path of ``knn_covariances`` through the interpreter (small clouds)."""
    if seed >= 2:
        pytest.skip("the interpreted run covers the first 2 seeds")
    pts, k = _self_query_cloud(seed)
    _check_self_query_covariances(interpreted[("self_query", seed)], pts, k)
    _check_self_query_covariances(interpreted[("self_query_padded", seed)], pts, k)
    cov, order = interpreted[("self_query_ordered", seed)]
    _check_ordered(cov, order, interpreted[("self_query_padded", seed)])


def _check_ordered(cov, order, plain):
    """``knn_covariances_ordered``: a permutation, and the covariances of the points in it,
    bit for bit (the same tree and arithmetic); its neighbouring entries lie close."""
    n = plain.shape[0]
    assert order.dtype == torch.int64
    assert torch.equal(torch.sort(order).values, torch.arange(n, device=order.device))
    assert torch.equal(cov, plain[order])


def _self_query_cloud(seed):
    pts = datasets.random_subsample(datasets.load_bunny("bun000"), 150, seed=seed)
    return pts, 12


def test_knn_covariances_ordered_elsewhere_and_bad_input():
    pts = torch.rand(60, 3)
    assert kg.knn_covariances_ordered(pts, 5) is None  # the "cpu" backend: no graph
    with pytest.raises(ValueError, match="k"):
        kg.knn_covariances_ordered(pts, 61)
    with pytest.raises(ValueError, match="shape"):
        kg.knn_covariances_ordered(pts[:, :2], 5)


def test_knn_covariances_float64_and_bad_input():
    pts = datasets.random_subsample(datasets.load_bunny("bun000"), 50, seed=0)
    assert kg.knn_covariances(pts.double(), 5) is None  # no fused kernel: the caller searches
    with pytest.raises(ValueError, match="k"):
        kg.knn_covariances(pts, 51)
    with pytest.raises(ValueError, match="eps"):
        kg.knn_covariances(pts, 5, eps=1.5)
    with pytest.raises(ValueError, match="points"):
        kg.knn_covariances(pts[:, :2], 5)


# ---- the Mahalanobis normal equations ------------------------------------------------------

def _case(seed: int, B=2, N=157, M=101, S=1, offset=0.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cloud, nb = _bunny_table(n=max(N, M), k=10, seed=seed)
    C = ref.covariances_reference(cloud.double(), nb)
    x = (torch.randn(B, N, 3, generator=g) * 0.05 + offset).to(dtype)
    y = (x[:, :M] + 0.01 * torch.randn(B, M, 3, generator=g)).to(dtype)
    sc = C[torch.randint(0, C.shape[0], (B, N), generator=g)].to(dtype)
    tc = C[torch.randint(0, C.shape[0], (B, M), generator=g)].to(dtype)
    idx = torch.randint(-1, M, (B, N, S), generator=g)
    R = torch.stack([transforms.random_transform(40.0, 0.0, generator=g)[:3, :3]
                     for _ in range(B)]).to(dtype)
    lengths = torch.randint(N // 2, N + 1, (B,), generator=g)
    lengths[0] = N
    center = (offset + 0.01 * torch.randn(B, 3, generator=g)).to(dtype)
    return x, sc, y, tc, idx, R, lengths, center


def _assert_within(got, want, mag, rel):
    got = got.detach().cpu().double().numpy()
    np.testing.assert_array_less(np.abs(got - want), rel * mag + 1e-300)


@pytest.mark.parametrize("kind", ref.KERNELS)
@pytest.mark.parametrize("S", [1, 3])
def test_sums_reference_matches_numpy_oracle(seed, kind, S):
    x, sc, y, tc, idx, R, L, c = _case(seed, S=S, dtype=torch.float64)
    got = ref.gicp_sums_reference(x, sc, y, tc, idx, R, lengths=L, center=c, kernel=kind,
                                  scale=0.01)
    assert got.dtype == torch.float64 and got.shape == (2, 30)
    want, mag = _sums_oracle(x, sc, y, tc, idx, R, L, c, kind, 0.01)
    _assert_within(got, want, mag, 4 * 157 * S * U64 * 8)  # + the inverses' rounding


@pytest.mark.parametrize("kind", ref.KERNELS)
@pytest.mark.parametrize("S", [1, 3])
def test_sums_backend_matches_reference(backend, seed, kind, S):
    x, sc, y, tc, idx, R, L, c = _case(seed, S=S, offset=0.0 if seed else 300.0)
    args = [t.to(backend.device) for t in (x, sc, y, tc, idx, R)]
    got = kg.gicp_sums(*args, lengths=L.to(backend.device), center=c.to(backend.device),
                       kernel=kind, scale=0.01)
    assert got.dtype == torch.float64 and got.device.type == backend.device
    want, mag = _sums_oracle(x, sc, y, tc, idx, R, L, c, kind, 0.01)
    assert torch.equal(got[:, 28].cpu(), torch.from_numpy(want[:, 28]))  # counts: exact
    if backend.name == "triton":
        from pointalign.kernels.gicp.triton import BLOCK

        rel = (8 * KAPPA + 2 * BLOCK) * U32
    else:  # float64 in another order (the reference: whole columns; numba: blocks)
        rel = 4 * 157 * S * U64 * 8
    _assert_within(got, want, mag, rel)


def test_sums_masking_and_padding(backend):
    x, sc, y, tc, idx, R, L, c = _case(0, S=2)
    dev = backend.device
    put = [t.to(dev) for t in (x, sc, y, tc)]
    none = torch.full_like(idx, -1).to(dev)
    s = kg.gicp_sums(*put, none, R.to(dev), lengths=L.to(dev), center=c.to(dev))
    assert torch.equal(s.cpu(), torch.zeros_like(s.cpu()))
    s = kg.gicp_sums(*put, idx.to(dev), R.to(dev), lengths=torch.zeros_like(L).to(dev),
                     center=c.to(dev))
    assert torch.equal(s.cpu(), torch.zeros_like(s.cpu()))
    L = torch.tensor([150, 40])
    junk, junk_c = x.clone(), sc.clone()
    for b in range(2):
        junk[b, L[b]:] = 1e6
        junk_c[b, L[b]:] = 7.0
    a = kg.gicp_sums(*put, idx.to(dev), R.to(dev), lengths=L.to(dev), center=c.to(dev))
    b = kg.gicp_sums(junk.to(dev), junk_c.to(dev), *put[2:], idx.to(dev), R.to(dev),
                     lengths=L.to(dev), center=c.to(dev))
    assert torch.equal(a, b)


def test_sums_point_to_plane_special_case():
    """With Cˢ = 0 and Cᵗ = nnᵀ + δ(I − nnᵀ), the sums are ICP's point-to-plane + O(1/δ)."""
    x, _, y, _, idx, R, L, c = _case(1, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    n = torch.nn.functional.normalize(torch.randn(2, 101, 3, generator=g, dtype=torch.float64),
                                      dim=-1)
    big = 1e6  # M = nnᵀ + (I − nnᵀ)/δ; the adjugate's rounding grows as δ u
    tc = n[..., :, None] * n[..., None, :]
    tc = tc + big * (torch.eye(3, dtype=torch.float64) - tc)
    sc = torch.zeros(2, 157, 3, 3, dtype=torch.float64)
    got = ref.gicp_sums_reference(x, sc, y, tc, idx, R, lengths=L, center=c)
    p2l = ne.normal_equations_reference(x, y, idx[..., 0], target_normals=n, lengths=L,
                                        center=c)
    # the in-plane part adds Σ|J|²|r|²/δ at most: bounded by the scale of the sums / δ × 10
    scale = p2l[:, :28].abs().amax(0, keepdim=True) + got[:, :28].abs().amax(0, keepdim=True)
    assert ((got[:, :28] - p2l[:, :28]).abs() <= 10 / big * scale.amax()).all()


def test_update_matches_solve_of_reference(backend, seed):
    x, sc, y, tc, idx, R, L, c = _case(seed)
    T = torch.eye(4, dtype=torch.float64).repeat(2, 1, 1)
    T[:, :3, :3] = R.double()
    dev = backend.device
    s, D, Tn, Tf, fl = kg.gicp_update(*(t.to(dev) for t in (x, sc, y, tc, idx)),
                                      transform=T.to(dev), lengths=L.to(dev),
                                      center=c.to(dev))
    assert D.device.type == dev and Tf.dtype == torch.float32 and fl.dtype == torch.int32
    Dr, Tr, flr = ne.solve_update_reference(s.cpu(), c, T, plane=True)
    # the device solve (Triton: Jacobi sweeps) against LAPACK's eigh: ICP's bound
    torch.testing.assert_close(D.cpu(), Dr, atol=1e-6, rtol=0)
    torch.testing.assert_close(Tn.cpu(), Tr, atol=1e-6, rtol=0)
    assert torch.equal(fl.cpu(), flr)
    torch.testing.assert_close(Tf.cpu().double(), Tn.cpu(), atol=1e-6, rtol=1e-6)


def test_sums_bad_input():
    x, sc, y, tc, idx, R, L, c = _case(0)
    with pytest.raises(ValueError, match="source"):
        kg.gicp_sums(x[0], sc, y, tc, idx, R)
    with pytest.raises(ValueError, match="source_cov"):
        kg.gicp_sums(x, sc[:, :5], y, tc, idx, R)
    with pytest.raises(ValueError, match="target_cov"):
        kg.gicp_sums(x, sc, y, tc[..., :2], idx, R)
    with pytest.raises(ValueError, match="idx"):
        kg.gicp_sums(x, sc, y, tc, idx.to(torch.int32), R)
    with pytest.raises(ValueError, match="rotation"):
        kg.gicp_sums(x, sc, y, tc, idx, R[:1])
    with pytest.raises(ValueError, match="kernel"):
        kg.gicp_sums(x, sc, y, tc, idx, R, kernel="welsch")
    with pytest.raises(ValueError, match="scale"):
        kg.gicp_sums(x, sc, y, tc, idx, R, scale=0.0)
    with pytest.raises(ValueError, match="center"):
        kg.gicp_sums(x, sc, y, tc, idx, R, center=c[:1])


# ---- the Gaussian voxel map ------------------------------------------------------------------

def _voxel_case(seed: int, B=2, N=300, M=400):
    g = torch.Generator().manual_seed(seed)
    tgt = torch.randn(B, M, 3, generator=g) * 0.1
    covs = ref.covariances_reference(*_bunny_table(n=M, k=8, seed=seed))
    tc = covs[None].repeat(B, 1, 1, 1)
    src = tgt[:, :N] + 0.03 * torch.randn(B, N, 3, generator=g)
    lengths = torch.tensor([M, M - 57])
    return src, tgt, tc, lengths


def _voxel_oracle(tgt, tc, lengths, size, src, offsets):
    """Per batch: {cell: (mean, mean cov)}, and each source point's nearest voxel's cell."""
    maps, best = [], []
    for b in range(tgt.shape[0]):
        m: dict = {}
        for p, C in zip(tgt[b, :lengths[b]].double().numpy(), tc[b].double().numpy(),
                        strict=False):
            key = tuple(np.floor(p * (1.0 / size)).astype(np.int64))
            s = m.setdefault(key, [np.zeros(3), np.zeros((3, 3)), 0])
            s[0] += p
            s[1] += C
            s[2] += 1
        maps.append({kk: (v[0] / v[2], v[1] / v[2], v[2]) for kk, v in m.items()})
        row = []
        for p in src[b].double().numpy():
            cell = np.floor(p * (1.0 / size)).astype(np.int64)
            cands = [(float(((p - maps[-1][key][0]) ** 2).sum()), key) for o in offsets
                     if (key := tuple(cell + np.asarray(o))) in maps[-1]]
            row.append(min(cands)[1] if cands else None)
        best.append(row)
    return maps, best


@pytest.mark.parametrize("size", [0.02, 0.05])
def test_voxelize_matches_oracle(seed, size):
    src, tgt, tc, L = _voxel_case(seed)
    vm = kg.voxelize(tgt, L, tc, size)
    maps, _ = _voxel_oracle(tgt, tc, L, size, src, ref.OFFSETS[:1])
    for b in range(2):
        v = len(maps[b])
        keys = vm.keys[b, :v]
        assert (vm.keys[b, v:] == ref.KEY_PAD).all() and (keys[1:] > keys[:-1]).all()
        for q in range(v):
            kk = int(keys[q])
            cell = tuple(((kk >> (2 * ref.KEY_BITS - s * ref.KEY_BITS)) & ((1 << ref.KEY_BITS)
                                                                            - 1)) - ref.KEY_OFFSET
                         for s in range(3))
            mu, C, n = maps[b][cell]
            assert int(vm.counts[b, q]) == n
            np.testing.assert_allclose(vm.means[b, q].double().numpy(), mu, rtol=2 * U32,
                                       atol=2 * U32 * 0.5)
            np.testing.assert_allclose(vm.covariances[b, q].double().numpy(), C, rtol=0,
                                       atol=4 * U32)


def _assert_same_map(got, want):
    for name in ("keys", "counts", "means", "covariances"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.voxel_size == want.voxel_size


@pytest.mark.parametrize("size", [0.004, 0.03, 10.0])
def test_voxelize_cpu_equals_reference(seed, size):
    """The hashed numba pass gives the reference's map bit for bit.

    The same float64 cells, the same float64 sums in point order per voxel and the same
    divisions: nothing is rounded differently (fine voxels: most hold one point; coarse:
    one voxel holds them all; the second problem is padded).
    """
    from pointalign.kernels.gicp import cpu as gcpu

    _, tgt, tc, L = _voxel_case(seed)
    tgt = tgt + 0.5  # cells on both sides of no origin
    got = gcpu.voxelize_cpu(tgt, L.tolist(), tc, size)
    _assert_same_map(got, ref.voxelize_reference(tgt, L, tc, size))
    with pytest.raises(ValueError, match="too small"):
        gcpu.voxelize_cpu(tgt * 1e6, L.tolist(), tc, 1e-3)


def test_voxelize_cpu_equals_reference_on_a_scan():
    from pointalign.kernels.gicp import cpu as gcpu

    pts = datasets.load_bunny("bun000")[None]
    covs = torch.eye(3).expand(*pts.shape[:2], 3, 3) * (1.0 + pts[..., :1, None])
    L = torch.tensor([pts.shape[1]])
    _assert_same_map(gcpu.voxelize_cpu(pts, L.tolist(), covs, 0.01),
                     ref.voxelize_reference(pts, L, covs, 0.01))


@pytest.mark.parametrize("neighborhood", ref.NEIGHBORHOODS)
def test_voxel_lookup_exact(backend, seed, neighborhood):
    src, tgt, tc, L = _voxel_case(seed)
    dev = backend.device
    vm = kg.voxelize(tgt.to(dev), L.to(dev), tc.to(dev), 0.03)
    got = kg.voxel_lookup(src.to(dev), vm, neighborhood).cpu()
    assert got.dtype == torch.int64 and got.shape == src.shape[:2]
    want = ref.voxel_lookup_reference(src, ref.voxelize_reference(tgt, L, tc, 0.03),
                                      neighborhood)
    assert torch.equal(got, want)
    _, best = _voxel_oracle(tgt, tc, L, 0.03, src, ref.OFFSETS[:neighborhood])
    keys = vm.keys.cpu()
    for b in range(2):
        for i, cell in enumerate(best[b]):
            if cell is None:
                assert got[b, i] == -1
            else:
                c = np.asarray(cell) + ref.KEY_OFFSET
                kk = (int(c[0]) << (2 * ref.KEY_BITS)) | (int(c[1]) << ref.KEY_BITS) | int(c[2])
                assert int(keys[b, got[b, i]]) == kk
    if neighborhood > 1:  # a wider search finds at least the voxels the own cell finds
        own = kg.voxel_lookup(src.to(dev), vm, 1).cpu()
        assert ((got >= 0) | (own < 0)).all()


@pytest.mark.parametrize("neighborhood", ref.NEIGHBORHOODS)
@pytest.mark.parametrize("kind", ["none", "huber"])
def test_vgicp_update_equals_move_lookup_update(backend, seed, neighborhood, kind):
    """One VGICP step (fused on the numba path) gives the bits of its three parts.

    ``transform_points`` → ``voxel_lookup`` → ``gicp_update``: the fused kernel moves each
    point with the same float32 products and sums, finds the same voxel and adds the same
    float64 terms in the same row blocks, so the sums and the solve are equal.
    """
    from pointalign.kernels import ransac as kr

    src, tgt, tc, L = _voxel_case(seed)
    g = torch.Generator().manual_seed(seed)
    B, N = src.shape[:2]
    sc = tc[:, torch.randint(0, tc.shape[1], (N,), generator=g)]
    dev = backend.device
    T = torch.stack([transforms.random_transform(8.0, 0.01, generator=g) for _ in range(B)])
    Tf = T.to(torch.float32)
    lengths = torch.tensor([N, N - 31])
    center = 0.01 * torch.randn(B, 3, generator=g)
    vm = kg.voxelize(tgt.to(dev), L.to(dev), tc.to(dev), 0.03)
    args = dict(lengths=lengths.to(dev), center=center.to(dev), kernel=kind, scale=0.02)
    got = kg.vgicp_update(src.to(dev), sc.to(dev), vm, neighborhood, transform=T.to(dev),
                          transform_f32=Tf.to(dev), **args)
    x = kr.transform_points(Tf.to(dev), src.to(dev))
    idx = kg.voxel_lookup(x, vm, neighborhood)
    want = kg.gicp_update(x, sc.to(dev), vm.means, vm.covariances, idx, transform=T.to(dev),
                          **args)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    assert float(got[0][0, 28]) > 0  # pairs were found
    with pytest.raises(ValueError, match="neighborhood"):
        kg.vgicp_update(src.to(dev), sc.to(dev), vm, 5, transform=T.to(dev),
                        transform_f32=Tf.to(dev), **args)


def test_voxel_bad_input():
    src, tgt, tc, L = _voxel_case(0)
    vm = kg.voxelize(tgt, L, tc, 0.03)
    with pytest.raises(ValueError, match="neighborhood"):
        kg.voxel_lookup(src, vm, 9)
    with pytest.raises(ValueError, match="points"):
        kg.voxel_lookup(src[0], vm, 1)
    with pytest.raises(ValueError, match="voxel_size"):
        kg.voxelize(tgt, L, tc, 0.0)
    with pytest.raises(ValueError, match="voxel_size"):
        kg.voxelize(tgt * 1e6, L, tc, 1e-3)  # beyond 2**20 voxels from the origin


# ---- Triton through the interpreter (child process, tiny sizes) ------------------------------

INTERP_SUMS = [("none", 1, 0.0), ("huber", 3, 0.0), ("tukey", 1, 300.0), ("cauchy", 2, 0.0)]


def run_interpreted_cases(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the Triton kernels through the dispatchers."""
    from pointalign.kernels import _backend, kdtree

    assert _backend.backend(torch.empty(0)) == "interpret"
    out: dict = {}
    for dtype in (torch.float32, torch.float64):
        pts, idx = _bunny_table(n=200, k=10)
        idx[::5, 4:] = -1
        out[("cov", dtype)] = kg.covariances(pts.to(dtype), idx)
    pts, idx = _degenerate_table()
    out["cov_degenerate"] = kg.covariances(pts, idx)
    for kind, S, off in INTERP_SUMS:
        x, sc, y, tc, ix, R, L, c = _case(0, N=150, M=90, S=S, offset=off)
        out[("sums", kind)] = kg.gicp_sums(x, sc, y, tc, ix, R, lengths=L, center=c,
                                           kernel=kind, scale=0.01)
    x, sc, y, tc, ix, R, L, c = _case(1)
    T = torch.eye(4, dtype=torch.float64).repeat(2, 1, 1)
    T[:, :3, :3] = R.double()
    out["update"] = kg.gicp_update(x, sc, y, tc, ix, transform=T, lengths=L, center=c)
    for seed in range(2):
        pts, k = _self_query_cloud(seed)
        tree = kdtree.build(pts, kdtree.depth_for(pts.shape[0], 16))
        out[("self_query", seed)] = kg.knn_covariances(pts, k, tree=tree)
        out[("self_query_padded", seed)] = kg.knn_covariances(pts, k)  # its own tree
        out[("self_query_ordered", seed)] = kg.knn_covariances_ordered(pts, k)
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.kernels.test_gicp", "run_interpreted_cases")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_triton_interpreted_covariances(interpreted, dtype):
    pts, idx = _bunny_table(n=200, k=10)
    idx[::5, 4:] = -1
    got = interpreted[("cov", dtype)]
    assert got.dtype == dtype
    want, gaps = _cov_oracle(pts.double().numpy(), idx.numpy())
    tol = 8 * math.sqrt(U64) / gaps + (4 * U32 if dtype == torch.float32 else 0.0)
    assert (np.abs(got.double().numpy() - want).max((1, 2)) <= np.minimum(tol, 1.0)).all()
    pts, idx = _degenerate_table()
    want, _ = _cov_oracle(pts.numpy(), idx.numpy())
    torch.testing.assert_close(interpreted["cov_degenerate"], torch.from_numpy(want),
                               atol=1e-12, rtol=0)


@pytest.mark.parametrize("case", INTERP_SUMS, ids=[c[0] for c in INTERP_SUMS])
def test_triton_interpreted_sums(interpreted, case):
    from pointalign.kernels.gicp.triton import BLOCK

    kind, S, off = case
    x, sc, y, tc, ix, R, L, c = _case(0, N=150, M=90, S=S, offset=off)
    got = interpreted[("sums", kind)]
    want, mag = _sums_oracle(x, sc, y, tc, ix, R, L, c, kind, 0.01)
    assert torch.equal(got[:, 28], torch.from_numpy(want[:, 28]))
    _assert_within(got, want, mag, (8 * KAPPA + 2 * BLOCK) * U32)


def test_triton_interpreted_update(interpreted):
    x, sc, y, tc, ix, R, L, c = _case(1)
    T = torch.eye(4, dtype=torch.float64).repeat(2, 1, 1)
    T[:, :3, :3] = R.double()
    s, D, Tn, Tf, fl = interpreted["update"]
    Dr, Tr, flr = ne.solve_update_reference(s, c, T, plane=True)
    torch.testing.assert_close(D, Dr, atol=1e-6, rtol=0)
    torch.testing.assert_close(Tn, Tr, atol=1e-6, rtol=0)
    assert torch.equal(fl, flr)


# ---- CUDA at sizes the interpreter cannot reach ------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("S", [1, 7])
def test_triton_cuda_large(seed, S):
    x, sc, y, tc, idx, R, L, c = _case(seed, N=70_001, M=30_011, S=S, offset=100.0)
    args = [t.cuda() for t in (x, sc, y, tc, idx, R)]
    got = kg.gicp_sums(*args, lengths=L.cuda(), center=c.cuda(), kernel="huber", scale=0.01)
    want, mag = _sums_oracle(x, sc, y, tc, idx, R, L, c, "huber", 0.01)
    assert torch.equal(got[:, 28].cpu(), torch.from_numpy(want[:, 28]))
    from pointalign.kernels.gicp.triton import BLOCK

    _assert_within(got, want, mag, (8 * KAPPA + 2 * BLOCK) * U32)


# ---- the CPU's fused GICP step ---------------------------------------------------------------

@pytest.mark.parametrize("kind", ["none", "huber"])
@pytest.mark.parametrize("scan", [False, True])
def test_gicp_step_cpu_equals_move_search_update(seed, kind, scan):
    """One fused step (move, hinted search, sums, solve) gives the bits of its parts.

    ``transform_points`` → the host tree's ``nearest`` (from the hints) → ``gicp_update``:
    the fused pass moves each row with the same float32 products and sums, finds the same
    partner (the search is exact, whatever the hint) and adds the same float64 terms in
    the same row blocks. Two problems share the target (one tree); the second is padded.
    """
    from pointalign.kernels import knn as kk
    from pointalign.kernels import ransac as kr
    from pointalign.kernels._backend import cpu_available

    if not cpu_available():
        pytest.skip("numba is not installed")
    g = torch.Generator().manual_seed(seed)
    if scan:
        tgt1 = datasets.random_subsample(datasets.load_bunny("bun000"), 3000, seed=seed)
    else:
        tgt1 = torch.rand(2500, 3, generator=g) * 0.2
    M, N = tgt1.shape[0], 900
    tc1 = ref.covariances_reference(tgt1, torch.from_numpy(
        cKDTree(tgt1.numpy()).query(tgt1.numpy(), 8)[1]).to(torch.int64))
    tree = kk.host_tree(tgt1)
    d, i = tree.knn_self(12)
    tree.set_candidates(d, i, 8)
    src = tgt1[torch.randint(0, M, (2, N), generator=g)] + 0.004 * torch.randn(2, N, 3,
                                                                               generator=g)
    sc = tc1[torch.randint(0, M, (2, N), generator=g)]
    T = torch.stack([transforms.random_transform(5.0, 0.005, generator=g) for _ in range(2)])
    Tf = T.to(torch.float32)
    lengths = torch.tensor([N, N - 77])
    center = 0.01 * torch.randn(2, 3, generator=g)
    hint = torch.randint(-1, M, (2, N), generator=g)  # some none, most wrong
    tgt, tc = tgt1.expand(2, M, 3), tc1.expand(2, M, 3, 3)
    args = dict(lengths=lengths, center=center, kernel=kind, scale=0.01)
    got = kg.gicp_step_cpu(src, sc, tgt, tc, tree, hint, 0.01, transform=T, transform_f32=Tf,
                           **args)
    x = kr.transform_points(Tf, src)
    want_idx = torch.stack([torch.from_numpy(tree.nearest(x[b].numpy(), 0.01 * 0.01,
                                                          hint[b].numpy())[1])
                            for b in range(2)])
    want = kg.gicp_update(x, sc, tgt, tc, want_idx, transform=T, **args)
    for a, b in zip(got[:5], want, strict=True):
        assert torch.equal(a, b)
    for b in range(2):
        L = int(lengths[b])
        assert torch.equal(got[5][b, :L], want_idx[b, :L]) and (got[5][b, L:] == -1).all()
    assert int((want_idx >= 0).sum()) > N  # pairs were found
    with pytest.raises(ValueError, match="hint"):
        kg.gicp_step_cpu(src, sc, tgt, tc, tree, hint[:, :5], 0.01, transform=T,
                         transform_f32=Tf, **args)
