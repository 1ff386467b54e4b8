"""Soft-correspondence registration: EM-ICP and Softassign, with O(N + M) memory.

Both algorithms weigh every (source, target) pair instead of picking nearest neighbours,
which tolerates a poor initial pose, and both reduce each step to a weighted Horn problem on
per-source-point soft correspondences (Tamaki et al., "Softassign and EM-ICP on GPU",
eqs. 18-20, 26, 28-29): with row weights w_i and soft correspondences m_i,
``argmin Σ_i w_i ||R x_i + t − m_i||²`` has the same centroids and cross-covariance as the
soft problem ``Σ_ij m_ij ||R x_i + t − y_j||²``. The N×M matrix is never stored: each step
is one or more fused passes of :mod:`pointalign.kernels.soft` (distance, exp, row
reductions in the log domain), and Softassign keeps Sinkhorn's row and column scalings only
(M = diag(r) K diag(c), K recomputed on the fly).

Scale: defaults are derived from the target's RMS radius ``ρ`` (root-mean-square distance of
its points from their centroid), so they work in metres on real scans and in any other
unit. The constants are chosen so that on the Stanford bunny (ρ ≈ 0.0562 m) they give the
seed code's values (Tamaki et al.): σ₀² = 0.01 m², σ_min² = 1e-5 m², d₀² = 0.01 m².

The annealing loop stays on the device. The pose is read by the kernels from device
memory, Horn's 4×4 eigenproblem is solved on the device, and the host reads back one
flag every ``CHECK_EVERY`` iterations (a batched convergence check) to stop early. On
CUDA (Triton backend) the whole fixed-length schedule is instead captured once into a
CUDA graph (:func:`pointalign.kernels.soft.run_schedule`, cached per shape and schedule)
and replayed: no host reads, converged pairs are frozen on the device, the loop runs to
the end of the schedule. EM-ICP's graph holds the whole call (centroids, defaults from ρ,
schedule, loop, pose back to the input frames, fitness pass, the degeneracy test's
covariances) and writes one packed float64 buffer: one device → host transfer per call.

Conventions: ``source`` is moved onto ``target``; results are ``T_target_source``
(``x_t = R x_s + t``). Batches: padded ``(B, N, 3)`` clouds plus ``source_lengths`` /
``target_lengths`` (B,), as for ICP.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from pointalign import _validate, estimate
from pointalign.kernels import soft as ksoft
from pointalign.registration.criteria import ConvergenceCriteria
from pointalign.registration.result import RegistrationResult

#: the bunny's RMS radius (m), to express the seed code's values in units of ρ
_BUNNY_RMS = 0.0562
#: EM-ICP defaults as multiples of the target's RMS radius ρ. σ_min and σ₀ are tuned on
#: held-out bunny pairs (benchmarks/tune_soft.py, results/soft_tuning-cpu.json): σ_min =
#: 0.03 ρ (seed: 0.0563 ρ) lowers the median rotation error by 17 % (4.24° → 3.53°, 1000
#: points, same success rate); σ₀ keeps the seed's σ₀/σ_min ratio, so the schedule is still
#: 66 iterations (σ₀ between 1 ρ and 3 ρ made no difference).
EMICP_SIGMA_MIN = 0.03                         # σ_min = 0.03 ρ (seed: σ_min² = 1e-5 m²)
EMICP_SIGMA = EMICP_SIGMA_MIN * math.sqrt(0.01 / 1e-5)  # σ₀ = 0.949 ρ (seed: σ₀² = 0.01 m²)
EMICP_OUTLIER = 0.1 / _BUNNY_RMS          # d₀ = 1.78 ρ   (seed: d₀² = 0.01; 1 ρ .. ∞ alike)
#: Softassign defaults: β₀ = 1/(SOFT_SIGMA ρ)², inliers within √α = SOFT_ALPHA ρ. SOFT_SIGMA =
#: 1 (seed: 1.78, σ = 0.1 m on the bunny) is tuned on held-out bunny pairs (tune_soft.py):
#: the same success rate and a 32 % lower median rotation error (2.34° → 1.58°, 1000 points,
#: short schedule); √α between 0.05 ρ and 0.2 ρ did not do better than the seed's 0.1 ρ.
SOFT_SIGMA = 1.0
SOFT_ALPHA = 0.1
#: iterations between host-side convergence checks
CHECK_EVERY = 8


# --------------------------------------------------------------------------------------
# shared plumbing
# --------------------------------------------------------------------------------------


def _prepare(source, target, source_lengths, target_lengths, init, device):
    like = source if isinstance(source, torch.Tensor) else None
    dev = _validate.as_device(device, like)
    src, sl, batched = _validate.as_batch(source, "source", lengths=source_lengths,
                                          min_points=3, device=dev, dtype=torch.float32)
    tgt, tl_, batched_t = _validate.as_batch(target, "target", lengths=target_lengths,
                                             min_points=3, device=dev, dtype=torch.float32)
    if batched != batched_t:
        raise ValueError("source, target: both must be single clouds (N, 3) or both batches "
                         f"(B, N, 3); got {tuple(src.shape)} batched={batched} and "
                         f"{tuple(tgt.shape)} batched={batched_t}")
    if src.shape[0] != tgt.shape[0]:
        raise ValueError(f"source, target: batch sizes differ ({src.shape[0]} vs {tgt.shape[0]})")
    B = src.shape[0]
    T0 = _validate.as_transform(init, "init", batch=B, device=dev, dtype=torch.float64)
    return dev, src, sl, tgt, tl_, T0, batched


def _centroid(points: torch.Tensor, lengths: torch.Tensor):
    mask = (torch.arange(points.shape[1], device=points.device)[None, :]
            < lengths[:, None]).to(torch.float64)
    p = points.to(torch.float64)
    c = (p * mask[..., None]).sum(1) / lengths.to(torch.float64)[:, None]
    rms = (((p - c[:, None]).square().sum(-1) * mask).sum(1)
           / lengths.to(torch.float64)).sqrt()
    return c, rms, mask


def _collinear(src, sl, tgt, tl_) -> torch.Tensor:
    """``(B,)`` True where the source or the target lies on a line (or a point): the rotation
    about that line is then undetermined, so the pair is reported "degenerate"."""
    def cov(points, lengths):
        w = (torch.arange(points.shape[1], device=points.device)[None, :]
             < lengths[:, None]).to(torch.float64)
        return estimate._weighted_moments(points, points, w).source_cov
    # one 3×3 eigenvalue call for both clouds, on the host (a device eigensolver launch
    # costs more than the whole problem)
    covs = torch.cat([cov(src, sl), cov(tgt, tl_)]).cpu()
    flat = ~estimate._spans_plane(covs).reshape(2, -1)
    return (flat[0] | flat[1]).to(src.device)


def _translate(T: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``Tr(−b) T Tr(a)``: the pose between clouds centred on a (source) and b (target)."""
    out = T.clone()
    out[:, :3, 3] = T[:, :3, 3] + (T[:, :3, :3] @ a[..., None])[..., 0] - b
    return out


