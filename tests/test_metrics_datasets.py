import math

import numpy as np
import pytest
import torch

from pointalign import datasets, metrics
from pointalign import transforms as T


def test_errors_of_known_perturbation():
    truth = T.se3_exp(torch.tensor([0.1, 0.2, 0.3, 1.0, 2.0, 3.0], dtype=torch.float64))
    delta = T.make(T.axis_angle_to_matrix(torch.tensor([0, 0, 1.0]), math.radians(2.0)),
                   torch.zeros(3, dtype=torch.float64))
    est = truth @ delta
    rot, trans = metrics.relative_error(est, truth)
    assert rot == pytest.approx(2.0, abs=1e-9)
    assert trans == pytest.approx(0.0, abs=1e-12)
    est2 = est.clone()
    est2[:3, 3] += torch.tensor([0.0, 0.3, 0.4], dtype=torch.float64)
    assert metrics.translation_error(est2, truth) == pytest.approx(0.5)
    eps = metrics.zabatani_error(est2.numpy(), truth.numpy())
    assert eps == pytest.approx(2 * math.sqrt(2) * math.sin(math.radians(1.0)) + 0.5, rel=1e-9)


def test_batched_errors():
    g = torch.Generator().manual_seed(0)
    a = T.make(T.random_rotation(3, generator=g), torch.zeros(3, 3, dtype=torch.float64))
    rot = metrics.rotation_error(a, a)
    assert rot.shape == (3,) and np.allclose(rot, 0, atol=1e-5)


def test_fitness_and_rmse():
    tgt = torch.zeros(1, 3, dtype=torch.float64)
    src = torch.tensor([[0.1, 0, 0], [0, 0.2, 0], [5.0, 0, 0]], dtype=torch.float64)
    fit, rmse = metrics.correspondence_stats(src, tgt, np.eye(4), 0.5)
    assert fit == pytest.approx(2 / 3)
    assert rmse == pytest.approx(math.sqrt((0.01 + 0.04) / 2))
    fit, rmse = metrics.correspondence_stats(src, tgt, np.eye(4), 0.01)
    assert fit == 0 and math.isinf(rmse)
    with pytest.raises(ValueError, match="max_correspondence_distance"):
        metrics.fitness(src, tgt, np.eye(4), 0)


def test_registration_recall():
    assert metrics.registration_recall([1, 20, 3], [0.1, 0.1, 0.5]) == pytest.approx(1 / 3)


def test_bundled_bunny_ground_truth_overlaps():
    pair = datasets.load_bunny_pair()
    assert pair.source.shape == (40097, 3) and pair.target.shape == (40256, 3)
    rot, trans = metrics.relative_error(pair.T_target_source, np.eye(4))
    assert rot == pytest.approx(34.28, abs=0.01)
    assert trans == pytest.approx(0.0532, abs=1e-3)
    fit_true, _ = metrics.correspondence_stats(pair.source, pair.target, pair.T_target_source, 1e-3)
    fit_conj, _ = metrics.correspondence_stats(pair.source, pair.target,
                                               T.invert(pair.T_target_source), 1e-3)
    assert fit_true > 0.9 and fit_conj < 0.05  # the conjugate reading would fail


def test_read_bun_conf_all_scans(shared_data):
    poses = datasets.read_bun_conf((shared_data / "stanford_bunny/data/bun.conf").read_text())
    assert len(poses) == 10
    assert torch.equal(poses["bun000.ply"], torch.eye(4, dtype=torch.float64))


def test_make_pair_ground_truth(seed):
    cloud = datasets.random_subsample(datasets.load_bunny("bun000"), 2000, seed)
    pair = datasets.make_pair(cloud, rotation_deg=25, translation=0.05, seed=seed)
    back = T.apply(pair.T_target_source, pair.source.double())
    assert torch.allclose(back.float(), pair.target, atol=1e-6)
    rot, trans = metrics.relative_error(pair.T_target_source, np.eye(4))
    assert rot == pytest.approx(25) and trans == pytest.approx(0.05)
    again = datasets.make_pair(cloud, rotation_deg=25, translation=0.05, seed=seed)
    assert torch.equal(again.source, pair.source)


