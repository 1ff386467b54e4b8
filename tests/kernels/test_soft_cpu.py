"""kernels._soft_cpu: the numba row passes of the soft methods against the PyTorch reference.

Exact form: equal to ``soft.soft_rows_reference`` (float64 sums in another order). EM-ICP's
"cells" form: every row sum within the bounds the module states (Jensen / Hoeffding per kept
cell, ``e^(−s(R − h)²)`` per dropped point). Softassign's "truncated" form: every Sinkhorn
output within its relative bound. The plan: modes, info, estimates.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointalign.kernels import soft
from pointalign.kernels._numba import available
from pointalign.kernels.knn.cpu import CpuTree
from pointalign.kernels.soft import cpu as _soft_cpu

pytestmark = pytest.mark.skipif(not available(), reason="numba is not installed")


def _cloud(g, n, flat=0.05):
    """A noisy sheet-like cloud (n, 3) float64: surfaces are what the soft methods see."""
    return torch.randn(n, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 1.0, flat],
                                                                                dtype=torch.float64)


def _pose(rz=0.1, t=(0.05, -0.02, 0.01)):
    T = torch.eye(4, dtype=torch.float64)
    c, s = math.cos(rz), math.sin(rz)
    T[:2, :2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    T[:3, 3] = torch.tensor(t, dtype=torch.float64)
    return T


@pytest.mark.parametrize("scale,weights", [(2.0, False), (50.0, True), (1e6, True)])
def test_exact_rows_equal_reference(scale, weights):
    """The exact numba pass (both kernels: linear weights and running maximum) = reference."""
    g = torch.Generator().manual_seed(3)
    q, p = _cloud(g, 301), _cloud(g, 257)
    lw = torch.randn(1, 257, generator=g, dtype=torch.float64) * 3 if weights else None
    sc = torch.tensor([scale], dtype=torch.float64)
    T = _pose()[None]
    ref = soft.soft_rows_reference(q[None], p[None], T, sc, point_log_weights=lw, squares=True)
    plan = soft.cpu_plan(301, 257, 1, approximation="exact")
    got = soft.soft_rows(q[None], p[None], T, sc, point_log_weights=lw, squares=True,
                         approximation=plan)
    fin = torch.isfinite(ref.lse)
    assert torch.equal(fin, torch.isfinite(got.lse))
    assert torch.allclose(got.lse[fin], ref.lse[fin], rtol=0, atol=1e-9)
    assert got.lse2 is not None and ref.lse2 is not None
    assert torch.allclose(got.lse2[fin], ref.lse2[fin], rtol=0, atol=1e-9)
    assert torch.allclose(got.mean, ref.mean, rtol=0, atol=1e-9)


@pytest.mark.parametrize("sigma", [0.6, 0.2, 0.05])
def test_cells_row_sums_within_stated_bounds(sigma):
    """At source-cell centroids, the cells' row sums bracket the exact all-pairs sums."""
    g = torch.Generator().manual_seed(5)
    t = _cloud(g, 3000)
    q = _cloud(g, 400) + 0.05
    k, c = _soft_cpu.TRUNCATE_K, _soft_cpu.CELL_RATIO
    _, a = _soft_cpu.cell_side(sigma, c)
    assert c * sigma / math.sqrt(2) < a <= c * sigma
    cen, n, _ = _soft_cpu._merge(t.numpy(), a)
    if sigma > 0.5:
        assert cen.shape[0] < t.shape[0] / 2  # cells do merge here
    tree = CpuTree(cen, leaf_size=8)
    for mult in (1.0, 2.0):  # lse (scale s) and lse2 (scale 2s) of the same pass
        s = 0.5 / sigma ** 2
        R, h = k * sigma, math.sqrt(3) / 2 * a
        lse, lse2, _ = _soft_cpu._run_rows(q.numpy(), np.log(n), tree, s, R * R, True)
        approx = torch.from_numpy(lse if mult == 1 else lse2)
        sm = mult * s
        ref = soft.soft_rows_reference(q[None], t[None], torch.eye(4, dtype=torch.float64)[None],
                                       torch.tensor([sm], dtype=torch.float64)).lse[0]
        hi = ref + sm * h * h                                      # Jensen, every kept cell
        rng = 4 * sm * R * h + sm * h * h                           # Hoeffding at d <= R
        dropped = t.shape[0] * math.exp(-sm * (R - h) ** 2)
        lo = torch.log((ref.exp() - dropped).clamp_min(0)) - rng * rng / 8  # -inf: vacuous
        assert torch.all(approx <= hi + 1e-9), (approx - hi).max()
        assert torch.all(approx >= lo - 1e-9), (lo - approx).max()


