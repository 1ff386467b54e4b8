"""Pictures of a registration: a before/after PNG, the convergence history, an HTML viewer.

Optional extra: ``pip install 'pointalign[viz]'`` (matplotlib for the PNGs, plotly for the
HTML viewer). Large clouds are subsampled for drawing only (a fixed random subset, the same
points before and after); nothing here changes the inputs or the result.

* :func:`render`: both clouds in two colours, before (top row) and after (bottom row) the
  transformation, one image: three views along the axes for an object; a top view, a zoom
  on the residuals and its side view for a scene (LiDAR); the numbers and units in the
  title.
* :func:`plot_history`: RMSE and fitness per iteration, and the time per stage.
* :func:`write_html`: one self-contained HTML file (plotly's JavaScript inlined: no network,
  no server) with both clouds, before/after/residual buttons, the camera on the cloud's up
  axis and the result's numbers.
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


#: a cloud whose thinnest extent is below this fraction of its widest is a scene (LiDAR,
#: terrain, a room): drawn from the top with a zoom, and viewed with its thin axis up
FLAT_RATIO = 0.25


def _residuals(moved: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Distance from each moved source point to its nearest target point (``(N,)``)."""
    from scipy.spatial import cKDTree

    return cKDTree(target).query(moved, k=1, workers=-1)[0]


def _verdict(result: Any) -> str:
    """``trusted``/``not trusted`` and why (the verdict's reason when a verdict decided)."""
    if result is None or result.batched:
        return ""
    ok = bool(result.converged)
    why = (result.info or {}).get("verdict")
    reason = why if isinstance(why, str) and why and why != "trusted" else result.stop_reason
    return f"{'converged' if ok else 'NOT converged'} ({reason})"


def _summary_lines(T: np.ndarray | None, result: Any, units: str, extent: float) -> str:
    if T is None:
        return f"no transformation given; extent {extent:.4g} {units}"
    import torch

    from pointalign import transforms

    ang = math.degrees(float(transforms.rotation_angle(torch.from_numpy(T[:3, :3]))))
    line = (f"transformation: rotation {ang:.2f} deg, translation "
            f"{np.linalg.norm(T[:3, 3]):.4g} {units}; extent {extent:.4g} {units}")
    if result is not None and not result.batched:
        line += (f"\nfitness {float(result.fitness):.4f}, rmse {float(result.rmse):.4g} "
                 f"{units}, {int(result.iterations)} iterations, {_verdict(result)}")
    return line


def _window(tgt: np.ndarray, moved_before: np.ndarray, extent: float, plane: list[int],
            up: int) -> tuple[np.ndarray, float]:
    """Centre and half-width of a scene's zoom on the residuals (a square of the top view).

    Wide enough to show the misalignment before (40 median residuals across), at least
    5 % and at most 30 % of the extent; placed on the square of that size holding the most
    target points that stand above the square's lowest point (walls, poles, cars: the
    structure in which a misalignment shows from above, unlike flat ground).
    """
    spread = float(np.median(_residuals(moved_before, tgt)))
    half = float(np.clip(20.0 * spread, 0.025 * extent, 0.15 * extent))
    xy = tgt[:, plane]
    cells = np.floor((xy - xy.min(0)) / (2 * half)).astype(np.int64)
    key = cells[:, 0] * (int(cells[:, 1].max()) + 1) + cells[:, 1]
    _, inverse = np.unique(key, return_inverse=True)
    inverse = inverse.reshape(-1)
    floor = np.full(inverse.max() + 1, np.inf)
    np.minimum.at(floor, inverse, tgt[:, up])
    tall = tgt[:, up] - floor[inverse] > 0.25 * half
    best = int(np.argmax(np.bincount(inverse[tall], minlength=floor.size))) if tall.any() \
        else int(np.argmax(np.bincount(inverse)))
    centre = np.zeros(3)
    centre[plane] = xy.min(0) + (cells[inverse == best][0] + 0.5) * 2 * half
    return centre, half


