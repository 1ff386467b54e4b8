"""Fused soft-correspondence reductions (EM-ICP / Softassign E-step) and their reference.

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

* :func:`soft_rows`: the raw reductions (lse, lse2, mean).
* :func:`emicp_rows`: EM-ICP weights λ_i = Σ_j √α_ij and x'_i (Granger & Pennec).
* :func:`sinkhorn_scaling`: one Sinkhorn half-step in log scalings (Gold et al.).
* :func:`emicp_step`: one whole EM-ICP iteration (E-step and Horn), fused on Triton.
* :func:`centre`: a cloud centred once, with its moments, in the layout the passes read.

Dispatch via :func:`pointalign.kernels._backend.backend`: Triton kernels from
``_soft_triton.py`` on CUDA (and through the interpreter under ``TRITON_INTERPRET=1``),
the chunked PyTorch reference below otherwise. Reference: T. Tamaki et al., "Softassign and
EM-ICP on GPU", 2010; S. Granger and X. Pennec, ECCV 2002; S. Gold et al., Pattern
Recognition 1998.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from pointalign.kernels._backend import backend
from pointalign.kernels.horn import horn_from_sums, weighted_horn

#: Pairs per tile of the reference (a few temporaries of this many elements exist at once).
TILE_PAIRS = 1 << 20


class SoftRows(NamedTuple):
    """Row reductions of ``exp(z_ij)``: lse, lse2 and mean.

    ``lse (B, N)``, ``lse2 (B, N)`` or None, ``mean (B, N, 3)``; padding rows hold -inf / 0.
    """

    lse: torch.Tensor
    lse2: torch.Tensor | None
    mean: torch.Tensor


def _check(query, points, transform, scale, query_lengths, point_lengths, point_log_weights):
    if query.dim() != 3 or query.shape[-1] != 3:
        raise ValueError(f"query: expected shape (B, N, 3), got {tuple(query.shape)}")
    if points.dim() != 3 or points.shape[-1] != 3 or points.shape[0] != query.shape[0]:
        raise ValueError(f"points: expected shape ({query.shape[0]}, M, 3), got "
                         f"{tuple(points.shape)}")
    B = query.shape[0]
    if transform.shape != (B, 4, 4):
        raise ValueError(f"transform: expected shape ({B}, 4, 4), got {tuple(transform.shape)}")
    if scale.shape != (B,):
        raise ValueError(f"scale: expected shape ({B},), got {tuple(scale.shape)}")
    if point_log_weights is not None and point_log_weights.shape != points.shape[:2]:
        raise ValueError(f"point_log_weights: expected shape {tuple(points.shape[:2])}, got "
                         f"{tuple(point_log_weights.shape)}")
    for name, t in (("points", points), ("transform", transform), ("scale", scale)):
        if t.device != query.device:
            raise ValueError(f"{name}: on {t.device}, query on {query.device}")
    B, N, M = query.shape[0], query.shape[1], points.shape[1]
    ql = torch.full((B,), N, dtype=torch.int64, device=query.device) if query_lengths is None \
        else query_lengths.to(device=query.device, dtype=torch.int64)
    pl = torch.full((B,), M, dtype=torch.int64, device=query.device) if point_lengths is None \
        else point_lengths.to(device=query.device, dtype=torch.int64)
    return ql, pl


def _use_triton(x: torch.Tensor) -> bool:
    return backend(x) in ("triton", "interpret")


def _use_cpu(x: torch.Tensor, approximation: Any) -> bool:
    """Tell whether a :func:`cpu_plan` is given and ``x`` runs on the numba "cpu" backend."""
    return approximation is not None and backend(x) == "cpu"


# --------------------------------------------------------------------------------------
# reference (the CPU path and the spec)
# --------------------------------------------------------------------------------------


def soft_rows_reference(
    query: torch.Tensor,
    points: torch.Tensor,
    transform: torch.Tensor,
    scale: torch.Tensor,
    *,
    query_lengths: torch.Tensor | None = None,
    point_lengths: torch.Tensor | None = None,
    point_log_weights: torch.Tensor | None = None,
    squares: bool = False,
    tile_pairs: int = TILE_PAIRS,
) -> SoftRows:
    """Chunked PyTorch reference of :func:`soft_rows` (never more than a tile of N×M).

    Computes in the query's dtype; online log-sum-exp over point chunks.
    """
    ql, pl = _check(query, points, transform, scale, query_lengths, point_lengths,
                    point_log_weights)
    B, N = query.shape[0], query.shape[1]
    dt, dev = query.dtype, query.device
    lse = torch.full((B, N), -math.inf, dtype=dt, device=dev)
    lse2 = torch.full((B, N), -math.inf, dtype=dt, device=dev) if squares else None
    mean = torch.zeros((B, N, 3), dtype=dt, device=dev)
    T = transform.to(dt)
    ql_h, pl_h = ql.tolist(), pl.tolist()
    for b in range(B):
        nq, npt = ql_h[b], pl_h[b]
        if nq == 0 or npt == 0:
            continue
        q = query[b, :nq] @ T[b, :3, :3].T + T[b, :3, 3]
        p = points[b, :npt]
        g = None if point_log_weights is None else point_log_weights[b, :npt].to(dt)
        s = scale[b].to(dt)
        bm = max(1, min(npt, tile_pairs))
        bn = max(1, min(nq, tile_pairs // bm))
        for i0 in range(0, nq, bn):
            qi = q[i0:i0 + bn]
            run_m = torch.full((qi.shape[0],), -math.inf, dtype=dt, device=dev)
            l1 = torch.zeros_like(run_m)
            l2 = torch.zeros_like(run_m)
            u = torch.zeros((qi.shape[0], 3), dtype=dt, device=dev)
            for j0 in range(0, npt, bm):
                pj = p[j0:j0 + bm]
                # squared distance from coordinate differences, one coordinate at a time
                z = (qi[:, 0:1] - pj[None, :, 0]).square_()
                z += (qi[:, 1:2] - pj[None, :, 1]).square_()
                z += (qi[:, 2:3] - pj[None, :, 2]).square_()
                z.mul_(-s)
                if g is not None:
                    z += g[None, j0:j0 + bm]
                m_new = torch.maximum(run_m, z.amax(1))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                alpha = torch.exp(run_m - m_safe)
                e = z.sub_(m_safe[:, None]).exp_()
                l1 = l1 * alpha + e.sum(1)
                if squares:
                    l2 = l2 * alpha * alpha + (e * e).sum(1)
                u = u * alpha[:, None] + e @ pj
                run_m = m_new
            lse[b, i0:i0 + qi.shape[0]] = run_m + torch.log(l1)
            if lse2 is not None:
                lse2[b, i0:i0 + qi.shape[0]] = 2 * run_m + torch.log(l2)
            mean[b, i0:i0 + qi.shape[0]] = torch.where(
                l1[:, None] > 0, u / l1.clamp_min(torch.finfo(dt).tiny)[:, None],
                torch.zeros_like(u))
    return SoftRows(lse, lse2, mean)


# --------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------


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
    approximation: Any = None,
    offset: torch.Tensor | None = None,
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
        approximation: a :func:`cpu_plan` (used on the "cpu" backend only); None: reference.
        offset: ``(B,)`` the logits' known shift (Softassign's βα), for the plan's
            truncation rule (pairs with ``s d² > k²/2 + offset`` dropped); None: 0.

    Returns:
        :class:`SoftRows`; ``lse`` in the query's dtype.

    """
    ql, pl = _check(query, points, transform, scale, query_lengths, point_lengths,
                    point_log_weights)
    if _use_cpu(query, approximation):
        from pointalign.kernels.soft import cpu as _soft_cpu

        return SoftRows(*_soft_cpu.soft_rows(query, points, transform, scale, ql, pl,
                                             point_log_weights, squares, offset,
                                             approximation))
    if _use_triton(query):
        from pointalign.kernels.soft import triton as _soft_triton

        lse, lse2, mean = _soft_triton.rows(query, points, transform, scale, ql, pl,
                                            point_log_weights, None, mode="raw",
                                            squares=squares)
        return SoftRows(lse, lse2, mean)
    return soft_rows_reference(query, points, transform, scale, query_lengths=ql,
                               point_lengths=pl, point_log_weights=point_log_weights,
                               squares=squares)


