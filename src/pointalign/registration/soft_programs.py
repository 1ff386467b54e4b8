"""The annealing programs of EM-ICP and Softassign (Tamaki et al.): what one schedule step does.

:class:`EmicpProgram` and :class:`SoftassignProgram` are fixed-length programs for the
executor (:func:`pointalign.kernels._loop.run_program`): each step runs the soft passes of
:mod:`pointalign.kernels.soft` and the weighted Horn update; :class:`Annealing` holds what
both share (the schedule, the settling test, the fitness at the end). The public functions
:func:`~pointalign.registration.soft.emicp` and
:func:`~pointalign.registration.soft.softassign` validate, build a program and run it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pointalign import estimate
from pointalign.kernels import _loop
from pointalign.kernels import soft as ksoft
from pointalign.kernels import stability as kstab
from pointalign.registration._edge import recentre


def rho(y: ksoft.Centred) -> torch.Tensor:
    """``(B,)`` RMS radius of a centred cloud (clamped away from 0)."""
    tr = torch.diagonal(y.scatter, dim1=-2, dim2=-1).sum(-1)
    return (tr / y.lengths.to(torch.float64).clamp_min(1)).sqrt().clamp_min(1e-12)


def _fitness(x: ksoft.Centred, y: ksoft.Centred, T: torch.Tensor, inlier: torch.Tensor,
             passes: ksoft.Passes):
    """Fitness and RMSE ``(B,)`` of hard nearest neighbours within ``inlier (B,)``."""
    rows = torch.arange(x.points.shape[1], device=T.device)[None, :] < x.lengths[:, None]
    d2 = passes.nearest_d2(x.points, y.points, T, inlier.square(), x.lengths, y.lengths)
    inl = rows & (d2 <= inlier.square()[:, None])
    n_in = inl.sum(1)
    rmse = (torch.where(inl, d2, 0).sum(1) / n_in.clamp_min(1)).sqrt()
    return n_in.double() / x.lengths.double(), torch.where(n_in > 0, rmse, math.inf)


class _Settling:
    """Per-problem settling on the device, for B problems at once.

    Every ``check_every`` iterations (before the last) a problem whose update is below both
    tolerances (translation at the source centroid) and whose soft weights changed by less
    than ``relative_weights`` (relative L1) is done: it keeps its pose and iteration count.
    """

    def __init__(self, prog: Annealing, T: torch.Tensor, flat: torch.Tensor):
        self.prog, self.T, self.flat, self.done = prog, T, flat, flat.clone()
        self.iters = torch.zeros(flat.shape, dtype=torch.int64, device=T.device)
        self.w: torch.Tensor | None = None
        self.history: list[dict[str, torch.Tensor]] = []

    def step(self, it: int, T: torch.Tensor, w: torch.Tensor, checkpoint: Any,
             **record: torch.Tensor) -> bool:
        """Take iteration ``it``'s (1-based) pose and weights; True: all done, stop early."""
        p, T_old, w_old = self.prog, self.T, torch.zeros_like(w) if self.w is None else self.w
        self.T, self.w = T, w
        if p.progress is not None:
            p.progress.advance()
        if it % p.check_every or it >= p.n_iter:
            return False
        dR = (T[:, :3, :3] - T_old[:, :3, :3]).square().sum((-1, -2)).sqrt() / math.sqrt(2)
        dt = (T[:, :3, 3] - T_old[:, :3, 3]).norm(dim=-1)
        dw = (w - w_old).abs().sum(-1).double() / w.sum(-1).double().clamp_min(1e-300)
        self.iters = torch.where(self.done, self.iters, it)
        self.done = self.done | ((dR < p.rotation_tolerance) & (dt < p.translation_tolerance)
                                 & (dw < p.relative_weights))
        self.history.append(dict(record, rotation_update=dR, translation_update=dt,
                                 weight_change=dw))
        return checkpoint(self.done)

    def finish(self, it: int) -> torch.Tensor:
        """Count ``it`` iterations for the problems still running; ``(B,)`` iterations."""
        self.iters = torch.where(self.done, self.iters, it)
        return self.iters


