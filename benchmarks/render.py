"""Write BENCHMARKS.md from every JSON file in benchmarks/results/ (never edit it by hand).

    python benchmarks/render.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
OUT = HERE.parent / "BENCHMARKS.md"

ORDER = [
    "first_call", "latency", "tranche3_ab", "tranche3_cpu_ab", "anderson", "gicp", "gicp_s21",
    "gicp_s22", "gicp_s23", "gicp_s21cpu", "refine", "many", "many_global", "many_dask", "multiway",
    "estimates", "session4_ab", "cpu", "session_ab", "refactor_ab", "memory", "precision", "knn",
    "kdtree", "icp", "soft", "surface", "ransac", "hard_pairs", "hard_pairs_open3d"]


def _fmt(v):
    if isinstance(v, float):
        if v != v:
            return "n/a"
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1000 or a < 1e-3:
            return f"{v:.3g}"
        return f"{v:.4g}"
    if v is None:
        return ""
    return str(v)


def _table(rows, columns=None):
    if not rows:
        return ""
    cols = list(columns or [])
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    docs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]
    docs.sort(key=lambda d: (ORDER.index(d["topic"]) if d["topic"] in ORDER else 99,
                             d["meta"].get("device_type") != "cuda", d["topic"]))
    out = ["# Benchmarks", "",
           "Written by `benchmarks/render.py` from `benchmarks/results/*.json`; each section",
           "names its device, date, commit, versions and the command that produced it. Times",
           "are medians after warm-up (CUDA events on the GPU), with the inter-quartile range",
           "where given. Peers ran in the same process on the same inputs.", ""]
    for d in docs:
        m = d["meta"]
        out += [f"## {d['title']} ({m['device']})", "",
                f"- date: {m['date']}, commit `{m['commit']}`",
                f"- command: `{m['command']}`",
                "- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()), ""]
        if d.get("notes"):
            out += [d["notes"], ""]
        if d.get("rows"):
            out += [_table(d["rows"], d.get("columns")), ""]
        for name, rows in d.get("tables", {}).items():
            if d["topic"] == "hard_pairs" and name == "pairs":
                continue  # per-pair rows stay in the JSON; the cells summarise them
            if d["topic"] == "first_call" and name == "compile":
                # per module for register() (the demo's); the other steps' totals only
                rows = [r for r in rows if r.get("step") == "register"
                        or r.get("module") == "(all)"]
            out += [f"### {name}", "", _table(rows), ""]
        for png in sorted(RESULTS.glob(f"{d['topic']}-{m['device_type']}*.png")):
            out += [f"![{png.stem}](benchmarks/results/{png.name})", ""]
        if m["device_type"] == "cuda":  # figures written by benchmarks/plot_<topic>.py
            for png in sorted((HERE.parent / "docs" / "img").glob(f"{d['topic']}_*.png")):
                out += [f"![{png.stem}](docs/img/{png.name})", ""]
    OUT.write_text("\n".join(out))
    print(f"wrote {OUT} from {len(docs)} result files")


if __name__ == "__main__":
    main()
