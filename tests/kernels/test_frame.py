"""kernels.frame.local_frame (the pair's local frame) against its reference
``local_frame_reference`` (``kernels/frame/reference.py``), by backend and through the
Triton interpreter.

Exactness: the spec takes ``torch.mean`` in float64; the Triton kernels sum blocks of rows
relative to each cloud's first row in float64 and add the blocks in a fixed order. The
centroids and radii are float64 sums of the same numbers grouped differently: equal to a
few float64 roundings of the cloud's coordinates (a relative 1e-13 of their magnitude here,
far below float32's 6e-8). The float32 clouds are ``float32(x − c)``: where the centroids'
last bits differ, a row differs by that difference and one float32 rounding, never more.
On the "torch" and "cpu" backends the entry point is the spec (the same bits).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointalign.kernels import _backend
from pointalign.kernels import frame as kframe
from pointalign.kernels.frame.reference import local_frame_reference
from tests._interpreted import interpreted_fixture

#: (seed, B, Bt, N, M, dtype, local, offset): one cloud each, a shared target with short
#: entries, batches with one-point entries, UTM-like float64, blocks of a 4096-row kernel
CASES = [(0, 1, 1, 1000, 1500, torch.float32, True, 0.0),
         (1, 3, 1, 700, 900, torch.float32, False, 100.0),
         (2, 3, 3, 9000, 20, torch.float32, True, 1e3),
         (3, 1, 1, 5000, 4097, torch.float64, True, 5e5),
         (4, 2, 2, 1, 3, torch.float32, True, -7.0)]


def _case(seed, B, Bt, N, M, dtype, local, offset):
    g = np.random.default_rng(seed)
    s = torch.from_numpy(g.normal(size=(B, N, 3)) * 3 + offset).to(dtype)
    t = torch.from_numpy(g.normal(size=(Bt, M, 3)) + offset).to(dtype)
    sl = torch.from_numpy(g.integers(1, N + 1, B)) if B > 1 else torch.tensor([N])
    tl = torch.from_numpy(g.integers(1, M + 1, Bt)) if Bt > 1 else torch.tensor([M])
    if B > 1:
        sl[0] = 1  # a one-point source: radius 0
    return s, sl, sl.numpy(), t, tl, tl.numpy(), local


def _check(got, case):
    s, sl, sc, t, tl, tc, local = _case(*case)
    want = local_frame_reference(s, sl, sc, t, tl, tc, local)
    scale = float(t.abs().max() + s.abs().max())
    torch.testing.assert_close(got[2].cpu(), want[2], rtol=1e-13, atol=1e-13 * scale)
    # float32(x − c') against float32(x − c): the shifts' difference, then one rounding
    dc = float((got[2][:, :3].cpu() - want[2][:, :3]).abs().max())
    for g, w in zip(got[:2], want[:2], strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape
        ulp = torch.finfo(torch.float32).eps * w.abs().clamp_min(torch.finfo(torch.float32).tiny)
        assert bool(((g.cpu() - w).abs() <= ulp + dc).all())


@pytest.mark.parametrize("case", CASES, ids=[str(c[0]) for c in CASES])
def test_local_frame_matches_reference(backend, case):
    s, sl, sc, t, tl, tc, local = _case(*case)
    dev = backend.device
    before = s.clone(), t.clone()
    got = kframe.local_frame(s.to(dev), sl.to(dev), sc, t.to(dev), tl.to(dev), tc,
                             local=local)
    _check(got, case)
    assert torch.equal(s, before[0]) and torch.equal(t, before[1])  # inputs untouched


def test_reference_meaning():
    """The spec itself: the host row's columns mean what the contract says."""
    s, sl, sc, t, tl, tc, _ = _case(*CASES[1])
    src, tgt, host = local_frame_reference(s, sl, sc, t, tl, tc, True)
    t64 = t[0].double()
    c = t64.mean(0)
    torch.testing.assert_close(host[:, :3], c.expand(3, 3))
    torch.testing.assert_close(host[:, 3], ((t64 - c) ** 2).sum(1).mean().sqrt().expand(3))
    assert bool((host[:, 4:7] == 0).all())
    for b in range(3):
        x = s[b, : sl[b]].double()
        want = ((x - x.mean(0)) ** 2).sum(1).mean().sqrt()
        torch.testing.assert_close(host[b, 7], want)
    assert float(host[0, 7]) == 0.0  # one point
    torch.testing.assert_close(tgt[0], (t64 - c).float())
    torch.testing.assert_close(src, (s.double() - c).float())


def test_bad_shapes():
    s, t = torch.zeros(2, 5, 3), torch.zeros(3, 5, 3)
    lens = torch.full((2,), 5)
    with pytest.raises(ValueError, match="local_frame: expected"):
        kframe.local_frame(s, lens, lens.numpy(), t, torch.full((3,), 5), np.full(3, 5))


def test_mismatched_devices():
    """Lengths on another device than the points: a clear error before any work (the meta
    device stands for a GPU here)."""
    s, sl, sc, t, tl, tc, _ = _case(*CASES[0])
    with pytest.raises(ValueError, match="different devices"):
        kframe.local_frame(s, sl, sc, t, tl.to("meta"), tc)


@pytest.mark.parametrize("cloud,bad", [("target", float("inf")), ("source", float("nan")),
                                       ("source", float("inf"))])
def test_non_finite_reaches_the_host_row(backend, cloud, bad):
    """A NaN or Inf row makes its problem's numbers non-finite (prepare_pair then scans):
    a source's too, whose only trace is its radius (a max with 0 must keep the NaN)."""
    s, sl, sc, t, tl, tc, _ = _case(*CASES[0])
    x = (s if cloud == "source" else t).clone()
    x[0, 7, 1] = bad
    s, t = (x, t) if cloud == "source" else (s, x)
    dev = backend.device
    host = kframe.local_frame(s.to(dev), sl.to(dev), sc, t.to(dev), tl.to(dev), tc)[2]
    assert not bool(torch.isfinite(host).all())


def run_interpreted_frame(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the Triton kernels through the dispatcher."""
    assert _backend.backend(torch.empty(0)) == "interpret"
    out = {case[0]: kframe.local_frame(*_case(*case)[:6], local=case[6]) for case in CASES}
    s, sl, sc, t, tl, tc, _ = _case(*CASES[0])
    s = s.clone()
    s[0, 7, 1] = float("nan")
    out["nan"] = kframe.local_frame(s, sl, sc, t, tl, tc)[2]
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.kernels.test_frame", "run_interpreted_frame")


@pytest.mark.parametrize("case", CASES, ids=[str(c[0]) for c in CASES])
def test_triton_interpreted_matches_reference(interpreted, case):
    _check(interpreted[case[0]], case)


def test_triton_interpreted_non_finite(interpreted):
    assert not bool(torch.isfinite(interpreted["nan"]).all())
