"""What a user meets first: the cold first call, the first call at each new size (issue 23).

Three measurements, each in fresh child processes so that nothing is warm by accident:

* ``cold``: empty Triton and numba caches (fresh ``TRITON_CACHE_DIR`` and
  ``NUMBA_CACHE_DIR``): ``import pointalign``, the first ``register()`` on the bundled
  bunny pair, then the second call (warm);
* ``cached``: a second process reusing those caches (what every later session pays);
* ``compile`` (``--compile-table``, CPU): a fresh process with an empty numba cache logs
  every kernel numba compiles during the first ``register()`` (``numba:compile`` events):
  signatures and CPU seconds per kernel;
* ``--manifest`` (GPU): records the Triton manifest anew
  (``src/pointalign/kernels/triton_manifest.json``, :mod:`pointalign.kernels._precompile`):
  each warm-up step in a fresh process with an empty Triton cache logs the specialisation
  of every kernel it compiles (``register`` also on twelve scan pairs of other sizes), then
  another fresh process times each one's compile; what the steps built (kernels, launchers)
  is packed into ``triton_prebuilt.tar.xz`` (:mod:`pointalign.kernels._prebuilt`);
* ``--prebuilt-ab`` (GPU): cold first calls without the prebuilt kernels
  (``POINTALIGN_PREBUILT=0``) interleaved with ones with them, each in a fresh cache; every
  cold row counts the kernels its cache holds, compiled there or prebuilt;
* ``sizes``: one process registers every ordered pair of the Stanford bunny scans (90 calls,
  each scan a different size) one after another, twice; per call it records the wall time
  and the number of Triton kernels compiled during the call (``knobs.runtime``'s compile
  hook) so that a recompilation for a new size shows as a count, not a guess. The second
  loop is the warm reference: a call of the first loop above twice the second loop's
  median is "slow", and the sum of the excess is reported.

Run::

    python benchmarks/bench_first_call.py              # CUDA when present, else the CPU
    python benchmarks/bench_first_call.py --device cpu --pairs 12

Writes ``results/first_call-<device>.json`` (rendered into BENCHMARKS.md by render.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _child_cold(device: str) -> dict:
    """Import, first and second register() on the bundled pair, in this process."""
    t0 = time.perf_counter()
    import torch

    t_torch = time.perf_counter() - t0
    import pointalign as pa

    t_import = time.perf_counter() - t0
    pair = pa.datasets.load_bunny_pair()
    src, tgt = pair.source.to(device), pair.target.to(device)
    out = {"import_torch_s": t_torch, "import_s": t_import}
    for name in ("first", "second", "third"):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        r = pa.register(src, tgt, seed=0)
        if device == "cuda":
            torch.cuda.synchronize()
        out[f"{name}_s"] = time.perf_counter() - t
        out[f"{name}_stages"] = {k: round(v, 4) for k, v in r.timings.items()}
        if name == "first":
            out["built"] = _built_here(os.environ.get("TRITON_CACHE_DIR"))
    rot, tr = pa.metrics.relative_error(r.transformation, pair.T_target_source)
    out["error_deg"], out["error_m"] = float(rot), float(tr)
    return out


def _built_here(cache: str | None) -> dict:
    """What Triton's disk cache holds: kernels compiled here (their PTX kept) or found."""
    if not cache or not Path(cache).is_dir():
        return {}
    groups = list(Path(cache).glob("*/__grp__*.json"))
    compiled = sum(1 for g in groups if any(g.parent.glob("*.ptx")))
    return {"kernels_compiled": compiled, "kernels_prebuilt": len(groups) - compiled}


