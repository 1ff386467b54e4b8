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
   size and a chance edge about nothing (the SC² measure). Steps 1-2 are one kernel entry
   point, :func:`pointalign.kernels.ransac.second_order_of_points` (with ``pair_lengths``
   and ``second_order``: the graph's lengths are rounded one way on every device).
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

import dataclasses

import torch

from pointalign import _validate
from pointalign.kernels import _loop
from pointalign.kernels import ransac as _k
from pointalign.kernels.ransac import FeatureMatches
from pointalign.kernels.soft import weighted_horn


def rank_correspondences(source_features: torch.Tensor, target_features: torch.Tensor,
                         limit: int, *, matches: FeatureMatches | None = None) -> torch.Tensor:
    """At most ``limit`` feature correspondences, the most distinctive first: ``(C, 2)``.

    Every source point's nearest target feature is a candidate; mutual nearest neighbours
    come first, then the rest, each group ordered by Lowe's ratio (nearest over second
    nearest feature distance, smaller first).

    Args:
        source_features: ``(N, D)`` float tensor.
        target_features: ``(M, D)`` float tensor, M >= 2, same device.
        limit: largest number of pairs returned (>= 1).
        matches: the feature matches of these features when the caller has them
            (:func:`pointalign.kernels.ransac.feature_matches` ``(source_features,
            target_features, k >= 2, backward=True)``, as :func:`pointalign.register`
            computes once for RANSAC and this ranking); default: searched here.

    Returns:
        ``(C, 2)`` int64 tensor of ``(source index, target index)`` rows, C <= limit.

    """
    n, m = source_features.shape[0], target_features.shape[0]
    if matches is None:
        matches = _k.feature_matches(source_features, target_features, 2)
    else:
        matches.check(n, m)
    order = torch.argsort(_k.ranking_keys(matches), stable=True)[:limit]  # mutual ones first
    return torch.stack([order, matches.idx[order, 0]], 1)


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
    program = _Cliques(tau, min(int(seeds), c), min(max(int(k), 3), c), max(int(rounds), 0))
    # a fixed device program: on a GPU one CUDA graph per size and bound, replayed from the
    # second call on (~45 launches in one)
    _, out = _loop.run_program(program, {"source": source.to(torch.float32),
                                         "target": target.to(torch.float32)},
                               host_outputs=False, eager_first=True)
    return out["T"], out["support"]


@dataclasses.dataclass(frozen=True)
class _Cliques:
    """:func:`compatibility_hypotheses`' device work, with no host read (a graph replays it).

    Inputs ``source``, ``target (C, 3)`` float32; outputs ``T (seeds, 4, 4)`` float64 and
    ``support (seeds,)`` int64, best first.
    """

    tau: float
    seeds: int
    k: int
    rounds: int

    def __call__(self, inputs: dict[str, torch.Tensor], checkpoint: object
                 ) -> dict[str, torch.Tensor]:
        src, tgt, tau = inputs["source"], inputs["target"], self.tau
        S = _k.second_order_of_points(src, tgt, tau)  # second-order compatibility
        seed_idx = torch.topk(S.sum(1), self.seeds).indices
        rows = S[seed_idx]
        rows[torch.arange(self.seeds, device=src.device), seed_idx] = rows.max() + 1  # itself
        member_s, member = torch.topk(rows, self.k, dim=1)
        w = (member_s > 0).to(torch.float32)
        T, _ = weighted_horn(src[member], tgt[member], w)
        for _ in range(self.rounds):
            res = (_k.transform_points(T, src) - tgt).norm(dim=2)  # (H, C)
            inl = (res < tau).to(torch.float32)
            T_new, ok = weighted_horn(src.expand(self.seeds, -1, -1),
                                      tgt.expand(self.seeds, -1, -1), inl)
            ok &= inl.sum(1) >= 3
            T = torch.where(ok[:, None, None], T_new, T)
        support = ((_k.transform_points(T, src) - tgt).norm(dim=2) < tau).sum(1)
        order = torch.argsort(support, descending=True, stable=True)
        return {"T": T[order], "support": support[order]}
