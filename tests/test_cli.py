import json
import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from pointalign import _defaults, cli, cli_bench, datasets, io, metrics, transforms
from pointalign.registration.pipeline import Scales

runner = CliRunner()


def test_info_lists_backends_and_methods():
    res = runner.invoke(cli.app, ["info"])
    assert res.exit_code == 0, res.output
    assert "kernels knn" in res.output and "method icp" in res.output


def test_info_names_the_backend_running_per_family_and_keeps_install_hints(monkeypatch):
    import importlib.util

    from pointalign.kernels import _backend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "open3d" else real(name, *a))
    res = runner.invoke(cli.app, ["info"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "pip install 'pointalign[open3d]'" in res.output  # rich markup kept the [open3d]
    assert "PyTorch reference kernels" not in res.output
    rows = dict(cli._family_backends())
    if _backend.backend(torch.empty(0)) == "cpu":  # numba present: its families say so
        assert rows["kernels knn"].startswith("cpu: numba CPU kernels")
        assert "numba CPU kernels" in res.output
    monkeypatch.setenv("POINTALIGN_BACKEND", "torch")
    assert dict(cli._family_backends())["kernels knn"] == "cpu: PyTorch reference"


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
    assert "{SOURCE}" not in res.output and "SOURCE TARGET" in res.output
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
    monkeypatch.setattr(cli_bench, "_find_benchmarks", lambda: root)
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
    monkeypatch.setattr(cli_bench, "_find_benchmarks", lambda: None)
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


# ----------------------------------------------------------------------------------------
# the CLI's shape: shared option aliases, program options on the callback, bench apart
# ----------------------------------------------------------------------------------------

def test_program_options_live_once_on_the_app_and_bench_in_its_module():
    import typer

    group = typer.main.get_command(cli.app)
    assert {"verbose", "quiet", "config"} <= {p.name for p in group.params}
    for name, cmd in group.commands.items():
        assert not {"verbose", "quiet", "config"} & {p.name for p in cmd.params}, name
    assert cli_bench.bench.__module__ == "pointalign.cli_bench" and "bench" in group.commands
    assert not hasattr(cli, "_run_suite")  # the suite runner moved too
    # the aliases: one declaration per shared name, used by every command that has it
    src = __import__("inspect").getsource(cli)
    for opt in ("min=1, metavar=\"N\"", "\"--allow-failure\"", "compute device (auto",
                "\"--verbose\", \"-v\"", "random seed", "float32 columns per point"):
        assert src.count(opt) == 1, opt


def test_help_shows_plain_metavars():
    res = runner.invoke(cli.app, ["batch", "--help"])
    assert res.exit_code == 0
    assert "<list[Path]>" not in res.output and "{SOURCE" not in res.output
    assert "SOURCE..." in res.output and "-q/--quiet" in res.output


def test_program_options_before_or_after_the_command(tmp_path, monkeypatch):
    _, src, tgt = _small_pair(tmp_path, 50)

    def boom(*a, **k):
        raise AssertionError("work started before the option check")

    monkeypatch.setattr(io, "read", boom)
    for args in (["-v", "-q", "register", str(src), str(tgt)],
                 ["register", str(src), str(tgt), "-vv", "--quiet"]):
        res = runner.invoke(cli.app, args)
        assert res.exit_code == 2 and "exclude" in res.output, args


def test_icp_default_distance_comes_from_the_library(tmp_path, monkeypatch):
    pair, src, tgt = _small_pair(tmp_path, 300)
    monkeypatch.setattr(_defaults, "icp_distance", lambda cloud: 0.0123)
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--method", "icp",
                                  "--device", "cpu", "--max-iterations", "2",
                                  "--allow-failure"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "0.0123 (5% of the source's bounding-box diagonal)" in res.output
    real = _defaults.bounding_box_diagonal(pair.source) * _defaults.ICP_DISTANCE_FRACTION
    monkeypatch.undo()
    assert _defaults.icp_distance(pair.source) == pytest.approx(real)
    assert Scales(0.004).fine == pytest.approx(0.002)
    with pytest.raises(ValueError, match="source: all points coincide"):
        _defaults.icp_distance(np.zeros((5, 3)))


def test_parameters_table_states_the_cap_it_ran_with(tmp_path):
    _, src, tgt = _small_pair(tmp_path, 300)
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--method", "icp",
                                  "--device", "cpu", "--max-distance", "0.02"],
                        terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "method default" not in res.output
    assert re.search(r"max iterations\s*│ 50 \(icp's default\)", res.output), res.output


def test_quiet_prints_the_matrix_alone_and_verbose_shows_info(tmp_path):
    pair, src, tgt = _small_pair(tmp_path, 300)
    base = ["register", str(src), str(tgt), "--method", "icp", "--device", "cpu",
            "--max-distance", "0.02"]
    res = runner.invoke(cli.app, [*base, "-q"])
    assert res.exit_code == 0, res.output
    T = np.array([[float(v) for v in line.split()] for line in res.stdout.splitlines()])
    assert T.shape == (4, 4)  # nothing but the matrix: --init and np.loadtxt read it back
    rot, trans = metrics.relative_error(T, pair.T_target_source)
    assert rot < 0.5 and trans < 1e-3
    res = runner.invoke(cli.app, [*base, "-v"], terminal_width=200)
    assert res.exit_code == 0, res.output
    words = " ".join(res.output.split())  # rich's log handler wraps at its own width
    assert "INFO" in words and "300 points" in words and "stages:" in words


def test_not_trusted_names_the_verdict_not_the_local_stop(tmp_path, monkeypatch):
    _, src, tgt = _small_pair(tmp_path, 50)
    fake = cli_result = __import__("pointalign").RegistrationResult(
        transformation=np.eye(4), fitness=0.1, rmse=0.01, iterations=3, converged=False,
        stop_reason="small_update", info={"verdict": "small overlap"})
    monkeypatch.setattr(cli, "_run", lambda *a, **k: (cli_result, {"method": "global"}))
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--device", "cpu"])
    assert res.exit_code == 3
    assert "did not converge (small overlap)" in res.output and fake.stop_reason not in \
        res.output.split("did not converge")[1]


def test_demo_local_methods_align_from_a_stated_start():
    res = runner.invoke(cli.app, ["demo", "--method", "icp", "--device", "cpu"],
                        terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "the true pose turned by 5 deg and moved by 5 mm" in res.output
    assert "NOT aligned" not in res.output and "aligned: errors" in res.output
    res = runner.invoke(cli.app, ["demo", "--method", "approx-icp", "--device", "cpu", "-q"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("aligned:") and "coarse method" in res.stdout
    # from the identity, a local method says why it cannot get there
    res = runner.invoke(cli.app, ["demo", "--method", "icp", "--start", "identity",
                                  "--max-iterations", "3", "--device", "cpu", "-q"])
    assert res.exit_code == 1
    assert "NOT aligned" in res.stdout and "local method" in res.stdout and \
        "--start near" in res.stdout


def test_bin_columns_are_inferred_by_default(tmp_path):
    pair, _, tgt = _small_pair(tmp_path)
    b3 = tmp_path / "s3.bin"  # 800 x 3 float32: its size also divides by 16
    pair.source.numpy().astype("<f4").tofile(b3)
    res = runner.invoke(cli.app, ["register", str(b3), str(tgt), "--method", "icp",
                                  "--device", "cpu", "--max-distance", "0.02"],
                        terminal_width=200)
    assert res.exit_code == 0, res.output
    assert "read as 3 float32 columns" in res.output and "800 points" in res.output


# ----------------------------------------------------------------------------------------
# GICP and VGICP as methods; the global method's --refine
# ----------------------------------------------------------------------------------------

def test_register_gicp_and_vgicp_call_the_library(tmp_path, monkeypatch):
    """--method gicp calls pa.gicp with the local methods' distance (the library's default
    unless given); vgicp calls pa.vgicp with --voxel-size or register's automatic edge of
    the target; both recover the pair and say which values they used."""
    import pointalign as pa
    from pointalign.features.downsample import auto_voxel_size
    from pointalign.registration import gicp as gicp_module

    pair, src, tgt = _small_pair(tmp_path, 800)
    calls = []
    for name in ("gicp", "vgicp"):
        real = getattr(gicp_module, name)
        assert getattr(pa, name) is real  # the public function is the one the CLI runs

        def spy(*a, _real=real, _name=name, **k):
            calls.append((_name, k))
            return _real(*a, **k)
        monkeypatch.setattr(gicp_module, name, spy)
    for method, extra in (("gicp", []), ("vgicp", []), ("vgicp", ["--voxel-size", "0.01"])):
        js = tmp_path / f"{method}{len(extra)}.json"
        res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--method", method,
                                      "--device", "cpu", "--json", str(js), *extra],
                            terminal_width=200)
        assert res.exit_code == 0, res.output
        doc = json.loads(js.read_text())
        rot, trans = metrics.relative_error(np.array(doc["transformation"]),
                                            pair.T_target_source)
        assert rot < 0.5 and trans < 1e-3
        name, kw = calls[-1]
        assert name == method
        if method == "gicp":
            want = _defaults.icp_distance(pair.source)
            assert kw["max_correspondence_distance"] == pytest.approx(want)
            assert "5% of the source" in res.output
        elif extra:
            assert kw["voxel_size"] == 0.01 and doc["parameters"]["voxel_size"] == 0.01
        else:
            assert kw["voxel_size"] == pytest.approx(auto_voxel_size(pair.target))
            assert "automatic voxel edge of the target" in res.output
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--method", "vgicp",
                                  "--device", "cpu", "--max-distance", "0.02"])
    assert "max-distance is ignored by method vgicp" in res.output