def _untranslate(Tc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = Tc.clone()
    out[:, :3, 3] = Tc[:, :3, 3] + b - (Tc[:, :3, :3] @ a[..., None])[..., 0]
    return out


def _invert(T: torch.Tensor) -> torch.Tensor:
    Rt = T[:, :3, :3].transpose(-1, -2)
    out = torch.zeros_like(T)
    out[:, :3, :3] = Rt
    out[:, :3, 3] = -(Rt @ T[:, :3, 3:])[..., 0]
    out[:, 3, 3] = 1
    return out


def _criteria(criteria: ConvergenceCriteria | None, default_max: int) -> ConvergenceCriteria:
    if criteria is None:
        return ConvergenceCriteria(max_iterations=default_max)
    if not isinstance(criteria, ConvergenceCriteria):
        raise TypeError(f"criteria: expected ConvergenceCriteria, got {type(criteria).__name__}")
    return criteria


class _Tracker:
    """Per-pair convergence bookkeeping on the device (pose update and weight change).

    ``done`` changes only at checks, so iteration counts are brought up to date there (and
    in :meth:`finish`), not every iteration: no per-iteration launches.
    """

    def __init__(self, B: int, dev: torch.device, crit: ConvergenceCriteria):
        self.crit = crit
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        self.iters = torch.zeros(B, dtype=torch.int64, device=dev)
        self.counted = 0
        self.history: list[dict[str, Any]] = []

    def keep(self, T_old, T_new, valid):
        """The pose to keep: ``T_new`` where valid and not yet converged, else ``T_old``."""
        return torch.where((valid & ~self.done)[:, None, None], T_new, T_old)

    def finish(self, it: int) -> None:
        """Count iterations ``counted+1 .. it`` for the pairs that had not converged."""
        if it > self.counted:
            self.iters += (~self.done).to(torch.int64) * (it - self.counted)
            self.counted = it

    def step(self, it: int, T_old, T, w_old, w_new, check: bool, record: dict) -> bool:
        """After iteration ``it`` (1-based; ``T`` already kept by :meth:`keep` or the
        kernel): on ``check`` iterations evaluate the stop test; True when all converged.

        While a CUDA graph is captured (the whole schedule replayed at once) nothing is
        read back: pairs that converged keep their pose and iteration count on the device
        (``done`` masks them), and the loop runs to the end of the schedule.
        """
        if not check:
            return False
        self.finish(it)
        dR = (T[:, :3, :3] - T_old[:, :3, :3]).square().sum((-1, -2)).sqrt() / math.sqrt(2)
        dt = (T[:, :3, 3] - T_old[:, :3, 3]).norm(dim=-1)
        dw = (w_new - w_old).abs().sum(-1).double() / w_new.sum(-1).double().clamp_min(1e-300)
        conv = (dR < self.crit.rotation_tolerance) & (dt < self.crit.translation_tolerance) \
            & (dw < self.crit.relative_fitness)
        self.done = self.done | conv
        self.history.append(dict(record, rotation_update=dR, translation_update=dt,
                                 weight_change=dw))
        if ksoft.capturing():
            return False
        return bool(self.done.all())  # the one host sync per CHECK_EVERY steps


def _to_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """Copy many small device tensors to NumPy in one transfer (float64 round trip, exact
    for bool and for integers below 2**53)."""
    if not tensors:
        return []
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]).cpu().numpy()
    out, k = [], 0
    for t in tensors:
        n = t.numel()
        v = flat[k:k + n].reshape(tuple(t.shape))
        k += n
        dt = {torch.bool: np.bool_, torch.int64: np.int64}.get(t.dtype, np.float64)
        out.append(v.astype(dt) if dt is not np.float64 else v)
    return out


