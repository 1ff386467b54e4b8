import json

import numpy as np
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
