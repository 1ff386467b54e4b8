"""register()'s first stage for one pair: each cloud downsampled, indexed and described.

:func:`prepare_cloud` downsamples one cloud at the voxel edge, builds its index and
describes it (:func:`describe_cloud`): one neighbour search (``Scales.feature_radius``,
:data:`FEATURE_NEIGHBOURS`) serves FPFH and, cut to ``Scales.normal_radius`` and
:data:`NORMAL_NEIGHBOURS`, the normals.
:func:`prepare_both` does the same for both clouds of a pair on a device as one group: the
same values (see there), fewer launches and host synchronisations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pointalign.features.downsample import CloudGroup, voxel_downsample, voxel_downsample_many
from pointalign.features.fpfh import fpfh, neighbourhoods, restrict
from pointalign.features.normals import estimate_normals
from pointalign.kernels import _loop
from pointalign.kernels.features import pca_normals
from pointalign.kernels.features.fpfh import fpfh_combine, spfh
from pointalign.kernels.knn import radius_pair, radius_pair_at_width
from pointalign.search import build_index
from pointalign.search.base import KnnResult
from pointalign.search.brute import BruteForceIndex

if TYPE_CHECKING:
    from pointalign.registration.pipeline import Scales

#: neighbours of each downsampled cloud's one search (FPFH's cap, as Open3D's tutorial) ...
FEATURE_NEIGHBOURS = 100
#: ... of which the nearest within ``Scales.normal_radius`` give the normals
NORMAL_NEIGHBOURS = 30
#: the radius table's width :func:`describe_both` searches with before reading anything:
#: register()'s feature radius (5 voxel edges) holds up to 139 points on the bunny pair's
#: downsampled clouds and 171 on the KITTI pair's (a wider neighbourhood searches again)
DESCRIBE_WIDTH = 256


class Prepared(NamedTuple):
    """One cloud ready for the global stage (:func:`prepare_cloud`), on the compute device.

    ``down``: ``(n, 3)`` float32 downsampled points (edge ``Scales.voxel``); ``index``: an
    :class:`~pointalign.search.base.Index` over them; ``normals``: ``(n, 3)`` float32 unit
    normals; ``features``: ``(n, 33)`` float32 FPFH.
    """

    down: torch.Tensor
    index: Any
    normals: torch.Tensor
    features: torch.Tensor


#: :func:`prepare_both`'s deferred check: call it once the prepared clouds have been used;
#: None where they stand, else the pair prepared again (a neighbourhood wider than the
#: radius table: the description searched anew)
Settle = Callable[[], "tuple[Prepared, Prepared] | None"]


def prepare_both(src: torch.Tensor, tgt: torch.Tensor, scales: Scales, clock: _loop.Clock,
                 describe: bool, v: float, group: CloudGroup | None = None,
                 pending: list[Settle] | None = None) -> tuple[Prepared, Prepared]:
    """:func:`prepare_cloud` of both clouds of a pair on a device, as one group.

    One downsampling sort for both (:func:`~pointalign.features.downsample.
    voxel_downsample_many`), and where both are searched by brute force (the device's index
    up to :data:`~pointalign.search.policy.AUTO_BRUTE_MAX_POINTS` points) one radius table
    for both (:func:`~pointalign.kernels.knn.radius_pair`), one SPFH and one FPFH launch:
    fewer launches and host synchronisations. The normals and features are each cloud's
    own for its points (the same arithmetic per row); the points are too, up to the float64
    rounding of a centroid that ``voxel_downsample_many`` states (below float32's: the
    tests compare every array bit for bit). ``group``: ``group_clouds([src, tgt])`` when
    the caller has it. ``pending``: where given, the description's check is not read here
    but appended to it (:data:`Settle`): the caller goes on launching work on the clouds
    while the device describes them, and settles before it trusts a result.
    """
    # the second cloud's rows of a group buffer start at an offset: its own copy, so that
    # every kernel reads it 16-byte aligned, as the cloud alone (Triton specialises pointer
    # alignment: an unaligned pointer is another compilation, at a size of its own)
    downs = voxel_downsample_many([src, tgt], scales.voxel, group)
    downs[1] = downs[1].clone()
    for down, name in zip(downs, ("source", "target"), strict=True):
        if down.shape[0] < 3:
            raise ValueError(f"voxel_size: {v or scales.voxel:g} leaves {down.shape[0]} "
                             f"{name} point(s); at least 3 are needed (a smaller voxel_size)")
    clock.lap("downsample")
    indexes = [build_index(d) for d in downs]
    clock.lap("index")
    if not describe:
        s, t = (Prepared(d, ix, d.new_zeros(0, 3), d.new_zeros(0, 33))
                for d, ix in zip(downs, indexes, strict=True))
        return s, t
    if min(d.shape[0] for d in downs) < FEATURE_NEIGHBOURS or not all(
            isinstance(ix, BruteForceIndex) for ix in indexes):  # searched cloud by cloud
        s, t = (describe_cloud(d, ix, scales, clock)
                for d, ix in zip(downs, indexes, strict=True))
        return s, t

    def prepared(normals: tuple[torch.Tensor, torch.Tensor],
                 features: tuple[torch.Tensor, torch.Tensor]) -> tuple[Prepared, Prepared]:
        return (Prepared(downs[0], indexes[0], normals[0], features[0]),
                Prepared(downs[1], indexes[1], normals[1].clone(), features[1].clone()))

    normals, features, again = describe_both(downs[0], downs[1], scales, clock,
                                             defer=pending is not None)
    if pending is not None:
        pending.append(lambda: None if (redo := again()) is None else prepared(*redo))
    return prepared(normals, features)


@dataclass(frozen=True)
class _Describe:
    """:func:`describe_both`'s work as one fixed device program (``kernels._loop.run_program``).

    Inputs ``first (n1, 3)``, ``second (n2, 3)``: the clouds. Outputs ``normals (n1 + n2,
    3)``, ``features (n1 + n2, 33)`` and ``widest (2,)``: the radius table is ``width``
    columns wide, decided before the search
    (:func:`~pointalign.kernels.knn.radius_pair_at_width`), and the rows are exact where
    each cloud's widest neighbourhood fits it (the caller checks).
    """

    feature_radius: float
    normal_radius: float
    width: int

    def __call__(self, inputs: _loop.Tensors, checkpoint: Any) -> _loop.Tensors:
        """Search both clouds, then their normals and features (no host read)."""
        first, second = inputs["first"], inputs["second"]
        cat = torch.cat([first, second])
        d2, idx, widest = radius_pair_at_width(cat, first.shape[0], self.feature_radius,
                                               FEATURE_NEIGHBOURS, self.width)
        normals, features = self.described(first, second, cat, d2, idx)
        return {"normals": normals, "features": features, "widest": widest}

    def described(self, first: torch.Tensor, second: torch.Tensor, cat: torch.Tensor,
                  d2: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the normals (each facing its cloud's centroid) and FPFH from the table.

        ``cat``: both clouds one after the other (the table's rows); each cloud is also
        read as its own tensor, 16-byte aligned (Triton compiles a kernel again for a
        pointer of another alignment).
        """
        n1 = first.shape[0]
        table = restrict(KnnResult(d2, idx), self.normal_radius, NORMAL_NEIGHBOURS)
        normals = torch.cat([pca_normals(cat, rows, d.mean(0), centers=d) for d, rows in
                             ((first, table[:n1]), (second, table[n1:]))])
        return normals, fpfh_combine(spfh(cat, normals, idx), idx, d2)


