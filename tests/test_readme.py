"""The README's Python example runs as written on a CPU-only machine."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_a_python_example():
    blocks = _python_blocks()
    assert blocks and "import pointalign" in blocks[0]
    assert 'device="cuda"' not in blocks[0].replace('"cpu"/"cuda"', "")
    assert "scan.ply" not in blocks[0]


def test_readme_example_runs(tmp_path):
    code = _python_blocks()[0]
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "fitness" in proc.stdout
    assert (tmp_path / "aligned.ply").is_file() and (tmp_path / "result.json").is_file()


def test_readme_tells_what_make_demo_installs():
    """The pin resolves to whatever build pip picks; the CPU index is an option, not a claim."""
    text = README.read_text()
    make = (README.parent / "Makefile").read_text()
    assert "the CPU build by default" not in text
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text and "CUDA build" in text
    assert "TORCH_INDEX ?=" in make and "--index-url $(TORCH_INDEX)" in make
    assert "tranche" not in text.lower()  # no section named after internal work
    assert "## Coming from Open3D or small_gicp" in text
    assert "## Changes to the public API" in text and "T_target_source` is a `(4, 4)` float64" \
        in text


def test_readme_says_which_open3d_and_small_gicp_habits_hold_and_which_not():
    """Issue 26: the habits followed and those not, each difference with its reason; every
    function the section names is public."""
    import pointalign as pa

    text = README.read_text()
    section = text.split("## Coming from Open3D or small_gicp", 1)[1].split("\n## ", 1)[0]
    for habit in ("evaluate_registration", "max_iterations=", "num_threads=",
                  "preprocess", "Differences, each for a reason"):
        assert habit in section, habit
    assert "GICP/VGICP" not in section or "not here" not in section.split("GICP/VGICP")[1][:40]
    for name in re.findall(r"`pa\.(\w+)", section):
        assert hasattr(pa, name), name
