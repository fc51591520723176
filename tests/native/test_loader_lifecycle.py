"""pyloader.DataLoader over its whole life: create / iterate / break / del, Ctrl-C, exit, fork.

Every configuration of the loader (native path with and without the copy engine, pinned
staging, collate_fn, per-sample iteration; torch's path with worker processes, with and
without the copy engine) is created and abandoned mid-epoch many times; afterwards no
native thread (/proc/self/task), no batch buffer (the loader's slot pools) and no child
process (/proc/*/stat) may be left. KeyboardInterrupt, interpreter exit and fork run in
subprocesses or forked children, as users hit them. Linux only: everything is read from /proc.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from native_util import run_in_forked_child, threads_now, wait_threads

import pyloader
from pyloader.loader import transfer as _transfer

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")

ROOT = Path(pyloader.__file__).resolve().parents[1]
IMG = 256
FIELDS: dict[str, Any] = {"label": ("int64", ()), "img": ("uint8", (IMG,))}
N = 120
CYCLES = 30


def expected_img(i: int) -> np.ndarray:
    return ((np.arange(IMG, dtype=np.int64) * 5 + i) % 251).astype(np.uint8)


def sample(i: int) -> dict[str, Any]:
    return {"label": i, "img": expected_img(i)}


def open_ds(path: str) -> pyloader.ShardDataset:
    return pyloader.ShardDataset(path, rank=0, world_size=1)


class MapDataset(torch.utils.data.Dataset):
    """Map-style: sample i is {"label": i, "img": expected_img(i)}."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"label": torch.tensor(i), "img": torch.from_numpy(expected_img(i))}


def stack_collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {"label": torch.stack([s["label"] for s in samples]), "img": torch.stack([s["img"] for s in samples])}


def check_batch(batch: Any, first: int, rows: int) -> None:
    """A batch of ``rows`` consecutive samples starting at ``first`` (numpy only)."""
    labels = batch["label"].numpy()
    assert labels.tolist() == list(range(first, first + rows))
    img = batch["img"].numpy()
    for r, i in enumerate(labels.tolist()):
        assert np.array_equal(img[r], expected_img(i)), f"img of sample {i}"


# --- /proc -------------------------------------------------------------------------------






