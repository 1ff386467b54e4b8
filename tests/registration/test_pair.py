"""prepare_pair: the pair's host part (frame, extents) read once, now or at its first use."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointalign import datasets
from pointalign.registration import _edge


def _clouds():
    p = datasets.make_pair(datasets.random_subsample(datasets.load_bunny("bun000"), 500, 0),
                           10.0, 0.02, seed=0)
    return p.source + 30.0, p.target + 30.0  # far from the origin: a frame that matters


def test_deferred_host_part_is_the_eager_one():
    s, t = _clouds()
    eager = _edge.prepare_pair(s, t, init=None, device=torch.device("cpu"))
    lazy = _edge.prepare_pair(s, t, init=None, device=torch.device("cpu"), defer=True)
    assert "host" not in vars(lazy)  # not read yet
    assert torch.equal(lazy.source, eager.source) and torch.equal(lazy.target, eager.target)
    assert lazy.resolve() is lazy and "host" in vars(lazy)
    for name in ("init", "init_world", "extent", "centroid", "resolution", "source_extent"):
        assert np.array_equal(getattr(lazy, name), getattr(eager, name)), name
    assert np.array_equal(lazy.frame.center, eager.frame.center)
    assert np.allclose(lazy.frame.center[0], t.double().mean(0).numpy())


@pytest.mark.parametrize("name", ["source", "target"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_point_raises_when_the_host_part_is_read(name, bad):
    s, t = _clouds()
    x = (s if name == "source" else t).clone()
    x[7, 2] = bad
    kept = x.clone()
    args = (x, t) if name == "source" else (s, x)
    with pytest.raises(ValueError, match=f"{name}: 1 rows contain NaN or Inf"):
        _edge.prepare_pair(*args, init=None, device=torch.device("cpu"))
    pair = _edge.prepare_pair(*args, init=None, device=torch.device("cpu"), defer=True)
    with pytest.raises(ValueError, match=f"{name}: 1 rows contain NaN or Inf"):
        pair.resolve()
    assert torch.equal(x.nan_to_num(), kept.nan_to_num())  # the input is not modified


def test_the_first_error_is_the_scans_order():
    """A NaN source and a malformed target: the source's scan speaks first, as when the
    scans ran before anything else."""
    s, t = _clouds()
    s = s.clone()
    s[0, 0] = float("nan")
    with pytest.raises(ValueError, match="source: 1 rows contain NaN"):
        _edge.prepare_pair(s, t[:, :2], init=None, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="target: expected shape"):
        _edge.prepare_pair(s[1:], t[:, :2], init=None, device=torch.device("cpu"))
