"""The spec of the grid family: the built grid's layout, the cell keys and the reference query.

:func:`pointalign.kernels.grid.grid_build` sorts points into cells of edge ``c`` over their
bounding box; :func:`grid_query_reference` is the plain PyTorch statement of
:func:`pointalign.kernels.grid.grid_query` (the k nearest among the 27 cells around each
query, ties by original index). The Triton kernel (``grid/triton.py``) imports this module,
never its dispatcher.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from pointalign.kernels.knn.reference import _sort_rows

#: Cells are this much larger than asked, so rounding never hides a point within ``c``.
CELL_MARGIN = 1e-5


class GridData(NamedTuple):
    """A built grid (tensors on the points' device).

    Attributes:
        params: ``(4,)`` float64: origin x, y, z and ``1 / cell``.
        cell: the cell edge (float; already includes the safety margin).
        dims: ``(nx, ny, nz)`` cells per axis.
        cell_start: ``(nx * ny * nz + 1,)`` int32, sorted-order start of each cell.
        sorted_points: ``(3, M)`` coordinates in key order, structure of arrays.
        sorted_idx: ``(M,)`` int32 original index of each sorted point.
        dims_dev: ``(3,)`` int64 ``dims`` on the points' device (read by the kernel, so a
            query needs no host-to-device copy: no synchronisation, graph capture safe).

    """

    params: torch.Tensor
    cell: float
    dims: tuple[int, int, int]
    cell_start: torch.Tensor
    sorted_points: torch.Tensor
    sorted_idx: torch.Tensor
    dims_dev: torch.Tensor

    @property
    def radius(self) -> float:
        """The certified radius: every point within it of a query is in the query's 27 cells.

        The cell edge without the safety margin (the ``cell_size`` the grid was built for, or
        larger when ``max_cells`` forced larger cells).
        """
        return self.cell / (1 + CELL_MARGIN)


def _query_cells(g: GridData, query: torch.Tensor) -> torch.Tensor:
    """``(N, 3)`` int64 cell coordinates of queries, clamped to ``[-2, dim + 1]``."""
    c = ((query.to(torch.float64) - g.params[:3]) * g.params[3]).floor()
    hi = torch.tensor(g.dims, dtype=torch.float64, device=query.device) + 1
    return torch.maximum(torch.minimum(c, hi), torch.full_like(c, -2.0)).to(torch.int64)


def query_keys(g: GridData, query: torch.Tensor) -> torch.Tensor:
    """Linear cell key of each query (any order-preserving value for queries off the grid)."""
    c = _query_cells(g, query) + 2
    nx, ny, nz = (d + 4 for d in g.dims)
    return (c[:, 0] * ny + c[:, 1]) * nz + c[:, 2]


def _ranges(g: GridData, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Start and length ``(N, 9)`` of the 9 sorted-order ranges covering the 27 cells."""
    nx, ny, nz = g.dims
    c = _query_cells(g, query)
    cx, cy, cz = c[:, 0:1], c[:, 1:2], c[:, 2:3]
    d = torch.arange(-1, 2, device=query.device)
    x = (cx + d.repeat_interleave(3)[None, :])  # (N, 9)
    y = (cy + d.repeat(3)[None, :])
    zlo = (cz - 1).clamp(min=0)
    zhi = (cz + 1).clamp(max=nz - 1)
    ok = (x >= 0) & (x < nx) & (y >= 0) & (y < ny) & (zlo <= zhi)
    base = (x.clamp(0, nx - 1) * ny + y.clamp(0, ny - 1)) * nz
    cs = g.cell_start.to(torch.int64)
    s = cs[(base + zlo.clamp(max=nz - 1)).clamp(0, nx * ny * nz - 1)]
    e = cs[(base + zhi.clamp(min=0) + 1).clamp(0, nx * ny * nz)]
    s = torch.where(ok, s, torch.zeros_like(s))
    n = torch.where(ok, e - s, torch.zeros_like(s))
    return s, n


