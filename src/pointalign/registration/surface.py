"""Rigid registration by quadratic distance-map approximants stored in a k-d tree.

Zabatani & Bronstein, "Parallelized algorithms for rigid surface alignment on GPU" (2012),
following Mitra, Gelfand, Pottmann & Guibas, "Registration of point cloud data from a
geometric optimization perspective" (SGP 2004). Every node of the target's k-d tree (all
levels) stores a quadratic approximant of the squared distance to the target surface,

    ``d̂²(q) = qᵀAq − 2bᵀq + c``   (A symmetric positive semi-definite),

built from the node's points: its mean ``s*`` (the representative point), and the PCA frame
``(e1, e2, n)`` of their covariance (``n``: the smallest-variance direction). Kinds:

* ``"point"`` (far field, eq. 4): ``||q − s*||²``, ``A = I``.
* ``"plane"`` (near field, eq. 5): ``⟨n, q − s*⟩²``, ``A = nnᵀ``.
* ``"second_order"`` (Pottmann & Hofer, eq. 7): ``A = nnᵀ + λ1 d1d1ᵀ + λ2 d2d2ᵀ`` with principal
  directions ``d_i`` and curvatures ``κ_i`` from a **local quadric fit**
  ``w ≈ αu² + βuv + γv² + ζ`` of the node's points in its PCA frame (curvatures: eigenvalues
  of the Hessian ``[[2α, β], [β, 2γ]]``). The non-negative weights ``max(δ/(δ − ρ_i), 0)``
  depend on the query's signed distance ``δ``, which a per-cell constant cannot know; we
  store their average over both sides of the surface at ``|δ| = δ0``, the node's RMS radius
  (the typical distance of the queries that land in the cell), capped at 1:
  ``λ = min(1, ½ s/(1+s) + ½ max(s/(s−1), 0))`` with ``s = δ0 |κ|``. Small for flat cells
  (plane-like), 1 far beyond the curvature radius (point-like).
* a callable ``f(s_star (K, 3), normal (K, 3), frame (K, 3, 3)) -> (A (K, 3, 3), b (K, 3),
  c (K,))`` (float64; ``frame[:, :, j]`` = e1, e2, n as columns) for any other approximant.

``surface_newton`` minimises ``Σ_q d̂²(R q + t)`` by damped Newton steps (Algorithm 2): the
motion is linearised (small rotation), the 6×6 system ``F ξ = g`` is reduced in one fused
pass (:func:`pointalign.kernels.surface.newton_terms`) and solved in float64, and the step
length is chosen by the Armijo rule (Algorithm 1) on the **exact** objective (the
approximants looked up at the moved points). ``approximate_icp`` is the paper's approximate
GPU ICP: the correspondence of a source point is the mean of the tree cell it falls in (no
backtracking), and the update is Horn's closed form.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from pointalign import _validate, estimate, transforms
from pointalign._math import eigh3 as symmetric_eigh3
from pointalign.kernels import kdtree as _kd
from pointalign.kernels import surface as _ks
from pointalign.registration.criteria import ConvergenceCriteria
from pointalign.registration.result import RegistrationResult
from pointalign.search.kdtree import KDTreeIndex

APPROXIMANTS = ("point", "plane", "second_order")
#: fewest points a node needs for its own PCA frame; smaller nodes inherit their parent's
MIN_FRAME_POINTS = 5
#: default: deepest tree level whose nodes hold at least this many points
MIN_CELL_POINTS = 8
#: default leaf size of the tree built when no ``index`` is given
LEAF_SIZE = 8
#: Armijo halvings tried before the step counts as failed (then: next level, or stop)
MAX_BACKTRACKS = 12
#: the point approximant's step may be stretched up to this factor (see surface_newton)
MAX_EXPANSION = 8.0
#: a coarse level is left when the objective changes by less than this, relatively
LEVEL_RELATIVE_CHANGE = 1e-3
#: with ``tree_depth=None`` the iteration starts this many levels above the finest level
#: (but not above level 3: at least 8 cells)
COARSE_LEVELS = 6
#: approximate ICP starts at least this many levels above the finest (cell-mean ICP on
#: small cells stalls ~15° off at 15-30° motions on the bunny, measured) ...
AICP_COARSE_LEVELS = 7
#: ... and on cells whose median RMS radius is at least this fraction of the whole target's
#: (the root's) RMS radius: a lookup's capture range is a length, not a point count. Starting
#: ``finest − 7`` levels up alone put the first cells of 150k-1M-point bunnies at 2.7-3.8 mm
#: (levels 8-9) against a 10°/10 mm motion (~15 mm RMS): cell-mean ICP there has spurious
#: fixed points (and diverges when its rmse-raising steps are kept), so the iteration
#: slid down to ~1 mm cells and crept 0.2 mm per step: 50 steps, still ~9° off (issue 5,
#: 3e5 and 1e6 on the H100). 0.3 picks level 3 on the bunny (cells of ~20 mm).
AICP_START_RADIUS = 0.3
#: Newton moves to the deepest level whose median cell radius is at least this many times
#: the motion still expected
CELL_MARGIN = 2.0
#: approximate ICP (linear convergence: the step underestimates the remaining motion)
#: uses a wider margin
AICP_MARGIN = 8.0
#: default stop thresholds relative to float32 (see :func:`default_criteria`)
STOP_RELATIVE = 1e-5

Approximant = str | Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                             tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------------- approximants


def symmetric_eigh2(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenpairs of symmetric 2×2 ``[[a, b], [b, c]]`` (each ``(K,)``) in closed form.

    ``λ = m ∓ r`` with ``m = (a + c)/2``, ``r = hypot((a − c)/2, b)``; the eigenvector of the
    larger is ``(cos θ, sin θ)``, ``θ = ½ atan2(2b, a − c)``. Returns ``(eigenvalues (K, 2)
    ascending, eigenvectors (K, 2, 2) as columns)``. No LAPACK/cuSOLVER call, O(K) memory.
    """
    m = 0.5 * (a + c)
    r = torch.hypot(0.5 * (a - c), b)
    th = 0.5 * torch.atan2(2 * b, a - c)
    co, si = torch.cos(th), torch.sin(th)
    vecs = torch.stack([torch.stack([-si, co], -1), torch.stack([co, si], -1)], -1)
    return torch.stack([m - r, m + r], -1), vecs


