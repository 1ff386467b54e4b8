"""register_many on one device: the same poses and verdicts as register() pair by pair,
pairs with an init, inputs as paths/dicts/PairSpec, the table's forms, chunking, the
batched verdict against register's, bad input.

Tolerances: register_many registers each pair in its target's frame scaled by 1/v (one
bound for a whole batch) where register() works unscaled, so the float32 coordinates
round differently; poses agree to well under the ICP's own settling (updates below
0.01° and 0.001 v): 0.05° and 0.05 v.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointalign import datasets, io, metrics
from pointalign.cloud import PointCloud
from pointalign.registration import many as many_module
from pointalign.registration.many import ManyResult, PairSpec, chunk, register_many, table
from pointalign.registration.pipeline import register

#: small clouds and few hypotheses: CI time
OPTS = dict(hypotheses=1024)


def _pairs(seed: int, k: int = 3, n: int = 500):
    bunny = datasets.load_bunny("bun000")
    return [datasets.make_pair(datasets.random_subsample(bunny, n, seed=seed * 10 + s),
                               12.0, 0.01, noise=3e-4, seed=seed * 10 + s) for s in range(k)]


@pytest.fixture(scope="module")
def batch():
    pairs = _pairs(0)
    return pairs, register_many(pairs, device="cpu", **OPTS)


def test_matches_register_pair_by_pair(batch):
    pairs, res = batch
    assert isinstance(res, ManyResult) and len(res) == len(pairs)
    for i, p in enumerate(pairs):
        row = res[i]
        one = register(p.source, p.target, device="cpu", **OPTS)
        assert row["index"] == i
        v = one.info["voxel_size"]
        assert row["voxel_size"] == pytest.approx(v, rel=1e-12)
        rot, trans = metrics.relative_error(row["transformation"], one.transformation)
        assert rot < 0.05 and trans < 0.05 * v
        assert row["trusted"] == one.converged and row["verdict"] == one.info["verdict"]
        assert row["stop_reason"] == one.stop_reason  # the verdict's, as register's
        assert row["fitness"] == pytest.approx(one.fitness, abs=0.02)
        rot, trans = metrics.relative_error(row["transformation"], p.T_target_source)
        assert rot < 0.5 and trans < 2e-3
        assert row["info"]["H"].shape == (6, 6)
        assert np.allclose(row["info"]["H"], row["info"]["H"].T)


def test_gicp_and_distance_overrides_agree_with_register():
    """refine="gicp" and the two distance overrides (metres) reach every pair as they reach
    register(): pairs whose overrides differ in voxels run in separate batches."""
    pairs = _pairs(7, k=2)
    kw = dict(OPTS, refine="gicp", max_correspondence_distance=0.018,
              icp_max_correspondence_distance=0.007)
    res = register_many(pairs, device="cpu", **kw)
    for i, p in enumerate(pairs):
        row, one = res[i], register(p.source, p.target, device="cpu", **kw)
        v = one.info["voxel_size"]
        assert row["voxel_size"] == pytest.approx(v, rel=1e-12)
        rot, trans = metrics.relative_error(row["transformation"], one.transformation)
        assert rot < 0.05 and trans < 0.05 * v
        assert row["trusted"] == one.converged and row["verdict"] == one.info["verdict"]
        assert row["stop_reason"] == one.stop_reason
        rot, trans = metrics.relative_error(row["transformation"], p.T_target_source)
        assert rot < 0.5 and trans < 2e-3


def test_table_forms(batch, tmp_path):
    _, res = batch
    rows = res.to_rows()
    assert list(rows[0]) == list(many_module.COLUMNS)
    T = np.array([[r[f"T{i}{j}"] for i in range(4) for j in range(4)] for r in rows])
    np.testing.assert_array_equal(T.reshape(-1, 4, 4), res.transformations)
    path = res.to_csv(tmp_path / "t.csv")
    import csv

    with path.open() as f:
        back = list(csv.DictReader(f))
    assert len(back) == len(res) and float(back[1]["T03"]) == rows[1]["T03"]
    pytest.importorskip("pyarrow")
    pq = res.to_parquet(tmp_path / "t.parquet")
    import pyarrow.parquet as pqm

    tab = pqm.read_table(pq)
    assert tab.num_rows == len(res) and tab.column("T23").to_pylist() == [r["T23"] for r in rows]


def test_chunks_are_independent(batch):
    """Chunk by chunk: a pair's row is the same whether its chunk holds 1 or 3 pairs, within
    the batched ICP's padding (another reduction length: rounding only)."""
    pairs, res = batch
    one = register_many(pairs[:2], device="cpu", chunk_size=1, **OPTS)
    for i in range(2):
        rot, trans = metrics.relative_error(one[i]["transformation"], res[i]["transformation"])
        assert rot < 0.01 and trans < 1e-5
        assert one[i]["verdict"] == res[i]["verdict"]
    again = register_many(pairs[:2], device="cpu", chunk_size=1, **OPTS)
    np.testing.assert_array_equal(again.transformations, one.transformations)


