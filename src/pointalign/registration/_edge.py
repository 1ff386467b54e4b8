"""The edge every registration algorithm shares: devices, inputs, frames, stop reasons, results.

* :func:`resolve_device`: the one rule for ``device=`` (explicit, else the inputs' common
  device, else CUDA when present); inputs on different devices are an error.
* :func:`prepare_pair`: source and target as padded float32 batches **in a local frame**:
  both are shifted by the target's centroid in float64 before anything becomes float32, so
  georeferenced coordinates (UTM: ~5·10⁵ m) keep their millimetres. :class:`Frame` carries
  that shift; :meth:`Frame.to_world` composes a local estimate back in float64.
* :class:`StopReason`: why an algorithm stopped, one vocabulary for all of them.
* :func:`build_result`: a :class:`RegistrationResult` from per-problem host arrays, batched
  or squeezed to one problem.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from pointalign import _math, _validate
from pointalign.kernels import upload
from pointalign.registration.result import RegistrationResult
from pointalign.search import policy


class StopReason(str, enum.Enum):
    """Why an algorithm stopped (or why its result is trusted); equal to its string value.

    Converged (``result.converged`` is True):

    * ``SMALL_UPDATE``: the last update rotated by less than ``rotation_tolerance`` and
      moved by less than ``translation_tolerance``;
    * ``RELATIVE_CHANGE``: fitness and RMSE stopped changing (Open3D's rule);
    * ``SCHEDULE``: an annealing schedule reached its end (EM-ICP's σ_min, Softassign's β)
      with the pose settled (its last check moved it by a small fraction of the final
      scale; else ``STALLED``);
    * ``POSE_AND_WEIGHTS``: an annealing method's pose and soft weights settled early;
    * ``NO_DECREASE``: no step along the last update lowers the objective any more (a
      descent method's line search found none while the refused step was small, or
      approximate ICP's step raised it and was taken back): a numerical minimum.

    Not converged:

    * ``MAX_ITERATIONS``: the iteration cap was reached first;
    * ``NO_CORRESPONDENCES``: no source point had a partner within the distance bound;
    * ``DEGENERATE``: the problem does not determine a pose (collinear points, too few
      correspondences, a rank-deficient system);
    * ``AMBIGUOUS``: the iteration settled, but the data do not determine the pose there:
      the final correspondences let the source slide along the target without changing
      any residual (a plane moved in-plane, a sphere or cylinder turned, fewer than 6
      correspondences); :func:`pointalign._math.stability` ≤ ``STABILITY_EPS``
      (``info["stability"]``), decided once at the end by :func:`build_result`;
    * ``STALLED``: the iteration stopped without settling: ``surface_newton``'s line search
      found no step while the refused Newton step still asked for a large motion (the
      distance map is poor at this pose: ``STALL`` in
      :mod:`pointalign.registration.surface.newton`), or an annealing schedule ended while
      its last check still moved the pose by more than ``SETTLED`` of the final scale
      (:mod:`pointalign.registration.soft`);
    * ``LOW_FITNESS``: the iteration settled, but fewer than :data:`MIN_FITNESS` (1 %) of
      the source points have a partner: a handful of chance matches (a distance given in
      other units than the clouds, no overlap) decide nothing, whatever the stop rule said;
      decided once at the end by :func:`build_result`;
    * ``COARSE_INPUT``: the iteration settled, but the coordinates came rounded by more than
      :data:`MAX_RESOLUTION` of the target's extent (float32 far from the origin: at 10⁵ m
      a float32 coordinate's spacing is ~8 mm), so the pose is only as good as that
      rounding (``info["input_resolution"]``); pass float64 coordinates;
    * ``NO_HYPOTHESIS`` / ``BELOW_THRESHOLD``: a global method found no (good enough)
      hypothesis; ``TOO_FEW_CORRESPONDENCES``: fewer than three feature correspondences to
      draw hypotheses from.

    A sampling method (RANSAC) has no convergence of its own, only a confidence:

    * ``CONFIDENCE``: enough hypotheses were drawn to find an all-inlier sample with the
      asked probability (converged);
    * ``INLIER_RATIO``: the best hypothesis reached the asked inlier ratio (converged);
    * ``MAX_HYPOTHESES``: the hypothesis budget ran out first; RANSAC still returns its best
      hypothesis as its answer (``converged`` True unless a threshold was asked and missed,
      which is ``BELOW_THRESHOLD``), so its caller passes ``converged`` to
      :func:`build_result` rather than reading it from this reason.

    Where a verdict on the result decides (``register``), the reason is the verdict's:

    * ``TRUSTED``: every test passed (converged);
    * ``SMALL_OVERLAP``, ``WEAK_MARGIN``, ``NOT_CONCENTRATED``
      (``"residuals_not_concentrated"``): the first test that failed (not converged; a
      pose the data do not determine is ``AMBIGUOUS``, as above).
    """

    SMALL_UPDATE = "small_update"
    RELATIVE_CHANGE = "relative_change"
    SCHEDULE = "schedule"
    POSE_AND_WEIGHTS = "pose_and_weights"
    NO_DECREASE = "no_decrease"
    MAX_ITERATIONS = "max_iterations"
    NO_CORRESPONDENCES = "no_correspondences"
    DEGENERATE = "degenerate"
    AMBIGUOUS = "ambiguous"
    LOW_FITNESS = "low_fitness"
    STALLED = "stalled"
    COARSE_INPUT = "coarse_input"
    NO_HYPOTHESIS = "no_hypothesis"
    BELOW_THRESHOLD = "below_threshold"
    TOO_FEW_CORRESPONDENCES = "too_few_correspondences"
    CONFIDENCE = "confidence"
    INLIER_RATIO = "inlier_ratio"
    MAX_HYPOTHESES = "max_hypotheses"
    TRUSTED = "trusted"
    SMALL_OVERLAP = "small_overlap"
    WEAK_MARGIN = "weak_margin"
    NOT_CONCENTRATED = "residuals_not_concentrated"

    def __str__(self) -> str:
        return self.value

    @property
    def converged(self) -> bool:
        """True for the reasons that mean the algorithm converged."""
        return self in _CONVERGED


_CONVERGED = frozenset({StopReason.SMALL_UPDATE, StopReason.RELATIVE_CHANGE,
                        StopReason.SCHEDULE, StopReason.POSE_AND_WEIGHTS,
                        StopReason.NO_DECREASE, StopReason.CONFIDENCE,
                        StopReason.INLIER_RATIO, StopReason.TRUSTED})


#: the one rule for ``device=`` (defined in :mod:`pointalign._validate`, where the features
#: and search modules reach it too): explicit, else the inputs' common device, else CUDA
#: when present; inputs on different devices are a ValueError naming each
resolve_device = _validate.resolve_device


@dataclass(frozen=True)
class Frame:
    """The local frame of a batch of problems: ``x_local = x_world − center``.

    ``center (B, 3)`` float64 on the host (the target's centroid).
    """

    center: np.ndarray

    def _shift(self, sign: float) -> np.ndarray:
        S = np.tile(np.eye(4), (self.center.shape[0], 1, 1))
        S[:, :3, 3] = sign * self.center
        return S

    def to_local(self, T: np.ndarray) -> np.ndarray:
        """``T_target_source (B, 4, 4)`` between world frames → between local frames."""
        return self._shift(-1.0) @ T @ self._shift(1.0)

    def to_world(self, T: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`to_local`, in float64."""
        return self._shift(1.0) @ T @ self._shift(-1.0)


@dataclass(frozen=True)
class HostPart:
    """What a :class:`Pair` knows on the host, read from the device once (see its fields)."""

    init: np.ndarray
    frame: Frame
    init_world: np.ndarray
    extent: np.ndarray
    centroid: np.ndarray
    resolution: np.ndarray
    source_extent: np.ndarray


@dataclass(frozen=True)
class Pair:
    """Validated inputs of a batch of B problems, in their local :class:`Frame`.

    Attributes:
        source: ``(B, N, 3)`` float32, padded; rows ``>= source_lengths[b]`` are padding.
        target: ``(B, M, 3)`` float32 (expanded, not copied, for a shared target).
        source_lengths, target_lengths: ``(B,)`` int64 on the device.
        source_counts, target_counts: the same on the host (NumPy int64).
        batched: whether the caller passed batches (results keep that form).
        shared_target: one target for all B sources.
        device: the compute device.

    and on the host (:class:`HostPart`, read from the device at the first use of one of
    them, or at :meth:`resolve`):

        init: ``(B, 4, 4)`` float64 NumPy, the initial estimate in the local frames.
        frame: the shift back to the caller's coordinates.
        init_world: ``(B, 4, 4)`` float64 NumPy, the initial estimate as given (a problem
            left at ``init`` is returned as exactly this, see :func:`build_result`).
        extent: ``(B,)`` float64 NumPy, each target's RMS distance from its centroid
            (metres): the scale that relative tolerances and the stability rule read.
        centroid: ``(B, 3)`` float64 NumPy, each target's centroid in the local frame (0
            unless ``local=False``).
        resolution: ``(B,)`` float64 NumPy, about the spacing of the coordinates as given
            (their dtype's epsilon times their magnitude): what float32 input far from the
            origin has already lost.
        source_extent: ``(B,)`` float64 NumPy, each source's RMS distance from its own
            centroid (the scale :func:`check_units` compares with ``extent``).

    """

    source: torch.Tensor
    target: torch.Tensor
    source_lengths: torch.Tensor
    target_lengths: torch.Tensor
    source_counts: np.ndarray
    target_counts: np.ndarray
    batched: bool
    shared_target: bool
    device: torch.device
    read_host: Callable[[], HostPart] = dataclasses.field(repr=False, compare=False)

    @functools.cached_property
    def host(self) -> HostPart:
        """The host part (the first use waits for its transfer; a NaN/Inf input raises)."""
        return self.read_host()

    def resolve(self) -> Pair:
        """Read the host part now (a NaN/Inf input raises here); return self."""
        _ = self.host
        return self

    @property
    def init(self) -> np.ndarray:
        """``(B, 4, 4)`` float64, the initial estimate in the local frames."""
        return self.host.init

    @property
    def frame(self) -> Frame:
        """The shift back to the caller's coordinates."""
        return self.host.frame

    @property
    def init_world(self) -> np.ndarray:
        """``(B, 4, 4)`` float64, the initial estimate as given."""
        return self.host.init_world

    @property
    def extent(self) -> np.ndarray:
        """``(B,)`` float64, each target's RMS distance from its centroid (metres)."""
        return self.host.extent

    @property
    def centroid(self) -> np.ndarray:
        """``(B, 3)`` float64, each target's centroid in the local frame."""
        return self.host.centroid

    @property
    def resolution(self) -> np.ndarray:
        """``(B,)`` float64, about the spacing of the coordinates as given."""
        return self.host.resolution

    @property
    def source_extent(self) -> np.ndarray:
        """``(B,)`` float64, each source's RMS distance from its own centroid."""
        return self.host.source_extent

    @property
    def size(self) -> int:
        """B, the number of problems."""
        return self.source.shape[0]


def _centroids(pts: torch.Tensor, lengths: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
    """``(B, 3)`` centroids in the points' dtype (padding rows excluded)."""
    if bool((counts == pts.shape[1]).all()):
        return pts.mean(1)
    rows = torch.arange(pts.shape[1], device=pts.device)[None, :, None] < lengths[:, None, None]
    return (pts * rows).sum(1) / lengths[:, None].clamp_min(1).to(pts.dtype)


#: the smallest fitness (fraction of source points with a partner) a converged result may
#: have: below it the pose rests on a few chance matches (1 %: 400 of the bunny's 40k
#: points; partial overlaps of real scans at their usual distances keep 10 % or more)
MIN_FITNESS = 0.01

#: the coarsest input spacing, as a fraction of the target's RMS radius, at which a settled
#: iteration still counts as converged (the bunny in float32 at 10⁴ m: 0.02, poses within
#: 3·10⁻⁴ of the extent; at 10⁵ m: 0.2, poses ~10 % off)
MAX_RESOLUTION = 0.05


def prepare_pair(source: Any, target: Any, *, init: Any, device: torch.device,
                 source_lengths: Any = None, target_lengths: Any = None,
                 min_points: int = 1, local: bool = True, defer: bool = False) -> Pair:
    """Validate a registration problem (or a batch of them) and move it to its local frame.

    Args:
        source: ``(N, 3)``, ``(B, N, 3)`` or a list of clouds (arrays, tensors, PointClouds).
        target: ``(M, 3)`` (shared by every source) or ``(B, M, 3)``.
        init: ``(4, 4)`` or ``(B, 4, 4)`` initial ``T_target_source`` (None: identity).
        device: the compute device (:func:`resolve_device`).
        source_lengths: ``(B,)`` valid source points per padded batch entry.
        target_lengths: ``(B,)`` valid target points per padded batch entry.
        min_points: fewest points a cloud may have.
        local: shift to the target's centroid (False: keep the caller's coordinates, e.g.
            to query an index the caller built over the target as given).
        defer: leave the host part (:class:`HostPart`: centroids, extents, the frame) in
            flight, read at its first use: a caller may enqueue device work on the
            device part first. A NaN/Inf input then raises at that first use.

    """
    def scans() -> None:  # each cloud's own checks, NaN/Inf included: the first error raises
        for name, x, lengths in (("source", source, source_lengths),
                                 ("target", target, target_lengths)):
            _validate.as_batch(x, name, lengths=lengths, min_points=min_points, device=device)

    try:
        pair = _pair_on_device(source, target, init, device, source_lengths, target_lengths,
                               min_points, local, scans)
    except (ValueError, TypeError):
        scans()  # a NaN/Inf input's error first, as when the scans ran first
        raise
    return pair if defer else pair.resolve()


def _pair_on_device(source: Any, target: Any, init: Any, device: torch.device,
                    source_lengths: Any, target_lengths: Any, min_points: int, local: bool,
                    scans: Callable[[], None]) -> Pair:
    """:func:`prepare_pair`'s work, its host part left in flight (``scans``: the checks)."""
    # NaN/Inf: told by the centroids and extents read at the end (a non-finite point makes
    # them non-finite), then the clouds' own scans name it: no wait for the device here
    with _validate.trusted():
        src, slens, batched = _validate.as_batch(source, "source", lengths=source_lengths,
                                                 min_points=min_points, device=device)
        tgt, tlens, tbatched = _validate.as_batch(target, "target", lengths=target_lengths,
                                                  min_points=min_points, device=device)
    B = src.shape[0]
    if tbatched and not batched:
        raise ValueError("target: batched (B, M, 3) but source is a single (N, 3) cloud")
    shared = not tbatched and B > 1
    if tgt.shape[0] != B and not shared:
        raise ValueError(f"target: expected {B} clouds (like source) or one, got {tgt.shape[0]}")
    T0t = _validate.as_transform(init, "init", batch=B if batched else None, device="cpu",
                                 dtype=torch.float64)
    T0 = (T0t if batched else T0t[None]).detach().numpy()
    # lengths on the host: known without a transfer unless the caller passed them
    s_counts = (slens.cpu().numpy() if source_lengths is not None
                or isinstance(source, (list, tuple)) else np.full(B, src.shape[1]))
    t_counts = (tlens.cpu().numpy() if target_lengths is not None
                or isinstance(target, (list, tuple)) else np.full(tgt.shape[0], tgt.shape[1]))
    # the local frame: shift by the target centroid in float64 before going to float32
    t64 = tgt.to(torch.float64)
    c = _centroids(t64, tlens, t_counts)                              # (B_t, 3)
    # the extent (RMS distance from the centroid) comes back with the centroid: one transfer
    d2 = ((t64 - c[:, None]) ** 2).sum(-1, keepdim=True)
    rms = _centroids(d2.expand(-1, -1, 3), tlens, t_counts)[:, :1].sqrt()
    c_true = c
    if not local:
        c = torch.zeros_like(c)
    # the source's extent the same way, for the units check (check_units): the float64
    # source is made here anyway, and its two reductions cost ~1 % of one ICP iteration
    s64 = src.to(torch.float64)
    s_d2 = ((s64 - _centroids(s64, slens, s_counts)[:, None]) ** 2).sum(-1, keepdim=True)
    s_rms = _centroids(s_d2.expand(-1, -1, 3), slens, s_counts)[:, :1].sqrt()
    src_l = (s64 - (c if not shared else c.expand(B, 3))[:, None]).to(torch.float32) \
        .contiguous()
    tgt_l = (t64 - c[:, None]).to(torch.float32).contiguous()
    t_host = torch.cat([c, rms, c_true - c], 1)
    if shared:
        tgt_l, tlens, t_counts = tgt_l.expand(B, -1, -1), tlens.expand(B), \
            np.repeat(t_counts, B)
        t_host = t_host.expand(B, -1)
    pending = _to_host_later(torch.cat([t_host, s_rms], 1))  # one transfer
    eps = max(torch.finfo(src.dtype).eps, torch.finfo(tgt.dtype).eps)

    def read_host() -> HostPart:
        host = pending().astype(np.float64)
        if not np.isfinite(host).all():  # the scans raise the caller's error (not if trusted)
            scans()
        frame = Frame(host[:, :3].copy())
        # the coordinates' spacing as given: epsilon x magnitude (the centroid's plus 3 RMS
        # radii)
        world = np.abs(host[:, :3] + host[:, 4:7]).max(1) + 3 * host[:, 3]
        return HostPart(frame.to_local(T0), frame, T0, host[:, 3].copy(), host[:, 4:7].copy(),
                        eps * world, host[:, 7].copy())

    return Pair(src_l, tgt_l, slens, tlens, np.asarray(s_counts, dtype=np.int64),
                np.asarray(t_counts, dtype=np.int64), batched, shared, device, read_host)


def _to_host_later(t: torch.Tensor) -> Callable[[], np.ndarray]:
    """Start copying ``t`` to the host; the returned call waits for the copy alone.

    On CUDA a copy into pinned memory behind an event on the current stream: work the
    caller enqueues after it does not delay the read. Elsewhere the copy is made at once.
    """
    if not t.is_cuda:
        out = t.cpu().numpy()
        return lambda: out
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    buf.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))

    def read() -> np.ndarray:
        done.synchronize()
        return buf.numpy()

    return read


class LocalPair(NamedTuple):
    """One problem of :func:`prepare_pairs`: one source, one target, in the target's frame.

    What :func:`prepare_pair` makes of one ``(N, 3)`` source and one ``(M, 3)`` target,
    unbatched: ``source``, ``target`` are ``pair.source[0]``, ``pair.target[0]``;
    ``center`` is ``pair.frame.center[0]``; ``init`` is ``pair.init[0]``.
    """

    source: torch.Tensor   # (N, 3) float32, local frame
    target: torch.Tensor   # (M, 3) float32, local frame
    center: np.ndarray     # (3,) float64, the target's centroid (the caller's coordinates)
    init: np.ndarray       # (4, 4) float64, the initial estimate in the local frame


#: the error of a source or target given as a batch where one cloud each is expected
ONE_CLOUD_EACH = "source, target: expected one (N, 3) cloud each, got a batch"


def prepare_pairs(sources: Sequence[Any], targets: Sequence[Any], inits: Sequence[Any], *,
                  device: torch.device, min_points: int = 1
                  ) -> list[LocalPair | ValueError | TypeError]:
    """:func:`prepare_pair` of many single-cloud problems at once: the same numbers and errors.

    Problem i is ``prepare_pair(sources[i], targets[i], init=inits[i], device=device,
    min_points=min_points)`` of one ``(N, 3)`` source and one ``(M, 3)`` target (a batch
    given there: the ValueError :data:`ONE_CLOUD_EACH`); each gets its
    :class:`LocalPair` or the error ``prepare_pair`` raises for it. The clouds of all
    problems are checked by :func:`pointalign._validate.as_points_many` (one copy to the
    device, one NaN/Inf scan for all), each target's centroid is its own float64 mean, as
    ``prepare_pair`` takes it (the same reduction: the same bits), and all clouds are
    shifted and rounded to float32 by one element-wise pass; one transfer brings the
    centroids to the host. A problem whose clouds do not pass the checks one by one (a
    wrong shape, a list of clouds, a batch) goes through :func:`prepare_pair` itself, so
    its error (or its batch) is the one it gives. The inputs are not modified.
    """
    n = len(sources)
    if len(targets) != n or len(inits) != n:
        raise ValueError(f"targets, inits: expected {n} of each (one per source), got "
                         f"{len(targets)} and {len(inits)}")
    out: list[LocalPair | ValueError | TypeError | None] = [None] * n
    fast = [i for i in range(n)
            if not isinstance(sources[i], (list, tuple))
            and not isinstance(targets[i], (list, tuple))]
    many = _validate.as_points_many([x for i in fast for x in (sources[i], targets[i])],
                                    ["source", "target"] * len(fast),
                                    min_points=min_points, device=device,
                                    cat_dtype=torch.float64)
    alone = sorted(set(range(n)) - set(fast))   # checked by prepare_pair, one by one
    good: list[tuple[int, torch.Tensor, torch.Tensor, np.ndarray | None]] = []
    for j, i in enumerate(fast):
        s, t = many.clouds[2 * j], many.clouds[2 * j + 1]
        # prepare_pair checks the source (its shape, then NaN/Inf), then the target
        if not many.shaped[2 * j] or (not isinstance(s, Exception)
                                      and not many.shaped[2 * j + 1]):
            alone.append(i)
            continue
        if not isinstance(s, torch.Tensor):
            out[i] = s
            continue
        if not isinstance(t, torch.Tensor):
            out[i] = t
            continue
        try:
            T0 = None if inits[i] is None else _validate.as_transform(
                inits[i], "init", batch=None, device="cpu", dtype=torch.float64
            ).detach().numpy()
        except (ValueError, TypeError) as exc:
            out[i] = exc
            continue
        good.append((i, s, t, T0))
    if good:
        # prepare_pair's float64 centroid of each target (a mean over its own rows: the
        # same reduction), then every row of every cloud shifted by its problem's centroid
        # and rounded to float32, in one pass
        c = torch.stack([t.mean(0) for _, _, t, _ in good])                 # (G, 3)
        sizes = [int(x.shape[0]) for _, s, t, _ in good for x in (s, t)]
        both = (many.points if sum(sizes) == many.points.shape[0]
                else torch.cat([x for _, s, t, _ in good for x in (s, t)]))
        rows = torch.repeat_interleave(
            torch.arange(len(good), device=c.device).repeat_interleave(2),
            upload(sizes, dtype=torch.int64, device=c.device), output_size=sum(sizes))
        parts = torch.split((both - c[rows]).to(torch.float32), sizes)
        centers = c.cpu().numpy()                                           # one transfer
        for g, (i, _, _, T0) in enumerate(good):
            center = centers[g].copy()
            init = np.eye(4) if T0 is None else Frame(center[None]).to_local(T0[None])[0]
            out[i] = LocalPair(parts[2 * g], parts[2 * g + 1], center, init)
    for i in sorted(alone):
        try:
            pair = prepare_pair(sources[i], targets[i], init=inits[i], device=device,
                                min_points=min_points)
        except (ValueError, TypeError) as exc:
            out[i] = exc
            continue
        out[i] = ValueError(ONE_CLOUD_EACH) if pair.batched else LocalPair(
            pair.source[0], pair.target[0], pair.frame.center[0].copy(), pair.init[0])
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


#: the normals a cloud carries (a PointCloud's, an Open3D cloud's): defined in
#: :mod:`pointalign._validate`, where the features reach it too
cloud_normals = _validate.cloud_normals


def target_normals(target: Any, normals: Any, pair: Pair) -> torch.Tensor | None:
    """Return unit normals ``(B, M, 3)`` float32 from ``normals`` or the target cloud, else None.

    ``normals``: the caller's ``(M, 3)`` / ``(B, M, 3)`` array; None: the normals the target
    carries (:func:`cloud_normals`: a PointCloud's or an Open3D cloud's), else None.
    """
    if normals is None:
        normals = cloud_normals(target)
    if normals is None:
        return None
    t = _validate._to_tensor("target_normals", normals)
    shape = tuple(pair.target.shape)
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if tuple(t.shape) != shape and not (t.shape[0] == 1 and tuple(t.shape[1:]) == shape[1:]):
        raise ValueError(f"target_normals: expected shape {shape[1:]} or {shape} (like "
                         f"target), got {tuple(t.shape)}")
    t = _validate._float("target_normals", t, torch.float32).to(pair.device)
    _validate._check_finite("target_normals", t)
    return t.expand(*shape).contiguous()


def knn_index(idxs: Sequence[Any], b: int, points: torch.Tensor) -> Any:
    """Return problem ``b``'s correspondence index where a k-NN self-query can search it.

    ``points (m, 3)``: the points of that self-query (normals, covariances); None where the
    index cannot serve it. A tree over exactly these points answers the exact k-NN, the
    neighbours of a tree built for them (a host tree keeps the self-query as its shortcut
    lists, a device tree saves a second build); not a voxel grid (cells sized for the
    correspondence bound) nor brute force (N × M, where the caller's own search is faster).
    A caller's index (a :class:`~pointalign.search.shifted.ShiftedIndex`: over the target
    as given, trusted to hold it, as the registration trusts it for its correspondences)
    is searched through its shift.
    """
    from pointalign.search.brute import BruteForceIndex
    from pointalign.search.grid import VoxelGridIndex
    from pointalign.search.shifted import ShiftedIndex

    top = idxs[b] if b < len(idxs) else None
    ix = getattr(top, "index", top)  # behind tiers, or the caller's behind its shift
    p = getattr(ix, "points", None)
    if ix is None or isinstance(ix, (VoxelGridIndex, BruteForceIndex)) \
            or not isinstance(p, torch.Tensor) or p.shape != points.shape \
            or p.device != points.device:
        return None
    if isinstance(top, ShiftedIndex):
        return top
    return ix if p is points or torch.equal(p, points) else None


# ---- estimates of long work (announced before it starts: _progress.announce) -------------

def measured_stability(pair: Pair, T_local: np.ndarray, *, index: Any = None,
                       max_distance: float | None = None) -> np.ndarray:
    """:func:`pointalign._math.stability` of each final pose, measured on the data: ``(B,)``.

    For the methods whose own iteration holds no 6×6 information (EM-ICP, Softassign, the
    surface methods): the point-to-plane information of a sample of each problem's final
    nearest-neighbour correspondences (ICP's point-to-point test,
    :func:`pointalign.registration.stability.stability`), so that a pose the data do not
    determine (a sphere turned about its centre, three points, a plane slid in-plane) is
    "ambiguous" whichever method found it. A few thousand queries and one small PCA pass.

    Args:
        pair: the prepared problem(s).
        T_local: ``(B, 4, 4)`` float64 final poses in the local frames.
        index: an Index over the target the method already holds (e.g. the surface methods'
            k-d tree, in ``pair.target``'s coordinates), or one per problem; the search
            policy decides whether it is queried (:func:`pointalign.search.policy.probe_index`).
        max_distance: correspondences farther apart are not counted (None or inf: every
            nearest neighbour counts).

    """
    from pointalign.registration import stability as _stability  # (it imports this module)

    assert pair.extent is not None
    scale = float(np.max(pair.extent)) + float(np.max(pair.source_extent
                                                       if pair.source_extent is not None
                                                       else pair.extent))
    d = max_distance if max_distance is not None and np.isfinite(max_distance) \
        and max_distance > 0 else 1e6 * max(scale, 1e-30)
    n = 1 if pair.shared_target else pair.size
    own = list(index) if isinstance(index, (list, tuple)) else [index] * n
    with _validate.trusted():  # the prepared targets were checked
        built = [policy.probe_index(pair.target[b, : pair.target_counts[b]],
                                    _stability.STABILITY_SAMPLE, index=own[b]) for b in range(n)]
    idxs = tuple(built * pair.size if n == 1 else built)
    # (point-to-point: the sums of a final step are not read, the sample is measured)
    return _stability.stability(pair, idxs, np.asarray(T_local, dtype=np.float64),
                                np.zeros((pair.size, 30)), False, d)


def build_result(pair: Pair, T_local: np.ndarray, *, fitness: np.ndarray, rmse: np.ndarray,
                 iterations: np.ndarray, reasons: Sequence[StopReason | str],
                 history: list[dict[str, Any]], timings: dict[str, float],
                 info: dict[str, Any], converged: np.ndarray | None = None,
                 stability: np.ndarray | None = None) -> RegistrationResult:
    """Build the :class:`RegistrationResult` of B problems, squeezed for unbatched input.

    The one result builder: every public registration function (icp, the soft and surface
    methods, ransac, register) returns what this builds, so the rules below hold for all.

    Args:
        pair: the prepared inputs.
        T_local: ``(B, 4, 4)`` float64 estimates in the local frames.
        fitness: ``(B,)`` host array.
        rmse: ``(B,)`` host array.
        iterations: ``(B,)`` host array.
        reasons: B stop reasons: :class:`StopReason` members, or the caller's own words
            where something else decides (``register``'s verdict), then with ``converged``.
        history: one dict per iteration of ``(B,)`` arrays (or scalars).
        timings: seconds per stage.
        info: extras; ``(B, …)`` arrays are split per problem when squeezing.
        converged: ``(B,)`` bools, the caller's decision; defaults to ``reason.converged``
            of each reason.
        stability: ``(B,)`` :func:`pointalign._math.stability` of each final pose (None:
            not measured).

    **The rules**, applied to every problem still converged (by its reason or by
    ``converged``): a fitness below :data:`MIN_FITNESS` is too few partners to decide
    anything: reason ``LOW_FITNESS``, not converged; at a stability ≤
    :data:`pointalign._math.STABILITY_EPS` the data do not
    determine the pose: reason ``AMBIGUOUS``, not converged (``info["stability"]`` records
    the values); on input coarser than :data:`MAX_RESOLUTION` of the extent the pose is only
    as good as that rounding: reason ``COARSE_INPUT``, not converged
    (``info["input_resolution"]``).

    """
    reasons = list(reasons)
    conv = (np.array([bool(getattr(r, "converged", False)) for r in reasons])
            if converged is None else np.array(converged, dtype=bool).reshape(len(reasons)))
    fit = np.asarray(fitness, dtype=np.float64).reshape(len(reasons))
    for b in np.nonzero(conv & ~(fit >= MIN_FITNESS))[0]:
        reasons[b], conv[b] = StopReason.LOW_FITNESS, False
    if pair.resolution is not None and pair.extent is not None:
        # (a target of no extent is left to the degeneracy and stability rules)
        coarse = (pair.extent > 0) & (pair.resolution > MAX_RESOLUTION * pair.extent)
        if coarse.any():
            for b in np.nonzero(coarse & conv)[0]:
                reasons[b], conv[b] = StopReason.COARSE_INPUT, False
            info = {**info, "input_resolution": pair.resolution}
    if stability is not None:
        stab = np.asarray(stability, dtype=np.float64)
        for b in np.nonzero(conv & ~(stab > _math.STABILITY_EPS))[0]:
            reasons[b], conv[b] = StopReason.AMBIGUOUS, False
        info = {**info, "stability": stab}
    T = pair.frame.to_world(T_local)
    if pair.init_world is not None:  # left at init: exactly init (no float64 round trip)
        kept = (T_local == pair.init).all(axis=(1, 2))
        T = np.where(kept[:, None, None], pair.init_world, T)
    result = RegistrationResult(
        transformation=T, fitness=fitness, rmse=rmse, iterations=iterations, converged=conv,
        stop_reason=[str(r) for r in reasons], history=history, timings=timings, info=info,
        transformation_tensor=upload(T, dtype=torch.float64, device=pair.device))
    return result if pair.batched else result[0]


def in_world(result: RegistrationResult, frame: Frame) -> RegistrationResult:
    """Return an unbatched ``result`` solved in the local ``frame`` in the caller's coordinates.

    The transformation (and its tensor, and a nested ``info["global"]`` result) are composed
    back in float64: ``T_world = Tr(c) T_local Tr(−c)`` (:meth:`Frame.to_world`). For a
    result an algorithm returned to a composite one (``register``'s global stage) that
    builds its own result with :func:`build_result` on its own :class:`Pair`.
    """
    T = frame.to_world(np.asarray(result.transformation, dtype=np.float64)[None])[0]
    tt = result.transformation_tensor
    info = dict(result.info)
    if isinstance(info.get("global"), RegistrationResult):
        info["global"] = in_world(info["global"], frame)
    return dataclasses.replace(
        result, transformation=T, info=info,
        transformation_tensor=None if tt is None else
        upload(T, dtype=torch.float64, device=tt.device))
