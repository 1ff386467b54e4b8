"""Motion hypotheses from a correspondence compatibility graph (second-order spectral seeds).

Rigid motions preserve distances, so two correct correspondences ``(s_i, t_i)`` and
``(s_j, t_j)`` satisfy ``‖s_i − s_j‖ ≈ ‖t_i − t_j‖``. The ideas follow the
compatibility-graph estimators (MAC, Zhang et al. CVPR 2023; SC²-PCR, Chen et al. CVPR
2022; TurboReg, ICCV 2025): correct correspondences form a large clique of the graph whose
edges join length-consistent pairs, while wrong ones are compatible with few others at
random. Our own formulation, all in batched torch (one code path on CPU and GPU, no host
loop over hypotheses):

1. ``A_ij = 1`` when ``|‖s_i − s_j‖ − ‖t_i − t_j‖| < tau`` (i ≠ j): ``(C, C)``.
2. Second-order compatibility ``S = A ⊙ (A A)``: ``S_ij`` counts the correspondences
   compatible with both i and j, so an edge inside the true clique scores about the clique
   size and a chance edge about nothing (the SC² measure).
3. Seeds: the ``seeds`` correspondences of largest row sum of S.
4. Each seed's consensus set: the ``k`` correspondences of largest ``S_seed,j`` (the seed
   included). A weighted Horn fit on that set (one batched call) gives a motion per seed;
   each motion is then re-fitted ``rounds`` times on the correspondences it maps within
   ``tau`` (a local optimisation, batched as well).
5. Hypotheses are ranked by how many correspondences they map within ``tau``.

The caller (:func:`pointalign.register`) scores these hypotheses together with parallel
RANSAC's on the clouds themselves and refines the best few: this module proposes, it does
not decide.
"""

from __future__ import annotations

import torch

from pointalign import _validate
from pointalign.kernels import ransac as _k
from pointalign.kernels.soft import weighted_horn


def rank_correspondences(source_features: torch.Tensor, target_features: torch.Tensor,
                         limit: int) -> torch.Tensor:
    """At most ``limit`` feature correspondences, the most distinctive first: ``(C, 2)``.

    Every source point's nearest target feature is a candidate; mutual nearest neighbours
    come first, then the rest, each group ordered by Lowe's ratio (nearest over second
    nearest feature distance, smaller first).

    Args:
        source_features: ``(N, D)`` float tensor.
        target_features: ``(M, D)`` float tensor, M >= 2, same device.
        limit: largest number of pairs returned (>= 1).

    Returns:
        ``(C, 2)`` int64 tensor of ``(source index, target index)`` rows, C <= limit.

    """
    d, j = _k.feature_knn(source_features, target_features, 2)
    _, back = _k.feature_knn(target_features, source_features, 1)
    i = torch.arange(source_features.shape[0], device=source_features.device)
    mutual = back[j[:, 0], 0] == i
    ratio = (d[:, 0].clamp_min(0).sqrt() / d[:, 1].clamp_min(1e-30).sqrt()).clamp(0, 1)
    key = ratio.to(torch.float64) + (~mutual).to(torch.float64) * 2.0  # mutual ones first
    order = torch.argsort(key, stable=True)[:limit]
    return torch.stack([i[order], j[order, 0]], 1)


def second_order_reference(A: torch.Tensor) -> torch.Tensor:
    """Return ``A ⊙ (A A)`` of the 0/1 matrix ``A (C, C)`` float32 (the reference)."""
    return A * (A @ A)


def second_order(A: torch.Tensor) -> torch.Tensor:
    """Second-order compatibility ``A ⊙ (A A)`` of ``A (C, C)`` (0/1 float32): ``(C, C)``.

    On the "cpu" backend by bit sets (``_ransac_cpu.second_order_cpu``: equal to the
    reference bit for bit, the counts being exact integers), else
    :func:`second_order_reference`.
    """
    from pointalign.kernels._backend import backend

    if (backend(A) == "cpu" and A.device.type == "cpu" and A.dtype == torch.float32
            and 0 < A.shape[0] < 1 << 24):
        from pointalign.kernels.ransac import cpu as _ransac_cpu

        return _ransac_cpu.second_order_cpu(A)
    return second_order_reference(A)


