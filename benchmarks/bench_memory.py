"""GPU memory: peak allocation of ``register()`` and ``icp()`` against cloud size, by stage.

A synthetic surface (a height field with bumps on all scales, so that every pose is
determined) of N points, and a second sample of it moved by a known pose, on the GPU.
For each size: the peak of ``torch.cuda.max_memory_allocated`` over the call, in bytes per
input point (two clouds of N float32 points hold 24 bytes per point of input), and the peak
of each stage of the pipeline (the functions ``register()`` calls, wrapped for the run:
peak above what was allocated when the stage began).

    python benchmarks/bench_memory.py                    # 1M .. 50M points
    python benchmarks/bench_memory.py --sizes 1e6,1e7    # chosen sizes
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Recorder, parse_args  # noqa: E402

import pointalign as pa  # noqa: E402

GIB = float(1 << 30)
#: functions of the pipeline whose peaks are reported (module, attribute)
STAGES = [
    ("pointalign.registration.pipeline", a) for a in (
        "auto_voxel_size", "stray_fraction", "dense_mask", "voxel_downsample",
        "neighbourhoods", "fpfh", "ransac")
] + [("pointalign.search", "build_index"), ("pointalign.features.normals", "estimate_normals"),
     ("pointalign.registration.icp", "icp")]
NOTES = (
    "Peak GPU memory (torch.cuda.max_memory_allocated, PyTorch's caching allocator; the "
    "driver's own context is not included) for two synthetic surface samples of N float32 "
    "points each (a height field with bumps on several scales, moved by a 20° rotation and "
    "a translation). bytes_per_point: the call's peak over N. The stage columns give each "
    "stage's peak above what was allocated when it began, in GiB (nested stages overlap). "
    "icp: 30 point-to-plane iterations, target normals given, index built inside."
)


def surface(n: int, seed: int, device: str) -> torch.Tensor:
    """``(n, 3)`` float32 samples of a bumpy height field over a 100 m square."""
    g = torch.Generator(device=device).manual_seed(seed)
    xy = torch.rand(n, 2, generator=g, device=device) * 100.0
    x, y = xy[:, 0], xy[:, 1]
    z = (3 * torch.sin(x / 9) * torch.cos(y / 13) + 0.5 * torch.sin(x / 2.1 + y / 3.7)
         + 0.05 * torch.cos(x * 1.3) * torch.sin(y * 1.1))
    return torch.stack([x, y, z], 1)


def pose(device: str) -> torch.Tensor:
    axis = torch.tensor([0.3, -0.2, 1.0], dtype=torch.float64)
    R = pa.transforms.axis_angle_to_matrix(axis / axis.norm(), math.radians(20))
    t = torch.tensor([4.0, -2.0, 1.0], dtype=torch.float64)
    return pa.transforms.make(R, t).to(device)


class StagePeaks:
    """Wrap pipeline functions to record each one's peak above its starting allocation."""

    def __init__(self) -> None:
        self.peaks: dict[str, float] = {}
        self.saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> StagePeaks:
        for mod_name, attr in STAGES:
            mod = importlib.import_module(mod_name)
            fn = getattr(mod, attr)
            self.saved.append((mod, attr, fn))
            setattr(mod, attr, self._wrap(attr, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for mod, attr, fn in self.saved:
            setattr(mod, attr, fn)

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                self.peaks[name] = max(self.peaks.get(name, 0.0), peak / GIB)
        return inner


def measure(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GIB, out


def one_size(n: int, dev: str, T: torch.Tensor, stages: bool) -> dict[str, object]:
    """Peaks of register() and icp() on two n-point samples of the surface."""
    src = surface(n, 1, dev)
    tgt = pa.transforms.apply(T, surface(n, 2, dev).double()).float()
    row: dict[str, object] = {"points": n, "inputs_gib": 2 * 12 * n / GIB}
    try:
        peak, res = measure(lambda: pa.register(src, tgt, device=dev))
        err = float(pa.metrics.rotation_error(res.transformation, T.cpu().numpy()))
        row.update(register_peak_gib=peak, register_bytes_per_point=peak * GIB / n,
                   register_rot_err_deg=err, register_converged=bool(res.converged),
                   register_s=res.timings.get("total"))
    except MemoryError as exc:
        row.update(register_peak_gib=float("nan"), register_error=str(exc)[:120])
    if stages:
        with StagePeaks() as sp:
            try:
                pa.register(src, tgt, device=dev)
            except MemoryError:
                pass
        row.update({f"{k}_gib": v for k, v in sp.peaks.items()})
    try:
        nrm = pa.estimate_normals(tgt, k=16, device=dev)
        peak, _ = measure(lambda: pa.icp(src, tgt, init=T, target_normals=nrm,
                                         method="point_to_plane",
                                         max_correspondence_distance=0.5, device=dev))
        row.update(icp_peak_gib=peak, icp_bytes_per_point=peak * GIB / n)
    except MemoryError as exc:
        row.update(icp_peak_gib=float("nan"), icp_error=str(exc)[:120])
    return row


def main() -> None:
    p = parse_args(__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1e6,3e6,1e7,3e7,5e7")
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage run")
    args = p.parse_args()
    dev = args.device or "cuda"
    if torch.device(dev).type != "cuda":
        sys.exit("bench_memory measures GPU memory: run it with a CUDA device")
    rec = Recorder("memory", dev, title="GPU memory against size", notes=NOTES)
    T = pose(dev)
    for n in [int(float(s)) for s in args.sizes.split(",")]:
        row = one_size(n, dev, T, stages=not args.no_stages)
        rec.add(**row)
        torch.cuda.empty_cache()
    rec.save()


if __name__ == "__main__":
    main()
