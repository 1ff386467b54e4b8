"""Properties of ``pointalign.transforms`` over random inputs (hypothesis).

Round trips (compose/invert/apply, axis-angle, quaternions, se3), proper rotations, batched
and unbatched ``apply`` agreeing, float32 and float64, and one input policy: NumPy arrays are
accepted wherever tensors are and give the same result; other types and wrong shapes raise a
``TypeError``/``ValueError`` naming the argument. ``max_examples`` is kept small (CI time).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pointalign import transforms as T

FEW = settings(max_examples=25, deadline=None)
seeds = st.integers(0, 2**32 - 1)
dtypes = st.sampled_from([torch.float32, torch.float64])
#: absolute tolerance of a composed result per dtype (values of order 1-10)
TOL = {torch.float32: 2e-5, torch.float64: 1e-11}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _transforms(seed: int, n: int | None, dtype: torch.dtype) -> torch.Tensor:
    g = _gen(seed)
    shape = () if n is None else (n,)
    R = T.random_rotation(n, generator=g)
    t = torch.randn(*shape, 3, generator=g, dtype=torch.float64) * 3
    return T.make(R, t).to(dtype)


def _points(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(*shape, 3, generator=_gen(seed + 1), dtype=torch.float64) * 2).to(dtype)


@FEW
@given(seeds, dtypes, st.integers(1, 4))
def test_random_rotations_are_proper(seed, dtype, n):
    R = T.random_rotation(n, generator=_gen(seed), dtype=dtype)
    assert R.shape == (n, 3, 3) and R.dtype == dtype
    eye = torch.eye(3, dtype=dtype).expand(n, 3, 3)
    torch.testing.assert_close(R.transpose(-1, -2) @ R, eye, atol=10 * TOL[dtype], rtol=0)
    torch.testing.assert_close(torch.linalg.det(R.double()), torch.ones(n, dtype=torch.float64),
                               atol=10 * TOL[dtype], rtol=0)


@FEW
@given(seeds, dtypes)
def test_compose_invert_apply_round_trips(seed, dtype):
    A, B = _transforms(seed, 3, dtype), _transforms(seed + 7, 3, dtype)
    p = _points(seed, (3, 10), dtype)
    tol = dict(atol=TOL[dtype] * 10, rtol=0)
    eye = torch.eye(4, dtype=dtype).expand(3, 4, 4)
    torch.testing.assert_close(T.compose(A, T.invert(A)), eye, **tol)
    torch.testing.assert_close(T.compose(T.invert(A), A), eye, **tol)
    torch.testing.assert_close(T.invert(T.invert(A)), A, **tol)
    torch.testing.assert_close(T.apply(T.compose(A, B), p), T.apply(A, T.apply(B, p)), **tol)
    torch.testing.assert_close(T.apply(T.invert(A), T.apply(A, p)), p, **tol)
    torch.testing.assert_close(T.invert(T.compose(A, B)), T.compose(T.invert(B), T.invert(A)),
                               **tol)
    # compose is associative and takes any number of transforms
    torch.testing.assert_close(T.compose(A, B, A), T.compose(T.compose(A, B), A), **tol)
    torch.testing.assert_close(T.compose(A), A)


@FEW
@given(seeds, dtypes, st.integers(1, 3), st.integers(1, 6))
def test_apply_batched_agrees_with_one_at_a_time(seed, dtype, b, n):
    Ts = _transforms(seed, b, dtype)
    p = _points(seed, (b, n), dtype)
    batched = T.apply(Ts, p)
    assert batched.shape == (b, n, 3) and batched.dtype == dtype
    for i in range(b):
        torch.testing.assert_close(batched[i], T.apply(Ts[i], p[i]), atol=TOL[dtype], rtol=0)
        # one transform broadcast over a batch of clouds, a batch of transforms over one cloud
        torch.testing.assert_close(T.apply(Ts[i], p)[i], T.apply(Ts[i], p[i]))
        torch.testing.assert_close(T.apply(Ts, p[i])[i], T.apply(Ts[i], p[i]))


@FEW
@given(seeds, dtypes)
def test_apply_keeps_the_points_dtype_and_computes_in_the_transforms(seed, dtype):
    A = _transforms(seed, None, torch.float64)
    p = _points(seed, (7,), dtype)
    out = T.apply(A, p)
    assert out.dtype == dtype
    ref = (p.double() @ A[:3, :3].T + A[:3, 3]).to(dtype)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


@FEW
@given(seeds, st.floats(1e-3, math.pi - 1e-3), st.floats(1e-3, 10.0))
def test_axis_angle_matrix_round_trip(seed, angle, length):
    axis = torch.randn(3, generator=_gen(seed), dtype=torch.float64)
    axis = axis / axis.norm() * length
    R = T.axis_angle_to_matrix(axis, angle)
    unit = axis / axis.norm()
    torch.testing.assert_close(R @ unit, unit, atol=1e-12, rtol=0)        # the axis is fixed
    torch.testing.assert_close(T.rotation_angle(R), torch.tensor(angle, dtype=torch.float64),
                               atol=1e-9, rtol=0)
    torch.testing.assert_close(T.so3_log(R), unit * angle, atol=1e-8, rtol=0)
    torch.testing.assert_close(T.so3_exp(unit * angle), R, atol=1e-12, rtol=0)
    # the same rotation from the quaternion (cos θ/2, sin θ/2 · axis)
    q = torch.cat([torch.tensor([math.cos(angle / 2)], dtype=torch.float64),
                   math.sin(angle / 2) * unit])
    torch.testing.assert_close(T.quaternion_to_matrix(q), R, atol=1e-12, rtol=0)


@FEW
@given(seeds, st.floats(0.1, 10.0), st.booleans())
def test_quaternion_round_trip_any_scale_and_sign(seed, scale, negate):
    q = torch.randn(5, 4, generator=_gen(seed), dtype=torch.float64)
    R = T.quaternion_to_matrix(q * scale * (-1 if negate else 1))
    torch.testing.assert_close(R, T.quaternion_to_matrix(q), atol=1e-12, rtol=0)
    back = T.matrix_to_quaternion(R)
    assert bool((back[:, 0] >= 0).all())
    unit = q / q.norm(dim=-1, keepdim=True)
    unit = unit * torch.where(unit[:, :1] < 0, -1.0, 1.0)
    torch.testing.assert_close(back, unit, atol=1e-10, rtol=0)


@FEW
@given(seeds, st.floats(0.0, math.pi - 1e-2))
def test_se3_exp_log_round_trip(seed, angle):
    g = _gen(seed)
    omega = torch.randn(3, generator=g, dtype=torch.float64)
    omega = omega / omega.norm() * angle
    xi = torch.cat([omega, torch.randn(3, generator=g, dtype=torch.float64)])
    M = T.se3_exp(xi)
    torch.testing.assert_close(T.se3_log(M), xi, atol=1e-8, rtol=0)
    torch.testing.assert_close(T.invert(M), T.se3_exp(-xi), atol=1e-10, rtol=0)


# --------------------------------------------------------------------------- input policy

def _calls(seed: int) -> list[tuple[str, object, tuple]]:
    """(name, function, float64 tensor arguments) for every array-taking function."""
    A = _transforms(seed, None, torch.float64)
    g = _gen(seed)
    return [
        ("apply", T.apply, (A, torch.randn(4, 3, generator=g, dtype=torch.float64))),
        ("compose", T.compose, (A, T.invert(A))),
        ("invert", T.invert, (A,)),
        ("make", T.make, (A[:3, :3], A[:3, 3])),
        ("skew", T.skew, (A[:3, 3],)),
        ("quaternion_to_matrix", T.quaternion_to_matrix, (torch.randn(4, generator=g,
                                                                      dtype=torch.float64),)),
        ("matrix_to_quaternion", T.matrix_to_quaternion, (A[:3, :3],)),
        ("axis_angle_to_matrix", T.axis_angle_to_matrix, (A[:3, 3], A[0, 3])),
        ("so3_exp", T.so3_exp, (A[:3, 3] / 10,)),
        ("so3_log", T.so3_log, (A[:3, :3],)),
        ("se3_exp", T.se3_exp, (torch.randn(6, generator=g, dtype=torch.float64),)),
        ("se3_log", T.se3_log, (A,)),
        ("rotation_angle", T.rotation_angle, (A[:3, :3],)),
    ]


#: each function's array arguments, by name, as its error messages call them
ARG_NAMES = {"apply": ("T", "points"), "compose": ("Ts[0]", "Ts[1]"), "invert": ("T",),
             "make": ("rotation", "translation"), "skew": ("v",), "quaternion_to_matrix": ("q",),
             "matrix_to_quaternion": ("R",), "axis_angle_to_matrix": ("axis", "angle"),
             "so3_exp": ("omega",), "so3_log": ("R",), "se3_exp": ("xi",), "se3_log": ("T",),
             "rotation_angle": ("R",)}


@settings(max_examples=15, deadline=None)
@given(seeds, st.data())
def test_numpy_inputs_are_accepted_and_agree_with_tensors(seed, data):
    for name, fn, args in _calls(seed):
        as_numpy = data.draw(st.lists(st.booleans(), min_size=len(args), max_size=len(args)),
                             label=name)
        mixed = tuple(a.numpy() if flip else a for a, flip in zip(args, as_numpy, strict=True))
        ref, got = fn(*args), fn(*mixed)
        assert isinstance(got, torch.Tensor), name
        # equal up to rounding (a strided view and its contiguous copy reduce in other orders)
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=0, msg=name)


@settings(max_examples=15, deadline=None)
@given(seeds, st.data())
def test_bad_types_and_shapes_name_the_argument(seed, data):
    for name, fn, args in _calls(seed):
        i = data.draw(st.integers(0, len(args) - 1), label=f"{name} argument")
        arg_name = ARG_NAMES[name][i]
        if name == "axis_angle_to_matrix" and i == 1:
            continue  # the angle is a number; checked in the bad-input table
        bad = data.draw(st.sampled_from(["text", None, "bool", "complex", "shape"]),
                        label=f"{name} bad")
        if bad == "text":
            value, exc = "abc", TypeError
        elif bad is None:
            value, exc = None, TypeError
        elif bad == "bool":
            value, exc = args[i] > 0, TypeError
        elif bad == "complex":
            value, exc = args[i].to(torch.complex128), TypeError
        else:  # one column too many in the trailing dimension
            value, exc = torch.cat([args[i], args[i][..., :1]], -1), ValueError
        call = list(args)
        call[i] = value
        with pytest.raises(exc, match=rf"^{re.escape(arg_name)}(?![\w\[])"):
            fn(*call)


def test_inputs_are_not_modified():
    for name, fn, args in _calls(3):
        before = [a.clone() for a in args]
        fn(*args)
        for a, b in zip(args, before, strict=True):
            assert torch.equal(a, b), name


def test_integer_inputs_are_promoted():
    p = np.arange(12, dtype=np.int64).reshape(4, 3)
    out = T.apply(np.eye(4), p)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.from_numpy(p).float())
