"""The ransac family's spec: the PyTorch references and the constants both backends share.

Each function here is the plain statement of an entry point of
:mod:`pointalign.kernels.ransac` (the contracts are in that module's docstring); the
dispatcher runs these on the "torch" backend and on devices without a fused kernel, and the
tests compare the CPU kernels (``cpu.py``, ``score_cpu.py``) against them. Nothing here
imports the dispatcher or a backend.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pointalign import _validate

#: feature-distance entries per chunk of :func:`feature_knn_reference`
CHUNK_ENTRIES = 1 << 24
#: the widest k the Triton feature kernel serves (``triton.py``: each lane keeps its two
#: nearest; RANSAC's ratio test asks 2, the backward matches 1; larger k: the reference)
MAX_TRITON_FEATURE_K = 2
#: queries per call of the index when :func:`score_transforms_reference` scores many motions
SCORE_QUERIES = 1 << 21


def feature_knn_reference(query: torch.Tensor, ref: torch.Tensor,
                          k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked ``cdist`` + ``topk``: the k nearest rows of ``ref (M, D)`` per ``query (N, D)``.

    Returns ``(dists_sq (N, k), idx (N, k) int64)``, ascending, the squared distances
    clamped at 0; the ``N × M`` matrix exists one chunk of :data:`CHUNK_ENTRIES` at a time.
    """
    n, m = query.shape[0], ref.shape[0]
    d_out = torch.empty(n, k, dtype=query.dtype, device=query.device)
    i_out = torch.empty(n, k, dtype=torch.int64, device=query.device)
    step = max(1, CHUNK_ENTRIES // max(m, 1))
    for s in range(0, n, step):
        e = min(n, s + step)
        d = torch.cdist(query[s:e], ref).square_()
        vals, idx = torch.topk(d, k, dim=1, largest=False, sorted=True)
        d_out[s:e] = vals.clamp_min_(0)
        i_out[s:e] = idx
    return d_out, i_out


def feature_knn_many_reference(query: torch.Tensor, ref: torch.Tensor, n: torch.Tensor,
                               m: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`feature_knn_reference` of B problems: ``query (B, N, D)``, ``ref (B, M, D)``.

    Problem b's first ``n[b]`` query rows and ``m[b]`` reference rows are valid (``(B,)``
    int64 tensors); returns ``(dists_sq (B, N, k), idx (B, N, k) int64)``, ascending, with
    padding query rows at ``(inf, -1)``. Batched ``cdist`` over chunks of problems of about
    :data:`CHUNK_ENTRIES` distances.
    """
    b, nq, nr = query.shape[0], query.shape[1], ref.shape[1]
    dev = query.device
    d_out = torch.empty(b, nq, k, dtype=query.dtype, device=dev)
    i_out = torch.empty(b, nq, k, dtype=torch.int64, device=dev)
    cols = torch.arange(nr, device=dev)
    rows = torch.arange(nq, device=dev)
    step = max(1, CHUNK_ENTRIES // max(nq * nr, 1))
    for s in range(0, b, step):
        e = min(b, s + step)
        d = torch.cdist(query[s:e], ref[s:e]).square_()
        d.masked_fill_(cols[None, None, :] >= m[s:e, None, None], math.inf)
        vals, idx = torch.topk(d, k, dim=2, largest=False, sorted=True)
        pad = rows[None, :, None] >= n[s:e, None, None]
        d_out[s:e] = vals.clamp_min_(0).masked_fill_(pad, math.inf)
        i_out[s:e] = idx.masked_fill_(pad, -1)
    return d_out, i_out


def ranking_keys_reference(dists: torch.Tensor, idx: torch.Tensor,
                           back_idx: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch statement of :func:`pointalign.kernels.ransac.ranking_keys`.

    ``dists, idx (N, k >= 2)``: each source row's two nearest target rows; ``back_idx
    (M, 1)``: each target row's nearest source row. Returns ``(N,)`` float64: Lowe's ratio
    ``min(1, sqrt(max(d₀, 0)) / sqrt(max(d₁, 1e-30)))`` in the distances' dtype, plus 2
    where the nearest is not mutual.
    """
    i = torch.arange(dists.shape[0], device=dists.device)
    mutual = back_idx[idx[:, 0], 0] == i
    ratio = (dists[:, 0].clamp_min(0).sqrt() / dists[:, 1].clamp_min(1e-30).sqrt()).clamp(0, 1)
    return ratio.to(torch.float64) + (~mutual).to(torch.float64) * 2.0


def triangle_similar_reference(src: torch.Tensor, tgt: torch.Tensor,
                               similarity: float) -> torch.Tensor:
    """Edge-length ratio test of triangle pairs ``src, tgt (H, 3, 3)`` → ``(H,)`` bool.

    For the edges ``p_j − p_{j−1}`` of both triangles (float norms in the points' dtype),
    ``min(l_s, l_t) >= (1 − similarity) · max(l_s, l_t)`` and ``min > 0``, every edge.
    """
    ls = (src - src.roll(1, dims=-2)).norm(dim=-1)  # (H, 3)
    lt = (tgt - tgt.roll(1, dims=-2)).norm(dim=-1)
    lo, hi = torch.minimum(ls, lt), torch.maximum(ls, lt)
    ok = (lo >= (1.0 - similarity) * hi) & (lo > 0)
    return ok.all(-1)


def triangle_has_area(tri: torch.Tensor, eps: float) -> torch.Tensor:
    """Tell which triangles ``(H, 3, 3)`` span a plane: ``(H,)`` bool.

    ``|e₁ × e₂|² > eps |e₁|² |e₂|²`` in float64 (e: the edges from the first vertex):
    collinear or coincident vertices leave a turn about their line free.
    """
    t = tri.to(torch.float64)
    e1, e2 = t[:, 1] - t[:, 0], t[:, 2] - t[:, 0]
    c = torch.linalg.cross(e1, e2)
    return (c * c).sum(-1) > eps * (e1 * e1).sum(-1) * (e2 * e2).sum(-1)


def transform_points_reference(T: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """``R_s p + t_s`` for ``T (S, 4, 4)`` and ``points (P, 3)`` or ``(S, P, 3)``: one GEMM.

    ``x Rᵀ + t`` by ``baddbmm`` in the points' dtype: ``(S, P, 3)``.
    """
    Tp = T.to(points.dtype)
    src = points if points.dim() == 3 else points.expand(T.shape[0], -1, -1)
    return torch.baddbmm(Tp[:, None, :3, 3], src, Tp[:, :3, :3].transpose(1, 2))


def score_transforms_reference(T: torch.Tensor, points: torch.Tensor, index: Any,
                               max_distance: float, with_matches: bool = False,
                               with_sums: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Move by :func:`transform_points_reference`, ask ``index.nearest_within``, sum in PyTorch.

    ``T (S, 4, 4)``, ``points (P, 3)`` → ``counts (S,) int64``, ``sums (S,) float64`` (or
    None without ``with_sums``), ``matches (S, P) int64`` (or None without
    ``with_matches``); at most :data:`SCORE_QUERIES` queries per call of the index.
    """
    s, p = T.shape[0], points.shape[0]
    step = max(1, SCORE_QUERIES // max(p, 1))
    parts = []
    for a in range(0, s, step):
        b = min(s, a + step)
        q = transform_points_reference(T[a:b], points).reshape(-1, 3)
        # finite points moved by finite motions: the index's trusted path (no checks; no
        # hint, so a k-d tree groups these scattered queries by leaf first)
        with _validate.trusted():
            res = index.nearest_within(q, max_distance)
        dist, idx = res.dists[:, 0], res.idx[:, 0]
        idx = idx.view(b - a, p)
        hit = idx >= 0
        d2 = torch.where(hit, dist.view(b - a, p), 0.0)
        parts.append((hit.sum(1), d2.sum(1, dtype=torch.float64),
                      idx if with_matches else None))
    if len(parts) == 1:  # the usual case: no concatenation
        c, sq, m = parts[0]
        return c, sq if with_sums else None, m
    counts, sqs, matches = zip(*parts, strict=True)
    return (torch.cat(counts), torch.cat(sqs) if with_sums else None,
            torch.cat(matches) if with_matches else None)


def second_order_reference(A: torch.Tensor) -> torch.Tensor:
    """Return ``A ⊙ (A A)`` of the 0/1 matrix ``A (C, C)`` or ``(B, C, C)`` float32."""
    return A * (A @ A)


def pair_lengths(points: torch.Tensor) -> torch.Tensor:
    """``|p_i − p_j|`` for every pair of ``points (C, 3)``: ``(C, C)`` in the points' dtype.

    ``points (B, C, 3)``: the same for each of B problems, ``(B, C, C)`` (the same values).

    Computed as ``sqrt((dx² + dy²) + dz²)``, the sum rounded step by step (elementwise
    operations: no fused multiply-add, no ``|p|² + |q|² − 2 p·q`` cancellation) and the
    root taken in float64, then rounded (PyTorch's float32 root on the CPU is not always
    the correctly rounded one; this is): for float32 points, the same values on every
    device and in the CPU kernel of ``second_order_of_points`` (``cpu._length``).
    """
    d = points[..., :, None, :] - points[..., None, :, :]
    s = (d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1]) + d[..., 2] * d[..., 2]
    return s.to(torch.float64).sqrt().to(points.dtype)


def compatibility_reference(source: torch.Tensor, target: torch.Tensor,
                            tau: float) -> torch.Tensor:
    """Return the length-consistency graph ``A (C, C)`` float32 of correspondences ``(C, 3)``.

    ``A_ij = 1`` when ``|ds_ij − dt_ij| < tau`` and i ≠ j, with ``ds, dt`` the
    :func:`pair_lengths` of the source and target ends (the comparison in their dtype).
    ``(B, C, 3)`` ends: B graphs ``(B, C, C)``.
    """
    A = ((pair_lengths(source) - pair_lengths(target)).abs() < tau).to(torch.float32)
    c = A.shape[-1]
    return A.masked_fill_(torch.eye(c, dtype=torch.bool, device=A.device), 0)


def second_order_of_points_reference(source: torch.Tensor, target: torch.Tensor,
                                     tau: float) -> torch.Tensor:
    """:func:`second_order_reference` of :func:`compatibility_reference`: ``(C, C)``."""
    return second_order_reference(compatibility_reference(source, target, tau))
