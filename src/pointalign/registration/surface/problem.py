"""The edge shared by the surface methods: the validated problem, moves, default criteria."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pointalign import transforms
from pointalign.kernels import _loop
from pointalign.registration import _edge, checks
from pointalign.registration._edge import StopReason
from pointalign.registration.criteria import ConvergenceCriteria
from pointalign.registration.result import RegistrationResult
from pointalign.search.kdtree import KDTreeIndex


@dataclass(frozen=True)
class _Problem:
    """One validated problem in its local frame: the source, the target's tree, the pair."""

    pair: _edge.Pair
    source: torch.Tensor          # (N, 3) float32
    tree: KDTreeIndex
    centroid: np.ndarray          # (3,) float64, the source's centroid
    cov: np.ndarray               # (3, 3) float64, the source's covariance
    radius: float                 # the source's RMS radius


def _prepare(source: Any, target: Any, init: Any, device: Any, index: Any,
             max_correspondence_distance: float | None = None, method: str = "surface_newton"
             ) -> tuple[_Problem, _loop.Clock]:
    """Validate, resolve the device, move to the local frame and build the target's tree.

    Without ``index`` the problem is shifted by the target's centroid in float64 before it
    becomes float32 (georeferenced coordinates keep their precision) and the tree is built
    there; an ``index`` was built in the caller's coordinates, which are then kept. The
    clouds' scales and the truncation distance are compared first
    (:func:`pointalign.registration.checks.check_units`).
    """
    if index is not None and not isinstance(index, KDTreeIndex):
        raise TypeError(f"index: expected a KDTreeIndex over the target, "
                        f"got {type(index).__name__}")
    if index is None and target is None:
        raise ValueError("target: required when no index is given")
    tgt = index.points if index is not None else target
    dev = _edge.resolve_device(device, source=source, target=tgt)
    pair = _edge.prepare_pair(source, tgt, init=init, device=dev, min_points=3,
                              local=index is None)
    if pair.batched:
        raise ValueError("source: expected one (N, 3) cloud, got a batch")
    checks.check_units(pair, max_correspondence_distance=max_correspondence_distance)
    checks.announce_surface(pair, method)
    clock = _loop.Clock(dev)
    tree = index if index is not None else clock.stage(
        "tree", KDTreeIndex, pair.target[0], leaf_size=8)
    src = pair.source[0]
    s64 = src.double()
    centroid = s64.mean(0)
    cov = (s64 - centroid).T @ (s64 - centroid) / s64.shape[0]
    return _Problem(pair, src, tree, centroid.cpu().numpy(), cov.cpu().numpy(),
                    math.sqrt(max(float(cov.trace()), 0.0))), clock


def _move(xi: np.ndarray, center: np.ndarray) -> np.ndarray:
    """``(4, 4)``: rotate by ``exp(ω)`` about ``center``, then translate by ``τ``; ξ = (ω, τ)."""
    R = transforms.so3_exp(torch.from_numpy(np.asarray(xi[:3], dtype=np.float64))).numpy()
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = R, center - R @ center + xi[3:]
    return T


def _rms_displacement(D: np.ndarray, T: np.ndarray, prob: _Problem) -> float:
    """RMS of ``||D x − x||`` over the source points moved by ``T`` (from their moments)."""
    R0 = T[:3, :3]
    cov, centroid = R0 @ prob.cov @ R0.T, R0 @ prob.centroid + T[:3, 3]
    M = D[:3, :3] - np.eye(3)
    mean_disp = M @ centroid + D[:3, 3]
    return math.sqrt(max(float(np.trace(M @ cov @ M.T) + mean_disp @ mean_disp), 0.0))


def default_criteria(points: torch.Tensor) -> ConvergenceCriteria:
    """Stop rule for float32 clouds, scaled to ``points (N, 3)``.

    ``||T_step − I||`` small: the accepted step rotates by less than 1e-5 rad and moves the
    centroid by less than 1e-5 of the cloud's RMS radius (about 300× float32 rounding of the
    coordinates); or the RMS approximate distance changes by less than 1e-5 relatively (the
    float32 objective is reproducible to about 1e-6 at 10⁶ points); at most 50 steps.
    """
    stop_relative = 1e-5
    p = points.double()
    radius = float(((p - p.mean(0)) ** 2).sum(-1).mean().sqrt())
    return ConvergenceCriteria(max_iterations=50, relative_rmse=stop_relative,
                               rotation_tolerance=stop_relative,
                               translation_tolerance=stop_relative * max(radius, 1e-30))


def _finish(prob: _Problem, T: np.ndarray, fit: float, rmse: float, it: int,
            reason: StopReason, history: list, timings: dict, info: dict
            ) -> RegistrationResult:
    """Build the result; a pose the data do not determine is "ambiguous" (build_result).

    The stability is measured on the final nearest-neighbour correspondences, through the
    method's own k-d tree where the search policy says it serves
    (:func:`pointalign.search.policy.probe_index`: on a device; in host memory SciPy's
    tree; :func:`pointalign.registration._edge.measured_stability`): the distance
    map of a sphere or a plane is as small at a turned or slid pose as at the true one, so
    "no_decrease" there is no answer.
    """
    stab = _edge.measured_stability(prob.pair, T[None], index=prob.tree,
                                    max_distance=info.get("max_correspondence_distance"))
    return _edge.build_result(prob.pair, T[None], fitness=np.array([fit]),
                              rmse=np.array([rmse]), iterations=np.array([it]),
                              reasons=[reason], history=history, timings=timings, info=info,
                              stability=stab)
