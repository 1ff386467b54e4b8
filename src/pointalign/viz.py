"""Pictures of a registration: a before/after PNG, the convergence history, an HTML viewer.

Optional extra: ``pip install 'pointalign[viz]'`` (matplotlib for the PNGs, plotly for the
HTML viewer). Large clouds are subsampled for drawing only (a fixed random subset, the same
points before and after); nothing here changes the inputs or the result.

* :func:`render`: both clouds in two colours from three viewpoints (along the target's
  principal axes), before (top row) and after (bottom row) the transformation, one image.
* :func:`plot_history`: RMSE and fitness per iteration, and the time per stage.
* :func:`write_html`: one self-contained HTML file (plotly's JavaScript inlined: no network,
  no server) with both clouds, a before/after toggle and the result's numbers.
"""

from __future__ import annotations

import html as _html
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from pointalign import _validate

SOURCE_COLOUR = "#e4572e"  # orange-red: the moving cloud
TARGET_COLOUR = "#2e86ab"  # blue: the fixed cloud


def _mpl() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("pointalign.viz needs matplotlib: pip install 'pointalign[viz]'"
                          ) from exc
    return plt


def _points(x: Any, name: str) -> np.ndarray:
    from pointalign import _validate

    return _validate.as_points(x, name).detach().to("cpu").double().numpy()


def _transform(T: Any) -> np.ndarray:
    from pointalign import _validate

    return _validate.as_transform(T, "transformation").numpy()


def subsample(points: np.ndarray, max_points: int, seed: int = 0) -> np.ndarray:
    """At most ``max_points`` rows of ``points (N, 3)``: a fixed random subset (for drawing).

    Args:
        points: ``(N, 3)`` array.
        max_points: cap (>= 1).
        seed: the subset's seed (the same points every call).

    Returns:
        ``(min(N, max_points), 3)`` array, rows in their original order.

    """
    max_points = _validate.integer(max_points, "max_points", minimum=1)
    seed = _validate.seed(seed)
    if len(points) <= max_points:
        return points
    idx = np.sort(np.random.default_rng(seed).choice(len(points), max_points, replace=False))
    return points[idx]


