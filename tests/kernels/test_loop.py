"""The device-loop executor: eager and graph runs give the same records; keys cannot drift.

Eager runs on every backend's device (graphs off); CUDA graphs on the "triton" backend only
(``-m gpu``).
"""

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch

from pointalign.kernels import _loop
from tests._backends import backends, selected


@dataclass(frozen=True)
class Affine:
    """x ← a·x + b (per entry); records x before the update, its sum and a flag."""

    graph_safe: ClassVar[bool] = True
    a: float
    b: float

    def __call__(self, inputs, state):
        x = state["x"]
        new = self.a * x + self.b * inputs["w"]
        return {"x": new}, {"x": x, "total": x.sum(), "big": (x.abs() > 1).any()}


@dataclass(frozen=True)
class Syncing(Affine):
    """Reads the device on the host: cannot be captured."""

    graph_safe: ClassVar[bool] = False

    def __call__(self, inputs, state):
        if float(state["x"].sum()) > 1e30:
            raise AssertionError("unreachable")
        return super().__call__(inputs, state)


def _expected(x0, w, a, b, n):
    out, x = [], x0.double().clone()
    for _ in range(n):
        out.append(x.clone())
        x = a * x + b * w.double()
    return out


def _collect(run, stop_after=None):
    recs = []
    for r in run:
        recs.append(r)
        if stop_after is not None and len(recs) == stop_after:
            break
    return recs


def _inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ({"w": torch.randn(5, generator=g).to(device)},
            {"x": torch.randn(5, generator=g).to(device)})


def test_eager_records_every_step_in_order(backend, monkeypatch):
    monkeypatch.setattr(_loop, "USE_GRAPHS", False)
    inputs, state = _inputs(backend.device)
    run = _loop.iterate(Affine(0.5, 1.0), inputs, state, max_steps=6)
    recs = _collect(run)
    want = _expected(state["x"], inputs["w"], 0.5, 1.0, 6)
    assert len(recs) == 6 and run.launched == 6 and run.graph == "off"
    for r, w in zip(recs, want, strict=True):
        np.testing.assert_allclose(r["x"], w.cpu().numpy(), rtol=1e-6)
        assert r["total"].shape == () and r["big"].dtype == bool
        assert bool(r["big"]) == bool((w.abs() > 1).any())


def test_eager_stops_when_the_consumer_stops_and_leaves_inputs_alone(backend, monkeypatch):
    monkeypatch.setattr(_loop, "USE_GRAPHS", False)
    inputs, state = _inputs(backend.device)
    x0 = state["x"].clone()
    run = _loop.iterate(Affine(0.5, 1.0), inputs, state, max_steps=50)
    assert len(_collect(run, stop_after=3)) == 3
    # on the CPU nothing is launched ahead; on a GPU one step is in flight while the host
    # reads the last record
    assert run.launched == (4 if backend.device == "cuda" else 3)
    assert torch.equal(state["x"], x0)


def test_signature_follows_every_field_and_shape():
    inputs, state = _inputs("cpu")
    k1, _ = _loop.signature(Affine(0.5, 1.0), inputs, state)
    assert k1 == _loop.signature(Affine(0.5, 1.0), inputs, state)[0]
    assert k1 != _loop.signature(Affine(0.5, 2.0), inputs, state)[0]
    assert k1 != _loop.signature(Affine(0.5, 1.0), {"w": torch.zeros(6)}, state)[0]
    assert k1 != _loop.signature(Syncing(0.5, 1.0), inputs, state)[0]


def test_signature_names_objects_by_identity_and_refuses_tensors():
    @dataclass(frozen=True)
    class WithObject:
        obj: object

    @dataclass(frozen=True)
    class WithTensor:
        t: object

    a, b = object(), object()
    ka, objs = _loop.signature(WithObject(a))
    assert objs == [a] and ka != _loop.signature(WithObject(b))[0]
    with pytest.raises(TypeError, match="tensor"):
        _loop.signature(WithTensor(torch.zeros(1)))
    with pytest.raises(TypeError, match="frozen dataclass"):
        _loop.signature(lambda i, s: (s, s))


class Table:
    """An object a step reads tensors from, keyed by their layout (as a KDTreeIndex)."""

    def __init__(self, w):
        self.w = w

    def graph_arrays(self):
        return ("Table", tuple(self.w.shape)), {"w": self.w}

    def with_arrays(self, arrays):
        return Table(arrays["w"])


@dataclass(frozen=True)
class AddTable:
    """x ← x + table.w; records x before the update."""

    graph_safe: ClassVar[bool] = True
    tables: tuple

    def __call__(self, inputs, state):
        x = state["x"]
        return {"x": x + self.tables[0].w + self.tables[-1].w}, {"x": x}


