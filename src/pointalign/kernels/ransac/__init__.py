"""RANSAC kernels: feature-space nearest neighbours, the triangle test, batched transforms.

Contracts (the PyTorch references here are the spec; no Triton kernel: each operation is a
single fused PyTorch op or a GEMM that already runs near the GPU's limits, so a
hand-written kernel would not clearly pay):

* ``feature_knn(query (N, D), ref (M, D), k) -> (dists_sq (N, k), idx (N, k) int64)``:
  exact k nearest rows of ``ref`` in Euclidean feature space, ascending, ``k <= M``.
  Reference: distances from ``torch.cdist`` over row chunks (the N×M matrix exists one
  chunk at a time), clamped at 0. The "cpu" backend (``_ransac_cpu``, k <= 16) fuses the
  distances and the selection and sums ``(q_d − r_d)²`` directly; the two agree up to
  ``cdist``'s rounding (a neighbour can differ only between near-equidistant rows).
  Inside :func:`shared_feature_knn` ``(a, b)``, the calls ``feature_knn(a, b, k <= K)`` and
  ``feature_knn(b, a, 1)`` on that backend are answered from one fused pass over the
  ``N × M`` distances (identical answers: the same sums, the same tie rule).
* ``triangle_similar(src (H, 3, 3), tgt (H, 3, 3), similarity) -> (H,) bool``: for the
  three edges e of the source triangle and the matching target edges,
  ``min(l_s, l_t) >= (1 - similarity) · max(l_s, l_t)`` and both > 0 (the polygon test of
  Bolles & Fischler, as used in the parallel RANSAC paper; Open3D's edge-length checker
  with ``similarity_threshold = 1 - similarity``).
* ``transform_points(T (S, 4, 4), points (P, 3) or (S, P, 3)) -> (S, P, 3)`` in the points'
  dtype. Reference: one ``baddbmm``; the "cpu" backend moves the points in one numba pass
  with the products and sums ``baddbmm`` makes on the CPU (below).
* ``score_transforms(T (S, 4, 4), points (P, 3), index, max_distance, with_matches)
  -> (counts (S,) int64, sums (S,) float64, matches (S, P) int64 | None)``: per transform,
  the points whose moved position has an indexed point within ``max_distance``, the sum of
  their squared distances (``with_sums``), and (``with_matches``) every point's match
  (−1: none).
  Reference (:func:`score_transforms_reference`): :func:`transform_points_reference`, then the
  index's ``nearest_within``, then sums in PyTorch. The "cpu" index with a scoring grid
  (``_score_cpu.BoundGrid``) runs one fused numba kernel instead: no ``(S, P, 3)`` tensor
  and, without matches, no ``(S·P,)`` results. It moves the points with the same float32
  products and sums as ``baddbmm`` on the CPU (``((p₀r₀ + p₁r₁) + p₂r₂) + t``, no fused
  multiply-add), so counts and matches are identical; the float64 sums differ from the
  reference's only in summation order (blocks of points in a fixed order, see
  ``_score_cpu._score``).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from pointalign.kernels._backend import backend

#: feature-distance entries per chunk of ``feature_knn``
_CHUNK_ENTRIES = 1 << 24
#: queries per call of the index when :func:`score_transforms_reference` scores many motions
SCORE_QUERIES = 1 << 21


def feature_knn_reference(query: torch.Tensor, ref: torch.Tensor,
                          k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked ``cdist`` + ``topk`` (PyTorch reference of :func:`feature_knn`)."""
    n, m = query.shape[0], ref.shape[0]
    d_out = torch.empty(n, k, dtype=query.dtype, device=query.device)
    i_out = torch.empty(n, k, dtype=torch.int64, device=query.device)
    step = max(1, _CHUNK_ENTRIES // max(m, 1))
    for s in range(0, n, step):
        e = min(n, s + step)
        d = torch.cdist(query[s:e], ref).square_()
        vals, idx = torch.topk(d, k, dim=1, largest=False, sorted=True)
        d_out[s:e] = vals.clamp_min_(0)
        i_out[s:e] = idx
    return d_out, i_out


def _fused_applies(query: torch.Tensor, ref: torch.Tensor) -> bool:
    """Return True when the "cpu" kernel answers ``feature_knn(query, ref, ·)``."""
    return (backend(query) == "cpu" and query.device.type == "cpu" and ref.device.type == "cpu"
            and query.dtype in (torch.float32, torch.float64) and ref.dtype == query.dtype)


class SharedFeatureKnn:
    """Answers ``feature_knn(a, b, k' <= k)`` and ``feature_knn(b, a, 1)`` from one pass.

    Made by :func:`shared_feature_knn`; a context manager that may be entered more than once
    (the pass runs at most once, on the first matching call inside any of the blocks).
    """

    def __init__(self, a: torch.Tensor, b: torch.Tensor, k: int, enabled: bool):
        self.a, self.b, self.k, self.enabled = a, b, k, enabled
        self.versions = (a._version, b._version)
        self.out: tuple[torch.Tensor, ...] | None = None
        self._prev: list[Any] = []

    def __enter__(self) -> SharedFeatureKnn:
        self._prev.append(getattr(_shared, "entry", None))
        _shared.entry = self if self.enabled else None
        return self

    def __exit__(self, *exc: object) -> None:
        _shared.entry = self._prev.pop()

    def answer(self, query: torch.Tensor, ref: torch.Tensor,
               k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Return the shared answer of ``feature_knn(query, ref, k)``, or None."""
        if (self.a._version, self.b._version) != self.versions:
            return None  # modified in place since: search again
        if query is self.a and ref is self.b and k <= self.k:
            fwd = True
        elif query is self.b and ref is self.a and k == 1:
            fwd = False
        else:
            return None
        if self.out is None:
            from pointalign.kernels.ransac import cpu as _ransac_cpu

            self.out = _ransac_cpu.feature_knn_both_cpu(self.a, self.b, self.k)
        d, i, bd, bi = self.out
        if not fwd:
            return bd.clone(), bi.clone()
        return d[:, :k].contiguous(), i[:, :k].contiguous()


_shared = threading.local()


def shared_feature_knn(a: torch.Tensor, b: torch.Tensor, k: int = 2) -> SharedFeatureKnn:
    """Share the work of ``feature_knn(a, b, k' <= k)`` and ``feature_knn(b, a, 1)``.

    Inside ``with`` blocks of the returned object (this thread only), on the "cpu" backend,
    the first such call runs the fused kernel once (``_ransac_cpu.feature_knn_both_cpu``)
    and every matching call is served from it: the same tensors (``is``), not modified in
    place since. Other calls, and every call on other backends, search as usual. The
    answers are those of separate calls (same sums in the same order, same tie rule): only
    the work is shared.

    Args:
        a: ``(N, D)`` float tensor (e.g. the source features), N >= 1.
        b: ``(M, D)`` float tensor, same dtype and device.
        k: largest forward k served (``1 <= k``; larger than ``M`` or the kernel's limit:
            no sharing).

    """
    ok = (a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1] and a.shape[0] >= 1
          and _fused_applies(a, b))
    if ok:
        from pointalign.kernels.ransac import cpu as _ransac_cpu

        ok = 1 <= k <= min(b.shape[0], _ransac_cpu.MAX_K)
    return SharedFeatureKnn(a, b, k, ok)


def feature_knn(query: torch.Tensor, ref: torch.Tensor,
                k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact k nearest neighbours in feature space (entry point; see the module contract).

    Args:
        query: ``(N, D)`` float tensor.
        ref: ``(M, D)`` float tensor, same dtype and device.
        k: neighbours per query, 1 <= k <= M.

    """
    if query.dim() != 2 or ref.dim() != 2 or query.shape[1] != ref.shape[1]:
        raise ValueError(f"feature_knn: expected (N, D) and (M, D), got {tuple(query.shape)} "
                         f"and {tuple(ref.shape)}")
    if not 1 <= k <= ref.shape[0]:
        raise ValueError(f"feature_knn: k must be in [1, {ref.shape[0]}], got {k}")
    if _fused_applies(query, ref):
        from pointalign.kernels.ransac import cpu as _ransac_cpu

        entry = getattr(_shared, "entry", None)
        got = None if entry is None else entry.answer(query, ref, k)
        if got is not None:
            return got
        if k <= _ransac_cpu.MAX_K:
            return _ransac_cpu.feature_knn_cpu(query, ref, k)
    return feature_knn_reference(query, ref, k)


def triangle_similar(src: torch.Tensor, tgt: torch.Tensor, similarity: float) -> torch.Tensor:
    """Edge-length ratio test of triangle pairs ``(H, 3, 3)`` → ``(H,)`` bool (see contract)."""
    ls = (src - src.roll(1, dims=-2)).norm(dim=-1)  # (H, 3)
    lt = (tgt - tgt.roll(1, dims=-2)).norm(dim=-1)
    lo, hi = torch.minimum(ls, lt), torch.maximum(ls, lt)
    ok = (lo >= (1.0 - similarity) * hi) & (lo > 0)
    return ok.all(-1)


def transform_points(T: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """``R_s p + t_s`` for every transform s and point p, in the points' dtype.

    ``T (S, 4, 4)`` and ``points (P, 3)`` (every transform moves the same points) or
    ``(S, P, 3)`` (transform s moves ``points[s]``) → ``(S, P, 3)``. On the "cpu" backend
    one parallel numba pass (``_score_cpu.move_points``: the reference's products and sums
    in the same order, see the module contract), else :func:`transform_points_reference`.
    """
    if (backend(points) == "cpu" and T.device.type == "cpu" and not points.requires_grad
            and not T.requires_grad and points.dtype in (torch.float32, torch.float64)):
        from pointalign.kernels.ransac import score_cpu as _score_cpu

        Tp = T.detach().to(points.dtype)
        pts = points if points.dim() == 3 else points[None]
        return torch.from_numpy(_score_cpu.move_points(
            Tp[:, :3, :3].contiguous().numpy(), Tp[:, :3, 3].contiguous().numpy(),
            pts.detach().contiguous().numpy()))
    return transform_points_reference(T, points)


def transform_points_reference(T: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :func:`transform_points`: one batched GEMM, ``x Rᵀ + t``."""
    Tp = T.to(points.dtype)
    src = points if points.dim() == 3 else points.expand(T.shape[0], -1, -1)
    return torch.baddbmm(Tp[:, None, :3, 3], src, Tp[:, :3, :3].transpose(1, 2))


def score_transforms_reference(T: torch.Tensor, points: torch.Tensor, index: Any,
                               max_distance: float, with_matches: bool = False,
                               with_sums: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Move by :func:`transform_points_reference`, ask ``index.nearest_within`` (the reference)."""
    from pointalign import _validate

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


def score_transforms(T: torch.Tensor, points: torch.Tensor, index: Any, max_distance: float,
                     with_matches: bool = False, with_sums: bool = True
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

    Returns:
        ``counts (S,) int64``, ``sums (S,) float64`` (squared distances of the inliers) or
        None (``with_sums=False``) and ``matches (S, P) int64`` (−1: no indexed point within
        the bound) or None.

    """
    if T.dim() != 3 or T.shape[1:] != (4, 4):
        raise ValueError(f"T: expected shape (S, 4, 4), got {tuple(T.shape)}")
    if points.dim() != 2 or points.shape[1] != 3:
        raise ValueError(f"points: expected shape (P, 3), got {tuple(points.shape)}")
    s, p = T.shape[0], points.shape[0]
    if s == 0:
        dev = points.device
        return (torch.zeros(0, dtype=torch.int64, device=dev),
                torch.zeros(0, dtype=torch.float64, device=dev) if with_sums else None,
                torch.zeros(0, p, dtype=torch.int64, device=dev) if with_matches else None)
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