def _proc_stats() -> list[tuple[int, str, int, int]]:
    """(pid, state, ppid, pgrp) of every process."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                text = fh.read()
        except OSError:
            continue  # it exited meanwhile
        rest = text[text.rindex(")") + 2:].split()
        out.append((int(name), rest[0], int(rest[1]), int(rest[2])))
    return out


def children(pid: int | None = None) -> list[tuple[int, str]]:
    """(pid, state) of the child processes of ``pid`` (this process), zombies included."""
    me = os.getpid() if pid is None else pid
    return [(p, st) for p, st, ppid, _ in _proc_stats() if ppid == me]


def group_members(pgrp: int) -> list[tuple[int, str]]:
    return [(p, st) for p, st, _, g in _proc_stats() if g == pgrp]


def wait_gone(list_fn: Callable[[], list[tuple[int, str]]], timeout: float = 5.0) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    left = list_fn()
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = list_fn()
    return left






# --- create / iterate / break / del ------------------------------------------------------

# name -> (native dataset?, DataLoader kwargs)
CONFIGS: dict[str, tuple[bool, dict[str, Any]]] = {
    "native": (True, {"num_workers": 2}),
    "native-device-cpu": (True, {"num_workers": 2, "device": "cpu"}),
    "native-pin-memory": (True, {"num_workers": 2, "pin_memory": True}),
    "native-collate-fn": (True, {"num_workers": 1, "collate_fn": stack_collate}),
    "native-collate-fn-device-cpu": (True, {"num_workers": 1, "collate_fn": stack_collate, "device": "cpu"}),
    "native-batch-size-none": (True, {"num_workers": 1, "batch_size": None}),
    "native-batch-size-none-device-cpu": (True, {"num_workers": 1, "batch_size": None, "device": "cpu"}),
    "map-workers": (False, {"num_workers": 2}),
    "map-workers-device-cpu": (False, {"num_workers": 2, "device": "cpu"}),
}


@pytest.fixture(autouse=True)
def _pin_warning_already_issued(monkeypatch) -> None:
    """No CUDA driver here: pin_memory=True falls back to pageable staging with one warning per
    process, at the first iter() (NOTE [lazy pinned pools]); it counts as issued, so these tests
    stay silent whatever ran before them (monkeypatch restores the flag afterwards)."""
    monkeypatch.setattr(_transfer, "_warned_pageable", True)


def make_loader(native: bool, path: str, kwargs: dict[str, Any]) -> pyloader.DataLoader:
    kw = {"batch_size": 8, **kwargs}
    if kw["num_workers"] and not native:
        kw.setdefault("timeout", 60)  # a hung torch worker fails the test instead of hanging it
    ds: Any = open_ds(path) if native else MapDataset(N)
    return pyloader.DataLoader(ds, **kw)


def pools(loader: pyloader.DataLoader) -> list[Any]:
    return [p for p in (getattr(loader, "_pool", None), loader._staging_pool) if p is not None]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_create_iterate_break_del_leaves_nothing_behind(write_dataset, config: str) -> None:
    native, kwargs = CONFIGS[config]
    per_sample = "batch_size" in kwargs and kwargs["batch_size"] is None
    # Per-sample iteration reads native batches of 64: enough of them that the epoch's
    # threads are still running when the cycle breaks.
    path = write_dataset(640 if per_sample else N, FIELDS, sample)

    running = 0  # cycles whose epoch was seen running at its first item

    def cycle(k: int, base: int | None = None) -> None:
        nonlocal running
        loader = make_loader(native, path, kwargs)
        got = 0
        for item in loader:
            if base is not None and got == 0:  # the measurements below do see a running epoch
                running += threads_now() > base if native else len(new_children()) >= 2
            if per_sample:
                assert int(item["label"]) == got
                assert np.array_equal(item["img"].numpy(), expected_img(got))
                got += 1
            else:
                check_batch(item, got, 8)
                got += 8
            if got >= 8 * (1 + k % 3):  # break after 1..3 batches (or 8..24 samples)
                break
        if kwargs.get("device") == "cpu":
            assert loader._staging_pool is not None, "this configuration runs the copy engine"
        del item
        # Buffers: once every batch is dropped and the epoch abandoned, all slots are free.
        ps = pools(loader)
        if native:
            assert ps, "a native loader has a slot pool"
        del loader
        for p in ps:
            assert p.free == p.created, f"cycle {k}: {p.created - p.free} of {p.created} slots not returned"

    # Child processes that other tests of this session left running are not ours to count.
    before = {p for p, _ in children()}

    def new_children() -> list[tuple[int, str]]:
        return [(p, st) for p, st in children() if p not in before]

    # Warm-up: lazy imports, torch's thread pools, the shard mappings of the first open.
    cycle(0)
    gc.collect()
    base = wait_threads(threads_now())
    assert not wait_gone(new_children), "warm-up left child processes"
    for k in range(1, CYCLES + 1):
        cycle(k, base)
        n = wait_threads(base)
        assert n <= base, f"{config} cycle {k}: {n - base} threads left after the loader and its iterator were dropped"
        left = wait_gone(new_children)
        assert not left, f"{config} cycle {k}: child processes left: {left}"
    gc.collect()
    assert wait_threads(base) <= base
    # The test measures something: most cycles broke off a running epoch. Not every one: on
    # a loaded machine a one-thread epoch of 15 batches may end before the consumer takes its
    # first item (CI saw it once in 30 cycles).
    what = "native thread" if native else "torch worker process"
    assert running >= CYCLES // 2, f"a {what} running mid-epoch in only {running} of {CYCLES} cycles"


@pytest.mark.timeout(120)
def test_explicit_reiteration_keeps_held_iterators_and_frees_dropped_ones(write_dataset) -> None:
    # A new iter() leaves the previous one running (as torch's: NOTE [iterators of one loader]):
    # each held iterator keeps its own threads and reads on; a dropped one stops them.
    ds = open_ds(write_dataset(N, FIELDS, sample))
    loader = pyloader.DataLoader(ds, batch_size=8, num_workers=2, device="cpu")
    next(iter(loader))
    gc.collect()
    base = wait_threads(threads_now())
    for _ in range(5):
        it = iter(loader)  # the previous `it` is dropped here
        check_batch(next(it), 0, 8)
        # This epoch's: 2 collation workers, the copy engine's 2 (NOTE [copy engine threads]).
        assert wait_threads(base + 4) <= base + 4, "a dropped iterator's threads were not stopped"
    held = [it]
    for _ in range(3):
        held.append(iter(loader))
        check_batch(next(held[-1]), 0, 8)
    for it in held:
        check_batch(next(it), 8, 8)  # every held iterator reads on
    del held, it
    assert wait_threads(base) <= base, "the held iterators' threads outlived them"
    for p in pools(loader):
        assert p.free == p.created


# --- KeyboardInterrupt ---------------------------------------------------------------------

_SIGINT_SCRIPT = r"""
import os, signal, sys, time, torch, pyloader
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C's default, even where SIGINT was ignored at start
kind, path = sys.argv[1], sys.argv[2]

