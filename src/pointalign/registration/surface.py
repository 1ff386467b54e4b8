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

``surface_newton`` minimises ``Σ_q d̂²(R q + t)`` by damped Newton steps (Algorithm 2,
:class:`NewtonStep`): the motion is linearised (small rotation), the 6×6 system ``F ξ = g``
is reduced in one fused pass (:func:`pointalign.kernels.surface.newton_terms`) and solved
in float64 (:func:`newton_direction`), and the step length is chosen by the Armijo rule
(Algorithm 1) on the **exact** objective (the approximants looked up at the moved points).
``approximate_icp`` is the paper's approximate GPU ICP (:class:`CellMeanStep`): the
correspondence of a source point is the mean of the tree cell it falls in (no
backtracking), and the update is Horn's closed form.

Both are a step and host rules on the one executor (:mod:`pointalign.kernels._loop`), go
coarse to fine through the tree's levels by one :class:`LevelSchedule` (not in the paper:
a lookup without backtracking needs cells larger than the motion), and share the edge of
every algorithm (:mod:`pointalign.registration._edge`: device, local float64 frame, stop
reasons, result).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from pointalign import _validate, estimate, transforms
from pointalign._math import eigh3 as symmetric_eigh3
from pointalign.kernels import _loop, normal_eq
from pointalign.kernels import kdtree as _kd
from pointalign.kernels import surface as _ks
from pointalign.kernels._backend import backend
from pointalign.registration import _edge
from pointalign.registration._edge import StopReason
from pointalign.registration.criteria import ConvergenceCriteria
from pointalign.registration.result import RegistrationResult
from pointalign.search.kdtree import KDTreeIndex

APPROXIMANTS = ("point", "plane", "second_order")

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
    L: list[list[Any]] = [[None] * n for _ in range(n)]
    for j in range(n):
        d = M[:, j, j] - sum((L[j][k] * L[j][k] for k in range(j)), torch.zeros_like(M[:, 0, 0]))
        ljj = torch.where(d > 0, d, torch.full_like(d, float("nan"))).sqrt()
        L[j][j] = ljj
        for i in range(j + 1, n):
            v = M[:, i, j] - sum((L[i][k] * L[j][k] for k in range(j)), torch.zeros_like(ljj))
            L[i][j] = v / ljj
    y: list[torch.Tensor] = []
    for i in range(n):
        y.append((r[:, i] - sum((L[i][k] * y[k] for k in range(i)), torch.zeros_like(r[:, 0])))
                 / L[i][i])
    x: list[Any] = [None] * n
    for i in reversed(range(n)):
        x[i] = (y[i] - sum((L[k][i] * x[k] for k in range(i + 1, n)), torch.zeros_like(y[i])))\
            / L[i][i]
    return torch.stack(x, -1)


