"""The ``register-many`` and ``multiway`` commands, for the typer app of :mod:`pointalign.cli`.

``register_commands(app)`` adds them; parsing and printing only, the work is
:func:`pointalign.registration.many.register_many` and
:func:`pointalign.registration.multiway.multiway`.
"""

from __future__ import annotations

import csv
import enum
import json
from pathlib import Path
from typing import Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

EXIT_FAILED = 1
EXIT_NOT_CONVERGED = 3

console = Console(highlight=False)
err = Console(stderr=True, highlight=False)

_T_COLUMNS = [f"T{r}{c}" for r in range(4) for c in range(4)]


class Device(str, enum.Enum):
    """Compute device choices."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Edges(str, enum.Enum):
    """Candidate edges of ``multiway``."""

    all = "all"
    neighbours = "neighbours"


class Solver(str, enum.Enum):
    """Pose-graph solvers of ``multiway``."""

    auto = "auto"
    gtsam = "gtsam"
    scipy = "scipy"


def read_pairs(path: Path) -> list[dict[str, Any]]:
    """Read a pairs CSV: columns ``source``, ``target`` and optionally ``name`` and ``T00``…``T33``.

    Relative paths are taken from the CSV's folder. A row with the sixteen ``Tij`` gives
    its pair an initial ``T_target_source`` (the global stage is skipped).
    """
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise ValueError(f"PAIRS: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if not rows or not {"source", "target"} <= set(rows[0]):
        raise ValueError(f"PAIRS: {str(path)!r} needs a header with 'source' and 'target' "
                         "columns and at least one row")
    out = []
    for k, r in enumerate(rows, 2):
        spec: dict[str, Any] = {}
        for key in ("source", "target"):
            p = Path(r[key] or "")
            spec[key] = str(p if p.is_absolute() else path.parent / p)
        spec["name"] = r.get("name") or f"{Path(r['source']).name}->{Path(r['target']).name}"
        if all(r.get(c) not in (None, "") for c in _T_COLUMNS):
            try:
                spec["init"] = np.array([float(r[c]) for c in _T_COLUMNS]).reshape(4, 4)
            except ValueError:
                raise ValueError(f"PAIRS: line {k}: T00..T33 must be numbers") from None
        out.append(spec)
    return out


def _json_safe(v: Any) -> Any:
    """Plain JSON values: arrays as lists, non-finite floats as None."""
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, np.ndarray):
        return _json_safe(v.tolist())
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if np.isfinite(v) else None
    return v


def register_commands(app: typer.Typer) -> None:
    """Add ``register-many`` and ``multiway`` to ``app``."""

    @app.command("register-many")
    def register_many_cmd(
        pairs: Path = typer.Argument(..., metavar="PAIRS.csv", exists=True, dir_okay=False,
                                     readable=True, help="CSV with source,target[,name]"
                                     "[,T00..T33] columns (paths relative to the CSV)"),
        output: Path = typer.Option(Path("register_many.csv"), "--output", "-o",
                                    help="result table: .csv or .parquet"),
        scheduler: str | None = typer.Option(None, "--scheduler", metavar="ADDRESS",
                                             help="Dask scheduler address (tcp://host:port);"
                                             " default: this machine"),
        device: Device = typer.Option(Device.auto, help="compute device (without "
                                      "--scheduler)"),
        chunk_size: int | None = typer.Option(None, min=1, metavar="N",
                                              help="pairs per batch / per Dask task"),
        voxel_size: float | None = typer.Option(None, min=0.0, help="voxel edge (default: "
                                                "register()'s rule per pair)"),
        hypotheses: int = typer.Option(16384, min=1, metavar="N", help="RANSAC hypotheses"),
        seed: int = typer.Option(0, min=0, metavar="N", help="RANSAC seed"),
        retries: int = typer.Option(2, min=0, metavar="N", help="reruns of a failed task"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress, no table"),
    ) -> None:
        """Register every pair of PAIRS.csv, batched (or on a Dask cluster); one table."""
        from pointalign.registration.many import register_many

        if output.suffix.lower() not in (".csv", ".parquet"):
            err.print(f"[red]--output: expected a .csv or .parquet file, got {output}[/red]")
            raise typer.Exit(EXIT_FAILED)
        try:
            specs = read_pairs(pairs)
        except ValueError as exc:
            err.print(f"[red]{exc}[/red]")
            raise typer.Exit(EXIT_FAILED) from None
        client = None
        if scheduler is not None:
            try:
                from distributed import Client
            except ImportError:
                err.print("[red]--scheduler needs Dask's distributed: pip install "
                          "'pointalign[dist]'[/red]")
                raise typer.Exit(EXIT_FAILED) from None
            client = Client(scheduler)
        try:
            res = register_many(specs, client=client, chunk_size=chunk_size, retries=retries,
                                device=None if device is Device.auto or client is not None
                                else device.value, on_error="record", progress=not quiet,
                                voxel_size=voxel_size or None, hypotheses=hypotheses,
                                seed=seed)
            if output.suffix.lower() == ".parquet":
                res.to_parquet(output)
            else:
                res.to_csv(output)
        except (OSError, ValueError, ImportError) as exc:
            err.print(f"[red]{exc}[/red]")
            raise typer.Exit(EXIT_FAILED) from None
        finally:
            if client is not None:
                client.close()
        failed = sum(bool(r["error"]) for r in res.rows)
        doubtful = sum(not r["trusted"] for r in res.rows) - failed
        if not quiet:
            table = Table(title=f"register-many: {len(res)} pair(s)")
            for col in ("pair", "fitness", "rmse", "verdict", "ms"):
                table.add_column(col, justify="left" if col in ("pair", "verdict")
                                 else "right")
            for r in res.rows[:50]:
                table.add_row(r["name"], f"{r['fitness']:.4f}", f"{r['rmse']:.4g}",
                              r["error"] or r["verdict"], f"{r['total_s'] * 1e3:.0f}")
            console.print(table)
            if len(res) > 50:
                console.print(f"... {len(res) - 50} more in {output}")
            console.print(f"{len(res)} pairs in {res.timings['total']:.1f} s "
                          f"({len(res) / max(res.timings['total'], 1e-9):.1f} pairs/s); "
                          f"table written to {output}")
        if failed:
            err.print(f"[red]{failed} pair(s) failed (see the 'error' column)[/red]")
            raise typer.Exit(EXIT_FAILED)
        if doubtful:
            err.print(f"[yellow]{doubtful} pair(s) not trusted (see 'verdict')[/yellow]")
            raise typer.Exit(EXIT_NOT_CONVERGED)

    @app.command("multiway")
    def multiway_cmd(
        scans: list[Path] = typer.Argument(..., metavar="SCANS...", exists=True,
                                           dir_okay=False, readable=True,
                                           help="two or more clouds; the first is the frame"),
        output: Path | None = typer.Option(None, "--output", "-o",
                                           help="merged cloud (.ply, .pcd, ...)"),
        json_out: Path | None = typer.Option(None, "--json", help="poses and edges as JSON"),
        device: Device = typer.Option(Device.auto, help="compute device"),
        edges: Edges = typer.Option(Edges.all, help="candidate edges"),
        loop_closures: int = typer.Option(0, min=0, metavar="N", help="extra candidates "
                                          "with --edges neighbours"),
        voxel_size: float | None = typer.Option(None, min=0.0, help="registration voxel "
                                                "edge (default: register()'s rule)"),
        merge_voxel: float | None = typer.Option(None, min=0.0, help="downsample the merged "
                                                 "cloud at this edge"),
        solver: Solver = typer.Option(Solver.auto, help="pose-graph solver"),
        refine: int = typer.Option(1, min=0, metavar="N", help="joint refinement rounds"),
        hypotheses: int = typer.Option(16384, min=1, metavar="N", help="RANSAC hypotheses"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress, no table"),
    ) -> None:
        """Register SCANS into the first one's frame (pairs + robust pose graph)."""
        from pointalign import io
        from pointalign.registration.multiway import multiway

        try:
            res = multiway([str(s) for s in scans], edges=edges.value,
                           loop_closures=loop_closures, voxel_size=voxel_size or None,
                           solver=solver.value, refine=refine, hypotheses=hypotheses,
                           device=None if device is Device.auto else device.value,
                           progress=not quiet)
            if output is not None:
                io.write(output, res.merge([str(s) for s in scans], merge_voxel or None))
            if json_out is not None:
                doc = {"scans": [str(s) for s in scans], "solver": res.solver,
                       "voxel_size": res.voxel_size, "poses": res.poses.tolist(),
                       "edges": res.edges, "timings": res.timings}
                json_out.write_text(json.dumps(_json_safe(doc), indent=1, allow_nan=False)
                                    + "\n", encoding="utf-8")
        except (OSError, ValueError, ImportError) as exc:
            err.print(f"[red]{exc}[/red]")
            raise typer.Exit(EXIT_FAILED) from None
        if not quiet:
            table = Table(title=f"multiway: {len(scans)} scans, {len(res.edges)} candidate "
                          f"edges, solver {res.solver}")
            for col in ("edge", "verdict", "kept", "residual (voxels)"):
                table.add_column(col, justify="left" if col != "residual (voxels)"
                                 else "right")
            for e in res.edges:
                table.add_row(f"{scans[e['j']].name} -> {scans[e['i']].name}", e["verdict"],
                              "yes" if e["kept"] else "no",
                              "-" if not np.isfinite(e["residual"]) else f"{e['residual']:.3f}")
            console.print(table)
            console.print(f"{len(scans)} poses in {res.timings['total']:.1f} s"
                          + (f"; merged cloud written to {output}" if output else ""))
