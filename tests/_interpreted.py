"""The Triton kernels' CPU tests: child processes under ``TRITON_INTERPRET=1``.

Triton decides at import time whether its standard library is interpreted, so a process
that already imported Triton for compiled kernels cannot interpret kernels. Each test
module that checks its kernels through the interpreter therefore names one child
function ``module.function(out_path)``, which runs the kernels and saves its tensors with
``torch.save``; :func:`interpreted_fixture` makes the module-scoped fixture that returns
the saved dict.

Interpreted kernels are slow (minutes of the suite on a 2-core machine), so the children
run beside the rest of the suite: ``conftest.py`` moves the tests that read them to the
end of the run (:func:`move_last`) and starts the children, one at a time, when
collection finishes (:func:`start`); a fixture then waits for its child's result. A
fixture whose child was not started (a single test run by name) runs it inline.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

#: per child, wall seconds before it counts as hung
TIMEOUT_S = 900

#: (test module, fixture name) -> child function, filled as test modules are imported
REGISTRY: dict[tuple[str, str], str] = {}


class _Child:
    """One child process, started on a background thread and awaited by its fixture."""

    def __init__(self, module: str, function: str, out_path: Path):
        self.module, self.function, self.out_path = module, function, out_path
        self.proc: subprocess.Popen | None = None
        self.result: tuple[int, str] | None = None
        self.done = threading.Event()

    def run(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "POINTALIGN_BACKEND"}
        # one thread each: the child shares the machine with the rest of the suite
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
        code = f"import {self.module} as m; m.{self.function}({str(self.out_path)!r})"
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True)
            out, _ = self.proc.communicate(timeout=TIMEOUT_S)
            self.result = (self.proc.returncode, out)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.result = (-1, f"timed out after {TIMEOUT_S} s")
        except OSError as e:
            self.result = (-1, repr(e))
        finally:
            self.done.set()

    def wait(self) -> dict:
        self.done.wait()
        assert self.result is not None
        code, out = self.result
        assert code == 0, f"interpreted run {self.module}.{self.function} failed:\n{out[-4000:]}"
        return torch.load(self.out_path)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


#: children started by :func:`start`, by (module, function); set when the session ends
_STARTED: dict[tuple[str, str], _Child] = {}
_STOPPING = threading.Event()
_TMP_DIRS: list[Path] = []


def interpreted_fixture(module: str, function: str, name: str = "interpreted"):
    """Return a module-scoped fixture ``name`` giving the dict ``module.function`` saved."""
    REGISTRY[(module, name)] = function

    @pytest.fixture(scope="module", name=name)
    def fixture(tmp_path_factory):
        pytest.importorskip("triton")
        child = _STARTED.get((module, function))
        if child is None:  # not started with the session: run it here
            child = _Child(module, function, tmp_path_factory.mktemp("interp") / "out.pt")
            child.run()
        return child.wait()

    return fixture


def _children_of(item) -> list[tuple[str, str]]:
    mod = getattr(getattr(item, "module", None), "__name__", None)
    return [(mod, REGISTRY[(mod, f)]) for f in getattr(item, "fixturenames", ())
            if (mod, f) in REGISTRY]


def move_last(items: list) -> None:
    """Reorder ``items`` in place: the tests that read a child's result run last."""
    items.sort(key=lambda item: bool(_children_of(item)))  # stable: order kept within


def start(items: list) -> None:
    """Start the children the selected ``items`` need, in their order, one at a time."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return
    calls = list(dict.fromkeys(c for item in items for c in _children_of(item)))
    if not calls:
        return
    tmp = Path(tempfile.mkdtemp(prefix="pointalign-interp-"))
    _TMP_DIRS.append(tmp)
    children = [_Child(m, f, tmp / f"{m}.{f}.pt") for m, f in calls]
    _STARTED.update({(c.module, c.function): c for c in children})

    def run_all() -> None:
        for c in children:
            if _STOPPING.is_set():
                c.result = (-1, "not run: the session ended")
                c.done.set()
            else:
                c.run()

    threading.Thread(target=run_all, name="interpreted-children", daemon=True).start()


def stop() -> None:
    """Kill children still running when the session ends (a failed ``-x`` run)."""
    _STOPPING.set()
    for c in _STARTED.values():
        c.kill()
    for d in _TMP_DIRS:
        shutil.rmtree(d, ignore_errors=True)
