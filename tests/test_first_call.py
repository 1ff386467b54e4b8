"""The first call on a fresh machine: the compile notice and ``pointalign warmup``."""

from __future__ import annotations

import warnings

import pytest
from typer.testing import CliRunner

from pointalign import _progress, _warmup, cli
from pointalign.kernels import _backend, _numba


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not announced yet."""
    monkeypatch.setattr(_numba, "_announced", False)


@pytest.mark.skipif(not _numba.available(), reason="numba is not installed")
def test_fresh_machine_hears_once_that_numba_compiles(fresh, monkeypatch):
    monkeypatch.setattr(_numba, "cached_kernels", lambda: 0)
    monkeypatch.delenv("POINTALIGN_BACKEND", raising=False)
    with pytest.warns(_progress.SlowOperationWarning, match="numba compiles them now"):
        assert _backend.backend() == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _backend.backend()  # once per process


@pytest.mark.skipif(not _numba.available(), reason="numba is not installed")
def test_a_machine_with_cached_kernels_hears_nothing(fresh, monkeypatch):
    monkeypatch.setattr(_numba, "cached_kernels", lambda: 12)
    monkeypatch.delenv("POINTALIGN_BACKEND", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _backend.backend() == "cpu"


@pytest.mark.skipif(not _numba.available(), reason="numba is not installed")
def test_cached_kernels_counts_index_files(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    before = _numba.cached_kernels()
    folder = _numba.cache_dirs()[1]  # where numba puts a kernel family's index files
    assert folder.parent == tmp_path
    folder.mkdir()
    (folder / "k.f-1.py311.nbi").write_bytes(b"")
    (tmp_path / "other.nbi").write_bytes(b"")  # another package's: not counted
    assert _numba.cached_kernels() == before + 1


def test_warmup_runs_every_step_and_reports_seconds(monkeypatch):
    monkeypatch.setattr(_warmup, "default_workers", lambda dev: 1)  # the fake steps: here
    calls = []
    monkeypatch.setattr(_warmup, "_steps", lambda dev: [
        ("one", lambda: calls.append(("one", dev.type))),
        ("two", lambda: calls.append(("two", dev.type)))])
    seconds = _warmup.warmup("cpu", quiet=True)
    assert list(seconds) == ["one", "two"] and all(s >= 0 for s in seconds.values())
    assert calls == [("one", "cpu"), ("two", "cpu")]
    res = CliRunner().invoke(cli.app, ["warmup", "--device", "cpu"], terminal_width=120)
    assert res.exit_code == 0, res.output
    assert "warm-up on cpu" in res.output and "two" in res.output


def test_warmup_steps_cover_the_public_methods():
    import torch

    names = [n for n, _ in _warmup._steps(torch.device("cpu"))]
    for method in ("register", "gicp", "emicp", "softassign", "surface_newton"):
        assert any(n.startswith(method) for n in names), method


def test_warmup_workers_must_be_positive():
    with pytest.raises(ValueError, match="workers"):
        _warmup.warmup("cpu", quiet=True, workers=0)