Pair = tuple[torch.Tensor, torch.Tensor]


def describe_both(first: torch.Tensor, second: torch.Tensor, scales: Scales,
                  clock: _loop.Clock, defer: bool = False
                  ) -> tuple[Pair, Pair, Callable[[], tuple[Pair, Pair] | None]]:
    """:func:`describe_cloud` of two clouds of at least :data:`FEATURE_NEIGHBOURS` points.

    Each cloud ``(n, 3)`` searched within itself by brute force (one radius table for both);
    the normals (each cloud facing its own centroid) and FPFH of the concatenation, read
    through its shifted neighbour indices. One fixed program (:class:`_Describe`: a CUDA
    graph from a size's second call) whose table is :data:`DESCRIBE_WIDTH` wide; one host
    read after it, and where a neighbourhood did not fit, the search again
    (:func:`~pointalign.kernels.knn.radius_pair`, which widens its table). Returns
    ``(normals, normals), (features, features)``: ``(n, 3)`` and ``(n, 33)`` per cloud, as
    each alone, and ``again()``: None, or where a neighbourhood did not fit the table, the
    description searched anew. ``defer``: the table's read waits for ``again()`` (the
    caller's to make before it trusts the description); else it is made here, and the
    description returned is the exact one.
    """
    n1 = first.shape[0]
    program = _Describe(scales.feature_radius, scales.normal_radius, DESCRIBE_WIDTH)
    n = n1 + second.shape[0]
    _, out = _loop.run_program(program, {"first": first, "second": second},
                               pairs=float(n) * n, host_outputs=False, eager_first=True)

    def split(normals: torch.Tensor, features: torch.Tensor) -> tuple[Pair, Pair]:
        return (normals[:n1], normals[n1:]), (features[:n1], features[n1:])

    def again() -> tuple[Pair, Pair] | None:
        if max(out["widest"].tolist()) <= DESCRIBE_WIDTH:  # the one host read
            return None
        cat = torch.cat([first, second])
        d2, idx = radius_pair(cat, n1, scales.feature_radius, FEATURE_NEIGHBOURS)
        return split(*program.described(first, second, cat, d2, idx))

    described = split(out["normals"], out["features"])
    if not defer:  # the exact description now; nothing left to check
        described, again = again() or described, lambda: None
    clock.lap("describe")
    return (*described, again)