def test_signature_keys_array_objects_by_layout_and_place():
    a, b, c = Table(torch.zeros(3)), Table(torch.ones(3)), Table(torch.zeros(4))
    ka, objs = _loop.signature(AddTable((a, a)), by_arrays=True)
    assert objs == [] and ka == _loop.signature(AddTable((b, b)), by_arrays=True)[0]
    assert ka != _loop.signature(AddTable((a, b)), by_arrays=True)[0]  # shared, or not
    assert ka != _loop.signature(AddTable((c, c)), by_arrays=True)[0]  # another layout
    kid, objs = _loop.signature(AddTable((a, a)))  # by identity unless asked
    assert objs == [a, a] and kid != _loop.signature(AddTable((b, b)))[0]


def test_array_objects_are_swapped_once_each_in_field_order():
    a, b = Table(torch.zeros(3)), Table(torch.ones(3))
    made = []

    def swap(obj):
        made.append(obj)
        return Table(obj.w.clone())

    shared = _loop._with_arrays(AddTable((a, a)), swap, {})
    assert made == [a] and shared.tables[0] is shared.tables[1] is not a
    made.clear()
    two = _loop._with_arrays(AddTable((b, a)), swap, {})
    assert made == [b, a] and two.tables[0] is not two.tables[1]
    assert list(_loop._array_objects(AddTable((b, a, b)), {}).values()) == [b, a]


@dataclass(frozen=True)
class Countdown:
    """A fixed program: n halvings with an early stop once every entry is below tol."""

    n: int
    tol: float

    def __call__(self, inputs, checkpoint):
        x = inputs["x"].clone()
        steps = torch.zeros((), dtype=torch.int64, device=x.device)
        for _ in range(self.n):
            x = torch.where(x.abs() < self.tol, x, 0.5 * x)
            steps = steps + 1
            if checkpoint(x.abs() < self.tol):
                break
        return {"x": x, "steps": steps}


def test_program_stops_early_when_eager(backend, monkeypatch):
    monkeypatch.setattr(_loop, "USE_GRAPHS", False)
    x = torch.tensor([1.0, -2.0], device=backend.device)
    host, dev = _loop.run_program(Countdown(100, 1e-3), {"x": x})
    assert int(host["steps"]) == 11 and np.all(np.abs(host["x"]) < 1e-3)
    assert torch.equal(dev["steps"].cpu(), torch.tensor(11))


def test_to_host_round_trip_keeps_dtypes():
    t = {"f": torch.tensor([[1.5, 2.0]]), "i": torch.tensor([3, -4]), "b": torch.tensor([True]),
         "d": torch.tensor(2.0**40 + 1, dtype=torch.float64)}
    h = _loop.to_host(t)
    assert h["f"].shape == (1, 2) and h["i"].dtype == np.int64 and h["b"].dtype == bool
    assert int(h["i"][1]) == -4 and float(h["d"]) == 2.0**40 + 1


# ---- CUDA graphs --------------------------------------------------------------------------

def _graph_run(step, inputs, state, n, stop_after=None):
    run = _loop.iterate(step, inputs, state, max_steps=n)
    return run, _collect(run, stop_after)