def _stop_reasons(degenerate, done, iters, n_sched: int) -> tuple[list[str], np.ndarray]:
    """Why each pair stopped, and whether that counts as converged: ``(B,)`` inputs.

    ``degenerate`` (collinear input), ``done`` (pose and weights settled), ``iters``
    (iterations run) against the schedule's length ``n_sched``.
    """
    reasons = []
    for f, d, it in zip(degenerate, done, iters, strict=True):
        if f:
            reasons.append("degenerate")
        elif d:
            reasons.append("pose_and_weights")
        elif it >= n_sched:
            reasons.append("schedule")
        else:
            reasons.append("max_iterations")
    converged = np.array([r not in ("max_iterations", "degenerate") for r in reasons])
    return reasons, converged


def _finish(name, Tc, a, b, src, sl, tgt, tl_, tracker, n_sched, max_it, inlier_distance,
            batched, t_start, t_iter, info, T0):
    """Build the RegistrationResult: pose back to the input frames, fitness and rmse.

    A degenerate pair (collinear source or target) keeps its initial pose ``T0``, with 0
    iterations and ``stop_reason`` "degenerate".
    """
    flat = _collinear(src, sl, tgt, tl_)
    T = torch.where(flat[:, None, None], T0, _untranslate(Tc, a, b))
    # hard nearest-neighbour distances through the same fused pass at a huge scale:
    # −lse/s → min_j d_ij² (soft-min; error ≤ log(M)/s)
    big = 1e4 / inlier_distance.square().clamp_min(1e-30)
    T32 = T.to(torch.float32)
    r = ksoft.soft_rows(src, tgt, T32, big.to(torch.float32), query_lengths=sl,
                        point_lengths=tl_)
    mask = torch.arange(src.shape[1], device=src.device)[None, :] < sl[:, None]
    d2 = (-r.lse.double() / big[:, None]).clamp_min(0)
    inl = mask & (d2 <= inlier_distance.square()[:, None])
    n_in = inl.sum(1)
    rmse_t = torch.where(n_in > 0, (torch.where(inl, d2, 0).sum(1) / n_in.clamp_min(1)).sqrt(),
                         torch.full_like(d2[:, 0], math.inf))
    hist_keys = [[k for k, v in h.items() if isinstance(v, torch.Tensor)]
                 for h in tracker.history]
    info_keys = [k for k, v in info.items() if isinstance(v, torch.Tensor)]
    host = iter(_to_host(n_in.double() / sl.double(), rmse_t,
                         torch.where(flat, 0, tracker.iters), tracker.done, flat, T,
                         inlier_distance, *(info[k] for k in info_keys),
                         *(h[k] for h, ks in zip(tracker.history, hist_keys, strict=True)
                           for k in ks)))
    fitness, rmse, iters, done, flat_h, Tn = (next(host) for _ in range(6))
    inlier_h = next(host)
    info = dict(info, **{k: next(host) for k in info_keys})
    history = [dict(h, **{k: next(host) for k in ks})
               for h, ks in zip(tracker.history, hist_keys, strict=True)]
    reasons, converged = _stop_reasons(flat_h, done, iters, n_sched)
    if not batched:
        history = [{k: (float(v[0]) if isinstance(v, np.ndarray) else v) for k, v in h.items()}
                   for h in history]
    t_end = time.perf_counter()
    timings = {"iterate": t_iter - t_start, "total": t_end - t_start}
    info = dict(info, algorithm=name, inlier_distance=inlier_h, scheduled_iterations=n_sched)
    if not batched:
        info = {k: (v[0] if isinstance(v, np.ndarray) and v.ndim >= 1 and len(v) == 1 else v)
                for k, v in info.items()}
        return RegistrationResult(Tn[0], float(fitness[0]), float(rmse[0]), int(iters[0]),
                                  bool(converged[0]), reasons[0], history, timings, info,
                                  T[0])
    return RegistrationResult(Tn, fitness, rmse, iters, converged, reasons, history, timings,
                              info, T)


