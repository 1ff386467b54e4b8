"""The first call on a fresh machine: the compile notice and ``pointalign warmup``."""

from __future__ import annotations

import warnings

import pytest
from typer.testing import CliRunner

from pointalign import _progress, _warmup, cli
from pointalign.kernels import _numba


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not announced yet, outside any public call."""
    monkeypatch.setattr(_numba, "_announced", False)
    monkeypatch.setattr(_numba, "_silent", False)
    monkeypatch.setattr(_numba, "_scope", [])
    monkeypatch.setattr(_numba, "_depth", [0])


class _Event:
    """What numba's ``numba:compile`` event carries: the dispatcher (its py_func)."""

    def __init__(self, module: str) -> None:
        f = type("F", (), {"__module__": module})()
        self.data = {"dispatcher": type("D", (), {"py_func": f})()}


def _compile(module: str = "pointalign.kernels.knn.cpu") -> None:
    """One (fake) kernel compile as numba reports it: a start, then an end event."""
    _numba._on_start(_Event(module))
    _numba._on_end(_Event(module))


@pytest.mark.skipif(not _numba.available(), reason="numba is not installed")
def test_a_first_use_announces_its_pending_compile_once(fresh, monkeypatch):
    todo = [("knn.cpu._build", "array(float32, 2d, C), int64", 4.0),
            ("knn.cpu._nearest", "", 3.0)]
    monkeypatch.setattr(_numba, "pending", lambda steps: todo if steps == ("gicp",) else [])

    @_numba.first_use("gicp")
    def method():
        _compile()
        _compile()  # the same call's next kernel: no second notice

    with pytest.warns(_progress.SlowOperationWarning,
                      match=r"numba compiles 2 CPU kernels for this call \(about 7 s") as rec:
        method()
    assert rec[0].filename == __file__  # the user's line, not numba's or the wrapper's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compile("numba.np.arrayobj")  # numba's own overloads: not ours
        method.__wrapped__()  # type: ignore[attr-defined]  (no scope: the notice was given)


@pytest.mark.skipif(not _numba.available(), reason="numba is not installed")
def test_a_call_that_loads_from_the_cache_hears_nothing(fresh, monkeypatch):
    monkeypatch.setattr(_numba, "pending", lambda steps: [])

    @_numba.first_use("register")
    def method():
        return 3

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert method() == 3  # no compile event: nothing said
        _numba._silent = True  # the warm-up's own bar says it
        _compile()


@pytest.mark.skipif(not _numba.available(), reason="numba is not installed")
def test_a_compile_outside_the_methods_is_announced_once_without_estimate(fresh):
    with pytest.warns(_progress.SlowOperationWarning, match="typically 1-4 s each"):
        _compile()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compile()


@pytest.mark.skipif(not _numba.available(), reason="numba is not installed")
def test_the_manifest_names_kernels_and_signatures_that_exist():
    table = _numba.manifest()
    assert "register" in table and all(table.values())
    for rows in table.values():
        for kernel, args, seconds in rows:
            assert seconds >= 0
            d = _numba.dispatcher(kernel)
            assert d is not None, kernel
            sig = _numba.signature(args)
            assert sig is not None and ", ".join(str(t) for t in sig) == args, args


@pytest.mark.skipif(not _numba.available(), reason="numba is not installed")
def test_signature_reads_what_numba_prints():
    import numpy as np
    from numba import typeof

    arrays = (np.zeros((2, 3), np.float32), np.zeros(4, np.int64)[::2], np.int64(3),
              np.float64(1.0), True)
    printed = ", ".join(str(typeof(a)) for a in arrays)
    assert ", ".join(str(t) for t in _numba.signature(printed)) == printed
    assert _numba.signature("UniTuple(int64 x 2)") is None
    assert _numba.signature("") == ()


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
    monkeypatch.setattr(_warmup, "default_workers", lambda dev, steps: 1)  # the fakes: here
    calls = []
    monkeypatch.setattr(_warmup, "_steps", lambda dev: [
        ("register", lambda: calls.append(("register", dev.type))),
        ("two", lambda: calls.append(("two", dev.type)))])
    seconds = _warmup.warmup("cpu", quiet=True, every_method=True)
    assert list(seconds) == ["register", "two"] and all(s >= 0 for s in seconds.values())
    assert calls == [("register", "cpu"), ("two", "cpu")]
    res = CliRunner().invoke(cli.app, ["warmup", "--device", "cpu", "--all"],
                             terminal_width=120)
    assert res.exit_code == 0, res.output
    assert "warm-up on cpu" in res.output and "two" in res.output
    calls.clear()  # by default: what the demo and a first register() need
    res = CliRunner().invoke(cli.app, ["warmup", "--device", "cpu"], terminal_width=120)
    assert res.exit_code == 0, res.output
    assert calls == [("register", "cpu")] and "--all" in res.output


def test_warmup_steps_cover_the_public_methods():
    import torch

    names = [n for n, _ in _warmup._steps(torch.device("cpu"))]
    for method in ("register", "gicp", "emicp", "softassign", "surface_newton"):
        assert any(n.startswith(method) for n in names), method


def test_warmup_workers_must_be_positive():
    with pytest.raises(ValueError, match="workers"):
        _warmup.warmup("cpu", quiet=True, workers=0)


@pytest.mark.skipif(not _numba.available(), reason="numba is not installed")
def test_compiles_counts_this_package_kernels_only(fresh, monkeypatch):
    monkeypatch.setattr(_numba, "_compiled", [0])
    monkeypatch.setattr(_numba, "_silent", True)  # the warm-up's case: counted, not said
    before = _numba.compiles()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compile()
        _compile("numba.np.arrayobj")
    assert _numba.compiles() == before + 1


def test_import_is_light():
    """``import pointalign`` imports torch and NumPy, not numba, SciPy, Triton or plotting: a
    GPU-only process never pays for the CPU kernels' compiler (numba is imported with the
    first CPU kernel's module)."""
    import subprocess
    import sys

    code = ("import sys, pointalign; heavy = ('numba', 'scipy', 'triton', 'matplotlib', "
            "'plotly', 'dask', 'distributed', 'open3d'); "
            "print(','.join(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "", f"import pointalign imported {out}"
