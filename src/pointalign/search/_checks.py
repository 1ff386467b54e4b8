"""Argument checks shared by the search indexes (errors name the argument)."""

from __future__ import annotations

from typing import Any

import torch

from pointalign import _validate


def index_points(points: Any, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """Check the ``points (M, 3)`` of an index: non-empty, finite, float, contiguous."""
    return _validate.as_points(points, "points", device=device, dtype=dtype).contiguous()


def query_points(query: Any, like: torch.Tensor) -> torch.Tensor:
    """Check ``query (N, 3)``: on ``like``'s device, cast to its dtype; N may be 0.

    A tensor on another device than the index is an error (no silent copies); NumPy input is
    moved to the index's device. The index's own points (``query is like``, a self-query)
    were checked when the index was built and are returned as they are.
    """
    if query is like:
        return like
    if isinstance(query, torch.Tensor):
        if query.device != like.device:
            raise ValueError(
                f"query: on {query.device} but the index is on {like.device}; "
                "move the query (or build the index) on one device")
        if query.dim() == 2 and query.shape == (0, 3):
            return query.to(like.dtype)
        if (_validate.is_trusted() and query.dim() == 2 and query.shape[1] == 3
                and query.dtype == like.dtype):
            return query.contiguous()
    q = _validate.as_points(query, "query", device=like.device, dtype=like.dtype)
    return q.contiguous()


def check_k(k: Any, m: int, name: str = "k", *, allow_more: bool = False) -> int:
    """Check an integer ``k >= 1``; ``k > m`` (more than the index holds) fails unless allowed."""
    if isinstance(k, bool) or not isinstance(k, int):
        try:
            import numpy as np

            if isinstance(k, np.integer):
                k = int(k)
            else:
                raise TypeError
        except TypeError:
            raise TypeError(f"{name}: expected an integer, got {type(k).__name__}") from None
    if k < 1:
        raise ValueError(f"{name}: must be >= 1, got {k}")
    if k > m and not allow_more:
        raise ValueError(f"{name}: asked for {k} neighbours but the index holds only {m} points")
    return k


def check_distance(value: Any, name: str) -> float:
    """Check a finite distance > 0 (ValueError naming the argument otherwise)."""
    return _validate.positive(value, name)


def check_hint(hint: Any, n: int, like: torch.Tensor, *, values: bool) -> torch.Tensor | None:
    """Check a ``hint (N,)`` int64 tensor on ``like``'s device (None passes).

    Shape, dtype and device are always checked (``ValueError``/``TypeError`` naming
    ``hint``); with ``values`` (an index that reads the hint, outside ``trusted()``) also that
    every entry is ``-1`` or a valid index into the ``M`` points (one synchronisation).
    """
    if hint is None:
        return None
    if not isinstance(hint, torch.Tensor):
        raise TypeError(f"hint: expected an int64 tensor, got {type(hint).__name__}")
    if hint.dtype != torch.int64:
        raise TypeError(f"hint: expected dtype int64, got {hint.dtype}")
    if hint.shape != (n,):
        raise ValueError(f"hint: expected shape ({n},), got {tuple(hint.shape)}")
    if hint.device != like.device:
        raise ValueError(f"hint: on {hint.device} but the index is on {like.device}")
    if values and not _validate.is_trusted() and n:
        m = like.shape[0]
        if not bool(((hint >= -1) & (hint < m)).all()):
            raise ValueError(f"hint: entries must be -1 or indices in [0, {m})")
    return hint


def array_layout(arrays: dict[str, torch.Tensor]) -> tuple:
    """Every array's name, shape, dtype and device: what a captured CUDA graph bakes in."""
    return tuple((k, tuple(v.shape), v.dtype, str(v.device)) for k, v in arrays.items())


def check_arrays(arrays: dict[str, torch.Tensor], mine: dict[str, torch.Tensor]) -> None:
    """Refuse ``arrays`` unless laid out as ``mine`` (an index's ``graph_arrays()``)."""
    got = {k: (tuple(v.shape), v.dtype, v.device) for k, v in arrays.items()
           if isinstance(v, torch.Tensor)}
    if got != {k: (tuple(v.shape), v.dtype, v.device) for k, v in mine.items()}:
        raise ValueError(f"arrays: expected the layout of graph_arrays() "
                         f"({sorted(mine)}, shapes as this index's), got {sorted(arrays)}")