def test_make_pair_overlap_noise_outliers(seed):
    cloud = datasets.random_subsample(datasets.load_bunny("bun000"), 2000, seed)
    pair = datasets.make_pair(cloud, 10, 0.0, noise=1e-3, outlier_fraction=0.1, overlap=0.8,
                              seed=seed)
    assert pair.source.shape[0] == pytest.approx(1600, abs=2)
    fit, _ = metrics.correspondence_stats(pair.source, pair.target, pair.T_target_source, 5e-3)
    assert 0.8 < fit < 0.95  # ~10% outliers off the surface
    with pytest.raises(ValueError, match="overlap"):
        datasets.make_pair(cloud, overlap=0)
    with pytest.raises(ValueError, match="outlier_fraction"):
        datasets.make_pair(cloud, outlier_fraction=1.0)


def test_evaluate_registration_takes_open3d_order_and_names():
    """Open3D's (source, target, max_correspondence_distance, transformation), identity default."""
    g = np.random.default_rng(0)
    src = g.normal(size=(200, 3))
    T = np.eye(4)
    T[:3, 3] = [0.01, 0.0, 0.0]
    tgt = src + T[:3, 3]
    o3d_order = metrics.evaluate_registration(src, tgt, 0.05, T)
    old_order = metrics.evaluate_registration(src, tgt, T, 0.05)
    keywords = metrics.evaluate_registration(src, tgt, transformation=T,
                                             max_correspondence_distance=0.05)
    for ev in (old_order, keywords):
        assert ev.fitness == o3d_order.fitness and ev.inlier_rmse == o3d_order.inlier_rmse
        np.testing.assert_array_equal(ev.correspondence_set, o3d_order.correspondence_set)
    assert o3d_order.fitness == 1.0 and o3d_order.inlier_rmse < 1e-12
    assert o3d_order.rmse == o3d_order.inlier_rmse  # the name RegistrationResult uses
    ident = metrics.evaluate_registration(src, tgt, 0.05)  # Open3D's default: the identity
    assert ident.inlier_rmse == pytest.approx(0.01, rel=1e-9)
    np.testing.assert_array_equal(ident.transformation, np.eye(4))
    assert metrics.correspondence_stats(src, tgt, T, 0.05) == (1.0, o3d_order.inlier_rmse)


def test_relative_error_batches_must_match():
    three, two = np.stack([np.eye(4)] * 3), np.stack([np.eye(4)] * 2)
    with pytest.raises(ValueError, match="batches of 3 and 2"):
        metrics.relative_error(three, two)
    with pytest.raises(ValueError, match="batches of 3 and 2"):
        metrics.zabatani_error(torch.from_numpy(three), torch.from_numpy(two))
    rot, trans = metrics.relative_error(three, np.eye(4))  # one truth for the whole batch
    assert rot.shape == (3,) and trans.shape == (3,)


def test_registration_recall_clear_errors():
    with pytest.raises(TypeError, match="rotation_errors: expected a sequence of numbers"):
        metrics.registration_recall("12", "34")
    with pytest.raises(ValueError, match="rotation_errors: expected a 1-D.*single pair"):
        metrics.registration_recall(np.array(3.0), np.array(0.1))
    with pytest.raises(ValueError, match="equal, non-zero lengths"):
        metrics.registration_recall([1.0, 2.0], [0.1])
    assert metrics.registration_recall(torch.tensor([1.0, 30.0]), [0.1, 0.1]) == 0.5
    assert metrics.registration_recall([float("nan")], [0.0]) == 0.0  # a failed pair


def test_pair_ground_truth_is_numpy_like_results():
    pair = datasets.load_bunny_pair()
    T = pair.T_target_source
    assert isinstance(T, np.ndarray) and T.dtype == np.float64 and T.shape == (4, 4)
    G = T.copy()  # as with result.transformation
    G[:3, 3] += 1.0
    assert not np.array_equal(G, T)
    np.testing.assert_array_equal(T.numpy(), T)  # code written for the tensor still runs
    assert type(T.numpy()) is np.ndarray
    synthetic = datasets.make_pair(pair.target[:100], rotation_deg=5.0, seed=0)
    assert isinstance(synthetic.T_target_source, np.ndarray)
    hard = datasets.make_hard_pair(pair.target[:200], seed=0)
    assert hard.T_target_source.dtype == np.float64
