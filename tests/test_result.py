"""RegistrationResult: JSON round trip, evaluate(), and evaluate_registration's meaning."""

import json
import math

import numpy as np
import pytest
import torch

import pointalign as pa
from pointalign import datasets
from pointalign.registration.result import RegistrationResult


def _result(batched=False):
    rng = np.random.default_rng(0)
    if batched:
        T = np.stack([np.eye(4), np.eye(4)])
        T[1, :3, 3] = [0.1, -0.2, 0.3]
        return RegistrationResult(
            transformation=T, fitness=np.array([0.5, 1.0]), rmse=np.array([0.01, math.inf]),
            iterations=np.array([3, 7]), converged=np.array([True, False]),
            stop_reason=["relative_rmse", "max_iterations"],
            history=[{"iteration": 0, "fitness": np.array([0.1, 0.2])}],
            timings={"total": 0.25}, info={"H": torch.randn(2, 6, 6, dtype=torch.float64)})
    T = np.eye(4)
    T[:3, 3] = [1.0, 2.0, 3.0]
    return RegistrationResult(
        transformation=T, fitness=np.float64(0.75), rmse=math.inf, iterations=np.int64(12),
        converged=np.bool_(True), stop_reason="relative_rmse",
        history=[{"iteration": 0, "fitness": 0.5, "rmse": float("nan")}],
        timings={"index": 0.1, "total": 0.5},
        info={"H": rng.normal(size=(6, 6)), "counts": np.arange(4, dtype=np.int32),
              "t32": torch.tensor([1.0, float("inf")]), "name": "x", "nested": {"a": [1, 2]},
              "scalar_inf": -math.inf},
        transformation_tensor=torch.from_numpy(T))


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.nan_to_num(posinf=9e9, neginf=-9e9, nan=7.0),
                           b.nan_to_num(posinf=9e9, neginf=-9e9, nan=7.0))
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b, (a, b)


@pytest.mark.parametrize("batched", [False, True])
def test_json_round_trip(tmp_path, batched):
    r = _result(batched)
    text = r.to_json()
    doc = json.loads(text)  # strict JSON: no NaN/Infinity tokens
    assert "Infinity" not in text and "NaN" not in text
    assert doc["format"] == "pointalign.RegistrationResult"
    path = r.save(tmp_path / "r.json")
    back = RegistrationResult.load(path)
    np.testing.assert_array_equal(back.transformation, r.transformation)
    assert back.transformation.dtype == np.float64
    for name in ("fitness", "rmse", "iterations", "converged", "stop_reason", "history",
                 "timings", "info"):
        _same(getattr(r, name), getattr(back, name))
    assert torch.equal(back.transformation_tensor, torch.from_numpy(r.transformation))
    assert back.summary() == r.summary()


def test_to_dict_is_plain_for_the_common_fields():
    d = _result().to_dict()
    assert d["transformation"][0][3] == 1.0 and d["fitness"] == 0.75
    assert d["rmse"] == {"__float__": "inf"} and d["iterations"] == 12
    assert d["converged"] is True and isinstance(d["info"]["H"]["__ndarray__"], list)


def test_real_result_round_trips(tmp_path):
    pair = datasets.load_bunny_pair()
    src = datasets.random_subsample(pair.source, 500, seed=0)
    r = pa.icp(src, pair.target, init=pair.T_target_source.numpy(),
               max_correspondence_distance=0.005, device="cpu")
    back = RegistrationResult.load(r.save(tmp_path / "icp.json"))
    np.testing.assert_array_equal(back.transformation, r.transformation)
    assert back.fitness == r.fitness and back.converged == r.converged


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        RegistrationResult.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        RegistrationResult.load(bad)
    bad.write_text('{"fitness": 1}')
    with pytest.raises(ValueError, match="transformation"):
        RegistrationResult.load(bad)
    with pytest.raises(ValueError, match="folder"):
        _result().save(tmp_path / "no" / "such" / "r.json")


def test_evaluate_registration_matches_brute_force():
    rng = np.random.default_rng(3)
    src = rng.normal(size=(300, 3))
    tgt = rng.normal(size=(400, 3))
    T = np.eye(4)
    T[:3, 3] = [0.05, 0.0, -0.02]
    d = 0.3
    ev = pa.evaluate_registration(src, tgt, T, d)
    moved = src + T[:3, 3]
    D = np.linalg.norm(moved[:, None] - tgt[None], axis=-1)
    nn, dmin = D.argmin(1), D.min(1)
    inl = dmin <= d
    assert ev.fitness == pytest.approx(inl.mean())
    assert ev.inlier_rmse == pytest.approx(np.sqrt(np.mean(dmin[inl] ** 2)))
    np.testing.assert_array_equal(ev.correspondence_set[:, 0], np.nonzero(inl)[0])
    np.testing.assert_array_equal(ev.correspondence_set[:, 1], nn[inl])
    assert ev.correspondence_set.dtype == np.int64
    # nothing within reach: fitness 0, rmse inf, empty set
    far = pa.evaluate_registration(src, tgt + 100.0, np.eye(4), d)
    assert far.fitness == 0.0 and far.inlier_rmse == math.inf
    assert far.correspondence_set.shape == (0, 2)


def test_evaluate_registration_bad_input_names_argument():
    pts = np.zeros((5, 3))
    with pytest.raises(ValueError, match="max_correspondence_distance"):
        pa.evaluate_registration(pts, pts, np.eye(4), -1.0)
    with pytest.raises(ValueError, match="transformation"):
        pa.evaluate_registration(pts, pts, np.ones((4, 4)), 1.0)


def test_result_evaluate_is_the_common_measure():
    r = _result()
    rng = np.random.default_rng(1)
    src = rng.normal(size=(50, 3))
    tgt = src + r.transformation[:3, 3]
    ev = r.evaluate(src, tgt, 1e-6)
    assert ev.fitness == 1.0 and ev.inlier_rmse < 1e-9
    with pytest.raises(TypeError, match="batched"):
        _result(True).evaluate(src, tgt, 1.0)


def test_inlier_rmse_is_open3ds_name_for_rmse():
    r = RegistrationResult(transformation=np.eye(4), fitness=0.5, rmse=0.25)
    assert r.inlier_rmse == 0.25
