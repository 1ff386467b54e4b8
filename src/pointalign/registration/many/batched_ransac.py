"""register_many's global stage, batched: RANSAC and the graph's proposals of a group.

:func:`global_many`: features padded to ``(B, n, 33)``, matched by one batched brute
force (:func:`pointalign.kernels.ransac.feature_matches_many`); RANSAC's rounds for
every pair at once (the samples of all pairs in one tensor; the T(d,d) test and the
scores by one packed index over the targets, each query row naming its pair; the
per-pair selections as padded ``(B, ·)`` sorts); the compatibility-graph proposals of
:mod:`~pointalign.registration.robust` batched over pairs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from pointalign import estimate
from pointalign.kernels import _loop, upload
from pointalign.kernels import ransac as _kr
from pointalign.kernels.horn import weighted_horn
from pointalign.kernels.soft import weighted_horn as soft_weighted_horn
from pointalign.registration._edge import MIN_FITNESS, StopReason
from pointalign.registration.many.batched import _packed, _pad, _score
from pointalign.registration.options import Options as _Options
from pointalign.registration.pipeline import CORRESPONDENCES, Scales
from pointalign.registration.ransac import required_hypotheses
from pointalign.registration.ransac_programs import key as _key
from pointalign.registration.result import RegistrationResult
from pointalign.search.packed import PackedIndex

#: pairs per chunk of the compatibility graphs (each ``(C, C)`` float32, C <= 1,000)
GRAPH_PAIRS = 32
#: seeds and consensus size of :func:`pointalign.registration.robust.compatibility_hypotheses`
_SEEDS, _K, _ROUNDS = 64, 32, 2


class PairGlobal(NamedTuple):
    """One pair's global result: RANSAC's, and the candidates (None: nothing to refine)."""

    glob: RegistrationResult
    candidates: torch.Tensor | None


def global_many(sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                source_features: Sequence[torch.Tensor],
                target_features: Sequence[torch.Tensor], scales: Scales, opts: _Options,
                clock: _loop.Clock) -> list[PairGlobal]:
    """RANSAC and (``robust``) the graph's proposals of B pairs, batched.

    Args:
        sources: B ``(n_b, 3)`` float32 downsampled source clouds.
        targets: B ``(m_b, 3)`` float32 downsampled target clouds.
        source_features: their ``(n_b, 33)`` FPFH.
        target_features: ``(m_b, 33)``.
        scales: the lengths (``correspondence``: RANSAC's bound), one for the group.
        opts: the checked options (RANSAC's among :data:`.batched.BATCHED_RANSAC_OPTIONS`).
        clock: the stage clock.

    Returns:
        B :class:`PairGlobal`: what ``pipeline._global`` returns per pair (RANSAC's result
        in the scaled frame, the candidates ``(H, 4, 4)`` float64, RANSAC's first).

    """
    ro = dict(opts.ransac_options)
    mutual, ratio = bool(ro.get("mutual", False)), ro.get("ratio_test")
    sim = float(ro.get("triangle_similarity", 0.2))
    tdd, conf = int(ro.get("tdd_points", 32)), float(ro.get("confidence", 0.999))
    h = int(opts.hypotheses)
    max_h = int(ro.get("max_hypotheses") or 4 * h)
    max_val, top = int(ro.get("max_validations", 32)), int(ro.get("refine_top", 4))
    iters = int(ro.get("refine_iterations", 5)) if ro.get("local_refinement", True) else 0
    dist = scales.correspondence
    B = len(sources)
    S, n_src = _pad(sources)
    Tg, n_tgt = _pad(targets)
    SF, _ = _pad(source_features)
    TF, _ = _pad(target_features)
    dev, N = S.device, S.shape[1]
    ns, nt = [int(x.shape[0]) for x in sources], [int(x.shape[0]) for x in targets]
    index = _packed(Tg, nt, dist)
    clock.lap("ransac_index")
    use_ratio = opts.robust or ratio is not None
    k = 2 if use_ratio and min(nt) >= 2 else 1
    fm = _kr.feature_matches_many(SF, TF, n_src, n_tgt, k, backward=opts.robust or mutual)
    cols = torch.arange(N, device=dev)
    real = cols[None] < n_src[:, None]                                           # (B, N)
    keep = real.clone()
    if ratio is not None and k == 2:
        keep &= fm.dists[..., 0].sqrt() < float(ratio) * fm.dists[..., 1].sqrt()
    if mutual:
        assert fm.back_idx is not None
        back = torch.gather(fm.back_idx[..., 0], 1, fm.idx[..., 0].clamp_min(0))
        keep &= back == cols[None]
    # each pair's correspondences first, in increasing source row (as ``_correspond``)
    corr_i = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices     # (B, N)
    corr_j = torch.gather(fm.idx[..., 0].clamp_min(0), 1, corr_i)
    n_corr_t = keep.sum(1)
    bi = torch.arange(B, device=dev)[:, None]
    cs, ct = S[bi, corr_i], Tg[bi, corr_j]                                       # (B, N, 3)
    clock.lap("correspondences")
    g = torch.Generator(device=dev)
    g.manual_seed(int(opts.seed))
    d_max = min(tdd, N)
    perm = torch.where(real, torch.rand(B, N, generator=g, device=dev), 2.0).argsort(1)
    subset = S[bi, perm[:, :d_max]]                                              # (B, d, 3)
    n_sub = n_src.clamp_max(d_max)
    eye = torch.eye(4, dtype=torch.float64, device=dev)
    pool_T = eye.expand(B, top, 4, 4).clone()
    pool_c = torch.zeros(B, top, dtype=torch.int64, device=dev)
    pool_sq = torch.zeros(B, top, dtype=torch.float64, device=dev)
    pool_key = torch.full((B, top), -math.inf, dtype=torch.float64, device=dev)
    n_corr = n_corr_t.tolist()
    active = [c >= 3 for c in n_corr]
    drawn = [0] * B
    stop = [StopReason.MAX_HYPOTHESES if a else StopReason.TOO_FEW_CORRESPONDENCES
            for a in active]
    done = 0
    while done < max_h and any(active):
        hh = min(h, max_h - done)
        done += hh
        act = upload([b for b in range(B) if active[b]], dtype=torch.int64, device=dev)
        na = int(act.shape[0])
        for b in range(B):
            drawn[b] += hh if active[b] else 0
        r = torch.rand(na, hh, 3, generator=g, device=dev)
        triples = (r * n_corr_t[act][:, None, None]).long().minimum(
            n_corr_t[act][:, None, None] - 1)
        ab = act[:, None, None]
        # rows of the pairs' correspondence tables laid end to end
        est = _kr.triangle_motions(cs.reshape(-1, 3), ct.reshape(-1, 3),
                                   (ab * N + triples).reshape(-1, 3), sim,
                                   estimate.DEGENERACY_EPS)
        clock.lap("triangle")
        if est.rows.numel():
            prob = act[est.rows // hh]
            c_sub, _, _ = _score(est.T, prob, subset, n_sub, index, dist)
            c_sub = torch.where(est.valid, c_sub, -1)
            best = torch.full((B,), -1, dtype=torch.int64, device=dev).scatter_reduce(
                0, prob, c_sub, "amax")
            passed = (c_sub >= 1) & (2 * c_sub >= best[prob])
            # per pair: passed first by T(d,d) count (hypothesis order on ties)
            o1 = torch.sort(torch.where(passed, c_sub, -1), descending=True,
                            stable=True).indices
            o2 = torch.sort(prob[o1], stable=True).indices
            order = o1[o2]
            counts = torch.zeros(B, dtype=torch.int64, device=dev).index_add_(  # no sync
                0, prob, torch.ones_like(prob))
            first = torch.cumsum(counts, 0) - counts
            rank = torch.arange(order.shape[0], device=dev) - first[prob[order]]
            take = passed[order] & (rank < max_val)
            sel, slot = order[take], rank[take]
            clock.lap("tdd")
            T = est.T[sel]
            P = prob[sel]
            c, sq, _ = _score(T, P, S, n_src, index, dist)
            new_T = eye.expand(B, max_val, 4, 4).clone()
            new_c = torch.zeros(B, max_val, dtype=torch.int64, device=dev)
            new_sq = torch.zeros(B, max_val, dtype=torch.float64, device=dev)
            new_key = torch.full((B, max_val), -math.inf, dtype=torch.float64, device=dev)
            new_T[P, slot], new_c[P, slot], new_sq[P, slot] = T, c, sq
            new_key[P, slot] = _key(c, sq, dist)
            allk = torch.cat([pool_key, new_key], 1)
            o = torch.sort(allk, dim=1, descending=True, stable=True).indices[:, :top]
            pool_T = torch.gather(torch.cat([pool_T, new_T], 1), 1,
                                  o[..., None, None].expand(-1, -1, 4, 4))
            pool_c = torch.gather(torch.cat([pool_c, new_c], 1), 1, o)
            pool_sq = torch.gather(torch.cat([pool_sq, new_sq], 1), 1, o)
            pool_key = torch.gather(allk, 1, o)
            clock.lap("score")
        explained = _explained(pool_T[:, 0], cs, ct, n_corr_t, dist)
        has, n_expl = torch.stack([torch.isfinite(pool_key[:, 0]).long(), explained]).tolist()
        for b in range(B):
            if active[b] and has[b]:
                if drawn[b] >= required_hypotheses(n_expl[b] / n_corr[b], conf):
                    active[b], stop[b] = False, StopReason.CONFIDENCE
        clock.lap("score")
    found = torch.isfinite(pool_key[:, 0])
    if iters > 0:
        pool_T, pool_c, pool_sq, pool_key = _refine(pool_T, pool_c, pool_sq, pool_key, S,
                                                    Tg, n_src, index, dist, iters)
        clock.lap("refine")
    explained = _explained(pool_T[:, 0], cs, ct, n_corr_t, dist)
    found_h, cnt_h, sq_h, expl_h = (x.tolist() for x in (found, pool_c[:, 0], pool_sq[:, 0],
                                                         explained))
    T_best = pool_T[:, 0]
    T_host = T_best.cpu().numpy()
    globs = []
    for b in range(B):
        if not found_h[b]:
            reason = stop[b] if stop[b] == StopReason.TOO_FEW_CORRESPONDENCES \
                else StopReason.NO_HYPOTHESIS
            globs.append(_result(np.eye(4), 0.0, math.inf, drawn[b], reason, n_corr[b], 0.0,
                                 eye))
            continue
        fit = cnt_h[b] / ns[b]
        rmse = math.sqrt(sq_h[b] / cnt_h[b]) if cnt_h[b] else math.inf
        globs.append(_result(T_host[b], fit, rmse, drawn[b], stop[b], n_corr[b],
                             expl_h[b] / n_corr[b], T_best[b]))
    clock.lap("ransac")
    if opts.refine == "none":
        return [PairGlobal(gl, None) for gl in globs]
    props = _proposals(S, Tg, n_src, fm, dist) if opts.robust else [None] * B
    clock.lap("robust")
    out = []
    for b in range(B):
        if not found_h[b]:
            out.append(PairGlobal(globs[b], None))
            continue
        tt = globs[b].transformation_tensor
        assert tt is not None
        H = props[b]
        out.append(PairGlobal(globs[b], tt[None] if H is None else torch.cat([tt[None], H])))
    return out


def _result(T: np.ndarray, fitness: float, rmse: float, drawn: int, reason: StopReason,
            n_corr: int, w: float, T_dev: torch.Tensor) -> RegistrationResult:
    """One pair's RANSAC result (the rules of ``_edge.build_result`` that apply here)."""
    conv = bool(reason.converged) and fitness >= MIN_FITNESS
    if bool(reason.converged) and not conv:
        reason = StopReason.LOW_FITNESS
    return RegistrationResult(
        transformation=np.asarray(T, dtype=np.float64), fitness=fitness, rmse=rmse,
        iterations=drawn, converged=conv, stop_reason=str(reason),
        info={"correspondences": n_corr, "correspondence_inlier_ratio": w, "hypotheses": drawn},
        transformation_tensor=T_dev.to(torch.float64))


def _explained(T: torch.Tensor, cs: torch.Tensor, ct: torch.Tensor, n_corr: torch.Tensor,
               dist: float) -> torch.Tensor:
    """Per pair, the correspondences ``cs → ct (B, N, 3)`` that ``T (B, 4, 4)`` maps within."""
    res = (_kr.transform_points(T, cs) - ct).norm(dim=2)
    ok = (res <= dist) & (torch.arange(cs.shape[1], device=cs.device)[None] < n_corr[:, None])
    return ok.sum(1)


def _refine(T: torch.Tensor, c: torch.Tensor, sq: torch.Tensor, key: torch.Tensor,
            S: torch.Tensor, Tg: torch.Tensor, n_src: torch.Tensor, index: PackedIndex,
            dist: float, iterations: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lo-RANSAC of every pair's pool ``T (B, R, 4, 4)`` (``ransac_programs.Refined``, batched).

    Empty slots (key -inf) are never updated; returns the pools sorted by key, best first.
    """
    B, R = key.shape
    prob = torch.arange(B, device=S.device)[:, None].expand(B, R).reshape(-1)
    Tf, cf, sqf, kf = T.reshape(-1, 4, 4), c.reshape(-1), sq.reshape(-1), key.reshape(-1)
    real = torch.isfinite(kf)
    _, _, idx = _score(Tf, prob, S, n_src, index, dist, with_matches=True)
    assert idx is not None
    src_b = S[prob]
    for _ in range(iterations):
        tgt = Tg[prob[:, None], idx.clamp_min(0)]
        T_new, valid = weighted_horn(src_b, tgt, (idx >= 0).to(S.dtype))
        c_new, sq_new, idx_new = _score(T_new, prob, S, n_src, index, dist, with_matches=True)
        assert idx_new is not None
        k_new = _key(c_new, sq_new, dist)
        better = real & valid & (k_new > kf)
        if not bool(better.any()):
            break
        Tf = torch.where(better[:, None, None], T_new, Tf)
        cf, sqf = torch.where(better, c_new, cf), torch.where(better, sq_new, sqf)
        kf = torch.where(better, k_new, kf)
        idx = torch.where(better[:, None], idx_new, idx)
    key = kf.view(B, R)
    o = torch.sort(key, dim=1, descending=True, stable=True).indices
    return (torch.gather(Tf.view(B, R, 4, 4), 1, o[..., None, None].expand(-1, -1, 4, 4)),
            torch.gather(cf.view(B, R), 1, o), torch.gather(sqf.view(B, R), 1, o),
            torch.gather(key, 1, o))


def _proposals(S: torch.Tensor, Tg: torch.Tensor, n_src: torch.Tensor,
               fm: _kr.FeatureMatches, tau: float) -> list[torch.Tensor | None]:
    """Propose the compatibility graph's hypotheses of every pair (``robust``, batched).

    ``rank_correspondences`` (mutual matches first, then by Lowe's ratio; at most
    :data:`~pointalign.registration.pipeline.CORRESPONDENCES`) and
    ``compatibility_hypotheses`` of each pair, in chunks of :data:`GRAPH_PAIRS` pairs.
    Returns per pair ``(H, 4, 4)`` float64, most supported first, or None (fewer than 3
    correspondences).
    """
    B, N = S.shape[0], S.shape[1]
    dev = S.device
    cols = torch.arange(N, device=dev)
    d, j = fm.dists, fm.idx
    assert fm.back_idx is not None and d.shape[2] >= 2
    back = torch.gather(fm.back_idx[..., 0], 1, j[..., 0].clamp_min(0))
    mutual = back == cols[None]
    ratio = (d[..., 0].clamp_min(0).sqrt() / d[..., 1].clamp_min(1e-30).sqrt()).clamp(0, 1)
    key = ratio.to(torch.float64) + (~mutual).to(torch.float64) * 2.0
    key = torch.where(cols[None] < n_src[:, None], key, math.inf)
    C = min(CORRESPONDENCES, N)
    ci = torch.argsort(key, dim=1, stable=True)[:, :C]                          # (B, C)
    cj = torch.gather(j[..., 0].clamp_min(0), 1, ci)
    bi = torch.arange(B, device=dev)[:, None]
    src, tgt = S[bi, ci], Tg[bi, cj]
    cnt = n_src.clamp_max(C)
    cnt_h = cnt.tolist()
    out: list[torch.Tensor | None] = [None] * B
    for lo in range(0, B, GRAPH_PAIRS):
        hi = min(B, lo + GRAPH_PAIRS)
        for b, T in zip(range(lo, hi), _graph_hypotheses(src[lo:hi], tgt[lo:hi],
                                                         cnt[lo:hi], cnt_h[lo:hi], tau),
                        strict=True):
            out[b] = T
    return out


def _graph_hypotheses(src: torch.Tensor, tgt: torch.Tensor, cnt: torch.Tensor,
                      cnt_h: list[int], tau: float) -> list[torch.Tensor | None]:
    """``robust.compatibility_hypotheses`` of G pairs ``src, tgt (G, C, 3)``, ``cnt`` rows."""
    G, C = src.shape[0], src.shape[1]
    dev = src.device
    Sm = _kr.second_order_of_points_many(src, tgt, cnt, tau)                  # (G, C, C)
    ns = min(_SEEDS, C)
    valid = torch.arange(C, device=dev)[None] < cnt[:, None]                    # (G, C)
    # padding rows last: a pair's first min(ns, cnt) seeds are its own
    seed = torch.topk(torch.where(valid, Sm.sum(2), -1.0), ns, dim=1).indices   # (G, ns)
    gi = torch.arange(G, device=dev)[:, None]
    rows = Sm[gi, seed]                                                          # (G, ns, C)
    mx = rows.amax(dim=(1, 2))
    rows[gi, torch.arange(ns, device=dev)[None], seed] = (mx + 1)[:, None]
    kk = min(_K, C)
    member_s, member = torch.topk(rows, kk, dim=2)
    w = (member_s > 0).to(torch.float32).reshape(G * ns, kk)
    gs = gi[..., None]
    T, _ = soft_weighted_horn(src[gs, member].reshape(G * ns, kk, 3),
                              tgt[gs, member].reshape(G * ns, kk, 3), w)
    vrow = valid[:, None].expand(G, ns, C).reshape(G * ns, C)
    s_all = src[:, None].expand(G, ns, C, 3).reshape(G * ns, C, 3)
    t_all = tgt[:, None].expand(G, ns, C, 3).reshape(G * ns, C, 3)
    for _ in range(_ROUNDS):
        res = (_kr.transform_points(T, s_all) - t_all).norm(dim=2)
        inl = ((res < tau) & vrow).to(torch.float32)
        T_new, ok = soft_weighted_horn(s_all, t_all, inl)
        ok &= inl.sum(1) >= 3
        T = torch.where(ok[:, None, None], T_new, T)
    support = (((_kr.transform_points(T, s_all) - t_all).norm(dim=2) < tau) & vrow).sum(1)
    seed_ok = torch.arange(ns, device=dev)[None] < cnt[:, None].clamp_max(ns)  # (G, ns)
    support = torch.where(seed_ok.reshape(-1), support, -1).view(G, ns)
    order = torch.argsort(support, dim=1, descending=True, stable=True)
    T = torch.gather(T.view(G, ns, 4, 4), 1, order[..., None, None].expand(-1, -1, 4, 4))
    return [T[g, :min(ns, cnt_h[g])] if cnt_h[g] >= 3 else None for g in range(G)]
