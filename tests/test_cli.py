import json
import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from pointalign import cli, datasets, io, metrics, transforms

runner = CliRunner()


def test_info_lists_backends_and_methods():
    res = runner.invoke(cli.app, ["info"])
    assert res.exit_code == 0, res.output
    assert "kernel backend (cpu)" in res.output and "method icp" in res.output


def _pair_files(tmp_path, n=3000):
    bunny = datasets.random_subsample(datasets.load_bunny("bun000"), n, seed=0)
    pair = datasets.make_pair(bunny, rotation_deg=5.0, translation=0.005, seed=1)
    src, tgt = tmp_path / "src.ply", tmp_path / "tgt.pcd"
    io.write(src, pair.source)
    io.write(tgt, pair.target)
    return pair, src, tgt


def test_register_icp_writes_outputs(tmp_path):
    pair, src, tgt = _pair_files(tmp_path)
    out, js = tmp_path / "aligned.ply", tmp_path / "r.json"
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--method", "icp",
                                  "--device", "cpu", "--max-distance", "0.02",
                                  "--output", str(out), "--json", str(js)])
    assert res.exit_code == 0, res.output
    doc = json.loads(js.read_text())
    T = np.array(doc["transformation"])
    rot, trans = metrics.relative_error(T, pair.T_target_source)
    assert rot < 0.5 and trans < 1e-3
    aligned = io.read(out)
    moved = transforms.apply(torch.as_tensor(T), pair.source.double())
    assert torch.allclose(aligned.points.double(), moved, atol=1e-5)


def test_register_with_init_file(tmp_path):
    pair, src, tgt = _pair_files(tmp_path)
    init = tmp_path / "init.txt"
    np.savetxt(init, pair.T_target_source.numpy())
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--method", "icp-plane",
                                  "--device", "cpu", "--init", str(init),
                                  "--max-distance", "0.005"])
    assert res.exit_code == 0, res.output


def test_register_reports_bad_files_and_methods(tmp_path):
    bad = tmp_path / "broken.ply"
    bad.write_bytes(b"ply\nformat nonsense\n")
    good = tmp_path / "ok.xyz"
    np.savetxt(good, np.random.default_rng(0).normal(size=(10, 3)))
    res = runner.invoke(cli.app, ["register", str(bad), str(good)])
    assert res.exit_code == 1 and "broken.ply" in res.output
    res = runner.invoke(cli.app, ["register", str(good), str(good), "--method", "magic"])
    assert res.exit_code != 0 and "magic" in res.output
    assert res.exit_code == 2


def _small_pair(tmp_path, n=800):
    bunny = datasets.random_subsample(datasets.load_bunny("bun000"), n, seed=0)
    pair = datasets.make_pair(bunny, rotation_deg=5.0, translation=0.005, seed=1)
    src, tgt = tmp_path / "s.ply", tmp_path / "t.pcd"
    io.write(src, pair.source)
    io.write(tgt, pair.target)
    return pair, src, tgt


def test_version_and_plain_help():
    import pointalign

    res = runner.invoke(cli.app, ["--version"])
    assert res.exit_code == 0 and pointalign.__version__ in res.output
    res = runner.invoke(cli.app, ["register", "--help"])
    assert res.exit_code == 0
    assert "<bool>" not in res.output and "{source}" not in res.output
    assert "global|icp|icp-plane" in res.output and "auto|cpu|cuda" in res.output
    for opt in ("--max-iterations", "--seed", "--config", "--verbose", "--quiet", "--plot",
                "--html", "--allow-failure", "--bin-columns"):
        assert opt in res.output


