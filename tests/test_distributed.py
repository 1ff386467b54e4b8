"""register_many on a real local Dask cluster (worker processes on this machine).

* the distributed table equals the single-process one bit for bit: the same chunks run
  the same code on the same kind of device (CPU workers, one thread each);
* clouds given as paths are read on the workers;
* a worker process killed while chunks run loses no pair and duplicates none (Dask
  reruns the chunks the dead worker held; its nanny starts a new one).

Small pairs with an init (the local stages only) keep the cluster tests short; one chunk
goes through the global stage too.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from pointalign import datasets, io, transforms
from pointalign.cloud import PointCloud
from pointalign.registration.many import register_many

distributed = pytest.importorskip("distributed")


def _pairs(k: int, n: int = 300, seed: int = 0):
    bunny = datasets.load_bunny("bun000")
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(k):
        p = datasets.make_pair(datasets.random_subsample(bunny, n, seed=seed + s), 8.0, 0.005,
                               noise=3e-4, seed=seed + s)
        init = transforms.random_transform(2.0, 0.002, generator=g) @ p.T_target_source
        out.append((p.source.numpy(), p.target.numpy(), init.numpy()))
    return out


@pytest.fixture(scope="module")
def client():
    # processes, one thread each: what a CPU cluster runs; numba's kernels come from its cache
    env = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  dashboard_address=None, worker_dashboard_address=None,
                                  env=env) as cluster, distributed.Client(cluster) as c:
        yield c


def test_distributed_equals_single_process(client, tmp_path):
    pairs = _pairs(6)
    # two pairs as files: read on the worker, not shipped through the scheduler
    for k in (0, 1):
        s, t = tmp_path / f"s{k}.ply", tmp_path / f"t{k}.ply"
        io.write(s, PointCloud(pairs[k][0]))
        io.write(t, PointCloud(pairs[k][1]))
        pairs[k] = (str(s), str(t), pairs[k][2])
    # and one pair without an init: the global stage on a worker
    p = _pairs(1, seed=40)[0]
    pairs.append((p[0], p[1]))
    local = register_many(pairs, device="cpu", chunk_size=2, hypotheses=512)
    dist = register_many(pairs, client=client, chunk_size=2, hypotheses=512)
    assert [r["index"] for r in dist.rows] == list(range(len(pairs)))
    np.testing.assert_array_equal(dist.transformations, local.transformations)
    for a, b in zip(dist.to_rows(), local.to_rows(), strict=True):
        for key in ("name", "fitness", "rmse", "verdict", "stop_reason", "iterations",
                    "overlap", "margin", "concentration", "stability"):
            assert a[key] == b[key], key
    assert all(r["trusted"] for r in dist.rows)


def test_killed_worker_loses_no_pair(client):
    pairs = _pairs(12, n=400, seed=100)
    local = register_many(pairs, device="cpu", chunk_size=1)
    pids = client.run(os.getpid)
    victim = sorted(pids.items())[0]
    import threading

    killed = []

    def kill_when_busy():
        # kill the worker process while the chunks run: wait until it holds a task
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            busy = client.processing().get(victim[0], ())
            if busy:
                os.kill(victim[1], signal.SIGKILL)  # a process this test's cluster started
                killed.append(len(busy))
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    dist = register_many(pairs, client=client, chunk_size=1)
    killer.join()
    assert killed, "the worker was never seen busy: nothing was tested"
    assert [r["index"] for r in dist.rows] == list(range(len(pairs)))  # none lost, none twice
    np.testing.assert_array_equal(dist.transformations, local.transformations)
    # the nanny restarts the worker: the cluster is whole again for later work
    client.wait_for_workers(2, timeout=60)
