"""Triton's first use on a machine: the recorded kernels compiled side by side, ahead.

Triton compiles a kernel on its first launch, in the calling thread, one after another
(0.2-1.5 s each, most of it Python in Triton's front end: threads would not overlap). A
first ``register()`` on a fresh GPU machine launches about 20, so it used to take 17 s.
The Triton manifest (:data:`MANIFEST`, ``triton_manifest.json``) lists, per warm-up step
(:data:`pointalign._warmup.DEMO_STEPS` and the other methods), each kernel's
specialisation as a device run recorded it: argument types, constexprs, divisibility
attributes, ``num_warps``/``num_stages``, and its compile seconds. Before a public method's
first GPU call in a process, :func:`ensure` compiles the step's kernels that are missing in
forked child processes (one per core, longest first) into Triton's own disk cache; the
launches then find them there. Meanwhile the parent pays the CUDA runtime's own first-use
costs (:func:`warm_runtime`: library handles, sort and scan kernels) that the call would
otherwise pay inside its stages. A marker file in that cache says it is done, so later
processes pay one ``stat``.

Before that, the kernels and launchers the recording machine built are unpacked into the
cache where this machine is like it (:mod:`pointalign.kernels._prebuilt`): the children then
find them and compile only what differs.

Where the manifest does not apply (another Triton version than the one that recorded it,
the interpreter, no ``fork``, ``POINTALIGN_PRECOMPILE=0``), nothing happens: the kernels
compile on first launch as before. A specialisation the manifest lacks (a new size
class) also compiles on launch.
``benchmarks/bench_first_call.py --manifest`` records the manifest anew on a GPU machine.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

MANIFEST = Path(__file__).with_name("triton_manifest.json")

#: the launch options kept from a recording (the rest are the local backend's defaults)
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion",
            "launch_cooperative_grid", "launch_pdl", "debug", "sanitize_overflow")

#: seconds after which the children still compiling are stopped (the launches compile the
#: rest): a fresh 16-core machine takes ~2 s
TIMEOUT_S = 120.0

_done: set[tuple[str, ...]] = set()  # steps ensured in this process
_unpacked = [0]  # prebuilt kernels the last :func:`_applies` unpacked (kernels._prebuilt)
logger = logging.getLogger("pointalign")


@functools.lru_cache(maxsize=1)
def manifest() -> dict[str, Any]:
    """Return the manifest: ``{"triton": version, "steps": {step: [entry, ...]}}`` (read once)."""
    try:
        doc = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return {"triton": None, "steps": {}}
    return doc if isinstance(doc, dict) and isinstance(doc.get("steps"), dict) \
        else {"triton": None, "steps": {}}


def entries(steps: Sequence[str]) -> list[dict[str, Any]]:
    """Return the manifest's entries for ``steps`` (each once), longest first."""
    seen: dict[str, dict[str, Any]] = {}
    for step in steps:
        for e in manifest()["steps"].get(step, []):
            seen.setdefault(_key(e), e)
    return sorted(seen.values(), key=lambda e: -float(e.get("seconds", 1.0)))


def _key(entry: dict[str, Any]) -> str:
    spec = {k: v for k, v in entry.items() if k != "seconds"}
    return json.dumps(spec, sort_keys=True)


# ---- compiling one entry (in a child process: no CUDA calls) -----------------------------

def _jit_function(path: str) -> Any:
    """Return the ``JITFunction`` named ``module:name`` (lazily jitted ones included)."""
    from triton.runtime.jit import JITFunction

    module_name, name = path.split(":")
    module = importlib.import_module(module_name)
    obj = getattr(module, name)
    if isinstance(obj, JITFunction):
        return obj
    for getter in ("_kernels", "_kernel"):  # the modules that jit per interpreter mode
        made = getattr(module, getter, None)
        found = made() if callable(made) else None
        for k in (found.values() if isinstance(found, dict) else [found]):
            if isinstance(k, JITFunction) and k.fn is obj:
                return k
    raise LookupError(f"no Triton kernel {path}")


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _constant(v: Any) -> Any:
    import triton.language as tl

    if isinstance(v, str) and tl.dtype.is_dtype(v):
        return tl.dtype(v)
    if isinstance(v, dict) and "constexpr" in v:
        return tl.constexpr(_tuples(v["constexpr"]))
    if isinstance(v, dict) and "jit_function" in v:
        return _jit_function(v["jit_function"])
    return _tuples(v)


