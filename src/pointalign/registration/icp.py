"""Iterative closest point: point-to-point (Horn) and point-to-plane (linearised 6×6), batched.

Each iteration: move the source by the current estimate, find for every source point the
nearest target point within ``max_correspondence_distance`` (an
:class:`~pointalign.search.base.Index` built once over the target and reused), reduce the
correspondences in one fused pass (:func:`pointalign.kernels.normal_eq.normal_equations`),
and solve for the update in float64:

* point-to-point: ``argmin Σ w_i ||R x_i + t − y_i||²`` by Horn's quaternion method from the
  weighted moments (Besl & McKay, "A method for registration of 3-D shapes", PAMI 1992;
  Horn, JOSA A 1987);
* point-to-plane: ``argmin Σ w_i (n_iᵀ(R x_i + t − y_i))²`` linearised at the current
  estimate, a 6×6 system (Chen & Medioni, "Object modelling by registration of multiple
  range images", IVC 1992).

Weights w_i come from the robust kernel (IRLS: recomputed from the current residuals).

The search of each iteration is warm-started where the index allows it: the k-d tree starts
from the distance to the last iteration's correspondence (an exact search still, but one
that prunes most of the tree once the updates are small: on the H100, ICP on the 40k-point
bunny pair at 5 cm went from 1.4 to 0.40 ms per iteration in ``bench_icp``, and at 1M
points from about 15.7 to 6-7 ms).

Device traffic: one small record per step. Each step (move the source, search, fused
reduction, float64 solve by Jacobi rotations in a Triton kernel, compose the estimate) is
enqueued on the device; the estimate feeds the next step there. The host reads each step's
record (sums, update, estimate, flags) while the next step already runs, and replays the
stopping rules iteration by iteration, so results equal a per-iteration check; a step
computed past a stop is discarded (``info["device_steps"]``). A single problem's steps are
replayed from CUDA graphs: a one-step graph captured after the first step of a call, and
chunks of ``CHUNK`` steps kept for later calls with the same index (``USE_CUDA_GRAPHS``,
``info["cuda_graph"]``). On the CPU the same loop runs the PyTorch references
(``torch.linalg.eigh`` solve), one step per check.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np
import torch

from pointalign import _validate, estimate, transforms
from pointalign.cloud import PointCloud
from pointalign.kernels import normal_eq
from pointalign.registration.criteria import ConvergenceCriteria, RobustKernel
from pointalign.registration.result import RegistrationResult

METHODS = ("point_to_point", "point_to_plane")

#: neighbours used for target normals when point-to-plane needs them and none are given
NORMALS_K = 20


def _resolve_device(device: Any, *named: tuple[str, Any]) -> torch.device:
    devs = {}
    for name, x in named:
        if isinstance(x, PointCloud):
            devs[name] = x.points.device
        elif isinstance(x, torch.Tensor):
            devs[name] = x.device
        elif isinstance(x, (list, tuple)):
            for i, c in enumerate(x):
                if isinstance(c, (torch.Tensor, PointCloud)):
                    devs[f"{name}[{i}]"] = c.device if isinstance(c, torch.Tensor) \
                        else c.points.device
    if len(set(devs.values())) > 1:
        desc = ", ".join(f"{k} on {v}" for k, v in devs.items())
        raise ValueError(f"inputs are on different devices: {desc}; move them to one device "
                         "(or pass NumPy arrays and device=)")
    if device is not None:
        return _validate.as_device(device)
    if devs:
        return next(iter(devs.values()))
    return _validate.default_device()


def _as_batch_f32(x: Any, name: str, lengths: Any, dev: torch.device):
    pts, lens, batched = _validate.as_batch(x, name, lengths=lengths, min_points=1, device=dev)
    return pts.to(torch.float32).contiguous(), lens, batched


def _target_normals(target: Any, target_normals: Any, tgt: torch.Tensor, dev: torch.device):
    """Normals ``(B, M, 3)`` float32 from the argument or a PointCloud target, else None."""
    if target_normals is None and isinstance(target, PointCloud):
        target_normals = target.normals
    if target_normals is None:
        return None
    t = _validate._to_tensor("target_normals", target_normals)
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.shape != tgt.shape and not (t.shape[0] == 1 and t.shape[1:] == tgt.shape[1:]):
        raise ValueError(f"target_normals: expected shape {tuple(tgt.shape[1:])} or "
                         f"{tuple(tgt.shape)} (like target), got {tuple(t.shape)}")
    t = _validate._float("target_normals", t, torch.float32).to(dev)
    _validate._check_finite("target_normals", t)
    return t.expand_as(tgt).contiguous()


def _build_indexes(tgt, tlens, max_dist, index):
    """One index per distinct target (the target may be shared by all pairs)."""
    from pointalign.search import build_index

    B = tgt.shape[0]
    if index is not None:
        idxs = list(index) if isinstance(index, (list, tuple)) else [index] * B
        if len(idxs) != B:
            raise ValueError(f"index: expected one index or a list of {B}, got {len(idxs)}")
        for b, ix in enumerate(idxs):
            p = getattr(ix, "points", None)
            n = int(tlens[b])
            if p is None or not hasattr(ix, "nearest_within"):
                raise TypeError("index: expected an object implementing the Index protocol "
                                "(pointalign.search.build_index)")
            if p.shape != (n, 3) or p.device != tgt.device:
                raise ValueError(f"index: built over {tuple(p.shape)} points on {p.device}, but "
                                 f"target{'' if B == 1 else f'[{b}]'} has ({n}, 3) on "
                                 f"{tgt.device}")
        return idxs
    out = []
    for b in range(B):
        pts = tgt[b, : int(tlens[b])]
        out.append(_default_index(pts, max_dist, build_index))
    return out


#: On a GPU, ICP searches a voxel grid with cells of the maximum correspondence distance
#: when that distance is at most this many times the grid's automatic cell (about 4 points
#: per occupied cell); a larger bound would make every query scan thousands of points, so
#: the k-d tree (whose cost does not grow with the bound) is used instead.
GRID_MAX_RATIO = 8.0


def _default_index(pts: torch.Tensor, max_dist: float, build_index):
    """The index ICP builds when none is given (the rule is in :func:`icp`'s docstring)."""
    if pts.device.type == "cpu":
        return build_index(pts, "auto", max_distance=max_dist)  # SciPy cKDTree
    order = ["grid", "kdtree", "brute"]
    try:
        from pointalign.search.grid import auto_cell_size

        if max_dist > GRID_MAX_RATIO * auto_cell_size(pts):
            order = ["kdtree", "grid", "brute"]
    except (ImportError, AttributeError, TypeError, ValueError):
        pass  # no grid module (or another helper): try the methods in the default order
    for m in order:
        try:
            return build_index(pts, m, max_distance=max_dist)
        except (ImportError, ValueError):
            continue
    return build_index(pts, "brute")


#: Steps per replay of a graph kept for later calls; steps run past a stop are discarded.
#: Eager steps are checked one at a time: launching a step costs the host more than the
#: synchronisation of a check (about 0.3 ms against 30 us for a few thousand points), and
#: on large clouds the device time of a wasted step is larger still, so a longer eager
#: chunk only adds discarded steps.
CHUNK = 8

#: Replay the steps of a single (unbatched) problem from a CUDA graph: a replay costs the
#: host a few API calls where an eager step costs ~15 launches (and Python around each);
#: falls back to eager launches if the capture fails. Two graphs:
#:
#: * within a call, once it has launched ``GRAPH_AFTER_STEPS`` steps eagerly (which
#:   compiles every kernel the capture records), a graph of one step is captured on the
#:   call's own tensors (capturing costs about two eager steps) and replayed for the
#:   remaining steps, one in flight while the host checks the last;
#: * a later call with the same index captures a ``CHUNK``-step graph on copies of its
#:   inputs at its start and keeps it: calls after that refresh the copies and replay.
#:
#: info["cuda_graph"] says which happened ("first_use": eager only, "captured", "reused",
#: a failure, or "off").
USE_CUDA_GRAPHS = True
#: Eager steps a call launches before it captures its one-step graph (see
#: ``USE_CUDA_GRAPHS``).
GRAPH_AFTER_STEPS = 1
#: Captured graphs kept for later calls with the same index and problem shape (least
#: recently used first out). Each holds its own copy of the inputs (source, target,
#: normals, ~3 floats per point each), refreshed by a device copy on every call.
GRAPH_CACHE_SIZE = 4
_graphs: dict[tuple, dict] = {}


_streams: dict[torch.device, Any] = {}
_anchors: dict[torch.device, Any] = {}


def _side_stream(dev: torch.device):
    """Return the side stream graphs are captured on (one per device, created once)."""
    if dev not in _streams:
        _streams[dev] = torch.cuda.Stream(dev)
    return _streams[dev]


def _scratch_pool(dev: torch.device):
    """Return the memory pool the one-step graphs of single calls share (None: a new one).

    The pool of the last such graph, which is kept alive for it (a pool lives while a graph
    uses it), so later captures reuse its memory instead of allocating afresh. Sharing is
    safe because replays never overlap: every graph is replayed on the current stream, and
    what outlives a replay (the record) stays referenced by its call.
    """
    g = _anchors.get(dev)
    return None if g is None else g.pool()


def _cached_graph(key: tuple, ix: Any) -> dict:
    """Return the graph record kept under ``key`` for this very index, or an empty one.

    A hit moves to the most recent place; a miss is filled by this call's capture.
    """
    rec = _graphs.pop(key, None)
    if rec is not None and rec["index"]() is ix:
        _graphs[key] = rec
        return rec
    return {}


def _store_graph(key: tuple, ix: Any, rec: dict) -> None:
    """Keep ``rec`` for later calls while ``ix`` lives (dropped when it is collected)."""
    def forget(_ref, key=key):
        _graphs.pop(key, None)

    rec["index"] = weakref.ref(ix, forget)
    _graphs[key] = rec
    while len(_graphs) > GRAPH_CACHE_SIZE:
        _graphs.pop(next(iter(_graphs)))


#: Queries are put in a spatially coherent (Morton) order from this many on; below it the
#: search is too small for the order to matter and the ~40 launches of the sort would not pay.
SPATIAL_ORDER_MIN = 8192


def _spatial_order(points: torch.Tensor) -> torch.Tensor:
    """Permutation ``(N,)`` sorting ``points (N, 3)`` along a Morton (Z-order) curve.

    10 bits per axis over the bounding box; one sort per ICP call.
    """
    lo = points.amin(0)
    span = (points.amax(0) - lo).amax().clamp_min(1e-30)
    q = ((points - lo) / span * 1023).clamp(0, 1023).to(torch.int64)

    def spread(v: torch.Tensor) -> torch.Tensor:
        v = (v | (v << 16)) & 0x030000FF
        v = (v | (v << 8)) & 0x0300F00F
        v = (v | (v << 4)) & 0x030C30C3
        return (v | (v << 2)) & 0x09249249

    return torch.argsort(spread(q[:, 0]) | (spread(q[:, 1]) << 1) | (spread(q[:, 2]) << 2))


#: Correspondence search on the Triton path goes through fine voxel grids first: tier j has
#: cells ``TIER_BASE * 4**j`` automatic cells (at most ``TIERS`` tiers, all below half the
#: maximum distance). A query whose nearest point in a tier lies within the tier's cell is
#: answered exactly there (every closer point is in its 27 cells); the rest go on to the next
#: tier and finally to the index itself (bound = the maximum distance). Queries already
#: answered are sent to the next stage as a far-away point, which every index rejects at once,
#: so the shapes stay static (no compaction, no synchronisation). Not used in front of brute
#: force or of a grid with cells <= GRID_MAX_RATIO automatic cells (measured slower on the
#: H100: bunny 40k, grid 1 cm 0.60 -> 0.84 ms/iteration; k-d tree 5 cm 2.9 -> 2.2).
TIER_BASE = 2.0
TIERS = 2
_FAR = 1e30
_tier_cache: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()


def _tiers(ix: Any, max_dist: float) -> list:
    """The fine grids (built once per index and cached) used before ``ix``; may be empty."""
    from pointalign.kernels._backend import backend

    pts = getattr(ix, "points", None)
    if not isinstance(pts, torch.Tensor) or backend(pts) == "torch":
        return []
    try:
        from pointalign.search.grid import VoxelGridIndex, auto_cell_size

        if not hasattr(VoxelGridIndex, "nearest_within_unchecked"):
            return []
        if type(ix).__name__ == "BruteForceIndex":
            return []  # its cost does not drop for the queries already answered
        if getattr(ix, "supports_hint", False):
            return []  # the last correspondences prune its search better (see _query_fn)
        cache = _tier_cache.setdefault(ix, {})
        if "auto" not in cache:
            cache["auto"] = auto_cell_size(pts)
        if isinstance(ix, VoxelGridIndex) and ix.cell_size <= GRID_MAX_RATIO * cache["auto"]:
            return []  # a fine enough grid: one pass is cheaper (measured on the bunny)
        out = []
        for j in range(TIERS):
            cell = TIER_BASE * 4**j * cache["auto"]
            if cell > max_dist / 2:
                break
            if cell not in cache:
                cache[cell] = VoxelGridIndex(pts, cell)
            out.append(cache[cell])
        return out
    except (ImportError, TypeError, ValueError):
        return []


def _query_fn(ix: Any, max_dist: float):
    """``(x (n, 3), hint (n,)) -> idx (n,)``: the nearest target point within ``max_dist``.

    ``-1`` where none. Exact (same answer as ``ix.nearest_within``). ``hint`` holds the last
    iteration's correspondences (-1: none); an index with ``supports_hint`` (the k-d tree)
    starts its search from them (after the first iterations the source moves little, so the
    hint is at or next to the answer and most of the tree is pruned). Otherwise the hint is
    unused and the search goes through the fine grid tiers (see ``TIER_BASE``) and the
    index's check-free path where they exist.
    """
    tiers = _tiers(ix, max_dist)
    fast = getattr(ix, "nearest_within_unchecked", None)
    hinted = callable(fast) and getattr(ix, "supports_hint", False)

    def last(q: torch.Tensor, hint: torch.Tensor) -> torch.Tensor:
        if hinted:
            return fast(q, max_dist, hint)[1]
        if callable(fast):
            return fast(q, max_dist)[1]
        return ix.nearest_within(q, max_dist).idx[:, 0]

    last.hinted = hinted  # whether the hint is read (callers keep it up to date only then)
    if not tiers:
        return last

    def query(q: torch.Tensor, hint: torch.Tensor) -> torch.Tensor:
        idx = None
        for g in tiers:
            _, i = g.nearest_within_unchecked(q, g.cell_size)
            idx = i if idx is None else torch.where(idx >= 0, idx, i)
            q = torch.where(i[:, None] >= 0, torch.full_like(q[:1], _FAR), q)
        return torch.where(idx >= 0, idx, last(q, hint))

    query.hinted = hinted
    return query


def _make_translation(c: torch.Tensor) -> torch.Tensor:
    return transforms.make(torch.eye(3, dtype=c.dtype).expand(c.shape[0], 3, 3), c)


def _solve(sums: torch.Tensor, plane: bool, c: torch.Tensor):
    """Host float64 update ``(B, 4, 4)`` (in absolute coordinates) and validity ``(B,)``."""
    if plane:
        H, g = normal_eq.unpack_hessian(sums)
        est = estimate.solve_point_to_plane(H, g, strict=False)
    else:
        W = sums[:, 0]
        sx, sy = sums[:, 1:4], sums[:, 4:7]
        cross = sums[:, 7:16].reshape(-1, 3, 3)
        Wd = W.clamp_min(1e-300)[:, None, None]
        cov_x = normal_eq.unpack_sym3(sums[:, 16:22]) - sx[:, :, None] * sx[:, None, :] / Wd
        cov_y = normal_eq.unpack_sym3(sums[:, 22:28]) - sy[:, :, None] * sy[:, None, :] / Wd
        est = estimate.horn_from_moments(
            estimate.Moments(W, sx, sy, cross, cov_x, cov_y), strict=False)
    # the update was solved in coordinates centred on c: un-centre it
    D = _make_translation(c) @ est.transformation @ _make_translation(-c)
    return D, est.valid


_TRIU3 = np.array(normal_eq.TRIU3)
_TRIU6 = np.array(normal_eq.TRIU6)


#: Horn's N(S) is linear in S: N = Σ_k S_k C_k with C (9, 4, 4) (estimate's basis)
_HORN_N = estimate.HORN_BASIS.numpy().reshape(9, 4, 4)


def _sym_np(v: np.ndarray, pairs: np.ndarray, n: int) -> np.ndarray:
    M = np.zeros((v.shape[0], n, n))
    M[:, pairs[:, 0], pairs[:, 1]] = v
    M[:, pairs[:, 1], pairs[:, 0]] = v
    return M


def _spans_plane_np(cov: np.ndarray) -> np.ndarray:
    ev = np.linalg.eigvalsh(cov)
    return ev[:, 1] > estimate.DEGENERACY_EPS * np.maximum(ev[:, 2], 1e-300)


def _rodrigues_np(w: np.ndarray) -> np.ndarray:
    th2 = (w * w).sum(-1)[:, None, None]
    th = np.sqrt(th2)
    K = np.zeros((w.shape[0], 3, 3))
    K[:, 0, 1], K[:, 0, 2], K[:, 1, 2] = -w[:, 2], w[:, 1], -w[:, 0]
    K[:, 1, 0], K[:, 2, 0], K[:, 2, 1] = w[:, 2], -w[:, 1], w[:, 0]
    small = th2 < 1e-12
    safe = np.where(small, 1.0, th)
    a = np.where(small, 1 - th2 / 6, np.sin(safe) / safe)
    b = np.where(small, 0.5 - th2 / 24, (1 - np.cos(safe)) / (safe * safe))
    return np.eye(3) + a * K + b * (K @ K)


def _solve_np(sums: np.ndarray, plane: bool, c: np.ndarray):
    """NumPy twin of :func:`_solve`: the loop's host solve.

    Same formulas as ``estimate.horn_from_moments`` and ``estimate.solve_point_to_plane``
    (checked equal in the tests), in a few NumPy calls instead of dozens of small torch ops.
    Returns ``(D (B, 4, 4), valid (B,), usable (B,))``.
    """
    B = sums.shape[0]
    if plane:
        A = _sym_np(sums[:, :21], _TRIU6, 6)
        bb = -sums[:, 21:27]
        ev, V = np.linalg.eigh(A)
        keep = ev > estimate.DEGENERACY_EPS * np.maximum(ev[:, -1:], 1e-300)
        inv = np.where(keep, 1.0 / np.maximum(ev, 1e-300), 0.0)
        xi = (V @ (inv[:, :, None] * (V.transpose(0, 2, 1) @ bb[:, :, None])))[:, :, 0]
        usable = np.isfinite(xi).all(-1) & keep.any(-1)
        xi = np.where(usable[:, None], xi, 0.0)
        valid = keep.all(-1) & usable
        # a rank-deficient system keeps its least-norm step (as estimate.solve_point_to_plane)
        R, t = _rodrigues_np(xi[:, :3]), xi[:, 3:]
    else:
        W = sums[:, 0]
        sx, sy = sums[:, 1:4], sums[:, 4:7]
        Wd = np.maximum(W, 1e-300)[:, None]
        xm, ym = sx / Wd, sy / Wd
        S = sums[:, 7:16].reshape(B, 3, 3) - W[:, None, None] * (xm[:, :, None] * ym[:, None, :])
        cov_x = _sym_np(sums[:, 16:22], _TRIU3, 3) - sx[:, :, None] * sx[:, None, :] / Wd[..., None]
        cov_y = _sym_np(sums[:, 22:28], _TRIU3, 3) - sy[:, :, None] * sy[:, None, :] / Wd[..., None]
        N = np.einsum("bk,kij->bij", S.reshape(B, 9), _HORN_N)
        _, vecs = np.linalg.eigh(N)
        q = vecs[:, :, -1]
        q = q / np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), 1e-300)
        w, x, y, z = q[:, 0], q[:, 1], q[:, 2], q[:, 3]
        R = np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
                      2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
                      2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
                     -1).reshape(B, 3, 3)
        t = ym - (R @ xm[:, :, None])[:, :, 0]
        spans = _spans_plane_np(np.concatenate([cov_x, cov_y]))
        valid = (W > 0) & spans[:B] & spans[B:]
        valid &= np.isfinite(R).all((-1, -2)) & np.isfinite(t).all(-1)
        R, t = np.nan_to_num(R), np.nan_to_num(t)
        R = np.where(valid[:, None, None], R, np.eye(3))
        t = np.where(valid[:, None], t, 0.0)
        usable = valid
    # un-centre: x ↦ R (x − c) + t + c
    D = np.tile(np.eye(4), (B, 1, 1))
    D[:, :3, :3] = R
    D[:, :3, 3] = t + c - (R @ c[:, :, None])[:, :, 0]
    return D, valid, usable


