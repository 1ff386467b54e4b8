"""Out of device memory: the kNN tiles shrink and retry; an entry point that still runs out
raises a MemoryError that names it (never a raw CUDA error). Simulated on the CPU by making
an allocation-heavy step raise ``torch.OutOfMemoryError``."""

import pytest
import torch

from pointalign import icp
from pointalign.kernels import _loop
from pointalign.kernels import knn as K
from pointalign.search import build_index


def test_knn_reference_retries_with_smaller_tiles(monkeypatch, rng):
    q = torch.rand(300, 3, generator=rng)
    p = torch.rand(400, 3, generator=rng)
    want = K.knn_reference(q, p, 40)
    seen = []
    real = K.knn_reference

    def flaky(query, points, k, max_distance_sq=None, *, tile_pairs=K._TILE_PAIRS):
        seen.append(tile_pairs)
        if tile_pairs > K._TILE_PAIRS // 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
        return real(query, points, k, max_distance_sq, tile_pairs=tile_pairs)

    monkeypatch.setattr(K, "knn_reference", flaky)
    got = K.knn_tiles(q, p, 40)  # k > 32: the reference path
    assert seen == [K._TILE_PAIRS, K._TILE_PAIRS // 4, K._TILE_PAIRS // 16]
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])


def test_knn_gives_up_below_the_smallest_tile(monkeypatch, rng):
    from pointalign.features.normals import estimate_normals

    def broke(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(K, "knn_reference", broke)
    pts = torch.rand(50, 3, generator=rng)
    with pytest.raises(torch.OutOfMemoryError):
        K.knn_tiles(pts, pts, 40)
    # through a public entry point it becomes a MemoryError naming that entry point
    with pytest.raises(MemoryError, match="^estimate_normals: the device ran out of memory"):
        estimate_normals(pts, k=10, index=build_index(pts, "brute"))


def test_entry_point_turns_out_of_memory_into_a_clear_error(monkeypatch, rng):
    from pointalign.registration import icp as icp_mod

    src = torch.rand(200, 3, generator=rng)
    before = src.clone()

    def broke(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setattr(icp_mod, "_indexes", broke)
    _loop._programs.put(("kept",), [], "a graph")  # what a GPU run keeps between calls
    with pytest.raises(MemoryError, match=r"^icp: the device ran out of memory .*80\.00 GiB"):
        icp(src, src + 0.01, max_correspondence_distance=0.05, device="cpu")
    assert torch.equal(src, before)
    assert _loop._programs.get(("kept",), []) is None  # kept graphs released with the error
