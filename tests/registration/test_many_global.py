"""register_many's batched stages (registration/many/batched*.py) against the per-pair ones.

* preparation: the downsampled clouds equal each cloud's own (bit for bit: the same cells,
  the same sums); the normals equal (the same neighbour rows, the same kernel per point;
  dot > 1 - 1e-6); FPFH within 1e-3 on at least 80 % of the rows of each cloud: the packed
  search measures distances on shifted coordinates (float32 at the lattice's extent), which
  moves the 1/d² weights by ~1e-4 and can flip a neighbour lying on the 5-voxel radius,
  which changes that point's histogram and its neighbours' (up to 15 % of one cloud's rows
  seen on the bunny pairs);
* registration: the same verdicts and poses within the ICP's settling as the per-pair path
  (RANSAC draws other samples, one generator for the group), and the true pose;
* the rule: batched on a GPU, per pair on the CPU unless forced; per pair for one pair, for
  options it does not implement; pairs with an init and bad pairs beside batched ones.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
import torch

from pointalign import datasets, metrics
from pointalign.features.downsample import group_clouds, voxel_downsample
from pointalign.kernels import _loop
from pointalign.registration import voxel_rule
from pointalign.registration.many import batched as bt
from pointalign.registration.many import batched_local as bl
from pointalign.registration.many import batched_prepare as bp
from pointalign.registration.many import local_stages, register_many
from pointalign.registration.options import check
from pointalign.registration.pipeline import Scales
from pointalign.registration.prepare import prepare_cloud

OPTS = dict(hypotheses=1024)


def _pairs(k: int = 3, n: int = 500, seed: int = 0):
    bunny = datasets.load_bunny("bun000")
    return [datasets.make_pair(datasets.random_subsample(bunny, n, seed=seed + s), 12.0, 0.01,
                               noise=3e-4, seed=seed + s) for s in range(k)]


def _scaled_clouds(pairs, device):
    opts = check("register_many", {})
    out = []
    for p in pairs:
        s = torch.as_tensor(np.asarray(p.source), dtype=torch.float32, device=device)
        t = torch.as_tensor(np.asarray(p.target), dtype=torch.float32, device=device)
        s, t = s - t.mean(0), t - t.mean(0)
        v, _ = voxel_rule.voxel_size_per_cloud(s, t, opts)
        out += [s / v, t / v]
    return out


def test_described_as_each_cloud_alone(backend):
    clouds = _scaled_clouds(_pairs(3, 2000), backend.device)
    unit = Scales(1.0)
    downs, sizes = bp.prepare_many(clouds, unit, _loop.Clock(torch.device(backend.device)))
    normals, features = bp.describe_many(downs, unit)
    clock = _loop.Clock(torch.device(backend.device))
    for c, d, n, f in zip(clouds, downs, normals, features, strict=True):
        assert torch.equal(d, voxel_downsample(c, 1.0))
        one = prepare_cloud(c, unit, clock, "cloud")
        assert float((one.normals * n).sum(1).min()) > 1 - 1e-6
        close = ((one.features - f).abs() <= 1e-3).all(1)
        assert float(close.float().mean()) >= 0.8
        assert f.shape == one.features.shape and d.shape[0] in sizes


def _local(pairs, device):
    """Each pair's clouds as register_many holds them (float32, about the target's centroid)."""
    out = []
    for p in pairs:
        s = torch.as_tensor(np.asarray(p.source), dtype=torch.float64)
        t = torch.as_tensor(np.asarray(p.target), dtype=torch.float64)
        c = t.mean(0)
        out.append(((s - c).float().to(device), (t - c).float().to(device)))
    return out


@dataclasses.dataclass(frozen=True)
class _Overflowing(voxel_rule._Rule):
    """The voxel rule's program, saying that its packed cells overflowed."""

    def __call__(self, inputs, checkpoint):
        out = super().__call__(inputs, checkpoint)
        return {**out, "overflow": torch.ones_like(out["overflow"])}


