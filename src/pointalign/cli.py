"""Command line: ``pointalign info | register | batch | demo | view | bench``.

Parses, checks every option and output path before any work, calls the public API, prints.
No numerics live here. Exit codes: 0 success; 1 the work failed (unreadable data, an error
while registering); 2 usage error (bad option, missing input, unwritable output); 3 the
registration ran but did not converge (``--allow-failure`` keeps 0).

Every option of a command can also come from a TOML file given with ``--config``: keys are
the option names (``max-distance`` or ``max_distance``), at the top level or in a table
named after the command (``[register]``), which wins; options on the command line win over
the file.
"""

from __future__ import annotations

import enum
import importlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_CONVERGED = 3

# plain click help (rich_markup_mode=None): choices shown as [a|b|c], flags without a type
app = typer.Typer(
    add_completion=False, no_args_is_help=True, rich_markup_mode=None,
    help="Rigid point-cloud registration on the GPU and the CPU.",
    epilog="Exit codes: 0 success, 1 failure, 2 usage error, 3 registration did not "
           "converge (see --allow-failure).")
console = Console(highlight=False)
err = Console(stderr=True, highlight=False)

#: method name -> (module, function, what it does); resolved lazily so a method whose
#: module is missing gets a clear message instead of an ImportError.
METHODS: dict[str, tuple[str, str, str]] = {
    "global": ("pointalign.registration.pipeline", "register",
               "FPFH + parallel RANSAC, then point-to-plane ICP (works from any pose)"),
    "icp": ("pointalign.registration.icp", "icp", "point-to-point ICP (local)"),
    "icp-plane": ("pointalign.registration.icp", "icp", "point-to-plane ICP (local)"),
    "emicp": ("pointalign.registration.soft", "emicp", "EM-ICP, soft correspondences"),
    "softassign": ("pointalign.registration.soft", "softassign", "Softassign with Sinkhorn"),
    "newton": ("pointalign.registration.surface", "surface_newton",
               "distance-map Newton (point-to-plane approximant)"),
    "approx-icp": ("pointalign.registration.surface", "approximate_icp",
                   "ICP on k-d tree cell approximants"),
}

Method = enum.Enum(  # type: ignore[misc]  # mypy reads only literal functional Enums
    "Method", {m.replace("-", "_").upper(): m for m in METHODS}, type=str)


class Device(str, enum.Enum):
    """Compute device choices."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


#: which of the shared options each method uses (the others are reported as ignored)
USES: dict[str, set[str]] = {
    "global": {"voxel_size", "max_iterations", "seed"},
    "icp": {"init", "max_distance", "max_iterations"},
    "icp-plane": {"init", "max_distance", "max_iterations"},
    "emicp": {"init", "max_iterations"},
    "softassign": {"init", "max_iterations"},
    "newton": {"init", "max_distance", "max_iterations"},
    "approx-icp": {"init", "max_distance", "max_iterations"},
}

CLOUD_SUFFIXES = (".ply", ".pcd", ".xyz", ".txt", ".csv", ".pts", ".xyzn", ".xyzrgb", ".npy",
                  ".npz", ".las", ".laz", ".bin")
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg")
HTML_SUFFIXES = (".html", ".htm")


# ------------------------------------------------------------------------------ helpers

def _version() -> str:
    import pointalign

    return pointalign.__version__


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"pointalign {_version()}")
        raise typer.Exit()


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise typer.BadParameter("reading TOML on Python 3.10 needs 'pip install tomli'",
                                     param_hint="--config") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror or exc}",
                                 param_hint="--config") from None
    except tomllib.TOMLDecodeError as exc:
        raise typer.BadParameter(f"{path} is not valid TOML: {exc}",
                                 param_hint="--config") from None


def _config_callback(ctx: typer.Context, param: Any, value: Path | None) -> Path | None:
    """Eager: read the TOML file into the command's default_map before other options."""
    if value is None:
        return value
    doc = _load_toml(value)
    cmd = ctx.info_name or ""
    names: dict[str, str] = {}
    for p in ctx.command.params:
        if getattr(p, "param_type_name", "") != "option" or p.name == "config":
            continue
        names[p.name] = p.name
        for opt in p.opts:
            names[opt.lstrip("-").replace("-", "_")] = p.name
    section = doc.get(cmd, {})
    flat = {k: v for k, v in doc.items() if not isinstance(v, dict)}
    if not isinstance(section, dict):
        raise typer.BadParameter(f"[{cmd}] must be a table", param_hint="--config")
    flat.update(section)
    defaults: dict[str, Any] = {}
    for key, v in flat.items():
        k = key.replace("-", "_")
        if k not in names:
            known = ", ".join(sorted(n.replace("_", "-") for n in set(names.values())))
            raise typer.BadParameter(f"{value}: unknown option {key!r} for '{cmd}'; "
                                     f"known: {known}", param_hint="--config")
        defaults[names[k]] = v
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def _config_option() -> Any:
    return typer.Option(None, "--config", help="TOML file with values for any option "
                        "(keys = option names; a table named after the command wins over "
                        "top-level keys)",
                        callback=_config_callback, is_eager=True, exists=True,
                        dir_okay=False, metavar="FILE.toml")


