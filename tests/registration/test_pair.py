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


def _rigid(seed: int) -> torch.Tensor:
    from pointalign import transforms

    g = torch.Generator().manual_seed(seed)
    return transforms.make(transforms.so3_exp(0.3 * torch.randn(3, generator=g,
                                                                dtype=torch.float64)),
                           torch.randn(3, generator=g, dtype=torch.float64))


def test_recentre_is_the_frames_move_to_local():
    """recentre(T, c, c) (on the device, for an init given there) is Frame.to_local (the
    host's matrix products), to float64 rounding; with a = -c, b = -c it goes back."""
    from pointalign.registration._pair import Frame, recentre

    T = torch.stack([_rigid(4), _rigid(5)])
    c = 100.0 * torch.randn(2, 3, generator=torch.Generator().manual_seed(6),
                            dtype=torch.float64)
    local = recentre(T, c, c)
    np.testing.assert_allclose(local.numpy(), Frame(c.numpy()).to_local(T.numpy()),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(recentre(local, -c, -c), T, rtol=0, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("batched", [False, True])
def test_an_init_on_the_device_is_moved_to_the_local_frame_there(batched):
    """An init given on the GPU is not read before the device starts: its local form is made
    there, and the host part brings both back; they equal the host path's (float64)."""
    s, t = (x.cuda() for x in _clouds())
    dev = torch.device("cuda")
    T = torch.stack([_rigid(0), _rigid(1)]) if batched else _rigid(0)
    src = torch.stack([s, s]) if batched else s
    on_host = _edge.prepare_pair(src, t, init=T.numpy(), device=dev)
    on_dev = _edge.prepare_pair(src, t, init=T.cuda(), device=dev, defer=True)
    assert on_dev.init_device is not None and "host" not in vars(on_dev)
    assert torch.equal(on_dev.init_on_device().cpu(), torch.from_numpy(on_dev.init))
    assert np.array_equal(on_dev.init_world, on_host.init_world)
    np.testing.assert_allclose(on_dev.init, on_host.init, rtol=0, atol=1e-12)
    assert np.array_equal(on_dev.frame.center, on_host.frame.center)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["nan", "skew"])
def test_a_bad_init_on_the_device_raises_when_the_host_part_is_read(bad):
    s, t = (x.cuda() for x in _clouds())
    T = _rigid(2)
    if bad == "nan":
        T[0, 3] = float("nan")
    else:
        T[0, 1] += 0.1
    T = T.cuda()
    kept = T.clone()
    message = "init: 1 rows contain NaN" if bad == "nan" else "not a rigid transform"
    with pytest.raises(ValueError, match=message):
        _edge.prepare_pair(s, t, init=T, device=torch.device("cuda"))
    pair = _edge.prepare_pair(s, t, init=T, device=torch.device("cuda"), defer=True)
    with pytest.raises(ValueError, match=message):
        pair.resolve()
    assert torch.equal(T.nan_to_num(), kept.nan_to_num())  # the input is not modified


@pytest.mark.gpu
def test_icp_with_a_caller_index_and_an_init_on_the_device():
    """The centre a caller's index is searched from, and the init, stay on the device: the
    same result as with the init on the host."""
    import pointalign as pa

    s, t = (x.cuda() for x in _clouds())
    index = pa.search.build_index(t)
    T = torch.eye(4, dtype=torch.float64)
    T[:3, 3] = torch.tensor([0.004, -0.003, 0.002])  # a small slip to undo
    kw = dict(max_correspondence_distance=0.05, method="point_to_plane", index=index)
    a = pa.icp(s, t, init=T.numpy(), **kw)
    b = pa.icp(s, t, init=T.cuda(), **kw)
    assert a.iterations == b.iterations and a.stop_reason == b.stop_reason
    np.testing.assert_allclose(a.transformation, b.transformation, rtol=0, atol=1e-9)
