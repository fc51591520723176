"""The code blocks of the README and of every page under ``docs/`` run as written.

The convention, checked by ``test_every_block_is_run_or_says_why``:

- Every fenced block names its language. ``python`` and ``bash`` blocks run; ``text`` and
  ``json`` blocks are diagrams, synopses of formats and sample output, never run.
- A ``python`` or ``bash`` block whose preceding non-blank line is
  ``<!-- not run: REASON -->`` is not run; the reason must be a real one (it needs a GPU, it is a signature or a usage synopsis, it installs the package or runs
  a long benchmark). Such blocks are few; ``MAX_NOT_RUN`` caps them per page.
- A block inside an HTML comment opened by a line ``<!-- setup`` is a hidden setup block: it
  runs like the others but does not show on the rendered page (the stand-ins an example
  assumes: a dataset, a checkpoint path, a training step).

Each page runs in a temporary folder of its own as the scripts a reader would paste its
blocks into (``test_page_runs_as_scripts``): the blocks, setup blocks included, in order,
written to ``docs_script_<n>.py`` files in that folder, each run as ``python -W error
docs_script_<n>.py`` (warnings as errors; bash blocks where they stand, through
``subprocess``), with the same folder and the same environment. A block with an ``if __name__ == "__main__":`` guard is a script of its own (a
process it starts with ``spawn`` imports that file again: NOTE [docs scripts]); the blocks
after it start a new script, so they import what they use. A missing guard or import fails.

A page runs in order, in a temporary folder prepared by ``workdir`` with the
small data the pages name: ``data/train/image.npy`` (uint8 ``[1000, 3, 32, 32]``) and
``label.npy`` (int64 ``[1000]``), ``data/part-0.parquet`` and ``part-1.parquet`` (columns
``image``, ``label``), ``images/<class>/<n>.bin`` and ``wds/shard-0.tar``. The ``python``
blocks of one script share its namespace; ``bash`` blocks run with ``bash -euo pipefail``
and the ``pyloader`` command of this interpreter.

``s3://bucket/dataset`` is real: an S3-compatible server (moto's) on 127.0.0.1 holds that
dataset (the ``data/train`` arrays converted, in several shards), and the standard AWS
variables (``AWS_ENDPOINT_URL``, a key and a region) point every client of the page at it,
so the remote examples run as written. The one rewrite: the NVMe cache folder the pages
name, ``/local/nvme/pyloader``, becomes a folder under the temporary one.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch.distributed
import torch.utils.data

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = ("python", "bash")
DATA = ("text", "json")
MAX_NOT_RUN = 4
NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S.*?)\s*-->")
SETUP = "<!-- setup"
NVME = "/local/nvme/pyloader"  # the pages' node-local cache folder, rewritten per run
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    section: str
    skip: str | None  # the not-run reason
    hidden: bool  # a setup block inside an HTML comment
    alone: bool = False  # a script of its own (NOTE [docs scripts])


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with their section and markers."""
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
                         marker.group(1) if marker else None, last_text == SETUP))
        last_text = ""
    return out


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory) -> Iterator[str]:
    """An S3-compatible server on 127.0.0.1 whose ``s3://bucket/dataset`` is a small dataset."""
    import boto3
    import s3fs

    sys.path.insert(0, str(ROOT / "tests" / "remote"))
    try:
        from remote_servers import S3Server
    finally:
        sys.path.pop(0)
    import pyloader

    src = tmp_path_factory.mktemp("s3src")
    rng = np.random.default_rng(1)
    pyloader.convert({"image": rng.integers(0, 256, (600, 3, 32, 32), dtype=np.uint8),
                      "label": np.arange(600, dtype=np.int64) % 10}, src / "dataset", shard_size="400K")
    assert len(list((src / "dataset").glob("*.pyl"))) >= 4  # enough for four nodes to share
    srv = S3Server().start()
    try:
        boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket="bucket")
        fs = s3fs.S3FileSystem(**srv.storage_options())
        for f in sorted((src / "dataset").iterdir()):
            fs.put_file(str(f), f"bucket/dataset/{f.name}")
        assert fs.exists("bucket/dataset/manifest.json")
        yield srv.endpoint
    finally:
        srv.stop()


