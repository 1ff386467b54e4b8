"""The first call on a fresh CPU machine: warm-up, demo and first register() (issue 23).

Each measurement runs in fresh child processes with an empty numba cache (a new
``NUMBA_CACHE_DIR``; the library's own cache folders follow it,
:func:`pointalign.kernels._numba.cache_dirs`), so that nothing is warm by accident:

* ``cold``: ``pointalign warmup`` (what ``make demo`` runs first), then ``pointalign demo``,
  then a fresh process's first ``register()`` on the bundled pair, then
  ``pointalign warmup --all`` (the other methods' kernels) on the same cache, and
  ``pointalign warmup --all`` once more on an empty cache (every method's kernels). Per step the
  wall seconds and the CPU seconds (user + system of the child and its workers: the
  warm-up compiles in parallel processes), repeated ``--repeat`` times; the machine's load
  average is recorded beside them (a shared machine's other work inflates wall time, less
  so CPU time).
* ``compile`` (``--compile-table``): per warm-up step, a process with its own empty cache
  runs that step alone and logs numba's ``numba:compile`` events (cache loads fire none):
  per kernel module, signatures compiled and compiler CPU seconds (the serial sum of the
  steps counts a kernel two steps share twice). ``--manifest`` also
  writes what each step compiles, kernel by kernel, to
  ``src/pointalign/kernels/compile_manifest.json`` (the first-use announcement's estimate).

* ``make`` (``--make TORCH_INDEX``): ``make demo`` end to end in a fresh copy of HEAD,
  once with pip (a new ``.venv``, PyTorch from ``TORCH_INDEX``) and once more with numba's
  cache emptied (the pip steps then skip: their stamps exist).

Run::

    python benchmarks/bench_first_call_cpu.py --repeat 2 --compile-table --label after
    python benchmarks/bench_first_call_cpu.py --skip-cold --skip-all --label after \
        --make https://download.pytorch.org/whl/cpu

Writes ``results/first_call-cpu.json`` (rendered into BENCHMARKS.md's first-call section by
render.py); rows of another ``--label`` already in that file are kept, so that a "before"
and an "after" run sit side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MANIFEST = ROOT / "src" / "pointalign" / "kernels" / "compile_manifest.json"


def _timed(cmd: list[str], env: dict) -> dict:
    """Run ``cmd``; its wall seconds, CPU seconds (with its children) and stdout tail."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n"
                         f"{p.stderr[-3000:]}")
    return {"wall_s": wall, "user_s": r1.ru_utime - r0.ru_utime,
            "sys_s": r1.ru_stime - r0.ru_stime, "stdout": p.stdout}


def _child_first_register() -> dict:
    """In a fresh process: import, then the first register() on the bundled pair.

    Also counts the kernels numba compiles meanwhile (none where the warm-up covered them).
    """
    from numba.core import event

    compiled: list[str] = []
    event.register("numba:compile", type("L", (event.Listener,), {
        "on_start": lambda s, ev: compiled.append(ev.data["dispatcher"].py_func.__name__),
        "on_end": lambda s, ev: None})())
    t0 = time.perf_counter()
    import pointalign as pa

    t_import = time.perf_counter() - t0
    pair = pa.datasets.load_bunny_pair()
    t = time.perf_counter()
    r = pa.register(pair.source, pair.target, seed=0)
    first = time.perf_counter() - t
    rot, tr = pa.metrics.relative_error(r.transformation, pair.T_target_source)
    return {"import_s": t_import, "first_s": first, "error_deg": float(rot),
            "error_mm": 1e3 * float(tr), "compiled": len(compiled)}


