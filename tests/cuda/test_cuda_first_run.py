"""What a first run on a GPU must check beyond the values (run by benchmarks/gpu_check.sh;
skipped without CUDA): streams, overlap, the legacy default stream, fork, interpreter exit,
the caller's context, the real driver's error text, leaks over epochs and pinned growth.

Each test is short (a few seconds on one GPU) and compares batches with a CPU reference, so
a wrong order of copies shows up as wrong values, not as a crash.
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pyloader
from pyloader import _C
from pyloader.errors import DeviceError

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.cuda,
]

ROOT = Path(pyloader.__file__).resolve().parents[1]

WIDE = 4096  # 16 KB of float32 per record
FIELDS: dict[str, Any] = {"x": ("float32", (WIDE,)), "label": ("int64", ())}


def sample(i: int) -> dict[str, Any]:
    return {"x": np.arange(WIDE, dtype=np.float32) + np.float32(i * WIDE), "label": i}


GROW_FIELDS: dict[str, Any] = {"tokens": ("int32", (None,)), "label": ("int64", ())}


def grow_sample(i: int) -> dict[str, Any]:
    # Lengths rise through the (unshuffled) epoch: later batches need larger buffers.
    return {"tokens": np.arange(64 * (i + 1), dtype=np.int32) + i, "label": i}


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def dataset(write_dataset: Callable[..., str]) -> str:
    return write_dataset(256, FIELDS, sample, shard_bytes=1 << 20)


_CYCLES_PER_MS: list[float] = []


def cycles_per_ms() -> float:
    """torch.cuda._sleep cycles per millisecond on this GPU (measured once with events)."""
    if not _CYCLES_PER_MS:
        torch.cuda._sleep(1_000_000)  # warm-up
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        _CYCLES_PER_MS.append(20_000_000 / a.elapsed_time(b))
    return _CYCLES_PER_MS[0]


def gpu_sleep(ms: float) -> None:
    """~ms of GPU work on the current stream."""
    torch.cuda._sleep(int(ms * cycles_per_ms()))


def expected_x(labels: torch.Tensor) -> torch.Tensor:
    lab = labels.to(torch.float32).view(-1, 1)
    return torch.arange(WIDE, dtype=torch.float32, device=labels.device) + lab * WIDE


def check_x(b: dict[str, torch.Tensor], where: str) -> None:
    assert b["x"].device.type == "cuda", where
    assert torch.equal(b["x"], expected_x(b["label"])), f"{where}: x does not match its labels"


# -- streams ---------------------------------------------------------------------------------
def test_batch_taken_on_another_stream_than_it_was_submitted_on(dataset: str) -> None:
    """The loader submits device_prefetch batches ahead, so each batch is submitted under one
    stream and taken under the other: the taking stream must wait for the copies (and the
    copies for the work queued on the submitting stream when the destination was allocated)."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    loader = pyloader.DataLoader(pyloader.ShardDataset(dataset), batch_size=16, num_workers=2, device="cuda")
    ok = []
    it = iter(loader)
    for i in range(len(loader)):
        s = (s1, s2)[i % 2]
        other = (s2, s1)[i % 2]
        with torch.cuda.stream(other):
            gpu_sleep(1.0)  # the submitting stream of some batches is busy
        with torch.cuda.stream(s):
            b = next(it)
            ok.append(torch.equal(b["x"], expected_x(b["label"])))  # read at once on the taking stream
            del b
    torch.cuda.synchronize()
    assert len(ok) == 16 and all(ok), f"batches read wrong on the taking stream: {ok}"