def test_demo_unknown_method_fails_before_loading(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("data loaded before the option check")

    monkeypatch.setattr(datasets, "load_bunny_pair", boom)
    res = runner.invoke(cli.app, ["demo", "--method", "nosuch"])
    assert res.exit_code == 2 and "nosuch" in res.output


@pytest.mark.parametrize("args, words", [
    (["--output", "{tmp}/missing/a.ply"], "does not exist"),
    (["--output", "{tmp}/a.foo"], "unknown suffix"),
    (["--json", "{tmp}/nodir/r.json"], "does not exist"),
    (["--plot", "{tmp}/p.gif"], "unknown suffix"),
    (["--html", "{tmp}/v.txt"], "unknown suffix"),
    (["--device", "tpu"], "tpu"),
    (["--max-distance", "-1"], "> 0"),
    (["--max-iterations", "0"], "--max-iterations"),
    (["-v", "-q"], "exclude"),
])
def test_usage_errors_exit_2_before_any_work(tmp_path, monkeypatch, args, words):
    _, src, tgt = _small_pair(tmp_path, 50)

    def boom(*a, **k):
        raise AssertionError("work started before the option check")

    monkeypatch.setattr(io, "read", boom)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), *args])
    assert res.exit_code == 2, res.output
    assert words in res.output and "Traceback" not in res.output


def test_cuda_without_gpu_is_a_usage_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    _, src, tgt = _small_pair(tmp_path, 50)
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--device", "cuda"])
    assert res.exit_code == 2 and "no CUDA device" in res.output


def test_json_holds_inputs_parameters_device_version(tmp_path):
    import pointalign
    from pointalign.registration.result import RegistrationResult

    pair, src, tgt = _small_pair(tmp_path)
    js = tmp_path / "r.json"
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--method", "icp",
                                  "--device", "cpu", "--json", str(js)])
    assert res.exit_code == 0, res.output
    assert "5% of the source" in res.output and pointalign.__version__ in res.output
    doc = json.loads(js.read_text())
    assert doc["pointalign_version"] == pointalign.__version__ and doc["device"] == "cpu"
    assert doc["inputs"]["source"]["points"] == 800
    assert doc["parameters"]["max_distance"] > 0
    back = RegistrationResult.load(js)
    rot, trans = metrics.relative_error(back.transformation, pair.T_target_source)
    assert rot < 0.5 and trans < 1e-3


def test_not_converged_exits_3_unless_allowed(tmp_path):
    _, src, tgt = _small_pair(tmp_path)
    base = ["register", str(src), str(tgt), "--method", "icp", "--device", "cpu",
            "--max-iterations", "1"]
    res = runner.invoke(cli.app, base)
    assert res.exit_code == 3 and "did not converge" in res.output
    res = runner.invoke(cli.app, [*base, "--allow-failure"])
    assert res.exit_code == 0


def test_config_file_and_ignored_options(tmp_path):
    _, src, tgt = _small_pair(tmp_path)
    cfg = tmp_path / "run.toml"
    cfg.write_text('method = "icp"\ndevice = "cpu"\n[register]\nmax-iterations = 1\n'
                   'allow_failure = true\nvoxel-size = 0.1\n')
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    assert "voxel-size is ignored by method icp" in res.output
    assert "max iterations │ 1" in res.output or "max iterations" in res.output
    # the command line wins over the file
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--config", str(cfg),
                                  "--max-iterations", "50"])
    assert res.exit_code == 0 and "│ 50" in res.output
    bad = tmp_path / "bad.toml"
    bad.write_text("max_distanse = 1\n")
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--config", str(bad)])
    assert res.exit_code == 2 and "max_distanse" in res.output
    bad.write_text('method = "magic"\n')
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--config", str(bad)])
    assert res.exit_code == 2 and "magic" in res.output


def test_reads_kitti_bin(tmp_path):
    pair, _, tgt = _small_pair(tmp_path)
    b = tmp_path / "s.bin"
    rows = np.concatenate([pair.source.numpy(), np.ones((len(pair.source), 1))], 1)
    rows.astype("<f4").tofile(b)
    res = runner.invoke(cli.app, ["register", str(b), str(tgt), "--method", "icp",
                                  "--device", "cpu"])
    assert res.exit_code == 0, res.output
    b3 = tmp_path / "s3.bin"
    pair.source.numpy().astype("<f4").tofile(b3)
    res = runner.invoke(cli.app, ["register", str(b3), str(tgt), "--method", "icp",
                                  "--device", "cpu", "--bin-columns", "3"])
    assert res.exit_code == 0, res.output