def _fill(axis: Any, xl: tuple[float, float], yl: tuple[float, float]) -> None:
    """Widen the shorter range so that one unit is as long on both axes of the panel.

    The panel keeps its size (equal aspect on the data's extent, not a sliver of a box):
    the limits grow to the panel's shape instead of the panel shrinking to the data's.
    """
    fig = axis.figure
    pos = axis.get_position()
    want = (pos.height * fig.get_figheight()) / max(pos.width * fig.get_figwidth(), 1e-9)
    (x0, x1), (y0, y1) = xl, yl
    xr, yr = max(x1 - x0, 1e-12), max(y1 - y0, 1e-12)
    if yr / xr < want:
        grow = 0.5 * (xr * want - yr)
        y0, y1 = y0 - grow, y1 + grow
    else:
        grow = 0.5 * (yr / want - xr)
        x0, x1 = x0 - grow, x1 + grow
    axis.set_xlim(x0, x1)
    axis.set_ylim(y0, y1)
    axis.set_aspect("equal", adjustable="box")


def render(source: Any, target: Any, transformation: Any = None, path: str | os.PathLike =
           "registration.png", *, result: Any = None, max_points: int = 20000,
           title: str | None = None, units: str = "m", dpi: int = 110) -> Path:
    """Draw both clouds before and after the transformation, as one image.

    Objects (an extent of similar size along every axis) are drawn from three viewpoints
    along the data's axes. Scenes (LiDAR sweeps, rooms: the thinnest extent below
    :data:`FLAT_RATIO` of the widest) are drawn as a top view of the whole extent, a top
    view zoomed on the residuals (a window around the scan's dense part, wide enough to
    show the misalignment before) and a side view of that window, so that a 0.7 m motion
    in a 130 m sweep is visible. Every panel keeps an equal aspect on its own extent (no
    slivers). The target (blue) is drawn first, the source (orange-red) on top of it, so
    the source is never hidden. The title gives the motion and, with ``result``, its
    fitness, rmse (with ``units``), iterations and verdict.

    Args:
        source: ``(N, 3)`` cloud (array, tensor, PointCloud, Open3D cloud…), the moving one.
        target: ``(M, 3)`` cloud.
        transformation: ``(4, 4)`` ``T_target_source``; None: ``result.transformation``,
            else the identity (one row only).
        path: image file to write (``.png``, ``.pdf``, ``.svg`` by matplotlib).
        result: optional :class:`~pointalign.RegistrationResult` whose numbers are shown.
        max_points: points drawn per cloud (random subset, for drawing only).
        title: figure title.
        units: the data's length unit, for labels (``"m"``: the library's convention).
        dpi: resolution of a raster image.

    Returns:
        The path written.

    """
    plt = _mpl()
    if transformation is None and result is not None and not result.batched:
        transformation = result.transformation
    src, tgt = _points(source, "source"), _points(target, "target")
    T = None if transformation is None else _transform(transformation)
    src_d, tgt_d = subsample(src, max_points, 1), subsample(tgt, max_points, 2)
    rows = [("before", src_d)] if T is None else [
        ("before", src_d), ("after", src_d @ T[:3, :3].T + T[:3, 3])]
    allp = np.concatenate([tgt_d] + [r[1] for r in rows])
    lo, hi = np.percentile(allp, 0.2, 0), np.percentile(allp, 99.8, 0)
    ext = hi - lo
    extent = float(ext.max()) or 1.0
    scene = float(ext.min()) < FLAT_RATIO * extent
    up = int(np.argmin(ext))
    a, b = [i for i in range(3) if i != up]
    centre, half = _window(tgt_d, src_d, extent, [a, b], up) if scene else (np.zeros(3),
                                                                               0.0)

    def in_window(p: np.ndarray) -> np.ndarray:
        return np.all(np.abs(p[:, [a, b]] - centre[[a, b]]) <= half, axis=1)

    views: list[tuple[tuple[int, int], float | None, str]] = [
        ((a, b), None, "top view"), ((a, b), half, "top view, zoom"),
        ((a, up), half, "side view of the zoom")] if scene else [
        ((0, 1), None, "view along z"), ((2, 1), None, "view along x"),
        ((0, 2), None, "view along y")]
    fig, ax = plt.subplots(len(rows), 3, figsize=(14, 4.4 * len(rows) + 0.8), squeeze=False)
    n_draw = max(len(src_d), len(tgt_d))
    size = max(0.3, min(4.0, 6000.0 / n_draw))
    limits: list[tuple[Any, tuple[float, float], tuple[float, float]]] = []
    for r, (label, pts) in enumerate(rows):
        for col, ((i, j), zoom, vname) in enumerate(views):
            axis = ax[r][col]
            t_pts, s_pts = tgt_d, pts
            if zoom is None:
                xl = (lo[i] - 0.04 * extent, hi[i] + 0.04 * extent)
                yl = (lo[j] - 0.04 * extent, hi[j] + 0.04 * extent)
            else:  # the window: a square of the top view, seen from above or the side
                t_pts, s_pts = tgt_d[in_window(tgt_d)], pts[in_window(pts)]
                xl = (centre[i] - zoom, centre[i] + zoom)
                mid = centre[j]
                if j == up:
                    zs = np.concatenate([t_pts[:, j], s_pts[:, j]])
                    mid = 0.5 * (zs.min() + zs.max()) if zs.size else mid
                yl = (mid - zoom, mid + zoom)
            dot = size if zoom is None else min(6.0, 3 * size)
            # the target first, the source on top: the target never hides the source
            axis.scatter(t_pts[:, i], t_pts[:, j], s=dot, c=TARGET_COLOUR, alpha=0.9,
                         linewidths=0, rasterized=True)
            axis.scatter(s_pts[:, i], s_pts[:, j], s=dot, c=SOURCE_COLOUR, alpha=0.85,
                         linewidths=0, rasterized=True)
            limits.append((axis, xl, yl))
            axis.tick_params(labelsize=7)
            axis.set_xlabel(f"{'xyz'[i]} ({units})", fontsize=8, labelpad=1)
            axis.set_ylabel(f"{'xyz'[j]} ({units})", fontsize=8, labelpad=1)
            extra = f", {2 * zoom:.3g} {units} wide" if zoom is not None else ""
            axis.set_title(f"{label}: {vname}{extra}", fontsize=10)
    handles = [plt.Line2D([], [], ls="", marker="o", color=SOURCE_COLOUR,
                          label=f"source ({len(src)} points)"),
               plt.Line2D([], [], ls="", marker="o", color=TARGET_COLOUR,
                          label=f"target ({len(tgt)} points)")]
    fig.legend(handles=handles, loc="upper right", frameon=False, fontsize=9)
    subtitle = _summary_lines(T, result, units, extent)
    fig.suptitle((title + "\n" if title else "") + subtitle, fontsize=11)
    for axis, xl, yl in limits:
        axis.set_xlim(*xl)
        axis.set_ylim(*yl)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.75 if result is not None else 0.55)
                           / fig.get_figheight()))
    for axis, xl, yl in limits:
        _fill(axis, xl, yl)
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
            if scale == "log" and finite.size and (finite > 0).all() and \
                    finite.max() > 20 * finite.min():
                from matplotlib.ticker import FuncFormatter

                a.set_yscale("log")  # plain tick labels (0.0012, not 1.2×10^-3)
                plain = FuncFormatter(lambda v, _: f"{v:.3g}")
                a.yaxis.set_major_formatter(plain)
                a.yaxis.set_minor_formatter(plain)
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
    if result.batched:
        head = f"converged={np.asarray(result.converged).tolist()} ({result.stop_reason})"
    else:
        head = f"{int(result.iterations)} iterations, {_verdict(result)}"
    fig.suptitle(f"{head}; {len(hist)} steps recorded in the history", fontsize=11)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=dpi)
    plt.close(fig)
    return p