def _same_rule(local, options):
    opts = check("register_many", options)
    got = voxel_rule._voxel_sizes_many(local, opts)  # the device's path, on every device
    group = group_clouds([x for p in local for x in p])   # the same with the caller's group
    assert [str(r) if isinstance(r, ValueError) else r for r in
            voxel_rule._voxel_sizes_many(local, opts, group)] \
        == [str(r) if isinstance(r, ValueError) else r for r in got]
    # the edges' program and then the stray fractions apart (the path of a group whose
    # packed cells could overflow)
    with mock.patch.object(voxel_rule, "_Rule", _Overflowing):
        apart = voxel_rule._voxel_sizes_many(local, opts)
    assert [str(r) if isinstance(r, ValueError) else r for r in apart] \
        == [str(r) if isinstance(r, ValueError) else r for r in got]
    # the host looking after every round: the search goes on from the device's state
    with mock.patch("pointalign.features.downsample.FIRST_ROUNDS", 1):
        stepwise = voxel_rule._voxel_sizes_many(local, opts)
    assert [str(r) if isinstance(r, ValueError) else r for r in stepwise] \
        == [str(r) if isinstance(r, ValueError) else r for r in got]
    public = voxel_rule.voxel_sizes(local, opts)  # the host's per-cloud path in host memory
    for (s, t), g, h in zip(local, got, public, strict=True):
        try:
            want = voxel_rule.voxel_size_per_cloud(s, t, opts)
        except ValueError as exc:
            assert isinstance(g, ValueError) and str(g) == str(exc)
            assert isinstance(h, ValueError) and str(h) == str(exc)
            continue
        assert g == want and h == want  # v bit for bit, the same stray decision
    return got


def test_voxel_sizes_equal_the_per_pair_rule(backend):
    """The voxel rule's batched path: every pair's v (bit for bit) and stray decision as the
    rule one cloud at a time (voxel_size_per_cloud), on clean and contaminated bunny-size pairs
    of several sizes and scales; with a given voxel_size, without outlier removal, with
    another target."""
    bunny = datasets.load_bunny("bun000")
    pairs = _pairs(2, 2000) + _pairs(1, 800, seed=5)
    pairs += [datasets.make_hard_pair(datasets.random_subsample(bunny, n, seed=n),
                                      outlier_fraction=f, seed=n)
              for n, f in ((2000, 0.05), (3000, 0.2), (1500, 0.0))]
    pairs.append(datasets.load_bunny_pair())  # full scans: dense at v, no strays
    local = _local(pairs, backend.device)
    local = [(s * k, t * k) for (s, t), k in zip(local, (1.0, 1000.0, 0.01, 1.0, 30.0, 1.0, 1.0),
                                                    strict=True)]
    flat = torch.zeros(9, 3, device=backend.device)
    local.append((flat, flat + 0))  # every point coincides: auto_voxel_size's error
    got = _same_rule(local, {})
    _same_strays(local, got)
    assert any(g[1] for g in got if not isinstance(g, ValueError))  # strays were found
    assert not all(g[1] for g in got if not isinstance(g, ValueError))
    _same_rule(local[:-1], {"voxel_size": 0.004})
    _same_rule(local, {"remove_outliers": False, "target_points": 300})


def test_voxel_sizes_on_the_real_bunny_scans(shared_data):
    """The same rule on the Stanford scans (full size, and bunny-size subsamples)."""
    from pointalign import _validate, io

    d = shared_data / "stanford_bunny" / "data"
    names = ["bun000", "bun045", "bun090", "bun180", "bun270", "bun315"]
    scans = [_validate.as_points(io.read(d / f"{n}.ply"), "scan", dtype=torch.float32)
             for n in names if (d / f"{n}.ply").is_file()]
    if len(scans) < 2:
        pytest.skip("the Stanford bunny scans are not there")
    small = [datasets.random_subsample(x, 2000, seed=i) for i, x in enumerate(scans)]
    pairs = [datasets.Pair(a, b, np.eye(4)) for a, b in zip(scans[:-1], scans[1:], strict=True)]
    pairs += [datasets.Pair(a, b, np.eye(4)) for a, b in zip(small[:-1], small[1:], strict=True)]
    local = _local(pairs, "cpu")
    got = _same_rule(local, {})
    _same_strays(local, got)