class Slow(torch.utils.data.Dataset):
    def __len__(self): return 10_000
    def __getitem__(self, i):
        time.sleep(0.02)
        return {"label": torch.tensor(i), "img": torch.full((64,), i % 251, dtype=torch.uint8)}

fifo = None
if kind == "map0":
    loader = pyloader.DataLoader(Slow(), batch_size=4, device="cpu", num_workers=0)
elif kind == "map2":
    loader = pyloader.DataLoader(Slow(), batch_size=4, device="cpu", num_workers=2, timeout=60)
elif kind == "native-busy":
    loader = pyloader.DataLoader(pyloader.ShardDataset(path, rank=0, world_size=1, shuffle=True), batch_size=4,
                                 num_workers=2, device="cpu")
elif kind == "native-blocked":
    ds = pyloader.ShardDataset(path, rank=0, world_size=1)
    fifo = ds.shard_paths[1]
    os.unlink(fifo)
    os.mkfifo(fifo)  # stalled storage: opening shard 1 blocks until the FIFO is opened for writing
    loader = pyloader.DataLoader(ds, batch_size=ds.records_per_shard[0], num_workers=1, device="cpu")
seen = 0
try:
    if kind == "native-blocked":
        print("READY", flush=True)  # the first next() already blocks
    while True:  # epochs until Ctrl-C
        for batch in loader:
            seen += 1
            if seen == 1:
                print("READY", flush=True)
            if kind == "native-busy":
                time.sleep(0.001)
    print("loop ended without KeyboardInterrupt", flush=True)
    sys.exit(3)
except KeyboardInterrupt:
    import threading
    assert threading.current_thread() is threading.main_thread()
    print(f"CAUGHT KeyboardInterrupt after {seen} batches at {time.monotonic():.6f}", flush=True)
    if fifo is not None:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # storage recovers
