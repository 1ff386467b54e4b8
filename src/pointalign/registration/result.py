"""RegistrationResult: the only result type of every registration algorithm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class RegistrationResult:
    """Outcome of a registration.

    Attributes:
        transformation: ``(4, 4)`` float64 NumPy array ``T_target_source`` mapping source
            points into the target frame (``x_t = R x_s + t``); ``(B, 4, 4)`` for a batch.
        fitness: fraction of source points with a correspondence within the maximum
            distance (Open3D's meaning); ``(B,)`` array for a batch.
        rmse: RMS distance over those inlier correspondences (metres); ``(B,)`` for a batch.
        iterations: iterations run (``(B,)`` for a batch).
        converged: whether a convergence criterion (not the iteration cap) stopped it.
        stop_reason: which criterion stopped it ("relative_rmse", "max_iterations", …).
        history: per-iteration records (dicts of floats), oldest first.
        timings: seconds per stage, e.g. ``{"index": …, "iterate": …, "total": …}``.
        info: algorithm-specific extras (e.g. the final 6x6 information matrix ``H``,
            RANSAC stage counts). Values may be tensors.
        transformation_tensor: the same transformation as a float64 tensor on the
            compute device, for users who stay in PyTorch.
    """

    transformation: np.ndarray
    fitness: Any = 0.0
    rmse: Any = float("inf")
    iterations: Any = 0
    converged: Any = False
    stop_reason: Any = ""
    history: list[dict[str, float]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    transformation_tensor: torch.Tensor | None = None

    @property
    def batched(self) -> bool:
        """True when this result holds B transformations."""
        return self.transformation.ndim == 3

    def __len__(self) -> int:
        return self.transformation.shape[0] if self.batched else 1

    def __getitem__(self, b: int) -> RegistrationResult:
        """The b-th result of a batched run, as an unbatched result."""
        if not self.batched:
            raise TypeError("this RegistrationResult is not batched")

        def pick(v: Any) -> Any:
            if isinstance(v, (np.ndarray, torch.Tensor)) and v.ndim >= 1 and len(v) == len(self):
                x = v[b]
                return x.item() if x.ndim == 0 else x
            if isinstance(v, list) and len(v) == len(self):
                return v[b]
            return v

        return RegistrationResult(
            transformation=self.transformation[b],
            fitness=pick(self.fitness),
            rmse=pick(self.rmse),
            iterations=pick(self.iterations),
            converged=pick(self.converged),
            stop_reason=pick(self.stop_reason),
            history=[{k: (pick(v) if isinstance(v, (np.ndarray, list)) else v)
                      for k, v in h.items()} for h in self.history],
            timings=dict(self.timings),
            info={k: pick(v) for k, v in self.info.items()},
            transformation_tensor=None if self.transformation_tensor is None
            else self.transformation_tensor[b],
        )

    def summary(self) -> str:
        """One line for logs and the CLI."""
        if self.batched:
            return f"RegistrationResult(batch of {len(self)})"
        total = self.timings.get("total")
        tt = f", {total * 1e3:.1f} ms" if total is not None else ""
        return (
            f"fitness {float(self.fitness):.4f}, rmse {float(self.rmse):.6g}, "
            f"{int(self.iterations)} iterations, converged={bool(self.converged)}"
            f" ({self.stop_reason}){tt}"
        )