def test_small_pairs_run_on_one_cpu_thread(batch, monkeypatch):
    """On the CPU a pair of at most SERIAL_POINTS points runs its stages on one thread (the
    pairs parallelise across workers); larger pairs keep the caller's count. The rows agree
    either way within the registrations' settling (another thread count may group a
    reduction differently: rounding only)."""
    from pointalign import _threads

    pairs, res = batch
    seen: list[int] = []
    stage = chunk._global_stage

    def spy(*a, **k):
        seen.append(_threads.get_num_threads())
        return stage(*a, **k)

    monkeypatch.setattr(chunk, "_global_stage", spy)
    with _threads.threads(2):
        register_many(pairs[:1], device="cpu", **OPTS)
        assert seen == [1]
        monkeypatch.setattr(chunk, "SERIAL_POINTS", 10)
        big = register_many(pairs[:1], device="cpu", **OPTS)
        assert seen == [1, 2]
    rot, trans = metrics.relative_error(big[0]["transformation"], res[0]["transformation"])
    assert rot < 0.01 and trans < 1e-5 and big[0]["verdict"] == res[0]["verdict"]


def test_init_skips_global_stage():
    pairs = _pairs(1, k=2)
    g = torch.Generator().manual_seed(5)
    from pointalign import transforms

    inits = [transforms.random_transform(3.0, 0.003, generator=g) @ p.T_target_source
             for p in pairs]
    res = register_many([(p.source, p.target, T) for p, T in zip(pairs, inits, strict=True)],
                        device="cpu")
    for i, p in enumerate(pairs):
        rot, trans = metrics.relative_error(res[i]["transformation"], p.T_target_source)
        assert rot < 0.5 and trans < 2e-3
        assert res[i]["trusted"], res[i]["verdict"]
        assert res[i]["margin"] == 0.0  # one hypothesis: no different one to compete


def test_paths_dicts_and_errors(tmp_path):
    p = _pairs(2, k=1)[0]
    src, tgt = tmp_path / "s.ply", tmp_path / "t.ply"
    io.write(src, PointCloud(p.source))
    io.write(tgt, PointCloud(p.target))
    specs = [(str(src), str(tgt)),
             {"source": PointCloud(p.source), "target": p.target.numpy(), "name": "mixed"},
             PairSpec(src, tmp_path / "missing.ply")]
    with pytest.raises((ValueError, OSError), match="pairs\\[2\\]|missing"):
        register_many(specs, device="cpu", **OPTS)
    res = register_many(specs, device="cpu", on_error="record", **OPTS)
    assert res[0]["name"] == "s.ply->t.ply" and res[1]["name"] == "mixed"
    np.testing.assert_allclose(res[0]["transformation"], res[1]["transformation"], atol=1e-5)
    assert res[2]["error"] and res[2]["verdict"] == "error"
    assert np.isnan(res[2]["transformation"]).all() and not res[2]["trusted"]
    assert res[0]["error"] == "" and res[0]["trusted"]


def test_bad_input():
    p = _pairs(0, k=1)[0]
    with pytest.raises(TypeError, match="pairs"):
        register_many("a.csv")
    with pytest.raises(TypeError, match="pairs\\[0\\]"):
        register_many([p.source])
    with pytest.raises(ValueError, match="pairs\\[0\\]"):
        register_many([{"source": p.source}])
    with pytest.raises(ValueError, match="method"), pytest.warns(DeprecationWarning):
        register_many([(p.source, p.target)], method="bogus")
    with pytest.raises(ValueError, match="refine"):
        register_many([(p.source, p.target)], refine="bogus")
    with pytest.raises(TypeError, match=r"^register_many\(\) got an unexpected keyword"):
        register_many([(p.source, p.target)], foo=1)
    with pytest.raises(ValueError, match="chunk_size"):
        register_many([(p.source, p.target)], chunk_size=0)
    with pytest.raises(ValueError, match="on_error"):
        register_many([(p.source, p.target)], on_error="ignore")
    with pytest.raises(ValueError, match="init"):
        register_many([(p.source, p.target, np.eye(3))])
    with pytest.raises(ValueError, match="device"):
        register_many([(p.source, p.target)], client=object(), device="cpu")
    with pytest.raises(ValueError, match="pairs\\[0\\].*source"):
        register_many([(p.source[:2], p.target)], device="cpu")
    assert len(register_many([], device="cpu")) == 0


