"""GICP kernels: plane-regularised covariances, the Mahalanobis normal equations, voxel maps.

Contracts (the PyTorch spec of each is in :mod:`.reference`; the numba kernels are in
``cpu.py``, the Triton kernels in ``triton.py``; :func:`pointalign.kernels.backend` picks):

* ``covariances(points (N, 3), nbr_idx (Q, K) int64, eps) -> (Q, 3, 3)``: the
  plane-regularised covariance ``I − (1 − ε) n nᵀ`` of each neighbourhood (n its smallest
  eigenvector; ``-1`` = no neighbour), in one pass over the neighbour table (mean and
  covariance in float64); **fallback I** for fewer than 3 neighbours or a neighbourhood
  that does not span a plane (:func:`pointalign._math.spans_plane`). Never NaN for finite
  points. Dtype of the points.
* ``knn_covariances(points (N, 3), k, eps, tree=None) -> (N, 3, 3) | None``:
  ``covariances`` of each point's k nearest points (itself included; the exact k-NN of
  every index, ties by index on the CPU), with no index from the caller: numba fuses the
  search and the reduction in one pass (float32 finite points: the same result as the
  search then ``covariances``, bit for bit); the Triton path self-queries a k-d tree in
  tree order, then ``covariances``: the given ``tree``, or one built over the points padded
  to a size class, the whole as one CUDA graph per class (up to
  ``SELF_QUERY_GRAPH_MAX`` points); None elsewhere (the caller searches an index).
* ``knn_covariances_ordered(points (N, 3), k, eps) -> (cov (N, 3, 3), order (N,)) | None``:
  the Triton self-query's covariances left in the order of the k-d tree it builds (a
  spatially coherent order for queries), with that order: ``cov[i]`` is point
  ``order[i]``'s. None where ``knn_covariances`` has no graph of its own.
* ``gicp_sums(source, source_cov, target, target_cov, idx, rotation, lengths, center,
  kernel, scale) -> (B, 30)`` float64: the Gauss-Newton normal equations of the
  plane-to-plane cost over the pairs ``(i, idx[b, i, s])``, laid out as ``normal_eq``'s
  point-to-plane sums (``[0:21]`` JᵀWMJ, ``[21:27]`` JᵀWMr, ``[27]`` Σ w rᵀMr) plus
  ``[28]`` matched source rows and ``[29]`` their mean squared distances summed
  (:func:`.reference.gicp_sums_reference`). The Triton kernel accumulates blocks in
  float32 and adds the block partials in float64; the numba kernel and the reference
  compute in float64.
* ``gicp_update(...)``: ``gicp_sums`` followed by ``normal_eq``'s 6×6 point-to-plane
  solve (the same least-norm rule and un-centring), on the device:
  ``(sums, D, T_new, T_new as float32, flags)`` as :func:`pointalign.kernels.normal_eq.icp_update`.
* ``vgicp_update(source, source_cov, vmap, neighborhood, ...)``: one VGICP step from the
  unmoved source: ``transform_points`` by the float32 estimate, ``voxel_lookup``, then
  ``gicp_update`` against the voxel Gaussians. The numba path fuses the move, the look-up
  and the sums in one pass (the same bits as the three calls); elsewhere the three calls.
* ``voxelize(points (B, M, 3), lengths, covariances (B, M, 3, 3), voxel_size) -> VoxelMap``
  and ``voxel_lookup(points (B, N, 3), vmap, neighborhood) -> (B, N)`` int64: the
  Gaussian voxel map of VGICP and, for each point, the occupied voxel around it whose mean
  is nearest (integer answers, equal on every backend).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pointalign.kernels import _loop, kdtree, normal_eq
from pointalign.kernels._backend import backend
from pointalign.kernels.gicp.reference import (
    KERNELS,
    NEIGHBORHOODS,
    PLANE_EPS,
    ROBUST_SCALE2,
    WIDTH,
    VoxelMap,
    covariances_reference,
    gicp_sums_reference,
    voxel_lookup_reference,
    voxelize_reference,
)
from pointalign.kernels.kdtree import TreeArrays

#: rows (about) per k-d tree self-query of the Triton path (a neighbour table of ~160 MB)
_SELF_QUERY_CHUNK = 1 << 20

#: leaf size of the k-d tree the Triton self-query builds (a KDTreeIndex's default)
SELF_QUERY_LEAF = 16

#: clouds of up to this many points get the Triton self-query as one CUDA graph per size
#: class (:func:`size_class`); larger ones search the caller's index
SELF_QUERY_GRAPH_MAX = 1 << 19

__all__ = ["KERNELS", "NEIGHBORHOODS", "PLANE_EPS", "ROBUST_SCALE2", "WIDTH", "VoxelMap",
           "covariances", "gicp_step_cpu", "gicp_sums", "gicp_update", "knn_covariances",
           "knn_covariances_ordered", "size_class", "vgicp_update", "voxel_lookup", "voxelize"]


def covariances(points: torch.Tensor, nbr_idx: torch.Tensor,
                eps: float = PLANE_EPS) -> torch.Tensor:
    """Plane-regularised covariance of each neighbourhood (entry point; see the contract).

    Args:
        points: ``(N, 3)`` float tensor; ``nbr_idx`` indexes it.
        nbr_idx: ``(Q, K)`` int64 neighbour indices (``-1`` = none), one row per output.
        eps: the regularisation ε (eigenvalues ``(ε, 1, 1)``), in (0, 1].

    Returns:
        ``(Q, 3, 3)`` symmetric positive definite matrices in the points' dtype.

    """
    if points.dim() != 2 or points.shape[1] != 3 or nbr_idx.dim() != 2 \
            or nbr_idx.dtype != torch.int64 or nbr_idx.device != points.device:
        raise ValueError(f"covariances: expected points (N, 3) and an int64 nbr_idx (Q, K) on "
                         f"the points' device, got {tuple(points.shape)} and "
                         f"{tuple(nbr_idx.shape)} {nbr_idx.dtype} on {nbr_idx.device}")
    if not 0 < eps <= 1:
        raise ValueError(f"eps: must be in (0, 1], got {eps}")
    be = backend(points)
    if be == "cpu":
        from pointalign.kernels.gicp import cpu as _gicp_cpu

        return _gicp_cpu.covariances_cpu(points, nbr_idx, eps)
    if be in ("triton", "interpret"):
        from pointalign.kernels.gicp import triton as _gicp_triton

        return _gicp_triton.covariances(points, nbr_idx, eps)
    return covariances_reference(points, nbr_idx, eps)


def knn_covariances(points: torch.Tensor, k: int, eps: float = PLANE_EPS, *,
                    tree: TreeArrays | None = None) -> torch.Tensor | None:
    """Plane-regularised covariances of each point's k-NN, searched here (see the contract).

    Args:
        points: ``(N, 3)`` float tensor, ``N >= k``.
        k: neighbours per point, the point itself included (``1 <= k <= N``).
        eps: the regularisation ε, in (0, 1].
        tree: a k-d tree over exactly these points (a
            :class:`~pointalign.search.kdtree.KDTreeIndex`'s arrays), for the Triton path.

    Returns:
        ``(N, 3, 3)`` in the points' dtype, or None where the backend has no such path
        (search an index, then :func:`covariances`). The "cpu" backend fuses the search and
        the reduction (float32 finite points; ``tree`` not needed). The Triton path asks
        every point's k nearest in tree order (:func:`pointalign.kernels.kdtree.self_knn`:
        a leaf's points walk the tree together; no grouping of the queries, no scatter of
        the answers) and reduces them with
        :func:`covariances`: in the given ``tree``, else in a tree built here, the build,
        search and reduction replayed as one CUDA graph per :func:`size_class` (clouds of
        up to :data:`SELF_QUERY_GRAPH_MAX` points; None above).

    """
    if points.dim() != 2 or points.shape[1] != 3:
        raise ValueError(f"points: expected shape (N, 3), got {tuple(points.shape)}")
    n = points.shape[0]
    if not 1 <= int(k) <= n:
        raise ValueError(f"k: expected 1 <= k <= {n}, got {k}")
    if not 0 < eps <= 1:
        raise ValueError(f"eps: must be in (0, 1], got {eps}")
    be = backend(points)
    if be == "cpu":
        from pointalign.kernels.gicp import cpu as _gicp_cpu

        return _gicp_cpu.knn_covariances_cpu(points, int(k), float(eps))
    if be not in ("triton", "interpret") or k > kdtree.TRITON_MAX_K:
        return None
    if tree is None:
        out = _size_class_self_query(points, int(k), float(eps))
        return None if out is None else out["cov"]
    if tree.points.shape != points.shape or tree.points.device != points.device:
        raise ValueError(f"tree: built over {tuple(tree.points.shape)} points on "
                         f"{tree.points.device}, expected {tuple(points.shape)} on "
                         f"{points.device}")
    return _tree_self_query(tree, int(k), float(eps))


def _tree_self_query(tree: TreeArrays, k: int, eps: float) -> torch.Tensor:
    """Covariances of every tree point's k-NN, asked in tree order, in the points' order."""
    cov = _tree_order_covariances(tree, k, eps)
    out = torch.empty_like(cov)
    out[tree.perm] = cov
    return out


def _tree_order_covariances(tree: TreeArrays, k: int, eps: float) -> torch.Tensor:
    """Covariances ``(M, 3, 3)`` of every tree point's k-NN, in tree order."""
    n, depth = tree.points.shape[0], tree.depth
    cov = torch.empty(n, 3, 3, dtype=tree.points.dtype, device=tree.points.device)
    leaves = 2**depth
    step = max(1, (leaves * _SELF_QUERY_CHUNK) // n)  # leaves a chunk: bounds the table
    for a in range(0, leaves, step):
        b = min(leaves, a + step)
        _, nbr = kdtree.self_knn(tree, k, (a, b))  # tree positions, in any order
        cov[(a * n) >> depth: (b * n) >> depth] = covariances(tree.points, nbr, eps)
    return cov


def size_class(n: int) -> int:
    """Round ``n >= 1`` up to one of 8 sizes per octave (at most 12.5 % more, at least 64)."""
    if int(n) < 1:
        raise ValueError(f"n: expected a count >= 1, got {n}")
    n = max(int(n), 64)
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step


def _far_rows(points: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``points (P, 3)`` with each row not ``real`` replaced by a distinct far point.

    The far points lie on a row beyond the real points' box by more than the box's extent,
    one step apart (farther from every real point than any two real points are from each
    other, so never among a real point's k nearest for ``k <=`` the real count; copies of
    one point would tie at distance 0 and defeat the search's pruning: 6.5k copies padding
    100k points took the program from 6.8 to 12.5 ms, H200).
    """
    big = torch.finfo(points.dtype).max
    lo = torch.where(real[:, None], points, big).amin(0)
    hi = torch.where(real[:, None], points, -big).amax(0)
    step = (hi - lo).amax() + 1
    far = (hi + 2 * step).expand(points.shape[0], 3).clone()
    far[:, 0] += torch.arange(points.shape[0], device=points.device,
                              dtype=points.dtype) * step
    return torch.where(real[:, None], points, torch.nan_to_num(far, posinf=big))


@dataclasses.dataclass(frozen=True)
class _SelfQueryProgram:
    """Build a k-d tree over a cloud, ask each point's k nearest in tree order, reduce.

    A fixed device program (:func:`pointalign.kernels._loop.run_program`): input
    ``points (P, 3)``, the cloud's rows and then rows of NaN (padding up to a size class;
    each replaced by a far point, :func:`_far_rows`); output ``cov (P, 3, 3)`` in the
    points' order, or ``ordered``: ``cov`` and ``order (P,)`` int64 in the tree's order
    with the cloud's rows first (``cov[i]`` is row ``order[i]``'s).
    """

    k: int
    eps: float
    depth: int
    ordered: bool = False

    def __call__(self, inputs: dict[str, torch.Tensor], checkpoint: object
                 ) -> dict[str, torch.Tensor]:
        pts = inputs["points"]
        real = ~torch.isnan(pts[:, 0])
        pts = _far_rows(pts, real)
        layout = kdtree.build_layout(pts.shape[0], self.depth, pts.device)
        tree = kdtree.build(pts, self.depth, "device", layout=layout, graph=False)
        if not self.ordered:
            return {"cov": _tree_self_query(tree, self.k, self.eps)}
        cov = _tree_order_covariances(tree, self.k, self.eps)
        # the cloud's rows first, in tree order (a stable partition by one running count)
        keep = real[tree.perm]
        count = torch.cumsum(keep, 0)
        pos = torch.arange(keep.shape[0], device=pts.device)
        dest = torch.where(keep, count - 1, count[-1] + pos - count)
        order, cov_out = torch.empty_like(tree.perm), torch.empty_like(cov)
        order[dest] = tree.perm
        cov_out[dest] = cov
        return {"cov": cov_out, "order": order}


def _size_class_self_query(points: torch.Tensor, k: int, eps: float, ordered: bool = False
                           ) -> dict[str, torch.Tensor] | None:
    """Run the Triton self-query of ``knn_covariances`` without a tree: a graph per size class.

    The points are padded to :func:`size_class` with rows of NaN, which the program
    replaces by far points (:func:`_far_rows`), and the padding, the build, the search and
    the reduction run as one program: a CUDA graph per size class and ``k``, captured on
    its first call and replayed after (a build is a few launches a level of a few
    microseconds of work each below 10^5 points). Returns :class:`_SelfQueryProgram`'s
    outputs cut to the cloud's ``N`` rows. Clouds above :data:`SELF_QUERY_GRAPH_MAX`
    points: None (the caller's index; launches are negligible there).
    """
    n = points.shape[0]
    if n > SELF_QUERY_GRAPH_MAX:
        return None
    size = size_class(n)
    padded = torch.empty(size, 3, dtype=points.dtype, device=points.device)
    padded[:n] = points
    padded[n:] = float("nan")
    depth = kdtree.depth_for(size, SELF_QUERY_LEAF)
    _, out = _loop.run_program(_SelfQueryProgram(k, eps, depth, ordered), {"points": padded},
                               host_outputs=False)
    return {name: v[:n] for name, v in out.items()}


def knn_covariances_ordered(points: torch.Tensor, k: int, eps: float = PLANE_EPS
                            ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Covariances of each point's k-NN in the order of the k-d tree searched (see contract).

    Args:
        points: ``(N, 3)`` float32 tensor, ``k <= N``.
        k: neighbours per point, the point itself included.
        eps: the regularisation ε, in (0, 1].

    Returns:
        ``(cov (N, 3, 3), order (N,) int64)``, ``cov[i]`` the covariance of point
        ``order[i]`` and ``order`` a spatially coherent order (the tree's: queries sent in
        it visit the same nodes), or None where the backend has no graph of its own (the
        "cpu" backend, clouds above :data:`SELF_QUERY_GRAPH_MAX` points, ``k`` above the
        kernel's): call :func:`knn_covariances` then.

    """
    if points.dim() != 2 or points.shape[1] != 3:
        raise ValueError(f"points: expected shape (N, 3), got {tuple(points.shape)}")
    if not 1 <= int(k) <= points.shape[0]:
        raise ValueError(f"k: expected 1 <= k <= {points.shape[0]}, got {k}")
    if backend(points) not in ("triton", "interpret") or k > kdtree.TRITON_MAX_K \
            or points.dtype != torch.float32:
        return None
    out = _size_class_self_query(points, int(k), float(eps), ordered=True)
    return None if out is None else (out["cov"], out["order"])


def _check(source, source_cov, target, target_cov, idx, rotation, lengths, center, kernel,
           scale) -> None:
    if source.dim() != 3 or source.shape[-1] != 3:
        raise ValueError(f"source: expected shape (B, N, 3), got {tuple(source.shape)}")
    B, N = source.shape[:2]
    if target.dim() != 3 or target.shape[0] != B or target.shape[-1] != 3:
        raise ValueError(f"target: expected shape ({B}, M, 3), got {tuple(target.shape)}")
    if tuple(source_cov.shape) != (B, N, 3, 3):
        raise ValueError(f"source_cov: expected shape ({B}, {N}, 3, 3), got "
                         f"{tuple(source_cov.shape)}")
    if tuple(target_cov.shape) != (*target.shape, 3):
        raise ValueError(f"target_cov: expected shape {(*target.shape, 3)}, got "
                         f"{tuple(target_cov.shape)}")
    if idx.dim() != 3 or idx.shape[:2] != (B, N) or idx.dtype != torch.int64:
        raise ValueError(f"idx: expected ({B}, {N}, S) int64, got {tuple(idx.shape)} "
                         f"{idx.dtype}")
    if tuple(rotation.shape) != (B, 3, 3):
        raise ValueError(f"rotation: expected shape ({B}, 3, 3), got {tuple(rotation.shape)}")
    if tuple(lengths.shape) != (B,):
        raise ValueError(f"lengths: expected shape ({B},), got {tuple(lengths.shape)}")
    if tuple(center.shape) != (B, 3):
        raise ValueError(f"center: expected shape ({B}, 3), got {tuple(center.shape)}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    if not scale > 0:
        raise ValueError(f"scale: must be > 0, got {scale}")
    devs = {t.device for t in (source, source_cov, target, target_cov, idx, rotation, lengths,
                               center)}
    if len(devs) != 1:
        raise ValueError(f"gicp_sums: inputs on different devices {sorted(map(str, devs))}")


def gicp_sums(
    source: torch.Tensor,
    source_cov: torch.Tensor,
    target: torch.Tensor,
    target_cov: torch.Tensor,
    idx: torch.Tensor,
    rotation: torch.Tensor,
    *,
    lengths: torch.Tensor | None = None,
    center: torch.Tensor | None = None,
    kernel: str = "none",
    scale: float = 1.0,
) -> torch.Tensor:
    """Compute the GICP sums of one iteration in one fused pass (see the module contract).

    Args:
        source: ``(B, N, 3)`` float tensor, source points x already moved by the estimate.
        source_cov: ``(B, N, 3, 3)`` source covariances in the source's own frame.
        target: ``(B, M, 3)`` float tensor, target points (or voxel means) y.
        target_cov: ``(B, M, 3, 3)`` their covariances.
        idx: ``(B, N, S)`` int64 partners of each source row (``-1`` = none); ``(B, N)``
            is read as S = 1.
        rotation: ``(B, 3, 3)`` the estimate's rotation (turns the source covariances).
        lengths: ``(B,)`` int64 valid source rows (default N).
        center: ``(B, 3)`` centre of the linearisation (default 0).
        kernel: robust kernel ("none", "huber", "tukey", "cauchy").
        scale: the robust kernel's k (> 0, metres; it reads ``sqrt(ROBUST_SCALE2 · rᵀMr)``).

    Returns:
        ``(B, 30)`` float64 sums on the input's device.

    """
    B, N = source.shape[:2]
    if idx.dim() == 2:
        idx = idx[:, :, None]
    if lengths is None:
        lengths = torch.full((B,), N, dtype=torch.int64, device=source.device)
    if center is None:
        center = torch.zeros(B, 3, dtype=source.dtype, device=source.device)
    _check(source, source_cov, target, target_cov, idx, rotation, lengths, center, kernel,
           float(scale))
    be = backend(source)
    if be == "cpu":
        from pointalign.kernels.gicp import cpu as _gicp_cpu

        return _gicp_cpu.gicp_sums_cpu(source, source_cov, target, target_cov, idx, rotation,
                                       lengths, center, kernel, float(scale))
    if be in ("triton", "interpret"):
        from pointalign.kernels.gicp import triton as _gicp_triton

        return _gicp_triton.gicp_sums(source, source_cov, target, target_cov, idx, rotation,
                                      lengths, center, kernel, float(scale))
    return gicp_sums_reference(source, source_cov, target, target_cov, idx, rotation,
                               lengths=lengths, center=center, kernel=kernel, scale=scale)


def gicp_update(
    source: torch.Tensor,
    source_cov: torch.Tensor,
    target: torch.Tensor,
    target_cov: torch.Tensor,
    idx: torch.Tensor,
    *,
    transform: torch.Tensor,
    lengths: torch.Tensor,
    center: torch.Tensor,
    kernel: str = "none",
    scale: float = 1.0,
    eps: float = 1e-10,
) -> tuple[torch.Tensor, ...]:
    """One GICP step after the correspondences: the sums, the update and the new estimate.

    :func:`gicp_sums` (rotation: that of ``transform``, the float64 ``(B, 4, 4)`` estimate
    that moved the source) followed by the point-to-plane 6×6 solve of
    :func:`pointalign.kernels.normal_eq.solve_update_reference` (``eps``: its rank rule).
    On the Triton path the solve runs on the device (no host round trip).

    Returns:
        ``(sums (B, 30) float64, D (B, 4, 4) float64, T_new (B, 4, 4) float64, T_new as
        float32, flags (B, 2) int32 (valid, usable))``.

    """
    if idx.dim() == 2:
        idx = idx[:, :, None]
    rotation = transform[:, :3, :3].to(torch.float32)
    be = backend(source)
    if be in ("triton", "interpret"):
        from pointalign.kernels.gicp import triton as _gicp_triton

        _check(source, source_cov, target, target_cov, idx, rotation, lengths, center,
               kernel, float(scale))
        return _gicp_triton.gicp_update(source, source_cov, target, target_cov, idx,
                                        rotation, lengths, center, kernel, float(scale),
                                        transform.to(torch.float64).contiguous(), eps)
    s = gicp_sums(source, source_cov, target, target_cov, idx, rotation, lengths=lengths,
                  center=center, kernel=kernel, scale=scale)
    if be == "cpu":  # NumPy: a handful of 6×6 systems, where ~25 PyTorch ops cost ~1 ms
        D, Tn, fl = normal_eq.solve_update_plane_host(s, center, transform, eps=eps)
    else:
        D, Tn, fl = normal_eq.solve_update_reference(s, center, transform, plane=True, eps=eps)
    dev = source.device
    return (s, D.to(dev), Tn.to(dev), Tn.to(dev, torch.float32), fl.to(dev))


def gicp_step_cpu(
    source: torch.Tensor,
    source_cov: torch.Tensor,
    target: torch.Tensor,
    target_cov: torch.Tensor,
    tree: Any,
    hint: torch.Tensor,
    max_distance: float,
    *,
    transform: torch.Tensor,
    transform_f32: torch.Tensor,
    lengths: torch.Tensor,
    center: torch.Tensor,
    kernel: str = "none",
    scale: float = 1.0,
    eps: float = 1e-10,
) -> tuple[torch.Tensor, ...] | None:
    """One whole GICP step on the "cpu" backend: move, search, sums and solve.

    The bits of ``transform_points(transform_f32, source)``, the target's host tree's
    ``nearest`` within ``max_distance`` from ``hint (B, N)`` (original indices, -1: none)
    and :func:`gicp_update`, in one numba pass (``cpu._gicp_step_sums``) and the host
    solve. ``source (B, N, 3)``, ``source_cov (B, N, 3, 3)``, ``target (B, M, 3)``,
    ``target_cov (B, M, 3, 3)``, ``transform (B, 4, 4)`` float64 and ``transform_f32``
    its float32 copy, ``lengths (B,)``, ``center (B, 3)``; ``tree``: the target's
    :class:`pointalign.kernels.knn.cpu.CpuTree` (one, shared by every entry).

    Returns:
        :func:`gicp_update`'s ``(sums, D, T_new, T_new as float32, flags)`` and the
        partners ``(B, N)`` int64 (-1: none, and every row past ``lengths[b]``); None
        off the "cpu" backend (the caller then runs the three passes).

    """
    if backend(source) != "cpu" or transform_f32.device.type != "cpu":
        return None
    from pointalign.kernels.gicp import cpu as _gicp_cpu

    B, N = source.shape[:2]
    md = float(max_distance)
    rotation = transform[:, :3, :3].to(torch.float32)
    _check(source, source_cov, target, target_cov, torch.empty(B, N, 1, dtype=torch.int64),
           rotation, lengths, center, kernel, float(scale))
    if tuple(hint.shape) != (B, N):
        raise ValueError(f"hint: expected shape ({B}, {N}), got {tuple(hint.shape)}")
    s, idx = _gicp_cpu.gicp_step_sums_cpu(source, source_cov, transform_f32, target,
                                          target_cov, tree, hint, md * md,
                                          rotation, lengths, center, kernel, float(scale))
    D, Tn, fl = normal_eq.solve_update_plane_host(s, center, transform, eps=eps)
    return (s, D, Tn, Tn.to(torch.float32), fl, idx)


def vgicp_update(
    source: torch.Tensor,
    source_cov: torch.Tensor,
    vmap: VoxelMap,
    neighborhood: int,
    *,
    transform: torch.Tensor,
    transform_f32: torch.Tensor,
    lengths: torch.Tensor,
    center: torch.Tensor,
    kernel: str = "none",
    scale: float = 1.0,
    eps: float = 1e-10,
) -> tuple[torch.Tensor, ...]:
    """One VGICP step: move, nearest voxel, sums, solve (see the module contract).

    Args:
        source: ``(B, N, 3)`` float tensor, the source points in their own frame.
        source_cov: ``(B, N, 3, 3)`` their covariances.
        vmap: the target's :class:`VoxelMap` (``B`` rows).
        neighborhood: cells searched per point (:data:`NEIGHBORHOODS`).
        transform: ``(B, 4, 4)`` float64 estimate (its rotation turns the covariances).
        transform_f32: the same in float32 (moves the points, as ``transform_points``).
        lengths: ``(B,)`` int64 valid source rows.
        center: ``(B, 3)`` centre of the linearisation.
        kernel: robust kernel (as :func:`gicp_sums`).
        scale: the robust kernel's k (> 0).
        eps: the solve's rank rule (as :func:`gicp_update`).

    Returns:
        :func:`gicp_update`'s ``(sums, D, T_new, T_new as float32, flags)``.

    """
    if neighborhood not in NEIGHBORHOODS:
        raise ValueError(f"neighborhood: expected one of {NEIGHBORHOODS}, got {neighborhood!r}")
    if backend(source) != "cpu" or transform_f32.device.type != "cpu":
        from pointalign.kernels import ransac as _kr

        x = _kr.transform_points(transform_f32, source)
        idx = voxel_lookup(x, vmap, neighborhood)
        return gicp_update(x, source_cov, vmap.means, vmap.covariances, idx,
                           transform=transform, lengths=lengths, center=center,
                           kernel=kernel, scale=scale, eps=eps)
    from pointalign.kernels.gicp import cpu as _gicp_cpu

    B, N = source.shape[:2]
    rotation = transform[:, :3, :3].to(torch.float32)
    _check(source, source_cov, vmap.means, vmap.covariances,
           torch.empty(B, N, 1, dtype=torch.int64), rotation, lengths, center, kernel,
           float(scale))
    s = _gicp_cpu.vgicp_sums_cpu(source, source_cov, transform_f32, vmap.keys, vmap.means,
                                 vmap.covariances, vmap.inv_size, neighborhood, rotation,
                                 lengths, center, kernel, float(scale))
    D, Tn, fl = normal_eq.solve_update_plane_host(s, center, transform, eps=eps)
    return (s, D, Tn, Tn.to(torch.float32), fl)


def voxelize(points: torch.Tensor, lengths: torch.Tensor, covariances: torch.Tensor,
             voxel_size: float, counts: list[int] | None = None) -> VoxelMap:
    """Gaussian voxel map of ``points (B, M, 3)`` with ``covariances (B, M, 3, 3)``.

    Rows ``>= lengths[b]`` are padding. numba on the CPU (one hashed pass, the same map);
    elsewhere the PyTorch reference (a sort of the voxel keys and segment sums on the
    points' device), run once per call: :func:`.reference.voxelize_reference`.
    """
    if points.dim() != 3 or points.shape[-1] != 3 \
            or tuple(covariances.shape) != (*points.shape, 3):
        raise ValueError(f"voxelize: expected points (B, M, 3) and covariances (B, M, 3, 3), "
                         f"got {tuple(points.shape)} and {tuple(covariances.shape)}")
    if not voxel_size > 0:
        raise ValueError(f"voxel_size: must be > 0, got {voxel_size}")
    if backend(points) == "cpu":
        from pointalign.kernels.gicp import cpu as _gicp_cpu

        return _gicp_cpu.voxelize_cpu(points, lengths.tolist() if counts is None
                                      else [int(c) for c in counts], covariances,
                                      float(voxel_size))
    return voxelize_reference(points, lengths, covariances, float(voxel_size), counts)


def voxel_lookup(points: torch.Tensor, vmap: VoxelMap, neighborhood: int = 1) -> torch.Tensor:
    """Find the nearest occupied voxel around each of ``points (B, N, 3)``: ``(B, N)`` int64.

    Candidates: the voxels at ``floor(p / voxel_size) + OFFSETS[s]``, ``s < neighborhood``
    (1: the point's own voxel, 7: and its six face neighbours, 27); the answer is the
    occupied one whose mean is nearest (its index in ``vmap.keys[b]``), ``-1`` when none
    is occupied. numba on the CPU; the PyTorch reference elsewhere (a batched
    ``searchsorted``: no synchronisation, graph capture safe).
    """
    if neighborhood not in NEIGHBORHOODS:
        raise ValueError(f"neighborhood: expected one of {NEIGHBORHOODS}, got {neighborhood!r}")
    if points.dim() != 3 or points.shape[-1] != 3 or points.shape[0] != vmap.keys.shape[0]:
        raise ValueError(f"points: expected shape ({vmap.keys.shape[0]}, N, 3), got "
                         f"{tuple(points.shape)}")
    if backend(points) == "cpu":
        from pointalign.kernels.gicp import cpu as _gicp_cpu

        return _gicp_cpu.voxel_lookup_cpu(points, vmap.keys, vmap.means, vmap.inv_size,
                                          neighborhood)
    return voxel_lookup_reference(points, vmap, neighborhood)
