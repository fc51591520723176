"""Lifetime of native threads, slots and batches: abandonment, reuse, GIL, fork, exit, errors.

Everything here runs the real engine on real shard files written by ``write_dataset``.
Thread counts come from /proc/self/task and memory from /proc/self/statm, so these tests
need Linux. Where a scenario needs ``next()`` to block for an unbounded time, a shard
file is replaced by a FIFO: opening it blocks like a stalled network mount would, until
the test opens the other end (the reader then sees an empty file and fails that batch).
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from native_util import run_in_forked_child, threads_now, wait_threads

import pyloader
from pyloader.format import spec as _format

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")

ROOT = Path(pyloader.__file__).resolve().parents[1]
IMG = 4096

# label, a fixed field whose bytes depend on the label, and a variable-length field.
FIELDS: dict[str, Any] = {
    "label": ("int64", ()),
    "img": ("uint8", (IMG,)),
    "tokens": ("int32", (None,)),
}
# Only fixed fields: torch's default_collate cannot stack variable-length rows.
FIXED_FIELDS: dict[str, Any] = {"label": ("int64", ()), "img": ("uint8", (IMG,))}
BIG = 150_000  # bytes per record for the "large dataset" tests
BIG_FIELDS: dict[str, Any] = {"label": ("int64", ()), "payload": ("uint8", (BIG,))}


def expected_img(i: int) -> np.ndarray:
    return ((np.arange(IMG, dtype=np.int64) * 7 + i) % 251).astype(np.uint8)


def sample(i: int) -> dict[str, Any]:
    return {"label": i, "img": expected_img(i), "tokens": np.arange(i, i + i % 7, dtype=np.int32)}


def fixed_sample(i: int) -> dict[str, Any]:
    return {"label": i, "img": expected_img(i)}


def big_sample(i: int) -> dict[str, Any]:
    return {"label": i, "payload": np.full(BIG, i % 256, np.uint8)}


def check_batch(batch: dict[str, torch.Tensor], labels: list[int]) -> None:
    """Asserts every field of ``batch`` holds exactly the samples ``labels`` (numpy only:
    torch ops could start torch's own thread pool and disturb thread counts)."""
    assert batch["label"].numpy().tolist() == labels
    img = batch["img"].numpy()
    assert img.shape == (len(labels), IMG)
    for row, i in enumerate(labels):
        assert np.array_equal(img[row], expected_img(i)), f"img of sample {i} (row {row}) is wrong"
    if "tokens" in batch:
        toks, lens = batch["tokens"].numpy(), batch["tokens_lengths"].numpy()
        for row, i in enumerate(labels):
            n = i % 7
            assert lens[row] == n
            assert toks[row, :n].tolist() == list(range(i, i + n))
            assert not toks[row, n:].any(), "variable-field padding must be zero"






def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_ds(path: str, **kw: Any) -> pyloader.ShardDataset:
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 1)
    return pyloader.ShardDataset(path, **kw)


def plan_labels(ds: pyloader.ShardDataset, **kw: Any) -> list[int]:
    """Global ids (== labels) that ``ds`` reads, from its plan."""
    sidx, ridx = ds.plan(**kw)
    offsets = np.cumsum(ds.records_per_shard) - np.asarray(ds.records_per_shard)
    return (offsets[sidx] + ridx).tolist()


def stall_shard(ds: pyloader.ShardDataset, shard: int) -> str:
    """Replaces shard ``shard`` with a FIFO: opening it blocks until ``unstall``."""
    p = ds.shard_paths[shard]
    os.unlink(p)
    os.mkfifo(p)
    return p