def _per_pair(value, name, default, B, dev, *, allow_inf=False):
    """Check a positive scalar or (B,) parameter; ``None`` takes ``default (B,)``."""
    if value is None:
        return default
    v = torch.as_tensor(value, dtype=torch.float64).to(dev).reshape(-1)
    if v.numel() not in (1, B):
        raise ValueError(f"{name}: expected a number or {B} values, got {v.numel()}")
    if bool(torch.isnan(v).any()) or bool((v <= 0).any()) or (
            not allow_inf and not bool(torch.isfinite(v).all())):
        raise ValueError(f"{name}: must be {'> 0' if allow_inf else 'finite and > 0'}, "
                         f"got {value}")
    return v.expand(B).clone()


# --------------------------------------------------------------------------------------
# EM-ICP
# --------------------------------------------------------------------------------------


@_validate.out_of_memory_is_clear
def emicp(
    source: Any,
    target: Any,
    *,
    init: Any = None,
    sigma: float | None = None,
    sigma_min: float | None = None,
    factor: float = 0.9,
    outlier_distance: float | None = None,
    criteria: ConvergenceCriteria | None = None,
    device: str | torch.device | None = None,
    source_lengths: Any = None,
    target_lengths: Any = None,
) -> RegistrationResult:
    """Multi-scale EM-ICP (Granger & Pennec 2002, as in Tamaki et al.'s Algorithm 3).

    Each iteration, with d_ij² = ||R x_i + t − y_j||²:
    α_ij = exp(−d_ij²/σ²) / C_i, C_i = exp(−d₀²/σ²) + Σ_j exp(−d_ij²/σ²),
    λ_i = Σ_j √α_ij, x'_i = Σ_j √α_ij y_j / λ_i, then (R, t) = weighted Horn of
    (x_i → x'_i, weights λ_i), then σ² ← factor · σ², until σ < sigma_min.

    Args:
        source: ``(N, 3)`` points moved onto the target, or a padded batch ``(B, N, 3)``.
        target: ``(M, 3)`` fixed points, or ``(B, M, 3)``.
        init: initial ``T_target_source`` ``(4, 4)`` (or ``(B, 4, 4)``); identity if None.
        sigma: initial σ (metres); default 0.949 ρ, ρ the target's RMS radius (53 mm on
            the bunny; the seed code's σ² = 0.01 is 1.78 ρ).
        sigma_min: σ at which annealing stops; default 0.03 ρ (1.7 mm on the bunny; the
            seed's σ² = 1e-5 is 0.0563 ρ). Both tuned on held-out bunny pairs (see
            ``EMICP_SIGMA_MIN``). Must be < sigma.
        factor: multiplies **σ²** each iteration (the seed code's ``sigma_factor``), in
            (0, 1). The number of iterations is ⌈log(σ_min²/σ²) / log(factor)⌉ (66 with the
            defaults, as with the seed's values), unless the pose and weights stop changing first.
        outlier_distance: d₀ (metres), the distance at which a point is as likely an outlier
            as a match; default 1.78 ρ (the seed's d₀² = 0.01 on the bunny); ``inf`` turns
            the outlier term off.
        criteria: ``max_iterations`` caps the iterations (default: the schedule's length);
            the run stops early when, at a check (every ``CHECK_EVERY`` iterations), the
            pose update is below ``rotation_tolerance`` (rad) and ``translation_tolerance``
            (m, measured at the source centroid) **and** the relative L1 change of the
            weights λ is below ``relative_fitness``.
        device: compute device (default: the source tensor's device, else CUDA if present).
        source_lengths: ``(B,)`` valid source points of a padded batch.
        target_lengths: ``(B,)`` valid target points of a padded batch.

    Returns:
        :class:`RegistrationResult`; ``stop_reason`` is ``"schedule"`` (σ reached
        sigma_min), ``"pose_and_weights"`` (early stop), ``"max_iterations"`` or
        ``"degenerate"`` (source or target on a line: ``init`` is returned). ``fitness``
        and ``rmse`` use hard nearest neighbours within ``3 σ_min``.

    """
    t_start = time.perf_counter()
    dev, src, sl, tgt, tl_, T0, batched = _prepare(source, target, source_lengths,
                                                   target_lengths, init, device)
    factor = _validate.in_range(factor, "factor", 0.0, 1.0)
    B = src.shape[0]
    # defaults are multiples of ρ and are computed on the device with everything else; only
    # user-given σ's need a host look at ρ (the schedule length depends on σ_min/σ₀)
    defaults = (sigma is None, sigma_min is None, outlier_distance is None)
    given = [None if d else _per_pair(v, n, None, B, dev, allow_inf=n == "outlier_distance")
             for d, v, n in zip(defaults, (sigma, sigma_min, outlier_distance),
                                ("sigma", "sigma_min", "outlier_distance"), strict=True)]
    if defaults[0] and defaults[1]:
        ratios = [EMICP_SIGMA_MIN / EMICP_SIGMA]
    else:
        rho_h = (_centroid(tgt, tl_)[1].clamp_min(1e-12) if not all(
            g is not None for g in given[:2]) else None)
        s0 = given[0] if given[0] is not None else EMICP_SIGMA * rho_h
        s1 = given[1] if given[1] is not None else EMICP_SIGMA_MIN * rho_h
        ratio = (s1 / s0).cpu()
        if bool((ratio >= 1).any()):
            raise ValueError(f"sigma_min: must be smaller than sigma, got sigma_min "
                             f"{s1.tolist()} and sigma {s0.tolist()}")
        ratios = [float(r) for r in ratio]
    n_sched = int(max(math.ceil(math.log(r ** 2) / math.log(factor) - 1e-9) for r in ratios))
    crit = _criteria(criteria, max(n_sched, 1))
    n_iter = min(n_sched, int(crit.max_iterations))
    params = (torch.zeros((3, B), dtype=torch.float64, device=dev) if all(defaults) else
              torch.stack([torch.zeros(B, dtype=torch.float64, device=dev) if g is None else g
                           for g in given]))

    def run(src, tgt, sl, tl_, T0, params):
        """Run everything on the device (one CUDA graph on Triton).

        Prelude, annealing loop, pose back to the input frames, fitness pass and the
        covariances of the degeneracy test; returns ``(packed float64 results, T, check
        iterations)`` (see :func:`_emicp_unpack`).
        """
        a, _, _ = _centroid(src, sl)
        b, rho, _ = _centroid(tgt, tl_)
        rho = rho.clamp_min(1e-12)
        sig0 = EMICP_SIGMA * rho if defaults[0] else params[0]
        sigmin = EMICP_SIGMA_MIN * rho if defaults[1] else params[1]
        d0 = EMICP_OUTLIER * rho if defaults[2] else params[2]
        k = torch.arange(n_iter, dtype=torch.float64, device=dev)
        sig2 = sig0.square()[None, :] * factor ** k[:, None]            # (n_iter, B)
        log_out = -(d0.square()[None, :] / sig2)                         # −d₀²/σ² (−inf ok)
        mask = torch.arange(src.shape[1], device=dev)[None, :] < sl[:, None]
        src_c = torch.where(mask[..., None], src - a[:, None].to(src.dtype), 0.0)
        tgt_c = ksoft.point_layout(tgt - b[:, None].to(tgt.dtype))
        Tc = _translate(T0, a, b)
        scale_f = (0.5 / sig2).to(torch.float32)                         # 1/(2σ²)
        log_out_f = log_out.to(torch.float32)
        tracker = _Tracker(B, dev, crit)
        lam_prev = torch.zeros(src_c.shape[:2], dtype=torch.float32, device=dev)
        it = 0
        for it in range(1, n_iter + 1):
            T_new, _, lam = ksoft.emicp_step(src_c, tgt_c, Tc, scale_f[it - 1],
                                             log_out_f[it - 1], tracker.done,
                                             source_lengths=sl, target_lengths=tl_)
            check = it % CHECK_EVERY == 0 and it < n_iter
            stop = tracker.step(it, Tc, T_new, lam_prev, lam, check,
                                {"iteration": it, "sigma": sig2[it - 1].sqrt()})
            Tc, lam_prev = T_new, lam
            if stop:
                break
        tracker.finish(it)
        T = _untranslate(Tc, a, b)
        if n_iter:
            last = tracker.iters.clamp(1, n_iter) - 1
            sig_used = sig2.gather(0, last[None, :])[0].sqrt()
        else:
            sig_used = sig0
        inlier = 3 * sigmin
        fit, rmse = _fitness(src, sl, tgt, tl_, T, inlier)
        covs = _covariances(src, sl, tgt, tl_)
        hist = [h[key] for h in tracker.history for key in _HIST_KEYS]
        packed = torch.cat([fit, rmse, tracker.iters.double(), tracker.done.double(),
                            T.reshape(-1), covs.reshape(-1), inlier, sig0, sigmin, sig_used,
                            d0, rho, *hist])
        its = [h["iteration"] for h in tracker.history]
        return packed, T, its

    key = ("emicp", tuple(src.shape), tuple(tgt.shape), str(dev), n_iter, n_sched, factor,
           defaults, CHECK_EVERY, crit.rotation_tolerance, crit.translation_tolerance,
           crit.relative_fitness)
    packed, T, its = ksoft.run_schedule(key, run, src, tgt, sl, tl_, T0, params,
                                        pairs=B * src.shape[1] * tgt.shape[1])
    host = packed.cpu().numpy()  # the one device → host transfer (and sync)
    t_iter = time.perf_counter()
    return _emicp_unpack(host, its, T, T0, src, sl, tgt, tl_, B, n_sched, batched,
                         t_start, t_iter)


