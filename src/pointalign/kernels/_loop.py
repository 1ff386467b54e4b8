"""The one device-loop executor: *how* an algorithm's steps run, never *what* they compute.

An iterative algorithm is written as a **step** and **stopping rules**:

* the step is a frozen dataclass whose fields are every constant it reads (its signature)
  and whose ``__call__(inputs, state) -> (state, record)`` enqueues one iteration on the
  device: ``inputs`` are the tensors that stay fixed over the loop (points, normals,
  lengths), ``state`` the tensors the iteration carries (the estimate, hints), ``record``
  the small tensors the host reads (sums, the update, flags). All three are dicts of
  tensors; the state keeps its keys, shapes and dtypes from step to step;
* the rules are plain host code over each step's record (NumPy arrays)::

      for record in loop.iterate(step, inputs, state, max_steps=n):
          if rules(record):
              break

Everything else (eager launches or CUDA-graph replay, streams, lookahead, transfers,
caches) is decided here, from the backend of the inputs (``kernels/_backend.py``).
Steps computed past the consumer's stop are discarded (``Run.launched`` counts them).

**Eager** (the PyTorch references on the CPU, the Triton interpreter, steps that read the
device on the host, ``POINTALIGN_CUDA_GRAPHS=0``): one step, then its record, checked
before the next. On a GPU the next step is launched before the last record is read, so
the device works while the host checks (graph-safe steps only: a step that reads the device
has waited for it already, and a step ahead would be wasted at every stop).

**Graphs** (Triton on CUDA; :func:`iterate` only, per :func:`signature`):

============================  =========================================================
what the cache holds           what this call does
============================  =========================================================
nothing for the signature      step 1 eager (compiles every kernel), then a 1-step graph is
                               captured on the call's own tensors and replayed, one step
                               in flight; the signature is marked seen
seen                           a ``CHUNK``-step graph (the step's ``chunk``, if it says) is
                               captured on copies of the inputs
                               (after a warm-up step) and kept (LRU of ``CACHE_SIZE``)
a kept graph                   the inputs are copied in; chunks of ``CHUNK`` steps are
                               replayed, each checked before the next
a failed capture               eager from then on; ``Run.graph`` says why
============================  =========================================================

Near ``max_steps`` a kept chunk is replayed whole while at least half of it is used
(surplus steps are discarded), else single steps run eagerly. A captured graph ends by
copying its final state back into its own state buffers, so a replay costs no copies
after a replay.

The signature is derived from the step's fields, never written by hand, so a new
constant cannot be left out of the key: numbers, strings and tuples by value, other
objects by identity, held weakly (the kept graph goes with the object). An object that
offers ``graph_arrays() -> (key, arrays)`` and ``with_arrays(arrays)`` (a search index:
:class:`~pointalign.search.kdtree.KDTreeIndex`,
:class:`~pointalign.search.brute.BruteForceIndex`) is keyed by its key, the shapes of what
a graph reads of it: a kept graph captures over its own copy of the object's arrays, and
a later call with another such object copies that object's arrays in, as it copies the
inputs (each ICP call builds a new index over its target; same-sized targets share the
graph). A step field may not be a tensor: tensors go in ``inputs``/``state``.

Fixed-length programs with no host decision inside (annealing schedules: EM-ICP,
Softassign) go through :func:`run_program`: the whole program is one CUDA graph per
signature on Triton, and its outputs come back in one transfer. A program may offer the
executor an early stop with ``checkpoint(done)``; it is honoured when running eagerly.

Not thread-safe: drive one device from one thread.
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from pointalign.kernels._backend import backend

Tensors = dict[str, torch.Tensor]
Host = dict[str, np.ndarray]

#: replay loops from CUDA graphs where the backend allows (``POINTALIGN_CUDA_GRAPHS=0``: never)
USE_GRAPHS = True
#: eager steps a call of an unseen signature launches before capturing its one-step graph
EAGER_STEPS = 1
#: steps per replay of a kept graph (iterate)
CHUNK = 8
#: kept graphs (iterate) and kept programs (run_program), least recently used dropped first
CACHE_SIZE = 4
PROGRAM_CACHE_SIZE = 16
#: above this many point pairs per pass a launch is negligible next to the pass: programs
#: run eagerly (no graph memory held for no gain)
PROGRAM_GRAPH_MAX_PAIRS = 4e9


class Step(Protocol):
    """One iteration of an algorithm; a frozen dataclass of everything it reads."""

    #: False for a step that reads the device on the host (it then always runs eagerly)
    graph_safe: ClassVar[bool]
    #: steps per replay of its kept graph (default :data:`CHUNK`): fewer for a loop that
    #: usually stops within a step or two, whose surplus steps would be wasted device work
    chunk: ClassVar[int]

    def __call__(self, inputs: Tensors, state: Tensors) -> tuple[Tensors, Tensors]:
        """Enqueue one iteration: ``(inputs, state) -> (next state, record)``."""
        ...


_current: dict[tuple[int, int, int], torch.cuda.Stream] = {}  # (by its C-layer identity)


def current_stream(device: torch.device | str | int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)``, without building a new Stream object a call.

    The stream's identity is read from PyTorch's C layer (~0.3 us) and its Python object
    kept: ``torch.cuda.current_stream`` builds one each call (~8-10 us on the device's
    hosts), and a register() call asked ~35 times (Clock laps, transfers).
    """
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    read = getattr(torch._C, "_cuda_getCurrentStream", None)
    if read is None:  # (another PyTorch: the public call)
        return torch.cuda.current_stream(index)
    key = tuple(read(index))
    stream = _current.get(key)
    if stream is None:
        stream = _current[key] = torch.cuda.current_stream(index)
    return stream