def _verbosity(verbose: int, quiet: bool) -> int:
    from pointalign import _progress

    if verbose and quiet:
        raise typer.BadParameter("--verbose and --quiet exclude each other",
                                 param_hint="--quiet")
    level = -1 if quiet else verbose
    _progress.configure_logging(level)
    _short_warnings()
    return level


def _short_warnings() -> None:
    """Show the library's warnings as one yellow line each.

    Python's default shows the file, line and source of the warning: noise for a
    command-line user. Other warnings keep Python's format.
    """
    import warnings

    from pointalign import _progress

    default = warnings.showwarning
    if getattr(default, "_pointalign_cli", False):
        return

    def show(message: Any, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if issubclass(category, _progress.PointalignWarning):
            err.print(f"[yellow]warning: {message}[/yellow]")
        else:
            default(message, category, filename, lineno, file, line)

    show._pointalign_cli = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def _positive(value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"expected a finite number > 0, got {value}")
    return value


def _check_output(path: Path | None, suffixes: tuple[str, ...], hint: str) -> None:
    """Fail with a usage error unless ``path`` can be written (before any work)."""
    if path is None:
        return
    if path.suffix.lower() not in suffixes:
        raise typer.BadParameter(f"{path}: unknown suffix {path.suffix!r}; use one of "
                                 f"{', '.join(suffixes)}", param_hint=hint)
    if path.is_dir():
        raise typer.BadParameter(f"{path} is a directory", param_hint=hint)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise typer.BadParameter(f"folder {parent} does not exist", param_hint=hint)
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise typer.BadParameter(f"{path} is not writable", param_hint=hint)


def _check_input(path: Path, hint: str) -> None:
    if path.suffix.lower() not in CLOUD_SUFFIXES:
        raise typer.BadParameter(f"{path}: unknown suffix {path.suffix!r}; readable: "
                                 f"{', '.join(CLOUD_SUFFIXES)}", param_hint=hint)


def _check_reports(json_out: Path | None, plot: Path | None, html: Path | None) -> None:
    """Check the report paths (``--json``, ``--plot``, ``--html``) and their extras first."""
    _check_output(json_out, (".json",), "--json")
    _check_output(plot, PLOT_SUFFIXES, "--plot")
    _check_output(html, HTML_SUFFIXES, "--html")
    if plot is not None:
        _need_module("matplotlib", "viz", "--plot")
    if html is not None:
        _need_module("plotly", "viz", "--html")


def _resolve_device(device: Device) -> str:
    import torch

    if device is Device.auto:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device is Device.cuda and not torch.cuda.is_available():
        raise typer.BadParameter("cuda was asked for but no CUDA device is available "
                                 "(use --device cpu)", param_hint="--device")
    return device.value


def _need_module(module: str, extra: str, hint: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        raise typer.BadParameter(f"needs {module}: pip install 'pointalign[{extra}]'",
                                 param_hint=hint) from None


def _resolve(method: str) -> Callable[..., Any]:
    module, func, _ = METHODS[method]
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError):
        err.print(f"[red]method {method!r} is not available in this build "
                  f"({module}.{func} is missing).[/red]")
        raise typer.Exit(EXIT_FAILED) from None


def _read_init(path: Path | None) -> np.ndarray | None:
    """Read an initial transform from a text file (16 numbers) or a result JSON (before work)."""
    if path is None:
        return None
    from pointalign import _validate
    from pointalign.registration.result import RegistrationResult

    try:
        if path.suffix.lower() == ".json":
            T = RegistrationResult.load(path).transformation
        else:
            T = np.loadtxt(path, dtype=np.float64).reshape(4, 4)
        return _validate.as_transform(T, "init").numpy()
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"{path}: {exc}", param_hint="--init") from None