"""


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["map0", "map2", "native-busy", "native-blocked"])
def test_ctrl_c_mid_iteration(write_dataset, kind: str) -> None:
    path = write_dataset(200, FIELDS, sample, compression="none", shard_bytes=32 << 10)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    # Its own session: Ctrl-C in a terminal signals the whole foreground process group.
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", _SIGINT_SCRIPT, kind, path], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = _readline(proc, 60)
        assert line.strip() == "READY", f"the script did not start: {line!r}"
        time.sleep(0.5)  # mid-iteration
        group_before = group_members(proc.pid)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"{kind}: the process did not exit within 15 s of Ctrl-C\nstdout:\n{out}\nstderr:\n{err}")
        ended = time.monotonic()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    report = f"rc={proc.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    assert "CAUGHT KeyboardInterrupt" in out, \
        f"{kind}: KeyboardInterrupt did not reach the main thread's except\n{report}"
    caught = float(out.split(" at ")[-1].split()[0])
    assert caught - sent < 3.0, f"{kind}: KeyboardInterrupt took {caught - sent:.2f} s\n{report}"
    for bad in ("Traceback", "terminate called", "Segmentation fault", "Fatal Python error", "Exception ignored"):
        assert bad not in err, f"{kind}: {bad!r} on stderr\n{report}"
    assert proc.returncode == 0, report
    assert ended - sent < 6.0, f"{kind}: exit took {ended - sent:.1f} s after Ctrl-C\n{report}"
    if kind == "map2":
        assert len(group_before) >= 3, f"expected the two torch workers to be running: {group_before}"
    left = wait_gone(lambda: group_members(proc.pid), timeout=2.0)
    assert not left, f"{kind}: processes of the interrupted program outlived it: {left}\n{report}"


# --- interpreter exit with a live iterator -------------------------------------------------

_EXIT_LIVE = r"""
import sys, time, torch, pyloader
kind, path = sys.argv[1], sys.argv[2]
if kind == "native":
    loader = pyloader.DataLoader(pyloader.ShardDataset(path, rank=0, world_size=1), batch_size=8, num_workers=3,
                                 device="cpu", device_prefetch=3)
else:
    class Items(torch.utils.data.Dataset):
        def __len__(self): return 400
        def __getitem__(self, i): return torch.full((64,), i, dtype=torch.int64)
    loader = pyloader.DataLoader(Items(), batch_size=8, num_workers=2, device="cpu", timeout=60)
it = iter(loader)
KEEP = [next(it), next(it)]
assert int(KEEP[1]["label"][0] if kind == "native" else KEEP[1][0, 0]) == 8
print(f"EXITING at {time.monotonic():.6f}", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["native", "map-workers"])
def test_interpreter_exit_with_a_live_iterator(write_dataset, kind: str) -> None:
    path = write_dataset(400, FIELDS, sample)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", _EXIT_LIVE, kind, path], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"interpreter exit hung with a live iterator\nstdout:\n{out}\nstderr:\n{err}")
    ended = time.monotonic()
    report = f"rc={proc.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    assert "EXITING at" in out, report
    for bad in ("Traceback", "terminate called", "Segmentation fault", "Fatal Python error", "Exception ignored"):
        assert bad not in err, f"{bad!r} on stderr\n{report}"
    assert proc.returncode == 0, report
    began = float(out.split("EXITING at ")[1].split()[0])
    assert ended - began < 5.0, f"exit took {ended - began:.1f} s with a live iterator\n{report}"
    left = wait_gone(lambda: group_members(proc.pid), timeout=2.0)
    assert not left, f"processes outlived the program: {left}"


# --- fork ------------------------------------------------------------------------------------


def _child_reads_a_new_loader(path: str, inherited: Any, step: Callable[[str], None]) -> int:
    step("the parent's epoch in progress refuses to run in the child")
    try:
        next(inherited)
        return 9
    except pyloader.LoaderStateError:
        pass
    step("a new DataLoader(device='cpu') over a freshly opened dataset")
    loader = pyloader.DataLoader(open_ds(path), batch_size=8, num_workers=2, device="cpu")
    for epoch in range(2):
        got = 0
        for batch in loader:
            check_batch(batch, got, 8)
            got += 8
        if got != N:
            return 10 + epoch
        step(f"epoch {epoch} complete")
    step("the same over the parent's dataset object")
    loader = pyloader.DataLoader(DS_HOLDER[0], batch_size=8, num_workers=2, device="cpu")
    got = 0
    for batch in loader:
        check_batch(batch, got, 8)
        got += 8
    if got != N:
        return 12
    step("done")
    return 0


DS_HOLDER: list[Any] = []


