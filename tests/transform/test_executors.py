"""Per-sample transforms on the thread and process executors: same batches, errors, shutdown, resume."""

from __future__ import annotations

import gc
import glob
import os
import signal
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
from pyloader.transform.processes import shm_dir, slot_prefix

FIELDS = {"x": ("float32", (4,)), "label": "int64", "tokens": ("int32", (None,))}
N = 300


def sample(i: int) -> dict[str, Any]:
    return {"x": np.full(4, i, np.float32), "label": i, "tokens": np.arange(i % 7, dtype=np.int32)}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("transform") / "ds")
    with pyloader.ShardWriter(d, FIELDS, shard_bytes=2048) as w:
        for i in range(N):
            w.write(sample(i))
    return d


def augment(s: dict[str, Any], ctx: pyloader.SampleContext) -> dict[str, Any]:
    """Draws from all three of the context's generators, so each must be reproducible."""
    noise = torch.rand(4, generator=ctx.torch_generator)
    return {"x": s["x"] * 2 + noise + float(ctx.rng.random()), "label": s["label"],
            "coin": ctx.random.random() < 0.5, "index": ctx.index, "n": len(s["tokens"])}


def global_random(s: dict[str, Any]) -> dict[str, Any]:
    """Draws from the process-wide generators (reproducible on the process executor only)."""
    return {"label": s["label"], "r": torch.rand(()) + np.random.rand() + __import__("random").random()}


def read(path: str, **kw: Any) -> list[Any]:
    ds_kw = {k: kw.pop(k) for k in ("shuffle", "seed", "transform", "decode") if k in kw}
    ds = pyloader.ShardDataset(path, **{"shuffle": True, "seed": 7, **ds_kw})
    kw.setdefault("batch_size", 16)
    return list(pyloader.DataLoader(ds, **kw))


