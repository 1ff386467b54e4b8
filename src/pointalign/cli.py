"""Command line: ``pointalign info | register | demo``. Parses, calls the public API, prints.

No numerics live here.
"""

from __future__ import annotations

import importlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Rigid point-cloud registration on the GPU and the CPU.")
console = Console()

#: method name -> (module, function, what it needs); resolved lazily so a method whose
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
}


def _resolve(method: str) -> Callable[..., Any]:
    if method not in METHODS:
        raise typer.BadParameter(f"unknown method {method!r}; choose from {sorted(METHODS)}")
    module, func, _ = METHODS[method]
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError):
        console.print(f"[red]method {method!r} is not available in this build "
                      f"({module}.{func} is missing).[/red]")
        raise typer.Exit(2) from None


def _call(method: str, source: Any, target: Any, *, init: Any, device: str | None,
          max_distance: float | None, voxel_size: float | None) -> Any:
    from pointalign import _validate

    fn = _resolve(method)
    src = _validate.as_points(source, "source")
    extent = float((src.amax(0) - src.amin(0)).norm())
    if method == "global":
        return fn(source, target, voxel_size=voxel_size, device=device)
    if method in ("icp", "icp-plane"):
        dist = max_distance if max_distance is not None else 0.05 * extent
        return fn(source, target, init=init, max_correspondence_distance=dist,
                  method="point_to_plane" if method == "icp-plane" else "point_to_point",
                  device=device)
    return fn(source, target, init=init, device=device)


def _errors(T_est: np.ndarray, T_true: np.ndarray) -> tuple[float, float]:
    from pointalign import metrics

    rot, trans = metrics.relative_error(T_est, T_true)
    return float(rot), float(trans)


@app.command()
def info() -> None:
    """Versions, devices, and which backend each kernel family uses."""
    import torch

    import pointalign
    from pointalign.kernels import _backend

    table = Table(title=f"pointalign {pointalign.__version__}")
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
    console.print(table)


@app.command()
def register(
    source: Path = typer.Argument(..., help="source cloud file (moved onto the target)"),
    target: Path = typer.Argument(..., help="target cloud file"),
    method: str = typer.Option("global", help=f"one of {', '.join(METHODS)}"),
    init: Path | None = typer.Option(None, help="text file with the initial 4x4 T_target_source"),
    device: str | None = typer.Option(None, help="cpu or cuda (default: cuda if present)"),
    voxel_size: float | None = typer.Option(None, help="voxel size for global registration"),
    max_distance: float | None = typer.Option(None, help="max correspondence distance"),
    output: Path | None = typer.Option(None, help="write the aligned source cloud here"),
    json_out: Path | None = typer.Option(None, "--json", help="write the result as JSON"),
) -> None:
    """Align SOURCE onto TARGET and print the transformation T_target_source."""
    from pointalign import io

    try:
        src, tgt = io.read(source), io.read(target)
        T0 = np.loadtxt(init).reshape(4, 4) if init is not None else None
    except (OSError, ValueError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    try:
        result = _call(method, src, tgt, init=T0, device=device, max_distance=max_distance,
                       voxel_size=voxel_size)
    except (ValueError, TypeError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    console.print(result.summary())
    console.print(np.array2string(result.transformation, precision=6, suppress_small=True))
    if output is not None:
        io.write(output, src.transform(result.transformation))
        console.print(f"aligned source written to {output}")
    if json_out is not None:
        doc = {"method": method, "transformation": result.transformation.tolist(),
               "fitness": float(result.fitness), "rmse": float(result.rmse),
               "iterations": int(result.iterations), "converged": bool(result.converged),
               "stop_reason": str(result.stop_reason), "timings": result.timings}
        json_out.write_text(json.dumps(doc, indent=2))


@app.command()
def demo(
    method: str = typer.Option("global", help=f"one of {', '.join(METHODS)}"),
    device: str | None = typer.Option(None, help="cpu or cuda (default: cuda if present)"),
) -> None:
    """Align the bundled Stanford bunny scans bun045 -> bun000 from the identity."""
    from pointalign import datasets

    pair = datasets.load_bunny_pair()
    T_true = pair.T_target_source.numpy()
    rot0, trans0 = _errors(np.eye(4), T_true)
    console.print(f"bun045 ({len(pair.source)} points) -> bun000 ({len(pair.target)} points); "
                  f"true motion {rot0:.1f} deg, {trans0 * 1e3:.1f} mm; start: identity")
    t0 = time.perf_counter()
    result = _call(method, pair.source, pair.target, init=None, device=device,
                   max_distance=None, voxel_size=None)
    wall = time.perf_counter() - t0
    rot, trans = _errors(result.transformation, T_true)
    table = Table(title=f"demo: method {method}")
    for col in ("rotation error", "translation error", "fitness", "rmse", "time"):
        table.add_column(col)
    table.add_row(f"{rot:.3f} deg", f"{trans * 1e3:.3f} mm", f"{float(result.fitness):.3f}",
                  f"{float(result.rmse) * 1e3:.3f} mm", f"{wall * 1e3:.0f} ms (first call)")
    console.print(table)
    if result.timings:
        console.print("stages: " + ", ".join(f"{k} {v * 1e3:.1f} ms"
                                             for k, v in result.timings.items()))
    ok = rot < 1.0 and trans < 2e-3
    verdict = "[green]aligned[/green]" if ok else "[red]NOT aligned[/red]"
    console.print(f"{verdict}: errors {'below' if ok else 'above'} 1 deg / 2 mm")
    if not ok or not math.isfinite(rot):
        raise typer.Exit(1)


if __name__ == "__main__":  # pragma: no cover
    app()