@pytest.mark.timeout(120)
def test_fork_after_a_device_cpu_loader(write_dataset, tmp_path) -> None:
    path = write_dataset(N, FIELDS, sample)
    ds = open_ds(path)
    DS_HOLDER[:] = [ds]
    loader = pyloader.DataLoader(ds, batch_size=8, num_workers=2, device="cpu")
    assert sum(int(b["label"].shape[0]) for b in loader) == N  # one whole epoch
    live = iter(loader)  # and one in progress at fork time: its threads and engine are running
    check_batch(next(live), 0, 8)
    child = run_in_forked_child(lambda step: _child_reads_a_new_loader(path, live, step),
                                str(tmp_path / "child.log"), timeout=60)
    assert child.code is not None, f"the forked child hung (killed after 60 s); its steps:\n{child.log}"
    assert child.code == 0, f"the forked child failed with exit code {child.code}; its steps:\n{child.log}"
    # The parent's epoch in progress is unaffected.
    got = 8
    for batch in live:
        check_batch(batch, got, 8)
        got += 8
    assert got == N
    DS_HOLDER.clear()


def _child_drops_a_mid_epoch_iterator(it: Any, finished: list[Any], step: Callable[[str], None]) -> int:
    step("stats() of the parent's iterator")
    try:
        it.stats()
    except pyloader.LoaderStateError:
        pass
    else:
        return 1  # it read the parent's native set (whose locks a parent thread may hold)
    step("drop it")
    del it
    gc.collect()
    if finished:
        return 2  # its finish callback ran here, reading the parent's native set
    step("done")
    return 0


@pytest.mark.timeout(120)
def test_a_forked_child_drops_a_mid_epoch_iterator_without_touching_the_parents_set(write_dataset,
                                                                                     tmp_path) -> None:
    path = write_dataset(N, FIELDS, sample)
    it = open_ds(path).batches(8, num_threads=2)
    check_batch(next(it), 0, 8)
    finished: list[Any] = []
    it.on_finish = finished.append
    child = run_in_forked_child(lambda step: _child_drops_a_mid_epoch_iterator(it, finished, step),
                                str(tmp_path / "child.log"), timeout=60)
    assert child.code is not None, f"the forked child hung (killed after 60 s); its steps:\n{child.log}"
    assert child.code == 0, f"the forked child failed with exit code {child.code}; its steps:\n{child.log}"
    assert sum(int(b["label"].shape[0]) for b in it) == N - 8  # the parent's epoch goes on
    assert finished and finished[0]["records"] == N  # and its finish callback runs here


def _child_touches_the_parents_copy_engine(stage: Any, live: Any, step: Callable[[str], None]) -> int:
    # The parent's engine thread may hold the engine's lock at the fork: every access here
    # must refuse before taking it (a child that locked would hang at random, one fork in many).
    for name in ("submitted", "taken"):
        step(f"engine.{name}")
        try:
            getattr(stage._engine, name)
        except pyloader.LoaderStateError:
            pass
        else:
            return 1
    step("outstanding() and consumed() without the engine")
    if stage.outstanding() != 0:
        return 2
    step("next() of the parent's iterator, with jobs of the parent's in its ring")
    try:
        next(live)
    except pyloader.LoaderStateError:
        pass
    else:
        return 3
    step("done")
    return 0


@pytest.mark.timeout(120)
def test_a_forked_child_reads_no_counter_of_the_parents_copy_engine(write_dataset, tmp_path) -> None:
    """See NOTE [loader across fork]: the ticket counters lock the engine, so they refuse in a child,
    and a parent's staged iterator raised on there (whose error path asked whether its job was
    consumed) raises LoaderStateError instead of waiting for the lock."""
    path = write_dataset(N, FIELDS, sample)
    loader = pyloader.DataLoader(open_ds(path), batch_size=8, num_workers=2, device="cpu", prefetch=4)
    live = iter(loader)
    check_batch(next(live), 0, 8)
    stage = loader._kept_stage
    assert stage is not None and stage.outstanding() > 0, "no job in flight at the fork: the test tests nothing"
    child = run_in_forked_child(lambda step: _child_touches_the_parents_copy_engine(stage, live, step),
                                str(tmp_path / "child.log"), timeout=60)
    assert child.code is not None, f"the forked child hung (killed after 60 s); its steps:\n{child.log}"
    assert child.code == 0, f"the forked child failed with exit code {child.code}; its steps:\n{child.log}"
    got = 8
    for batch in live:  # the parent's epoch goes on
        check_batch(batch, got, 8)
        got += 8
    assert got == N
