"""register_many's batched path (issue 25, part 2): which path runs, what its stages share.

The per-pair global stage (``pipeline._prepare_pair`` then ``pipeline._global``) is
launch-bound on a GPU: about 1,700 small launches and 100 host synchronisations per
bunny-size pair. The batched path runs every stage once for the whole group, in the frame
``register_many`` already uses (each pair scaled by 1/v, so every radius is the same
number of voxels for all pairs): :mod:`.batched_prepare` (v, strays, downsampling, normals
and FPFH), :mod:`.batched_ransac` (RANSAC's rounds and the compatibility-graph proposals)
and, for the local stages, :mod:`.batched_local`. What they share lives here: the padding
(:func:`_pad`), one packed index over a group's clouds (:func:`_packed`), the scores of
motions through it (:func:`_score`) and the index the local stages read (:func:`index_of`,
:func:`indexes_of` for a group).

What stays per pair: each cloud's index for the local stages (brute force on a GPU: no
build); a target holding duplicated points (its normals); the per-pair Python loops that
wrap the results (views and one ``cat`` per pair). The random
draws differ from the per-pair path's (one generator for the group), so the hypotheses
differ; the results are equivalent, not identical (tests: the same verdicts).

Which path runs (:func:`applies`): the batched one on a GPU, for groups of at least
:data:`MIN_PAIRS` pairs without an ``init``, whose RANSAC options are among
:data:`BATCHED_RANSAC_OPTIONS`; otherwise the per-pair one. :data:`BATCHED` forces it either
way (None: that rule); :func:`batched_local` is that rule for the local stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pointalign.kernels import ransac as _kr
from pointalign.kernels import upload
from pointalign.registration.options import Options as _Options
from pointalign.search import build_index, policy
from pointalign.search.brute import BruteForceIndex
from pointalign.search.packed import PackedIndex

#: None: the batched stage on a GPU, per pair on the CPU; True/False: always/never
BATCHED: bool | None = None
#: a smaller group runs per pair (nothing to batch)
MIN_PAIRS = 2
#: RANSAC options the batched stage implements (``inlier_ratio_threshold``: per pair)
BATCHED_RANSAC_OPTIONS = frozenset({
    "mutual", "ratio_test", "triangle_similarity", "tdd_points", "confidence",
    "max_hypotheses", "max_validations", "local_refinement", "refine_top",
    "refine_iterations"})


def applies(opts: _Options, device: torch.device, pairs: int) -> bool:
    """Tell whether ``pairs`` pairs (no ``init``) of one chunk take the batched stage."""
    if pairs < MIN_PAIRS or not set(opts.ransac_options) <= BATCHED_RANSAC_OPTIONS:
        return False
    return device.type == "cuda" if BATCHED is None else BATCHED


def batched_local(device: torch.device) -> bool:
    """Tell whether register_many's local stages batch their per-pair work here.

    The rule of :func:`applies` without its group conditions: on a GPU (launch-bound per
    pair), :data:`BATCHED` forcing it either way.
    """
    return device.type == "cuda" if BATCHED is None else BATCHED


def _pad(clouds: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C, max n, D)`` zero-padded and the lengths ``(C,)`` int64 on the device.

    ``pad_sequence``'s result, by one concatenation and one scatter (it copies cloud by
    cloud: a launch per cloud on a GPU).
    """
    dev = clouds[0].device
    sizes = [int(c.shape[0]) for c in clouds]
    total, m = sum(sizes), max(sizes)
    n = upload(sizes, dtype=torch.int64, device=dev)
    flat = torch.cat(list(clouds))
    out = flat.new_zeros((len(sizes), m, *flat.shape[1:]))
    owner = torch.repeat_interleave(torch.arange(len(sizes), device=dev), n,
                                    output_size=total)
    col = torch.arange(total, device=dev) - (torch.cumsum(n, 0) - n)[owner]
    out.view(len(sizes) * m, *flat.shape[1:]).index_copy_(0, owner * m + col, flat)
    return out, n


def _packed(points: torch.Tensor, lengths: list[int], distance: float) -> PackedIndex:
    """One packed index over ``points (C, M, 3)`` (the search policy's, on the CPU too)."""
    idx = policy.choose_batch_index(points, lengths, max_distance=distance)
    if isinstance(idx, PackedIndex):
        return idx
    return PackedIndex(points, lengths, max_distance=distance,
                       build=lambda p: policy.choose_index(p, max_distance=distance))


def _score(T: torch.Tensor, prob: torch.Tensor, src: torch.Tensor, n_src: torch.Tensor,
           index: PackedIndex, dist: float, with_matches: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Score motions ``T (S, 4, 4)`` of pairs ``prob (S,)`` on their padded sources.

    ``src (B, N, 3)`` with ``n_src (B,)`` valid rows. Returns counts ``(S,)`` int64, the
    float64 sums of the inliers' squared distances ``(S,)`` and (``with_matches``) each
    row's target match ``(S, N)`` (-1: none, or a padding row).
    """
    s, n = T.shape[0], src.shape[1]
    if s == 0:
        z = torch.zeros(0, dtype=torch.int64, device=src.device)
        return z, z.to(torch.float64), z.new_zeros(0, n) if with_matches else None
    moved = _kr.transform_points(T, src[prob])                                 # (S, N, 3)
    rows = prob[:, None].expand(s, n).reshape(-1)
    res = index.nearest_within(moved.reshape(-1, 3), dist, problem=rows)
    ok = (res.idx[:, 0] >= 0).view(s, n) & (torch.arange(n, device=src.device)[None]
                                            < n_src[prob][:, None])
    d2 = torch.where(ok, res.dists[:, 0].view(s, n).to(torch.float64), 0.0)
    match = torch.where(ok, res.idx[:, 0].view(s, n), -1) if with_matches else None
    return ok.sum(1), d2.sum(1), match


def index_of(down: torch.Tensor) -> Any:
    """Return the index over ``down (n, 3)`` the local stages read (as ``prepare_cloud``)."""
    return build_index(down)


def indexes_of(downs: Sequence[torch.Tensor]) -> list[Any]:
    """:func:`index_of` of each cloud of a group (one device): the same indexes.

    The search policy is asked once for the group's device (:func:`~pointalign.search.
    policy.search_plan`) and per cloud by its pure rule (:func:`~pointalign.search.policy.
    index_method`, no bound: brute force on a GPU up to ``AUTO_BRUTE_MAX_POINTS``, made
    directly, no build); any other choice (a tree) is built by :func:`index_of`.
    """
    if not downs:
        return []
    plan = policy.search_plan(downs[0])
    return [BruteForceIndex(d) if policy.index_method(plan, int(d.shape[0])) == "brute"
            else index_of(d) for d in downs]
