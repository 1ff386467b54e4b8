"""Parallel RANSAC's device programs: the batch of hypotheses, Lo-RANSAC, the counts.

What :func:`~pointalign.registration.ransac.ransac` runs on the device, each as a fixed
program with no host read (:func:`pointalign.kernels._loop.run_program`: one CUDA graph per
size on a GPU): :class:`Batch` (one batch of hypotheses, the pool of the best so far) and
:class:`Refined` (Lo-RANSAC of the pool and its best motion); and the counting helpers
they share with :func:`pointalign.register` (:func:`count_inliers`,
:func:`count_inliers_within`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from pointalign import _validate, estimate
from pointalign.kernels import ransac as _k
from pointalign.kernels.horn import weighted_horn


def score(T: torch.Tensor, points: torch.Tensor, index: Any, max_distance: float,
           *, with_matches: bool = False, valid: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Score transforms: inlier count and sum of squared inlier distances.

    ``T (S, 4, 4)`` applied to ``points (P, 3)`` → ``(S,) int64, (S,) float64`` and, with
    ``with_matches``, the matched target index of every point ``(S, P) int64`` (−1: none
    within the bound), else None; ``valid (S,)`` bool: score only those (the others 0).
    :func:`pointalign.kernels.ransac.score_transforms`: one fused kernel with the "cpu"
    index or a brute-force one on CUDA, else the index's ``nearest_within``.
    """
    counts, sq, matches = _k.score_transforms(T, points, index, max_distance, with_matches,
                                              valid=valid)
    assert sq is not None  # with_sums
    return counts, sq, matches


