"""Prebuilt Triton kernels: what the recording GPU machine compiled, for machines like it.

The Triton manifest's recording (``benchmarks/bench_first_call.py --manifest``) also packs,
from the Triton disk caches of its steps, every compiled kernel's binary and metadata (the
cubin and Triton's JSON, not the intermediate forms) and every C module Triton built there
(the kernels' launchers, its driver's helper) into :data:`ARCHIVE`, each under Triton's own
cache key. Before a machine's first GPU call (:func:`pointalign.kernels._precompile.ensure`),
:func:`install` unpacks them into Triton's disk cache, where Triton's lookups find them as if
it had built them: the forked precompile then finds most of its work done.

Triton's key of a kernel hashes its own installation (its sources and library), the backend
(ptxas's version, the GPU architecture), the kernel's source and all it calls, the
specialisation, the options and Triton's cache-relevant environment variables; a C module's
key hashes its source and the platform, and its file name carries the Python ABI. So a
prebuilt file is found only where this machine would have built exactly it; anywhere else
(another Triton build or Python, another GPU, a kernel changed since the recording) the
lookups miss and Triton compiles as before. The archive is not even opened unless Triton's
version, the platform and the GPU's compute capability equal the recording's, and it is
unpacked once per machine (a marker in the cache). ``POINTALIGN_PREBUILT=0`` leaves it out.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import lzma
import os
import re
import sysconfig
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: the packed kernels and modules, next to the manifest
ARCHIVE = Path(__file__).with_name("triton_prebuilt.tar.xz")
#: the archive's table of contents: the recording's Triton, platform and GPU, its kernels
INDEX = "index.json"
#: Triton's cache folders are base32 keys; a member is ``<key>/<file name>``
_MEMBER = re.compile(r"^([A-Z2-7]{16,128})/([A-Za-z0-9_][A-Za-z0-9_.\-]{0,200})$")

logger = logging.getLogger("pointalign")


def _platform() -> str:
    from triton.runtime.build import platform_key

    return platform_key()


def _module_suffix() -> str:
    return str(sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def _grp(metadata: str) -> str:
    """Triton's group file of a kernel whose metadata file is ``metadata`` (``<name>.json``)."""
    return f"__grp__{metadata}"


def pack(cache_dirs: Iterable[str | os.PathLike[str]], capability: tuple[int, int],
         out: Path = ARCHIVE) -> dict[str, Any]:
    """Pack what Triton built into ``cache_dirs`` (disk caches) as :data:`ARCHIVE`.

    Per kernel its metadata and cubin (a folder whose group lists a cubin), and every
    compiled C module. ``capability``: the recording GPU's ``(major, minor)``. Returns the
    index written. Deterministic for the same files (sorted members, no times or owners).
    """
    import triton

    files: dict[str, bytes] = {}
    kernels: dict[str, str] = {}
    for root in cache_dirs:
        for d in sorted(p for p in Path(root).iterdir() if p.is_dir()):
            for grp in sorted(d.glob(_grp("*.json"))):
                child = json.loads(grp.read_text()).get("child_paths", {})
                metadata = grp.name[len(_grp("")):]
                keep = [n for n in child if n == metadata or n.endswith(".cubin")]
                if metadata in keep and len(keep) == 2:
                    for n in keep:
                        files[f"{d.name}/{n}"] = (d / n).read_bytes()
                    kernels[d.name] = metadata
            for so in sorted(d.glob("*" + _module_suffix())):
                files[f"{d.name}/{so.name}"] = so.read_bytes()
    index = {"triton": triton.__version__, "platform": _platform(),
             "module_suffix": _module_suffix(), "capability": list(capability),
             "kernels": dict(sorted(kernels.items()))}
    for name in files:
        if not _MEMBER.match(name):
            raise ValueError(f"unexpected cache file name {name!r}")
    with tarfile.open(out, "w:xz", preset=9) as tf:
        for name, data in [(INDEX, json.dumps(index, indent=1).encode())] + sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tf.addfile(info, io.BytesIO(data))
    return index


def _applies(index: dict[str, Any], capability: tuple[int, int]) -> bool:
    import triton

    return (index.get("triton") == triton.__version__ and index.get("platform") == _platform()
            and index.get("module_suffix") == _module_suffix()
            and list(index.get("capability", ())) == list(capability))


def _write(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed, as Triton does)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@functools.lru_cache(maxsize=4)
def _digest(archive: Path, size: int, mtime_ns: int) -> str:
    return hashlib.sha256(archive.read_bytes()).hexdigest()[:32]


def _marker(cache_dir: Path, archive: Path) -> Path:
    st = archive.stat()
    name = f"prebuilt-{_digest(archive, st.st_size, st.st_mtime_ns)}"
    return cache_dir / "pointalign-precompiled" / name


def install(cache_dir: Path, capability: tuple[int, int], archive: Path = ARCHIVE) -> int:
    """Unpack ``archive`` into Triton's disk cache ``cache_dir``, once per machine.

    Only files the cache lacks are written (a kernel Triton built itself stays); a kernel's
    group file, whose paths are this cache's, is written last, so that a lookup finds a
    kernel whole or not at all. ``capability``: this GPU's ``(major, minor)``.

    Returns:
        The number of kernels added: 0 where the archive does not apply (another Triton,
        platform or GPU), is missing or unreadable (logged, never raised), or was unpacked
        here before.

    """
    if os.environ.get("POINTALIGN_PREBUILT", "1") == "0" or not archive.is_file():
        return 0
    try:
        marker = _marker(cache_dir, archive)
        if marker.exists():
            return 0
        added = 0
        with tarfile.open(archive, "r:xz") as tf:
            head = tf.next()
            if head is None or head.name != INDEX:
                raise ValueError("the archive does not start with its index")
            index = json.load(tf.extractfile(head))  # type: ignore[arg-type]
            if not _applies(index, capability):
                return 0
            kernels: dict[str, str] = index["kernels"]
            for m in tf:
                if m.name == INDEX:
                    continue
                got = _MEMBER.match(m.name)
                if not m.isfile() or got is None:
                    raise ValueError(f"unexpected archive member {m.name!r}")
                key, name = got.groups()
                dest = cache_dir / key / name
                if (key in kernels and (cache_dir / key / _grp(kernels[key])).exists()) \
                        or dest.exists():
                    continue  # Triton's own, or unpacked before
                _write(dest, tf.extractfile(m).read())  # type: ignore[union-attr]
            for key, metadata in kernels.items():
                d = cache_dir / key
                grp = d / _grp(metadata)
                cubin = metadata[:-len(".json")] + ".cubin"
                if grp.exists() or not (d / metadata).is_file() or not (d / cubin).is_file():
                    continue
                paths = {n: str(d / n) for n in (metadata, cubin)}
                _write(grp, json.dumps({"child_paths": paths}).encode())
                added += 1
        _write(marker, json.dumps({"archive": archive.name, "kernels": added}).encode())
        return added
    except (OSError, tarfile.TarError, lzma.LZMAError, ValueError, KeyError, TypeError,
            EOFError) as exc:
        logger.debug("prebuilt Triton kernels not installed: %r", exc)
        return 0
