"""register_many's local stages of a chunk: coarse ICP, final stage, verdicts, and the rows.

Batched per group of pairs sharing their lengths in voxels; on a GPU
(:func:`.batched.batched_local`) the per-pair counts, clouds and verdicts of a whole group
at once through :mod:`.batched_local`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pointalign.kernels import _loop
from pointalign.registration.many import batched as _batched
from pointalign.registration.many import batched_local as _local
from pointalign.registration.many.work import _by_scales, _Work
from pointalign.registration.options import Options as _Options
from pointalign.registration.pipeline import (
    _final_clouds,
    _final_icp,
    _refine_hypotheses,
    icp_criteria,
)
from pointalign.registration.result import RegistrationResult
from pointalign.registration.verdict import verdicts


def _global_row(w: _Work) -> None:
    """Fill the row of a pair whose last stage is the global one (refine "none", no hypothesis)."""
    if w.glob is None:  # an init and refine="none": nothing to do
        w.row.update(transformation=np.asarray(w.spec.init, dtype=np.float64),
                     verdict="not refined (refine='none')")
        return
    g, r = w.glob, w.r
    w.row.update(transformation=_unscaled(np.asarray(g.transformation), r.v, r.center),
                 fitness=float(g.fitness), rmse=float(g.rmse) * r.v,
                 converged=bool(g.converged), trusted=bool(g.converged),
                 verdict="global only" if g.converged else str(g.stop_reason).replace("_", " "),
                 stop_reason=str(g.stop_reason), iterations=int(g.iterations))


#: the local stages' clock names as register_many's timings name them (``local.<name>``)
_LOCAL_NAMES = {"hypotheses": "coarse", "icp_prepare": "final_prepare", "icp": "final_icp"}


def _local_stages(works: list[_Work], opts: _Options, device: torch.device
                  ) -> dict[str, float]:
    """Coarse ICP of every pair's hypotheses, final stage and verdicts, batched per group.

    On a GPU (:func:`.batched.batched_local`) the coarse stage's counts and sorts
    (:func:`.batched_local.refine_many`) and the final clouds (:func:`.batched_local.
    final_clouds_many`) run for a whole group at once; else per pair, as ``register``.
    Returns the seconds per part (one clock: a synchronisation at each part's end):
    ``rows`` (results wrapped), ``coarse_*`` (``coarse`` on the per-pair path),
    ``final_clouds``, ``final_prepare``, ``final_icp``, ``verdict``.
    """
    clock = _loop.Clock(device)
    batched = _batched.batched_local(device)
    for w in works:
        if w.refined is None and w.cands is None:  # refine="none", or RANSAC found nothing
            _global_row(w)
    clock.lap("rows")
    coarse = [(w, w.cands) for w in works if w.cands is not None]
    for scales, group in _by_scales([w for w, _ in coarse]).items():
        cands = dict((id(w), c) for w, c in coarse)
        refine = _local.refine_many if batched and len(group) > 1 else _refine_hypotheses
        got = refine([(cands[id(w)], w.r.source, w.r.target) for w in group],
                     scales, icp_criteria(scales, opts.max_iterations), opts.robust, clock)
        for w, (R, fit_v, its) in zip(group, got, strict=True):
            w.refined, w.fit_v, w.coarse_iterations = R, fit_v, its
    final = [w for w in works if w.refined is not None]
    ivs = opts.icp_voxel_size
    clouds: dict[int, Any] = {}
    if batched and ivs is None and len(final) > 1:
        for same in _by_normal_radius(final).values():
            got_c = _local.final_clouds_many([w.r.src for w in same], [w.r.tgt for w in same],
                                          [w.r.v for w in same], same[0].r.scales,
                                          opts.refine)
            clouds.update((id(w), c) for w, c in zip(same, got_c, strict=True))
    else:
        clouds = {id(w): _final_clouds(w.r.src / w.r.v, w.r.tgt / w.r.v, w.r.scales,
                                       None if ivs is None else ivs / w.r.v, opts.refine)
                  for w in final}
    clock.lap("final_clouds")
    for scales, same in _by_scales(final).items():
        # pairs of similar sizes share a padded batch (padding costs work per iteration)
        for group in _size_groups(sorted(same, key=lambda w: clouds[id(w)].source.shape[0]),
                                  lambda w: clouds[id(w)].source.shape[0]):
            hyp = [w.hypotheses for w in group]
            res = _final_icp([clouds[id(w)] for w in group], torch.stack([R[0] for R, _ in hyp]),
                             scales, icp_criteria(scales, opts.max_iterations), opts.refine,
                             clock, own_index=not batched)
            assert res.transformation_tensor is not None
            stab = np.asarray(res.info["stability"], dtype=np.float64).reshape(-1)
            judged = (_local.verdicts_many if batched else verdicts)(
                res.transformation_tensor, stab, [R for R, _ in hyp], [f for _, f in hyp],
                [w.r.source for w in group], [w.r.target for w in group], scales)
            clock.lap("verdict")
            for j, (w, (ver, reason)) in enumerate(zip(group, judged, strict=True)):
                _final_row(w, res, j, ver, str(reason), clouds[id(w)].source.shape[0],
                           float(stab[j]))
            clock.lap("rows")
    out = clock.total()
    out.pop("total")
    return {_LOCAL_NAMES.get(k, k): v for k, v in out.items()}


def _by_normal_radius(works: list[_Work]) -> dict[float, list[_Work]]:
    """Group pairs by their normal radius in voxels (one radius per batched search)."""
    groups: dict[float, list[_Work]] = {}
    for w in works:
        groups.setdefault(w.r.scales.normal_radius, []).append(w)
    return groups


def _final_row(w: _Work, res: RegistrationResult, j: int, ver: dict[str, Any], reason: str,
               n_source: int, stability: float) -> None:
    """Fill the row of pair ``j`` of the final stage's batched result ``res``."""
    r = w.r
    w.row.update(transformation=_unscaled(res.transformation[j], r.v, r.center),
                 fitness=float(res.fitness[j]), rmse=float(res.rmse[j]) * r.v,
                 verdict=ver["verdict"], trusted=ver["trusted"], converged=ver["trusted"],
                 stop_reason=reason, iterations=int(res.iterations[j]),
                 overlap=ver["overlap"], margin=ver["margin"],
                 concentration=ver["concentration"], stability=stability,
                 info={"H": _information_world(res.info["H"][j], r.v),
                       "H_center": r.center.copy(),
                       "icp_converged": bool(res.converged[j]),
                       "icp_stop_reason": str(res.stop_reason[j]),
                       "coarse_iterations": w.coarse_iterations,
                       "correspondences": int(round(float(res.fitness[j]) * n_source))})


def _unscaled(T: np.ndarray, v: float, center: np.ndarray) -> np.ndarray:
    """Scaled local ``T (4, 4)`` → the caller's coordinates, in float64."""
    out = np.array(T, dtype=np.float64)
    out[:3, 3] *= v
    out[:3, 3] += center - out[:3, :3] @ center
    return out


def _information_world(H: np.ndarray, v: float) -> np.ndarray:
    """Convert the final ICP's ``H`` (twist about the scaled local origin) to metres.

    The scaled frame's twist (ω, v/s) against residuals in voxels: ``H_m = D H D / s²``
    with ``D = diag(1, 1, 1, 1/s, 1/s, 1/s)`` (s = v); about the target's centroid
    (``info["H_center"]``), the twist about the world origin follows by the adjoint.
    """
    d = np.array([1.0, 1.0, 1.0, 1.0 / v, 1.0 / v, 1.0 / v])
    return (d[:, None] * np.asarray(H, dtype=np.float64) * d[None]) * v * v


def _size_groups(order: list[_Work], size: Any, ratio: float = 1.5) -> list[list[_Work]]:
    """Split ``order`` (ascending ``size(w)``) where the largest would pass ``ratio`` × smallest."""
    groups: list[list[_Work]] = []
    for w in order:
        if groups and size(w) <= ratio * size(groups[-1][0]):
            groups[-1].append(w)
        else:
            groups.append([w])
    return groups
