"""Anderson acceleration of a registration fixed point, with an energy safeguard.

ICP is a fixed-point iteration ``x_{k+1} = G(x_k)`` on the pose: find correspondences at
``x_k``, solve for the pose that fits them best. Its convergence is linear and slow along
flat valleys of the energy (a bunny turning about its long axis). Anderson acceleration
(Walker and Ni, "Anderson acceleration for fixed-point iterations", SINUM 2011) takes the
combination of the last ``m`` images ``g_i = G(x_i)`` whose residuals ``f_i = g_i − x_i``
cancel best::

    γ = argmin_γ ‖f_k − ΔF γ‖²,    x_{k+1} = g_k − ΔG γ

with ``ΔF``, ``ΔG`` the differences of consecutive residuals and images (``m`` columns).
For ICP the pose is parametrised relative to the initial pose ``T₀`` as
``x = (ω, (t + R c − c) / s)`` of ``T T₀⁻¹ = (R, t)``: its rotation vector and the move of
the target's centroid ``c``, scaled by the target's extent ``s`` (both then of order one,
far from the rotation vector's wrap at π whatever the initial pose, and the same in
whatever frame the caller's coordinates put the problem; Pavlov et al., "AA-ICP", ICRA
2018; Zhang et al., "Fast and robust iterative closest point", PAMI 2021).

An accelerated point is not guaranteed to be better. The safeguard of Zhang et al.: the
next step evaluates the energy at the accelerated point (its correspondence search is
needed anyway); if the energy rose above the last accepted point's, the point is rejected,
the iteration continues from the plain image ``G`` of the last accepted point and the
history restarts. A rejection costs one step; a plain ICP step is never rejected, so the
energy of the accepted points never rises where plain ICP's would not.

The energy is the truncated quadratic ``Σ_i min(d_i², τ²)`` over the valid source points
(``τ`` the correspondence distance): a point without a correspondence counts ``τ²``, so
energies at different correspondence sets compare.

Everything runs on the device in float64, with no host decision inside the step, so an
accelerated step is as graph-safe as the step it wraps; on a GPU the update is one kernel
(:mod:`pointalign.kernels.anderson`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from pointalign.kernels import _loop, upload
from pointalign.kernels.anderson import anderson_update

#: default history length (Zhang et al. use 5-6; 5 is a little more stable here)
DEFAULT_HISTORY = 5


@dataclass(frozen=True)
class AndersonStep:
    """An ICP-like step ``(inputs, state) → (state, record)`` with Anderson acceleration.

    Wraps ``inner``, whose state holds ``T (B, 4, 4)`` float64 and ``Tf`` (its float32
    copy), and whose record holds ``sums (B, 30)`` at T, the plain ``update`` D and the
    plain next pose ``T = D T``. Adds to the state the history and the safeguard's memory
    (:meth:`prepare`), and to the record ``accepted (B,)``: False when the pose this
    step evaluated was an accelerated point whose energy rose (the rules then discard that
    pose and the record's ``update`` is the plain update of the last accepted pose).
    """

    graph_safe: ClassVar[bool] = True
    inner: Any
    tau2: float
    history: int = DEFAULT_HISTORY

    def prepare(self, inputs: _loop.Tensors, state: _loop.Tensors, n_valid: torch.Tensor,
                scale: torch.Tensor, pivot: torch.Tensor
                ) -> tuple[_loop.Tensors, _loop.Tensors]:
        """Return the inner step's inputs and state with what acceleration adds.

        Inputs gain the constants ``origin`` (the initial pose), ``n_valid (B,)`` (valid
        source points, for the energy), ``scale (B,)`` (the extent the translation is
        divided by) and ``pivot (B, 3)`` (the target's centroid, which the translation is
        seen from); the state gains the history and the safeguard's memory.
        """
        T = state["T"]
        B, dev = T.shape[0], T.device
        k = self.history + 1
        eye = torch.eye(4, dtype=torch.float64, device=dev).repeat(B, 1, 1)
        inputs = dict(inputs, origin=T.clone(),
                      n_valid=n_valid.to(device=dev, dtype=torch.float64),
                      scale=scale.to(device=dev, dtype=torch.float64),
                      pivot=pivot.to(device=dev, dtype=torch.float64))
        state = dict(state,
                     x_hist=torch.zeros(B, k, 6, dtype=torch.float64, device=dev),
                     g_hist=torch.zeros(B, k, 6, dtype=torch.float64, device=dev),
                     count=torch.zeros(B, dtype=torch.int64, device=dev),
                     energy=torch.full((B,), torch.inf, dtype=torch.float64, device=dev),
                     accelerated=torch.zeros(B, dtype=torch.bool, device=dev),
                     fallback=T.clone(), fallback_update=eye)
        return inputs, state

    def __call__(self, inputs: _loop.Tensors, state: _loop.Tensors):
        """Take one plain step at ``state["T"]``, then the safeguard and the accelerated pose.

        The update is :func:`pointalign.kernels.anderson.anderson_update` (one launch on a GPU).
        """
        inner_state = {k: state[k] for k in ("T", "Tf", "hint") if k in state}
        new, rec = self.inner(inputs, inner_state)
        consts = {k: inputs[k] for k in ("origin", "n_valid", "scale", "pivot")}
        updated, accel = anderson_update(state, rec, consts, self.tau2)
        out = dict(new)
        out.update(updated)
        if "hint" in state and "hint" not in new:
            out["hint"] = state["hint"]
        return out, dict(rec, **accel)


def accelerated(step: Any, inputs: _loop.Tensors, state: _loop.Tensors, pair: Any,
                tau: float) -> tuple[AndersonStep, _loop.Tensors, _loop.Tensors]:
    """Wrap ``step`` for the problems of ``pair`` (a prepared :class:`~._edge.Pair`).

    ``tau`` is the correspondence bound of the truncated energy. Returns the accelerated
    step with its inputs and state (:meth:`AndersonStep.prepare`).
    """
    acc = AndersonStep(step, tau * tau)
    inputs, state = acc.prepare(inputs, state, *(  # pinned: no wait for the device
        upload(np.asarray(a, np.float64), dtype=torch.float64, device=state["T"].device)
        for a in (pair.source_counts, pair.extent, pair.centroid)))
    return acc, inputs, state


def max_steps(step: Any, iterations: int) -> int:
    """Return the most steps ``iterations`` counted iterations may take.

    A rejected point is a step but no iteration, and follows an accepted one, so an
    accelerated run takes at most ``2 · iterations + 1`` steps.
    """
    return (2 * iterations if isinstance(step, AndersonStep) else iterations) + 1
