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
``x = (ω, t / s)`` of ``T T₀⁻¹``: its rotation vector and its translation scaled by the
target's extent ``s`` (both then of order one, and far from the rotation vector's wrap at
π whatever the initial pose; Pavlov et al., "AA-ICP", ICRA 2018; Zhang et al., "Fast and
robust iterative closest point", PAMI 2021).

An accelerated point is not guaranteed to be better. The safeguard of Zhang et al.: the
next step evaluates the energy at the accelerated point (its correspondence search is
needed anyway); if the energy rose above the last accepted point's, the point is rejected,
the iteration continues from the plain image ``G`` of the last accepted point and the
history restarts. A rejection costs one step; a plain ICP step is never rejected, so the
energy of the accepted points never rises where plain ICP's would not.

The energy is the truncated quadratic ``Σ_i min(d_i², τ²)`` over the valid source points
(``τ`` the correspondence distance): a point without a correspondence counts ``τ²``, so
energies at different correspondence sets compare.

Everything runs on the device in float64 tensor operations, with no host decision inside
the step, so an accelerated step is as graph-safe as the step it wraps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pointalign import _math
from pointalign.kernels import _loop

#: default history length (Zhang et al. use 5-6; 5 is a little more stable here)
DEFAULT_HISTORY = 5

#: Tikhonov term of the small least-squares problem, relative to its largest diagonal entry
_RIDGE = 1e-10


