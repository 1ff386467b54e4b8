"""Parallel RANSAC's device work: the batch of hypotheses, Lo-RANSAC, the inlier counts.

What :func:`~pointalign.registration.ransac.ransac` runs on the device: :class:`Batch`, one
batch of hypotheses and the pool of the best so far as a fixed program with no host read
(:func:`pointalign.kernels._loop.run_program`: one CUDA graph per size on a GPU);
:func:`refine`, Lo-RANSAC of the pool, its rounds on the executor (a read every two rounds);
and the counting helpers :func:`pointalign.register` shares (:func:`count_inliers`,
:func:`count_inliers_within`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from pointalign import _validate, estimate
from pointalign.kernels import _loop
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
    """Ranking key ``(S,)`` float64 of ``counts (S,)`` inliers with squared sums ``sq (S,)``.

    More inliers first, then lower inlier RMSE (in [0, 1) of the bound).
    """
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


def refine(T: torch.Tensor, counts: torch.Tensor, sq: torch.Tensor, src: torch.Tensor,
           tgt: torch.Tensor, index: Any, max_distance: float,
           iterations: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lo-RANSAC local optimisation of ``T (B, 4, 4)``.

    Each round (:class:`RefineStep`) re-estimates every motion by Horn on all its inliers
    (nearest target point within the bound) and keeps the update only if it scores better;
    at most ``iterations`` rounds, and none after a round that improved no motion. The
    matches found when scoring an update are its inliers for the next round (one
    neighbour query per round). The rounds run on the executor (:func:`~pointalign.kernels.
    _loop.iterate`: on a GPU replays of a kept CUDA graph, the index keyed by its layout),
    and the host reads one flag per round (whether any motion improved). The
    re-estimation is the fused weighted Horn of :func:`pointalign.kernels.horn.
    weighted_horn` (one launch on a GPU); it tests only for a zero weight, not for collinear
    inliers, whose motion (any turn about their line) is kept only if it scores better, as
    any candidate is.
    """
    _, _, idx = score(T, src, index, max_distance, with_matches=True)
    assert idx is not None  # with_matches
    state = {"T": T, "counts": counts, "sq": sq, "key": key(counts, sq, max_distance),
             "idx": idx, "round": torch.zeros((), dtype=torch.int64, device=T.device)}
    run = _loop.iterate(RefineStep(index, float(max_distance), int(iterations)),
                        {"src": src, "tgt": tgt}, state, max_steps=max(int(iterations), 1))
    for rec in run:
        if not rec["improved"]:
            break
    out = run.state  # steps run past the host's stop change nothing (below)
    return out["T"], out["counts"], out["sq"]


@dataclasses.dataclass(frozen=True)
class RefineStep:
    """One Lo-RANSAC round of :func:`refine` as an executor step (no host read).

    State ``T (B, 4, 4)`` float64, ``counts (B,)``, ``sq (B,)``, ``key (B,)``, ``idx (B, P)``
    (each motion's inliers) and ``round`` (0-d); record ``improved`` (0-d: any motion kept
    its update). A round that improves nothing leaves the state as it was, and so does the
    next one (the same inliers give the same update: the kernels are deterministic), so
    steps launched past the host's stop, or past ``rounds``, change nothing.
    """

    index: Any
    max_distance: float
    rounds: int
    #: rounds per graph replay: the motions usually stop improving within one or two, and
    #: each surplus round is a full scoring pass
    chunk: ClassVar[int] = 2

    def __call__(self, inputs: dict[str, torch.Tensor], state: dict[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Enqueue one round; return the new state and whether a motion improved."""
        src, tgt, idx = inputs["src"], inputs["tgt"], state["idx"]
        T_new, valid = weighted_horn(src.expand(idx.shape[0], -1, -1), tgt[idx.clamp_min(0)],
                                     (idx >= 0).to(src.dtype))
        c_new, sq_new, idx_new = score(T_new, src, self.index, self.max_distance,
                                        with_matches=True)
        assert idx_new is not None  # with_matches
        key_new = key(c_new, sq_new, self.max_distance)
        better = valid & (key_new > state["key"]) & (state["round"] < self.rounds)
        new = {"T": torch.where(better[:, None, None], T_new, state["T"]),
               "counts": torch.where(better, c_new, state["counts"]),
               "sq": torch.where(better, sq_new, state["sq"]),
               "key": torch.where(better, key_new, state["key"]),
               "idx": torch.where(better[:, None], idx_new, idx),
               "round": state["round"] + 1}
        return new, {"improved": better.any()}


__all__ = ["Batch", "RefineStep", "count_inliers", "count_inliers_within", "explained", "key",
           "refine", "score"]
