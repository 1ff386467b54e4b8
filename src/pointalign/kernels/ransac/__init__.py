"""RANSAC kernels: feature-space nearest neighbours, the triangle test, batched transforms.

Contracts (the PyTorch references in :mod:`~pointalign.kernels.ransac.reference` are the
spec):

* ``feature_knn(query (N, D), ref (M, D), k) -> (dists_sq (N, k), idx (N, k) int64)``:
  exact k nearest rows of ``ref`` in Euclidean feature space, ascending, ``k <= M``.
  Reference: distances from ``torch.cdist`` over row chunks (the N×M matrix exists one
  chunk at a time), clamped at 0. The "cpu" backend (``cpu.py``, k <= 16) fuses the
  distances and the selection and sums ``(q_d − r_d)²`` directly; so does the "triton"
  backend for float32 (``triton.py``, k <= 2: the same sums, each product possibly fused
  with its sum). Both agree with the reference up to ``cdist``'s rounding (a neighbour can
  differ only between near-equidistant rows); ties go to the smaller index.
* ``feature_matches(source (N, D), target (M, D), k, backward) -> FeatureMatches``: the
  forward ``feature_knn(source, target, k)`` and (``backward``) the backward
  ``feature_knn(target, source, 1)``, the matches RANSAC and the correspondence ranking
  read; on the "cpu" and "triton" backends both from one fused pass over the ``N × M``
  distances (``cpu.feature_knn_both_cpu``, ``triton.feature_knn``: the same sums, the same
  tie rule, so the answers of the two separate calls), else from the two calls.
* ``feature_matches_many(source (B, N, D), target (B, M, D), n (B,), m (B,), k)
  -> FeatureMatches`` of ``(B, N, k)`` forward and ``(B, M, 1)`` backward tables: problem
  b's :func:`feature_matches` of its first ``n[b]`` source and ``m[b]`` target rows, B
  problems in a few launches (``register_many``'s global stage); padding rows get index
  -1 and distance inf. Reference: batched ``cdist`` + ``topk`` (padding masked) over
  chunks of problems; the same distances and tie rule as :func:`feature_knn_reference`
  up to ``cdist``'s rounding (its batched and unbatched forms may round differently). On
  the "triton" backend (float32) the batched form of ``triton.feature_knn``: each problem's
  answers are those of its :func:`feature_matches` alone.
* ``ranking_keys(matches) -> (N,) float64``: each source row's Lowe ratio of its two
  nearest feature distances, plus 2 where its nearest is not mutual (the correspondence
  ranking's sort key). Reference: :func:`ranking_keys_reference`; on CUDA (float32) one
  Triton launch, correctly rounded like the reference: the same keys bit for bit.
* ``triangle_similar(src (H, 3, 3), tgt (H, 3, 3), similarity) -> (H,) bool``: for the
  three edges e of the source triangle and the matching target edges,
  ``min(l_s, l_t) >= (1 - similarity) · max(l_s, l_t)`` and both > 0 (the polygon test of
  Bolles & Fischler, as used in the parallel RANSAC paper; Open3D's edge-length checker
  with ``similarity_threshold = 1 - similarity``).
* ``triangle_motions(cs (C, 3), ct (C, 3), triples (H, 3), similarity, eps, compact)
  -> Hypotheses(T (S, 4, 4), valid (S,), rows (S,), passed ())``: RANSAC's hypotheses from
  three correspondences each that pass the triangle test (``triangle_similar``; S of H, in
  order, ``rows`` their indices; ``passed`` S as a 0-d int64 tensor), with both triangles'
  area test (:func:`~pointalign.kernels.ransac.reference.triangle_has_area`, float64) and
  Horn's motion of the three pairs (unit weights, float64 moments), the identity where not
  valid. ``compact=False``: all H hypotheses instead (``rows`` 0..H−1), those failing the
  triangle test not valid: no host synchronisation, fixed shapes (a loop a CUDA graph
  replays); ``compact=None``: compacted in host memory (free there), else all H.
  Reference: the triangle test, the compaction (one host synchronisation), then
  :func:`pointalign.kernels.horn.weighted_horn` and the area tests of the survivors
  (uncompacted: scattered back to their rows). On CUDA (float32) one Triton launch tests
  every hypothesis (edge ratios and both areas, no PyTorch op chain), then the same
  compaction and Horn (uncompacted: Horn of every hypothesis, ~0.16 ms for 16,384 on an
  H200): the same decisions up to a length on the test's bound (float32 norms rounded
  otherwise), the same motions.
* ``transform_points(T (S, 4, 4), points (P, 3) or (S, P, 3)) -> (S, P, 3)`` in the points'
  dtype. Reference: one ``baddbmm``; the "cpu" backend moves the points in one numba pass
  with the products and sums ``baddbmm`` makes on the CPU (below); on CUDA, float32 points
  move in one Triton pass (``triton.py``), within a few ulps of the reference.
* ``score_transforms(T (S, 4, 4), points (P, 3), index, max_distance, with_matches)
  -> (counts (S,) int64, sums (S,) float64, matches (S, P) int64 | None)``: per transform,
  the points whose moved position has an indexed point within ``max_distance``, the sum of
  their squared distances (``with_sums``), and (``with_matches``) every point's match
  (−1: none). With ``valid (S,) bool`` only those transforms are scored; the others count
  0 with sum 0 and no match (on CUDA the Triton kernel skips their scan; elsewhere the
  valid rows are scored alone, a compaction that costs nothing in host memory).
  Reference (:func:`score_transforms_reference`): :func:`transform_points_reference`, then the
  index's ``nearest_within``, then sums in PyTorch. The "cpu" index with a scoring grid
  (``score_cpu.BoundGrid``) runs one fused numba kernel instead: no ``(S, P, 3)`` tensor
  and, without matches, no ``(S·P,)`` results. It moves the points with the same float32
  products and sums as ``baddbmm`` on the CPU (``((p₀r₀ + p₁r₁) + p₂r₂) + t``, no fused
  multiply-add), so counts and matches are identical; the float64 sums differ from the
  reference's only in summation order (blocks of points in a fixed order, see
  ``score_cpu._score``). On CUDA (float32) a brute-force index
  (``BruteForceIndex.scoring_layout``) is scored by one Triton launch
  (``triton.score_transforms``): the points move by ``transform_points``' formula on CUDA
  (a few ulps from ``baddbmm``; kept in registers, they may round a few ulps from its
  stored ones), then the index's own 1-NN scan; so counts and matches are the reference's
  except for a point within those ulps of the bound or of a tie, and each squared distance
  is within those ulps too; the sums in a fixed blocked order.
* ``second_order(A (C, C)) -> (C, C)``: the second-order compatibility ``A ⊙ (A A)`` of a
  0/1 float32 matrix (the SC² measure of :mod:`pointalign.registration.robust`). The "cpu"
  backend counts by bit sets (``cpu.second_order_cpu``): the counts are exact integers, so
  it equals the reference bit for bit.
* ``pair_lengths(points (C, 3)) -> (C, C)``: every pairwise length, rounded as its
  docstring states (one formula on every device; it is the spec, no dispatch).
* ``second_order_of_points(source (C, 3), target (C, 3), tau) -> (C, C)``:
  ``second_order`` of the length-consistency graph ``A_ij = [|ds_ij − dt_ij| < tau]``,
  i ≠ j (:func:`~pointalign.kernels.ransac.reference.compatibility_reference`). The "cpu"
  backend computes the lengths and A's bit sets pair by pair in one kernel
  (``cpu.second_order_points_cpu``, equal bit for bit: neither the lengths nor A are
  stored).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from pointalign.kernels._backend import backend
from pointalign.kernels.ransac.reference import (
    MAX_TRITON_FEATURE_K,
    compatibility_reference,
    feature_knn_reference,
    pair_lengths,
    ranking_keys_reference,
    score_transforms_reference,
    second_order_of_points_reference,
    second_order_reference,
    transform_points_reference,
    triangle_has_area,
    triangle_similar_reference,
)


def _fused_applies(query: torch.Tensor, ref: torch.Tensor) -> bool:
    """Return True when the "cpu" kernel answers ``feature_knn(query, ref, ·)``."""
    return (backend(query) == "cpu" and query.device.type == "cpu" and ref.device.type == "cpu"
            and query.dtype in (torch.float32, torch.float64) and ref.dtype == query.dtype)


def _check_features(query: torch.Tensor, ref: torch.Tensor, k: int, what: str) -> None:
    if query.dim() != 2 or ref.dim() != 2 or query.shape[1] != ref.shape[1]:
        raise ValueError(f"{what}: expected (N, D) and (M, D), got {tuple(query.shape)} "
                         f"and {tuple(ref.shape)}")
    if not 1 <= k <= ref.shape[0]:
        raise ValueError(f"{what}: k must be in [1, {ref.shape[0]}], got {k}")


def feature_knn(query: torch.Tensor, ref: torch.Tensor,
                k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact k nearest neighbours in feature space (entry point; see the module contract).

    Args:
        query: ``(N, D)`` float tensor.
        ref: ``(M, D)`` float tensor, same dtype and device.
        k: neighbours per query, 1 <= k <= M.

    Returns:
        ``(dists_sq (N, k), idx (N, k) int64)``, ascending.

    """
    _check_features(query, ref, k, "feature_knn")
    if _fused_applies(query, ref):
        from pointalign.kernels.ransac import cpu as _ransac_cpu

        if k <= _ransac_cpu.MAX_K:
            return _ransac_cpu.feature_knn_cpu(query, ref, k)
    if _triton_applies(query, ref, k):
        from pointalign.kernels.ransac import triton as _ransac_triton

        d, i = _ransac_triton.feature_knn(query, ref, k)
        return d, i
    return feature_knn_reference(query, ref, k)


