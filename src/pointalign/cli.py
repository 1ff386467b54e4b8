"""Command line: ``pointalign info|register|batch|demo|view|bench|register-many|multiway``.

Parses, checks every option and output path before any work, calls the public API, prints.
No numerics live here: the default distances come from :mod:`pointalign._defaults` and the
library's signatures. Exit codes: 0 success; 1 the work failed (unreadable data, an error
while registering); 2 usage error (bad option, missing input, unwritable output); 3 the
registration ran but is not trusted (``--allow-failure`` keeps 0).

Options shared by several commands are declared once, as ``Annotated`` aliases
(``DeviceOpt``, ``MethodOpt``, ...). ``-v``/``-q``/``--config`` belong to the program
(the app callback) and may be written before or after the command's name. Every option of
a command can also come from a TOML file given with ``--config``: keys are the option names
(``max-distance`` or ``max_distance``), at the top level or in a table named after the
command (``[register]``), which wins; options on the command line win over the file.
``bench`` lives in :mod:`pointalign.cli_bench`, ``register-many`` and ``multiway`` in
:mod:`pointalign.cli_many` (``register_commands(app)``), all registered on the same app.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperArgument, TyperCommand, TyperGroup

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_CONVERGED = 3

console = Console(highlight=False)
err = Console(stderr=True, highlight=False)


# ------------------------------------------------------------------------------ the app

class _PlainArgument(TyperArgument):
    """A positional argument shown as ``SOURCE`` (usage) and ``<file>`` (help), no braces."""

    def get_usage_pieces(self, ctx: Any) -> list[str]:  # noqa: D102
        name = self.metavar or (self.name or "").upper()
        return [name if self.nargs == 1 or name.endswith("...") else name + "..."]

    def display_type(self, ctx: Any) -> str:  # noqa: D102
        shown = super().display_type(ctx)
        return "<file>" if shown.startswith("<list[") else shown


#: every command's help ends with the program's options, which it accepts too
_PROGRAM_OPTIONS = ("Program options, before or after the command: -v/--verbose (-vv: debug), "
                    "-q/--quiet, --config FILE.toml; see 'pointalign --help'.")


class _Command(TyperCommand):
    """A command whose arguments are :class:`_PlainArgument` (clean usage and help)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epilog = (self.epilog + "\n\n" if self.epilog else "") + _PROGRAM_OPTIONS
        for p in self.params:
            if type(p) is TyperArgument:
                p.__class__ = _PlainArgument


#: the program's own options: accepted after the command's name too
_GLOBAL_FLAG = re.compile(r"^(-v+|--verbose|-q|--quiet|--config=.*)$")
_CMD_KEY = "pointalign.command"


class _Group(TyperGroup):
    """The app: ``-v``/``-q``/``--config`` may follow the command (``register a b -q``)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # noqa: D102
        args = list(args)
        i = 0
        while i < len(args) and args[i].startswith("-") and args[i] != "--":
            i += 2 if args[i] == "--config" else 1
        if i < len(args) and args[i] in self.commands:
            name, rest = args[i], args[i + 1:]
            ctx.meta[_CMD_KEY] = name
            moved: list[str] = []
            kept: list[str] = []
            j = 0
            while j < len(rest):
                a = rest[j]
                if a == "--":
                    kept += rest[j:]
                    break
                if _GLOBAL_FLAG.match(a):
                    moved.append(a)
                elif a == "--config" and j + 1 < len(rest):
                    moved += rest[j:j + 2]
                    j += 1
                else:
                    kept.append(a)
                j += 1
            args = args[:i] + moved + [name] + kept
        return super().parse_args(ctx, args)


# plain help (rich_markup_mode=None): choices shown as <a|b|c>, flags without a type
app = typer.Typer(
    cls=_Group, add_completion=False, no_args_is_help=True, rich_markup_mode=None,
    help="Rigid point-cloud registration on the GPU and the CPU.",
    epilog="Exit codes: 0 success, 1 failure, 2 usage error, 3 the registration is not "
           "trusted (see --allow-failure). -v, -q and --config may also follow the command.")


def command(*args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Any]:
    """``app.command`` with this program's command class (clean argument help)."""
    return app.command(*args, cls=_Command, **kwargs)


#: method name -> (module, function, what it does); resolved lazily so a method whose
#: module is missing gets a clear message instead of an ImportError.
METHODS: dict[str, tuple[str, str, str]] = {
    "global": ("pointalign.registration.pipeline", "register",
               "FPFH + parallel RANSAC, then point-to-plane ICP or GICP (--refine; works "
               "from any pose)"),
    "icp": ("pointalign.registration.icp", "icp", "point-to-point ICP (local)"),
    "icp-plane": ("pointalign.registration.icp", "icp", "point-to-plane ICP (local)"),
    "gicp": ("pointalign.registration.gicp", "gicp",
             "generalized ICP, plane-to-plane (local)"),
    "vgicp": ("pointalign.registration.gicp", "vgicp",
              "voxelized GICP: Gaussians per voxel, no neighbour search per step (local)"),
    "emicp": ("pointalign.registration.soft", "emicp", "EM-ICP, soft correspondences"),
    "softassign": ("pointalign.registration.soft", "softassign", "Softassign with Sinkhorn"),
    "newton": ("pointalign.registration.surface", "surface_newton",
               "distance-map Newton (point-to-plane approximant)"),
    "approx-icp": ("pointalign.registration.surface", "approximate_icp",
                   "ICP on k-d tree cell approximants (coarse)"),
}

