"""The distance-map approximants of the surface methods: per-node frames, curvatures, coefficients.

Every node of the target's k-d tree stores ``d̂²(q) = qᵀAq − 2bᵀq + c``, built from its
points' mean, PCA frame and (second order) a local quadric fit; the kinds are listed in
:mod:`pointalign.registration.surface`. The per-node statistics come from the surface
kernel family (:mod:`pointalign.kernels.surface`); the formulas from :mod:`pointalign._math`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pointalign import _math, _validate
from pointalign.kernels import surface as _ks
from pointalign.registration.surface.levels import _resolve_depth
from pointalign.search.kdtree import KDTreeIndex

APPROXIMANTS = ("point", "plane", "second_order")

Approximant = str | Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                             tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

#: nodes of fewer points have no PCA frame of their own (they take their parent's)
MIN_FRAME_POINTS = 5


def node_frames(tree: KDTreeIndex) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, PCA frame and RMS radius of every node: ``(K, 3)``, ``(K, 3, 3)``, ``(K,)``.

    ``frame[:, :, 0..2]`` are the eigenvectors of the node's covariance reordered as
    ``(e1, e2, n)``: largest, middle, smallest eigenvalue (the normal). The eigen-solve is the
    closed form of :func:`pointalign._math.eigh3` (O(K) memory, no cuSOLVER). Nodes with
    fewer than 5 points take their parent's frame. float64
    (:func:`pointalign.kernels.surface.node_frames`).
    """
    return _ks.node_frames(tree.arrays, MIN_FRAME_POINTS)


def _curvatures(tree: KDTreeIndex, mean: torch.Tensor, frame: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Principal curvatures ``(K, 2)`` and directions ``(K, 3, 2)`` by a quadric fit per node.

    Least squares ``w ≈ αu² + βuv + γv² + ζ`` in the node's PCA frame: the 4×4 normal
    equations from :func:`pointalign.kernels.surface.quadric_sums`, solved by
    :func:`_fit_curvatures`.
    """
    normal_eq, rhs = _ks.quadric_sums(tree.arrays, mean, frame)
    return _fit_curvatures(normal_eq, rhs, tree.node_sizes(), frame)


def _fit_curvatures(normal_eq: torch.Tensor, rhs: torch.Tensor, sizes: torch.Tensor,
                    frame: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Curvatures ``(K, 2)`` and directions ``(K, 3, 2)`` from the quadric fits' sums.

    ``normal_eq (K, 4, 4)``, ``rhs (K, 4)``: the sums of :func:`_curvatures`; ``sizes (K,)``
    the nodes' point counts (fewer than 6: no fit, curvature 0); ``frame (K, 3, 3)``. The
    system is solved by :func:`pointalign._math.solve_spd4` after Jacobi scaling; the
    curvatures and directions are the closed-form 2×2 eigenpairs
    (:func:`pointalign._math.symmetric_eigh2`) of the Hessian ``[[2α, β], [β, 2γ]]``.
    """
    # Jacobi scaling (u⁴ ~ 1e-12 beside 1 in small cells), then a tiny ridge
    dscale = normal_eq.diagonal(dim1=1, dim2=2).clamp_min(1e-300).rsqrt()  # (K, 4)
    scaled = normal_eq * dscale[:, :, None] * dscale[:, None, :] + \
        1e-12 * torch.eye(4, dtype=torch.float64, device=normal_eq.device)
    coef = _math.solve_spd4(scaled, rhs * dscale) * dscale
    ok = (sizes >= 6) & torch.isfinite(coef).all(-1)
    zero = torch.zeros_like(coef[:, 0])
    al, be, ga = (torch.where(ok, coef[:, i], zero) for i in range(3))
    kappa, dirs2 = _math.symmetric_eigh2(2 * al, be, 2 * ga)
    dirs = frame[:, :, :2] @ dirs2  # (K, 3, 2)
    return kappa, dirs


def _pottmann_hofer_weight(kappa: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    s = delta[:, None] * kappa.abs()
    near = 0.5 * s / (1 + s)
    far = torch.where(s > 1, 0.5 * s / (s - 1).clamp_min(1e-12), torch.zeros_like(s))
    return (near + far).clamp(max=1.0)


def approximant_coefficients(tree: KDTreeIndex, approximant: Approximant = "plane"
                             ) -> torch.Tensor:
    """Per-node coefficients ``(K, 10)`` float32 (``a00 a01 a02 a11 a12 a22 b0 b1 b2 c``).

    Cached on the tree as the payload ``"surface:<kind>"`` for the built-in kinds (so an
    ``index`` passed back in reuses them); callables are evaluated every time.
    """
    key = f"surface:{approximant}" if isinstance(approximant, str) else None
    if key is not None and tree.has_payload(key):
        return tree.payload(key)
    if isinstance(approximant, str) and approximant not in APPROXIMANTS:
        raise ValueError(f"approximant: expected one of {APPROXIMANTS} or a callable, "
                         f"got {approximant!r}")
    if not isinstance(approximant, str) and not callable(approximant):
        raise TypeError(f"approximant: expected a string or a callable, "
                        f"got {type(approximant).__name__}")
    mean, frame, radius = node_frames(tree)
    normal = frame[:, :, 2]
    K = mean.shape[0]
    eye = torch.eye(3, dtype=torch.float64, device=mean.device)
    if approximant == "point":
        A = eye.expand(K, 3, 3)
    elif approximant == "plane":
        A = normal[:, :, None] * normal[:, None, :]
    elif approximant == "second_order":
        kappa, dirs = _curvatures(tree, mean, frame)
        lam = _pottmann_hofer_weight(kappa, radius)
        A = normal[:, :, None] * normal[:, None, :] + (dirs * lam[:, None, :]) @ \
            dirs.transpose(1, 2)
    else:
        assert callable(approximant)  # a name was handled above
        out = approximant(mean.clone(), normal.clone(), frame.clone())
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError("approximant: a callable must return (A, b, c)")
        A, bb, cc = (torch.as_tensor(v, dtype=torch.float64, device=mean.device) for v in out)
        if A.shape != (K, 3, 3) or bb.shape != (K, 3) or cc.shape != (K,):
            raise ValueError(f"approximant: expected A (K, 3, 3), b (K, 3), c (K,) with K={K}, "
                             f"got {tuple(A.shape)}, {tuple(bb.shape)}, {tuple(cc.shape)}")
        A = 0.5 * (A + A.transpose(1, 2))
    if isinstance(approximant, str):
        bb = (A @ mean.unsqueeze(-1)).squeeze(-1)
        cc = (mean * bb).sum(-1)
    co = torch.stack([A[:, 0, 0], A[:, 0, 1], A[:, 0, 2], A[:, 1, 1], A[:, 1, 2], A[:, 2, 2],
                      bb[:, 0], bb[:, 1], bb[:, 2], cc], -1).float().contiguous()
    if key is not None:
        tree.attach(key, co)
    return co


def approximate_sq_distance(tree: KDTreeIndex, query: Any, approximant: Approximant = "plane",
                            depth: int | None = None) -> torch.Tensor:
    """``d̂²(q)`` ``(N,)`` of ``query (N, 3)`` from the approximant of its cell at ``depth``."""
    q = _validate.as_points(query, "query", device=tree.device, dtype=tree.points.dtype)
    co = approximant_coefficients(tree, approximant)
    node = tree.descend(q, _resolve_depth(tree, depth))
    return _ks.evaluate(q.double(), co[node].double()).clamp_min(0)
