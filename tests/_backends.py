"""The kernel backends under test: the ``backend`` fixture's values (``tests/conftest.py``).

``from tests._backends import backends`` narrows a test to some backends.
"""

from __future__ import annotations

import dataclasses

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