def _read_cloud(path: Path, bin_columns: int) -> Any:
    from pointalign import io

    if path.suffix.lower() == ".bin":
        return io.read_bin(path, columns=bin_columns)
    return io.read(path)


def _ignored(method: str, given: dict[str, Any]) -> list[str]:
    return [k for k, v in given.items() if v is not None and k not in USES[method]]


def _run(method: str, source: Any, target: Any, *, init: np.ndarray | None, device: str,
         max_distance: float | None, voxel_size: float | None, max_iterations: int | None,
         seed: int | None) -> tuple[Any, dict[str, Any]]:
    """Run one method; returns the result and the parameters actually used."""
    from pointalign import _validate
    from pointalign.registration.criteria import ConvergenceCriteria

    fn = _resolve(method)
    used: dict[str, Any] = {"method": method, "device": device}
    crit = None if max_iterations is None else ConvergenceCriteria(max_iterations=max_iterations)
    if method == "global":
        kw: dict[str, Any] = {"voxel_size": voxel_size, "device": device}
        if max_iterations is not None:
            kw["max_iterations"] = max_iterations
        if seed is not None:
            kw["seed"] = seed
        result = fn(source, target, **kw)
        v = float(result.info.get("voxel_size", voxel_size or float("nan")))
        used.update(voxel_size=v, voxel_size_source="given" if voxel_size else "automatic",
                    max_distance=0.5 * v, max_distance_source="0.5 x voxel size (final ICP)",
                    max_iterations=max_iterations or 30, seed=seed or 0)
        return result, used
    common: dict[str, Any] = {"init": init, "device": device}
    if crit is not None:
        common["criteria"] = crit
    if method in ("icp", "icp-plane"):
        src = _validate.as_points(source, "source")
        dist = max_distance
        used["max_distance_source"] = "given"
        if dist is None:
            dist = 0.05 * float((src.amax(0) - src.amin(0)).norm())
            used["max_distance_source"] = "5% of the source's bounding-box diagonal"
        used["max_distance"] = dist
        used["estimation"] = "point_to_plane" if method == "icp-plane" else "point_to_point"
        result = fn(source, target, max_correspondence_distance=dist,
                    method=used["estimation"], **common)
    elif method in ("newton", "approx-icp"):
        used["max_distance"] = max_distance
        used["max_distance_source"] = "given" if max_distance else "none (no truncation)"
        result = fn(source, target, max_correspondence_distance=max_distance, **common)
    else:
        result = fn(source, target, **common)
    used["max_iterations"] = max_iterations if max_iterations is not None else "method default"
    return result, used


