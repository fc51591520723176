"""The copy engine (csrc/core/copy_engine.{h,cpp}): ring, ordering, slot lifetime, shutdown.

These tests run ``_C.CopyEngine(backend="cpu")`` in this process: copies land exactly, the
ring hands out tickets in order and rejects misuse, staged results outlive their sources,
and every slot (staging or a HostBatch's) returns to its pool -- never before its copies
completed (NOTE [copy ordering], NOTE [copy engine shutdown]). ``backend="cuda"`` and pinned
slot pools are tested against a stand-in driver by test_fake_driver.py, and against the real
one by tests/cuda on a GPU machine.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from native_util import FIELDS, IMG, expected_img, sample

import pyloader
from pyloader import _C

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux")

ROOT = Path(pyloader.__file__).resolve().parents[1]


def open_ds(path: str) -> pyloader.ShardDataset:
    return pyloader.ShardDataset(path, rank=0, world_size=1)


def rand_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def engine(depth: int = 2, pool: Any = None) -> tuple[Any, Any]:
    pool = pool if pool is not None else _C.SlotPool(num_fields=1)
    return _C.CopyEngine(backend="cpu", depth=depth, staging=pool), pool


def wait_until(cond: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def test_copies_land_exactly_and_nowhere_else() -> None:
    e, _ = engine()
    assert e.backend == "cpu" and e.depth == 2
    sizes = [1, 7, 64, 4095, 4096, 100_003]
    srcs = [rand_bytes(n, seed=n) for n in sizes]
    # Each destination sits inside a larger canary buffer: bytes around it must not change.
    pad = 37
    outs = [torch.full((n + 2 * pad,), 0xA5, dtype=torch.uint8) for n in sizes]
    segs = [(s.data_ptr(), o.data_ptr() + pad, s.nbytes) for s, o in zip(srcs, outs, strict=True)]
    t = e.submit(segs)
    assert e.take(t) is None, "a job without staging has no result"
    for s, o in zip(srcs, outs, strict=True):
        assert torch.equal(o[pad:-pad], s)
        assert bool((o[:pad] == 0xA5).all()) and bool((o[-pad:] == 0xA5).all()), "a copy wrote outside its segment"
    # Typed tensors through their data_ptr: the engine copies raw bytes.
    f = torch.linspace(-3, 3, 1001, dtype=torch.float64)
    g = torch.empty_like(f)
    t = e.submit([(f.data_ptr(), g.data_ptr(), f.nbytes)])
    e.take(t)
    assert torch.equal(f, g)
    e.close()


def test_staged_results_equal_sources_and_outlive_them() -> None:
    e, pool = engine(depth=2)
    sizes = [3, 64, 1000, 65_537]
    srcs = [rand_bytes(n, seed=100 + n) for n in sizes]
    keep = [s.clone() for s in srcs]
    t = e.submit([(s.data_ptr(), 0, s.nbytes) for s in srcs], stage=True)
    res = e.take(t)
    assert isinstance(res, list) and len(res) == len(sizes)
    views = [torch.from_dlpack(c) for c in res]
    del res
    for v, s, k in zip(views, srcs, keep, strict=True):
        assert v.dtype == torch.uint8 and v.shape == (k.numel(),)
        assert torch.equal(v, k)
        lo, hi = s.data_ptr(), s.data_ptr() + s.nbytes
        assert not lo <= v.data_ptr() < hi, "a staged result must be a copy, not a view of the source"
    # The caller owns the sources again after take(): overwrite and free them.
    for s in srcs:
        s.fill_(0)
    del srcs
    gc.collect()
    # Churn: later jobs must take other staging slots, not the one the views still use.
    for j in range(20):
        junk = rand_bytes(70_000, seed=j)
        e.take(e.submit([(junk.data_ptr(), 0, junk.nbytes)], stage=True))
    assert pool.created >= 2, "the held result must keep its slot out of the pool"
    e.close()
    del e
    gc.collect()
    for v, k in zip(views, keep, strict=True):
        assert torch.equal(v, k), "a staged result changed after its sources were freed and the engine closed"
    held = pool.created - pool.free
    assert held == 1, f"{held} staging slots out of the pool while one result is alive"
    del views, v
    gc.collect()
    assert pool.free == pool.created


def test_staged_job_with_destinations_copies_through_the_staging_slot() -> None:
    e, pool = engine()
    a, b = rand_bytes(5000, 1), rand_bytes(333, 2)
    out = torch.zeros(5000, dtype=torch.uint8)
    t = e.submit([(a.data_ptr(), out.data_ptr(), a.nbytes), (b.data_ptr(), 0, b.nbytes)], stage=True)
    res = e.take(t)
    assert res[0] is None, "a segment with a destination has no staged result"
    assert torch.equal(out, a)
    assert torch.equal(torch.from_dlpack(res[1]), b)
    c = e.counters()
    assert c["bytes"] == a.nbytes and c["staged_bytes"] == a.nbytes + b.nbytes
    del res
    e.close()
    assert pool.free == pool.created == 1


def test_tickets_are_consecutive() -> None:
    e, _ = engine(depth=3)
    src = rand_bytes(100, 0)
    dst = torch.empty_like(src)
    tickets = []
    for _ in range(3):
        tickets.append(e.submit([(src.data_ptr(), dst.data_ptr(), 100)]))
    for t in tickets:
        e.take(t)
    for _ in range(10):
        t = e.submit([(src.data_ptr(), dst.data_ptr(), 100)])
        tickets.append(t)
        e.take(t)
    assert tickets == list(range(13))
    e.close()


def test_take_out_of_order_is_rejected() -> None:
    e, _ = engine(depth=3)
    src = rand_bytes(64, 3)
    dsts = [torch.zeros(64, dtype=torch.uint8) for _ in range(3)]
    with pytest.raises(pyloader.LoaderStateError):
        e.take(0)  # nothing submitted
    t0, t1, t2 = (e.submit([(src.data_ptr(), d.data_ptr(), 64)]) for d in dsts)
    with pytest.raises(pyloader.LoaderStateError, match="out of order"):
        e.take(t1)
    with pytest.raises(pyloader.LoaderStateError):
        e.take(t2 + 1)  # never submitted
    e.take(t0)
    with pytest.raises(pyloader.LoaderStateError):
        e.take(t0)  # already taken
    e.take(t1)
    e.take(t2)
    assert all(torch.equal(d, src) for d in dsts)
    e.close()


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_more_than_depth_outstanding_is_rejected(depth: int) -> None:
    e, _ = engine(depth=depth)
    src = rand_bytes(64, 4)
    dst = torch.empty_like(src)
    seg = [(src.data_ptr(), dst.data_ptr(), 64)]
    tickets = [e.submit(seg) for _ in range(depth)]
    with pytest.raises(pyloader.LoaderStateError, match="outstanding"):
        e.submit(seg)
    e.take(tickets[0])
    assert e.submit(seg) == depth, "a rejected submit must not use up a ticket"
    with pytest.raises(pyloader.LoaderStateError):
        e.submit(seg)
    for t in range(1, depth + 1):
        e.take(t)
    e.close()


def test_use_after_close_raises_and_close_is_idempotent() -> None:
    e, _ = engine()
    src = rand_bytes(64, 5)
    dst = torch.empty_like(src)
    t = e.submit([(src.data_ptr(), dst.data_ptr(), 64)])
    e.close()
    with pytest.raises(pyloader.LoaderStateError, match="closed"):
        e.take(t)
    with pytest.raises(pyloader.LoaderStateError, match="closed"):
        e.submit([(src.data_ptr(), dst.data_ptr(), 64)])
    e.close()


def test_invalid_arguments() -> None:
    pool = _C.SlotPool(num_fields=1)
    with pytest.raises(ValueError):
        _C.CopyEngine(backend="tpu", staging=pool)
    with pytest.raises(ValueError):
        _C.CopyEngine(backend="cpu", depth=0, staging=pool)
    e, _ = engine(pool=pool)
    src = rand_bytes(8, 6)
    with pytest.raises(ValueError, match="stage=True"):
        e.submit([(src.data_ptr(), 0, 8)])  # no destination, no staging
    with pytest.raises(ValueError, match="null source"):
        e.submit([(0, src.data_ptr(), 8)])
    assert e.submit([(src.data_ptr(), 0, 8)], stage=True) == 0, "rejected submits must not use tickets"
    e.close()


def _close_in_thread(e: Any, timeout: float = 20.0) -> float:
    t0 = time.monotonic()
    th = threading.Thread(target=e.close, daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), f"close() hung for {timeout} s with jobs not taken"
    return time.monotonic() - t0


@pytest.mark.parametrize("depth", [1, 3])
def test_close_with_jobs_not_taken_releases_every_staging_slot(depth: int) -> None:
    e, pool = engine(depth=depth)
    srcs = [rand_bytes(50_000, seed=k) for k in range(depth)]
    for s in srcs:
        e.submit([(s.data_ptr(), 0, s.nbytes)], stage=True)
    assert wait_until(lambda: e.counters()["jobs"] == depth)
    assert pool.created >= 1
    assert _close_in_thread(e) < 10
    assert pool.free == pool.created, f"{pool.created - pool.free} staging slots lost by close()"


def test_close_with_some_results_held() -> None:
    e, pool = engine(depth=3)
    srcs = [rand_bytes(20_000, seed=k) for k in range(3)]
    tickets = [e.submit([(s.data_ptr(), 0, s.nbytes)], stage=True) for s in srcs]
    held = torch.from_dlpack(e.take(tickets[0])[0])
    _close_in_thread(e)
    assert pool.created - pool.free == 1, "only the slot of the held result may stay out of the pool"
    assert torch.equal(held, srcs[0])
    del held
    gc.collect()
    assert pool.free == pool.created


def test_zero_byte_segments_and_empty_jobs() -> None:
    e, pool = engine(depth=2)
    a = rand_bytes(100, 7)
    out = torch.zeros(100, dtype=torch.uint8)
    empty = torch.empty(0, dtype=torch.uint8)
    # Zero-byte segments between real ones, with null pointers where no byte is read.
    t = e.submit([(0, out.data_ptr(), 0), (a.data_ptr(), out.data_ptr(), 100), (a.data_ptr(), out.data_ptr(), 0)])
    assert e.take(t) is None
    assert torch.equal(out, a)
    t = e.submit([(0, 0, 0), (a.data_ptr(), 0, 100), (empty.data_ptr(), 0, 0)], stage=True)
    res = e.take(t)
    parts = [torch.from_dlpack(c) for c in res]
    assert [p.numel() for p in parts] == [0, 100, 0]
    assert torch.equal(parts[1], a)
    t = e.submit([], stage=True)  # a job with no segments at all
    assert e.take(t) == []
    t = e.submit([])
    assert e.take(t) is None
    t = e.submit([(0, 0, 0)], stage=True)  # only an empty segment
    assert torch.from_dlpack(e.take(t)[0]).numel() == 0
    c = e.counters()
    assert c["jobs"] == 5 and c["bytes"] == 100 and c["staged_bytes"] == 100
    del res, parts
    e.close()
    assert pool.free == pool.created


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_many_pipelined_jobs_are_byte_exact(depth: int) -> None:
    rng = np.random.default_rng(depth)
    e, pool = engine(depth=depth)
    data = rand_bytes(1 << 18, seed=depth)
    pending: list[tuple[int, list[tuple[int, int, int, bool]], torch.Tensor]] = []
    total = staged_total = 0
    checked = 0

    def check(entry: tuple[int, list[tuple[int, int, int, bool]], torch.Tensor]) -> None:
        ticket, plan, out = entry
        res = e.take(ticket)
        for k, (off, n, dst_off, direct) in enumerate(plan):
            want = data[off:off + n]
            if direct:
                assert torch.equal(out[dst_off:dst_off + n], want), f"job {ticket} segment {k}"
            else:
                assert torch.equal(torch.from_dlpack(res[k]), want), f"job {ticket} staged segment {k}"

    for j in range(120):
        stage = bool(j % 3)
        plan = []
        out = torch.zeros(1 << 16, dtype=torch.uint8)
        dst_off = 0
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(0, 8000))
            off = int(rng.integers(0, data.numel() - n))
            direct = not stage or bool(rng.integers(0, 2))
            plan.append((off, n, dst_off, direct))
            total += n if direct else 0
            staged_total += n if stage else 0
            dst_off += n
        segs = [(data.data_ptr() + off, out.data_ptr() + d if direct else 0, n) for off, n, d, direct in plan]
        ticket = e.submit(segs, stage=stage)
        assert ticket == j
        pending.append((ticket, plan, out))
        if len(pending) == depth:
            check(pending.pop(0))
            checked += 1
    while pending:
        check(pending.pop(0))
        checked += 1
    assert checked == 120
    c = e.counters()
    assert c["jobs"] == 120 and c["bytes"] == total and c["staged_bytes"] == staged_total
    e.close()
    gc.collect()
    assert pool.free == pool.created


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_staging_slots_are_reused_in_the_steady_state(depth: int) -> None:
    e, pool = engine(depth=depth)
    srcs = [rand_bytes(3000 + k, seed=k) for k in range(8)]
    outstanding: list[tuple[int, torch.Tensor]] = []
    for j in range(200):
        s = srcs[j % len(srcs)]
        outstanding.append((e.submit([(s.data_ptr(), 0, s.nbytes)], stage=True), s))
        if len(outstanding) == depth:
            t, want = outstanding.pop(0)
            got = torch.from_dlpack(e.take(t)[0])
            assert torch.equal(got, want)
            del got  # the caller drops each result after use
        assert pool.created <= depth + 1, f"job {j}: {pool.created} staging slots for depth {depth}"
    for t, want in outstanding:
        assert torch.equal(torch.from_dlpack(e.take(t)[0]), want)
    e.close()
    assert pool.free == pool.created <= depth + 1


def test_counters_add_up() -> None:
    e, _ = engine(depth=2)
    a, b = rand_bytes(1000, 1), rand_bytes(24, 2)
    out = torch.empty(1024, dtype=torch.uint8)
    e.take(e.submit([(a.data_ptr(), out.data_ptr(), 1000), (b.data_ptr(), out.data_ptr() + 1000, 24)]))
    e.take(e.submit([(a.data_ptr(), 0, 1000)], stage=True))
    e.take(e.submit([(a.data_ptr(), out.data_ptr(), 500), (b.data_ptr(), 0, 24)], stage=True))
    c = e.counters()
    assert c["jobs"] == 3
    assert c["bytes"] == 1000 + 24 + 500, "bytes: what reached a destination"
    assert c["staged_bytes"] == 1000 + 500 + 24, "staged_bytes: what was packed into staging slots"
    for k in ("issue_ns", "complete_ns", "take_wait_ns", "submit_wait_ns"):
        assert c[k] >= 0
    e.close()
    assert e.counters()["jobs"] == 3


@pytest.mark.skipif(_C.cuda_driver_error() is None, reason="a CUDA driver is present")
def test_cuda_backend_without_a_driver_raises_device_error() -> None:
    from pyloader.errors import DeviceError

    with pytest.raises(DeviceError, match="libcuda.so.1") as ei:
        _C.CopyEngine(backend="cuda", staging=_C.SlotPool(num_fields=1))
    assert isinstance(ei.value, RuntimeError)
    with pytest.raises(DeviceError):
        _C.SlotPool(num_fields=1, pinned=True)


def test_device_error_is_exported() -> None:
    # The copy engine's errors are documented as pyloader.LoaderStateError,
    # pyloader.LoaderTimeoutError and pyloader.DeviceError: a caller must be able to catch each.
    from pyloader.errors import DeviceError

    assert getattr(pyloader, "DeviceError", None) is DeviceError, "pyloader.DeviceError is not exported"
    assert "DeviceError" in pyloader.__all__


_BAD_STAGING = r"""
import sys
import numpy as np
from pyloader import _C  # without torch: a quick start
which = sys.argv[1]
staging = None if which == "none" else _C.SlotPool(num_fields=0)
src = np.arange(100, dtype=np.uint8)
try:
    e = _C.CopyEngine(backend="cpu", staging=staging)
    e.take(e.submit([(src.ctypes.data, 0, 100)], stage=True))
