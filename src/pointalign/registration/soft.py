"""Soft-correspondence registration: EM-ICP and Softassign, with O(N + M) memory.

Both weigh every (source, target) pair instead of picking nearest neighbours, which
tolerates a poor initial pose, and both reduce each step to a weighted Horn problem on
soft correspondences (Tamaki et al., "Softassign and EM-ICP on GPU", eqs. 18-20, 26,
28-29): with row weights w_i and soft correspondences m_i, ``Σ_i w_i ||R x_i + t − m_i||²``
has the centroids and cross-covariance of ``Σ_ij m_ij ||R x_i + t − y_j||²``. The N×M
matrix is never stored (Softassign keeps Sinkhorn's scalings only, M = diag(r) K diag(c)).

Each algorithm is one fixed-length device program (:class:`EmicpProgram`,
:class:`SoftassignProgram`) over one run's passes (:func:`pointalign.kernels.soft.prepare`,
in the form ``approximation`` chooses up front): centre both clouds, anneal, take the pose
back to the input frames, measure fitness; a problem that settled is frozen
(:class:`_Settling`). Results are ``T_target_source``; batches are padded, as in ICP.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pointalign import _progress, _threads, _validate
from pointalign.kernels import _first_use, _loop
from pointalign.kernels import soft as ksoft
from pointalign.registration import _edge, checks
from pointalign.registration import stability as _stability
from pointalign.registration._edge import StopReason
from pointalign.registration.criteria import ConvergenceCriteria, as_criteria
from pointalign.registration.result import RegistrationResult
from pointalign.registration.soft_programs import Annealing, EmicpProgram, SoftassignProgram
from pointalign.registration.soft_programs import rho as _rho

# Defaults are multiples of the target's RMS radius ρ, so they hold in any unit. The seed
# code (Tamaki et al., for the bunny, ρ = 0.0562 m) has EM-ICP σ₀ = 1.78 ρ, σ_min = 0.0563 ρ,
# d₀ = 1.78 ρ and Softassign σ = 1/√β₀ = 1.78 ρ. Tuning: benchmarks/tune_soft.py.
#: EM-ICP σ_min / ρ, tuned (seed: 0.0563): 17 % lower median rotation error, same success
EMICP_SIGMA_MIN = 0.03
#: EM-ICP σ₀ / ρ: the seed's σ₀/σ_min = √(0.01/1e-5) = √1000 (66 iterations at factor 0.9)
EMICP_SIGMA = EMICP_SIGMA_MIN * math.sqrt(1000.0)
#: EM-ICP d₀ / ρ: the seed's (anything from 1 ρ to ∞ did alike)
EMICP_OUTLIER = 1.78
#: Softassign 1/(√β₀ ρ), tuned (seed: 1.78): 32 % lower median rotation error, same success
SOFT_SIGMA = 1.0
#: Softassign √α / ρ, the seed's (0.05 ρ .. 0.2 ρ did not do better)
SOFT_ALPHA = 0.1
#: iterations between settling checks
CHECK_EVERY = 8
#: σ₀, σ_min, 1/√β₀ and √α must lie within [RANGE⁻¹ ρ, RANGE ρ] (ρ: the target's RMS radius)
RANGE = 1e6
#: a run estimated to take longer than this (seconds) warns (SlowOperationWarning)
SLOW_S = 30.0
#: a schedule that ends is converged ("schedule") only when its last check moved the source
#: by at most this fraction of the final scale (EM-ICP's σ_min, Softassign's 1/√β_end or
#: √α/3), else "stalled". Measured on the bunny (defaults, from 10-45° off): runs that end
#: aligned moved 0.001-0.04 of it, 0.07 on the full bun045 -> bun000 pair (0.84° off);
#: EM-ICP left sliding on a wrong pose from 90° moved 0.2 or more
SETTLED = 0.1


def _criteria(criteria: Any, max_iterations: Any) -> ConvergenceCriteria | None:
    """Return the call's criteria (``max_iterations=`` as the shortcut); None: the schedule."""
    if criteria is None and max_iterations is None:
        return None  # the whole schedule
    return as_criteria(criteria, max_iterations)