def test_batched_verdicts_equal_register_verdict(seed):
    """verdicts() of a batch equals verdict() (register's) pair by pair: the same searches
    and counts (integers); the margin test compares float64 distances and angles computed
    alike."""
    from types import SimpleNamespace

    from pointalign import transforms
    from pointalign.registration.pipeline import Scales
    from pointalign.registration.prepare import Prepared
    from pointalign.registration.verdict import verdict, verdicts
    from pointalign.search import build_index

    g = torch.Generator().manual_seed(seed)
    bunny = datasets.load_bunny("bun000")
    Ts, Rs, Fs, Ss, Ts_, stab = [], [], [], [], [], np.array([0.1, 0.005, 0.2])
    for b, n in enumerate((300, 420, 377)):
        s = datasets.random_subsample(bunny, n, seed=seed + b) / 0.004
        t = datasets.random_subsample(bunny, n + 50, seed=seed + 7 + b) / 0.004
        Ss.append(Prepared(s, None, s[:0], s.new_zeros(0, 33)))
        Ts_.append(Prepared(t, build_index(t), t[:0], t.new_zeros(0, 33)))
        k = 2 + b
        R = torch.stack([transforms.random_transform(4.0 * j, 2.0 * j, generator=g)
                         for j in range(k)])
        Rs.append(R)
        Fs.append(torch.sort(torch.randint(0, n, (k,), generator=g), descending=True).values)
        Ts.append(R[0] if b != 1 else transforms.random_transform(1.0, 0.5, generator=g))
    scales = Scales(1.0)
    got = verdicts(torch.stack(Ts), stab, Rs, Fs, Ss, Ts_, scales)
    for b in range(3):
        local = SimpleNamespace(transformation_tensor=Ts[b], info={"stability": stab[b]})
        ref = verdict(local, Rs[b], Fs[b], Ss[b], Ts_[b], scales)
        assert got[b][1] == ref[1], b
        for key in ("overlap", "margin", "concentration", "trusted", "verdict"):
            assert got[b][0][key] == ref[0][key], (b, key)
    assert "pose not determined" in got[1][0]["verdict"]


def test_method_none_rows():
    pairs = _pairs(3, k=2)
    res = register_many(pairs, device="cpu", refine="none", **OPTS)
    for i, p in enumerate(pairs):
        rot, _ = metrics.relative_error(res[i]["transformation"], p.T_target_source)
        assert rot < 5.0 and math.isfinite(res[i]["rmse"])


# ---- the command line (pointalign.cli_many, registered on pointalign.cli's app) -------

def _app():
    pytest.importorskip("typer")
    from typer.testing import CliRunner

    from pointalign import cli

    return cli.app, CliRunner()


def _pairs_csv(tmp_path, pairs, with_init=True):
    import csv

    with (tmp_path / "pairs.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["source", "target", "name"] + ([f"T{r}{c}" for r in range(4)
                                                    for c in range(4)] if with_init else []))
        for k, p in enumerate(pairs):
            io.write(tmp_path / f"s{k}.ply", PointCloud(p.source))
            io.write(tmp_path / f"t{k}.ply", PointCloud(p.target))
            w.writerow([f"s{k}.ply", f"t{k}.ply", f"pair{k}"]
                       + (p.T_target_source.reshape(-1).tolist() if with_init else []))
    return tmp_path / "pairs.csv"


def _read_table(path):
    import csv

    with path.open() as f:
        rows = list(csv.DictReader(f))
    Ts = [np.array([float(row[f"T{i}{j}"]) for i in range(4) for j in range(4)]).reshape(4, 4)
          for row in rows]
    return rows, Ts


