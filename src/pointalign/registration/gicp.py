"""Generalized ICP (plane-to-plane) and voxelized GICP, batched, on the shared executor.

Every point carries a covariance, estimated from its k nearest neighbours and regularised
to a plane (:func:`pointalign.features.covariances.estimate_covariances`): ``C = I − (1 −
ε) n nᵀ``. Each iteration (:class:`GicpStep`) moves the source by the current estimate
``T = [R, t]``, pairs every source point x_i with a target point y_j and minimises the
plane-to-plane (Mahalanobis) cost by one Gauss-Newton step (Segal, Haehnel & Thrun,
"Generalized-ICP", RSS 2009)::

    Σ w_i rᵢᵀ Mᵢ rᵢ,   rᵢ = x_i − y_j,   Mᵢ = (Cᵗ_j + R Cˢ_i Rᵀ)⁻¹,

linearised in the twist ξ of the update ``exp(ξ) T``; the 6×6 normal equations are
reduced in one fused pass (:func:`pointalign.kernels.gicp.gicp_update`) and solved in
float64 by the point-to-plane solve of ICP (least-norm on a rank-deficient system).

* :func:`gicp`: the partner of x_i is its nearest target point within
  ``max_correspondence_distance`` (an Index over the target, built once and reused, as in
  :func:`~pointalign.registration.icp.icp`).
* :func:`vgicp`: the target's points and covariances are aggregated per voxel once (mean
  and mean covariance: a Gaussian per voxel, Koide et al., "Voxelized GICP for fast and
  accurate 3D point cloud registration", ICRA 2021); x_i is paired with the occupied
  voxel around it whose mean is nearest (among its own cell, or the 7 / 27 cells around
  it, as small_gicp's voxel search): no nearest-neighbour search per iteration.

Weights w come from the robust kernel, read at ``ρ = sqrt(2ε · rᵀ M r)`` (≈ the
point-to-plane distance, so ``k`` is in metres). The stopping rules, the information matrix
``info["H"]``, the stability verdict and the result are ICP's
(:mod:`pointalign.registration.icp`, :mod:`pointalign.registration._edge`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from pointalign import _threads, _validate, estimate
from pointalign.kernels import _first_use, _loop
from pointalign.kernels import gicp as _kg
from pointalign.kernels import ransac as _kr
from pointalign.registration import _edge, anderson, checks
from pointalign.registration.criteria import (
    ConvergenceCriteria,
    RobustKernel,
    as_criteria,
    as_robust_kernel,
)
from pointalign.registration.icp import (
    IcpStep,
    _indexes,
    _Rules,
    information_matrix,
    run_rules,
)
from pointalign.registration.result import RegistrationResult
from pointalign.registration.stability import stability
from pointalign.search import policy

#: neighbours per covariance when none are given (small_gicp's and Open3D's examples)
COVARIANCE_K = 20


@dataclass(frozen=True)
class GicpStep(IcpStep):
    """One GICP iteration for B problems in lockstep (the correspondence search of ICP).

    Inputs: ``source (B, N, 3)``, ``source_cov (B, N, 3, 3)``, ``target (B, M, 3)``,
    ``target_cov (B, M, 3, 3)``, ``lengths (B,)``, ``center (B, 3)``. State: ``T (B, 4, 4)``
    float64, ``Tf`` (float32) and, for indexes that read it, ``hint (B, N)``. Record: the
    ``(B, 30)`` sums at T, the update ``D``, ``T' = D T`` and ``flags (B, 2)``.
    """

    def __call__(self, inputs: _loop.Tensors, state: _loop.Tensors):
        """Run one iteration: search, fused Mahalanobis sums and solve."""
        T, Tf = state["T"], state["Tf"]
        tree = self._host_tree()
        fused = None if tree is None or "hint" not in state else _kg.gicp_step_cpu(
            inputs["source"], inputs["source_cov"], inputs["target"], inputs["target_cov"],
            tree, state["hint"], self.max_distance, transform=T, transform_f32=Tf,
            lengths=inputs["lengths"], center=inputs["center"], kernel=self.kernel,
            scale=self.scale, eps=estimate.DEGENERACY_EPS)
        if fused is not None:  # the CPU's one pass: the bits of the three below
            sums, D, T_new, Tf_new, flags, idx = fused
            return ({"T": T_new, "Tf": Tf_new, "hint": idx},
                    {"sums": sums, "update": D, "T": T_new, "flags": flags})
        x = _kr.transform_points(Tf, inputs["source"])
        with _validate.trusted():
            idx = self._search(x, state.get("hint"))
        sums, D, T_new, Tf_new, flags = _kg.gicp_update(
            x, inputs["source_cov"], inputs["target"], inputs["target_cov"], idx,
            transform=T, lengths=inputs["lengths"], center=inputs["center"],
            kernel=self.kernel, scale=self.scale, eps=estimate.DEGENERACY_EPS)
        new = {"T": T_new, "Tf": Tf_new} | ({"hint": idx} if "hint" in state else {})
        return new, {"sums": sums, "update": D, "T": T_new, "flags": flags}

    def _host_tree(self) -> Any:
        """Return the one index's host k-d tree where the "cpu" backend searches it, or None.

        With one, on CPU tensors, the move, the search and the sums run as one numba pass
        (:func:`pointalign.kernels.gicp.gicp_step_cpu`).
        """
        ix = self.indexes[0]
        if any(other is not ix for other in self.indexes):
            return None
        return getattr(ix, "host_tree", None)


@dataclass(frozen=True)
class VgicpStep:
    """One VGICP iteration: the nearest voxel around each moved source point, sums, solve.

    Inputs: ``source``, ``source_cov``, ``lengths``, ``center`` as :class:`GicpStep`, and
    the voxel map (:class:`pointalign.kernels.gicp.VoxelMap`) as ``keys (B, V)``,
    ``means (B, V, 3)``, ``voxel_cov (B, V, 3, 3)``, ``counts (B, V)``. State and record as
    :class:`GicpStep` (no hint).
    """

    graph_safe: ClassVar[bool] = True
    voxel_size: float
    neighborhood: int
    kernel: str
    scale: float

    def __call__(self, inputs: _loop.Tensors, state: _loop.Tensors):
        """Run one iteration: voxel look-up, fused Mahalanobis sums and solve."""
        T, Tf = state["T"], state["Tf"]
        vmap = _kg.VoxelMap(inputs["keys"], inputs["means"], inputs["voxel_cov"],
                            inputs["counts"], self.voxel_size)
        sums, D, T_new, Tf_new, flags = _kg.vgicp_update(
            inputs["source"], inputs["source_cov"], vmap, self.neighborhood, transform=T,
            transform_f32=Tf, lengths=inputs["lengths"], center=inputs["center"],
            kernel=self.kernel, scale=self.scale, eps=estimate.DEGENERACY_EPS)
        return {"T": T_new, "Tf": Tf_new}, {"sums": sums, "update": D, "T": T_new,
                                            "flags": flags}


# ---- covariances: given, kept with a PointCloud, or estimated ----------------------------

def _given_covariances(arg: Any, cloud: Any, name: str, pts: torch.Tensor,
                       counts: np.ndarray) -> torch.Tensor | None:
    """``(B, N, 3, 3)`` float32 covariances from ``arg`` or a PointCloud (or list), else None."""
    B, N = pts.shape[:2]
    if arg is None:
        kept = _kept_covariances(cloud)
        if kept is None:
            return None
        if len(kept) == 1:
            arg = kept[0]
        else:  # a list of PointClouds: pad each to N rows
            arg = torch.eye(3, dtype=torch.float32, device=pts.device).repeat(B, N, 1, 1)
            for b, c in enumerate(kept):
                arg[b, : c.shape[0]] = c.to(pts.device, torch.float32)
    t = _validate._to_tensor(name, arg)
    if t.dim() == 3:
        t = t.unsqueeze(0)
    if t.dim() != 4 or t.shape[1:] != (N, 3, 3) or t.shape[0] not in (1, B):
        want = f"({int(counts[0])}, 3, 3)" if B == 1 else f"({B}, {N}, 3, 3)"
        raise ValueError(f"{name}: expected shape {want} (like {name.split('_')[0]}), got "
                         f"{tuple(t.shape)}")
    t = _validate._float(name, t, torch.float32).to(pts.device)
    _validate._check_finite(name, t.reshape(-1, 9))
    return t.expand(B, N, 3, 3).contiguous()


def _kept_covariances(cloud: Any) -> list[torch.Tensor] | None:
    """Return the covariances kept with ``cloud`` (a PointCloud or a list), one per cloud.

    None unless every cloud is a PointCloud that keeps its covariances.
    """
    clouds = cloud if isinstance(cloud, (list, tuple)) else [cloud]
    kept = [getattr(c, "covariances", None) if hasattr(c, "points") else None for c in clouds]
    tensors = [c for c in kept if isinstance(c, torch.Tensor)]
    return tensors if tensors and len(tensors) == len(kept) else None


def _covariances_missing(arg: Any, cloud: Any) -> bool:
    """Tell whether a cloud's covariances will be estimated: neither given nor kept."""
    return arg is None and _kept_covariances(cloud) is None