def _prepare(source, target, init, device, source_lengths, target_lengths,
             lengths: dict[str, float], **params: Any):
    """Check the inputs: the pair, the ``params`` given (B numbers > 0, finite but d₀) and ρ.

    Returns ``(pair, units, given, ρ)``: ``units`` the units check still to run once the
    program is enqueued (:func:`checks.prepared_pair`; None: it ran here); ρ the targets'
    RMS radii ``(B,)`` on the host when a given parameter sets a length (``value **
    lengths[name]``, in metres, within ``[1/RANGE, RANGE] ρ``), else None.
    """
    dev = _edge.resolve_device(device, source=source, target=target)
    pair, units = checks.prepared_pair(source, target, init, dev, source_lengths,
                                       target_lengths, min_points=3)
    if pair.shared_target:
        raise ValueError("source, target: both must be single clouds (N, 3) or both batches "
                         f"(B, N, 3); got {pair.size} sources and one target")
    given = {}
    for name, value in ((n, v) for n, v in params.items() if v is not None):
        if isinstance(value, (bool, str, bytes)):
            raise TypeError(f"{name}: expected a number or {pair.size} numbers, got {value!r}")
        try:
            v = torch.as_tensor(value, dtype=torch.float64).detach().cpu().reshape(-1)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name}: expected a number or {pair.size} numbers, got "
                            f"{type(value).__name__}") from None
        if v.numel() not in (1, pair.size):
            raise ValueError(f"{name}: expected a number or {pair.size} values, got {v.numel()}")
        if not bool(((v > 0) & ((v < math.inf) | (name == "outlier_distance"))).all()):
            raise ValueError(f"{name}: must be > 0{', finite' * (name != 'outlier_distance')}"
                             f", got {value}")
        given[name] = v.expand(pair.size).clone()
    if not any(n in given for n in lengths):
        return pair, units, given, None
    rho = _rho(ksoft.centre(pair.target, pair.target_lengths)).cpu()
    for name in (n for n in lengths if n in given):
        rel = given[name] ** lengths[name] / rho
        bad = ~((rel >= 1 / RANGE) & (rel <= RANGE))
        if bool(bad.any()):
            raise ValueError(f"{name}: {given[name][bad][0].item():.3g} is out of range for "
                             f"clouds of RMS radius {rho[bad][0].item():.3g} (the length it sets "
                             f"must lie within [{1 / RANGE:g}, {RANGE:g}] times the radius)")
    return pair, units, given, rho


def _check_final_beta(beta_factor: float, temperatures: int, beta0: torch.Tensor | None,
                      rho: torch.Tensor | None) -> None:
    """Raise ValueError when Softassign's last β would leave the range its lengths allow.

    The schedule reaches ``β₀ · beta_factor^(temperatures − 1)``; its length 1/√β must stay
    above ``ρ / RANGE`` (ρ: the target's RMS radius), as β₀'s does. Checked in logs, so
    ``beta_factor=1e6`` is a clear error rather than a float overflow.
    """
    log_growth = (temperatures - 1) * math.log(beta_factor)
    # log(β₀ ρ²): the default β₀ = 1/(SOFT_SIGMA ρ)²
    log_b0 = (torch.log(beta0 * rho.square()) if beta0 is not None and rho is not None
              else torch.tensor([-2 * math.log(SOFT_SIGMA)], dtype=torch.float64))
    worst = float(log_b0.max()) + log_growth
    if worst > 2 * math.log(RANGE):
        most = math.exp((2 * math.log(RANGE) - float(log_b0.max()))
                        / max(temperatures - 1, 1))
        raise ValueError(f"beta_factor: {beta_factor:g} over {temperatures} temperatures "
                         f"raises β by a factor of e^{log_growth:.0f}, past the range "
                         f"Softassign works in (1/√β down to {1 / RANGE:g} of the clouds' "
                         f"radius); use at most {most:.4g} (Gold et al.: 1.075) or fewer "
                         "temperatures")


def _settling(criteria: ConvergenceCriteria | None, n_sched: int) -> dict[str, Any]:
    """Return a program's settling fields from ``criteria`` (None: the whole schedule)."""
    crit = ConvergenceCriteria(max_iterations=n_sched) if criteria is None else criteria
    return dict(n_iter=min(n_sched, int(crit.max_iterations)), check_every=CHECK_EVERY,
                rotation_tolerance=float(crit.rotation_tolerance),
                translation_tolerance=float(crit.translation_tolerance),
                relative_weights=float(crit.weight_change))