def test_cells_emicp_step_close_to_exact():
    """One EM-ICP step in cells form lands near the exact step (a bounded perturbation)."""
    g = torch.Generator().manual_seed(7)
    y = _cloud(g, 2000).float()[None]
    x = (_cloud(g, 1500).float() @ _pose()[:3, :3].T.float())[None]
    L = torch.tensor([1500]), torch.tensor([2000])
    T0 = torch.eye(4, dtype=torch.float64)[None]
    fr = torch.zeros(1, dtype=torch.bool)
    for sigma in (0.5, 0.1):
        sc = torch.tensor([0.5 / sigma ** 2])
        lo = torch.tensor([-4.0 / sigma ** 2])
        plan = soft.cpu_plan(1500, 2000, 1, approximation="approximate")
        assert plan.mode == "cells"
        Ta, _, lam_a = soft.emicp_step(x, y, T0, sc, lo, fr, source_lengths=L[0],
                                       target_lengths=L[1], approximation=plan)
        Te, _, lam_e = soft.emicp_step(x, y, T0, sc, lo, fr, source_lengths=L[0],
                                       target_lengths=L[1])
        R = Ta[0, :3, :3] @ Te[0, :3, :3].T
        ang = math.degrees(math.acos(max(-1.0, min(1.0, (float(R.trace()) - 1) / 2))))
        assert ang < 0.5 and float((Ta[0, :3, 3] - Te[0, :3, 3]).norm()) < 0.02 * sigma
        assert float((lam_a - lam_e).abs().sum() / lam_e.sum()) < 0.1
        # the exact numba form is the reference up to float rounding
        plan_x = soft.cpu_plan(1500, 2000, 1, approximation="exact")
        Tx, _, _ = soft.emicp_step(x, y, T0, sc, lo, fr, source_lengths=L[0],
                                   target_lengths=L[1], approximation=plan_x)
        assert torch.allclose(Tx, Te, atol=1e-5)


def test_truncated_sinkhorn_within_its_bound():
    """Softassign's truncation: each half-step's output within the stated relative bound."""
    g = torch.Generator().manual_seed(11)
    x, y = _cloud(g, 500)[None], _cloud(g, 450)[None]
    T = _pose()[None]
    Ti = torch.linalg.inv(T)
    for beta, alpha in ((1.0, 0.01), (30.0, 0.01), (2000.0, 0.001)):
        b = torch.tensor([beta], dtype=torch.float64)
        ba = torch.tensor([beta * alpha], dtype=torch.float64)
        lw = torch.zeros(1, dtype=torch.float64)
        plan = soft.cpu_plan(500, 450, 1, approximation="approximate", method="softassign")
        assert plan.mode == "truncated"
        g_col = ba[:, None].expand(1, 450)
        for _ in range(2):
            ref = soft.sinkhorn_scaling(x, y, T, b, g_col, lw, ba)
            got = soft.sinkhorn_scaling(x, y, T, b, g_col, lw, ba, approximation=plan)
            # out = βα − log(w + Σ): a relative error ≤ tol of the normaliser
            assert torch.all(got >= ref - 1e-9)
            assert torch.all(got - ref <= -math.log1p(-_soft_cpu.SOFTASSIGN_TOLERANCE) + 1e-9)
            g_row = ref
            g_col = soft.sinkhorn_scaling(y, x, Ti, b, g_row, lw, ba)
        r_ref = soft.soft_rows(y, x, Ti, b, point_log_weights=g_row)
        r_got = soft.soft_rows(y, x, Ti, b, point_log_weights=g_row, approximation=plan,
                               offset=ba)
        fin = torch.isfinite(r_got.lse)
        assert torch.all(r_got.lse[fin] <= r_ref.lse[fin] + 1e-9)