def render(source: Any, target: Any, transformation: Any = None, path: str | os.PathLike =
           "registration.png", *, max_points: int = 20000, title: str | None = None,
           dpi: int = 110) -> Path:
    """Draw both clouds from three viewpoints, before and after the transformation, as one PNG.

    Each column looks along one axis of the data (orthographic views along z, x and y, one
    scale for all), where scans and LiDAR keep their "up" direction. The source is drawn
    in orange-red, the target in blue; the top row shows the source as given, the bottom
    row the source moved by ``transformation``.

    Args:
        source: ``(N, 3)`` cloud (array, tensor, PointCloud, Open3D cloud…), the moving one.
        target: ``(M, 3)`` cloud.
        transformation: ``(4, 4)`` ``T_target_source``; None: identity (one row only).
        path: image file to write (``.png``, ``.pdf``, ``.svg`` by matplotlib).
        max_points: points drawn per cloud (random subset, for drawing only).
        title: figure title.
        dpi: resolution of a raster image.

    Returns:
        The path written.

    """
    plt = _mpl()
    src, tgt = _points(source, "source"), _points(target, "target")
    T = None if transformation is None else _transform(transformation)
    src_d, tgt_d = subsample(src, max_points, 1), subsample(tgt, max_points, 2)
    rows = [("before", src_d)] if T is None else [
        ("before", src_d), ("after", src_d @ T[:3, :3].T + T[:3, 3])]
    # orthographic views along the data's own axes: scans and LiDAR keep "up" on an axis
    views = [(0, 1, "along z"), (2, 1, "along x"), (0, 2, "along y")]
    fig, ax = plt.subplots(len(rows), 3, figsize=(13, 4.0 * len(rows) + 0.6), squeeze=False)
    size = max(0.3, min(4.0, 6000.0 / max(len(src_d), len(tgt_d))))
    allp = np.concatenate([tgt_d] + [r[1] for r in rows])
    lo, hi = np.percentile(allp, 0.2, 0), np.percentile(allp, 99.8, 0)
    pad = 0.04 * (hi - lo).max()
    colours = np.array([TARGET_COLOUR] * len(tgt_d) + [SOURCE_COLOUR] * len(src_d))
    # one scatter with the two clouds interleaved at random: neither colour hides the other
    order = np.random.default_rng(3).permutation(len(colours))
    for r, (label, pts) in enumerate(rows):
        both = np.concatenate([tgt_d, pts])[order]
        for col, (i, j, vname) in enumerate(views):
            a = ax[r][col]
            a.scatter(both[:, i], both[:, j], s=size, c=colours[order], alpha=0.6,
                      linewidths=0, rasterized=True)
            a.set_xlim(lo[i] - pad, hi[i] + pad)
            a.set_ylim(lo[j] - pad, hi[j] + pad)
            a.set_aspect("equal")
            a.tick_params(labelsize=7)
            a.set_xlabel("xyz"[i], fontsize=8, labelpad=1)
            a.set_ylabel("xyz"[j], fontsize=8, labelpad=1)
            a.set_title(f"{label}: view {vname}", fontsize=10)
    handles = [plt.Line2D([], [], ls="", marker="o", color=SOURCE_COLOUR,
                          label=f"source ({len(src)} points)"),
               plt.Line2D([], [], ls="", marker="o", color=TARGET_COLOUR,
                          label=f"target ({len(tgt)} points)")]
    fig.legend(handles=handles, loc="upper right", frameon=False, fontsize=9)
    if T is not None:
        from pointalign import transforms

        ang = math.degrees(float(transforms.rotation_angle(
            __import__("torch").from_numpy(T[:3, :3]))))
        subtitle = f"transformation: rotation {ang:.2f} deg, translation " \
                   f"{np.linalg.norm(T[:3, 3]):.4g}"
    else:
        subtitle = "no transformation given"
    fig.suptitle((title + "\n" if title else "") + subtitle, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    p = Path(path)
    fig.savefig(p, dpi=dpi)
    plt.close(fig)
    return p


def _series(history: list[dict[str, Any]], key: str) -> np.ndarray | None:
    vals = [h[key] for h in history if key in h]
    if not vals:
        return None
    arr = np.array([np.asarray(v, dtype=float) for v in vals])
    return arr.reshape(len(vals), -1)


def plot_history(result: Any, path: str | os.PathLike = "history.png", *,
                 dpi: int = 110) -> Path:
    """Draw RMSE and fitness per iteration and the seconds per stage into one image.

    Args:
        result: a :class:`~pointalign.RegistrationResult` (batched results: one line per
            batch entry).
        path: image file to write.
        dpi: resolution of a raster image.

    Returns:
        The path written.

    """
    plt = _mpl()
    hist = list(result.history or [])
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    for a, key, scale in ((ax[0], "rmse", "log"), (ax[1], "fitness", "linear")):
        ys = _series(hist, key)
        if ys is None:
            a.text(0.5, 0.5, f"no per-iteration {key}\nin this result's history",
                   ha="center", va="center", transform=a.transAxes)
        else:
            its = _series(hist, "iteration")
            x = its[:, 0] if its is not None else np.arange(len(ys))
            for b in range(ys.shape[1]):
                a.plot(x, ys[:, b], marker="." if len(x) < 60 else None, lw=1.2)
            finite = ys[np.isfinite(ys)]
            if scale == "log" and finite.size and (finite > 0).all():
                a.set_yscale("log")
        a.set_title(key + (" (RMS inlier distance)" if key == "rmse" else " (inlier fraction)"),
                    fontsize=10)
        a.set_xlabel("iteration")
        a.grid(alpha=0.3)
    stages = {k: float(v) for k, v in (result.timings or {}).items()
              if k != "total" and "." not in k}
    a = ax[2]
    if stages:
        names = list(stages)
        a.barh(names, [stages[n] * 1e3 for n in names], color=TARGET_COLOUR)
        a.invert_yaxis()
        a.set_xlabel("ms")
        total = (result.timings or {}).get("total")
        a.set_title("time per stage" + (f" (total {float(total) * 1e3:.1f} ms)"
                                        if total is not None else ""), fontsize=10)
    else:
        a.text(0.5, 0.5, "no stage timings", ha="center", va="center", transform=a.transAxes)
    conv = np.asarray(result.converged)
    fig.suptitle(f"{len(hist)} history records; converged={conv.tolist()} "
                 f"({result.stop_reason})", fontsize=11)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=dpi)
    plt.close(fig)
    return p


