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
