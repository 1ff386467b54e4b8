"""Prebuilt Triton kernels (kernels/_prebuilt.py): packed from one cache, found in another.

Triton compiles for a named GPU without one, so the round trip (compile into a cache, pack,
unpack into an empty cache, compile again: a cache hit) runs on the CPU; the device run
checks that a fresh machine's first call finds the shipped archive's kernels.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from pointalign.kernels import _prebuilt, _precompile  # noqa: E402

from .test_precompile import _SPLIT, _sm90  # noqa: E402

SM90 = (9, 0)


def _compiled(cache: Path) -> list[Path]:
    """Kernel folders whose intermediate forms are there: compiled in that cache."""
    return [g.parent for g in cache.glob("*/__grp__*.json") if any(g.parent.glob("*.ptx"))]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A cache with one kernel compiled for sm_90, and its archive."""
    cache = tmp_path_factory.mktemp("built")
    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    try:
        _precompile.compile_entry(_SPLIT, _sm90())
    finally:
        if old is None:
            del os.environ["TRITON_CACHE_DIR"]
        else:
            os.environ["TRITON_CACHE_DIR"] = old
    (cache / "MODULEKEYAAAAAAAAAAAAAA").mkdir()  # a compiled C module (a launcher's form)
    (cache / "MODULEKEYAAAAAAAAAAAAAA" / f"mod{_prebuilt._module_suffix()}").write_bytes(b"elf")
    archive = tmp_path_factory.mktemp("archive") / "prebuilt.tar.xz"
    index = _prebuilt.pack([cache], SM90, out=archive)
    return cache, archive, index


def test_pack_keeps_the_binary_and_metadata_only(packed):
    cache, archive, index = packed
    assert len(index["kernels"]) == 1 and len(_compiled(cache)) == 1
    with tarfile.open(archive, "r:xz") as tf:
        names = tf.getnames()
    assert names[0] == _prebuilt.INDEX
    suffixes = sorted(Path(n).suffix for n in names[1:])
    assert suffixes == [".cubin", ".json", Path(_prebuilt._module_suffix()).suffix]
    again = archive.with_name("again.tar.xz")
    _prebuilt.pack([cache], SM90, out=again)
    assert again.read_bytes() == archive.read_bytes()  # deterministic


def test_an_unpacked_kernel_is_found_not_compiled(packed, tmp_path, monkeypatch):
    _, archive, _ = packed
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert _prebuilt.install(tmp_path, SM90, archive) == 1
    n = sum(1 for _ in tmp_path.rglob("*"))
    assert (tmp_path / "MODULEKEYAAAAAAAAAAAAAA" / f"mod{_prebuilt._module_suffix()}").is_file()
    _precompile.compile_entry(_SPLIT, _sm90())  # Triton's lookup: a cache hit
    assert _compiled(tmp_path) == [] and sum(1 for _ in tmp_path.rglob("*")) == n
    grp = next(tmp_path.glob("*/__grp__*.json"))
    paths = json.loads(grp.read_text())["child_paths"].values()
    assert all(Path(p).parent == grp.parent for p in paths)  # this cache's paths


def test_install_is_once_per_machine_and_keeps_tritons_own(packed, tmp_path):
    cache, archive, _ = packed
    own = _compiled(cache)[0]
    mine = tmp_path / own.name
    mine.mkdir()
    grp = next(own.glob("__grp__*.json"))
    (mine / grp.name).write_text("{}")  # Triton's own entry of that key: left alone
    assert _prebuilt.install(tmp_path, SM90, archive) == 0
    assert (mine / grp.name).read_text() == "{}" and not list(mine.glob("*.cubin"))
    assert _prebuilt.install(tmp_path, SM90, archive) == 0  # the marker: not opened again
    assert list((tmp_path / "pointalign-precompiled").glob("prebuilt-*"))


@pytest.mark.parametrize("change", ["capability", "triton", "platform", "switched off"])
def test_nothing_is_unpacked_where_it_does_not_apply(packed, tmp_path, monkeypatch, change):
    _, archive, _ = packed
    capability = SM90
    if change == "capability":
        capability = (8, 0)
    elif change == "triton":
        monkeypatch.setattr("triton.__version__", "0.0.0")
    elif change == "platform":
        monkeypatch.setattr(_prebuilt, "_platform", lambda: "riscv64,Linux,64bit,ELF")
    else:
        monkeypatch.setenv("POINTALIGN_PREBUILT", "0")
    assert _prebuilt.install(tmp_path, capability, archive) == 0
    assert not list(tmp_path.glob("*/*.cubin"))


def _archive(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:xz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("bad", ["truncated", "not xz", "escaping member", "no index",
                                 "missing"])
def test_a_bad_archive_installs_nothing_and_raises_nothing(packed, tmp_path, bad):
    _, archive, index = packed
    dest = tmp_path / "cache"
    path = tmp_path / "bad.tar.xz"
    if bad == "truncated":
        path.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    elif bad == "not xz":
        path.write_bytes(b"not an archive")
    elif bad == "escaping member":
        _archive(path, {_prebuilt.INDEX: json.dumps(index).encode(),
                        "../../outside.cubin": b"x"})
    elif bad == "no index":
        _archive(path, {"AAAAAAAAAAAAAAAAAAAA/k.cubin": b"x"})
    assert _prebuilt.install(dest, SM90, path) == 0
    assert not list(tmp_path.rglob("outside.cubin")) and not list(dest.glob("*/*.cubin"))


def test_the_shipped_archive_matches_the_manifest():
    if not _prebuilt.ARCHIVE.is_file():
        pytest.skip("no prebuilt archive in this checkout")
    doc = _precompile.manifest()
    with tarfile.open(_prebuilt.ARCHIVE, "r:xz") as tf:
        index = json.load(tf.extractfile(_prebuilt.INDEX))
        names = {json.load(tf.extractfile(f"{key}/{meta}"))["name"]
                 for key, meta in index["kernels"].items()}
    assert index["triton"] == doc["triton"]
    every = {e["kernel"].split(":")[1] for step in doc["steps"]
             for e in _precompile.entries([step])}
    assert every <= names, f"recorded but not packed: {sorted(every - names)}"


@pytest.mark.gpu
def test_a_fresh_cache_finds_the_shipped_kernels(tmp_path):
    """A fresh process with an empty Triton cache: register()'s step compiles nothing."""
    import triton

    with tarfile.open(_prebuilt.ARCHIVE, "r:xz") as tf:
        index = json.load(tf.extractfile(_prebuilt.INDEX))
    if not _prebuilt._applies(index, torch.cuda.get_device_capability()):
        pytest.skip(f"the archive is for Triton {index['triton']} on sm_"
                    f"{''.join(map(str, index['capability']))} (here {triton.__version__})")
    code = ("import torch; from pointalign.kernels import _precompile as p; "
            "assert p.ensure(('register',), torch.device('cuda')) is not None")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), POINTALIGN_PREBUILT="1")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    compiled = [next(d.glob("*.json")).stem for d in _compiled(tmp_path)]
    assert compiled == [], f"compiled anew (a kernel changed since the recording?): {compiled}"