def test_plan_modes_info_and_estimates():
    assert soft.cpu_plan(100, 100, 10).mode == "exact"
    p = soft.cpu_plan(40000, 40000, 66)
    assert p.mode == "cells" and p.exact_estimate_s > _soft_cpu.AUTO_BUDGET_S
    info = p.info()
    assert info["mode"] == "cells" and info["k"] == _soft_cpu.TRUNCATE_K
    assert info["dropped_term_bound"] < 5e-3 and 0.9 < info["kept_cell_ratio_at_1_sigma"][0] < 1
    assert soft.cpu_plan(40000, 40000, 66, approximation="exact").mode == "exact"
    sa = soft.cpu_plan(2000, 2000, 3000, method="softassign")
    assert sa.mode == "truncated"
    assert 2000 * math.exp(-sa.k ** 2 / 2) <= _soft_cpu.SOFTASSIGN_TOLERANCE * 1.0001
    with pytest.raises(ValueError, match="approximation"):
        soft.cpu_plan(1, 1, 1, approximation="fast")
    with pytest.raises(ValueError, match="method"):
        soft.cpu_plan(1, 1, 1, method="icp")
    # with the clouds, the cells' estimate counts cells: far below the exact one at 40k
    g = torch.Generator().manual_seed(1)
    pts = _cloud(g, 40000).numpy() * 0.05
    sig = [0.05 * 0.9 ** (k / 2) for k in range(66)]
    est = soft.cpu_plan(40000, 40000, 66, source=pts, target=pts, sigmas=sig)
    assert 0 < est.estimate_s < est.exact_estimate_s / 5


def _softassign_plan(x, y, betas, alpha):
    return soft.cpu_plan(x.shape[0], y.shape[0], 1, approximation="approximate",
                         method="softassign", source=x.numpy(), target=y.numpy(),
                         betas=betas, alpha=alpha, passes_per_beta=1)


def test_softassign_cells_pass_within_block_bounds():
    """Hot β: each source cell's term against the target cells brackets its block's exact
    sums (``block_factor``: Jensen above, Hoeffding at the largest kept distance below)."""
    g = torch.Generator().manual_seed(13)
    y = _cloud(g, 1500)
    x = _cloud(g, 1200) + 0.03
    beta, alpha = 1.0, 0.01
    plan = _softassign_plan(x, y, [beta], alpha)
    assert plan.mode == "cells" and plan.phases[0]["form"] == "cells"
    c = plan.cell_ratio
    sigma = math.sqrt(0.5 / beta)
    _, a = _soft_cpu.cell_side(sigma, c)
    cx, nx, inv = _soft_cpu._merge(x.numpy(), a)
    assert inv is not None and cx.shape[0] < 900  # the cells merge here
    lw = torch.randn(1500, generator=g, dtype=torch.float64) * 0.5  # column scalings
    T = torch.eye(4, dtype=torch.float64)
    r2 = (plan.k ** 2 / 2 + beta * alpha) / beta
    lse, _ = _soft_cpu._softassign_cells(x, y, T, beta, lw, r2, plan)
    ref = soft.soft_rows_reference(x[None], y[None], T[None],
                                   torch.tensor([beta], dtype=torch.float64),
                                   point_log_weights=lw[None]).lse[0].numpy()
    # per source cell: n_I e^(lse_I) against Σ_(i∈I) e^(ref_i) (each point takes its cell's)
    block = np.bincount(inv, weights=np.exp(ref), minlength=cx.shape[0])
    approx = nx * np.exp(lse[np.unique(inv, return_index=True)[1]])
    R = math.sqrt(r2) + 2 * math.sqrt(3) * a
    lo, hi = _soft_cpu.block_factor(R / sigma, a / sigma)
    dropped = nx * 1500 * math.exp(lw.max().item()) * math.exp(-beta * r2)
    assert np.all(approx <= hi * block * (1 + 1e-12))
    assert np.all(approx >= lo * (block - dropped) * (1 - 1e-12))
    # what it gives in practice: every cell's block within a few per cent
    assert np.abs(np.log(approx / block)).max() < 0.05