Method = enum.Enum(  # type: ignore[misc]  # mypy reads only literal functional Enums
    "Method", {m.replace("-", "_").upper(): m for m in METHODS}, type=str)


class Device(str, enum.Enum):
    """Compute device choices."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Refine(str, enum.Enum):
    """The global method's final stage (``register(refine=...)``)."""

    point_to_plane = "point_to_plane"
    gicp = "gicp"
    none = "none"


class Start(str, enum.Enum):
    """Where ``demo`` starts a method."""

    auto = "auto"
    identity = "identity"
    near = "near"


#: which of the shared options each method uses (the others are reported as ignored)
USES: dict[str, set[str]] = {
    "global": {"voxel_size", "max_iterations", "seed", "refine"},
    "icp": {"init", "max_distance", "max_iterations"},
    "icp-plane": {"init", "max_distance", "max_iterations"},
    "gicp": {"init", "max_distance", "max_iterations"},
    "vgicp": {"init", "voxel_size", "max_iterations"},
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


def _error(message: str) -> None:
    """One red line on standard error (brackets in ``message`` are kept, not markup)."""
    err.print(f"[red]{escape(message)}[/red]")


def _warning(message: str) -> None:
    """One yellow line on standard error, above any progress bar."""
    from pointalign import _progress

    text = f"[yellow]warning: {escape(message)}[/yellow]"
    live = _progress.live_console()
    (live or err).print(text)


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


_PROGRAM_KEYS = ("verbose", "quiet")


def _config_callback(ctx: typer.Context, param: Any, value: Path | None) -> Path | None:
    """Eager: read the TOML file into the default maps before any other option.

    The program's keys (``verbose``, ``quiet``) go to the app's map, the command's to its
    own (``ctx.default_map[command]``); a key neither knows is a usage error.
    """
    if value is None:
        return value
    doc = _load_toml(value)
    cmd_name = ctx.meta.get(_CMD_KEY)
    cmd = ctx.command.get_command(ctx, cmd_name) if cmd_name else None  # type: ignore[attr-defined]
    names: dict[str, str] = {k: k for k in _PROGRAM_KEYS}
    for p in (cmd.params if cmd is not None else []):
        if getattr(p, "param_type_name", "") != "option":
            continue
        names[p.name] = p.name
        for opt in p.opts:
            names[opt.lstrip("-").replace("-", "_")] = p.name
    section = doc.get(cmd_name, {}) if cmd_name else {}
    if not isinstance(section, dict):
        raise typer.BadParameter(f"[{cmd_name}] must be a table", param_hint="--config")
    flat = {k: v for k, v in doc.items() if not isinstance(v, dict)}
    flat.update(section)
    program: dict[str, Any] = {}
    own: dict[str, Any] = {}
    for key, v in flat.items():
        k = key.replace("-", "_")
        if k not in names:
            known = ", ".join(sorted(n.replace("_", "-") for n in set(names.values())))
            raise typer.BadParameter(f"{value}: unknown option {key!r} for "
                                     f"'{cmd_name or 'pointalign'}'; known: {known}",
                                     param_hint="--config")
        (program if k in _PROGRAM_KEYS else own)[names[k]] = v
    dm = {**(ctx.default_map or {}), **program}
    if cmd_name:
        dm[cmd_name] = {**dm.get(cmd_name, {}), **own}
    ctx.default_map = dm
    return value


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
    """Show the library's warnings as one yellow line each, above any progress bar.

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
            _warning(str(message))
        else:
            default(message, category, filename, lineno, file, line)

    show._pointalign_cli = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def _level(ctx: typer.Context) -> int:
    """Return the verbosity the app callback set: -1 quiet, 0 normal, 1 info, 2 debug."""
    obj = ctx.find_root().obj
    return int(obj.get("level", 0)) if isinstance(obj, dict) else 0


def _log() -> Any:
    from pointalign import _progress

    return _progress.get_logger("cli")


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


def _install_hint(extra: str) -> str:
    return f"pip install 'pointalign[{extra}]'"


def _need_module(module: str, extra: str, hint: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        raise typer.BadParameter(f"needs {module}: {_install_hint(extra)}",
                                 param_hint=hint) from None


def _resolve(method: str) -> Callable[..., Any]:
    module, func, _ = METHODS[method]
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError):
        _error(f"method {method!r} is not available in this build ({module}.{func} is "
               "missing).")
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


def _read_cloud(path: Path, bin_columns: int | None) -> Any:
    from pointalign import io

    t0 = time.perf_counter()
    cloud = io.read_bin(path, columns=bin_columns) if path.suffix.lower() == ".bin" \
        else io.read(path)
    _log().info("read %s: %s points in %.2f s", path, f"{len(cloud):,}",
                time.perf_counter() - t0)
    return cloud


def _refine(refine: Refine | None) -> str | None:
    return None if refine is None else Refine(refine).value


def _ignored(method: str, given: dict[str, Any]) -> list[str]:
    return [k for k, v in given.items() if v is not None and k not in USES[method]]


def _iteration_cap(method: str, given: int | None, result: Any, source: Any) -> str:
    """Describe the iteration cap a method ran with, and where it came from (never a guess)."""
    if given is not None:
        return str(given)
    if method == "global":
        from pointalign.registration.pipeline import register

        cap = inspect.signature(register).parameters["max_iterations"].default
        return f"{cap} per ICP stage (coarse and final; register's default)"
    if method in ("icp", "icp-plane", "gicp", "vgicp"):
        from pointalign.registration.criteria import ConvergenceCriteria

        return f"{ConvergenceCriteria().max_iterations} ({METHODS[method][1]}'s default)"
    if method in ("newton", "approx-icp"):
        from pointalign import _validate
        from pointalign.registration.surface import default_criteria

        pts = _validate.as_points(source, "source", device="cpu")
        return f"{default_criteria(pts).max_iterations} ({METHODS[method][1]}'s default)"
    sched = (result.info or {}).get("scheduled_iterations")
    return f"{sched} (the annealing schedule's length)" if sched is not None else \
        "the annealing schedule's length"


def _run(method: str, source: Any, target: Any, *, init: np.ndarray | None, device: str,
         max_distance: float | None, voxel_size: float | None, max_iterations: int | None,
         seed: int | None, refine: str | None = None) -> tuple[Any, dict[str, Any]]:
    """Run one method; returns the result and the parameters actually used."""
    from pointalign import _defaults
    from pointalign.registration.criteria import ConvergenceCriteria
    from pointalign.registration.pipeline import Scales

    fn = _resolve(method)
    used: dict[str, Any] = {"method": method, "device": device}
    crit = None if max_iterations is None else ConvergenceCriteria(max_iterations=max_iterations)
    if method == "global":
        kw: dict[str, Any] = {"voxel_size": voxel_size, "device": device}
        if max_iterations is not None:
            kw["max_iterations"] = max_iterations
        if seed is not None:
            kw["seed"] = seed
        if refine is not None:
            kw["refine"] = refine
        result = fn(source, target, **kw)
        v = float(result.info.get("voxel_size", voxel_size or float("nan")))
        seed_default = inspect.signature(fn).parameters["seed"].default
        used.update(voxel_size=v, voxel_size_source="given" if voxel_size else "automatic",
                    max_distance=Scales(v).fine if v > 0 else v,
                    max_distance_source=f"{Scales(1.0).fine:g} x voxel size (final stage)",
                    seed=seed if seed is not None else seed_default,
                    refine=refine or inspect.signature(fn).parameters["refine"].default)
        used["max_iterations"] = _iteration_cap(method, max_iterations, result, source)
        return result, used
    common: dict[str, Any] = {"init": init, "device": device}
    if crit is not None:
        common["criteria"] = crit
    if method in ("icp", "icp-plane", "gicp"):
        dist = max_distance
        used["max_distance_source"] = "given"
        if dist is None:
            dist = _defaults.icp_distance(source)
            used["max_distance_source"] = (f"{100 * _defaults.ICP_DISTANCE_FRACTION:g}% of "
                                           "the source's bounding-box diagonal")
        used["max_distance"] = dist
        if method != "gicp":
            common["method"] = used["estimation"] = \
                "point_to_plane" if method == "icp-plane" else "point_to_point"
        result = fn(source, target, max_correspondence_distance=dist, **common)
    elif method == "vgicp":
        used["voxel_size"], used["voxel_size_source"] = voxel_size, "given"
        if voxel_size is None:
            from pointalign.features.downsample import auto_voxel_size

            used["voxel_size"] = auto_voxel_size(target)
            used["voxel_size_source"] = "register's automatic voxel edge of the target"
        result = fn(source, target, voxel_size=used["voxel_size"], **common)
    elif method in ("newton", "approx-icp"):
        used["max_distance"] = max_distance
        used["max_distance_source"] = "given" if max_distance else "none (no truncation)"
        result = fn(source, target, max_correspondence_distance=max_distance, **common)
    else:
        result = fn(source, target, **common)
    used["max_iterations"] = _iteration_cap(method, max_iterations, result, source)
    return result, used


def _params_table(used: dict[str, Any]) -> Table:
    table = Table(title="parameters used", show_header=False)
    table.add_column("parameter")
    table.add_column("value")
    for k, v in used.items():
        if k.endswith("_source"):
            continue
        src = used.get(f"{k}_source")
        val = "none" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)
        table.add_row(k.replace("_", " "), escape(val + (f" ({src})" if src else "")))
    table.add_row("pointalign", _version())
    return table


def _matrix_text(T: Any) -> str:
    """Write the 4x4 matrix as 4 lines of numbers (``--init`` and ``np.loadtxt`` read them)."""
    return "\n".join(" ".join(f"{float(x):.17g}" for x in row) for row in np.asarray(T))


def _print_result(result: Any, used: dict[str, Any], level: int) -> None:
    """Print the parameters, the summary and the matrix (``-q``: the matrix alone)."""
    if level < 0:
        console.print(_matrix_text(result.transformation), markup=False, soft_wrap=True)
        return
    console.print(_params_table(used))
    console.print(escape(result.summary()))
    console.print(np.array2string(np.asarray(result.transformation), precision=6,
                                  suppress_small=True), markup=False)
    if result.timings:
        _log().info("stages: %s", ", ".join(f"{k} {v * 1e3:.1f} ms"
                                            for k, v in result.timings.items()))


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


def _say(level: int, text: str) -> None:
    """Print ``text`` unless ``-q``."""
    if level >= 0:
        console.print(text)


def _pictures(src: Any, tgt: Any, result: Any, plot: Path | None, html: Path | None,
              title: str, level: int) -> None:
    from pointalign import viz

    if plot is not None:
        viz.render(src, tgt, result.transformation, path=plot, title=title, result=result)
        hist = plot.with_name(plot.stem + "_history" + plot.suffix)
        if result.history or result.timings:
            viz.plot_history(result, hist)
            _say(level, f"pictures written to {escape(str(plot))} and {escape(str(hist))}")
        else:
            _say(level, f"picture written to {escape(str(plot))}")
    if html is not None:
        viz.write_html(src, tgt, result.transformation, html, result=result, title=title)
        _say(level, f"viewer written to {escape(str(html))}")


def _family_backends() -> list[tuple[str, str]]:
    """For each kernel family, what runs for CPU (and CUDA) tensors, read from the kernels.

    ``_backend.backend`` names the backend; on "cpu" a family runs numba kernels only when
    it has a ``cpu`` module, its PyTorch reference otherwise.
    """
    import pkgutil

    import torch

    import pointalign.kernels as kernels
    from pointalign.kernels import _backend

    families = sorted(m.name for m in pkgutil.iter_modules(kernels.__path__) if m.ispkg)
    devices = {"cpu": torch.empty(0)}
    if torch.cuda.is_available():
        devices["cuda"] = torch.empty(0, device="cuda")
    words = {"triton": "Triton kernels", "interpret": "Triton interpreter (slow; for tests)",
             "torch": "PyTorch reference"}
    rows = []
    for fam in families:
        parts = []
        for dev, x in devices.items():
            name = _backend.backend(x)
            if name == "cpu":
                has = importlib.util.find_spec(f"pointalign.kernels.{fam}.cpu") is not None
                what = "numba CPU kernels" if has else "PyTorch reference (no CPU kernel)"
            else:
                what = words.get(name, name)
            parts.append(f"{dev}: {what}")
        rows.append((f"kernels {fam}", "; ".join(parts)))
    search = []
    for dev, x in devices.items():
        plan = _backend.search_plan(x)
        search.append(f"{dev}: " + ("SciPy cKDTree on the host" if plan.host_tree else
                                    "fused Triton search kernels" if plan.fused else
                                    "PyTorch references"))
    rows.append(("nearest-neighbour search", "; ".join(search)))
    return rows


# ------------------------------------------------------------------------------ options

DeviceOpt = Annotated[Device, typer.Option(help="compute device (auto: cuda if present)")]
MethodOpt = Annotated[Method, typer.Option(help="registration method (see 'pointalign info')")]
MaxIterationsOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045 (typer reads it)
    min=1, metavar="N", help="iteration cap (default: the method's, printed)")]
SeedOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    min=0, metavar="N", help="random seed (global)")]
VoxelSizeOpt = Annotated[Optional[float], typer.Option(  # noqa: UP045
    callback=_positive, metavar="FLOAT",
    help="voxel edge of global registration and of vgicp's voxels (default: register's "
         "automatic edge, of the target for vgicp; printed)")]
MaxDistanceOpt = Annotated[Optional[float], typer.Option(  # noqa: UP045
    callback=_positive, metavar="FLOAT",
    help="max correspondence distance of local methods (icp, gicp default: 5% of the "
         "source's bounding-box diagonal, printed)")]
RefineOpt = Annotated[Optional[Refine], typer.Option(  # noqa: UP045
    help="the global method's final stage: point_to_plane ICP (register's default), gicp "
         "(generalized ICP) or none (the global stage alone)")]
BinColumnsOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    min=3, metavar="N", help="float32 columns per point of .bin scans (default: inferred "
                             "from the data, 4 = KITTI's x y z reflectance, or 3)")]
JsonOpt = Annotated[Optional[Path], typer.Option(  # noqa: UP045
    "--json", metavar="FILE.json",
    help="write the inputs, parameters, device, version and result(s) as JSON")]
PlotOpt = Annotated[Optional[Path], typer.Option(  # noqa: UP045
    metavar="FILE.png", help="before/after picture; also writes <name>_history.png")]
HtmlOpt = Annotated[Optional[Path], typer.Option(  # noqa: UP045
    metavar="FILE.html", help="self-contained HTML viewer")]
AllowFailureOpt = Annotated[bool, typer.Option(
    "--allow-failure", help="exit 0 even when the registration is not trusted")]
InitOpt = Annotated[Optional[Path], typer.Option(  # noqa: UP045
    metavar="FILE", exists=True, dir_okay=False,
    help="initial T_target_source: a text file with 16 numbers or a result JSON")]
VerboseOpt = Annotated[int, typer.Option(
    "--verbose", "-v", count=True, show_default=False,
    help="-v: what is read, chosen and timed (INFO); -vv: the library's debug log")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="no progress, tables or warnings: register prints the 4x4 matrix "
                          "alone, demo its verdict; errors still go to standard error")]
ConfigOpt = Annotated[Optional[Path], typer.Option(  # noqa: UP045
    "--config", callback=_config_callback, is_eager=True, exists=True, dir_okay=False,
    metavar="FILE.toml", help="TOML file with values for any option (keys = option names; a "
                              "table named after the command wins over top-level keys)")]
VersionOpt = Annotated[bool, typer.Option(
    "--version", callback=_version_callback, is_eager=True,
    help="print the version and exit")]


SourceArg = Annotated[Path, typer.Argument(
    metavar="SOURCE", exists=True, dir_okay=False, readable=True,
    help="source cloud file (moved onto the target)")]
TargetArg = Annotated[Path, typer.Argument(
    metavar="TARGET", exists=True, dir_okay=False, readable=True, help="target cloud file")]


# ------------------------------------------------------------------------------ commands

@app.callback()
def main(
    ctx: typer.Context,
    version: VersionOpt = False,
    verbose: VerboseOpt = 0,
    quiet: QuietOpt = False,
    config: ConfigOpt = None,
) -> None:
    """Rigid point-cloud registration on the GPU and the CPU."""
    ctx.obj = {"level": _verbosity(verbose, quiet)}


@command()
def info() -> None:
    """Versions, devices, and which backend each kernel family uses."""
    import torch

    table = Table(title=f"pointalign {_version()}")
    table.add_column("item")
    table.add_column("value")
    table.add_row("torch", torch.__version__)
    try:
        import triton

        table.add_row("triton", triton.__version__)
    except Exception:
        table.add_row("triton", "not installed (used on CUDA only; the CPU runs the kernels "
                                "below)")
    table.add_row("CUDA", torch.cuda.get_device_name(0) if torch.cuda.is_available()
                  else "not available")
    table.add_row("CPU threads", str(torch.get_num_threads()))
    forced = os.environ.get("POINTALIGN_BACKEND")
    if forced:
        table.add_row("POINTALIGN_BACKEND", escape(forced))
    for item, what in _family_backends():
        table.add_row(item, escape(what))
    for method, (module, func, what) in METHODS.items():
        try:
            ok = hasattr(importlib.import_module(module), func)
        except ImportError:
            ok = False
        table.add_row(f"method {method}", escape(("ready: " if ok else "missing: ") + what))
    for extra, module in (("viz", "matplotlib"), ("viz", "plotly"), ("open3d", "open3d"),
                          ("las", "laspy")):
        state = "installed" if importlib.util.find_spec(module) is not None else \
            f"not installed ({_install_hint(extra)})"
        table.add_row(f"optional {module}", escape(state))
    console.print(table)


@command()
def warmup(
    ctx: typer.Context,
    device: DeviceOpt = Device.auto,
    every_method: Annotated[bool, typer.Option(
        "--all", help="every public method's kernels (default: what the demo and a first "
                      "register() need; the others compile on first use, announced)")] = False,
) -> None:
    """Compile the kernels a device needs now (once per machine; cached on disk)."""
    from pointalign._warmup import warmup as _warmup

    dev = _resolve_device(device)
    level = _level(ctx)
    what = "every method's kernels" if every_method else \
        "register()'s kernels, the demo's (other methods: on first use, or --all)"
    _say(level, f"compiling pointalign's {what} for {dev} (once per machine: numba and "
                "Triton keep them in their disk caches)")
    t0 = time.perf_counter()
    seconds = _warmup(dev, quiet=level < 0, every_method=every_method)
    wall = time.perf_counter() - t0
    table = Table(title=f"warm-up on {dev}")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    for name, s in seconds.items():
        table.add_row(name, f"{s:.1f}")
    if level >= 0:
        console.print(table)
    _say(level, f"done in {wall:.0f} s; later processes start warm")


@command()
def register(
    ctx: typer.Context,
    source: SourceArg,
    target: TargetArg,
    method: MethodOpt = "global",  # type: ignore[assignment]
    init: InitOpt = None,
    device: DeviceOpt = Device.auto,
    voxel_size: VoxelSizeOpt = None,
    max_distance: MaxDistanceOpt = None,
    max_iterations: MaxIterationsOpt = None,
    seed: SeedOpt = None,
    refine: RefineOpt = None,
    bin_columns: BinColumnsOpt = None,
    output: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        metavar="FILE", help="write the aligned source cloud here (suffix picks the "
                             "format)")] = None,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
    html: HtmlOpt = None,
    allow_failure: AllowFailureOpt = False,
) -> None:
    """Align SOURCE onto TARGET and print the transformation T_target_source."""
    level = _level(ctx)
    m = Method(method).value
    # every check before any work
    _check_input(source, "SOURCE")
    _check_input(target, "TARGET")
    _check_output(output, CLOUD_SUFFIXES[:-1], "--output")
    _check_reports(json_out, plot, html)
    dev = _resolve_device(device)
    T0 = _read_init(init)
    for name in _ignored(m, {"init": init, "voxel_size": voxel_size,
                             "max_distance": max_distance, "seed": seed,
                             "refine": refine}) * (level >= 0):
        _warning(f"--{name.replace('_', '-')} is ignored by method {m}")

    from pointalign import _progress

    try:
        with _progress.task("reading clouds", total=2, delay=_progress.LIBRARY_DELAY) as bar:
            src = _read_cloud(source, bin_columns)
            bar.advance()
            tgt = _read_cloud(target, bin_columns)
            bar.advance()
    except (OSError, ValueError, ImportError) as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_FAILED) from None
    _say(level, f"{escape(str(source))} ({len(src):,} points) -> {escape(str(target))} "
                f"({len(tgt):,} points), method {m}, device {dev}")
    t0 = time.perf_counter()
    try:
        with _progress.task(f"registering ({m})", delay=_progress.LIBRARY_DELAY,
                            placeholder=True):
            result, used = _run(m, src, tgt, init=T0, device=dev, max_distance=max_distance,
                                voxel_size=voxel_size, max_iterations=max_iterations,
                                seed=seed, refine=_refine(refine))
    except (ValueError, TypeError, MemoryError) as exc:
        _error(f"registration failed: {exc}")
        raise typer.Exit(EXIT_FAILED) from None
    used["wall_seconds"] = time.perf_counter() - t0
    _print_result(result, used, level)
    try:
        if output is not None:
            from pointalign import io

            io.write(output, src.transform(result.transformation))
            _say(level, f"aligned source written to {escape(str(output))}")
        if json_out is not None:
            inputs = {"source": {"path": str(source), "points": len(src)},
                      "target": {"path": str(target), "points": len(tgt)},
                      "init": str(init) if init else None}
            _write_json(json_out, _json_doc("register", inputs, used, result))
            _say(level, f"result written to {escape(str(json_out))}")
        _pictures(src, tgt, result, plot, html, f"{source.name} -> {target.name} ({m})", level)
    except (OSError, ValueError) as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_FAILED) from None
    if not bool(result.converged):
        _error(f"the registration did not converge ({_why(result)})"
               + (" (--allow-failure: exit 0)" if allow_failure else ""))
        if not allow_failure:
            raise typer.Exit(EXIT_NOT_CONVERGED)


def _why(result: Any) -> str:
    """Why a result is not trusted: the verdict's reason when a verdict decided, else the stop."""
    verdict = (result.info or {}).get("verdict")
    if isinstance(verdict, str) and verdict not in ("", "trusted"):
        return verdict
    return str(result.stop_reason)


@command()
def batch(
    ctx: typer.Context,
    sources: Annotated[list[Path], typer.Argument(
        metavar="SOURCE...", exists=True, dir_okay=False, readable=True,
        help="source clouds, each aligned onto --target")],
    target: Annotated[Path, typer.Option(
        "--target", metavar="FILE", exists=True, dir_okay=False, readable=True,
        help="the cloud every source is aligned onto")],
    method: MethodOpt = "global",  # type: ignore[assignment]
    device: DeviceOpt = Device.auto,
    voxel_size: VoxelSizeOpt = None,
    max_distance: MaxDistanceOpt = None,
    max_iterations: MaxIterationsOpt = None,
    seed: SeedOpt = None,
    refine: RefineOpt = None,
    bin_columns: BinColumnsOpt = None,
    json_out: JsonOpt = None,
    allow_failure: AllowFailureOpt = False,
) -> None:
    """Align many SOURCE files onto one --target, with a progress bar and a table."""
    level = _level(ctx)
    m = Method(method).value
    for path in [*sources, target]:
        _check_input(path, "SOURCE" if path != target else "--target")
    _check_reports(json_out, None, None)
    dev = _resolve_device(device)
    for name in _ignored(m, {"voxel_size": voxel_size, "max_distance": max_distance,
                             "seed": seed, "refine": refine}) * (level >= 0):
        _warning(f"--{name.replace('_', '-')} is ignored by method {m}")
    from pointalign import _progress

    try:
        tgt = _read_cloud(target, bin_columns)
    except (OSError, ValueError, ImportError) as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_FAILED) from None
    table = Table(title=f"batch: {len(sources)} source(s) -> {escape(target.name)} ({m}, {dev})")
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
                                seed=seed, refine=_refine(refine))
        except (OSError, ValueError, TypeError, ImportError, MemoryError) as exc:
            failed += 1
            table.add_row(escape(path.name), "-", "-", "-", f"[red]failed: {escape(str(exc))}"
                          "[/red]", "-")
            if level < 0:
                _error(f"failed: {path}: {exc}")
            docs.append({"source": str(path), "error": str(exc)})
            continue
        used["wall_seconds"] = time.perf_counter() - t0
        ok = bool(result.converged)
        not_converged += not ok
        table.add_row(escape(path.name), str(len(src)), f"{float(result.fitness):.4f}",
                      f"{float(result.rmse):.4g}",
                      "yes" if ok else f"[red]no ({escape(_why(result))})[/red]",
                      f"{used['wall_seconds'] * 1e3:.0f}")
        docs.append(_json_doc("batch", {"source": {"path": str(path), "points": len(src)},
                                        "target": {"path": str(target), "points": len(tgt)}},
                              used, result))
    if level >= 0:
        console.print(table)
    if json_out is not None:
        try:
            _write_json(json_out, {"pointalign_version": _version(), "command": "batch",
                                   "results": docs})
        except (OSError, ValueError) as exc:
            _error(str(exc))
            raise typer.Exit(EXIT_FAILED) from None
        _say(level, f"results written to {escape(str(json_out))}")
    if failed:
        raise typer.Exit(EXIT_FAILED)
    if not_converged and not allow_failure:
        _error(f"{not_converged} registration(s) did not converge")
        raise typer.Exit(EXIT_NOT_CONVERGED)