def node_frames(tree: KDTreeIndex) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, PCA frame and RMS radius of every node: ``(K, 3)``, ``(K, 3, 3)``, ``(K,)``.

    ``frame[:, :, 0..2]`` are the eigenvectors of the node's covariance reordered as
    ``(e1, e2, n)``: largest, middle, smallest eigenvalue (the normal). The eigen-solve is the
    closed form of :func:`pointalign.features.normals.symmetric_eigh3` (O(K) memory, no
    cuSOLVER). Nodes with fewer than 5 points take their parent's
    frame. float64.
    """
    min_frame_points = 5  # fewer points: no PCA frame of their own
    fast = _ks.node_frames(tree.arrays, min_frame_points)  # the "cpu" backend's kernel
    if fast is not None:
        return fast
    pts = tree.points.double()
    size = tree.node_sizes().double()
    mean = tree.node_sums(pts) / size[:, None]
    second = tree.node_sums((pts[:, :, None] * pts[:, None, :]).reshape(-1, 9)).reshape(-1, 3, 3)
    cov = second / size[:, None, None] - mean[:, :, None] * mean[:, None, :]
    cov = 0.5 * (cov + cov.transpose(1, 2))
    evals, evecs = symmetric_eigh3(cov)  # ascending
    frame = torch.stack([evecs[:, :, 2], evecs[:, :, 1], evecs[:, :, 0]], -1)
    radius = evals.clamp_min(0).sum(-1).sqrt()
    small = tree.node_sizes() < min_frame_points
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
    fast = _ks.quadric_sums(tree.arrays, mean, frame)  # the "cpu" backend's kernel
    if fast is not None:
        normal_eq, rhs = fast
    for level in range(tree.depth + 1 if fast is None else 0):
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
        assert callable(approximant)  # a name was handled above
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


# ----------------------------------------------------------------------------- levels


def _resolve_depth(tree: KDTreeIndex, depth: int | None) -> int:
    """Check ``depth`` and clamp it to the tree (None: the deepest level of >= 8-point cells)."""
    if depth is None:
        min_cell_points = 8
        m = tree.points.shape[0]
        return max((lv for lv in range(tree.depth + 1) if (m >> lv) >= min_cell_points),
                   default=0)
    return min(_validate.integer(depth, "tree_depth", minimum=0), tree.depth)


def _level_radii(tree: KDTreeIndex, levels: list[int]) -> list[float]:
    """Median RMS radius of the cells of each level in ``levels`` (cached per node)."""
    key = "surface:radius"
    if not tree.has_payload(key):
        fast = _ks.node_moments(tree.arrays)  # the "cpu" backend's kernel
        if fast is not None:
            tree.attach(key, fast[1].diagonal(dim1=1, dim2=2).sum(-1).clamp_min(0).sqrt()
                        .float())
    if not tree.has_payload(key):
        pts = tree.points.double()
        size = tree.node_sizes().double().clamp_min(1)
        mean = tree.node_sums(pts) / size[:, None]
        sq = tree.node_sums((pts * pts).sum(-1)) / size
        tree.attach(key, (sq - (mean * mean).sum(-1)).clamp_min(0).sqrt().float())
    r = tree.payload(key)
    return torch.stack([r[tree.level_nodes(lv)].median() for lv in levels]).tolist()


@dataclass
class LevelSchedule:
    """The coarse-to-fine tree levels of :func:`surface_newton` and :func:`approximate_icp`.

    Cells of deep levels are small; a source point moved off the surface by more than a cell
    falls in a cell whose approximant describes another piece of surface (the lookup does
    not backtrack). So the iteration starts on a coarse level and, after each step on a
    coarse level (:meth:`after_step`), moves to the deepest level whose median cell radius
    is at least ``margin`` times the motion still expected, or one level deeper when the
    objective stopped changing. The stop rules apply on the finest level only.

    Attributes:
        levels: the tree levels, coarse to fine (``[depth]`` for a fixed ``tree_depth``).
        radii: the median cell radius of each level.
        margin: cell radius over expected motion required to go deeper.
        index: the current position in ``levels``.
        prev_disp: the last step's RMS displacement on this level (NaN: none yet).

    """

    levels: list[int]
    radii: list[float]
    margin: float
    index: int = 0
    prev_disp: float = math.nan

    #: a coarse level is left when the objective changes by less than this, relatively
    LEVEL_RELATIVE_CHANGE: ClassVar[float] = 1e-3

    @classmethod
    def for_tree(cls, tree: KDTreeIndex, tree_depth: int | None, *,
                 cell_means: bool) -> LevelSchedule:
        """Build the schedule on ``tree`` down to ``tree_depth`` (None: the default depth).

        With ``tree_depth`` given that one level is used throughout. Otherwise the start is
        6 levels above the finest (never above level 3, 8 cells); for the cell-mean
        methods (``cell_means``: approximate ICP and the point approximant) 7 levels above
        and no deeper than the deepest level whose median cell radius is at least 0.3 of
        the whole target's: a lookup's capture range is a length, not a point count (on
        150k-1M-point bunnies a start 7 levels up put the first cells at 2.7-3.8 mm against
        a 10°/10 mm motion, ~15 mm RMS; cell-mean ICP there has spurious fixed points and
        crept 0.2 mm per step, still ~9° off after 50 steps; issue 5). Their margin is 8
        (linear convergence: a step underestimates the motion still to come), else 2.
        """
        depth = _resolve_depth(tree, tree_depth)
        margin = 8.0 if cell_means else 2.0
        if tree_depth is not None:
            return cls([depth], _level_radii(tree, [depth]), margin)
        start = depth - (7 if cell_means else 6)
        if cell_means:
            radii = _level_radii(tree, list(range(depth + 1)))
            start = min(start, max((lv for lv in range(depth + 1) if radii[lv] >= 0.3 * radii[0]),
                                   default=0))
        levels = list(range(min(depth, max(3, start)), depth + 1))
        return cls(levels, _level_radii(tree, levels), margin)

    @property
    def level(self) -> int:
        """The current tree level."""
        return self.levels[self.index]

    @property
    def finest(self) -> bool:
        """Whether the current level is the last one."""
        return self.index == len(self.levels) - 1

    def descend(self) -> None:
        """Go one level finer (the current level gives no more descent)."""
        self.index = min(self.index + 1, len(self.levels) - 1)
        self.prev_disp = math.nan

    def after_step(self, disp: float, rel_change: float) -> bool:
        """Pick the level after a step on a coarse level; True when it changed.

        ``disp``: the step's RMS displacement of the source; ``rel_change``: the relative
        change of the objective. The motion still expected is ``disp``, stretched by the
        observed linear rate ρ (remaining ≈ disp ρ / (1 − ρ)) when convergence is slow.
        """
        rho = min(disp / self.prev_disp if self.prev_disp > 0 else 0.0, 0.9)
        remaining = disp * max(1.0, rho / (1.0 - rho))
        new = self.index
        while new + 1 < len(self.levels) and self.radii[new + 1] >= self.margin * remaining:
            new += 1
        if new == self.index and rel_change < self.LEVEL_RELATIVE_CHANGE:
            new += 1
        if new == self.index:
            self.prev_disp = disp
            return False
        self.index, self.prev_disp = new, math.nan
        return True


# ----------------------------------------------------------------------------- shared edge


@dataclass(frozen=True)
class _Problem:
    """One validated problem in its local frame: the source, the target's tree, the pair."""

    pair: _edge.Pair
    source: torch.Tensor          # (N, 3) float32
    tree: KDTreeIndex
    centroid: np.ndarray          # (3,) float64, the source's centroid
    cov: np.ndarray               # (3, 3) float64, the source's covariance
    radius: float                 # the source's RMS radius


