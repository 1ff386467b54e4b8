"""A pair in flight through register_many's stages (:class:`_Work`), its failure, its groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from pointalign.registration.many.pairs import PairSpec
from pointalign.registration.pipeline import Scales
from pointalign.registration.prepare import Prepared
from pointalign.registration.result import RegistrationResult


class _Ready(NamedTuple):
    """A pair after the global stage: its local clouds and their prepared, scaled copies."""

    src: torch.Tensor           # (N, 3) float32 local (the target's centroid at 0), metres
    tgt: torch.Tensor           # (M, 3)
    center: np.ndarray          # (3,) float64 the target's centroid (caller's frame)
    v: float                    # the voxel edge (metres); from here on lengths are in v
    scales: Scales              # Scales(1, …): the lengths in voxels
    source: Prepared            # downsampled, indexed (and described) in the scaled frame
    target: Prepared


@dataclass(eq=False)
class _Work:
    """A pair in flight: what the stages found so far.

    Compared and hashed by identity (``eq=False``): a generated ``__eq__`` would compare
    field by field, and a membership test over a chunk's pairs (``w in works``) would cost
    a comparison per earlier pair (quadratic in the chunk: 499,500 calls at 1,000 pairs).
    """

    index: int
    spec: PairSpec
    row: dict[str, Any]
    ready: _Ready | None = None
    glob: RegistrationResult | None = None   # RANSAC's result (scaled frame)
    cands: torch.Tensor | None = None        # (H, 4, 4) float64 global candidates
    refined: torch.Tensor | None = None      # (k, 4, 4) refined hypotheses, best first
    fit_v: torch.Tensor | None = None        # (k,) their overlap counts
    coarse_iterations: int = 0

    @property
    def r(self) -> _Ready:
        """The pair after the global stage."""
        assert self.ready is not None
        return self.ready

    @property
    def hypotheses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``refined (k, 4, 4)`` and ``fit_v (k,)``, once known."""
        assert self.refined is not None and self.fit_v is not None
        return self.refined, self.fit_v


def _fail(w: _Work, exc: Exception, on_error: str) -> None:
    if on_error == "raise":
        raise type(exc)(f"pairs[{w.index}] ({w.spec.name}): {exc}") from exc
    w.row.update(error=f"{type(exc).__name__}: {exc}", verdict="error")


def _by_scales(works: list[_Work]) -> dict[Scales, list[_Work]]:
    """Group pairs by their lengths in voxels (one bound per batched call), in order."""
    groups: dict[Scales, list[_Work]] = {}
    for w in works:
        groups.setdefault(w.r.scales, []).append(w)
    return groups