def pair_lengths(points: torch.Tensor) -> torch.Tensor:
    """``|p_i − p_j|`` for every pair of ``points (C, 3)``: ``(C, C)`` in the points' dtype.

    Computed as ``sqrt((dx² + dy²) + dz²)``, the sum rounded step by step (elementwise
    operations: no fused multiply-add, no ``|p|² + |q|² − 2 p·q`` cancellation) and the
    root taken in float64, then rounded (PyTorch's float32 root on the CPU is not always
    the correctly rounded one; this is): for float32 points, the same values on every
    device and in the CPU kernel of :func:`second_order_of_points`.
    """
    d = points[:, None, :] - points[None, :, :]
    s = (d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1]) + d[..., 2] * d[..., 2]
    return s.to(torch.float64).sqrt().to(points.dtype)


def second_order_of_points(source: torch.Tensor, target: torch.Tensor,
                           tau: float) -> torch.Tensor:
    """Second-order compatibility of correspondences ``source, target (C, 3)``: ``(C, C)``.

    The length-consistency graph: ``A_ij = 1`` when ``|ds_ij − dt_ij| < tau`` and i ≠ j,
    with ``ds, dt`` the :func:`pair_lengths` of the source and target ends; the answer is
    :func:`second_order` ``(A)``. On the "cpu" backend one kernel computes the lengths and
    A's bit sets pair by pair (``_ransac_cpu.second_order_points_cpu``, equal bit for bit:
    neither the lengths nor A are stored), else A is formed and passed on.
    """
    from pointalign.kernels._backend import backend

    c = source.shape[0]
    if (backend(source) == "cpu" and source.device.type == "cpu"
            and source.dtype == torch.float32 and target.dtype == torch.float32
            and 0 < c < 1 << 24):
        from pointalign.kernels.ransac import cpu as _ransac_cpu

        return _ransac_cpu.second_order_points_cpu(source, target, tau)
    A = ((pair_lengths(source) - pair_lengths(target)).abs() < tau).to(torch.float32)
    A.fill_diagonal_(0)
    return second_order(A)


@_validate.out_of_memory_is_clear
def compatibility_hypotheses(
    source: torch.Tensor,
    target: torch.Tensor,
    tau: float,
    *,
    seeds: int = 64,
    k: int = 32,
    rounds: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Motion hypotheses from length-consistent cliques of correspondences.

    Args:
        source: ``(C, 3)`` float tensor, the source end of each correspondence.
        target: ``(C, 3)`` float tensor, its target end (same device), C >= 3.
        tau: length-consistency and inlier bound (> 0), e.g. 1.5 voxels.
        seeds: hypotheses made (at most C).
        k: size of each seed's consensus set (>= 3).
        rounds: re-fits of each motion on the correspondences it explains.

    Returns:
        ``(T (H, 4, 4) float64, support (H,) int64)``: the hypotheses, most supported first,
        and how many correspondences each maps within ``tau``.

    """
    tau = _validate.positive(tau, "tau")
    c = source.shape[0]
    if c < 3 or target.shape != source.shape:
        raise ValueError(f"source, target: expected two (C, 3) tensors with C >= 3, got "
                         f"{tuple(source.shape)} and {tuple(target.shape)}")
    src, tgt = source.to(torch.float32), target.to(torch.float32)
    S = second_order_of_points(src, tgt, tau)  # second-order compatibility
    n_seeds = min(int(seeds), c)
    seed_idx = torch.topk(S.sum(1), n_seeds).indices
    kk = min(max(int(k), 3), c)
    rows = S[seed_idx]
    rows[torch.arange(n_seeds, device=src.device), seed_idx] = rows.max() + 1  # seed itself
    member_s, member = torch.topk(rows, kk, dim=1)
    w = (member_s > 0).to(torch.float32)
    T, _ = weighted_horn(src[member], tgt[member], w)
    for _ in range(max(int(rounds), 0)):
        res = (_k.transform_points(T, src) - tgt).norm(dim=2)  # (H, C)
        inl = (res < tau).to(torch.float32)
        T_new, ok = weighted_horn(src.expand(n_seeds, -1, -1), tgt.expand(n_seeds, -1, -1),
                                  inl)
        ok &= inl.sum(1) >= 3
        T = torch.where(ok[:, None, None], T_new, T)
    support = ((_k.transform_points(T, src) - tgt).norm(dim=2) < tau).sum(1)
    order = torch.argsort(support, descending=True, stable=True)
    return T[order], support[order]
