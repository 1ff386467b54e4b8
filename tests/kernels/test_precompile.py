"""The Triton manifest and the forked ahead-of-launch compile (kernels/_precompile.py).

Triton compiles for a named target without a GPU (its wheel carries ptxas), so the
mechanism (an entry rebuilt from the manifest, compiled in forked children into the disk
cache) is tested here on the CPU; the device run checks that a launch then finds it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("triton")

from pointalign import _warmup  # noqa: E402
from pointalign.kernels import _precompile  # noqa: E402

#: the smallest kernel (its compile takes ~0.2 s): the k-d tree's axis-keys kernel
_SPLIT = {
    "kernel": "pointalign.kernels.kdtree.triton:_axis_keys_kernel",
    "signature": {"pts_ptr": "*fp32", "key_ptr": "*i32", "m_points": "i32",
                  "BLOCK": "constexpr", "PACKED": "constexpr"},
    "constexprs": [[[3], 64], [[4], False]],
    "attrs": [[[i], [["tt.divisibility", 16]]] for i in (0, 1)],
    "options": {"num_warps": 4, "num_stages": 3, "num_ctas": 1},
    "seconds": 0.2,
}


def _sm90():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def _files(d) -> int:
    return sum(len(f) for _, _, f in os.walk(d))


def test_manifest_entries_name_kernels_of_this_package():
    doc = _precompile.manifest()
    steps = {name for name, _ in _warmup._steps(torch.device("cpu"))}
    assert set(doc["steps"]) <= steps
    for step in doc["steps"]:
        for e in _precompile.entries([step]):
            assert e["kernel"].startswith("pointalign.kernels.")
            assert set(e) >= {"kernel", "signature", "constexprs", "attrs", "options"}
            _precompile._jit_function(e["kernel"])  # resolves (lazily jitted ones too)


def test_entries_are_unique_and_longest_first(monkeypatch):
    a = dict(_SPLIT, seconds=0.1)
    b = dict(_SPLIT, options={"num_warps": 8, "num_stages": 3, "num_ctas": 1}, seconds=2.0)
    monkeypatch.setattr(_precompile, "manifest",
                        lambda: {"triton": "x", "steps": {"s": [a, b], "t": [a]}})
    got = _precompile.entries(["s", "t"])
    assert [e["seconds"] for e in got] == [2.0, 0.1]


def test_bins_balance_the_longest_first():
    todo = [{"seconds": s} for s in (5.0, 3.0, 2.0, 2.0, 1.0)]
    bins = _precompile._bins(todo, 2)
    loads = sorted(sum(e["seconds"] for e in b) for b in bins)
    assert loads == [6.0, 7.0]
    assert len(_precompile._bins(todo[:1], 4)) == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_compile_fills_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert _files(tmp_path) == 0
    assert _precompile.compile_forked([_SPLIT], _sm90(), workers=2)
    n = _files(tmp_path)
    assert n > 0
    _precompile.compile_entry(_SPLIT, _sm90())  # again in this process: a cache hit
    assert _files(tmp_path) == n


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_the_parent_works_meanwhile_and_its_failure_costs_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ran = []
    assert _precompile.compile_forked([_SPLIT], _sm90(), meanwhile=lambda: ran.append(1))
    assert ran == [1]

    def fails():
        raise RuntimeError("no device")

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "other"))
    assert _precompile.compile_forked([_SPLIT], _sm90(), meanwhile=fails)
    assert _files(tmp_path / "other") > 0


@pytest.mark.gpu
def test_the_runtime_warm_up_runs_on_the_gpu():
    _precompile.warm_runtime(torch.device("cuda"))


def test_a_bad_entry_makes_the_child_fail_not_the_parent(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    bad = dict(_SPLIT, kernel="pointalign.kernels.kdtree.triton:no_such_kernel")
    assert not _precompile.compile_forked([bad], _sm90())


def test_ensure_does_nothing_off_the_gpu(monkeypatch):
    monkeypatch.setattr(_precompile, "compile_forked",
                        lambda *a, **k: pytest.fail("compiled for a CPU call"))
    monkeypatch.setattr(_precompile, "_done", set())
    assert _precompile.ensure(("register",), torch.device("cpu")) is None
    assert _precompile.ensure(("register",), None) is None


def test_ensure_compiles_once_and_leaves_markers(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_precompile, "_done", set())
    monkeypatch.setattr(_precompile, "_applies", lambda device: _sm90())
    monkeypatch.setattr(_precompile, "manifest",
                        lambda: {"triton": "x", "steps": {"register": [_SPLIT]}})
    monkeypatch.setattr(_precompile, "compile_forked",
                        lambda todo, target, workers=None, meanwhile=None:
                        calls.append(len(todo)) or True)
    assert _precompile.ensure(("register",), "cuda") is not None
    assert _precompile.ensure(("register",), "cuda") is None  # this process: done
    monkeypatch.setattr(_precompile, "_done", set())
    assert _precompile.ensure(("register",), "cuda") is None  # this machine: the marker
    assert calls == [1]
    markers = list((tmp_path / "pointalign-precompiled").iterdir())
    assert len(markers) == 1 and json.loads(markers[0].read_text()) == {"step": "register"}


def test_what_the_cache_holds_is_not_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert _precompile.missing([_SPLIT], _sm90()) == [_SPLIT]
    _precompile.compile_entry(_SPLIT, _sm90())
    assert _precompile.missing([_SPLIT], _sm90()) == []
    other = dict(_SPLIT, options={"num_warps": 2, "num_stages": 3, "num_ctas": 1})
    assert _precompile.missing([_SPLIT, other], _sm90()) == [other]
    monkeypatch.setattr(_precompile, "_done", set())
    monkeypatch.setattr(_precompile, "_applies", lambda device: _sm90())
    monkeypatch.setattr(_precompile, "manifest",
                        lambda: {"triton": "x", "steps": {"register": [_SPLIT]}})
    monkeypatch.setattr(_precompile, "compile_forked",
                        lambda *a, **k: pytest.fail("forked to compile a cached kernel"))
    assert _precompile.ensure(("register",), "cuda") is not None
    assert list((tmp_path / "pointalign-precompiled").iterdir())  # the step's marker


@pytest.mark.gpu
def test_a_precompiled_kernel_is_launched_without_compiling(tmp_path, monkeypatch):
    from triton.runtime import driver

    from pointalign.kernels import kdtree
    from pointalign.kernels.kdtree import triton as kd

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    pts = torch.rand(500, 3, device="cuda")
    kernels = (kd._axis_keys_kernel, kd._top_nodes_kernel, kd._top_side_kernel,
               kd._top_flags_kernel, kd._top_partition_kernel, kd._top_gather_kernel,
               kd._subtree_kernel)  # 500 points: the subtree kernel builds it all
    for k in kernels:  # launched earlier in this process: forget
        k.device_caches.clear()
    with _precompile.record() as got:  # what the launch compiles: its entries
        kdtree.build(pts, 2)
        torch.cuda.synchronize()
    assert got, "the launch reported no compile"
    entry = got[0]
    fresh = tmp_path / "fresh"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh))
    assert _precompile.compile_forked(got, driver.active.get_current_target())
    n = _files(fresh)
    for k in kernels:  # this process forgets; the disk remembers
        k.device_caches.clear()
    kdtree.build(pts, 2)
    torch.cuda.synchronize()
    new = _files(fresh) - n  # kernels and launchers were all there
    assert new == 0, f"{entry['kernel']}: {new} files compiled again at its launch"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_hanging_child_is_stopped_at_the_deadline():
    import time

    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        time.sleep(60)
        os._exit(0)
    t = time.monotonic()
    assert not _precompile._wait([pid], deadline=t + 0.3)
    assert time.monotonic() - t < 10


def test_precompile_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("POINTALIGN_PRECOMPILE", "0")
    assert _precompile._applies(torch.device("cuda")) is None
