"""Look at a registration: a before/after PNG, the convergence plot and an HTML viewer.

Shows: ``pointalign.viz.render`` (three views, before and after, one PNG),
``viz.plot_history`` (RMSE/fitness per iteration and time per stage) and
``viz.write_html`` (one self-contained file: open it in a browser, no server). Needs the
``viz`` extra (matplotlib, plotly).

    python examples/viewer.py --device cpu
    python examples/viewer.py --out pictures/
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import pointalign as pa
from pointalign import viz


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None, help="folder for the pictures")
    p.add_argument("--points", type=int, default=3000)
    args = p.parse_args()

    out = args.out or Path(tempfile.mkdtemp(prefix="pointalign-viewer-"))
    out.mkdir(parents=True, exist_ok=True)
    pair = pa.datasets.load_bunny_pair()
    src = pa.datasets.random_subsample(pair.source, args.points, seed=0)
    tgt = pa.datasets.random_subsample(pair.target, args.points, seed=1)
    init = pa.transforms.random_transform(5.0, 0.005) @ torch.as_tensor(pair.T_target_source)
    result = pa.icp(src, tgt, init=init, max_correspondence_distance=0.005,
                    device=args.device)
    print(result.summary())
    print("wrote", viz.render(src, tgt, result.transformation, path=out / "pair.png",
                              title="bun045 -> bun000"))
    print("wrote", viz.plot_history(result, out / "history.png"))
    print("wrote", viz.write_html(src, tgt, result.transformation, out / "pair.html",
                                  result=result))


if __name__ == "__main__":
    main()
