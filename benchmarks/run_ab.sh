#!/usr/bin/env bash
# A before/after timing in one device call: the old code unpacked in $BASE (default .base,
# made with: git archive 356792a src benchmarks | tar -x -C .base), the new one in src/.
#   BASE=.base2 TOPIC=session_ab BASE_NAME="4e78fc8" bash benchmarks/run_ab.sh
# EXTRA_BASE (with EXTRA_NAME, EXTRA_TOPIC): one more old checkout, run once after the pairs
# and compared with the same 'after' runs (e.g. the start of an earlier session).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 POINTALIGN_DATA="$PWD/.data"
OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
BASE=${BASE:-.base}; TOPIC=${TOPIC:-refactor_ab}; BASE_NAME=${BASE_NAME:-".base = 356792a"}
for rep in 1 2; do for lab in before after; do
  if [ $lab = before ]; then SRC=$BASE/src; else SRC=src; fi
  PYTHONPATH="$PWD/$SRC:${PYTHONPATH:-}" python3 benchmarks/bench_ab.py --label $lab --out "$OUT/${lab}_$rep.json"
done; done
if [ -n "${WITHOUT_CHECK:-}" ]; then  # one more 'after' run with the measured stability off
  PYTHONPATH="$PWD/src:${PYTHONPATH:-}" python3 benchmarks/bench_ab.py --label after-without-check --without-check --out "$OUT/nocheck_1.json"
fi
PYTHONPATH="$PWD/src:${PYTHONPATH:-}" python3 benchmarks/bench_ab.py --compare "$OUT"/before_*.json "$OUT"/after_*.json $(ls "$OUT"/nocheck_*.json 2>/dev/null) --topic "$TOPIC" --base "$BASE_NAME" --title "${TITLE:-}" --notes "${NOTES:-}"
if [ -n "${EXTRA_BASE:-}" ]; then
  mkdir -p "$OUT/extra"
  PYTHONPATH="$PWD/$EXTRA_BASE/src:${PYTHONPATH:-}" python3 benchmarks/bench_ab.py --label before --out "$OUT/extra/before_1.json"
  PYTHONPATH="$PWD/src:${PYTHONPATH:-}" python3 benchmarks/bench_ab.py --compare "$OUT"/extra/before_1.json "$OUT"/after_*.json --topic "${EXTRA_TOPIC:-extra_ab}" --base "${EXTRA_NAME:-$EXTRA_BASE}"
fi