def _triton_applies(query: torch.Tensor, ref: torch.Tensor, k: int) -> bool:
    """Return True when the Triton kernel answers ``feature_knn(query, ref, k)``."""
    return (backend(query) == "triton" and query.dtype == torch.float32
            and ref.dtype == torch.float32 and ref.device == query.device
            and k <= MAX_TRITON_FEATURE_K and not query.requires_grad
            and not ref.requires_grad)


class FeatureMatches(NamedTuple):
    """Feature-space matches of a source against a target, found once and read by several.

    Made by :func:`feature_matches`; :func:`pointalign.registration.ransac.ransac` and
    :func:`pointalign.registration.robust.rank_correspondences` take it as ``matches=``.

    Attributes:
        dists: ``(N, k)`` squared feature distances of each source row's k nearest target
            rows, ascending.
        idx: ``(N, k)`` int64 target rows of those neighbours.
        back_dists: ``(M, 1)`` squared distance of each target row's nearest source row,
            or None (not searched).
        back_idx: ``(M, 1)`` int64 source row of that neighbour, or None.

    """

    dists: torch.Tensor
    idx: torch.Tensor
    back_dists: torch.Tensor | None = None
    back_idx: torch.Tensor | None = None

    @property
    def k(self) -> int:
        """Forward neighbours per source row."""
        return int(self.idx.shape[1])

    def forward(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``feature_knn(source, target, k)`` for ``k <= self.k``: ``(N, k)`` dists and idx."""
        if k == self.k:
            return self.dists, self.idx
        return self.dists[:, :k].contiguous(), self.idx[:, :k].contiguous()

    def check(self, n: int, m: int, name: str = "matches") -> None:
        """Raise a ValueError unless these are matches of ``n`` source and ``m`` target rows."""
        if not (isinstance(self.dists, torch.Tensor) and isinstance(self.idx, torch.Tensor)
                and self.idx.dim() == 2 and self.idx.shape[0] == n and self.idx.shape[1] >= 1
                and self.dists.shape == self.idx.shape):
            raise ValueError(f"{name}: expected forward matches of shape ({n}, k) (one row per "
                             f"source feature), got {_shape(self.idx)} and {_shape(self.dists)}")
        if (self.back_idx is None) != (self.back_dists is None) or (
                self.back_idx is not None and self.back_dists is not None
                and (tuple(self.back_idx.shape) != (m, 1)
                     or tuple(self.back_dists.shape) != (m, 1))):
            raise ValueError(f"{name}: expected backward matches of shape ({m}, 1) (one row "
                             f"per target feature) or None, got {_shape(self.back_idx)} and "
                             f"{_shape(self.back_dists)}")


def _shape(x: Any) -> Any:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def feature_matches(source: torch.Tensor, target: torch.Tensor, k: int = 2, *,
                    backward: bool = True) -> FeatureMatches:
    """Forward k nearest and backward nearest features in one call (see the module contract).

    Args:
        source: ``(N, D)`` float tensor (e.g. the source's FPFH), N >= 1.
        target: ``(M, D)`` float tensor, same dtype and device.
        k: forward neighbours per source row, 1 <= k <= M.
        backward: also find each target row's nearest source row.

    Returns:
        :class:`FeatureMatches`: what ``feature_knn(source, target, k)`` and (with
        ``backward``) ``feature_knn(target, source, 1)`` return.

    """
    _check_features(source, target, k, "feature_matches")
    if backward and source.shape[0] >= 1 and _fused_applies(source, target):
        from pointalign.kernels.ransac import cpu as _ransac_cpu

        if k <= _ransac_cpu.MAX_K:
            return FeatureMatches(*_ransac_cpu.feature_knn_both_cpu(source, target, k))
    if _triton_applies(source, target, k):
        from pointalign.kernels.ransac import triton as _ransac_triton

        return FeatureMatches(*_ransac_triton.feature_knn(source, target, k,
                                                          backward=backward))
    d, i = feature_knn(source, target, k)
    if not backward:
        return FeatureMatches(d, i)
    return FeatureMatches(d, i, *feature_knn(target, source, 1))


def ranking_keys(matches: FeatureMatches) -> torch.Tensor:
    """Rank key of every source row by how distinctive its nearest target feature is: ``(N,)``.

    Lowe's ratio (nearest over second nearest feature distance, in ``[0, 1]``, computed in
    the distances' dtype), plus 2 where the nearest is not mutual (the target row's nearest
    source row is another), in float64: sorted ascending, mutual matches come first, each
    group by its ratio (:func:`pointalign.registration.robust.rank_correspondences`).
    ``matches``: with ``k >= 2`` forward and the backward matches. Reference:
    :func:`ranking_keys_reference`; on CUDA (float32) one Triton launch with the same
    operations, correctly rounded: the same keys bit for bit.
    """
    if matches.k < 2 or matches.back_idx is None:
        raise ValueError(f"matches: the ranking needs k >= 2 forward and the backward "
                         f"matches, got k = {matches.k} and backward "
                         f"{'none' if matches.back_idx is None else 'present'}")
    d, j = matches.forward(2)
    if backend(d) == "triton" and d.dtype == torch.float32:
        from pointalign.kernels.ransac import triton as _ransac_triton

        return _ransac_triton.ranking_keys(d, j, matches.back_idx)
    return ranking_keys_reference(d, j, matches.back_idx)


def triangle_similar(src: torch.Tensor, tgt: torch.Tensor, similarity: float) -> torch.Tensor:
    """Edge-length ratio test of triangle pairs ``(H, 3, 3)`` → ``(H,)`` bool (see contract)."""
    return triangle_similar_reference(src, tgt, similarity)


class Hypotheses(NamedTuple):
    """RANSAC's triangle hypotheses (:func:`triangle_motions`).

    Attributes:
        T: ``(S, 4, 4)`` float64 motions (the identity where not ``valid``).
        valid: ``(S,)`` bool: the triangle test passed, both triangles have an area and
            Horn's pose is finite.
        rows: ``(S,)`` int64: the hypothesis (row of ``triples``) of each, ascending.
        passed: 0-d int64 tensor, how many hypotheses passed the triangle test.

    """

    T: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor
    passed: torch.Tensor


def triangle_motions(cs: torch.Tensor, ct: torch.Tensor, triples: torch.Tensor,
                     similarity: float, eps: float, compact: bool | None = True
                     ) -> Hypotheses:
    """Motions of RANSAC's triangle hypotheses (see the module contract).

    Args:
        cs: ``(C, 3)`` float tensor, the source end of each correspondence.
        ct: ``(C, 3)`` float tensor, its target end (same dtype and device).
        triples: ``(H, 3)`` int64 correspondence rows of each hypothesis.
        similarity: the triangle test's allowed relative edge-length difference.
        eps: the area test's degeneracy bound (``estimate.DEGENERACY_EPS``).
        compact: keep only the hypotheses passing the triangle test (one host
            synchronisation on a device); False: all H, the others not valid (none); None:
            compact where that costs no synchronisation (host memory), else keep all.

    Returns:
        :class:`Hypotheses`, in the order of ``triples``.

    """
    from pointalign.kernels.horn import weighted_horn

    H = triples.shape[0]
    if compact is None:
        compact = cs.device.type == "cpu"
    if (backend(cs) == "triton" and cs.dtype == torch.float32 and ct.dtype == torch.float32
            and not cs.requires_grad and not ct.requires_grad):
        from pointalign.kernels.ransac import triton as _ransac_triton

        keep, area = _ransac_triton.triangle_tests(cs, ct, triples, similarity, eps)
        if compact:
            rows = keep.nonzero().squeeze(1)  # stream compaction: one host synchronisation
            tri, area = triples[rows], area[rows]
        else:  # every hypothesis: no host synchronisation
            rows, tri, area = torch.arange(H, device=cs.device), triples, area & keep
        T, ok = weighted_horn(cs[tri], ct[tri], cs.new_ones(tri.shape))
        valid = ok & area
        passed = keep.sum()
    else:
        src, tgt = cs[triples], ct[triples]
        rows = triangle_similar(src, tgt, similarity).nonzero().squeeze(1)  # one sync
        s, t = src[rows], tgt[rows]
        area = triangle_has_area(s, eps) & triangle_has_area(t, eps)
        T, ok = weighted_horn(s, t, s.new_ones(s.shape[:2]))
        valid = ok & area
        passed = torch.tensor(rows.shape[0], device=cs.device)
        if not compact:  # scattered back to their rows: the same motions, fixed shapes
            T = T.new_zeros(H, 4, 4).index_copy_(0, rows, T)
            valid = valid.new_zeros(H).index_copy_(0, rows, valid)
            rows = torch.arange(H, device=cs.device)
    eye = torch.eye(4, dtype=T.dtype, device=T.device)
    return Hypotheses(torch.where(valid[:, None, None], T, eye), valid, rows, passed)


def transform_points(T: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """``R_s p + t_s`` for every transform s and point p, in the points' dtype.

    ``T (S, 4, 4)`` and ``points (P, 3)`` (every transform moves the same points) or
    ``(S, P, 3)`` (transform s moves ``points[s]``) → ``(S, P, 3)``. On the "cpu" backend
    one parallel numba pass (``score_cpu.move_points``: the reference's products and sums
    in the same order, see the module contract); on CUDA float32 points one Triton pass
    (``ransac/triton.py``: float32 FMAs, a few ulps from the reference's GEMM), else
    :func:`transform_points_reference`.
    """
    if (backend(points) == "cpu" and T.device.type == "cpu" and not points.requires_grad
            and not T.requires_grad and points.dtype in (torch.float32, torch.float64)):
        from pointalign.kernels.ransac import score_cpu as _score_cpu

        Tp = T.detach().to(points.dtype)
        pts = points if points.dim() == 3 else points[None]
        return torch.from_numpy(_score_cpu.move_points(
            Tp[:, :3, :3].contiguous().numpy(), Tp[:, :3, 3].contiguous().numpy(),
            pts.detach().contiguous().numpy()))
    if (backend(points) == "triton" and points.dtype == torch.float32
            and not points.requires_grad and not T.requires_grad):
        from pointalign.kernels.ransac import triton as _ransac_triton

        return _ransac_triton.transform_points(T, points)
    return transform_points_reference(T, points)


def _scoring_grid(T: torch.Tensor, points: torch.Tensor, index: Any,
                  max_distance: float) -> Any:
    """Return the "cpu" index's grid that answers this scoring (a ``BoundGrid``), or None."""
    if T.device.type != "cpu" or points.device.type != "cpu":
        return None
    grid_of = getattr(index, "scoring_grid", None)
    if grid_of is None:
        return None
    grid = grid_of(max_distance, T.shape[0] * points.shape[0])
    if grid is None or torch.from_numpy(grid.points[:0]).dtype != points.dtype:
        return None  # other dtypes: the reference rounds the moved points to the index's
    return grid


def _scoring_layout(T: torch.Tensor, points: torch.Tensor, index: Any) -> torch.Tensor | None:
    """Return the brute-force index's ``(3, M)`` points the Triton scoring reads, or None."""
    layout_of = getattr(index, "scoring_layout", None)
    if (layout_of is None or backend(points) != "triton" or points.dtype != torch.float32
            or points.requires_grad or T.requires_grad):
        return None
    soa = layout_of()
    if soa is None or soa.dtype != torch.float32 or soa.device != points.device \
            or soa.shape[1] >= 2**31 - 1:
        return None
    return soa


def score_transforms(T: torch.Tensor, points: torch.Tensor, index: Any, max_distance: float,
                     with_matches: bool = False, with_sums: bool = True,
                     valid: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Score motions by their inliers (entry point; see the module contract).

    Args:
        T: ``(S, 4, 4)`` float tensor of finite motions.
        points: ``(P, 3)`` float tensor of finite points, on T's device.
        index: an index over the target (:class:`~pointalign.search.base.Index`) with the
            points' dtype and device.
        max_distance: the inlier bound (> 0).
        with_matches: also return every point's match.
        with_sums: also return the sums (False: counts only, which the fused kernel finds
            faster: a point's search stops at its first indexed point within the bound).
        valid: optional ``(S,)`` bool on T's device: score only these motions (the others
            count 0, sum 0, no match).

    Returns:
        ``counts (S,) int64``, ``sums (S,) float64`` (squared distances of the inliers) or
        None (``with_sums=False``) and ``matches (S, P) int64`` (−1: no indexed point within
        the bound) or None.

    """
    if T.dim() != 3 or T.shape[1:] != (4, 4):
        raise ValueError(f"T: expected shape (S, 4, 4), got {tuple(T.shape)}")
    if points.dim() != 2 or points.shape[1] != 3:
        raise ValueError(f"points: expected shape (P, 3), got {tuple(points.shape)}")
    if valid is not None and (valid.shape != T.shape[:1] or valid.dtype != torch.bool):
        raise ValueError(f"valid: expected ({T.shape[0]},) bool, got {tuple(valid.shape)} "
                         f"{valid.dtype}")
    s, p = T.shape[0], points.shape[0]
    if s == 0:
        dev = points.device
        return (torch.zeros(0, dtype=torch.int64, device=dev),
                torch.zeros(0, dtype=torch.float64, device=dev) if with_sums else None,
                torch.zeros(0, p, dtype=torch.int64, device=dev) if with_matches else None)
    soa = _scoring_layout(T, points, index)
    if soa is not None:
        from pointalign.kernels.ransac import triton as _ransac_triton

        c, sq, m = _ransac_triton.score_transforms(T, points, soa, max_distance, with_matches,
                                                   valid)
        return c, sq if with_sums else None, m
    if valid is not None:  # the valid rows alone (a compaction: free in host memory)
        rows = valid.nonzero().squeeze(1)
        vc, vsq, vm = score_transforms(T[rows], points, index, max_distance, with_matches,
                                       with_sums)
        return (vc.new_zeros(s).index_copy_(0, rows, vc),
                None if vsq is None else vsq.new_zeros(s).index_copy_(0, rows, vsq),
                None if vm is None else vm.new_full((s, p), -1).index_copy_(0, rows, vm))
    grid = _scoring_grid(T, points, index, max_distance)
    if grid is None:
        return score_transforms_reference(T, points, index, max_distance, with_matches,
                                          with_sums)
    Tp = T.detach().to(points.dtype)
    R = Tp[:, :3, :3].contiguous().numpy()
    t = Tp[:, :3, 3].contiguous().numpy()
    c, sq, m = grid.score(R, t, points.detach().contiguous().numpy(), with_matches,
                          with_sums)
    return (torch.from_numpy(c), torch.from_numpy(sq) if sq is not None else None,
            torch.from_numpy(m) if m is not None else None)


def second_order(A: torch.Tensor) -> torch.Tensor:
    """Second-order compatibility ``A ⊙ (A A)`` of ``A (C, C)`` (0/1 float32): ``(C, C)``.

    On the "cpu" backend by bit sets (``cpu.second_order_cpu``: equal to the reference bit
    for bit, the counts being exact integers), else :func:`second_order_reference`.
    """
    if (backend(A) == "cpu" and A.device.type == "cpu" and A.dtype == torch.float32
            and 0 < A.shape[0] < 1 << 24):
        from pointalign.kernels.ransac import cpu as _ransac_cpu

        return _ransac_cpu.second_order_cpu(A)
    return second_order_reference(A)


def second_order_of_points(source: torch.Tensor, target: torch.Tensor,
                           tau: float) -> torch.Tensor:
    """Second-order compatibility of correspondences ``source, target (C, 3)``: ``(C, C)``.

    The length-consistency graph: ``A_ij = 1`` when ``|ds_ij − dt_ij| < tau`` and i ≠ j,
    with ``ds, dt`` the :func:`pair_lengths` of the source and target ends; the answer is
    :func:`second_order` ``(A)``. On the "cpu" backend with float32 ends one kernel computes
    the lengths and A's bit sets pair by pair (``cpu.second_order_points_cpu``, equal bit
    for bit: neither the lengths nor A are stored), else A is formed
    (:func:`~pointalign.kernels.ransac.reference.compatibility_reference`) and passed on.
    """
    c = source.shape[0]
    if (backend(source) == "cpu" and source.device.type == "cpu"
            and source.dtype == torch.float32 and target.dtype == torch.float32
            and 0 < c < 1 << 24):
        from pointalign.kernels.ransac import cpu as _ransac_cpu

        return _ransac_cpu.second_order_points_cpu(source, target, tau)
    return second_order(compatibility_reference(source, target, tau))


def feature_matches_many(source: torch.Tensor, target: torch.Tensor, n: torch.Tensor,
                         m: torch.Tensor, k: int = 2, *, backward: bool = True
                         ) -> FeatureMatches:
    """Feature matches of B problems at once (see the module contract).

    Args:
        source: ``(B, N, D)`` float tensor, problem b's first ``n[b]`` rows valid.
        target: ``(B, M, D)`` float tensor, problem b's first ``m[b]`` rows valid.
        n: ``(B,)`` int64 tensor on the device.
        m: ``(B,)`` int64 tensor, each >= k.
        k: forward neighbours per source row.
        backward: also find each target row's nearest source row.

    Returns:
        :class:`FeatureMatches` with ``(B, N, k)`` forward and ``(B, M, 1)`` backward tables.

    """
    if source.dim() != 3 or target.dim() != 3 or source.shape[0] != target.shape[0] \
            or source.shape[2] != target.shape[2] or not 1 <= k <= target.shape[1]:
        raise ValueError(f"feature_matches_many: expected (B, N, D), (B, M, D) and 1 <= k <= "
                         f"M, got {tuple(source.shape)}, {tuple(target.shape)}, k={k}")
    if _triton_applies(source, target, k):
        from pointalign.kernels.ransac import triton as _ransac_triton

        return FeatureMatches(*_ransac_triton.feature_knn(source, target, k, n, m,
                                                          backward=backward))
    from pointalign.kernels.ransac.reference import feature_knn_many_reference

    d, i = feature_knn_many_reference(source, target, n, m, k)
    if not backward:
        return FeatureMatches(d, i)
    return FeatureMatches(d, i, *feature_knn_many_reference(target, source, m, n, 1))


def second_order_of_points_many(source: torch.Tensor, target: torch.Tensor,
                                counts: torch.Tensor, tau: float) -> torch.Tensor:
    """Second-order compatibility of B problems' correspondences (see the module contract).

    Args:
        source: ``(B, C, 3)`` float tensor, problem b's first ``counts[b]`` rows valid.
        target: ``(B, C, 3)`` float tensor.
        counts: ``(B,)`` int64 tensor on the device.
        tau: the length tolerance.

    Returns:
        ``(B, C, C)`` float32, zero in padding rows and columns.

    """
    b, c = source.shape[0], source.shape[1]
    if (backend(source) == "cpu" and source.device.type == "cpu"
            and source.dtype == torch.float32 and target.dtype == torch.float32
            and 0 < c < 1 << 24):
        from pointalign.kernels.ransac import cpu as _ransac_cpu

        out = torch.zeros(b, c, c, dtype=torch.float32)
        for j, n in enumerate(counts.tolist()):
            if n:
                out[j, :n, :n] = _ransac_cpu.second_order_points_cpu(
                    source[j, :n].contiguous(), target[j, :n].contiguous(), tau)
        return out
    valid = torch.arange(c, device=source.device)[None] < counts[:, None]          # (B, C)
    A = compatibility_reference(source, target, tau)
    A = A * (valid[:, :, None] & valid[:, None, :]).to(A.dtype)
    return second_order_reference(A)


__all__ = ["FeatureMatches", "Hypotheses", "feature_knn", "feature_knn_reference",
           "feature_matches", "feature_matches_many", "second_order_of_points_many",
           "pair_lengths", "ranking_keys", "ranking_keys_reference", "score_transforms",
           "score_transforms_reference", "second_order", "second_order_of_points",
           "second_order_of_points_reference",
           "second_order_reference", "transform_points", "transform_points_reference",
           "triangle_motions", "triangle_similar"]
