"""kernels.anderson.anderson_update (the Anderson step's update) against its reference
``anderson_update_reference`` (``kernels/anderson/reference.py``), by backend and through
the Triton interpreter.

Both compute in float64 from the same inputs. The kernel takes so(3)'s log through Newton
steps where the spec calls ``atan2``, and solves the small Gram system by Cholesky where the
spec uses LU: two backward-stable solves agree to ~κ u. With at most six differences of
six-vectors the Gram systems here are well conditioned and the poses agree to 1e-12; with
seven (eight slots) the Gram matrix is singular but for the ridge (κ up to 1/RIDGE = 1e10)
and they agree to 1e-6. The counts, flags and selections agree exactly.
"""

from __future__ import annotations

import pytest
import torch

from pointalign import _math
from pointalign.kernels import _backend, anderson
from pointalign.kernels.anderson.reference import anderson_update_reference
from tests._interpreted import interpreted_fixture

#: (seed, history slots m + 1, problems)
CASES = [(0, 6, 8), (1, 3, 5), (2, 8, 4)]


def _pose(g: torch.Generator, B: int, angle: float) -> torch.Tensor:
    T = torch.eye(4, dtype=torch.float64).repeat(B, 1, 1)
    T[:, :3, :3] = _math.so3_exp(angle * torch.randn(B, 3, generator=g, dtype=torch.float64))
    T[:, :3, 3] = torch.randn(B, 3, generator=g, dtype=torch.float64)
    return T


def _case(seed: int, K: int, B: int):
    """Every branch among the problems: empty and full histories, rejected and accepted
    accelerated points, an unusable update, an origin far from the identity (near π)."""
    g = torch.Generator().manual_seed(seed)
    origin = _pose(g, B, 1.0)
    origin[0, :3, :3] = _math.so3_exp(torch.tensor([[0.0, 0.0, 3.1]], dtype=torch.float64))
    T = _pose(g, B, 0.3) @ origin
    T[1] = origin[1]  # at the origin: x = 0
    plain = _pose(g, B, 0.02) @ T
    # histories of a smooth sequence (the Gram systems well conditioned, as in ICP)
    steps = torch.randn(B, K, 6, generator=g, dtype=torch.float64)
    x_hist = 0.1 * steps.cumsum(1)
    g_hist = x_hist + 0.05 * torch.randn(B, K, 6, generator=g, dtype=torch.float64)
    count = torch.randint(0, K + 1, (B,), generator=g)
    count[:2] = torch.tensor([0, K])
    energy = 50.0 + 100.0 * torch.rand(B, generator=g, dtype=torch.float64)
    accelerated = torch.rand(B, generator=g) < 0.6
    accelerated[:2] = torch.tensor([False, True])
    flags = torch.ones(B, 2, dtype=torch.int32)
    flags[-1, 1] = 0
    state = {"T": T, "x_hist": x_hist, "g_hist": g_hist, "count": count, "energy": energy,
             "accelerated": accelerated, "fallback": _pose(g, B, 0.2),
             "fallback_update": _pose(g, B, 0.05)}
    record = {"T": plain, "update": plain @ torch.linalg.inv(T),
              "sums": 100.0 * torch.rand(B, 30, generator=g, dtype=torch.float64),
              "flags": flags}
    consts = {"origin": origin, "n_valid": torch.full((B,), 120.0, dtype=torch.float64),
              "scale": 0.5 + torch.rand(B, generator=g, dtype=torch.float64),
              "pivot": torch.randn(B, 3, generator=g, dtype=torch.float64)}
    return state, record, consts, 0.5


def _on(tensors: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in tensors.items()}


def _check(got, want, slots: int) -> None:
    (gs, gr), (ws, wr) = got, want
    tol = 1e-12 if slots - 1 <= 6 else 1e-6
    assert set(gs) == set(ws) and set(gr) == set(wr)
    for out, ref in ((gs, ws), (gr, wr)):
        for key, w in ref.items():
            v = out[key].cpu()
            assert v.shape == w.shape and v.dtype == w.dtype, key
            if w.dtype.is_floating_point:
                torch.testing.assert_close(v, w, rtol=0, atol=tol if w.dtype ==
                                           torch.float64 else 1e-6, msg=key)
            else:
                assert torch.equal(v, w), key


@pytest.mark.parametrize("case", CASES, ids=[str(c[0]) for c in CASES])
def test_update_matches_reference(backend, case):
    state, record, consts, tau2 = _case(*case)
    got = anderson.anderson_update(_on(state, backend.device), _on(record, backend.device),
                                   _on(consts, backend.device), tau2)
    want = anderson_update_reference(state, record, consts, tau2)
    _check(got, want, case[1])
    ws, wr = want
    # the cases reach every branch
    assert wr["accepted"].any() and not wr["accepted"].all()
    assert ws["accelerated"].any() and (wr["accepted"] & ~ws["accelerated"]).any()


def test_reference_branches():
    """The spec itself on its branches (not against the kernel): a rejected point returns to
    the fallback and restarts the history; an accepted one shifts it in."""
    state, record, consts, tau2 = _case(0, 6, 8)
    out, rec = anderson_update_reference(state, record, consts, tau2)
    energy = anderson.truncated_energy(record["sums"], consts["n_valid"], tau2)
    reject = state["accelerated"] & (energy > state["energy"])
    assert torch.equal(rec["accepted"], ~reject)
    assert torch.equal(out["T"][reject], state["fallback"][reject])
    assert (out["count"][reject] == 0).all()
    keep = ~reject
    x = anderson.to_vector(state["T"], consts["origin"], consts["scale"], consts["pivot"])
    torch.testing.assert_close(out["x_hist"][keep, -1], x[keep], rtol=0, atol=0)
    assert torch.equal(out["x_hist"][keep, :-1], state["x_hist"][keep, 1:])


def run_interpreted_anderson(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the Triton update through the dispatcher."""
    assert _backend.backend(torch.empty(0)) == "interpret"
    torch.save({case: anderson.anderson_update(*_case(*case)) for case in CASES}, out_path)


interpreted = interpreted_fixture("tests.kernels.test_anderson", "run_interpreted_anderson")


@pytest.mark.parametrize("case", CASES, ids=[str(c[0]) for c in CASES])
def test_triton_interpreted_matches_reference(interpreted, case):
    _check(interpreted[case], anderson_update_reference(*_case(*case)), case[1])
