"""Fixtures for the remote tests: a dataset served by a loopback HTTP server, a cache dir,
fast retry settings, and a check that no test leaves temp files in its cache."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from remote_servers import FaultServer
from remote_util import temp_files, write_ds


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYLOADER_FETCH_ATTEMPTS", "4")
    monkeypatch.setenv("PYLOADER_FETCH_BACKOFF", "0.01")
    monkeypatch.setenv("PYLOADER_FETCH_BACKOFF_CAP", "2")
    monkeypatch.setenv("PYLOADER_FETCH_DEADLINE", "20")
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
def cache_dir(tmp_path):
    d = str(tmp_path / "cache")
    yield d
    # Datasets dropped by the test cancel their fetchers (weakref.finalize); a download
    # still in flight stops at its next chunk and removes its temp file.
    gc.collect()
    # Cancels take ~50 ms, but removing a temp can take seconds where the filesystem is
    # mounted with online discard (ext4 `discard`: unlinking a file whose blocks were
    # reserved with posix_fallocate issues a synchronous TRIM; seen blocking 1.5-10 s on
    # this machine's virtual disk). The bound still catches a temp that is never removed.
    # A download thread that saw the cancel may still be between making its temp and
    # removing it: wait for the download threads to end too, not only for no temp now.
    deadline = time.monotonic() + 30
    while (temp_files(d) or _downloading()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert temp_files(d) == [], "a test left partial downloads behind"


def _downloading() -> bool:
    return any(t.name == "pyloader-fetch" and t.is_alive() for t in threading.enumerate())