@dataclass(frozen=True)
class Annealing:
    """What both annealing programs share: the iteration count and the settling test.

    Inputs: ``source (B, N, 3)``, ``target (B, M, 3)``, lengths, ``init (B, 4, 4)`` float64,
    the caller's per-problem parameters. Outputs: ``T``, ``history.<key> (checks, B)``,
    ``(B,)`` fitness, rmse, iterations, done, flat, info; with ``probe_k``, the stability
    probe's ``stability_sums (B, 23)`` (:func:`pointalign.kernels.stability.probe_information`
    of the final poses, about the target's centroid, within the largest inlier distance).
    """

    SOURCE_LAYOUT: ClassVar[bool]  # set by each subclass
    n_iter: int
    check_every: int
    rotation_tolerance: float
    translation_tolerance: float
    relative_weights: float
    #: the run's passes (``kernels.soft.prepare``): the form, the trees and cells it owns
    passes: Any = dataclasses.field(default=None, kw_only=True)
    #: a progress bar (``_progress.task``) advanced per iteration on the host; None: none
    progress: Any = dataclasses.field(default=None, kw_only=True)
    #: k of the final pose's stability probe measured inside the program (0: none; inputs
    #: ``probe_rows``, ``probe_valid``: :func:`pointalign.registration.stability.device_probe`)
    probe_k: int = dataclasses.field(default=0, kw_only=True)

    def _start(self, inputs: _loop.Tensors):
        """Centre both clouds; ρ; the settling state (done: source or target on a line)."""
        x = ksoft.centre(inputs["source"], inputs["source_lengths"], layout=self.SOURCE_LAYOUT)
        y = ksoft.centre(inputs["target"], inputs["target_lengths"])
        flat = ~(estimate._spans_plane(x.scatter) & estimate._spans_plane(y.scatter))
        track = _Settling(self, recentre(inputs["init"], x.center, y.center), flat)
        return x, y, rho(y), track

    def _finish(self, inputs: _loop.Tensors, x: ksoft.Centred, y: ksoft.Centred,
                track: _Settling, inlier: torch.Tensor, **info: torch.Tensor) -> _loop.Tensors:
        """Collect the outputs: the pose in the input frames (``init`` if degenerate) etc."""
        T = recentre(track.T, -x.center, -y.center)
        fitness, rmse = _fitness(x, y, track.T, inlier, self.passes)
        out = {"T": torch.where(track.flat[:, None, None], inputs["init"], T),
               "fitness": fitness, "rmse": rmse, "iterations": track.iters,
               "done": track.done, "flat": track.flat, "inlier_distance": inlier, **info}
        for key in track.history[0] if track.history else ():
            out["history." + key] = torch.stack([h[key] for h in track.history])
        if self.probe_k:  # the final poses' stability sample, within the batch's widest bound
            out["stability_sums"] = kstab.probe_information(
                inputs["source"], inputs["probe_rows"], inputs["probe_valid"],
                out["T"].to(torch.float32), inputs["target"], inputs["target_lengths"],
                y.center, inlier.max().square(), self.probe_k)
        return out


