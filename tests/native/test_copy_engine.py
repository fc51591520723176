"""The copy engine (csrc/core/copy_engine.{h,cpp}): ring, ordering, slot lifetime, shutdown.

Part one runs ``_C.CopyEngine(backend="cpu")`` in this process: copies land exactly, the
ring hands out tickets in order and rejects misuse, staged results outlive their sources,
and every slot (staging or a HostBatch's) returns to its pool -- never before its copies
completed (NOTE [copy ordering], NOTE [copy engine shutdown]).

Part two runs ``backend="cuda"`` and pinned slot pools against a stand-in ``libcuda.so.1``
(tests/native/fake_cuda/fake_cuda.c, compiled here with the system C compiler) in
subprocesses whose ``LD_LIBRARY_PATH`` points at it. The stand-in checks the call protocol
on the CPU: contexts per thread, live allocations, asynchronous streams and events. It is
no GPU: the real driver is exercised by tests/cuda on a GPU machine.
"""

from __future__ import annotations

import gc
import importlib.util
import json
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

import pyloader
from pyloader import _C
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux")

ROOT = Path(pyloader.__file__).resolve().parents[1]
FAKE_DIR = Path(__file__).resolve().parent / "fake_cuda"
IMG = 512
FIELDS: dict[str, Any] = {"label": ("int64", ()), "img": ("uint8", (IMG,))}


def expected_img(i: int) -> np.ndarray:
    return ((np.arange(IMG, dtype=np.int64) * 13 + i) % 251).astype(np.uint8)


def sample(i: int) -> dict[str, Any]:
    return {"label": i, "img": expected_img(i)}


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


# =========================================================================================
# Part one: the CPU backend
# =========================================================================================


def test_copies_land_exactly_and_nowhere_else() -> None:
    e, _ = engine()
    assert e.backend == "cpu" and e.depth == 2
    sizes = [1, 7, 64, 4095, 4096, 100_003]
    srcs = [rand_bytes(n, seed=n) for n in sizes]
    # Each destination sits inside a larger canary buffer: bytes around it must not change.
    pad = 37
    outs = [torch.full((n + 2 * pad,), 0xA5, dtype=torch.uint8) for n in sizes]
    segs = [(s.data_ptr(), o.data_ptr() + pad, s.nbytes) for s, o in zip(srcs, outs)]
    t = e.submit(segs)
    assert e.take(t) is None, "a job without staging has no result"
    for s, o in zip(srcs, outs):
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
    for v, s, k in zip(views, srcs, keep):
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
    for v, k in zip(views, keep):
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


# --- HostBatch sources (NOTE [copy ordering]: the slot returns only after its copies) ----------


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
    assert pool.created <= 2 + 2 + 3 + 2, f"{pool.created} slots for a bounded pipeline"
    assert wait_until(lambda: pool.free == pool.created), "a kept device='cpu' batch holds a slot"


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


# =========================================================================================
# Part two: backend="cuda" and pinned memory against the stand-in driver
# =========================================================================================


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory) -> str:
    """The directory holding the stand-in libcuda.so.1 (built once per module)."""
    spec = importlib.util.spec_from_file_location("fake_cuda_build", FAKE_DIR / "build.py")
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    if builder.compiler() is None:
        pytest.skip("no C compiler to build the stand-in CUDA driver")
    out = tmp_path_factory.mktemp("fake_cuda")
    builder.build(str(out))
    return str(out)


