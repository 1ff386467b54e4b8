"""Default distances that scale with the data, written once for the library and the CLI.

:func:`icp_distance`: a local method's maximum correspondence distance when none is given,
:data:`ICP_DISTANCE_FRACTION` (5 %) of the source's bounding-box diagonal. (The lengths of
:func:`pointalign.register`, multiples of its voxel edge, are
:class:`pointalign.registration.pipeline.Scales`.)
"""

from __future__ import annotations

from typing import Any

import torch

from pointalign import _validate

#: a local method's default maximum correspondence distance, as a fraction of the source's
#: bounding-box diagonal
ICP_DISTANCE_FRACTION = 0.05

def bounding_box_diagonal(points: Any, name: str = "points") -> float:
    """Length of the axis-aligned bounding box's diagonal of ``points (N, 3)``, in their units.

    Args:
        points: ``(N, 3)`` cloud (array, tensor, PointCloud, Open3D cloud).
        name: the argument's name in error messages.

    """
    p = _validate.as_points(points, name, device="cpu", dtype=torch.float64)
    return float((p.amax(0) - p.amin(0)).norm())


def icp_distance(source: Any) -> float:
    """Default maximum correspondence distance of a local method for ``source (N, 3)``.

    ``ICP_DISTANCE_FRACTION × diagonal``: 5 % of the source's bounding-box diagonal (12.7 mm
    on the bundled bunny scan bun045, about 6 m on a 130 m LiDAR sweep).

    Raises:
        ValueError: the source's points all coincide (a zero diagonal).

    """
    d = bounding_box_diagonal(source, "source")
    if not d > 0:
        raise ValueError("source: all points coincide, so no distance scales with it; "
                         "give max_correspondence_distance")
    return ICP_DISTANCE_FRACTION * d
