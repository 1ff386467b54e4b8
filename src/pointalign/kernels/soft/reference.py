"""The soft family's spec: the PyTorch reference of every pass, and what the backends share.

Every pass is a row reduction of ``exp(z_ij)``, ``z_ij = −s ||R q_i + t − p_j||² + g_j``
over tiles of (query × points), never more than a tile of the N×M matrix at once, with a
running maximum per row (the online log-sum-exp): no NaN whatever the scale.

:class:`Passes` is the exact form of one run's passes in PyTorch; the backends subclass it
(``triton.TritonPasses``, ``cpu.CpuPasses``) and replace the passes they run faster or in
another form. Its :meth:`Passes.softassign_update` (the per-pass loop of one Softassign
update, :func:`softassign_passes`) and :meth:`Passes.nearest_d2` (the fitness pass) are
written once here over the passes of ``self``. This module imports no backend.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from pointalign import _math
from pointalign.kernels.horn import horn_reference, weighted_horn

#: Pairs per tile of the reference (a few temporaries of this many elements exist at once).
TILE_PAIRS = 1 << 20
#: The fitness pass off the CPU: the soft minimum ``−lse/s`` at ``s = FITNESS_SCALE / max_d2``
#: is below the nearest squared distance by at most ``log(M) max_d2 / FITNESS_SCALE``.
FITNESS_SCALE = 1e4


class SoftRows(NamedTuple):
    """Row reductions of ``exp(z_ij)``: lse, lse2 and mean.

    ``lse (B, N)``, ``lse2 (B, N)`` or None, ``mean (B, N, 3)``; padding rows hold -inf / 0.
    """

    lse: torch.Tensor
    lse2: torch.Tensor | None
    mean: torch.Tensor


def check(query, points, transform, scale, query_lengths, point_lengths, point_log_weights):
    """Check a pass's arguments (ValueError naming the argument); return ``(ql, pl)`` int64.

    Shapes as :func:`pointalign.kernels.soft.soft_rows`; lengths None: every row.
    """
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
    return lengths_or_all(query_lengths, query), lengths_or_all(point_lengths, points)


def lengths_or_all(lengths: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """``lengths (B,)`` as int64 on ``x``'s device; None: every row of ``x (B, N, 3)``."""
    if lengths is None:
        return torch.full((x.shape[0],), x.shape[1], dtype=torch.int64, device=x.device)
    return lengths.to(device=x.device, dtype=torch.int64)