def _source(entry: dict[str, Any], target: Any) -> tuple[Any, dict[str, Any]]:
    """Triton's ``(source, options)`` of a manifest ``entry``, as its launch builds them."""
    from triton.compiler import ASTSource, make_backend

    fn = _jit_function(entry["kernel"])
    constexprs = {tuple(k): _constant(v) for k, v in entry["constexprs"]}
    attrs = {tuple(k): v for k, v in entry["attrs"]}
    signature = {k: _tuples(v) for k, v in entry["signature"].items()}
    options = make_backend(target).parse_options(dict(entry["options"]))
    return ASTSource(fn, signature, constexprs, attrs), options.__dict__


def compile_entry(entry: dict[str, Any], target: Any, launcher: bool = False) -> None:
    """Compile one manifest ``entry`` for ``target`` into Triton's disk cache.

    The same source, specialisation and options as the launch would compile (as Triton's
    own ``JITFunction.preload`` rebuilds them), so the launch finds the result; with
    ``launcher`` also the kernel's launcher (on a GPU machine, whose driver is loaded).
    """
    import triton

    src, options = _source(entry, target)
    kernel = triton.compile(src, target=target, options=options)
    if launcher:
        # Triton versions that build a C launcher per signature (gcc, ~0.3 s) cache it on
        # the kernel's first load: build it here too (no CUDA call: it is only compiled;
        # where that fails, e.g. no driver, the first load builds it)
        with contextlib.suppress(Exception):
            from triton.runtime import driver

            driver.active.launcher_cls(kernel.src, kernel.metadata)


def missing(todo: list[dict[str, Any]], target: Any) -> list[dict[str, Any]]:
    """Return the entries of ``todo`` Triton's disk cache lacks (all, where that is unknown).

    Looks each one up as ``triton.compile`` does (Triton 3.6's key: its installation, the
    backend, the source and its specialisation, the options, the cache-relevant
    environment), without compiling.
    """
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.compiler import make_backend
        from triton.runtime.cache import get_cache_key, get_cache_manager

        backend = make_backend(target)
        env = get_cache_invalidating_env_vars()
        out = []
        for e in todo:
            src, options = _source(e, target)
            opts = backend.parse_options(dict(options, **src.parse_options()))
            key = hashlib.sha256(get_cache_key(src, backend, opts, env).encode()).hexdigest()
            if get_cache_manager(key).get_group(f"{src.name[:150]}.json") is None:
                out.append(e)
        return out
    except Exception as exc:  # another Triton's internals: compile them all, as before
        logger.debug("Triton cache lookup failed: %r", exc)
        return list(todo)


# ---- the parallel compile ------------------------------------------------------------------

def _cache_dir() -> Path:
    from triton import knobs

    d = getattr(getattr(knobs, "cache", None), "dir", None) \
        or os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache"
    return Path(d)


def _marker(todo: list[dict[str, Any]], target: Any) -> Path:
    import triton

    h = hashlib.sha256(json.dumps([triton.__version__, repr(target)]
                                  + [_key(e) for e in todo]).encode()).hexdigest()[:32]
    return _cache_dir() / "pointalign-precompiled" / h


def _bins(todo: list[dict[str, Any]], workers: int) -> list[list[dict[str, Any]]]:
    """Longest-processing-time schedule: each entry to the least loaded worker."""
    bins: list[list[dict[str, Any]]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for e in todo:  # longest first
        w = load.index(min(load))
        bins[w].append(e)
        load[w] += float(e.get("seconds", 1.0))
    return [b for b in bins if b]


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)


def _prepare(todo: list[dict[str, Any]], target: Any) -> None:
    """Do once, before forking, what every child would otherwise do again.

    Triton's own key (a hash of its sources and library: ~0.3 s), the backend and its
    hash (``ptxas --version``), and each kernel's source hash.
    """
    from triton.compiler import make_backend

    _triton_key()  # computed once per process (ahead, in :func:`_applies`)
    make_backend(target).hash()
    for e in todo:
        _ = _jit_function(e["kernel"]).cache_key


