"""Plot Tamaki et al.'s Fig. 1 from ``benchmarks/results/soft-<device>.json``.

Time (ms, log) against points per side (log) for every algorithm and device in the results
(the GPU file's main table and its "cpu" table, plus soft-cpu.json when present), with the
H100 floor of EM-ICP and the seed code's published H100 times (issue 4) for reference.
Writes ``benchmarks/results/soft-cuda-fig1.png`` (picked up by ``render.py``).

    python benchmarks/plot_soft.py [results/soft-cuda.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
#: the seed code (Tamaki et al.'s GPU implementation) built and run on an H100 (issue 4)
SEED_H100_MS = {"EM-ICP seed code (H100)": [(5000, 40.0), (40000, 1690.0)],
                "Softassign seed code (H100)": [(5000, 750.0)]}
#: the issue's H100 targets
TARGET_MS = {"EM-ICP target": [(5000, 3.0), (40000, 60.0), (200000, 1500.0)],
             "Softassign target": [(5000, 30.0)]}


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = [Path(a) for a in sys.argv[1:]] or sorted(RESULTS.glob("soft-*.json"))
    series: dict[str, list[tuple[int, float]]] = {}
    floor: dict[int, float] = {}
    for f in files:
        doc = json.loads(f.read_text())
        dev = doc["meta"].get("device", f.stem)
        tables = [("", doc.get("rows", []))] + list(doc.get("tables", {}).items())
        for _tname, rows in tables:
            for r in rows:
                label = f"{r['algorithm']} ({'CPU' if r['device'] == 'cpu' else dev})"
                series.setdefault(label, []).append((r["points"], r["time_ms"]))
                if r["algorithm"] == "emicp" and r.get("floor_ms") and r["device"] != "cpu":
                    floor[r["points"]] = r["floor_ms"]
    if not series:
        raise SystemExit("no soft-*.json results found")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    for label, pts in SEED_H100_MS.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "x:", ms=9, label=label)
    for label, pts in TARGET_MS.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "v", ms=7, mfc="none", label=label)
    if floor:
        xs = sorted(floor)
        ax.plot(xs, [floor[x] for x in xs], "k--", lw=1, label="EM-ICP floor (H100 FP32)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("points per side")
    ax.set_ylabel("time (ms)")
    ax.set_title("bun045 → bun000: time against points (cf. Tamaki et al. Fig. 1)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = RESULTS / "soft-cuda-fig1.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
