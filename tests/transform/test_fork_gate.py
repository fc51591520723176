"""Forks of the loader's process while its transform threads run (NOTE [fork gate] in threads.py).

A lock held by another thread at a fork stays held in the child for good. Here the lock is a
Python one that the thread executor's transform holds through each of its samples (standing
for the locks inside torch or a tokenizer that a transform thread may hold), and the forked
worker takes it with a timeout: without the gate most forks come while a transform thread
holds it, and the worker reports so instead of hanging.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

import pyloader
from pyloader.transform import threads

FIELDS = {"x": ("float32", (4,)), "label": "int64"}
N = 96
BATCH = 8

_LOCK = threading.Lock()  # held by the thread loader's transform through each sample


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("forkgate") / "ds")
    with pyloader.ShardWriter(d, FIELDS, shard_bytes=1024) as w:
        for i in range(N):
            w.write({"x": np.full(4, i, np.float32), "label": i})
    return d


def hold_the_lock(s: dict[str, Any]) -> dict[str, Any]:
    with _LOCK:
        time.sleep(0.002)
        return {"label": s["label"], "x": s["x"] + 1}


def take_the_lock(s: dict[str, Any]) -> dict[str, Any]:
    """In a forked worker: the lock is free unless a thread held it at the fork."""
    if not _LOCK.acquire(timeout=5):
        raise RuntimeError(f"the lock was held at the fork (worker {os.getpid()})")
    _LOCK.release()
    return {"label": s["label"], "pid": os.getpid()}


class _Background:
    """Iterates a thread-executor loader epoch after epoch on a thread until stopped, counting its samples."""

    def __init__(self, ld: pyloader.DataLoader) -> None:
        self.ld, self.stop, self.batches, self.error = ld, threading.Event(), 0, None
        self.bad: list[Any] = []
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                labels: list[int] = []
                for b in self.ld:
                    if not torch.equal(b["x"][:, 0], b["label"].to(torch.float32) + 1):
                        self.bad.append(b)
                    labels += b["label"].tolist()
                    self.batches += 1
                    if self.stop.is_set():
                        return
                if sorted(labels) != list(range(N)):
                    self.bad.append(sorted(labels))
        except BaseException as e:  # noqa: BLE001 - reported by finish()
            self.error = e

    def inside_a_sample(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not threads._gate_inside and time.monotonic() < deadline:
            time.sleep(0.001)
        assert threads._gate_inside, "the thread loader's workers never started a sample"

    def finish(self) -> None:
        self.stop.set()
        self.t.join(60)
        assert not self.t.is_alive()
        assert self.error is None, self.error
        assert not self.bad, self.bad[:2]


def thread_loader(path: str) -> pyloader.DataLoader:
    return pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=3), batch_size=BATCH, num_workers=2,
                               executor="threads", transform=hold_the_lock)


def test_process_workers_forked_beside_running_transform_threads_get_no_held_lock(shards) -> None:
    bg = _Background(thread_loader(shards))
    try:
        bg.inside_a_sample()
        procs = pyloader.DataLoader(pyloader.ShardDataset(shards, shuffle=True, seed=5), batch_size=BATCH,
                                    num_workers=2, executor="processes", transform=take_the_lock)
        for epoch in range(3):  # a pool per epoch: 6 forks, each beside the transform threads
            labels: list[int] = []
            pids: set[int] = set()
            for b in procs:
                labels += b["label"].tolist()
                pids |= set(b["pid"].tolist())
            assert sorted(labels) == list(range(N)), epoch
            assert os.getpid() not in pids and len(pids) == 2, pids
    finally:
        bg.finish()
    assert bg.batches >= 1


class _TakeTheLock(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        if not _LOCK.acquire(timeout=5):
            raise RuntimeError(f"the lock was held at the fork (worker {os.getpid()})")
        _LOCK.release()
        return i


def test_any_fork_of_the_process_waits_for_the_transform_threads(shards) -> None:
    # torch's own DataLoader forks its workers through multiprocessing: the gate is on every fork.
    bg = _Background(thread_loader(shards))
    try:
        bg.inside_a_sample()
        for _ in range(3):
            got = [int(i) for b in torch.utils.data.DataLoader(_TakeTheLock(), batch_size=4, num_workers=2)
                   for i in b]
            assert sorted(got) == list(range(16))
    finally:
        bg.finish()


def slow_sample(s: dict[str, Any]) -> dict[str, Any]:
    time.sleep(1.5)
    return s


def test_a_fork_waits_for_a_long_sample_no_longer_than_the_bound(shards, monkeypatch) -> None:
    monkeypatch.setattr(threads, "FORK_GATE_S", 0.2)
    ld = pyloader.DataLoader(pyloader.ShardDataset(shards), batch_size=1, num_workers=1, executor="threads",
                             transform=slow_sample)
    it = iter(ld)
    try:
        deadline = time.monotonic() + 10
        while not threads._gate_inside and time.monotonic() < deadline:
            time.sleep(0.001)
        assert threads._gate_inside
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        waited = time.monotonic() - t0
        assert os.waitpid(pid, 0)[1] == 0
        assert 0.15 < waited < 1.2, f"the fork waited {waited:.2f} s for a 1.5 s sample (bound 0.2 s)"
        assert threads._gate_open.is_set() and threads._gate_forks == 0
        b = next(it)  # the thread goes on with its samples after the fork
        assert b["label"].shape == (1,)
    finally:
        del it


def fork_a_child(s: dict[str, Any]) -> dict[str, Any]:
    """A transform that forks (as one starting a multiprocessing helper would) from inside its sample.

    It sleeps first, so that a fork of the other thread finds it inside its sample, about to fork too.
    """
    time.sleep(0.005)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return s


def test_transform_threads_that_fork_do_not_wait_for_each_other(shards, monkeypatch) -> None:
    # Each thread forking is outside while it forks: two forking at once would otherwise each
    # wait for the other's sample until the bound.
    monkeypatch.setattr(threads, "FORK_GATE_S", 5.0)
    ld = pyloader.DataLoader(pyloader.ShardDataset(shards), batch_size=4, num_workers=2, executor="threads",
                             transform=fork_a_child)
    t0 = time.monotonic()
    labels = [int(x) for _, b in zip(range(4), ld) for x in b["label"]]
    took = time.monotonic() - t0
    assert labels == list(range(16))
    assert took < 5.0, f"16 forks from two transform threads took {took:.1f} s: forks waited for each other"
    assert threads._gate_open.is_set() and threads._gate_forks == 0 and not threads._gate_inside


def test_forking_transform_threads_after_a_remote_dataset_is_opened(shards) -> None:
    """The remote stage loads with the first remote dataset, after a thread stream may have
    installed the gate; pyloader's own fork hooks that hold a lock (the lock-file registry's)
    are registered with every dataset, before the gate's, so forking transform threads still
    do not wait for each other. Run in a fresh interpreter: the order of registration is the
    process's."""
    code = textwrap.dedent("""
        import os, time
        from typing import Any
        import pyloader
        from pyloader.transform import threads
    """) + inspect.getsource(fork_a_child) + textwrap.dedent(f"""
        threads.FORK_GATE_S = 5.0
        ds = pyloader.ShardDataset({shards!r})
        for b in pyloader.DataLoader(ds, batch_size=4, num_workers=2, executor="threads", transform=lambda s: s):
            pass  # a thread stream: the gate's hooks are registered now
        import pyloader.remote.cache  # what opening a remote dataset loads
        t0 = time.monotonic()
        ld = pyloader.DataLoader(ds, batch_size=4, num_workers=2, executor="threads", transform=fork_a_child)
        labels = [int(x) for _, b in zip(range(4), ld) for x in b["label"]]
        assert labels == list(range(16)), labels
        print(round(time.monotonic() - t0, 2))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    took = float(out.stdout.split()[-1])
    assert took < 5.0, f"16 forks from two transform threads took {took:.1f} s: forks waited for each other"
