"""Plot Zabatani & Bronstein's Fig. 4 and Fig. 5 from ``benchmarks/results/surface-cuda.json``.

Fig. 4: time of one iteration against input size (left) and speed-up over the CPU (right);
Fig. 5: time to convergence against input size, tree reused (solid) and including the tree
+ approximant build (dashed) (left), and speed-up over the CPU (right). The CPU anchors (our
ICP on the CPU, small_gicp ICP on all cores) are measured at 10⁵ points only; the speed-up
at larger sizes divides by the CPU time scaled linearly in N from there (marked
"extrapolated"). Writes ``docs/img/surface_fig4.png`` and ``docs/img/surface_fig5.png``.

    python benchmarks/plot_surface.py [results/surface-cuda.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
OUT = HERE.parent / "docs" / "img"
CPU = ("CPU ICP (ours)", "small_gicp ICP", "small_gicp ICP (CPU)")


def _series(rows, key):
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and v == v:
            out.setdefault(r["algorithm"], []).append((int(r["N"]), float(v)))
    return {k: sorted(v) for k, v in out.items()}


def _cpu_at(series, name, n):
    """CPU time at ``n``: measured, or scaled linearly in N from the largest measured size."""
    pts = series.get(name)
    if not pts:
        return None, False
    d = dict(pts)
    if n in d:
        return d[n], False
    n0, t0 = pts[-1]
    return t0 * n / n0, True


def _plot(ax_t, ax_s, series, cpu_name, ylabel, title, dashed=None):
    for name, pts in series.items():
        if name in CPU:
            continue
        line, = ax_t.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
        if dashed and name in dashed:
            q = dashed[name]
            ax_t.plot([p[0] for p in q], [p[1] for p in q], "--", color=line.get_color(), lw=1)
        sx, sy, ext = [], [], []
        for n, t in pts:
            c, e = _cpu_at(series, cpu_name, n)
            if c is not None and t > 0:
                sx.append(n)
                sy.append(c / t)
                ext.append(e)
        if sx:
            ax_s.plot(sx, sy, "o-", color=line.get_color(), label=name)
            ax_s.plot([x for x, e in zip(sx, ext, strict=True) if e],
                      [y for y, e in zip(sy, ext, strict=True) if e],
                      "o", mfc="white", color=line.get_color())
    for name, mk in zip(CPU, ("k^", "ks", "ks"), strict=True):
        if name in series:
            pts = series[name]
            label = name if name.endswith("(CPU)") else f"{name} (CPU)"
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], mk, label=label)
    for ax in (ax_t, ax_s):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("points N (template = query size)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_ylabel(ylabel)
    ax_t.set_title(title, fontsize=9)
    ax_s.set_ylabel(f"speed-up over {cpu_name}")
    ax_s.set_title("open markers: CPU time extrapolated linearly from 1e5", fontsize=8)
    ax_t.legend(fontsize=6)
    ax_s.legend(fontsize=6)


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "surface-cuda.json"
    doc = json.loads(path.read_text())
    dev = doc["meta"].get("device", path.stem)
    tables = doc.get("tables", {})
    it_rows = tables.get("iteration (Fig. 4)", [])
    cv_rows = tables.get("converge (Fig. 5, Tables 1-2)", [])
    if not it_rows or not cv_rows:
        raise SystemExit(f"{path}: no iteration/converge tables")
    OUT.mkdir(parents=True, exist_ok=True)

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    _plot(a, b, _series(it_rows, "ms"), "CPU ICP (ours)", "time of one iteration (ms)",
          f"one iteration, bunny upsampled ({dev}); cf. Zabatani & Bronstein Fig. 4")
    fig.tight_layout()
    fig.savefig(OUT / "surface_fig4.png", dpi=120)
    plt.close(fig)

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    _plot(a, b, _series(cv_rows, "ms"), "small_gicp ICP (CPU)", "time to convergence (ms)",
          f"to convergence ({dev}); dashed: incl. tree + approximant build; cf. Fig. 5",
          dashed=_series(cv_rows, "ms_incl_build"))
    fig.tight_layout()
    fig.savefig(OUT / "surface_fig5.png", dpi=120)
    plt.close(fig)
    print(f"wrote {OUT / 'surface_fig4.png'} and {OUT / 'surface_fig5.png'}")


if __name__ == "__main__":
    main()
