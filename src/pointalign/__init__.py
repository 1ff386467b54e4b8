"""pointalign: rigid point-cloud registration on the GPU and the CPU."""

from pointalign.cloud import PointCloud
from pointalign.registration.criteria import ConvergenceCriteria, RobustKernel
from pointalign.registration.result import RegistrationResult

__version__ = "0.1.0"

__all__ = [
    "ConvergenceCriteria",
    "PointCloud",
    "RegistrationResult",
    "RobustKernel",
    "__version__",
]