# Shared by every script: the stand-in's hooks and a few helpers.
PRELUDE = r"""
import ctypes, gc, json, os, sys, time, warnings
import numpy as np, torch, pyloader
from pyloader import _C
warnings.simplefilter("error")
assert _C.cuda_driver_error() is None, _C.cuda_driver_error()
FAKE = ctypes.CDLL("libcuda.so.1")
FAKE.fake_cuda_stats.restype = ctypes.c_char_p
FAKE.fake_cuda_is_pinned.argtypes = [ctypes.c_void_p]
FAKE.fake_cuda_pending.restype = ctypes.c_long
FAKE.fake_cuda_set_copy_delay_us.argtypes = [ctypes.c_long]
FAKE.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
FAKE.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
FAKE.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
IMG = %(img)d

def stats():
    return json.loads(FAKE.fake_cuda_stats())

def pinned(t):
    return FAKE.fake_cuda_is_pinned(ctypes.c_void_p(t.data_ptr())) == 1

def depth0(where):
    assert FAKE.fake_cuda_ctx_depth() == 0, f"{where}: the consumer thread was left with a context pushed"

class Ctx:
    # The test's own calls on stream 0 need a current context, like anyone's.
    def __enter__(self):
        ctx = ctypes.c_void_p()
        assert FAKE.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert FAKE.cuCtxPushCurrent_v2(ctx) == 0
    def __exit__(self, *a):
        assert FAKE.cuCtxPopCurrent_v2(None) == 0
        assert FAKE.cuDevicePrimaryCtxRelease_v2(0) == 0

def sync_default_stream():
    # The consumer's "final wait": synchronise stream 0 only. take() ordered stream 0 after
    # the job's copies, so they must have completed too.
    with Ctx():
        assert FAKE.cuStreamSynchronize(None) == 0

def expected_img(i):
    return ((np.arange(IMG, dtype=np.int64) * 13 + i) %% 251).astype(np.uint8)

def check_clean(s, allocs_live=0):
    bad = {k: s[k] for k in ("no_ctx_calls", "bad_pops", "bad_frees", "bad_releases", "free_while_pending",
                             "copies_from_freed", "queued_from_freed", "bad_handles") if s[k]}
    assert not bad and not s["errors"], f"driver protocol violations: {bad} {s['errors']}"
    assert s["allocs_live"] == allocs_live, f"{s['allocs_live']} pinned allocations live, expected {allocs_live}"

def report(**kw):
    print("REPORT " + json.dumps(kw), flush=True)
"""


def run_fake(fake_dir: str, body: str, *args: str, timeout: float = 90.0, log: str | None = None,
             delay_us: int = 300) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Runs PRELUDE + body in a fresh interpreter that loads the stand-in driver; returns the
    process and the last ``report(...)`` it printed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join([fake_dir, env.get("LD_LIBRARY_PATH", "")])
    env["FAKE_CUDA_COPY_DELAY_US"] = str(delay_us)
    if log is not None:
        env["FAKE_CUDA_LOG"] = log
    code = PRELUDE % {"img": IMG} + body
    try:
        res = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, *args], env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the stand-in driver script hung ({timeout} s)\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    text = f"rc={res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.returncode == 0, text
    for bad in ("terminate called", "Segmentation fault", "Fatal Python error", "Aborted"):
        assert bad not in res.stderr, text
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("REPORT ")]
    assert lines, text
    return res, json.loads(lines[-1][len("REPORT "):])


def write_fields_dataset(write_dataset, n: int) -> str:
    return write_dataset(n, FIELDS, sample)


_DRIVER_AND_PINNED_POOL = r"""
s0 = stats()
assert s0["inits"] == 1 and s0["init_pid"] == os.getpid()
ds = pyloader.ShardDataset(sys.argv[1], rank=0, world_size=1)
pool = _C.SlotPool(num_fields=2, pinned=True)
assert pool.pinned
assert stats()["allocs"] == 0, "a pool allocates on first use only"
got = []
it = ds.batches(8, num_threads=2, prefetch=3, pool=pool)
for b in it:
    assert pinned(b["label"]) and pinned(b["img"]), "a pinned pool's batch is not in cuMemHostAlloc memory"
    for r, i in enumerate(b["label"].tolist()):
        assert np.array_equal(b["img"][r].numpy(), expected_img(i))
    got += b["label"].tolist()
    depth0("iteration")
assert got == list(range(len(got))) and len(got) == 96
del b, it
gc.collect()
s1 = stats()
assert s1["allocs"] > 0 and s1["allocs_live"] > 0
assert pool.free == pool.created
del pool
gc.collect()
s2 = stats()
check_clean(s2, allocs_live=0)
assert s2["frees"] == s2["allocs"]
assert s2["retained"] == 0, "the pinned allocator did not release the primary context"
from pyloader.errors import DeviceError
for make in (lambda: _C.SlotPool(num_fields=1, pinned=True, device=1),
             lambda: _C.CopyEngine(backend="cuda", device=1, staging=_C.SlotPool(num_fields=1))):
    try:
        make()
        raise AssertionError("device 1 of a one-device driver was accepted")
    except DeviceError as ex:
        assert "CUDA_ERROR_INVALID_DEVICE" in str(ex), str(ex)
s2 = stats()
check_clean(s2, allocs_live=0)
assert s2["retained"] == 0
depth0("end")
report(allocs=s2["allocs"], frees=s2["frees"], pushes=s2["pushes"], pops=s2["pops"])
"""