def _prepare(source: Any, target: Any, init: Any, device: Any, index: Any
             ) -> tuple[_Problem, _loop.Clock]:
    """Validate, resolve the device, move to the local frame and build the target's tree.

    Without ``index`` the problem is shifted by the target's centroid in float64 before it
    becomes float32 (georeferenced coordinates keep their precision) and the tree is built
    there; an ``index`` was built in the caller's coordinates, which are then kept.
    """
    if index is not None and not isinstance(index, KDTreeIndex):
        raise TypeError(f"index: expected a KDTreeIndex over the target, "
                        f"got {type(index).__name__}")
    if index is None and target is None:
        raise ValueError("target: required when no index is given")
    tgt = index.points if index is not None else target
    dev = _edge.resolve_device(device, source=source, target=tgt)
    pair = _edge.prepare_pair(source, tgt, init=init, device=dev, min_points=3,
                              local=index is None)
    if pair.batched:
        raise ValueError("source: expected one (N, 3) cloud, got a batch")
    clock = _loop.Clock(dev)
    tree = index if index is not None else clock.stage(
        "tree", KDTreeIndex, pair.target[0], leaf_size=8)
    src = pair.source[0]
    s64 = src.double()
    centroid = s64.mean(0)
    cov = (s64 - centroid).T @ (s64 - centroid) / s64.shape[0]
    return _Problem(pair, src, tree, centroid.cpu().numpy(), cov.cpu().numpy(),
                    math.sqrt(max(float(cov.trace()), 0.0))), clock


def _move(xi: np.ndarray, center: np.ndarray) -> np.ndarray:
    """``(4, 4)``: rotate by ``exp(ω)`` about ``center``, then translate by ``τ``; ξ = (ω, τ)."""
    R = transforms.so3_exp(torch.from_numpy(np.asarray(xi[:3], dtype=np.float64))).numpy()
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = R, center - R @ center + xi[3:]
    return T


def _rms_displacement(D: np.ndarray, T: np.ndarray, prob: _Problem) -> float:
    """RMS of ``||D x − x||`` over the source points moved by ``T`` (from their moments)."""
    R0 = T[:3, :3]
    cov, centroid = R0 @ prob.cov @ R0.T, R0 @ prob.centroid + T[:3, 3]
    M = D[:3, :3] - np.eye(3)
    mean_disp = M @ centroid + D[:3, 3]
    return math.sqrt(max(float(np.trace(M @ cov @ M.T) + mean_disp @ mean_disp), 0.0))


def _angle(R: np.ndarray) -> float:
    """Rotation angle (radians) of ``R (3, 3)``, accurate near 0."""
    s = 0.5 * np.linalg.norm([R[2, 1] - R[1, 2], R[0, 2] - R[2, 0], R[1, 0] - R[0, 1]])
    return float(np.arctan2(s, 0.5 * (np.trace(R) - 1)))


def default_criteria(points: torch.Tensor) -> ConvergenceCriteria:
    """Stop rule for float32 clouds, scaled to ``points (N, 3)``.

    ``||T_step − I||`` small: the accepted step rotates by less than 1e-5 rad and moves the
    centroid by less than 1e-5 of the cloud's RMS radius (about 300× float32 rounding of the
    coordinates); or the RMS approximate distance changes by less than 1e-5 relatively (the
    float32 objective is reproducible to about 1e-6 at 10⁶ points); at most 50 steps.
    """
    stop_relative = 1e-5
    p = points.double()
    radius = float(((p - p.mean(0)) ** 2).sum(-1).mean().sqrt())
    return ConvergenceCriteria(max_iterations=50, relative_rmse=stop_relative,
                               rotation_tolerance=stop_relative,
                               translation_tolerance=stop_relative * max(radius, 1e-30))


def _finish(prob: _Problem, T: np.ndarray, fit: float, rmse: float, it: int,
            reason: StopReason, history: list, timings: dict, info: dict
            ) -> RegistrationResult:
    return _edge.build_result(prob.pair, T[None], fitness=np.array([fit]),
                              rmse=np.array([rmse]), iterations=np.array([it]),
                              reasons=[reason], history=history, timings=timings, info=info)


# ----------------------------------------------------------------------------- Newton


def newton_direction(F: np.ndarray, g: np.ndarray, radius: float
                     ) -> tuple[np.ndarray, bool]:
    """Solve for the Newton direction ``ξ = F⁺ g`` ``(6,)``; tell whether F is determined.

    ``F (6, 6)``, ``g (6,)`` float64 about the rotation centre; ``radius`` is the length
    that makes the rotation columns unitless (the source's RMS radius). The degeneracy rule
    has the library's form (as :data:`pointalign.estimate.DEGENERACY_EPS`): on the scaled
    system ``S F S`` (``S = diag(1/radius ×3, 1 ×3)``) eigenvalues at or below ``eps ×`` the
    largest are dropped and the step is the least-norm one on the determined directions;
    F is *determined* when none is dropped (a plane leaves three motions free, a line two,
    identical points three). Here ``eps = 1e-5``: F comes from float32 coefficients and
    float32 block sums, so a free motion shows as an eigenvalue of ~1e-8-1e-6 of the
    largest, of either sign (1e-10 would sit inside that rounding); the bunny's smallest is
    ~0.1 of its largest.
    """
    rank_eps = 1e-5
    s = np.array([1.0 / radius] * 3 + [1.0] * 3) if radius > 0 else np.ones(6)
    ev, V = np.linalg.eigh(F * s[:, None] * s[None, :])
    keep = ev > rank_eps * max(ev[-1], 1e-300)
    inv = np.where(keep, 1.0 / np.where(keep, ev, 1.0), 0.0)
    return s * (V @ (inv * (V.T @ (s * g)))), bool(keep.all())


