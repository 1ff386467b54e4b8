"""PyTorch spec of the stability probe (:func:`pointalign.kernels.stability.probe_information`)."""

from __future__ import annotations

import torch

from pointalign import _math
from pointalign.kernels.features.reference import neighbour_covariances, pca_normals_reference
from pointalign.kernels.knn.reference import knn_reference
from pointalign.kernels.normal_eq.reference import TRIU6


def probe_information_reference(source: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
                                transform: torch.Tensor, target: torch.Tensor,
                                target_counts: torch.Tensor, center: torch.Tensor,
                                max_distance_sq: float | torch.Tensor, k: int
                                ) -> torch.Tensor:
    """Problem by problem: the searches by brute force, the rest in float64. ``(B, 23)``."""
    B = rows.shape[0]
    out = torch.zeros(B, 23, dtype=torch.float64, device=source.device)
    for b in range(B):
        tb = b if target.shape[0] == B else 0
        y_all = target[tb, : int(target_counts[tb])]
        r = rows[b][valid[b]]
        if r.numel() == 0 or y_all.shape[0] == 0:
            continue
        Tb = transform[b].to(source.dtype)
        x = source[b, r] @ Tb[:3, :3].T + Tb[:3, 3]
        j = knn_reference(x, y_all, 1, float(max_distance_sq))[1][:, 0]
        j = j[j >= 0]
        if j.numel():
            out[b] = _sums(y_all, j, knn_reference(y_all[j], y_all, k)[1], center[b])
    return out


def neighbourhood_information_reference(table: torch.Tensor, nearest: torch.Tensor,
                                        neighbours: torch.Tensor, center: torch.Tensor
                                        ) -> torch.Tensor:
    """Problem by problem from the given rows, in float64. ``(B, 23)``."""
    B = nearest.shape[0]
    out = torch.zeros(B, 23, dtype=torch.float64, device=table.device)
    for b in range(B):
        ok = nearest[b] >= 0
        if bool(ok.any()):
            out[b] = _sums(table, nearest[b][ok], neighbours[b][ok], center[b])
    return out


def _sums(pts: torch.Tensor, j: torch.Tensor, nb: torch.Tensor, c: torch.Tensor
          ) -> torch.Tensor:
    """One problem's 23 sums: samples at rows ``j (S,)`` of ``pts``, their ``nb (S, k)``."""
    iu = torch.tensor([i for i, _ in TRIU6]), torch.tensor([j for _, j in TRIU6])
    y = pts[j]
    flat = ~_math.spans_plane(neighbour_covariances(pts.double(), nb))
    n = pca_normals_reference(pts, nb, centers=y).double()
    yc = y.double() - c.to(torch.float64)
    J = torch.cat([torch.linalg.cross(yc, n), n], 1) * (~flat)[:, None]
    out = torch.zeros(23, dtype=torch.float64, device=pts.device)
    out[:21] = (J.T @ J)[iu]
    out[21] = float((~flat).sum())
    out[22] = float(flat.sum())
    return out
