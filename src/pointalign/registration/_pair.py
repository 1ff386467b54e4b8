"""The validated problem every registration algorithm starts from: a pair in its local frame.

* :func:`prepare_pair`: source and target as padded float32 batches **in a local frame**:
  both are shifted by the target's centroid in float64 before anything becomes float32, so
  georeferenced coordinates (UTM: ~5·10⁵ m) keep their millimetres. :class:`Frame` carries
  that shift; :meth:`Frame.to_world` composes a local estimate back in float64. The
  :class:`Pair`'s host part (:class:`HostPart`: the frame, extents) comes from the device in
  one transfer, which a caller may leave in flight while it enqueues device work.
* :func:`prepare_pairs`: the same for many single-cloud problems at once.

Re-exported by :mod:`pointalign.registration._edge`, where the algorithms reach them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from pointalign import _validate
from pointalign.kernels import upload
from pointalign.kernels._loop import current_stream
from pointalign.kernels.frame import local_frame


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
        identity_init: no ``init`` was given (the identity, in every local frame too).
        init_device: ``(B, 4, 4)`` float64, the initial estimate in the local frames on the
            device, where it was given there (no host read before the device starts), or
            None.
        center_device: ``(B, 3)`` float64, the frames' centres (:attr:`frame`) on the
            device (None in host memory).

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
    identity_init: bool = False
    init_device: torch.Tensor | None = dataclasses.field(default=None, repr=False,
                                                         compare=False)
    center_device: torch.Tensor | None = dataclasses.field(default=None, repr=False,
                                                           compare=False)

    def init_on_device(self) -> torch.Tensor:
        """``(B, 4, 4)`` float64 :attr:`init` on the device.

        With no ``init`` given it is the identity in every frame (a shift and its inverse):
        made on the device, without reading the host part; an ``init`` given on the device
        was moved to the local frames there (:attr:`init` is that tensor's copy); else
        uploaded from the host part.
        """
        if self.identity_init:
            return torch.eye(4, dtype=torch.float64, device=self.device).repeat(self.size, 1, 1)
        if self.init_device is not None:
            return self.init_device
        return upload(self.init, dtype=torch.float64, device=self.device)

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
    T0d, T0 = _init_on_device(init, B, batched, device), None
    if T0d is None:
        T0t = _validate.as_transform(init, "init", batch=B if batched else None,
                                     device="cpu", dtype=torch.float64)
        T0 = (T0t if batched else T0t[None]).detach().numpy()
    # lengths on the host: known without a transfer unless the caller passed them
    s_counts = (slens.cpu().numpy() if source_lengths is not None
                or isinstance(source, (list, tuple)) else np.full(B, src.shape[1]))
    t_counts = (tlens.cpu().numpy() if target_lengths is not None
                or isinstance(target, (list, tuple)) else np.full(tgt.shape[0], tgt.shape[1]))
    # the local frame: shift by the target centroid in float64 before going to float32;
    # the centroids and the extents (RMS distances from them, the source's for the units
    # check) come back in one transfer (kernels.frame: two launches on a GPU)
    src_l, tgt_l, host_row = local_frame(src, slens, s_counts, tgt, tlens, t_counts,
                                         local=local)
    if shared:
        tgt_l, tlens, t_counts = tgt_l.expand(B, -1, -1), tlens.expand(B), \
            np.repeat(t_counts, B)
    center, T_local = host_row[:, :3], None
    row = host_row
    if T0d is not None:  # one transfer: the frame, and the init as given and as moved
        T_local = recentre(T0d, center, center)
        row = torch.cat([host_row, T0d.reshape(B, 16), T_local.reshape(B, 16)], 1)
    pending = _to_host_later(row)
    eps = max(torch.finfo(src.dtype).eps, torch.finfo(tgt.dtype).eps)

    def read_host() -> HostPart:
        host = pending().astype(np.float64)
        init_world, init_local = T0, None
        if T_local is not None:  # the device's init, checked now (its error first, as ever)
            init_world, init_local = (host[:, 8:24].reshape(B, 4, 4),
                                      host[:, 24:].reshape(B, 4, 4))
            _validate.as_transform(torch.from_numpy(init_world), "init", batch=B)
            host = host[:, :8]
        if not np.isfinite(host).all():  # the scans raise the caller's error (not if trusted)
            scans()
        frame = Frame(host[:, :3].copy())
        # the coordinates' spacing as given: epsilon x magnitude (the centroid's plus 3 RMS
        # radii)
        world = np.abs(host[:, :3] + host[:, 4:7]).max(1) + 3 * host[:, 3]
        assert init_world is not None  # (given on the host, or read from the device)
        return HostPart(frame.to_local(init_world) if init_local is None else init_local,
                        frame, init_world, host[:, 3].copy(), host[:, 4:7].copy(),
                        eps * world, host[:, 7].copy())

    return Pair(src_l, tgt_l, slens, tlens, np.asarray(s_counts, dtype=np.int64),
                np.asarray(t_counts, dtype=np.int64), batched, shared, device, read_host,
                identity_init=init is None, init_device=T_local,
                center_device=center if device.type == "cuda" else None)


def _init_on_device(init: Any, B: int, batched: bool, device: torch.device
                    ) -> torch.Tensor | None:
    """``(B, 4, 4)`` float64 ``init`` left on ``device``, where a GPU tensor was given there.

    Its checks (finite, rigid: :func:`pointalign._validate.as_transform`) wait for the host
    part, so that the device starts without a host read; None where ``init`` is anything
    else (checked on the host at once, with the errors of a wrong shape or dtype).
    """
    if (device.type != "cuda" or not isinstance(init, torch.Tensor) or not init.is_cuda
            or not init.is_floating_point() or init.shape[-2:] != (4, 4)
            or init.device.index != (device.index if device.index is not None
                                     else torch.cuda.current_device())):
        return None
    if init.dim() == 2:
        return init.detach().to(torch.float64).expand(B, 4, 4)
    if init.dim() == 3 and batched and init.shape[0] == B:
        return init.detach().to(torch.float64)
    return None


def recentre(T: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Return ``Tr(−b) T Tr(a)`` of rigid motions ``T (B, 4, 4)``, on their device.

    The motion between clouds shifted by ``−a`` and ``−b (B, 3)``; with ``a = b`` the
    centre, :meth:`Frame.to_local`.
    """
    out = T.clone()
    out[:, :3, 3] += (T[:, :3, :3] @ a[..., None])[..., 0] - b
    return out


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
    done.record(current_stream(t.device))

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
    :func:`pointalign.kernels.frame.local_frame`'s spec takes it (on the CPU the same
    reduction as ``prepare_pair``: the same bits; on a GPU ``prepare_pair``'s kernels group
    the sums differently, equal to float64 rounding), and all clouds are
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
        # the float64 centroid of each target (a mean over its own rows: local_frame's spec),
        # then every row of every cloud shifted by its problem's centroid
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
