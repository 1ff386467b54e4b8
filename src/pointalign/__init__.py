"""pointalign: rigid point-cloud registration on the GPU and the CPU."""

from pointalign import datasets, metrics, transforms
from pointalign.cloud import PointCloud
from pointalign.io import read, read_bin, write
from pointalign.registration.criteria import ConvergenceCriteria, RobustKernel
from pointalign.registration.result import RegistrationResult

__version__ = "0.1.0"

__all__ = [
    "ConvergenceCriteria",
    "PointCloud",
    "RegistrationResult",
    "RobustKernel",
    "__version__",
    "datasets",
    "metrics",
    "read",
    "read_bin",
    "transforms",
    "write",
]