def _print_result(result: Any, used: dict[str, Any]) -> None:
    table = Table(title="parameters used", show_header=False)
    table.add_column("parameter")
    table.add_column("value")
    for k, v in used.items():
        if k.endswith("_source"):
            continue
        src = used.get(f"{k}_source")
        val = f"{v:.6g}" if isinstance(v, float) else str(v)
        table.add_row(k.replace("_", " "), val + (f" ({src})" if src else ""))
    table.add_row("pointalign", _version())
    console.print(table)
    console.print(result.summary())
    console.print(np.array2string(np.asarray(result.transformation), precision=6,
                                  suppress_small=True))


def _json_doc(command: str, inputs: dict[str, Any], used: dict[str, Any], result: Any,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch

    res = result.to_dict()
    # the headline numbers also at the top level, for scripts (jq .transformation)
    doc = {"pointalign_version": _version(), "command": command, "inputs": inputs,
           "parameters": used, "device": used.get("device"), "torch": torch.__version__,
           **{k: res[k] for k in ("transformation", "fitness", "rmse", "iterations",
                                  "converged", "stop_reason")},
           "result": res}
    if extra:
        doc.update(extra)
    return doc


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    from pointalign.registration.result import _jsonable

    path.write_text(json.dumps(_jsonable(doc), indent=2, allow_nan=False) + "\n")


def _pictures(src: Any, tgt: Any, result: Any, plot: Path | None, html: Path | None,
              title: str) -> None:
    from pointalign import viz

    if plot is not None:
        viz.render(src, tgt, result.transformation, path=plot, title=title)
        hist = plot.with_name(plot.stem + "_history" + plot.suffix)
        if result.history or result.timings:
            viz.plot_history(result, hist)
            console.print(f"pictures written to {plot} and {hist}")
        else:
            console.print(f"picture written to {plot}")
    if html is not None:
        viz.write_html(src, tgt, result.transformation, html, result=result, title=title)
        console.print(f"viewer written to {html}")


# ------------------------------------------------------------------------------ commands

@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version_callback,
                                 is_eager=True, help="print the version and exit"),
) -> None:
    """Rigid point-cloud registration on the GPU and the CPU."""


@app.command()
def info() -> None:
    """Versions, devices, and which backend each kernel family uses."""
    import torch

    from pointalign.kernels import _backend

    table = Table(title=f"pointalign {_version()}")
    table.add_column("item")
    table.add_column("value")
    table.add_row("torch", torch.__version__)
    try:
        import triton

        table.add_row("triton", triton.__version__)
    except Exception:
        table.add_row("triton", "not installed (CPU path: PyTorch reference kernels)")
    table.add_row("CUDA", torch.cuda.get_device_name(0) if torch.cuda.is_available()
                  else "not available")
    table.add_row("CPU threads", str(torch.get_num_threads()))
    for dev, name in _backend.describe().items():
        table.add_row(f"kernel backend ({dev})", name)
    for method, (module, func, what) in METHODS.items():
        try:
            ok = hasattr(importlib.import_module(module), func)
        except ImportError:
            ok = False
        table.add_row(f"method {method}", ("ready: " if ok else "missing: ") + what)
    for extra, module in (("viz", "matplotlib"), ("viz", "plotly"), ("open3d", "open3d"),
                          ("las", "laspy")):
        try:
            importlib.import_module(module)
            state = "installed"
        except ImportError:
            state = f"not installed (pip install 'pointalign[{extra}]')"
        table.add_row(f"optional {module}", state)
    console.print(table)


_METHOD_HELP = "; ".join(f"{k}: {v[2]}" for k, v in METHODS.items())


