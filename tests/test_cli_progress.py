"""CLI: many files (batch), the quick benchmark, and what --quiet silences."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from pointalign import cli, cli_bench, datasets, io, metrics

runner = CliRunner()
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _files(tmp_path, n=300, count=2):
    bunny = datasets.random_subsample(datasets.load_bunny("bun000"), n, seed=0)
    pairs, paths = [], []
    for i in range(count):
        pair = datasets.make_pair(bunny, rotation_deg=4.0, translation=0.004, seed=i + 1)
        io.write(tmp_path / f"s{i}.ply", pair.source)
        pairs.append(pair)
        paths.append(str(tmp_path / f"s{i}.ply"))
    io.write(tmp_path / "t.ply", pairs[0].target)
    return pairs, paths, str(tmp_path / "t.ply")


def test_batch_aligns_every_file_and_writes_one_json(tmp_path):
    pairs, paths, tgt = _files(tmp_path)
    js = tmp_path / "all.json"
    res = runner.invoke(cli.app, ["batch", *paths, "--target", tgt, "--method", "icp",
                                  "--device", "cpu", "--max-distance", "0.02", "--seed", "3",
                                  "--json", str(js)])
    assert res.exit_code == 0, res.output
    assert "--seed is ignored by method icp" in res.output
    assert res.output.count("s0.ply") == 1 and res.output.count("s1.ply") == 1
    doc = json.loads(js.read_text())
    assert [r["inputs"]["source"]["path"] for r in doc["results"]] == paths
    # every source is a moved copy of the same bunny subset: each result maps it back
    truth = pairs[0].T_target_source.numpy()
    for r, pair in zip(doc["results"], pairs, strict=True):
        T = np.array(r["transformation"]) @ np.linalg.inv(pair.T_target_source.numpy()) @ truth
        rot, trans = metrics.relative_error(T, truth)
        assert rot < 0.5 and trans < 1e-3
    # --quiet: no warning line; an unreadable file: its row says why, exit 1
    (tmp_path / "bad.ply").write_text("not a ply\n")
    res = runner.invoke(cli.app, ["batch", str(tmp_path / "bad.ply"), "--target", tgt,
                                  "--method", "icp", "--device", "cpu", "--seed", "3", "-q"])
    assert res.exit_code == 1, res.output
    assert "ignored" not in res.output and "failed" in res.output and "bad.ply" in res.output


def test_bench_quick_runs_the_quick_suite_and_prints_its_table(tmp_path, monkeypatch):
    monkeypatch.setattr(cli_bench, "_find_benchmarks", lambda: BENCHMARKS)
    # tiny sizes, no peer library: the whole run is a few seconds of CPU
    monkeypatch.setenv("POINTALIGN_BENCH_SCALE", "0.01")
    monkeypatch.setenv("POINTALIGN_BENCH_STEPS", "knn")
    monkeypatch.setenv("POINTALIGN_OPEN3D", "0")
    res = runner.invoke(cli.app, ["bench", "--quick", "--device", "cpu",
                                  "--results", str(tmp_path)])
    assert res.exit_code == 0, res.output
    words = res.output.split()  # the table wraps at the runner's 80 columns
    assert "quick:" in words and "k-NN" in words and "k=1," in words and "cKDTree" in words
    assert "see its table above" in " ".join(words)
    saved = json.loads((tmp_path / "quick-cpu.json").read_text())
    assert len(saved["rows"]) == 2 and all(r["pointalign_ms"] > 0 for r in saved["rows"])
    assert all(r["check"].startswith("max diff") and float(r["check"].split()[-1]) < 1e-4
               for r in saved["rows"])
    assert os.environ.get("POINTALIGN_BENCH_RESULTS") is None  # the child's, not ours


def test_library_warnings_are_one_short_line_in_the_cli(capsys):
    import warnings

    from pointalign import _progress

    with warnings.catch_warnings():  # restores warnings.showwarning afterwards
        warnings.simplefilter("always")
        cli._verbosity(0, False)
        cli._verbosity(1, False)  # installed once
        _progress.warn("register: the result is doubtful (weak margin)",
                       _progress.DoubtfulResultWarning)
    err = capsys.readouterr().err
    assert "warning: register: the result is doubtful (weak margin)" in err
    assert "DoubtfulResultWarning" not in err and err.count("doubtful") == 1
    _progress.configure_logging(0)
