"""kernels.normal_eq, the fused ICP reduction and solve: the reference against independent
float64 oracles; every backend (torch, cpu, triton) against the reference; the Triton
kernels through the interpreter; masking, bad input; ICP end to end on the "cpu" backend.

Exactness: counts (``[28]``) are integers and equal exactly; the "cpu" backend's float64
sums differ from the reference's only by the order of float64 additions (rtol 1e-10); the
Triton kernel sums float32 blocks (1e-4 of each column's scale); the same code under 1 and 2
threads gives the same bits; the dispatcher returns what the kernel it calls returns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pointalign as pa
from pointalign import estimate
from pointalign.kernels import _backend
from pointalign.kernels import normal_eq as ne
from pointalign.kernels.normal_eq import cpu as _normal_eq_cpu
from tests._backends import backends, selected
from tests._interpreted import interpreted_fixture
from tests._oracles import icp_solve_np

KERNELS = ne.KERNELS


def _weights_np(r: np.ndarray, kind: str, k: float) -> np.ndarray:
    a = np.abs(r)
    if kind == "none":
        return np.ones_like(a)
    if kind == "huber":
        return np.where(a <= k, 1.0, k / np.maximum(a, 1e-30))
    if kind == "tukey":
        return np.where(a < k, (1 - (a / k) ** 2) ** 2, 0.0)
    return 1 / (1 + (a / k) ** 2)


def _case(seed: int, B=3, N=157, M=101, offset=0.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, N, 3, generator=g) + offset).to(dtype)
    y = (x[:, :M] + 0.3 * torch.randn(B, M, 3, generator=g)).to(dtype)
    n = torch.nn.functional.normalize(torch.randn(B, M, 3, generator=g), dim=-1).to(dtype)
    idx = torch.randint(-1, M, (B, N), generator=g)
    lengths = torch.randint(0, N + 1, (B,), generator=g)
    lengths[0] = N
    center = (torch.full((B, 3), offset) + 0.1 * torch.randn(B, 3, generator=g)).to(dtype)
    return x, y, n, idx, lengths, center


def _oracle(x, y, n, idx, lengths, center, kind, k):
    """(B, 30) float64 by NumPy loops over batch entries (p2l via estimate's own system)."""
    B = x.shape[0]
    out = np.zeros((B, 30))
    for b in range(B):
        L = int(lengths[b])
        ii = idx[b, :L].numpy()
        keep = ii >= 0
        xb = x[b, :L].double().numpy()[keep] - center[b].double().numpy()
        yb = y[b].double().numpy()[ii[keep]] - center[b].double().numpy()
        d2 = ((xb - yb) ** 2).sum(-1)
        out[b, 28] = keep.sum()
        out[b, 29] = d2.sum()
        if n is None:
            w = _weights_np(np.sqrt(d2), kind, k)
            out[b, 0] = w.sum()
            out[b, 1:4] = (w[:, None] * xb).sum(0)
            out[b, 4:7] = (w[:, None] * yb).sum(0)
            out[b, 7:16] = ((w[:, None] * xb).T @ yb).reshape(9)
            xx, yy = (w[:, None] * xb).T @ xb, (w[:, None] * yb).T @ yb
            out[b, 16:22] = [xx[i, j] for i, j in ne.TRIU3]
            out[b, 22:28] = [yy[i, j] for i, j in ne.TRIU3]
        else:
            nb = n[b].double().numpy()[ii[keep]]
            w = _weights_np(((xb - yb) * nb).sum(-1), kind, k)
            H, g, rr = estimate.point_to_plane_system(
                torch.from_numpy(xb), torch.from_numpy(yb), torch.from_numpy(nb),
                torch.from_numpy(w))
            out[b, :21] = [H[i, j].item() for i, j in ne.TRIU6]
            out[b, 21:27] = g.numpy()
            out[b, 27] = rr.item()
    return out


def _close(got: torch.Tensor, want: np.ndarray, rtol: float) -> None:
    got = got.detach().cpu().double().numpy()
    scale = np.abs(want).max(0, keepdims=True) + 1e-12
    np.testing.assert_allclose(got / scale, want / scale, atol=rtol, rtol=0)


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("plane", [False, True], ids=["p2p", "p2l"])
def test_reference_matches_float64_oracle(seed, kind, plane):
    x, y, n, idx, lengths, center = _case(seed)
    nn = n if plane else None
    got = ne.normal_equations_reference(x, y, idx, target_normals=nn, lengths=lengths,
                                        center=center, kernel=kind, scale=0.7)
    assert got.dtype == torch.float64 and got.shape == (3, 30)
    _close(got, _oracle(x, y, nn, idx, lengths, center, kind, 0.7), 1e-12)


def _on(device, *tensors):
    return [t.to(device) if t is not None else None for t in tensors]


def test_masking_no_correspondences(backend):
    x, y, n, idx, lengths, center = _on(backend.device, *_case(0))
    none = torch.full_like(idx, -1)
    for nn in (None, n):
        s = ne.normal_equations(x, y, none, target_normals=nn, lengths=lengths, center=center)
        assert torch.equal(s, torch.zeros_like(s))
        s = ne.normal_equations(x, y, idx, target_normals=nn, center=center,
                                lengths=torch.zeros_like(lengths))
        assert torch.equal(s, torch.zeros_like(s))


def test_padding_rows_ignored(backend, seed):
    x, y, n, idx, lengths, center = _on(backend.device, *_case(seed))
    lengths = torch.tensor([150, 40, 1], device=backend.device)
    junk = x.clone()
    for b in range(3):
        junk[b, lengths[b]:] = 1e6  # finite garbage in the padding
    for nn in (None, n):
        a = ne.normal_equations(x, y, idx, target_normals=nn, lengths=lengths, center=center)
        c = ne.normal_equations(junk, y, idx, target_normals=nn, lengths=lengths, center=center)
        assert torch.equal(a, c)


def test_unpack_roundtrip(seed):
    x, y, n, idx, lengths, center = _case(seed)
    s = ne.normal_equations_reference(x, y, idx, target_normals=n, lengths=lengths,
                                      center=center)
    H, g = ne.unpack_hessian(s)
    assert torch.equal(H, H.transpose(1, 2))
    assert (torch.linalg.eigvalsh(H) > -1e-9).all()
    assert torch.equal(g, s[:, 21:27])


def test_bad_input(backend):
    x, y, n, idx, lengths, center = _on(backend.device, *_case(0))
    with pytest.raises(ValueError, match="source"):
        ne.normal_equations(x[0], y, idx)
    with pytest.raises(ValueError, match="idx"):
        ne.normal_equations(x, y, idx.to(torch.int32))
    with pytest.raises(ValueError, match="target_normals"):
        ne.normal_equations(x, y, idx, target_normals=n[:, :5])
    with pytest.raises(ValueError, match="kernel"):
        ne.normal_equations(x, y, idx, kernel="welsch")
    with pytest.raises(ValueError, match="scale"):
        ne.normal_equations(x, y, idx, scale=0.0)
    with pytest.raises(ValueError, match="center"):
        ne.normal_equations(x, y, idx, center=center[:2])


# ---- Triton through the interpreter (child process, tiny sizes) --------------------------

INTERP = [("p2p-none", False, "none", 0.0), ("p2p-tukey", False, "tukey", 0.0),
          ("p2l-huber", True, "huber", 0.0), ("p2l-cauchy-far", True, "cauchy", 500.0)]


def run_interpreted_cases(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): Triton kernel on every case, via dispatch."""
    from pointalign.kernels import _backend

    assert _backend.backend(torch.empty(0)) == "interpret"
    out = {}
    for seed in range(3):
        for name, plane, kind, off in INTERP:
            x, y, n, idx, lengths, center = _case(seed, B=2, N=300, M=97, offset=off)
            out[(name, seed)] = ne.normal_equations(
                x, y, idx, target_normals=n if plane else None, lengths=lengths,
                center=center, kernel=kind, scale=0.7)
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.kernels.test_normal_eq", "run_interpreted_cases")


@pytest.mark.parametrize("case", INTERP, ids=[c[0] for c in INTERP])
def test_triton_interpreted_matches_reference(case, seed, interpreted):
    name, plane, kind, off = case
    x, y, n, idx, lengths, center = _case(seed, B=2, N=300, M=97, offset=off)
    nn = n if plane else None
    got = interpreted[(name, seed)]
    assert got.dtype == torch.float64 and got.shape == (2, 30)
    ref = ne.normal_equations_reference(x, y, idx, target_normals=nn, lengths=lengths,
                                        center=center, kernel=kind, scale=0.7)
    assert torch.equal(got[:, 28], ref[:, 28])  # counts are exact
    _close(got, ref.numpy(), 1e-4)


# ---- every backend against the reference ---------------------------------------------------

@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("plane", [False, True], ids=["p2p", "p2l"])
@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_normal_equations_match_reference(backend, seed, kind, plane, offset):
    """The dispatcher on each backend: counts exact, sums to float32 block rounding."""
    N, M = (100_003, 70_001) if backend.device == "cuda" else (10_007, 7_001)
    x, y, n, idx, lengths, center = _case(seed, B=3, N=N, M=M, offset=offset)
    args = _on(backend.device, x, y, n, idx, lengths, center)
    assert _backend.backend(args[0]) == backend.name
    got = ne.normal_equations(args[0], args[1], args[3], target_normals=args[2] if plane
                              else None, lengths=args[4], center=args[5], kernel=kind,
                              scale=0.7)
    assert got.device.type == backend.device and got.dtype == torch.float64
    ref = ne.normal_equations_reference(x, y, idx, target_normals=n if plane else None,
                                        lengths=lengths, center=center, kernel=kind, scale=0.7)
    assert torch.equal(got[:, 28].cpu(), ref[:, 28])
    _close(got, ref.numpy(), 1e-4)


# ---- the device solve: sums -> update (icp_update / solve_update_reference) ---------------

def _solve_case(seed: int, plane: bool):
    """Sums of 3 entries: exact correspondences, random ones, and only two (degenerate)."""
    from pointalign import datasets, transforms
    from pointalign.features.normals import estimate_normals

    cloud = datasets.random_subsample(datasets.load_bunny("bun000"), 400, seed=seed)
    g = torch.Generator().manual_seed(seed)
    T = transforms.random_transform(20.0, 0.02, generator=g).float()
    x = transforms.apply(T, cloud)[None].repeat(3, 1, 1).contiguous()
    y = cloud[None].repeat(3, 1, 1).contiguous()
    idx = torch.randint(-1, cloud.shape[0], (3, cloud.shape[0]), generator=g)
    idx[0] = torch.arange(cloud.shape[0])
    idx[2, 2:] = -1
    with selected("torch"):  # the inputs are the same for every backend under test
        n = estimate_normals(cloud, k=10)[None].repeat(3, 1, 1).contiguous() if plane else None
    c = cloud.mean(0)[None].repeat(3, 1).contiguous()
    Tin = transforms.random_transform(5.0, 0.01, generator=g)[None].repeat(3, 1, 1).double()
    return x, y, idx, n, c, Tin, T


@pytest.mark.parametrize("plane", [False, True], ids=["p2p", "p2l"])
def test_solve_reference_matches_numpy_solver(seed, plane):
    """The torch spec of the device solve equals the independent NumPy oracle."""
    x, y, idx, n, c, Tin, T = _solve_case(seed, plane)
    s = ne.normal_equations_reference(x, y, idx, target_normals=n, center=c)
    D, Tn, fl = ne.solve_update_reference(s, c, Tin, plane=plane)
    Dn, vn, un = icp_solve_np(s.numpy(), plane, c.double().numpy())
    np.testing.assert_allclose(D.numpy(), Dn, atol=1e-9)
    np.testing.assert_allclose(Tn.numpy(), Dn @ Tin.numpy(), atol=1e-9)
    np.testing.assert_array_equal(fl[:, 0].numpy() > 0, vn)
    np.testing.assert_array_equal(fl[:, 1].numpy() > 0, un)
    assert not vn[2] and vn[0]
    if not plane:  # exact correspondences: the update undoes T
        np.testing.assert_allclose(Dn[0] @ T.double().numpy(), np.eye(4), atol=1e-5)


def _host_solve_matches(host, s, c, Tin, plane: bool, atol: float) -> torch.Tensor:
    """Check a cpu-backend host solve against the torch spec on sums ``s``; its flags."""
    Dr, Tr, flr = ne.solve_update_reference(s, c, Tin, plane=plane)
    D, Tn, fl = host(s, c, Tin)
    assert D.dtype == Tn.dtype == torch.float64 and fl.dtype == torch.int32
    torch.testing.assert_close(D, Dr, atol=atol, rtol=0)
    torch.testing.assert_close(Tn, Tr, atol=atol, rtol=0)
    assert torch.equal(fl, flr)
    return fl


@backends("cpu")
def test_solve_plane_host_matches_reference(backend, seed):
    """The cpu backend's NumPy point-to-plane solve equals the torch spec (the case holds a
    well-posed, a rank-deficient and an empty system), and icp_update takes it."""
    x, y, idx, n, c, Tin, _ = _solve_case(seed, True)
    s = ne.normal_equations_reference(x, y, idx, target_normals=n, center=c)
    s[1, :21] = s[1, :21] * torch.tensor([1.0 if a < 3 and b < 3 else 0.0 for a, b in ne.TRIU6],
                                         dtype=torch.float64)  # translations undetermined
    s[1, 24:27] = 0
    fl = _host_solve_matches(ne.solve_update_plane_host, s, c, Tin, True, 1e-12)
    assert fl[0].tolist() == [1, 1] and fl[1].tolist() == [0, 1] and fl[2, 0] == 0
    L = torch.full((3,), x.shape[1])
    _, D2, Tn2, _, fl2 = ne.icp_update(x, y, idx, transform=Tin, plane=True, target_normals=n,
                                       lengths=L, center=c)
    D3, _, fl3 = ne.solve_update_reference(
        ne.normal_equations_reference(x, y, idx, target_normals=n, lengths=L, center=c),
        c, Tin, plane=True)
    torch.testing.assert_close(D2, D3, atol=1e-9, rtol=0)
    assert torch.equal(fl2, fl3)


@backends("cpu")
def test_solve_point_host_matches_reference(backend, seed):
    """The cpu backend's point-to-point solve (numba Horn, NumPy rest) equals the torch spec
    on a well-posed, a random and a degenerate (two-point) system, and icp_update takes it.
    The 4×4 eigenvectors agree to rounding over the eigen-gap (Jacobi against ``eigh``)."""
    x, y, idx, _, c, Tin, _ = _solve_case(seed, False)
    s = ne.normal_equations_reference(x, y, idx, center=c)
    fl = _host_solve_matches(ne.solve_update_point_host, s, c, Tin, False, 1e-10)
    assert fl[0].tolist() == [1, 1] and fl[2].tolist() == [0, 0]
    L = torch.full((3,), x.shape[1])
    _, D2, _, _, fl2 = ne.icp_update(x, y, idx, transform=Tin, plane=False, lengths=L,
                                     center=c)
    torch.testing.assert_close(D2, ne.solve_update_reference(s, c, Tin, plane=False)[0],
                               atol=1e-9, rtol=0)
    assert torch.equal(fl2, fl)


@backends("torch")
def test_icp_update_torch_path_outputs(backend, seed):
    x, y, idx, n, c, Tin, _ = _solve_case(seed, True)
    L = torch.full((3,), x.shape[1])
    s, D, Tn, Tf, fl = ne.icp_update(x, y, idx, transform=Tin, plane=True, target_normals=n,
                                     lengths=L, center=c)
    ref = ne.normal_equations_reference(x, y, idx, target_normals=n, lengths=L, center=c)
    assert torch.equal(s, ref) and Tf.dtype == torch.float32
    torch.testing.assert_close(Tf.double(), Tn, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(Tn, D @ Tin)


def run_interpreted_solve(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the Triton solve kernel on given sums."""
    from pointalign.kernels import _backend
    from pointalign.kernels.normal_eq import triton as _normal_eq_triton

    assert _backend.backend(torch.empty(0)) == "interpret"
    out = {}
    for plane in (False, True):
        x, y, idx, n, c, Tin, _ = _solve_case(0, plane)
        s = ne.normal_equations_reference(x, y, idx, target_normals=n, center=c)
        o = (torch.empty(3, 4, 4, dtype=torch.float64), torch.empty(3, 4, 4, dtype=torch.float64),
             torch.empty(3, 4, 4), torch.empty(3, 2, dtype=torch.int32))
        _normal_eq_triton._solve_kernel[(3,)](s, c, Tin, *o, 1e-10, PLANE=plane,
                                              SWEEPS=_normal_eq_triton._SWEEPS6,
                                              SQUARINGS=_normal_eq_triton._SQUARINGS,
                                              num_warps=1)
        out[plane] = (s,) + o
    torch.save(out, out_path)


