"""numba's ahead-of-time compiler (``numba.pycc``) on one of register()'s kernels (issue 23).

Builds ``features.cpu._normals`` (a ``prange`` kernel) for its register() signature (from
the compile manifest) into an extension module with ``numba.pycc.CC``, then times it
against the JIT kernel on 200,000 points (k = 30) and checks the outputs are equal.

Measured on the shared 2-core EPYC (numba 0.68.1): importing numba.pycc warns "The 'pycc'
module is pending deprecation. Replacement technology is being developed."; the build of
this one kernel took 3.2 s wall on a quiet machine (11-21 s under load; the whole probe
6.1 s of CPU with gcc); the AOT kernel ran in 55 ms against 31 ms for the JIT one on 2
threads (357-392 ms against 220-237 ms under load): pycc compiles without numba's
parallel passes, so the prange loop runs serially; equal outputs. Not adopted: a
deprecated API, a C compiler at installation or one binary wheel per platform, serial
kernels; the warm-up compiles the JIT kernels instead.

    python benchmarks/probe_pycc.py
"""

from __future__ import annotations

import importlib
import sys
import tempfile
import time
import warnings

import numpy as np


def main() -> None:
    from numba.core import types

    from pointalign.kernels import _numba
    from pointalign.kernels.features import cpu as fc

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from numba.pycc import CC
    print("import warning:", [str(w.message).splitlines()[0] for w in caught][:1])
    tmp = tempfile.mkdtemp()
    cc = CC("pa_aot_normals")
    cc.output_dir = tmp
    args = [a for k, a, _ in _numba.manifest()["register"] if k == "features.cpu._normals"][0]
    sig = _numba.signature(args)
    assert sig is not None
    cc.export("normals", types.void(*sig))(fc._normals.py_func)
    c, t = time.process_time(), time.perf_counter()
    cc.compile()
    print(f"pycc build: {time.perf_counter() - t:.1f} s wall, {time.process_time() - c:.1f} s "
          "CPU of this process (gcc runs as a child)")
    sys.path.insert(0, tmp)
    aot = importlib.import_module("pa_aot_normals")
    rng = np.random.default_rng(0)
    n, k = 200_000, 30
    pts = rng.random((n, 3), dtype=np.float32)
    idx = rng.integers(0, n, (n, k))
    vp = np.zeros(3, np.float32)
    out_jit, out_aot = np.empty((n, 3), np.float32), np.empty((n, 3), np.float32)
    fc._normals(pts, idx, pts, vp, False, out_jit)  # compiled or loaded from the cache
    t = time.perf_counter()
    aot.normals(pts, idx, pts, vp, False, out_aot)
    t_aot = time.perf_counter() - t
    t = time.perf_counter()
    fc._normals(pts, idx, pts, vp, False, out_jit)
    t_jit = time.perf_counter() - t
    print(f"{n:,} normals: AOT {1e3 * t_aot:.0f} ms, JIT {1e3 * t_jit:.0f} ms, "
          f"equal {np.array_equal(out_jit, out_aot)}")


if __name__ == "__main__":
    main()
