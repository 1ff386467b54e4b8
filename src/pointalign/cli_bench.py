"""``pointalign bench``: run the benchmark suites of a source checkout, print a summary.

Registered on :data:`pointalign.cli.app` (``cli`` imports this module at its end). The
suites are the ``benchmarks/bench_*.py`` scripts of a source checkout (not part of the
installed package); each runs in its own process, its result rows streamed into a
progress bar and summarised in one table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from pointalign.cli import (
    EXIT_FAILED,
    EXIT_USAGE,
    Device,
    DeviceOpt,
    _error,
    _level,
    _resolve_device,
    command,
    console,
    err,
)


def _find_benchmarks() -> Path | None:
    here = Path(__file__).resolve()
    for base in [Path.cwd(), *Path.cwd().parents, *here.parents]:
        cand = base / "benchmarks"
        if (cand / "common.py").is_file() and any(cand.glob("bench_*.py")):
            return cand
    return None


@command()
def bench(
    ctx: typer.Context,
    quick: Annotated[bool, typer.Option(
        "--quick", help="small sizes: a smoke run (under a minute on a 2-core CPU with the "
                        "default suites)")] = False,
    suite: Annotated[list[str], typer.Option(
        "--suite", metavar="NAME", help="suite name (repeatable), e.g. quick, knn, icp, "
        "kdtree, soft, surface, ransac; default: quick (k-NN, features, ICP, register on the "
        "bundled bunny) with --quick, every other suite otherwise")] = [],  # noqa: B006
    device: DeviceOpt = Device.auto,
    results: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        metavar="DIR", help="folder for the JSON results (default: a temporary folder; the "
                            "recorded results are kept)")] = None,
) -> None:
    """Run the benchmark suites of a source checkout and print a summary table.

    -v also prints each benchmark's own output; -q prints the summary alone.
    """
    level = _level(ctx)
    root = _find_benchmarks()
    if root is None:
        _error("the benchmarks are not part of the installed package: run 'pointalign "
               "bench' inside a source checkout of pointalign (the folder that holds "
               "benchmarks/), e.g. after 'git clone' and 'make demo'.")
        raise typer.Exit(EXIT_USAGE)
    available = sorted(p.stem.removeprefix("bench_") for p in root.glob("bench_*.py"))
    # --quick: the one-process quick look (bench_quick.py); full: every suite but that one
    chosen = list(suite) or (["quick"] if quick and "quick" in available else
                             ["knn"] if quick else [s for s in available if s != "quick"])
    unknown = [s for s in chosen if s not in available]
    if unknown:
        raise typer.BadParameter(f"unknown suite(s) {', '.join(unknown)}; available: "
                                 f"{', '.join(available)}", param_hint="--suite")
    dev = _resolve_device(device)
    if results is not None:
        if not results.is_dir():
            raise typer.BadParameter(f"folder {results} does not exist", param_hint="--results")
        out_dir = results
    else:
        import tempfile

        out_dir = Path(tempfile.mkdtemp(prefix="pointalign-bench-"))
    from pointalign import _progress

    env = dict(os.environ, POINTALIGN_BENCH_RESULTS=str(out_dir), PYTHONUNBUFFERED="1")
    src_dir = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src_dir), env.get("PYTHONPATH")]))
    summary = Table(title=f"pointalign bench ({dev}{', quick' if quick else ''})")
    for col in ("suite", "status", "rows", "seconds", "fastest at the largest size"):
        summary.add_column(col)
    failed = 0
    details: list[tuple[str, list[dict[str, Any]]]] = []
    for name in _progress.track(chosen, "benchmarks", quiet=level < 0):
        cmd = [sys.executable, str(root / f"bench_{name}.py"), "--device", dev]
        cmd += ["--quick"] if quick else []
        if level >= 0:
            console.print(f"running {name} ...")
        t0 = time.perf_counter()
        code, stdout, stderr = _run_suite(cmd, env, name, echo=level >= 1, quiet=level < 0)
        secs = time.perf_counter() - t0
        rows = _bench_rows(stdout)
        ok = code == 0
        failed += not ok
        detailed = bool(rows) and all("operation" in r for r in rows)
        summary.add_row(name, "[green]ok[/green]" if ok else f"[red]exit {code}[/red]",
                        str(len(rows)), f"{secs:.1f}",
                        "see its table above" if detailed else _bench_headline(rows))
        if detailed:
            details.append((name, rows))
        if not ok and stderr:
            err.print(stderr[-1500:], markup=False)
    for name, rows in details:
        console.print(_operation_table(name, rows))
    console.print(summary)
    saved = sorted(out_dir.glob("*.json"))
    if saved:
        console.print(f"JSON results in {out_dir}")
    if failed:
        raise typer.Exit(EXIT_FAILED)


def _run_suite(cmd: list[str], env: dict[str, str], name: str, *, echo: bool,
               quiet: bool) -> tuple[int, str, str]:
    """Run one benchmark script; stream its rows into a progress bar (and echo with -v).

    Returns the exit code, standard output and standard error (read by a thread so that
    neither pipe fills up).
    """
    import threading

    from pointalign import _progress

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1)
    err_parts: list[str] = []
    reader = threading.Thread(target=lambda: err_parts.append(proc.stderr.read()),  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    out: list[str] = []
    rows = 0
    with _progress.task(f"{name}: 0 rows", quiet=quiet) as bar:
        for line in proc.stdout:  # type: ignore[union-attr]
            out.append(line)
            if echo:
                console.print(line.rstrip("\n"), markup=False)
            if line.lstrip().startswith("{"):
                rows += 1
                bar.update(description=f"{name}: {rows} rows")
    code = proc.wait()
    reader.join()
    return code, "".join(out), "".join(err_parts)


def _operation_table(name: str, rows: list[dict[str, Any]]) -> Table:
    """One table row per benchmark row of a suite whose rows name an ``operation``."""
    keys = [k for k in ("operation", "size", "pointalign_ms", "peer", "peer_ms", "ratio",
                        "check") if any(r.get(k) not in (None, "") for r in rows)]
    table = Table(title=f"{name}: times in ms (median)")
    names = {"pointalign_ms": "ours ms", "ratio": "ours/peer"}
    for k in keys:
        table.add_column(names.get(k, k.replace("_", " ")),
                         justify="right" if k.endswith(("ms", "ratio")) else "left")
    def cell(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return str(v)

    for r in rows:
        table.add_row(*[cell(r.get(k)) for k in keys])
    return table


def _bench_rows(stdout: str) -> list[dict[str, Any]]:
    """Parse the result rows a benchmark printed (one JSON object per line)."""
    rows = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _bench_headline(rows: list[dict[str, Any]], n: int = 8) -> str:
    """Describe the rows at the largest size: method (or label) and its time, fastest first."""
    def size(r: dict[str, Any]) -> float:
        for k in ("n", "n_source", "points", "n_points", "size"):
            if isinstance(r.get(k), (int, float)):
                return float(r[k])
        return 0.0

    def timing(r: dict[str, Any]) -> tuple[str, float] | None:
        for k in ("ms_per_iter", "total_ms", "median_ms", "ms"):
            if isinstance(r.get(k), (int, float)):
                return k, float(r[k])
        for k, v in r.items():
            if k.endswith("_ms") and isinstance(v, (int, float)):
                return k, float(v)
        return None

    timed = [r for r in rows if timing(r) is not None]
    if not timed:
        return "-"
    big = max(size(r) for r in timed)
    out = []
    for r in timed:
        if size(r) != big:
            continue
        key, ms = timing(r)  # type: ignore[misc]
        label = str(r.get("method") or r.get("case") or r.get("dataset") or "?")
        where = r.get("dataset") or r.get("problem")
        out.append((ms, f"{label}{f' ({where})' if where else ''}: {ms:.3g} {key}"))
    head = f"at size {big:.0f}:\n" if big else ""
    seen: set[str] = set()
    lines = []
    for _, t in sorted(out):
        name = t.split(":")[0]
        if name not in seen:
            seen.add(name)
            lines.append(t)
    return head + "\n".join(lines[:n])
