"""The stability of a final pose: how well the data determine it, measured once per call.

:func:`stability` gives :func:`pointalign._math.stability` of each problem's final pose
(the smallest eigenvalue of its point-to-plane information, scaled by the cloud's extent),
from which :func:`~pointalign.registration._edge.build_result` turns a converged stop on
data that do not determine the pose (a plane, a cylinder) into ``"ambiguous"``.
Point-to-plane methods read it from the final 6×6 their last step solved; point-to-point
ones (Horn's moments cannot see a slide along the surface) measure it here on a sample of
the final correspondences (:func:`point_information`), for a whole batch at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pointalign import _math, _validate
from pointalign.kernels import _loop, _np_math, features, normal_eq, upload
from pointalign.kernels import stability as probe
from pointalign.registration import _edge
from pointalign.search import policy
from pointalign.search.brute import BruteForceIndex
from pointalign.search.packed import PackedIndex

#: point-to-point's stability test (:func:`stability`): correspondences sampled per
#: problem, and the neighbours of their target normals (16, not ICP's ``NORMALS_K`` of 20: the
#: k-d tree's Triton kernel keeps k candidates in a register list padded to a power of
#: two, and k = 20 (padded to 32) searched the sample in 1.2 ms on an H100 against 0.5 ms)
STABILITY_SAMPLE = 2048
STABILITY_K = 16
#: the neighbours a sample whose STABILITY_K nearest do not span a plane looks at instead
#: (duplicated points: a cloud with every point repeated 8 times still shows its surface)
DUPLICATE_K = 64


def stability_sample(counts: np.ndarray, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each problem's sample of source rows (:func:`_draw_sample`), kept per sizes and device.

    The same sizes draw the same rows, so a repeated call (a loop over scans of one size)
    reuses the device tensors: no draw, no transfer. Read-only; the last four size sets are
    kept (a batch of 256 problems holds ~5 MB).
    """
    return _draw_sample(np.asarray(counts, dtype=np.int64).tobytes(), str(device))