def test_view_and_pictures(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("plotly")
    pair, src, tgt = _small_pair(tmp_path, 300)
    png, html = tmp_path / "p.png", tmp_path / "v.html"
    js = tmp_path / "r.json"
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--method", "icp",
                                  "--device", "cpu", "--plot", str(png), "--html", str(html),
                                  "--json", str(js)])
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "p_history.png").is_file()
    assert "pointalign-view" in html.read_text()
    out = tmp_path / "view.html"
    res = runner.invoke(cli.app, ["view", str(src), str(tgt), "--json", str(js),
                                  "--output", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "<script" in text and not re.search(r"<script[^>]*\ssrc=", text)
    res = runner.invoke(cli.app, ["view", str(src), str(tgt), "--output", str(tmp_path / "x.png")])
    assert res.exit_code == 2


def test_bench_runs_suites_and_summarises(tmp_path, monkeypatch):
    root = tmp_path / "benchmarks"
    root.mkdir()
    (root / "common.py").write_text("")
    (root / "bench_fake.py").write_text(
        "import json, os, sys\n"
        "assert '--quick' in sys.argv\n"
        "d = sys.argv[sys.argv.index('--device') + 1]\n"
        "p = os.path.join(os.environ['POINTALIGN_BENCH_RESULTS'], f'fake-{d}.json')\n"
        "json.dump({'rows': [{'a': 1}, {'a': 2}], 'tables': {}}, open(p, 'w'))\n"
        "print(json.dumps({'case': 'small', 'total_ms': 12.5}))\n"
        "print(json.dumps({'case': 'large', 'total_ms': 99.0}))\n")
    (root / "bench_broken.py").write_text("raise SystemExit(4)\n")
    monkeypatch.setattr(cli, "_find_benchmarks", lambda: root)
    out = tmp_path / "res"
    out.mkdir()
    res = runner.invoke(cli.app, ["bench", "--quick", "--suite", "fake", "--device", "cpu",
                                  "--results", str(out)])
    assert res.exit_code == 0, res.output
    assert "fake" in res.output and (out / "fake-cpu.json").is_file()
    assert "small: 12.5 total_ms" in res.output
    res = runner.invoke(cli.app, ["bench", "--quick", "--suite", "broken", "--device", "cpu",
                                  "--results", str(out)])
    assert res.exit_code == 1 and "exit 4" in res.output
    res = runner.invoke(cli.app, ["bench", "--suite", "nosuch"])
    assert res.exit_code == 2 and "fake" in res.output
    monkeypatch.setattr(cli, "_find_benchmarks", lambda: None)
    res = runner.invoke(cli.app, ["bench", "--quick"])
    assert res.exit_code == 2 and "checkout" in res.output


def test_progress_silent_off_terminal_and_forced_on(monkeypatch, capsys):
    import io as _io
    import logging
    import warnings

    from pointalign import _progress

    monkeypatch.delenv("POINTALIGN_PROGRESS", raising=False)
    assert not _progress.enabled(stream=_io.StringIO())  # not a terminal
    assert list(_progress.track(range(3), "steps")) == [0, 1, 2]
    monkeypatch.setenv("POINTALIGN_PROGRESS", "1")
    assert _progress.enabled()
    with _progress.quiet():
        assert not _progress.enabled()
    assert not _progress.enabled(quiet=True)
    with _progress.task("outer", total=2) as bar:
        bar.advance()
        with _progress.task("inner", total=1) as inner:  # nested: one display
            inner.advance()
        bar.advance()
    monkeypatch.setenv("POINTALIGN_PROGRESS", "0")
    assert not _progress.enabled()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _progress.warn_ignored("voxel_size", "icp", "no downsampling in ICP")
    assert rec and issubclass(rec[0].category, _progress.IgnoredParameterWarning)
    assert "voxel_size is ignored by icp" in str(rec[0].message)
    _progress.configure_logging(2)
    assert logging.getLogger("pointalign").level == logging.DEBUG
    _progress.configure_logging(-1)
    assert logging.getLogger("pointalign").level == logging.ERROR and not _progress.enabled()
    _progress.configure_logging(0)
    _progress.set_quiet(False)
