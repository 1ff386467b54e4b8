"""Stray points (features/outliers.py): the batched stray fractions against each cloud alone.

``stray_fractions_many`` answers every cloud's sample by one sort over ``(cloud, cell)`` and
one capped count (``kernels.grid.count_within``, tested against a brute-force count in
``tests/kernels/test_grid.py``); its counts use the search contract's squared distance on
each cloud's own coordinates, so on the "torch" and "cpu" backends they equal the per-cloud
index's bit for bit (and so do the fractions, rounded as ``Tensor.mean`` rounds them on the
device). On "triton" the kernels may fuse the distance's multiply-adds: a neighbour within
~2 float32 ulps of v may count differently there (not seen on these clouds).
"""

from __future__ import annotations

import pytest
import torch

from pointalign import datasets
from pointalign.features import outliers
from pointalign.features.downsample import auto_voxel_size_many, group_clouds
from pointalign.kernels.grid import reference as grid_ref


def _clouds(device: str) -> list[torch.Tensor]:
    bunny = datasets.load_bunny("bun000")
    out = []
    for k, (n, s, o, frac) in enumerate(((2000, 1.0, 0.0, 0.05), (1500, 10.0, 5.0, 0.0),
                                         (3000, 0.01, -1.0, 0.2), (2500, 100.0, 0.0, 0.02))):
        p = datasets.make_hard_pair(datasets.random_subsample(bunny, n, seed=k),
                                    outlier_fraction=frac, seed=k)
        out += [p.source * s + o, p.target * s + o]
    g = torch.Generator().manual_seed(1)
    out += [datasets.random_subsample(bunny, 2000, seed=9), torch.rand(5, 3, generator=g),
            torch.rand(6, 3, generator=g), bunny]
    return [c.to(torch.float32).to(device) for c in out]


@pytest.mark.parametrize("budget", [None, 3000])
def test_stray_fractions_many_equal_each_alone(backend, budget, monkeypatch):
    """Every cloud's fraction equals stray_fraction's (its own index at v), at the automatic
    edge and at a coarser one; in one pass and in several (a small candidate budget)."""
    if budget is not None:
        monkeypatch.setattr(grid_ref, "COUNT_BUDGET", budget)
    clouds = _clouds(backend.device)
    group = group_clouds(clouds)
    auto = auto_voxel_size_many(group, 5000)
    for vs in (auto, [2.5 * v for v in auto]):
        got = outliers.stray_fractions_many(group, vs)
        want = [outliers.stray_fraction(c, v) for c, v in zip(clouds, vs, strict=True)]
        assert got == want
    assert any(f >= outliers.MIN_STRAY_FRACTION for f in got)


def test_capped_counts_stop_in_crowded_cells(backend):
    """_within_many with a cap: the exact count below the cap, the cap elsewhere (a lidar
    scan's crowded cells stop comparing there), against a brute-force count per cloud."""
    g = torch.Generator().manual_seed(3)
    dense = torch.rand(3000, 3, generator=g) * 0.05            # ~hundreds per v-cell
    sparse = torch.rand(400, 3, generator=g) * 4.0 + 1.0
    clouds = [torch.cat([dense, sparse]).to(backend.device), (sparse * 0.5).to(backend.device)]
    group = group_clouds(clouds)
    q = torch.arange(group.points.shape[0], device=backend.device)
    for v, cap in ((0.02, 5), (0.3, 17)):
        exact = []
        for c in clouds:  # the contract's sum, left to right (as every backend adds it)
            e = c[:, None] - c[None]
            d2 = e[..., 0] * e[..., 0] + e[..., 1] * e[..., 1] + e[..., 2] * e[..., 2]
            exact.append((d2 <= torch.tensor(v * v, dtype=c.dtype)).sum(1))
        exact = torch.cat(exact)
        assert bool((exact >= cap).any()) and bool((exact < cap).any())
        got, overflow = outliers._within_many(*outliers._arrays(group, [v, v]), q, group.owner,
                                              cap=cap)
        assert not bool(overflow)
        assert torch.equal(got, exact.clamp_max(cap))


def test_mean_rounded_as_torch(device):
    """_mean_as_torch(s, n) is ``float(x.float().mean())`` of n 0/1 values holding s ones."""
    dev = torch.device(device)
    for n in (6, 7, 50, 999, 2000, 4096, 4097, 8191):
        for s in sorted({0, 1, n // 50, n // 50 + 1, n // 7, n // 2, n - 1, n}):
            x = torch.zeros(n, device=dev)
            x[:s] = 1
            assert outliers._mean_as_torch(s, n, dev) == float(x.float().mean()), (s, n)


@pytest.mark.parametrize("budget", [None, 3000])
def test_dense_masks_many_equal_each_alone(backend, budget, monkeypatch):
    """Every cloud's mask equals dense_mask's (its own index at v; the median rule), at the
    automatic edge, a coarser and a finer one (where the median rule keeps every point);
    the kept counts are the masks' sums."""
    if budget is not None:
        monkeypatch.setattr(grid_ref, "COUNT_BUDGET", budget)
    clouds = _clouds(backend.device)[:-1]  # not the full scan: the reference is slow
    group = group_clouds(clouds)
    auto = auto_voxel_size_many(group, 5000)
    dropped = []
    for vs in (auto, [2.5 * v for v in auto], [0.3 * v for v in auto]):
        keep, kept = outliers.dense_masks_many(group, vs)
        dropped.append(not bool(keep.all()))
        for c, v, m, k in zip(clouds, vs, torch.split(keep, group.sizes), kept, strict=True):
            want = outliers.dense_mask(c, v)
            assert torch.equal(m, want)
            assert k == int(want.sum())
    assert dropped == [True, True, False]  # strays dropped; too fine: the median keeps all


def test_robust_voxel_sizes_many_equal_each_alone(backend):
    """robust_voxel_sizes_many: robust_voxel_size's edge of every cloud, bit for bit (clean
    clouds keep their automatic edge, contaminated ones move), with and without start."""
    clouds = _clouds(backend.device)[:-1]
    for target in (5000, 300):
        want = [outliers.robust_voxel_size(c, target) for c in clouds]
        assert outliers.robust_voxel_sizes_many(clouds, target) == want
        start = auto_voxel_size_many(group_clouds(clouds), target)
        assert outliers.robust_voxel_sizes_many(clouds, target, start=start) == want
        assert any(w != s for w, s in zip(want, start, strict=True))
    assert outliers.robust_voxel_sizes_many([]) == []