def assert_batches_equal(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert torch.equal(x[k], y[k]), k
            else:
                assert x[k] == y[k], k


def test_transform_applies_to_every_sample_in_plan_order(shards) -> None:
    plain = read(shards)
    got = read(shards, transform=augment)
    assert [b["label"].tolist() for b in got] == [b["label"].tolist() for b in plain]
    assert sum(len(b["label"]) for b in got) == N
    for b, p in zip(got, plain):
        assert b["x"].shape == (len(p["label"]), 4) and b["x"].dtype == torch.float32
        assert torch.all(b["x"] >= p["x"] * 2) and torch.all(b["x"] < p["x"] * 2 + 2)
        assert b["index"].tolist() == p["label"].tolist()  # global index == record position here
        assert b["coin"].dtype == torch.bool


@pytest.mark.parametrize("executor,workers", [("threads", 2), ("threads", 3), ("processes", 1),
                                              ("processes", 2)])
def test_same_batches_for_every_executor_and_worker_count(shards, executor: str, workers: int) -> None:
    want = read(shards, transform=augment, num_workers=1)
    got = read(shards, transform=augment, num_workers=workers, executor=executor)
    assert_batches_equal(got, want)


def test_seeds_change_with_epoch_and_seed_not_with_rank_or_world(shards) -> None:
    a = read(shards, transform=augment, num_workers=2)
    ds = pyloader.ShardDataset(shards, shuffle=True, seed=7)
    loader = pyloader.DataLoader(ds, batch_size=16, transform=augment)
    list(loader)  # epoch 0
    b = list(loader)  # epoch 1
    c = read(shards, transform=augment, seed=8)

    def by_index(batches: list[Any]) -> dict[int, torch.Tensor]:
        return {int(i): x for bt in batches for i, x in zip(bt["index"], bt["x"])}

    ia, ib, ic = by_index(a), by_index(b), by_index(c)
    assert set(ia) == set(ib) == set(ic) == set(range(N))
    assert all(not torch.equal(ia[i], ib[i]) for i in range(N))  # another epoch: other noise
    assert all(not torch.equal(ia[i], ic[i]) for i in range(N))  # another seed: other noise
    # Two ranks of a world of 2 transform each sample as the single reader did.
    for rank in range(2):
        ds = pyloader.ShardDataset(shards, shuffle=True, seed=7, rank=rank, world_size=2)
        part = by_index(list(pyloader.DataLoader(ds, batch_size=8, transform=augment, num_workers=2)))
        assert len(part) >= N // 2 and all(torch.equal(part[i], ia[i]) for i in part)


def test_global_generators_are_seeded_per_sample_on_the_process_executor(shards) -> None:
    one = read(shards, transform=global_random, num_workers=1, executor="processes")
    two = read(shards, transform=global_random, num_workers=2, executor="processes")
    assert_batches_equal(one, two)
    assert len({float(r) for b in one for r in b["r"]}) == N  # not one value repeated


def test_seeding_the_globals_leaves_the_state_the_public_seeds_leave() -> None:
    """``_seed_globals`` calls the seeding functions directly: the same state as random.seed & co."""
    import random

    import numpy as np

    from pyloader.transform.stage import _seed_globals

    def draws() -> tuple[Any, ...]:
        return (random.random(), random.gauss(0.0, 1.0), random.getrandbits(70), float(np.random.rand()),
                float(np.random.standard_normal()), torch.rand(3).tolist(), torch.randint(0, 1 << 30, (2,)).tolist())

    def leave_normals_pending() -> None:  # gauss() keeps its pair's second normal: seeding must drop it
        while random._inst.gauss_next is None:  # type: ignore[attr-defined]
            random.gauss(0.0, 1.0)
        while not np.random.get_state()[3]:  # numpy's legacy generator keeps one too
            np.random.standard_normal()

    for seed in (0, 1, 2**32 + 5, 0x9E3779B97F4A7C15, 2**64 - 1):
        leave_normals_pending()
        random.seed(seed)
        np.random.seed(seed & 0xFFFFFFFF)
        torch.default_generator.manual_seed(seed)
        expected = draws()
        leave_normals_pending()
        _seed_globals(seed)
        assert draws() == expected, seed


def test_resume_mid_epoch_reproduces_the_augmented_batches(shards) -> None:
    full = read(shards, transform=augment, num_workers=2)
    ds = pyloader.ShardDataset(shards, shuffle=True, seed=7)
    loader = pyloader.DataLoader(ds, batch_size=16, transform=augment, num_workers=2)
    it = iter(loader)
    head = [next(it) for _ in range(5)]
    state = loader.state_dict()
    del it
    for executor in ("threads", "processes"):
        ds2 = pyloader.ShardDataset(shards, shuffle=True, seed=7)
        again = pyloader.DataLoader(ds2, batch_size=16, transform=augment, num_workers=3, executor=executor)
        again.load_state_dict(state)
        assert_batches_equal(head + list(again), full)


def test_dataset_transform_under_torch_dataloader(shards) -> None:
    ds = pyloader.ShardDataset(shards, shuffle=True, seed=7, transform=augment)
    ours = read(shards, transform=augment)
    theirs = list(torch.utils.data.DataLoader(ds, batch_size=16))
    assert [b["label"].tolist() for b in theirs] == [b["label"].tolist() for b in ours]
    for a, b in zip(theirs, ours):
        assert torch.equal(a["x"], b["x"])
    # The dataset's transform is the loader's default; the loader's own replaces it.
    via_ds = list(pyloader.DataLoader(ds, batch_size=16))
    assert_batches_equal(via_ds, ours)
    replaced = list(pyloader.DataLoader(ds, batch_size=16, transform=lambda s: {"label": s["label"] + 1}))
    assert replaced[0].keys() == {"label"} and replaced[0]["label"].tolist() == (ours[0]["label"] + 1).tolist()


def test_transform_and_collate_fn_run_off_the_training_thread(shards) -> None:
    seen: set[int] = set()
    collated: set[int] = set()
    main = threading.get_ident()

    def tr(s: dict[str, Any]) -> dict[str, Any]:
        seen.add(threading.get_ident())
        return s

    def collate(samples: list[Any]) -> Any:
        collated.add(threading.get_ident())
        return len(samples)

    # Threads: the sets are this process's (executor="auto" would start this transform on
    # forked processes, whose sets the parent never sees: NOTE [executor choice]).
    got = read(shards, transform=tr, collate_fn=collate, num_workers=2, executor="threads")
    assert sum(got) == N
    assert seen and main not in seen
    assert collated and main not in collated


def test_variable_fields_pass_through_a_transform_as_native_batches(shards) -> None:
    plain = read(shards)
    got = read(shards, transform=lambda s: s, num_workers=2)
    assert_batches_equal(got, plain)
    assert got[0]["tokens_lengths"].dtype == torch.int64


def test_batch_size_none_yields_transformed_samples(shards) -> None:
    got = read(shards, transform=augment, batch_size=None, num_workers=2)
    assert len(got) == N
    assert isinstance(got[0], dict) and got[0]["x"].shape == (4,)
    batched = read(shards, transform=augment, num_workers=2)
    assert [int(s["label"]) for s in got] == [int(v) for b in batched for v in b["label"]]


def test_batch_transform_runs_on_each_batch(shards) -> None:
    def norm(b: dict[str, Any]) -> dict[str, Any]:
        return {**b, "x": (b["x"] - 1) / 2, "normed": True}

    plain = read(shards, transform=augment)
    for kw in ({}, {"device": "cpu"}, {"executor": "processes"}):
        got = read(shards, transform=augment, batch_transform=norm, **kw)
        assert all(b["normed"] is True for b in got)
        assert all(torch.allclose(b["x"], (p["x"] - 1) / 2) for b, p in zip(got, plain))
    # Without a per-sample transform too, and over any dataset (torch's generic path).
    raw = read(shards, batch_transform=norm)
    assert all(b["normed"] is True for b in raw)
    plain_list = [{"x": torch.full((4,), float(i))} for i in range(6)]
    got = list(pyloader.DataLoader(plain_list, batch_size=2, batch_transform=norm))
    assert len(got) == 3 and all(b["normed"] is True for b in got)
    assert torch.equal(got[1]["x"], (torch.full((2, 4), 2.0) + torch.tensor([[0.0], [1.0]]) - 1) / 2)


class Boom(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)


def explode_on_42(s: dict[str, Any]) -> dict[str, Any]:
    if int(s["label"]) == 42:
        raise Boom("record 42 is bad")
    return {"label": s["label"]}


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_transform_errors_keep_type_and_traceback_and_iteration_goes_on(shards, executor: str) -> None:
    ds = pyloader.ShardDataset(shards)  # in order: record 42 is in batch 2 (16 per batch)
    it = iter(pyloader.DataLoader(ds, batch_size=16, transform=explode_on_42, num_workers=2, executor=executor))
    assert next(it)["label"][0] == 0
    assert next(it)["label"][0] == 16
    with pytest.raises(Boom) as ei:
        next(it)
    text = str(ei.value) + "".join(getattr(ei.value, "__notes__", []))
    assert "record 42 is bad" in text
    assert "explode_on_42" in text or "explode_on_42" in "".join(
        __import__("traceback").format_tb(ei.value.__traceback__))
    assert "transform worker" in text
    shard = ds.record_name(0, 0).split(",")[0].split("'")[1]
    assert os.path.dirname(shard) in text and "record" in text
    assert next(it)["label"][0] == 48  # the iteration goes on, as torch's does
    assert sum(len(b["label"]) for b in it) == N - 64


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_inconsistent_shapes_name_the_field(shards, executor: str) -> None:
    def ragged(s: dict[str, Any]) -> dict[str, Any]:
        n = len(s["tokens"])
        return {"label": s["label"], "toks": torch.zeros(n, n)}  # ragged in two dims: no padding rule

    with pytest.raises(pyloader.CollateError, match=r"field 'toks'.*shape") as ei:
        read(shards, transform=ragged, executor=executor)
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_timeout_applies_to_transformed_batches(shards, executor: str) -> None:
    def slow(s: dict[str, Any]) -> dict[str, Any]:
        time.sleep(2.0)
        return s

    ds = pyloader.ShardDataset(shards)
    loader = pyloader.DataLoader(ds, batch_size=4, transform=slow, timeout=0.3, executor=executor)
    t0 = time.monotonic()
    it = iter(loader)
    with pytest.raises(pyloader.LoaderTimeoutError,
                       match=r"^DataLoader timed out after 0\.3 seconds: no transformed batch arrived \(batch 0"):
        next(it)
    assert time.monotonic() - t0 < 3
    it.close()  # waits for the sample in progress, not the whole batch (4 x 2 s)
    assert time.monotonic() - t0 < 5


def _transform_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pyloader-transform")]


def _slot_files() -> list[str]:
    return glob.glob(os.path.join(shm_dir(), glob.escape(slot_prefix(os.getpid())) + "*"))


def _children() -> list[int]:
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def _running(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (not exited: a zombie waiting to be reaped is not)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            out.append(pid)
    return out


def _plus_one(s: dict[str, Any]) -> dict[str, Any]:
    return {"x": s["x"] + 1}


def _pool_loader(shards: str) -> tuple[set[int], Any]:
    """(this process's children now, a process-executor loader whose transform adds one)."""
    gc.collect()
    before = set(_children())
    return before, pyloader.DataLoader(pyloader.ShardDataset(shards), batch_size=8, transform=_plus_one,
                                       num_workers=2, executor="processes")


@pytest.mark.timeout(60)
def test_an_epochs_pool_exits_once_its_batches_are_made(shards) -> None:
    """See NOTE [transform pool]: with persistent_workers=False each worker is told to exit as soon as
    the parent has its last batch, so that the epoch's end does not wait for the workers to exit."""
    before, ld = _pool_loader(shards)
    for _ in range(2):
        it = iter(ld)
        n = sum(len(next(it)["x"]) for _ in range(len(ld)))  # every batch, the epoch not ended yet
        workers = [p for p in _children() if p not in before]
        assert len(workers) == 2, workers
        deadline = time.monotonic() + 10
        while _running(workers) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _running(workers), "the workers kept running after their last batch"
        with pytest.raises(StopIteration):
            next(it)
        while [p for p in _children() if p not in before] and time.monotonic() < deadline:
            time.sleep(0.02)  # reaped by the loader's reaper thread (NOTE [late reaping])
        assert not [p for p in _children() if p not in before]
        assert n == N


_SLOW_EXIT: list[threading.Thread] = []


def _slow_exit(s: dict[str, Any]) -> dict[str, Any]:
    """Identity; in a worker process, keeps the process from exiting for 3 s (a thread it waits for)."""
    if not _SLOW_EXIT and os.getpid() != _SLOW_EXIT_PARENT:
        t = threading.Thread(target=time.sleep, args=(3.0,), name="slow-exit")  # (not a daemon: exit waits)
        t.start()
        _SLOW_EXIT.append(t)
    return {"x": s["x"] + 1}


_SLOW_EXIT_PARENT = os.getpid()


@pytest.mark.timeout(60)
def test_an_epoch_ends_without_waiting_for_its_workers_to_exit(shards) -> None:
    """See NOTE [late reaping]: a worker slow to exit after its last batch does not hold up the
    epoch's end; the reaper stops it after the grace period, and nothing is left."""
    gc.collect()
    before = set(_children())
    ld = pyloader.DataLoader(pyloader.ShardDataset(shards), batch_size=8, transform=_slow_exit, num_workers=2,
                             executor="processes")
    for _ in range(2):
        n = 0
        for b in ld:
            n += len(b["x"])
            workers = [p for p in _children() if p not in before]
        assert n == N
        # Each worker waits 3 s for its thread before it can exit: the epoch ended before that.
        assert len(_running(workers)) >= 1, "the epoch's end waited for the workers to exit"
        deadline = time.monotonic() + 15
        while [p for p in _children() if p not in before] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not [p for p in _children() if p not in before], "workers left unreaped"
        assert not _slot_files()


@pytest.mark.timeout(60)
def test_one_reaper_thread_reaps_epoch_after_epoch(shards) -> None:
    """See NOTE [late reaping]: the reaper waits for the next epoch's workers (LINGER_S) instead of
    leaving, so an epoch's end does not wait for a new thread to start."""
    from pyloader.transform import reap

    before, ld = _pool_loader(shards)
    reapers = []
    for _ in range(3):
        assert sum(len(b["x"]) for b in ld) == N
        deadline = time.monotonic() + 15
        while [p for p in _children() if p not in before] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not [p for p in _children() if p not in before], "workers left unreaped"
        time.sleep(0.1)  # (a reaper with nothing left to reap would leave now)
        reapers.append(reap._thread)
    assert reapers[0] is not None and reapers[0].is_alive() and all(r is reapers[0] for r in reapers), reapers
    assert [t.name for t in threading.enumerate()].count("pyloader-reaper") == 1


class _NoThread(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


@pytest.mark.timeout(60)
def test_an_epoch_reaps_its_workers_itself_where_no_thread_can_start(shards, monkeypatch) -> None:
    """See NOTE [late reaping]: without a reaper thread (a process limit) the epoch's end reaps its workers."""
    from types import SimpleNamespace

    from pyloader.transform import reap

    monkeypatch.setattr(reap, "threading", SimpleNamespace(Thread=_NoThread, Lock=threading.Lock,
                                                           current_thread=threading.current_thread))
    monkeypatch.setattr(reap, "_thread", None)  # (a reaper that an earlier epoch started may still linger)
    before, ld = _pool_loader(shards)
    assert sum(len(b["x"]) for b in ld) == N
    assert not [p for p in _children() if p not in before], "workers left unreaped"
    assert not _slot_files()


@pytest.mark.parametrize("executor", ["threads", "processes"])
@pytest.mark.parametrize("how", ["break", "del", "close", "end"])
def test_nothing_left_after_break_del_or_end(shards, executor: str, how: str) -> None:
    def tr(s: dict[str, Any]) -> dict[str, Any]:
        return {"x": s["x"] + 1}

    gc.collect()  # iterators of earlier tests that ended in an exception are in reference cycles
    ds = pyloader.ShardDataset(shards)
    loader = pyloader.DataLoader(ds, batch_size=8, transform=tr, num_workers=2, executor=executor)
    it = iter(loader)
    kept = next(it)  # a batch the loop keeps must stay valid after shutdown
    if how == "break":
        for _ in it:
            break
        it.close()
    elif how == "close":
        it.close()
    elif how == "end":
        list(it)
    del it
    deadline = time.monotonic() + 10
    while (_transform_threads() or _children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _transform_threads()
    assert not _children()
    assert not _slot_files()
    assert torch.equal(kept["x"][:, 0], torch.arange(8, dtype=torch.float32) + 1)


def test_process_slots_are_reused_only_once_released(shards) -> None:
    def tr(s: dict[str, Any]) -> dict[str, Any]:
        return {"x": s["x"] + 0}

    ds = pyloader.ShardDataset(shards)
    held = list(pyloader.DataLoader(ds, batch_size=4, transform=tr, num_workers=2, executor="processes"))
    # Every batch held at once: no slot was overwritten under a batch the loop still had.
    flat = torch.cat([b["x"][:, 0] for b in held])
    assert flat.tolist() == [float(i) for i in range(N)]


def test_a_killed_worker_raises_transform_worker_error(shards) -> None:
    def slow(s: dict[str, Any]) -> dict[str, Any]:
        time.sleep(0.02)
        return {"label": s["label"]}

    ds = pyloader.ShardDataset(shards)
    it = iter(pyloader.DataLoader(ds, batch_size=8, transform=slow, num_workers=2, executor="processes"))
    next(it)
    for pid in _children():
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(pyloader.TransformWorkerError, match="SIGKILL"):
        for _ in range(N):
            next(it)
    del it
    assert not _slot_files()


def test_full_shared_memory_is_a_clear_error(shards) -> None:
    free = os.statvfs(shm_dir())
    need = free.f_bavail * free.f_frsize + (1 << 30)

    def huge(samples: list[Any]) -> dict[str, torch.Tensor]:
        return {"x": torch.zeros(1, dtype=torch.uint8).expand(need)}  # a view: no memory used

    ds = pyloader.ShardDataset(shards)
    loader = pyloader.DataLoader(ds, batch_size=8, collate_fn=huge, transform=lambda s: s, executor="processes")
    with pytest.raises(pyloader.SharedMemoryError) as ei:
        next(iter(loader))
    assert shm_dir() in str(ei.value) and str(need) in str(ei.value)
    assert isinstance(ei.value, OSError)
    assert not _slot_files()


def test_ctrl_c_leaves_no_process_or_segment(shards, tmp_path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        import pyloader

        # Ctrl-C's default handler even where this process was started with SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def tr(s):
            time.sleep(0.01)
            return {{"label": s["label"]}}

        ds = pyloader.ShardDataset({shards!r})
        loader = pyloader.DataLoader(ds, batch_size=4, transform=tr, num_workers=2, executor="processes")
        try:
            for epoch in range(1000):
                for b in loader:
                    print("batch", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            import faulthandler
            faulthandler.dump_traceback_later(20, exit=True)  # a hang at exit shows where
    """))
    with subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            assert proc.stdout is not None
            for _ in range(3):
                assert proc.stdout.readline().startswith("batch")
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as fh:
                kids = [int(p) for p in fh.read().split()]
            assert kids
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert "interrupted" in out
    assert proc.returncode == 0, err
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{k}") for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [k for k in kids if os.path.exists(f"/proc/{k}")]
    assert not glob.glob(os.path.join(shm_dir(), glob.escape(slot_prefix(proc.pid)) + "*"))


def test_bad_arguments_are_refused(shards) -> None:
    ds = pyloader.ShardDataset(shards)
    with pytest.raises(ValueError, match="executor"):
        pyloader.DataLoader(ds, transform=augment, executor="fibers")
    with pytest.raises(ValueError, match="transform must be callable"):
        pyloader.DataLoader(ds, transform=3)
    with pytest.raises(ValueError, match="transform must be callable"):
        pyloader.ShardDataset(shards, transform="x")
    with pytest.raises(ValueError, match="batch_transform"):
        pyloader.DataLoader(ds, batch_transform=3)
    with pytest.raises(ValueError, match="pyloader dataset"):
        pyloader.DataLoader(list(range(4)), transform=augment)
    with pytest.raises(ValueError, match="multiprocessing_context"):
        pyloader.DataLoader(ds, multiprocessing_context="spawn")
    loader = pyloader.DataLoader(ds, batch_size=50, transform=augment, executor="processes",
                                 multiprocessing_context="spawn")
    assert loader.multiprocessing_context == "spawn"


def test_spawn_context_runs_a_module_level_transform(shards) -> None:
    ds = pyloader.ShardDataset(shards, shuffle=True, seed=7)
    got = list(pyloader.DataLoader(ds, batch_size=16, transform=augment, executor="processes",
                                   multiprocessing_context="spawn", num_workers=2))
    assert_batches_equal(got, read(shards, transform=augment))


def test_stats_report_the_transform_stage(shards) -> None:
    def slow(s: dict[str, Any]) -> dict[str, Any]:
        time.sleep(0.008)  # long enough that start-up and end weigh little on busy
        return s

    for executor in ("threads", "processes"):
        ds = pyloader.ShardDataset(shards)
        loader = pyloader.DataLoader(ds, batch_size=16, transform=slow, executor=executor, num_workers=2)
        list(loader)
        s = loader.stats()
        assert s["transform_executor"] == executor and s["transform_workers"] == 2
        assert s["transformed_samples"] == N and s["transform_batches"] == len(loader)
        assert s["transform_per_sample_us"] >= 8000
        assert 0 < s["transform_busy_fraction"] <= 1.0 + 1e-6
        assert isinstance(s["transform_hint"], str) and s["transform_hint"]
        assert s["wait_fraction"] > 0.5  # nothing else to do: the loop waited for the transform
        assert "more workers would help" in s["transform_hint"]
