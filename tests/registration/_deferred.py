"""A check shared by the tests of methods that read the pair's host part late on CUDA."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch


def assert_scans_raise(call: Callable[[torch.Tensor, torch.Tensor], Any], s: torch.Tensor,
                       t: torch.Tensor) -> None:
    """``call(source, target)`` raises the NaN/Inf scans' error for a NaN source and for an
    Inf target, and leaves the cloud it was given as it was."""
    for bad, name in ((float("nan"), "source"), (float("inf"), "target")):
        x = (s if name == "source" else t).clone()
        x[3, 1] = bad
        before = x.clone()
        with pytest.raises(ValueError, match=f"{name}: 1 rows contain NaN or Inf"):
            call(*((x, t) if name == "source" else (s, x)))
        assert torch.equal(x.isnan(), before.isnan()) and torch.equal(
            x.nan_to_num(), before.nan_to_num())
