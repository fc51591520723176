"""A transform worker process that dies, whichever it is, is reported at once (NOTE [transform worker deaths]).

Real worker processes are killed (SIGKILL, as the out-of-memory killer does; SIGSEGV, as a
crash in a C extension does) or crash inside the transform, with ``timeout=0`` (wait
forever) and with a long timeout: ``next()`` must raise ``TransformWorkerError`` naming the
worker, its pid, the signal or exit code and the samples it held within about a second.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import multiprocessing
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from worker_util import alive, slot_files

import pyloader

FIELDS = {"x": ("float32", (4,)), "label": "int64"}
N = 240
BATCH = 4
DETECT_S = 1.0  # the promise: a death is reported within a second of the consumer waiting


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("deaths") / "ds")
    with pyloader.ShardWriter(d, FIELDS, shard_bytes=2048) as w:
        for i in range(N):
            w.write({"x": np.full(4, i, np.float32), "label": i})
    return d


def slow(s: dict[str, Any]) -> dict[str, Any]:
    if faulthandler.is_enabled():  # (pytest's, inherited: a worker killed by SIGSEGV would print its stack)
        faulthandler.disable()
    time.sleep(0.05)  # the consumer is always waiting: a batch takes 0.2 s, a death must not
    return {"label": s["label"]}


def crash_on_42(s: dict[str, Any]) -> dict[str, Any]:
    if int(s["label"]) == 42:
        faulthandler.disable()  # (pytest's, inherited: the worker's stack is not this test's business)
        ctypes.string_at(0)  # a segmentation fault, as a bug in a C extension makes
    return {"label": s["label"]}


def exit_on_42(s: dict[str, Any]) -> dict[str, Any]:
    if int(s["label"]) == 42:
        os._exit(3)
    return {"label": s["label"]}


def children() -> set[int]:
    gc.collect()  # iterators of earlier tests that ended in an exception are in reference cycles
    return {p.pid for p in multiprocessing.active_children()}


def workers_by_index(before: set[int]) -> dict[int, int]:
    """{worker index: pid} of this process's transform workers started since ``before`` (``children()``)."""
    out = {}
    for p in multiprocessing.active_children():
        if p.name.startswith("pyloader-transform-") and p.pid not in before:
            out[int(p.name.rsplit("-", 1)[1])] = p.pid
    return out


def next_until_error(it: Any) -> tuple[pyloader.TransformWorkerError, int]:
    """Iterates until TransformWorkerError; the error and how many batches came first."""
    got = 0
    with pytest.raises(pyloader.TransformWorkerError) as ei:
        for _ in range(N):
            next(it)
            got += 1
    return ei.value, got


def check_error(e: pyloader.TransformWorkerError, w: int, pid: int, how: str) -> None:
    msg = str(e)
    assert f"worker {w} (pid {pid})" in msg and how in msg, msg
    assert e.worker == w and e.pid == pid  # type: ignore[attr-defined]
    # What it held: batches of its share (t % W == w), and their samples (unshuffled: t*B..t*B+B-1).
    assert e.batches and all(t % 3 == w for t in e.batches), msg  # type: ignore[attr-defined]
    want = [i for t in e.batches for i in range(t * BATCH, (t + 1) * BATCH)]  # type: ignore[attr-defined]
    assert e.samples == want, msg  # type: ignore[attr-defined]
    assert f"samples {want[0]}, {want[1]}" in msg, msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [0, 120])
@pytest.mark.parametrize(("w", "sig"), [(0, signal.SIGKILL), (1, signal.SIGKILL), (2, signal.SIGKILL),
                                        (1, signal.SIGSEGV)])
def test_a_killed_worker_is_reported_within_a_second(shards, w: int, sig: signal.Signals, timeout: int) -> None:
    ds = pyloader.ShardDataset(shards)
    before = children()
    it = iter(pyloader.DataLoader(ds, batch_size=BATCH, transform=slow, num_workers=3, executor="processes",
                                  timeout=timeout))
    next(it)
    pids = workers_by_index(before)
    assert sorted(pids) == [0, 1, 2]
    os.kill(pids[w], sig)
    t0 = time.monotonic()
    e, _ = next_until_error(it)
    took = time.monotonic() - t0
    assert took < DETECT_S, f"the death of worker {w} took {took:.2f} s to be reported"
    check_error(e, w, pids[w], f"killed by signal {sig.name}")
    assert e.exitcode == -sig  # type: ignore[attr-defined]
    with pytest.raises(pyloader.LoaderStateError):
        next(it)  # the stream was closed: the other workers are stopped and their slots removed
    del it
    assert not [p for p in pids.values() if alive(p)]
    assert not slot_files()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("transform", "how"), [(crash_on_42, "killed by signal SIGSEGV"),
                                                (exit_on_42, "exited with code 3")])
def test_a_worker_that_crashes_in_its_transform_names_the_sample(shards, transform: Any, how: str) -> None:
    ds = pyloader.ShardDataset(shards)
    it = iter(pyloader.DataLoader(ds, batch_size=BATCH, transform=transform, num_workers=3, executor="processes"))
    t0 = time.monotonic()
    e, got = next_until_error(it)
    assert time.monotonic() - t0 < 10
    w = (42 // BATCH) % 3
    msg = str(e)
    assert f"worker {w} " in msg and how in msg, msg
    assert 42 // BATCH == e.batches[0] and 42 in e.samples, msg  # type: ignore[attr-defined]
    assert got <= 42 // BATCH  # batches before it came out, in order; none after it
    del it
    assert not slot_files()


@pytest.mark.timeout(60)
def test_a_worker_of_the_first_of_two_open_streams_is_reported(shards) -> None:
    """The second stream's workers, forked later, hold none of the first stream's pipe ends."""
    ds = pyloader.ShardDataset(shards)
    before = children()
    first = iter(pyloader.DataLoader(ds, batch_size=BATCH, transform=slow, num_workers=3, executor="processes"))
    next(first)
    mine = workers_by_index(before)
    second = iter(pyloader.DataLoader(ds, batch_size=BATCH, transform=slow, num_workers=3, executor="processes"))
    next(second)
    os.kill(mine[1], signal.SIGKILL)
    t0 = time.monotonic()
    e, _ = next_until_error(first)
    assert time.monotonic() - t0 < DETECT_S
    check_error(e, 1, mine[1], "SIGKILL")
    assert len(list(second)) == N // BATCH - 1  # the other stream is untouched
    del first, second


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with __import__("contextlib").suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:"):
                out.add(link)
    return out


def test_each_worker_holds_only_its_own_pipe_end(shards) -> None:
    ds = pyloader.ShardDataset(shards)
    kids = children()
    before = socket_inodes(os.getpid())
    it = iter(pyloader.DataLoader(ds, batch_size=BATCH, transform=slow, num_workers=3, executor="processes"))
    next(it)
    pids = workers_by_index(kids)
    parent = socket_inodes(os.getpid())
    parent_ends = parent - before  # the parent's end of each worker's pipe
    assert len(parent_ends) == 3, parent_ends
    own = {}
    for w, pid in pids.items():
        held = socket_inodes(pid)
        assert not held & parent_ends, f"worker {w} holds the parent's end of a pipe: {held & parent_ends}"
        own[w] = held - parent - before  # (a socket of the test process, inherited at the fork, is not a pipe end)
        assert len(own[w]) == 1, f"worker {w} holds {len(own[w])} pipe ends of its own: {own[w]}"
    assert len(set().union(*own.values())) == 3, f"workers share a pipe end: {own}"
    del it