#: per-check history values of EM-ICP, in the packed order
_HIST_KEYS = ("sigma", "rotation_update", "translation_update", "weight_change")


def _fitness(src, sl, tgt, tl_, T, inlier_distance):
    """Fitness and rmse with hard nearest neighbours within ``inlier_distance`` (B,).

    The distances come from the same fused pass at a huge scale: −lse/s → min_j d_ij²
    (soft-min; error ≤ log(M)/s).
    """
    big = 1e4 / inlier_distance.square().clamp_min(1e-30)
    r = ksoft.soft_rows(src, tgt, T.to(torch.float32), big.to(torch.float32),
                        query_lengths=sl, point_lengths=tl_)
    mask = torch.arange(src.shape[1], device=src.device)[None, :] < sl[:, None]
    d2 = (-r.lse.double() / big[:, None]).clamp_min(0)
    inl = mask & (d2 <= inlier_distance.square()[:, None])
    n_in = inl.sum(1)
    rmse = torch.where(n_in > 0, (torch.where(inl, d2, 0).sum(1) / n_in.clamp_min(1)).sqrt(),
                       torch.full_like(d2[:, 0], math.inf))
    return n_in.double() / sl.double(), rmse


def _covariances(src, sl, tgt, tl_) -> torch.Tensor:
    """``(2, B, 3, 3)`` float64 covariances of the source and target (degeneracy test)."""
    def cov(points, lengths):
        w = (torch.arange(points.shape[1], device=points.device)[None, :]
             < lengths[:, None]).to(torch.float64)
        return estimate._weighted_moments(points, points, w).source_cov
    return torch.stack([cov(src, sl), cov(tgt, tl_)])