def graphs_enabled(x: torch.Tensor) -> bool:
    """Tell whether loops over tensors like ``x`` replay CUDA graphs (Triton on CUDA)."""
    return (USE_GRAPHS and backend(x) == "triton"
            and os.environ.get("POINTALIGN_CUDA_GRAPHS", "1") != "0")


def synchronize(x: torch.Tensor | torch.device) -> None:
    """Wait for the device of ``x`` (a no-op on the CPU)."""
    dev = x.device if isinstance(x, torch.Tensor) else torch.device(x)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Clock:
    """Seconds per named stage, without making the host wait at each boundary.

    Either time a call with :meth:`stage`, or charge the time since the last boundary with
    :meth:`lap`; :meth:`total` adds ``"total"`` since the clock was made. On CUDA a
    boundary records a timing event on the current stream (no synchronisation: the host
    goes on enqueueing the next stage while the device runs this one), and a stage's
    seconds are the device's between its two events: its kernels and any wait for the
    host's launches. They are read, with one wait for the last event, when
    :attr:`timings` is next asked. Elsewhere host seconds between the boundaries.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._timings: dict[str, float] = {}
        self._cuda = torch.device(device).type == "cuda"
        self._pending: list[tuple[str, Any, Any]] = []  # (stage, start event, end event)
        self._t0 = self._last = time.perf_counter()
        self._mark = self._event() if self._cuda else None

    def _event(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(current_stream(self.device))
        return ev

    def stage(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` as stage ``name`` (times of a repeated name add up)."""
        self.lap(None)
        out = fn(*args, **kwargs)
        self.lap(name)
        return out

    def lap(self, name: str | None) -> None:
        """Charge the time since the last boundary to ``name`` (None: to nothing)."""
        if self._cuda:
            mark = self._event()
            if name is not None:
                self._pending.append((name, self._mark, mark))
            self._mark = mark
            return
        now = time.perf_counter()
        if name is not None:
            self._timings[name] = self._timings.get(name, 0.0) + now - self._last
        self._last = now

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per stage so far (on CUDA: waits for the last boundary's event)."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for name, start, end in self._pending:
                self._timings[name] = self._timings.get(name, 0.0) \
                    + start.elapsed_time(end) / 1e3
            self._pending.clear()
        return self._timings

    def total(self) -> dict[str, float]:
        """Return the stage timings plus ``"total"``: seconds since the clock was made."""
        synchronize(self.device)
        timings = self.timings
        timings["total"] = time.perf_counter() - self._t0
        return timings


class Beside:
    """Run independent work beside what the caller enqueues next (a second CUDA stream).

    ``out = beside(fn, *args)`` enqueues ``fn``'s device work on a second stream of the
    device, which first waits for everything the caller enqueued so far; the caller then
    enqueues its own work, which the device may run at the same time, and
    ``beside.join(out)`` makes the caller's stream wait for ``fn``'s before ``out`` is
    used. Latency-bound work (a k-d tree build's short launches) then fills the device
    around another stream's. The host runs ``fn`` at once either way; elsewhere than on
    CUDA (or with :data:`CONCURRENT` off) ``fn`` simply runs and ``join`` returns ``out``.

    The tensors in ``args`` and the tensors ``join`` returns are marked as used on the
    other stream (``record_stream``), so that the allocator never hands their memory to
    new work before both streams are past them.
    """

    def __init__(self, device: torch.device | str):
        dev = torch.device(device)
        self.stream = _beside_stream(dev) if dev.type == "cuda" and CONCURRENT else None
        self.device = dev

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` with its device work on the second stream."""
        if self.stream is None:
            return fn(*args, **kwargs)
        here = current_stream(self.device)
        self.stream.wait_stream(here)
        for t in _tensors_in((args, kwargs)):
            if t.is_cuda:
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            return fn(*args, **kwargs)

    def join(self, out: Any) -> Any:
        """Make the caller's stream wait for the work run beside; return ``out``."""
        if self.stream is None:
            return out
        here = current_stream(self.device)
        here.wait_stream(self.stream)
        for t in _tensors_in(out):
            if t.is_cuda:
                t.record_stream(here)
        return out


#: :class:`Beside` runs its work on a second stream on CUDA (False: inline, for A/B runs)
CONCURRENT = True
_beside: dict[torch.device, Any] = {}


def _beside_stream(dev: torch.device) -> Any:
    if dev not in _beside:
        _beside[dev] = torch.cuda.Stream(dev)
    return _beside[dev]


def _tensors_in(x: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested tuples, lists and dicts."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors_in(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors_in(v)


# ---- signatures -------------------------------------------------------------------------

def _has_arrays(value: Any) -> bool:
    return hasattr(value, "graph_arrays") and hasattr(value, "with_arrays")


_step_fields: dict[type, tuple[dataclasses.Field, ...]] = {}  # per type, found once


def _fields_of(value: Any) -> tuple[dataclasses.Field, ...]:
    """Return the fields of ``value`` if a frozen dataclass instance (a step's part), else ().

    Kept per type: a signature walks every field of a step on every call.
    """
    kind = type(value)
    found = _step_fields.get(kind)
    if found is None:
        found = (dataclasses.fields(value) if dataclasses.is_dataclass(value)
                 and not isinstance(value, type)
                 and getattr(kind, "__dataclass_params__").frozen else ())  # noqa: B009
        _step_fields[kind] = found
    return found


def _key_of(value: Any, objects: list, arrays: dict | None = None) -> Any:
    """Return the key of a step's field (numbers by value, objects by identity).

    ``arrays`` (a dict, id -> first place): graph-array objects by their layout and place
    instead; None: by identity, as every other object.
    """
    if isinstance(value, torch.Tensor):
        raise TypeError("a step field may not be a tensor: pass it in inputs or state")
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_key_of(v, objects, arrays) for v in value)
    fields = _fields_of(value)
    if fields:
        return (type(value).__qualname__,
                tuple(_key_of(getattr(value, f.name), objects, arrays) for f in fields))
    if arrays is not None and _has_arrays(value):
        # the place tells one index shared by a batch from equal-shaped distinct ones
        return ("arrays", value.graph_arrays()[0], arrays.setdefault(id(value), len(arrays)))
    objects.append(value)
    return ("object", id(value))


def _with_arrays(value: Any, swap: Any, memo: dict) -> Any:
    """``value`` (a step, or a field of one) with each graph-array object ``o`` as ``swap(o)``.

    An object met twice (one index shared by a batch's problems) is swapped once (``memo``).
    """
    if isinstance(value, (tuple, list)):
        return type(value)(_with_arrays(v, swap, memo) for v in value)
    fields = _fields_of(value)
    if fields:
        if any(_array_objects(getattr(value, f.name), {}) for f in fields if not f.init):
            raise TypeError("a graph-array object in a field outside __init__ cannot be swapped")
        return dataclasses.replace(value, **{f.name: _with_arrays(getattr(value, f.name), swap,
                                                                  memo)
                                             for f in fields if f.init})
    if _has_arrays(value):
        if id(value) not in memo:
            memo[id(value)] = swap(value)
        return memo[id(value)]
    return value


def _array_objects(value: Any, out: dict) -> dict:
    """Collect the graph-array objects of a step into ``out``, by ``id``, each once."""
    if isinstance(value, (tuple, list)):
        for v in value:
            _array_objects(v, out)
    elif fields := _fields_of(value):
        for f in fields:
            _array_objects(getattr(value, f.name), out)
    elif _has_arrays(value):
        out.setdefault(id(value), value)
    return out


def _shapes(tensors: Tensors) -> tuple:
    return tuple((k, tuple(v.shape), v.dtype, str(v.device)) for k, v in tensors.items())


def signature(step: Any, *tensor_dicts: Tensors, by_arrays: bool = False
              ) -> tuple[tuple, list]:
    """Return the cache key of a step over tensors like ``tensor_dicts`` and the objects named.

    Returns ``(key, objects)``: the key holds the step's type, every field (numbers and
    strings by value, other objects by ``id``) and the names, shapes, dtypes and devices of
    the tensors; ``objects`` are the objects named by identity, which a cache must hold
    weakly and check on a hit. ``by_arrays``: objects offering ``graph_arrays`` are keyed
    by their key instead (the caller copies their arrays in, as :func:`iterate` does).
    """
    frozen = dataclasses.is_dataclass(step) and \
        getattr(type(step), "__dataclass_params__").frozen  # noqa: B009 (untyped attr)
    if not frozen:
        raise TypeError(f"a step must be a frozen dataclass, got {type(step).__name__}")
    objects: list = []
    key = (_key_of(step, objects, {} if by_arrays else None),) + \
        tuple(_shapes(t) for t in tensor_dicts)
    return key, objects


class _Entry:
    """A cached graph with weak references to the objects its signature names."""

    def __init__(self, objects: list, payload: Any):
        self.refs = [weakref.ref(o) for o in objects]
        self.payload = payload

    def alive_for(self, objects: list) -> bool:
        return len(self.refs) == len(objects) and all(
            r() is o for r, o in zip(self.refs, objects, strict=True))


class _Cache:
    """LRU of graphs by signature; an entry whose objects are gone is never returned."""

    def __init__(self, size: int):
        self.size = size
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()

    def get(self, key: tuple, objects: list) -> Any:
        ent = self.entries.get(key)
        if ent is None:
            return None
        if not ent.alive_for(objects):
            del self.entries[key]
            return None
        self.entries.move_to_end(key)
        return ent.payload

    def put(self, key: tuple, objects: list, payload: Any) -> None:
        self.entries[key] = _Entry(objects, payload)
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()


_graphs = _Cache(CACHE_SIZE)
_programs = _Cache(PROGRAM_CACHE_SIZE)
_streams: dict[torch.device, Any] = {}
_anchors: dict[torch.device, Any] = {}


def clear_caches() -> None:
    """Drop every kept graph (frees their memory pools once no replay is in flight)."""
    _graphs.clear()
    _programs.clear()
    _anchors.clear()


def _side_stream(dev: torch.device) -> Any:
    if dev not in _streams:
        _streams[dev] = torch.cuda.Stream(dev)
    return _streams[dev]


# ---- records: one packed transfer per step or chunk -----------------------------------------

class _Layout:
    """Where each record entry sits in the packed float64 row (from the first record)."""

    def __init__(self, record: Tensors):
        self.items = [(k, tuple(v.shape), v.dtype) for k, v in record.items()]
        self.sizes = [int(np.prod(s)) for _, s, _ in self.items]

    def pack(self, record: Tensors) -> torch.Tensor:
        """``(R,)`` float64 (exact for flags and integers below 2**53)."""
        return torch.cat([v.reshape(-1).to(torch.float64) for v in record.values()])

    def unpack(self, row: np.ndarray) -> Host:
        out, k = {}, 0
        for (name, shape, dtype), n in zip(self.items, self.sizes, strict=True):
            v = row[k:k + n].reshape(shape)
            k += n
            if dtype == torch.bool:
                v = v > 0.5
            elif not dtype.is_floating_point:
                v = v.astype(np.int64)
            out[name] = v
        return out


class _Transfer:
    """A packed ``(k, R)`` device record on its way to the host (async on CUDA)."""

    def __init__(self, packed: torch.Tensor, steps: int):
        self.steps = steps
        if packed.is_cuda:
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(current_stream(packed.device))
        else:
            self.host, self.done = packed, None  # type: ignore[assignment]

    def wait(self) -> np.ndarray:
        if self.done is not None:
            self.done.synchronize()
        return self.host.numpy()


# ---- iterate: steps with host rules -------------------------------------------------------

class Run:
    """The steps of one :func:`iterate` call; iterate over it for the host records.

    Attributes:
        launched: steps enqueued so far (those past the consumer's stop are discarded).
        timings: host seconds spent launching steps (``"launch"``) and waiting for their
            records (``"sync"``).
        graph: how the steps ran: ``"off"`` (eager: no graphs on this backend),
            ``"first_use"`` (eager: too few steps to capture), ``"captured"`` (a graph made
            in this call), ``"reused"`` (a kept graph), or why a capture failed.

    """

    def __init__(self, step: Any, inputs: Tensors, state: Tensors, max_steps: int,
                 ahead: Callable[[Host, Host], bool] | None = None):
        self.step, self.inputs, self.state = step, dict(inputs), dict(state)
        self.max_steps = int(max_steps)
        self._ahead_hint = ahead
        self.launched = 0
        self._yielded = 0
        self.timings = {"launch": 0.0, "sync": 0.0}
        self._layout: _Layout | None = None
        self._pending: deque[_Transfer] = deque()
        any_tensor = next(iter(self.inputs.values()))
        self.dev = any_tensor.device
        self._ahead = getattr(step, "graph_safe", True)
        self._graphs = graphs_enabled(any_tensor) and self._ahead
        self.graph = "first_use" if self._graphs else "off"
        self._g: _Graph | None = None
        self._seen = False
        if self._graphs:
            self._key, self._objects = signature(step, self.inputs, self.state,
                                                 by_arrays=True)
            kept = _graphs.get(self._key, self._objects)
            if kept == "failed":
                self._graphs = False
                self.graph = "failed before"
            elif isinstance(kept, _Graph):
                self._g, self.graph = kept, "reused"
                kept.load_inputs(self.inputs, step)
            elif kept == "seen":
                self._seen = True
            else:
                _graphs.put(self._key, self._objects, "seen")

    # -- the consumer's side
    def start(self) -> Run:
        """Enqueue the first steps now (iterating would): host work after this overlaps them."""
        self._launch_ahead()
        return self

    def __iter__(self) -> Iterator[Host]:
        while True:
            self._launch_ahead()
            if not self._pending:
                return
            tr = self._pending.popleft()
            t0 = time.perf_counter()
            rows = tr.wait()
            self.timings["sync"] += time.perf_counter() - t0
            assert self._layout is not None
            if tr.steps > 1 and self._ahead_hint is not None and self._ahead_hint(
                    self._layout.unpack(rows[-2]), self._layout.unpack(rows[-1])):
                self._launch_ahead()  # the next chunk runs while the consumer reads these
            for r in range(tr.steps):
                if self._yielded == self.max_steps:  # a chunk replayed past the cap
                    return
                self._yielded += 1
                yield self._layout.unpack(rows[r])

    # -- launching
    def _launch_ahead(self) -> None:
        """Enqueue steps: one at a time with one more in flight on a GPU, or a kept chunk."""
        while self.launched < self.max_steps:
            left = self.max_steps - self.launched
            k = self._g.k if self._g is not None and self._g.k > 1 and 2 * left >= self._g.k \
                else 1
            # one step in flight while the host checks the last; not for a step that reads
            # the device itself (it has waited already: a step ahead would be pure waste)
            depth = 2 if self.dev.type == "cuda" and k == 1 and self._ahead else 1
            if self._pending and (k > 1 or len(self._pending) >= depth or
                                  self._pending[-1].steps > 1):
                return
            self._launch(k)

    def _launch(self, k: int) -> None:
        t0 = time.perf_counter()
        packed = None
        if self._graphs:
            packed = self._graphed(k)
        if packed is None:
            k = 1
            self.state, rec = self.step(self.inputs, self.state)
            if self._layout is None:
                self._layout = _Layout(rec)
            packed = self._layout.pack(rec)[None]
        self.launched += k
        self._pending.append(_Transfer(packed, k))
        self.timings["launch"] += time.perf_counter() - t0

    def _graphed(self, k: int) -> torch.Tensor | None:
        """Replay (capturing first if the policy says so); None: run this step eagerly."""
        g = self._g
        if g is None:
            if self.launched < EAGER_STEPS and not self._seen:
                return None  # an unseen signature: eager first, which compiles the kernels
            keep = self._seen
            try:
                g = _Graph.capture(self.step, self.inputs, self.state,
                                   getattr(self.step, "chunk", CHUNK) if keep else 1,
                                   keep=keep, dev=self.dev)
            except Exception as exc:  # e.g. a step that synchronises
                self._graphs = False
                self.graph = f"{type(exc).__name__}: {exc}"[:300]
                _graphs.put(self._key, self._objects, "failed")
                torch.cuda.synchronize(self.dev)
                return None
            self._g, self.graph = g, "captured"
            if keep:
                _graphs.put(self._key, self._objects, g)
            else:
                _anchors[self.dev] = g.graph
        if k != g.k:
            return None
        if self._layout is None:
            self._layout = g.layout
        g.load_state(self.state)
        g.graph.replay()
        self.state = g.state_in
        return g.records


class _Graph:
    """A captured chain of ``k`` steps: static inputs/state in, packed records out."""

    def __init__(self) -> None:
        self.graph: Any = None
        self.k = 1
        self.inputs: Tensors | None = None
        self.state_in: Tensors = {}
        self.records: torch.Tensor | None = None
        self.layout: _Layout | None = None
        self.arrays: list[Tensors] = []  # a kept graph's copies of its step's objects' arrays

    @classmethod
    def capture(cls, step: Any, inputs: Tensors, state: Tensors, k: int, *, keep: bool,
                dev: torch.device) -> _Graph:
        g = cls()
        g.k = k
        # a kept graph reads its own copies of the inputs and of its step's objects' arrays;
        # a call's graph reads the call's
        g.inputs = {n: v.clone() for n, v in inputs.items()} if keep else None
        ins = g.inputs if keep else inputs
        if keep:
            def private(obj: Any) -> Any:
                arrays = {n: v.clone() for n, v in obj.graph_arrays()[1].items()}
                g.arrays.append(arrays)
                return obj.with_arrays(arrays)

            step = _with_arrays(step, private, {})
        g.state_in = {n: v.clone() for n, v in state.items()}
        side = _side_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        if keep:  # warm-up outside the capture (compilation, allocator) on scratch copies
            with torch.cuda.stream(side):
                step(ins, {n: v.clone() for n, v in state.items()})
            torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # captured on the side stream directly: torch.cuda.graph() would first empty the
        # allocator's cache; the graphs of single calls share one pool (replays never overlap)
        with torch.cuda.stream(side):
            pool = None if keep or dev not in _anchors else _anchors[dev].pool()
            graph.capture_begin(pool=pool)
            try:
                s, rows = g.state_in, []
                for _ in range(k):
                    s, rec = step(ins, s)
                    if g.layout is None:
                        g.layout = _Layout(rec)
                    rows.append(g.layout.pack(rec))
                for n, v in s.items():  # the final state back into the state buffers
                    if v is not g.state_in[n]:
                        g.state_in[n].copy_(v)
                g.records = torch.stack(rows)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(dev).wait_stream(side)
        g.graph = graph
        return g

    def load_inputs(self, inputs: Tensors, step: Any) -> None:
        """Copy a call's inputs, and its step's objects' arrays, into the graph's."""
        assert self.inputs is not None
        for n, v in inputs.items():
            self.inputs[n].copy_(v)
        objects = list(_array_objects(step, {}).values())
        assert len(objects) == len(self.arrays)  # the same key: the same objects' layout
        for obj, mine in zip(objects, self.arrays, strict=True):
            for n, v in obj.graph_arrays()[1].items():
                if v.data_ptr() != mine[n].data_ptr():
                    mine[n].copy_(v)

    def load_state(self, state: Tensors) -> None:
        """Copy ``state`` into the state buffers unless it is them (after a replay)."""
        if state is self.state_in:
            return
        for n, v in state.items():
            self.state_in[n].copy_(v)


def iterate(step: Any, inputs: Tensors, state: Tensors, *, max_steps: int,
            ahead: Callable[[Host, Host], bool] | None = None) -> Run:
    """Run ``step`` up to ``max_steps`` times from ``state``; iterate the result for records.

    Args:
        step: a frozen dataclass ``(inputs, state) -> (state, record)`` (module docstring).
        inputs: tensors the steps read and never change (one device).
        state: the initial carried tensors (not modified).
        max_steps: the most steps to run (>= 1).
        ahead: the consumer's guess, from the last two records of a replayed chunk, that it
            will read past them: then the next chunk is launched before those records are
            yielded, and the device runs it while the host checks them. A wrong True costs
            a chunk of device work whose records are discarded, never a result.

    Returns:
        A :class:`Run`; iterating it yields one host record per step (dict of NumPy arrays
        with the record's shapes). Stop iterating to stop the loop.

    """
    return Run(step, inputs, state, max_steps, ahead)


# ---- run_program: fixed device programs ---------------------------------------------------

def _tree_clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _tree_clone(v) for k, v in x.items()}
    return x


class _Checkpoint:
    """``checkpoint(done) -> bool``: True when the program may stop (eager only)."""

    def __init__(self, eager: bool):
        self.eager = eager

    def __call__(self, done: torch.Tensor) -> bool:
        return self.eager and bool(done.all())


def run_program(program: Any, inputs: Tensors, *, pairs: float = 0.0,
                device_outputs: bool = True, host_outputs: bool = True,
                eager_first: bool = False,
                meanwhile: Callable[[], None] | None = None) -> tuple[Host, Tensors]:
    """Run a fixed device program and bring its outputs to the host in one transfer.

    ``program(inputs, checkpoint) -> outputs`` (a frozen dataclass, dict of tensors in and
    out) must not read the device on the host, except through ``checkpoint(done)``: a
    chance to stop early when every entry of the bool tensor ``done`` is set, taken only
    when the program runs eagerly. On Triton the whole program is one CUDA graph per
    :func:`signature`, captured after a warm-up run and replayed on copies of the inputs;
    ``pairs`` (point pairs per pass) above ``PROGRAM_GRAPH_MAX_PAIRS`` runs eagerly.
    ``eager_first``: the first call of a signature runs eagerly and marks it seen; the
    graph is captured at the second (a loop over clouds of many sizes pays no capture for
    a size it meets once). A program called while another graph is being captured runs
    inline, into that graph. A graph-array object among the program's fields (a search
    index) is keyed by its layout, as :func:`iterate` keys it: the kept graph reads its own
    copy of the object's arrays, into which a later call's object's arrays are copied.

    Returns:
        ``(host, device)``: the outputs as NumPy arrays and as device tensors (on a graph
        replay the device copies are made only if ``device_outputs``; else ``{}``). A
        replay packs the outputs inside the graph: one copy to the host, no launch after it.
        ``host_outputs=False``: no transfer, ``host`` is ``{}`` (large outputs that stay on
        the device). ``meanwhile()``, when given, runs once the program is enqueued and
        before its outputs are read (host checks that may raise, while the device works).

    """
    def host(out: Tensors) -> Host:
        if meanwhile is not None:
            meanwhile()
        return to_host(out) if host_outputs else {}

    def eager() -> tuple[Host, Tensors]:
        out = program(inputs, _Checkpoint(True))
        return host(out), out

    first = next(iter(inputs.values()))
    if not graphs_enabled(first) or pairs > PROGRAM_GRAPH_MAX_PAIRS:
        return eager()
    if torch.cuda.is_current_stream_capturing():  # inside another capture: inline
        out = program(inputs, _Checkpoint(False))
        return host(out), out
    key, objects = signature(program, inputs, by_arrays=True)
    key = (key, host_outputs)
    ent = _programs.get(key, objects)
    if ent == "failed":
        return eager()
    if ent is None and eager_first:
        _programs.put(key, objects, "seen")
        return eager()
    if ent is None or ent == "seen":
        dev = first.device
        static = {n: v.clone() for n, v in inputs.items()}
        arrays: list[Tensors] = []  # the kept graph's copies of its objects' arrays

        def private(obj: Any) -> Any:
            mine = {n: v.clone() for n, v in obj.graph_arrays()[1].items()}
            arrays.append(mine)
            return obj.with_arrays(mine)

        kept = _with_arrays(program, private, {})
        side = _side_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up: compiles the kernels, fills the allocator
            out = kept(static, _Checkpoint(False))
        torch.cuda.current_stream(dev).wait_stream(side)
        try:
            graph = torch.cuda.CUDAGraph()
            # on the side stream directly, as _Graph.capture (torch.cuda.graph() would first
            # collect garbage and empty the allocator's cache)
            with torch.cuda.stream(side):
                graph.capture_begin()
                try:
                    gout = kept(static, _Checkpoint(False))
                    layout = _Layout(gout) if host_outputs else None
                    packed = layout.pack(gout) if layout is not None else None
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(dev).wait_stream(side)
        except Exception:  # capture unsupported here: eager from now on
            _programs.put(key, objects, "failed")
            torch.cuda.synchronize(dev)
            return host(out), out
        ent = (graph, static, gout, layout, packed, arrays)
        _programs.put(key, objects, ent)
    graph, static, gout, layout, packed, arrays = ent
    for n, v in inputs.items():
        static[n].copy_(v)
    for obj, mine in zip(_array_objects(program, {}).values(), arrays, strict=True):
        for n, v in obj.graph_arrays()[1].items():
            if v.data_ptr() != mine[n].data_ptr():
                mine[n].copy_(v)
    graph.replay()
    out = _tree_clone(gout) if device_outputs else {}
    if meanwhile is not None:
        meanwhile()
    if layout is None:
        return {}, out
    return layout.unpack(packed.cpu().numpy()), out


def to_host(tensors: Tensors) -> Host:
    """Copy a dict of small device tensors to NumPy in one transfer (float64 round trip)."""
    if not tensors:
        return {}
    layout = _Layout(tensors)
    return layout.unpack(layout.pack(tensors).cpu().numpy())


__all__ = ["CHUNK", "Beside", "Clock", "Run", "Step", "clear_caches", "current_stream",
           "graphs_enabled", "iterate", "run_program", "signature", "synchronize", "to_host"]