def test_softassign_cells_equal_truncated_once_cells_hold_one_point():
    """Cold β: one point per cell on both sides: the pass is the per-point truncated one."""
    g = torch.Generator().manual_seed(17)
    y, x = _cloud(g, 400)[None], _cloud(g, 300)[None]
    beta, alpha = torch.tensor([1e6], dtype=torch.float64), 1e-4
    plan = _softassign_plan(x[0], y[0], [1e6], alpha)
    assert [p["form"] for p in plan.phases] == ["per_point"]
    trunc = soft.cpu_plan(300, 400, 1, approximation="approximate", method="softassign")
    assert trunc.mode == "truncated"
    T, lw = _pose()[None], torch.randn(1, 400, generator=g, dtype=torch.float64)
    ba = beta * alpha
    a = soft.soft_rows(x, y, T, beta, point_log_weights=lw, approximation=plan, offset=ba)
    b = soft.soft_rows(x, y, T, beta, point_log_weights=lw, approximation=trunc, offset=ba)
    assert torch.equal(a.lse, b.lse) and torch.equal(a.mean, b.mean)
    assert plan.info()["passes"] == {"per_point": 1}


def test_softassign_cells_plan_phases_and_estimate():
    """The plan's phases go from cells to per point as β grows; its estimate follows."""
    g = torch.Generator().manual_seed(19)
    x, y = _cloud(g, 2000) * 0.05, _cloud(g, 2000) * 0.05
    betas = [1 / 0.05 ** 2 * 1.12 ** k for k in range(100)]  # hot to one point per cell
    plan = soft.cpu_plan(2000, 2000, 3000, approximation="approximate", method="softassign",
                         source=x.numpy(), target=y.numpy(), betas=betas, alpha=2.5e-5,
                         passes_per_beta=30)
    forms = [p["form"] for p in plan.phases]
    assert forms[0] == "cells" and forms[-1] == "per_point" and forms.count("per_point") == 1
    assert plan.phases[0]["temperatures"][0] == 0 and plan.phases[-1]["temperatures"][1] == 99
    assert plan.phases[0]["cells"][0] < 1500
    assert 0 < plan.estimate_s < plan.exact_estimate_s / 3
    info = plan.info()
    assert info["mode"] == "cells" and info["cell_ratio"] == _soft_cpu.SOFT_CELL_RATIO
    lo, hi = info["cell_block_ratio_at_1_sigma"]
    assert (lo, hi) == _soft_cpu.block_factor(1.0, _soft_cpu.SOFT_CELL_RATIO)
    assert 0 < lo < 1 < hi < 1.5
    # the block bound is second order in a/σ: halving the cells shrinks its log 4x at d -> 0
    assert math.log(_soft_cpu.block_factor(0.0, 0.2)[1]) == pytest.approx(
        math.log(_soft_cpu.block_factor(0.0, 0.4)[1]) / 4)


def test_softassign_cells_kernel_matrix_equals_tree_pass(monkeypatch):
    """One update's cached kernel matrix (row pass, then the column pass through its
    transpose) gives the tree passes' sums; a new pose rebuilds it. (Weights that vary
    within a cell take the tree pass: ``test_softassign_cells_pass_within_block_bounds``.)"""
    g = torch.Generator().manual_seed(29)
    x, y = _cloud(g, 900)[None], _cloud(g, 800)[None]
    beta, ba = torch.tensor([2.0], dtype=torch.float64), torch.tensor([0.02], dtype=torch.float64)
    plan = _softassign_plan(x[0], y[0], [2.0], 0.01)
    lw = ba[:, None].expand(1, 800)  # the first row pass's column weights: one per cell

    def passes(plan_, T):
        Ti = torch.linalg.inv(T)
        g_row = soft.sinkhorn_scaling(x, y, T, beta, lw, torch.zeros(1, dtype=torch.float64),
                                      ba, approximation=plan_)
        return g_row, soft.soft_rows(y, x, Ti, beta, point_log_weights=g_row,
                                     approximation=plan_, offset=ba)

    for T in (_pose()[None], _pose(0.3, (0.1, 0.0, 0.0))[None]):
        g_row, cols = passes(plan, T)
        slot = plan.cache.items["kernel"]  # built by the row pass, used by the column pass
        assert slot["s"] == 2.0 and slot["q"][1] == x.data_ptr()
        monkeypatch.setattr(_soft_cpu, "KERNEL_CACHE_PAIRS", -1)  # the tree passes
        tree_plan = _softassign_plan(x[0], y[0], [2.0], 0.01)
        g_ref, ref = passes(tree_plan, T)
        monkeypatch.undo()
        assert "kernel" not in tree_plan.cache.items
        assert torch.allclose(g_row, g_ref, rtol=0, atol=1e-10)
        assert torch.allclose(cols.lse, ref.lse, rtol=0, atol=1e-10)
        assert torch.allclose(cols.mean, ref.mean, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype,batch", [(torch.float32, 1), (torch.float64, 1),
                                         (torch.float64, 2)])
