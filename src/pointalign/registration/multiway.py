"""multiway(): many scans of one object or scene into one frame; merge() into one cloud.

1. **Candidate edges** between scans: every pair (``edges="all"``), or each scan with the
   next ``neighbours`` in the given order plus loop-closure candidates (the last scan with
   the first, and the ``loop_closures`` most similar other pairs by a rotation-invariant
   shape signature); or an explicit list of ``(i, j)``.
2. Each edge registered **globally and locally** through
   :func:`~pointalign.registration.many.register_many` (batched; on a Dask cluster with
   ``client=``): ``Z_ij = T_i_j`` maps scan j into scan i, with the final ICP's 6×6
   information matrix and the verdict.
3. A **robust pose graph**: poses ``X_k = T_0_k`` (scan 0 fixed), one factor per trusted
   edge with error ``e_ij = Log(Z_ij⁻¹ X_i⁻¹ X_j)`` (a twist (ω, v) in scan j's frame) and
   information ``Ω_ij``, the ICP's H normalised so that ``eᵀ Ω e`` is the mean squared
   point-to-plane displacement of the edge's correspondences in voxels. False edges are
   pruned by graduated non-convexity with a truncated-least-squares cost (Yang, Antonante,
   Tzoumas & Carlone, "Graduated non-convexity for robust spatial perception", RA-L 2020):
   an edge whose displacement stays above ``max_displacement`` voxels gets weight 0.
   Solvers: ``"gtsam"`` (gtsam's ``GncLMOptimizer``, TLS loss; the ``multiway`` extra)
   or ``"scipy"`` (SciPy's ``least_squares`` on a sparse block Jacobian inside the same GNC
   loop, written here); ``"auto"`` takes gtsam where it imports. Both prune the same
   edges and give the same poses on the bunny and on synthetic graphs; gtsam is ~15x
   faster (a 10-scan graph with 24 edges and 2 false ones: 0.4 s against 6.6 s on a
   loaded 2-core CPU), so it is preferred.
4. An optional **joint refinement** (``refine`` rounds): every kept edge registered again
   by ICP from the graph's relative pose (batched), then the graph solved again.

Returns :class:`MultiwayResult`: one pose per scan in the first scan's frame and per-edge
diagnostics. :func:`merge` moves the scans by their poses into one cloud.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pointalign import _threads, _validate
from pointalign.cloud import PointCloud
from pointalign.registration.many import ManyResult, PairSpec, register_many

EDGES = ("all", "neighbours")
SOLVERS = ("auto", "scipy", "gtsam")

#: GNC's inlier bound by default: an edge is kept while its correspondences move by at most
#: this RMS point-to-plane displacement (voxels) between its measurement and the graph
MAX_DISPLACEMENT = 1.0
#: GNC's continuation factor (Yang et al.: 1.4) and its cap on outer rounds
GNC_FACTOR = 1.4
GNC_ROUNDS = 100


@dataclass(frozen=True)
class MultiwayResult:
    """Outcome of :func:`multiway`.

    Attributes:
        poses: ``(S, 4, 4)`` float64: ``T_0_k`` maps scan k into the first scan's frame.
        edges: one dict per candidate edge: ``i``, ``j`` (``Z = T_i_j`` maps scan j into
            scan i), ``trusted`` (the pair's verdict), ``kept`` (used by the final graph),
            ``weight`` (GNC's, in [0, 1]), ``residual`` (RMS displacement in voxels between
            the measurement and the graph), ``rotation_deg`` / ``translation`` (the same as
            a pose difference), ``fitness``, ``rmse``, ``verdict``, ``transformation``.
        solver: the pose-graph solver used.
        voxel_size: the voxel edge of the registrations (metres).
        table: the :class:`~pointalign.registration.many.ManyResult` of the last round of
            edge registrations.
        timings: seconds: ``register``, ``graph``, ``refine``, ``total``.

    """

    poses: np.ndarray
    edges: list[dict[str, Any]]
    solver: str
    voxel_size: float
    table: ManyResult
    timings: dict[str, float] = field(default_factory=dict)

    def merge(self, scans: Sequence[Any], voxel_size: float | None = None) -> PointCloud:
        """:func:`merge` with these poses."""
        return merge(scans, self.poses, voxel_size)


# ---------------------------------------------------------------------------- SE(3) helpers

def _log(T: np.ndarray) -> np.ndarray:
    from pointalign import transforms

    return transforms.se3_log(torch.from_numpy(np.ascontiguousarray(T))).numpy()


def _exp(xi: np.ndarray) -> np.ndarray:
    from pointalign import transforms

    return transforms.se3_exp(torch.from_numpy(np.ascontiguousarray(xi))).numpy()


def _inv(T: np.ndarray) -> np.ndarray:
    out = np.zeros_like(T)
    R = T[..., :3, :3]
    out[..., :3, :3] = np.swapaxes(R, -1, -2)
    out[..., :3, 3] = -(np.swapaxes(R, -1, -2) @ T[..., :3, 3, None])[..., 0]
    out[..., 3, 3] = 1.0
    return out


def _adjoint(T: np.ndarray) -> np.ndarray:
    """``Ad_T (6, 6)`` for twists (ω, v): ``Exp(Ad_T ξ) = T Exp(ξ) T⁻¹``."""
    R, t = T[:3, :3], T[:3, 3]
    tx = np.array([[0, -t[2], t[1]], [t[2], 0, -t[0]], [-t[1], t[0], 0]])
    A = np.zeros((6, 6))
    A[:3, :3] = R
    A[3:, 3:] = R
    A[3:, :3] = tx @ R
    return A


def edge_information(H: np.ndarray, center: np.ndarray, Z: np.ndarray, count: float,
                     voxel: float) -> np.ndarray:
    """Return the pose-graph information ``Ω (6, 6)`` of an edge, ``e = Log(Z⁻¹ X_i⁻¹ X_j)``.

    ``H``: the final ICP's information (twist about the target's ``center (3,)``, left
    perturbation, metres) over ``count`` correspondences; ``Z (4, 4)`` the edge's
    measurement. With ``C`` the shift to the centre, ``δ_c = Ad(C⁻¹ Z) e``, so
    ``Ω = Aᵀ (H / (count · voxel²)) A``: ``eᵀ Ω e`` is the mean squared point-to-plane
    displacement in voxels. A small ridge (1e-9 of the trace) keeps a sliding direction
    (a flat overlap) from making Ω singular.
    """
    C = np.eye(4)
    C[:3, 3] = center
    A = _adjoint(_inv(C) @ Z)
    Hn = np.asarray(H, dtype=np.float64) / (max(count, 1.0) * voxel * voxel)
    Hn = 0.5 * (Hn + Hn.T) + 1e-9 * max(np.trace(Hn), 1e-300) * np.eye(6)
    return A.T @ Hn @ A


# ---------------------------------------------------------------------------- edges

def _signature(points: torch.Tensor, bins: int = 16) -> np.ndarray:
    """Return a rotation-invariant shape signature: PCA spreads and a radial histogram."""
    p = points.to(torch.float64)
    c = p - p.mean(0)
    ev = torch.linalg.eigvalsh(c.T @ c / max(p.shape[0], 1)).clamp_min(0).sqrt()
    r = c.norm(dim=1)
    h = torch.histc(r / r.max().clamp_min(1e-300), bins=bins, min=0, max=1)
    return torch.cat([ev / ev.sum().clamp_min(1e-300), h / h.sum()]).cpu().numpy()


def candidate_edges(clouds: Sequence[torch.Tensor], edges: Any, neighbours: int,
                    loop_closures: int) -> list[tuple[int, int]]:
    """Return the candidate pairs ``(i, j)``, i < j (see the module docstring)."""
    n = len(clouds)
    if isinstance(edges, str):
        if edges not in EDGES:
            raise ValueError(f"edges: expected one of {EDGES} or a list of (i, j), "
                             f"got {edges!r}")
        if edges == "all":
            return list(itertools.combinations(range(n), 2))
        out = {(i, j) for i in range(n) for j in range(i + 1, min(n, i + 1 + neighbours))}
        if n > 2:
            out.add((0, n - 1))
        if loop_closures:
            sig = np.stack([_signature(c) for c in clouds])
            rest = sorted((float(np.abs(sig[i] - sig[j]).sum()), i, j)
                          for i, j in itertools.combinations(range(n), 2) if (i, j) not in out)
            out.update((i, j) for _, i, j in rest[:loop_closures])
        return sorted(out)
    pairs = []
    for e in edges:
        i, j = (int(x) for x in e)
        if not (0 <= i < n and 0 <= j < n) or i == j:
            raise ValueError(f"edges: ({i}, {j}) is not a pair of two of the {n} scans")
        pairs.append((min(i, j), max(i, j)))
    return sorted(set(pairs))


# ---------------------------------------------------------------------------- the graph

@dataclass
class _Graph:
    n: int
    ij: np.ndarray          # (E, 2)
    Z: np.ndarray           # (E, 4, 4)
    L: np.ndarray           # (E, 6, 6): Ω = L Lᵀ (Cholesky), residual Lᵀ e


def _errors(g: _Graph, X: np.ndarray) -> np.ndarray:
    """``e_ij = Log(Z⁻¹ X_i⁻¹ X_j)`` for every edge, ``(E, 6)``."""
    i, j = g.ij[:, 0], g.ij[:, 1]
    return _log(_inv(g.Z) @ _inv(X[i]) @ X[j])


def _whitened(g: _Graph, X: np.ndarray) -> np.ndarray:
    return np.einsum("eab,ea->eb", g.L, _errors(g, X))


def _spanning_poses(n: int, ij: np.ndarray, Z: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Return initial poses from a maximum spanning tree of the edges (Prim from scan 0)."""
    X = np.full((n, 4, 4), np.nan)
    X[0] = np.eye(4)
    done = {0}
    while len(done) < n:
        best, pick = -math.inf, None
        for e, (i, j) in enumerate(ij):
            if (i in done) != (j in done) and weight[e] > best:
                best, pick = weight[e], e
        if pick is None:
            missing = sorted(set(range(n)) - done)
            raise ValueError(f"scans: {missing} share no trusted overlap with scan 0's "
                             "group; pass more edges (edges='all') or a coarser voxel_size")
        i, j = ij[pick]
        if i in done:
            X[j] = X[i] @ Z[pick]
            done.add(int(j))
        else:
            X[i] = X[j] @ _inv(Z[pick])
            done.add(int(i))
    return X


