"""The verdict of :func:`~pointalign.registration.pipeline.register` on its final pose.

Three measurements of the final pose T on the downsampled clouds, and the final ICP's
stability; the thresholds were calibrated on ``benchmarks/bench_hard_pairs.py`` (see its
docstring).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pointalign import _math, transforms
from pointalign.registration._edge import StopReason
from pointalign.registration.ransac import count_inliers_within
from pointalign.registration.result import RegistrationResult

if TYPE_CHECKING:
    from pointalign.registration.pipeline import Prepared, Scales

#: a different hypothesis turns more than this away from T (degrees)
DISTINCT_ANGLE_DEG = 5.0
#: verdict thresholds, calibrated on benchmarks/bench_hard_pairs.py (see its docstring)
MIN_OVERLAP = 0.2
MAX_MARGIN = 0.95
MIN_CONCENTRATION = 0.45


def verdict(local: RegistrationResult, R: torch.Tensor, fit_v: torch.Tensor,
             source: Prepared, target: Prepared,
             scales: Scales) -> tuple[dict[str, Any], StopReason]:
    """Whether the final ICP's pose T is trustworthy, and why not.

    * ``overlap``: fraction of the downsampled source within ``Scales.overlap`` of the
      target under T;
    * ``margin``: the best *different* refined hypothesis' overlap (``fit_v (k,)`` of
      ``R (k, 4, 4)``) over the winner's (different: it maps the source's centroid more
      than ``Scales.distinct`` away or turns more than :data:`DISTINCT_ANGLE_DEG` away
      from T); near 1 = ambiguous;
    * ``concentration``: of the source points within ``Scales.correspondence``, the
      fraction within ``Scales.fine`` (a right pose puts most matches near zero);
    * the final ICP's ``stability`` (:func:`pointalign._math.stability`): at or below
      ``STABILITY_EPS`` the data do not determine the pose.

    Returns ``{overlap, margin, concentration, trusted, verdict}`` (``verdict``: "trusted"
    or every failed test in words) and the :class:`StopReason` of the first failed test
    (``TRUSTED`` when none failed).
    """
    T = local.transformation_tensor
    assert T is not None  # icp() always returns it
    c_out, c_in, c_overlap = count_inliers_within(
        T, source.down, target.index, (scales.correspondence, scales.fine, scales.overlap))
    ctr = source.down.mean(0).to(torch.float64)
    moved = R[:, :3, :3] @ ctr + R[:, :3, 3]
    here = T[:3, :3] @ ctr + T[:3, 3]
    dR = R[:, :3, :3].transpose(1, 2) @ T[:3, :3]
    ang = torch.rad2deg(transforms.rotation_angle(dR))
    other = ((moved - here).norm(dim=1) > scales.distinct) | (ang > DISTINCT_ANGLE_DEG)
    best = float(c_overlap[0])
    second = float(fit_v[other].max()) if bool(other.any()) else 0.0
    overlap, margin = best / source.down.shape[0], second / max(best, 1.0)
    concentration = float(c_in[0]) / max(float(c_out[0]), 1.0)
    stability = float(local.info.get("stability", 1.0))
    failed = [(words, reason) for words, reason, bad in (
        ("small overlap", StopReason.SMALL_OVERLAP, overlap < MIN_OVERLAP),
        ("weak margin", StopReason.WEAK_MARGIN, margin > MAX_MARGIN),
        ("residuals not concentrated", StopReason.NOT_CONCENTRATED,
         concentration < MIN_CONCENTRATION),
        ("pose not determined", StopReason.AMBIGUOUS, not stability > _math.STABILITY_EPS),
    ) if bad]
    return ({"overlap": overlap, "margin": margin, "concentration": concentration,
             "trusted": not failed,
             "verdict": ", ".join(w for w, _ in failed) if failed else "trusted"},
            failed[0][1] if failed else StopReason.TRUSTED)