def test_copies_overlap_compute(dataset: str) -> None:
    """~1 ms GPU steps fed by the loader keep the GPU about as busy as steps over batches
    already on the GPU: the copies run beside the compute, not between the steps."""
    steps, step_ms = 63, 1.0  # as many as the loader's timed steps below (256 / 4 - 1)
    resident = [torch.zeros(16, WIDE, device=dev()) for _ in range(steps)]
    gpu_sleep(1.0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x in resident:
        gpu_sleep(step_ms)
        x.sum()
    torch.cuda.synchronize()
    baseline = steps * step_ms / 1000 / (time.perf_counter() - t0)

    loader = pyloader.DataLoader(pyloader.ShardDataset(dataset), batch_size=4, num_workers=4, device="cuda",
                                 device_prefetch=3)
    for b in loader:  # warm-up epoch: slots, pinned memory, the engine
        b["x"].sum()
    it = iter(loader)
    next(it)["x"].sum()  # timed from the second batch: the steady state, not the epoch's start
    torch.cuda.synchronize()
    n = 0
    t0 = time.perf_counter()
    for b in it:
        gpu_sleep(step_ms)
        b["x"].sum()
        n += 1
    torch.cuda.synchronize()
    busy = n * step_ms / 1000 / (time.perf_counter() - t0)
    copy = loader.stats()["copy"]
    assert busy >= 0.8 * baseline, f"GPU busy {busy:.2f} fed by the loader against {baseline:.2f} over resident " \
                                   f"batches ({n} steps of {step_ms} ms); copy counters: {copy}"


def test_busy_legacy_default_stream_does_not_hold_up_batches(dataset: str) -> None:
    """Someone else's long work on the legacy default stream: an epoch on a non-blocking
    stream of the loop's does not wait for it (the engine's copy stream is non-blocking)."""
    loader = pyloader.DataLoader(pyloader.ShardDataset(dataset), batch_size=32, num_workers=2, device="cuda")
    side = torch.cuda.Stream()
    sums = torch.zeros(8, device=dev())
    # Warm-up: the loop below, twice, so that neither the loader nor torch's caching allocator
    # allocates in the timed epoch (a cudaMalloc or cuMemHostAlloc waits for the legacy
    # stream: torch's own copies on a side stream, after a first allocation there, waited
    # the full 1.5 s on an H200).
    with torch.cuda.stream(side):
        for _ in range(2):
            for i, b in enumerate(loader):
                sums[i] = (b["x"] - expected_x(b["label"])).abs().sum()
    torch.cuda.synchronize()
    allocs0 = loader.stats()["pinned"]["driver_allocs"]  # each cuMemHostAlloc synchronises the device
    with torch.cuda.stream(torch.cuda.default_stream()):
        gpu_sleep(1500.0)
        legacy_done = torch.cuda.Event()
        legacy_done.record()
    t0 = time.perf_counter()
    with torch.cuda.stream(side):
        for i, b in enumerate(loader):
            sums[i] = (b["x"] - expected_x(b["label"])).abs().sum()
        side.synchronize()
    took = time.perf_counter() - t0
    legacy_busy = not legacy_done.query()
    torch.cuda.synchronize()
    assert torch.count_nonzero(sums).item() == 0, "batches read wrong"
    allocs = loader.stats()["pinned"]["driver_allocs"] - allocs0
    assert took < 1.0 and legacy_busy, f"the epoch took {took:.2f} s behind 1.5 s of work on the legacy stream " \
                                       f"(legacy stream still busy after it: {legacy_busy}; pinned allocations " \
                                       f"in the epoch: {allocs})"


# -- process lifetime --------------------------------------------------------------------------
def test_fork_with_a_live_device_loader(dataset: str) -> None:
    """A fork with a device loader between epochs (its engine threads, stream, events and
    pinned slots kept) and a copy in flight on another engine: the child drops everything it
    inherited and reads with a CPU loader, without a CUDA call that could hang or crash; the
    parent carries on. (The child drops no iterator that is mid-epoch: its collation threads
    may hold locks at the fork, which the child cannot take.)"""
    loader = pyloader.DataLoader(pyloader.ShardDataset(dataset), batch_size=16, num_workers=2, device="cuda")
    for k, b in enumerate(loader):
        check_x(b, f"parent, batch {k} before the fork")
    idx = dev().index
    staging = _C.SlotPool(num_fields=1, pinned=True, device=idx)
    inherited: dict[str, Any] = {"loader": loader, "batch": b, "staging": staging,
                                 "engine": _C.CopyEngine(backend="cuda", device=idx, depth=2, staging=staging)}
    del loader, b, staging
    src = torch.arange(1 << 20, dtype=torch.int32)
    out = torch.zeros_like(src, device=dev())
    handle = int(torch.cuda.current_stream().cuda_stream)
    gpu_sleep(50.0)  # the copy below waits behind this: in flight at the fork
    ticket = inherited["engine"].submit([(src.data_ptr(), out.data_ptr(), src.nbytes)], stream=handle, stage=True)
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3  # dropping what it inherited failed
        try:
            inherited.clear()
            gc.collect()
            code = 4  # reading failed
            cpu = pyloader.DataLoader(pyloader.ShardDataset(dataset), batch_size=16, num_workers=2)
            labels = [int(v) for b in cpu for v in b["label"]]
            code = 0 if labels == list(range(256)) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    status = 0
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, \
        f"the forked child failed: status {status} (exit 3: dropping the inherited loader, 4: reading, 2: values)"
    inherited["engine"].take(ticket, stream=handle)
    assert torch.equal(out.cpu(), src), "the copy in flight at the fork"
    for k, b in enumerate(inherited["loader"]):
        check_x(b, f"parent, batch {k} after the fork")
    inherited["engine"].close()


def test_sys_exit_with_copies_in_flight(dataset: str) -> None:
    """sys.exit() with batches submitted, copies queued behind busy GPU work and the iterator
    alive: the interpreter exits with the status asked for, without hanging or aborting."""
    script = textwrap.dedent(f"""
        import sys, torch, pyloader
        loader = pyloader.DataLoader(pyloader.ShardDataset({dataset!r}), batch_size=16, num_workers=2,
                                     device="cuda", device_prefetch=3)
        it = iter(loader)
        b = next(it)
        torch.cuda._sleep(200_000_000)  # the copies queued next wait behind this
        b = next(it)
        print("EXITING", flush=True)
        sys.exit(7)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], env=env, capture_output=True,
                         text=True, timeout=60)
    text = f"rc={res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert "EXITING" in res.stdout, text
    assert res.returncode == 7, text
    for bad in ("terminate called", "Segmentation fault", "Fatal Python error", "Aborted"):
        assert bad not in res.stderr, text


# -- the caller's CUDA state ---------------------------------------------------------------------
def _current_context() -> int:
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    assert cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return int(ctx.value or 0)


def test_consumer_context_unchanged(dataset: str) -> None:
    """pyloader's driver calls push and pop the primary context: the caller's current context
    is what it was, on the main thread (torch's) and on a thread that has none."""
    torch.zeros(1, device=dev())
    before = _current_context()
    assert before != 0
    for kw in ({"device": "cuda"}, {"pin_memory": True}):
        for _b in pyloader.DataLoader(pyloader.ShardDataset(dataset), batch_size=32, num_workers=2, **kw):
            assert _current_context() == before, f"{kw}: the current context changed inside the epoch"
        assert _current_context() == before, f"{kw}: the current context changed"
        assert torch.cuda.current_device() == dev().index

    # A thread with no current context, driving the copy engine itself (torch would make
    # its device's context current on any thread it runs CUDA work on).
    eng = _C.CopyEngine(backend="cuda", device=dev().index, depth=2,
                        staging=_C.SlotPool(num_fields=1, pinned=True, device=dev().index))
    src = torch.arange(1 << 16, dtype=torch.int32)
    dst = torch.zeros_like(src, device=dev())
    torch.cuda.synchronize()
    seen: list[int] = []

    def bare_thread() -> None:
        seen.append(_current_context())
        t = eng.submit([(src.data_ptr(), dst.data_ptr(), src.nbytes)], stream=0, stage=True)
        seen.append(_current_context())
        eng.take(t, stream=0)
        seen.append(_current_context())

    th = threading.Thread(target=bare_thread)
    th.start()
    th.join(30)
    assert not th.is_alive()
    torch.cuda.synchronize()  # take() ordered the legacy stream after the copy
    assert torch.equal(dst.cpu(), src), "the copy did not land"
    assert seen == [0, 0, 0], f"contexts current on a bare thread before/after submit/take: {seen}"
    eng.close()
    assert _current_context() == before


def test_real_driver_error_text_for_a_bad_device(dataset: str) -> None:
    """A device the machine does not have: DeviceError with the driver's own name and text."""
    n = torch.cuda.device_count()
    makers: list[Callable[[], object]] = [
        lambda: _C.SlotPool(num_fields=1, pinned=True, device=n),
        lambda: _C.CopyEngine(backend="cuda", device=n, staging=_C.SlotPool(num_fields=1)),
    ]
    for make in makers:
        with pytest.raises(DeviceError) as info:
            make()
        msg = str(info.value)
        assert "CUDA_ERROR_INVALID_DEVICE" in msg and "invalid device ordinal" in msg and "code 101" in msg, msg
    with pytest.raises(DeviceError, match="no such GPU"):
        pyloader.DataLoader(pyloader.ShardDataset(dataset), batch_size=8, device=f"cuda:{n}")


# -- steady state over epochs -------------------------------------------------------------------
def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_no_stream_or_event_leak_over_many_epochs(dataset: str) -> None:
    """Finished epochs reuse one engine (NOTE [stage across epochs]); abandoned ones close
    theirs. Over many of both the engines' threads are joined and device memory (where
    streams and events live) stays flat."""
    loader = pyloader.DataLoader(pyloader.ShardDataset(dataset), batch_size=64, num_workers=2, device="cuda")
    for b in loader:
        check_x(b, "warm-up")
    del b
    stage = loader._kept_stage
    gc.collect()
    torch.cuda.synchronize()
    threads0, free0 = _threads(), torch.cuda.mem_get_info()[0]
    epochs = 12
    for _ in range(epochs):
        for b in loader:
            b["x"].sum()
        assert loader._kept_stage is stage, "a finished epoch did not keep its copy engine"
    for k in range(epochs):
        it = iter(loader)
        check_x(next(it), f"abandoned epoch {k}")
        it.close()
        del it
    gc.collect()
    torch.cuda.synchronize()
    threads1, free1 = _threads(), torch.cuda.mem_get_info()[0]
    assert threads1 <= threads0 + 4, f"threads grew from {threads0} to {threads1} over {2 * epochs} epochs"
    assert free0 - free1 < 64 << 20, f"device memory shrank by {(free0 - free1) >> 20} MiB over {2 * epochs} epochs"


def test_variable_length_growth_without_a_stall(write_dataset: Callable[..., str]) -> None:
    """Lengths rise through each epoch: pinned buffers grow by size classes in the first
    epoch and never again; no pinned memory is freed through the driver (each free
    synchronises the device)."""
    path = write_dataset(256, GROW_FIELDS, grow_sample, shard_bytes=1 << 18)
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=16, num_workers=2, device="cuda")
    per_epoch = []
    for epoch in range(4):
        labels: list[int] = []
        for b in loader:
            lab = b["label"]
            lengths = b["tokens_lengths"]
            assert lengths.tolist() == [64 * (i + 1) for i in lab.tolist()], f"epoch {epoch}"
            last = int(lab[-1])
            n = int(lengths[-1])
            assert torch.equal(b["tokens"][-1, :n].cpu(), torch.arange(n, dtype=torch.int32) + last)
            labels += lab.tolist()
        assert labels == list(range(256)), f"epoch {epoch}"
        per_epoch.append(dict(loader.stats()["pinned"]))
    assert all(p["driver_frees"] == 0 for p in per_epoch), f"pinned memory freed mid-training: {per_epoch}"
    # After the first epoch only a slot that did not meet the longest batches yet grows, once
    # (NOTE [pinned cache]).
    later = per_epoch[-1]["driver_allocs"] - per_epoch[0]["driver_allocs"]
    assert later <= loader._pool.created, \
        f"{later} pinned allocations after the first epoch (each synchronises the device): {per_epoch}"


# torch warns once per process at the first sparse tensor unless a global switch is set,
# even when check_invariants= is passed (torch 2.11): a note about torch's defaults.
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled:UserWarning")
def test_sparse_leaves_reach_the_device_without_a_host_wait() -> None:
    """Sparse tensors in a batch are pinned by torch and copied with non_blocking=True on the
    submit stream; a batch taken on another stream waits for that stream."""
    from pyloader.loader import transfer as _transfer

    batches = [{"s": torch.sparse_coo_tensor([[0, k + 1]], [float(k), 7.0], (64,), check_invariants=True),
                "d": torch.full((4,), k)} for k in range(8)]
    stage = _transfer.DeviceStage(dev(), pin=False, depth=2)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    got = []
    it = _transfer.Staged(iter(batches), stage, stage.submit_tree, go_on_after_error=False)
    for k in range(len(batches)):
        with torch.cuda.stream((s1, s2)[k % 2]):
            gpu_sleep(1.0)  # the copies queued on this stream run late
            b = next(it)
            assert b["s"].is_sparse and b["s"].device == dev()
            got.append((b["s"].to_dense(), b["d"].clone()))
    torch.cuda.synchronize()
    stage.close()
    for k, (s, d) in enumerate(got):
        assert torch.equal(s.cpu(), batches[k]["s"].to_dense()) and torch.equal(d.cpu(), batches[k]["d"]), f"batch {k}"


def test_packed_rows_to_the_device_match_the_host(write_dataset: Callable[..., str]) -> None:
    """Packed batches (NOTE [packing rule]) staged to the GPU by the copy engine equal the host's,
    every output (tokens, position ids, document ids, cu_seqlens of varying length) over an epoch."""
    path = write_dataset(300, GROW_FIELDS, grow_sample, shard_bytes=1 << 16)
    spec = pyloader.PackSpec(seq_len=512, mode="first_fit", lookahead=16)
    ds = pyloader.ShardDataset(path, shuffle=True, seed=3)
    host = [{k: v.clone() for k, v in b.items()} for b in pyloader.DataLoader(ds, batch_size=4, pack=spec)]
    got = []
    for b in pyloader.DataLoader(ds, batch_size=4, pack=spec, device=dev()):
        assert all(v.device == dev() for v in b.values())
        got.append({k: v.cpu() for k, v in b.items()})
    assert len(got) == len(host) > 10
    for a, b in zip(host, got, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