def _child_compile(step: str) -> dict:
    """The warm-up step ``step`` in this process (empty cache), numba's compiles logged."""
    import warnings

    sys.path.insert(0, str(HERE))
    from bench_first_call import _CompileLog

    log = _CompileLog()
    log.install()
    full: dict[str, list[str]] = {}  # kernel -> its signatures, untruncated
    from numba.core import event

    def on_start(ev) -> None:
        name = log._name(ev)
        full.setdefault(name, []).append(", ".join(str(t) for t in ev.data["args"]))

    event.register("numba:compile", type("L", (event.Listener,), {
        "on_start": lambda s, ev: on_start(ev), "on_end": lambda s, ev: None})())
    import torch

    from pointalign import _warmup

    call = dict(_warmup._steps(torch.device("cpu")))[step]
    warnings.simplefilter("ignore")
    t, c = time.perf_counter(), time.process_time()
    call()
    for name, row in log.rows.items():
        row["args"] = full[name]
    return {"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c,
            "kernels": log.rows}


def _python_child(what: str, env: dict, *args: str) -> tuple[dict, dict]:
    code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); "
            f"import bench_first_call_cpu as b; "
            f"print('@@' + json.dumps(b._child_{what}(*{list(args)!r})))")
    r = _timed([sys.executable, "-c", code], env)
    line = [ln for ln in r.pop("stdout").splitlines() if ln.startswith("@@")]
    return json.loads(line[-1][2:]), r


def _row(rec, label: str, run: int, step: str, command: str, r: dict, **extra) -> None:
    rows = rec.tables.setdefault("cold", [])  # a re-measured row replaces the old one
    rows[:] = [x for x in rows if (x.get("label"), x.get("run"), x.get("step"))
               != (label, run, step)]
    rec.add("cold", label=label, run=run, step=step, command=command,
            wall_s=round(r["wall_s"], 2), cpu_s=round(r["user_s"] + r["sys_s"], 2),
            load=round(os.getloadavg()[0], 1), **extra)


def _module(kernel: str) -> str:
    """``knn.cpu._nearest`` -> ``knn``; numba's own overloads (np.empty...) -> ``numba``."""
    return "numba (overloads)" if kernel.startswith("numba.") else kernel.split(".")[0]


