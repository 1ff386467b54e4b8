"""The voxel edge v of register()'s pairs and their stray points: one rule, two paths.

:func:`~pointalign.registration.pipeline.register` (one pair) and
:func:`~pointalign.registration.many.register_many` (a group of pairs) choose v and decide
about stray points by the same functions:

1. :func:`voxel_sizes`: v from each pair's larger cloud
   (:func:`~pointalign.features.downsample.auto_voxel_size`); the stray fractions of both
   clouds at v (:func:`~pointalign.features.outliers.stray_fraction`); where a pair shows
   strays (at least :data:`~pointalign.features.outliers.MIN_STRAY_FRACTION` in either
   cloud) and v is automatic, v again without them
   (:func:`~pointalign.features.outliers.robust_voxel_size`);
2. :func:`without_strays`: the dense points of each pair that shows strays.

Two paths give the same answers. In host memory (the search plan's host tree) each cloud is
answered alone by its own SciPy tree (:func:`voxel_size_per_cloud`,
:func:`without_strays_per_cloud`), which beats a sort and compare on the CPU (the bunny
pair's rule on one core: 14 against 70 ms), and a caller's index over the target is
reused. On a device the whole group is answered at once, the edges' rounds and the stray
counts at the edges as one device program read once (:func:`_edges_and_strays`, over
:func:`~pointalign.features.downsample.edge_search` and
:func:`~pointalign.features.outliers.stray_counts`; no index built); the tests hold that
path to the per-cloud one (v bit for bit, the same decisions and masks on the CPU
backends; on a GPU a squared distance within ~2 float32 ulps of v² may count differently,
see :func:`~pointalign.features.outliers.stray_fractions_many`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from pointalign.features.downsample import (
    EDGE_ROUNDS,
    CloudGroup,
    auto_voxel_size,
    auto_voxel_size_many,
    edge_search,
    edge_search_inputs,
    group_clouds,
    searched,
)
from pointalign.features.outliers import (
    MIN_STRAY_FRACTION,
    dense_mask,
    dense_masks_many,
    robust_voxel_size,
    robust_voxel_sizes_many,
    stray_counts,
    stray_fraction,
    stray_fractions_many,
    stray_fractions_of,
    stray_sample,
)
from pointalign.kernels import upload
from pointalign.registration.options import Options
from pointalign.search import policy

#: ``auto_voxel_size``'s error, for a pair whose larger cloud's points all coincide
COINCIDE = "points: all points coincide; cannot choose a voxel size"

Clouds = tuple[torch.Tensor, torch.Tensor]


def voxel_sizes(pairs: Sequence[Clouds], opts: Options,
                target_indexes: Sequence[Any] | None = None, group: CloudGroup | None = None
                ) -> list[tuple[float, bool] | ValueError]:
    """Choose v and tell whether strays are to be removed, for every pair.

    Args:
        pairs: ``(source (N, 3), target (M, 3))`` float tensors on one device, checked.
        opts: the checked options (``voxel_size``, ``target_points``, ``remove_outliers``).
        target_indexes: per pair an index over the target, or None (host memory only: the
            per-cloud path searches it; a device builds none).
        group: the pairs' clouds as one group (``group_clouds([s₀, t₀, s₁, t₁, …])``) when
            the caller has it (a device's path uses it instead of grouping them again).

    Returns:
        Per pair ``(v, strays)``, or the ValueError :data:`COINCIDE` where the larger cloud's
        points all coincide. On a device one host read for the whole group (a few more
        where a pair shows strays: its edge again without them).

    """
    if not pairs:
        return []
    if policy.search_plan(pairs[0][0]).host_tree:
        out: list[tuple[float, bool] | ValueError] = []
        for i, (s, t) in enumerate(pairs):
            try:
                out.append(voxel_size_per_cloud(
                    s, t, opts, None if target_indexes is None else target_indexes[i]))
            except ValueError as exc:
                out.append(exc)
        return out
    return _voxel_sizes_many(pairs, opts, group)


def _voxel_sizes_many(pairs: Sequence[Clouds], opts: Options, group: CloudGroup | None = None
                      ) -> list[tuple[float, bool] | ValueError]:
    """:func:`voxel_sizes` of the whole group at once (the device's path)."""
    # both clouds of every pair as one group (one synchronisation for their corners): the
    # automatic edge of each pair's larger cloud, the stray fractions of both
    bigs = [2 * i + int(s.shape[0] < t.shape[0]) for i, (s, t) in enumerate(pairs)]
    if opts.voxel_size is None or opts.remove_outliers:
        if group is None:
            group = group_clouds([x for p in pairs for x in p])
        vs, fr = _edges_and_strays(group, opts, bigs)
    else:
        vs, fr = [float(opts.voxel_size)] * len(pairs), None
    ok = [math.isfinite(v) for v in vs]
    strays = [False] * len(pairs) if fr is None else \
        [max(fr[2 * i], fr[2 * i + 1]) >= MIN_STRAY_FRACTION for i in range(len(pairs))]
    if opts.voxel_size is None:  # v without the strays, for every pair that shows some
        redo = [i for i in range(len(pairs)) if ok[i] and strays[i]]
        robust = robust_voxel_sizes_many([pairs[i][bigs[i] % 2] for i in redo],
                                         opts.target_points, start=[vs[i] for i in redo])
        for i, rv in zip(redo, robust, strict=True):
            vs[i], ok[i] = rv, math.isfinite(rv)
    return [(v, st) if good else ValueError(COINCIDE)
            for v, good, st in zip(vs, ok, strays, strict=True)]


def _edges_and_strays(group: CloudGroup, opts: Options, bigs: list[int]
                      ) -> tuple[list[float], list[float] | None]:
    """Each pair's edge (NaN: its larger cloud's points coincide) and every cloud's strays.

    The automatic edges (:func:`~pointalign.features.downsample.edge_search`) and the
    stray counts at them (:func:`~pointalign.features.outliers.stray_counts`, each cloud at
    its pair's edge, 1.0 where that is NaN) as one fixed device program (:class:`_Rule`: on
    a GPU one CUDA graph per size from a size's second call) and one read. Where the
    packed cells overflowed (a group of many clouds at tiny edges), the edges and then the
    fractions by their own functions, one cloud at a time where needed. Returns ``(edges,
    fractions)``, the fractions None unless ``opts.remove_outliers``.
    """
    n, dev = len(bigs), group.points.device
    given = None if opts.voxel_size is None else [float(opts.voxel_size)] * len(group.sizes)
    inputs = {"points": group.points, "owner": group.owner, "lo": group.lo,
              **edge_search_inputs(group, opts.target_points, bigs, given),
              # each cloud's pair's larger cloud, whose edge it is searched at
              "pair_of": upload([bigs[c // 2] for c in range(len(group.sizes))],
                                dtype=torch.int64, device=dev)}
    queries: list[int] = []
    if opts.remove_outliers:
        sample, queries = stray_sample(group)
        inputs.update(sample)
    host = searched(lambda rounds: _Rule(rounds, bool(opts.remove_outliers)), inputs,
                    EDGE_ROUNDS if given is None else 0)
    if host["overflow"]:
        vs = given[:n] if given is not None else auto_voxel_size_many(
            group, opts.target_points, clouds=bigs)
        return vs, stray_fractions_many(group, [v if math.isfinite(v) else 1.0 for v in vs
                                                for _ in (0, 1)]) \
            if opts.remove_outliers else None
    vs = [float(host["edges"][b]) for b in bigs]
    if not opts.remove_outliers:
        return vs, None
    return vs, stray_fractions_of(group.sizes, host["strays"].tolist(), queries, dev)


@dataclasses.dataclass(frozen=True)
class _Rule:
    """``rounds`` of the edge search, then (``strays``) the stray counts at the edges.

    A fixed device program with no host read (:func:`_edges_and_strays`); with no rounds
    the edges are the given ones. ``overflow``: some grid overflowed its packed key.
    """

    rounds: int
    strays: bool

    def __call__(self, inputs: dict[str, torch.Tensor], checkpoint: object
                 ) -> dict[str, torch.Tensor]:
        out = edge_search(inputs, self.rounds)
        if self.strays:
            e = out["edges"][inputs["pair_of"]]
            strays, over = stray_counts(inputs, torch.where(torch.isfinite(e), e, 1.0))
            out = {**out, "strays": strays, "overflow": out["overflow"] | over}
        return out


def voxel_size(source: torch.Tensor, target: torch.Tensor, opts: Options,
               target_index: Any = None, group: CloudGroup | None = None
               ) -> tuple[float, bool]:
    """:func:`voxel_sizes` of one pair: ``(v, strays)``; raises its ValueError."""
    rule = voxel_sizes([(source, target)], opts,
                       None if target_index is None else [target_index], group)[0]
    if isinstance(rule, ValueError):
        raise rule
    return rule


def without_strays(pairs: Sequence[Clouds], vs: Sequence[float],
                   group: CloudGroup | None = None) -> list[Clouds]:
    """Both clouds of every pair without their stray points, pair i at ``vs[i]``.

    Every cloud's :func:`~pointalign.features.outliers.dense_mask`: in host memory cloud by
    cloud (:func:`without_strays_per_cloud`), on a device by one
    :func:`~pointalign.features.outliers.dense_masks_many` (the same masks) and the kept
    points of all clouds by one selection (a few host synchronisations for the group). A
    pair where either cloud keeps fewer than 3 points stays as given. ``group``: as
    :func:`voxel_sizes`'.
    """
    if not pairs:
        return []
    if policy.search_plan(pairs[0][0]).host_tree:
        return [without_strays_per_cloud(s, t, v) for (s, t), v in zip(pairs, vs, strict=True)]
    return _without_strays_many(pairs, vs, group)


def _without_strays_many(pairs: Sequence[Clouds], vs: Sequence[float],
                         group: CloudGroup | None = None) -> list[Clouds]:
    """:func:`without_strays` of the whole group at once (the device's path)."""
    if group is None:
        group = group_clouds([x for p in pairs for x in p])
    keep, kept = dense_masks_many(group, [v for v in vs for _ in (0, 1)])
    dense = torch.split(group.points[keep], kept)
    return [(dense[2 * i], dense[2 * i + 1]) if min(kept[2 * i], kept[2 * i + 1]) >= 3
            else p for i, p in enumerate(pairs)]


def voxel_size_per_cloud(source: torch.Tensor, target: torch.Tensor, opts: Options,
                         target_index: Any = None) -> tuple[float, bool]:
    """Apply :func:`voxel_size`'s rule one cloud and one index at a time.

    ``target_index``: an index over the target to search, or None. The host's path, and the
    tests' oracle for the device's.
    """
    big = source if source.shape[0] >= target.shape[0] else target
    v = auto_voxel_size(big, opts.target_points) if opts.voxel_size is None else opts.voxel_size
    strays = opts.remove_outliers and max(
        stray_fraction(source, v),
        stray_fraction(target, v, index=target_index)) >= MIN_STRAY_FRACTION
    if strays and opts.voxel_size is None:
        v = robust_voxel_size(big, opts.target_points)
    return v, strays


def without_strays_per_cloud(source: torch.Tensor, target: torch.Tensor,
                             v: float) -> Clouds:
    """Apply :func:`without_strays` to one pair, one cloud at a time (the host's path)."""
    s_keep, t_keep = dense_mask(source, v), dense_mask(target, v)
    if int(s_keep.sum()) >= 3 and int(t_keep.sum()) >= 3:
        return source[s_keep], target[t_keep]
    return source, target


__all__ = ["COINCIDE", "voxel_size", "voxel_size_per_cloud", "voxel_sizes", "without_strays",
           "without_strays_per_cloud"]