@dataclass(frozen=True)
class NewtonStep:
    """One damped Newton iteration (Algorithm 2) with the Armijo rule (Algorithm 1).

    From the terms ``F, g, f0`` at the current pose T: the direction ``ξ = F⁺ g``
    (:func:`newton_direction`), then the step ``α ∈ {1, β, β², …}`` (at most 12 trials), the
    first with ``f(α) − f0 <= σ α ∇fᵀξ`` on the exact objective; with ``stretch`` (the
    point approximant) an accepted full step is stretched to ``α ∈ {2, 4, 8}`` while the
    exact objective keeps falling and the condition holds. Each trial is one fused pass at
    the moved pose whose terms, when accepted, are the next iteration's: one pass per
    iteration when the full step is taken.

    Inputs: ``source (N, 3)`` float32, ``coeffs (K, 10)``. State (host, float64): ``T (4, 4)``
    and ``terms (29,)`` at T on this step's level. Record: ``line (6,)`` = (usable: F is not
    empty, accepted, α, f0, determined: of F, passes), the direction ``xi (6,)`` and the new
    state (``T``, ``terms``).
    """

    #: the line search reads each trial's objective on the host: the executor runs it eagerly
    graph_safe: ClassVar[bool] = False
    #: Armijo trials before the step counts as failed (then: next level, or stop)
    MAX_BACKTRACKS: ClassVar[int] = 12
    #: the point approximant's accepted full step may be stretched up to this factor
    MAX_STRETCH: ClassVar[float] = 8.0

    tree: KDTreeIndex             # the target's tree (a signature names it by identity)
    level: int
    tau2: float                   # squared truncation distance (inf: none)
    beta: float
    sigma: float
    stretch: bool
    centroid: tuple[float, float, float]   # the source's centroid (the rotation centre)
    radius: float

    def terms(self, inputs: _loop.Tensors, T: torch.Tensor) -> torch.Tensor:
        """``(29,)`` float64 host terms at pose ``T`` about the moved centroid."""
        center = T[:3, :3] @ torch.tensor(self.centroid, dtype=torch.float64) + T[:3, 3]
        return _ks.newton_terms(inputs["source"], T, center, self.tree.arrays, inputs["coeffs"],
                                self.level, tau2=self.tau2).cpu()

    def __call__(self, inputs: _loop.Tensors, state: _loop.Tensors):
        """Run one iteration: ``(inputs, state) -> (state, record)`` (class docstring)."""
        T, tt = state["T"], state["terms"]
        F, g, f0, _ = _ks.unpack(tt)
        usable = math.isfinite(float(F.diagonal().abs().max())) and bool(F.diagonal().any())
        xi, determined = newton_direction(F.numpy(), g.numpy(), self.radius) if usable else \
            (np.zeros(6), False)
        center = T[:3, :3].numpy() @ np.array(self.centroid) + T[:3, 3].numpy()
        slope = -2.0 * float(g.numpy() @ xi)   # directional derivative of the model, < 0
        alpha, passes, best = 1.0, 0, None
        for _ in range(self.MAX_BACKTRACKS if usable else 0):
            Tc = torch.from_numpy(_move(alpha * xi, center)) @ T
            tc = self.terms(inputs, Tc)
            passes += 1
            if float(tc[27]) - f0 <= self.sigma * alpha * slope:
                best = (alpha, Tc, tc)
                break
            alpha *= self.beta
        while self.stretch and best is not None and best[0] >= 1.0 and \
                best[0] < self.MAX_STRETCH:
            # the cell-mean model is stiff (ICP-like linear convergence: the full step
            # undershoots by a steady factor), so try 2ξ, 4ξ, … while the exact objective
            # keeps falling (Armijo's condition still holds at every accepted length)
            a2 = 2 * best[0]
            Te = torch.from_numpy(_move(a2 * xi, center)) @ T
            te = self.terms(inputs, Te)
            passes += 1
            fe = float(te[27])
            if not (fe < float(best[2][27]) and fe - f0 <= self.sigma * a2 * slope):
                break
            best = (a2, Te, te)
        new = state if best is None else {"T": best[1], "terms": best[2]}
        # one host row: the executor packs records into one float64 row per step
        line = [usable, best is not None, alpha if best is None else best[0], f0, determined,
                passes]
        record = {"line": torch.tensor(line, dtype=torch.float64),
                  "xi": torch.from_numpy(np.asarray(xi, dtype=np.float64)),
                  "T": new["T"], "terms": new["terms"]}
        return new, record