def _solve_spd4(M: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Solve ``M x = r`` for symmetric positive definite ``M (K, 4, 4)``, ``r (K, 4)``.

    Unrolled Cholesky on ``(K,)`` columns (no batched LAPACK/cuSOLVER call, O(K) memory);
    rows whose pivot is not positive give NaN.
    """
    n = 4
    L = [[None] * n for _ in range(n)]
    for j in range(n):
        d = M[:, j, j] - sum((L[j][k] * L[j][k] for k in range(j)), torch.zeros_like(M[:, 0, 0]))
        ljj = torch.where(d > 0, d, torch.full_like(d, float("nan"))).sqrt()
        L[j][j] = ljj
        for i in range(j + 1, n):
            v = M[:, i, j] - sum((L[i][k] * L[j][k] for k in range(j)), torch.zeros_like(ljj))
            L[i][j] = v / ljj
    y = []
    for i in range(n):
        y.append((r[:, i] - sum((L[i][k] * y[k] for k in range(i)), torch.zeros_like(r[:, 0])))
                 / L[i][i])
    x = [None] * n
    for i in reversed(range(n)):
        x[i] = (y[i] - sum((L[k][i] * x[k] for k in range(i + 1, n)), torch.zeros_like(y[i])))\
            / L[i][i]
    return torch.stack(x, -1)


def node_frames(tree: KDTreeIndex) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, PCA frame and RMS radius of every node: ``(K, 3)``, ``(K, 3, 3)``, ``(K,)``.

    ``frame[:, :, 0..2]`` are the eigenvectors of the node's covariance reordered as
    ``(e1, e2, n)``: largest, middle, smallest eigenvalue (the normal). The eigen-solve is the
    closed form of :func:`pointalign.features.normals.symmetric_eigh3` (O(K) memory, no
    cuSOLVER). Nodes with fewer than :data:`MIN_FRAME_POINTS` points take their parent's
    frame. float64.
    """
    pts = tree.points.double()
    size = tree.node_sizes().double()
    mean = tree.node_sums(pts) / size[:, None]
    second = tree.node_sums((pts[:, :, None] * pts[:, None, :]).reshape(-1, 9)).reshape(-1, 3, 3)
    cov = second / size[:, None, None] - mean[:, :, None] * mean[:, None, :]
    cov = 0.5 * (cov + cov.transpose(1, 2))
    evals, evecs = symmetric_eigh3(cov)  # ascending
    frame = torch.stack([evecs[:, :, 2], evecs[:, :, 1], evecs[:, :, 0]], -1)
    radius = evals.clamp_min(0).sum(-1).sqrt()
    small = tree.node_sizes() < MIN_FRAME_POINTS
    if bool(small.any()):
        for level in range(1, tree.depth + 1):
            ids = tree.level_nodes(level)
            sel = ids[small[ids]]
            frame[sel] = frame[(sel - 1) // 2]
    return mean, frame, radius


def _curvatures(tree: KDTreeIndex, mean: torch.Tensor, frame: torch.Tensor):
    """Principal curvatures ``(K, 2)`` and directions ``(K, 3, 2)`` by a quadric fit per node.

    Least squares ``w ≈ αu² + βuv + γv² + ζ`` in the node's PCA frame (4×4 normal equations,
    solved by an unrolled Cholesky); curvatures and directions from the closed-form 2×2
    eigen-solve of the Hessian ``[[2α, β], [β, 2γ]]``.
    """
    K = tree.n_nodes
    dev = tree.device
    normal_eq = torch.zeros(K, 4, 4, dtype=torch.float64, device=dev)
    rhs = torch.zeros(K, 4, dtype=torch.float64, device=dev)
    tp = tree.tree_points.double()
    m = tp.shape[0]
    for level in range(tree.depth + 1):
        b = _kd.level_bounds(m, level, dev)
        seg = torch.repeat_interleave(torch.arange(2**level, device=dev), b[1:] - b[:-1],
                                      output_size=m) + (2**level - 1)
        local = ((tp - mean[seg]).unsqueeze(1) @ frame[seg]).squeeze(1)  # (m, 3): u, v, w
        u, v, w = local[:, 0], local[:, 1], local[:, 2]
        phi = torch.stack([u * u, u * v, v * v, torch.ones_like(u)], -1)
        normal_eq.index_add_(0, seg, phi[:, :, None] * phi[:, None, :])
        rhs.index_add_(0, seg, phi * w[:, None])
    # Jacobi scaling (u⁴ ~ 1e-12 beside 1 in small cells), then a tiny ridge
    dscale = normal_eq.diagonal(dim1=1, dim2=2).clamp_min(1e-300).rsqrt()  # (K, 4)
    scaled = normal_eq * dscale[:, :, None] * dscale[:, None, :] + \
        1e-12 * torch.eye(4, dtype=torch.float64, device=dev)
    coef = _solve_spd4(scaled, rhs * dscale) * dscale
    ok = (tree.node_sizes() >= 6) & torch.isfinite(coef).all(-1)
    zero = torch.zeros_like(coef[:, 0])
    al, be, ga = (torch.where(ok, coef[:, i], zero) for i in range(3))
    kappa, dirs2 = symmetric_eigh2(2 * al, be, 2 * ga)
    dirs = frame[:, :, :2] @ dirs2  # (K, 3, 2)
    return kappa, dirs


def _pottmann_hofer_weight(kappa: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    s = delta[:, None] * kappa.abs()
    near = 0.5 * s / (1 + s)
    far = torch.where(s > 1, 0.5 * s / (s - 1).clamp_min(1e-12), torch.zeros_like(s))
    return (near + far).clamp(max=1.0)


def approximant_coefficients(tree: KDTreeIndex, approximant: Approximant = "plane"
                             ) -> torch.Tensor:
    """Per-node coefficients ``(K, 10)`` float32 (``a00 a01 a02 a11 a12 a22 b0 b1 b2 c``).

    Cached on the tree as the payload ``"surface:<kind>"`` for the built-in kinds (so an
    ``index`` passed back in reuses them); callables are evaluated every time.
    """
    key = f"surface:{approximant}" if isinstance(approximant, str) else None
    if key is not None and tree.has_payload(key):
        return tree.payload(key)
    if isinstance(approximant, str) and approximant not in APPROXIMANTS:
        raise ValueError(f"approximant: expected one of {APPROXIMANTS} or a callable, "
                         f"got {approximant!r}")
    if not isinstance(approximant, str) and not callable(approximant):
        raise TypeError(f"approximant: expected a string or a callable, "
                        f"got {type(approximant).__name__}")
    mean, frame, radius = node_frames(tree)
    normal = frame[:, :, 2]
    K = mean.shape[0]
    eye = torch.eye(3, dtype=torch.float64, device=mean.device)
    if approximant == "point":
        A = eye.expand(K, 3, 3)
    elif approximant == "plane":
        A = normal[:, :, None] * normal[:, None, :]
    elif approximant == "second_order":
        kappa, dirs = _curvatures(tree, mean, frame)
        lam = _pottmann_hofer_weight(kappa, radius)
        A = normal[:, :, None] * normal[:, None, :] + (dirs * lam[:, None, :]) @ \
            dirs.transpose(1, 2)
    else:
        out = approximant(mean.clone(), normal.clone(), frame.clone())
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError("approximant: a callable must return (A, b, c)")
        A, bb, cc = (torch.as_tensor(v, dtype=torch.float64, device=mean.device) for v in out)
        if A.shape != (K, 3, 3) or bb.shape != (K, 3) or cc.shape != (K,):
            raise ValueError(f"approximant: expected A (K, 3, 3), b (K, 3), c (K,) with K={K}, "
                             f"got {tuple(A.shape)}, {tuple(bb.shape)}, {tuple(cc.shape)}")
        A = 0.5 * (A + A.transpose(1, 2))
    if isinstance(approximant, str):
        bb = (A @ mean.unsqueeze(-1)).squeeze(-1)
        cc = (mean * bb).sum(-1)
    co = torch.stack([A[:, 0, 0], A[:, 0, 1], A[:, 0, 2], A[:, 1, 1], A[:, 1, 2], A[:, 2, 2],
                      bb[:, 0], bb[:, 1], bb[:, 2], cc], -1).float().contiguous()
    if key is not None:
        tree.attach(key, co)
    return co


def approximate_sq_distance(tree: KDTreeIndex, query: Any, approximant: Approximant = "plane",
                            depth: int | None = None) -> torch.Tensor:
    """``d̂²(q)`` ``(N,)`` of ``query (N, 3)`` from the approximant of its cell at ``depth``."""
    q = _validate.as_points(query, "query", device=tree.device, dtype=tree.points.dtype)
    co = approximant_coefficients(tree, approximant)
    node = tree.descend(q, _resolve_depth(tree, depth))
    return _ks.evaluate(q.double(), co[node].double()).clamp_min(0)


# ----------------------------------------------------------------------------- helpers


def _resolve_depth(tree: KDTreeIndex, depth: int | None) -> int:
    if depth is None:
        m = tree.points.shape[0]
        d = 0
        for level in range(tree.depth + 1):
            if (m >> level) >= MIN_CELL_POINTS:
                d = level
        return d
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"tree_depth: expected a non-negative integer, got {depth!r}")
    return min(depth, tree.depth)


def _schedule(tree: KDTreeIndex, depth: int, tree_depth: int | None,
              coarse_levels: int | None = None,
              start_radius: float | None = None) -> list[int]:
    """Levels visited: ``[depth]`` when given, else coarse to fine up to ``depth``.

    Cells of deep levels are small; a source point moved off the surface by more than a cell
    falls in a cell whose approximant describes another piece of surface (the lookup does not
    backtrack). Starting :data:`COARSE_LEVELS` levels higher and descending one level each
    time the current level converges keeps the lookup valid while the motion is large.
    With ``start_radius`` the start is also no deeper than the deepest level whose median
    cell radius is at least ``start_radius`` times the root's (a scale rule, independent of
    the number of points).
    """
    if tree_depth is not None:
        return [depth]
    c = COARSE_LEVELS if coarse_levels is None else coarse_levels
    start = depth - c
    if start_radius is not None:
        radii = _level_radii(tree, list(range(depth + 1)))
        by_size = max((lv for lv in range(depth + 1) if radii[lv] >= start_radius * radii[0]),
                      default=0)
        start = min(start, by_size)
    return list(range(min(depth, max(3, start)), depth + 1))


def _setup(source, target, init, criteria, device, index, tree_depth):
    dev = _validate.as_device(device, like=source if isinstance(source, torch.Tensor) else None)
    src = _validate.as_points(source, "source", min_points=3, device=dev, dtype=torch.float32)
    if index is not None:
        if not isinstance(index, KDTreeIndex):
            raise TypeError(f"index: expected a KDTreeIndex over the target, "
                            f"got {type(index).__name__}")
        tree = index
        if tree.device != src.device:
            raise ValueError(f"index: on {tree.device} but the source is on {src.device}")
    else:
        if target is None:
            raise ValueError("target: required when no index is given")
        tgt = _validate.as_points(target, "target", min_points=3, device=dev,
                                  dtype=torch.float32)
        tree = KDTreeIndex(tgt, leaf_size=LEAF_SIZE)
    T0 = torch.eye(4, dtype=torch.float64) if init is None else \
        _validate.as_transform(init, "init", device="cpu").to(torch.float64)
    crit = ConvergenceCriteria() if criteria is None else criteria
    if not isinstance(crit, ConvergenceCriteria):
        raise TypeError(f"criteria: expected ConvergenceCriteria, got {type(crit).__name__}")
    return src, tree, T0, crit, _resolve_depth(tree, tree_depth)


def _step(xi: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
    """``(4, 4)`` float64: rotate by ``exp(ω)`` about ``center``, then translate by ``τ``."""
    R = transforms.so3_exp(xi[:3])
    return transforms.make(R, center - R @ center + xi[3:])


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def _result(T, fitness, rmse, it, converged, reason, history, timings, info):
    return RegistrationResult(transformation=T.numpy().copy(), fitness=fitness, rmse=rmse,
                              iterations=it, converged=converged, stop_reason=reason,
                              history=history, timings=timings, info=info,
                              transformation_tensor=T.clone())


# ----------------------------------------------------------------------------- Newton


def default_criteria(points: torch.Tensor) -> ConvergenceCriteria:
    """Stop rule for float32 clouds, scaled to ``points (N, 3)``.

    ``||T_step − I||`` small: the accepted step rotates by less than 1e-5 rad and moves the
    centroid by less than 1e-5 of the cloud's RMS radius (about 300× float32 rounding of the
    coordinates); or the RMS approximate distance changes by less than 1e-5 relatively (the
    float32 objective is reproducible to about 1e-6 at 10⁶ points); at most 50 steps.
    """
    p = points.double()
    radius = float(((p - p.mean(0)) ** 2).sum(-1).mean().sqrt())
    return ConvergenceCriteria(max_iterations=50, relative_rmse=STOP_RELATIVE,
                               rotation_tolerance=STOP_RELATIVE,
                               translation_tolerance=STOP_RELATIVE * max(radius, 1e-30))


def _level_radii(tree: KDTreeIndex, levels: list[int]) -> list[float]:
    """Median RMS radius of the cells of each level in ``levels`` (cached per node)."""
    key = "surface:radius"
    if not tree.has_payload(key):
        pts = tree.points.double()
        size = tree.node_sizes().double().clamp_min(1)
        mean = tree.node_sums(pts) / size[:, None]
        sq = tree.node_sums((pts * pts).sum(-1)) / size
        tree.attach(key, (sq - (mean * mean).sum(-1)).clamp_min(0).sqrt().float())
    r = tree.payload(key)
    return torch.stack([r[tree.level_nodes(lv)].median() for lv in levels]).tolist()


def _rms_displacement(D: torch.Tensor, cov: torch.Tensor, centroid: torch.Tensor) -> float:
    """RMS of ``||D x − x||`` over points with ``centroid (3,)`` and covariance ``cov (3, 3)``."""
    M = D[:3, :3] - torch.eye(3, dtype=D.dtype)
    mean_disp = M @ centroid + D[:3, 3]
    return math.sqrt(max(float((M @ cov @ M.T).trace() + mean_disp @ mean_disp), 0.0))


def surface_newton(
    source: Any,
    target: Any = None,
    *,
    approximant: Approximant = "plane",
    tree_depth: int | None = None,
    init: Any = None,
    criteria: ConvergenceCriteria | None = None,
    device: str | torch.device | None = None,
    index: KDTreeIndex | None = None,
    max_correspondence_distance: float | None = None,
    armijo: tuple[float, float] = (0.5, 1e-4),
) -> RegistrationResult:
    """Register ``source`` to ``target`` by damped Newton steps on ``Σ_q d̂²(R q + t)``.

    Coarse to fine (``tree_depth=None``): the iteration starts :data:`COARSE_LEVELS` levels
    above the finest, where cells are large enough for a lookup without backtracking to stay
    on the right piece of surface while the motion is large (the point approximant, ICP to
    the cell means, starts :data:`AICP_COARSE_LEVELS` up and on cells of at least
    :data:`AICP_START_RADIUS` times the target's RMS radius). After each accepted step it
    moves to the deepest level whose typical cell radius is at least :data:`CELL_MARGIN`
    (point: :data:`AICP_MARGIN`) times the motion still expected (the step's RMS displacement of the
    source, stretched by the observed rate of convergence); the stop rule applies on the
    finest level only. With ``tree_depth`` given, that one level is used throughout.

    Args:
        source: ``(N, 3)`` points (array, tensor or PointCloud), the query surface.
        target: ``(M, 3)`` points, the template; may be None when ``index`` is given.
        approximant: ``"point"``, ``"plane"``, ``"second_order"`` or a callable (module
            docstring).
        tree_depth: tree level whose approximants are used (default: coarse to fine, down to
            the deepest level whose cells hold at least 8 points).
        init: ``(4, 4)`` initial ``T_target_source`` (default identity).
        criteria: iteration cap; stops when the Newton step ``ξ = (ω, τ)`` rotates by less
            than ``rotation_tolerance`` and moves the centroid by less than
            ``translation_tolerance`` ("small_update", i.e. ``||T(ξ) − I||`` small), or the
            RMS approximate distance changes by less than ``relative_rmse`` relatively
            ("relative_change"), or no step decreases it ("line_search"). Default:
            :func:`default_criteria` (float32-aware, scaled to the source).
        device: compute device (default: the source's).
        index: a :class:`~pointalign.search.kdtree.KDTreeIndex` over the target, reused across
            calls with its cached approximants (build it once: ``KDTreeIndex(target)``).
        max_correspondence_distance: truncate each term at this distance (``min(d̂², τ²)``),
            so points outside the overlap stop pulling; None: no truncation.
        armijo: ``(β, σ)`` of the Armijo rule: step ``α ∈ {1, β, β², …}``, accepted when
            ``f(α) − f(0) <= σ α ∇fᵀξ``. With the point approximant a full step that is
            accepted is then stretched to ``α ∈ {2, 4, …, MAX_EXPANSION}`` while the exact
            objective keeps falling and the condition holds (ICP-like linear convergence:
            the Newton step on the cell means undershoots by a steady factor; 3e5-point
            bunny at 10°/10 mm: 17 steps instead of 38-50).

    Returns:
        :class:`RegistrationResult`; ``iterations`` counts Newton steps (one 6×6 solve
        each); ``fitness`` is the fraction of terms within the truncation distance (1
        without one), ``rmse`` the RMS approximate distance over them, ``info`` holds the
        final ``F`` (6×6), ``objective``, ``tree_depth`` and the number of objective passes
        (``passes``, Armijo trials included).

    """
    t_start = time.perf_counter()
    src, tree, T, crit, depth = _setup(source, target, init, criteria, device, index,
                                       tree_depth)
    if criteria is None:
        crit = default_criteria(src)
    beta, sigma = armijo
    if not (0 < beta < 1 and 0 < sigma < 1):
        raise ValueError(f"armijo: expected 0 < beta, sigma < 1, got {armijo}")
    tau2 = math.inf
    if max_correspondence_distance is not None:
        tau2 = _validate.positive(max_correspondence_distance,
                                  "max_correspondence_distance") ** 2
    t0 = time.perf_counter()
    co = approximant_coefficients(tree, approximant)
    # the point approximant is ICP to the cell means: it takes approximate ICP's schedule
    # (larger first cells, wider margin; smaller ones stall on the bunny at 5-30°, measured)
    far = isinstance(approximant, str) and approximant == "point"
    levels = _schedule(tree, depth, tree_depth, AICP_COARSE_LEVELS if far else None,
                       AICP_START_RADIUS if far else None)
    margin = AICP_MARGIN if far else CELL_MARGIN
    radii = _level_radii(tree, levels)
    _sync(co)
    t_approx = time.perf_counter() - t0
    arrays = tree.arrays
    n = src.shape[0]
    s64 = src.double()
    centroid = s64.mean(0)
    cov = ((s64 - centroid).T @ (s64 - centroid) / n).cpu()
    centroid = centroid.cpu()
    state = {"lvl": 0, "passes": 0}

    def terms(Tc):
        center = Tc[:3, :3] @ centroid + Tc[:3, 3]
        state["passes"] += 1
        # the truncation applies on the finest level only: on coarse levels the cells'
        # approximants lie farther from the surface than a correspondence distance meant
        # for it
        fine = state["lvl"] == len(levels) - 1
        return _ks.newton_terms(src, Tc, center, arrays, co, levels[state["lvl"]],
                                tau2=tau2 if fine else math.inf).cpu(), center

    def stats(tt):
        obj, inl = float(tt[27]), float(tt[28])
        inl_obj = obj - (n - inl) * tau2 if math.isfinite(tau2) else obj
        return inl / n, math.sqrt(max(inl_obj, 0.0) / inl) if inl > 0 else math.inf

    def descend_to(new_lvl):
        state["lvl"] = new_lvl
        return terms(T)

    tt, center = terms(T)
    history = []
    reason, converged, it = "max_iterations", False, 0
    prev_disp = math.nan
    eye4 = torch.eye(6, dtype=torch.float64)
    while it < crit.max_iterations:
        lvl = state["lvl"]
        finest = lvl == len(levels) - 1
        F, g, f0, _ = _ks.unpack(tt)
        scale = float(F.diagonal().abs().max())
        if not math.isfinite(scale) or scale <= 0:
            reason = "degenerate"
            break
        it += 1
        xi = torch.linalg.solve(F + 1e-12 * scale * eye4, g)
        slope = -2.0 * float(g @ xi)  # directional derivative of the model, < 0
        alpha, accepted = 1.0, False
        for _ in range(MAX_BACKTRACKS):
            Tc = _step(alpha * xi, center) @ T
            tc, cc = terms(Tc)
            if float(tc[27]) - f0 <= sigma * alpha * slope:
                accepted = True
                break
            alpha *= beta
        if accepted and far and alpha == 1.0:
            # the cell-mean model is stiff (ICP-like linear convergence: the full step
            # undershoots by a steady factor), so try 2ξ, 4ξ, … while the exact objective
            # keeps falling (Armijo's condition still holds at every accepted length)
            f_best = float(tc[27])
            while alpha < MAX_EXPANSION:
                Te = _step(2 * alpha * xi, center) @ T
                te, ce = terms(Te)
                fe = float(te[27])
                if not (fe < f_best and fe - f0 <= sigma * 2 * alpha * slope):
                    break
                alpha, Tc, tc, cc, f_best = 2 * alpha, Te, te, ce, fe
        if not accepted:
            if not finest:  # no descent on this level's approximants: use finer cells
                tt, center = descend_to(lvl + 1)
                prev_disp = math.nan
                continue
            reason, converged = "line_search", True
            break
        f1 = float(tc[27])
        # the full Newton step ξ (not the damped one) measures the motion still expected: a
        # step cut short by the line search is small because the model is poor, not because
        # the iteration converged
        R0 = T[:3, :3]
        full = max(alpha, 1.0) * xi
        disp = _rms_displacement(_step(full, center), R0 @ cov @ R0.T, R0 @ centroid + T[:3, 3])
        rot, trans = float(full[:3].norm()), float(full[3:].norm())
        T, tt, center = Tc, tc, cc
        fit, rmse = stats(tt)
        history.append({"objective": f1, "step": alpha, "rotation": rot, "translation": trans,
                        "displacement": disp, "fitness": fit, "rmse": rmse,
                        "level": levels[lvl]})
        rel = abs(f0 - f1) / f0 if f0 > 0 else 0.0
        rel_rmse = 1.0 - math.sqrt(max(f1, 0.0) / f0) if f0 > 0 else 0.0
        if finest:
            if rot < crit.rotation_tolerance and trans < crit.translation_tolerance:
                reason, converged = "small_update", True
                break
            if f1 == 0 or abs(rel_rmse) < crit.relative_rmse:
                reason, converged = "relative_change", True
                break
            continue
        # coarse to fine: the motion still expected is the step's displacement, stretched
        # by the observed linear rate ρ (remaining ≈ disp ρ / (1 − ρ)) when it is slow
        rho = disp / prev_disp if prev_disp > 0 else 0.0
        remaining = disp * max(1.0, min(rho, 0.9) / (1.0 - min(rho, 0.9)))
        prev_disp = disp
        new_lvl = lvl
        while new_lvl + 1 < len(levels) and radii[new_lvl + 1] >= margin * remaining:
            new_lvl += 1
        if new_lvl == lvl and rel < LEVEL_RELATIVE_CHANGE:
            new_lvl = lvl + 1
        if new_lvl != lvl:
            tt, center = descend_to(new_lvl)
            prev_disp = math.nan
    fit, rmse = stats(tt)
    t_end = time.perf_counter()
    timings = {"approximants": t_approx, "iterate": t_end - t0 - t_approx,
               "total": t_end - t_start}
    info = {"F": _ks.unpack(tt)[0], "objective": float(tt[27]),
            "tree_depth": levels[state["lvl"]], "passes": state["passes"],
            "approximant": approximant if isinstance(approximant, str) else "custom"}
    return _result(T, fit, rmse, it, converged, reason, history, timings, info)


# ----------------------------------------------------------------------------- approximate ICP


def approximate_icp(
    source: Any,
    target: Any = None,
    *,
    tree_depth: int | None = None,
    init: Any = None,
    criteria: ConvergenceCriteria | None = None,
    device: str | torch.device | None = None,
    index: KDTreeIndex | None = None,
    max_correspondence_distance: float | None = None,
) -> RegistrationResult:
    """ICP whose correspondence is the mean point of the tree cell the source point falls in.

    The paper's approximate GPU ICP (GCAICP): descend the target's k-d tree to a level
    without backtracking, take that node's mean as the corresponding point, drop pairs
    farther apart than ``max_correspondence_distance`` (if given; finest level only), and
    solve ``argmin Σ ||R x + t − y||²`` in closed form (Horn; the moments are reduced on the
    device, the 4×4 eigenproblem solved on the host). Coarse to fine as
    :func:`surface_newton`: after each step the level moves to the deepest one whose median
    cell radius is at least :data:`AICP_MARGIN` times the motion still expected, or one
    level deeper when the RMS distance to the cell means stops changing (by less than
    :data:`LEVEL_RELATIVE_CHANGE`). On the finest level it stops on a small update,
    ``|Δrmse| / rmse < relative_rmse``, or a step that would raise the RMS distance
    ("no_decrease": the step is not taken). Arguments as :func:`surface_newton` (default
    criteria: :func:`default_criteria`).
    """
    t_start = time.perf_counter()
    src, tree, T, crit, depth = _setup(source, target, init, criteria, device, index,
                                       tree_depth)
    if criteria is None:
        crit = default_criteria(src)
    tau2 = math.inf
    if max_correspondence_distance is not None:
        tau2 = _validate.positive(max_correspondence_distance,
                                  "max_correspondence_distance") ** 2
    t0 = time.perf_counter()
    key = "surface:mean"
    if not tree.has_payload(key):
        tree.attach(key, (tree.node_sums(tree.points) / tree.node_sizes()[:, None]).float())
    means = tree.payload(key)
    levels = _schedule(tree, depth, tree_depth, AICP_COARSE_LEVELS, AICP_START_RADIUS)
    radii = _level_radii(tree, levels)
    n = src.shape[0]
    s64 = src.double()
    centroid = s64.mean(0)
    cov = ((s64 - centroid).T @ (s64 - centroid) / n).cpu()
    centroid = centroid.cpu()
    history = []
    reason, converged, it = "max_iterations", False, 0
    fit, rmse = 0.0, math.inf
    prev_rmse, prev_disp = math.inf, math.nan
    T_prev, fit_prev = T, fit
    lvl = 0

    def match(Tc, level):
        """Cell means of the moved source, weights, and (inliers, Σ w d²) on the host."""
        Td = Tc.to(src.device, torch.float32)
        q = src @ Td[:3, :3].T + Td[:3, 3]
        y = means[tree.descend(q, level)]
        d2 = ((q - y) ** 2).sum(-1)
        fine = level == levels[-1]
        w = (d2 <= tau2).float() if fine and math.isfinite(tau2) else torch.ones_like(d2)
        return y, w, torch.stack([w.sum(), (w * d2).sum()]).double().cpu()

    y, w, sums = match(T, levels[lvl])
    while it < crit.max_iterations:
        finest = lvl == len(levels) - 1
        n_in = float(sums[0])
        if n_in < 3:
            reason = "no_correspondences"
            break
        fit, rmse = n_in / n, math.sqrt(float(sums[1]) / n_in)
        if rmse > prev_rmse * (1 + 1e-9):
            # the previous step raised the RMS distance to the cell means (the lookup is not
            # a nearest-neighbour search, so ICP's monotonicity fails; on coarse levels the
            # cloud then drifts along the cells): take it back, go one level finer or stop
            T, fit, rmse = T_prev, fit_prev, prev_rmse
            history.pop()
            if not finest:
                lvl, prev_disp, prev_rmse = lvl + 1, math.nan, math.inf
                y, w, sums = match(T, levels[lvl])
                continue
            reason, converged = "no_decrease", True
            break
        it += 1
        est = estimate.horn_from_moments(_moments(s64, y.double(), w.double()), strict=False)
        if not bool(est.valid.all()):
            if not finest:  # too few distinct cell means: go finer
                lvl += 1
                y, w, sums = match(T, levels[lvl])
                continue
            reason = "degenerate"
            break
        T_new = est.transformation
        D = T_new @ transforms.invert(T)
        R0 = T[:3, :3]
        disp = _rms_displacement(D, R0 @ cov @ R0.T, R0 @ centroid + T[:3, 3])
        rot = float(transforms.rotation_angle(D[:3, :3]))
        trans = float(D[:3, 3].norm())
        T_prev, fit_prev = T, fit
        T = T_new
        history.append({"rmse": rmse, "fitness": fit, "rotation": rot, "translation": trans,
                        "displacement": disp, "level": levels[lvl]})
        rel = abs(prev_rmse - rmse) / prev_rmse if math.isfinite(prev_rmse) and \
            prev_rmse > 0 else math.inf
        if finest:
            prev_rmse = rmse
            if rot < crit.rotation_tolerance and trans < crit.translation_tolerance:
                reason, converged = "small_update", True
                break
            if rel < crit.relative_rmse:
                reason, converged = "relative_change", True
                break
            y, w, sums = match(T, levels[lvl])
            continue
        rho = disp / prev_disp if prev_disp > 0 else 0.0
        remaining = disp * max(1.0, min(rho, 0.9) / (1.0 - min(rho, 0.9)))
        prev_disp = disp
        new_lvl = lvl
        while new_lvl + 1 < len(levels) and radii[new_lvl + 1] >= AICP_MARGIN * remaining:
            new_lvl += 1
        if new_lvl == lvl and rel < LEVEL_RELATIVE_CHANGE:
            new_lvl = lvl + 1
        if new_lvl != lvl:
            lvl, prev_disp = new_lvl, math.nan
            prev_rmse = math.inf
        else:
            prev_rmse = rmse
        y, w, sums = match(T, levels[lvl])
    t_end = time.perf_counter()
    return _result(T, fit, rmse, it, converged, reason, history,
                   {"iterate": t_end - t0, "total": t_end - t_start},
                   {"tree_depth": levels[lvl]})


def _moments(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> estimate.Moments:
    """Weighted moments of pairs ``x, y (N, 3)`` reduced on their device, returned on the host.

    Centred on the weighted centroids for accuracy (as :mod:`pointalign.estimate` does).
    """
    W = w.sum()
    xm = (w[:, None] * x).sum(0) / W.clamp_min(1e-300)
    ym = (w[:, None] * y).sum(0) / W.clamp_min(1e-300)
    xc, yc = x - xm, y - ym
    wx = w[:, None] * xc
    cross = wx.T @ yc + W * (xm[:, None] * ym[None, :])
    parts = [W, xm * W, ym * W, cross, wx.T @ xc, (w[:, None] * yc).T @ yc]
    flat = torch.cat([p.reshape(-1) for p in parts]).cpu()
    W, sx, sy, cr, cx, cy = flat.split([1, 3, 3, 9, 9, 9])
    return estimate.Moments(W[0], sx, sy, cr.reshape(3, 3), cx.reshape(3, 3), cy.reshape(3, 3))
