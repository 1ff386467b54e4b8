"""The pairs of register_many: :class:`PairSpec` and the forms ``pairs`` may take."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pointalign import _validate

PathLike = (str, os.PathLike)


@dataclass(frozen=True)
class PairSpec:
    """One registration problem of :func:`register_many`.

    Attributes:
        source: ``(N, 3)`` cloud (array, tensor or PointCloud) or a file path.
        target: ``(M, 3)`` cloud or a file path.
        name: a label for the table (default: the index, or ``source->target`` of paths).
        init: ``(4, 4)`` initial ``T_target_source``; given, the global stage is skipped.

    """

    source: Any
    target: Any
    name: str = ""
    init: np.ndarray | None = None


def _specs(pairs: Iterable[Any]) -> list[PairSpec]:
    """Normalise ``pairs`` to :class:`PairSpec` (names default to paths or the index)."""
    if isinstance(pairs, (str, os.PathLike)) or not isinstance(pairs, Iterable):
        raise TypeError("pairs: expected a sequence of (source, target) pairs, PairSpec or "
                        f"dicts, got {type(pairs).__name__}")
    out = []
    for i, p in enumerate(pairs):
        if isinstance(p, PairSpec):
            spec = p
        elif isinstance(p, dict):
            if "source" not in p or "target" not in p:
                raise ValueError(f"pairs[{i}]: a dict needs 'source' and 'target'")
            spec = PairSpec(p["source"], p["target"], str(p.get("name") or ""), p.get("init"))
        elif hasattr(p, "source") and hasattr(p, "target"):  # e.g. datasets.Pair
            spec = PairSpec(p.source, p.target, str(getattr(p, "name", "") or ""))
        elif isinstance(p, (tuple, list)) and len(p) in (2, 3):
            spec = PairSpec(p[0], p[1], "", p[2] if len(p) == 3 else None)
        else:
            raise TypeError(f"pairs[{i}]: expected (source, target), (source, target, init), "
                            f"a dict or a PairSpec, got {type(p).__name__}")
        init = None if spec.init is None else _validate.as_transform(
            spec.init, f"pairs[{i}].init", device="cpu", dtype=torch.float64).numpy()
        name = spec.name or (f"{Path(spec.source).name}->{Path(spec.target).name}"
                             if isinstance(spec.source, PathLike)
                             and isinstance(spec.target, PathLike) else str(i))
        out.append(PairSpec(spec.source, spec.target, name, init))
    return out