def _solve_scipy(g: _Graph, X0: np.ndarray, w: np.ndarray, max_nfev: int = 100) -> np.ndarray:
    """Weighted least squares over right perturbations ``X_k = X0_k Exp(ξ_k)``, scan 0 fixed.

    SciPy's ``least_squares`` (trust-region reflective) on the whitened edge errors with a
    sparse Jacobian of 6×6 blocks: ``∂e/∂ξ_j = Jr⁻¹(e)`` and ``∂e/∂ξ_i = −Jr⁻¹(e) Ad(X_j⁻¹ X_i)``,
    taken with ``Jr⁻¹ ≈ I`` (errors and steps are small near a solution; the residuals
    themselves are exact, and each call of :func:`_gnc_scipy` restarts from the last poses).
    """
    from scipy.optimize import least_squares
    from scipy.sparse import csr_matrix

    n, E = g.n, g.ij.shape[0]
    sw = np.sqrt(np.maximum(w, 0.0))
    i_, j_ = g.ij[:, 0], g.ij[:, 1]

    def poses(x: np.ndarray) -> np.ndarray:
        X = X0.copy()
        X[1:] = X0[1:] @ _exp(x.reshape(n - 1, 6))
        return X

    def fun(x: np.ndarray) -> np.ndarray:
        return (sw[:, None] * _whitened(g, poses(x))).reshape(-1)

    rows = np.repeat(np.arange(6 * E).reshape(E, 6, 1), 6, axis=2)    # (E, 6, 6)

    def jac(x: np.ndarray) -> csr_matrix:
        X = poses(x)
        Lt = np.swapaxes(g.L, 1, 2) * sw[:, None, None]                # whitening Lᵀ
        Ad = np.stack([_adjoint(T) for T in _inv(X[j_]) @ X[i_]])
        blocks = [(-(Lt @ Ad), i_), (Lt, j_)]
        data, r, c = [], [], []
        for blk, k in blocks:
            keep = k > 0
            cols = 6 * (k[keep] - 1)[:, None, None] + np.arange(6)[None, None, :]
            data.append(blk[keep].reshape(-1))
            r.append(rows[keep].reshape(-1))
            c.append(np.broadcast_to(cols, blk[keep].shape).reshape(-1))
        return csr_matrix((np.concatenate(data), (np.concatenate(r), np.concatenate(c))),
                          shape=(6 * E, 6 * (n - 1)))

    x = np.zeros(6 * (n - 1))
    r = least_squares(fun, x, jac=jac, method="trf", x_scale="jac", xtol=1e-10, ftol=1e-12,
                      gtol=1e-10, max_nfev=max_nfev)
    return poses(r.x)