def unstall(fifo: str, timeout: float = 10.0) -> None:
    """Opens the FIFO's write end so a reader blocked in open() proceeds (and reads EOF)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            return
        except OSError:  # ENXIO: no reader has it open (yet)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def run_python(code: str, *args: str, timeout: float = 90.0,
               on_timeout: Callable[[], None] | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", code, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if on_timeout is not None:
            on_timeout()
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"subprocess did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_clean_exit(res: subprocess.CompletedProcess[str]) -> None:
    report = f"rc={res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    for bad in ("terminate called", "Segmentation fault", "Fatal Python error", "Aborted", "core dumped"):
        assert bad not in res.stderr, report
    assert res.returncode == 0, report






# --- abandonment --------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_abandoned_iterators_stop_threads_and_free_memory(write_dataset) -> None:
    path = write_dataset(400, FIELDS, sample, shard_bytes=256 << 10)
    ds = open_ds(path)

    def abandon_one(collect: bool = True) -> None:
        it = ds.batches(16, num_threads=4, prefetch=8)
        for batch in it:
            assert threads_now() >= base + 4, "the pipeline's worker threads should be running"
            check_batch(batch, list(range(16)))
            break
        del batch, it
        if collect:
            gc.collect()

    base = threads_now()
    abandon_one()  # warm-up: maps the shards, imports whatever numpy/torch load lazily
    gc.collect()
    base = wait_threads(base)
    rss_warm = 0
    for k in range(200):
        abandon_one(collect=k % 20 == 0)  # a full gc costs ~0.2 s with torch loaded
        n = wait_threads(base)
        assert n == base, f"round {k}: {n - base} native threads still alive after del + gc"
        if k == 19:
            rss_warm = rss_bytes()
    growth = rss_bytes() - rss_warm
    # Each round fills ~10 slots of 16 x 4 KiB images: a leak would add ~100 MiB here.
    assert growth < 32 << 20, f"RSS grew by {growth >> 20} MiB over 180 abandoned iterators"


@pytest.mark.timeout(120)
def test_close_mid_epoch_joins_threads_and_later_next_raises(write_dataset) -> None:
    ds = open_ds(write_dataset(200, FIELDS, sample))
    base = threads_now()
    it = ds.batches(8, num_threads=3, prefetch=6)
    check_batch(next(it), list(range(8)))
    assert threads_now() >= base + 3
    it.close()
    assert wait_threads(base) == base
    it.close()  # idempotent
    with pytest.raises(pyloader.LoaderStateError):
        next(it)


@pytest.mark.timeout(120)
def test_dataloader_abandoned_epoch_stops_threads(write_dataset) -> None:
    # BUG (pyloader/loader/dataloader.py, DataLoader.__iter__: ``self._active = it``): the loader
    # keeps a strong reference to the iterator it returned, so ``for b in loader: break``
    # followed by ``del``/gc.collect() leaves the epoch's native threads (and its prefetched
    # slots) alive until the loader is iterated again or deleted. torch's (non-persistent)
    # DataLoader shuts its workers down as soon as the abandoned iterator is collected.
    # Holding a weakref (stats() could keep just the counters) would fix it.
    ds = open_ds(write_dataset(200, FIELDS, sample))
    base = wait_threads(threads_now())
    loader = pyloader.DataLoader(ds, batch_size=8, num_workers=3)  # epoch 0 starts ahead (NOTE [first epoch ahead])
    _prepared(loader)  # its slots made (NOTE [prepared slots]): that thread is gone
    for batch in loader:
        check_batch(batch, list(range(8)))
        assert threads_now() >= base + 3
        break
    del batch
    gc.collect()
    n = wait_threads(base)
    assert n == base, f"{n - base} native threads of an abandoned pyloader.DataLoader epoch are still alive"


# --- slot reuse ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_slot_pool_is_reused_across_epochs_when_batches_are_dropped(write_dataset) -> None:
    n = 300
    ds = open_ds(write_dataset(n, FIELDS, sample))
    threads, prefetch = 3, 4
    loader = pyloader.DataLoader(ds, batch_size=8, num_workers=threads, prefetch=prefetch)
    pool = loader._pool
    created_after_first = None
    for epoch in range(6):
        seen = 0
        for k, batch in enumerate(loader):
            check_batch(batch, list(range(k * 8, min(n, (k + 1) * 8))))
            seen += 1
        del batch
        assert seen == len(loader) == -(-n // 8)
        if created_after_first is None:
            created_after_first = pool.created
        # The ring, the workers, the loop's batch, and the next epoch's first `threads`
        # batches (NOTE [epoch ahead]).
        assert pool.created <= threads + prefetch + 2 + threads, f"epoch {epoch}: pool grew to {pool.created} slots"
    assert created_after_first is not None and created_after_first >= 1
    gc.collect()
    loader._ahead[1].close()  # the next epoch's early pipeline returns its slots too
    assert pool.free == pool.created, "every slot returns to the pool once its batch is dropped"


@pytest.mark.timeout(120)
def test_kept_batches_stay_correct_and_the_pool_grows(write_dataset) -> None:
    n = 96
    ds = open_ds(write_dataset(n, FIELDS, sample))
    loader = pyloader.DataLoader(ds, batch_size=8, num_workers=3, shuffle=True, prefetch=3)
    pool = loader._pool
    order0 = plan_labels(ds, epoch=0, shuffle=True)
    order1 = plan_labels(ds, epoch=1, shuffle=True)
    assert order0 != order1
    kept0 = list(loader)  # epoch 0, every batch still referenced
    assert len(kept0) == len(loader) == n // 8
    assert pool.created >= len(kept0)
    kept1 = list(loader)  # epoch 1 must not write into epoch 0's buffers
    assert pool.created >= len(kept0) + len(kept1)
    for kept, order in ((kept0, order0), (kept1, order1)):
        for k, batch in enumerate(kept):
            check_batch(batch, order[k * 8:(k + 1) * 8])
    created = pool.created
    del kept0, kept1, kept, batch
    gc.collect()
    early = loader._ahead[1]  # epoch 2, started during epoch 1's tail (NOTE [epoch ahead])
    deadline = time.monotonic() + 10
    while early.counters()["batches"] < 3 and time.monotonic() < deadline:  # its 3 threads' batches
        time.sleep(0.01)
    assert early.counters()["batches"] == 3
    assert pool.free == created - 3
    for batch in loader:  # noqa: B007 - a third epoch takes slots from the free list only
        pass
    del batch
    assert pool.created == created


@pytest.mark.timeout(120)
def test_batch_outlives_iterator_loader_and_dataset(write_dataset) -> None:
    path = write_dataset(120, FIELDS, sample)
    ds = open_ds(path, shuffle=True, seed=3)
    expected = plan_labels(ds, epoch=0)
    loader = pyloader.DataLoader(ds, batch_size=8, num_workers=2)
    it = iter(loader)
    next(it)
    batch = next(it)  # mid-epoch: workers are still running and holding slots
    row_view = batch["img"][5]  # a view into the same slot
    label_view = batch["label"][2:4]
    del it, loader, ds
    gc.collect()
    shutil.rmtree(path)  # the files (and their mappings) are gone too
    # Churn the allocator so a freed slot would likely be reused and overwritten.
    other = open_ds(write_dataset(120, FIELDS, lambda i: sample(119 - i)))
    junk = [b for b in other.batches(8, num_threads=2)]
    check_batch(batch, expected[8:16])
    del batch
    gc.collect()
    assert np.array_equal(row_view.numpy(), expected_img(expected[13]))
    assert label_view.tolist() == expected[10:12]
    assert len(junk) == 15


def _prepared(loader: pyloader.DataLoader, timeout: float = 20.0) -> Any:
    """The loader's pool once its prepare() thread is done (NOTE [prepared slots])."""
    pool = loader._batch_pool
    assert pool is not None, "a pageable native loader makes its pool when built"
    deadline = time.monotonic() + timeout
    while pool.preparing and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not pool.preparing
    return pool