def row_mask(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """``(B, n)`` bool: the valid rows of a padded batch with ``lengths (B,)``."""
    return torch.arange(n, device=lengths.device)[None, :] < lengths[:, None]


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
    """Chunked PyTorch reference of :func:`pointalign.kernels.soft.soft_rows`.

    Computes in the query's dtype; online log-sum-exp over point chunks; never more than
    ``tile_pairs`` pairs of the N×M matrix at once.
    """
    ql, pl = check(query, points, transform, scale, query_lengths, point_lengths,
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


def emicp_weights(lse: torch.Tensor, lse2: torch.Tensor, log_outlier: torch.Tensor):
    """EM-ICP row weights from :func:`soft_rows_reference` output at scale 1/(2σ²).

    λ_i = exp(lse_i − ½ log(exp(log_outlier) + exp(lse2_i))); −inf rows give 0.
    """
    log_c = torch.logaddexp(lse2, log_outlier[:, None].expand_as(lse2))
    log_c = torch.where(torch.isinf(log_c), torch.zeros_like(log_c), log_c)
    return torch.exp(lse - 0.5 * log_c)


def sinkhorn_normalise(lse: torch.Tensor, offset: torch.Tensor, log_slack: torch.Tensor,
                       lengths: torch.Tensor) -> torch.Tensor:
    """Return a Sinkhorn half-step's new log scalings from a pass's row sums (eqs. 5-6).

    ``out_i = offset − log(exp(log_slack) + exp(lse_i))`` for ``lse (B, N)``, ``offset``
    and ``log_slack (B,)``; ``-inf`` on the rows beyond ``lengths (B,)``.
    """
    out = offset.to(lse.dtype)[:, None] - torch.logaddexp(
        lse, log_slack.to(lse.dtype)[:, None].expand_as(lse))
    return torch.where(row_mask(lengths, lse.shape[1]), out, torch.full_like(out, -math.inf))


def softassign_weights(lse: torch.Tensor, log_slack: torch.Tensor) -> torch.Tensor:
    """Softassign's column weights ``w_j = c_j Σ_i K_ij r_i = sigmoid(lse_j − log slack)``.

    ``lse (B, M)`` of the last column pass, ``log_slack (B,)``; 0 on padding columns (whose
    lse is −inf).
    """
    return torch.nan_to_num(torch.sigmoid(lse - log_slack.to(lse.dtype)[:, None]), nan=0.0)


def softassign_row_scalings(passes: Passes, source, target, transform, beta, offset,
                            log_slack, source_lengths, target_lengths, rounds: int):
    """Return the log row scalings ``(B, N)`` of an update's Sinkhorn rounds (not its last pass).

    ``rounds`` row normalisations of M = diag(r) K diag(c) (c = 1 at first) and ``rounds − 1``
    column ones (:meth:`Passes.sinkhorn_scaling`; the column passes move the target by
    ``passes.inverse(transform)``). Arguments as :meth:`Passes.softassign_update`.
    """
    inverse = passes.inverse(transform)     # the column passes move the target by T⁻¹
    g_col = offset[:, None].expand(-1, target.shape[1])                 # log c + βα, c = 1
    g_row = g_col
    for s in range(rounds):                                               # eqs. 5-6, in logs
        g_row = passes.sinkhorn_scaling(source, target, transform, beta, g_col, log_slack,
                                        offset, source_lengths, target_lengths)
        if s + 1 < rounds:
            g_col = passes.sinkhorn_scaling(target, source, inverse, beta, g_row, log_slack,
                                            offset, target_lengths, source_lengths)
    return g_row


def softassign_passes(passes: Passes, source, target, transform, beta, offset, log_slack,
                      source_lengths, target_lengths, rounds: int):
    """One Softassign update's Sinkhorn passes, one by one, with ``passes``' passes.

    :func:`softassign_row_scalings`, then the last column normalisation with the soft
    correspondences in one pass (:meth:`Passes.soft_rows`). Arguments as
    :meth:`Passes.softassign_update`.
    """
    g_row = softassign_row_scalings(passes, source, target, transform, beta, offset,
                                    log_slack, source_lengths, target_lengths, rounds)
    # last column normalisation and x'_j = Σ_i m_ij x_i / Σ_i m_ij in one pass
    r = passes.soft_rows(target, source, passes.inverse(transform), beta, target_lengths,
                         source_lengths, point_log_weights=g_row, offset=offset)
    return r.lse, r.mean


@dataclass(frozen=True)
class Passes:
    """The passes of one soft-method run: here the exact ones, in PyTorch (the spec).

    :func:`pointalign.kernels.soft.prepare` returns this or a backend's subclass; the
    algorithm calls its methods and never asks which. Arguments are trusted (the module
    functions of :mod:`pointalign.kernels.soft` check them): ``(B, N, 3)`` query or source,
    ``(B, M, 3)`` points or target (padded), ``(B, 4, 4)`` transforms, ``(B,)`` scales,
    ``(B,)`` int64 lengths (None: every row).

    Attributes:
        device: the tensors' device (a string: a CUDA graph of the program that holds this
            object is keyed by value).

    """

    device: str = "cpu"

    @property
    def host(self) -> bool:
        """The passes run on the host, one call per iteration: a progress bar can follow."""
        return torch.device(self.device).type == "cpu"

    @property
    def estimate_s(self) -> float | None:
        """Predicted seconds of the run's passes where the backend can tell; else None."""
        return None

    @property
    def exact_estimate_s(self) -> float | None:
        """Predicted seconds of the exact form's passes where the backend can tell."""
        return None

    @property
    def form(self) -> str:
        """The form of the passes: "exact" here (see ``cpu.CpuPasses``)."""
        return "exact"

    def info(self) -> dict:
        """Return the record for ``result.info["approximation"]`` (JSON-safe)."""
        return {"mode": "exact", "device": self.device}

    def running(self) -> contextlib.AbstractContextManager:
        """Return the context the whole run executes in (threads); nothing here."""
        return contextlib.nullcontext()

    def soft_rows(self, query, points, transform, scale, query_lengths=None,
                  point_lengths=None, *, point_log_weights=None, squares=False,
                  offset=None) -> SoftRows:
        """Row reductions (:func:`pointalign.kernels.soft.soft_rows`).

        ``offset (B,)``: the logits' known shift (Softassign's βα), for a form that drops
        pairs relative to it; the exact form ignores it.
        """
        return soft_rows_reference(query, points, transform, scale, query_lengths=query_lengths,
                                   point_lengths=point_lengths,
                                   point_log_weights=point_log_weights, squares=squares)

    def emicp_rows(self, source, target, transform, scale, log_outlier, source_lengths=None,
                   target_lengths=None):
        """EM-ICP's ``(λ (B, N), x' (B, N, 3))`` (:func:`pointalign.kernels.soft.emicp_rows`)."""
        r = soft_rows_reference(source, target, transform, scale, query_lengths=source_lengths,
                                point_lengths=target_lengths, squares=True)
        assert r.lse2 is not None  # squares=True
        return emicp_weights(r.lse, r.lse2, log_outlier.to(r.lse.dtype)), r.mean

    def emicp_step(self, source, target, transform, scale, log_outlier, frozen,
                   source_lengths=None, target_lengths=None):
        """One EM-ICP iteration (:func:`pointalign.kernels.soft.emicp_step`)."""
        lam, xp = self.emicp_rows(source, target, transform, scale, log_outlier,
                                  source_lengths, target_lengths)
        T_new, valid = horn_reference(source, xp, lam)
        return keep_frozen(T_new, valid, frozen, transform), valid, lam

    def sinkhorn_scaling(self, query, points, transform, beta, point_log_weights, log_slack,
                         offset, query_lengths=None, point_lengths=None) -> torch.Tensor:
        """One Sinkhorn half-step (:func:`pointalign.kernels.soft.sinkhorn_scaling`)."""
        ql = lengths_or_all(query_lengths, query)
        r = self.soft_rows(query, points, transform, beta.to(query.dtype), ql, point_lengths,
                           point_log_weights=point_log_weights, offset=offset)
        return sinkhorn_normalise(r.lse, offset, log_slack, ql)

    def softassign_update(self, source, target, transform, beta, offset, log_slack,
                          source_lengths, target_lengths, rounds: int):
        """One Softassign pose update's passes: ``(lse (B, M), mean (B, M, 3))`` of the last.

        Args:
            source: ``(B, N, 3)`` x (the row passes' queries).
            target: ``(B, M, 3)`` y.
            transform: ``(B, 4, 4)`` float64 pose T applied to the source (the column
                passes move the target by T⁻¹, :meth:`inverse`).
            beta: ``(B,)`` β.
            offset: ``(B,)`` βα (every logit's shift, also the first column log weights).
            log_slack: ``(B,)`` log of the slack entry.
            source_lengths: ``(B,)`` valid source points.
            target_lengths: ``(B,)`` valid target points.
            rounds: Sinkhorn rounds (≥ 1).

        Returns:
            the last column pass of :func:`softassign_passes`: ``lse`` of ``Σ_i K_ij r_i``
            and the soft correspondences ``mean``, in the source's dtype.

        """
        return softassign_passes(self, source, target, transform, beta, offset, log_slack,
                                 source_lengths, target_lengths, rounds)

    def softassign_step(self, source, target, transform, beta, offset, log_slack, frozen,
                        source_lengths, target_lengths, rounds: int):
        """One Softassign iteration: the update's passes, the weights, Horn.

        :meth:`softassign_update`, the column weights (:func:`softassign_weights`) and the
        weighted Horn pose of ``(x'_j, y_j, w_j)``
        (:func:`pointalign.kernels.horn.weighted_horn`); arguments as
        :meth:`softassign_update`, and ``frozen (B,) bool``: these entries keep
        ``transform``.

        Returns:
            ``(T (B, 4, 4) float64, valid (B,) bool, w (B, M))``: entries that are frozen
            or have zero total weight (``valid`` False) keep ``transform``.

        """
        lse, mean = self.softassign_update(source, target, transform, beta, offset, log_slack,
                                           source_lengths, target_lengths, rounds)
        w = softassign_weights(lse, log_slack)
        T_new, valid = weighted_horn(mean, target, w)
        return keep_frozen(T_new, valid, frozen, transform), valid, w

    def inverse(self, transform: torch.Tensor) -> Any:
        """T⁻¹ of ``transform (B, 4, 4)`` as these passes take a pose: here the matrix.

        A backend may return another form its passes read (the Triton passes: T itself,
        marked to be inverted inside the row kernel, which saves the launches of an
        inverse per update).
        """
        return _math.invert_rigid(transform)

    def nearest_d2(self, query, points, transform, max_d2, query_lengths=None,
                   point_lengths=None) -> torch.Tensor:
        """Squared distance ``(B, N)`` float64 of each moved query to its nearest point.

        Here the soft minimum ``−lse/s`` of one pass at ``s = FITNESS_SCALE / max_d2``
        (``max_d2 (B,)``): at most ``log(M) max_d2 / FITNESS_SCALE`` below the nearest
        squared distance, never above it, clamped at 0 (:func:`.nearest_d2`'s contract).
        """
        big = FITNESS_SCALE / max_d2.clamp_min(1e-30)
        r = self.soft_rows(query, points, transform, big.to(torch.float32), query_lengths,
                           point_lengths)
        return (-r.lse.double() / big[:, None]).clamp_min(0)


def keep_frozen(T_new: torch.Tensor, valid: torch.Tensor, frozen: torch.Tensor,
                transform: torch.Tensor) -> torch.Tensor:
    """``T_new (B, 4, 4)`` where valid and not frozen, else ``transform`` (float64)."""
    keep = valid & ~frozen
    return torch.where(keep[:, None, None], T_new, transform.to(torch.float64))
