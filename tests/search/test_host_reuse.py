"""Work the CPU path no longer repeats: SciPy's tree built only when queried, and ICP's
estimated target normals searched on the correspondence index (same answers as before)."""

from __future__ import annotations

import torch

from pointalign.kernels import _backend
from pointalign.search.ckdtree import CKDTreeIndex
from tests._backends import backends


def _sheet(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g)
    return torch.cat([xy, (0.1 * torch.sin(5 * xy[:, :1]) * torch.cos(3 * xy[:, 1:]))], 1)


@backends("cpu", "torch")
def test_ckdtree_scipy_tree_built_on_first_use(backend):
    p, q = _sheet(500, 0), _sheet(50, 1)
    ix = CKDTreeIndex(p)
    assert ix._scipy is None  # nothing built yet
    res = ix.knn(q, 3)
    truth = torch.cdist(q.double(), p.double()).square().topk(3, largest=False)
    assert torch.equal(res.idx, truth.indices)
    uses_host = _backend.backend(p) == "cpu" and ix.uses_hint
    assert (ix._scipy is None) == uses_host  # only SciPy's path builds SciPy's tree


def test_icp_normals_on_the_correspondence_index_equal_their_own_tree(monkeypatch):
    from pointalign.registration import _edge
    from pointalign.registration import icp as icp_mod

    t = _sheet(3000, 2)
    t[100:110] = t[:10]  # duplicates: ties broken by index the same way in both trees
    pair = _edge.prepare_pair(t[::2], t, init=None, device=torch.device("cpu"), local=True,
                              source_lengths=None, target_lengths=None)
    idxs = icp_mod._indexes(pair, None, 0.05)
    seen = []
    real = CKDTreeIndex.knn
    monkeypatch.setattr(CKDTreeIndex, "knn", lambda self, *a: seen.append(self) or real(self, *a))
    shared = icp_mod._normals(t, None, pair, idxs)
    own = icp_mod._normals(t, None, pair)
    assert torch.equal(shared, own)
    base = getattr(idxs[0], "index", idxs[0])
    if isinstance(base, CKDTreeIndex):  # the host path reuses it, and only then
        assert seen[0] is base and seen[-1] is not base


def test_import_sets_passive_wait_policy_unless_set():
    """Importing pointalign before torch makes idle OpenMP threads sleep; a user's choice
    is left alone."""
    import os
    import subprocess
    import sys

    code = "import {} , os; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}

    def run(mods, **extra):
        out = subprocess.run([sys.executable, "-c", code.format(mods)], env={**env, **extra},
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()

    assert run("pointalign") == "PASSIVE"
    assert run("pointalign", OMP_WAIT_POLICY="active") == "active"