def _angle_np(R: np.ndarray) -> np.ndarray:
    """Rotation angles (radians) of ``R (B, 3, 3)``, accurate near 0."""
    s = 0.5 * np.linalg.norm(np.stack([R[:, 2, 1] - R[:, 1, 2], R[:, 0, 2] - R[:, 2, 0],
                                       R[:, 1, 0] - R[:, 0, 1]], -1), axis=-1)
    cth = 0.5 * (R[:, 0, 0] + R[:, 1, 1] + R[:, 2, 2] - 1)
    return np.arctan2(s, cth)


def _information(sums: torch.Tensor, plane: bool, c: torch.Tensor) -> torch.Tensor:
    """6×6 information matrix ``(B, 6, 6)`` of the final correspondences.

    Twist (ω, v) about the origin of the target frame (small_gicp / Open3D ``H``).
    """
    B = sums.shape[0]
    eye3 = torch.eye(3, dtype=torch.float64)
    # J_origin = J_centred @ A with A = [[I, 0], [[c]×ᵀ, I]]
    A = torch.eye(6, dtype=torch.float64).repeat(B, 1, 1)
    A[:, 3:, :3] = transforms.skew(c).transpose(1, 2)
    if plane:
        Hc, _ = normal_eq.unpack_hessian(sums)
        return A.transpose(1, 2) @ Hc @ A
    # point-to-point: Σ w Gᵀ G with G = [−[y]×, I], from the target moments shifted to 0
    W = sums[:, 0]
    sy_c = sums[:, 4:7]
    yy_c = normal_eq.unpack_sym3(sums[:, 22:28])
    sy = sy_c + W[:, None] * c
    yy = yy_c + c[:, :, None] * sy_c[:, None, :] + sy_c[:, :, None] * c[:, None, :] \
        + W[:, None, None] * c[:, :, None] * c[:, None, :]
    tr = torch.diagonal(yy, dim1=1, dim2=2).sum(-1)
    H = torch.zeros(B, 6, 6, dtype=torch.float64)
    H[:, :3, :3] = tr[:, None, None] * eye3 - yy
    H[:, :3, 3:] = transforms.skew(sy)
    H[:, 3:, :3] = transforms.skew(sy).transpose(1, 2)
    H[:, 3:, 3:] = W[:, None, None] * eye3
    return H