@pytest.fixture
def workdir(tmp_path, monkeypatch, s3_endpoint) -> Path:
    """The folder the pages describe; torch's DataLoader name and process group restored afterwards."""
    rng = np.random.default_rng(0)
    train = tmp_path / "data" / "train"
    train.mkdir(parents=True)
    n = 1000
    np.save(train / "image.npy", rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8))
    np.save(train / "label.npy", np.arange(n, dtype=np.int64) % 10)
    import pyarrow as pa
    import pyarrow.parquet as pq
    for part in range(2):
        flat = pa.array(rng.integers(0, 256, 300 * 192, dtype=np.uint8))
        table = pa.table({"image": pa.FixedSizeListArray.from_arrays(flat, 192),
                          "label": pa.array(np.arange(300, dtype=np.int64) % 10)})
        pq.write_table(table, tmp_path / "data" / f"part-{part}.parquet", row_group_size=100)
    for cls in ("cat", "dog"):
        (tmp_path / "images" / cls).mkdir(parents=True)
        for k in range(3):
            (tmp_path / "images" / cls / f"{k}.bin").write_bytes(rng.bytes(64))
    (tmp_path / "wds").mkdir()
    with tarfile.open(tmp_path / "wds" / "shard-0.tar", "w") as tar:
        for key in range(4):
            for ext, payload in (("jpg", rng.bytes(32)), ("cls", str(key % 2).encode())):
                info = tarfile.TarInfo(f"{key:06d}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.utils.data, "DataLoader", torch.utils.data.DataLoader)  # a page may patch it
    monkeypatch.setenv("PYLOADER_CACHE_DIR", str(tmp_path / "cache"))
    for k, v in {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield tmp_path
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # a page may start a one-process group
    # What a page wrote to the bucket goes: the next run of a page (as scripts) finds it as the first did.
    import boto3
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bucket"):
        for obj in page.get("Contents", []):
            if not obj["Key"].startswith("dataset/"):
                s3.delete_object(Bucket="bucket", Key=obj["Key"])


# NOTE [docs scripts]: a reader pastes a page's blocks into a script and runs it. The
# script run catches what the shared namespace hides: a block that starts processes with
# `spawn` (Dask's LocalCluster) re-imports the script file in each of them, so without its
# `if __name__ == "__main__":` guard every worker starts a cluster of its own. Such a block
# is therefore one script file alone: a spawned process re-importing it re-runs nothing
# but that block's imports, as with a reader's script of that block. Every other run of
# consecutive blocks is one script file; bash blocks run where they stand.
GUARD = re.compile(r"^if __name__ == [\"']__main__[\"']:", re.M)
BASH_HELPER = """import subprocess as _docs_subprocess
import sys as _docs_sys


def _docs_bash(code, where):
    r = _docs_subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=120)
    if r.returncode:
        _docs_sys.exit(f"{where}: exit {r.returncode}\\n{r.stdout}\\n{r.stderr}")
"""


def page_scripts(path: Path, runnable: list[Block], workdir: Path) -> list[Path]:
    """The script files a reader would make of ``runnable`` (NOTE [docs scripts]), written into ``workdir``."""
    groups: list[list[Block]] = []
    for b in runnable:
        alone = b.lang == "python" and GUARD.search(b.code) is not None
        if alone or not groups or groups[-1][-1].alone:
            groups.append([])
        b.alone = alone
        groups[-1].append(b)
    out = []
    for n, group in enumerate(groups):
        parts = [f"# {page_id(path)}: blocks at lines {', '.join(str(b.line) for b in group)} (tests/test_docs_examples.py)\n"]
        if any(b.lang == "bash" for b in group):
            parts.append(BASH_HELPER)
        for b in group:
            code = b.code.replace(NVME, str(workdir / "nvme"))
            where = f"{page_id(path)}:{b.line} ({b.section})"
            parts.append(f"# --- {where}\n" + (code if b.lang == "python" else f"_docs_bash({code!r}, {where!r})\n"))
        script = workdir / f"docs_script_{n}.py"
        script.write_text("\n".join(parts))
        out.append(script)
    return out


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_block_is_run_or_says_why(page):
    found = blocks(page)
    for b in found:
        where = f"{page_id(page)}:{b.line}"
        assert b.lang in RUN + DATA, f"{where}: a block must name its language, one of {RUN + DATA}"
        if b.lang in DATA:
            assert b.skip is None and not b.hidden, f"{where}: a {b.lang} block is never run: drop its marker"
        if b.hidden:
            assert b.lang in RUN and b.skip is None, f"{where}: a setup block must run"
    assert sum(b.skip is not None for b in found) <= MAX_NOT_RUN, f"{page_id(page)}: too many blocks not run"
    text = page.read_text()
    assert text.count("not run:") == sum(b.skip is not None for b in found), \
        f"{page_id(page)}: a not-run marker that is not directly above a block"
    assert text.count(SETUP) == sum(b.hidden for b in found), \
        f"{page_id(page)}: a setup comment that is not directly above a block"


def test_pages_are_found():
    names = {page_id(p) for p in PAGES}
    assert {"README.md", "docs/from-torch.md", "docs/resume.md", "docs/convert.md"} <= names
    assert sum(b.lang in RUN and b.skip is None for p in PAGES for b in blocks(p)) >= 15


@pytest.mark.timeout(180)
@pytest.mark.parametrize("page", [p for p in PAGES if any(b.lang in RUN and b.skip is None for b in blocks(p))],
                         ids=page_id)
def test_page_runs_as_scripts(page, workdir):
    """The page's blocks as the script files a reader makes of them (NOTE [docs scripts]), warnings as errors.

    Issue 27 Deliver 5. Each script runs in a child interpreter of its own: the examples
    start clusters, process groups and worker processes (and multiprocessing's helpers)
    that must not outlive the page inside the test process, where later tests count their
    own children.
    """
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for script in page_scripts(page, [b for b in blocks(page) if b.lang in RUN and b.skip is None], workdir):
        r = subprocess.run([sys.executable, "-W", "error", script.name], cwd=workdir, env=env, capture_output=True,
                           text=True, timeout=170)
        assert r.returncode == 0, (f"{page_id(page)} as a script ({script.name}, below): exit {r.returncode}\n"
                                   f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}\n--- {script.name}\n{script.read_text()}")


def test_a_script_without_its_guard_fails(tmp_path):
    """The script run catches what issue 27 item 8 was: a Dask block that starts a cluster without its guard."""
    page = tmp_path / "page.md"
    page.write_text("# Page\n```python\nimport os\n\nmarker = os.getcwd()\n```\n"
                    "```python\nimport multiprocessing as mp\nimport sys\n\n"
                    "p = mp.get_context('spawn').Process(target=print, args=('child',))\np.start()\np.join()\n"
                    "sys.exit(p.exitcode)\n```\n")
    found = blocks(page)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    scripts = page_scripts(page, found, tmp_path)
    assert len(scripts) == 1, "no guard: one script of both blocks"
    r = subprocess.run([sys.executable, scripts[0].name], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "freeze_support" in r.stderr, r.stderr[-2000:]
    head, body = found[1].code.split("\n\n")
    guarded = head + "\n\nif __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in body.splitlines())
    page.write_text(f"# Page\n```python\n{found[0].code}```\n```python\n{guarded}```\n")
    scripts = page_scripts(page, blocks(page), tmp_path)
    assert len(scripts) == 2, "the guarded block is a script of its own"
    for script in scripts:
        r = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "child"


def test_readme_says_what_each_extra_brings():
    """Issue 27 item 20: the README's install paragraph names every extra of pyproject.toml and what it installs."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = (ROOT / "README.md").read_text()
    para = text[text.index("`pip install -e .` installs"):].split("\n\n")[0]
    para_lower = " ".join(para.split()).lower()
    for extra, reqs in extras.items():
        assert f"`.[{extra}]`" in para, f"the README does not say what .[{extra}] brings"
        for req in reqs:
            name = re.split(r"[\[<>=!~ ]", req, maxsplit=1)[0].lower()
            assert name in para_lower, f"the README does not name {name} (extra {extra})"


def test_readme_says_how_long_the_tests_take():
    """Issue 40 item 23: the test command is followed by how long it takes and where the time goes."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index("python -m pytest -q            # tests"):].split("\n\n")[0]
    assert re.search(r"about \d+ minutes on \d+ CPU cores", after), after
    assert "build the C++ extension" in after and re.search(r"took \d[\d,]* s", after), after


# Issue 40 item 22: on these pages every visible block runs pasted alone into a script of its
# own: it imports what it uses and makes what it reads, with no hidden setup block run and no
# name from another block (the files earlier visible blocks wrote stay, as in a reader's folder).
# A hidden block may still follow a visible one (a check, a second run): it is not a reader's.
SELF_CONTAINED = [ROOT / "docs" / "mixtures.md", ROOT / "docs" / "resume.md"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", SELF_CONTAINED, ids=page_id)
def test_each_visible_block_runs_alone(page, workdir):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    visible = [b for b in blocks(page) if b.lang in RUN and b.skip is None and not b.hidden]
    assert visible, f"{page_id(page)}: no visible block to run"
    for n, b in enumerate(visible):
        where = f"{page_id(page)}:{b.line} ({b.section})"
        code = b.code.replace(NVME, str(workdir / "nvme"))
        if b.lang == "bash":
            cmd = ["bash", "-euo", "pipefail", "-c", code]
        else:
            script = workdir / f"docs_block_{n}.py"
            script.write_text(code)
            cmd = [sys.executable, "-W", "error", script.name]
        r = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=170)
        assert r.returncode == 0, f"{where}, pasted alone: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