interpreted_solve = interpreted_fixture("tests.kernels.test_normal_eq", "run_interpreted_solve",
                                        name="interpreted_solve")


@pytest.mark.parametrize("plane", [False, True], ids=["p2p", "p2l"])
def test_triton_solve_interpreted_matches_reference(interpreted_solve, plane):
    s, D, Tn, Tf, fl = interpreted_solve[plane]
    _, _, _, _, c, Tin, _ = _solve_case(0, plane)
    Dr, Tr, flr = ne.solve_update_reference(s, c, Tin, plane=plane)
    torch.testing.assert_close(D, Dr, atol=1e-7, rtol=0)  # the degenerate p2l entry: 1e-8
    torch.testing.assert_close(Tn, Tr, atol=1e-7, rtol=0)
    torch.testing.assert_close(Tf, Tr.float(), atol=1e-6, rtol=1e-6)
    assert torch.equal(fl, flr)


@pytest.mark.parametrize("plane", [False, True], ids=["p2p", "p2l"])
def test_icp_update_matches_reference(backend, seed, plane):
    x, y, idx, n, c, Tin, _ = _solve_case(seed, plane)
    L = torch.full((3,), x.shape[1])
    args = _on(backend.device, x, y, idx, n, c, Tin, L)
    assert _backend.backend(args[0]) == backend.name
    s, D, Tn, Tf, fl = ne.icp_update(args[0], args[1], args[2], target_normals=args[3],
                                     center=args[4], transform=args[5], lengths=args[6],
                                     plane=plane)
    Dr, Tr, flr = ne.solve_update_reference(s.cpu(), c, Tin, plane=plane)
    # the device's 6×6 solve is 8 cyclic Jacobi sweeps against LAPACK's eigh: they agree to
    # ~3e-7 on the worst seed (point-to-plane), far below the float32 sums' own rounding.
    # Entry 2 has two correspondences: its least-norm step lives in the eigenvectors of a
    # rank-deficient 6×6 whose null space the two solvers resolve to ~1e-6 (H200: 1.4e-6)
    tol = 1e-6 if plane else 1e-7
    for b, t in ((slice(0, 2), tol), (slice(2, 3), 10 * tol)):
        torch.testing.assert_close(D.cpu()[b], Dr[b], atol=t, rtol=0)
        torch.testing.assert_close(Tn.cpu()[b], Tr[b], atol=t, rtol=0)
    assert torch.equal(fl.cpu(), flr)
    ref = ne.normal_equations_reference(x, y, idx, target_normals=n, lengths=L, center=c)
    _close(s, ref.numpy(), 1e-4)