class _CompileLog:
    """numba's ``numba:compile`` events: per dispatcher, signatures compiled and seconds.

    A kernel that calls another (not inlined) dispatcher compiles it inside its own event;
    ``self_s`` is a dispatcher's time less its callees' (what compiling it alone costs),
    ``total_s`` includes them (both in CPU seconds of the compiling thread, which a shared
    machine's load inflates less than wall time). Loads from numba's disk cache fire no event.
    """

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}
        self._stack: list[list] = []

    @staticmethod
    def _name(ev) -> str:
        f = ev.data["dispatcher"].py_func
        return f"{f.__module__.replace('pointalign.kernels.', '')}.{f.__qualname__}"

    def on_start(self, ev) -> None:
        self._stack.append([time.thread_time(), 0.0])

    def on_end(self, ev) -> None:
        t0, inner = self._stack.pop()
        dt = time.thread_time() - t0
        if self._stack:
            self._stack[-1][1] += dt
        row = self.rows.setdefault(self._name(ev), {"signatures": 0, "self_s": 0.0,
                                                    "total_s": 0.0, "args": []})
        row["signatures"] += 1
        row["self_s"] += dt - inner
        row["total_s"] += dt
        row["args"].append(", ".join(str(a) for a in ev.data["args"])[:160])

    def install(self) -> None:
        from numba.core import event

        listener = type("L", (event.Listener,), {"on_start": lambda s, ev: self.on_start(ev),
                                                 "on_end": lambda s, ev: self.on_end(ev)})()
        event.register("numba:compile", listener)


def _child_compile(device: str) -> dict:
    """First register() on the bunny pair with every numba compile logged (CPU, empty cache).

    Returns the import and call times, the stage timings and per dispatcher the signatures
    compiled and the seconds spent (see :class:`_CompileLog`).
    """
    log = _CompileLog()
    log.install()
    t0 = time.perf_counter()
    import pointalign as pa

    t_import = time.perf_counter() - t0
    pair = pa.datasets.load_bunny_pair()
    src, tgt = pair.source.to(device), pair.target.to(device)
    t = time.perf_counter()
    r = pa.register(src, tgt, seed=0)
    first = time.perf_counter() - t
    t = time.perf_counter()
    pa.register(src, tgt, seed=0)
    second = time.perf_counter() - t
    return {"import_s": t_import, "first_s": first, "second_s": second,
            "first_stages": {k: round(v, 3) for k, v in r.timings.items()},
            "compiles": log.rows}


def _scans() -> dict:
    import pointalign as pa

    d = pa.datasets.shared_data_dir()
    if d is None:
        raise SystemExit("the Stanford bunny scans (../shared/data or .data) are needed")
    folder = d / "stanford_bunny" / "data"
    return {p.stem: pa.read(p).points for p in sorted(folder.glob("*.ply"))}


def _child_sizes(device: str, pairs: int, freeze: bool = False) -> dict:
    """Every ordered pair of bunny scans, twice, with Triton compiles counted per call.

    Per call also the CUDA graphs captured and the device allocations the caching allocator
    made (``num_device_alloc``): what a slow call without a compile spent its time on.
    """
    import torch

    import pointalign as pa

    compiled = [0]
    kernel_names: list[str] = []
    reprs: list[str] = []
    try:
        from triton import knobs

        def hook(*args, **kwargs):
            compiled[0] += 1
            fn = kwargs.get("fn")
            kernel_names.append(getattr(fn, "name", None) or "?")
            reprs.append(str(kwargs.get("repr", ""))[:400])
            return None

        knobs.runtime.jit_post_compile_hook = hook
    except Exception:  # no Triton (CPU machine): compiles are numba's, not counted here
        pass
    captures = [0]
    if device == "cuda":
        end = torch.cuda.CUDAGraph.capture_end

        def counted(self, *a, **k):
            captures[0] += 1
            return end(self, *a, **k)

        torch.cuda.CUDAGraph.capture_end = counted

    gc_time, gc_start = [0.0, 0], [0.0]

    def gc_clock(phase: str, info: dict) -> None:  # Python's collections of the oldest kind
        if info.get("generation") != 2:
            return
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_start[0]
            gc_time[1] += 1

    gc.callbacks.append(gc_clock)

    def allocs() -> int:
        return int(torch.cuda.memory_stats().get("num_device_alloc", 0)) if device == "cuda" \
            else 0

    scans = {k: v.to(device) for k, v in _scans().items()}
    names = sorted(scans)
    order = [(a, b) for a in names for b in names if a != b][:pairs]
    if freeze:  # what is alive now (the imports) leaves the collector's work
        gc.collect()
        gc.freeze()
    loops = []
    for _ in range(2):
        rows = []
        for a, b in order:
            c0, n0, g0, m0 = compiled[0], len(kernel_names), captures[0], allocs()
            gc0 = tuple(gc_time)
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            pa.register(scans[a], scans[b], seed=0)
            if device == "cuda":
                torch.cuda.synchronize()
            rows.append({"pair": f"{a}->{b}", "n": [int(scans[a].shape[0]), int(scans[b].shape[0])],
                         "s": time.perf_counter() - t, "compiled": compiled[0] - c0,
                         "kernels": sorted(set(kernel_names[n0:])),
                         "captures": captures[0] - g0, "device_allocs": allocs() - m0,
                         "gc2": gc_time[1] - gc0[1], "gc2_s": gc_time[0] - gc0[0]})
        loops.append(rows)
        if len(loops) == 1:  # what the calls after the first compiled, with its signature
            first_n = sum(1 for _ in range(rows[0]["compiled"]))
            later_reprs = reprs[first_n:]
    return {"loops": loops, "later_reprs": later_reprs}


