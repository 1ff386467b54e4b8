"""The Anderson update of an ICP-like fixed point: safeguard, history, accelerated pose.

Contract (the PyTorch spec is :func:`.reference.anderson_update_reference`; on Triton one
program per problem does the whole update in float64, ``triton.py``; on the "cpu" backend
the spec's steps run in NumPy, ``cpu.py``; :func:`pointalign.kernels.backend` picks).
``anderson_update(state, record, consts, tau2)`` for B problems, every pose float64
``(B, 4, 4)``:

* ``state``: ``T`` the pose this step evaluated; ``x_hist``, ``g_hist`` ``(B, m + 1, 6)``
  float64 the last points and their images, newest last; ``count (B,)`` int64 their filled
  slots; ``energy (B,)`` float64 the last accepted pose's; ``accelerated (B,)`` bool whether
  ``T`` is an accelerated point; ``fallback`` the plain image of the last accepted pose and
  ``fallback_update`` its update.
* ``record`` (the plain step at ``T``): ``sums (B, 30)`` (:mod:`.normal_eq`'s layout:
  ``[28]`` correspondences, ``[29]`` their squared distances), ``update`` D, ``T`` the
  plain image ``D T``, ``flags (B, 2)`` int32 (``[1]``: the update is usable).
* ``consts``: ``origin`` the initial pose, ``n_valid (B,)`` and ``scale (B,)`` float64,
  ``pivot (B, 3)`` float64 the point the translation is seen from (the target's centroid).
* ``tau2``: the squared correspondence bound of the truncated energy.

Returns ``(state', record')``: ``state'`` has ``state``'s keys (and ``Tf``, the next pose
as float32); ``record'`` holds the next pose ``T``, the ``update`` the stopping rules read
and ``accepted (B,)`` bool. The method is :mod:`pointalign.registration.anderson`'s: the
pose vector ``x = (ω, (t + R c − c) / scale)`` of ``T origin⁻¹ = (R, t)`` (``c`` the
pivot), the ridge-regularised combination of the filled history
(:data:`.reference.RIDGE`), the energy safeguard.

The kernel solves the small Gram system by Cholesky where the spec uses LU: for the
ridge-regularised positive definite systems the two agree to ~κ u.
"""

from __future__ import annotations

import torch

from pointalign.kernels._backend import backend
from pointalign.kernels.anderson.reference import (
    RIDGE,
    anderson_point,
    anderson_update_reference,
    from_vector,
    to_vector,
    truncated_energy,
)

__all__ = ["RIDGE", "anderson_point", "anderson_update", "from_vector", "to_vector",
           "truncated_energy"]

#: the most history slots (m + 1) the Triton kernel holds (an 8-row block)
MAX_SLOTS = 8


def anderson_update(state: dict[str, torch.Tensor], record: dict[str, torch.Tensor],
                    consts: dict[str, torch.Tensor], tau2: float
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One Anderson update (entry point; module contract)."""
    be = backend(state["T"])
    if be in ("triton", "interpret") and state["x_hist"].shape[1] <= MAX_SLOTS:
        from pointalign.kernels.anderson import triton as _triton

        return _triton.anderson_update(state, record, consts, tau2)
    if be == "cpu":
        from pointalign.kernels.anderson import cpu as _cpu

        return _cpu.anderson_update_host(state, record, consts, tau2)
    return anderson_update_reference(state, record, consts, tau2)
