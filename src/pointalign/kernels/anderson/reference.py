"""PyTorch spec of the Anderson update (:func:`pointalign.kernels.anderson.anderson_update`).

The pose vector, the combination of the history and the safeguard, in float64 tensor
operations (about 400 small kernels a step on a GPU: the Triton kernel fuses them).
"""

from __future__ import annotations

import torch

from pointalign import _math

#: Tikhonov term of the small least-squares problem, relative to its largest diagonal entry
RIDGE = 1e-10

Tensors = dict[str, torch.Tensor]


def to_vector(T: torch.Tensor, origin: torch.Tensor, scale: torch.Tensor,
              pivot: torch.Tensor) -> torch.Tensor:
    """Map a pose ``T (B, 4, 4)`` to ``x (B, 6)``, relative to ``origin (B, 4, 4)``.

    ``x`` is the rotation vector of ``T origin⁻¹`` and its translation as seen from
    ``pivot (B, 3)`` (``t + R c − c``: the move of the pivot), divided by ``scale (B,)``.
    About the target's centroid the vector, and so the combination, is the same in any
    frame the caller's coordinates put the problem in.
    """
    R = T[:, :3, :3] @ origin[:, :3, :3].transpose(1, 2)
    t = T[:, :3, 3] - (R @ origin[:, :3, 3:])[..., 0]
    t = t + (R @ pivot[..., None])[..., 0] - pivot
    return torch.cat([_math.so3_log(R), t / scale[:, None]], -1)


def from_vector(x: torch.Tensor, origin: torch.Tensor, scale: torch.Tensor,
                pivot: torch.Tensor) -> torch.Tensor:
    """Map ``x (B, 6)`` back to a pose ``T (B, 4, 4)``: the inverse of :func:`to_vector`."""
    D = torch.eye(4, dtype=x.dtype, device=x.device).repeat(x.shape[0], 1, 1)
    D[:, :3, :3] = _math.so3_exp(x[:, :3])
    D[:, :3, 3] = x[:, 3:] * scale[:, None] - (D[:, :3, :3] @ pivot[..., None])[..., 0] + pivot
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
        filled columns (``γ = 0`` where that system is singular); with one filled slot, the
        plain image ``g_k``.

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
    ridge = RIDGE * A.diagonal(dim1=1, dim2=2).amax(-1).clamp_min(1e-300)
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


def anderson_update_reference(state: Tensors, record: Tensors, consts: Tensors, tau2: float
                              ) -> tuple[Tensors, Tensors]:
    """Apply the safeguard, shift the history, combine (contract of ``anderson_update``)."""
    T, T_plain = state["T"], record["T"]
    origin, scale, pivot = consts["origin"], consts["scale"], consts["pivot"]
    k = state["x_hist"].shape[1]
    energy = truncated_energy(record["sums"], consts["n_valid"], tau2)
    reject = state["accelerated"] & (energy > state["energy"])
    keep = ~reject

    # the history gains (x, G(x)) of an accepted pose; a rejection restarts it
    x, g = to_vector(T, origin, scale, pivot), to_vector(T_plain, origin, scale, pivot)
    x_hist = torch.cat([state["x_hist"][:, 1:], x[:, None]], 1)
    g_hist = torch.cat([state["g_hist"][:, 1:], g[:, None]], 1)
    count = torch.where(keep, (state["count"] + 1).clamp_max(k),
                        torch.zeros_like(state["count"]))
    accel = anderson_point(x_hist, g_hist, count.clamp_min(1))
    usable = record["flags"][:, 1] > 0
    go = keep & usable & (count >= 2) & torch.isfinite(accel).all(-1)
    T_next = torch.where(go[:, None, None], from_vector(accel, origin, scale, pivot), T_plain)
    T_next = torch.where(reject[:, None, None], state["fallback"], T_next)
    update = torch.where(reject[:, None, None], state["fallback_update"], record["update"])
    out = {"T": T_next, "Tf": T_next.to(torch.float32),
           "x_hist": torch.where(keep[:, None, None], x_hist, state["x_hist"]),
           "g_hist": torch.where(keep[:, None, None], g_hist, state["g_hist"]),
           "count": count,
           "energy": torch.where(keep, energy, state["energy"]),
           "accelerated": go,
           "fallback": torch.where(keep[:, None, None], T_plain, state["fallback"]),
           "fallback_update": torch.where(keep[:, None, None], record["update"],
                                          state["fallback_update"])}
    return out, {"T": T_next, "update": update, "accepted": keep}
