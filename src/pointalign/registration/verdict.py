"""The verdict of :func:`~pointalign.registration.pipeline.register` on its final pose.

Three measurements of the final pose T on the downsampled clouds, and the final ICP's
stability; the thresholds were calibrated on ``benchmarks/bench_hard_pairs.py`` (see its
docstring). One formula for one pair and for a batch: :func:`verdict` is :func:`verdicts`
of a batch of one (``register_many`` judges a batch with one transfer to the host). Then
the result the verdict decides (:func:`decided_result`, :func:`global_result`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pointalign import _math, transforms
from pointalign.kernels import _loop
from pointalign.registration import _edge
from pointalign.registration._edge import StopReason
from pointalign.registration.ransac_programs import count_inliers_within
from pointalign.registration.result import RegistrationResult

if TYPE_CHECKING:
    from pointalign.registration.pipeline import Scales
    from pointalign.registration.prepare import Prepared

#: a different hypothesis turns more than this away from T (degrees)
DISTINCT_ANGLE_DEG = 5.0
#: verdict thresholds, calibrated on benchmarks/bench_hard_pairs.py (see its docstring)
MIN_OVERLAP = 0.2
MAX_MARGIN = 0.95
MIN_CONCENTRATION = 0.45


def _measure(T: torch.Tensor, R: torch.Tensor, fit_v: torch.Tensor, source: Prepared,
             target: Prepared, scales: Scales) -> torch.Tensor:
    """Count one pair's verdict numbers on the device: ``(4,)`` float64, no transfer.

    Within ``Scales.overlap``, the best different hypothesis' overlap, within
    ``Scales.correspondence``, within ``Scales.fine``. A fixed program (:class:`_Measure`):
    on a GPU one CUDA graph per size, the target's index keyed by its layout.
    """
    program = _Measure(target.index, scales.correspondence, scales.fine, scales.overlap,
                       scales.distinct)
    _, out = _loop.run_program(program, {"T": T, "R": R, "fit_v": fit_v,
                                         "points": source.down},
                               host_outputs=False, eager_first=True)
    return out["measured"]


@dataclasses.dataclass(frozen=True)
class _Measure:
    """:func:`_measure`'s device work, with no host read (a graph replays it).

    Inputs ``T (4, 4)``, ``R (k, 4, 4)`` float64, ``fit_v (k,)``, ``points (n, 3)``; output
    ``measured (4,)`` float64.
    """

    index: Any
    correspondence: float
    fine: float
    overlap: float
    distinct: float

    def __call__(self, inputs: dict[str, torch.Tensor], checkpoint: object
                 ) -> dict[str, torch.Tensor]:
        T, R, fit_v, points = inputs["T"], inputs["R"], inputs["fit_v"], inputs["points"]
        c_out, c_in, c_overlap = count_inliers_within(
            T, points, self.index, (self.correspondence, self.fine, self.overlap))
        ctr = points.mean(0).to(torch.float64)
        moved = R[:, :3, :3] @ ctr + R[:, :3, 3]
        here = T[:3, :3] @ ctr + T[:3, 3]
        dR = R[:, :3, :3].transpose(1, 2) @ T[:3, :3]
        ang = torch.rad2deg(transforms.rotation_angle(dR))
        other = ((moved - here).norm(dim=1) > self.distinct) | (ang > DISTINCT_ANGLE_DEG)
        # counts are >= 0: the best different one, or 0 when every hypothesis is the same
        second = torch.where(other, fit_v, torch.zeros_like(fit_v)).amax()[None]
        return {"measured": torch.cat([c_overlap, second, c_out, c_in]).to(torch.float64)}


def verdicts(T: torch.Tensor, stability: Any, hypotheses: Sequence[torch.Tensor],
             overlaps: Sequence[torch.Tensor], sources: Sequence[Prepared],
             targets: Sequence[Prepared],
             scales: Scales) -> list[tuple[dict[str, Any], StopReason]]:
    """Whether each of B final poses is trustworthy, and why not.

    * ``overlap``: fraction of the downsampled source within ``Scales.overlap`` of the
      target under T;
    * ``margin``: the best *different* refined hypothesis' overlap (``overlaps[b] (k,)``
      of ``hypotheses[b] (k, 4, 4)``) over the winner's (different: it maps the source's
      centroid more than ``Scales.distinct`` away or turns more than
      :data:`DISTINCT_ANGLE_DEG` away from T); near 1 = ambiguous;
    * ``concentration``: of the source points within ``Scales.correspondence``, the
      fraction within ``Scales.fine`` (a right pose puts most matches near zero);
    * the final ICP's ``stability`` (:func:`pointalign._math.stability`): at or below
      ``STABILITY_EPS`` the data do not determine the pose.

    Args:
        T: ``(B, 4, 4)`` float64 final poses (the frame of the prepared clouds).
        stability: ``(B,)`` the final ICP's ``info["stability"]``.
        hypotheses: B refined hypotheses ``(k_b, 4, 4)`` float64, best first.
        overlaps: B ``(k_b,)`` int64 overlap counts of those.
        sources: B downsampled, indexed sources
            (:class:`~pointalign.registration.pipeline.Prepared`).
        targets: B downsampled, indexed targets.
        scales: the lengths of every pair
            (:class:`~pointalign.registration.pipeline.Scales`).

    Returns:
        Per pair ``{overlap, margin, concentration, trusted, verdict}`` (``verdict``:
        "trusted" or every failed test in words) and the :class:`StopReason` of the first
        failed test (``TRUSTED`` when none failed). One transfer to the host for the batch.

    """
    host = torch.stack([_measure(T[b], hypotheses[b], overlaps[b], sources[b], targets[b],
                                 scales) for b in range(T.shape[0])]).cpu().numpy()
    return judged(host, stability, sources)


def judged(host: np.ndarray, stability: Any, sources: Sequence[Prepared]
           ) -> list[tuple[dict[str, Any], StopReason]]:
    """Judge B pairs from their measured numbers: host arithmetic only.

    ``host (B, 4)``: as :func:`_measure` returns them (overlap count, the best different
    hypothesis' overlap, the counts within the outer and the inner bound); the final ICP's
    ``stability``; the downsampled sources (their sizes).
    """
    stab = np.asarray(stability, dtype=np.float64).reshape(-1)
    out = []
    for (best, second, c_out, c_in), src, st in zip(host, sources, stab, strict=True):
        overlap, margin = best / src.down.shape[0], second / max(best, 1.0)
        concentration = c_in / max(c_out, 1.0)
        failed = [(words, reason) for words, reason, bad in (
            ("small overlap", StopReason.SMALL_OVERLAP, overlap < MIN_OVERLAP),
            ("weak margin", StopReason.WEAK_MARGIN, margin > MAX_MARGIN),
            ("residuals not concentrated", StopReason.NOT_CONCENTRATED,
             concentration < MIN_CONCENTRATION),
            ("pose not determined", StopReason.AMBIGUOUS, not st > _math.STABILITY_EPS),
        ) if bad]
        out.append(({"overlap": float(overlap), "margin": float(margin),
                     "concentration": float(concentration), "trusted": not failed,
                     "verdict": ", ".join(w for w, _ in failed) if failed else "trusted"},
                    failed[0][1] if failed else StopReason.TRUSTED))
    return out


def verdict(local: RegistrationResult, R: torch.Tensor, fit_v: torch.Tensor,
            source: Prepared, target: Prepared,
            scales: Scales) -> tuple[dict[str, Any], StopReason]:
    """Judge one pair: :func:`verdicts` of a batch of one.

    ``local``: the final ICP's result (its pose and ``info["stability"]``); ``R (k, 4, 4)``
    the refined hypotheses and ``fit_v (k,)`` their overlap counts, best first.
    """
    T = local.transformation_tensor
    assert T is not None  # icp() always returns it
    stability = np.asarray(local.info.get("stability", 1.0), dtype=np.float64).reshape(1)
    return verdicts(T[None], stability, [R], [fit_v], [source], [target], scales)[0]


def _with_ransac(timings: dict[str, float], glob: RegistrationResult) -> dict[str, float]:
    """Return the stage timings plus RANSAC's own as ``ransac.<stage>``."""
    return {**timings, **{f"ransac.{k}": x for k, x in glob.timings.items() if k != "total"}}


def global_result(pair: _edge.Pair, glob: RegistrationResult, info: dict[str, Any],
                  timings: dict[str, float]) -> RegistrationResult:
    """Build the result of ``refine="none"``, or of a RANSAC that found nothing: RANSAC's."""
    if not glob.converged:  # the global stage's failure is the verdict
        info = {**info, "verdict": str(glob.stop_reason).replace("_", " ")}
    return _edge.build_result(
        pair, np.asarray(glob.transformation, dtype=np.float64)[None],
        fitness=np.array([glob.fitness]), rmse=np.array([glob.rmse]),
        iterations=np.array([glob.iterations]), reasons=[StopReason(glob.stop_reason)],
        history=[], timings=_with_ransac(timings, glob), info={**glob.info, **info},
        converged=np.array([glob.converged]))


def decided_result(pair: _edge.Pair, local: RegistrationResult, glob: RegistrationResult,
                   info: dict[str, Any], reason: StopReason,
                   timings: dict[str, float]) -> RegistrationResult:
    """Build the result after ICP: the final ICP's pose and numbers, the verdict's decision."""
    info = {**local.info, **info, "ransac_info": glob.info,
            "icp_converged": bool(local.converged), "icp_stop_reason": str(local.stop_reason)}
    result = _edge.build_result(
        pair, np.asarray(local.transformation, dtype=np.float64)[None],
        fitness=np.array([local.fitness]), rmse=np.array([local.rmse]),
        iterations=np.array([local.iterations]), reasons=[reason], history=local.history,
        timings=_with_ransac(timings, glob), info=info, converged=np.array([info["trusted"]]))
    if result.stop_reason == reason:
        return result
    return dataclasses.replace(result, info={  # a rule of build_result overrode the verdict
        **result.info, "trusted": False, "verdict": str(result.stop_reason).replace("_", " ")})