def _emicp_unpack(host, its, T_dev, T0, src, sl, tgt, tl_, B, n_sched, batched, t_start,
                  t_iter):
    """Build EM-ICP's RegistrationResult from the packed host copy of ``run``'s results.

    A degenerate pair (collinear source or target, decided here on the host from the
    packed covariances) keeps ``T0``, with 0 iterations and ``stop_reason`` "degenerate";
    its fitness and rmse are then recomputed at ``T0`` (an extra pass, only in that case).
    """
    sizes = [B, B, B, B, 16 * B, 18 * B, B, B, B, B, B, B] + [B] * (len(_HIST_KEYS) * len(its))
    parts, k = [], 0
    for n in sizes:
        parts.append(host[k:k + n])
        k += n
    fitness, rmse, iters, done, Tn, covs, inlier, sig0, sigmin, sig_used, d0, rho = parts[:12]
    hist = parts[12:]
    flat = (~estimate._spans_plane(torch.from_numpy(covs.reshape(2, B, 3, 3)))).numpy()
    flat = flat[0] | flat[1]
    iters = np.where(flat, 0, iters.astype(np.int64))
    done = done.astype(bool)
    Tn = Tn.reshape(B, 4, 4).copy()
    T_dev = T_dev.clone()
    if flat.any():
        fd = torch.as_tensor(flat, device=T0.device)
        T_dev = torch.where(fd[:, None, None], T0, T_dev)
        fit0, rmse0 = _fitness(src, sl, tgt, tl_, T_dev,
                               torch.as_tensor(inlier, device=T0.device))
        fitness = np.where(flat, fit0.cpu().numpy(), fitness)
        rmse = np.where(flat, rmse0.cpu().numpy(), rmse)
        Tn = np.where(flat[:, None, None], T0.cpu().numpy(), Tn)
    reasons, converged = _stop_reasons(flat, done, iters, n_sched)
    history, j = [], 0
    for it in its:
        h = {"iteration": it}
        for key in _HIST_KEYS:
            h[key] = hist[j]
            j += 1
        history.append(h)
    info = {"sigma0": sig0, "sigma_min": sigmin, "sigma_final": sig_used,
            "outlier_distance": d0, "rms_radius": rho, "algorithm": "emicp",
            "inlier_distance": inlier, "scheduled_iterations": n_sched}
    t_end = time.perf_counter()
    # "iterate": until the device results were read (the graph also holds the fitness pass)
    timings = {"iterate": t_iter - t_start, "total": t_end - t_start}
    if not batched:
        history = [{k: (float(v[0]) if isinstance(v, np.ndarray) else v) for k, v in h.items()}
                   for h in history]
        info = {k: (v[0] if isinstance(v, np.ndarray) and v.ndim >= 1 and len(v) == 1 else v)
                for k, v in info.items()}
        return RegistrationResult(Tn[0], float(fitness[0]), float(rmse[0]), int(iters[0]),
                                  bool(converged[0]), reasons[0], history, timings, info,
                                  T_dev[0])
    return RegistrationResult(Tn, fitness, rmse, iters, converged, reasons, history, timings,
                              info, T_dev)