def _same_strays(local, rules):
    """The batched without_strays equals the one-cloud-at-a-time rule for the pairs showing
    strays (also given the caller's group)."""

    dirty = [(p, r[0]) for p, r in zip(local, rules, strict=True)
             if not isinstance(r, ValueError) and r[1]]
    assert dirty  # bunny-size subsamples show strays at v
    got = voxel_rule._without_strays_many([p for p, _ in dirty], [v for _, v in dirty])
    group = group_clouds([x for p, _ in dirty for x in p])  # the same with the caller's group
    again = voxel_rule._without_strays_many([p for p, _ in dirty], [v for _, v in dirty], group)
    for ((s, t), v), (gs, gt), (hs, ht) in zip(dirty, got, again, strict=True):
        ws, wt = voxel_rule.without_strays_per_cloud(s, t, v)
        assert torch.equal(gs, ws) and torch.equal(gt, wt)
        assert torch.equal(hs, ws) and torch.equal(ht, wt)


@pytest.fixture(scope="module")
def both():
    pairs = _pairs()
    per_pair = register_many(pairs, device="cpu", **OPTS)
    old, bt.BATCHED = bt.BATCHED, True
    try:
        batched = register_many(pairs, device="cpu", **OPTS)
    finally:
        bt.BATCHED = old
    return pairs, per_pair, batched


def test_batched_registers_as_the_per_pair_path(both):
    pairs, per_pair, batched = both
    assert any(k.startswith("global.") for k in batched.timings)  # the stage's split
    assert not any(k.startswith("global.") for k in per_pair.timings)
    for p, a, b in zip(pairs, per_pair.rows, batched.rows, strict=True):
        assert b["error"] == "" and b["voxel_size"] == a["voxel_size"]
        assert b["verdict"] == a["verdict"] and b["trusted"] == a["trusted"]
        v = a["voxel_size"]
        rot, trans = metrics.relative_error(b["transformation"], a["transformation"])
        assert rot < 0.05 and trans < 0.05 * v
        rot, trans = metrics.relative_error(b["transformation"], p.T_target_source)
        assert rot < 0.5 and trans < 2e-3


def test_which_path_runs(monkeypatch):
    opts = check("register_many", dict(OPTS))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not bt.applies(opts, cpu, 8) and bt.applies(opts, cuda, 8)
    assert not bt.applies(opts, cuda, 1)  # nothing to batch
    assert not bt.applies(check("register_many", dict(inlier_ratio_threshold=0.1)), cuda, 8)
    monkeypatch.setattr(bt, "BATCHED", True)
    assert bt.applies(opts, cpu, 8)
    monkeypatch.setattr(bt, "BATCHED", False)
    assert not bt.applies(opts, cuda, 8)


def test_init_and_bad_pairs_beside_batched_ones(monkeypatch):
    """A pair with an init goes the per-pair way (no features), a bad pair gets its row's
    error, the others run batched; refine="none" rows come from the batched RANSAC."""
    monkeypatch.setattr(bt, "BATCHED", True)
    pairs = _pairs(3, seed=20)
    specs = [(pairs[0].source, pairs[0].target),
             (pairs[1].source, pairs[1].target, pairs[1].T_target_source),
             (np.zeros((2, 3)), pairs[2].target),
             (pairs[2].source, pairs[2].target)]
    res = register_many(specs, device="cpu", on_error="record", **OPTS)
    assert [r["error"] != "" for r in res.rows] == [False, False, True, False]
    assert res[1].get("global_stages") is None and res[0]["global_stages"]
    for i in (0, 1, 3):
        rot, trans = metrics.relative_error(res[i]["transformation"],
                                            pairs[min(i, 2)].T_target_source)
        assert rot < 0.5 and trans < 2e-3
    none = register_many([pairs[0], pairs[2]], device="cpu", refine="none", **OPTS)
    for r in none.rows:
        assert r["verdict"] == "global only" and np.isfinite(r["transformation"]).all()


