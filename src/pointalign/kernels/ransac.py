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
* ``triangle_similar(src (H, 3, 3), tgt (H, 3, 3), similarity) -> (H,) bool``: for the
  three edges e of the source triangle and the matching target edges,
  ``min(l_s, l_t) >= (1 - similarity) · max(l_s, l_t)`` and both > 0 (the polygon test of
  Bolles & Fischler, as used in the parallel RANSAC paper; Open3D's edge-length checker
  with ``similarity_threshold = 1 - similarity``).
* ``transform_points(T (S, 4, 4), points (P, 3)) -> (S, P, 3)`` in the points' dtype.
"""

from __future__ import annotations

import torch

from pointalign.kernels._backend import backend

#: feature-distance entries per chunk of ``feature_knn``
_CHUNK_ENTRIES = 1 << 24


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
    if (backend(query) == "cpu" and query.device.type == "cpu" and ref.device.type == "cpu"
            and query.dtype in (torch.float32, torch.float64) and ref.dtype == query.dtype):
        from pointalign.kernels import _ransac_cpu

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
    """``R_s p + t_s`` for every transform s and point p: ``(S, 4, 4), (P, 3) -> (S, P, 3)``."""
    Tp = T.to(points.dtype)
    # one batched GEMM with the translation as its bias: x Rᵀ + t
    return torch.baddbmm(Tp[:, None, :3, 3], points.expand(T.shape[0], -1, -1),
                         Tp[:, :3, :3].transpose(1, 2))
