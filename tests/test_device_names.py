"""Every public entry point accepts the device spelled "cuda" (no ordinal) with CUDA inputs.

``torch.device("cuda") != torch.device("cuda:0")``: a device argument must be resolved to
the ordinal it means before it is compared with the devices of tensors or indexes.
"""

from __future__ import annotations

import pytest
import torch

import pointalign as pa

pytestmark = pytest.mark.gpu


def _pair(n: int = 3000):
    g = torch.Generator().manual_seed(0)
    src = torch.rand(n, 3, generator=g) * torch.tensor([1.0, 0.8, 0.3])
    src[:, 2] += 0.1 * torch.sin(6 * src[:, 0]) * torch.cos(5 * src[:, 1])
    T = pa.transforms.random_transform(5.0, 0.02, generator=g)
    tgt = pa.transforms.apply(T.to(torch.float64), src.double()).float()
    return src.cuda(), tgt.cuda()


def test_as_device_names_the_ordinal():
    from pointalign import _validate

    assert _validate.as_device("cuda") == torch.empty(0, device="cuda").device


@pytest.mark.parametrize("name", ["icp", "icp_index", "register", "ransac", "emicp",
                                  "surface_newton"])
def test_device_cuda_without_ordinal(name):
    src, tgt = _pair()
    if name == "icp":
        res = pa.icp(src, tgt, device="cuda", max_correspondence_distance=0.1)
    elif name == "icp_index":
        res = pa.icp(src, tgt, device="cuda", index=pa.build_index(tgt),
                     max_correspondence_distance=0.1)
    elif name == "register":
        res = pa.register(src, tgt, device="cuda")
    elif name == "ransac":
        f_s, f_t = pa.fpfh(src, radius=0.1), pa.fpfh(tgt, radius=0.1)
        res = pa.ransac(src, tgt, source_features=f_s, target_features=f_t, device="cuda",
                        target_index=pa.build_index(tgt), max_correspondence_distance=0.03)
    elif name == "emicp":
        res = pa.emicp(src[::6], tgt[::6], device="cuda")
    else:
        res = pa.surface_newton(src, tgt, device="cuda")
    assert res.transformation.shape == (4, 4)