def _tls_weights(r2: np.ndarray, mu: float, c2: float) -> np.ndarray:
    """GNC-TLS weights (Yang et al. 2020, eq. 14) at continuation parameter mu."""
    w = np.sqrt(c2 * mu * (mu + 1) / np.maximum(r2, 1e-300)) - mu
    w = np.where(r2 <= mu / (mu + 1) * c2, 1.0, w)
    return np.clip(np.where(r2 >= (mu + 1) / mu * c2, 0.0, w), 0.0, 1.0)


def _gnc_scipy(g: _Graph, X0: np.ndarray, c2: float) -> tuple[np.ndarray, np.ndarray]:
    """Graduated non-convexity with a TLS cost; SciPy's least_squares inside each round."""
    with _threads.torch_single():  # tiny batches: a thread pool only adds its wake-ups
        return _gnc_scipy_rounds(g, X0, c2)


def _gnc_scipy_rounds(g: _Graph, X0: np.ndarray, c2: float) -> tuple[np.ndarray, np.ndarray]:
    w = np.ones(g.ij.shape[0])
    X = _solve_scipy(g, X0, w)
    r2 = (_whitened(g, X) ** 2).sum(1)
    if r2.max() <= c2:
        return X, w
    mu = c2 / max(2 * r2.max() - c2, 1e-300)
    for _ in range(GNC_ROUNDS):
        w_new = _tls_weights(r2, mu, c2)
        # an approximate inner solve while mu grows (GNC needs none better), a full one
        # once the weights are binary
        X = _solve_scipy(g, X, w_new, max_nfev=5)
        r2 = (_whitened(g, X) ** 2).sum(1)
        binary = np.all((w_new < 1e-6) | (w_new > 1 - 1e-6))
        w = w_new
        if binary and np.array_equal(w > 0.5, _tls_weights(r2, mu, c2) > 0.5):
            break
        mu *= GNC_FACTOR
    return _solve_scipy(g, X, w), w