@app.command()
def register(
    source: Path = typer.Argument(..., help="source cloud file (moved onto the target)",
                                  metavar="SOURCE",
                                  exists=True, dir_okay=False, readable=True),
    target: Path = typer.Argument(..., help="target cloud file", exists=True, dir_okay=False,
                                  readable=True, metavar="TARGET"),
    method: Method = typer.Option("global", help="registration method (see 'pointalign "
                                  "info')"),
    init: Path | None = typer.Option(None, help="initial T_target_source: a text file with "
                                     "16 numbers or a result JSON", exists=True,
                                     dir_okay=False),
    device: Device = typer.Option(Device.auto, help="compute device (auto: cuda if present)"),
    voxel_size: float | None = typer.Option(None, callback=_positive,
                                            help="voxel edge for global registration "
                                            "(default: automatic, printed)"),
    max_distance: float | None = typer.Option(None, callback=_positive,
                                              help="max correspondence distance (icp default: "
                                              "5% of the source's diagonal, printed)"),
    max_iterations: int | None = typer.Option(None, min=1, metavar="N", help="iteration cap"),
    seed: int | None = typer.Option(None, min=0, metavar="N", help="random seed (global)"),
    bin_columns: int = typer.Option(4, min=3, metavar="N", help="float32 columns per point of .bin "
                                    "scans (KITTI: 4)"),
    output: Path | None = typer.Option(None, help="write the aligned source cloud here "
                                       "(suffix picks the format)"),
    json_out: Path | None = typer.Option(None, "--json", help="write inputs, parameters, "
                                         "device, version and the result as JSON"),
    plot: Path | None = typer.Option(None, help="before/after picture (PNG); also writes "
                                     "<name>_history.png"),
    html: Path | None = typer.Option(None, help="self-contained HTML viewer"),
    allow_failure: bool = typer.Option(False, "--allow-failure",
                                       help="exit 0 even when the registration did not "
                                       "converge"),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="more log output"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="only errors; no progress"),
    config: Path | None = _config_option(),
) -> None:
    """Align SOURCE onto TARGET and print the transformation T_target_source."""
    level = _verbosity(verbose, quiet)
    m = method.value
    # every check before any work
    _check_input(source, "SOURCE")
    _check_input(target, "TARGET")
    _check_output(output, CLOUD_SUFFIXES[:-1], "--output")
    _check_reports(json_out, plot, html)
    dev = _resolve_device(device)
    T0 = _read_init(init)
    for name in _ignored(m, {"init": init, "voxel_size": voxel_size,
                             "max_distance": max_distance, "seed": seed}) * (level >= 0):
        err.print(f"[yellow]warning: --{name.replace('_', '-')} is ignored by method "
                  f"{m}[/yellow]")

    from pointalign import _progress

    try:
        with _progress.task("reading clouds", total=2) as bar:
            src = _read_cloud(source, bin_columns)
            bar.advance()
            tgt = _read_cloud(target, bin_columns)
            bar.advance()
    except (OSError, ValueError, ImportError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(EXIT_FAILED) from None
    if level >= 0:
        console.print(f"{source} ({len(src)} points) -> {target} ({len(tgt)} points), "
                      f"method {m}, device {dev}")
    t0 = time.perf_counter()
    try:
        with _progress.task(f"registering ({m})"):
            result, used = _run(m, src, tgt, init=T0, device=dev, max_distance=max_distance,
                                voxel_size=voxel_size, max_iterations=max_iterations,
                                seed=seed)
    except (ValueError, TypeError, MemoryError) as exc:
        err.print(f"[red]registration failed: {exc}[/red]")
        raise typer.Exit(EXIT_FAILED) from None
    used["wall_seconds"] = time.perf_counter() - t0
    _print_result(result, used)
    try:
        if output is not None:
            from pointalign import io

            io.write(output, src.transform(result.transformation))
            console.print(f"aligned source written to {output}")
        if json_out is not None:
            inputs = {"source": {"path": str(source), "points": len(src)},
                      "target": {"path": str(target), "points": len(tgt)},
                      "init": str(init) if init else None}
            _write_json(json_out, _json_doc("register", inputs, used, result))
            console.print(f"result written to {json_out}")
        _pictures(src, tgt, result, plot, html, f"{source.name} -> {target.name} ({m})")
    except (OSError, ValueError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(EXIT_FAILED) from None
    if not bool(result.converged):
        err.print(f"[red]the registration did not converge ({result.stop_reason})[/red]"
                  + (" (--allow-failure: exit 0)" if allow_failure else ""))
        if not allow_failure:
            raise typer.Exit(EXIT_NOT_CONVERGED)


@app.command()
def batch(
    sources: list[Path] = typer.Argument(..., help="source clouds, each aligned onto TARGET",
                                         metavar="SOURCE...", exists=True, dir_okay=False,
                                         readable=True),
    target: Path = typer.Option(..., "--target", help="the cloud every source is aligned "
                                "onto", exists=True, dir_okay=False, readable=True),
    method: Method = typer.Option("global", help="registration method (see 'pointalign "
                                  "info')"),
    device: Device = typer.Option(Device.auto, help="compute device (auto: cuda if present)"),
    voxel_size: float | None = typer.Option(None, callback=_positive,
                                            help="voxel edge for global registration"),
    max_distance: float | None = typer.Option(None, callback=_positive,
                                              help="max correspondence distance (local "
                                              "methods)"),
    max_iterations: int | None = typer.Option(None, min=1, metavar="N", help="iteration cap"),
    seed: int | None = typer.Option(None, min=0, metavar="N", help="random seed (global)"),
    bin_columns: int = typer.Option(4, min=3, metavar="N", help="float32 columns per point "
                                    "of .bin scans (KITTI: 4)"),
    json_out: Path | None = typer.Option(None, "--json", help="write every result (and the "
                                         "parameters used) as one JSON file"),
    allow_failure: bool = typer.Option(False, "--allow-failure",
                                       help="exit 0 even when some registration did not "
                                       "converge"),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="more log output"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="only errors; no progress"),
    config: Path | None = _config_option(),
) -> None:
    """Align many SOURCE files onto one --target, with a progress bar and a table."""
    level = _verbosity(verbose, quiet)
    m = method.value
    for path in [*sources, target]:
        _check_input(path, "SOURCE" if path != target else "--target")
    _check_reports(json_out, None, None)
    dev = _resolve_device(device)
    for name in _ignored(m, {"voxel_size": voxel_size, "max_distance": max_distance,
                             "seed": seed}) * (level >= 0):
        err.print(f"[yellow]warning: --{name.replace('_', '-')} is ignored by method "
                  f"{m}[/yellow]")
    from pointalign import _progress

    try:
        tgt = _read_cloud(target, bin_columns)
    except (OSError, ValueError, ImportError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(EXIT_FAILED) from None
    table = Table(title=f"batch: {len(sources)} source(s) -> {target.name} ({m}, {dev})")
    for col in ("source", "points", "fitness", "rmse", "converged", "ms"):
        table.add_column(col, justify="left" if col == "source" else "right")
    docs: list[dict[str, Any]] = []
    failed = not_converged = 0
    for path in _progress.track(sources, "registering files", quiet=level < 0):
        try:
            src = _read_cloud(path, bin_columns)
            t0 = time.perf_counter()
            result, used = _run(m, src, tgt, init=None, device=dev, max_distance=max_distance,
                                voxel_size=voxel_size, max_iterations=max_iterations,
                                seed=seed)
        except (OSError, ValueError, TypeError, ImportError, MemoryError) as exc:
            failed += 1
            table.add_row(path.name, "-", "-", "-", f"[red]failed: {exc}[/red]", "-")
            docs.append({"source": str(path), "error": str(exc)})
            continue
        used["wall_seconds"] = time.perf_counter() - t0
        ok = bool(result.converged)
        not_converged += not ok
        table.add_row(path.name, str(len(src)), f"{float(result.fitness):.4f}",
                      f"{float(result.rmse):.4g}", "yes" if ok else "[red]no[/red]",
                      f"{used['wall_seconds'] * 1e3:.0f}")
        docs.append(_json_doc("batch", {"source": {"path": str(path), "points": len(src)},
                                        "target": {"path": str(target), "points": len(tgt)}},
                              used, result))
    console.print(table)
    if json_out is not None:
        try:
            _write_json(json_out, {"pointalign_version": _version(), "command": "batch",
                                   "results": docs})
        except (OSError, ValueError) as exc:
            err.print(f"[red]{exc}[/red]")
            raise typer.Exit(EXIT_FAILED) from None
        console.print(f"results written to {json_out}")
    if failed:
        raise typer.Exit(EXIT_FAILED)
    if not_converged and not allow_failure:
        err.print(f"[red]{not_converged} registration(s) did not converge[/red]")
        raise typer.Exit(EXIT_NOT_CONVERGED)


def _errors(T_est: np.ndarray, T_true: np.ndarray) -> tuple[float, float]:
    from pointalign import metrics

    rot, trans = metrics.relative_error(T_est, T_true)
    return float(rot), float(trans)


@app.command()
def demo(
    method: Method = typer.Option("global", help="registration method (see 'pointalign "
                                  "info')"),
    device: Device = typer.Option(Device.auto, help="compute device (auto: cuda if present)"),
    max_iterations: int | None = typer.Option(None, min=1, metavar="N", help="iteration cap"),
    seed: int | None = typer.Option(None, min=0, metavar="N", help="random seed (global)"),
    json_out: Path | None = typer.Option(None, "--json", help="write the result as JSON"),
    plot: Path | None = typer.Option(None, help="before/after picture (PNG)"),
    html: Path | None = typer.Option(None, help="self-contained HTML viewer"),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="more log output"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="only errors; no progress"),
    config: Path | None = _config_option(),
) -> None:
    """Align the bundled Stanford bunny scans bun045 -> bun000 from the identity."""
    level = _verbosity(verbose, quiet)
    m = method.value
    _check_reports(json_out, plot, html)
    dev = _resolve_device(device)
    if seed is not None and m != "global" and level >= 0:
        err.print(f"[yellow]warning: --seed is ignored by method {m}[/yellow]")
    from pointalign import datasets

    pair = datasets.load_bunny_pair()
    T_true = pair.T_target_source.numpy()
    rot0, trans0 = _errors(np.eye(4), T_true)
    console.print(f"bun045 ({len(pair.source)} points) -> bun000 ({len(pair.target)} points); "
                  f"true motion {rot0:.1f} deg, {trans0 * 1e3:.1f} mm; start: identity")
    from pointalign import _progress

    t0 = time.perf_counter()
    with _progress.task(f"registering ({m})"):
        result, used = _run(m, pair.source, pair.target, init=None, device=dev,
                            max_distance=None, voxel_size=None, max_iterations=max_iterations,
                            seed=seed)
    wall = time.perf_counter() - t0
    rot, trans = _errors(result.transformation, T_true)
    table = Table(title=f"demo: method {m}")
    for col in ("rotation error", "translation error", "fitness", "rmse", "time"):
        table.add_column(col)
    table.add_row(f"{rot:.3f} deg", f"{trans * 1e3:.3f} mm", f"{float(result.fitness):.3f}",
                  f"{float(result.rmse) * 1e3:.3f} mm", f"{wall * 1e3:.0f} ms (first call)")
    console.print(table)
    if result.timings:
        console.print("stages: " + ", ".join(f"{k} {v * 1e3:.1f} ms"
                                             for k, v in result.timings.items()))
    used["wall_seconds"] = wall
    _print_result(result, used)
    if json_out is not None:
        inputs = {"source": "bundled bun045", "target": "bundled bun000", "init": "identity"}
        _write_json(json_out, _json_doc("demo", inputs, used, result, {
            "errors": {"rotation_deg": rot, "translation": trans}}))
    _pictures(pair.source, pair.target, result, plot, html, f"bun045 -> bun000 ({m})")
    ok = rot < 1.0 and trans < 2e-3
    verdict = "[green]aligned[/green]" if ok else "[red]NOT aligned[/red]"
    console.print(f"{verdict}: errors {'below' if ok else 'above'} 1 deg / 2 mm")
    if not ok or not math.isfinite(rot):
        raise typer.Exit(EXIT_FAILED)


@app.command()
def view(
    source: Path = typer.Argument(..., exists=True, dir_okay=False, help="source cloud",
                                  metavar="SOURCE"),
    target: Path = typer.Argument(..., exists=True, dir_okay=False, help="target cloud",
                                  metavar="TARGET"),
    transform: Path | None = typer.Option(None, exists=True, dir_okay=False,
                                          help="text file with the 4x4 T_target_source"),
    json_in: Path | None = typer.Option(None, "--json", exists=True, dir_okay=False,
                                        help="result JSON (from register --json or "
                                        "RegistrationResult.save)"),
    output: Path = typer.Option(Path("view.html"), help="HTML file to write"),
    max_points: int = typer.Option(20000, min=100, metavar="N", help="points drawn per cloud "
                                   "(subsampled for drawing only)"),
    bin_columns: int = typer.Option(4, min=3, metavar="N",
                                    help="float32 columns per point of .bin scans"),
    config: Path | None = _config_option(),
) -> None:
    """Write one self-contained HTML file showing SOURCE and TARGET before and after."""
    _check_input(source, "SOURCE")
    _check_input(target, "TARGET")
    _check_output(output, HTML_SUFFIXES, "--output")
    _need_module("plotly", "viz", "--output")
    if transform is not None and json_in is not None:
        raise typer.BadParameter("give --transform or --json, not both", param_hint="--json")
    result = None
    if json_in is not None:
        from pointalign.registration.result import RegistrationResult

        try:
            result = RegistrationResult.load(json_in)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--json") from None
        T: Any = result.transformation
    else:
        T = _read_init(transform) if transform is not None else np.eye(4)
    try:
        src, tgt = _read_cloud(source, bin_columns), _read_cloud(target, bin_columns)
    except (OSError, ValueError, ImportError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(EXIT_FAILED) from None
    from pointalign import viz

    viz.write_html(src, tgt, T, output, result=result, max_points=max_points,
                   title=f"{source.name} -> {target.name}")
    console.print(f"viewer written to {output}")


def _find_benchmarks() -> Path | None:
    here = Path(__file__).resolve()
    for base in [Path.cwd(), *Path.cwd().parents, *here.parents]:
        cand = base / "benchmarks"
        if (cand / "common.py").is_file() and any(cand.glob("bench_*.py")):
            return cand
    return None


@app.command()
def bench(
    quick: bool = typer.Option(False, "--quick", help="small sizes: a smoke run "
                               "(under a minute on a 2-core CPU with the default suites)"),
    suite: list[str] = typer.Option([], "--suite", help="suite name (repeatable), e.g. quick, "
                                    "knn, icp, kdtree, soft, surface, ransac; default: quick "
                                    "(k-NN, features, ICP, register on the bundled bunny) "
                                    "with --quick, every other suite otherwise"),
    device: Device = typer.Option(Device.auto, help="compute device (auto: cuda if present)"),
    results: Path | None = typer.Option(None, help="folder for the JSON results (default: a "
                                        "temporary folder; the recorded results are kept)"),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="also print each "
                                "benchmark's own output"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="only the summary"),
    config: Path | None = _config_option(),
) -> None:
    """Run the benchmark suites of a source checkout and print a summary table."""
    level = _verbosity(verbose, quiet)
    root = _find_benchmarks()
    if root is None:
        err.print("[red]the benchmarks are not part of the installed package: run "
                  "'pointalign bench' inside a source checkout of pointalign (the folder "
                  "that holds benchmarks/), e.g. after 'git clone' and 'make demo'.[/red]")
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



if __name__ == "__main__":  # pragma: no cover
    app()
