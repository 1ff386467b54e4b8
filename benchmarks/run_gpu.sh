#!/usr/bin/env bash
# Run the GPU tests and the benchmarks on a CUDA machine with no network.
# Wheels for packages missing there (small_gicp, pykdtree, plyfile, pypcd4 and deps) are
# expected in .whl/, the shared real data in .data/ (both git-ignored; see README).
#   bash benchmarks/run_gpu.sh tests            # pytest -m gpu
#   bash benchmarks/run_gpu.sh bench knn icp     # selected benchmarks
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 POINTALIGN_DATA="$PWD/.data"
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD/src:/tmp/site:${PYTHONPATH:-}"
what=${1:-tests}; shift || true
case "$what" in
  tests) python3 -m pytest -q -m gpu -p no:cacheprovider "$@" ;;
  all)   python3 -m pytest -q -p no:cacheprovider "$@" ;;
  bench) for b in "$@"; do echo "=== bench_$b"; python3 "benchmarks/bench_$b.py" || echo "FAILED bench_$b"; done ;;
esac