def test_fake_driver_pinned_slot_pool_allocates_and_frees(fake_cuda, write_dataset) -> None:
    path = write_fields_dataset(write_dataset, 96)
    _, rep = run_fake(fake_cuda, _DRIVER_AND_PINNED_POOL, path)
    assert rep["allocs"] >= 2 and rep["frees"] == rep["allocs"]
    # Every allocation and free pushed and popped the context on whichever thread ran it.
    assert rep["pushes"] == rep["pops"] >= rep["allocs"] + rep["frees"]


_PINNED_DATALOADER = r"""
path = sys.argv[1]
ds = pyloader.ShardDataset(path, rank=0, world_size=1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    plain = [b for b in pyloader.DataLoader(ds, batch_size=8, num_workers=2)]
    loader = pyloader.DataLoader(ds, batch_size=8, num_workers=2, pin_memory=True)
    batches = list(loader)
assert not caught, [str(w.message) for w in caught]
assert loader._pool.pinned, "pin_memory=True with a driver must give a pinned pool"
assert len(batches) == len(plain) == 12
for a, b in zip(plain, batches):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
        assert pinned(b[k]), f"field {k} of a pin_memory batch is not in the driver's pinned memory"
        assert not pinned(a[k])
depth0("pinned DataLoader")

# collate_fn and a map-style dataset: staged by the copy engine into a pinned staging pool.
def collate(samples):
    return {"label": torch.stack([s["label"] for s in samples]), "img": torch.stack([s["img"] for s in samples])}
coll = list(pyloader.DataLoader(ds, batch_size=8, collate_fn=collate, pin_memory=True))
assert [int(x) for b in coll for x in b["label"]] == list(range(96))
assert all(pinned(b["img"]) and pinned(b["label"]) for b in coll), "collate_fn results were not staged into pinned memory"

class Squares(torch.utils.data.Dataset):
    def __len__(self): return 40
    def __getitem__(self, i): return torch.full((16,), i * i, dtype=torch.int64)
mapped = list(pyloader.DataLoader(Squares(), batch_size=5, pin_memory=True))
assert all(pinned(b) for b in mapped)
assert [int(b[j, 0]) for b in mapped for j in range(5)] == [i * i for i in range(40)]
depth0("staged")
live = stats()["allocs_live"]
assert live > 0
del plain, batches, loader, coll, mapped, a, b
gc.collect()
s = stats()
check_clean(s, allocs_live=0)
assert s["retained"] == 0
report(allocs=s["allocs"], live_before=live)
"""


def test_fake_driver_pinned_dataloader_gives_identical_batches(fake_cuda, write_dataset) -> None:
    path = write_fields_dataset(write_dataset, 96)
    _, rep = run_fake(fake_cuda, _PINNED_DATALOADER, path)
    assert rep["allocs"] > 0 and rep["live_before"] > 0


