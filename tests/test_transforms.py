import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pointalign import transforms as T

finite = st.floats(-3.0, 3.0, allow_nan=False)
vec3 = st.tuples(finite, finite, finite)


def _rot(seed, n=None):
    return T.random_rotation(n, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_random_rotations_are_proper(seed):
    R = _rot(seed, 8)
    eye = torch.eye(3, dtype=R.dtype)
    assert torch.allclose(R.transpose(-1, -2) @ R, eye.expand_as(R), atol=1e-12)
    assert torch.allclose(torch.linalg.det(R), torch.ones(8, dtype=R.dtype), atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_quaternion_round_trip(seed):
    R = _rot(seed, 5)
    q = T.matrix_to_quaternion(R)
    assert torch.allclose(q.norm(dim=-1), torch.ones(5, dtype=q.dtype))
    assert (q[:, 0] >= 0).all()
    assert torch.allclose(T.quaternion_to_matrix(q), R, atol=1e-12)
    assert torch.allclose(T.quaternion_to_matrix(-q), R, atol=1e-12)


def test_quaternion_near_pi_is_stable():
    axes = torch.nn.functional.normalize(torch.randn(20, 3, dtype=torch.float64), dim=-1)
    R = T.so3_exp(axes * (math.pi - 1e-9))
    assert torch.allclose(T.quaternion_to_matrix(T.matrix_to_quaternion(R)), R, atol=1e-9)
    assert torch.allclose(T.rotation_angle(R), torch.full((20,), math.pi, dtype=R.dtype),
                          atol=1e-7)


def test_quaternion_convention_against_scipy():
    from scipy.spatial.transform import Rotation

    q = torch.tensor([0.9, 0.1, -0.3, 0.2], dtype=torch.float64)
    q = q / q.norm()
    ours = T.quaternion_to_matrix(q).numpy()
    theirs = Rotation.from_quat(q[[1, 2, 3, 0]].numpy()).as_matrix()  # scipy: scalar last
    np.testing.assert_allclose(ours, theirs, atol=1e-12)


@settings(max_examples=80, deadline=None)
@given(vec3, vec3)
def test_se3_exp_log_round_trip(omega, v):
    xi = torch.tensor(omega + v, dtype=torch.float64)
    if xi[:3].norm() > math.pi - 1e-3:
        xi[:3] *= (math.pi - 1e-3) / xi[:3].norm()
    M = T.se3_exp(xi)
    assert torch.allclose(T.se3_log(M), xi, atol=1e-8)
    assert torch.allclose(torch.linalg.det(M[:3, :3]), torch.tensor(1.0, dtype=M.dtype))


def test_so3_exp_small_angles_match_first_order():
    w = torch.tensor([1e-9, -2e-9, 3e-9], dtype=torch.float64)
    R = T.so3_exp(w)
    assert torch.allclose(R, torch.eye(3, dtype=R.dtype) + T.skew(w), atol=1e-17)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_compose_invert_apply(seed):
    g = torch.Generator().manual_seed(seed)
    A = T.make(T.random_rotation(4, generator=g),
               torch.randn(4, 3, generator=g, dtype=torch.float64))
    B = T.make(T.random_rotation(4, generator=g),
               torch.randn(4, 3, generator=g, dtype=torch.float64))
    p = torch.randn(4, 10, 3, generator=g, dtype=torch.float64)
    assert torch.allclose(T.apply(T.compose(A, B), p), T.apply(A, T.apply(B, p)), atol=1e-12)
    assert torch.allclose(T.apply(T.invert(A), T.apply(A, p)), p, atol=1e-12)
    assert torch.allclose(T.invert(A), torch.linalg.inv(A), atol=1e-12)
    # distances are preserved
    d0 = torch.cdist(p, p)
    assert torch.allclose(torch.cdist(T.apply(A, p), T.apply(A, p)), d0, atol=1e-10)


def test_apply_keeps_dtype_and_does_not_modify_input():
    p = torch.randn(5, 3)
    p0 = p.clone()
    out = T.apply(T.se3_exp(torch.ones(6, dtype=torch.float64) * 0.1), p)
    assert out.dtype == torch.float32 and torch.equal(p, p0)


def test_random_transform_has_requested_magnitudes():
    g = torch.Generator().manual_seed(3)
    M = T.random_transform(37.0, 0.25, generator=g)
    assert math.isclose(float(torch.rad2deg(T.rotation_angle(M[:3, :3]))), 37.0, rel_tol=1e-9)
    assert math.isclose(float(M[:3, 3].norm()), 0.25, rel_tol=1e-12)


def test_zero_quaternion_rejected():
    with pytest.raises(ValueError, match="zero quaternion"):
        T.quaternion_to_matrix(torch.zeros(4))
