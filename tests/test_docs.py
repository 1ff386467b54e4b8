"""The documentation: its pages exist, its examples show code and output, its code runs.

``make docs`` builds the site (mkdocs --strict, in CI); these tests check the sources, and,
where a built ``site/`` exists, that the API pages show no literal Sphinx roles. The
browser check of the built site is in ``tests/test_viz.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _nav_pages() -> list[str]:
    return re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)


def test_every_nav_page_exists_and_the_newcomer_pages_are_there():
    pages = _nav_pages()
    for page in pages:
        assert (DOCS / page).is_file(), page
    for page in ("getting-started.md", "from-open3d.md", "tutorials/pair.md",
                 "tutorials/refine.md", "tutorials/lidar.md", "tutorials/batches.md",
                 "tutorials/files-and-units.md", "examples.md"):
        assert page in pages, page


def test_examples_page_shows_each_example_with_its_output():
    text = (DOCS / "examples.md").read_text()
    for script in sorted((ROOT / "examples").glob("*.py")):
        assert f'--8<-- "examples/{script.name}"' in text, script.name
        out = DOCS / "examples" / f"{script.stem}.txt"
        assert f'--8<-- "examples/{script.stem}.txt"' in text and out.is_file(), out
        assert out.read_text().strip(), f"{out} is empty"


def _python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


def test_getting_started_code_runs(tmp_path):
    """The first-registration and reading-the-result blocks run as written (CPU)."""
    blocks = _python_blocks("getting-started.md")
    code = "\n".join(b for b in blocks if "viz." not in b)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "error:" in proc.stdout and (tmp_path / "result.json").is_file()


def test_refine_tutorial_code_runs(tmp_path):
    code = "\n".join(_python_blocks("tutorials/refine.md"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_sphinx_roles_become_links():
    """The docs build's griffe extension turns :func:`x` into a cross-reference."""
    griffe = pytest.importorskip("griffe")
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import sphinx_roles
    finally:
        sys.path.pop(0)
    pkg = griffe.load("pointalign.metrics", search_paths=[str(ROOT / "src")],
                      resolve_aliases=False)
    fn = pkg["evaluate_registration"]
    out = sphinx_roles._rewrite("see :class:`RegistrationEvaluation` and :func:`~math.inf`"
                                " and :meth:`pointalign.RegistrationResult.save`", fn)
    assert ':class:' not in out and ":func:" not in out and ":meth:" not in out
    assert 'identifier="pointalign.metrics.RegistrationEvaluation" optional' in out
    assert 'identifier="pointalign.RegistrationResult.save" optional' in out


def test_built_site_shows_no_literal_roles():
    site = ROOT / "site"
    if not (site / "index.html").is_file():
        pytest.skip("no built site/ (make docs)")
    for page in (site / "api").rglob("*.html"):
        text = page.read_text()
        assert ":func:`" not in text and ":class:`" not in text, page


def test_api_signatures_are_wrapped_on_their_own_lines():
    """Issue 26: the API pages showed each signature as one long line."""
    conf = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^\s*separate_signature: true\s*$", conf, re.M)
    assert re.search(r"^\s*line_length: \d+\s*$", conf, re.M)
    site = ROOT / "site" / "api" / "registration" / "index.html"
    if site.is_file():  # built (make docs): register's signature spans several lines
        text = site.read_text()
        sig = re.search(r'id="pointalign.register".*?<pre.*?</pre>', text, re.S)
        assert sig is None or sig.group(0).count("\n") > 3
