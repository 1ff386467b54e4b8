"""One call from raw points to a cloud ready for registration (small_gicp's ``preprocess_points``).

:func:`preprocess` chains what users otherwise chain by hand: voxel downsampling, then
normals, covariances and FPFH features of the downsampled points, all from **one**
neighbour search over them (a k-d tree or grid built once; the features' radius search,
sorted by distance, also gives the k nearest for the normals and covariances). The result
is a :class:`~pointalign.cloud.PointCloud` whose fields the registration functions read:
``normals`` (point-to-plane :func:`~pointalign.icp`), ``covariances``
(:func:`~pointalign.gicp`), ``features`` (:func:`~pointalign.ransac`)::

    import pointalign as pa

    src = pa.preprocess(source_points, 0.25, covariances=True)
    tgt = pa.preprocess(target_points, 0.25, covariances=True)
    result = pa.gicp(src, tgt, max_correspondence_distance=1.0)

A module of its own (not ``features/``): it composes the features into the cloud the
registration functions take, so it sits above them, as ``register`` does.
"""

from __future__ import annotations

from typing import Any

import torch

from pointalign import _threads, _validate
from pointalign.cloud import PointCloud

#: neighbours per point for the normals and covariances (small_gicp's and Open3D's GICP
#: examples use 10-20; :data:`pointalign.features.covariances.DEFAULT_K`)
DEFAULT_K = 20
#: the FPFH radius and neighbour cap, in voxels and points (Open3D's global-registration
#: tutorial and :func:`pointalign.register`: 5 voxels, 100 neighbours)
FEATURE_RADIUS = 5.0
FEATURE_NEIGHBORS = 100


@_threads.per_call
@_validate.out_of_memory_is_clear
def preprocess(
    points: Any,
    voxel_size: float | None,
    *,
    normals: bool = True,
    covariances: bool = False,
    features: bool = False,
    k: int = DEFAULT_K,
    viewpoint: Any = None,
    device: str | torch.device | None = None,
) -> PointCloud:
    """Downsample a cloud and estimate its normals, covariances and FPFH in one call.

    Steps: :func:`~pointalign.voxel_downsample` at ``voxel_size`` (None: keep every point;
    a cloud's normals and colours are averaged per voxel), then one neighbour search over
    the kept points: the ``k`` nearest of each (with ``features``: up to
    :data:`FEATURE_NEIGHBORS` within :data:`FEATURE_RADIUS` × ``voxel_size``, sorted, whose
    first ``k`` are the k nearest within that radius). From that one table:

    * ``normals``: PCA of the k nearest (Hoppe et al. 1992), facing ``viewpoint`` (default:
      the cloud's centroid, so that FPFH is invariant to a motion of the cloud);
    * ``covariances``: the plane-regularised ``I − (1 − ε) n nᵀ`` of the k nearest
      (generalized ICP, Segal et al. 2009; ε = 1e-3);
    * ``features``: 33-bin FPFH (Rusu et al. 2009) over the radius neighbourhoods, from
      the normals above.

    Args:
        points: ``(N, 3)`` NumPy array or tensor, a :class:`PointCloud` or an Open3D cloud
            (metres by convention).
        voxel_size: voxel edge (> 0, the points' units), or None: no downsampling (then
            ``features`` needs a radius: pass a voxel size).
        normals: estimate normals (True; also done for ``features``), or keep the input's
            (averaged per voxel) if any.
        covariances: estimate per-point covariances (for :func:`~pointalign.gicp`).
        features: compute FPFH features (for :func:`~pointalign.ransac`); needs
            ``voxel_size``.
        k: neighbours per normal and covariance, the point included (>= 3).
        viewpoint: ``(3,)`` point the normals face (default: the cloud's centroid).
        device: compute device (default: the points' device for tensors and PointClouds,
            else CUDA when available).
        num_threads: CPU threads for this call (:func:`pointalign.threads`).

    Returns:
        A :class:`PointCloud` on ``device`` in the points' float dtype: ``points (V, 3)``,
        ``normals (V, 3)`` (with ``normals``, or averaged from the input's), ``colors
        (V, 3)`` (averaged, when the input has them), ``covariances (V, 3, 3)`` (with
        ``covariances``), ``features (V, 33)`` (with ``features``).

    Raises:
        ValueError / TypeError: naming the argument: a bad voxel size or k, ``features``
            without ``voxel_size``, fewer than 3 points left.

    """
    from pointalign.features.covariances import estimate_covariances
    from pointalign.features.downsample import voxel_downsample
    from pointalign.features.fpfh import fpfh
    from pointalign.features.normals import estimate_normals
    from pointalign.search import build_index

    for name, flag in (("normals", normals), ("covariances", covariances),
                       ("features", features)):
        _validate.flag(flag, name)
    k = _validate.integer(k, "k", minimum=3)
    if voxel_size is not None:
        voxel_size = _validate.positive(voxel_size, "voxel_size")
    elif features:
        raise ValueError("voxel_size: features=True needs a voxel size (the FPFH radius is "
                         f"{FEATURE_RADIUS:g} voxels); pass one")
    if _validate.kind(points) in ("open3d", "open3d_tensor"):
        points = PointCloud.from_open3d(points)
    if not isinstance(points, PointCloud):
        points = PointCloud(_validate.as_points(points, "points"))
    dev = _validate.resolve_device(device, points=points)
    cloud = points.to(dev)
    if voxel_size is not None:
        cloud = voxel_downsample(cloud, voxel_size)
    n = len(cloud)
    if n < 3:
        what = f"voxel_size: {voxel_size:g} leaves" if voxel_size is not None else \
            "points: the cloud has"
        raise ValueError(f"{what} {n} point(s); at least 3 are needed")
    pts = cloud.points
    if not (normals or covariances or features):
        return cloud
    # the one neighbour search, sorted by distance
    kk = min(k, n)
    index = build_index(pts)
    with _validate.trusted():
        if features:
            assert voxel_size is not None
            nbr = index.radius(pts, FEATURE_RADIUS * voxel_size, min(FEATURE_NEIGHBORS, n))
        else:
            nbr = index.knn(pts, kk)
        table = nbr.idx[:, :kk].contiguous()
        out_normals = cloud.normals
        if normals or features:
            vp = pts.mean(0) if viewpoint is None else viewpoint
            out_normals = estimate_normals(pts, neighbors=table, orient="viewpoint",
                                           viewpoint=vp, device=dev)
            out_normals = torch.as_tensor(out_normals, device=dev).to(pts.dtype)
        out_cov = estimate_covariances(pts, neighbors=table, device=dev) if covariances \
            else None
        out_feat = None
        if features:
            assert voxel_size is not None
            out_feat = fpfh(pts, radius=FEATURE_RADIUS * voxel_size, normals=out_normals,
                            neighbors=nbr, device=dev)
    return cloud.replace(normals=out_normals,
                         covariances=out_cov if covariances else cloud.covariances,
                         features=out_feat if features else cloud.features)