@_validate.out_of_memory_is_clear
def icp(
    source: Any,
    target: Any,
    *,
    init: Any = None,
    max_correspondence_distance: float,
    method: str = "point_to_point",
    robust_kernel: RobustKernel | None = None,
    criteria: ConvergenceCriteria | None = None,
    device: str | torch.device | None = None,
    index: Any = None,
    target_normals: Any = None,
    source_lengths: Any = None,
    target_lengths: Any = None,
) -> RegistrationResult:
    """Register ``source`` to ``target`` by ICP; returns ``T_target_source``.

    Correspondences: each source point's nearest target point within
    ``max_correspondence_distance``; points without one are left out (not an error). The
    update is Horn's closed form (point-to-point) or the 6×6 linearised point-to-plane
    solve, weighted by ``robust_kernel``. Stops on ``criteria``: the iteration cap; both
    ``|Δfitness| < relative_fitness`` and ``|Δrmse| / rmse < relative_rmse``
    ("relative_change"); an update smaller than the translation and rotation tolerances
    ("small_update"); no correspondence left ("no_correspondences", not converged); or a
    degenerate point-to-point problem (collinear or too few correspondences: "degenerate",
    not converged). A rank-deficient point-to-plane system (e.g. a single plane, whose
    in-plane motion is unobservable) takes its least-norm step on the determined directions
    and carries on; ``info["rank_deficient"]`` records that it happened.

    Batches: ``source (B, N, 3)`` with ``source_lengths (B,)`` and ``target (B, M, 3)`` with
    ``target_lengths (B,)`` (or one ``(M, 3)`` target shared by all B) run B independent
    problems in lockstep through the same kernels (the reduction is batched over B); one
    index is built per target (one in all for a shared target). Each problem stops on its
    own; the result is then batched (``transformation (B, 4, 4)``).

    Args:
        source: ``(N, 3)`` or ``(B, N, 3)`` points (NumPy, tensor or PointCloud), metres.
        target: ``(M, 3)`` or ``(B, M, 3)`` points; a PointCloud with normals supplies them.
        init: initial ``T_target_source`` ``(4, 4)`` or ``(B, 4, 4)`` (default identity).
        max_correspondence_distance: largest source-target distance of a correspondence
            (> 0, same units as the points).
        method: ``"point_to_point"`` or ``"point_to_plane"``.
        robust_kernel: :class:`RobustKernel` (default none).
        criteria: :class:`ConvergenceCriteria` (default ``ConvergenceCriteria()``).
        device: compute device; default: the tensors' device, else cuda when available.
        index: an Index over the target (or a list of B of them) from
            :func:`pointalign.search.build_index`, reused across calls. Default, built here:
            SciPy cKDTree on the CPU; on a GPU the voxel grid with cells of
            ``max_correspondence_distance`` when that is at most ``GRID_MAX_RATIO`` (8)
            automatic grid cells, else the k-d tree (falling back to grid, then brute force,
            when one is unavailable). ``info["index"]`` names the index used.
        target_normals: ``(M, 3)`` / ``(B, M, 3)`` unit normals for point-to-plane; default:
            the PointCloud's, else estimated with :func:`estimate_normals` (k = 20).
        source_lengths: ``(B,)`` valid source points per padded batch entry.
        target_lengths: ``(B,)`` valid target points per padded batch entry.

    Returns:
        :class:`RegistrationResult` with ``fitness`` (fraction of source points with a
        correspondence), ``rmse`` (RMS correspondence distance), ``history`` (one record per
        evaluation: iteration, fitness, rmse, correspondences), ``timings`` (seconds:
        index, normals, iterate, total, and the host-side search/reduce/solve split) and
        ``info["H"]``: the final 6×6 information matrix (twist (ω, v) about the target
        origin), ``info["per_iteration_s"]``.

    """
    t_start = time.perf_counter()
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    max_dist = _validate.positive(max_correspondence_distance, "max_correspondence_distance")
    rk = RobustKernel() if robust_kernel is None else robust_kernel
    if not isinstance(rk, RobustKernel):
        raise TypeError(f"robust_kernel: expected a RobustKernel, got {type(rk).__name__}")
    crit = ConvergenceCriteria() if criteria is None else criteria
    if not isinstance(crit, ConvergenceCriteria):
        raise TypeError(f"criteria: expected a ConvergenceCriteria, got {type(crit).__name__}")
    dev = _resolve_device(device, ("source", source), ("target", target),
                          ("target_normals", target_normals))
    src, slens, batched = _as_batch_f32(source, "source", source_lengths, dev)
    tgt, tlens, tbatched = _as_batch_f32(target, "target", target_lengths, dev)
    B = src.shape[0]
    if tgt.shape[0] != B:
        if tgt.shape[0] == 1 and not tbatched:
            tgt = tgt.expand(B, -1, -1)
            tlens = tlens.expand(B)
        else:
            raise ValueError(f"target: expected {B} clouds (like source) or one, got "
                             f"{tgt.shape[0]}")
    if tbatched and not batched:
        raise ValueError("target: batched (B, M, 3) but source is a single (N, 3) cloud")
    shared_target = not tbatched and B > 1
    # checked on the host: the loop keeps T there, and a (4, 4) check is cheaper than launches
    T0 = _validate.as_transform(init, "init", batch=B if batched else None, device="cpu",
                                dtype=torch.float64)
    T = (T0 if batched else T0[None]).detach().numpy().copy()
    plane = method == "point_to_plane"
    # lengths on the host: known without a transfer unless the caller passed them
    slens_h = slens.cpu() if source_lengths is not None else torch.full((B,), src.shape[1])
    tlens_h = tlens.cpu() if target_lengths is not None else torch.full((B,), tgt.shape[1])

    timings = {"index": 0.0, "normals": 0.0, "launch": 0.0, "sync": 0.0}
    t0 = time.perf_counter()
    if shared_target:
        idxs = _build_indexes(tgt[:1], tlens_h[:1], max_dist,
                              None if index is None else
                              (index[0] if isinstance(index, (list, tuple)) else index))
        idxs = idxs * B
    else:
        idxs = _build_indexes(tgt, tlens_h, max_dist, index)
    timings["index"] = time.perf_counter() - t0

    normals = _target_normals(target, target_normals, tgt, dev) if plane else None
    if plane and normals is None:
        from pointalign.features.normals import estimate_normals

        t0 = time.perf_counter()
        normals = torch.zeros_like(tgt)
        nb = 1 if shared_target else B
        for b in range(nb):
            m = int(tlens_h[b])
            k = max(3, min(NORMALS_K, m))
            if m >= 3:
                normals[b, :m] = estimate_normals(tgt[b, :m], k=k, orient=None, device=dev)
        if shared_target:
            normals = normals[:1].expand_as(tgt)
        timings["normals"] = time.perf_counter() - t0
    if normals is not None:
        normals = normals.contiguous()

    # centre of the coordinates for the float32 sums: the target centroid (host and device)
    if target_lengths is None:  # every row valid
        center_dev = tgt.mean(1, dtype=torch.float32)
    else:
        rows = torch.arange(tgt.shape[1], device=dev)[None, :, None] < tlens[:, None, None]
        center_dev = ((tgt * rows).sum(1) / tlens[:, None].clamp_min(1)).to(torch.float32)
    tgt_k = tgt.contiguous()

    N = src.shape[1]
    kind, scale = rk.kind, float(rk.k)
    single = B == 1 and int(slens_h[0]) == N
    if single and N >= SPATIAL_ORDER_MIN:
        # queries in a spatially coherent order: neighbouring threads of the search kernels
        # visit the same cells / tree nodes (the sums do not depend on the order)
        src = src[:, _spatial_order(src[0])]
    src = src.contiguous()
    queries = [_query_fn(ix, max_dist) for ix in idxs]
    hinted = any(getattr(q, "hinted", False) for q in queries)

    # ---- the device loop -----------------------------------------------------------------
    # Step j moves the source by T_j, searches, reduces and solves on the device, writing
    # sums_j, D_{j+1}, T_{j+1} and the flags of D_{j+1} into chunk buffers; T_{j+1} feeds
    # step j + 1 with no host round trip. After a chunk of steps, one transfer brings the
    # records back and the host replays the stopping rules iteration by iteration, exactly
    # as if it had checked after every step; steps past a stop are discarded.
    T_cur = torch.from_numpy(T).to(dev)
    Tf_cur = T_cur.to(torch.float32)
    sums_h: list[np.ndarray] = []      # sums_j
    T_h: list[np.ndarray] = [T.copy()]  # T_j
    fl_h: list[np.ndarray] = [None]
    upd_h: list[tuple] = [None]         # (angle, move) of the update D_j (j >= 1)
    stats_h: list[tuple] = []           # (correspondences, fitness, rmse) of sums_j
    active = np.ones(B, dtype=bool)
    eps = estimate.DEGENERACY_EPS

    def alloc(k_steps: int):
        return (torch.empty(k_steps, B, normal_eq.WIDTH, dtype=torch.float64, device=dev),
                torch.empty(k_steps, B, 4, 4, dtype=torch.float64, device=dev),
                torch.empty(k_steps, B, 4, 4, dtype=torch.float64, device=dev),
                torch.empty(k_steps, B, 4, 4, dtype=torch.float32, device=dev),
                torch.empty(k_steps, B, 2, dtype=torch.int32, device=dev))

    def steps(k_steps: int, T_in, Tf_in, bufs, lens_eff, data, hint):
        """Enqueue ``k_steps`` device steps from ``T_in``; returns the record (device).

        ``hint (B, N)`` int64: the last correspondences, read and overwritten by each step.
        """
        sums_r, D_r, T_r, Tf_r, fl_r = bufs
        src, tgt_k, normals, center_dev = data
        with _validate.trusted():
            for k in range(k_steps):
                x = torch.baddbmm(Tf_in[:, None, :3, 3], src, Tf_in[:, :3, :3].transpose(1, 2))
                if single:
                    idx = queries[0](x[0], hint[0]).view(1, N)
                else:
                    idx = torch.full((B, N), -1, dtype=torch.int64, device=dev)
                    for b in range(B):
                        if active[b]:
                            n_b = int(slens_h[b])
                            idx[b, :n_b] = queries[b](x[b, :n_b], hint[b, :n_b])
                if hinted:
                    hint.copy_(idx)
                normal_eq.icp_update(x, tgt_k, idx, transform=T_in, plane=plane,
                                     target_normals=normals, lengths=lens_eff,
                                     center=center_dev, kernel=kind, scale=scale, eps=eps,
                                     out=(sums_r[k], D_r[k], T_r[k], Tf_r[k], fl_r[k]))
                T_in, Tf_in = T_r[k], Tf_r[k]
        n = sums_r.shape[0]
        return torch.cat([sums_r, D_r.view(n, B, 16), T_r.view(n, B, 16),
                          fl_r.to(torch.float64)], -1)

    data = (src, tgt_k, normals, center_dev)
    use_graph = single and USE_CUDA_GRAPHS and dev.type == "cuda"
    gkey = (id(idxs[0]), N, tuple(tgt_k.shape), plane, kind, scale, max_dist, eps, str(dev))
    graph: dict = _cached_graph(gkey, idxs[0]) if use_graph else {}
    reused = "g" in graph
    if use_graph and not graph:  # the first call with this index: the next one captures
        _store_graph(gkey, idxs[0], {"seen": True})
    capture = use_graph and not reused and graph.get("seen", False)
    if reused:  # the captured graph reads its own copies of the inputs: refresh them
        for buf, x in zip(graph["data"], data + (slens,), strict=True):
            if buf is not None:
                buf.copy_(x)
        hint = graph["hint"]
        hint.fill_(-1)
    else:  # the last correspondences (none yet); a captured graph keeps this buffer
        hint = torch.full((B, N), -1, dtype=torch.int64, device=dev)

    def graph_ready() -> bool:
        late = launched_steps[0] >= GRAPH_AFTER_STEPS
        return use_graph and (reused or capture or late) and not graph.get("failed")

    def graph_steps() -> int:
        """Count the steps per replay of this call's graph (kept, or the one a capture makes)."""
        return graph.get("k", CHUNK if reused or capture else 1)

    def graphed_chunk():
        """Replay the call's graph (see ``USE_CUDA_GRAPHS``), capturing it first if needed.

        Returns the record (device), or None where graphs are off or the capture failed
        (the steps then run eagerly).
        """
        if not graph_ready():
            return None
        if "g" not in graph:
            k = graph_steps()
            keep = k == CHUNK  # a graph for later calls reads its own copies of the inputs
            T_in, Tf_in, bufs = T_cur.clone(), Tf_cur.clone(), alloc(k)
            static = tuple(None if x is None or not keep else x.clone()
                           for x in data + (slens,))
            if not keep:
                static = data + (slens,)
            try:
                side = _side_stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                if keep:  # warm-up outside the capture (compilation, allocations)
                    with torch.cuda.stream(side):
                        steps(1, T_in, Tf_in, bufs, static[-1], static[:-1], hint.clone())
                    torch.cuda.current_stream(dev).wait_stream(side)
                # captured on the side stream directly: torch.cuda.graph() would first empty
                # the allocator's cache (every later allocation then goes back to cudaMalloc)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.stream(side):
                    # a kept graph has a memory pool of its own; the one-step graphs of
                    # single calls share one, so each capture does not allocate afresh
                    g.capture_begin(pool=None if keep else _scratch_pool(dev))
                    try:
                        rec_dev = steps(k, T_in, Tf_in, bufs, static[-1], static[:-1], hint)
                    finally:
                        g.capture_end()
                torch.cuda.current_stream(dev).wait_stream(side)
            except Exception as exc:  # e.g. an index whose query synchronises
                graph["failed"] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.synchronize(dev)
                return None
            graph.update(g=g, k=k, T_in=T_in, Tf_in=Tf_in, bufs=bufs, rec=rec_dev,
                         data=static, hint=hint)
            if keep:
                _store_graph(gkey, idxs[0], graph)
            else:
                _anchors[dev] = g
        graph["T_in"].copy_(T_cur)
        graph["Tf_in"].copy_(Tf_cur)
        graph["g"].replay()
        return graph["rec"]

    # chunks in flight: (host record, event, steps). On a GPU a next single step is
    # launched before the last one is read, so the device works while the host checks the
    # stop rules (the one step launched past a stop is discarded); a CHUNK-step replay
    # waits for the check rather than risk discarding a whole chunk.
    pending: list[tuple] = []
    stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    launched_steps = [0]
    max_it = int(crit.max_iterations)

    def launch_chunk(k_steps: int) -> None:
        nonlocal T_cur, Tf_cur
        ts = time.perf_counter()
        rec_dev = graphed_chunk() if graph_ready() and k_steps == graph_steps() else None
        if rec_dev is not None:
            bufs = graph["bufs"]
        else:
            bufs = alloc(k_steps)
            if single:
                lens_eff = slens
            else:
                lens_eff = torch.where(torch.as_tensor(active, device=dev), slens,
                                       torch.zeros_like(slens))
            rec_dev = steps(k_steps, T_cur, Tf_cur, bufs, lens_eff, data, hint)
        T_cur, Tf_cur = bufs[2][-1], bufs[3][-1]
        launched_steps[0] += k_steps
        if stream is not None:  # stream-ordered: a later replay cannot overwrite it first
            rec = torch.empty(rec_dev.shape, dtype=rec_dev.dtype, pin_memory=True)
            rec.copy_(rec_dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        else:
            rec, done = rec_dev.cpu(), None
        pending.append((rec, done, k_steps))
        timings["launch"] += time.perf_counter() - ts

    def collect() -> None:
        tr = time.perf_counter()
        rec, done, k_steps = pending.pop(0)
        if done is not None:
            done.synchronize()
        rec = rec.numpy()
        timings["sync"] += time.perf_counter() - tr
        # what the stopping rules read, for the whole chunk at once (few NumPy calls)
        D = rec[:, :, 30:46].reshape(k_steps, B, 4, 4)
        ang = _angle_np(D[..., :3, :3].reshape(-1, 3, 3)).reshape(k_steps, B)
        mov = np.linalg.norm(D[..., :3, 3], axis=-1)
        cnt, fit, rmse = stats(rec[:, :, :30])
        for k in range(k_steps):
            sums_h.append(rec[k, :, :30])
            T_h.append(rec[k, :, 46:62].reshape(B, 4, 4))
            fl_h.append(rec[k, :, 62:64] > 0.5)
            upd_h.append((ang[k], mov[k]))
            stats_h.append((cnt[k], fit[k], rmse[k]))

    def need(j: int) -> None:
        """Make sure sums_j (step j) is on the host.

        One step per check (eager or replayed, one more in flight on a GPU), or a whole
        chunk replayed from a kept graph (see ``USE_CUDA_GRAPHS``).
        """
        while len(sums_h) <= j:
            launched = len(sums_h) + sum(p[2] for p in pending)
            while launched <= max_it:
                k = graph_steps() if graph_ready() else 1
                # a kept chunk near the iteration cap: replayed whole (steps past the cap
                # are discarded) while at least half of it is used; eager steps cost the
                # host more than a few surplus steps cost the device
                k = k if 2 * (max_it + 1 - launched) >= k else 1
                if pending and (k > 1 or dev.type != "cuda" or len(pending) > 1):
                    break
                launch_chunk(k)
                launched += k
            collect()

    n_src = slens_h.numpy().astype(np.float64)

    def stats(s: np.ndarray):
        """Correspondences, fitness and RMSE ``(..., B)`` from sums ``(..., B, 30)``."""
        cnt = s[..., 28].copy()
        fit = cnt / n_src
        rmse = np.where(cnt > 0, np.sqrt(s[..., 29] / np.maximum(cnt, 1)), np.inf)
        return cnt, fit, rmse

    t_it = time.perf_counter()
    iters = np.zeros(B, dtype=np.int64)
    converged = np.zeros(B, dtype=bool)
    reasons = [""] * B
    rank_deficient = np.zeros(B, dtype=bool)
    need(0)
    sums = sums_h[0]
    last = sums.copy()
    cnt, fit, rmse = stats_h[0]
    history = [{"iteration": 0, "fitness": fit.copy(), "rmse": rmse.copy(),
                "correspondences": cnt.copy()}]
    for b in range(B):
        if cnt[b] == 0:
            active[b], reasons[b] = False, "no_correspondences"
    for it in range(1, max_it + 1):
        if not active.any():
            break
        need(it)
        valid, usable = fl_h[it].T
        rank_deficient |= active & ~valid
        for b in np.nonzero(active & ~usable)[0]:
            active[b], reasons[b] = False, "degenerate"
        T = np.where(active[:, None, None], T_h[it], T)
        ang, mov = upd_h[it]
        iters[active] += 1
        if not active.any():
            break
        prev_fit, prev_rmse = fit, rmse
        sums = sums_h[it]
        cnt, fit_new, rmse_new = stats_h[it]
        fit = np.where(active, fit_new, prev_fit)
        rmse = np.where(active, rmse_new, prev_rmse)
        last[active] = sums[active]
        history.append({"iteration": it, "fitness": fit.copy(), "rmse": rmse.copy(),
                        "correspondences": np.where(active, cnt, history[-1]["correspondences"])})
        for b in np.nonzero(active)[0]:
            if cnt[b] == 0:
                active[b], reasons[b] = False, "no_correspondences"
            elif ang[b] < crit.rotation_tolerance and mov[b] < crit.translation_tolerance:
                active[b], converged[b], reasons[b] = False, True, "small_update"
            elif (abs(fit[b] - prev_fit[b]) < crit.relative_fitness
                  and abs(rmse[b] - prev_rmse[b]) / max(prev_rmse[b], 1e-300)
                  < crit.relative_rmse):
                active[b], converged[b], reasons[b] = False, True, "relative_change"
    for b in np.nonzero(active)[0]:
        reasons[b] = "max_iterations"
    info_steps = len(sums_h)
    timings["iterate"] = time.perf_counter() - t_it
    center = center_dev.cpu().to(torch.float64)  # read once the loop is over
    H = _information(torch.from_numpy(last), plane, center).numpy()
    timings["total"] = time.perf_counter() - t_start
    n_eval = max(1, len(history))
    info = {"H": H, "per_iteration_s": timings["iterate"] / n_eval,
            "method": method, "index": type(idxs[0]).__name__,
            "rank_deficient": rank_deficient, "device_steps": info_steps,
            "cuda_graph": ("reused" if reused else "captured" if "g" in graph
                           else graph.get("failed", "first_use" if use_graph else "off"))}
    Tn = T
    if batched:
        return RegistrationResult(
            transformation=Tn, fitness=fit, rmse=rmse, iterations=iters, converged=converged,
            stop_reason=reasons, history=history, timings=timings, info=info,
            transformation_tensor=torch.from_numpy(T).to(dev))
    hist = [{k: (float(v[0]) if isinstance(v, np.ndarray) else v) for k, v in h.items()}
            for h in history]
    info["H"] = H[0]
    info["rank_deficient"] = bool(rank_deficient[0])
    return RegistrationResult(
        transformation=Tn[0], fitness=float(fit[0]), rmse=float(rmse[0]),
        iterations=int(iters[0]), converged=bool(converged[0]), stop_reason=reasons[0],
        history=hist, timings=timings, info=info,
        transformation_tensor=torch.from_numpy(T[0]).to(dev))