def test_softassign_update_equals_its_passes(dtype, batch):
    """The fused update (kernel matrix from candidate pairs, all passes in one call) gives
    exactly the passes run one by one (``sinkhorn_scaling`` x 2·rounds − 1, ``soft_rows``)
    in float32 and float64: a pose close to the last (candidates reused), one far
    (candidates rebuilt), and None once no cell merges. A batch of two (padding in the
    second): within 1e-12, as the per-pass path keeps one problem's matrix at a time (its
    column passes then walk a tree: the same sums in another order)."""
    g = torch.Generator().manual_seed(31)
    x = torch.stack([_cloud(g, 700), _cloud(g, 700)]).to(dtype)[:batch]
    y = torch.stack([_cloud(g, 600), _cloud(g, 600)]).to(dtype)[:batch]
    xl, yl = torch.tensor([700, 650])[:batch], torch.tensor([600, 520])[:batch]
    beta = torch.tensor([2.0, 3.0], dtype=torch.float32)[:batch]
    ba = torch.tensor([0.02, 0.03], dtype=torch.float32)[:batch]
    log_w = torch.zeros(batch, dtype=torch.float32)
    plan = _softassign_plan(x[0].double(), y[0].double(), [2.0], 0.01)

    def passes(T, rounds):
        Ti = torch.linalg.inv(T)
        g_col = ba[:, None].expand(-1, 600)
        for s in range(rounds):
            g_row = soft.sinkhorn_scaling(x, y, T, beta, g_col, log_w, ba, query_lengths=xl,
                                          point_lengths=yl, approximation=plan)
            if s + 1 < rounds:
                g_col = soft.sinkhorn_scaling(y, x, Ti, beta, g_row, log_w, ba,
                                              query_lengths=yl, point_lengths=xl,
                                              approximation=plan)
        r = soft.soft_rows(y, x, Ti, beta, query_lengths=yl, point_lengths=xl,
                           point_log_weights=g_row, approximation=plan, offset=ba)
        return r.lse, r.mean

    poses = [_pose(), _pose(0.1001, (0.0501, -0.02, 0.01)), _pose(0.5, (0.4, 0.2, 0.0))]
    builds = []
    for T1, rounds in zip(poses, (3, 3, 1), strict=True):
        T = torch.stack([T1, torch.linalg.inv(T1)])[:batch]
        before = plan.cache.passes.get("cells", 0)
        got = _soft_cpu.softassign_update(x, y, T, beta, ba, log_w, xl, yl, rounds, plan)
        assert got is not None
        assert plan.cache.passes["cells"] == before + 2 * rounds * batch
        builds.append(id(plan.cache.items[("cand", 0)]["idx"]))
        lse, mean = passes(T, rounds)
        assert got[0].dtype == dtype
        if batch == 1:
            assert torch.equal(got[0], lse) and torch.equal(got[1], mean)
        else:
            assert torch.equal(torch.isinf(got[0]), torch.isinf(lse))
            assert torch.isinf(lse[1, 520:]).all() and torch.isfinite(lse[1, :520]).all()
            fin = torch.isfinite(lse)
            assert torch.allclose(got[0][fin], lse[fin], rtol=0, atol=1e-12)
            assert torch.allclose(got[1], mean, rtol=0, atol=1e-12)
    assert builds[0] == builds[1] != builds[2]  # reused for the small move only
    cold = torch.tensor([1e7, 1e7], dtype=torch.float32)[:batch]  # cells below the spacing
    T = torch.stack([poses[0], poses[0]])[:batch]
    assert _soft_cpu.softassign_update(x, y, T, cold, ba, log_w, xl, yl, 2, plan) is None
