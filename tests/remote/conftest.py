"""Fixtures for the remote tests: a dataset served by a loopback HTTP server, a cache dir,
fast retry settings, and a check that no test leaves temp files in its cache."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from remote_servers import FaultServer
from remote_util import temp_files, write_ds

import pyloader

FETCH_DEADLINE_S = 20  # fast_retries: no download retries past this
# The longest a download thread lives once its dataset is gone: cancelled at its next chunk,
# else its fetch deadline, plus the last attempt's stall timeout and the removal of its temp
# (seen up to 10 s where unlinking a fallocated file waits for a TRIM: ext4 `discard`).
DOWNLOAD_BOUND_S = FETCH_DEADLINE_S + 25


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYLOADER_FETCH_ATTEMPTS", "4")
    monkeypatch.setenv("PYLOADER_FETCH_BACKOFF", "0.01")
    monkeypatch.setenv("PYLOADER_FETCH_BACKOFF_CAP", "2")
    monkeypatch.setenv("PYLOADER_FETCH_DEADLINE", str(FETCH_DEADLINE_S))
    monkeypatch.setenv("PYLOADER_FETCH_STALL_TIMEOUT", "1")
    monkeypatch.delenv("PYLOADER_CACHE_DIR", raising=False)


@pytest.fixture
def srv_root(tmp_path) -> str:
    root = str(tmp_path / "srv")
    write_ds(os.path.join(root, "ds"))
    return root


@pytest.fixture
def server(srv_root):
    with FaultServer(srv_root, max_life=120) as s:
        yield s


@pytest.fixture
def slow_server(tmp_path):
    """1,200 records of 4 KiB in 1 MiB shards under /ds, served at 300 KB/s: downloads that last."""
    root = str(tmp_path / "slow-srv")
    with pyloader.ShardWriter(os.path.join(root, "ds"), {"x": ("uint8", (4096,))}, compression="none",
                              shard_bytes=1 << 20) as w:
        for i in range(1200):
            w.write({"x": np.full(4096, i % 251, np.uint8)})
    with FaultServer(root, bandwidth=300_000, max_life=120) as s:
        yield s


@pytest.fixture
def cache_dir(tmp_path):
    d = str(tmp_path / "cache")
    yield d
    # Datasets dropped by the test cancel their fetchers (weakref.finalize); a download
    # still in flight stops at its next chunk and removes its temp file before its thread
    # ends. So the wait is for what removes the temps -- the download threads -- for as long
    # as they run, however slow the machine: not a guess at how long that takes. The bound
    # is the threads' own (DOWNLOAD_BOUND_S), there to fail a test whose thread never ends.
    gc.collect()
    bound = time.monotonic() + DOWNLOAD_BOUND_S
    while (threads := _download_threads()) and time.monotonic() < bound:
        threads[0].join(max(0.0, bound - time.monotonic()))
    while temp_files(d) and time.monotonic() < bound:  # (a temp a test's own thread removes)
        time.sleep(0.05)
    assert temp_files(d) == [], "a test left partial downloads behind"


def _download_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pyloader-fetch" and t.is_alive()]