except (ValueError, TypeError) as ex:
    print("REJECTED", type(ex).__name__, ex, flush=True)
else:
    print("ACCEPTED", flush=True)
"""


@pytest.mark.parametrize("which", ["none", "no-fields"])
def test_a_staging_pool_without_buffers_is_rejected(which: str) -> None:
    # Validation raises, never crashes: a staged job needs the staging pool's first buffer.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _BAD_STAGING, which], env=env,
                         capture_output=True, text=True, timeout=60)
    report = f"rc={res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-3000:]}"
    assert res.returncode == 0, f"CopyEngine(staging={which}) crashed the process on a staged job\n{report}"
    assert "REJECTED" in res.stdout, report


# --- HostBatch sources (See NOTE [copy ordering]: the slot returns only after its copies) ----------


def _one_host_batch(ds: pyloader.ShardDataset, pool: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """A HostBatch of the first 8 records, with the pipeline closed: afterwards only this
    batch's slot is out of ``pool``."""
    it = ds.batches(8, num_threads=1, prefetch=1, pool=pool)
    host, tensors = it.next_host()
    it.close()
    del it
    gc.collect()
    assert pool.created - pool.free == 1
    return host, tensors


def test_host_batch_slot_is_held_until_its_copies_completed(write_dataset) -> None:
    ds = open_ds(write_dataset(64, FIELDS, sample))
    pool = _C.SlotPool(num_fields=2)
    e, _ = engine(depth=2)
    # A large job ahead of ours keeps the engine thread busy: while the engine has not
    # finished it, our job cannot have completed, so its slot must still be out of the pool.
    big = torch.ones(24 << 20, dtype=torch.uint8)
    big_out = torch.empty_like(big)
    conclusive = 0
    for _ in range(6):
        host, tensors = _one_host_batch(ds, pool)
        outs = {k: torch.empty_like(v) for k, v in tensors.items()}
        segs = [(v.data_ptr(), outs[k].data_ptr(), v.nbytes) for k, v in tensors.items()]
        jobs0 = e.counters()["jobs"]
        t_big = e.submit([(big.data_ptr(), big_out.data_ptr(), big.nbytes)])
        t = e.submit(segs, source=host)
        del host, tensors  # the engine's reference is the only one left
        free_now = pool.free
        if e.counters()["jobs"] == jobs0:  # the big job was not even issued when we looked
            conclusive += 1
            assert free_now == pool.created - 1, "the HostBatch's slot returned before its copies completed"
        e.take(t_big)
        e.take(t)
        assert wait_until(lambda: pool.free == pool.created), "the slot never returned after completion"
        assert outs["label"].tolist() == list(range(8))
        for r in range(8):
            assert np.array_equal(outs["img"][r].numpy(), expected_img(r))
    assert conclusive >= 1, "the engine always finished a 24 MiB copy before the next Python line ran"
    e.close()


