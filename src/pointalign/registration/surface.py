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
from pointalign.kernels import kdtree as _kd
from pointalign.features.normals import symmetric_eigh3
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
#: coarse to fine: the requested approximant is used on the last this many levels, the point
#: approximant (far field) before
NEAR_LEVELS = 3
#: approximate ICP's coarse-to-fine schedule starts only this many levels up
AICP_COARSE_LEVELS = 6
#: a coarse level is left when the objective changes by less than this, relatively, or after
#: LEVEL_MAX_ITERATIONS steps (the finest level runs to ``criteria``)
LEVEL_RELATIVE_CHANGE = 1e-3
LEVEL_MAX_ITERATIONS = 10
#: with ``tree_depth=None`` the iteration starts this many levels above the finest level
#: (but not above level 3: at least 8 cells)
COARSE_LEVELS = 6

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
              coarse_levels: int | None = None) -> list[int]:
    """Levels visited: ``[depth]`` when given, else coarse to fine up to ``depth``.

    Cells of deep levels are small; a source point moved off the surface by more than a cell
    falls in a cell whose approximant describes another piece of surface (the lookup does not
    backtrack). Starting :data:`COARSE_LEVELS` levels higher and descending one level each
    time the current level converges keeps the lookup valid while the motion is large.
    """
    if tree_depth is not None:
        return [depth]
    c = COARSE_LEVELS if coarse_levels is None else coarse_levels
    return list(range(min(depth, max(3, depth - c)), depth + 1))


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

    Args:
        source: ``(N, 3)`` points (array, tensor or PointCloud), the query surface.
        target: ``(M, 3)`` points, the template; may be None when ``index`` is given.
        approximant: ``"point"``, ``"plane"``, ``"second_order"`` or a callable (module
            docstring).
        tree_depth: tree level whose approximants are used (default: the deepest level whose
            cells hold at least 8 points). Smaller is coarser, faster to converge from far.
        init: ``(4, 4)`` initial ``T_target_source`` (default identity).
        criteria: iteration cap; stops when the accepted step rotates by less than
            ``rotation_tolerance`` and moves by less than ``translation_tolerance``
            ("small_update"), or the objective changes by less than ``relative_rmse``
            relatively ("relative_change"), or no step decreases it ("line_search").
        device: compute device (default: the source's).
        index: a :class:`~pointalign.search.kdtree.KDTreeIndex` over the target, reused across
            calls with its cached approximants (build it once: ``KDTreeIndex(target)``).
        max_correspondence_distance: truncate each term at this distance (``min(d̂², τ²)``),
            so points outside the overlap stop pulling; None: no truncation.
        armijo: ``(β, σ)`` of the Armijo rule: step ``α ∈ {1, β, β², …}``, accepted when
            ``f(α) − f(0) <= σ α ∇fᵀξ``.

    Returns:
        :class:`RegistrationResult`; ``fitness`` is the fraction of terms within the
        truncation distance (1 without one), ``rmse`` the RMS approximate distance over them,
        ``info`` holds the final ``F`` (6×6), ``objective`` and ``tree_depth``.

    """
    t_start = time.perf_counter()
    src, tree, T, crit, depth = _setup(source, target, init, criteria, device, index,
                                       tree_depth)
    beta, sigma = armijo
    if not (0 < beta < 1 and 0 < sigma < 1):
        raise ValueError(f"armijo: expected 0 < beta, sigma < 1, got {armijo}")
    tau2 = math.inf
    if max_correspondence_distance is not None:
        tau2 = _validate.positive(max_correspondence_distance,
                                  "max_correspondence_distance") ** 2
    t0 = time.perf_counter()
    co_fine = approximant_coefficients(tree, approximant)
    levels = _schedule(tree, depth, tree_depth)
    # far field: while the schedule is on coarse levels, the point approximant (eq. 4) pulls
    # the whole cloud in; the requested one takes over for the last NEAR_LEVELS levels
    co_far = approximant_coefficients(tree, "point") if len(levels) > NEAR_LEVELS else co_fine
    _sync(co_fine)
    t_approx = time.perf_counter() - t0
    arrays = tree.arrays
    n = src.shape[0]
    centroid = src.double().mean(0).cpu()

    lvl = 0

    def terms(Tc):
        center = Tc[:3, :3] @ centroid + Tc[:3, 3]
        near = lvl >= len(levels) - NEAR_LEVELS
        # the truncation applies on the near-field levels only: on coarse levels the cell
        # means lie farther from the surface than a correspondence distance meant for it
        return _ks.newton_terms(src, Tc, center, arrays, co_fine if near else co_far,
                                levels[lvl], tau2=tau2 if near else math.inf).cpu(), center

    def stats(tt):
        obj, inl = float(tt[27]), float(tt[28])
        inl_obj = obj - (n - inl) * tau2 if math.isfinite(tau2) else obj
        return inl / n, math.sqrt(max(inl_obj, 0.0) / inl) if inl > 0 else math.inf

    tt, center = terms(T)
    at_level = 0
    history = []
    reason, converged, it = "max_iterations", False, 0
    F = _ks.unpack(tt)[0]
    for it in range(1, crit.max_iterations + 1):
        F, g, f0, _ = _ks.unpack(tt)
        scale = float(F.diagonal().abs().max())
        if not math.isfinite(scale) or scale <= 0:
            reason = "degenerate"
            it -= 1
            break
        xi = torch.linalg.solve(F + 1e-12 * scale * torch.eye(6, dtype=torch.float64), g)
        slope = -2.0 * float(g @ xi)  # directional derivative of the model, < 0
        alpha, accepted = 1.0, False
        for _ in range(MAX_BACKTRACKS):
            Tc = _step(alpha * xi, center) @ T
            tc, cc = terms(Tc)
            if float(tc[27]) - f0 <= sigma * alpha * slope:
                accepted = True
                break
            alpha *= beta
        if not accepted:
            if lvl + 1 < len(levels):
                lvl += 1
                at_level = 0
                tt, center = terms(T)
                continue
            reason, converged = "line_search", True
            break
        f1 = float(tc[27])
        T, tt, center = Tc, tc, cc
        fit, rmse = stats(tt)
        rot = alpha * float(xi[:3].norm())
        trans = alpha * float(xi[3:].norm())
        history.append({"objective": f1, "step": alpha, "rotation": rot, "translation": trans,
                        "fitness": fit, "rmse": rmse, "level": levels[lvl]})
        stop = None
        rel = abs(f0 - f1) / f0 if f0 > 0 else 0.0
        if rot < crit.rotation_tolerance and trans < crit.translation_tolerance:
            stop = "small_update"
        elif f1 == 0 or rel < crit.relative_rmse:
            stop = "relative_change"
        at_level += 1
        if lvl + 1 < len(levels) and (stop is not None or rel < LEVEL_RELATIVE_CHANGE
                                      or at_level >= LEVEL_MAX_ITERATIONS):
            lvl += 1  # coarse to fine: go one level deeper
            at_level = 0
            tt, center = terms(T)
            continue
        if stop is not None:
            reason, converged = stop, True
            break
    fit, rmse = stats(tt)
    t_end = time.perf_counter()
    timings = {"approximants": t_approx, "iterate": t_end - t0 - t_approx,
               "total": t_end - t_start}
    info = {"F": _ks.unpack(tt)[0], "objective": float(tt[27]), "tree_depth": levels[lvl],
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

    The paper's approximate GPU ICP (GCAICP): descend the target's k-d tree to ``tree_depth``
    without backtracking, take that node's mean as the corresponding point, drop pairs
    farther apart than ``max_correspondence_distance`` (if given), and solve
    ``argmin Σ ||R x + t − y||²`` in closed form (Horn). Arguments as :func:`surface_newton`;
    stops on the iteration cap, a small update, ``|Δrmse| / rmse < relative_rmse``, or a step
    that would raise the RMS distance to the cell means ("no_decrease"; on coarse levels of
    the schedule this moves one level deeper instead).
    """
    t_start = time.perf_counter()
    src, tree, T, crit, depth = _setup(source, target, init, criteria, device, index,
                                       tree_depth)
    tau2 = math.inf
    if max_correspondence_distance is not None:
        tau2 = _validate.positive(max_correspondence_distance,
                                  "max_correspondence_distance") ** 2
    t0 = time.perf_counter()
    key = "surface:mean"
    if not tree.has_payload(key):
        tree.attach(key, (tree.node_sums(tree.points) / tree.node_sizes()[:, None]).float())
    means = tree.payload(key)
    n = src.shape[0]
    history = []
    reason, converged, it = "max_iterations", False, 0
    prev_rmse = math.inf
    fit, rmse = 0.0, math.inf
    # Horn's step moves the whole cloud to the cell means at once: coarse cells (means far
    # inside the surface) can throw it far off, so approximate ICP starts lower in the tree
    levels = _schedule(tree, depth, tree_depth, AICP_COARSE_LEVELS)
    lvl = 0
    for it in range(1, crit.max_iterations + 1):
        Td = T.to(src.device, torch.float32)
        q = src @ Td[:3, :3].T + Td[:3, 3]
        y = means[tree.descend(q, levels[lvl])]
        d2 = ((q - y) ** 2).sum(-1)
        w = (d2 <= tau2).float()
        sums = torch.stack([w.sum(), (w * d2).sum()]).double().cpu()
        n_in = float(sums[0])
        if n_in < 3:
            reason = "no_correspondences"
            it -= 1
            break
        fit, rmse = n_in / n, math.sqrt(float(sums[1]) / n_in)
        est = estimate.horn(src.double(), y.double(), w.double(), strict=False)
        if not bool(est.valid.all()):
            if lvl + 1 < len(levels):  # too few distinct cell means: go finer
                lvl += 1
                continue
            reason = "degenerate"
            it -= 1
            break
        T_new = est.transformation.cpu()
        # safeguard: a step that raises the RMS distance to the cell means at this level is
        # refused (the lookup is not a nearest-neighbour search, so ICP's monotonicity fails)
        Tn = T_new.to(src.device, torch.float32)
        qn = src @ Tn[:3, :3].T + Tn[:3, 3]
        d2n = ((qn - means[tree.descend(qn, levels[lvl])]) ** 2).sum(-1)
        wn = (d2n <= tau2).float()
        sn = torch.stack([wn.sum(), (wn * d2n).sum()]).double().cpu()
        if float(sn[0]) >= 3 and math.sqrt(float(sn[1]) / float(sn[0])) > rmse * (1 + 1e-9) \
                and float(sn[0]) >= n_in:
            if lvl + 1 < len(levels):
                lvl += 1
                prev_rmse = math.inf
                continue
            reason, converged = "no_decrease", True
            it -= 1
            break
        D = T_new @ transforms.invert(T)
        rot = float(transforms.rotation_angle(D[:3, :3]))
        trans = float(D[:3, 3].norm())
        T = T_new
        history.append({"rmse": rmse, "fitness": fit, "rotation": rot, "translation": trans,
                        "level": levels[lvl]})
        stop = None
        if rot < crit.rotation_tolerance and trans < crit.translation_tolerance:
            stop = "small_update"
        elif math.isfinite(prev_rmse) and prev_rmse > 0 and \
                abs(prev_rmse - rmse) / prev_rmse < crit.relative_rmse:
            stop = "relative_change"
        prev_rmse = rmse
        if stop is not None:
            if lvl + 1 < len(levels):
                lvl += 1
                prev_rmse = math.inf
                continue
            reason, converged = stop, True
            break
    t_end = time.perf_counter()
    return _result(T, fit, rmse, it, converged, reason, history,
                   {"iterate": t_end - t0, "total": t_end - t_start},
                   {"tree_depth": levels[lvl]})