def _numbers(result: Any, T: np.ndarray, units: str) -> list[tuple[str, str]]:
    import torch

    from pointalign import transforms

    ang = math.degrees(float(transforms.rotation_angle(torch.from_numpy(T[:3, :3]))))
    rows = [("rotation", f"{ang:.4f} deg"),
            ("translation", f"{np.linalg.norm(T[:3, 3]):.6g} {units}")]
    if result is not None and not result.batched:
        rows += [("fitness", f"{float(result.fitness):.4f}"),
                 ("rmse", f"{float(result.rmse):.6g} {units}"),
                 ("iterations", str(int(result.iterations))),
                 ("converged", f"{bool(result.converged)} ({result.stop_reason})")]
        verdict = (result.info or {}).get("verdict")
        if isinstance(verdict, str) and verdict:
            rows.append(("verdict", verdict))
        total = result.timings.get("total")
        if total is not None:
            rows.append(("time", f"{float(total) * 1e3:.1f} ms"))
    return rows


def up_axis(points: Any) -> int:
    """Guess which axis of ``points (N, 3)`` points up: 0, 1 or 2 (x, y, z).

    A scene (the thinnest extent below :data:`FLAT_RATIO` of the widest: LiDAR sweeps,
    terrain, rooms) stands on its thin axis (z for KITTI). An object stands on y, the
    convention of scanned and modelled objects (the Stanford bunny, the UWA models), whose
    range scans look along z. Pass ``up=`` to :func:`write_html` where this is wrong.
    """
    p = _points(points, "points")
    ext = np.percentile(p, 99.8, 0) - np.percentile(p, 0.2, 0)
    thin = int(np.argmin(ext))
    return thin if ext[thin] < FLAT_RATIO * float(ext.max()) else 1