def test_host_batch_of_a_job_never_taken_returns_at_close(write_dataset) -> None:
    ds = open_ds(write_dataset(32, FIELDS, sample))
    pool = _C.SlotPool(num_fields=2)
    e, staging = engine(depth=2)
    host, tensors = _one_host_batch(ds, pool)
    outs = {k: torch.empty_like(v) for k, v in tensors.items()}
    e.submit([(v.data_ptr(), outs[k].data_ptr(), v.nbytes) for k, v in tensors.items()], source=host)
    # Staged from the slot as well: the staging slot is the result, held by the ring until close.
    e.submit([(tensors["img"].data_ptr(), 0, tensors["img"].nbytes)], source=host, stage=True)
    del host, tensors
    gc.collect()
    _close_in_thread(e)
    assert pool.free == pool.created, "close() must release a HostBatch whose job was never taken"
    assert staging.free == staging.created
    assert outs["label"].tolist() == list(range(8))


def test_host_batch_of_a_staged_job_and_its_result(write_dataset) -> None:
    ds = open_ds(write_dataset(32, FIELDS, sample))
    pool = _C.SlotPool(num_fields=2)
    e, staging = engine(depth=2)
    host, tensors = _one_host_batch(ds, pool)
    img = tensors["img"]
    t = e.submit([(img.data_ptr(), 0, img.nbytes)], source=host, stage=True)
    del host, tensors, img
    gc.collect()
    res = torch.from_dlpack(e.take(t)[0]).reshape(8, IMG)
    # The batch slot returns once the copies completed; the staging slot is the result.
    assert wait_until(lambda: pool.free == pool.created)
    assert staging.created - staging.free == 1
    for r in range(8):
        assert np.array_equal(res[r].numpy(), expected_img(r))
    del res
    gc.collect()
    assert staging.free == staging.created
    e.close()


