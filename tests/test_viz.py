"""pointalign.viz: the before/after PNG, the history plot, the HTML viewer (and a real browser)."""

import json
import re
import shutil

import numpy as np
import pytest
import torch

import pointalign as pa
from pointalign import datasets, viz

mpl = pytest.importorskip("matplotlib")


def _colour_pixels(img, hex_colour, tol=60):
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)], dtype=float)
    px = img[..., :3].astype(float)
    if px.max() <= 1.0:
        px = px * 255
    return int((np.abs(px - rgb).sum(-1) < tol).sum())


@pytest.fixture(scope="module")
def pair():
    p = datasets.load_bunny_pair()
    return (datasets.random_subsample(p.source, 3000, seed=0),
            datasets.random_subsample(p.target, 3000, seed=1), p.T_target_source.numpy())


def test_render_draws_both_clouds_before_and_after(tmp_path, pair):
    import matplotlib.image as mpimg

    src, tgt, T = pair
    src_before = src.clone()
    path = viz.render(src, tgt, T, path=tmp_path / "r.png", title="bunny")
    img = mpimg.imread(path)
    assert img.shape[0] > 600 and img.shape[1] > 1000  # two rows of three views
    assert _colour_pixels(img, viz.SOURCE_COLOUR) > 500
    assert _colour_pixels(img, viz.TARGET_COLOUR) > 500
    assert torch.equal(src, src_before)  # input untouched
    one = mpimg.imread(viz.render(src, tgt, None, path=tmp_path / "one.png"))
    assert one.shape[0] < img.shape[0]  # no transformation: the "before" row only


def _svg_text(path):
    return path.read_text()


