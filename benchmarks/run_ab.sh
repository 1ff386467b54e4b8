#!/usr/bin/env bash
# Issue 12's before/after timing in one device call: the old code unpacked in .base/
# (git archive 356792a src benchmarks | tar -x -C .base), the new one in src/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 POINTALIGN_DATA="$PWD/.data"
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
for rep in 1 2; do for lab in before after; do
  if [ $lab = before ]; then SRC=.base/src; else SRC=src; fi
  PYTHONPATH="$PWD/$SRC:${PYTHONPATH:-}" python3 benchmarks/bench_ab.py --label $lab --out "$OUT/${lab}_$rep.json"
done; done
PYTHONPATH="$PWD/src:${PYTHONPATH:-}" python3 benchmarks/bench_ab.py --compare "$OUT"/before_*.json "$OUT"/after_*.json
