"""The CPU kernels' thread pool: pointalign.set_num_threads / get_num_threads and numba.

(Each family's thread-count invariance is tested in its own file: the same code under 1 and
2 threads gives the same bits.)
"""

from __future__ import annotations

import pytest
import torch

import pointalign as pa
from tests._backends import backends


def test_threads_api(monkeypatch):
    try:
        pa.set_num_threads(1)
        assert pa.get_num_threads() == 1 and torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="n"):
            pa.set_num_threads(0)
        with pytest.raises(TypeError, match="n"):
            pa.set_num_threads(1.5)
        pa.set_num_threads(None)
        monkeypatch.setenv("POINTALIGN_NUM_THREADS", "1")
        assert pa.get_num_threads() == 1
        monkeypatch.setenv("POINTALIGN_NUM_THREADS", "zero")
        with pytest.raises(ValueError, match="POINTALIGN_NUM_THREADS"):
            pa.get_num_threads()
    finally:
        monkeypatch.delenv("POINTALIGN_NUM_THREADS", raising=False)
        pa.set_num_threads(None)


@backends("cpu")
def test_numba_pool_start_keeps_torch_threads(backend):
    """numba's OpenMP pool start used to reset PyTorch's thread count (fresh process)."""
    import subprocess
    import sys

    code = ("import numpy as np, torch, pointalign as pa\n"
            "from pointalign.kernels.knn.cpu import CpuTree\n"
            "torch.set_num_threads(2); pa.set_num_threads(1)\n"
            "CpuTree(np.random.rand(100, 3)).nearest(np.zeros((4, 3)))\n"
            "print(torch.get_num_threads())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "1"
