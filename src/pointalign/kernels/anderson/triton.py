"""Triton kernel of the Anderson update: one program per problem, the whole update fused.

The spec's ~400 small tensor operations a step (pose vectors through so(3)'s log and exp,
the history's differences, a Gram system, the safeguard's selections) become one launch.
Poses (``Q`` the origin) are tuples of float64 scalars (the convention of
:mod:`pointalign.kernels._tl_math`); the history is an (8, 8) block, slots by rows and the
six coordinates by columns, so the Gram matrix, its Cholesky factor and the combination
are block operations of one warp.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs

from pointalign.kernels import _tl_math as tm
from pointalign.kernels.anderson.reference import RIDGE

_CACHE: dict[bool, Any] = {}


@triton.jit
def _load_pose(ptr):
    """Load the 16 entries of a row-major 4×4 pose at ``ptr`` as a tuple."""
    return [tl.load(ptr + k) for k in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]


@triton.jit
def _to_vector(T, Q, scale, c):
    """``reference.to_vector`` of one pose (``c`` the pivot, a 3-tuple): a 6-tuple."""
    R = [T[4 * (e // 3)] * Q[4 * (e % 3)] + T[4 * (e // 3) + 1] * Q[4 * (e % 3) + 1]
         + T[4 * (e // 3) + 2] * Q[4 * (e % 3) + 2] for e in (0, 1, 2, 3, 4, 5, 6, 7, 8)]
    t = [T[4 * i + 3] - (R[3 * i] * Q[3] + R[3 * i + 1] * Q[7] + R[3 * i + 2] * Q[11])
         + (R[3 * i] * c[0] + R[3 * i + 1] * c[1] + R[3 * i + 2] * c[2]) - c[i]
         for i in (0, 1, 2)]
    w0, w1, w2 = tm.so3_log(R)
    return w0, w1, w2, t[0] / scale, t[1] / scale, t[2] / scale


@triton.jit
def _from_vector(a, Q, scale, c):
    """``reference.from_vector``: the pose ``D Q`` of a 6-tuple ``a``, a 16-tuple."""
    Rd = tm.so3_exp(a[0], a[1], a[2])
    td = [a[3 + i] * scale - (Rd[3 * i] * c[0] + Rd[3 * i + 1] * c[1] + Rd[3 * i + 2] * c[2])
          + c[i] for i in (0, 1, 2)]
    top = [Rd[3 * (e // 4)] * Q[e % 4] + Rd[3 * (e // 4) + 1] * Q[4 + e % 4]
           + Rd[3 * (e // 4) + 2] * Q[8 + e % 4] for e in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)]
    return (top[0], top[1], top[2], top[3] + td[0],
            top[4], top[5], top[6], top[7] + td[1],
            top[8], top[9], top[10], top[11] + td[2],
            Q[12], Q[13], Q[14], Q[15])


@triton.jit
def _vector(values, idx, N: tl.constexpr):
    """Return the tuple ``values`` (N entries) as a block vector over ``idx``, zero-padded."""
    v = tl.zeros(idx.shape, dtype=tl.float64)
    for k in tl.static_range(N):
        v = tl.where(idx == k, values[k], v)
    return v


@triton.jit
def _spd_solve8(A, rhs):
    """Solve ``A γ = rhs`` for a positive definite (8, 8) block by Cholesky; ``(γ, ok)``.

    ok is False (and γ meaningless) where a pivot is not positive and finite.
    """
    i = tl.arange(0, 8)
    r = i[:, None]
    c = i[None, :]
    ok = tl.full((), 1, tl.int1)
    Lt = tl.zeros((8, 8), dtype=tl.float64)  # Lᵀ: row j holds column j of L
    for j in range(8):
        col = tl.sum(tl.where(c == j, A, 0.0), axis=1)
        d = tm._pick(col, i, j)
        good = (d > 0) & (d < float("inf"))
        ok = ok & good
        lj = tl.where(i >= j, col / tl.sqrt(tl.where(good, d, 1.0)), 0.0)
        Lt = tl.where(r == j, lj[None, :], Lt)
        A = A - lj[:, None] * lj[None, :]
    z = tl.zeros((8,), dtype=tl.float64)  # L z = rhs
    for j in range(8):
        row = tl.sum(tl.where(c == j, Lt, 0.0), axis=1)  # L[j, k] by k
        zj = (tm._pick(rhs, i, j) - tl.sum(tl.where(i < j, row * z, 0.0), axis=0)) \
            / tl.where(ok, tm._pick(row, i, j), 1.0)
        z = tl.where(i == j, zj, z)
    y = tl.zeros((8,), dtype=tl.float64)  # Lᵀ y = z
    for jj in range(8):
        j = 7 - jj
        row = tl.sum(tl.where(r == j, Lt, 0.0), axis=0)  # L[k, j] by k
        yj = (tm._pick(z, i, j) - tl.sum(tl.where(i > j, row * y, 0.0), axis=0)) \
            / tl.where(ok, tm._pick(row, i, j), 1.0)
        y = tl.where(i == j, yj, y)
    return y, ok


@triton.jit
def _combination(X, G, X_up, G_up, filled, ridge_rel, K: tl.constexpr):
    """``reference.anderson_point`` on (8, 8) history blocks (slot rows, coordinate columns).

    ``X_up``, ``G_up`` are the blocks moved up one row (row i holds slot i + 1). Returns
    the combined point ``g_k − ΔG γ`` as an (8,) block (coordinates 6, 7 zero).
    """
    i = tl.arange(0, 8)
    r = i[:, None]
    c = i[None, :]
    used = (i < K - 1) & (i >= K - filled)  # the filled difference columns
    live = used[:, None] & (c < 6)
    dF = tl.where(live, (G_up - X_up) - (G - X), 0.0)
    dG = tl.where(live, G_up - G, 0.0)
    A = tl.sum(dF[:, None, :] * dF[None, :, :], axis=2)  # Gram matrix over slots
    f_last = tl.sum(tl.where(r == K - 1, G - X, 0.0), axis=0)
    rhs = tl.sum(dF * f_last[None, :], axis=1)
    ridge = ridge_rel * tl.maximum(tl.max(tl.sum(tl.where(r == c, A, 0.0), axis=1), axis=0),
                                   1e-300)
    A = A + tl.where(r == c, ridge + tl.where(used, 0.0, 1.0)[:, None], 0.0)  # unused: γ = 0
    gamma, ok = _spd_solve8(A, rhs)
    gamma = tl.where(ok, gamma, 0.0)
    g_last = tl.sum(tl.where(r == K - 1, G, 0.0), axis=0)
    return g_last - tl.sum(dG * gamma[:, None], axis=0)


def _anderson_kernel(T_ptr, P_ptr, D_ptr, sums_ptr, flags_ptr, O_ptr, nv_ptr, sc_ptr, pv_ptr,
                     xh_ptr, gh_ptr, cnt_ptr, en_ptr, acc_ptr, fb_ptr, fbu_ptr,
                     Tn_ptr, Tf_ptr, xo_ptr, go_ptr, cnto_ptr, eno_ptr, acco_ptr, fbo_ptr,
                     fbuo_ptr, upd_ptr, ok_ptr, tau2, ridge_rel, K: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, 8)
    r = i[:, None]
    c = i[None, :]
    e16 = tl.arange(0, 16)
    # the safeguard: an accelerated pose whose truncated energy rose is rejected
    energy = tl.load(sums_ptr + b * 30 + 29) \
        + (tl.load(nv_ptr + b) - tl.load(sums_ptr + b * 30 + 28)) * tau2
    old_energy = tl.load(en_ptr + b)
    reject = (tl.load(acc_ptr + b) != 0) & (energy > old_energy)
    keep = ~reject
    # the history gains (x, G(x)); older slots move up one row
    Q = _load_pose(O_ptr + b * 16)
    scale = tl.load(sc_ptr + b)
    pivot = [tl.load(pv_ptr + b * 3 + k) for k in (0, 1, 2)]
    x = _to_vector(_load_pose(T_ptr + b * 16), Q, scale, pivot)
    g = _to_vector(_load_pose(P_ptr + b * 16), Q, scale, pivot)
    hmask = (r < K) & (c < 6)
    hoff = b * (K * 6) + r * 6 + c
    X0 = tl.load(xh_ptr + hoff, mask=hmask, other=0.0)
    G0 = tl.load(gh_ptr + hoff, mask=hmask, other=0.0)
    xv = _vector(x, i, 6)[None, :]
    gv = _vector(g, i, 6)[None, :]
    X = tl.where(r == K - 1, xv, tl.load(xh_ptr + hoff + 6, mask=(r < K - 1) & (c < 6),
                                         other=0.0))
    G = tl.where(r == K - 1, gv, tl.load(gh_ptr + hoff + 6, mask=(r < K - 1) & (c < 6),
                                         other=0.0))
    X_up = tl.where(r == K - 2, xv, tl.load(xh_ptr + hoff + 12, mask=(r < K - 2) & (c < 6),
                                            other=0.0))
    G_up = tl.where(r == K - 2, gv, tl.load(gh_ptr + hoff + 12, mask=(r < K - 2) & (c < 6),
                                            other=0.0))
    count = tl.where(keep, tl.minimum(tl.load(cnt_ptr + b) + 1, K), 0)
    accel = _combination(X, G, X_up, G_up, tl.maximum(count, 1), ridge_rel, K)
    finite = tl.sum(tl.where((i < 6) & ~((accel == accel) & (tl.abs(accel) < float("inf"))),
                             1, 0), axis=0) == 0
    go = keep & (tl.load(flags_ptr + b * 2 + 1) != 0) & (count >= 2) & finite
    a = [tm._pick(accel, i, k) for k in (0, 1, 2, 3, 4, 5)]
    T_acc = _vector(_from_vector(a, Q, scale, pivot), e16, 16)
    P = tl.load(P_ptr + b * 16 + e16)
    D = tl.load(D_ptr + b * 16 + e16)
    FB = tl.load(fb_ptr + b * 16 + e16)
    FBU = tl.load(fbu_ptr + b * 16 + e16)
    T_next = tl.where(reject, FB, tl.where(go, T_acc, P))
    tl.store(Tn_ptr + b * 16 + e16, T_next)
    tl.store(Tf_ptr + b * 16 + e16, T_next.to(tl.float32))
    tl.store(upd_ptr + b * 16 + e16, tl.where(reject, FBU, D))
    tl.store(fbo_ptr + b * 16 + e16, tl.where(keep, P, FB))
    tl.store(fbuo_ptr + b * 16 + e16, tl.where(keep, D, FBU))
    tl.store(xo_ptr + hoff, tl.where(keep, X, X0), mask=hmask)
    tl.store(go_ptr + hoff, tl.where(keep, G, G0), mask=hmask)
    tl.store(cnto_ptr + b, count.to(tl.int64))
    tl.store(eno_ptr + b, tl.where(keep, energy, old_energy))
    tl.store(acco_ptr + b, go.to(tl.uint8))
    tl.store(ok_ptr + b, keep.to(tl.uint8))


def _kernel() -> Any:
    interp = bool(knobs.runtime.interpret)
    if interp not in _CACHE:
        _CACHE[interp] = triton.jit(_anderson_kernel)
    return _CACHE[interp]


def anderson_update(state: dict[str, torch.Tensor], record: dict[str, torch.Tensor],
                    consts: dict[str, torch.Tensor], tau2: float
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Launch the update (contract of :func:`pointalign.kernels.anderson.anderson_update`)."""
    T = state["T"]
    B, K = T.shape[0], state["x_hist"].shape[1]
    dev, f64 = T.device, torch.float64

    def pose(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=dev, dtype=f64).contiguous()

    out = {"T": torch.empty(B, 4, 4, dtype=f64, device=dev),
           "Tf": torch.empty(B, 4, 4, dtype=torch.float32, device=dev),
           "x_hist": torch.empty_like(state["x_hist"]),
           "g_hist": torch.empty_like(state["g_hist"]),
           "count": torch.empty_like(state["count"]),
           "energy": torch.empty_like(state["energy"]),
           "accelerated": torch.empty(B, dtype=torch.bool, device=dev),
           "fallback": torch.empty(B, 4, 4, dtype=f64, device=dev),
           "fallback_update": torch.empty(B, 4, 4, dtype=f64, device=dev)}
    update = torch.empty(B, 4, 4, dtype=f64, device=dev)
    accepted = torch.empty(B, dtype=torch.bool, device=dev)
    _kernel()[(B,)](
        pose(T), pose(record["T"]), pose(record["update"]),
        record["sums"].to(f64).contiguous(), record["flags"].to(torch.int32).contiguous(),
        pose(consts["origin"]), consts["n_valid"].to(f64).contiguous(),
        consts["scale"].to(f64).contiguous(), consts["pivot"].to(f64).contiguous(),
        state["x_hist"].contiguous(), state["g_hist"].contiguous(), state["count"].contiguous(),
        state["energy"].contiguous(), state["accelerated"].contiguous().view(torch.uint8),
        pose(state["fallback"]), pose(state["fallback_update"]),
        out["T"], out["Tf"], out["x_hist"], out["g_hist"], out["count"], out["energy"],
        out["accelerated"].view(torch.uint8), out["fallback"], out["fallback_update"],
        update, accepted.view(torch.uint8), float(tau2), RIDGE, K=K, num_warps=1)
    return out, {"T": out["T"], "update": update, "accepted": accepted}