def test_global_refine_reaches_register(tmp_path, monkeypatch):
    """--refine is register()'s refine= (default: register's own); other methods ignore it."""
    from pointalign.registration import pipeline

    _, src, tgt = _small_pair(tmp_path, 300)
    import functools

    seen = []
    real = pipeline.register

    @functools.wraps(real)  # the CLI reads register's signature for its defaults
    def spy(*a, **k):
        seen.append(k.get("refine"))
        return real(*a, **k)
    monkeypatch.setattr(pipeline, "register", spy)
    for extra, want in (([], None), (["--refine", "gicp"], "gicp"),
                        (["--refine", "none"], "none")):
        res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--device", "cpu",
                                      "--voxel-size", "0.01", "--allow-failure", *extra],
                            terminal_width=200)
        assert res.exit_code == 0, res.output
        assert seen[-1] == want
        shown = want or "point_to_plane"
        assert re.search(rf"refine\s*│ {shown}", res.output), res.output
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--method", "icp",
                                  "--device", "cpu", "--refine", "gicp",
                                  "--max-distance", "0.02"])
    assert res.exit_code == 0 and "--refine is ignored by method icp" in res.output
    res = runner.invoke(cli.app, ["register", str(src), str(tgt), "--refine", "bogus"])
    assert res.exit_code == 2 and "bogus" in res.output
    assert [r.value for r in cli.Refine] == list(pipeline.REFINEMENTS)


def test_demo_and_batch_list_the_gicp_methods(tmp_path):
    for command in ("demo", "batch"):
        res = runner.invoke(cli.app, [command, "--help"], terminal_width=200)
        assert res.exit_code == 0 and "gicp|vgicp" in res.output and "--refine" in res.output
    res = runner.invoke(cli.app, ["demo", "--method", "vgicp", "--device", "cpu", "-q"])
    assert res.exit_code == 0 and res.stdout.startswith("aligned:"), res.output
    pair, src, tgt = _small_pair(tmp_path, 800)
    res = runner.invoke(cli.app, ["batch", str(src), "--target", str(tgt), "--method", "gicp",
                                  "--device", "cpu"], terminal_width=200)
    assert res.exit_code == 0, res.output