@dataclass
class _NewtonRules:
    """Stopping rules and the level schedule of :func:`surface_newton`, per step's record.

    A step that finds no descent leaves a coarse level for the next finer one and on the
    finest level ends the iteration ("no_decrease": a numerical minimum). An accepted step
    on a coarse level moves the schedule (:meth:`LevelSchedule.after_step`); on the finest
    level it stops on a small update ``||T(ξ) − I||`` or a small relative change of the RMS
    approximate distance (Algorithm 2's two criteria).
    """

    crit: ConvergenceCriteria
    schedule: LevelSchedule
    prob: _Problem
    T: np.ndarray
    terms: np.ndarray
    tau2: float = math.inf
    it: int = 0
    passes: int = 0
    reason: StopReason | None = None
    history: list[dict[str, Any]] = field(default_factory=list)

    def _stop(self, reason: StopReason) -> bool:
        self.reason = reason
        return True

    def __call__(self, rec: dict[str, np.ndarray]) -> bool:
        """Apply the rules to one record; True when this level's run ends (stop or new level)."""
        usable, accepted, alpha, f0, _, passes = rec["line"].tolist()
        self.passes += int(passes)
        if not usable:
            no_terms = self.terms[28] == 0
            return self._stop(StopReason.NO_CORRESPONDENCES if no_terms else
                              StopReason.DEGENERATE)
        self.it += 1
        sch = self.schedule
        if not accepted:
            if sch.finest:
                return self._stop(StopReason.NO_DECREASE)
            sch.descend()
            return True
        xi = rec["xi"]
        center = self.T[:3, :3] @ self.prob.centroid + self.T[:3, 3]
        # the full Newton step ξ (not the damped one) measures the motion still expected: a
        # step cut short by the line search is small because the model is poor, not because
        # the iteration converged
        full = max(alpha, 1.0) * xi
        disp = _rms_displacement(_move(full, center), self.T, self.prob)
        rot, trans = float(np.linalg.norm(full[:3])), float(np.linalg.norm(full[3:]))
        self.T, self.terms = rec["T"], rec["terms"]
        f1 = float(self.terms[27])
        fit, rmse = self.stats()
        self.history.append({"objective": f1, "step": alpha, "rotation": rot,
                             "translation": trans, "displacement": disp, "fitness": fit,
                             "rmse": rmse, "level": sch.level})
        if sch.finest:
            c = self.crit
            if rot < c.rotation_tolerance and trans < c.translation_tolerance:
                return self._stop(StopReason.SMALL_UPDATE)
            rel_rmse = 1.0 - math.sqrt(max(f1, 0.0) / f0) if f0 > 0 else 0.0
            if f1 == 0 or abs(rel_rmse) < c.relative_rmse:
                return self._stop(StopReason.RELATIVE_CHANGE)
            return False
        return sch.after_step(disp, abs(f0 - f1) / f0 if f0 > 0 else 0.0)

    def stats(self) -> tuple[float, float]:
        """Fitness (terms within the truncation) and RMS approximate distance over them."""
        n, obj, inl = self.prob.source.shape[0], float(self.terms[27]), float(self.terms[28])
        tau2 = self.tau2
        inl_obj = obj - (n - inl) * tau2 if math.isfinite(tau2) else obj
        return inl / n, math.sqrt(max(inl_obj, 0.0) / inl) if inl > 0 else math.inf


