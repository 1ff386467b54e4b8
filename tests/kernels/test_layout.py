"""The kernel layer's shape: no import circles, backends import their spec, not their dispatcher.

The static import graph is read from the source with :mod:`ast` (every ``import``, at module
level or inside a function: a lazy import is an arrow too). Only explicit imports count: that
``import pointalign.kernels.knn.reference`` runs ``knn/__init__.py`` first is Python's package
rule, the same for every layout, and not an arrow the code draws.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import pointalign
import pointalign.kernels

SRC = Path(pointalign.__file__).resolve().parent


def _modules(package) -> dict[str, Path]:
    """Every module of ``package`` (itself included): dotted name -> source file."""
    out = {package.__name__: Path(package.__file__)}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        spec = info.module_finder.find_spec(info.name, None)  # type: ignore[call-arg]
        assert spec is not None and spec.origin is not None, info.name
        out[info.name] = Path(spec.origin)
    return out


def _targets(name: str, path: Path, mods) -> set[str]:
    """Modules among ``mods`` that module ``name`` (source ``path``) imports.

    ``from a import b`` is an arrow to ``a.b`` when that is a module, else to ``a``;
    ``import a.b`` to the longest known prefix; relative imports are resolved.
    """
    found: set[str] = set()
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                known = [".".join(parts[:i]) for i in range(len(parts), 0, -1)
                         if ".".join(parts[:i]) in mods]
                found.update(known[:1])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                mod = ".".join(parts[:len(parts) - node.level + 1])
                mod = f"{mod}.{node.module}" if node.module else mod
            else:
                mod = node.module or ""
            for a in node.names:
                if f"{mod}.{a.name}" in mods:
                    found.add(f"{mod}.{a.name}")
                elif mod in mods:
                    found.add(mod)
    found.discard(name)
    return found


_ALL: dict[str, Path] = {}


def _all_modules() -> dict[str, Path]:
    """Every module of :mod:`pointalign` (cached)."""
    if not _ALL:
        _ALL.update(_modules(pointalign))
    return _ALL


def _graph(package) -> dict[str, set[str]]:
    """Static import graph among the modules of ``package``."""
    mods = _modules(package)
    return {name: _targets(name, path, mods) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that returns to its start), or None."""
    colour: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        colour[u] = 1
        path.append(u)
        for v in sorted(graph.get(u, ())):
            if colour.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in colour:
                found = visit(v)
                if found:
                    return found
        path.pop()
        colour[u] = 2
        return None

    for u in sorted(graph):
        if u not in colour:
            found = visit(u)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_kernels_have_no_import_cycle():
    graph = _graph(pointalign.kernels)
    assert "pointalign.kernels.knn.reference" in graph  # the walk found the families
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def _family_of(name: str) -> str | None:
    """``pointalign.kernels.<family>`` for a module inside a family folder, else None."""
    parts = name.split(".")
    return ".".join(parts[:3]) if len(parts) >= 4 and parts[:2] == ["pointalign", "kernels"] \
        else None


def test_backends_and_references_never_import_their_dispatcher():
    """``triton.py``, ``cpu*.py`` / ``*_cpu.py`` and ``reference.py`` import the spec, not the
    family's ``__init__`` (the dispatcher imports them: that arrow would close a circle)."""
    graph = _graph(pointalign.kernels)
    checked, bad = 0, []
    for name, targets in graph.items():
        fam, leaf = _family_of(name), name.rpartition(".")[2]
        if fam is None or not (leaf == "triton" or "cpu" in leaf or leaf == "reference"):
            continue
        checked += 1
        if fam in targets:
            bad.append(name)
        if leaf == "reference":  # the spec imports no backend of its family
            bad += [f"{name} -> {t}" for t in targets if t.startswith(fam + ".")
                    and t.rpartition(".")[2] != "reference"]
    assert checked >= 15, checked
    assert not bad, bad


def test_kernels_never_import_the_algorithm_layer():
    """No arrow runs back up from the kernel layer (it closed an 11-module circle once)."""
    up = ("pointalign.registration", "pointalign.search", "pointalign.features")
    mods = _all_modules()
    bad = sorted(f"{name} -> {t}" for name, path in _modules(pointalign.kernels).items()
                 for t in _targets(name, path, mods) if t.startswith(up))
    assert not bad, bad


def _backend_uses(package: str) -> list[str]:
    """Imports of ``pointalign.kernels._backend`` and calls of ``backend(...)`` in ``package``."""
    mods = {n: p for n, p in _all_modules().items()
            if n == package or n.startswith(package + ".")}
    out = []
    for _, path in sorted(mods.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            hit = False
            if isinstance(node, ast.Import):
                hit = any(a.name.startswith("pointalign.kernels._backend") for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                hit = mod.startswith("pointalign.kernels._backend") or (
                    mod == "pointalign.kernels"
                    and any(a.name in ("_backend", "backend") for a in node.names))
            elif isinstance(node, ast.Call):
                f = node.func
                hit = (isinstance(f, ast.Name) and f.id == "backend") or (
                    isinstance(f, ast.Attribute) and f.attr == "backend")
            if hit:
                out.append(f"{path.relative_to(SRC.parent)}:{node.lineno}")
    return out


@pytest.mark.parametrize("package", [
    "pointalign.search",
    "pointalign.features",
    "pointalign.registration",
])
def test_algorithm_layer_never_asks_for_the_backend(package):
    """The device is decided in ``kernels/`` only (DESIGN: one seam)."""
    uses = _backend_uses(package)
    assert not uses, uses


def test_every_module_imports_alone():
    """Each module of the package imported first, in a process where no other is loaded.

    One child process; before each import every ``pointalign`` module is dropped from
    ``sys.modules`` (third-party packages stay, which changes nothing about our circles).
    Optional dependencies that are not installed (Triton, numba, ...) are not failures.
    """
    names = sorted(_all_modules())
    code = (
        "import importlib, sys\n"
        f"names = {names!r}\n"
        "bad = []\n"
        "for n in names:\n"
        "    for m in [m for m in sys.modules if m.split('.')[0] == 'pointalign']:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(n)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if (e.name or '').startswith('pointalign'):\n"
        "            bad.append(f'{n}: {e!r}')\n"
        "    except Exception as e:\n"
        "        bad.append(f'{n}: {e!r}')\n"
        "print('BAD', bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=600)
    assert out.stdout.strip().splitlines()[-1] == "BAD []", out.stdout[-3000:] + out.stderr[-3000:]


def test_registration_modules_stay_small():
    """No module of ``registration/`` over 600 lines, ``soft.py`` under 550 (issue 22):
    one concern per module, each readable whole."""
    import pointalign.registration

    sizes = {name: len(path.read_text().splitlines())
             for name, path in _modules(pointalign.registration).items()}
    assert max(sizes.values()) <= 600, {n: s for n, s in sizes.items() if s > 600}
    assert sizes["pointalign.registration.soft"] < 550