def count_inliers(T: torch.Tensor, points: torch.Tensor, index: Any,
                  max_distance: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Inlier counts ``(S,) int64`` of motions ``T (S, 4, 4)`` on ``points (P, 3)``.

    A point is an inlier of a motion when ``index`` (over the target) has a point within
    ``max_distance`` of the moved point: RANSAC's T(d,d) count, and the score
    :func:`pointalign.register` ranks its hypotheses by. :func:`score`'s first output, without
    the sums, so the fused CPU kernel stops each point's search at its first target point
    within the bound (the same counts, less work). ``valid (S,)`` bool: count only those
    motions (the others count 0).
    """
    return _k.score_transforms(T, points, index, max_distance, with_sums=False,
                               valid=valid)[0]


def count_inliers_within(T: torch.Tensor, points: torch.Tensor, index: Any,
                         bounds: tuple[float, ...]) -> tuple[torch.Tensor, ...]:
    """Inlier counts of one motion ``T (4, 4)`` on ``points (P, 3)`` at several bounds.

    One search at the largest bound: a nearest point within a smaller bound is the nearest
    within the largest, so its squared distance (compared in the search's dtype, as the
    search compares it) tells every count. Equals :func:`count_inliers` ``(T[None],
    points, index, b)`` for each ``b``; returns one ``(1,)`` int64 count per bound.
    """
    q = _k.transform_points(T[None], points).reshape(-1, 3)
    with _validate.trusted():
        res = index.nearest_within(q, max(bounds))
    d2 = torch.where(res.idx[:, 0] >= 0, res.dists[:, 0], math.inf)
    return tuple((d2 <= b * b).sum()[None] for b in bounds)


def key(counts: torch.Tensor, sq: torch.Tensor, max_distance: float) -> torch.Tensor:
    """Ranking key: more inliers first, then lower inlier RMSE (in [0, 1) of the bound)."""
    rmse = (sq / counts.clamp_min(1).to(torch.float64)).sqrt()
    return counts.to(torch.float64) - 0.999 * (rmse / max_distance).clamp(0, 1)


@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch of :func:`~pointalign.registration.ransac.ransac`'s hypotheses, a fixed program.

    Inputs: the correspondences' ends ``cs, ct (N, 3)`` (the first ``n_corr`` (0-dim) rows:
    :func:`~pointalign.registration.ransac._correspond`), the batch's ``triples (H, 3)``,
    the T(d,d) ``subset (d, 3)``, the ``source (N, 3)`` and the pool of the best motions so
    far (``T (K, 4, 4)`` float64, ``counts (K,)`` with −1 for an empty row, ``sq (K,)``).
    On a device every hypothesis keeps its row (no compaction, no host read: in host memory
    only the triangle test's survivors stay, the same motions at no cost): those failing
    the triangle or the area test, or T(d,d), are masked, and the ``validations`` best by
    T(d,d) (fewer where fewer passed: the rest masked) are scored on the whole source.
    Outputs: the new pool (the best K of the old one and the scored motions by
    :func:`key`; ties keep the old rows first) and ``tally (8,)``: passed the triangle
    test, valid motions, passed T(d,d), scored, the pool's filled rows, the best motion's
    inliers, the correspondences it explains, and ``n_corr``.
    """

    index: Any
    similarity: float
    max_distance: float
    validations: int

    def __call__(self, inputs: dict[str, torch.Tensor], checkpoint: object
                 ) -> dict[str, torch.Tensor]:
        """Enqueue the batch; return the new pool and the tally (device tensors)."""
        cs, ct, d = inputs["cs"], inputs["ct"], self.max_distance
        est = _k.triangle_motions(cs, ct, inputs["triples"], self.similarity,
                                  estimate.DEGENERACY_EPS, compact=None)
        c_sub = torch.where(est.valid, count_inliers(est.T, inputs["subset"], self.index, d,
                                                     valid=est.valid), -1)
        best = c_sub.max() if c_sub.numel() else -1  # (none: compacted in host memory)
        passed = (c_sub >= 1) & (2 * c_sub >= best)
        # failures sort last; a stable sort keeps equal counts in hypothesis order
        order = torch.sort(torch.where(passed, c_sub, -1), descending=True,
                           stable=True).indices[:self.validations]
        ok, chosen = passed[order], est.T[order]
        c, sq, _ = score(chosen, inputs["source"], self.index, d, valid=ok)
        pool_T = torch.cat([inputs["T"], chosen])
        pool_c = torch.cat([inputs["counts"], torch.where(ok, c, -1)])
        pool_sq = torch.cat([inputs["sq"], sq])
        top = torch.sort(key(pool_c, pool_sq, d), descending=True,
                         stable=True).indices[:inputs["counts"].shape[0]]
        pool_T, pool_c, pool_sq = pool_T[top], pool_c[top], pool_sq[top]
        tally = torch.stack([est.passed, est.valid.sum(), passed.sum(), ok.sum(),
                              (pool_c >= 0).sum(), pool_c[0],
                              explained(pool_T[0], cs, ct, inputs["n_corr"], d),
                              inputs["n_corr"]])
        return {"T": pool_T, "counts": pool_c, "sq": pool_sq, "tally": tally}




def explained(T: torch.Tensor, cs: torch.Tensor, ct: torch.Tensor, count: torch.Tensor,
               max_distance: float) -> torch.Tensor:
    """Count the correspondences ``cs → ct`` that ``T (4, 4)`` maps within the bound.

    ``cs, ct (N, 3)``: the first ``count`` (0-dim) rows are the correspondences. Returns a
    0-dim int64 tensor, left on the device.
    """
    res = (_k.transform_points(T[None], cs)[0] - ct).norm(dim=1)
    real = torch.arange(cs.shape[0], device=cs.device) < count
    return ((res <= max_distance) & real).sum()


@dataclasses.dataclass(frozen=True)
class Refined:
    """Lo-RANSAC of the pool (Chum, Matas & Kittler 2003), then its best motion.

    Inputs: the pool ``T (K, 4, 4)`` float64, ``counts (K,)`` (−1: an empty row), ``sq
    (K,)`` (:class:`Batch`'s, best first), the ``source (N, 3)`` and ``target (M, 3)``, the
    correspondences' ends ``cs, ct (N, 3)`` and their count ``n_corr`` (0-dim). Each of
    ``rounds`` rounds re-estimates every filled row by Horn on its inliers (nearest target
    point within the bound; :func:`pointalign.kernels.horn.weighted_horn`, which tests only
    for a zero weight: a motion of collinear inliers is kept only if it scores better, as
    any candidate is) and keeps the update where it ranks higher by :func:`key`; the
    matches found when scoring an update are its inliers for the next round. A round that
    improves nothing leaves the pool as it was, and so does every later one (the same
    inliers give the same update: the kernels are deterministic), so the program stops
    there when it runs eagerly (``checkpoint``) and runs every round in a graph, with the
    same result. Outputs: ``T (4, 4)``, the best motion, and ``best (4,)`` float64: its
    inliers, their squared distances' sum, the pool's best inliers before the rounds, and
    the correspondences the best motion explains.
    """

    index: Any
    max_distance: float
    rounds: int

    def __call__(self, inputs: dict[str, torch.Tensor], checkpoint: Any
                 ) -> dict[str, torch.Tensor]:
        """Enqueue the rounds (eagerly: until one improves nothing); return the best."""
        T, c, sq, d = inputs["T"], inputs["counts"], inputs["sq"], self.max_distance
        src, tgt = inputs["source"], inputs["target"]
        filled, k = c >= 0, key(c, sq, d)
        idx = score(T, src, self.index, d, with_matches=True)[2] if self.rounds else None
        for _ in range(self.rounds):
            assert idx is not None  # with_matches
            T_new, valid = weighted_horn(src.expand(idx.shape[0], -1, -1),
                                         tgt[idx.clamp_min(0)], (idx >= 0).to(src.dtype))
            c_new, sq_new, idx_new = score(T_new, src, self.index, d, with_matches=True)
            assert idx_new is not None  # with_matches
            k_new = key(c_new, sq_new, d)
            better = filled & valid & (k_new > k)
            T = torch.where(better[:, None, None], T_new, T)
            c, sq = torch.where(better, c_new, c), torch.where(better, sq_new, sq)
            k, idx = torch.where(better, k_new, k), torch.where(better[:, None], idx_new, idx)
            if checkpoint(~better):
                break
        b = torch.sort(k, descending=True, stable=True).indices[0]
        n = explained(T[b], inputs["cs"], inputs["ct"], inputs["n_corr"], d)
        return {"T": T[b], "best": torch.stack([c[b].double(), sq[b], inputs["counts"][0].double(),
                                                n.double()])}
