"""Triton kernel for :func:`pointalign.kernels.grid.grid_query` (27-cell voxel-grid search).

One query per lane, ``BLOCK`` lanes per program. Queries are first sorted by cell key so
the lanes of a program visit the same cells (coherent loads, similar loop lengths); results
are scattered back (``sort_queries=False`` skips that for queries already in a coherent
order). For each of the 9 ``(i, j)`` columns a lane reads its contiguous range
``cell_start[key(i, j, l - 1)] .. cell_start[key(i, j, l + 1) + 1]`` and walks it, keeping
the best by (squared distance, original index): a running minimum for ``k == 1`` (``U``
candidates per lane per step, so that their loads overlap), a running top-k (replace the
worst kept entry) for ``k <= 32``. Cell coordinates are computed in float64 from the grid's
``params``; distances in the input dtype; offsets in int64; every load masked. Rows are
sorted by (distance, index) afterwards for ``k > 1``. Kernels are decorated on first use
per mode (compiled / ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton import knobs

from pointalign.kernels.grid.reference import query_keys
from pointalign.kernels.knn.reference import _sort_rows

_CACHE: dict[bool, object] = {}
#: candidates per lane per loop step of the 1-NN search (override: POINTALIGN_GRID_UNROLL);
#: ICP on the bunny (H100): 0.74 ms per iteration with 1, 0.50 with 4, 0.55 with 8 or 16
NN_UNROLL = int(os.environ.get("POINTALIGN_GRID_UNROLL", "4"))


def _grid_kernel(q_ptr, prm_ptr, dims_ptr, start_ptr, sp_ptr, sidx_ptr, out_d_ptr, out_i_ptr,
                 N, M, max_d2,
                 HAS_MAX: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                 BLOCK: tl.constexpr, U: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    rmask = rows < N
    qx = tl.load(q_ptr + rows * 3 + 0, mask=rmask, other=0.0)
    qy = tl.load(q_ptr + rows * 3 + 1, mask=rmask, other=0.0)
    qz = tl.load(q_ptr + rows * 3 + 2, mask=rmask, other=0.0)
    ox = tl.load(prm_ptr + 0)
    oy = tl.load(prm_ptr + 1)
    oz = tl.load(prm_ptr + 2)
    inv = tl.load(prm_ptr + 3)
    # dims come from memory: integer arguments equal to 1 would be specialised to constants
    nx = tl.load(dims_ptr + 0)
    ny = tl.load(dims_ptr + 1)
    nz = tl.load(dims_ptr + 2)
    fx = tl.floor((qx.to(tl.float64) - ox) * inv)
    fy = tl.floor((qy.to(tl.float64) - oy) * inv)
    fz = tl.floor((qz.to(tl.float64) - oz) * inv)
    cx = tl.minimum(tl.maximum(fx, -2.0), nx.to(tl.float64) + 1.0).to(tl.int64)
    cy = tl.minimum(tl.maximum(fy, -2.0), ny.to(tl.float64) + 1.0).to(tl.int64)
    cz = tl.minimum(tl.maximum(fz, -2.0), nz.to(tl.float64) + 1.0).to(tl.int64)
    zlo = tl.maximum(cz - 1, 0)
    zhi = tl.minimum(cz + 1, nz - 1)
    inf = float("inf")
    big = 2147483647
    slots = tl.arange(0, KP)
    zk = tl.full((BLOCK, KP), 0, dtype=q_ptr.dtype.element_ty)
    zk_i = tl.full((BLOCK, KP), 0, dtype=tl.int32)
    if K == 1:
        best_d = qx * 0 + inf
        best_i = tl.full((BLOCK,), -1, dtype=tl.int32)
    else:
        best_d = tl.where(slots[None, :] < K, zk + inf, zk - inf)
        best_i = zk_i - 1 - slots[None, :]
    for col in range(9):
        x = cx + (col // 3 - 1)
        y = cy + (col % 3 - 1)
        ok = rmask & (x >= 0) & (x < nx) & (y >= 0) & (y < ny) & (zlo <= zhi)
        base = (x * ny + y) * nz
        s = tl.load(start_ptr + base + zlo, mask=ok, other=0).to(tl.int64)
        e = tl.load(start_ptr + base + zhi + 1, mask=ok, other=0).to(tl.int64)
        n_it = tl.max(e - s, axis=0)
        j = n_it * 0
        if K == 1:
            # U candidates per lane per step: the U loads of a step are independent, so
            # their latency overlaps (one candidate per step left the loop latency-bound)
            uu = tl.arange(0, U)
            while j < n_it:
                pos = s[:, None] + j + uu[None, :]
                m = pos < e[:, None]
                px = tl.load(sp_ptr + pos, mask=m, other=inf)
                py = tl.load(sp_ptr + M + pos, mask=m, other=inf)
                pz = tl.load(sp_ptr + 2 * M + pos, mask=m, other=inf)
                oi = tl.load(sidx_ptr + pos, mask=m, other=big)
                dx = qx[:, None] - px
                dy = qy[:, None] - py
                dz = qz[:, None] - pz
                d = dx * dx + dy * dy + dz * dz
                if HAS_MAX:
                    d = tl.where(d <= max_d2, d, inf)
                # the step's best by (distance, original index), then merged with the best
                dmin = tl.min(d, axis=1)
                imin = tl.min(tl.where((d == dmin[:, None]) & (d < inf), oi, big), axis=1)
                better = (dmin < best_d) | ((dmin == best_d) & (dmin < inf) & (imin < best_i))
                best_d = tl.where(better, dmin, best_d)
                best_i = tl.where(better, imin, best_i)
                j += U
        else:
            while j < n_it:
                pos = s + j
                m = pos < e
                px = tl.load(sp_ptr + pos, mask=m, other=inf)
                py = tl.load(sp_ptr + M + pos, mask=m, other=inf)
                pz = tl.load(sp_ptr + 2 * M + pos, mask=m, other=inf)
                oi = tl.load(sidx_ptr + pos, mask=m, other=big)
                dx = qx - px
                dy = qy - py
                dz = qz - pz
                d = dx * dx + dy * dy + dz * dz
                if HAS_MAX:
                    d = tl.where(d <= max_d2, d, inf)
                worst = tl.max(best_d, axis=1)
                wi = tl.max(tl.where(best_d == worst[:, None], best_i, -big), axis=1)
                ins = (d < worst) | ((d == worst) & (d < inf) & (oi < wi))
                slot = (best_d == worst[:, None]) & (best_i == wi[:, None]) & ins[:, None]
                best_d = tl.where(slot, d[:, None] + zk, best_d)
                best_i = tl.where(slot, oi[:, None] + zk_i, best_i)
                j += 1
    if K == 1:
        best_i = tl.where(best_d == inf, -1, best_i)
        tl.store(out_d_ptr + rows, best_d, mask=rmask)
        tl.store(out_i_ptr + rows, best_i.to(tl.int64), mask=rmask)
    else:
        best_i = tl.where(best_d == inf, -1, best_i)
        out = rows[:, None] * K + slots[None, :]
        omask = rmask[:, None] & (slots[None, :] < K)
        tl.store(out_d_ptr + out, best_d, mask=omask)
        tl.store(out_i_ptr + out, best_i.to(tl.int64), mask=omask)


def _kernel():
    interp = bool(knobs.runtime.interpret)
    if interp not in _CACHE:
        # sizes stay specialised (divisible by 16 or not): without it a query took 1.33x
        # as long on an H200; the two variants are compiled once per machine
        _CACHE[interp] = triton.jit(_grid_kernel)
    return _CACHE[interp]


def grid_query(g, query: torch.Tensor, k: int, max_distance_sq: float | None = None, *,
               block: int | None = None, sort_queries: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the 27-cell search; same contract as :func:`pointalign.kernels.grid.grid_query`.

    ``g``: a :class:`~pointalign.kernels.grid.GridData`; ``query (N, 3)`` with its dtype and
    device; ``1 <= k <= 32``. Returns ``(dists_sq (N, k), idx (N, k) int64)``.
    """
    if not 1 <= k <= 32:
        raise ValueError(f"k: the Triton grid kernel handles 1..32, got {k}")
    n, m = query.shape[0], g.sorted_points.shape[1]
    order = None
    q = query.contiguous()
    if sort_queries and n > 1:
        order = torch.argsort(query_keys(g, q))
        q = q[order]
    kp = 1 if k == 1 else 1 << (k - 1).bit_length()
    out_d = torch.empty((n, k), dtype=q.dtype, device=q.device)
    out_i = torch.empty((n, k), dtype=torch.int64, device=q.device)
    has_max = max_distance_sq is not None
    bl = block or (128 if k == 1 else 32)
    grid = (max(1, -(-n // bl)),)
    _kernel()[grid](q, g.params, g.dims_dev, g.cell_start, g.sorted_points, g.sorted_idx,
                    out_d, out_i, n, m,
                    0.0 if max_distance_sq is None else float(max_distance_sq),
                    HAS_MAX=has_max, K=k, KP=kp, BLOCK=bl, U=NN_UNROLL, num_warps=4)
    if k > 1:
        out_d, out_i = _sort_rows(out_d, out_i)
    if order is not None:
        rd, ri = torch.empty_like(out_d), torch.empty_like(out_i)
        rd[order], ri[order] = out_d, out_i
        out_d, out_i = rd, ri
    return out_d, out_i


@triton.jit(do_not_specialize=("n",))
def _morton_kernel(p_ptr, lo_ptr, hi_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Morton codes of float32 points ``[pid·BLOCK, (pid + 1)·BLOCK)`` (int32, x lowest).

    The reference's arithmetic step by step: the box's longest side ``span`` (its three
    sides ``hi − lo``, their maximum, at least 1e-30), ``(p − lo) / span`` (correctly
    rounded division), ``× 1023``, clamped to [0, 1023], truncated; each axis's 10 bits
    spread two apart and interleaved.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    span = tl.maximum(tl.maximum(tl.load(hi_ptr + 0) - tl.load(lo_ptr + 0),
                                 tl.load(hi_ptr + 1) - tl.load(lo_ptr + 1)),
                      tl.load(hi_ptr + 2) - tl.load(lo_ptr + 2))
    span = tl.maximum(span, 1e-30)
    code = tl.zeros((BLOCK,), dtype=tl.int32)
    for a in tl.static_range(3):
        v = tl.load(p_ptr + offs * 3 + a, mask=m, other=0.0)
        q = tl.math.div_rn(v - tl.load(lo_ptr + a), span) * 1023.0
        b = tl.minimum(tl.maximum(q, 0.0), 1023.0).to(tl.int32)
        b = (b | (b << 16)) & 0x030000FF
        b = (b | (b << 8)) & 0x0300F00F
        b = (b | (b << 4)) & 0x030C30C3
        b = (b | (b << 2)) & 0x09249249
        code = code | (b << a)
    tl.store(out_ptr + offs, code, mask=m)


def morton_codes(points: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Morton codes ``(N,)`` int32 of float32 ``points (N, 3)``, ``N >= 1``.

    :func:`~pointalign.kernels.grid.reference.morton_codes_reference`'s, bit for bit: the
    box by one reduction, its longest side and the codes by one launch.
    """
    lo, hi = torch.aminmax(points, dim=0)
    pts = points.contiguous()
    n = pts.shape[0]
    code = torch.empty(n, dtype=torch.int32, device=pts.device)
    _morton_kernel[(triton.cdiv(n, block),)](pts, lo, hi, code, n, BLOCK=block, num_warps=4)
    return code


@triton.jit(do_not_specialize=("Q", "P", "cap", "steps"),
            # a sample's clouds and the clouds' first keys are views at any offset
            do_not_specialize_on_alignment=("qo_ptr", "base_ptr"))
def _count_kernel(keys_ptr, sp_ptr, q_ptr, qc_ptr, qo_ptr, dims_ptr, base_ptr, r2_ptr, out_ptr,
                  Q, P, cap, steps, BLOCK: tl.constexpr, U: tl.constexpr):
    """Capped counts of :func:`count_within` for queries ``[pid·BLOCK, (pid + 1)·BLOCK)``.

    Per lane and ``(i, j)`` column: two branch-free binary searches of ``steps`` rounds in
    the sorted keys (the first key >= the column's lowest cell, the first > its highest),
    then the range ``U`` candidates a step; a lane stops once it has ``cap`` hits, the
    program once every lane has stopped or run out of candidates.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    rm = rows < Q
    own = tl.load(qo_ptr + rows, mask=rm, other=0)
    cx = tl.load(qc_ptr + rows * 3 + 0, mask=rm, other=0)
    cy = tl.load(qc_ptr + rows * 3 + 1, mask=rm, other=0)
    cz = tl.load(qc_ptr + rows * 3 + 2, mask=rm, other=0)
    nx = tl.load(dims_ptr + own * 3 + 0, mask=rm, other=1)
    ny = tl.load(dims_ptr + own * 3 + 1, mask=rm, other=1)
    nz = tl.load(dims_ptr + own * 3 + 2, mask=rm, other=1)
    b = tl.load(base_ptr + own, mask=rm, other=0)
    r2 = tl.load(r2_ptr + own, mask=rm, other=0.0)
    qx = tl.load(q_ptr + rows * 3 + 0, mask=rm, other=0.0)
    qy = tl.load(q_ptr + rows * 3 + 1, mask=rm, other=0.0)
    qz = tl.load(q_ptr + rows * 3 + 2, mask=rm, other=0.0)
    zlo = tl.maximum(cz - 1, 0)
    zhi = tl.minimum(cz + 1, nz - 1)
    count = tl.zeros((BLOCK,), dtype=tl.int32)
    uu = tl.arange(0, U)
    for col in range(9):
        x = cx + (col // 3 - 1)
        y = cy + (col % 3 - 1)
        ok = rm & (x >= 0) & (x < nx) & (y >= 0) & (y < ny) & (count < cap)
        key = b + (x * ny + y) * nz
        k_lo = key + zlo
        k_hi = key + zhi
        s = tl.zeros((BLOCK,), dtype=tl.int64)
        ns = tl.where(ok, P, 0).to(tl.int64)
        e = tl.zeros((BLOCK,), dtype=tl.int64)
        ne = ns
        for _ in range(steps):
            half = ns // 2
            mid = s + half
            v = tl.load(keys_ptr + mid, mask=ns > 0, other=0)
            go = (ns > 0) & (v < k_lo)
            s = tl.where(go, mid + 1, s)
            ns = tl.where(go, ns - half - 1, half)
            half = ne // 2
            mid = e + half
            v = tl.load(keys_ptr + mid, mask=ne > 0, other=0)
            go = (ne > 0) & (v <= k_hi)
            e = tl.where(go, mid + 1, e)
            ne = tl.where(go, ne - half - 1, half)
        e = tl.where(ok, e, s)
        n_it = tl.max(e - s, axis=0)
        j = n_it * 0
        while j < n_it:
            pos = s[:, None] + j + uu[None, :]
            m = (pos < e[:, None]) & (count < cap)[:, None]
            dx = qx[:, None] - tl.load(sp_ptr + pos * 3 + 0, mask=m, other=0.0)
            dy = qy[:, None] - tl.load(sp_ptr + pos * 3 + 1, mask=m, other=0.0)
            dz = qz[:, None] - tl.load(sp_ptr + pos * 3 + 2, mask=m, other=0.0)
            hit = m & (dx * dx + dy * dy + dz * dz <= r2[:, None])
            count += tl.sum(hit.to(tl.int32), axis=1)
            j += U
            n_it = tl.max(tl.where(count < cap, e - s, 0), axis=0)
    tl.store(out_ptr + rows, tl.minimum(count, cap).to(tl.int64), mask=rm)


def count_within(sorted_keys: torch.Tensor, sorted_points: torch.Tensor, query: torch.Tensor,
                 query_cell: torch.Tensor, query_cloud: torch.Tensor, dims: torch.Tensor,
                 base: torch.Tensor, r2: torch.Tensor, cap: int, block: int = 128
                 ) -> torch.Tensor:
    """Launch :func:`_count_kernel`; same contract as :func:`~pointalign.kernels.grid.count_within`.

    One launch, no host synchronisation; no size or view offset is specialised (a new cloud
    size compiles nothing).
    """
    q, p = query.shape[0], sorted_keys.shape[0]
    out = torch.empty(q, dtype=torch.int64, device=query.device)
    _count_kernel[(max(1, triton.cdiv(q, block)),)](
        sorted_keys, sorted_points, query, query_cell, query_cloud, dims, base, r2, out,
        q, p, int(cap), max(1, p.bit_length()), BLOCK=block, U=4, num_warps=4)
    return out


#: a key's hash: the key times this odd 64-bit constant (wrapping), its high bits folded in
_HASH_MUL = tl.constexpr(0x5851F42D4C957F2D)


@triton.jit
def _cell_axis(p_ptr, lo_ptr, dims_ptr, rows, own, rm, sc, a: tl.constexpr, divide):
    """Return the rows' cell coordinate along axis ``a``, clamped to the cloud's grid."""
    rel = (tl.load(p_ptr + rows * 3 + a, mask=rm, other=0.0).to(tl.float64)
           - tl.load(lo_ptr + own * 3 + a, mask=rm, other=0.0))
    # float64 division is correctly rounded (div.rn.f64); ``divide`` a run-time flag (one
    # compilation for both)
    f = tl.floor(tl.where(divide != 0, rel / sc, rel * sc))
    hi = tl.load(dims_ptr + own * 3 + a, mask=rm, other=1) - 1
    return tl.minimum(tl.maximum(f.to(tl.int64), 0), hi)


@triton.jit
def _cell_key(p_ptr, owner_ptr, lo_ptr, scale_ptr, dims_ptr, base_ptr, rows, rm,
              has_owner, divide):
    """Return the rows' clouds, cells and keys.

    As :func:`~pointalign.kernels.grid.reference.cell_keys_reference` computes them.
    """
    own = tl.load(owner_ptr + rows * has_owner, mask=rm, other=0) * has_owner  # 0: one cloud
    sc = tl.load(scale_ptr + own, mask=rm, other=1.0)
    cx = _cell_axis(p_ptr, lo_ptr, dims_ptr, rows, own, rm, sc, 0, divide)
    cy = _cell_axis(p_ptr, lo_ptr, dims_ptr, rows, own, rm, sc, 1, divide)
    cz = _cell_axis(p_ptr, lo_ptr, dims_ptr, rows, own, rm, sc, 2, divide)
    ny = tl.load(dims_ptr + own * 3 + 1, mask=rm, other=0)
    nz = tl.load(dims_ptr + own * 3 + 2, mask=rm, other=0)
    key = tl.load(base_ptr + own, mask=rm, other=0) + (cx * ny + cy) * nz + cz
    return own, cx, cy, cz, key


@triton.jit(do_not_specialize=("P", "has_owner", "divide"),
            do_not_specialize_on_alignment=("owner_ptr", "lo_ptr", "scale_ptr", "dims_ptr",
                                            "base_ptr"))
def _keys_kernel(p_ptr, owner_ptr, lo_ptr, scale_ptr, dims_ptr, base_ptr, key_ptr, cell_ptr,
                 P, has_owner, divide, BLOCK: tl.constexpr):
    """Keys and cells of points ``[pid·BLOCK, (pid + 1)·BLOCK)``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    rm = rows < P
    _, cx, cy, cz, key = _cell_key(p_ptr, owner_ptr, lo_ptr, scale_ptr, dims_ptr, base_ptr,
                                   rows, rm, has_owner, divide)
    tl.store(key_ptr + rows, key, mask=rm)
    tl.store(cell_ptr + rows * 3 + 0, cx, mask=rm)
    tl.store(cell_ptr + rows * 3 + 1, cy, mask=rm)
    tl.store(cell_ptr + rows * 3 + 2, cz, mask=rm)


@triton.jit(do_not_specialize=("P", "mask", "has_owner", "divide"),
            do_not_specialize_on_alignment=("owner_ptr", "lo_ptr", "scale_ptr", "dims_ptr",
                                            "base_ptr"))
def _cells_kernel(p_ptr, owner_ptr, lo_ptr, scale_ptr, dims_ptr, base_ptr, table_ptr, count_ptr,
                  P, mask, has_owner, divide, BLOCK: tl.constexpr):
    """Insert the cell keys of points ``[pid·BLOCK, (pid + 1)·BLOCK)`` into the hash table.

    Each lane probes the table (``mask + 1`` slots, -1 where empty) linearly from its key's
    hash by compare-and-swap: it stops where it finds its key (the cell is counted already)
    or claims an empty slot (a new cell, counted for its cloud). Lanes that stopped compare
    against -2, which no slot holds, so they write nothing while the others go on.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    rm = rows < P
    own, _, _, _, key = _cell_key(p_ptr, owner_ptr, lo_ptr, scale_ptr, dims_ptr, base_ptr,
                                  rows, rm, has_owner, divide)
    h = key * _HASH_MUL
    slot = (h ^ (h >> 29)) & mask
    empty = tl.full((BLOCK,), -1, dtype=tl.int64)
    new = tl.zeros((BLOCK,), dtype=tl.int64)
    todo = rm
    left = tl.sum(todo.to(tl.int32), axis=0)
    while left > 0:
        seen = tl.atomic_cas(table_ptr + slot, tl.where(todo, empty, empty - 1), key)
        claimed = todo & (seen == empty)
        new += claimed.to(tl.int64)
        todo = todo & ~claimed & (seen != key)
        slot = tl.where(todo, (slot + 1) & mask, slot)
        left = tl.sum(todo.to(tl.int32), axis=0)
    # the new cells per cloud: one atomic for the program's first cloud, one per lane of
    # any later cloud (a program spans several clouds only at their boundaries)
    first = tl.min(tl.where(rm, own, 1 << 62), axis=0)
    tl.atomic_add(count_ptr + first, tl.sum(tl.where(own == first, new, 0), axis=0))
    tl.atomic_add(count_ptr + own, new, mask=rm & (own != first) & (new > 0))


def cell_keys(points: torch.Tensor, owner: torch.Tensor | None, lo: torch.Tensor,
              scale: torch.Tensor, dims: torch.Tensor, base: torch.Tensor, divide: bool,
              block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`_keys_kernel`; same contract as :func:`~pointalign.kernels.grid.cell_keys`.

    One launch, no host synchronisation, no size specialised.
    """
    p = points.shape[0]
    keys = torch.empty(p, dtype=torch.int64, device=points.device)
    cells = torch.empty((p, 3), dtype=torch.int64, device=points.device)
    if p:
        _keys_kernel[(triton.cdiv(p, block),)](
            points, base if owner is None else owner, lo, scale, dims, base, keys, cells, p,
            int(owner is not None), int(bool(divide)), BLOCK=block, num_warps=4)
    return keys, cells


def count_cells(points: torch.Tensor, owner: torch.Tensor | None, lo: torch.Tensor,
                scale: torch.Tensor, dims: torch.Tensor, base: torch.Tensor, divide: bool,
                block: int = 256) -> torch.Tensor:
    """Launch :func:`_cells_kernel`; same contract as :func:`~pointalign.kernels.grid.count_cells`.

    A table of at least twice as many slots as points (a power of two: at most half full,
    short probes) filled with -1, one launch; no host synchronisation, and no size is
    specialised (a new cloud size compiles nothing).
    """
    p = points.shape[0]
    counts = torch.zeros(base.shape[0], dtype=torch.int64, device=points.device)
    if p == 0:
        return counts
    slots = 1 << max(10, (2 * p - 1).bit_length())
    table = torch.full((slots,), -1, dtype=torch.int64, device=points.device)
    _cells_kernel[(triton.cdiv(p, block),)](
        points, base if owner is None else owner, lo, scale, dims, base, table, counts,
        p, slots - 1, int(owner is not None), int(bool(divide)), BLOCK=block, num_warps=4)
    return counts