def _gnc_gtsam(g: _Graph, X0: np.ndarray, c2: float) -> tuple[np.ndarray, np.ndarray]:
    """Gtsam's GncLMOptimizer (TLS) over BetweenFactorPose3, scan 0 fixed by a prior."""
    try:
        import gtsam
    except ImportError:
        raise ImportError("solver='gtsam' needs gtsam (Python 3.11-3.13 wheels): "
                          "pip install 'pointalign[multiway]'") from None
    graph = gtsam.NonlinearFactorGraph()
    graph.add(gtsam.PriorFactorPose3(0, gtsam.Pose3(), gtsam.noiseModel.Isotropic.Sigma(6, 1e-6)))
    for e, (i, j) in enumerate(g.ij):
        omega = g.L[e] @ g.L[e].T
        graph.add(gtsam.BetweenFactorPose3(int(i), int(j), gtsam.Pose3(g.Z[e]),
                                           gtsam.noiseModel.Gaussian.Information(omega)))
    init = gtsam.Values()
    for k in range(g.n):
        init.insert(k, gtsam.Pose3(X0[k]))
    params = gtsam.GncLMParams()
    params.setLossType(gtsam.GncLossType.TLS)
    params.setKnownInliers([0])
    opt = gtsam.GncLMOptimizer(graph, init, params)
    # gtsam's threshold is on the factor error 0.5 eᵀΩe
    opt.setInlierCostThresholds(0.5 * c2)
    res = opt.optimize()
    X = np.stack([res.atPose3(k).matrix() for k in range(g.n)])
    X = _inv(X[0]) @ X   # the prior holds scan 0 to within its sigma: make it exact
    X[0] = np.eye(4)
    return X, np.asarray(opt.getWeights())[1:]


# ---------------------------------------------------------------------------- multiway

def _has_gtsam() -> bool:
    try:
        import gtsam  # noqa: F401
    except ImportError:
        return False
    return True


def _load(scans: Sequence[Any], device: torch.device | None) -> list[Any]:
    from pointalign import io

    out = []
    for k, s in enumerate(scans):
        c = io.read(s) if isinstance(s, (str, os.PathLike)) else s
        out.append(_validate.as_points(c, f"scans[{k}]", min_points=3,
                                       device=device or "cpu"))
    return out