def _numbers(result: Any, T: np.ndarray) -> list[tuple[str, str]]:
    import torch

    from pointalign import transforms

    ang = math.degrees(float(transforms.rotation_angle(torch.from_numpy(T[:3, :3]))))
    rows = [("rotation", f"{ang:.4f} deg"), ("translation", f"{np.linalg.norm(T[:3, 3]):.6g}")]
    if result is not None and not result.batched:
        rows += [("fitness", f"{float(result.fitness):.4f}"),
                 ("rmse", f"{float(result.rmse):.6g}"),
                 ("iterations", str(int(result.iterations))),
                 ("converged", f"{bool(result.converged)} ({result.stop_reason})")]
        total = result.timings.get("total")
        if total is not None:
            rows.append(("time", f"{float(total) * 1e3:.1f} ms"))
    return rows


def write_html(source: Any, target: Any, transformation: Any = None,
               path: str | os.PathLike = "view.html", *, result: Any = None,
               max_points: int = 20000, title: str | None = None) -> Path:
    """Write one self-contained HTML file: both clouds in 3D with a before/after toggle.

    Plotly's JavaScript is inlined (about 5 MB), so the file opens offline in any browser
    with WebGL and needs no server. The buttons switch between the source as given and the
    source moved by ``transformation``; the result's numbers (rotation and translation of
    the transformation; fitness, rmse, iterations, converged and time when ``result`` is
    given) are shown in the page.

    Args:
        source: ``(N, 3)`` moving cloud (any accepted array-like).
        target: ``(M, 3)`` fixed cloud.
        transformation: ``(4, 4)`` ``T_target_source``; None: ``result.transformation`` or
            the identity.
        path: ``.html`` file to write.
        result: optional :class:`~pointalign.RegistrationResult` whose numbers are shown.
        max_points: points drawn per cloud (random subset, for drawing only).
        title: page title.

    Returns:
        The path written.

    """
    try:
        import plotly.graph_objects as go
    except ImportError as exc:
        raise ImportError("write_html needs plotly: pip install 'pointalign[viz]'") from exc
    if transformation is None:
        transformation = result.transformation if result is not None else np.eye(4)
    T = _transform(transformation)
    src, tgt = _points(source, "source"), _points(target, "target")
    src_d, tgt_d = subsample(src, max_points, 1), subsample(tgt, max_points, 2)
    after = src_d @ T[:3, :3].T + T[:3, 3]
    scale = float(np.ptp(tgt_d, axis=0).max()) or 1.0
    msize = 1.5 if max(len(src_d), len(tgt_d)) > 5000 else 2.5

    def trace(p: np.ndarray, name: str, colour: str, visible: bool) -> Any:
        return go.Scatter3d(x=p[:, 0], y=p[:, 1], z=p[:, 2], mode="markers", name=name,
                            visible=visible, marker={"size": msize, "color": colour,
                                                     "opacity": 0.7},
                            hovertemplate="%{x:.4f}, %{y:.4f}, %{z:.4f}<extra>" + name +
                            "</extra>")

    fig = go.Figure([
        trace(tgt_d, f"target ({len(tgt)} pts)", TARGET_COLOUR, True),
        trace(src_d, f"source before ({len(src)} pts)", SOURCE_COLOUR, False),
        trace(after, f"source after ({len(src)} pts)", SOURCE_COLOUR, True),
    ])
    numbers = _numbers(result, T)
    text = "<br>".join(f"<b>{_html.escape(k)}</b>: {_html.escape(v)}" for k, v in numbers)
    fig.update_layout(
        title={"text": _html.escape(title or "pointalign registration")},
        scene={"aspectmode": "data", "xaxis": {"title": "x"}, "yaxis": {"title": "y"},
               "zaxis": {"title": "z"}},
        margin={"l": 0, "r": 0, "t": 50, "b": 0},
        legend={"x": 0.01, "y": 0.98, "itemsizing": "constant"},
        updatemenus=[{"type": "buttons", "direction": "left", "x": 0.5, "xanchor": "center",
                      "y": 1.0, "yanchor": "bottom", "active": 1, "buttons": [
                          {"label": "before", "method": "restyle",
                           "args": [{"visible": [True, True, False]}]},
                          {"label": "after", "method": "restyle",
                           "args": [{"visible": [True, False, True]}]}]}],
        annotations=[{"text": text, "x": 0.99, "y": 0.98, "xref": "paper", "yref": "paper",
                      "xanchor": "right", "yanchor": "top", "showarrow": False,
                      "align": "left", "bgcolor": "rgba(255,255,255,0.85)",
                      "bordercolor": "#888", "borderwidth": 1}],
        meta={"pointalign": {"numbers": dict(numbers), "scale": scale}},
    )
    p = Path(path)
    fig.write_html(p, include_plotlyjs=True, full_html=True, div_id="pointalign-view",
                   config={"displaylogo": False})
    return p