def _errors(T_est: np.ndarray, T_true: np.ndarray) -> tuple[float, float]:
    from pointalign import metrics

    rot, trans = metrics.relative_error(T_est, T_true)
    return float(rot), float(trans)


#: the demo's bar for "aligned": rotation (degrees) and translation (metres) errors
DEMO_BAR = (1.0, 2e-3)
#: approximate ICP pairs points with cell means, not the surface: a coarse stage, judged by
#: a coarser bar (measured on the bundled pair from the identity: 4.2 deg / 3.8 mm)
DEMO_COARSE_BAR = (5.0, 5e-3)
#: where ``--start near`` puts a local method: the true pose turned by this many degrees
#: about an axis through the target's centroid and moved by this many metres
DEMO_NEAR = (5.0, 5e-3)
#: the local methods' maximum distance in the demo (the size of the near start); with
#: the general default (5% of the diagonal, 12.7 mm here) point-to-point ICP settles at
#: 1.3 deg, pulled by the parts of the scans that do not overlap
DEMO_LOCAL_DISTANCE = 5e-3
#: the distance at which the demo evaluates every result (fitness, rmse), whatever the
#: method's own distance
DEMO_EVAL_DISTANCE = 2e-3
#: methods that refine a pose they are given: the demo starts them near the answer
LOCAL_METHODS = ("icp", "icp-plane", "gicp", "vgicp")