@backends("triton")
def test_graph_policy_and_equality(backend, monkeypatch):
    monkeypatch.setattr(_loop, "USE_GRAPHS", True)
    _loop.clear_caches()
    inputs, state = _inputs(backend.device)
    step = Affine(0.9, 0.1)
    want = [w.cpu().numpy() for w in _expected(state["x"], inputs["w"], 0.9, 0.1, 20)]
    first, recs = _graph_run(step, inputs, state, 20)
    assert first.graph == "captured"  # step 1 eager, then a one-step graph
    second, recs2 = _graph_run(step, inputs, state, 20)
    assert second.graph == "captured"  # the kept CHUNK-step graph
    third, recs3 = _graph_run(step, inputs, state, 20)
    assert third.graph == "reused"
    for rs in (recs, recs2, recs3):
        assert len(rs) == 20
        for r, w in zip(rs, want, strict=True):
            np.testing.assert_allclose(r["x"], w, rtol=1e-5, atol=1e-6)
    # a stop inside a chunk discards the rest of it; new inputs are copied into the graph
    inputs2, state2 = _inputs(backend.device, seed=1)
    fourth, recs4 = _graph_run(step, inputs2, state2, 20, stop_after=5)
    assert fourth.graph == "reused" and fourth.launched == _loop.CHUNK and len(recs4) == 5
    want2 = _expected(state2["x"], inputs2["w"], 0.9, 0.1, 5)
    for r, w in zip(recs4, want2, strict=True):
        np.testing.assert_allclose(r["x"], w.cpu().numpy(), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(_loop, "USE_GRAPHS", False)
    off, recs5 = _graph_run(step, inputs, state, 20)
    assert off.graph == "off"
    for a, b in zip(recs5, recs3, strict=True):
        np.testing.assert_allclose(a["x"], b["x"], rtol=1e-6)


@backends("triton")
def test_ahead_launches_the_next_chunk_before_the_records(backend, monkeypatch):
    """``ahead`` True: the next chunk is enqueued before the consumer reads the first
    record of a chunk (so the device runs it meanwhile); False or none: after. The records
    are the same; a stop discards what ran ahead."""
    monkeypatch.setattr(_loop, "USE_GRAPHS", True)
    _loop.clear_caches()
    inputs, state = _inputs(backend.device)
    step = Affine(0.9, 0.1)
    for _ in range(2):  # capture the kept chunk graph
        _graph_run(step, inputs, state, 20)
    seen = {}
    for label, hint in (("none", None), ("no", lambda a, b: False), ("yes", lambda a, b: True)):
        run = _loop.iterate(step, inputs, state, max_steps=3 * _loop.CHUNK, ahead=hint)
        recs, launched = [], []
        for r in run:
            recs.append(r)
            launched.append(run.launched)
            if len(recs) == _loop.CHUNK + 1:
                break
        assert run.graph == "reused"
        ahead = label == "yes"
        assert launched[0] == (2 if ahead else 1) * _loop.CHUNK
        assert launched[_loop.CHUNK] == (3 if ahead else 2) * _loop.CHUNK
        seen[label] = np.stack([r["x"] for r in recs])
    np.testing.assert_array_equal(seen["yes"], seen["none"])
    np.testing.assert_array_equal(seen["no"], seen["none"])


@backends("triton")
def test_kept_graph_reads_each_calls_array_objects(backend, monkeypatch):
    """Calls with other objects of one layout share the kept graph; each replay reads the
    call's arrays (copied into the graph's own), never the capturing call's."""
    monkeypatch.setattr(_loop, "USE_GRAPHS", True)
    _loop.clear_caches()
    dev = backend.device
    x0 = {"x": torch.zeros(3, device=dev)}
    runs = []
    for w in (1.0, 2.0, 3.0, -1.0):
        t = Table(torch.full((3,), w, device=dev))
        keep = t.w.clone()
        run, recs = _graph_run(AddTable((t, t)), {"u": torch.zeros(1, device=dev)}, x0, 12)
        runs.append(run.graph)
        np.testing.assert_allclose([r["x"][0] for r in recs], [2 * w * j for j in range(12)])
        assert torch.equal(t.w, keep)  # the caller's arrays are not written
    assert runs == ["captured", "captured", "reused", "reused"]


@backends("triton")
def test_capture_failure_falls_back_to_eager(backend):
    @dataclass(frozen=True)
    class Sneaky(Affine):
        graph_safe: ClassVar[bool] = True  # claims so, but reads the device

        def __call__(self, inputs, state):
            _ = float(state["x"].sum())
            return super().__call__(inputs, state)

    _loop.clear_caches()
    inputs, state = _inputs(backend.device)
    run, recs = _graph_run(Sneaky(0.9, 0.1), inputs, state, 6)
    assert len(recs) == 6 and run.graph not in ("captured", "reused", "off")
    want = _expected(state["x"], inputs["w"], 0.9, 0.1, 6)
    np.testing.assert_allclose(recs[-1]["x"], want[-1].cpu().numpy(), rtol=1e-5)
    # a step that declares it reads the device is never captured
    run2, _ = _graph_run(Syncing(0.9, 0.1), inputs, state, 4)
    assert run2.graph == "off"


@backends("triton")
def test_program_is_one_graph_and_matches_eager(backend):
    _loop.clear_caches()
    x = torch.tensor([1.0, -2.0, 0.25], device=backend.device)
    with selected("torch"):  # the eager reference on the host, whatever the backend
        eager, _ = _loop.run_program(Countdown(40, 1e-3), {"x": x.cpu()})
    for _ in range(3):  # warm-up + capture, then replays
        host, _ = _loop.run_program(Countdown(40, 1e-3), {"x": x})
    # the graph cannot stop early: it runs all 40 steps, with the same masked result
    assert int(host["steps"]) == 40
    np.testing.assert_allclose(host["x"], eager["x"], rtol=1e-6)


@backends("triton")
def test_program_eager_first_then_one_graph_and_inline_in_a_capture(backend):
    """``eager_first``: a signature's first call runs eagerly (the early stop is taken),
    later calls replay its graph (all steps); a program called inside another capture
    runs into that graph."""
    _loop.clear_caches()
    x = torch.tensor([1.0, -2.0, 0.25], device=backend.device)
    steps = [int(_loop.run_program(Countdown(40, 1e-3), {"x": x}, eager_first=True)[0]
                 ["steps"]) for _ in range(3)]
    assert steps == [11, 40, 40]
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        try:
            host, out = _loop.run_program(Countdown(30, 1e-3), {"x": static},
                                          host_outputs=False)
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    assert host == {}
    static.copy_(x * 4)
    graph.replay()
    torch.cuda.synchronize()
    want = Countdown(30, 1e-3)({"x": (x * 4).cpu()}, lambda done: False)
    assert int(out["steps"]) == 30
    np.testing.assert_allclose(out["x"].cpu().numpy(), want["x"].numpy(), rtol=1e-6)


def test_clock_charges_each_stage_and_totals(backend):
    """Stage seconds add up per name, stay within the total, and (CUDA) time the work.

    On CUDA a boundary records an event instead of waiting: the stage that runs a kernel
    of known length (``torch.cuda._sleep``) is charged at least most of it, and the
    host got past the boundary before the kernel ended.
    """
    import time

    dev = torch.device(backend.device)
    clock = _loop.Clock(dev)
    x = torch.ones(1000, device=dev)
    out = clock.stage("add", torch.add, x, 1.0)
    if dev.type == "cuda":
        t0 = time.perf_counter()
        clock.stage("sleep", torch.cuda._sleep, 10**8)  # >= 33 ms below 3 GHz
        enqueued = time.perf_counter() - t0
    else:
        clock.stage("sleep", time.sleep, 0.05)
    clock.lap(None)
    clock.stage("add", torch.add, out, 1.0)
    timings = clock.total()
    assert set(timings) == {"add", "sleep", "total"}
    assert timings["sleep"] >= 0.03
    assert 0 <= timings["add"] and timings["add"] + timings["sleep"] <= timings["total"]
    if dev.type == "cuda":
        assert enqueued < 0.02  # no wait at the boundaries


def test_beside_runs_its_work_and_join_returns_it(backend):
    """On any device the result is the function's; joined, it is usable on the caller's
    stream (CUDA: the work was enqueued on the second stream, after the caller's)."""
    dev = torch.device(backend.device)
    x = torch.arange(6.0, device=dev)
    beside = _loop.Beside(dev)
    out = beside(lambda a, scale: {"y": a * scale, "n": [a.sum()]}, x, scale=3.0)
    got = beside.join(out)
    assert got is out
    np.testing.assert_array_equal(got["y"].cpu().numpy(), 3.0 * np.arange(6.0))
    assert float(got["n"][0]) == 15.0
    assert (beside.stream is not None) == (dev.type == "cuda")


@pytest.mark.gpu
def test_beside_orders_both_ways_around_a_long_kernel():
    """The work beside waits for what the caller enqueued first (a long sleep, then a
    write), and the caller's next use waits for it: no race either way."""
    dev = torch.device("cuda")
    x = torch.zeros(1 << 20, device=dev)
    torch.cuda._sleep(10**7)
    x.fill_(2.0)  # enqueued on the caller's stream behind the sleep
    beside = _loop.Beside(dev)
    y = beside(torch.mul, x, 5.0)
    torch.cuda._sleep(10**7)  # the caller's stream goes on meanwhile
    y = beside.join(y)
    z = y + 1.0
    torch.cuda.synchronize()
    assert float(z.min()) == 11.0 and float(z.max()) == 11.0
    off = _loop.CONCURRENT
    try:
        _loop.CONCURRENT = False
        assert _loop.Beside(dev).stream is None
    finally:
        _loop.CONCURRENT = off


@pytest.mark.gpu
def test_current_stream_is_torchs_inside_and_outside_a_stream_context():
    """The kept Stream objects name the stream PyTorch would: the default one, a side
    stream while it is current (with the device given as an index, a name or a device),
    and the default one again after it."""
    dev = torch.device("cuda")
    for d in (dev, "cuda", torch.cuda.current_device()):
        assert _loop.current_stream(d) == torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        assert _loop.current_stream(dev) == side == torch.cuda.current_stream(dev)
    assert _loop.current_stream(dev) == torch.cuda.current_stream(dev) != side
    assert _loop.current_stream(dev) is _loop.current_stream(dev)  # kept, not rebuilt
