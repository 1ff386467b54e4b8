"""Sample data with ground truth: the bundled bunny scans and synthetic pairs.

The package ships two Stanford Bunny range scans, bun000 and bun045 (see
``data/ACKNOWLEDGEMENT.txt``), and their poses from the scanning repository's
``bun.conf``. The poses are read as ``p_world = R(q)^T p_scan + t``: the file's
quaternions rotate by their conjugate. bun000 has the identity pose, so the world frame
is bun000's frame.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pointalign import _validate, transforms


class _Pose(np.ndarray):
    """A ``(4, 4)`` float64 NumPy array that also answers ``.numpy()``.

    :attr:`Pair.T_target_source` was a tensor before it became a NumPy array like
    ``RegistrationResult.transformation``; ``.numpy()`` (a plain view) keeps code written
    for the tensor working. Everything else is NumPy's.
    """

    def numpy(self) -> np.ndarray:
        """Return the values as a plain ``np.ndarray`` (a view, as ``Tensor.numpy()``)."""
        return self.view(np.ndarray)

    def __repr__(self) -> str:
        return repr(self.view(np.ndarray))


def _pose(T: Any) -> np.ndarray:
    """``T (4, 4)`` (tensor or array) as a fresh float64 NumPy array (:class:`_Pose`)."""
    a = T.detach().cpu().numpy() if isinstance(T, torch.Tensor) else np.asarray(T)
    return np.array(a, dtype=np.float64).view(_Pose)


@dataclass(frozen=True)
class Pair:
    """A registration problem with ground truth.

    Attributes:
        source: ``(N, 3)`` float tensor.
        target: ``(M, 3)`` float tensor.
        T_target_source: ``(4, 4)`` float64 NumPy array, the true transform (the kind of
            ``RegistrationResult.transformation``, so ``result.transformation`` and the
            truth compare directly; ``torch.as_tensor`` makes it a tensor).
        name: a short label.

    """

    source: torch.Tensor
    target: torch.Tensor
    T_target_source: np.ndarray
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "T_target_source", _pose(self.T_target_source))


def _data_file(name: str) -> Any:
    return resources.files("pointalign").joinpath("data").joinpath(name)


def read_bun_conf(text: str) -> dict[str, torch.Tensor]:
    """Parse a Stanford ``.conf`` file into ``{scan file name: T_world_scan (4, 4) float64}``.

    Each ``bmesh <file> tx ty tz qx qy qz qw`` line gives ``p_world = R(q)^T p + t`` with
    ``q = (qw, qx, qy, qz)``; ``camera`` lines are ignored.
    """
    poses = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts or parts[0] != "bmesh":
            continue
        if len(parts) != 9:
            raise ValueError(f"bun.conf line {lineno}: expected 9 fields, got {len(parts)}")
        tx, ty, tz, qx, qy, qz, qw = (float(v) for v in parts[2:])
        R = transforms.quaternion_to_matrix(torch.tensor([qw, qx, qy, qz], dtype=torch.float64))
        poses[parts[1]] = transforms.make(R.T, torch.tensor([tx, ty, tz], dtype=torch.float64))
    return poses


def bunny_poses() -> dict[str, torch.Tensor]:
    """World poses of all ten Stanford bunny scans, from the bundled ``bun.conf``."""
    return read_bun_conf(_data_file("bun.conf.txt").read_text())


def bunny_relative_pose(source: str = "bun045", target: str = "bun000") -> torch.Tensor:
    """Ground-truth ``T_target_source`` (4, 4) float64 between two bunny scans.

    The scans are named without ``.ply``.
    """
    poses = bunny_poses()
    for name, scan in (("source", source), ("target", target)):
        if not isinstance(scan, str) or scan + ".ply" not in poses:
            known = sorted(k.removesuffix(".ply") for k in poses)
            raise ValueError(f"{name}: unknown bunny scan {scan!r}; known: {known}")
    T_w_s, T_w_t = poses[source + ".ply"], poses[target + ".ply"]
    return transforms.invert(T_w_t) @ T_w_s


def load_bunny(name: str = "bun000") -> torch.Tensor:
    """One bundled bunny scan as an ``(N, 3)`` float32 tensor in metres (bun000 or bun045)."""
    with _data_file("bunny_scans.npz").open("rb") as f, np.load(f) as z:
        if name not in z.files:
            raise ValueError(f"name: the bundled scans are {z.files}, not {name!r}; use "
                             "shared_data_dir()")
        return torch.from_numpy(z[name].copy())


def load_bunny_pair() -> Pair:
    """bun045 (source) → bun000 (target) with the ground truth (about 34.3°, 53 mm)."""
    return Pair(load_bunny("bun045"), load_bunny("bun000"), _pose(bunny_relative_pose()),
                "bun045->bun000")


def perturbed_pose(T: Any, rotation_deg: float, translation: float, *, center: Any = None,
                   seed: int = 0) -> np.ndarray:
    """Return a pose near ``T``: turned by ``rotation_deg`` and moved by ``translation``.

    Returns ``D @ T`` where ``D`` turns by ``rotation_deg`` degrees about a random axis
    through ``center`` (the centroid of the given cloud; None: the origin) and then shifts
    by exactly ``translation`` along a random direction: the start of a local method that
    refines a known pose (``pointalign demo --start near``).

    Args:
        T: ``(4, 4)`` ``T_target_source`` (array or tensor).
        rotation_deg: the turn in degrees.
        translation: the shift length (units of the data).
        center: ``(M, 3)`` target-frame points whose centroid the turn is about, or None.
        seed: seeds the axis and direction (a CPU ``torch.Generator``).

    Returns:
        ``(4, 4)`` float64 NumPy array.

    """
    T64 = _validate.as_transform(T, "T", device="cpu")
    g = torch.Generator().manual_seed(_validate.seed(seed))
    D = transforms.random_transform(float(rotation_deg), float(translation), generator=g)
    if center is not None:
        c = _validate.as_points(center, "center", device="cpu", dtype=torch.float64).mean(0)
        R = D[:3, :3]
        D = transforms.make(R, c - R @ c + D[:3, 3])
    return (D @ T64.to(torch.float64)).numpy()


def shared_data_dir() -> Path | None:
    """Return the project's shared real-data folder, if present.

    Looks at ``$POINTALIGN_DATA`` first, then ``../shared/data`` and ``shared/data`` relative
    to the working directory and to this package's source tree, then ``.data`` (the copy
    carried to the GPU machine). Returns None when none exists (tests then skip).
    """
    cands = []
    if os.environ.get("POINTALIGN_DATA"):
        cands.append(Path(os.environ["POINTALIGN_DATA"]))
    here = Path(__file__).resolve()
    for base in (Path.cwd(), here.parents[2]):
        cands += [base / ".." / "shared" / "data", base / "shared" / "data", base / ".data"]
    for c in cands:
        if (c / "stanford_bunny").is_dir() or (c / "SOURCES.md").is_file():
            return c.resolve()
    return None


def make_pair(
    cloud: Any,
    rotation_deg: float = 10.0,
    translation: float = 0.0,
    noise: float = 0.0,
    outlier_fraction: float = 0.0,
    overlap: float = 1.0,
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
) -> Pair:
    """Build a synthetic pair with known ground truth from one cloud.

    The target is the cloud; the source is a (cropped) copy moved by the inverse of a random
    transform ``T_target_source`` of exactly ``rotation_deg`` degrees about a random axis and
    ``translation`` (same units as the cloud) along a random direction, with Gaussian noise
    of std ``noise`` per coordinate, and ``outlier_fraction`` of its points replaced by
    uniform samples from the bounding box (scaled by 1.2).

    Args:
        cloud: ``(N, 3)`` points (array, tensor or PointCloud).
        rotation_deg: exact rotation angle of ``T_target_source``, in degrees.
        translation: exact translation length of ``T_target_source`` (cloud units).
        noise: std of the Gaussian noise added per source coordinate.
        outlier_fraction: fraction of source points replaced by uniform outliers.
        overlap: fraction in (0, 1] of the target's points kept in the source: the source is
            cut by a random plane so that it keeps that fraction (partial overlap).
        seed: seeds a CPU ``torch.Generator`` (an integer in [0, 2**64 - 1], NumPy integers
            accepted); the pair is drawn on the host, so the same seed gives the same pair
            on every device.
        dtype: float dtype of the returned ``source`` and ``target``.

    Returns:
        :class:`Pair` with ``source (N', 3)``, ``target (N, 3)`` and ``T_target_source``.

    """
    pts = _validate.as_points(cloud, "cloud", min_points=3, device="cpu", dtype=torch.float64)
    _validate.positive(noise, "noise", allow_zero=True)
    if not 0 <= outlier_fraction < 1:
        raise ValueError(f"outlier_fraction: must be in [0, 1), got {outlier_fraction}")
    if not 0 < overlap <= 1:
        raise ValueError(f"overlap: must be in (0, 1], got {overlap}")
    g = torch.Generator().manual_seed(_validate.seed(seed))
    T = transforms.random_transform(rotation_deg, translation, generator=g)
    src = pts
    if overlap < 1:
        direction = torch.randn(3, generator=g, dtype=torch.float64)
        proj = src @ (direction / direction.norm())
        keep = proj <= torch.quantile(proj, overlap)
        src = src[keep]
    src = src + noise * torch.randn(src.shape, generator=g, dtype=torch.float64)
    n_out = int(math.floor(outlier_fraction * src.shape[0]))
    if n_out:
        lo, hi = pts.min(0).values, pts.max(0).values
        center, half = (lo + hi) / 2, (hi - lo) / 2 * 1.2
        idx = torch.randperm(src.shape[0], generator=g)[:n_out]
        src = src.clone()
        src[idx] = center + (torch.rand(n_out, 3, generator=g, dtype=torch.float64) * 2 - 1) * half
    src = transforms.apply(transforms.invert(T), src)
    return Pair(src.to(dtype), pts.to(dtype), _pose(T), f"synthetic {rotation_deg}deg")


def random_subsample(points: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` points drawn without replacement (all points when n >= N), fixed seed.

    Args:
        points: ``(N, 3)`` tensor.
        n: how many points (>= 0; NumPy integers accepted).
        seed: seeds a CPU ``torch.Generator`` (an integer in [0, 2**64 - 1]); the same seed
            draws the same rows whatever the points' device.

    """
    n = _validate.integer(n, "n", minimum=0)
    seed = _validate.seed(seed)
    if n >= points.shape[0]:
        return points
    g = torch.Generator().manual_seed(seed)
    return points[torch.randperm(points.shape[0], generator=g)[:n].to(points.device)]


#: the reference size of :func:`make_hard_pair`'s millimetre quantities: the bounding-box
#: diagonal of the Stanford bunny scan bun000 (metres)
HARD_PAIR_REFERENCE_DIAGONAL = 0.2474


def make_hard_pair(
    cloud: Any,
    overlap: float = 0.5,
    rotation_deg: float = 90.0,
    outlier_fraction: float = 0.05,
    *,
    translation: float = 0.05,
    noise: float = 0.0005,
    scale: float | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Pair:
    """Cut a partial-overlap pair with noise and outliers from one scan (issue 13's generator).

    1. A random direction d orders the points by ``p · d``; the source keeps the lowest
       fraction ``s = 1 / (2 − overlap)`` of them, the target the highest ``s``, so the
       shared slab holds ``overlap`` of each (counted in points, exactly up to rounding).
    2. Each side gets independent Gaussian noise of std ``noise · scale`` per coordinate.
    3. ``outlier_fraction`` of each side's points (chosen at random) are replaced by
       uniform samples in that side's bounding box.
    4. The source is moved by the inverse of ``T_target_source``: a turn of exactly
       ``rotation_deg`` about a random axis through the source's centroid, then a shift of
       exactly ``translation · scale`` along a random direction.

    The millimetre-sized defaults are for a bunny-sized object; ``scale`` multiplies the
    lengths ``translation`` and ``noise`` (default: the cloud's bounding-box diagonal over
    :data:`HARD_PAIR_REFERENCE_DIAGONAL`, so every scan is treated as a bunny of its size).

    Args:
        cloud: ``(N, 3)`` points (array, tensor or PointCloud), N >= 10.
        overlap: shared fraction of each side, in (0, 1].
        rotation_deg: the turn in degrees.
        outlier_fraction: fraction in [0, 1) of each side replaced by outliers.
        translation: shift length before scaling (metres for a bunny-sized cloud).
        noise: noise std before scaling.
        scale: length scale (> 0); default as above.
        seed: seeds a CPU ``torch.Generator`` (an integer in [0, 2**64 - 1], NumPy integers
            accepted); drawn on the host, so the same arguments give the same pair on every
            device.
        dtype: float dtype of the returned clouds.

    Returns:
        :class:`Pair` with ``source (Ns, 3)``, ``target (Nt, 3)`` and ``T_target_source``
        (float64); ``name`` records the parameters.

    """
    pts = _validate.as_points(cloud, "cloud", min_points=10, device="cpu", dtype=torch.float64)
    if not 0 < float(overlap) <= 1:
        raise ValueError(f"overlap: must be in (0, 1], got {overlap}")
    if not 0 <= float(outlier_fraction) < 1:
        raise ValueError(f"outlier_fraction: must be in [0, 1), got {outlier_fraction}")
    _validate.positive(noise, "noise", allow_zero=True)
    _validate.positive(translation, "translation", allow_zero=True)
    lo, hi = pts.min(0).values, pts.max(0).values
    if scale is None:
        scale = float((hi - lo).norm()) / HARD_PAIR_REFERENCE_DIAGONAL
    scale = _validate.positive(scale, "scale")
    g = torch.Generator().manual_seed(_validate.seed(seed))
    d = torch.randn(3, generator=g, dtype=torch.float64)
    order = torch.argsort(pts @ (d / d.norm()))
    n = pts.shape[0]
    keep = int(round(n / (2.0 - float(overlap))))
    src, tgt = pts[order[:keep]], pts[order[n - keep:]]

    def corrupt(p: torch.Tensor) -> torch.Tensor:
        p = p + noise * scale * torch.randn(p.shape, generator=g, dtype=torch.float64)
        n_out = int(math.floor(outlier_fraction * p.shape[0]))
        if n_out:
            a, b = p.min(0).values, p.max(0).values
            idx = torch.randperm(p.shape[0], generator=g)[:n_out]
            p = p.clone()
            p[idx] = a + torch.rand(n_out, 3, generator=g, dtype=torch.float64) * (b - a)
        return p

    src, tgt = corrupt(src), corrupt(tgt)
    T = transforms.random_transform(rotation_deg, translation * scale, generator=g)
    c = src.mean(0)
    R = T[:3, :3]
    T = transforms.make(R, c - R @ c + T[:3, 3])  # the turn about the source's centroid
    src = transforms.apply(transforms.invert(T), src)
    name = (f"overlap {overlap:g}, {rotation_deg:g} deg, {100 * outlier_fraction:g}% outliers, "
            f"seed {seed}")
    return Pair(src.to(dtype), tgt.to(dtype), _pose(T), name)