@_validate.out_of_memory_is_clear
def multiway(
    scans: Sequence[Any],
    *,
    device: str | torch.device | None = None,
    edges: Any = "all",
    neighbours: int = 1,
    loop_closures: int = 0,
    voxel_size: float | None = None,
    solver: str = "auto",
    max_displacement: float = MAX_DISPLACEMENT,
    refine: int = 1,
    client: Any = None,
    chunk_size: int | None = None,
    progress: bool | None = None,
    **register_options: Any,
) -> MultiwayResult:
    """Register scans into the first scan's frame: pairwise edges, then a robust pose graph.

    Args:
        scans: S >= 2 clouds: ``(N_k, 3)`` arrays/tensors, PointClouds or file paths.
        device: compute device (default: CUDA when present, else the CPU).
        edges: ``"all"`` pairs, ``"neighbours"`` (each scan with the next ``neighbours``
            in the given order, the last with the first, plus ``loop_closures``), or a
            list of ``(i, j)``.
        neighbours: with ``edges="neighbours"``: how many following scans each one meets.
        loop_closures: with ``edges="neighbours"``: extra candidate pairs, the most alike
            by a rotation-invariant shape signature.
        voxel_size: the voxel edge v of every registration (default: register()'s rule on
            the largest scan); the graph's inlier bound is in units of v.
        solver: ``"gtsam"``, ``"scipy"`` or ``"auto"`` (gtsam where installed, else SciPy).
        max_displacement: GNC's inlier bound, RMS displacement in voxels.
        refine: joint refinement rounds (0: none): kept edges re-registered by ICP from
            the graph's relative poses, then the graph solved again.
        client: a ``distributed.Client``: the edges run as chunks on its workers (pass
            scans as paths so that workers read them).
        chunk_size: pairs per chunk (see :func:`register_many`).
        progress: show progress bars (None: when interactive).
        **register_options: passed to :func:`register_many` (``hypotheses``, ``seed``, …;
            register's ``refine=`` cannot be: here ``refine`` counts the rounds above, so
            the edges' final stage is register's default, point-to-plane ICP).

    Returns:
        :class:`MultiwayResult`.

    """
    t0 = time.perf_counter()
    if isinstance(scans, (str, os.PathLike)) or not isinstance(scans, Sequence) \
            or len(scans) < 2:
        raise ValueError("scans: expected a sequence of at least 2 clouds or paths")
    if solver not in SOLVERS:
        raise ValueError(f"solver: expected one of {SOLVERS}, got {solver!r}")
    neighbours = _validate.integer(neighbours, "neighbours", minimum=1)
    loop_closures = _validate.integer(loop_closures, "loop_closures", minimum=0)
    refine = _validate.integer(refine, "refine", minimum=0)
    md = _validate.positive(max_displacement, "max_displacement")
    if solver == "auto":
        solver = "gtsam" if _has_gtsam() else "scipy"
    dev = None if client is not None else _validate.as_device(device)
    clouds = _load(scans, dev)
    if voxel_size is None:
        from pointalign.features.downsample import auto_voxel_size

        big = max(clouds, key=lambda c: c.shape[0])
        voxel_size = auto_voxel_size(big, register_options.get("target_points", 5000))
    v = _validate.positive(voxel_size, "voxel_size")
    pairs_ij = candidate_edges(clouds, edges, neighbours, loop_closures)
    # the clouds travel as given: paths stay paths (read where a chunk runs)
    given = [s if isinstance(s, (str, os.PathLike)) or client is None else c
             for s, c in zip(scans, clouds, strict=True)]
    if client is None:
        given = clouds
    kw = dict(device=dev, client=client, chunk_size=chunk_size, progress=progress,
              voxel_size=v, **register_options)
    t = time.perf_counter()
    specs = [PairSpec(given[j], given[i], f"{j}->{i}") for i, j in pairs_ij]
    table = register_many(specs, **kw)
    t_reg = time.perf_counter() - t
    ij = np.array(pairs_ij, dtype=np.int64).reshape(-1, 2)
    t = time.perf_counter()
    X, w, use, r2 = _graph(table, ij, len(clouds), v, md * md, solver)
    t_graph = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(refine):
        kept = np.nonzero(use)[0][w > 0.5]
        specs = [PairSpec(given[ij[e, 1]], given[ij[e, 0]], f"{ij[e, 1]}->{ij[e, 0]}",
                          _inv(X[ij[e, 0]]) @ X[ij[e, 1]]) for e in kept]
        again = register_many(specs, **kw)
        rows = list(table.rows)
        for e, r in zip(kept, again.rows, strict=True):
            rows[e] = dict(r, index=int(e))
        table = ManyResult(rows, table.timings)
        X, w, use, r2 = _graph(table, ij, len(clouds), v, md * md, solver, X)
    t_ref = time.perf_counter() - t
    weights, resid = np.zeros(len(ij)), np.full(len(ij), np.nan)
    weights[use], resid[use] = w, np.sqrt(np.maximum(r2, 0.0))
    E = _Graph(len(clouds), ij, table.transformations,
               np.stack([np.eye(6)] * len(ij)) if len(ij) else np.zeros((0, 6, 6)))
    err = _errors(E, X)
    out_edges = []
    for e, (i, j) in enumerate(ij):
        row = table.rows[e]
        out_edges.append({"i": int(i), "j": int(j), "trusted": bool(row["trusted"]),
                          "kept": bool(weights[e] > 0.5), "weight": float(weights[e]),
                          "residual": float(resid[e]),
                          "rotation_deg": float(np.degrees(np.linalg.norm(err[e, :3]))),
                          "translation": float(np.linalg.norm(
                              (_inv(table.transformations[e]) @ _inv(X[i]) @ X[j])[:3, 3])),
                          "fitness": float(row["fitness"]), "rmse": float(row["rmse"]),
                          "verdict": row["verdict"],
                          "transformation": table.transformations[e].copy()})
    return MultiwayResult(X, out_edges, solver, v, table,
                          {"register": t_reg, "graph": t_graph, "refine": t_ref,
                           "total": time.perf_counter() - t0})


