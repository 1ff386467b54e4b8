"""EM-ICP and Softassign on the CPU: the chosen form, its record, extreme parameters, offsets.

The approximated forms (``approximation="approximate"``) must land near the exact form on a
bunny subsample; ``info["approximation"]`` says which ran; parameters out of range raise a
ValueError naming them; a run that matched nothing is not "converged"; clouds far from the
origin (float64) give the unshifted run's pose.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointalign import _progress, datasets, metrics
from pointalign.kernels._numba import available
from pointalign.registration import soft
from pointalign.registration.soft import emicp, softassign

pytestmark = pytest.mark.skipif(not available(), reason="numba is not installed")

EM_SHORT = dict(sigma=0.03, sigma_min=0.004, factor=0.8)          # 18 iterations
SA_SHORT = dict(temperatures=12, beta_factor=1.4, iterations_per_temperature=2,
                sinkhorn_iterations=2)


def _bunny(n_src, n_tgt, seed=0):
    p = datasets.load_bunny_pair()
    return (datasets.random_subsample(p.source, n_src, seed).double(),
            datasets.random_subsample(p.target, n_tgt, seed + 1).double(), p.T_target_source)


def _translation(v) -> torch.Tensor:
    T = torch.eye(4, dtype=torch.float64)
    T[:3, 3] = torch.as_tensor(v, dtype=torch.float64)
    return T


def _pose_gap(Ta, Tb):
    r, t = metrics.relative_error(np.asarray(Ta), np.asarray(Tb))
    return r, t


def test_emicp_approximate_lands_near_exact():
    """Cells + truncation on 1200 x 1200 bunny points: within 0.5° / 1 mm of the exact form
    (both from the identity; the pose is ~34° away), and as near the truth (+0.5°)."""
    x, y, Td = _bunny(1200, 1200)
    ex = emicp(x, y, device="cpu", approximation="exact", **EM_SHORT)
    ap = emicp(x, y, device="cpu", approximation="approximate", **EM_SHORT)
    assert ex.info["approximation"]["mode"] == "exact"
    assert ap.info["approximation"]["mode"] == "cells"
    assert ap.info["approximation"]["k"] == 4.0 and "cell_rule" in ap.info["approximation"]
    r, t = _pose_gap(ap.transformation, ex.transformation)
    assert r < 0.5 and t < 1e-3, (r, t)
    r_ap, _ = _pose_gap(ap.transformation, Td.numpy())
    r_ex, _ = _pose_gap(ex.transformation, Td.numpy())
    assert r_ap < r_ex + 0.5, (r_ap, r_ex)


#: a short Softassign schedule that starts hot (β₀ = 1/ρ², cells of ~4 points) and ends cold
#: (β = 1/ρ² · 2.2^9 ≈ 1200/ρ²: one point per cell), as the default schedule does
SA_HOT_COLD = dict(temperatures=10, beta_factor=2.2, iterations_per_temperature=3,
                   sinkhorn_iterations=2)


def test_softassign_approximate_lands_near_exact():
    """Cells while they merge points, then per point: within 0.05° / 0.05 mm of the exact
    form on 400 x 400 bunny points (from the identity; the pose is ~34° away), and the record
    says which form ran in which phase."""
    x, y, Td = _bunny(400, 400)
    ex = softassign(x, y, device="cpu", approximation="exact", **SA_HOT_COLD)
    ap = softassign(x, y, device="cpu", approximation="approximate", **SA_HOT_COLD)
    assert ex.info["approximation"]["mode"] == "exact"
    info = ap.info["approximation"]
    assert info["mode"] == "cells" and info["normaliser_relative_bound"] <= 1e-4
    forms = [p["form"] for p in info["phases"]]
    assert forms[0] == "cells" and forms[-1] == "per_point", info["phases"]
    assert info["passes"]["cells"] > 0 and info["passes"]["per_point"] > 0
    assert sum(info["passes"].values()) == ap.iterations * 2 * 2
    r, t = _pose_gap(ap.transformation, ex.transformation)
    assert r < 0.05 and t < 5e-5, (r, t)
    r_ex, _ = _pose_gap(ex.transformation, Td.numpy())
    assert r_ex < 3.0, r_ex  # the exact run itself registers the pair


def test_auto_form_estimate_and_slow_warning(monkeypatch):
    x, y, _ = _bunny(200, 200)
    res = emicp(x, y, device="cpu", **EM_SHORT)
    assert res.info["approximation"]["mode"] == "exact"  # small: the exact form is seconds
    est = soft.estimate_seconds("emicp", x, y, device="cpu", **EM_SHORT)
    assert est["approximation"]["mode"] == "exact" and 0 < est["seconds"] < 3
    est = soft.estimate_seconds("softassign", x, y, device="cpu", approximation="approximate")
    assert est["approximation"]["mode"] == "cells" and est["seconds"] > 0
    with pytest.raises(ValueError, match="algorithm"):
        soft.estimate_seconds("icp", x, y)
    with pytest.raises(TypeError, match="sigmaa"):
        soft.estimate_seconds("emicp", x, y, sigmaa=0.1)
    with pytest.raises(ValueError, match="approximation"):
        emicp(x, y, device="cpu", approximation="fast")
    monkeypatch.setattr(soft, "SLOW_S", -1.0)
    with pytest.warns(_progress.SlowOperationWarning, match="estimated"):
        emicp(x, y, device="cpu", criteria=soft.ConvergenceCriteria(max_iterations=1))


@pytest.mark.parametrize("algo,kwargs,match", [
    (emicp, dict(sigma=1e-30), "sigma"),
    (emicp, dict(sigma=1e30), "sigma"),
    (emicp, dict(sigma_min=1e-30), "sigma_min"),
    (emicp, dict(sigma=1e30, sigma_min=1e29), "sigma"),
    (emicp, dict(sigma=1e-29, sigma_min=1e-30), "sigma"),
    (softassign, dict(beta0=1e-30), "beta0"),
    (softassign, dict(beta0=1e30), "beta0"),
    (softassign, dict(alpha=1e30), "alpha"),
    (softassign, dict(beta_factor=float("inf")), "beta_factor"),
])
def test_extreme_parameters_name_the_argument(algo, kwargs, match):
    x, y, _ = _bunny(50, 50)
    with pytest.raises(ValueError, match=match):
        algo(x, y, device="cpu", **kwargs)


@pytest.mark.parametrize("algo,kwargs", [(emicp, EM_SHORT), (softassign, SA_SHORT)])
def test_nothing_matched_is_not_converged(algo, kwargs):
    """The source placed 100 m away: no pair within reach, the pose stays: not converged."""
    x, y, _ = _bunny(100, 100)
    init = _translation([100.0, 0.0, 0.0])
    res = algo(x, y, init=init, device="cpu", **kwargs)
    assert not res.converged and res.stop_reason == "no_correspondences"
    assert res.fitness == 0


@pytest.mark.parametrize("algo,kwargs,offset",
                         [(emicp, EM_SHORT, o) for o in (1e3, 1e4, 1e5, 1e6)]
                         + [(softassign, SA_SHORT, o) for o in (1e3, 1e6)])
def test_far_from_origin_matches_unshifted(algo, kwargs, offset):
    """Float64 clouds shifted by 1e3..1e6 m: the pose of the unshifted run, moved along."""
    x, y, _ = _bunny(150, 150)
    o = torch.tensor([offset, -0.7 * offset, 0.3 * offset], dtype=torch.float64)
    base = algo(x, y, device="cpu", **kwargs)
    far = algo(x + o, y + o, device="cpu", **kwargs)
    # the same motion of the points where they are (the pose about the origin, 1e6 m away,
    # carries its rotation's last bits times the offset)
    xs = (x + o).numpy()
    moved_far = xs @ np.asarray(far.transformation)[:3, :3].T + \
        np.asarray(far.transformation)[:3, 3]
    moved_base = x.numpy() @ np.asarray(base.transformation)[:3, :3].T + \
        np.asarray(base.transformation)[:3, 3] + o.numpy()
    extent = float(np.ptp(x.numpy(), axis=0).max())
    gap = np.abs(moved_far - moved_base).max()
    assert gap < 1e-6 * extent, gap
    assert np.abs(np.asarray(far.transformation)[:3, :3]
                  - np.asarray(base.transformation)[:3, :3]).max() < 1e-6
    assert far.converged == base.converged and far.iterations == base.iterations


@pytest.mark.parametrize("algo,kwargs", [(emicp, EM_SHORT), (softassign, SA_SHORT)])
def test_progress_advances_once_per_iteration(monkeypatch, algo, kwargs):
    """The CPU run opens one progress task over the schedule and advances it per iteration."""
    import contextlib

    seen = []

    class Bar:
        n = 0

        def advance(self, n=1):
            self.n += n

    @contextlib.contextmanager
    def task(description, total=None, *, quiet=None):
        bar = Bar()
        seen.append((description, total, bar))
        yield bar

    monkeypatch.setattr(soft._progress, "task", task)
    x, y, _ = _bunny(100, 100)
    res = algo(x, y, device="cpu", **kwargs)
    (desc, total, bar), = seen
    assert total == res.info["scheduled_iterations"] and bar.n == res.iterations


def test_softassign_approximate_on_random_data_lands_near_exact():
    """A random anisotropic Gaussian cloud (250 points, 23° about z, 1 cm noise): the cells
    form gives the exact form's pose within 0.05° / 0.05 mm, and the truth within 0.5°."""
    import math

    g = torch.Generator().manual_seed(23)
    y = torch.randn(250, 3, generator=g, dtype=torch.float64) * \
        torch.tensor([1.0, 0.6, 0.3], dtype=torch.float64)
    c, s = math.cos(0.4), math.sin(0.4)
    T = torch.eye(4, dtype=torch.float64)
    T[:3, :3] = torch.tensor([[c, -s, 0], [s, c, 0], [0, 0, 1.0]], dtype=torch.float64)
    T[:3, 3] = torch.tensor([0.1, -0.05, 0.02], dtype=torch.float64)
    x = (y - T[:3, 3]) @ T[:3, :3] + 0.01 * torch.randn(250, 3, generator=g,
                                                         dtype=torch.float64)
    ex = softassign(x, y, device="cpu", approximation="exact", **SA_HOT_COLD)
    ap = softassign(x, y, device="cpu", approximation="approximate", **SA_HOT_COLD)
    assert ap.info["approximation"]["passes"].get("cells", 0) > 0
    r, t = _pose_gap(ap.transformation, ex.transformation)
    assert r < 0.05 and t < 5e-5, (r, t)
    r, _ = _pose_gap(ap.transformation, T.numpy())
    assert r < 0.5, r


def test_softassign_fused_updates_equal_the_passes(monkeypatch):
    """The "cells" updates fused into one call per update (``softassign_update``) give the
    pose of the passes run one by one, bit for bit (float32 bunny subsample, hot to cold),
    and the record counts the same passes."""
    from pointalign.kernels.soft import cpu as _soft_cpu

    x, y, _ = _bunny(300, 300)
    x, y = x.float(), y.float()
    fused = softassign(x, y, device="cpu", approximation="approximate", **SA_HOT_COLD)
    calls = []

    def per_pass(*args, **kw):
        calls.append(1)
        return None
    monkeypatch.setattr(_soft_cpu, "softassign_update", per_pass)
    ref = softassign(x, y, device="cpu", approximation="approximate", **SA_HOT_COLD)
    assert len(calls) == ref.iterations
    assert ref.info["approximation"]["passes"]["cells"] > 0
    assert fused.info["approximation"]["passes"] == ref.info["approximation"]["passes"]
    assert np.array_equal(np.asarray(fused.transformation), np.asarray(ref.transformation))