def compile_forked(todo: list[dict[str, Any]], target: Any, workers: int | None = None,
                   meanwhile: Callable[[], None] | None = None) -> bool:
    """Compile ``todo`` in forked children, one per core; True when every child succeeded.

    A child compiles only (no CUDA calls: the parent may have initialised CUDA, which a
    forked child must not use) and leaves with ``os._exit``. The parent runs ``meanwhile``
    (if given) while the children compile, then waits for them.
    """
    bins = _bins(todo, max(1, min(workers or _cores(), len(todo))))
    with contextlib.suppress(Exception):
        _prepare(todo, target)
    pids = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
        for part in bins:
            pid = os.fork()
            if pid == 0:  # pragma: no cover (the child)
                code = 0
                try:
                    for e in part:
                        compile_entry(e, target, launcher=True)
                except BaseException:
                    code = 1
                os._exit(code)
            pids.append(pid)
    deadline = time.monotonic() + TIMEOUT_S
    if meanwhile is not None:
        try:
            meanwhile()
        except Exception as exc:  # a head start only
            logger.debug("Triton precompile: the parent's warm-up failed: %r", exc)
    return _wait(pids, deadline=deadline)


def warm_runtime(device: Any) -> None:
    """Pay the CUDA runtime's first-use costs of the library calls the pipelines make.

    Run by the parent while the children compile (:func:`ensure`): the first call of
    each of these loads its kernels and creates its library handle (cuBLAS, cuSOLVER,
    the sort and scan kernels), which a first ``register()`` otherwise pays inside its
    stages. Small tensors; nothing is kept.
    """
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.rand(4096, 3, device=device, generator=g)
    for keys in (x[:, 0], (x[:, 1] * 4096).to(torch.int32), (x[:, 2] * 4096).to(torch.int64)):
        torch.sort(keys)
        torch.argsort(keys, stable=True)
        torch.cumsum(keys, 0)
        torch.unique(keys, return_inverse=True, return_counts=True)
        torch.searchsorted(torch.sort(keys).values, keys)
        (keys > keys.mean(dtype=torch.float32)).nonzero()
    torch.bincount((x[:, 0] * 64).to(torch.int64), minlength=64)
    torch.topk(x[:, 0], 8)
    torch.randperm(4096, device=device, generator=g)
    torch.quantile(x[:, 0], 0.5)
    x[:, 0].median()
    for dtype in (torch.float32, torch.float64):
        m = x[:64].to(dtype)
        sym = m.t() @ m + torch.eye(3, device=device, dtype=dtype)
        batch = sym.expand(16, 3, 3).contiguous()
        torch.linalg.eigh(batch)
        torch.linalg.eigvalsh(batch)
        torch.linalg.svd(batch)
        torch.linalg.solve(batch, m[:16, :, None])
        torch.linalg.det(batch)
        torch.linalg.cross(m[:16], m[16:32], dim=1)
        torch.bmm(batch, batch)
    torch.cuda.synchronize(device)


def _wait(pids: list[int], deadline: float) -> bool:
    """Reap the children; True when all exited 0.

    Past ``deadline`` the rest are killed: a child that hangs (e.g. on a lock another
    thread held at the fork) must not hang the call.
    """
    ok, left = True, set(pids)
    while left:
        for pid in list(left):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                left.discard(pid)
                ok = ok and os.waitstatus_to_exitcode(status) == 0
        if left and time.monotonic() > deadline:
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            logger.info("Triton precompile: %d processes timed out and were stopped",
                        len(left))
            return False
        if left:
            time.sleep(0.01)
    return ok


