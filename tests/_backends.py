"""The kernel backends under test: the ``backend`` fixture's values (``tests/conftest.py``).

``from tests._backends import backends`` narrows a test to some backends; :func:`selected`
runs a block on another backend (for the few tests that compare two backends' runs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import pytest


@dataclasses.dataclass(frozen=True)
class Backend:
    """One kernel backend under test: its name and the device its tensors live on."""

    name: str  #: "torch" (the PyTorch references), "cpu" (numba) or "triton" (CUDA)
    device: str  #: "cpu" or "cuda"


BY_NAME = {"torch": Backend("torch", "cpu"), "cpu": Backend("cpu", "cpu"),
            "triton": Backend("triton", "cuda")}
BACKENDS = [
    pytest.param(BY_NAME["torch"], id="torch"),
    pytest.param(BY_NAME["cpu"], id="cpu"),
    pytest.param(BY_NAME["triton"], id="triton", marks=pytest.mark.gpu),
]


def backends(*names: str) -> pytest.MarkDecorator:
    """Parametrise a test's ``backend`` fixture with some backends only (``"triton"``: gpu).

    ``@backends("cpu")`` for a test of the numba kernels' own machinery, ``@backends("triton")``
    for CUDA-only behaviour (graphs, no synchronisation); the default is all three.
    """
    return pytest.mark.parametrize(
        "backend", [pytest.param(n, id=n, marks=pytest.mark.gpu if n == "triton" else ())
                    for n in names], indirect=True)


@contextlib.contextmanager
def selected(name: str) -> Iterator[None]:
    """Run the block with ``POINTALIGN_BACKEND=name`` (restored after).

    Only for tests whose subject is the agreement of two backends on one computation (a
    whole ICP run on "cpu" against the same run on "torch"); a kernel test takes the
    ``backend`` fixture and compares with the reference function instead.
    """
    old = os.environ.get("POINTALIGN_BACKEND")
    os.environ["POINTALIGN_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["POINTALIGN_BACKEND"]
        else:
            os.environ["POINTALIGN_BACKEND"] = old