def _last_motion(hist: dict[str, np.ndarray], scale: np.ndarray,
                 radius: np.ndarray | None) -> np.ndarray:
    """How far the last check moved each source, over the schedule's final scale: ``(B,)``.

    ``hypot(Δt, ΔR · r)`` (the centroid's motion and the rotation's at the source's RMS
    radius r, over the last :data:`CHECK_EVERY` iterations) divided by ``scale`` (EM-ICP's
    σ_min, Softassign's final 1/√β or √α / 3); 0 where no check ran.
    """
    if "translation_update" not in hist or not len(hist["translation_update"]):
        return np.zeros(len(scale))
    dt = np.asarray(hist["translation_update"][-1], dtype=np.float64)
    dR = np.asarray(hist["rotation_update"][-1], dtype=np.float64)
    r = np.zeros_like(dt) if radius is None else np.asarray(radius, dtype=np.float64)
    return np.hypot(dt, dR * r) / np.maximum(np.asarray(scale, dtype=np.float64), 1e-300)


def _run(algorithm: str, t_start: float, prog: Annealing, pair: _edge.Pair,
         units: Callable[[], None] | None, given: dict[str, torch.Tensor],
         n_sched: int) -> RegistrationResult:
    """Run ``prog`` on ``pair`` and build the result (stop reasons, history, info).

    ``units``: the units check, run once the program is enqueued (None: it ran before).
    """
    inputs = {n: v.to(pair.device) for n, v in dict(
        source=pair.source, target=pair.target, source_lengths=pair.source_lengths,
        target_lengths=pair.target_lengths, init=pair.init_on_device(), **given).items()}
    # whether the data determine the pose found (a sphere turned, three points: ambiguous),
    # measured by the program's last step where it can (no launches or wait after it)
    probe = _stability.device_probe(pair)
    if probe is not None:
        prog = dataclasses.replace(prog, probe_k=probe[0])
        inputs.update(probe_rows=probe[1], probe_valid=probe[2])
    passes = prog.passes
    # the passes' estimate is for this process alone: a busy machine gives it a share of
    # its cores (_threads.host_share), and the call takes about that much longer
    est = None if passes.estimate_s is None else passes.estimate_s / _threads.host_share()
    what = f"{algorithm} on {pair.source.shape[1]} x {pair.target.shape[1]} points"
    if est is not None and est > SLOW_S:
        _progress.warn(f"{what} is estimated to take {_progress.describe_seconds(est)} "
                       f"({passes.form} form); subsample the clouds, use a GPU or a "
                       "nearest-neighbour method (icp)", _progress.SlowOperationWarning,
                       stacklevel=None)
    elif est is not None:
        _progress.announce(f"{what} on the CPU ({passes.form} form)", est)
    label = "EM-ICP" if algorithm == "emicp" else "Softassign"
    with _progress.task(label, total=prog.n_iter, quiet=None if passes.host else True) as bar, \
            passes.running():
        run = dataclasses.replace(prog, progress=bar) if passes.host else prog
        host, _ = _loop.run_program(run, inputs, device_outputs=False, meanwhile=units,
                                    pairs=pair.size * pair.source.shape[1] * pair.target.shape[1])
    t_run = time.perf_counter()
    sums = host.pop("stability_sums", None)
    # no source point near the target at the end: nothing was matched, not a solution
    reasons = [StopReason.DEGENERATE if f else StopReason.NO_CORRESPONDENCES if not fit > 0 else
               StopReason.POSE_AND_WEIGHTS if d else
               StopReason.SCHEDULE if i >= n_sched else StopReason.MAX_ITERATIONS
               for f, d, i, fit in zip(host.pop("flat"), host.pop("done"), host["iterations"],
                                       host["fitness"], strict=True)]
    hist = {k.split(".", 1)[1]: host.pop(k) for k in list(host) if k.startswith("history.")}
    # an annealing schedule's end is convergence only when the pose had settled there
    motion = _last_motion(hist, host["inlier_distance"] / 3.0, pair.source_extent)
    reasons = [StopReason.STALLED if r is StopReason.SCHEDULE and m > SETTLED else r
               for r, m in zip(reasons, motion, strict=True)]
    host["last_motion"] = motion
    history = [{"iteration": prog.check_every * (c + 1), **{k: v[c] for k, v in hist.items()}}
               for c in range(len(next(iter(hist.values()), ())))]
    T, fitness, rmse, iters = (host.pop(k) for k in ("T", "fitness", "rmse", "iterations"))
    info = dict(host, algorithm=algorithm, scheduled_iterations=n_sched,
                approximation=passes.info())
    stab = None if sums is None else _stability.probed_stability(pair, sums)
    if stab is None:
        stab = _edge.measured_stability(pair, T,
                                        max_distance=float(np.max(host["inlier_distance"])))
    timings = {"iterate": t_run - t_start, "total": time.perf_counter() - t_start}
    return _edge.build_result(pair, T, fitness=fitness, rmse=rmse, iterations=iters,
                              reasons=reasons, history=history, timings=timings, info=info,
                              stability=stab)