@command()
def demo(
    ctx: typer.Context,
    method: MethodOpt = "global",  # type: ignore[assignment]
    start: Annotated[Start, typer.Option(
        help="where the method starts: identity, or near (the true pose turned by "
             f"{DEMO_NEAR[0]:g} deg and moved by {DEMO_NEAR[1] * 1e3:g} mm); auto: near for "
             f"the local methods ({', '.join(LOCAL_METHODS)}), identity for the others")
    ] = Start.auto,
    device: DeviceOpt = Device.auto,
    max_iterations: MaxIterationsOpt = None,
    seed: SeedOpt = None,
    refine: RefineOpt = None,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
    html: HtmlOpt = None,
) -> None:
    """Align the bundled Stanford bunny scans bun045 -> bun000 and report the error."""
    level = _level(ctx)
    m = Method(method).value
    _check_reports(json_out, plot, html)
    dev = _resolve_device(device)
    for name in _ignored(m, {"seed": seed, "refine": refine}) * (level >= 0):
        _warning(f"--{name} is ignored by method {m}")
    from pointalign import datasets, metrics

    pair = datasets.load_bunny_pair()
    T_true = np.asarray(pair.T_target_source)
    rot0, trans0 = _errors(np.eye(4), T_true)
    where = Start(start)
    if where is Start.auto:
        where = Start.near if m in LOCAL_METHODS else Start.identity
    if where is Start.near and "init" not in USES[m]:
        _warning(f"--start near is ignored by method {m} (it takes no initial pose)")
        where = Start.identity
    if where is Start.near:
        init = datasets.perturbed_pose(T_true, *DEMO_NEAR, center=pair.target, seed=0)
        begin = (f"start: the true pose turned by {DEMO_NEAR[0]:g} deg and moved by "
                 f"{DEMO_NEAR[1] * 1e3:g} mm")
        if m in LOCAL_METHODS:
            begin += " (a local method refines a pose it is given)"
    else:
        init, begin = None, f"start: identity ({rot0:.1f} deg, {trans0 * 1e3:.1f} mm away)"
    local_distance = DEMO_LOCAL_DISTANCE if m in LOCAL_METHODS else None
    _say(level, f"bun045 ({len(pair.source):,} points) -> bun000 ({len(pair.target):,} "
                f"points); true motion {rot0:.1f} deg, {trans0 * 1e3:.1f} mm; {begin}")
    from pointalign import _progress

    t0 = time.perf_counter()
    with _progress.task(f"registering ({m})", delay=_progress.LIBRARY_DELAY,
                        placeholder=True):
        result, used = _run(m, pair.source, pair.target, init=init, device=dev,
                            max_distance=local_distance, voxel_size=None,
                            max_iterations=max_iterations, seed=seed, refine=_refine(refine))
    wall = time.perf_counter() - t0
    if local_distance is not None:
        used["max_distance_source"] = "the demo's setting for local methods"
    used["start"] = begin.removeprefix("start: ")
    rot, trans = _errors(result.transformation, T_true)
    ev = metrics.evaluate_registration(pair.source, pair.target, DEMO_EVAL_DISTANCE,
                                       result.transformation)
    coarse = m == "approx-icp"
    bar_rot, bar_trans = DEMO_COARSE_BAR if coarse else DEMO_BAR
    ok = rot < bar_rot and trans < bar_trans
    bar = f"{bar_rot:g} deg / {bar_trans * 1e3:g} mm"
    if ok:
        line = f"aligned: errors {rot:.3f} deg, {trans * 1e3:.3f} mm, below {bar}"
        if coarse:
            line += (" (a coarse method: refine with --method icp-plane or newton from "
                     "its result)")
    else:
        line = f"NOT aligned: errors {rot:.3f} deg, {trans * 1e3:.3f} mm, above {bar}"
        if m in LOCAL_METHODS and where is Start.identity:
            line += (f"; {m} is a local method and the identity is {rot0:.0f} deg from the "
                     "answer: try --start near, or --method global")
    if level < 0:
        console.print(line, markup=False, soft_wrap=True)
    else:
        table = Table(title=f"demo: method {m}")
        for col in ("rotation error", "translation error",
                    f"fitness ({DEMO_EVAL_DISTANCE * 1e3:g} mm)",
                    f"rmse ({DEMO_EVAL_DISTANCE * 1e3:g} mm)", "time"):
            table.add_column(col)
        table.add_row(f"{rot:.3f} deg", f"{trans * 1e3:.3f} mm", f"{ev.fitness:.3f}",
                      f"{ev.inlier_rmse * 1e3:.3f} mm", f"{wall:.1f} s")
        console.print(table)
        used["wall_seconds"] = wall
        _print_result(result, used, level)
    if json_out is not None:
        inputs = {"source": "bundled bun045", "target": "bundled bun000",
                  "init": used["start"]}
        _write_json(json_out, _json_doc("demo", inputs, used, result, {
            "errors": {"rotation_deg": rot, "translation": trans},
            "evaluation": {"max_correspondence_distance": DEMO_EVAL_DISTANCE,
                           "fitness": ev.fitness, "inlier_rmse": ev.inlier_rmse}}))
    _pictures(pair.source, pair.target, result, plot, html, f"bun045 -> bun000 ({m})", level)
    if level >= 0:
        console.print(("[green]" if ok else "[red]") + escape(line) +
                      ("[/green]" if ok else "[/red]"))
    if not ok or not math.isfinite(rot):
        raise typer.Exit(EXIT_FAILED)