@dataclass(frozen=True)
class EmicpProgram(Annealing):
    """EM-ICP's whole schedule (Granger & Pennec; Tamaki et al. Algorithm 3) on the device.

    ``sigma``, ``sigma_min``, ``outlier``: σ₀, σ_min, d₀ / ρ; None: the caller's (inputs).
    """

    SOURCE_LAYOUT: ClassVar[bool] = False  # the source is only ever the row pass's query
    factor: float
    sigma: float | None
    sigma_min: float | None
    outlier: float | None

    def __call__(self, inputs: _loop.Tensors, checkpoint: Any) -> _loop.Tensors:
        """Run the schedule: ``(inputs, checkpoint) -> outputs`` (see :class:`Annealing`)."""
        x, y, rho, track = self._start(inputs)
        sig0, sig_min, d0 = (inputs[n] if r is None else r * rho for n, r in (("sigma", self.sigma),
                             ("sigma_min", self.sigma_min), ("outlier_distance", self.outlier)))
        k = torch.arange(self.n_iter, dtype=torch.float64, device=rho.device)
        sig2 = sig0.square()[None, :] * self.factor ** k[:, None]        # (n_iter, B)
        sig = sig2.sqrt()  # each iteration's σ, recorded at the checks (one launch in all)
        scale = (0.5 / sig2).to(torch.float32)                            # 1/(2σ²)
        log_out = (-(d0.square()[None, :] / sig2)).to(torch.float32)     # −d₀²/σ² (−inf ok)
        it = 0
        for it in range(1, self.n_iter + 1):
            # E-step (λ_i, x'_i) and M-step (weighted Horn) in one fused call
            T, _, lam = self.passes.emicp_step(x.points, y.points, track.T, scale[it - 1],
                                               log_out[it - 1], track.done, x.lengths, y.lengths)
            if track.step(it, T, lam, checkpoint, sigma=sig[it - 1]):
                break
        last = track.finish(it).clamp(1, self.n_iter) - 1
        return self._finish(inputs, x, y, track, 3 * sig_min, sigma0=sig0, sigma_min=sig_min,
                            sigma_final=sig.gather(0, last[None])[0],
                            outlier_distance=d0, rms_radius=rho)


@dataclass(frozen=True)
class SoftassignProgram(Annealing):
    """Softassign's whole schedule (Gold et al.; Tamaki et al. Algorithm 2) on the device.

    ``sigma``: 1/(√β₀ ρ), ``alpha``: √α / ρ; None: the caller's (inputs ``beta0``, ``alpha``).
    """

    SOURCE_LAYOUT: ClassVar[bool] = True  # the source is also the column pass's points
    temperatures: int
    per_temperature: int
    sinkhorn_rounds: int
    beta_factor: float
    outlier_weight: float
    sigma: float | None
    alpha: float | None

    def __call__(self, inputs: _loop.Tensors, checkpoint: Any) -> _loop.Tensors:
        """Run the schedule: ``(inputs, checkpoint) -> outputs`` (see :class:`Annealing`)."""
        x, y, rho, track = self._start(inputs)
        beta0 = inputs["beta0"] if self.sigma is None else 1.0 / (self.sigma * rho).square()
        alpha = inputs["alpha"] if self.alpha is None else (self.alpha * rho).square()
        k = torch.arange(self.temperatures, dtype=torch.float64, device=rho.device)
        betas = beta0[None, :] * self.beta_factor ** k[:, None]         # (temperatures, B)
        betas_f = betas.to(torch.float32)
        offsets = (betas * alpha[None, :]).to(torch.float32)            # βα, every logit's
        log_w = torch.full_like(betas_f[0], math.log(self.outlier_weight))  # the slack
        it = 0
        for it in range(1, self.n_iter + 1):
            j = (it - 1) // self.per_temperature
            # Sinkhorn's rounds (eqs. 5-6, in logs); the last column pass gives x'_j and the
            # column sums of M, w_j = c_j Σ_i K_ij r_i = sigmoid(lse_j − log slack); then
            # Σ_ij m_ij ||R x_i + t − y_j||² has the moments of Σ_j w_j ||R x'_j + t − y_j||²
            T_new, _, w = self.passes.softassign_step(
                x.points, y.points, track.T, betas_f[j], offsets[j], log_w, track.done,
                x.lengths, y.lengths, self.sinkhorn_rounds)
            if track.step(it, T_new, w, checkpoint, beta=betas[j]):
                break
        j_end = ((track.finish(it).clamp(1, self.n_iter) - 1) // self.per_temperature) \
            .clamp_max(self.temperatures - 1)
        beta_end = betas.gather(0, j_end[None])[0]
        inlier = torch.maximum(alpha.sqrt(), 3.0 / beta_end.sqrt())
        return self._finish(inputs, x, y, track, inlier, beta0=beta0, beta_final=beta_end,
                            alpha=alpha, rms_radius=rho)