# ---------------------------------------------------------------------------- local stages

def _scaled_pairs(pairs, device, clock):
    """Each pair's clouds in register_many's frame (about the target's centroid, divided
    by v), prepared as per pair, and candidates about the true pose (a few perturbed, a
    few far off) in that frame."""
    from pointalign import transforms

    opts = check("register_many", {})
    out = []
    for k, (p, (s, t)) in enumerate(zip(pairs, _local(pairs, device), strict=True)):
        v, strays = voxel_rule.voxel_size_per_cloud(s, t, opts)
        if strays:
            s, t = voxel_rule.without_strays_per_cloud(s, t, v)
        unit = Scales(1.0)
        src, tgt = (prepare_cloud(x / v, unit, clock, "cloud") for x in (s, t))
        c = np.asarray(p.target, dtype=np.float64).mean(0)
        T = np.asarray(p.T_target_source, dtype=np.float64)
        ts = (T[:3, 3] - c + T[:3, :3] @ c) / v
        cands = []
        rng = np.random.default_rng(k)
        for j in range(7):
            deg = [0.5, 2.0, 3.0, 40.0, 90.0, 170.0, 1.0][j]
            turn = transforms.axis_angle_to_matrix(torch.tensor(rng.normal(size=3)),
                                                   np.radians(deg)).numpy()
            M = np.eye(4)
            M[:3, :3] = turn @ T[:3, :3]
            M[:3, 3] = ts + rng.normal(size=3) * [0.2, 0.5, 1.0, 5.0, 3.0, 1.0, 0.0][j]
            cands.append(M)
        out.append((torch.tensor(np.stack(cands), device=device), src, tgt))
    return out


def test_refine_many_as_each_pair_alone(backend):
    """refine_many: the coarse stage's counts through one packed index equal count_inliers
    with each pair's own index (the bound: a point within the lattice's rounding of a bound
    may count differently; none on these pairs), so the same hypotheses go to one ICP call
    as in _refine_hypotheses. That call searches an index it builds (a packed one on a
    device) where _refine_hypotheses searches each pair's own: the distances come from
    other arithmetic, so the refined motions agree to float32 rounding (1e-5 of a voxel
    and of a radian), the overlap counts and iterations to a point lying on a bound."""
    from pointalign.registration.pipeline import REFINE_TOP, _refine_hypotheses, icp_criteria
    from pointalign.registration.ransac import count_inliers

    dev = torch.device(backend.device)
    clock = _loop.Clock(dev)
    pairs = _pairs(3, 2000) + [datasets.make_hard_pair(datasets.random_subsample(
        datasets.load_bunny("bun000"), 2000, seed=4), outlier_fraction=0.05, seed=4)]
    problems = _scaled_pairs(pairs, backend.device, clock)
    unit = Scales(1.0)
    S, n_src = bt._pad([s.down for _, s, _ in problems])
    Tg, _ = bt._pad([t.down for _, _, t in problems])
    index = bt._packed(Tg, [int(t.down.shape[0]) for _, _, t in problems], 1.5)
    for b, (c, s, t) in enumerate(problems):
        prob = torch.full((c.shape[0],), b, dtype=torch.int64, device=dev)
        for d in (unit.correspondence, unit.overlap):
            got, _, _ = bt._score(c, prob, S, n_src, index, d)
            assert torch.equal(got, count_inliers(c, s.down, t.index, d))
    crit = icp_criteria(unit, 30)
    for robust in (True, False):
        want = _refine_hypotheses(problems, unit, crit, robust, clock)
        got = bl.refine_many(problems, unit, crit, robust, clock)
        for (R, f, i), (R1, f1, i1) in zip(got, want, strict=True):
            assert R.shape[0] == (REFINE_TOP if robust else 1)
            torch.testing.assert_close(R, R1, rtol=0, atol=1e-5)
            assert (f - f1).abs().max() <= 2 and abs(i - i1) <= 1