def _child_record(device: str, step: str) -> dict:
    """The Triton manifest entries of one warm-up step (empty cache: every kernel compiles)."""
    import torch

    import pointalign as pa
    from pointalign import _warmup
    from pointalign.kernels import _precompile

    dev = torch.device(device)
    with _precompile.record() as got:
        dict(_warmup._steps(dev))[step]()
        if step == "register":  # the size classes of other clouds
            scans = {k: v.to(dev) for k, v in _scans().items()}
            names = sorted(scans)
            for a, b in [(a, b) for a in names for b in names if a != b][::7][:12]:
                pa.register(scans[a], scans[b], seed=0)
        torch.cuda.synchronize()
    return {"entries": got}


def _child_time(device: str, path: str) -> dict:
    """Compile seconds of each entry in the file ``path`` (an empty cache, one by one)."""
    from triton.runtime import driver

    from pointalign.kernels import _precompile

    target = driver.active.get_current_target()
    out = []
    for e in json.loads(Path(path).read_text()):
        t = time.perf_counter()
        _precompile.compile_entry(e, target)
        out.append(round(time.perf_counter() - t, 3))
    return {"seconds": out}


def record_manifest(device: str, tmp: str) -> None:
    """Record ``triton_manifest.json`` (see the module doc): entries per step, timed."""
    import torch
    import triton

    from pointalign import _warmup
    from pointalign.kernels import _prebuilt, _precompile

    steps: dict[str, list] = {}
    for i, (step, _) in enumerate(_warmup._steps(torch.device(device))):
        env = dict(os.environ, TRITON_CACHE_DIR=f"{tmp}/record{i}", POINTALIGN_PRECOMPILE="0")
        got = _run_child("record", device, env, 0, step)["entries"]
        seen: dict[str, dict] = {}
        for e in got:
            seen.setdefault(_precompile._key(e), e)
        steps[step] = list(seen.values())
    every = {_precompile._key(e): e for v in steps.values() for e in v}
    path = Path(tmp) / "entries.json"
    path.write_text(json.dumps(list(every.values())))
    env = dict(os.environ, TRITON_CACHE_DIR=f"{tmp}/timing", POINTALIGN_PRECOMPILE="0")
    secs = dict(zip(every, _run_child("time", device, env, 0, str(path))["seconds"],
                    strict=True))
    doc = {"triton": triton.__version__,
           "recorded": "benchmarks/bench_first_call.py --manifest",
           "steps": {step: [dict(e, seconds=secs[_precompile._key(e)]) for e in v]
                     for step, v in steps.items()}}
    _precompile.MANIFEST.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"manifest: {len(every)} kernels, {sum(secs.values()):.1f} s of compiling, "
          f"longest {max(secs.values()):.2f} s -> {_precompile.MANIFEST}", flush=True)
    # what the steps built (kernels, launchers, the driver's helper), for machines like this
    index = _prebuilt.pack([f"{tmp}/record{i}" for i in range(len(steps))],
                           torch.cuda.get_device_capability(torch.device(device)))
    print(f"prebuilt: {len(index['kernels'])} kernels, "
          f"{_prebuilt.ARCHIVE.stat().st_size / 1e6:.2f} MB -> {_prebuilt.ARCHIVE}", flush=True)