# ---- the "cpu" backend's numba sums (normal_eq/cpu.py) and ICP on it -----------------------

def _sums_case(seed, dtype, B=3, N=1000, M=600, offset=5.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, N, 3, generator=g) + offset).to(dtype)
    y = (torch.randn(B, M, 3, generator=g) + offset).to(dtype)
    n = torch.nn.functional.normalize(torch.randn(B, M, 3, generator=g), dim=-1).to(dtype)
    idx = torch.randint(-1, M, (B, N), generator=g)
    lengths = torch.tensor([N, N // 3, 0])
    center = torch.full((B, 3), offset, dtype=dtype) + 0.1
    return x, y, n, idx, lengths, center


@backends("cpu")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("plane", [False, True])
@pytest.mark.parametrize("kernel", ne.KERNELS)
def test_normal_equations_cpu_equals_reference(backend, seed, dtype, plane, kernel):
    x, y, n, idx, lengths, center = _sums_case(seed, dtype)
    args = (x, y, idx)
    kw = dict(target_normals=n if plane else None, lengths=lengths, center=center,
              kernel=kernel, scale=0.8)
    ref = ne.normal_equations_reference(*args, **kw)
    got = _normal_eq_cpu.normal_equations_cpu(x, y, idx, n if plane else None, lengths, center,
                                              kernel, 0.8)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-9)
    assert torch.equal(ne.normal_equations(*args, **kw), got)  # the dispatcher's choice
    assert torch.all(got[2] == 0)  # lengths 0: nothing


@backends("cpu")
def test_normal_equations_cpu_thread_invariant(backend, seed):
    x, y, n, idx, lengths, center = _sums_case(seed, torch.float32, N=20000)
    try:
        pa.set_num_threads(1)
        a = _normal_eq_cpu.normal_equations_cpu(x, y, idx, n, lengths, center, "huber", 0.5)
        pa.set_num_threads(2)
        b = _normal_eq_cpu.normal_equations_cpu(x, y, idx, n, lengths, center, "huber", 0.5)
    finally:
        pa.set_num_threads(None)
    assert torch.equal(a, b)


@backends("cpu")
def test_icp_cpu_backend_equals_torch_backend(backend, bunny_scans):
    """ICP end to end: the "cpu" backend's kernels (tree, sums, host solve) against the same
    run on the PyTorch references."""
    s, t = bunny_scans
    s, t = s[::6].contiguous(), t[::6].contiguous()
    crit = pa.ConvergenceCriteria(max_iterations=15, relative_fitness=0, relative_rmse=0,
                                  translation_tolerance=0, rotation_tolerance=0)
    out = {}
    for be in ("cpu", "torch"):
        with selected(be):
            for m in ("point_to_point", "point_to_plane"):
                # plain: acceleration's extrapolation would amplify the rounding compared
                out[be, m] = pa.icp(s, t, max_correspondence_distance=0.05, method=m,
                                    criteria=crit, device="cpu", acceleration=False)
    for m in ("point_to_point", "point_to_plane"):
        a, b = out["cpu", m], out["torch", m]
        # float64 sums in another order, float32 normals (point-to-plane) and distance ties
        # of the search: after 15 iterations the estimates differ by ~1e-5 (measured 1.2e-5)
        tol = 1e-4
        torch.testing.assert_close(torch.as_tensor(a.transformation),
                                   torch.as_tensor(b.transformation), rtol=0, atol=tol)
        assert abs(a.fitness - b.fitness) <= 1e-3
