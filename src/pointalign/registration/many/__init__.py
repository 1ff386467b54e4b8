"""register_many(): many pairs at once, batched on one device or in chunks on a Dask cluster.

On one device the pairs run chunk by chunk (``chunk_size`` pairs), and inside a chunk
through the stages of :func:`~pointalign.registration.pipeline.register` (the same
functions, so the same options and the same rules):

1. **read** each cloud (paths are read here, on the worker that runs the chunk), then
   check all of the chunk's clouds and move them to their local frames at once
   (:func:`~pointalign.registration._edge.prepare_pairs`: one copy to the device, one
   NaN/Inf scan, ``prepare_pair``'s numbers and errors pair by pair);
2. **global stage**: on a GPU, batched for the chunk's pairs without an ``init``
   (:mod:`.batched_prepare`, :mod:`.batched_ransac`: the voxel edges v and stray decisions
   of all pairs by a few host synchronisations, one downsampling sort, one packed
   neighbour search, the normal and FPFH kernels once, RANSAC's rounds and the
   compatibility-graph proposals for all pairs at once; the rule is
   :func:`.batched.applies`), else per pair
   (``pipeline._prepare_pair``: v and stray points, downsampling, normals, FPFH;
   ``pipeline._global``: parallel RANSAC and the graph's proposals); a pair given an
   ``init`` is only downsampled and indexed;
3. **coarse ICP, batched**: ``pipeline._refine_hypotheses`` of every pair's best
   hypotheses in one point-to-plane :func:`~pointalign.registration.icp.icp` call (on a
   GPU the candidates' inlier counts, the overlap counts and the rankings of all pairs at
   once: :func:`.batched_local.refine_many`);
4. **final stage, batched**: ``pipeline._final_icp`` (point-to-plane ICP or GICP, as
   ``refine`` says), pairs grouped by size and padded; on a GPU the full clouds scaled and
   the targets' normals found for all pairs at once
   (:func:`.batched_local.final_clouds_many`), else per pair
   (``pipeline._final_clouds``);
5. **verdict, batched**: :func:`~pointalign.registration.verdict.verdicts` (on a GPU
   :func:`.batched_local.verdicts_many`: the counts of all pairs by
   one search), one transfer for the group.

``timings`` splits the stages: ``read.io`` / ``read.prepare`` (host clock only),
``global.<part>`` (the batched global stage), ``local.<part>`` (``rows``, ``coarse_rank`` /
``coarse_icp`` / ``coarse_overlap`` on a GPU or ``coarse`` per pair, ``final_clouds``,
``final_prepare``, ``final_icp``, ``verdict``): seconds summed over pairs, the device
synchronised once at each part's end (once per group, not per pair).

A pair's voxel edge v differs from pair to pair, and one ICP call takes one bound: each pair
is registered in its own frame, centred on its target's centroid (in float64) and **scaled
by 1/v** (``Scales(1, …)``), so that every bound is the same number of voxels for the whole
batch (pairs whose overridden bounds differ in voxels go in different batches). Poses come
back in the caller's coordinates: ``T = S(c, v) T_scaled S(c, v)⁻¹``.

With ``client=`` (a ``distributed.Client``) each chunk is one Dask task; clouds given as
paths are read on the worker. Dask reruns the tasks of a worker that dies (up to its
``distributed.scheduler.allowed-failures``) and ``retries=`` reruns a task that raised;
results are gathered by pair index, each pair exactly once.

On the CPU a pair of at most :data:`SERIAL_POINTS` points runs on one thread: the pairs,
not the kernels, are the parallel work. To use several cores, pass the client of a local
cluster with one single-threaded worker process per core
(``distributed.LocalCluster(n_workers=cores, threads_per_worker=1)``).

Where each part lives:

* :mod:`.api`: :func:`register_many`, the entry point;
* :mod:`.pairs`: :class:`PairSpec` and the forms ``pairs`` may take;
* :mod:`.table`: :class:`ManyResult` (rows, CSV, Parquet, pandas) and :data:`COLUMNS`;
* :mod:`.chunk`: one chunk (:func:`run_chunk`: read, then the stages), the chunk sizes;
* :mod:`.cluster`: the chunks as Dask tasks;
* :mod:`.work`: a pair in flight between the stages;
* :mod:`.global_stage`, :mod:`.local_stages`: a chunk's stages, per pair or batched;
* :mod:`.batched`: which path runs (:data:`.batched.BATCHED`), what the batched stages share;
* :mod:`.batched_prepare`, :mod:`.batched_ransac`: the global stage, batched;
* :mod:`.batched_local`: the local stages' per-pair work, batched.
"""

from pointalign.registration.many.api import register_many
from pointalign.registration.many.chunk import CHUNK_CPU, CHUNK_CUDA, SERIAL_POINTS, run_chunk
from pointalign.registration.many.pairs import PairSpec
from pointalign.registration.many.table import COLUMNS, ManyResult

__all__ = ["CHUNK_CPU", "CHUNK_CUDA", "COLUMNS", "SERIAL_POINTS", "ManyResult", "PairSpec",
           "register_many", "run_chunk"]