def grid_query_reference(g: GridData, query: torch.Tensor, k: int,
                         max_distance_sq: float | None = None, *,
                         budget: int = 1 << 21) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch reference of :func:`grid_query` (the CPU path and the spec).

    Gathers each query's candidates (the 9 ranges, padded to the longest row of a chunk,
    at most ``budget`` candidates per chunk), computes their squared distances and keeps
    the k smallest by (distance, original index).
    """
    n, dev, dt = query.shape[0], query.device, query.dtype
    out_d = torch.full((n, k), math.inf, dtype=dt, device=dev)
    out_i = torch.full((n, k), -1, dtype=torch.int64, device=dev)
    if n == 0:
        return out_d, out_i
    s_all, n_all = _ranges(g, query)
    tot = n_all.sum(1)
    pts = g.sorted_points
    sidx = g.sorted_idx.to(torch.int64)
    i = 0
    while i < n:
        # grow the chunk while the padded candidate matrix fits the budget
        step = max(1, min(n - i, budget // max(1, int(tot[i:i + 4096].max()))))
        sl = slice(i, i + step)
        s, ln, t = s_all[sl], n_all[sl], tot[sl]
        width = max(1, int(t.max()))
        pos = torch.arange(width, device=dev).expand(t.shape[0], width)
        cum = torch.cumsum(ln, 1)
        col = torch.searchsorted(cum, pos.contiguous(), right=True).clamp(max=8)
        off = pos - (cum.gather(1, col) - ln.gather(1, col))
        valid = pos < t[:, None]
        sp = torch.where(valid, s.gather(1, col) + off, torch.zeros_like(off))
        q = query[sl]
        d = ((pts[:, sp] - q.t()[:, :, None]) ** 2).sum(0)
        ok = valid if max_distance_sq is None else valid & (d <= max_distance_sq)
        d = torch.where(ok, d, torch.full_like(d, math.inf))
        oi = torch.where(ok, sidx[sp], torch.full_like(sp, -1))
        d, oi = _sort_rows(d, oi)
        kk = min(k, width)
        out_d[sl, :kk] = d[:, :kk]
        out_i[sl, :kk] = oi[:, :kk]
        i += step
    return out_d, out_i


#: candidate (query, point) pairs per pass of :func:`count_within_reference` (bounds its
#: temporaries to ~1 GB whatever the number of queries)
COUNT_BUDGET = 1 << 23


def count_within_reference(sorted_keys: torch.Tensor, sorted_points: torch.Tensor,
                           query: torch.Tensor, query_cell: torch.Tensor,
                           query_cloud: torch.Tensor, dims: torch.Tensor, base: torch.Tensor,
                           r2: torch.Tensor, cap: int, *, budget: int | None = None
                           ) -> torch.Tensor:
    """Plain PyTorch statement of :func:`pointalign.kernels.grid.count_within`.

    Each query's 27 cells are 9 key ranges (one per ``(i, j)`` column, ``l - 1 .. l + 1``),
    found by binary search in ``sorted_keys``; every candidate's squared distance
    ``dx² + dy² + dz²`` (in the points' dtype, summed left to right) is compared with its
    cloud's ``r2``, and the hits are added per query. The candidates are expanded in passes
    of about ``budget`` (default :data:`COUNT_BUDGET`) whole queries' worth: one host
    synchronisation, two when there are several passes. Returns ``(Q,)`` int64 counts,
    capped at ``cap``.
    """
    dev, i64 = query.device, torch.int64
    budget = COUNT_BUDGET if budget is None else budget
    qd, qb = dims[query_cloud], base[query_cloud]
    d = torch.arange(-1, 2, device=dev)
    x = query_cell[:, 0:1] + d.repeat_interleave(3)[None]                        # (Q, 9)
    y = query_cell[:, 1:2] + d.repeat(3)[None]
    ok = (x >= 0) & (x < qd[:, 0:1]) & (y >= 0) & (y < qd[:, 1:2])
    col = qb[:, None] + (x * qd[:, 1:2] + y) * qd[:, 2:3]
    z_lo = (query_cell[:, 2:3] - 1).clamp_min(0)
    z_hi = torch.minimum(query_cell[:, 2:3] + 1, qd[:, 2:3] - 1)
    start = torch.searchsorted(sorted_keys, col + z_lo)
    length = torch.where(ok, torch.searchsorted(sorted_keys, col + z_hi, right=True) - start, 0)
    within = torch.zeros(query.shape[0], dtype=i64, device=dev)
    start, length = start.reshape(-1), length.reshape(-1)
    cum = torch.cumsum(length, 0)
    total = int(cum[-1]) if cum.numel() else 0
    cuts = [(0, start.numel(), 0, total)]
    if total > budget:  # whole queries (9 ranges) per pass, about a budget each
        at = torch.searchsorted(cum, torch.arange(budget, total, budget, device=dev))
        ends = torch.unique(torch.cat([(at // 9 + 1) * 9, at.new_full((1,), start.numel())]))
        ends_h = ends.tolist()
        before = torch.cat([cum.new_zeros(1), cum])[ends].tolist()
        cuts = [(a, b, ca, cb) for a, b, ca, cb in
                zip([0, *ends_h[:-1]], ends_h, [0, *before[:-1]], before, strict=True)]
    for a, b, ca, cb in cuts:
        if cb == ca:
            continue
        rng = torch.repeat_interleave(torch.arange(a, b, device=dev), length[a:b],
                                      output_size=cb - ca)
        pos = start[rng] + torch.arange(ca, cb, device=dev) - (cum[rng] - length[rng])
        qi = rng // 9
        e = query[qi] - sorted_points[pos]
        d2 = e[:, 0] * e[:, 0] + e[:, 1] * e[:, 1] + e[:, 2] * e[:, 2]
        within.index_add_(0, qi, (d2 <= r2[query_cloud[qi]]).to(i64))
    return within.clamp_max(cap)


#: points per chunk of the Morton codes (bounds the int64 temporaries of a large cloud)
_MORTON_CHUNK = 1 << 22


def _spread(v: torch.Tensor) -> torch.Tensor:
    """Spread the low 10 bits of ``v`` (int64) two bits apart (bit b to bit 3b)."""
    v = (v | (v << 16)) & 0x030000FF
    v = (v | (v << 8)) & 0x0300F00F
    v = (v | (v << 4)) & 0x030C30C3
    return (v | (v << 2)) & 0x09249249


def morton_codes_reference(points: torch.Tensor) -> torch.Tensor:
    """Morton (Z-order) codes ``(N,)`` int32 of ``points (N, 3)`` over their bounding box.

    Per axis ``q = trunc(clamp((p - lo) / span * 1023, 0, 1023))`` in the points' dtype
    (``lo`` the box's minimum corner, ``span`` its longest side, at least 1e-30), the
    axes' bits interleaved x lowest: 30-bit codes. Computed a chunk at a time (the int64
    temporaries of a whole 50M-point cloud would hold ~3 GiB).
    """
    lo = points.amin(0)
    span = (points.amax(0) - lo).amax().clamp_min(1e-30)
    code = torch.empty(points.shape[0], dtype=torch.int32, device=points.device)
    for s in range(0, points.shape[0], _MORTON_CHUNK):
        q = ((points[s:s + _MORTON_CHUNK] - lo) / span * 1023).clamp(0, 1023).to(torch.int64)
        code[s:s + _MORTON_CHUNK] = _spread(q[:, 0]) | (_spread(q[:, 1]) << 1) \
            | (_spread(q[:, 2]) << 2)
    return code


def cell_keys_reference(points: torch.Tensor, owner: torch.Tensor | None, lo: torch.Tensor,
                        scale: torch.Tensor, dims: torch.Tensor, base: torch.Tensor,
                        divide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch statement of :func:`pointalign.kernels.grid.cell_keys`.

    Point i of cloud ``c = owner[i]`` (0 when ``owner`` is None): its cell
    ``floor((p_i − lo[c]) / scale[c])`` (``divide``) or ``floor((p_i − lo[c]) · scale[c])``
    in float64, clamped to ``[0, dims[c] − 1]``, and its key ``base[c] + (x · ny + y) · nz
    + z``. Returns ``(keys (P,), cells (P, 3))`` int64.
    """
    own = (torch.zeros(points.shape[0], dtype=torch.int64, device=points.device)
           if owner is None else owner)
    rel = points.to(torch.float64) - lo[own]
    s = scale[own, None]
    d = dims[own]
    cell = torch.minimum(torch.floor(rel / s if divide else rel * s).to(torch.int64)
                         .clamp_min(0), d - 1)
    keys = base[own] + (cell[:, 0] * d[:, 1] + cell[:, 1]) * d[:, 2] + cell[:, 2]
    return keys, cell


def count_cells_reference(points: torch.Tensor, owner: torch.Tensor | None, lo: torch.Tensor,
                          scale: torch.Tensor, dims: torch.Tensor, base: torch.Tensor,
                          divide: bool) -> torch.Tensor:
    """Plain PyTorch statement of :func:`pointalign.kernels.grid.count_cells`.

    The keys of :func:`cell_keys_reference`, sorted; a key unlike the one before it starts
    a cell, counted for its cloud. Returns ``(C,)`` int64, ``C = base.shape[0]``.
    """
    keys, order = torch.sort(cell_keys_reference(points, owner, lo, scale, dims, base,
                                                 divide)[0])
    new = torch.ones_like(keys)
    new[1:] = (keys[1:] != keys[:-1]).to(torch.int64)
    counts = torch.zeros(base.shape[0], dtype=torch.int64, device=points.device)
    if owner is None:
        return counts.add_(new.sum())
    return counts.index_add_(0, owner[order], new)