_CUDA_ENGINE_EXACT = r"""
s0 = stats()
rng = np.random.default_rng(0)
data = torch.from_numpy(rng.integers(0, 256, 1 << 17, dtype=np.uint8))
for depth in (1, 2, 3):
    staging = _C.SlotPool(num_fields=1, pinned=True)
    e = _C.CopyEngine(backend="cuda", device=0, depth=depth, staging=staging)
    depth0("construction")
    assert e.backend == "cuda" and e.depth == depth
    pending = []
    for j in range(40):
        stage = j % 2 == 1
        out = torch.zeros(1 << 14, dtype=torch.uint8)  # the "device" memory: host memory the fake writes
        plan, at = [], 0
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.integers(0, 4000))
            off = int(rng.integers(0, data.numel() - n))
            plan.append((off, n, at))
            at += n
        segs = [(data.data_ptr() + off, out.data_ptr() + d, n) for off, n, d in plan]
        t = e.submit(segs, stage=stage)
        depth0("submit")
        pending.append((t, plan, out))
        if len(pending) == depth:
            t, plan, out = pending.pop(0)
            res = e.take(t)
            depth0("take")
            assert res is None or all(r is None for r in res)
            sync_default_stream()
            for off, n, d in plan:
                assert torch.equal(out[d:d + n], data[off:off + n]), f"depth {depth} job {t}: bytes differ after take + wait"
    for t, plan, out in pending:
        e.take(t)
        sync_default_stream()
        for off, n, d in plan:
            assert torch.equal(out[d:d + n], data[off:off + n])
    c = e.counters()
    assert c["jobs"] == 40
    e.close()
    depth0("close")
    del e
    gc.collect()
    assert staging.free == staging.created
    del staging
    gc.collect()
    s = stats()
    check_clean(s, allocs_live=0)
    assert s["streams_live"] == 0 and s["events_live"] == 0, "the engine leaked its stream or events"
    assert s["retained"] == 0
s = stats()
assert s["copies_from_pinned"] > 0 and s["copies_from_pageable"] > 0
report(copies=s["copies"], pinned=s["copies_from_pinned"], pageable=s["copies_from_pageable"],
       pushes=s["pushes"], pops=s["pops"], streams=s["streams_created"])
"""


def test_fake_driver_cuda_engine_delivers_exact_bytes(fake_cuda) -> None:
    _, rep = run_fake(fake_cuda, _CUDA_ENGINE_EXACT)
    assert rep["streams"] == 3
    assert rep["copies"] >= 3 * 40 // 2
    # The engine thread of each engine pushes once for its whole life and never pops.
    assert rep["pushes"] - rep["pops"] == 3


_CUDA_ENGINE_ORDERING = r"""
staging = _C.SlotPool(num_fields=1, pinned=True)
e = _C.CopyEngine(backend="cuda", device=0, depth=2, staging=staging)
FAKE.fake_cuda_set_copy_delay_us(40_000)
src = torch.arange(4096, dtype=torch.int32)
results = {}

# 1. take() orders the consumer's stream after the copies: syncing stream 0 alone suffices.
out = torch.zeros_like(src)
t = e.submit([(src.data_ptr(), out.data_ptr(), src.nbytes)], stage=True)
e.take(t)
sync_default_stream()
results["after_take"] = bool(torch.equal(out, src))

# 2. submit() orders the copies after the work already queued on the consumer's stream:
# stream 0 first writes a stale pattern into the destination, slowly (5 copies x 40 ms).
out = torch.zeros_like(src)
stale = torch.full_like(src, -1)
with Ctx():
    for _ in range(5):
        assert FAKE.cuMemcpyHtoDAsync_v2(out.data_ptr(), stale.data_ptr(), stale.nbytes, None) == 0
t = e.submit([(src.data_ptr(), out.data_ptr(), src.nbytes)], stage=True)
e.take(t)
sync_default_stream()
results["after_stream_work"] = bool(torch.equal(out, src))
depth0("ordering")
e.close()
del e, staging
gc.collect()
check_clean(stats())
report(**results)
"""


def test_fake_driver_copies_are_ordered_with_the_consumer_stream(fake_cuda) -> None:
    _, rep = run_fake(fake_cuda, _CUDA_ENGINE_ORDERING)
    assert rep["after_take"], "after take() and a wait on the consumer's stream the copy had not landed"
    assert rep["after_stream_work"], "the copy ran before the work queued on the consumer's stream"


