"""TEMPORARY shim (replaced by the search helper's policy module at merge)."""
from __future__ import annotations

import torch

from pointalign.search import build_index


class _Plain:
    def __init__(self, ix):
        self.index = ix
        self.points = ix.points
        self.uses_hint = bool(getattr(ix, "supports_hint", False))

    def nearest_within(self, q, d, *, hint=None):
        fast = getattr(self.index, "nearest_within_unchecked", None)
        if fast is not None:
            if self.uses_hint:
                dd, i = fast(q, d, hint)
            else:
                dd, i = fast(q, d)
            from pointalign.search.base import KnnResult
            return KnnResult(dd[:, None], i[:, None])
        return self.index.nearest_within(q, d)


def choose_index(points, *, max_distance=None):
    return build_index(points, "auto", max_distance=max_distance)


import weakref
_cache = weakref.WeakKeyDictionary()


def correspondence_index(index, max_distance):
    d = _cache.setdefault(index, {})
    if max_distance not in d:
        d[max_distance] = _Plain(index)
    return d[max_distance]


def query_order(points: torch.Tensor):
    return None
