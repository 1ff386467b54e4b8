"""Small tensor operations shared by several modules."""

from __future__ import annotations

import torch


def exclusive_cumsum_rows(values: torch.Tensor) -> torch.Tensor:
    """Prefix sums over the rows of ``values (M, ...)``, with a leading zero row.

    ``out[k] = Σ_{i<k} values[i]``, shape ``(M + 1, ...)``, so that the sum of rows
    ``[s, e)`` is ``out[e] − out[s]``. Deterministic. The scan runs along the innermost
    (contiguous) dimension: PyTorch's CUDA scan over the outer dimension of an ``(M, 3)``
    float64 tensor took 5 ms at M = 40k on an H100, the inner scan a few microseconds.
    """
    flat = values.reshape(values.shape[0], -1).T.contiguous()  # (C, M)
    out = torch.zeros((flat.shape[0], flat.shape[1] + 1), dtype=values.dtype,
                      device=values.device)
    torch.cumsum(flat, 1, out=out[:, 1:])
    return out.T.reshape((values.shape[0] + 1,) + values.shape[1:])