# --------------------------------------------------------------------------------------
# Softassign
# --------------------------------------------------------------------------------------


@_validate.out_of_memory_is_clear
def softassign(
    source: Any,
    target: Any,
    *,
    init: Any = None,
    beta0: float | None = None,
    beta_factor: float = 1.075,
    temperatures: int = 100,
    alpha: float | None = None,
    iterations_per_temperature: int = 5,
    sinkhorn_iterations: int = 3,
    outlier_weight: float = 1.0,
    criteria: ConvergenceCriteria | None = None,
    device: str | torch.device | None = None,
    source_lengths: Any = None,
    target_lengths: Any = None,
) -> RegistrationResult:
    """Softassign with deterministic annealing (Gold et al. 1998; Tamaki et al. Alg. 2).

    For each of ``temperatures`` values β = β₀ · beta_factor^k and each of
    ``iterations_per_temperature`` updates: K_ij = exp(−β (d_ij² − α)) with
    d_ij = ||R x_i + t − y_j||, an outlier (slack) column and row of value
    ``outlier_weight``, ``sinkhorn_iterations`` rounds of row then column normalisation of
    M = diag(r) K diag(c) (only r and c are stored, in logs), then the weighted Horn step on
    the row sums of M and S = X̂ᵀ M Ŷ (eqs. 18-20, 26).

    Args:
        source: ``(N, 3)`` or ``(B, N, 3)`` points moved onto the target (as :func:`emicp`).
        target: ``(M, 3)`` or ``(B, M, 3)`` fixed points.
        init: initial ``T_target_source``; identity if None.
        beta0: initial β (1/m²), > 0; default 1/ρ² (tuned on held-out bunny pairs, see
            ``SOFT_SIGMA``; the seed's σ = 0.1 m on the bunny is 1/(1.78 ρ)²).
        beta_factor: β multiplier per temperature, > 1 (Gold et al.'s 1.075).
        temperatures: number of β values (the seed's 100).
        alpha: squared distance (m²) below which a pair beats the outlier slot at low
            temperature; default (0.1 ρ)² (5.6 mm on the bunny).
        iterations_per_temperature: pose updates per β (the seed's 5).
        sinkhorn_iterations: Sinkhorn rounds per update (the seed's 3).
        outlier_weight: value of the slack entries (> 0).
        criteria: as :func:`emicp` (counted in pose updates).
        device: compute device, as :func:`emicp`.
        source_lengths: ``(B,)`` valid source points of a padded batch.
        target_lengths: ``(B,)`` valid target points of a padded batch.

    Returns:
        :class:`RegistrationResult` (``iterations`` counts pose updates); ``stop_reason`` is
        ``"schedule"``, ``"pose_and_weights"``, ``"max_iterations"`` or ``"degenerate"``
        (source or target on a line: ``init`` is returned).

    """
    t_start = time.perf_counter()
    dev, src, sl, tgt, tl_, T0, batched = _prepare(source, target, source_lengths,
                                                   target_lengths, init, device)
    beta_factor = float(beta_factor)
    if not math.isfinite(beta_factor) or beta_factor <= 1.0:
        raise ValueError(f"beta_factor: must be finite and > 1, got {beta_factor}")
    for name, v in (("temperatures", temperatures),
                    ("iterations_per_temperature", iterations_per_temperature),
                    ("sinkhorn_iterations", sinkhorn_iterations)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
    w_out = _validate.positive(outlier_weight, "outlier_weight")
    B = src.shape[0]
    a, _, _ = _centroid(src, sl)
    b, rho, _ = _centroid(tgt, tl_)
    rho = rho.clamp_min(1e-12)
    beta_0 = _per_pair(beta0, "beta0", 1.0 / (SOFT_SIGMA * rho).square(), B, dev)
    alpha_v = _per_pair(alpha, "alpha", (SOFT_ALPHA * rho).square(), B, dev)
    n_sched = int(temperatures) * int(iterations_per_temperature)
    crit = _criteria(criteria, n_sched)
    n_iter = min(n_sched, int(crit.max_iterations))
    src_c = ksoft.point_layout(src - a[:, None].to(src.dtype))
    tgt_c = ksoft.point_layout(tgt - b[:, None].to(tgt.dtype))
    Tc = _translate(T0, a, b)
    log_w = torch.full((B,), math.log(w_out), dtype=torch.float32, device=dev)
    n_temp = int(temperatures)
    n_per = int(iterations_per_temperature)
    n_sink = int(sinkhorn_iterations)
    k = torch.arange(n_temp, dtype=torch.float64, device=dev)
    betas = beta_0[None, :] * beta_factor ** k[:, None]              # (temperatures, B)
    betas_f = betas.to(torch.float32)
    bas_f = (betas * alpha_v[None, :]).to(torch.float32)             # βα, every logit's offset

    def loop(src_c, tgt_c, sl, tl_, Tc, betas_f, bas_f, betas, log_w):
        tracker = _Tracker(B, dev, crit)
        w_prev = torch.zeros(tgt_c.shape[:2], dtype=torch.float32, device=dev)
        it = 0
        stop = False
        for j in range(n_temp):
            beta_f, ba = betas_f[j], bas_f[j]
            for _ in range(n_per):
                if it >= n_iter:
                    break
                T32 = Tc  # the kernels read float64 poses directly
                Ti32 = _invert(Tc)
                g_col = ba[:, None].expand(B, tgt_c.shape[1])     # log c + βα, c = 1
                for s_ in range(n_sink):
                    g_row = ksoft.sinkhorn_scaling(src_c, tgt_c, T32, beta_f, g_col, log_w,
                                                   ba, query_lengths=sl, point_lengths=tl_)
                    if s_ + 1 < n_sink:
                        g_col = ksoft.sinkhorn_scaling(tgt_c, src_c, Ti32, beta_f, g_row,
                                                       log_w, ba, query_lengths=tl_,
                                                       point_lengths=sl)
                # the last column normalisation and the statistics in one pass: column
                # log-sums and the soft correspondences x'_j = Σ_i m_ij x_i / Σ_i m_ij
                r = ksoft.soft_rows(tgt_c, src_c, Ti32, beta_f, query_lengths=tl_,
                                    point_lengths=sl, point_log_weights=g_row)
                # new log c_j + βα = βα − log(slack + Σ_i K_ij r_i); column sums of
                # M = diag(r) K diag(c): c_j Σ_i K_ij r_i = exp(lse_j + log c_j)
                log_c = -torch.logaddexp(r.lse, log_w[:, None].expand_as(r.lse))
                w = torch.exp(r.lse + log_c)
                w = torch.nan_to_num(w, nan=0.0, posinf=0.0)
                # Σ_ij m_ij ||R x_i + t − y_j||² has the moments of Σ_j w_j ||R x'_j + t − y_j||²
                T_new, valid = ksoft.weighted_horn(r.mean, tgt_c, w)
                it += 1
                check = it % CHECK_EVERY == 0 and it < n_iter
                T_new = tracker.keep(Tc, T_new, valid)
                stop = tracker.step(it, Tc, T_new, w_prev, w, check,
                                    {"iteration": it, "beta": betas[j]})
                Tc, w_prev = T_new, w
                if stop:
                    break
            if stop or it >= n_iter:
                break
        tracker.finish(it)
        return Tc, tracker.iters, tracker.done, tracker.history

    key = ("softassign", tuple(src_c.shape), tuple(tgt_c.shape), str(dev), n_temp, n_per,
           n_sink, n_iter, CHECK_EVERY, crit.rotation_tolerance, crit.translation_tolerance,
           crit.relative_fitness)
    Tc, iters, done, history = ksoft.run_schedule(key, loop, src_c, tgt_c, sl, tl_, Tc,
                                                  betas_f, bas_f, betas, log_w,
                                                  pairs=B * src_c.shape[1] * tgt_c.shape[1])
    tracker = _Tracker(B, dev, crit)
    tracker.iters, tracker.done, tracker.history = iters, done, history
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t_iter = time.perf_counter()
    j_end = ((iters.clamp(1, max(n_iter, 1)) - 1) // n_per).clamp_max(n_temp - 1)
    beta_end = betas[j_end, torch.arange(B, device=dev)]
    inlier = torch.maximum(alpha_v.sqrt(), 3.0 / beta_end.sqrt())
    return _finish("softassign", Tc, a, b, src, sl, tgt, tl_, tracker, n_sched, n_iter,
                   inlier, batched, t_start, t_iter,
                   {"beta0": beta_0, "beta_final": beta_end, "alpha": alpha_v,
                    "rms_radius": rho},
                   T0)
