"""Triton kernel for :mod:`pointalign.kernels.normal_eq` (private; see its contract).

One program reduces ``BLOCK`` source rows of one batch entry: it gathers the
corresponding target point (and normal), forms the robust weight and the 30 per-row terms,
sums them in float32 registers and writes one partial row. A second tiny reduction sums the
``(B, P, 30)`` partials in float64 on the device (deterministic; no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pointalign.kernels.normal_eq import KERNELS, WIDTH

BLOCK = 256


@triton.jit
def _weight(r, scale, KIND: tl.constexpr):
    a = tl.abs(r)
    if KIND == 0:
        w = tl.full(a.shape, 1.0, tl.float32)
    elif KIND == 1:
        w = tl.where(a <= scale, 1.0, scale / tl.maximum(a, 1e-30))
    elif KIND == 2:
        u = a / scale
        w = tl.where(a < scale, (1.0 - u * u) * (1.0 - u * u), 0.0)
    else:
        u = a / scale
        w = 1.0 / (1.0 + u * u)
    return w


@triton.jit
def _normal_eq_kernel(x_ptr, y_ptr, n_ptr, idx_ptr, len_ptr, c_ptr, out_ptr,
                      N, M, P, scale,
                      PLANE: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    L = tl.load(len_ptr + b)
    inb = offs < L
    j = tl.load(idx_ptr + b * N + offs, mask=inb, other=-1)
    valid = inb & (j >= 0)
    j = tl.where(valid, j, 0)
    c0 = tl.load(c_ptr + b * 3 + 0).to(tl.float32)
    c1 = tl.load(c_ptr + b * 3 + 1).to(tl.float32)
    c2 = tl.load(c_ptr + b * 3 + 2).to(tl.float32)
    xb = x_ptr + b * N * 3 + offs * 3
    yb = y_ptr + b * M * 3 + j * 3
    x0 = tl.where(valid, tl.load(xb + 0, mask=valid, other=0.0).to(tl.float32) - c0, 0.0)
    x1 = tl.where(valid, tl.load(xb + 1, mask=valid, other=0.0).to(tl.float32) - c1, 0.0)
    x2 = tl.where(valid, tl.load(xb + 2, mask=valid, other=0.0).to(tl.float32) - c2, 0.0)
    y0 = tl.where(valid, tl.load(yb + 0, mask=valid, other=0.0).to(tl.float32) - c0, 0.0)
    y1 = tl.where(valid, tl.load(yb + 1, mask=valid, other=0.0).to(tl.float32) - c1, 0.0)
    y2 = tl.where(valid, tl.load(yb + 2, mask=valid, other=0.0).to(tl.float32) - c2, 0.0)
    d0 = x0 - y0
    d1 = x1 - y1
    d2 = x2 - y2
    dd = d0 * d0 + d1 * d1 + d2 * d2
    vf = tl.where(valid, 1.0, 0.0)
    o = out_ptr + (b * P + pid) * 30
    if PLANE:
        nb = n_ptr + b * M * 3 + j * 3
        n0 = tl.load(nb + 0, mask=valid, other=0.0).to(tl.float32)
        n1 = tl.load(nb + 1, mask=valid, other=0.0).to(tl.float32)
        n2 = tl.load(nb + 2, mask=valid, other=0.0).to(tl.float32)
        r = n0 * d0 + n1 * d1 + n2 * d2
        w = _weight(r, scale, KIND) * vf
        # J = [x̃ × n, n]
        j0 = x1 * n2 - x2 * n1
        j1 = x2 * n0 - x0 * n2
        j2 = x0 * n1 - x1 * n0
        w0 = w * j0
        w1 = w * j1
        w2 = w * j2
        w3 = w * n0
        w4 = w * n1
        w5 = w * n2
        tl.store(o + 0, tl.sum(w0 * j0, 0))
        tl.store(o + 1, tl.sum(w0 * j1, 0))
        tl.store(o + 2, tl.sum(w0 * j2, 0))
        tl.store(o + 3, tl.sum(w0 * n0, 0))
        tl.store(o + 4, tl.sum(w0 * n1, 0))
        tl.store(o + 5, tl.sum(w0 * n2, 0))
        tl.store(o + 6, tl.sum(w1 * j1, 0))
        tl.store(o + 7, tl.sum(w1 * j2, 0))
        tl.store(o + 8, tl.sum(w1 * n0, 0))
        tl.store(o + 9, tl.sum(w1 * n1, 0))
        tl.store(o + 10, tl.sum(w1 * n2, 0))
        tl.store(o + 11, tl.sum(w2 * j2, 0))
        tl.store(o + 12, tl.sum(w2 * n0, 0))
        tl.store(o + 13, tl.sum(w2 * n1, 0))
        tl.store(o + 14, tl.sum(w2 * n2, 0))
        tl.store(o + 15, tl.sum(w3 * n0, 0))
        tl.store(o + 16, tl.sum(w3 * n1, 0))
        tl.store(o + 17, tl.sum(w3 * n2, 0))
        tl.store(o + 18, tl.sum(w4 * n1, 0))
        tl.store(o + 19, tl.sum(w4 * n2, 0))
        tl.store(o + 20, tl.sum(w5 * n2, 0))
        tl.store(o + 21, tl.sum(w0 * r, 0))
        tl.store(o + 22, tl.sum(w1 * r, 0))
        tl.store(o + 23, tl.sum(w2 * r, 0))
        tl.store(o + 24, tl.sum(w3 * r, 0))
        tl.store(o + 25, tl.sum(w4 * r, 0))
        tl.store(o + 26, tl.sum(w5 * r, 0))
        tl.store(o + 27, tl.sum(w * r * r, 0))
    else:
        w = _weight(tl.sqrt(dd), scale, KIND) * vf
        wx0 = w * x0
        wx1 = w * x1
        wx2 = w * x2
        wy0 = w * y0
        wy1 = w * y1
        wy2 = w * y2
        tl.store(o + 0, tl.sum(w, 0))
        tl.store(o + 1, tl.sum(wx0, 0))
        tl.store(o + 2, tl.sum(wx1, 0))
        tl.store(o + 3, tl.sum(wx2, 0))
        tl.store(o + 4, tl.sum(wy0, 0))
        tl.store(o + 5, tl.sum(wy1, 0))
        tl.store(o + 6, tl.sum(wy2, 0))
        tl.store(o + 7, tl.sum(wx0 * y0, 0))
        tl.store(o + 8, tl.sum(wx0 * y1, 0))
        tl.store(o + 9, tl.sum(wx0 * y2, 0))
        tl.store(o + 10, tl.sum(wx1 * y0, 0))
        tl.store(o + 11, tl.sum(wx1 * y1, 0))
        tl.store(o + 12, tl.sum(wx1 * y2, 0))
        tl.store(o + 13, tl.sum(wx2 * y0, 0))
        tl.store(o + 14, tl.sum(wx2 * y1, 0))
        tl.store(o + 15, tl.sum(wx2 * y2, 0))
        tl.store(o + 16, tl.sum(wx0 * x0, 0))
        tl.store(o + 17, tl.sum(wx0 * x1, 0))
        tl.store(o + 18, tl.sum(wx0 * x2, 0))
        tl.store(o + 19, tl.sum(wx1 * x1, 0))
        tl.store(o + 20, tl.sum(wx1 * x2, 0))
        tl.store(o + 21, tl.sum(wx2 * x2, 0))
        tl.store(o + 22, tl.sum(wy0 * y0, 0))
        tl.store(o + 23, tl.sum(wy0 * y1, 0))
        tl.store(o + 24, tl.sum(wy0 * y2, 0))
        tl.store(o + 25, tl.sum(wy1 * y1, 0))
        tl.store(o + 26, tl.sum(wy1 * y2, 0))
        tl.store(o + 27, tl.sum(wy2 * y2, 0))
    tl.store(o + 28, tl.sum(vf, 0))
    tl.store(o + 29, tl.sum(dd * vf, 0))


def normal_equations_triton(source: torch.Tensor, target: torch.Tensor, idx: torch.Tensor,
                            target_normals: torch.Tensor | None, lengths: torch.Tensor,
                            center: torch.Tensor, kernel: str, scale: float) -> torch.Tensor:
    """Launcher: contiguous inputs, grid (ceil(N / BLOCK), B), float64 sum of the partials."""
    B, N = source.shape[:2]
    M = target.shape[1]
    x = source.contiguous()
    y = target.contiguous()
    n = target_normals.contiguous() if target_normals is not None else y
    ix = idx.contiguous()
    ln = lengths.to(torch.int64).contiguous()
    c = center.to(torch.float32).contiguous()
    P = max(1, triton.cdiv(N, BLOCK))
    partial = torch.empty(B, P, WIDTH, dtype=torch.float32, device=source.device)
    _normal_eq_kernel[(P, B)](
        x, y, n, ix, ln, c, partial, N, M, P, float(scale),
        PLANE=target_normals is not None, KIND=KERNELS.index(kernel), BLOCK=BLOCK,
        num_warps=4)
    return partial.sum(1, dtype=torch.float64)


# ---- the solve: partial sums -> update, on the device (no host round trip) ----------------
#
# The (P, 30) float32 block partials are summed in float64 (one torch reduction), then one
# program per batch entry solves in float64 with scalar code: Horn's 4×4 eigenproblem (point-to-point; plus the two 3×3
# covariance spectra of the degeneracy test) or the 6×6 pseudo-inverse (point-to-plane), by
# cyclic Jacobi rotations with a fixed number of sweeps (quadratic convergence: 6-8 sweeps
# reach float64 round-off for these sizes). Triton has no small local arrays, so the
# straight-line scalar code (one variable per matrix entry) is generated below from the
# index pairs, registered with ``linecache`` (Triton reads a kernel's source) and compiled.

_SWEEPS = {3: 6, 4: 6, 6: 8}


def _a(p: str, i: int, j: int) -> str:
    return f"{p}{min(i, j)}{max(i, j)}"


def _jacobi(n: int, a: str, v: str | None, ind: str) -> list[str]:
    """Lines: cyclic Jacobi on the symmetric scalars ``a{i}{j}`` (and vectors ``v{i}{j}``)."""
    out = [f"for _sw in range({_SWEEPS[n]}):"]
    i2 = ind + "    "
    for p in range(n):
        for q in range(p + 1, n):
            apq, app, aqq = _a(a, p, q), _a(a, p, p), _a(a, q, q)
            out += [f"nz = tl.abs({apq}) > 1e-300",
                    f"th = ({aqq} - {app}) / tl.where(nz, 2.0 * {apq}, 1.0)",
                    "tt = tl.where(th >= 0, 1.0, -1.0) / (tl.abs(th) + tl.sqrt(th * th + 1.0))",
                    "tt = tl.where(nz, tt, 0.0)",
                    "cs = 1.0 / tl.sqrt(tt * tt + 1.0)",
                    "sn = tt * cs",
                    f"{app} = {app} - tt * {apq}",
                    f"{aqq} = {aqq} + tt * {apq}",
                    f"{apq} = {apq} * 0.0"]
            for k in range(n):
                if k in (p, q):
                    continue
                kp, kq = _a(a, k, p), _a(a, k, q)
                out += [f"u0 = {kp}", f"u1 = {kq}",
                        f"{kp} = cs * u0 - sn * u1", f"{kq} = sn * u0 + cs * u1"]
            if v is not None:
                for k in range(n):
                    kp, kq = f"{v}{k}{p}", f"{v}{k}{q}"
                    out += [f"u0 = {kp}", f"u1 = {kq}",
                            f"{kp} = cs * u0 - sn * u1", f"{kq} = sn * u0 + cs * u1"]
    return [ind + out[0]] + [i2 + x for x in out[1:]]


def _finite(x: str) -> str:
    return f"(({x}) == ({x})) & (tl.abs({x}) < float('inf'))"


def _solve_source() -> str:
    from pointalign.kernels.normal_eq import TRIU3, TRIU6

    I1 = "    "
    I2 = "        "
    L = ["def _solve_kernel(sums_ptr, c_ptr, tin_ptr, d_ptr, tn_ptr, tf_ptr, flag_ptr, eps,",
         "                  PLANE: tl.constexpr):",
         "    b = tl.program_id(0).to(tl.int64)"]
    L += [f"    s{k} = tl.load(sums_ptr + b * 30 + {k})" for k in range(30)]
    L += [f"    c{k} = tl.load(c_ptr + b * 3 + {k}).to(tl.float64)" for k in range(3)]
    L += [f"    T{i}{j} = tl.load(tin_ptr + b * 16 + {4 * i + j})"
          for i in range(4) for j in range(4)]
    L += ["    zero = s0 * 0.0", "    one = zero + 1.0"]
    # ---- point-to-plane
    L += ["    if PLANE:"]
    L += [I2 + f"h{i}{j} = s{q}" for q, (i, j) in enumerate(TRIU6)]
    L += [I2 + f"g{i} = -s{21 + i}" for i in range(6)]
    L += [I2 + f"v{i}{j} = {'one' if i == j else 'zero'}" for i in range(6) for j in range(6)]
    L += _jacobi(6, "h", "v", I2)
    L += [I2 + "mx = " + "tl.maximum(" * 5 + "h00" +
          "".join(f", h{i}{i})" for i in range(1, 6))]
    L += [I2 + "thr = eps * tl.maximum(mx, 1e-300)"]
    for i in range(6):
        L += [I2 + f"k{i} = h{i}{i} > thr",
              I2 + f"inv{i} = tl.where(k{i}, 1.0 / tl.maximum(h{i}{i}, 1e-300), 0.0)",
              I2 + f"y{i} = inv{i} * (" + " + ".join(f"v{k}{i} * g{k}" for k in range(6)) + ")"]
    for k in range(6):
        L += [I2 + f"xi{k} = " + " + ".join(f"v{k}{i} * y{i}" for i in range(6))]
    L += [I2 + "usable = (" + " | ".join(f"k{i}" for i in range(6)) + ")"]
    for k in range(6):
        L += [I2 + f"usable = usable & {_finite(f'xi{k}')}"]
    L += [I2 + "valid = usable & " + " & ".join(f"k{i}" for i in range(6))]
    for k in range(6):
        L += [I2 + f"xi{k} = tl.where(usable, xi{k}, 0.0)"]
    # Rodrigues: R = I + a K + b (w wᵀ − θ² I)
    L += [I2 + "th2 = xi0 * xi0 + xi1 * xi1 + xi2 * xi2",
          I2 + "small = th2 < 1e-12",
          I2 + "safe = tl.where(small, 1.0, tl.sqrt(th2))",
          I2 + "ra = tl.where(small, 1.0 - th2 / 6.0, tl.sin(safe) / safe)",
          I2 + "rb = tl.where(small, 0.5 - th2 / 24.0, (1.0 - tl.cos(safe)) / (safe * safe))"]
    K = {(0, 1): "-xi2", (0, 2): "xi1", (1, 0): "xi2", (1, 2): "-xi0", (2, 0): "-xi1",
         (2, 1): "xi0"}
    for i in range(3):
        for j in range(3):
            e = f"rb * xi{i} * xi{j}"
            e += " + one - rb * th2" if i == j else f" + ra * ({K[(i, j)]})"
            L += [I2 + f"R{i}{j} = {e}"]
    L += [I2 + f"t{i} = xi{3 + i}" for i in range(3)]
    # ---- point-to-point (Horn)
    L += ["    else:",
          I2 + "W = s0",
          I2 + "Wd = tl.maximum(W, 1e-300)"]
    L += [I2 + f"xm{i} = s{1 + i} / Wd" for i in range(3)]
    L += [I2 + f"ym{i} = s{4 + i} / Wd" for i in range(3)]
    L += [I2 + f"S{i}{j} = s{7 + 3 * i + j} - W * xm{i} * ym{j}"
          for i in range(3) for j in range(3)]
    for q, (i, j) in enumerate(TRIU3):
        L += [I2 + f"p{i}{j} = s{16 + q} - s{1 + i} * s{1 + j} / Wd",
              I2 + f"p{i + 3}{j + 3} = s{22 + q} - s{4 + i} * s{4 + j} / Wd"]
    terms = {(0, 0): "S00 + S11 + S22", (0, 1): "S12 - S21", (0, 2): "S20 - S02",
             (0, 3): "S01 - S10", (1, 1): "S00 - S11 - S22", (1, 2): "S01 + S10",
             (1, 3): "S20 + S02", (2, 2): "S11 - S00 - S22", (2, 3): "S12 + S21",
             (3, 3): "S22 - S00 - S11"}
    L += [I2 + f"n{i}{j} = {e}" for (i, j), e in terms.items()]
    L += [I2 + f"v{i}{j} = {'one' if i == j else 'zero'}" for i in range(4) for j in range(4)]
    L += _jacobi(4, "n", "v", I2)
    # eigenvector of the largest eigenvalue (the last on ties, as numpy's eigh)
    L += [I2 + "best = n00"] + [I2 + f"q{k} = v{k}0" for k in range(4)]
    for i in range(1, 4):
        L += [I2 + f"sel = n{i}{i} >= best", I2 + f"best = tl.where(sel, n{i}{i}, best)"]
        L += [I2 + f"q{k} = tl.where(sel, v{k}{i}, q{k})" for k in range(4)]
    L += [I2 + "qn = tl.maximum(tl.sqrt(q0 * q0 + q1 * q1 + q2 * q2 + q3 * q3), 1e-300)"]
    L += [I2 + f"q{k} = q{k} / qn" for k in range(4)]
    L += [I2 + "R00 = 1.0 - 2.0 * (q2 * q2 + q3 * q3)",
          I2 + "R01 = 2.0 * (q1 * q2 - q3 * q0)",
          I2 + "R02 = 2.0 * (q1 * q3 + q2 * q0)",
          I2 + "R10 = 2.0 * (q1 * q2 + q3 * q0)",
          I2 + "R11 = 1.0 - 2.0 * (q1 * q1 + q3 * q3)",
          I2 + "R12 = 2.0 * (q2 * q3 - q1 * q0)",
          I2 + "R20 = 2.0 * (q1 * q3 - q2 * q0)",
          I2 + "R21 = 2.0 * (q2 * q3 + q1 * q0)",
          I2 + "R22 = 1.0 - 2.0 * (q1 * q1 + q2 * q2)"]
    L += [I2 + f"t{i} = ym{i} - (R{i}0 * xm0 + R{i}1 * xm1 + R{i}2 * xm2)" for i in range(3)]
    # degeneracy: both covariances span a plane (middle eigenvalue > eps * largest)
    blk = []
    for o in (0, 3):
        for p in range(3):
            for q in range(p + 1, 3):
                blk.append((o + p, o + q))
    # two independent 3×3 Jacobi runs in one loop (pairs within each block only)
    jl = _jacobi(3, "p", None, I2)
    jl2 = [x.replace("p00", "P33").replace("p01", "P34").replace("p02", "P35")
           .replace("p11", "P44").replace("p12", "P45").replace("p22", "P55") for x in jl[1:]]
    L += jl + jl2
    L = [x.replace("P33", "p33").replace("P34", "p34").replace("P35", "p35")
         .replace("P44", "p44").replace("P45", "p45").replace("P55", "p55") for x in L]
    L += [I2 + "valid = W > 0"]
    for o in (0, 3):
        e = [f"p{o + i}{o + i}" for i in range(3)]
        L += [I2 + f"emax = tl.maximum(tl.maximum({e[0]}, {e[1]}), {e[2]})",
              I2 + f"emin = tl.minimum(tl.minimum({e[0]}, {e[1]}), {e[2]})",
              I2 + f"emid = {e[0]} + {e[1]} + {e[2]} - emax - emin",
              I2 + "valid = valid & (emid > eps * tl.maximum(emax, 1e-300))"]
    for i in range(3):
        for j in range(3):
            L += [I2 + f"valid = valid & {_finite(f'R{i}{j}')}"]
        L += [I2 + f"valid = valid & {_finite(f't{i}')}"]
    for i in range(3):
        for j in range(3):
            L += [I2 + f"R{i}{j} = tl.where(valid, R{i}{j}, {1.0 if i == j else 0.0})"]
        L += [I2 + f"t{i} = tl.where(valid, t{i}, 0.0)"]
    L += [I2 + "usable = valid"]
    # ---- un-centre (x ↦ R (x − c) + t + c), compose with T, store
    L += [I1 + f"D{i}3 = t{i} + c{i} - (R{i}0 * c0 + R{i}1 * c1 + R{i}2 * c2)"
          for i in range(3)]
    L += [I1 + f"D{i}{j} = R{i}{j}" for i in range(3) for j in range(3)]
    L += [I1 + "D30 = zero", I1 + "D31 = zero", I1 + "D32 = zero", I1 + "D33 = one"]
    for i in range(4):
        for j in range(4):
            L += [I1 + f"N{i}{j} = " + " + ".join(f"D{i}{k} * T{k}{j}" for k in range(4))]
            L += [I1 + f"tl.store(d_ptr + b * 16 + {4 * i + j}, D{i}{j})",
                  I1 + f"tl.store(tn_ptr + b * 16 + {4 * i + j}, N{i}{j})",
                  I1 + f"tl.store(tf_ptr + b * 16 + {4 * i + j}, N{i}{j}.to(tl.float32))"]
    L += [I1 + "tl.store(flag_ptr + b * 2 + 0, valid.to(tl.int32))",
          I1 + "tl.store(flag_ptr + b * 2 + 1, usable.to(tl.int32))"]
    return "\n".join(L) + "\n"


def _compile_solve():
    import linecache

    src = _solve_source()
    fname = "<pointalign._normal_eq_triton._solve_kernel>"
    linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
    ns = {"tl": tl, "triton": triton}
    exec(compile(src, fname, "exec"), ns)
    return triton.jit(ns["_solve_kernel"])


_solve_kernel = _compile_solve()


def partials_triton(source, target, idx, target_normals, lengths, center, kernel, scale):
    """The ``(B, P, 30)`` float32 block partials of :func:`normal_equations_triton`."""
    B, N = source.shape[:2]
    M = target.shape[1]
    n = target_normals if target_normals is not None else target
    P = max(1, triton.cdiv(N, BLOCK))
    partial = torch.empty(B, P, WIDTH, dtype=torch.float32, device=source.device)
    _normal_eq_kernel[(P, B)](
        source, target, n, idx, lengths, center, partial, N, M, P, float(scale),
        PLANE=target_normals is not None, KIND=KERNELS.index(kernel), BLOCK=BLOCK,
        num_warps=4)
    return partial


def icp_update_triton(source, target, idx, target_normals, lengths, center, kernel, scale,
                      transform, eps, out):
    """Reduce and solve on the device: writes ``out = (sums, D, T_new, T_new_f32, flags)``.

    Inputs must be contiguous, ``lengths`` int64, ``center`` float32, ``transform (B, 4, 4)``
    float64 (not aliased with ``out``). Three launches, no synchronisation.
    """
    partial = partials_triton(source, target, idx, target_normals, lengths, center, kernel,
                              scale)
    B = partial.shape[0]
    sums, D, Tn, Tf, flags = out
    torch.sum(partial, 1, dtype=torch.float64, out=sums)
    _solve_kernel[(B,)](sums, center, transform, D, Tn, Tf, flags, float(eps),
                        PLANE=target_normals is not None, num_warps=1)
    return out