@pytest.mark.timeout(120)
def test_built_loader_prepares_its_first_epoch_slots(write_dataset) -> None:
    """The constructor starts making prefetch + 3 slots, fixed-shape buffers populated (NOTE
    [prepared slots]); a first epoch whose loop drops each batch then reads into them and
    makes none."""
    n, bs, threads, prefetch = 64, 8, 2, 3
    ds = open_ds(write_dataset(n, BIG_FIELDS, lambda i: {"label": i, "payload": np.full(BIG, i % 251, np.uint8)},
                               shard_bytes=4 << 20), shuffle=True, seed=2)
    loader = pyloader.DataLoader(ds, batch_size=bs, num_workers=threads, prefetch=prefetch)
    pool = _prepared(loader)
    # Free, or holding epoch 0's first batches, collated ahead (NOTE [first epoch ahead]).
    assert pool.created == prefetch + 3 and pool.free >= 3, (pool.created, pool.free)
    mem = pool.memory()
    # label (8 rows of int64: one page) and payload (8 x 150,000 bytes in whole pages), exact.
    assert mem["live_bytes"] == (prefetch + 3) * (4096 + -(-bs * BIG // 4096) * 4096), mem
    expected = plan_labels(ds, epoch=0)
    # Not enumerate(): its cached result tuple keeps the previous batch alive while it asks
    # for the next, so the loop would hold two slots at that moment, not one.
    k = 0
    for batch in loader:
        labels = expected[k * bs:(k + 1) * bs]
        assert batch["label"].numpy().tolist() == labels
        assert all(int(batch["payload"][i, 0]) == labels[i] % 251 for i in range(len(labels)))
        del batch
        k += 1
    assert k * bs == n
    assert pool.created == prefetch + 3
    assert pool.memory()["driver_frees"] == 0  # no prepared buffer was regrown


@pytest.mark.timeout(120)
def test_plain_loop_reads_into_the_prepared_slots_only(write_dataset) -> None:
    """A plain ``for batch in loader:`` loop -- its variable still holds the previous batch
    while it asks for the next, and the next epoch's first batches are made ahead (NOTE
    [epoch ahead]) -- reads epoch after epoch into the slots the constructor prepared (NOTE
    [prepared slots]): no slot is made, no batch memory populated, inside an epoch."""
    n, bs, threads, prefetch = 96, 8, 2, 3
    ds = open_ds(write_dataset(n, BIG_FIELDS, lambda i: {"label": i, "payload": np.full(BIG, i % 251, np.uint8)},
                               shard_bytes=4 << 20), shuffle=True, seed=3)
    loader = pyloader.DataLoader(ds, batch_size=bs, num_workers=threads, prefetch=prefetch)
    pool = _prepared(loader)
    prepared = pool.created
    seen = 0
    for _ in range(4):
        for batch in loader:
            seen += int(batch["label"].shape[0])
            time.sleep(0.002)  # a training step: the read-ahead fills up meanwhile
    assert seen == 4 * n
    assert pool.created == prepared == prefetch + 3, f"prepared {prepared} slots, the loop made {pool.created - prepared} more"


@pytest.mark.timeout(120)
def test_loader_dropped_or_forked_while_preparing_its_slots(write_dataset, tmp_path) -> None:
    """A loader dropped while its pool's prepare() thread runs joins that thread (stopped
    early); a child forked meanwhile has no such thread and drops its copy without joining."""
    path = write_dataset(16, BIG_FIELDS, lambda i: {"label": i, "payload": np.zeros(BIG, np.uint8)},
                         shard_bytes=4 << 20)
    base = threads_now()
    for _ in range(3):
        loader = pyloader.DataLoader(open_ds(path), batch_size=16, num_workers=4, prefetch=16)  # 19 x 2.3 MiB
        assert loader._batch_pool is not None
        del loader
        gc.collect()
    assert wait_threads(base) <= base, "a prepare() thread outlived its pool"

    loader = pyloader.DataLoader(open_ds(path), batch_size=16, num_workers=4, prefetch=16)

    def child(step: Callable[[str], None]) -> int:
        nonlocal loader
        step("forked")
        del loader
        gc.collect()
        step("dropped the loader")
        return 0

    forked = run_in_forked_child(child, str(tmp_path / "child.log"), timeout=30)
    assert forked.code == 0, f"child exit code {forked.code}; its steps:\n{forked.log}"
    pool = _prepared(loader)
    assert pool.created == 16 + 3
    labels = [int(x) for b in loader for x in b["label"]]
    assert labels == list(range(16))


@pytest.mark.timeout(60)
def test_loaders_that_prepare_no_slots_when_built(write_dataset) -> None:
    """Pinned pools are made at the first iter() (NOTE [lazy pinned pools]); transform and
    packing loaders collate into pools of their own; "auto" sizes memory against its budget."""
    path = write_dataset(32, FIXED_FIELDS, fixed_sample)
    ds = open_ds(path)
    cases = [dict(transform=lambda s: s), dict(num_workers="auto"), dict(batch_size=None)]
    for kw in cases:
        args: dict[str, Any] = {"batch_size": 4, "num_workers": 2, **kw}
        loader = pyloader.DataLoader(ds, **args)
        assert loader._batch_pool is None, kw
    plain = pyloader.DataLoader(ds, batch_size=4, num_workers=2)
    assert _prepared(plain).created == 2 * 2 + 3


# --- the GIL ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_gil_is_released_while_waiting_in_next(write_dataset) -> None:
    ds = open_ds(write_dataset(200, BIG_FIELDS, big_sample, compression="none", shard_bytes=4 << 20))
    counter = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            counter[0] += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        c0 = counter[0]
        time.sleep(0.3)  # sleep releases the GIL: the spinner's free-running rate
        base_rate = (counter[0] - c0) / 0.3
        in_next, ticks, epochs = 0.0, 0, 0
        deadline = time.monotonic() + 30
        while in_next < 0.5 and time.monotonic() < deadline:
            it = ds.batches(32, num_threads=1, prefetch=1, epoch=epochs)
            got: list[int] = []
            while True:
                c0, t0 = counter[0], time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                finally:
                    in_next += time.perf_counter() - t0
                    ticks += counter[0] - c0
                got += batch["label"].tolist()
                assert int(batch["payload"][-1, -1]) == got[-1] % 256
            assert got == list(range(200))
            epochs += 1
    finally:
        stop.set()
        t.join()
    assert in_next >= 0.2, f"only {in_next:.3f} s spent in next(): the test measured nothing"
    rate = ticks / in_next
    assert ticks > 1000 and rate > 0.2 * base_rate, (
        f"a Python thread advanced {ticks} times in {in_next:.2f} s inside next() "
        f"({rate:.0f}/s vs {base_rate:.0f}/s free-running): next() holds the GIL while waiting"
    )


@pytest.mark.timeout(60)
def test_close_from_another_thread_unblocks_a_stalled_next(write_dataset) -> None:
    ds = open_ds(write_dataset(60, FIELDS, sample, compression="none", shard_bytes=32 << 10))
    assert len(ds.shard_paths) >= 3
    fifo = stall_shard(ds, 1)
    per0 = ds.records_per_shard[0]
    it = ds.batches(per0, num_threads=1, prefetch=1)
    check_batch(next(it), list(range(per0)))  # batch 1 is now stuck opening the FIFO
    outcome: list[BaseException | str] = []

    def consume() -> None:
        try:
            next(it)
            outcome.append("returned a batch")
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            outcome.append(e)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    time.sleep(0.3)
    assert consumer.is_alive(), f"next() should block on the stalled shard: {outcome}"
    closer = threading.Thread(target=it.close, daemon=True)
    closer.start()
    consumer.join(5)
    try:
        assert not consumer.is_alive(), "next() stayed blocked after close() from another thread"
        assert isinstance(outcome[0], pyloader.LoaderStateError), outcome
    finally:
        unstall(fifo)  # the worker stuck in open() can now finish, so close() can join it
        closer.join(10)
    assert not closer.is_alive(), "close() did not return once the stalled read finished"
    with pytest.raises(pyloader.LoaderStateError):
        next(it)


_OPENAT = {"x86_64": "257", "aarch64": "56"}.get(platform.machine())  # openat's system call number


def _threads_in_openat() -> int:
    """This process's threads blocked in openat() (/proc/self/task/<tid>/syscall: the call's number first)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/syscall") as fh:
                n += fh.read().split(" ", 1)[0] == _OPENAT
        except OSError:  # the thread ended meanwhile
            pass
    return n


@pytest.mark.timeout(60)
def test_a_worker_waiting_for_another_workers_stalled_open_leaves_at_close(write_dataset) -> None:
    """See NOTE [one open per shard]: the second worker that needs a shard the first is opening waits
    for it, and sees close() within a slice, where both used to sit in open() of the stalled file."""
    if _OPENAT is None:
        pytest.skip(f"openat's system call number on {platform.machine()} is not listed here")
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/syscall") as fh:
            fh.read()
    except OSError as e:
        pytest.skip(f"a thread's system call cannot be read here: {e}")
    ds = open_ds(write_dataset(60, FIELDS, sample, compression="none", shard_bytes=32 << 10))
    per0, per1 = ds.records_per_shard[0], ds.records_per_shard[1]
    assert per0 == per1 and per0 % 2 == 0 and per0 >= 4
    fifo = stall_shard(ds, 1)
    base = threads_now()
    half = per0 // 2
    it = ds.batches(half, num_threads=2, prefetch=2)  # batches 0-1 in shard 0, 2-3 both in shard 1
    check_batch(next(it), list(range(half)))
    check_batch(next(it), list(range(half, per0)))
    # One worker now sits in open() of the FIFO (its thread's system call: openat), the other
    # waits for that open.
    deadline = time.monotonic() + 10
    while not _threads_in_openat() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads_in_openat() == 1
    assert threads_now() == base + 2
    closer = threading.Thread(target=it.close, daemon=True)
    closer.start()
    try:
        # The waiting worker leaves; the one in open() stays until the FIFO opens.
        assert wait_threads(base + 1 + 1, timeout=5.0) == base + 1 + 1  # + the closer thread
        assert closer.is_alive(), "close() returned while a worker was still in open()"
    finally:
        unstall(fifo)
        closer.join(10)
    assert not closer.is_alive(), "close() did not return once the stalled open finished"
    assert wait_threads(base) == base


@pytest.mark.timeout(60)
def test_a_batch_that_is_in_is_not_held_for_a_stalled_next_one(write_dataset) -> None:
    """See NOTE [paired wake-ups]: a consumer asleep until two batches are in still gets the first
    at once when the second cannot come (its shard's open is stalled)."""
    ds = open_ds(write_dataset(60, FIELDS, sample, compression="none", shard_bytes=32 << 10))
    per0 = ds.records_per_shard[0]
    fifo = stall_shard(ds, 1)
    try:
        for round_ in range(5):
            it = ds.batches(per0, num_threads=2, prefetch=2)  # batch 0: shard 0; batch 1: the FIFO
            t0 = time.monotonic()
            check_batch(next(it), list(range(per0)))
            took = time.monotonic() - t0
            assert took < 1.0, f"round {round_}: the first batch came after {took:.3f} s"
            closer = threading.Thread(target=it.close, daemon=True)
            closer.start()
            unstall(fifo)  # the worker in open() reads EOF: its batch fails, close() returns
            closer.join(10)
            assert not closer.is_alive()
            os.unlink(fifo)
            os.mkfifo(fifo)
    finally:
        with contextlib.suppress(OSError):
            unstall(fifo, timeout=0.5)


@pytest.mark.timeout(120)
def test_close_from_another_thread_during_iteration_never_deadlocks(write_dataset) -> None:
    ds = open_ds(write_dataset(200, BIG_FIELDS, big_sample, compression="none", shard_bytes=4 << 20))
    rng = random.Random(0)
    base = threads_now()
    for round_ in range(20):
        it = ds.batches(16, num_threads=2, prefetch=2)
        closer = threading.Timer(rng.uniform(0.0, 0.02), it.close)
        closer.start()
        got: list[int] = []
        ended: BaseException | None = None
        try:
            for batch in it:
                got += batch["label"].tolist()
        except pyloader.LoaderStateError as e:
            ended = e
        closer.join(10)
        assert not closer.is_alive(), f"round {round_}: close() deadlocked"
        # Batches delivered before the close are the plan's prefix, intact.
        assert got == list(range(len(got)))
        assert ended is not None or len(got) == 200
        assert wait_threads(base) == base


@pytest.mark.timeout(60)
def test_dropping_the_iterator_in_another_thread_while_next_waits(write_dataset) -> None:
    ds = open_ds(write_dataset(200, BIG_FIELDS, big_sample, compression="none", shard_bytes=4 << 20))
    base = threads_now()
    for _ in range(6):
        holder = [ds.batches(64, num_threads=1, prefetch=1)]
        it = holder[0]
        first = next(it)
        entering = threading.Event()

        def drop(holder: list[Any], entering: threading.Event) -> None:
            entering.wait(5)
            time.sleep(0.001)
            holder.clear()
            gc.collect()

        t = threading.Thread(target=drop, args=(holder, entering))
        t.start()
        entering.set()
        second = next(it)  # the call keeps the pipeline alive; it must still deliver
        t.join(10)
        assert not t.is_alive()
        assert first["label"].tolist() == list(range(64))
        assert second["label"].tolist() == list(range(64, 128))
        assert int(second["payload"][3, 100]) == 67
        del it, first, second
        gc.collect()
        assert wait_threads(base) == base


# --- fork ---------------------------------------------------------------------------------


def _child_after_fork(ds: pyloader.ShardDataset, inherited: dict[str, Any], loader: pyloader.DataLoader,
                      n: int, step: Callable[[str], None]) -> int:
    """Runs in the forked child; returns its exit code (0: all good, else the failed step).

    ``inherited`` holds the only references to the parent's iterator and batch."""
    it, first = inherited["it"], inherited["first"]
    step("a: next() on the parent's iterator")
    try:
        next(it)
        return 10
    except pyloader.LoaderStateError:
        pass
    step("a: the native pipeline of the parent's iterator")
    try:
        it._pipeline.next()
        return 11
    except pyloader.LoaderStateError:
        pass
    step("a: the batch taken before fork is intact in the child")
    check_batch(first, list(range(8)))
    step("b: a new iterator from the same dataset reads the whole epoch")
    got: list[int] = []
    for batch in ds.batches(8, num_threads=3, prefetch=4):
        labels = batch["label"].numpy().tolist()
        check_batch(batch, labels)
        got += labels
    if got != list(range(n)):
        return 12
    step("b: the parent's DataLoader (and its slot pool) can start a new epoch")
    got = []
    for batch in loader:
        got += batch["label"].numpy().tolist()
    if got != list(range(n)):
        return 13
    step("c: deleting the inherited iterator and batch")
    it.close()  # a no-op in the child, must not try to join the parent's threads
    pipeline = weakref.ref(it._pipeline)
    del it, first, batch
    inherited.clear()
    gc.collect()
    if pipeline() is not None:
        return 14  # the test itself still holds a reference: it checked nothing
    step("done")
    return 0


@pytest.mark.timeout(120)
def test_fork_while_native_threads_run(write_dataset, tmp_path) -> None:
    # BUG (csrc/core/batch_pipeline.cpp:53, ~BatchPipeline, and NOTE [pipeline shutdown] in
    # batch_pipeline.h): in a forked child, close() leaks the parent's threads, but the
    # destructor then destroys cv_work_/cv_ready_, on which the parent's workers were
    # waiting at fork time; glibc's pthread_cond_destroy waits for those waiters, which do
    # not exist in the child, so dropping an inherited iterator hangs forever in step (c)
    # (gdb: __pthread_cond_destroy <- BatchPipeline::~BatchPipeline <- pybind11 dealloc).
    # Reproduce: it = ds.batches(8, num_threads=3); next(it); os.fork(); in the child
    # ``del it``. The same hang hits a child that re-iterates a pyloader.DataLoader whose
    # active iterator it inherited (DataLoader.__iter__ drops it). In a child the whole
    # pipeline (condition variables included) must be leaked, not destroyed.
    n = 120
    ds = open_ds(write_dataset(n, FIELDS, sample))
    loader = pyloader.DataLoader(ds, batch_size=8, num_workers=2)
    loader_it = iter(loader)
    next(loader_it)  # the loader has a live epoch (and live threads) at fork time too
    # The threads the iterator below starts, by id: threads that end by themselves meanwhile
    # (the loader's slot-preparing thread, an earlier test's) do not change what is new.
    before = set(os.listdir("/proc/self/task"))
    inherited = {"it": ds.batches(8, num_threads=3, prefetch=4)}
    inherited["first"] = next(inherited["it"])
    started = set(os.listdir("/proc/self/task")) - before
    assert len(started) >= 3, f"the iterator started {len(started)} threads, not its 3 workers"
    child = run_in_forked_child(lambda step: _child_after_fork(ds, inherited, loader, n, step),
                                str(tmp_path / "child.log"), timeout=30)
    assert child.code is not None, f"forked child hung (killed after 30 s) in the last of its steps:\n{child.log}"
    assert child.code == 0, f"child failed with exit code {child.code}; its steps:\n{child.log}"
    # The parent's iterators are unaffected by the fork.
    check_batch(inherited["first"], list(range(8)))
    got = list(range(8))
    for batch in inherited["it"]:
        labels = batch["label"].tolist()
        check_batch(batch, labels)
        got += labels
    assert got == list(range(n))
    assert len(list(loader_it)) == len(loader) - 1


@pytest.mark.timeout(180)
def test_torch_fork_workers_after_native_iteration(write_dataset) -> None:
    n = 150
    ds = open_ds(write_dataset(n, FIXED_FIELDS, fixed_sample))
    assert [int(x) for b in ds.batches(16) for x in b["label"]] == list(range(n))
    live = ds.batches(10, num_threads=2, prefetch=2)
    check_batch(next(live), list(range(10)))  # native threads alive while torch forks
    dl = torch.utils.data.DataLoader(ds, batch_size=7, num_workers=2, multiprocessing_context="fork",
                                     timeout=60)
    seen: list[int] = []
    for batch in dl:
        labels = batch["label"].tolist()
        check_batch(batch, labels)
        seen += labels
    assert sorted(seen) == list(range(n)), "every sample exactly once across the two workers"
    rest = [int(x) for b in live for x in b["label"]]
    assert rest == list(range(10, n))


# --- interpreter exit and signals ---------------------------------------------------------

_EXIT_LIVE = r"""
import sys, pyloader
ds = pyloader.ShardDataset(sys.argv[1], rank=0, world_size=1)
it = ds.batches(8, num_threads=4, prefetch=8)
BATCH = next(it)
loader = pyloader.DataLoader(ds, batch_size=8, num_workers=3)
loader_it = iter(loader)
BATCH2 = next(loader_it)
cycle = [ds.batches(8, num_threads=2)]
cycle.append(cycle)  # only the cyclic GC (or nothing) will ever free this one
next(cycle[0])
assert BATCH["label"].tolist() == list(range(8))
print("exiting with live iterators", flush=True)
"""


@pytest.mark.timeout(120)
def test_interpreter_exit_with_live_iterators(write_dataset) -> None:
    path = write_dataset(400, BIG_FIELDS, big_sample, compression="none", shard_bytes=4 << 20)
    for _ in range(2):
        res = run_python(_EXIT_LIVE, path, timeout=60)
        assert_clean_exit(res)
        assert "exiting with live iterators" in res.stdout


_EXIT_DAEMON = r"""
import sys, threading, time, pyloader
ds = pyloader.ShardDataset(sys.argv[1], rank=0, world_size=1)
def loop():
    # The native iterator itself, not torch tensors: torch aborts on its own when a daemon
    # thread frees any tensor during interpreter exit (THPVariable_clear re-takes the GIL in
    # a noexcept destructor), so only pyloader's binding is under test here.
    while True:
        pipe = ds.batches(64, num_threads=1, prefetch=1)._pipeline
        while pipe.next() is not None:
            pass
threading.Thread(target=loop, daemon=True).start()
time.sleep(0.5)
print("main thread exits while a daemon thread is inside next()", flush=True)
"""


@pytest.mark.timeout(180)
def test_interpreter_exit_while_a_daemon_thread_waits_in_next(write_dataset) -> None:
    # NOTE [GIL at interpreter exit] in csrc/bindings/gil_release.h: a daemon thread inside
    # next() when the interpreter finalizes must neither abort the process (a forced unwind
    # through a noexcept destructor) nor hang it.
    path = write_dataset(400, BIG_FIELDS, big_sample, compression="none", shard_bytes=4 << 20)
    for _ in range(10):
        res = run_python(_EXIT_DAEMON, path, timeout=60)
        assert_clean_exit(res)


_SIGINT_IN_NEXT = r"""
import os, signal, sys, threading, time, pyloader
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C's default, even where SIGINT was ignored at start
path, how = sys.argv[1], sys.argv[2]
ds = pyloader.ShardDataset(path, rank=0, world_size=1)
fifo = ds.shard_paths[1]
os.unlink(fifo)
os.mkfifo(fifo)  # stalled storage: opening shard 1 blocks until someone writes
it = ds.batches(ds.records_per_shard[0], num_threads=1, prefetch=1)
first = next(it)
sent = []
def interrupt():
    time.sleep(0.5)
    sent.append(time.monotonic())
    if how == "raise_signal":
        signal.raise_signal(signal.SIGINT)
    else:
        os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
print("blocking in next()", flush=True)
try:
    next(it)
    print("next() returned instead of raising KeyboardInterrupt", flush=True)
    sys.exit(3)
except KeyboardInterrupt:
    print(f"KeyboardInterrupt after {time.monotonic() - sent[0]:.3f} s", flush=True)
# Storage recovers; the stuck worker sees an empty file and the iterator can be dropped.
os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
del it
print("clean", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raise_signal", "kill"])
def test_keyboard_interrupt_reaches_a_blocked_next(write_dataset, how: str) -> None:
    path = write_dataset(60, FIELDS, sample, compression="none", shard_bytes=32 << 10)
    fifo = os.path.join(path, "shard-000001.pyl")
    assert os.path.exists(fifo)
    # If the signal never arrives, open the FIFO's write end so the child can finish.
    res = run_python(_SIGINT_IN_NEXT, path, how, timeout=20,
                     on_timeout=lambda: unstall(fifo, timeout=1) if os.path.exists(fifo) else None)
    assert "KeyboardInterrupt after" in res.stdout, (
        f"Ctrl-C did not interrupt a blocked next()\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}")
    latency = float(res.stdout.split("KeyboardInterrupt after ")[1].split(" s")[0])
    assert latency < 2.0, f"KeyboardInterrupt took {latency:.2f} s to reach the user"
    assert_clean_exit(res)
    assert "clean" in res.stdout


_SIGINT_UNCAUGHT = r"""
import os, signal, sys, threading, time, pyloader
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C's default, even where SIGINT was ignored at start
ds = pyloader.ShardDataset(sys.argv[1], rank=0, world_size=1, shuffle=True)
def interrupt():
    time.sleep(1.0)
    print(f"SIGINT at {time.monotonic():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
epoch = 0
while True:  # until Ctrl-C, which nobody catches
    for batch in ds.batches(64, num_threads=2, prefetch=2, epoch=epoch):
        pass
    epoch += 1
"""


@pytest.mark.timeout(120)
def test_uncaught_keyboard_interrupt_during_iteration_exits_promptly(write_dataset) -> None:
    path = write_dataset(400, BIG_FIELDS, big_sample, compression="none", shard_bytes=4 << 20)
    res = run_python(_SIGINT_UNCAUGHT, path, timeout=60)
    ended = time.monotonic()  # CLOCK_MONOTONIC is system-wide: comparable with the child's
    report = f"rc={res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert "SIGINT at" in res.stdout, report
    sent = float(res.stdout.split("SIGINT at ")[1].split()[0])
    assert ended - sent < 5.0, f"the process took {ended - sent:.1f} s to die after Ctrl-C\n{report}"
    assert "KeyboardInterrupt" in res.stderr, report
    for bad in ("terminate called", "Segmentation fault", "Fatal Python error"):
        assert bad not in res.stderr, report
    # Python re-raises SIGINT after finalizing so the parent sees death by SIGINT.
    assert res.returncode in (-signal.SIGINT, 128 + signal.SIGINT), report


# --- an error inside one batch ------------------------------------------------------------


def corrupt_raw_payload(ds: pyloader.ShardDataset, global_id: int, field: str) -> tuple[str, int]:
    """Flips one payload byte of ``field`` of sample ``global_id``; returns (shard path, record)."""
    ends = np.cumsum(ds.records_per_shard)
    s = int(np.searchsorted(ends, global_id, side="right"))
    rec = global_id - int(ends[s] - ds.records_per_shard[s])
    f = [x.name for x in ds.fields].index(field)
    path = ds.shard_paths[s]
    with open(path, "r+b") as fh:
        header = fh.read(_format.HEADER_SIZE)
        vals = _format._HEADER.unpack_from(header)
        num_fields, index_off, payload_off = vals[4], vals[8], vals[10]
        fh.seek(index_off + (rec * num_fields + f) * _format.INDEX_ENTRY_SIZE)
        entry = np.frombuffer(fh.read(_format.INDEX_ENTRY_SIZE), dtype=_format.INDEX_DTYPE)[0]
        assert int(entry["codec"]) == _format.CODEC_RAW and int(entry["stored"]) > 0
        pos = payload_off + int(entry["offset"]) + int(entry["stored"]) // 2
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0xFF]))
    return path, rec


@pytest.mark.timeout(60)
def test_corrupt_record_in_third_batch(write_dataset) -> None:
    # version=2: corrupt_raw_payload finds the value through its index entry (every field has one).
    path = write_dataset(80, FIELDS, sample, compression="none", shard_bytes=16 << 10, version=2)
    ds = open_ds(path)
    bad_id = 2 * 8 + 3  # in batch index 2 (the third)
    shard, rec = corrupt_raw_payload(ds, bad_id, "img")
    ds = open_ds(path)
    base = threads_now()
    it = ds.batches(8, num_threads=3, prefetch=4)
    b0, b1 = next(it), next(it)
    with pytest.raises(pyloader.ShardCorruptError) as ei:
        next(it)
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.shard == shard and err.record == rec and err.field == "img"
    assert wait_threads(base) == base, "a failed batch ends the iteration and joins the workers"
    for _ in range(3):
        with pytest.raises((StopIteration, pyloader.LoaderStateError)):
            next(it)
    check_batch(b0, list(range(8)))
    check_batch(b1, list(range(8, 16)))
