"""The code blocks of the docs run as written.

Which blocks run: every fenced ``python`` and ``bash`` block of ``docs/from-torch.md``, and
the ``python`` blocks of the README sections named in ``README_SECTIONS``. A block whose
preceding non-blank line is ``<!-- not run: REASON -->`` is skipped (it needs a GPU,
remote storage or credentials); a skipped block must give its reason.

A page runs as one session, in order, in a temporary folder prepared as the page says
(``data/train/image.npy`` and ``label.npy``): ``python`` blocks share one namespace,
``bash`` blocks run with ``bash -euo pipefail`` and the ``pyloader`` command of this
interpreter. The README's ``/data/`` paths are moved under the temporary folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch.utils.data

ROOT = Path(__file__).resolve().parent.parent
FROM_TORCH = ROOT / "docs" / "from-torch.md"
README = ROOT / "README.md"
README_SECTIONS = ["Write and read a dataset"]  # the quick start
NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    section: str
    skip: str | None  # the not-run reason


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with their section and not-run marker."""
    out: list[Block] = []
    lines = path.read_text().splitlines()
    section, last_text, i = "", "", 0
    while i < len(lines):
        line = lines[i]
        m = FENCE.match(line)
        if m is None:
            if line.startswith("#"):
                section = line.lstrip("#").strip()
            if line.strip():
                last_text = line.strip()
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        marker = NOT_RUN.fullmatch(last_text)
        out.append(Block(m.group(1), "\n".join(body) + "\n", start + 1, section,
                         marker.group(1) if marker else None))
        last_text = ""
    return out


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """The folder the pages describe; torch's DataLoader name restored afterwards."""
    train = tmp_path / "data" / "train"
    train.mkdir(parents=True)
    n = 1000
    rng = np.random.default_rng(0)
    np.save(train / "image.npy", rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8))
    np.save(train / "label.npy", np.arange(n, dtype=np.int64) % 10)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.utils.data, "DataLoader", torch.utils.data.DataLoader)  # a page may patch it
    monkeypatch.setenv("PYLOADER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def run_page(path: Path, runnable: list[Block], workdir: Path, replace: dict[str, str] | None = None) -> None:
    namespace: dict[str, object] = {"__name__": "__docs__"}
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for b in runnable:
        code = b.code
        for old, new in (replace or {}).items():
            code = code.replace(old, new)
        where = f"{path.relative_to(ROOT)}:{b.line} ({b.section})"
        if b.lang == "python":
            try:
                exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the docs' own examples
            except Exception as e:
                raise AssertionError(f"{where}: the example raised {type(e).__name__}: {e}") from e
        else:
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=workdir, env=env,
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, f"{where}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"


def test_from_torch_blocks_are_run_or_say_why():
    found = blocks(FROM_TORCH)
    assert sum(b.skip is None for b in found) >= 6
    for b in found:
        assert b.lang in ("python", "bash"), f"line {b.line}: a block without a runnable language"


@pytest.mark.timeout(120)
def test_from_torch_runs(workdir):
    run_page(FROM_TORCH, [b for b in blocks(FROM_TORCH) if b.skip is None], workdir)
    assert (workdir / "shards" / "train" / "manifest.json").exists()


@pytest.mark.timeout(120)
def test_readme_quick_start_runs(workdir):
    chosen = [b for b in blocks(README) if b.lang == "python" and b.section in README_SECTIONS and b.skip is None]
    assert {b.section for b in chosen} == set(README_SECTIONS)
    run_page(README, chosen, workdir, replace={'"/data/': f'"{workdir}/data/'})
    assert (workdir / "data" / "mnist-like" / "manifest.json").exists()