@command()
def view(
    ctx: typer.Context,
    source: SourceArg,
    target: TargetArg,
    transform: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        metavar="FILE", exists=True, dir_okay=False,
        help="text file with the 4x4 T_target_source")] = None,
    json_in: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        "--json", metavar="FILE.json", exists=True, dir_okay=False,
        help="result JSON (from register --json or RegistrationResult.save)")] = None,
    output: Annotated[Path, typer.Option(metavar="FILE.html", help="HTML file to write")
                      ] = Path("view.html"),
    max_points: Annotated[int, typer.Option(
        min=100, metavar="N", help="points drawn per cloud (subsampled for drawing only)")
    ] = 20000,
    bin_columns: BinColumnsOpt = None,
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
        _error(str(exc))
        raise typer.Exit(EXIT_FAILED) from None
    from pointalign import viz

    viz.write_html(src, tgt, T, output, result=result, max_points=max_points,
                   title=f"{source.name} -> {target.name}")
    _say(_level(ctx), f"viewer written to {escape(str(output))}")


# ``bench`` (and its suite runner) live in their own module, registered on this app; so do
# ``register-many`` and ``multiway``
from pointalign import cli_bench as _cli_bench  # noqa: E402,F401
from pointalign import cli_many as _cli_many  # noqa: E402

_cli_many.register_commands(app)

if __name__ == "__main__":  # pragma: no cover
    # run the app of the imported module (the one ``cli_bench`` registered ``bench`` on)
    from pointalign.cli import app as _app

    _app()