def test_final_clouds_as_each_pair_alone(backend):
    """final_clouds_many: the scaled clouds bit for bit, each target's own index, the
    normals as estimate_normals' (the same neighbour rows wherever the packed search finds
    them: dot > 1 - 1e-5 on at least 99.9 % of the rows; a row whose neighbour lies on the
    radius within the lattice's rounding may move more); a target holding duplicated
    points goes alone (bit for bit); GICP gets no normals."""
    from pointalign.registration.pipeline import _final_clouds

    pairs = _local(_pairs(3, 2000), backend.device)
    s0, t0 = pairs[0]
    pairs.append((s0, torch.cat([t0, t0[:50]])))  # duplicated points
    opts = check("register_many", {})
    vs = [voxel_rule.voxel_size_per_cloud(s, t, opts)[0] for s, t in pairs]
    unit = Scales(1.0)
    got = bl.final_clouds_many([s for s, _ in pairs], [t for _, t in pairs], vs, unit,
                               "point_to_plane")
    for (s, t), v, g in zip(pairs, vs, got, strict=True):
        one = _final_clouds(s / v, t / v, unit, None)
        assert torch.equal(g.source, one.source) and torch.equal(g.target, one.target)
        assert g.index.points.shape == one.index.points.shape
        dot = (g.normals * one.normals).sum(1)
        assert float((dot > 1 - 1e-5).float().mean()) >= 0.999
    assert torch.equal(got[-1].normals, _final_clouds(s0 / vs[-1], pairs[-1][1] / vs[-1],
                                                      unit, None).normals)
    gicp = bl.final_clouds_many([s0], [t0], vs[:1], unit, "gicp")
    assert gicp[0].normals is None


def test_local_stages_batched_register_as_per_pair(monkeypatch):
    """register_many with the local stages batched (forced on the CPU) gives the per-pair
    local stages' rows on the same global results, and the local split in its timings."""
    pairs = _pairs(3, 1000, seed=30)
    monkeypatch.setattr(bt, "BATCHED", True)
    a = register_many(pairs, device="cpu", **OPTS)
    monkeypatch.setattr(bt, "batched_local", lambda device: False)
    b = register_many(pairs, device="cpu", **OPTS)
    for ra, rb in zip(a.rows, b.rows, strict=True):
        assert ra["verdict"] == rb["verdict"]
        np.testing.assert_allclose(ra["transformation"], rb["transformation"], atol=1e-6)
    for key in ("local.coarse_rank", "local.coarse_icp", "local.final_clouds",
                "local.final_icp", "local.verdict", "read.prepare"):
        assert key in a.timings, key
    assert "local.coarse" in b.timings
    assert local_stages._LOCAL_NAMES["icp"] == "final_icp"


def test_verdicts_many_as_each_pair_alone(backend):
    """verdicts_many: the numbers and verdicts of verdict.verdicts (the same counts through
    the packed index; none near a bound on these pairs), for good and wrong poses."""
    from pointalign.registration.pipeline import _refine_hypotheses, icp_criteria
    from pointalign.registration.verdict import verdicts

    dev = torch.device(backend.device)
    clock = _loop.Clock(dev)
    problems = _scaled_pairs(_pairs(3, 1500, seed=40), backend.device, clock)
    unit = Scales(1.0)
    refined = _refine_hypotheses(problems, unit, icp_criteria(unit, 30), True, clock)
    hyps, fits = [R for R, _, _ in refined], [f for _, f, _ in refined]
    for pick in (0, -1):  # the best, and the worst refined hypothesis as the final pose
        T = torch.stack([R[pick] for R in hyps])
        stab = np.array([1.0, 0.0, 0.5])
        args = (T, stab, hyps, fits, [s for _, s, _ in problems], [t for _, _, t in problems],
                unit)
        assert bl.verdicts_many(*args) == verdicts(*args)
