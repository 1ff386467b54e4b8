"""ShiftedIndex: an index over points in another frame, searched with this frame's queries."""

from __future__ import annotations

import pytest
import torch

from pointalign.kernels import _loop
from pointalign.search import build_index
from pointalign.search.shifted import Offset, ShiftedIndex

METHODS = ["brute", "grid", "kdtree", "ckdtree"]


@pytest.mark.parametrize("method", METHODS)
def test_answers_are_the_searched_index_answers_of_the_moved_queries(method, device):
    """Every query method gives what the searched index gives for ``q + offset``, with the
    same tensors in; ``points`` are the searched points moved back; the hint is passed on."""
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    off = torch.tensor([30.0, -20.0, 5.0], device=dev)
    far = (torch.rand(400, 3, generator=g).to(dev) + off).contiguous()
    ix = build_index(far, method, max_distance=0.1) if method == "grid" else \
        build_index(far, method)
    sh = ShiftedIndex(ix, Offset(off))
    q = torch.rand(50, 3, generator=g).to(dev)
    for got, want in ((sh.knn(q, 4), ix.knn(q + off, 4)),
                      (sh.radius(q, 0.2, 8), ix.radius(q + off, 0.2, 8)),
                      (sh.nearest_within(q, 0.1), ix.nearest_within(q + off, 0.1))):
        assert torch.equal(got.idx, want.idx) and torch.equal(got.dists, want.dists)
    hint = ix.nearest_within(q + off, 0.1).idx[:, 0]
    got = sh.nearest_within(q, 0.1, hint=hint)
    assert torch.equal(got.idx[:, 0], hint)
    assert sh.uses_hint == ix.uses_hint and sh.index is ix
    torch.testing.assert_close(sh.points, far - off)


def test_offset_is_a_graph_array_object():
    """The executor keys an offset by its layout and copies each call's value in; a shifted
    index is keyed by its fields, so two calls with other offsets share one key."""
    a, b = (Offset(torch.tensor(v)) for v in ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]))
    assert a.graph_arrays()[0] == b.graph_arrays()[0]
    assert torch.equal(a.with_arrays({"value": b.value}).value, b.value)
    with pytest.raises(ValueError, match="layout"):
        a.with_arrays({"value": torch.zeros(4)})
    ix = build_index(torch.rand(20, 3, generator=torch.Generator().manual_seed(1)), "brute")
    keys = [_loop._key_of(ShiftedIndex(ix, o), [], {}) for o in (a, b)]
    assert keys[0] == keys[1]