def test_cli_register_many(tmp_path):
    app, runner = _app()
    pairs = _pairs(4, k=2)
    csv_path = _pairs_csv(tmp_path, pairs)
    out = tmp_path / "out.csv"
    r = runner.invoke(app, ["register-many", str(csv_path), "-o", str(out),
                            "--device", "cpu", "--quiet"])
    assert r.exit_code == 0, r.output
    assert r.stdout == ""  # -q (the program's option, after the command): nothing printed
    rows, Ts = _read_table(out)
    assert [row["name"] for row in rows] == ["pair0", "pair1"]
    for T, p in zip(Ts, pairs, strict=True):
        rot, trans = metrics.relative_error(T, p.T_target_source)
        assert rot < 0.5 and trans < 2e-3
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    r = runner.invoke(app, ["register-many", str(bad), "-o", str(out)])
    assert r.exit_code == 1 and "source" in r.output
    r = runner.invoke(app, ["register-many", str(csv_path), "-o", str(tmp_path / "t.txt")])
    assert r.exit_code == 2 and "unknown suffix" in r.output  # a usage error, before work


def test_cli_register_many_options_and_config(tmp_path, monkeypatch):
    """The shared options reach register_many as register's keywords (unset ones keep its
    defaults); --config fills them from a [register-many] table; the command line wins."""
    from pointalign.registration import many

    app, runner = _app()
    csv_path = _pairs_csv(tmp_path, _pairs(6, k=1), with_init=False)
    seen = {}

    def fake(specs, **kw):
        seen.update(kw, n=len(specs))
        return ManyResult([{**table._empty_row(0, "x"), "trusted": True,
                            "transformation": np.eye(4)}], {"total": 0.1})

    monkeypatch.setattr(many, "register_many", fake)
    cfg = tmp_path / "run.toml"
    cfg.write_text('[register-many]\nrefine = "gicp"\nhypotheses = 99\nseed = 3\n'
                   'device = "cpu"\n')
    r = runner.invoke(app, ["register-many", str(csv_path), "-o", str(tmp_path / "o.csv"),
                            "--config", str(cfg), "--seed", "4", "--voxel-size", "0.005"])
    assert r.exit_code == 0, r.output
    assert seen["refine"] == "gicp" and seen["hypotheses"] == 99 and seen["seed"] == 4
    assert seen["voxel_size"] == 0.005 and seen["device"] == "cpu" and seen["n"] == 1
    assert "max_iterations" not in seen  # not given: register's default
    cfg.write_text('[register-many]\nquiet_please = true\n')
    r = runner.invoke(app, ["register-many", str(csv_path), "--config", str(cfg)])
    assert r.exit_code == 2 and "quiet_please" in r.output


def test_cli_commands_are_registered_on_the_app_with_the_program_options():
    import typer

    from pointalign import cli, cli_many

    group = typer.main.get_command(cli.app)
    for name in ("register-many", "multiway"):
        assert name in group.commands
        assert not {"quiet", "verbose", "config"} & {p.name for p in group.commands[name].params}
    fresh = typer.Typer()
    cli_many.register_commands(fresh)
    assert {c.name for c in fresh.registered_commands} == {"register-many", "multiway"}


def test_cli_multiway(tmp_path):
    import json

    app, runner = _app()
    p = _pairs(5, k=1, n=600)[0]
    paths = [tmp_path / "a.ply", tmp_path / "b.ply"]
    io.write(paths[0], PointCloud(p.target))
    io.write(paths[1], PointCloud(p.source))
    r = runner.invoke(app, ["multiway", *map(str, paths), "--output", str(tmp_path / "m.ply"),
                            "--json", str(tmp_path / "poses.json"), "--device", "cpu",
                            "--hypotheses", "1024", "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "poses.json").read_text())
    rot, trans = metrics.relative_error(np.array(doc["poses"][1]), p.T_target_source)
    assert rot < 0.5 and trans < 2e-3
    assert doc["command"] == "multiway" and len(doc["edges"]) == 1
    assert io.read(tmp_path / "m.ply").points.shape[0] == 1200


@pytest.mark.gpu
def test_cuda_register_many_matches_cpu(batch):
    """On CUDA (Triton kernels, another RANSAC generator): the same poses within the
    registrations' own accuracy (0.1°, 0.1 v) and every pair trusted."""
    pairs, cpu = batch
    res = register_many(pairs, device="cuda", **OPTS)
    for i, p in enumerate(pairs):
        rot, trans = metrics.relative_error(res[i]["transformation"], cpu[i]["transformation"])
        assert rot < 0.1 and trans < 0.1 * cpu[i]["voxel_size"]
        rot, trans = metrics.relative_error(res[i]["transformation"], p.T_target_source)
        assert rot < 0.5 and trans < 2e-3 and res[i]["trusted"], res[i]["verdict"]
