"""register_many's global stage of a chunk: per pair (``pipeline``'s functions) or batched.

The batched path: :mod:`.batched_prepare` (v, strays, scaling, downsampling, normals and
FPFH) then :mod:`.batched_ransac` (RANSAC and the graph's proposals);
:func:`.batched.applies` tells which path a chunk takes.
"""

from __future__ import annotations

import numpy as np
import torch

from pointalign.kernels import _loop
from pointalign.registration import _edge, voxel_rule
from pointalign.registration.many import batched as _batched
from pointalign.registration.many import batched_prepare as _prepare
from pointalign.registration.many import batched_ransac as _ransac
from pointalign.registration.many.work import _by_scales, _fail, _Ready, _Work
from pointalign.registration.options import Options as _Options
from pointalign.registration.pipeline import Scales, _global, _prepare_pair
from pointalign.registration.prepare import Prepared
from pointalign.registration.ransac_programs import count_inliers


def _global_stage(w: _Work, pair: _edge.LocalPair, opts: _Options, clock: _loop.Clock
                  ) -> None:
    """Per pair, in its frame scaled by 1/v: both clouds prepared, the global candidates.

    ``pair``: the checked clouds in their local frame (register()'s float64 shift). A pair
    given an ``init`` needs no features: its clouds are downsampled and indexed (for the
    verdict) and the init is its one hypothesis.
    """
    src, tgt = pair.source, pair.target
    start = w.spec.init is not None
    v, scales, source, target = _prepare_pair(src, tgt, opts, clock, in_voxels=True,
                                              describe=not start)
    w.ready = _Ready(src, tgt, pair.center, v, scales, source, target)
    w.row["voxel_size"] = v
    if not start:
        w.glob, w.cands, *_ = _global(source, target, scales, opts, clock)
    elif opts.refine != "none":
        T0 = torch.from_numpy(pair.init).to(src.device)
        T0[:3, 3] /= v
        w.refined = T0[None]
        w.fit_v = count_inliers(w.refined, source.down, target.index, scales.overlap)


def _global_stage_batched(works: list[_Work], pairs: dict[int, _edge.LocalPair],
                          opts: _Options,
                          device: torch.device, on_error: str) -> dict[str, float]:
    """Run the global stage of ``works`` (no init) at once (:mod:`.batched_prepare`, …).

    v and the stray decisions of all pairs at once
    (:func:`~pointalign.registration.voxel_rule.voxel_sizes`: register()'s rule), the strays
    dropped per pair that shows some, the clouds scaled by 1/v in one launch; then every
    cloud downsampled by one sort, described by one search and one launch per kernel, and
    RANSAC with the graph's proposals for each group of pairs sharing a bound.
    Fills each pair's ``ready``, ``glob`` and ``cands`` as :func:`_global_stage` does.
    Returns the seconds per stage for the whole group.
    """
    clock = _loop.Clock(device)
    mcd, fine = opts.max_correspondence_distance, opts.icp_max_correspondence_distance
    todo: list[_Work] = []
    clouds: list[torch.Tensor] = []
    meta: dict[int, tuple[torch.Tensor, torch.Tensor, np.ndarray, float, Scales]] = {}
    local = [(pairs[id(w)].source, pairs[id(w)].target) for w in works]
    dirty: list[int] = []  # the pairs showing strays: their dense points, all at once below
    for w, (src, tgt), rule in zip(works, local, voxel_rule.voxel_sizes(local, opts),
                                   strict=True):
        try:
            if isinstance(rule, Exception):
                raise rule
            v, strays = rule
            scales = Scales(1.0, None if mcd is None else mcd / v,
                            None if fine is None else fine / v)
            meta[id(w)] = (src, tgt, pairs[id(w)].center, v, scales)
            if strays:
                dirty.append(len(todo))
            todo.append(w)
            clouds += [src, tgt]
        except (ValueError, TypeError) as exc:
            _fail(w, exc, on_error)
    clock.lap("voxel_size")
    dense = voxel_rule.without_strays([(clouds[2 * i], clouds[2 * i + 1]) for i in dirty],
                                      [meta[id(todo[i])][3] for i in dirty])
    for i, (s_c, t_c) in zip(dirty, dense, strict=True):
        clouds[2 * i], clouds[2 * i + 1] = s_c, t_c
    clock.lap("strays")
    clouds = _prepare.scaled([meta[id(w)][3] for w in todo for _ in (0, 1)], clouds)
    clock.lap("scale")
    if not todo:
        return clock.total()
    unit = meta[id(todo[0])][4]
    downs, sizes = _prepare.prepare_many(clouds, unit, clock)
    kept, kept_downs = [], []
    for i, w in enumerate(todo):
        small = [(name, sizes[2 * i + j]) for j, name in enumerate(("source", "target"))
                 if sizes[2 * i + j] < 3]
        if small:
            name, got = small[0]
            _fail(w, ValueError(f"voxel_size: {meta[id(w)][3]:g} leaves {got} {name} "
                                "point(s); at least 3 are needed (a smaller voxel_size)"),
                  on_error)
            continue
        kept.append(w)
        kept_downs += [downs[2 * i], downs[2 * i + 1]]
    if not kept:
        return clock.total()
    normals, features = _prepare.describe_many(kept_downs, unit)
    clock.lap("describe")
    indexes = _batched.indexes_of(kept_downs)
    for i, w in enumerate(kept):
        src, tgt, center, v, scales = meta[id(w)]
        prep = [Prepared(kept_downs[2 * i + j], indexes[2 * i + j],
                         normals[2 * i + j], features[2 * i + j]) for j in (0, 1)]
        w.ready = _Ready(src, tgt, center, v, scales, prep[0], prep[1])
        w.row["voxel_size"] = v
    clock.lap("index")
    for scales, group in _by_scales(kept).items():
        found = _ransac.global_many([w.r.source.down for w in group],
                                [w.r.target.down for w in group],
                                [w.r.source.features for w in group],
                                [w.r.target.features for w in group], scales, opts, clock)
        for w, pg in zip(group, found, strict=True):
            w.glob, w.cands = pg.glob, pg.candidates
    return clock.total()
