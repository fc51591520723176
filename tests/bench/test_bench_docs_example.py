"""The `pyloader bench` command docs/from-torch.md gives prints no warning about its own settings
(issue 27, item 7): run as written, on the data the page converts, after the page's convert."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "from-torch.md"


def bash_lines(page: Path) -> list[str]:
    """Every command line of the page's bash blocks."""
    out, inside = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if inside and line.strip():
            out.append(line.strip())
    return out


def the_line(page: Path, start: str) -> str:
    (line,) = [ln for ln in bash_lines(page) if ln.startswith(start)]
    return line


@pytest.mark.timeout(300)
def test_the_bench_example_of_from_torch_warns_of_nothing(tmp_path) -> None:
    # data/train as the docs test prepares it (tests/test_docs_examples.py, workdir).
    train = tmp_path / "data" / "train"
    train.mkdir(parents=True)
    rng = np.random.default_rng(0)
    np.save(train / "image.npy", rng.integers(0, 256, (1000, 3, 32, 32), dtype=np.uint8))
    np.save(train / "label.npy", np.arange(1000, dtype=np.int64) % 10)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for line in (the_line(PAGE, "pyloader convert data/train shards/train"), the_line(PAGE, "pyloader bench")):
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=280)
        assert r.returncode == 0, f"{line}: exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert "bench: " in r.stdout and "What it drew from each stage" in r.stdout
    assert "WARNING" not in r.stdout and "too short to trust" not in r.stdout, r.stdout