def _row_mask(lengths: torch.Tensor, n: int) -> torch.Tensor:
    return torch.arange(n, device=lengths.device)[None, :] < lengths[:, None]


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
    approximation: Any = None,
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
        approximation: a :func:`cpu_plan` (used on the "cpu" backend only: the numba
            passes in the plan's form); None: the reference.

    Returns:
        ``(lam (B, N), x_prime (B, N, 3))``; padding rows have λ = 0.

    """
    if scale is None:
        if sigma2 is None:
            raise ValueError("sigma2: needed when scale is not given")
        scale = 0.5 / sigma2.to(source.dtype)
    ql, pl = _check(source, target, transform, scale, source_lengths, target_lengths, None)
    if _use_cpu(source, approximation):
        from pointalign.kernels.soft import cpu as _soft_cpu

        return _soft_cpu.emicp_rows(source, target, transform, scale, log_outlier, ql, pl,
                                    approximation)
    if _use_triton(source):
        from pointalign.kernels.soft import triton as _soft_triton

        w, _, mean = _soft_triton.rows(source, target, transform, scale, ql, pl, None,
                                    log_outlier, mode="emicp", squares=True)
        return w, mean
    r = soft_rows_reference(source, target, transform, scale, query_lengths=ql,
                            point_lengths=pl, squares=True)
    assert r.lse2 is not None  # squares=True
    return emicp_weights(r.lse, r.lse2, log_outlier.to(r.lse.dtype)), r.mean


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
    approximation: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One EM-ICP iteration: :func:`emicp_rows` then :func:`weighted_horn` on (x_i, x'_i, λ_i).

    On Triton the row kernels also write each row block's Horn moments, and one tiny
    kernel solves Horn from them (no second pass over the points, no casts, no masking
    launches): three launches per iteration.

    Args:
        source: ``(B, N, 3)`` x_i.
        target: ``(B, M, 3)`` y_j (best as :attr:`Centred.points`: read without a copy).
        transform: ``(B, 4, 4)`` float64 current T_target_source.
        scale: ``(B,)`` 1/(2σ²).
        log_outlier: ``(B,)`` −d₀²/σ² (as :func:`emicp_rows`).
        frozen: ``(B,)`` bool: these entries keep ``transform``.
        source_lengths: ``(B,)`` valid source points.
        target_lengths: ``(B,)`` valid target points.
        approximation: a :func:`cpu_plan` or None (see :func:`emicp_rows`).

    Returns:
        ``(T (B, 4, 4) float64, valid (B,) bool, lam (B, N))``: entries that are frozen or
        have zero total weight (``valid`` False) keep ``transform``.

    """
    if _use_triton(source):
        from pointalign.kernels.horn import triton as _horn_triton
        from pointalign.kernels.soft import triton as _soft_triton

        lam, mom, _ = _soft_triton.rows(source, target, transform, scale, source_lengths,
                                        target_lengths, None, log_outlier, mode="emicp",
                                        squares=True, moments=True)
        T, valid = _horn_triton.horn_from_parts(mom, transform.to(torch.float64), frozen)
        return T, valid, lam
    if _use_cpu(source, approximation):
        from pointalign.kernels.soft import cpu as _soft_cpu

        _check(source, target, transform, scale, source_lengths, target_lengths, None)
        lam, *moments = _soft_cpu.emicp_moments(source, target, transform, scale, log_outlier,
                                                source_lengths, target_lengths, approximation)
        T_new, valid = horn_from_sums(*moments)
    else:
        lam, xp = emicp_rows(source, target, transform, None, log_outlier, scale=scale,
                             source_lengths=source_lengths, target_lengths=target_lengths,
                             approximation=approximation)
        T_new, valid = weighted_horn(source, xp, lam)
    keep = valid & ~frozen
    return torch.where(keep[:, None, None], T_new, transform.to(torch.float64)), valid, lam


def cpu_plan(n: int, m: int, passes: int, **kw: Any):
    """Choose the CPU form of a soft method's passes up front (:func:`._soft_cpu.plan`).

    Returns a Plan to pass as ``approximation=`` to :func:`emicp_step`, :func:`emicp_rows`,
    :func:`soft_rows` and :func:`sinkhorn_scaling` (it holds the run's trees and cells:
    one plan per run); ``plan.info()`` goes into ``result.info["approximation"]``.
    ``plan.estimate_s`` is the predicted time of the chosen form, ``plan.exact_estimate_s``
    the exact one's. Without numba (backend "torch") the plan is ignored: the reference.
    """
    from pointalign.kernels.soft import cpu as _soft_cpu

    return _soft_cpu.plan(n, m, passes, **kw)


def point_layout(points: torch.Tensor) -> torch.Tensor:
    """``points (B, M, 3)`` in the layout the backend's row kernels read fastest.

    On Triton a float32 view of coordinate-contiguous storage (converted once here, not in
    every pass); elsewhere ``points`` itself. Values are unchanged.
    """
    if backend(points) == "triton":
        from pointalign.kernels.soft import triton as _soft_triton

        return _soft_triton.soa(points)
    return points


class Centred(NamedTuple):
    """A padded batch of clouds centred on their centroids, ready for repeated passes.

    ``points (B, N, 3)`` float32 ``x_i − c`` (padding rows 0) in the layout the backend's row
    kernels read fastest (:func:`point_layout`), usable as query or points; ``lengths (B,)``;
    ``center (B, 3)`` float64 centroids c; ``scatter (B, 3, 3)`` float64
    ``Σ_i (x_i − c)(x_i − c)ᵀ`` over the valid rows.
    """

    points: torch.Tensor
    lengths: torch.Tensor
    center: torch.Tensor
    scatter: torch.Tensor


def centre(points: torch.Tensor, lengths: torch.Tensor, *, layout: bool = True) -> Centred:
    """Centre ``points (B, N, 3)`` (``lengths (B,)`` valid rows) once for many passes.

    The moments are taken in float64; the layout is chosen here, once, so that the passes
    over the cloud (:func:`soft_rows`, :func:`emicp_step`, :func:`sinkhorn_scaling`) read it
    without a conversion (``layout=False`` keeps rows of xyz: a cloud that is only ever
    the query side of EM-ICP's row pass reads faster so). No host reads (safe inside a
    CUDA graph).
    """
    rows = _row_mask(lengths, points.shape[1])[..., None]
    p = points.to(torch.float64)
    c = torch.where(rows, p, 0.0).sum(1) / lengths.to(torch.float64).clamp_min(1)[:, None]
    d = torch.where(rows, p - c[:, None], 0.0)
    d32 = d.to(points.dtype)
    return Centred(point_layout(d32) if layout else d32, lengths, c, d.transpose(1, 2) @ d)


def emicp_weights(lse: torch.Tensor, lse2: torch.Tensor, log_outlier: torch.Tensor):
    """EM-ICP row weights from :func:`soft_rows` output at scale 1/(2σ²).

    λ_i = exp(lse_i − ½ log(exp(log_outlier) + exp(lse2_i))); −inf rows give 0.
    """
    log_c = torch.logaddexp(lse2, log_outlier[:, None].expand_as(lse2))
    log_c = torch.where(torch.isinf(log_c), torch.zeros_like(log_c), log_c)
    return torch.exp(lse - 0.5 * log_c)


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
    approximation: Any = None,
) -> torch.Tensor:
    """One Sinkhorn half-step for M = diag(r) K diag(c) with a slack entry, in logs.

    ``out_i = offset − log(exp(log_slack) + Σ_j exp(−β d_ij² + g_j))``: with
    ``g_j = log c_j + βα`` this is the new ``log r_i`` of a row normalisation (Tamaki
    eq. 5, with the outlier column's entry ``exp(log_slack)``); with the clouds swapped and
    the inverse transform it is a column normalisation (eq. 6). ``offset`` (B,) is added so
    the result can feed the next pass directly (pass βα).

    ``approximation``: a :func:`cpu_plan` (the "cpu" backend only; its truncation drops
    the pairs with ``β d² > k²/2 + offset``); None: the reference.

    Returns:
        ``(B, N)`` in the query's dtype; padding rows are ``-inf``.

    """
    ql, pl = _check(query, points, transform, beta, query_lengths, point_lengths,
                    point_log_weights)
    if _use_triton(query):
        from pointalign.kernels.soft import triton as _soft_triton

        return _soft_triton.rows(query, points, transform, beta.to(query.dtype), ql, pl,
                                 point_log_weights, log_slack, mode="sinkhorn",
                                 offset=offset)[0]
    if _use_cpu(query, approximation):
        r = soft_rows(query, points, transform, beta.to(query.dtype), query_lengths=ql,
                      point_lengths=pl, point_log_weights=point_log_weights,
                      approximation=approximation, offset=offset)
    else:
        r = soft_rows_reference(query, points, transform, beta.to(query.dtype),
                                query_lengths=ql, point_lengths=pl,
                                point_log_weights=point_log_weights)
    out = offset.to(r.lse.dtype)[:, None] - torch.logaddexp(
        r.lse, log_slack.to(r.lse.dtype)[:, None].expand_as(r.lse))
    return torch.where(_row_mask(ql, query.shape[1]), out, torch.full_like(out, -math.inf))