_CUDA_CLOSE_IN_FLIGHT = r"""
FAKE.fake_cuda_set_copy_delay_us(50_000)
staging = _C.SlotPool(num_fields=1, pinned=True)
e = _C.CopyEngine(backend="cuda", device=0, depth=3, staging=staging)
srcs = [torch.full((10_000,), k + 1, dtype=torch.uint8) for k in range(3)]
outs = [torch.zeros(10_000, dtype=torch.uint8) for _ in range(3)]
for s, o in zip(srcs, outs):
    e.submit([(s.data_ptr(), o.data_ptr(), s.nbytes)], stage=True)
deadline = time.monotonic() + 10
while e.counters()["jobs"] < 3 and time.monotonic() < deadline:  # all issued, none completed (50 ms each)
    time.sleep(0.001)
in_flight = FAKE.fake_cuda_pending(0)
t0 = time.monotonic()
e.close()  # NOTE [copy engine shutdown]: waits for the copies already issued
took = time.monotonic() - t0
pending = FAKE.fake_cuda_pending(0)
issued = e.counters()["jobs"]
landed = [bool(torch.equal(s, o)) for s, o in zip(srcs, outs)]
del e
gc.collect()
assert staging.free == staging.created
del staging  # frees the pinned staging slots: no copy may still read them
gc.collect()
s1 = stats()

# A HostBatch from a pinned pipeline as the source: its slot must not return (nor be freed)
# while the copy reads it.
ds = pyloader.ShardDataset(sys.argv[1], rank=0, world_size=1)
pool = _C.SlotPool(num_fields=2, pinned=True)
it = ds.batches(8, num_threads=1, prefetch=1, pool=pool)
host, tensors = it.next_host()
it.close()
del it
gc.collect()
assert pool.created - pool.free == 1
staging2 = _C.SlotPool(num_fields=1, pinned=True)
e = _C.CopyEngine(backend="cuda", device=0, depth=2, staging=staging2)
FAKE.fake_cuda_set_copy_delay_us(200_000)
outs2 = {k: torch.zeros_like(v) for k, v in tensors.items()}
t = e.submit([(v.data_ptr(), outs2[k].data_ptr(), v.nbytes) for k, v in tensors.items()], source=host)
del host, tensors  # no gc.collect() here: it can take longer than the copies
held_while_copying = pool.created - pool.free
e.take(t)
sync_default_stream()
deadline = time.monotonic() + 5
while pool.free != pool.created and time.monotonic() < deadline:
    time.sleep(0.01)
returned = pool.free == pool.created
ok2 = outs2["label"].tolist() == list(range(8)) and all(
    np.array_equal(outs2["img"][r].numpy(), expected_img(r)) for r in range(8))
# And close() with that kind of job in flight, then every pool dropped at once.
it = ds.batches(8, num_threads=1, prefetch=1, pool=pool)
host, tensors = it.next_host()
it.close()
del it
outs3 = {k: torch.zeros_like(v) for k, v in tensors.items()}
jobs = e.counters()["jobs"]
e.submit([(v.data_ptr(), outs3[k].data_ptr(), v.nbytes) for k, v in tensors.items()], source=host)
del host, tensors
deadline = time.monotonic() + 10
while e.counters()["jobs"] == jobs and time.monotonic() < deadline:  # issued: its copies take 2 x 200 ms
    time.sleep(0.001)
e.close()
ok3 = outs3["label"].tolist() == list(range(8)) and all(
    np.array_equal(outs3["img"][r].numpy(), expected_img(r)) for r in range(8))
del e, staging2, pool
gc.collect()
s2 = stats()
check_clean(s2, allocs_live=0)
assert s2["streams_live"] == 0 and s2["events_live"] == 0
report(took=took, in_flight=in_flight, pending=pending, issued=issued, landed=landed, clean1=not s1["errors"],
       held_while_copying=held_while_copying, returned=returned, ok2=ok2, ok3=ok3)
"""


def test_fake_driver_close_waits_for_copies_in_flight(fake_cuda, write_dataset) -> None:
    path = write_fields_dataset(write_dataset, 32)
    _, rep = run_fake(fake_cuda, _CUDA_CLOSE_IN_FLIGHT, path)
    assert rep["issued"] == 3 and rep["in_flight"] > 0, f"the scenario did not have copies in flight at close: {rep}"
    assert rep["pending"] == 0, f"close() returned with {rep['pending']} operations still queued on the copy stream"
    assert all(rep["landed"]), f"issued jobs whose copies had not landed when close() returned: {rep}"
    assert rep["clean1"]
    assert rep["held_while_copying"] == 1, "a HostBatch's pinned slot returned to its pool while its copy was queued"
    assert rep["returned"], "the HostBatch's slot did not return after its copy completed"
    assert rep["ok2"], "the copy from a HostBatch's pinned slot delivered wrong bytes"
    assert rep["ok3"], "close() returned before the copy from a HostBatch's pinned slot landed"


