"""An index over points in another frame, searched from this one.

A registration solves in a frame centred on the target (its float32 coordinates stay
small, so the sums and updates keep their precision). A caller's index was built over the
target as the caller gave it, possibly far from the origin. :class:`ShiftedIndex` lets the
registration search that index with its centred queries: each query is moved by the
offset between the frames first, and the answers (indices, squared distances) do not
depend on the frame. The search itself then rounds at the caller's coordinates, which
only decides near-ties between neighbours; every sum is taken in the centred frame.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from pointalign.search import _checks
from pointalign.search.base import KnnResult


class Offset:
    """A ``(3,)`` translation on a device, which an executor copies into its CUDA graphs.

    ``graph_arrays`` / ``with_arrays`` as an index's (:mod:`pointalign.kernels._loop`): a
    kept graph reads each call's offset, not the capturing call's.
    """

    def __init__(self, value: torch.Tensor):
        self.value = value

    def graph_arrays(self) -> tuple[tuple, dict[str, torch.Tensor]]:
        """Return ``(key, {"value": (3,)})``: the offset's layout and tensor."""
        arrays = {"value": self.value}
        return ("Offset", _checks.array_layout(arrays)), arrays

    def with_arrays(self, arrays: dict[str, torch.Tensor]) -> Offset:
        """Return an offset reading ``arrays["value"]`` (laid out as :meth:`graph_arrays`)."""
        _checks.check_arrays(arrays, self.graph_arrays()[1])
        return Offset(arrays["value"])


@dataclass(frozen=True)
class ShiftedIndex:
    """Search ``searched`` (built in another frame) with queries in this frame.

    A query ``q`` is searched as ``q + offset.value``: ``offset`` holds the other frame's
    coordinates of this frame's origin, in the searched index's dtype and on its device.
    A frozen dataclass of two fields, as :class:`~pointalign.search.policy.TieredIndex`:
    an executor's graph signature names it by its fields.

    Attributes:
        searched: the index the queries go to (its points in the other frame).
        offset: the :class:`Offset` between the frames.

    """

    searched: Any
    offset: Offset

    @property
    def index(self) -> Any:
        """The caller's index (behind any tiers the registration put before it)."""
        return getattr(self.searched, "index", self.searched)

    @functools.cached_property
    def points(self) -> torch.Tensor:
        """The ``(M, 3)`` points in this frame (made on first use)."""
        return self.searched.points - self.offset.value

    @property
    def uses_hint(self) -> bool:
        """Whether the searched index reads hints (passed on to it)."""
        return bool(self.searched.uses_hint)

    def knn(self, query: torch.Tensor, k: int) -> KnnResult:
        """``searched.knn`` of the moved queries."""
        return self.searched.knn(query + self.offset.value, k)

    def radius(self, query: torch.Tensor, r: float, max_neighbors: int) -> KnnResult:
        """``searched.radius`` of the moved queries."""
        return self.searched.radius(query + self.offset.value, r, max_neighbors)

    def nearest_within(self, query: torch.Tensor, max_distance: float, *,
                       hint: torch.Tensor | None = None) -> KnnResult:
        """``searched.nearest_within`` of the moved queries (the hint passed on)."""
        return self.searched.nearest_within(query + self.offset.value, max_distance,
                                            hint=hint)


__all__ = ["Offset", "ShiftedIndex"]
