"""Fused soft-correspondence reductions (EM-ICP / Softassign E-step): contract and dispatch.

One pass over tiles of (query × points) computes, for every query row i, the distance to
every point, the logit ``z_ij = −s ||R q_i + t − p_j||² + g_j``, its exponential and every
row reduction a step needs, without ever storing more than one tile of the N×M matrix:

* ``lse_i  = log Σ_j exp(z_ij)``             (row sum, in the log domain)
* ``lse2_i = log Σ_j exp(2 z_ij)``           (EM-ICP's normaliser C_i at half the scale)
* ``mean_i = Σ_j exp(z_ij − lse_i) p_j``     (soft correspondence = weighted point sum / row sum)

Everything runs with a running maximum per row (the online log-sum-exp of flash attention),
so a tiny σ or a large β never underflows to 0/0: no NaN, whatever the scale.

Column sums (Sinkhorn's column normalisation) are a second pass with the transposed tiling:
the same row kernel with the roles of the clouds swapped and the inverse transform. We chose
this over atomics because (a) a column's running maximum lives in many programs and a
log-domain sum cannot be combined with a float atomic add, (b) the result is deterministic,
and (c) Sinkhorn alternates row and column normalisations anyway, so each half-step is
exactly one pass. EM-ICP needs no column sums at all: its Horn step only needs the row
weights λ_i and the soft correspondences x'_i (Tamaki et al. eqs. 10-11, 28-29).

From the row reductions, with w_i the row weights and m_i the soft correspondences, the soft
Horn moments of Tamaki et al. eqs. 18-20/26 are W = Σ w_i, Σ w_i q_i, Σ w_i m_i and the
cross-covariance Σ_ij m_ij q_i p_jᵀ = Σ_i w_i q_i m_iᵀ: the matrix is never needed.

Entry points (all batched: ``query (B, N, 3)``, ``points (B, M, 3)``, padded, with lengths):

* :func:`prepare`: one run's passes (:class:`Passes`), in the form the backend offers; the
  algorithm calls their methods (the same operations as below) and never asks which.
* :func:`soft_rows`: the raw reductions (lse, lse2, mean).
* :func:`emicp_rows`: EM-ICP weights λ_i = Σ_j √α_ij and x'_i (Granger & Pennec).
* :func:`emicp_step`: one whole EM-ICP iteration (E-step and Horn), fused on Triton.
* :func:`sinkhorn_scaling`: one Sinkhorn half-step in log scalings (Gold et al.).
* :func:`softassign_update`: one Softassign update's Sinkhorn passes (its reference: the
  passes one by one); fused into one call over a kernel matrix by the CPU's "cells" form.
* :func:`softassign_step`: one whole Softassign iteration (the update, weights and Horn),
  fused on Triton.
* :func:`nearest_d2`: the fitness pass (squared distance to the nearest point).
* :func:`centre`: a cloud centred once, with its moments, in the layout the passes read.

Backends (:func:`pointalign.kernels._backend.backend`): Triton kernels (``triton.py``) on
CUDA and through the interpreter under ``TRITON_INTERPRET=1``; numba on the "cpu" backend
(``cpu.py``: exact, or with :func:`prepare`'s ``approximation`` a stated, bounded
approximation whose bounds that module states); the PyTorch reference (``reference.py``,
the spec) otherwise. Reference: T. Tamaki et al., "Softassign and EM-ICP on GPU", 2010;
S. Granger and X. Pennec, ECCV 2002; S. Gold et al., Pattern Recognition 1998.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pointalign.kernels._backend import backend
from pointalign.kernels.grid import morton_order_rows
from pointalign.kernels.horn import weighted_horn
from pointalign.kernels.soft.reference import (
    FITNESS_SCALE,
    TILE_PAIRS,
    Passes,
    SoftRows,
    check,
    emicp_weights,
    row_mask,
    soft_rows_reference,
)

__all__ = ["FITNESS_SCALE", "FORMS", "TILE_PAIRS", "Centred", "Passes", "SoftRows", "centre",
           "emicp_rows", "emicp_step", "emicp_weights", "nearest_d2", "point_layout",
           "prepare", "sinkhorn_scaling", "soft_rows", "soft_rows_reference",
           "softassign_step", "softassign_update", "weighted_horn"]

#: what :func:`prepare`'s ``approximation`` accepts
FORMS = ("auto", "exact", "approximate")


def _exact(x: torch.Tensor, m: int) -> Passes:
    """Return the exact passes of the backend that runs tensors like ``x`` (``m`` points)."""
    be = backend(x)
    if be in ("triton", "interpret"):
        from pointalign.kernels.soft import triton as _soft_triton

        return _soft_triton.TritonPasses(str(x.device))
    if be == "cpu":
        from pointalign.kernels.soft import cpu as _soft_cpu

        return _soft_cpu.exact_passes(str(x.device), x.shape[1], m)
    return Passes(str(x.device))


def prepare(method: str, source: torch.Tensor, target: torch.Tensor,
            source_lengths: torch.Tensor, target_lengths: torch.Tensor, *, iterations: int,
            approximation: str = "auto", schedule: Callable[[], dict] | None = None,
            outlier_weight: float = 1.0, sinkhorn_rounds: int = 1,
            per_temperature: int = 1) -> Passes:
    """Return one run's passes, in the form chosen up front for ``source`` and ``target``.

    On Triton and with the PyTorch reference, the exact passes (a plain object, keyed by
    value in a CUDA graph). On the "cpu" backend (numba, passes run on the host) a form is
    chosen from a cost estimate: exact while estimated at a few seconds, else a stated,
    bounded approximation (:mod:`pointalign.kernels.soft.cpu` states the forms and their
    bounds); the object owns its trees and cells for the run, reports the estimate
    (``estimate_s``) and records what ran (``info()``, for ``result.info
    ["approximation"]``).

    Args:
        method: "emicp" or "softassign".
        source: ``(B, N, 3)`` float tensor, padded (the algorithm's centred source).
        target: ``(B, M, 3)`` float tensor, padded.
        source_lengths: ``(B,)`` valid source points.
        target_lengths: ``(B,)`` valid target points.
        iterations: iterations of the run (EM-ICP steps or Softassign pose updates).
        approximation: "auto", "exact" or "approximate" (where the backend has no other
            form than the exact one, every choice is exact).
        schedule: called (at most once, only by a backend that plans ahead) for the first
            problem's schedule: EM-ICP ``{"sigmas": [σ per iteration]}``, Softassign
            ``{"betas": [β per temperature run], "alpha": α}``. None: no plan ahead.
        outlier_weight: Softassign's slack entry w.
        sinkhorn_rounds: Softassign's Sinkhorn rounds per update.
        per_temperature: Softassign's pose updates per β.

    Raises:
        ValueError: naming ``approximation`` or ``method`` when not one of the above.

    """
    if approximation not in FORMS:
        raise ValueError("approximation: expected 'auto', 'exact' or 'approximate', got "
                         f"{approximation!r}")
    if method not in ("emicp", "softassign"):
        raise ValueError(f"method: expected 'emicp' or 'softassign', got {method!r}")
    if backend(source) != "cpu":
        return _exact(source, target.shape[1])
    from pointalign.kernels.soft import cpu as _soft_cpu

    return _soft_cpu.prepare(method, source, target, source_lengths, target_lengths,
                             iterations=iterations, approximation=approximation,
                             schedule=schedule, outlier_weight=outlier_weight,
                             sinkhorn_rounds=sinkhorn_rounds, per_temperature=per_temperature)


def soft_rows(
    query: torch.Tensor,
    points: torch.Tensor,
    transform: torch.Tensor,
    scale: torch.Tensor,
    *,
    query_lengths: torch.Tensor | None = None,
    point_lengths: torch.Tensor | None = None,
    point_log_weights: torch.Tensor | None = None,
    squares: bool = False,
) -> SoftRows:
    """Row reductions of ``exp(z_ij)``, ``z_ij = −s ||R q_i + t − p_j||² + g_j``.

    Args:
        query: ``(B, N, 3)`` float tensor q_i (moved by ``transform``).
        points: ``(B, M, 3)`` float tensor p_j, same dtype and device.
        transform: ``(B, 4, 4)`` float tensor ``[R, t]`` applied to the query.
        scale: ``(B,)`` float tensor s > 0 (1/(2σ²) for EM-ICP, β for Softassign).
        query_lengths: ``(B,)`` valid query rows per batch entry (default all).
        point_lengths: ``(B,)`` valid points per batch entry (default all).
        point_log_weights: optional ``(B, M)`` column log-offsets g_j (log Sinkhorn scalings).
        squares: also return ``lse2 = log Σ_j exp(2 z_ij)``.

    Returns:
        :class:`SoftRows`; ``lse`` in the query's dtype.

    Range: the Triton kernel computes in float32, where ``z − max z`` loses all precision
    once ``s · min_j d_ij²`` reaches about 1e8 (half an ulp is then ≥ 1 in log2 units): such
    a row, far from every point at that scale, reports no mass (``lse = −inf``, mean 0),
    never NaN or +inf. The references (and "cpu" in float64) keep its finite ``lse``.

    """
    ql, pl = check(query, points, transform, scale, query_lengths, point_lengths,
                   point_log_weights)
    return _exact(query, points.shape[1]).soft_rows(
        query, points, transform, scale, ql, pl, point_log_weights=point_log_weights,
        squares=squares)


def emicp_rows(
    source: torch.Tensor,
    target: torch.Tensor,
    transform: torch.Tensor,
    sigma2: torch.Tensor | None,
    log_outlier: torch.Tensor,
    *,
    source_lengths: torch.Tensor | None = None,
    target_lengths: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EM-ICP E-step (Granger & Pennec; Tamaki et al. eqs. 8-11), fused.

    With d_ij² = ||R x_i + t − y_j||², α_ij = exp(−d_ij²/σ²) / C_i,
    C_i = exp(log_outlier) + Σ_j exp(−d_ij²/σ²) (log_outlier = −d_0²/σ²):
    λ_i = Σ_j √α_ij and x'_i = Σ_j √α_ij y_j / λ_i.

    Args:
        source: ``(B, N, 3)`` source points x_i.
        target: ``(B, M, 3)`` target points y_j.
        transform: ``(B, 4, 4)`` T_target_source applied to the source.
        sigma2: ``(B,)`` σ² > 0, or None with ``scale``.
        log_outlier: ``(B,)`` −d₀²/σ² (may be ``-inf``: no outlier term).
        source_lengths: ``(B,)`` valid source points (default all).
        target_lengths: ``(B,)`` valid target points (default all).
        scale: optional ``(B,)`` precomputed 1/(2σ²) in the source's dtype, used instead
            of ``sigma2`` (which may then be None): saves a launch per iteration.

    Returns:
        ``(lam (B, N), x_prime (B, N, 3))``; padding rows have λ = 0.

    """
    if scale is None:
        if sigma2 is None:
            raise ValueError("sigma2: needed when scale is not given")
        scale = 0.5 / sigma2.to(source.dtype)
    ql, pl = check(source, target, transform, scale, source_lengths, target_lengths, None)
    return _exact(source, target.shape[1]).emicp_rows(source, target, transform, scale,
                                                      log_outlier, ql, pl)


def emicp_step(
    source: torch.Tensor,
    target: torch.Tensor,
    transform: torch.Tensor,
    scale: torch.Tensor,
    log_outlier: torch.Tensor,
    frozen: torch.Tensor,
    *,
    source_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One EM-ICP iteration: :func:`emicp_rows` then :func:`weighted_horn` on (x_i, x'_i, λ_i).

    On Triton the row kernels also write each row block's Horn moments, and one tiny
    kernel solves Horn from them (no second pass over the points, no casts, no masking
    launches): three launches per iteration. On the "cpu" backend the numba pass sums the
    moments on the host.

    Args:
        source: ``(B, N, 3)`` x_i.
        target: ``(B, M, 3)`` y_j (best as :attr:`Centred.points`: read without a copy).
        transform: ``(B, 4, 4)`` float64 current T_target_source.
        scale: ``(B,)`` 1/(2σ²).
        log_outlier: ``(B,)`` −d₀²/σ² (as :func:`emicp_rows`).
        frozen: ``(B,)`` bool: these entries keep ``transform``.
        source_lengths: ``(B,)`` valid source points.
        target_lengths: ``(B,)`` valid target points.

    Returns:
        ``(T (B, 4, 4) float64, valid (B,) bool, lam (B, N))``: entries that are frozen or
        have zero total weight (``valid`` False) keep ``transform``.

    """
    ql, pl = check(source, target, transform, scale, source_lengths, target_lengths, None)
    return _exact(source, target.shape[1]).emicp_step(source, target, transform, scale,
                                                      log_outlier, frozen, ql, pl)


def sinkhorn_scaling(
    query: torch.Tensor,
    points: torch.Tensor,
    transform: torch.Tensor,
    beta: torch.Tensor,
    point_log_weights: torch.Tensor,
    log_slack: torch.Tensor,
    offset: torch.Tensor,
    *,
    query_lengths: torch.Tensor | None = None,
    point_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Sinkhorn half-step for M = diag(r) K diag(c) with a slack entry, in logs.

    ``out_i = offset − log(exp(log_slack) + Σ_j exp(−β d_ij² + g_j))``: with
    ``g_j = log c_j + βα`` this is the new ``log r_i`` of a row normalisation (Tamaki
    eq. 5, with the outlier column's entry ``exp(log_slack)``); with the clouds swapped and
    the inverse transform it is a column normalisation (eq. 6). ``offset`` (B,) is added so
    the result can feed the next pass directly (pass βα).

    Returns:
        ``(B, N)`` in the query's dtype; padding rows are ``-inf``.

    """
    ql, pl = check(query, points, transform, beta, query_lengths, point_lengths,
                   point_log_weights)
    return _exact(query, points.shape[1]).sinkhorn_scaling(
        query, points, transform, beta, point_log_weights, log_slack, offset, ql, pl)


def _check_per_problem(source: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Refuse per-problem arguments that are not ``(B,)`` on the source's device."""
    B = source.shape[0]
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.shape != (B,):
            raise ValueError(f"{name}: expected a ({B},) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
        if t.device != source.device:
            raise ValueError(f"{name}: on {t.device}, source on {source.device}")


def _check_rounds(rounds: object) -> None:
    """Refuse Sinkhorn ``rounds`` that are not an integer >= 1."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds: expected an integer >= 1, got {rounds!r}")


def softassign_update(
    source: torch.Tensor,
    target: torch.Tensor,
    transform: torch.Tensor,
    beta: torch.Tensor,
    offset: torch.Tensor,
    log_slack: torch.Tensor,
    *,
    source_lengths: torch.Tensor | None = None,
    target_lengths: torch.Tensor | None = None,
    rounds: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Softassign pose update's Sinkhorn passes (Gold et al.; Tamaki et al. Alg. 2).

    ``rounds`` row and ``rounds − 1`` column normalisations (:func:`sinkhorn_scaling`),
    then the last column normalisation with the soft correspondences (:func:`soft_rows` of
    the target against the source, with T⁻¹ and the row log scalings); argument shapes as
    :meth:`Passes.softassign_update`, which states them.

    Returns:
        ``(lse (B, M), mean (B, M, 3))`` of the last pass, in the source's dtype.

    """
    sl, tl = check(source, target, transform, beta, source_lengths, target_lengths, None)
    _check_per_problem(source, offset=offset, log_slack=log_slack)
    _check_rounds(rounds)
    return _exact(source, target.shape[1]).softassign_update(
        source, target, transform, beta, offset, log_slack, sl, tl, rounds)


def softassign_step(
    source: torch.Tensor,
    target: torch.Tensor,
    transform: torch.Tensor,
    beta: torch.Tensor,
    offset: torch.Tensor,
    log_slack: torch.Tensor,
    frozen: torch.Tensor,
    *,
    source_lengths: torch.Tensor | None = None,
    target_lengths: torch.Tensor | None = None,
    rounds: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Softassign iteration: :func:`softassign_update`, the weights, weighted Horn.

    The column weights ``w_j = sigmoid(lse_j − log_slack)`` (the column sums of M; 0 on
    padding) and the Horn pose of ``(x'_j, y_j, w_j)``. On Triton the last column pass
    writes the weights and each row block's Horn moments, and one tiny kernel solves Horn
    from them (as :func:`emicp_step`). Arguments as :func:`softassign_update`, and
    ``frozen (B,) bool``: these entries keep ``transform``.

    Returns:
        ``(T (B, 4, 4) float64, valid (B,) bool, w (B, M))``: entries that are frozen or
        have zero total weight (``valid`` False) keep ``transform``.

    """
    sl, tl = check(source, target, transform, beta, source_lengths, target_lengths, None)
    _check_per_problem(source, offset=offset, log_slack=log_slack, frozen=frozen)
    _check_rounds(rounds)
    return _exact(source, target.shape[1]).softassign_step(
        source, target, transform, beta, offset, log_slack, frozen, sl, tl, rounds)


def nearest_d2(
    query: torch.Tensor,
    points: torch.Tensor,
    transform: torch.Tensor,
    max_d2: torch.Tensor,
    *,
    query_lengths: torch.Tensor | None = None,
    point_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Squared distance of each moved query to its nearest point (the fitness pass).

    Args:
        query: ``(B, N, 3)`` float tensor, moved by ``transform``.
        points: ``(B, M, 3)`` float tensor.
        transform: ``(B, 4, 4)`` applied to the query.
        max_d2: ``(B,)`` the squared distance that matters: answers beyond it only need to
            be beyond it.
        query_lengths: ``(B,)`` valid queries (default all).
        point_lengths: ``(B,)`` valid points (default all).

    Returns:
        ``(B, N)`` float64. On the "cpu" backend exact (a k-d tree; ``inf`` beyond
        ``max_d2`` and on padding rows); elsewhere the soft minimum of one pass, at most
        ``log(M) max_d2 / FITNESS_SCALE`` below the nearest squared distance.

    """
    if max_d2.shape != (query.shape[0],):
        raise ValueError(f"max_d2: expected shape ({query.shape[0]},), got {tuple(max_d2.shape)}")
    ql, pl = check(query, points, transform, max_d2.to(query.device), query_lengths,
                   point_lengths, None)
    return _exact(query, points.shape[1]).nearest_d2(query, points, transform, max_d2, ql, pl)


def point_layout(points: torch.Tensor) -> torch.Tensor:
    """``points (B, M, 3)`` in the layout the backend's row kernels read fastest.

    On Triton a float32 view of coordinate-contiguous storage (converted once here, not in
    every pass); elsewhere ``points`` itself. Values are unchanged.
    """
    if backend(points) == "triton":
        from pointalign.kernels.soft import triton as _soft_triton

        return _soft_triton.soa(points)
    return points


def _cull_min_points() -> int:
    from pointalign.kernels.soft import triton as _soft_triton

    return _soft_triton.CULL_MIN_POINTS


class Centred(NamedTuple):
    """A padded batch of clouds centred on their centroids, ready for repeated passes.

    ``points (B, N, 3)`` ``x_i − c`` in the input's dtype (padding rows 0) in the layout
    and row order the backend's row kernels read fastest (:func:`point_layout`,
    :func:`centre`), usable as query or points; ``lengths (B,)``; ``center (B, 3)``
    float64 centroids c; ``scatter (B, 3, 3)`` float64 ``Σ_i (x_i − c)(x_i − c)ᵀ`` over
    the valid rows.
    """

    points: torch.Tensor
    lengths: torch.Tensor
    center: torch.Tensor
    scatter: torch.Tensor


def centre(points: torch.Tensor, lengths: torch.Tensor, *, layout: bool = True) -> Centred:
    """Centre ``points (B, N, 3)`` (``lengths (B,)`` valid rows) once for many passes.

    The moments are taken in float64; the layout is chosen here, once, so that the passes
    over the cloud read it without a conversion (``layout=False`` keeps rows of xyz: a
    cloud that is only ever the query side of EM-ICP's row pass reads faster so). On
    Triton a cloud of at least ``triton.CULL_MIN_POINTS`` points also has its valid rows
    put in Morton order (:func:`~pointalign.kernels.grid.morton_order_rows`): the row
    kernel's tiles of points and blocks of rows are then compact, which lets a pass leave
    out the tiles too far to count (``triton._cull_kernel``). Every soft pass sums over
    rows or over points, so the order changes no result beyond rounding;
    :attr:`Centred.points` rows are a permutation of the input's. No host reads (safe
    inside a CUDA graph).
    """
    rows = row_mask(lengths, points.shape[1])[..., None]
    p = points.to(torch.float64)
    c = torch.where(rows, p, 0.0).sum(1) / lengths.to(torch.float64).clamp_min(1)[:, None]
    d = torch.where(rows, p - c[:, None], 0.0)
    if backend(points) == "triton" and points.shape[1] >= _cull_min_points():
        order = morton_order_rows(d, lengths)
        d = d.gather(1, order[..., None].expand(-1, -1, 3))
    d32 = d.to(points.dtype)
    return Centred(point_layout(d32) if layout else d32, lengths, c, d.transpose(1, 2) @ d)