@_validate.out_of_memory_is_clear
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

    Each iteration (:class:`NewtonStep`) solves the 6×6 system ``F ξ = g`` reduced in one
    fused pass and takes the Armijo step along ξ on the exact objective. Coarse to fine
    (``tree_depth=None``, :class:`LevelSchedule`): the iteration starts 6 levels above the
    finest, where cells are large enough for a lookup without backtracking to stay on the
    right piece of surface while the motion is large (the point approximant, ICP to the
    cell means, starts as :func:`approximate_icp` does); after each accepted step it moves
    to the deepest level whose typical cell radius is at least 2 (point: 8) times the motion
    still expected (the step's RMS displacement of the source, stretched by the observed
    rate of convergence); the stop rules apply on the finest level only. With
    ``tree_depth`` given, that one level is used throughout.

    Precision: without ``index`` the problem is solved in a frame centred on the target's
    centroid (shifted in float64 before anything becomes float32) and the pose composed
    back in float64, so coordinates far from the origin (UTM) keep their precision; an
    ``index`` keeps the caller's coordinates (it was built in them).

    Args:
        source: ``(N, 3)`` points (array, tensor or PointCloud), the query surface.
        target: ``(M, 3)`` points, the template; ignored (may be None) when ``index`` is
            given.
        approximant: ``"point"``, ``"plane"``, ``"second_order"`` or a callable (module
            docstring).
        tree_depth: tree level whose approximants are used (default: coarse to fine, down to
            the deepest level whose cells hold at least 8 points).
        init: ``(4, 4)`` initial ``T_target_source`` (default identity).
        criteria: iteration cap; stops when the Newton step ``ξ = (ω, τ)`` rotates by less
            than ``rotation_tolerance`` and moves the centroid by less than
            ``translation_tolerance`` ("small_update", i.e. ``||T(ξ) − I||`` small), or the
            RMS approximate distance changes by less than ``relative_rmse`` relatively
            ("relative_change"), or no step decreases it ("no_decrease"). Default:
            :func:`default_criteria` (float32-aware, scaled to the source).
        device: compute device; default: the inputs' device, else cuda when available.
        index: a :class:`~pointalign.search.kdtree.KDTreeIndex` over the target, reused across
            calls with its cached approximants (build it once: ``KDTreeIndex(target)``).
        max_correspondence_distance: truncate each term at this distance (``min(d̂², τ²)``),
            so points outside the overlap stop pulling; None: no truncation.
        armijo: ``(β, σ)`` of the Armijo rule: step ``α ∈ {1, β, β², …}`` (12 trials at
            most), accepted when ``f(α) − f(0) <= σ α ∇fᵀξ``. With the point approximant a
            full step that is accepted is then stretched to ``α ∈ {2, 4, 8}`` while the
            exact objective keeps falling and the condition holds (ICP-like linear
            convergence: the Newton step on the cell means undershoots by a steady factor;
            3e5-point bunny at 10°/10 mm: 17 steps instead of 38-50).

    Returns:
        :class:`RegistrationResult`; ``iterations`` counts Newton steps (one 6×6 solve
        each); ``fitness`` is the fraction of terms within the truncation distance (1
        without one), ``rmse`` the RMS approximate distance over them. ``converged`` is
        False when the final system leaves a motion undetermined (a plane, a line,
        identical points: ``stop_reason`` "degenerate", ``info["rank_deficient"]``; the
        pose is then the least-norm solution on the determined motions). ``info`` holds the
        final ``F`` (6×6), ``objective``, ``tree_depth``, the number of objective passes
        (``passes``, Armijo trials included), ``rank_deficient``, ``approximant`` and
        ``max_correspondence_distance`` (None: the objective was not truncated).

    Accuracy (docs, "Surface methods"): ``converged`` means the Newton iteration reached
    the minimum of *this* objective; without ``max_correspondence_distance`` that is the
    least-squares fit of the whole source, so on partial overlaps the parts without a
    counterpart pull the pose off the truth, as untruncated ICP's would. Started from the
    reference pose it drifts to the same place: bun045 -> bun000 0.66-0.68° off (truncated at
    5 mm: 0.17-0.18°, at 2 mm: 0.05°; point-to-plane ICP at 5 mm: 0.08°); the fast_gicp LiDAR
    pair 0.78° / 50 mm (1 m: 0.33° / 49 mm; with its ~5k invalid returns at (0, 0, 0) removed
    from each scan, 1 m: 0.12° / 14 mm, point-to-plane ICP 0.07° / 18 mm, Open3D 0.04° /
    16 mm). Pass a truncation of a few point spacings (plus the expected residual noise) on
    scans that overlap partly, and drop invalid returns: points stored at the sensor origin
    in both scans are pinned there, which pulls the pose toward the identity.

    """
    t_start = time.perf_counter()
    crit = _validate.instance(criteria, ConvergenceCriteria, "criteria")
    if tree_depth is not None:
        _validate.integer(tree_depth, "tree_depth", minimum=0)
    if not isinstance(armijo, (tuple, list)) or len(armijo) != 2:
        raise TypeError(f"armijo: expected a pair (beta, sigma), each in (0, 1), got {armijo!r}")
    beta = _validate.in_range(armijo[0], "armijo beta", 0.0, 1.0)
    sigma = _validate.in_range(armijo[1], "armijo sigma", 0.0, 1.0)
    tau2 = math.inf if max_correspondence_distance is None else _validate.positive(
        max_correspondence_distance, "max_correspondence_distance") ** 2
    prob, clock = _prepare(source, target, init, device, index)
    if criteria is None:
        crit = default_criteria(prob.source)
    co = clock.stage("approximants", approximant_coefficients, prob.tree, approximant)
    stretch = isinstance(approximant, str) and approximant == "point"
    schedule = LevelSchedule.for_tree(prob.tree, tree_depth, cell_means=stretch)
    inputs = {"source": prob.source, "coeffs": co}
    T0 = torch.from_numpy(prob.pair.init[0].copy())
    rules = _NewtonRules(crit, schedule, prob, T0.numpy(), np.zeros(_ks.N_TERMS), tau2=tau2)
    t_it, runs = time.perf_counter(), []
    while rules.reason is None:
        # the truncation applies on the finest level only: on coarse levels the cells'
        # approximants lie farther from the surface than a correspondence distance meant
        # for it
        step = NewtonStep(prob.tree, schedule.level, tau2 if schedule.finest
                          else math.inf, beta, sigma, stretch, tuple(prob.centroid.tolist()),
                          prob.radius)
        left = int(crit.max_iterations) - rules.it
        if left <= 0:
            rules.reason = StopReason.MAX_ITERATIONS
            break
        T = torch.from_numpy(rules.T.copy())
        rules.terms = step.terms(inputs, T).numpy()
        rules.passes += 1
        run = _loop.iterate(step, inputs, {"T": T, "terms": torch.from_numpy(rules.terms)},
                            max_steps=left)
        runs.append(run)
        ended = False
        for record in run:
            if rules(record):
                ended = True
                break
        if not ended:
            rules.reason = StopReason.MAX_ITERATIONS
    F, g, _, _ = _ks.unpack(torch.from_numpy(rules.terms))
    determined = newton_direction(F.numpy(), g.numpy(), prob.radius)[1] and \
        rules.terms[28] > 0
    reason = rules.reason
    if not determined and reason is not StopReason.NO_CORRESPONDENCES:
        reason = StopReason.DEGENERATE
    fit, rmse = rules.stats()
    timings = dict(clock.timings, iterate=time.perf_counter() - t_it)
    timings["total"] = time.perf_counter() - t_start
    info = {"F": F, "objective": float(rules.terms[27]), "tree_depth": schedule.level,
            "passes": rules.passes, "rank_deficient": not determined,
            "approximant": approximant if isinstance(approximant, str) else "custom",
            "device_steps": sum(r.launched for r in runs),
            "max_correspondence_distance": max_correspondence_distance}
    return _finish(prob, rules.T, fit, rmse, rules.it, reason, rules.history, timings, info)


# ----------------------------------------------------------------------------- approximate ICP


@dataclass(frozen=True)
class CellMeanStep:
    """One approximate-ICP step on the device: cell means as correspondences, then Horn.

    Move the source by T, descend the tree to ``level`` (no backtracking) and take each
    point's cell mean as its partner (dropped beyond ``tau2``); reduce the pairs and solve
    Horn's closed form in float64 (:func:`pointalign.kernels.normal_eq.icp_update`, the ICP
    update with the cell means as the target).

    Inputs: ``source (1, N, 3)`` float32, ``means (1, K, 3)`` (the nodes' means),
    ``lengths (1,)``, ``center (1, 3)``. State: ``T (1, 4, 4)`` float64 and its float32
    ``Tf``. Record: ``sums (1, 30)`` at T, the update ``D``, ``T' = D T`` and ``flags``.
    """

    graph_safe: ClassVar[bool] = True
    tree: KDTreeIndex             # the target's tree (a signature names it by identity)
    level: int
    tau2: float

    def __call__(self, inputs: _loop.Tensors, state: _loop.Tensors):
        """Run one step: ``(inputs, state) -> (state, record)`` (class docstring)."""
        T, Tf = state["T"], state["Tf"]
        if backend(inputs["source"]) == "cpu":
            # one fused numba pass (move, descend, pair, Horn's sums; the "torch" backend's
            # moves and reduction below are its reference), then the float64 solve
            sums = _ks.cell_mean_sums(inputs["source"][0], Tf[0], self.tree.arrays,
                                      inputs["means"][0], self.level, tau2=self.tau2,
                                      center=inputs["center"][0])[None]
            D, T_new, flags = normal_eq.solve_update_reference(
                sums, inputs["center"], T, plane=False, eps=estimate.DEGENERACY_EPS)
            return {"T": T_new, "Tf": T_new.float()}, {"sums": sums, "update": D, "T": T_new,
                                                        "flags": flags}
        x = torch.baddbmm(Tf[:, None, :3, 3], inputs["source"], Tf[:, :3, :3].transpose(1, 2))
        node = _kd.descend(self.tree.arrays, x[0], self.level)
        if math.isfinite(self.tau2):
            d2 = ((x[0] - inputs["means"][0, node]) ** 2).sum(-1)
            node = torch.where(d2 <= self.tau2, node, torch.full_like(node, -1))
        sums, D, T_new, Tf_new, flags = normal_eq.icp_update(
            x, inputs["means"], node[None], transform=T, plane=False,
            lengths=inputs["lengths"], center=inputs["center"], eps=estimate.DEGENERACY_EPS)
        return {"T": T_new, "Tf": Tf_new}, {"sums": sums, "update": D, "T": T_new,
                                            "flags": flags}


@dataclass
class _CellMeanRules:
    """Stopping rules and the level schedule of :func:`approximate_icp`, per step's record.

    The cell-mean lookup is not a nearest-neighbour search, so ICP's monotonicity fails: a
    step that raised the RMS distance to the cell means is taken back, and the iteration
    goes one level finer or (finest level) stops ("no_decrease"). Too few distinct cell
    means for Horn's solve also send it one level finer (finest: "degenerate").
    """

    crit: ConvergenceCriteria
    schedule: LevelSchedule
    prob: _Problem
    T: np.ndarray
    it: int = 0
    fit: float = 0.0
    rmse: float = math.inf
    prev_rmse: float = math.inf
    reason: StopReason | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    #: relative change of the RMS distance made by the last step kept (inf: none yet)
    last_rel: float = math.inf
    #: the iteration ended on "no_decrease" while its steps still changed the RMS distance by
    #: LevelSchedule.LEVEL_RELATIVE_CHANGE or more: a stall of the cell-mean lookup (a step
    #: moved points into other cells), not a settled pose
    stalled: bool = False

    def __post_init__(self) -> None:
        self.T_prev, self.fit_prev = self.T, self.fit

    def _stop(self, reason: StopReason) -> bool:
        self.reason = reason
        return True

    def __call__(self, rec: dict[str, np.ndarray]) -> bool:
        """Apply the rules to one record; True when this level's run ends (stop or new level)."""
        s, sch = rec["sums"][0], self.schedule
        n_in = float(s[28])
        if n_in < 3:
            return self._stop(StopReason.NO_CORRESPONDENCES)
        fit, rmse = n_in / self.prob.source.shape[0], math.sqrt(float(s[29]) / n_in)
        if self.it >= self.crit.max_iterations:  # the last pose, evaluated
            self.fit, self.rmse = fit, rmse
            return self._stop(StopReason.MAX_ITERATIONS)
        if rmse > self.prev_rmse * (1 + 1e-9):
            # the previous step raised the RMS distance to the cell means (on coarse levels
            # the cloud then drifts along the cells): take it back, go finer or stop
            self.T, self.fit, self.rmse = self.T_prev, self.fit_prev, self.prev_rmse
            self.history.pop()
            if sch.finest:
                self.stalled = not self.last_rel < LevelSchedule.LEVEL_RELATIVE_CHANGE
                return self._stop(StopReason.NO_DECREASE)
            sch.descend()
            self.prev_rmse = math.inf
            return True
        self.fit, self.rmse = fit, rmse
        self.it += 1
        if not rec["flags"][0, normal_eq.FLAG_VALID]:
            if sch.finest:
                return self._stop(StopReason.DEGENERATE)
            sch.descend()  # too few distinct cell means: go finer
            return True
        D = rec["update"][0]
        disp = _rms_displacement(D, self.T, self.prob)
        rot, trans = _angle(D[:3, :3]), float(np.linalg.norm(D[:3, 3]))
        self.T_prev, self.fit_prev = self.T, fit
        self.T = rec["T"][0]
        self.history.append({"rmse": rmse, "fitness": fit, "rotation": rot,
                             "translation": trans, "displacement": disp,
                             "level": sch.level})
        prev, self.prev_rmse = self.prev_rmse, rmse
        rel = abs(prev - rmse) / prev if math.isfinite(prev) and prev > 0 else math.inf
        self.last_rel = rel
        if sch.finest:
            c = self.crit
            if rot < c.rotation_tolerance and trans < c.translation_tolerance:
                return self._stop(StopReason.SMALL_UPDATE)
            if rel < c.relative_rmse:
                return self._stop(StopReason.RELATIVE_CHANGE)
            return False
        if sch.after_step(disp, rel):
            self.prev_rmse = math.inf
            return True
        return False


@_validate.out_of_memory_is_clear
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

    The paper's approximate GPU ICP (GCAICP, :class:`CellMeanStep`): descend the target's
    k-d tree to a level without backtracking, take that node's mean as the corresponding
    point, drop pairs farther apart than ``max_correspondence_distance`` (if given; finest
    level only), and solve ``argmin Σ ||R x + t − y||²`` in closed form (Horn; reduced and
    solved on the device). Coarse to fine as :func:`surface_newton` with the cell-mean
    schedule (:class:`LevelSchedule`: first cells of at least 0.3 of the target's RMS
    radius, margin 8, one level deeper when the RMS distance to the cell means changes by
    less than 1e-3). On the finest level it stops on a small update,
    ``|Δrmse| / rmse < relative_rmse``, or a step that would raise the RMS distance
    ("no_decrease": the step is not taken; converged). Arguments and precision as
    :func:`surface_newton` (default criteria: :func:`default_criteria`).

    ``info`` holds ``tree_depth`` (the last level), ``device_steps``, ``cuda_graph``,
    ``max_correspondence_distance``, ``last_relative_change`` (the relative change of the
    RMS distance to the cell means made by the last step kept; inf when it was the first on
    its level) and ``stalled``: the iteration ended on "no_decrease" while that change was
    still at least 1e-3 (:attr:`LevelSchedule.LEVEL_RELATIVE_CHANGE`), i.e. a step moved
    points into other cells and raised the distance while the pose was still moving. The
    stop is then the lookup's, not a settled pose: ``stop_reason`` keeps the library's
    meaning of "no_decrease" (converged), and ``stalled`` says how much to trust it.

    Accuracy: the partner is the mean of the cell a point falls in, not the surface under
    it, so the fixed points of the iteration lie where the cell assignment is consistent,
    not at the least-squares pose: measured from the identity (docs, "Surface methods"):
    bun045 -> bun000 4.2° / 3.8 mm (50 steps, still creeping), the fast_gicp LiDAR pair
    2.4° / 0.89 m (stalled), KITTI 00 frames 1 -> 0 0.32° / 0.95 m (stalled: its 0.86 m
    forward motion barely recovered; the cells along a LiDAR scan line span metres, and on
    the coarse levels tens of metres, so each step moves the scan by centimetres). Use it as
    a cheap first stage and refine with :func:`surface_newton` or
    :func:`pointalign.icp` with a truncation.
    """
    t_start = time.perf_counter()
    crit = _validate.instance(criteria, ConvergenceCriteria, "criteria")
    if tree_depth is not None:
        _validate.integer(tree_depth, "tree_depth", minimum=0)
    tau2 = math.inf if max_correspondence_distance is None else _validate.positive(
        max_correspondence_distance, "max_correspondence_distance") ** 2
    prob, clock = _prepare(source, target, init, device, index)
    dev = prob.pair.device
    if criteria is None:
        crit = default_criteria(prob.source)
    tree = prob.tree

    def cell_means() -> torch.Tensor:
        key = "surface:mean"
        if not tree.has_payload(key):
            tree.attach(key, (tree.node_sums(tree.points) / tree.node_sizes()[:, None]).float())
        return tree.payload(key)

    means = clock.stage("approximants", cell_means)
    schedule = LevelSchedule.for_tree(tree, tree_depth, cell_means=True)
    inputs = {"source": prob.source[None], "means": means[None],
              "lengths": prob.pair.source_lengths, "center": means[:1].contiguous()}
    rules = _CellMeanRules(crit, schedule, prob, prob.pair.init[0].copy())
    t_it, runs = time.perf_counter(), []
    while rules.reason is None:
        step = CellMeanStep(tree, schedule.level, tau2 if schedule.finest else math.inf)
        T = torch.from_numpy(rules.T.copy())[None].to(dev)
        run = _loop.iterate(step, inputs, {"T": T, "Tf": T.float()},
                            max_steps=int(crit.max_iterations) - rules.it + 1)
        runs.append(run)
        for record in run:
            if rules(record):
                break
        else:
            rules.reason = StopReason.MAX_ITERATIONS
    timings = dict(clock.timings, iterate=time.perf_counter() - t_it)
    timings["total"] = time.perf_counter() - t_start
    info = {"tree_depth": schedule.level, "device_steps": sum(r.launched for r in runs),
            "cuda_graph": runs[-1].graph if runs else "off", "stalled": rules.stalled,
            "last_relative_change": rules.last_rel,
            "max_correspondence_distance": max_correspondence_distance}
    assert rules.reason is not None
    return _finish(prob, rules.T, rules.fit, rules.rmse, rules.it, rules.reason,
                   rules.history, timings, info)
