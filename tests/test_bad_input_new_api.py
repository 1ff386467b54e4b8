"""Bad input to the functions tranche 2 added gets a ValueError/TypeError naming the argument."""

import numpy as np
import pytest
import torch

import pointalign as pa
from pointalign.features.outliers import radius_outlier_mask, statistical_outlier_mask
from pointalign.search import policy

GOOD = torch.rand(50, 3, generator=torch.Generator().manual_seed(0))
EMPTY, NAN, FLAT = np.zeros((0, 3)), np.full((5, 3), np.nan), np.zeros((5, 2))

CASES = [
    ("evaluate_registration", lambda: pa.evaluate_registration(EMPTY, GOOD, np.eye(4), 0.1),
     ValueError, "source"),
    ("evaluate_registration", lambda: pa.evaluate_registration(NAN, GOOD, np.eye(4), 0.1),
     ValueError, "source"),
    ("evaluate_registration", lambda: pa.evaluate_registration(GOOD, GOOD, np.eye(3), 0.1),
     ValueError, "transformation"),
    ("evaluate_registration", lambda: pa.evaluate_registration(GOOD, GOOD, np.eye(4), -1),
     ValueError, "max_correspondence_distance"),
    # Open3D's order: (source, target, max_correspondence_distance, transformation)
    ("evaluate_registration", lambda: pa.evaluate_registration(GOOD, GOOD, 0.1, np.eye(3)),
     ValueError, "transformation"),
    ("evaluate_registration", lambda: pa.evaluate_registration(GOOD, GOOD, -1, np.eye(4)),
     ValueError, "max_correspondence_distance"),
    ("evaluate_registration", lambda: pa.evaluate_registration(GOOD, GOOD, "far"),
     TypeError, "max_correspondence_distance"),
    ("relative_error", lambda: pa.metrics.relative_error(np.stack([np.eye(4)] * 3),
                                                         np.stack([np.eye(4)] * 2)),
     ValueError, "estimate, truth"),
    ("registration_recall", lambda: pa.metrics.registration_recall("ab", [0.1, 0.2]),
     TypeError, "rotation_errors"),
    ("registration_recall", lambda: pa.metrics.registration_recall(["a"], [0.1]),
     TypeError, "rotation_errors"),
    ("registration_recall", lambda: pa.metrics.registration_recall(np.array(1.0),
                                                                   np.array(0.1)),
     ValueError, "rotation_errors"),
    ("registration_recall", lambda: pa.metrics.registration_recall([1.0], [{"t": 1}]),
     TypeError, "translation_errors"),
    ("radius_outlier_mask", lambda: radius_outlier_mask(EMPTY, 0.1), ValueError, "points"),
    ("radius_outlier_mask", lambda: radius_outlier_mask(FLAT, 0.1), ValueError, "points"),
    ("radius_outlier_mask", lambda: radius_outlier_mask(GOOD, float("nan")), ValueError,
     "radius"),
    ("statistical_outlier_mask", lambda: statistical_outlier_mask(NAN), ValueError, "points"),
    ("statistical_outlier_mask", lambda: statistical_outlier_mask(GOOD, neighbors=0),
     ValueError, "neighbors"),
    ("choose_index", lambda: policy.choose_index(EMPTY), ValueError, "points"),
    ("choose_index", lambda: policy.choose_index(GOOD, max_distance=0), ValueError,
     "max_distance"),
    ("correspondence_index", lambda: policy.correspondence_index(pa.build_index(GOOD), -1.0),
     ValueError, "max_distance"),
    ("set_num_threads", lambda: pa.set_num_threads(0), ValueError, "n"),
    ("set_num_threads", lambda: pa.set_num_threads("x"), TypeError, "n"),
    ("make_hard_pair", lambda: pa.datasets.make_hard_pair(GOOD, overlap=1.5), ValueError,
     "overlap"),
    ("make_hard_pair", lambda: pa.datasets.make_hard_pair(EMPTY), ValueError, "cloud"),
    ("register", lambda: pa.register(GOOD, GOOD, remove_outliers="yes"), TypeError,
     "remove_outliers"),
    ("register", lambda: pa.register(GOOD, GOOD, robust=1), TypeError, "robust"),
    ("icp", lambda: pa.icp(GOOD, GOOD, max_correspondence_distance=0.1, device="mps"),
     ValueError, "device"),
    ("emicp", lambda: pa.emicp(FLAT, GOOD), ValueError, "source"),
]


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_names_the_argument(case):
    _, call, exc, name = CASES[case]
    with pytest.raises(exc, match=rf"^{name}\b"):
        call()