def to_vector(T: torch.Tensor, origin: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Map a pose ``T (B, 4, 4)`` to ``x (B, 6)``, relative to ``origin (B, 4, 4)``.

    ``x`` is the rotation vector and the translation divided by ``scale (B,)`` of
    ``T origin⁻¹``.
    """
    R = T[:, :3, :3] @ origin[:, :3, :3].transpose(1, 2)
    t = T[:, :3, 3] - (R @ origin[:, :3, 3:])[..., 0]
    return torch.cat([_math.so3_log(R), t / scale[:, None]], -1)


def from_vector(x: torch.Tensor, origin: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Map ``x (B, 6)`` back to a pose ``T (B, 4, 4)``: the inverse of :func:`to_vector`."""
    D = torch.eye(4, dtype=x.dtype, device=x.device).repeat(x.shape[0], 1, 1)
    D[:, :3, :3] = _math.so3_exp(x[:, :3])
    D[:, :3, 3] = x[:, 3:] * scale[:, None]
    return D @ origin


def anderson_point(x_hist: torch.Tensor, g_hist: torch.Tensor, count: torch.Tensor
                   ) -> torch.Tensor:
    """Return the Anderson combination of the history, ``(B, 6)``.

    Args:
        x_hist: ``(B, m + 1, 6)`` the last points, newest last (older slots may be unused).
        g_hist: ``(B, m + 1, 6)`` their images ``G(x)``.
        count: ``(B,)`` int64, how many of the newest slots are filled (1 ≤ count ≤ m + 1).

    Returns:
        ``g_k − ΔG γ`` with ``γ`` the ridge-regularised least-squares coefficients over the
        filled columns; with one filled slot, the plain image ``g_k``.

    """
    f = g_hist - x_hist
    dF = f[:, 1:] - f[:, :-1]                              # (B, m, 6), newest last
    dG = g_hist[:, 1:] - g_hist[:, :-1]
    m = dF.shape[1]
    used = (torch.arange(m, device=count.device) >= (m + 1 - count)[:, None])  # (B, m)
    dF = dF * used[..., None]
    dG = dG * used[..., None]
    A = dF @ dF.transpose(1, 2)                            # (B, m, m) Gram matrix
    rhs = (dF @ f[:, -1:].transpose(1, 2))[..., 0]        # (B, m)
    ridge = _RIDGE * A.diagonal(dim1=1, dim2=2).amax(-1).clamp_min(1e-300)
    eye = torch.eye(m, dtype=A.dtype, device=A.device)
    A = A + (ridge[:, None, None] + (~used)[:, None, :].to(A.dtype)) * eye  # unused: γ = 0
    gamma, info = torch.linalg.solve_ex(A, rhs[..., None])
    gamma = torch.where((info == 0)[:, None, None], gamma, torch.zeros_like(gamma))[..., 0]
    return g_hist[:, -1] - (dG * gamma[..., None]).sum(1)


def truncated_energy(sums: torch.Tensor, n: torch.Tensor, tau2: float) -> torch.Tensor:
    """``Σ min(d², τ²)`` per problem from the fused sums ``(B, 30)`` and source counts ``n (B,)``.

    ``sums[:, 28]`` is the number of correspondences and ``sums[:, 29]`` the sum of their
    squared distances (:mod:`pointalign.kernels.normal_eq`'s layout).
    """
    return sums[:, 29].to(torch.float64) + (n - sums[:, 28].to(torch.float64)) * tau2


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
                scale: torch.Tensor) -> tuple[_loop.Tensors, _loop.Tensors]:
        """Return the inner step's inputs and state with what acceleration adds.

        Inputs gain the constants ``origin`` (the initial pose), ``n_valid (B,)`` (valid
        source points, for the energy) and ``scale (B,)`` (the extent the translation is
        divided by); the state gains the history and the safeguard's memory.
        """
        T = state["T"]
        B, dev = T.shape[0], T.device
        k = self.history + 1
        eye = torch.eye(4, dtype=torch.float64, device=dev).repeat(B, 1, 1)
        inputs = dict(inputs, origin=T.clone(),
                      n_valid=n_valid.to(device=dev, dtype=torch.float64),
                      scale=scale.to(device=dev, dtype=torch.float64))
        state = dict(state,
                     x_hist=torch.zeros(B, k, 6, dtype=torch.float64, device=dev),
                     g_hist=torch.zeros(B, k, 6, dtype=torch.float64, device=dev),
                     count=torch.zeros(B, dtype=torch.int64, device=dev),
                     energy=torch.full((B,), torch.inf, dtype=torch.float64, device=dev),
                     accelerated=torch.zeros(B, dtype=torch.bool, device=dev),
                     fallback=T.clone(), fallback_update=eye)
        return inputs, state

    def __call__(self, inputs: _loop.Tensors, state: _loop.Tensors):
        """One plain step at ``state["T"]``, then the safeguard and the accelerated next pose."""
        inner_state = {k: state[k] for k in ("T", "Tf", "hint") if k in state}
        new, rec = self.inner(inputs, inner_state)
        T, T_plain, scale, origin = state["T"], rec["T"], inputs["scale"], inputs["origin"]
        energy = truncated_energy(rec["sums"], inputs["n_valid"], self.tau2)
        reject = state["accelerated"] & (energy > state["energy"])
        keep = ~reject

        # the history gains (x, G(x)) of an accepted pose; a rejection restarts it
        x, g = to_vector(T, origin, scale), to_vector(T_plain, origin, scale)
        x_hist = torch.cat([state["x_hist"][:, 1:], x[:, None]], 1)
        g_hist = torch.cat([state["g_hist"][:, 1:], g[:, None]], 1)
        count = torch.where(keep, (state["count"] + 1).clamp_max(self.history + 1),
                            torch.zeros_like(state["count"]))
        accel = anderson_point(x_hist, g_hist, count.clamp_min(1))
        usable = rec["flags"][:, 1] > 0
        go = keep & usable & (count >= 2) & torch.isfinite(accel).all(-1)
        T_next = torch.where(go[:, None, None], from_vector(accel, origin, scale), T_plain)
        T_next = torch.where(reject[:, None, None], state["fallback"], T_next)
        update = torch.where(reject[:, None, None], state["fallback_update"], rec["update"])

        out = dict(new)
        out.update(T=T_next, Tf=T_next.to(torch.float32),
                   x_hist=torch.where(keep[:, None, None], x_hist, state["x_hist"]),
                   g_hist=torch.where(keep[:, None, None], g_hist, state["g_hist"]),
                   count=count,
                   energy=torch.where(keep, energy, state["energy"]),
                   accelerated=go,
                   fallback=torch.where(keep[:, None, None], T_plain, state["fallback"]),
                   fallback_update=torch.where(keep[:, None, None], rec["update"],
                                               state["fallback_update"]))
        if "hint" in state and "hint" not in new:
            out["hint"] = state["hint"]
        record = dict(rec, T=T_next, update=update, accepted=keep)
        return out, record
