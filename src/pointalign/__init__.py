"""pointalign: rigid point-cloud registration on the GPU and the CPU."""

from pointalign import _threads, datasets, metrics, transforms  # noqa: F401 (_threads first)
from pointalign._progress import (
    DoubtfulResultWarning,
    FileContentWarning,
    IgnoredParameterWarning,
    PointalignWarning,
    SlowOperationWarning,
    UnitsWarning,
)
from pointalign._threads import get_num_threads, set_num_threads, threads
from pointalign.cloud import PointCloud
from pointalign.features.covariances import estimate_covariances
from pointalign.features.downsample import voxel_downsample
from pointalign.features.fpfh import fpfh
from pointalign.features.normals import estimate_normals
from pointalign.features.outliers import radius_outlier_mask, statistical_outlier_mask
from pointalign.io import read, read_bin, write
from pointalign.metrics import RegistrationEvaluation, evaluate_registration
from pointalign.preprocess import preprocess
from pointalign.registration.criteria import ConvergenceCriteria, RobustKernel
from pointalign.registration.gicp import gicp, vgicp
from pointalign.registration.icp import icp
from pointalign.registration.many import ManyResult, PairSpec, register_many
from pointalign.registration.multiway import MultiwayResult, merge, multiway
from pointalign.registration.pipeline import register
from pointalign.registration.ransac import ransac
from pointalign.registration.result import RegistrationResult
from pointalign.registration.soft import emicp, softassign
from pointalign.registration.surface import approximate_icp, surface_newton
from pointalign.search import BruteForceIndex, CKDTreeIndex, VoxelGridIndex, build_index
from pointalign.search.kdtree import KDTreeIndex

__version__ = "0.1.0"

__all__ = [
    "BruteForceIndex",
    "CKDTreeIndex",
    "KDTreeIndex",
    "ManyResult",
    "MultiwayResult",
    "PairSpec",
    "VoxelGridIndex",
    "ConvergenceCriteria",
    "DoubtfulResultWarning",
    "FileContentWarning",
    "IgnoredParameterWarning",
    "PointalignWarning",
    "SlowOperationWarning",
    "UnitsWarning",
    "PointCloud",
    "RegistrationEvaluation",
    "RegistrationResult",
    "RobustKernel",
    "__version__",
    "approximate_icp",
    "build_index",
    "datasets",
    "emicp",
    "estimate_covariances",
    "estimate_normals",
    "evaluate_registration",
    "fpfh",
    "get_num_threads",
    "gicp",
    "icp",
    "merge",
    "metrics",
    "multiway",
    "preprocess",
    "radius_outlier_mask",
    "ransac",
    "set_num_threads",
    "read",
    "read_bin",
    "register",
    "register_many",
    "softassign",
    "statistical_outlier_mask",
    "surface_newton",
    "threads",
    "transforms",
    "vgicp",
    "voxel_downsample",
    "write",
]
