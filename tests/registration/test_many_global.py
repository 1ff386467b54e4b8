"""register_many's batched global stage (registration/many_global.py) against the per-pair one.

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

import numpy as np
import pytest
import torch

from pointalign import datasets, metrics
from pointalign.features.downsample import voxel_downsample
from pointalign.kernels import _loop
from pointalign.registration import many_global as mg
from pointalign.registration.many import register_many
from pointalign.registration.options import check
from pointalign.registration.pipeline import Scales, _prepare_cloud, _voxel_size

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
        v, _ = _voxel_size(s, t, opts, None)
        out += [s / v, t / v]
    return out


def test_described_as_each_cloud_alone(backend):
    clouds = _scaled_clouds(_pairs(3, 2000), backend.device)
    unit = Scales(1.0)
    downs, sizes = mg.prepare_many(clouds, unit, _loop.Clock(torch.device(backend.device)))
    normals, features = mg.describe_many(downs, unit)
    clock = _loop.Clock(torch.device(backend.device))
    for c, d, n, f in zip(clouds, downs, normals, features, strict=True):
        assert torch.equal(d, voxel_downsample(c, 1.0))
        one = _prepare_cloud(c, unit, clock, "cloud")
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


def _same_rule(local, options):
    opts = check("register_many", options)
    got = mg.voxel_sizes(local, opts)
    for (s, t), g in zip(local, got, strict=True):
        try:
            want = _voxel_size(s, t, opts, None)
        except ValueError as exc:
            assert isinstance(g, ValueError) and str(g) == str(exc)
            continue
        assert g == want  # v bit for bit, the same stray decision
    return got


def test_voxel_sizes_equal_the_per_pair_rule(backend):
    """mg.voxel_sizes: every pair's v (bit for bit) and stray decision as
    pipeline._voxel_size, on clean and contaminated bunny-size pairs of several sizes and
    scales; with a given voxel_size, without outlier removal, with another target."""
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
    _same_rule(_local(pairs, "cpu"), {})


@pytest.fixture(scope="module")
def both():
    pairs = _pairs()
    per_pair = register_many(pairs, device="cpu", **OPTS)
    old, mg.BATCHED = mg.BATCHED, True
    try:
        batched = register_many(pairs, device="cpu", **OPTS)
    finally:
        mg.BATCHED = old
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
    assert not mg.applies(opts, cpu, 8) and mg.applies(opts, cuda, 8)
    assert not mg.applies(opts, cuda, 1)  # nothing to batch
    assert not mg.applies(check("register_many", dict(inlier_ratio_threshold=0.1)), cuda, 8)
    monkeypatch.setattr(mg, "BATCHED", True)
    assert mg.applies(opts, cpu, 8)
    monkeypatch.setattr(mg, "BATCHED", False)
    assert not mg.applies(opts, cuda, 8)


def test_init_and_bad_pairs_beside_batched_ones(monkeypatch):
    """A pair with an init goes the per-pair way (no features), a bad pair gets its row's
    error, the others run batched; refine="none" rows come from the batched RANSAC."""
    monkeypatch.setattr(mg, "BATCHED", True)
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
