"""The Anderson update on the CPU backend: the spec's steps in float64 NumPy.

A step updates a handful of poses; the spec's ~400 PyTorch operations cost ~2.4 ms a step
on the CPU in overhead alone (measured: it made the accelerated ICP of a 5k-point pair
slower than plain), NumPy's ~0.25 ms. Same formulas (:mod:`pointalign.kernels._np_math`
for so(3)), the same LU solve of the Gram system; equal to the spec up to rounding.
"""

from __future__ import annotations

import numpy as np
import torch

from pointalign.kernels import _np_math
from pointalign.kernels.anderson.reference import RIDGE


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _to_vector(T: np.ndarray, origin: np.ndarray, scale: np.ndarray, pivot: np.ndarray
               ) -> np.ndarray:
    R = T[:, :3, :3] @ origin[:, :3, :3].transpose(0, 2, 1)
    t = T[:, :3, 3] - (R @ origin[:, :3, 3:])[..., 0] + (R @ pivot[..., None])[..., 0] - pivot
    return np.concatenate([_np_math.so3_log(R), t / scale[:, None]], -1)


def _from_vector(x: np.ndarray, origin: np.ndarray, scale: np.ndarray, pivot: np.ndarray
                 ) -> np.ndarray:
    D = np.tile(np.eye(4), (x.shape[0], 1, 1))
    D[:, :3, :3] = _np_math.so3_exp(x[:, :3])
    D[:, :3, 3] = x[:, 3:] * scale[:, None] - (D[:, :3, :3] @ pivot[..., None])[..., 0] + pivot
    return D @ origin


def _combination(x_hist: np.ndarray, g_hist: np.ndarray, count: np.ndarray) -> np.ndarray:
    f = g_hist - x_hist
    dF, dG = f[:, 1:] - f[:, :-1], g_hist[:, 1:] - g_hist[:, :-1]
    m = dF.shape[1]
    used = np.arange(m) >= (m + 1 - count)[:, None]
    dF, dG = dF * used[..., None], dG * used[..., None]
    A = dF @ dF.transpose(0, 2, 1)
    rhs = (dF @ f[:, -1:].transpose(0, 2, 1))[..., 0]
    ridge = RIDGE * np.maximum(np.diagonal(A, axis1=1, axis2=2).max(-1), 1e-300)
    A = A + (ridge[:, None, None] + (~used)[:, None, :]) * np.eye(m)
    gamma = np.zeros_like(rhs)
    for b in range(A.shape[0]):  # a singular system: γ = 0 (the plain image), as the spec
        try:
            gamma[b] = np.linalg.solve(A[b], rhs[b])
        except np.linalg.LinAlgError:
            pass
    return g_hist[:, -1] - (dG * gamma[..., None]).sum(1)


def anderson_update_host(state: dict[str, torch.Tensor], record: dict[str, torch.Tensor],
                         consts: dict[str, torch.Tensor], tau2: float
                         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run the update (contract of :func:`pointalign.kernels.anderson.anderson_update`)."""
    T, P, D = (_np(t).astype(np.float64) for t in (state["T"], record["T"], record["update"]))
    origin, scale, pivot, n = (_np(consts[k]).astype(np.float64)
                               for k in ("origin", "scale", "pivot", "n_valid"))
    xh, gh, fb, fbu = (_np(state[k]) for k in ("x_hist", "g_hist", "fallback",
                                                "fallback_update"))
    sums = _np(record["sums"]).astype(np.float64)
    K = xh.shape[1]
    energy = sums[:, 29] + (n - sums[:, 28]) * tau2
    reject = _np(state["accelerated"]) & (energy > _np(state["energy"]))
    keep = ~reject
    x, g = np.split(_to_vector(np.concatenate([T, P]), np.concatenate([origin, origin]),
                               np.concatenate([scale, scale]), np.concatenate([pivot, pivot])),
                    2)  # both in one pass
    x_hist = np.concatenate([xh[:, 1:], x[:, None]], 1)
    g_hist = np.concatenate([gh[:, 1:], g[:, None]], 1)
    count = np.where(keep, np.minimum(_np(state["count"]) + 1, K), 0)
    with np.errstate(all="ignore"):
        accel = _combination(x_hist, g_hist, np.maximum(count, 1))
        go = keep & (_np(record["flags"])[:, 1] > 0) & (count >= 2) \
            & np.isfinite(accel).all(-1)
        T_acc = _from_vector(np.where(go[:, None], accel, 0.0), origin, scale, pivot)
    T_next = np.where(reject[:, None, None], fb, np.where(go[:, None, None], T_acc, P))
    k3 = keep[:, None, None]
    out = {"T": T_next, "Tf": T_next.astype(np.float32),
           "x_hist": np.where(k3, x_hist, xh), "g_hist": np.where(k3, g_hist, gh),
           "count": count.astype(np.int64), "energy": np.where(keep, energy, _np(state["energy"])),
           "accelerated": go, "fallback": np.where(k3, P, fb),
           "fallback_update": np.where(k3, D, fbu)}
    dev = state["T"].device
    as_t = {k: torch.from_numpy(np.ascontiguousarray(v)).to(dev) for k, v in out.items()}
    return as_t, {"T": as_t["T"], "update": torch.from_numpy(np.where(reject[:, None, None],
                                                                      fbu, D)).to(dev),
                  "accepted": torch.from_numpy(keep).to(dev)}
