"""PyTorch spec of the local frame (:func:`pointalign.kernels.frame.local_frame`)."""

from __future__ import annotations

import numpy as np
import torch


def mean_rows(pts: torch.Tensor, lengths: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
    """``(B, 3)`` mean of each entry's first ``lengths[b]`` rows, in the points' dtype.

    ``counts``: the lengths on the host (all full: a plain mean, no mask).
    """
    if bool((counts == pts.shape[1]).all()):
        return pts.mean(1)
    rows = torch.arange(pts.shape[1], device=pts.device)[None, :, None] < lengths[:, None, None]
    return (pts * rows).sum(1) / lengths[:, None].clamp_min(1).to(pts.dtype)


def _radius(p64: torch.Tensor, c: torch.Tensor, lengths: torch.Tensor,
            counts: np.ndarray) -> torch.Tensor:
    """``(B, 1)`` RMS distance of each entry's rows from its centre ``c (B, 3)``, float64."""
    d2 = ((p64 - c[:, None]) ** 2).sum(-1, keepdim=True)
    return mean_rows(d2.expand(-1, -1, 3), lengths, counts)[:, :1].sqrt()


def local_frame_reference(source: torch.Tensor, source_lengths: torch.Tensor,
                          source_counts: np.ndarray, target: torch.Tensor,
                          target_lengths: torch.Tensor, target_counts: np.ndarray,
                          local: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 means by ``torch.mean`` (masked where an entry is short), then one shift each."""
    B = source.shape[0]
    t64 = target.to(torch.float64)
    c_true = mean_rows(t64, target_lengths, target_counts)               # (Bt, 3)
    rms = _radius(t64, c_true, target_lengths, target_counts)
    c = c_true if local else torch.zeros_like(c_true)
    s64 = source.to(torch.float64)
    s_rms = _radius(s64, mean_rows(s64, source_lengths, source_counts), source_lengths,
                    source_counts)
    shift = c if c.shape[0] == B else c.expand(B, 3)
    src_l = (s64 - shift[:, None]).to(torch.float32).contiguous()
    tgt_l = (t64 - c[:, None]).to(torch.float32).contiguous()
    t_host = torch.cat([c, rms, c_true - c], 1)
    return src_l, tgt_l, torch.cat([t_host.expand(B, -1), s_rms], 1)
