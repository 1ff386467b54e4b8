"""The options of :func:`~pointalign.registration.pipeline.register`, checked in one place.

:func:`check` serves ``register()`` and
:func:`~pointalign.registration.many.register_many` (which takes register's options), so
both accept, default and refuse the same keywords with the same messages.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import numpy as np

from pointalign import _progress, _validate
from pointalign.registration.ransac import ransac

#: register()'s refinements of the global result: point-to-plane ICP, generalized ICP
#: (:func:`~pointalign.registration.gicp.gicp`), or none (the global stage alone)
REFINEMENTS = ("point_to_plane", "gicp", "none")


class Options(NamedTuple):
    """:func:`~pointalign.registration.pipeline.register`'s checked keyword arguments."""

    voxel_size: float | None
    refine: str
    target_points: int
    hypotheses: int
    icp_voxel_size: float | None
    max_iterations: int
    seed: int
    remove_outliers: bool
    robust: bool
    max_correspondence_distance: float | None
    icp_max_correspondence_distance: float | None
    ransac_options: dict[str, Any]


#: ransac()'s keywords that register() sets itself; RANSAC_OPTIONS: those it passes on
_RANSAC_SET_HERE = frozenset({"source", "target", "source_features", "target_features",
                              "hypotheses", "target_index", "seed", "device", "matches",
                              "max_correspondence_distance", "num_threads"})
RANSAC_OPTIONS = tuple(sorted(set(inspect.signature(ransac).parameters) - _RANSAC_SET_HERE))


def _positive_or_none(value: Any, name: str) -> float | None:
    return None if value is None else _validate.positive(value, name)


def check(caller: str, given: dict[str, Any]) -> Options:
    """Check register's keyword arguments ``given`` (its defaults for those missing).

    The one check of :func:`~pointalign.registration.pipeline.register`'s options, for
    ``register`` and :func:`~pointalign.registration.many.register_many` (``caller`` names
    the function in the errors): a keyword neither register's nor one of
    :data:`RANSAC_OPTIONS` is a TypeError; ``method=`` (deprecated) becomes ``refine``.
    """
    from pointalign.registration.pipeline import register  # its signature: the defaults

    if "num_threads" in given:  # register's own (per call), never RANSAC's alone
        raise TypeError(f"{caller}() got an unexpected keyword argument 'num_threads' (run "
                        f"the call inside pointalign.threads(n) to set its threads)")
    bound = inspect.signature(register).bind(None, None, **given)
    bound.apply_defaults()
    a = bound.arguments
    ransac_options = dict(a["ransac_options"])
    for name in ("remove_outliers", "robust"):
        if not isinstance(a[name], (bool, np.bool_)):
            raise TypeError(f"{name}: expected True or False, got {a[name]!r}")
    unknown = sorted(set(ransac_options) - set(RANSAC_OPTIONS))
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r} "
                        f"(besides its own, {caller} passes these on to ransac(): "
                        f"{', '.join(RANSAC_OPTIONS)})")
    refine, method = a["refine"], a["method"]
    if method is not None:  # the old name: register(method="icp" | "none")
        _progress.warn(f'{caller}(method=...) is now {caller}(refine=...) ("icp" became '
                       '"point_to_plane")', DeprecationWarning, stacklevel=None)
        refine = {"icp": "point_to_plane"}.get(method, method)
    if refine not in REFINEMENTS:
        raise ValueError(f"{'refine' if method is None else 'method (now refine)'}: "
                         f"expected one of {REFINEMENTS}, got {refine!r}")
    return Options(
        _positive_or_none(a["voxel_size"], "voxel_size"), refine,
        _validate.integer(a["target_points"], "target_points", minimum=3),
        _validate.integer(a["hypotheses"], "hypotheses", minimum=1),
        _positive_or_none(a["icp_voxel_size"], "icp_voxel_size"),
        _validate.integer(a["max_iterations"], "max_iterations", minimum=1),
        _validate.seed(a["seed"]), bool(a["remove_outliers"]), bool(a["robust"]),
        _positive_or_none(a["max_correspondence_distance"], "max_correspondence_distance"),
        _positive_or_none(a["icp_max_correspondence_distance"],
                          "icp_max_correspondence_distance"),
        ransac_options)
