"""Native constructors under a limit on threads (NOTE [thread start failure] in core/errors.h).

A forked child lowers ``RLIMIT_NPROC`` so that only some of a constructor's threads can start,
then checks that the constructor raises ThreadStartError (EAGAIN, naming the limit) instead
of ending the process in std::terminate, that the threads it started were joined, that the
pipeline's shard retains were undone, and that everything works again once the limit is
raised. RLIMIT_NPROC counts every task of the user and does not bind root (CAP_SYS_RESOURCE),
so a child running as root first becomes ``nobody`` (setgid/setuid 65534); the dataset is
written to a directory that user can read.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from native_util import run_in_forked_child, threads_now, wait_threads

import pyloader
from pyloader import _C

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")

NOBODY = 65534
FIELDS: dict[str, Any] = {"label": ("int64", ()), "tokens": ("int32", (None,))}
N = 64


# Imported here: the children switch to a user who may not read the modules' files.
_ = (pyloader.ShardDataset, pyloader.DataLoader)


def user_tasks(uid: int) -> int:
    """Tasks (threads) of ``uid`` on this machine: what RLIMIT_NPROC counts."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue  # it exited meanwhile
    return n


def settled_threads() -> int:
    """The thread count once it stopped changing for 0.1 s (exiting threads still count)."""
    n, since = threads_now(), time.monotonic()
    while time.monotonic() - since < 0.1:
        time.sleep(0.005)
        if (m := threads_now()) != n:
            n, since = m, time.monotonic()
    return n


def allow_more_threads(k: int) -> None:
    """Lets this process's user start exactly ``k`` more threads."""
    settled_threads()
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    soft = user_tasks(os.getuid()) + k
    resource.setrlimit(resource.RLIMIT_NPROC, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def no_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))


@pytest.fixture
def readable_dataset() -> Iterator[str]:
    root = tempfile.mkdtemp(prefix="pyloader-nproc-")
    path = os.path.join(root, "ds")
    with pyloader.ShardWriter(path, FIELDS, shard_bytes=512) as w:
        for i in range(N):
            w.write({"label": i, "tokens": np.arange(i % 7 + 1, dtype=np.int32)})
    for d, _, files in os.walk(root):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
    try:
        yield path
    finally:
        shutil.rmtree(root, ignore_errors=True)


def as_limited_user() -> None:
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def expect_thread_error(step: Callable[[str], None], what: str, fn: Callable[[], Any]) -> int:
    """0 if fn() raised ThreadStartError(EAGAIN) naming the limit, else a failure code."""
    try:
        fn()
    except pyloader.ThreadStartError as e:
        step(f"{what}: {e}")
        if e.errno != errno.EAGAIN or "RLIMIT_NPROC" not in str(e) or not isinstance(e, OSError):
            return 2
        return 0
    step(f"{what}: no error")
    return 1


def run_limited(dataset: str, name: str, fn: Callable[[Callable[[str], None]], int]) -> None:
    log = os.path.join(os.path.dirname(dataset), f"{name}.log")  # where the child's user may write
    with open(log, "w"):
        pass
    os.chmod(log, 0o666)
    child = run_in_forked_child(fn, log, timeout=60)
    assert child.code is not None, f"{name}: the child hung; its steps:\n{child.log}"
    assert child.code == 0, f"{name}: the child failed with exit code {child.code}; its steps:\n{child.log}"


@pytest.mark.timeout(120)
def test_pipeline_and_loader_that_cannot_start_their_threads(readable_dataset) -> None:
    def child(step: Callable[[str], None]) -> int:
        ds = pyloader.ShardDataset(readable_dataset, rank=0, world_size=1)
        shards = ds._shard_set()
        if sum(len(b["label"]) for b in ds.batches(8, num_threads=2)) != N:  # every shard mapped, now idle
            return 10
        as_limited_user()  # once the modules it needs are imported (their files may be root's alone)
        base = threads_now()
        for started in (0, 3):  # prefetch=1: the started workers wait for room, none leaves
            allow_more_threads(started)
            code = expect_thread_error(step, f"pipeline, {started} of 8 started",
                                       lambda: ds.batches(1, num_threads=8, prefetch=1))
            no_limit()
            if code:
                return 20 + code
            if wait_threads(base) > base:
                step(f"threads left: {threads_now()} (before: {base})")
                return 30
            counts = shards.counts()
            if counts["active"] != 0:
                step(f"retained shards left: {counts}")
                return 31
        allow_more_threads(2)
        loader = pyloader.DataLoader(ds, batch_size=8, num_workers=6)
        code = expect_thread_error(step, "DataLoader iter()", lambda: next(iter(loader)))
        no_limit()
        if code:
            return 40 + code
        step("the same loader once the limit is raised")
        if [int(x) for b in loader for x in b["label"]] != list(range(N)):
            return 50
        return 0

    run_limited(readable_dataset, "pipeline", child)