def _estimated(pts: torch.Tensor, counts: np.ndarray, k: int, name: str, shared: bool,
               indexes: tuple = ()) -> torch.Tensor:
    """``(B, N, 3, 3)`` covariances of each cloud's first ``counts[b]`` points (k-NN).

    A correspondence index in ``indexes`` is searched where it serves a k-NN self-query
    over those points (:func:`~pointalign.registration._edge.knn_index`: a device k-d tree
    needs no second build, 3.2 ms at 25k points and 9.7 ms at 1M on an H200, and is asked
    in its own order: ``benchmarks/results/kdtree-cuda.json``; brute force is not, an N × M
    self-query: 15.3 ms against 4.6 ms for the tree built here at 15.8k points, H200).
    """
    from pointalign.features.covariances import estimate_covariances

    B, N = pts.shape[:2]
    out = None
    for b in range(1 if shared else B):
        m = int(counts[b])
        if m < k:
            raise ValueError(f"{name}{'' if B == 1 else f'[{b}]'}: {m} points, fewer than "
                             f"k = {k} neighbours per covariance; pass a smaller k or "
                             f"{name}_covariances")
        with _validate.trusted():
            c = estimate_covariances(pts[b, :m], k, index=_edge.knn_index(indexes, b,
                                                                          pts[b, :m]),
                                     device=pts.device).to(torch.float32)
        if B == 1 and m == N:  # one full cloud: no padding to fill
            return c[None]
        if out is None:
            out = torch.eye(3, dtype=torch.float32, device=pts.device).repeat(B, N, 1, 1)
        out[b, :m] = c
    assert out is not None
    return out[:1].expand_as(out).contiguous() if shared else out