def _run_child(what: str, device: str, env: dict, pairs: int, arg: Any = None) -> dict:
    extra = f", {pairs}" if what == "sizes" else ""
    extra += f", {arg!r}" if arg is not None else ""
    code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import bench_first_call as b; "
            f"print('@@' + json.dumps(b._child_{what}({device!r}" + extra + ")))")
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("@@")]
    if p.returncode or not line:
        raise SystemExit(f"child {what} failed ({p.returncode}):\n{p.stdout[-3000:]}\n"
                         f"{p.stderr[-3000:]}")
    out = json.loads(line[-1][2:])
    out["process_wall_s"] = wall
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--pairs", type=int, default=90, help="ordered scan pairs in the size loop")
    ap.add_argument("--skip-sizes", action="store_true")
    ap.add_argument("--compile-table", action="store_true",
                    help="CPU: also a fresh process with an empty numba cache that logs what "
                         "the first register() compiles, per kernel (signatures, CPU seconds)")
    ap.add_argument("--manifest", action="store_true",
                    help="GPU: record the Triton manifest anew first (see the module doc)")
    ap.add_argument("--skip-cold", action="store_true", help="no cold or cached first calls")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="sizes: gc.freeze() once the imports are done (no full collection "
                         "walks them during the loop)")
    ap.add_argument("--prebuilt-ab", action="store_true",
                    help="GPU: also cold first calls without the prebuilt kernels "
                         "(POINTALIGN_PREBUILT=0), interleaved with ones with them")
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import torch
    from common import Recorder

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rec = Recorder("first_call", device, title="First call and new sizes (issue 23)")
    with tempfile.TemporaryDirectory() as tmp:
        if a.manifest and device == "cuda":
            record_manifest(device, tmp)
        # with the prebuilt kernels (where they apply), then with the caches, then without
        # them and with them again in fresh caches (each fresh cache folder: a fresh machine's)
        runs = [] if a.skip_cold else [("cold", "triton", "1"), ("cached", "triton", "1")]
        if a.prebuilt_ab:
            runs += [("cold, no prebuilt", "triton_np", "0"), ("cold", "triton_p2", "1"),
                     ("cold, no prebuilt", "triton_np2", "0")]
        for label, cache, prebuilt in runs:
            env = dict(os.environ, TRITON_CACHE_DIR=f"{tmp}/{cache}",
                       NUMBA_CACHE_DIR=f"{tmp}/numba", POINTALIGN_PREBUILT=prebuilt)
            r = _run_child("cold", device, env, a.pairs)
            print(f"{label}: import {r['import_s']:.2f} s, first register {r['first_s']:.2f} s, "
                  f"second {1e3 * r['second_s']:.1f} ms, third {1e3 * r['third_s']:.1f} ms "
                  f"({r['error_deg']:.3f} deg) {r['built']}", flush=True)
            rec.add("cold", caches=label, import_s=round(r["import_s"], 3),
                    first_s=round(r["first_s"], 3), second_ms=round(1e3 * r["second_s"], 1),
                    third_ms=round(1e3 * r["third_s"], 1),
                    first_stages=json.dumps(r["first_stages"]),
                    **{k: v for k, v in r["built"].items()})
        if a.compile_table and device == "cpu":
            env = dict(os.environ, NUMBA_CACHE_DIR=f"{tmp}/numba_table")
            r = _run_child("compile", device, env, a.pairs)
            rows = sorted(r["compiles"].items(), key=lambda kv: -kv[1]["self_s"])
            print(f"compile table: first register {r['first_s']:.1f} s, "
                  f"{sum(v['signatures'] for _, v in rows)} signatures, "
                  f"{sum(v['self_s'] for _, v in rows):.1f} s of compiler CPU", flush=True)
            for name, v in rows:
                if v["self_s"] >= 0.05:
                    print(f"  {v['self_s']:6.2f} s  {v['signatures']:3d}  {name}", flush=True)
                rec.add("compile", kernel=name, signatures=v["signatures"],
                        self_cpu_s=round(v["self_s"], 3), total_cpu_s=round(v["total_s"], 3))
        if not a.skip_sizes:
            env = dict(os.environ, TRITON_CACHE_DIR=f"{tmp}/triton2",
                       NUMBA_CACHE_DIR=f"{tmp}/numba")
            r = _run_child("sizes", device, env, a.pairs, a.gc_freeze)
            first, again = r["loops"]
            med = statistics.median(x["s"] for x in again)
            slow = [x for x in first[1:] if x["s"] > 2 * med]
            excess = sum(x["s"] - med for x in slow)
            print(f"sizes: {len(first)} pairs, warm median {1e3 * med:.1f} ms, first call "
                  f"{first[0]['s']:.2f} s, later calls over 2x median: {len(slow)} "
                  f"(max {max([x['s'] for x in slow], default=0):.2f} s, excess {excess:.2f} s), "
                  f"Triton compiles after the first call: {sum(x['compiled'] for x in first[1:])}"
                  f", in the second loop: {sum(x['compiled'] for x in again)}", flush=True)
            rec.add("sizes", pairs=len(first), gc_freeze=a.gc_freeze,
                    warm_median_ms=round(1e3 * med, 1),
                    first_call_s=round(first[0]["s"], 3), slow_calls=len(slow),
                    slowest_s=round(max([x["s"] for x in slow], default=0.0), 3),
                    excess_s=round(excess, 3),
                    compiles_first_call=first[0]["compiled"],
                    compiles_later=sum(x["compiled"] for x in first[1:]),
                    compiles_second_loop=sum(x["compiled"] for x in again))
            for x in slow:
                rec.add("slow_calls", pair=x["pair"], n=str(x["n"]), s=round(x["s"], 3),
                        compiled=x["compiled"], kernels=" ".join(x["kernels"]),
                        captures=x["captures"], device_allocs=x["device_allocs"],
                        gc2=x["gc2"], gc2_s=round(x["gc2_s"], 3))
            for i, loop in enumerate((first, again)):
                caps = [x["captures"] for x in loop[1:]]
                with_, without = ([1e3 * x["s"] for x in loop[1:] if bool(x["captures"]) == c]
                                  or [0.0] for c in (True, False))
                print(f"loop {i + 1}: graph captures {sum(caps)} in {sum(1 for c in caps if c)} "
                      f"calls; device allocations {sum(x['device_allocs'] for x in loop[1:])}; "
                      f"median of calls with a capture {statistics.median(with_):.1f} ms, "
                      f"without {statistics.median(without):.1f} ms; full garbage collections "
                      f"{sum(x['gc2'] for x in loop)} "
                      f"({1e3 * sum(x['gc2_s'] for x in loop):.1f} ms)", flush=True)
            for x in sorted(first[1:], key=lambda x: -x["s"])[:6]:
                print(f"  slowest: {x['pair']} {1e3 * x['s']:.1f} ms, compiled {x['compiled']}, "
                      f"captures {x['captures']}, device allocs {x['device_allocs']}, full "
                      f"garbage collections {x['gc2']} ({1e3 * x['gc2_s']:.1f} ms)", flush=True)
            later = sorted({k for x in first[1:] for k in x["kernels"]})
            print("kernels compiled again at a new size:", " ".join(later), flush=True)
            for rp in r["later_reprs"][:12]:
                print("   ", rp, flush=True)
    print("wrote", rec.save())


if __name__ == "__main__":
    main()
