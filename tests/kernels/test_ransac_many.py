"""kernels.ransac's batched entry points (register_many's global stage), by backend.

* ``feature_matches_many``: each problem's forward (k nearest) and backward (nearest)
  feature matches equal ``feature_matches`` of that problem alone, up to cdist's rounding
  (batched and unbatched cdist may round differently: a neighbour may differ only between
  near-equidistant rows; distances to 1e-4 relative); padding rows are (inf, -1).
* ``second_order_of_points_many``: equal, bit for bit, to ``second_order_of_points`` of
  each problem's valid rows (the counts are exact integers), zero in the padding.
"""

from __future__ import annotations

import math

import torch

from pointalign.kernels import ransac as K


def _problems(device, sizes=((40, 55), (17, 60), (60, 9)), d=33, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = [torch.rand(n, d, generator=g) for n, _ in sizes]
    tgt = [torch.rand(m, d, generator=g) for _, m in sizes]
    pad = torch.nn.utils.rnn.pad_sequence
    n = torch.tensor([n for n, _ in sizes])
    m = torch.tensor([m for _, m in sizes])
    return ([x.to(device) for x in src], [x.to(device) for x in tgt],
            pad(src, batch_first=True).to(device), pad(tgt, batch_first=True).to(device),
            n.to(device), m.to(device))


def test_feature_matches_many_equal_each_problems(backend):
    src, tgt, S, T, n, m = _problems(backend.device)
    got = K.feature_matches_many(S, T, n, m, 2, backward=True)
    assert got.back_idx is not None and got.back_dists is not None
    for b, (s, t) in enumerate(zip(src, tgt, strict=True)):
        one = K.feature_matches(s, t, 2, backward=True)
        assert one.back_idx is not None and one.back_dists is not None
        nb, mb = s.shape[0], t.shape[0]
        assert float((got.idx[b, :nb] != one.idx).float().mean()) < 0.02  # near-ties only
        torch.testing.assert_close(got.dists[b, :nb], one.dists, rtol=1e-4, atol=1e-5)
        assert bool((got.idx[b, nb:] == -1).all()) and bool(torch.isinf(got.dists[b, nb:]).all())
        assert float((got.back_idx[b, :mb] != one.back_idx).float().mean()) < 0.02
        torch.testing.assert_close(got.back_dists[b, :mb], one.back_dists, rtol=1e-4,
                                   atol=1e-5)
        assert int(got.idx[b, :nb].max()) < mb and int(got.back_idx[b, :mb].max()) < nb


def test_second_order_of_points_many_equals_each_problems(backend):
    g = torch.Generator().manual_seed(1)
    counts = [50, 3, 0, 37]
    C = max(counts)
    S = torch.zeros(len(counts), C, 3)
    T = torch.zeros(len(counts), C, 3)
    for b, c in enumerate(counts):
        S[b, :c] = torch.rand(c, 3, generator=g) * 10
        ang = 0.3 * b
        R = torch.tensor([[math.cos(ang), -math.sin(ang), 0], [math.sin(ang), math.cos(ang), 0],
                          [0, 0, 1.0]])
        T[b, :c] = S[b, :c] @ R.T + 0.05 * torch.rand(c, 3, generator=g)
        T[b, c // 2:c] = torch.rand(c - c // 2, 3, generator=g) * 10  # outliers
    dev = backend.device
    got = K.second_order_of_points_many(S.to(dev), T.to(dev), torch.tensor(counts).to(dev),
                                        0.2).cpu()
    for b, c in enumerate(counts):
        if c:
            one = K.second_order_of_points(S[b, :c].to(dev), T[b, :c].to(dev), 0.2).cpu()
            assert torch.equal(got[b, :c, :c], one)
        assert not bool(got[b, c:].any()) and not bool(got[b, :, c:].any())