_CUDA_COPY_ERROR = r"""
from pyloader.errors import DeviceError
FAKE.fake_cuda_fail_copies.argtypes = [ctypes.c_long, ctypes.c_int]
staging = _C.SlotPool(num_fields=1, pinned=True)
e = _C.CopyEngine(backend="cuda", device=0, depth=2, staging=staging)
src = torch.arange(2000, dtype=torch.int64)
out = torch.zeros_like(src)
FAKE.fake_cuda_fail_copies(1, 2)  # the next copy: CUDA_ERROR_OUT_OF_MEMORY
t = e.submit([(src.data_ptr(), out.data_ptr(), src.nbytes)], stage=True)
try:
    e.take(t)
    raise AssertionError("take() of a job whose copy failed returned normally")
except DeviceError as ex:
    message = str(ex)
depth0("failed take")
# The engine carries on with the next jobs, and the failed job's staging slot came back.
for k in range(3):
    out = torch.zeros_like(src)
    e.take(e.submit([(src.data_ptr(), out.data_ptr(), src.nbytes)], stage=True))
    sync_default_stream()
    assert torch.equal(out, src), f"job {k} after the failure"
e.close()
free_ok = staging.free == staging.created
del e, staging
gc.collect()
check_clean(stats(), allocs_live=0)
report(message=message, free_ok=free_ok)
"""


def test_fake_driver_a_failed_copy_raises_device_error_at_take(fake_cuda) -> None:
    _, rep = run_fake(fake_cuda, _CUDA_COPY_ERROR)
    assert "cuMemcpyHtoDAsync" in rep["message"] and "CUDA_ERROR_OUT_OF_MEMORY" in rep["message"], rep["message"]
    assert rep["free_ok"], "the staging slot of the failed job was lost"


_FORK_AFTER_PINNED = r"""
import signal
ds = pyloader.ShardDataset(sys.argv[1], rank=0, world_size=1)
loader = pyloader.DataLoader(ds, batch_size=8, num_workers=2, pin_memory=True)
batches = list(loader)
assert pinned(batches[0]["img"])
staging = _C.SlotPool(num_fields=1, pinned=True)
eng = _C.CopyEngine(backend="cuda", device=0, depth=2, staging=staging)
src = torch.arange(1000, dtype=torch.int64)
out = torch.zeros_like(src)
ticket = eng.submit([(src.data_ptr(), out.data_ptr(), src.nbytes)], stage=True)  # in flight at fork
live = stats()["allocs_live"]
pid = os.fork()
if pid == 0:
    code = 1
    try:
        # The inherited pinned memory is readable; dropping it must not call the driver.
        assert [int(x) for b in batches for x in b["label"]] == list(range(96))
        del batches, loader, eng, staging
        gc.collect()
        code = 0
    except BaseException:
        import traceback; traceback.print_exc()
    sys.stdout.flush()
    if code:
        os._exit(code)
    sys.exit(0)  # a normal exit: finalizers and destructors run in the child
deadline = time.monotonic() + 30
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done == pid:
        rc = os.waitstatus_to_exitcode(status)
        break
    if time.monotonic() > deadline:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        rc = "hung"
        break
    time.sleep(0.02)
# The parent's engine and pinned batches still work after the fork.
eng.take(ticket)
sync_default_stream()
assert torch.equal(out, src)
assert [int(x) for b in batches for x in b["label"]] == list(range(96))
eng.close()
del batches, loader, eng, staging
gc.collect()
check_clean(stats(), allocs_live=0)
report(rc=rc, child=pid, live_at_fork=live)
"""


def test_fake_driver_forked_child_never_calls_the_driver(fake_cuda, write_dataset, tmp_path) -> None:
    path = write_fields_dataset(write_dataset, 96)
    log = str(tmp_path / "driver_calls.log")
    _, rep = run_fake(fake_cuda, _FORK_AFTER_PINNED, path, log=log)
    assert rep["rc"] == 0, f"the forked child exited with {rep['rc']}"
    assert rep["live_at_fork"] > 0
    calls = Path(log).read_text().splitlines() if os.path.exists(log) else []
    child_calls = [c for c in calls if c.split()[0] == str(rep["child"])]
    assert not [c for c in child_calls if c.endswith("cuMemFreeHost")], f"the child freed the parent's pinned memory: {child_calls}"
    assert not child_calls, f"the forked child called the CUDA driver: {child_calls}"
