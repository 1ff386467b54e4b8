"""Shared fixtures: devices, dtypes, seeds, and the real data when present."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from pointalign import _progress, datasets
from tests import _interpreted
from tests._backends import BACKENDS, BY_NAME, Backend

HAS_CUDA = torch.cuda.is_available()

# the one-time "numba compiles now" notice of a fresh machine (kernels/_numba.py) is a
# SlowOperationWarning; a test that expects no warning must not meet it first on CI
# (tests/test_first_call.py checks the notice itself)
from pointalign.kernels import _numba  # noqa: E402

_numba._announced = True

# seeds range: tests must pass for any of them; POINTALIGN_SEED picks another one
_SEED = int(os.environ.get("POINTALIGN_SEED", "0"))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run with -m gpu on the device)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
    _interpreted.move_last(items)


def pytest_collection_finish(session):
    """Start the Triton-interpreter children (tests/_interpreted.py) beside the suite."""
    _interpreted.start(session.items)


def pytest_sessionfinish(session, exitstatus):
    _interpreted.stop()


@pytest.fixture(params=[0, 1, 2])
def seed(request) -> int:
    """Three seeds per test (shifted by $POINTALIGN_SEED): no lucky seed."""
    return request.param + _SEED


@pytest.fixture
def rng(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Each device in turn: "cpu", then "cuda" (marked ``gpu``: skipped without a GPU)."""
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request) -> Iterator[Backend]:
    """Each kernel backend in turn, selected through ``POINTALIGN_BACKEND`` for the test.

    A kernel test takes this fixture, puts its tensors on ``backend.device`` and compares
    the dispatcher's answer with the reference (or an oracle): one test covers every
    backend. "cpu" skips where numba is missing; "triton" carries the ``gpu`` marker (and
    skips without a GPU). :func:`tests._backends.backends` narrows the list for one test.
    The Triton interpreter runs in child processes (``tests/_interpreted.py``), not here.
    The variable is set through a MonkeyPatch of its own, so that a test's
    ``monkeypatch.undo()`` leaves the backend alone.
    """
    b: Backend = request.param if isinstance(request.param, Backend) \
        else BY_NAME[request.param]
    if b.name == "cpu":
        from pointalign.kernels import _backend

        if not _backend.cpu_available():
            pytest.skip("numba is not installed")
    if b.device == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    mp = pytest.MonkeyPatch()
    mp.setenv("POINTALIGN_BACKEND", b.name)
    try:
        yield b
    finally:
        mp.undo()


@pytest.fixture(params=[torch.float32, torch.float64], ids=["f32", "f64"])
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(scope="session")
def bunny_pair() -> datasets.Pair:
    return datasets.load_bunny_pair()


@pytest.fixture(scope="session")
def bunny_scans() -> tuple[torch.Tensor, torch.Tensor]:
    """The two bundled bunny scans ``(bun045, bun000)``, each ``(N, 3)`` float32."""
    try:
        return datasets.load_bunny("bun045"), datasets.load_bunny("bun000")
    except Exception as e:  # pragma: no cover - package data missing
        pytest.skip(f"bunny not available: {e}")


@pytest.fixture(scope="session")
def shared_data():
    d = datasets.shared_data_dir()
    if d is None:
        pytest.skip("shared real data (../shared/data) not present")
    return d


@pytest.fixture(autouse=True)
def _restore_logging():
    """Undo what a test's CLI run configured (``-v`` attaches a stderr handler to the
    "pointalign" logger for the process, ``-q`` silences warnings): later tests see the
    library's own logging and warnings."""
    import logging

    log = logging.getLogger("pointalign")
    handlers, level, propagate = list(log.handlers), log.level, log.propagate
    quiet = _progress._QUIET.get()  # a CLI run with -q silences the process's warnings
    yield
    log.handlers[:] = handlers
    log.setLevel(level)
    log.propagate = propagate
    _progress.set_quiet(quiet)
