"""Progress bars, warnings and stage-timing logs inside the library (pointalign._progress)."""

from __future__ import annotations

import logging
import math
import time
import warnings

import numpy as np
import pytest
import torch

from pointalign import _progress
from pointalign.registration import checks, pipeline
from pointalign.registration.ransac import ransac
from pointalign.registration.result import RegistrationResult


def _ransac_problem(n: int = 300, seed: int = 0):
    """A source, a moved copy as target, and matching 8-D features (exact correspondences)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.rand(n, 3, generator=g, dtype=torch.float64)
    feats = torch.rand(n, 8, generator=g)
    c, s = math.cos(0.3), math.sin(0.3)
    R = torch.tensor([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    tgt = src @ R.T + torch.tensor([0.1, -0.2, 0.05], dtype=torch.float64)
    return src.float(), tgt.float(), feats


@pytest.fixture
def no_bar(monkeypatch):
    monkeypatch.delenv("POINTALIGN_PROGRESS", raising=False)
    _progress.set_quiet(False)
    yield
    _progress.set_quiet(False)


def test_ransac_draws_nothing_off_a_terminal_and_logs_its_timings(no_bar, capfd, caplog):
    src, tgt, f = _ransac_problem()
    with caplog.at_level(logging.DEBUG, logger="pointalign"):
        r = ransac(src, tgt, source_features=f, target_features=f,
                   max_correspondence_distance=0.01, hypotheses=64, max_hypotheses=256)
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # stderr is not a terminal here: no bar, no text
    assert r.converged and r.fitness > 0.99
    lines = [m for m in caplog.messages if m.startswith("ransac: total")]
    assert len(lines) == 1 and "hypotheses" in lines[0]


def test_delayed_bar_appears_only_for_long_work(monkeypatch):
    monkeypatch.setenv("POINTALIGN_PROGRESS", "1")  # as on a terminal
    with _progress.task("short", total=3, delay=5.0) as bar:
        bar.advance(2)
        assert not bar.shown
    assert _progress._SHARED["progress"] is None
    with _progress.task("long", total=3, delay=0.05) as bar:
        deadline = time.monotonic() + 5.0
        while not bar.shown and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bar.shown  # shown by the timer though nothing advanced it
        bar.advance()
        prog = _progress._SHARED["progress"]
        assert prog is not None and prog.tasks[0].completed == 1
        with _progress.task("inner", total=1) as inner:  # nested: the same display
            assert _progress._SHARED["progress"] is prog and _progress._SHARED["bars"] == 2
            inner.advance()
    assert _progress._SHARED["progress"] is None and _progress._SHARED["bars"] == 0


def test_batches_cover_the_total_and_close_on_break(monkeypatch):
    monkeypatch.setenv("POINTALIGN_PROGRESS", "1")
    assert list(_progress.batches(10, 4, "b", delay=0)) == [4, 4, 2]
    for h in _progress.batches(100, 10, "b", delay=0):
        assert _progress._SHARED["bars"] == 1 and h == 10
        break
    assert _progress._SHARED["bars"] == 0 and _progress._SHARED["progress"] is None


def test_ignored_parameters_warn_at_the_callers_line(no_bar):
    src, tgt, f = _ransac_problem(60)
    with pytest.warns(_progress.IgnoredParameterWarning, match="refine_top") as rec:
        ransac(src, tgt, source_features=f, target_features=f, max_correspondence_distance=0.01,
               hypotheses=32, local_refinement=False, refine_top=2)
    assert rec[0].filename == __file__
    with pytest.warns(_progress.IgnoredParameterWarning, match="icp_voxel_size") as rec:
        pipeline._warn_register(src, tgt, torch.device("cpu"), "none", 5000, 0.1, 30)
    assert "no ICP stage" in str(rec[0].message)


def test_quiet_silences_warnings_but_not_errors(no_bar):
    src, tgt, f = _ransac_problem(60)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with _progress.quiet():
            ransac(src, tgt, source_features=f, target_features=f,
                   max_correspondence_distance=0.01, hypotheses=32, local_refinement=False,
                   refine_top=2)
            _progress.warn_slow("x", 1e4, "y")
            with pytest.raises(ValueError, match="hypotheses"):
                ransac(src, tgt, source_features=f, target_features=f,
                       max_correspondence_distance=0.01, hypotheses=0)
    assert not [w for w in rec if issubclass(w.category, _progress.PointalignWarning)]


def test_slow_register_on_the_cpu_warns(no_bar, monkeypatch):
    pts = torch.zeros(1000, 3)
    assert not _progress.warn_slow("fast", 0.5 * _progress.SLOW_SECONDS, "nothing")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a small CPU call: no warning at all
        pipeline._warn_register(pts, pts, torch.device("cpu"), "icp", 5000, None, 30)
    monkeypatch.setattr(checks, "REGISTER_PER_POINT_S", 1.0)  # as if 1 s per point
    with pytest.warns(_progress.SlowOperationWarning, match=r"1,000 \+ 1,000 points.*minutes"):
        pipeline._warn_register(pts, pts, torch.device("cpu"), "icp", 5000, None, 30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipeline._warn_register(pts, pts, torch.device("meta"), "icp", 5000, None, 30)


def test_register_warns_when_its_verdict_is_doubtful(no_bar, monkeypatch, caplog):
    def fake(src, tgt, *args):
        ok = bool(src[0, 0] == 0)
        return RegistrationResult(transformation=np.eye(4), fitness=0.1, rmse=0.01,
                                  iterations=3, converged=ok, stop_reason="relative_change",
                                  timings={"ransac": 0.5, "icp": 0.25, "total": 0.75},
                                  info={"verdict": "trusted" if ok else "weak margin"})

    monkeypatch.setattr(pipeline, "_register", fake)
    bad = torch.rand(50, 3) + 1.0
    with pytest.warns(_progress.DoubtfulResultWarning, match="weak margin") as rec:
        r = pipeline.register(bad, bad, device="cpu")
    assert rec[0].filename == __file__ and not r.converged
    good = torch.zeros(50, 3)
    good[:, 1] = torch.arange(50.0)
    good[:, 2] = torch.arange(50.0) % 7
    with warnings.catch_warnings(), caplog.at_level(logging.DEBUG, logger="pointalign"):
        warnings.simplefilter("error")
        assert pipeline.register(good, good, device="cpu").converged
    assert any(m.startswith("register: total 750.0 ms: ransac 500.0, icp 250.0")
               for m in caplog.messages)
    with warnings.catch_warnings(record=True) as rec2, _progress.quiet():
        warnings.simplefilter("always")
        pipeline.register(bad, bad, device="cpu")
    assert not rec2


def test_placeholder_spinner_hides_while_a_counted_bar_shows(monkeypatch):
    """The CLI's spinner around a call gives way to the call's own bar with a count."""
    monkeypatch.setenv("POINTALIGN_PROGRESS", "1")
    _progress.set_quiet(False)
    assert _progress.live_console() is None
    with _progress.task("registering (icp)", placeholder=True) as spin:
        prog = _progress.live_console() and _progress._SHARED["progress"]
        assert prog is not None and spin.shown
        visible = {t.description: t.visible for t in prog.tasks}
        assert visible == {"registering (icp)": True}
        with _progress.task("ICP", total=50) as bar:
            bar.advance(3)
            visible = {t.description: t.visible for t in prog.tasks}
            assert visible == {"registering (icp)": False, "ICP": True}
            counted = next(t for t in prog.tasks if t.description == "ICP")
            assert counted.completed == 3 and counted.total == 50
        assert {t.description: t.visible for t in prog.tasks} == {"registering (icp)": True}
    assert _progress.live_console() is None and _progress._SHARED["counted"] == 0


def test_cli_warnings_print_above_the_bars(monkeypatch):
    """A warning issued while a bar is on screen goes through the display's console."""
    from pointalign import cli

    monkeypatch.setenv("POINTALIGN_PROGRESS", "1")
    _progress.set_quiet(False)
    printed = []
    with _progress.task("softassign", total=10):
        live = _progress.live_console()
        monkeypatch.setattr(live, "print", lambda *a, **k: printed.extend(a))
        cli._warning("softassign on 40000 x 40000 points [cells form] will take 3 minutes")
    assert printed and "[cells form]" in printed[0].replace("\\[", "[")