def prepare_cloud(cloud: torch.Tensor, scales: Scales, clock: _loop.Clock, name: str,
                  describe: bool = True, v: float | None = None) -> Prepared:
    """Downsample ``cloud (N, 3)``, index it, and describe it: normals and FPFH.

    One neighbour search (``Scales.feature_radius``, :data:`FEATURE_NEIGHBOURS`) serves
    FPFH and, cut to ``Scales.normal_radius`` and :data:`NORMAL_NEIGHBOURS`, the normals
    (facing the cloud's centroid). ``name`` and ``v`` (the edge in metres, default
    ``Scales.voxel``): for the error when the voxel leaves < 3 points. ``describe=False``
    (a pair given a start needs no features): downsampled and indexed only, ``normals``
    and ``features`` empty.
    """
    down = voxel_downsample(cloud, scales.voxel)
    if down.shape[0] < 3:
        raise ValueError(f"voxel_size: {v or scales.voxel:g} leaves {down.shape[0]} {name} "
                         "point(s); at least 3 are needed (a smaller voxel_size)")
    clock.lap("downsample")
    index = build_index(down)
    clock.lap("index")
    if not describe:
        return Prepared(down, index, down.new_zeros(0, 3), down.new_zeros(0, 33))
    return describe_cloud(down, index, scales, clock)


def describe_cloud(down: torch.Tensor, index: Any, scales: Scales, clock: _loop.Clock) -> Prepared:
    """Describe one downsampled cloud ``down (n, 3)`` searched by ``index``: normals, FPFH."""
    nb = neighbourhoods(down, scales.feature_radius, min(FEATURE_NEIGHBOURS, down.shape[0]),
                        index)
    normals = estimate_normals(down, neighbors=restrict(nb, scales.normal_radius,
                                                        NORMAL_NEIGHBOURS),
                               orient="viewpoint", viewpoint=down.mean(0))
    features = fpfh(down, radius=scales.feature_radius, normals=normals, neighbors=nb)
    clock.lap("describe")
    return Prepared(down, index, normals, features)


__all__ = ["DESCRIBE_WIDTH", "FEATURE_NEIGHBOURS", "NORMAL_NEIGHBOURS", "Prepared",
           "describe_both", "describe_cloud", "prepare_both", "prepare_cloud"]
