"""The ``register-many`` and ``multiway`` commands of :mod:`pointalign.cli`.

:func:`register_commands` adds them to an app; ``pointalign.cli`` calls it on its own app,
so they take the program's ``-v``/``-q``/``--config`` like every other command (a
``[register-many]`` or ``[multiway]`` table of the TOML file holds their options), and
their shared options are the CLI's ``Annotated`` aliases (``DeviceOpt``, ``SeedOpt``,
``VoxelSizeOpt``, ...). Parsing and printing only: the work is
:func:`pointalign.registration.many.register_many` and
:func:`pointalign.registration.multiway.multiway`.

No ``from __future__ import annotations`` here: the commands are defined inside
:func:`register_commands`, where the aliases are imported (``pointalign.cli`` imports this
module at its end), and typer reads their annotations as the objects they are.
"""

import csv
import enum
import json
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import typer

_T_COLUMNS = [f"T{r}{c}" for r in range(4) for c in range(4)]
TABLE_SUFFIXES = (".csv", ".parquet")


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
    """Add ``register-many`` and ``multiway`` to ``app`` (the CLI's command class)."""
    from rich.markup import escape
    from rich.table import Table

    from pointalign.cli import (
        EXIT_FAILED,
        EXIT_NOT_CONVERGED,
        AllowFailureOpt,
        Device,
        DeviceOpt,
        JsonOpt,
        MaxIterationsOpt,
        RefineOpt,
        SeedOpt,
        VoxelSizeOpt,
        _check_output,
        _Command,
        _error,
        _level,
        _positive,
        _refine,
        _resolve_device,
        _say,
        _version,
        console,
    )

    HypothesesOpt = Annotated[Optional[int], typer.Option(  # noqa: N806,UP045 (as cli.py's)
        min=1, metavar="N", help="RANSAC hypotheses per batch (default: register's)")]

    def _options(**given: Any) -> dict[str, Any]:
        """Return register's options the command was given (the others keep its defaults)."""
        return {k: v for k, v in given.items() if v is not None}

    @app.command("register-many", cls=_Command)
    def register_many_cmd(
        ctx: typer.Context,
        pairs: Annotated[Path, typer.Argument(
            metavar="PAIRS.csv", exists=True, dir_okay=False, readable=True,
            help="CSV with source,target[,name][,T00..T33] columns (paths relative to the "
                 "CSV; T00..T33: an initial T_target_source, no global stage)")],
        output: Annotated[Path, typer.Option(
            "--output", "-o", metavar="FILE", help="result table: .csv or .parquet (one "
                                                   "row per pair)")] = Path("register_many.csv"),
        scheduler: Annotated[Optional[str], typer.Option(  # noqa: UP045
            metavar="ADDRESS", help="Dask scheduler address (tcp://host:port): each chunk "
                                    "of pairs is one task on its workers; default: this "
                                    "machine")] = None,
        device: DeviceOpt = Device.auto,
        chunk_size: Annotated[Optional[int], typer.Option(  # noqa: UP045
            min=1, metavar="N", help="pairs per batch / per Dask task (default: "
                                     "register_many's for the device)")] = None,
        voxel_size: VoxelSizeOpt = None,
        hypotheses: HypothesesOpt = None,
        seed: SeedOpt = None,
        refine: RefineOpt = None,
        max_iterations: MaxIterationsOpt = None,
        retries: Annotated[int, typer.Option(
            min=0, metavar="N", help="reruns of a Dask task that raised")] = 2,
        allow_failure: AllowFailureOpt = False,
    ) -> None:
        """Register every pair of PAIRS.csv, batched (or on a Dask cluster); one table."""
        from pointalign.registration.many import register_many

        level = _level(ctx)
        _check_output(output, TABLE_SUFFIXES, "--output")
        dev = None if scheduler is not None or device is Device.auto \
            else _resolve_device(device)
        try:
            specs = read_pairs(pairs)
        except ValueError as exc:
            _error(str(exc))
            raise typer.Exit(EXIT_FAILED) from None
        client = None
        if scheduler is not None:
            try:
                from distributed import Client
            except ImportError:
                _error("--scheduler needs Dask's distributed: pip install 'pointalign[dist]'")
                raise typer.Exit(EXIT_FAILED) from None
            client = Client(scheduler)
        try:
            res = register_many(specs, client=client, chunk_size=chunk_size, retries=retries,
                                device=dev, on_error="record",
                                progress=False if level < 0 else None,
                                **_options(voxel_size=voxel_size, seed=seed,
                                           refine=_refine(refine), hypotheses=hypotheses,
                                           max_iterations=max_iterations))
            if output.suffix.lower() == ".parquet":
                res.to_parquet(output)
            else:
                res.to_csv(output)
        except (OSError, ValueError, ImportError) as exc:
            _error(str(exc))
            raise typer.Exit(EXIT_FAILED) from None
        finally:
            if client is not None:
                client.close()
        failed = sum(bool(r["error"]) for r in res.rows)
        doubtful = sum(not r["trusted"] for r in res.rows) - failed
        if level >= 0:
            table = Table(title=f"register-many: {len(res)} pair(s)")
            for col in ("pair", "fitness", "rmse", "verdict", "ms"):
                table.add_column(col, justify="left" if col in ("pair", "verdict")
                                 else "right")
            for r in res.rows[:50]:
                table.add_row(escape(r["name"]), f"{r['fitness']:.4f}", f"{r['rmse']:.4g}",
                              escape(r["error"] or r["verdict"]), f"{r['total_s'] * 1e3:.0f}")
            console.print(table)
            if len(res) > 50:
                console.print(f"... {len(res) - 50} more in {escape(str(output))}")
        _say(level, f"{len(res)} pairs in {res.timings['total']:.1f} s "
                    f"({len(res) / max(res.timings['total'], 1e-9):.1f} pairs/s); table "
                    f"written to {escape(str(output))}")
        if failed:
            _error(f"{failed} pair(s) failed (see the 'error' column)")
            raise typer.Exit(EXIT_FAILED)
        if doubtful:
            _error(f"{doubtful} pair(s) not trusted (see the 'verdict' column)"
                   + (" (--allow-failure: exit 0)" if allow_failure else ""))
            if not allow_failure:
                raise typer.Exit(EXIT_NOT_CONVERGED)

    @app.command("multiway", cls=_Command)
    def multiway_cmd(
        ctx: typer.Context,
        scans: Annotated[list[Path], typer.Argument(
            metavar="SCANS...", exists=True, dir_okay=False, readable=True,
            help="two or more clouds; the first is the frame")],
        output: Annotated[Optional[Path], typer.Option(  # noqa: UP045
            "--output", "-o", metavar="FILE", help="the merged cloud (.ply, .pcd, ...)")
        ] = None,
        json_out: JsonOpt = None,
        device: DeviceOpt = Device.auto,
        edges: Annotated[Edges, typer.Option(
            help="candidate edges: every pair, or each scan with the next and loop "
                 "closures")] = Edges.all,
        loop_closures: Annotated[int, typer.Option(
            min=0, metavar="N", help="extra candidates with --edges neighbours")] = 0,
        voxel_size: VoxelSizeOpt = None,
        merge_voxel: Annotated[Optional[float], typer.Option(  # noqa: UP045
            callback=_positive, metavar="FLOAT",
            help="downsample the merged cloud at this edge (default: every point)")] = None,
        solver: Annotated[Solver, typer.Option(
            help="pose-graph solver (auto: gtsam where installed, else SciPy)")
        ] = Solver.auto,
        rounds: Annotated[int, typer.Option(
            min=0, metavar="N", help="joint refinement rounds: kept edges registered again "
                                     "from the graph's poses (multiway(refine=N))")] = 1,
        hypotheses: HypothesesOpt = None,
        seed: SeedOpt = None,
        max_iterations: MaxIterationsOpt = None,
    ) -> None:
        """Register SCANS into the first one's frame (pairs + robust pose graph)."""
        from pointalign import io
        from pointalign.cli import CLOUD_SUFFIXES
        from pointalign.registration.multiway import multiway

        level = _level(ctx)
        _check_output(output, CLOUD_SUFFIXES[:-1], "--output")
        _check_output(json_out, (".json",), "--json")
        dev = None if device is Device.auto else _resolve_device(device)
        opts = _options(voxel_size=voxel_size, seed=seed, hypotheses=hypotheses,
                        max_iterations=max_iterations)
        try:
            res = multiway([str(s) for s in scans], edges=edges.value,
                           loop_closures=loop_closures, solver=solver.value, refine=rounds,
                           device=dev, progress=False if level < 0 else None, **opts)
            if output is not None:
                io.write(output, res.merge([str(s) for s in scans], merge_voxel))
            if json_out is not None:
                doc = {"pointalign_version": _version(), "command": "multiway",
                       "scans": [str(s) for s in scans], "solver": res.solver,
                       "voxel_size": res.voxel_size, "poses": res.poses.tolist(),
                       "edges": res.edges, "timings": res.timings}
                json_out.write_text(json.dumps(_json_safe(doc), indent=1, allow_nan=False)
                                    + "\n", encoding="utf-8")
        except (OSError, ValueError, ImportError) as exc:
            _error(str(exc))
            raise typer.Exit(EXIT_FAILED) from None
        if level >= 0:
            table = Table(title=f"multiway: {len(scans)} scans, {len(res.edges)} candidate "
                          f"edges, solver {res.solver}")
            for col in ("edge", "verdict", "kept", "residual (voxels)"):
                table.add_column(col, justify="left" if col != "residual (voxels)"
                                 else "right")
            for e in res.edges:
                table.add_row(escape(f"{scans[e['j']].name} -> {scans[e['i']].name}"),
                              escape(e["verdict"]), "yes" if e["kept"] else "no",
                              "-" if not np.isfinite(e["residual"]) else f"{e['residual']:.3f}")
            console.print(table)
        _say(level, f"{len(scans)} poses in {res.timings['total']:.1f} s"
                    + (f"; merged cloud written to {escape(str(output))}" if output else ""))