def _source_covariances(pair: _edge.Pair, source: Any, given: Any, k: int) -> torch.Tensor:
    """Source covariances ``(B, N, 3, 3)``: given, kept with the cloud, or estimated."""
    sc = _given_covariances(given, source, "source_covariances", pair.source,
                            pair.source_counts)
    return _estimated(pair.source, pair.source_counts, k, "source", False) if sc is None \
        else sc


def _source_side(pair: _edge.Pair, source: Any, given: Any, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the source ``(B, N, 3)`` and its covariances, in the order to query them.

    One full cloud is sent in a spatially coherent order: the order of the k-d tree its
    covariances were estimated in, where the kernel layer's self-query keeps it
    (:func:`pointalign.kernels.gicp.knn_covariances_ordered`: no scatter back, no second
    sort), else :func:`~pointalign.search.policy.query_order`'s; several clouds as given.
    """
    src = pair.source
    one = pair.size == 1 and pair.source_counts[0] == src.shape[1]
    if one and _covariances_missing(given, source) and src.shape[1] >= k:
        got = _kg.knn_covariances_ordered(src[0], k)
        if got is not None:
            return src[:, got[1]], got[0][None]
    cov = _source_covariances(pair, source, given, k)
    if one:
        order = policy.query_order(src[0])  # a spatially coherent order, or None
        if order is not None:
            src, cov = src[:, order], cov[:, order]
    return src, cov


def _target_covariances(pair: _edge.Pair, target: Any, given: Any, k: int,
                        indexes: tuple = ()) -> torch.Tensor:
    """Target covariances ``(B, M, 3, 3)``: given, kept, or estimated (``indexes`` searched)."""
    tc = _given_covariances(given, target, "target_covariances", pair.target,
                            pair.target_counts)
    return _estimated(pair.target, pair.target_counts, k, "target", pair.shared_target,
                      indexes) if tc is None else tc


def _both_covariances(beside: _loop.Beside, source_side: Any, pair: _edge.Pair,
                      target: Any, given: Any, k: int, indexes: tuple = ()
                      ) -> tuple[Any, torch.Tensor]:
    """Return ``(source_side, target covariances)``: the target's here, the source's joined.

    The source's side (:func:`_source_side`) ran ``beside``
    (:class:`~pointalign.kernels._loop.Beside`); as one stage, whose time ends when both
    are ready.
    """
    tc = _target_covariances(pair, target, given, k, indexes)
    return beside.join(source_side), tc


def _announce(pair: _edge.Pair, method: str, cap: int, source: Any, target: Any,
              source_covariances: Any, target_covariances: Any) -> None:
    """Announce a long CPU call (:func:`pointalign.registration.checks.announce_gicp`)."""
    def estimated(given: Any, cloud: Any, counts: np.ndarray) -> int:
        return int(counts.sum()) if _covariances_missing(given, cloud) else 0

    m = pair.target_counts[:1] if pair.shared_target else pair.target_counts
    checks.announce_gicp(pair, method, cap,
                         estimated(source_covariances, source, pair.source_counts)
                         + estimated(target_covariances, target, m))


def _check_k(k: Any) -> int:
    return _validate.integer(k, "k", minimum=3)


@dataclass
class _Levels:
    """The runs of one or more levels (VGICP's coarse-to-fine voxel sizes), added up."""

    pair: _edge.Pair
    crit: ConvergenceCriteria
    T: np.ndarray | None = None         # (B, 4, 4) the estimate so far (local frames);
    #                                     None: the pair's init, read at the first run
    rules: _Rules | None = None         # the last level's rules
    iterations: np.ndarray | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    launched: int = 0
    graph: str = "off"

    def run(self, step: Any, inputs: _loop.Tensors, state: _loop.Tensors,
            meanwhile: Any = None, **extra: Any) -> None:
        """Iterate ``step`` from the current estimate under ICP's stopping rules.

        The first steps are enqueued before the host reads the pair's host part and makes
        the rules; ``meanwhile()``, when given, runs then too (checks that may raise).
        """
        t_it = time.perf_counter()
        rules, run = run_rules(step, inputs, state, self.crit, self.pair, self.T, meanwhile)
        first = len(self.history)
        self.history += [{**h, "iteration": first + h["iteration"], **extra}
                         for h in rules.history]
        self.timings["iterate"] = self.timings.get("iterate", 0.0) + time.perf_counter() - t_it
        for key, v in run.timings.items():
            self.timings[key] = self.timings.get(key, 0.0) + v
        self.iterations = rules.iterations if self.iterations is None \
            else self.iterations + rules.iterations
        self.rules, self.T, self.launched, self.graph = rules, rules.T, \
            self.launched + run.launched, run.graph

    def result(self, clock: _loop.Clock, t_start: float,
               info: dict[str, Any]) -> RegistrationResult:
        """ICP's result: timings, ``H``, the stability verdict (from the final 6×6)."""
        rules, pair = self.rules, self.pair
        assert rules is not None and self.iterations is not None
        timings = dict(clock.timings, **self.timings)
        timings["total"] = time.perf_counter() - t_start
        info = {"H": information_matrix(rules.sums, True, pair.frame.center),
                "per_iteration_s": timings["iterate"] / max(1, len(self.history)), **info,
                "rank_deficient": rules.rank_deficient, "device_steps": self.launched,
                "cuda_graph": self.graph}
        stab = stability(pair, (), rules.T, rules.sums, True, 0.0)
        return _edge.build_result(pair, rules.T, fitness=rules.fitness, rmse=rules.rmse,
                                  iterations=self.iterations, reasons=rules.reasons,
                                  history=self.history, timings=timings, info=info,
                                  stability=stab)


def _voxel_sizes(voxel_size: Any) -> tuple[float, ...]:
    """``voxel_size`` as a non-empty tuple of positive floats (one number: one level)."""
    if isinstance(voxel_size, (list, tuple)):
        if not voxel_size:
            raise ValueError("voxel_size: expected a number or a non-empty sequence, got []")
        return tuple(_validate.positive(v, f"voxel_size[{i}]") for i, v in enumerate(voxel_size))
    return (_validate.positive(voxel_size, "voxel_size"),)


@_first_use.first_use("gicp")
@_threads.per_call
@_validate.out_of_memory_is_clear
def gicp(
    source: Any,
    target: Any,
    *,
    init: Any = None,
    max_correspondence_distance: float,
    criteria: ConvergenceCriteria | None = None,
    max_iterations: int | None = None,
    robust_kernel: RobustKernel | str | tuple[str, float] | None = None,
    device: str | torch.device | None = None,
    index: Any = None,
    k: int = COVARIANCE_K,
    source_covariances: Any = None,
    target_covariances: Any = None,
    source_lengths: Any = None,
    target_lengths: Any = None,
    acceleration: bool = False,
) -> RegistrationResult:
    """Register ``source`` to ``target`` by generalized ICP; returns ``T_target_source``.

    Gauss-Newton on the plane-to-plane cost ``Σ w rᵀ (Cᵗ + R Cˢ Rᵀ)⁻¹ r`` over the pairs
    of each source point and its nearest target point within
    ``max_correspondence_distance`` (Segal et al. 2009; see the module docstring). Points
    without a partner are left out. Stops as :func:`~pointalign.registration.icp.icp`
    (``stop_reason``): "max_iterations", "relative_change", "small_update",
    "no_correspondences" (not converged), "degenerate"; a converged stop on data that do
    not determine the pose becomes "ambiguous" (``info["stability"]``).

    Covariances: ``source_covariances`` / ``target_covariances`` when given, else a
    PointCloud's :attr:`~pointalign.cloud.PointCloud.covariances`, else estimated here from
    the ``k`` nearest neighbours of each point
    (:func:`~pointalign.features.covariances.estimate_covariances`; keep them with the
    cloud to reuse them across calls).

    Batches: ``source (B, N, 3)`` with ``source_lengths (B,)`` and ``target (B, M, 3)`` with
    ``target_lengths (B,)`` (or one shared ``(M, 3)`` target) run B independent problems in
    lockstep through the same kernels, each stopping on its own.

    Args:
        source: ``(N, 3)`` or ``(B, N, 3)`` points (NumPy, tensor or PointCloud), metres.
        target: ``(M, 3)`` or ``(B, M, 3)`` points.
        init: initial ``T_target_source`` ``(4, 4)`` or ``(B, 4, 4)`` (default identity).
        max_correspondence_distance: largest source-target distance of a pair (> 0).
        criteria: :class:`ConvergenceCriteria` (default ``ConvergenceCriteria()``).
        max_iterations: shortcut for ``criteria=ConvergenceCriteria(max_iterations=n)``;
            not both.
        robust_kernel: :class:`RobustKernel` on ``ρ = sqrt(2ε rᵀ M r)`` (≈ the
            point-to-plane distance, metres), a kind (``"huber"``) or a pair
            ``("huber", k)``; default none.
        device: compute device; default: the tensors' device, else cuda when available.
        index: an Index over the target (or a list of B of them) from
            :func:`pointalign.search.build_index`, reused across calls; default: chosen by
            :func:`pointalign.search.policy.choose_index`.
        k: neighbours per estimated covariance (>= 3); every cloud whose covariances are
            estimated needs at least k points.
        source_covariances: ``(N, 3, 3)`` / ``(B, N, 3, 3)`` source covariances (in the
            source's frame), e.g. from ``estimate_covariances``.
        target_covariances: ``(M, 3, 3)`` / ``(B, M, 3, 3)`` target covariances.
        source_lengths: ``(B,)`` valid source points per padded batch entry.
        target_lengths: ``(B,)`` valid target points per padded batch entry.
        acceleration: Anderson acceleration of the iteration, as :func:`icp`'s (its
            safeguard on the truncated point-to-point energy); off by default: it saved
            iterations only on the 1M-point pair (77 -> 19) and cost time on KITTI and
            the bunny (BENCHMARKS.md).
        num_threads: CPU threads for this call (:func:`pointalign.threads`); None: the
            process setting.

    Returns:
        :class:`RegistrationResult`: ``fitness`` (fraction of source points with a partner),
        ``rmse`` (RMS distance of the pairs), ``history``, ``timings`` (seconds: index,
        covariances, iterate, total, …) and ``info``: ``H`` (the final 6×6 Gauss-Newton
        information ``Σ w Jᵀ M J``, twist (ω, v) about the target origin),
        ``rank_deficient``, ``index``, ``stability``, ``device_steps``, ``cuda_graph``.

    """
    t_start = time.perf_counter()
    max_dist = _validate.positive(max_correspondence_distance, "max_correspondence_distance")
    rk = as_robust_kernel(robust_kernel)
    crit = as_criteria(criteria, max_iterations)
    accelerate = _validate.flag(acceleration, "acceleration")
    k = _check_k(k)
    dev = _edge.resolve_device(device, source=source, target=target,
                               source_covariances=source_covariances,
                               target_covariances=target_covariances)
    pair, units = checks.prepared_pair(source, target, init, dev, source_lengths,
                                       target_lengths, max_correspondence_distance=max_dist)
    _announce(pair, "GICP", int(crit.max_iterations), source, target, source_covariances,
              target_covariances)
    B = pair.size
    clock = _loop.Clock(dev)
    # the source's covariances (a k-d tree build and a self-query on a GPU) and its query
    # order run beside the target's index and covariances, whose k-NN can search that index
    # (KITTI full x0.92-0.94 in one process on an H200); "covariances" is charged until both
    # are ready
    beside = _loop.Beside(dev)
    side = clock.stage("covariances", beside, _source_side, pair, source, source_covariances,
                       k)
    idxs = clock.stage("index", _indexes, pair, index, max_dist,
                       _covariances_missing(target_covariances, target))
    (src, s_cov), t_cov = clock.stage("covariances", _both_covariances, beside, side, pair,
                                      target, target_covariances, k, idxs)
    inputs = {"source": src, "source_cov": s_cov, "target": pair.target, "target_cov": t_cov,
              "lengths": pair.source_lengths, "center": torch.zeros(B, 3, device=dev)}
    T0 = pair.init_on_device()  # no wait for the device
    state = {"T": T0, "Tf": T0.to(torch.float32)}
    if any(ix.uses_hint for ix in idxs):
        state["hint"] = torch.full(pair.source.shape[:2], -1, dtype=torch.int64, device=dev)
    levels = _Levels(pair, crit)
    step: Any = GicpStep(idxs, max_dist, True, rk.kind, float(rk.k))
    if accelerate:
        step, inputs, state = anderson.accelerated(step, inputs, state, pair, max_dist)
    levels.run(step, inputs, state, meanwhile=units)
    info = {"method": "gicp", "index": type(getattr(idxs[0], "index", idxs[0])).__name__}
    return levels.result(clock, t_start, info)


@_first_use.first_use("vgicp")
@_threads.per_call
@_validate.out_of_memory_is_clear
def vgicp(
    source: Any,
    target: Any,
    *,
    voxel_size: float | Sequence[float],
    init: Any = None,
    neighborhood: int = 1,
    criteria: ConvergenceCriteria | None = None,
    max_iterations: int | None = None,
    robust_kernel: RobustKernel | str | tuple[str, float] | None = None,
    device: str | torch.device | None = None,
    k: int = COVARIANCE_K,
    source_covariances: Any = None,
    target_covariances: Any = None,
    source_lengths: Any = None,
    target_lengths: Any = None,
) -> RegistrationResult:
    """Register ``source`` to ``target`` by voxelized GICP; returns ``T_target_source``.

    The target's points and covariances are aggregated once per voxel of edge
    ``voxel_size`` (mean and mean covariance, Koide et al. 2021); each iteration pairs every
    moved source point with the occupied voxel around it whose mean is nearest (among
    ``neighborhood`` cells) and takes the Gauss-Newton step
    of :func:`gicp`'s cost with the voxel Gaussians in place of target points: no
    nearest-neighbour search per iteration. Stops, covariances, batches and the result as
    :func:`gicp`; ``fitness`` is the fraction of source points with an occupied voxel
    around them and ``rmse`` the RMS distance to those voxels' means.

    Args:
        source: ``(N, 3)`` or ``(B, N, 3)`` points (NumPy, tensor or PointCloud), metres.
        target: ``(M, 3)`` or ``(B, M, 3)`` points.
        voxel_size: voxel edge (> 0, metres), a few times the point spacing (small_gicp's
            examples: 1 m on driving scans); or a sequence of edges, coarse to fine, run
            one after the other (each level starts from the last one's estimate): a
            coarse level widens the basin of convergence (voxels much smaller than the
            initial misalignment see little of it), the fine one sets the accuracy.
        init: initial ``T_target_source`` ``(4, 4)`` or ``(B, 4, 4)`` (default identity).
        neighborhood: the cells searched for each source point's voxel: 1 (its own), 7 (and
            the six face neighbours) or 27 (small_gicp's DIRECT1 / DIRECT7 / DIRECT27); the
            occupied one with the nearest mean is its partner.
        criteria: :class:`ConvergenceCriteria` (default ``ConvergenceCriteria()``).
        max_iterations: shortcut for ``criteria=ConvergenceCriteria(max_iterations=n)``;
            not both.
        robust_kernel: :class:`RobustKernel`, a kind or a pair, as in :func:`gicp`.
        device: compute device; default: the tensors' device, else cuda when available.
        k: neighbours per estimated covariance (>= 3).
        source_covariances: ``(N, 3, 3)`` / ``(B, N, 3, 3)`` source covariances.
        target_covariances: ``(M, 3, 3)`` / ``(B, M, 3, 3)`` target point covariances
            (aggregated per voxel here).
        source_lengths: ``(B,)`` valid source points per padded batch entry.
        target_lengths: ``(B,)`` valid target points per padded batch entry.
        num_threads: CPU threads for this call (:func:`pointalign.threads`).

    Returns:
        :class:`RegistrationResult` as :func:`gicp`, from the last level (``iterations``
        and ``history`` over all levels, each record with its ``voxel_size``);
        ``info["voxels"]`` holds the occupied voxels per problem and level,
        ``timings["voxelize"]`` the maps' builds.

    """
    t_start = time.perf_counter()
    sizes = _voxel_sizes(voxel_size)
    _validate.choice(neighborhood, "neighborhood", _kg.NEIGHBORHOODS)
    rk = as_robust_kernel(robust_kernel)
    crit = as_criteria(criteria, max_iterations)
    k = _check_k(k)
    dev = _edge.resolve_device(device, source=source, target=target,
                               source_covariances=source_covariances,
                               target_covariances=target_covariances)
    pair = _edge.prepare_pair(source, target, init=init, device=dev,
                              source_lengths=source_lengths, target_lengths=target_lengths)
    checks.check_units(pair, voxel_size=sizes)
    _announce(pair, "VGICP", int(crit.max_iterations), source, target, source_covariances,
              target_covariances)
    B = pair.size
    clock = _loop.Clock(dev)
    # one after the other: on a second stream (as gicp's) they measured no faster (x0.99 to
    # x1.05 on the KITTI pair, H200): with no index to build, the host bounds this stage
    s_cov = clock.stage("covariances", _source_covariances, pair, source, source_covariances,
                        k)
    t_cov = clock.stage("covariances", _target_covariances, pair, target, target_covariances,
                        k)
    n_t = 1 if pair.shared_target else B
    inputs = {"source": pair.source, "source_cov": s_cov, "lengths": pair.source_lengths,
              "center": torch.zeros(B, 3, device=dev)}
    levels = _Levels(pair, crit, pair.init)
    voxels = []
    for vs in sizes:
        vmap = clock.stage("voxelize", _kg.voxelize, pair.target[:n_t],
                           pair.target_lengths[:n_t], t_cov[:n_t], vs,
                           counts=pair.target_counts[:n_t])
        voxels.append((vmap.counts > 0).sum(1).cpu().numpy().repeat(B // n_t))
        keys, means, covs, counts = (t.expand(B, *t.shape[1:]).contiguous()
                                     for t in (vmap.keys, vmap.means, vmap.covariances,
                                               vmap.counts))
        T0 = torch.from_numpy(levels.T).to(dev)
        levels.run(VgicpStep(vs, int(neighborhood), rk.kind, float(rk.k)),
                   inputs | {"keys": keys, "means": means, "voxel_cov": covs,
                             "counts": counts},
                   {"T": T0, "Tf": T0.to(torch.float32)}, voxel_size=vs)
    info = {"method": "vgicp", "index": "VoxelMap", "voxels": np.stack(voxels, 1),
            "voxel_size": sizes, "neighborhood": int(neighborhood)}
    return levels.result(clock, t_start, info)