def _make_demo(rec, label: str, torch_index: str, ref: str) -> None:
    """``make demo`` end to end in a fresh copy of ``ref``: with pip, then without it."""
    import shutil

    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        env = {k: v for k, v in os.environ.items()
               if k not in ("NUMBA_CACHE_DIR", "PYTHONPATH", "VIRTUAL_ENV")}
        cmd = ["make", "-C", str(tree), "demo", f"TORCH_INDEX={torch_index}"]
        r = _timed(cmd, env)
        _row(rec, label, 1, "make demo (with pip: new .venv)", " ".join(cmd[:1] + cmd[3:]),
             r)
        for f in list(tree.rglob("*.nbi")) + list(tree.rglob("*.nbc")):
            f.unlink()  # the editable install's numba cache (src/.../__pycache__)
        r = _timed(cmd, env)
        _row(rec, label, 1, "make demo (without pip: numba cache emptied)",
             " ".join(cmd[:1] + cmd[3:]), r)
        shutil.rmtree(tree, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="cold sequences, each a fresh cache")
    ap.add_argument("--label", default="current", help="names this run's rows (before/after)")
    ap.add_argument("--compile-table", action="store_true")
    ap.add_argument("--manifest", action="store_true", help="with --compile-table: write "
                    "src/pointalign/kernels/compile_manifest.json")
    ap.add_argument("--skip-all", action="store_true", help="no `pointalign warmup --all`")
    ap.add_argument("--skip-cold", action="store_true", help="no cold sequence")
    ap.add_argument("--ref", default="HEAD", help="the commit --make builds (default HEAD)")
    ap.add_argument("--make", metavar="TORCH_INDEX", default=None,
                    help="also `make demo TORCH_INDEX=...` in a fresh copy of HEAD (git "
                         "archive): with pip (a new .venv), then again with numba's cache "
                         "emptied (without pip)")
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from common import RESULTS, Recorder

    rec = Recorder("first_call", "cpu", title="First call on a fresh CPU (issue 23)",
                   notes="Fresh child processes, empty numba cache per run; cpu_s is user + "
                         "system of the process and its warm-up workers; load: the 1-minute "
                         "load average after the step (a shared 2-core machine: another "
                         "user's tests inflate wall time). `make demo` runs the first two "
                         "steps. before: commit 43593f6 (every method warmed, one worker "
                         "process per method); after: register()'s kernels only, compiled "
                         "kernel by kernel in one process per core, longest first "
                         "(`warmup --all`: the rest), parallel kernels through numba's "
                         "prange pass only.")
    old = RESULTS / "first_call-cpu.json"
    if old.exists():  # keep the rows not measured again (a "before" beside an "after")
        doc = json.loads(old.read_text())
        rec.tables.update(doc.get("tables", {}))
    cli = [sys.executable, "-m", "pointalign"]
    for run in range(1, 0 if a.skip_cold else a.repeat + 1):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, NUMBA_CACHE_DIR=f"{tmp}/numba")
            r = _timed(cli + ["-q", "warmup", "--device", "cpu"], env)
            _row(rec, a.label, run, "warmup", "pointalign warmup", r)
            r = _timed(cli + ["-q", "demo", "--device", "cpu"], env)
            _row(rec, a.label, run, "demo", "pointalign demo", r)
            res, r = _python_child("first_register", env)
            _row(rec, a.label, run, "first register() (fresh process)", "python -c ...", r,
                 import_s=round(res["import_s"], 2), call_s=round(res["first_s"], 2),
                 error_deg=round(res["error_deg"], 3), compiled=res["compiled"])
            if not a.skip_all:
                r = _timed(cli + ["-q", "warmup", "--device", "cpu", "--all"], env)
                _row(rec, a.label, run, "warmup --all (after the above)",
                     "pointalign warmup --all", r)
        if not a.skip_all:  # every method's kernels from an empty cache
            with tempfile.TemporaryDirectory() as tmp:
                env = dict(os.environ, NUMBA_CACHE_DIR=f"{tmp}/numba")
                r = _timed(cli + ["-q", "warmup", "--device", "cpu", "--all"], env)
                _row(rec, a.label, run, "warmup --all (empty cache)",
                     "pointalign warmup --all", r)
    if a.make is not None:
        _make_demo(rec, a.label, a.make, a.ref)
    if a.compile_table:
        rec.tables["compile"] = [r for r in rec.tables.get("compile", [])
                                 if r.get("label") != a.label]
        import torch

        from pointalign import _warmup

        steps = {}
        for step, _ in _warmup._steps(torch.device("cpu")):
            with tempfile.TemporaryDirectory() as tmp:
                env = dict(os.environ, NUMBA_CACHE_DIR=f"{tmp}/numba")
                steps[step], _r = _python_child("compile", env, step)
            print(f"{step}: {steps[step]['cpu_s']:.1f} s CPU", flush=True)
        manifest = {}
        for step, s in steps.items():
            per: dict[str, list[float]] = {}
            for kernel, v in s["kernels"].items():
                m = per.setdefault(_module(kernel), [0, 0.0])
                m[0] += v["signatures"]
                m[1] += v["self_s"]
            for module, (sigs, secs) in sorted(per.items(), key=lambda kv: -kv[1][1]):
                rec.add("compile", label=a.label, step=step, module=module, signatures=sigs,
                        compile_cpu_s=round(secs, 2))
            rec.add("compile", label=a.label, step=step, module="(all)",
                    signatures=sum(v[0] for v in per.values()),
                    compile_cpu_s=round(sum(v[1] for v in per.values()), 2),
                    step_wall_s=round(s["wall_s"], 2), step_cpu_s=round(s["cpu_s"], 2))
            # a kernel's own seconds (its callees are rows of their own), with the step's
            # numba overloads (np.empty...) shared out in proportion: the rows of a step
            # add up to its measured compile time
            ours = {k: v for k, v in s["kernels"].items() if not k.startswith("numba.")}
            scale = sum(v[1] for v in per.values()) / max(
                1e-9, sum(v["self_s"] for v in ours.values()))
            manifest[step] = sorted(
                ([k, args, round(scale * v["self_s"] / v["signatures"], 2)]
                 for k, v in ours.items() for args in v["args"]), key=lambda row: -row[2])
        if a.manifest:
            MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
            print("wrote", MANIFEST)
    print("wrote", rec.save())


if __name__ == "__main__":
    main()