@functools.lru_cache(maxsize=4)
def _draw_sample(counts_key: bytes, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each problem's sample of source rows: ``rows (B, S)`` int64 and ``valid (B, S)`` bool.

    Problem b draws ``min(n_b, STABILITY_SAMPLE)`` rows of its ``n_b`` source points with
    replacement from a generator seeded 0 (a random sample, not a stride: a stride can alias
    with the scan pattern of an ordered cloud, such as lidar rings, and pick a biased,
    near-degenerate subset; with replacement: O(sample) work, where a permutation of n
    costs ms at 1M). The draw depends only on n_b, so it is made once per distinct size;
    a smaller problem's tail is padding (row 0, ``valid`` False).
    """
    counts = np.frombuffer(counts_key, dtype=np.int64)
    B = counts.shape[0]
    S = int(min(int(counts.max()), STABILITY_SAMPLE))
    rows = torch.zeros(B, S, dtype=torch.int64)
    valid = torch.zeros(B, S, dtype=torch.bool)
    for n in np.unique(counts):
        s = int(min(int(n), STABILITY_SAMPLE))
        r = torch.randint(int(n), (s,), generator=torch.Generator().manual_seed(0))
        sel = torch.from_numpy(counts == n)
        rows[sel, :s] = r
        valid[sel, :s] = True
    both = torch.cat([rows, valid.to(torch.int64)], 1).to(device)  # one transfer
    return both[:, :S], both[:, S:].to(torch.bool)


def device_probe(pair: _edge.Pair) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """How a device program measures its final poses' stability itself: ``(k, rows, valid)``.

    Where :func:`~pointalign.registration._edge.measured_stability` would search every
    target by brute force (:func:`pointalign.search.policy.probe_index`) and the probe is
    device work alone (:func:`pointalign.kernels.stability.probe_runs_on_device`), a program
    whose last step runs the probe on its final poses (``soft_programs.Annealing``) saves
    the measurement's launches, transfer and wait after it: the sample
    (:func:`stability_sample`, ``rows``, ``valid`` ``(B, S)``) is then one of its inputs and
    ``k`` its neighbours. None elsewhere (a host tree, a tree for a large target).
    """
    k = int(min(STABILITY_K, int(pair.target_counts.max())))
    if not probe.probe_runs_on_device(pair.source, k):  # first: no index built for nothing
        return None
    n = 1 if pair.shared_target else pair.size
    with _validate.trusted():  # the prepared targets were checked
        if not all(isinstance(policy.probe_index(pair.target[b, : pair.target_counts[b]],
                                                 STABILITY_SAMPLE), BruteForceIndex)
                   for b in range(n)):
            return None
    rows, valid = stability_sample(pair.source_counts, pair.device)
    return k, rows, valid


def probed_stability(pair: _edge.Pair, sums: np.ndarray) -> np.ndarray | None:
    """:func:`pointalign._math.stability` from a program's probe ``sums (B, 23)``: ``(B,)``.

    None where a matched sample's neighbourhood spans no plane (every point repeated): the
    caller measures again (:func:`~pointalign.registration._edge.measured_stability`, whose
    search then looks at more neighbours).
    """
    if bool((sums[:, 22] > 0).any()):
        return None
    H = probe.information_matrix(torch.from_numpy(np.asarray(sums, dtype=np.float64)))
    return _np_math.stability(H.numpy(), pair.extent)


def _by_index(indexes: tuple) -> list[tuple[Any, list[int]]]:
    """Group problem numbers by their (shared or own) index object, in first-seen order."""
    groups: dict[int, tuple[Any, list[int]]] = {}
    for b, ix in enumerate(indexes):
        groups.setdefault(id(ix), (ix, []))[1].append(b)
    return list(groups.values())


@dataclass(frozen=True)
class _OneIndexProbe:
    """:func:`point_information`'s searches and sums where one index serves every problem.

    A fixed device program (:func:`pointalign.kernels._loop.run_program`: from a size's
    second call one CUDA graph instead of ~30 launches and their glue). Inputs: ``source
    (B, N, 3)``, the sample ``rows``, ``valid (B, S)``, ``T (B, 4, 4)`` float32, the one
    target ``table (M, 3)``, ``center (B, 3)`` float64. Output ``sums (B, 23)``
    (:func:`pointalign.kernels.stability.neighbourhood_information`).
    """

    index: Any
    k: int
    max_distance: float

    def __call__(self, inputs: _loop.Tensors, checkpoint: Any) -> _loop.Tensors:
        """Move the sample, find its correspondences and their neighbours, sum ``Σ J Jᵀ``."""
        rows, T, table = inputs["rows"], inputs["T"], inputs["table"]
        B, S = rows.shape
        x = torch.gather(inputs["source"], 1, rows[..., None].expand(-1, -1, 3))
        x = x @ T[:, :3, :3].transpose(1, 2) + T[:, None, :3, 3]
        j = self.index.nearest_within(x.reshape(-1, 3), self.max_distance).idx[:, 0]
        nb = self.index.knn(table[j.clamp_min(0)], self.k).idx.view(B, S, self.k)
        nearest = torch.where((j.view(B, S) >= 0) & inputs["valid"], j.view(B, S), -1)
        sums = probe.neighbourhood_information(table, nearest, nb, inputs["center"])
        assert sums is not None  # run only where the fused kernel applies
        return {"sums": sums}


def point_information(pair: _edge.Pair, indexes: tuple, T: np.ndarray,
                       max_distance: float) -> torch.Tensor:
    """Point-to-plane information ``(B, 6, 6)`` of every problem's final correspondences, sampled.

    For each problem b, at most :data:`STABILITY_SAMPLE` source points
    (:func:`stability_sample`) moved by ``T[b] (4, 4)``, their nearest target points y
    within the bound, and those points' normals n by PCA of their :data:`STABILITY_K`
    nearest target points: ``Σ J Jᵀ`` with ``J = [(y − c) × n, n]`` about the target
    centroid c. The whole batch at once: one query per distinct index (one in all for a
    shared target), then one kernel (kernels/stability ``neighbourhood_information``) or
    one PCA kernel and one batched product; one transfer; no synchronisation per problem.
    One index over one target (a single problem, a shared target): those steps are one
    fixed program (:class:`_OneIndexProbe`, a CUDA graph from a size's second call).
    """
    assert pair.centroid is not None  # set by prepare_pair
    dev, B = pair.source.device, pair.size
    rows, valid = stability_sample(pair.source_counts, dev)
    c = upload(pair.centroid, dtype=torch.float64, device=dev)  # no wait for the device
    Tf = upload(T, dtype=torch.float32, device=dev)
    # k: STABILITY_K, or a smaller target's size (its missing columns are -1: none)
    k = int(min(STABILITY_K, int(pair.target_counts.max())))
    if all(isinstance(ix, BruteForceIndex) for ix in indexes):
        # brute force over each problem's own target: the whole measurement in one pass
        # (kernels/stability), one transfer; samples without a plane look again below
        nt = 1 if pair.shared_target else B  # a shared target is an expanded view: once
        sums = probe.probe_information(pair.source, rows, valid, Tf, pair.target[:nt],
                                       pair.target_lengths[:nt], c,
                                       max_distance * max_distance, k).cpu()
        if not bool((sums[:, 22] > 0).any()):
            return probe.information_matrix(sums)
    groups = _by_index(indexes)
    if len(groups) == 1 and (pair.shared_target or B == 1) and probe.neighbourhood_fused(
            pair.target):  # one index over one target: the steps below as one program
        with _validate.trusted():
            host, _ = _loop.run_program(
                _OneIndexProbe(groups[0][0], k, float(max_distance)),
                dict(source=pair.source, rows=rows, valid=valid, T=Tf, table=pair.target[0],
                     center=c), device_outputs=False, eager_first=True)
        sums = torch.from_numpy(host["sums"])
        if not bool((sums[:, 22] > 0).any()):
            return probe.information_matrix(sums)
    S = rows.shape[1]
    x = torch.gather(pair.source, 1, rows[..., None].expand(-1, -1, 3))      # (B, S, 3)
    x = x @ Tf[:, :3, :3].transpose(1, 2) + Tf[:, None, :3, 3]
    M = pair.target.shape[1]
    # the target rows the searches answer in, as rows of one packed table (B·M, 3), or of
    # the one shared target
    table = pair.target[0] if pair.shared_target else pair.target.reshape(-1, 3)
    base = torch.zeros(B, 1, dtype=torch.int64, device=dev) if pair.shared_target else \
        (torch.arange(B, device=dev) * M)[:, None]
    j = torch.empty(B, S, dtype=torch.int64, device=dev)
    # each index's problems: all of them (one index) as a slice, else uploaded rows (a list
    # would be copied from pageable memory, which waits for the device)
    searches = [(ix, bs, slice(None) if len(bs) == B else upload(bs, dtype=torch.int64,
                                                                 device=dev))
                for ix, bs in groups]
    with _validate.trusted():
        for ix, bs, sel in searches:
            q = x[sel].reshape(-1, 3)
            j[sel] = ix.nearest_within(q, max_distance).idx[:, 0].view(len(bs), S)
        y = table[(j.clamp_min(0) + base).reshape(-1)].view(B, S, 3)
        nb = torch.full((B, S, k), -1, dtype=torch.int64, device=dev)
        for ix, bs, sel in searches:
            kb = int(min(STABILITY_K, int(pair.target_counts[bs[0]])))
            r = ix.knn(y[sel].reshape(-1, 3), kb).idx.view(len(bs), S, kb)
            nb[sel, :, :kb] = torch.where(r >= 0, r + base[sel, :, None], r)
        # on a GPU the rest is one kernel (kernels/stability), unless a matched sample's
        # neighbourhood spans no plane (counted in its column 22): then the steps below
        fused = probe.neighbourhood_information(
            table, torch.where((j >= 0) & valid, j + base, -1), nb, c)
        if fused is not None and not bool(((fused := fused.cpu())[:, 22] > 0).any()):
            return probe.information_matrix(fused)
        # a neighbourhood that does not span a plane (every point repeated: the k nearest are
        # copies of two or three points) defines no normal: such samples look again with
        # DUPLICATE_K neighbours, and those still without a plane constrain nothing (an
        # arbitrary normal would count as a constraint the data do not give)
        flat = ~_spans(table, nb)
        if bool(flat.any()):  # one synchronisation, at the end of the iteration
            kd = int(min(DUPLICATE_K, int(pair.target_counts.max())))
            wide = torch.full((B, S, kd), -1, dtype=torch.int64, device=dev)
            for ix, bs, sel in searches:
                kb = int(min(DUPLICATE_K, int(pair.target_counts[bs[0]])))
                if isinstance(ix, PackedIndex):  # its queries: every row, problem by problem
                    r = ix.knn(y[sel].reshape(-1, 3), kb).idx.view(len(bs), S, kb)
                    wide[sel, :, :kb] = torch.where(r >= 0, r + base[sel, :, None], r)
                    continue
                # only the flat samples look again (a wide k-NN costs more than the first)
                bt = upload(bs, dtype=torch.int64, device=dev)
                bi, si = flat[bt].nonzero(as_tuple=True)
                if bi.numel() == 0:
                    continue
                r = ix.knn(y[bt[bi], si], kb).idx
                wide[bt[bi], si, :kb] = torch.where(r >= 0, r + base[bt[bi]], r)
            wide = torch.where(flat[..., None], wide, torch.cat(
                [nb, nb.new_full((B, S, kd - k), -1)], -1) if kd > k else nb[..., :kd])
            nb, k = wide, kd
            flat = ~_spans(table, nb)
    # one fused kernel per device for every sample (a chain of small float64 ops per problem
    # cost ~2 ms on a GPU)
    normal = features.pca_normals(table, nb.view(B * S, k), centers=y.view(B * S, 3))
    normal = normal.to(torch.float64).view(B, S, 3)
    J = torch.cat([torch.linalg.cross(y.to(torch.float64) - c[:, None], normal), normal], -1)
    J = J * ((j >= 0) & valid & ~flat)[..., None]
    return (J.transpose(1, 2) @ J).cpu()


def _spans(table: torch.Tensor, nb: torch.Tensor) -> torch.Tensor:
    """Whether each neighbourhood ``nb (B, S, k)`` of rows of ``table`` spans a plane: ``(B, S)``.

    The library's degeneracy rule (:func:`pointalign._math.spans_plane`) on the float64
    covariance of the neighbours (``-1``: none), in chunks of rows (a batch of many problems
    keeps its temporaries to ~50 MB).
    """
    flat = nb.reshape(-1, nb.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.bool, device=nb.device)
    step = max(1, (1 << 21) // max(1, nb.shape[-1]))
    for s in range(0, flat.shape[0], step):
        ix = flat[s:s + step]
        ok = ix >= 0
        p = table[ix.clamp_min(0)].to(torch.float64) * ok[..., None]
        cnt = ok.sum(-1, keepdim=True).clamp_min(1)
        d = (p - (p.sum(-2) / cnt)[..., None, :]) * ok[..., None]
        out[s:s + step] = _math.spans_plane(d.transpose(-1, -2) @ d)
    return out.view(nb.shape[:-1])


def stability(pair: _edge.Pair, indexes: tuple, T: np.ndarray, sums: np.ndarray | None,
              plane: bool, max_distance: float) -> np.ndarray:
    """:func:`pointalign._math.stability` of each problem's final pose, ``(B,)`` float64.

    Point-to-plane: from the final sums (the 6×6 the last step solved, no extra work),
    summed about the local origin.
    Point-to-point: Horn's moments cannot see a slide along the surface, so the
    point-to-plane information of a sample of the final correspondences is measured, for
    the whole batch at once (:func:`point_information`).
    """
    assert pair.centroid is not None and pair.extent is not None  # set by prepare_pair
    if plane:  # (NumPy: a few 6×6 on the host, ~1 µs an operation against torch's ~5-10)
        assert sums is not None  # point-to-plane reads the final sums
        # the sums are about the local origin; the rule reads H about the target's centroid
        H = _np_math.shift_information(normal_eq.unpack_hessian(sums)[0], -pair.centroid)
    else:
        H = point_information(pair, indexes, T, max_distance).numpy()
    return _np_math.stability(H, pair.extent)