def _ring_scene(n=6000, seed=0):
    """A flat LiDAR-like scene, 120 m across and 4 m high, with a few walls."""
    g = np.random.default_rng(seed)
    ground = np.c_[g.uniform(-60, 60, (n, 2)), g.normal(-1.8, 0.02, n)]
    wall = np.c_[g.uniform(5, 15, n // 4), np.full(n // 4, 8.0) + g.normal(0, 0.02, n // 4),
                 g.uniform(-1.8, 2.0, n // 4)]
    return np.concatenate([ground, wall])


def test_render_scene_top_view_zoom_and_numbers(tmp_path):
    """A LiDAR-scale scene: top view, a zoom on the residuals, units and the result's numbers."""
    tgt = _ring_scene()
    T = np.eye(4)
    T[:3, 3] = [0.7, 0.0, 0.0]  # a 0.7 m motion in a 120 m scene
    src = tgt - T[:3, 3]
    r = pa.RegistrationResult(transformation=T, fitness=0.875, rmse=0.0123, iterations=9,
                              converged=False, stop_reason="small_update",
                              info={"verdict": "small overlap"})
    with mpl.rc_context({"svg.fonttype": "none"}):
        path = viz.render(src, tgt, path=tmp_path / "scene.svg", result=r, title="scene")
    text = _svg_text(path)
    for words in ("top view", "top view, zoom", "side view of the zoom", "x (m)",
                  "fitness 0.8750", "rmse 0.0123 m", "NOT converged (small overlap)",
                  "translation 0.7 m", "extent 1"):
        assert words in text, words
    # an object keeps its three views along the axes
    with mpl.rc_context({"svg.fonttype": "none"}):
        obj = _svg_text(viz.render(np.random.default_rng(1).normal(size=(500, 3)),
                                   np.random.default_rng(2).normal(size=(500, 3)),
                                   np.eye(4), path=tmp_path / "obj.svg", units="mm"))
    assert "view along z" in obj and "zoom" not in obj and "x (mm)" in obj


def test_render_after_row_shows_the_source_on_top(tmp_path, pair):
    """Aligned clouds: in the "after" row the source is drawn over the target, not under."""
    import matplotlib.image as mpimg

    src, tgt, T = pair
    moved_back = torch.from_numpy(np.linalg.inv(T)).float()
    same = pa.transforms.apply(moved_back, tgt)  # the source is the target, moved away
    img = mpimg.imread(viz.render(same, tgt, T, path=tmp_path / "same.png"))
    after = img[img.shape[0] // 2:]
    assert _colour_pixels(after, viz.SOURCE_COLOUR) > 3 * _colour_pixels(after,
                                                                         viz.TARGET_COLOUR)


def test_subsample_is_for_drawing_only_and_fixed():
    pts = np.random.default_rng(0).normal(size=(1000, 3))
    a, b = viz.subsample(pts, 100), viz.subsample(pts, 100)
    assert a.shape == (100, 3) and np.array_equal(a, b)
    assert viz.subsample(pts, 5000) is pts
    with pytest.raises(ValueError, match="max_points"):
        viz.subsample(pts, 0)


def test_plot_history(tmp_path, pair):
    import matplotlib.image as mpimg

    src, tgt, T = pair
    r = pa.icp(src, tgt, init=T, max_correspondence_distance=0.005, device="cpu")
    img = mpimg.imread(viz.plot_history(r, tmp_path / "h.png"))
    assert img.shape[1] > 1000
    empty = pa.RegistrationResult(transformation=np.eye(4))
    assert viz.plot_history(empty, tmp_path / "e.png").is_file()
    with mpl.rc_context({"svg.fonttype": "none"}):
        text = viz.plot_history(r, tmp_path / "h.svg").read_text()
    assert f"{int(r.iterations)} iterations" in text and "steps recorded" in text
    assert "10^" not in text and "times10" not in text  # plain tick labels


def _plotly_data(text):
    m = re.search(r"Plotly\.newPlot\(\s*\"pointalign-view\",\s*(\[.*?\])\s*,\s*\{", text,
                  re.S)
    return json.loads(m.group(1)) if m else None


def test_write_html_is_self_contained(tmp_path, pair):
    pytest.importorskip("plotly")
    src, tgt, T = pair
    r = pa.RegistrationResult(transformation=T, fitness=0.9, rmse=1e-3, iterations=7,
                              converged=True, stop_reason="relative_rmse")
    path = viz.write_html(src, tgt, None, tmp_path / "v.html", result=r, max_points=500)
    text = path.read_text()
    # no external script or stylesheet: everything is inlined
    assert not re.search(r"<script[^>]*\ssrc=", text)
    assert not re.search(r"<link[^>]*\shref=\"http", text)
    data = _plotly_data(text)
    assert data is not None and len(data) == 3
    assert [len(d["x"]) if isinstance(d["x"], list) else None for d in data][0] in (500, None)
    assert "fitness" in text and "0.9000" in text and "before" in text and "after" in text


def test_write_html_up_axis_units_and_residual_colours(tmp_path, pair):
    pytest.importorskip("plotly")
    src, tgt, T = pair
    text = viz.write_html(src, tgt, T, tmp_path / "b.html", max_points=500).read_text()
    assert '"up":"y"' in text.replace(" ", "")  # the y-up bunny stands upright
    assert '"camera":{"eye"' in text.replace(" ", "") or '"camera":{"up"' in text.replace(" ",
                                                                                          "")
    assert "residual (m)" in text and "x (m)" in text and "Viridis" in text
    assert viz.up_axis(tgt) == 1 and viz.up_axis(_ring_scene()) == 2
    scene = _ring_scene(800)
    text = viz.write_html(scene, scene, np.eye(4), tmp_path / "s.html", units="mm").read_text()
    assert '"up":"z"' in text.replace(" ", "") and "x (mm)" in text
    forced = viz.write_html(src, tgt, T, tmp_path / "f.html", max_points=300, up="x").read_text()
    assert '"up":"x"' in forced.replace(" ", "")
    with pytest.raises(ValueError, match="up"):
        viz.write_html(src, tgt, T, tmp_path / "g.html", up="w")


def _browser():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        exe = shutil.which(name)
        if exe:
            return exe
    return None


@pytest.mark.slow
def test_html_draws_in_headless_browser(tmp_path, pair):
    """Open the viewer in headless Chromium; both clouds' colours must be on screen."""
    pytest.importorskip("plotly")
    webdriver = pytest.importorskip("selenium.webdriver")
    exe, driver_exe = _browser(), shutil.which("chromedriver")
    if exe is None or driver_exe is None:
        pytest.skip("no chromium/chromedriver (apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    src, tgt, T = pair
    path = viz.write_html(src, tgt, T, tmp_path / "v.html", max_points=3000)
    opts = webdriver.ChromeOptions()
    opts.binary_location = exe
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
              "--use-angle=swiftshader", "--enable-unsafe-swiftshader",
              "--window-size=1200,900"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(driver_exe), options=opts)
    try:
        drv.set_page_load_timeout(120)
        drv.get(path.as_uri())
        n = drv.execute_script(
            "const g = document.getElementById('pointalign-view');"
            "return g && g._fullData ? g._fullData.length : -1;")
        assert n == 3, n
        import io

        import matplotlib.image as mpimg

        img = mpimg.imread(io.BytesIO(drv.get_screenshot_as_png()), format="png")
        after_src = _colour_pixels(img, viz.SOURCE_COLOUR, 90)
        after_tgt = _colour_pixels(img, viz.TARGET_COLOUR, 90)
        assert after_src > 200 and after_tgt > 200, (after_src, after_tgt)
        # the "before" button shows the other source trace
        drv.execute_script(
            "Plotly.restyle('pointalign-view', {visible: [true, true, false]});")
        vis = drv.execute_script(
            "return document.getElementById('pointalign-view')._fullData"
            ".map(d => d.visible);")
        assert vis == [True, True, False]
    finally:
        drv.quit()


SITE = __import__("pathlib").Path(__file__).resolve().parents[1] / "site"


@pytest.mark.slow
def test_built_docs_index_loads_and_its_links_resolve():
    """Open the built docs (``make docs``) in headless Chromium; every internal link resolves."""
    from urllib.parse import unquote, urlsplit

    if not (SITE / "index.html").is_file():
        pytest.skip("no built site/ (make docs)")
    webdriver = pytest.importorskip("selenium.webdriver")
    exe, driver_exe = _browser(), shutil.which("chromedriver")
    if exe is None or driver_exe is None:
        pytest.skip("no chromium/chromedriver (apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = exe
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(driver_exe), options=opts)
    try:
        drv.set_page_load_timeout(60)
        checked = 0
        for page in ("index.html", "getting-started/index.html", "examples/index.html"):
            path = SITE / page
            if not path.is_file():
                continue
            drv.get(path.as_uri())
            assert drv.title, page
            links = drv.execute_script(
                "return Array.from(document.querySelectorAll('a[href]')).map(a => a.href);")
            for href in links:
                u = urlsplit(href)
                if u.scheme != "file":
                    continue  # external links are not ours to check
                target = __import__("pathlib").Path(unquote(u.path))
                if target.is_dir():
                    target = target / "index.html"
                assert target.is_file(), f"{page}: broken link {href}"
                if u.fragment and target.suffix == ".html":
                    assert f'id="{u.fragment}"' in target.read_text(), \
                        f"{page}: no anchor #{u.fragment} in {target}"
                checked += 1
        assert checked > 10
    finally:
        drv.quit()