def _applies(device: Any) -> Any:
    """Return the Triton target to compile for (None: the manifest does not apply)."""
    import torch

    from pointalign.kernels import _backend

    if getattr(device, "type", None) != "cuda" or not hasattr(os, "fork") \
            or os.environ.get("POINTALIGN_PRECOMPILE", "1") == "0" \
            or _backend.backend(torch.empty(0, device=device)) != "triton":
        return None
    import triton

    if manifest().get("triton") != triton.__version__:
        return None
    from pointalign.kernels import _prebuilt

    # before the driver starts: its helper module may be among the prebuilt files
    _unpacked[0] = _prebuilt.install(_cache_dir(), torch.cuda.get_device_capability(device))
    from triton.runtime import driver

    # Triton's key of its own installation (a hash of libtriton, ~0.3 s), which every
    # compile and every first launch needs, beside the driver's start (on a fresh machine
    # a gcc build of its helper module): both wait outside Python most of the time
    ahead = threading.Thread(target=_triton_key, daemon=True)
    ahead.start()
    try:
        return driver.active.get_current_target()
    finally:
        ahead.join()  # before any fork: no thread may hold a lock a child needs


def _triton_key() -> None:
    with contextlib.suppress(Exception):  # where this Triton keeps it
        from triton.runtime.cache import triton_key

        triton_key()


def ensure(steps: Sequence[str], device: Any) -> float | None:
    """Compile the manifest's kernels of ``steps`` for ``device`` ahead of their launch.

    Once per machine (a marker per step in Triton's cache) and once per process (a set);
    says so when it compiles. Returns the seconds spent compiling, or None where nothing was to do.
    """
    key = tuple(steps)
    if key in _done:
        return None
    _done.add(key)
    try:
        target = _applies(device)
        if target is None:
            return None
        markers = {step: _marker(entries([step]), target) for step in steps}
        pending = [step for step, m in markers.items() if not m.exists()]
        todo = entries(pending)
        if not todo:
            return None
        t = time.perf_counter()
        todo = missing(todo, target)  # e.g. found among the prebuilt kernels
        if not todo:
            _mark(markers, pending)
            logger.info("first use on this machine: the %d Triton kernels it needs were all "
                        "found in the cache (%d prebuilt ones unpacked)",
                        len(entries(pending)), _unpacked[0])
            return time.perf_counter() - t
        from pointalign import _progress
        from pointalign.kernels import _numba

        workers = min(_cores(), len(todo))
        seconds = [float(e.get("seconds", 1.0)) for e in todo]
        estimate = max(max(seconds), sum(seconds) / workers)
        what = (f"first use on this machine: Triton compiles {len(todo)} GPU kernels in "
                f"{workers} processes, once")
        if not _progress.announce(what, estimate, stacklevel=_numba._user_stacklevel()):
            logger.info("%s (%s)", what, _progress.describe_seconds(estimate))
        if compile_forked(todo, target, workers, meanwhile=lambda: warm_runtime(device)):
            _mark(markers, pending)
        return time.perf_counter() - t
    except Exception as exc:  # an optimisation only: the launches compile what is missing
        logger.debug("Triton precompile skipped: %r", exc)
        return None


def _mark(markers: dict[str, Path], steps: list[str]) -> None:
    for step in steps:
        markers[step].parent.mkdir(parents=True, exist_ok=True)
        markers[step].write_text(json.dumps({"step": step}))


# ---- recording the manifest (on a GPU machine) -------------------------------------------

@contextlib.contextmanager
def record() -> Iterator[list[dict[str, Any]]]:
    """Collect the entry of every Triton kernel this process compiles inside the block.

    Triton reports a kernel the first time this process launches it with a new
    specialisation (``knobs.runtime.jit_cache_hook``); record each step in a fresh process.
    """
    from triton import knobs

    got: list[dict[str, Any]] = []

    def hook(*, key: Any, repr: Any, fn: Any, compile: Any, **_: Any) -> bool:
        spec = json.loads(compile["specialization_data"])
        if not spec["name"].startswith("pointalign."):
            return False
        module, name = spec["name"].rsplit(".", 1)
        got.append({
            "kernel": f"{module}:{name}",
            "signature": spec["signature"],
            "constexprs": [[k, v] for k, v in zip(spec["constant_keys"],
                                                  spec["constant_vals"], strict=True)],
            "attrs": [[k, v] for k, v in zip(spec["attrs_keys"], spec["attrs_vals"],
                                             strict=True)],
            "options": {k: spec["options"][k] for k in _OPTIONS if k in spec["options"]},
        })
        return False

    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield got
    finally:
        knobs.runtime.jit_cache_hook = old