def _graph(table: ManyResult, ij: np.ndarray, n: int, v: float, c2: float, solver: str,
           X0: np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Solve the robust pose graph of the trusted edges.

    Returns the poses ``(S, 4, 4)``, GNC's weights and squared whitened residuals of the
    edges used, and the mask of those edges among all ``(E,)``.
    """
    rows = table.rows
    use = np.array([bool(r["trusted"]) and np.isfinite(r["transformation"]).all()
                    for r in rows], dtype=bool)
    Z = table.transformations
    L = np.zeros((len(rows), 6, 6))
    for e, r in enumerate(rows):
        if use[e]:
            info = r["info"]
            omega = edge_information(info["H"], info["H_center"], Z[e],
                                     float(info["correspondences"]), v)
            try:
                L[e] = np.linalg.cholesky(omega)
            except np.linalg.LinAlgError:
                use[e] = False
    overlap = np.array([float(r["overlap"]) if np.isfinite(r["overlap"]) else 0.0
                        for r in rows])
    if X0 is None:
        X0 = _spanning_poses(n, ij[use], Z[use], overlap[use])
    g = _Graph(n, ij[use], Z[use], L[use])
    X, w = (_gnc_gtsam if solver == "gtsam" else _gnc_scipy)(g, X0, c2)
    return X, w, use, (_whitened(g, X) ** 2).sum(1)


def merge(scans: Sequence[Any], poses: Any, voxel_size: float | None = None) -> PointCloud:
    """Move every scan by its pose and combine them into one cloud.

    Args:
        scans: S clouds (arrays, tensors, PointClouds or paths).
        poses: ``(S, 4, 4)`` ``T_0_k`` (e.g. :attr:`MultiwayResult.poses`).
        voxel_size: downsample the combined cloud at this edge (default: keep every point).

    Returns:
        A :class:`PointCloud` in the first scan's frame (float32 points, on the CPU).

    """
    from pointalign import io, transforms
    from pointalign.features.downsample import voxel_downsample

    P = _validate.as_transform(poses, "poses", batch=len(scans), device="cpu",
                               dtype=torch.float64)
    pts = []
    for k, s in enumerate(scans):
        c = io.read(s) if isinstance(s, (str, os.PathLike)) else s
        p = _validate.as_points(c, f"scans[{k}]", device="cpu", dtype=torch.float64)
        pts.append(transforms.apply(P[k], p))
    allp = torch.cat(pts).to(torch.float32)
    if voxel_size is not None:
        allp = voxel_downsample(allp, _validate.positive(voxel_size, "voxel_size"))
    return PointCloud(allp)