@_first_use.first_use("emicp")
@_threads.per_call
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
    max_iterations: int | None = None,
    device: str | torch.device | None = None,
    source_lengths: Any = None,
    target_lengths: Any = None,
    approximation: str = "auto",
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
        sigma: initial σ (metres; a number or B); default ``EMICP_SIGMA`` ρ = 0.949 ρ, ρ the
            target's RMS radius.
        sigma_min: σ at which annealing stops, < sigma; default ``EMICP_SIGMA_MIN`` ρ = 0.03 ρ.
        factor: multiplies **σ²** each iteration (the seed's ``sigma_factor``), in (0, 1):
            ⌈log(σ_min²/σ²) / log(factor)⌉ iterations (66 with the defaults, as the seed's).
        outlier_distance: d₀ (metres), the distance at which a point is as likely an outlier
            as a match; default ``EMICP_OUTLIER`` ρ = 1.78 ρ; ``inf``: no outlier term.
        criteria: ``max_iterations`` caps the schedule (default: its length); every
            ``CHECK_EVERY`` iterations a problem stops when its update is below both
            tolerances (at the source centroid) and its λ changed by < ``relative_weights``.
        max_iterations: shortcut for ``criteria=ConvergenceCriteria(max_iterations=n)``;
            not both.
        device: compute device (default: the inputs' device, else CUDA if present).
        source_lengths: ``(B,)`` valid source points of a padded batch.
        target_lengths: ``(B,)`` valid target points of a padded batch.
        approximation: the E-step's form where the backend has a cheaper one (the CPU's
            numba passes; the GPU's is exact, leaving out only tiles of points whose
            weights sum to under 2^−32 of each row's, from 16k points on): "auto" (exact
            while estimated at a few seconds, else approximate), "exact" or "approximate"
            (cells of 0.4σ, cell pairs beyond 4σ dropped; bounds in
            :mod:`pointalign.kernels.soft.cpu`), recorded in
            ``result.info["approximation"]``; a run estimated above ``SLOW_S`` seconds
            warns (:class:`~pointalign._progress.SlowOperationWarning`).
        num_threads: CPU threads for this call (:func:`pointalign.threads`).

    Raises:
        ValueError: naming the argument: σ, σ_min outside ``[1e-6 ρ, 1e6 ρ]``, σ_min ≥ σ etc.

    Returns:
        :class:`RegistrationResult`; ``stop_reason`` is ``"schedule"`` (σ reached
        sigma_min with the pose settled), ``"stalled"`` (σ reached sigma_min while the last
        check still moved the source by more than ``SETTLED`` σ_min: not converged,
        ``info["last_motion"]``), ``"pose_and_weights"`` (settled early),
        ``"max_iterations"``, ``"degenerate"`` (source or target on a line: ``init`` is
        returned) or ``"no_correspondences"`` (no source point within ``3 σ_min`` of the
        target at the end: not converged); a pose the data do not determine (a sphere
        turned, three points) is ``"ambiguous"`` (``info["stability"]``). ``fitness`` and
        ``rmse``: hard nearest neighbours within ``3 σ_min``. Passes run on the host show a
        progress bar (``_progress``).

    """
    return _run("emicp", time.perf_counter(), *_emicp_setup(
        source, target, init=init, sigma=sigma, sigma_min=sigma_min, factor=factor,
        outlier_distance=outlier_distance, criteria=criteria, max_iterations=max_iterations,
        device=device, source_lengths=source_lengths, target_lengths=target_lengths,
        approximation=approximation))


def _emicp_setup(source, target, *, init, sigma, sigma_min, factor, outlier_distance, criteria,
                 max_iterations, device, source_lengths, target_lengths, approximation):
    """Check EM-ICP's arguments: its program (with the run's passes), pair, inputs, length."""
    factor = _validate.in_range(factor, "factor", 0.0, 1.0)
    criteria = _criteria(criteria, max_iterations)
    pair, units, given, rho = _prepare(
        source, target, init, device, source_lengths, target_lengths,
        {"sigma": 1, "sigma_min": 1}, sigma=sigma, sigma_min=sigma_min,
        outlier_distance=outlier_distance)
    # the schedule's length needs σ_min/σ₀ on the host: ρ only when a σ is given (no sync)
    r = torch.ones(pair.size, dtype=torch.float64) if rho is None else rho
    s0, s1 = given.get("sigma", EMICP_SIGMA * r), given.get("sigma_min", EMICP_SIGMA_MIN * r)
    ratio = torch.as_tensor(s1 / s0, dtype=torch.float64).reshape(-1)
    if bool((ratio >= 1).any()):
        raise ValueError(f"sigma_min: must be smaller than sigma, got {s1} and sigma {s0}")
    n_sched = max(math.ceil(math.log(q ** 2) / math.log(factor) - 1e-9) for q in ratio.tolist())
    settle = _settling(criteria, n_sched)

    def schedule() -> dict[str, Any]:  # the first problem's σ per iteration
        s00 = float(given["sigma"][0]) if "sigma" in given else EMICP_SIGMA * float(
            (rho if rho is not None else _rho(ksoft.centre(pair.target, pair.target_lengths)))[0])
        return {"sigmas": [s00 * factor ** (k / 2) for k in range(settle["n_iter"])]}
    passes = ksoft.prepare("emicp", pair.source, pair.target, pair.source_lengths,
                           pair.target_lengths, iterations=settle["n_iter"],
                           approximation=approximation, schedule=schedule)
    return EmicpProgram(**settle, factor=factor, passes=passes,
                        sigma=None if sigma is not None else EMICP_SIGMA,
                        sigma_min=None if sigma_min is not None else EMICP_SIGMA_MIN,
                        outlier=None if outlier_distance is not None else EMICP_OUTLIER), \
        pair, units, given, n_sched


def estimate_seconds(algorithm: str, source: Any, target: Any, **params: Any) -> dict[str, Any]:
    """Predict, up front, how long :func:`emicp` or :func:`softassign` will take.

    Args:
        algorithm: "emicp" or "softassign".
        source: as the algorithm's ``source``.
        target: as the algorithm's ``target``.
        **params: the algorithm's keyword arguments (``approximation`` included).

    Returns:
        ``{"seconds": predicted seconds of the chosen form (None where the passes give no
        estimate: off the CPU), "exact_seconds": the exact form's, "approximation": what
        ``result.info["approximation"]`` will say}``: a pairs-per-second model, not a promise.

    """
    public = {"emicp": emicp, "softassign": softassign}.get(algorithm)
    if public is None:
        raise ValueError(f"algorithm: expected 'emicp' or 'softassign', got {algorithm!r}")
    args = inspect.signature(public).bind(source, target, **params)  # TypeError: unknown names
    args.apply_defaults()
    args.arguments.pop("num_threads", None)  # (per_call's: how the call runs, not what)
    prog, _, units, _, _ = (_emicp_setup if algorithm == "emicp" else _softassign_setup)(
        **args.arguments)
    if units is not None:  # the checks a call makes (a NaN input, units) before its answer
        units()
    passes = prog.passes
    return {"seconds": passes.estimate_s, "exact_seconds": passes.exact_estimate_s,
            "approximation": passes.info()}


@_first_use.first_use("softassign")
@_threads.per_call
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
    max_iterations: int | None = None,
    device: str | torch.device | None = None,
    source_lengths: Any = None,
    target_lengths: Any = None,
    approximation: str = "auto",
) -> RegistrationResult:
    """Softassign with deterministic annealing (Gold et al. 1998; Tamaki et al. Alg. 2).

    For each of ``temperatures`` values β = β₀ · beta_factor^k and each of
    ``iterations_per_temperature`` updates: K_ij = exp(−β (d_ij² − α)), d_ij =
    ||R x_i + t − y_j||, with a slack row and column of value ``outlier_weight``;
    ``sinkhorn_iterations`` rounds of row then column normalisation of M = diag(r) K diag(c)
    (r, c stored in logs); the weighted Horn step on S = X̂ᵀ M Ŷ (eqs. 18-20, 26).

    Args:
        source: ``(N, 3)`` or ``(B, N, 3)`` points moved onto the target (as :func:`emicp`).
        target: ``(M, 3)`` or ``(B, M, 3)`` fixed points.
        init: initial ``T_target_source``; identity if None.
        beta0: initial β (1/m²), > 0; default 1/(``SOFT_SIGMA`` ρ)² = 1/ρ².
        beta_factor: β multiplier per temperature, > 1 (Gold et al.'s 1.075).
        temperatures: number of β values (the seed's 100).
        alpha: squared distance (m²) below which a pair beats the outlier slot at low
            temperature; default (``SOFT_ALPHA`` ρ)² = (0.1 ρ)².
        iterations_per_temperature: pose updates per β (the seed's 5).
        sinkhorn_iterations: Sinkhorn rounds per update (the seed's 3).
        outlier_weight: value of the slack entries (> 0).
        criteria: as :func:`emicp` (in pose updates; the weights: M's column sums).
        max_iterations: as :func:`emicp`'s.
        device: compute device, as :func:`emicp`.
        source_lengths: ``(B,)`` valid source points of a padded batch.
        target_lengths: ``(B,)`` valid target points of a padded batch.
        approximation: as :func:`emicp`'s; "approximate": Sinkhorn on cells of 0.5σ
            (σ = 1/√(2β)) while they merge points, then per point with far pairs dropped
            (the bounds: :mod:`pointalign.kernels.soft.cpu`); the record adds the predicted
            phases and the passes run in each form.
        num_threads: CPU threads for this call (:func:`pointalign.threads`).

    Raises:
        ValueError: naming the argument, e.g. for 1/√β₀ or √α outside ``[1e-6 ρ, 1e6 ρ]``.

    Returns:
        :class:`RegistrationResult` (``iterations`` counts pose updates); ``stop_reason`` as
        :func:`emicp`'s: ``"schedule"``, ``"stalled"``, ``"pose_and_weights"``,
        ``"max_iterations"``, ``"degenerate"``, ``"no_correspondences"`` or
        ``"ambiguous"``.

    """
    return _run("softassign", time.perf_counter(), *_softassign_setup(
        source, target, init=init, beta0=beta0, beta_factor=beta_factor, alpha=alpha,
        temperatures=temperatures, iterations_per_temperature=iterations_per_temperature,
        sinkhorn_iterations=sinkhorn_iterations, outlier_weight=outlier_weight,
        criteria=criteria, max_iterations=max_iterations, device=device,
        source_lengths=source_lengths, target_lengths=target_lengths,
        approximation=approximation))


def _softassign_setup(source, target, *, init, beta0, beta_factor, temperatures, alpha,
                      iterations_per_temperature, sinkhorn_iterations, outlier_weight, criteria,
                      max_iterations, device, source_lengths, target_lengths, approximation):
    """Check Softassign's arguments: its program (with the run's passes), pair, inputs, length."""
    beta_factor = _validate.in_range(beta_factor, "beta_factor", 1.0, math.inf)
    n_temp, rounds, per_t = (_validate.integer(v, name, minimum=1) for name, v in (
        ("temperatures", temperatures), ("sinkhorn_iterations", sinkhorn_iterations),
        ("iterations_per_temperature", iterations_per_temperature)))
    w_out = _validate.positive(outlier_weight, "outlier_weight")
    criteria = _criteria(criteria, max_iterations)
    pair, units, given, rho = _prepare(
        source, target, init, device, source_lengths, target_lengths,
        {"beta0": -0.5, "alpha": 0.5}, beta0=beta0, alpha=alpha)
    _check_final_beta(beta_factor, n_temp, given.get("beta0"), rho)
    n_sched = n_temp * per_t
    settle = _settling(criteria, n_sched)

    def schedule() -> dict[str, Any]:  # the first problem's β per temperature run, and α
        rho = float(_rho(ksoft.centre(pair.target[:1], pair.target_lengths[:1]))[0])
        b0 = float(given["beta0"][0]) if "beta0" in given else 1.0 / (SOFT_SIGMA * rho) ** 2
        a0 = float(given["alpha"][0]) if "alpha" in given else (SOFT_ALPHA * rho) ** 2
        runs = min(-(-settle["n_iter"] // per_t), n_temp)
        return {"betas": [b0 * beta_factor ** k for k in range(runs)], "alpha": a0}
    passes = ksoft.prepare("softassign", pair.source, pair.target, pair.source_lengths,
                           pair.target_lengths, iterations=settle["n_iter"],
                           approximation=approximation, schedule=schedule, outlier_weight=w_out,
                           sinkhorn_rounds=rounds, per_temperature=per_t)
    return SoftassignProgram(**settle, temperatures=n_temp, per_temperature=per_t,
                             sinkhorn_rounds=rounds, beta_factor=beta_factor,
                             outlier_weight=w_out, passes=passes,
                             sigma=None if beta0 is not None else SOFT_SIGMA,
                             alpha=None if alpha is not None else SOFT_ALPHA), \
        pair, units, given, n_sched