@pytest.mark.timeout(120)
def test_packer_copy_engine_and_prepare_that_cannot_start_their_threads(readable_dataset) -> None:
    def child(step: Callable[[str], None]) -> int:
        ds = pyloader.ShardDataset(readable_dataset, rank=0, world_size=1)
        ds.batches(8, num_threads=1, ragged=True).close()
        as_limited_user()
        base = threads_now()
        docs = ds.batches(8, num_threads=1, ragged=True)
        items = np.arange(N, dtype=np.int64)

        def packer() -> Any:
            return _C.Packer(docs=docs._pipeline, field=1, pool=_C.SlotPool(num_fields=4), pos=items,
                             start=np.zeros(N, np.int64), end=np.full(N, -1, np.int64), seq_len=16, rows=2)

        allow_more_threads(0)
        code = expect_thread_error(step, "packer", packer)
        no_limit()
        if code:
            return 10 + code
        docs.close()
        step("a packer once the limit is raised")
        docs = ds.batches(8, num_threads=1, ragged=True)
        p = packer()
        rows = 0
        while (b := p.next()) is not None:
            rows += int(b[1])
        p.close()
        if rows == 0:
            return 20
        for started in (0, 1):
            allow_more_threads(started)
            code = expect_thread_error(step, f"copy engine, {started} of 2 started",
                                       lambda: _C.CopyEngine(backend="cpu", staging=_C.SlotPool(num_fields=1)))
            no_limit()
            if code:
                return 30 + code
        if wait_threads(base) > base:
            step(f"threads left: {threads_now()} (before: {base})")
            return 40
        allow_more_threads(0)
        pool = _C.SlotPool(num_fields=1)
        pool.prepare(count=2, field_bytes=[4096])  # no thread: no prepared slots, and no error
        no_limit()
        if pool.preparing or pool.created != 0:
            return 50
        return 0

    run_limited(readable_dataset, "others", child)


@pytest.mark.timeout(120)
def test_a_transform_loader_that_cannot_start_its_threads(readable_dataset) -> None:
    def child(step: Callable[[str], None]) -> int:
        ds = pyloader.ShardDataset(readable_dataset, rank=0, world_size=1)
        # batch_size=1: more batches than the native stream reads ahead, so its threads stay.
        # executor="threads": all six start with the epoch ("auto" starts on its probe's one).
        loader = pyloader.DataLoader(ds, batch_size=1, num_workers=6, transform=lambda s: s, executor="threads")
        it = iter(loader)
        next(it)  # the transform modules imported, as the limited user may not read them
        it.close()
        as_limited_user()
        base = settled_threads()  # the closed epoch's threads gone (a finished one's are detached)
        allow_more_threads(3)  # the native stream's threads and one or two of the six transform threads
        step(f"{threads_now()} threads; RLIMIT_NPROC {resource.getrlimit(resource.RLIMIT_NPROC)}, "
             f"user tasks {user_tasks(os.getuid())}")
        try:
            next(iter(loader))
            step("no error")
            return 1
        except RuntimeError as e:  # threading's "can't start new thread", or ThreadStartError
            step(f"iter(): {type(e).__name__}: {e}")
        finally:
            no_limit()
        if wait_threads(base) > base:
            step(f"threads left: {threads_now()} (before: {base})")
            return 2
        if [int(x) for b in loader for x in b["label"]] != list(range(N)):
            return 3
        return 0

    run_limited(readable_dataset, "transform", child)