def write_html(source: Any, target: Any, transformation: Any = None,
               path: str | os.PathLike = "view.html", *, result: Any = None,
               max_points: int = 20000, title: str | None = None, up: str = "auto",
               units: str = "m") -> Path:
    """Write one self-contained HTML file: both clouds in 3D with before/after buttons.

    Plotly's JavaScript is inlined (about 5 MB), so the file opens offline in any browser
    with WebGL and needs no server. The buttons show the source as given ("before"), moved
    by ``transformation`` ("after"), or moved and coloured by its residual, the distance
    to the nearest target point in ``units`` ("residual": where the clouds disagree). The
    camera stands on the cloud's up axis (:func:`up_axis`: the thin axis of a scene, y for
    an object; ``up`` overrides). The transformation's rotation and translation and, with
    ``result``, its fitness, rmse, iterations, convergence, verdict and time are shown.

    Args:
        source: ``(N, 3)`` moving cloud (any accepted array-like).
        target: ``(M, 3)`` fixed cloud.
        transformation: ``(4, 4)`` ``T_target_source``; None: ``result.transformation`` or
            the identity.
        path: ``.html`` file to write.
        result: optional :class:`~pointalign.RegistrationResult` whose numbers are shown.
        max_points: points drawn per cloud (random subset, for drawing only).
        title: page title.
        up: ``"auto"``, ``"x"``, ``"y"`` or ``"z"``: the axis drawn upwards.
        units: the data's length unit, for labels (``"m"``: the library's convention).

    Returns:
        The path written.

    """
    try:
        import plotly.graph_objects as go
    except ImportError as exc:
        raise ImportError("write_html needs plotly: pip install 'pointalign[viz]'") from exc
    if up not in ("auto", "x", "y", "z"):
        raise ValueError(f"up: expected 'auto', 'x', 'y' or 'z', got {up!r}")
    if transformation is None:
        transformation = result.transformation if result is not None else np.eye(4)
    T = _transform(transformation)
    src, tgt = _points(source, "source"), _points(target, "target")
    src_d, tgt_d = subsample(src, max_points, 1), subsample(tgt, max_points, 2)
    after = src_d @ T[:3, :3].T + T[:3, 3]
    residual = _residuals(after, tgt)
    scale = float(np.ptp(tgt_d, axis=0).max()) or 1.0
    msize = 1.5 if max(len(src_d), len(tgt_d)) > 5000 else 2.5
    axis = "xyz".index(up) if up != "auto" else up_axis(tgt_d)

    def trace(p: np.ndarray, name: str, colour: str, visible: bool) -> Any:
        return go.Scatter3d(x=p[:, 0], y=p[:, 1], z=p[:, 2], mode="markers", name=name,
                            visible=visible, marker={"size": msize, "color": colour,
                                                     "opacity": 0.7},
                            hovertemplate="%{x:.4f}, %{y:.4f}, %{z:.4f} " + units +
                            "<extra>" + name + "</extra>")

    fig = go.Figure([
        trace(tgt_d, f"target ({len(tgt)} pts)", TARGET_COLOUR, True),
        trace(src_d, f"source before ({len(src)} pts)", SOURCE_COLOUR, False),
        trace(after, f"source after ({len(src)} pts)", SOURCE_COLOUR, True),
    ])
    numbers = _numbers(result, T, units)
    numbers.append(("residual (median)", f"{float(np.median(residual)):.4g} {units}"))
    text = "<br>".join(f"<b>{_html.escape(k)}</b>: {_html.escape(v)}" for k, v in numbers)
    up_vec = {"x": 0, "y": 0, "z": 0, "xyz"[axis]: 1}
    eye = {"x": 1.25, "y": 1.25, "z": 1.25, "xyz"[axis]: 0.9}
    hi = float(np.percentile(residual, 95)) or 1.0
    plain = {"marker.color": [TARGET_COLOUR, SOURCE_COLOUR, SOURCE_COLOUR],
             "marker.showscale": [False, False, False]}
    fig.update_layout(
        title={"text": _html.escape(title or "pointalign registration")},
        scene={"aspectmode": "data", "xaxis": {"title": f"x ({units})"},
               "yaxis": {"title": f"y ({units})"}, "zaxis": {"title": f"z ({units})"},
               "camera": {"up": up_vec, "eye": eye}},
        margin={"l": 0, "r": 0, "t": 50, "b": 0},
        legend={"x": 0.01, "y": 0.98, "itemsizing": "constant"},
        updatemenus=[{"type": "buttons", "direction": "left", "x": 0.5, "xanchor": "center",
                      "y": 1.0, "yanchor": "bottom", "active": 1, "buttons": [
                          {"label": "before", "method": "restyle",
                           "args": [{"visible": [True, True, False], **plain}]},
                          {"label": "after", "method": "restyle",
                           "args": [{"visible": [True, False, True], **plain}]},
                          {"label": f"residual ({units})", "method": "restyle",
                           "args": [{"visible": [True, False, True],
                                     "marker.color": [TARGET_COLOUR, SOURCE_COLOUR,
                                                      residual.tolist()],
                                     "marker.colorscale": "Viridis", "marker.cmin": 0.0,
                                     "marker.cmax": hi,
                                     "marker.showscale": [False, False, True],
                                     "marker.colorbar": {"title": {"text": units}}}]}]}],
        annotations=[{"text": text, "x": 0.99, "y": 0.98, "xref": "paper", "yref": "paper",
                      "xanchor": "right", "yanchor": "top", "showarrow": False,
                      "align": "left", "bgcolor": "rgba(255,255,255,0.85)",
                      "bordercolor": "#888", "borderwidth": 1}],
        meta={"pointalign": {"numbers": dict(numbers), "scale": scale, "up": "xyz"[axis],
                             "units": units}},
    )
    p = Path(path)
    fig.write_html(p, include_plotlyjs=True, full_html=True, div_id="pointalign-view",
                   config={"displaylogo": False})
    return p
