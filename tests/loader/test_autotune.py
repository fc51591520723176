"""See NOTE [autotune]: DataLoader(num_workers="auto", memory_budget=) tunes the native threads
and read-ahead online, never past the memory budget, and leaves the data unchanged."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import pyloader
from pyloader.loader import autotune

RECORD = 4096
BATCH = 32


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("auto") / "ds")
    rng = np.random.default_rng(0)
    with pyloader.ShardWriter(path, {"x": ("uint8", (RECORD,)), "id": ("int64", ())}, compression="none",
                              shard_bytes=1 << 20) as w:
        for i in range(4000):
            w.write({"x": rng.integers(0, 255, RECORD, dtype=np.uint8), "id": i})
    return path


def _run(loader, seconds: float, step_s: float = 0.0) -> int:
    """Iterates whole epochs for at least ``seconds``; returns the epochs run."""
    t0 = time.perf_counter()
    epochs = 0
    while time.perf_counter() - t0 < seconds:
        for _ in loader:
            if step_s:
                time.sleep(step_s)
        epochs += 1
    return epochs


@pytest.mark.timeout(120)
def test_a_wrong_start_is_corrected_and_reported(ds_path) -> None:
    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path, shuffle=True), batch_size=BATCH, num_workers="auto")
    tuner = loader._auto()
    tuner.threads, tuner.prefetch = 1, 1  # deliberately wrong: one thread, one batch ahead
    _run(loader, 2.0)
    report = loader.stats()["autotune"]
    assert report["max_threads"] == autotune.cpu_budget()
    assert report["slot_bytes"] == BATCH * (RECORD + 8)
    assert report["prefetch"] >= report["threads"] > 0
    assert report["memory_bytes"] == (report["prefetch"] + report["threads"] + 2) * report["slot_bytes"]
    whys = [d["why"] for d in report["decisions"]]
    assert whys, "a loop that only waits on the loader must move the start values"
    if autotune.cpu_budget() > 1:
        assert report["threads"] > 1 and any("one more thread" in w for w in whys), whys
    else:
        assert any("read-ahead" in w for w in whys), whys
    for d in report["decisions"]:
        assert set(d) == {"t", "threads", "prefetch", "fetch_jobs", "why"} and "the loop waited" in d["why"]
        assert d["fetch_jobs"] is None  # local data: no downloads to tune


@pytest.mark.timeout(120)
def test_the_memory_budget_is_never_exceeded(ds_path) -> None:
    slot = BATCH * (RECORD + 8)
    budget = 7 * slot  # room for (threads + prefetch + 2) <= 7
    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path, shuffle=True), batch_size=BATCH,
                                 num_workers="auto", memory_budget=budget)
    _run(loader, 1.5)
    report = loader.stats()["autotune"]
    assert report["memory_budget"] == budget
    assert report["memory_bytes"] <= budget
    assert report["threads"] + report["prefetch"] + 2 <= 7
    # What was really allocated: every batch slot the loader ever made.
    assert loader._batch_pool.created * slot <= budget, (loader._batch_pool.created, report)


@pytest.mark.timeout(120)
def test_a_budget_below_one_batch_in_flight_is_reported(ds_path) -> None:
    slot = BATCH * (RECORD + 8)
    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path), batch_size=BATCH, num_workers="auto",
                                 memory_budget=2 * slot)
    n = sum(int(b["id"].shape[0]) for b in loader)
    assert n == 4000  # it still loads, with the least it can hold
    report = loader.stats()["autotune"]
    assert (report["threads"], report["prefetch"]) == (1, 1)
    assert any("over the memory budget" in d["why"] for d in report["decisions"])


@pytest.mark.timeout(120)
def test_idle_threads_are_given_back_to_a_slow_training_step(ds_path) -> None:
    if autotune.cpu_budget() < 2:
        pytest.skip("needs 2 CPUs to start with 2 threads")
    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path), batch_size=BATCH, num_workers="auto")
    tuner = loader._auto()
    tuner.threads, tuner.prefetch = 2, 8
    # A step far slower than loading a 130 KB batch. Idle for 3 intervals in a row (0.6 s)
    # is the rule; on a busy machine a wait now and then (a worker preempted) restarts the
    # count, so whole epochs run until the thread is given back, for at most 8 s.
    deadline = time.perf_counter() + 8.0
    while time.perf_counter() < deadline:
        _run(loader, 0.5, step_s=0.004)
        if loader.stats()["autotune"]["threads"] == 1:
            break
    report = loader.stats()["autotune"]
    assert report["threads"] == 1, report
    assert any("one thread fewer" in d["why"] for d in report["decisions"])


@pytest.mark.timeout(120)
def test_tuning_changes_no_batch(ds_path) -> None:
    def epochs(num_workers):
        loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path, shuffle=True, seed=3), batch_size=BATCH,
                                     num_workers=num_workers)
        if num_workers == "auto":
            loader._auto().threads, loader._auto().prefetch = 1, 1
        return [[(b["id"].clone(), b["x"][:, :8].clone()) for b in loader] for _ in range(3)]

    auto, fixed = epochs("auto"), epochs(2)
    for ea, ef in zip(auto, fixed):
        assert len(ea) == len(ef) == 125
        for (ia, xa), (i_f, xf) in zip(ea, ef):
            assert torch.equal(ia, i_f) and torch.equal(xa, xf)


def test_auto_is_refused_where_it_cannot_tune(ds_path) -> None:
    ds = pyloader.ShardDataset(ds_path)
    with pytest.raises(ValueError, match="memory_budget= bounds what num_workers='auto'"):
        pyloader.DataLoader(ds, batch_size=4, num_workers=2, memory_budget=1 << 20)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="memory_budget must be a positive number of bytes"):
            pyloader.DataLoader(ds, batch_size=4, num_workers="auto", memory_budget=bad)
    # (with a transform it tunes the transform workers: NOTE [transform autotune], tests/transform/test_auto.py)
    pyloader.DataLoader(ds, batch_size=4, num_workers="auto", transform=lambda s: s)
    with pytest.raises(ValueError, match="needs a number of worker processes"):
        pyloader.DataLoader(torch.utils.data.TensorDataset(torch.arange(10)), batch_size=4, num_workers="auto")
    with pytest.raises(ValueError, match="num_workers must be a non-negative int or 'auto', got 'many'"):
        pyloader.DataLoader(ds, batch_size=4, num_workers="many")


@pytest.mark.timeout(120)
def test_epoch_hand_overs_never_grow_the_pool_past_the_budget(tmp_path) -> None:
    """See NOTE [epoch ahead]: the next epoch's pipeline takes only slots the current one frees,
    and only once the current one has collated everything. Many short epochs, each a
    hand-over with workers asleep for room when the last batch is claimed: every record
    once per epoch, and the pool within the budget after all of them."""
    path = str(tmp_path / "ds")
    with pyloader.ShardWriter(path, {"x": ("uint8", (RECORD,)), "id": ("int64", ())}, compression="none",
                              shard_bytes=1 << 18) as w:
        for i in range(12 * BATCH):
            w.write({"x": np.full(RECORD, i % 251, dtype=np.uint8), "id": i})
    slot = BATCH * (RECORD + 8)
    budget = 7 * slot
    for _ in range(3):
        loader = pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True), batch_size=BATCH,
                                     num_workers="auto", memory_budget=budget)
        for epoch in range(40):
            ids = []
            for b in loader:
                ids.extend(int(i) for i in b["id"])
                time.sleep(0.002)  # a training step: the workers wait for room, then race for slots
            assert sorted(ids) == list(range(12 * BATCH)), epoch
        assert loader.stats()["started_ahead"]
        assert loader._batch_pool.created * slot <= budget, (loader._batch_pool.created, loader.stats()["autotune"])