def test_dataloader_device_cpu_returns_slots_after_each_copy(write_dataset) -> None:
    n = 160
    ds = open_ds(write_dataset(n, FIELDS, sample))
    loader = pyloader.DataLoader(ds, batch_size=8, num_workers=2, device="cpu", device_prefetch=3, prefetch=2)
    kept = list(loader)  # every batch kept: they are copies, so the slots must still return
    assert len(kept) == n // 8
    labels = [int(x) for b in kept for x in b["label"]]
    assert labels == list(range(n))
    for b in kept[::5]:
        for r, i in enumerate(b["label"].tolist()):
            assert np.array_equal(b["img"][r].numpy(), expected_img(i))
    pool = loader._pool
    # The ring, the workers, the device queue, the loop, and the next epoch's first batches
    # (See NOTE [epoch ahead]: at most num_workers of them, held in that pipeline's ring).
    assert pool.created <= 2 + 2 + 3 + 2 + 2, f"{pool.created} slots for a bounded pipeline"
    assert loader._ahead is not None
    early = loader._ahead[1]
    assert wait_until(lambda: early.counters()["batches"] == 2)
    assert wait_until(lambda: pool.free == pool.created - 2), "a kept device='cpu' batch holds a slot"
    early.close()
    assert pool.free == pool.created


def test_dataloader_copy_counters_of_the_current_and_last_epoch(write_dataset) -> None:
    n = 64
    ds = open_ds(write_dataset(n, FIELDS, sample))
    loader = pyloader.DataLoader(ds, batch_size=8, device="cpu")
    it = iter(loader)
    for _ in range(n // 8):
        next(it)
    live = loader.stats()  # the epoch's iterator is alive
    assert live["copy"]["backend"] == "cpu" and live["copy"]["jobs"] == n // 8
    assert live["copy"]["bytes"] == n * (8 + IMG)
    with pytest.raises(StopIteration):
        next(it)
    del it
    gc.collect()
    # DataLoader.stats(): "counters of the current (or last) epoch ... with a copy engine,
    # its counters under 'copy'".
    last = loader.stats()
    assert "copy" in last, f"the last epoch's copy counters are gone once its iterator is: {sorted(last)}"
    assert last["copy"]["jobs"] == n // 8 and last["copy"]["bytes"] == n * (8 + IMG)
