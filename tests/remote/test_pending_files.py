"""PendingFiles: the calls a ShardFetcher makes of a pending set, on files a Python reader opens (NOTE [pending files])."""

from __future__ import annotations

import threading
import time

import pytest

from pyloader.remote.pending_files import PendingFiles


def _files(n: int = 3) -> PendingFiles:
    return PendingFiles(n, lambda i, message, errno: OSError(errno, f"file {i}: {message}"))


@pytest.mark.timeout(30)
def test_a_file_is_released_after_its_last_planned_read_and_only_then_unloads():
    f = _files()
    f.retain(1, 2)
    f.mark_ready(1, "/x/1")
    assert f.wait_events(0.0)[0] == []
    assert not f.unload(1)  # planned reads left
    with f.reading(1) as path:
        assert path == "/x/1"
        assert not f.unload(1, force=True)  # a read runs on it
    f.release(1)
    assert f.wait_events(0.0)[0] == []
    f.release(1)
    assert f.wait_events(0.0)[0] == [1]  # its last planned read: released
    assert f.unload(1) and f.counts()["unloads"] == 1
    with pytest.raises(ValueError, match="released more often"):
        f.release(1)


@pytest.mark.timeout(30)
def test_a_forced_unload_makes_a_needed_file_pending_and_its_read_waits_for_it():
    f = _files()
    f.retain(0)
    f.mark_ready(0, "/x/0")
    assert f.unload(0, force=True)  # needed later, no read now: the fetcher brings it back
    got: list[str] = []

    def read() -> None:
        with f.reading(0) as p:
            got.append(p)

    t = threading.Thread(target=read)
    t.start()
    deadline = time.monotonic() + 10
    waiting: list[int] = []
    while not waiting and time.monotonic() < deadline:
        waiting = f.wait_events(0.1)[1]
    assert waiting == [0] and f.waiting() == [0]
    f.mark_ready(0, "/y/0")
    t.join(10)
    assert got == ["/y/0"] and f.waiting() == []


@pytest.mark.timeout(30)
def test_a_failed_file_raises_the_readers_error_until_retried():
    f = _files()
    f.retain(2)
    f.mark_failed(2, "gone", 2)
    with pytest.raises(OSError, match="file 2: gone") as e, f.reading(2):
        pass
    assert e.value.errno == 2
    assert f.retry(2) and not f.retry(2)
    f.mark_ready(2, "/x/2")
    with f.reading(2) as p:
        assert p == "/x/2"


@pytest.mark.timeout(30)
def test_a_file_fetched_with_no_planned_read_is_released_at_once():
    f = _files()
    f.mark_ready(0, "/x/0")  # fetched for an iterator that was closed meanwhile
    assert f.wait_events(0.0)[0] == [0] and f.unload(0)
