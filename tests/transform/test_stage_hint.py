"""``stats()["transform_hint"]`` follows from the figures the same stats print, and an
epoch where executor="auto" moved to processes reports the whole epoch (NOTE [executor choice]).

Real loaders over real shards: a straggler batch (the consumer waits while reading and
the other workers are idle), a sleeping transform, a computing one, a trivial one under
a slow consumer, and a slow reading path (a remote dataset on a bandwidth-limited
loopback server).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np
import pytest

import pyloader
from pyloader.contract import cpu_budget
from pyloader.transform import auto as auto_mod
from pyloader.transform.stage import BUSY_AT, RARELY_WAITS, READ_SHARE, START_SHARE

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "remote"))

FIELDS = {"x": ("float32", (256,)), "label": "int64"}


def write(path: str, n: int, noise: bool = False) -> str:
    rng = np.random.default_rng(0)
    with pyloader.ShardWriter(path, FIELDS, shard_bytes=65536) as w:
        for i in range(n):
            x = rng.standard_normal(256, dtype=np.float32) if noise else np.full(256, i, np.float32)
            w.write({"x": x, "label": i})
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    return write(str(tmp_path_factory.mktemp("hint") / "ds"), 256)


def check_hint(s: dict[str, Any]) -> str:
    """The hint's verdict is the one its printed figures imply, and it prints them; returns the hint."""
    hint, wait, busy = s["transform_hint"], s["wait_fraction"], s["transform_busy_fraction"]
    assert f"{wait:.0%}" in hint, (hint, wait)
    if wait < RARELY_WAITS:
        assert hint.startswith("enough"), s
        return hint
    assert f"{busy:.0%}" in hint, (hint, busy)
    if busy >= BUSY_AT:
        assert hint.startswith(("more workers would help", "the transform binds")), s
        return hint
    native = s.get("native_wait_s")
    wall = s["consumer_wait_s"] / wait
    reading = native is not None and native >= READ_SHARE * s["consumer_wait_s"] and native >= RARELY_WAITS * wall
    assert hint.startswith("reading limits" if reading else "neither"), s
    if native is not None:
        assert f"{native:.3f} s" in hint, (hint, native)
    return hint


def straggler(s: dict[str, Any], ctx: pyloader.SampleContext) -> dict[str, Any]:
    if ctx.index == 0:
        time.sleep(0.5)  # one slow sample: its batch holds the consumer while the rest is done
    return s


@pytest.mark.timeout(60)
def test_a_straggler_batch_blames_neither_reading_nor_the_transform(shards) -> None:
    # The consumer waits half a second for batch 0 while the native pipeline had every batch
    # ready: the old hint blamed reading ("see shard_wait_s") with shard_wait_s near zero.
    ld = pyloader.DataLoader(pyloader.ShardDataset(shards), batch_size=16, num_workers=2, executor="threads",
                             transform=straggler)
    assert sum(len(b["label"]) for b in ld) == 256
    s = ld.stats()
    assert s["wait_fraction"] > 0.5 and s["transform_busy_fraction"] < BUSY_AT, s
    assert s["native_wait_s"] < 0.1, s
    assert check_hint(s).startswith("neither"), s


def sleeping(s: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.002)  # holds no CPU while it waits
    return s


@pytest.mark.timeout(60)
def test_a_sleeping_transform_on_every_cpu_still_asks_for_more_workers(shards) -> None:
    workers = cpu_budget()
    ld = pyloader.DataLoader(pyloader.ShardDataset(shards), batch_size=16, num_workers=workers, executor="threads",
                             transform=sleeping)
    for _ in ld:
        pass
    s = ld.stats()
    hint = check_hint(s)
    assert s["transform_busy_fraction"] >= BUSY_AT and hint.startswith("more workers would help"), s
    assert "on a CPU only" in hint, hint  # the figure that says more workers than CPUs still help


def computing(s: dict[str, Any]) -> dict[str, Any]:
    acc = 0
    for k in range(20000):  # ~1 ms of pure Python
        acc += k * k % 7
    return {"x": s["x"] + 0 * acc, "label": s["label"]}


@pytest.mark.timeout(60)
def test_a_computing_transform_on_one_worker_names_the_cpus(shards) -> None:
    ld = pyloader.DataLoader(pyloader.ShardDataset(shards), batch_size=16, num_workers=1, executor="threads",
                             transform=computing)
    for _ in ld:
        pass
    s = ld.stats()
    hint = check_hint(s)
    assert s["transform_busy_fraction"] >= BUSY_AT, s
    cpus = cpu_budget()
    assert f"the {cpus} CPUs this process may use" in hint, hint
    assert hint.startswith("more workers would help" if cpus > 1 else "the transform binds"), hint


@pytest.mark.timeout(60)
def test_a_slow_consumer_is_told_the_transform_is_enough_with_its_wait(shards) -> None:
    ld = pyloader.DataLoader(pyloader.ShardDataset(shards), batch_size=16, num_workers=2, executor="threads",
                             transform=lambda s: s)
    for _ in ld:
        time.sleep(0.03)  # a training step: the workers keep ahead of it
    s = ld.stats()
    assert s["wait_fraction"] < RARELY_WAITS, s
    assert check_hint(s).startswith("enough"), s


@pytest.mark.timeout(120)
def test_a_slow_reading_path_is_blamed_with_its_figure(tmp_path) -> None:
    from remote_servers import FaultServer

    write(str(tmp_path / "srv" / "ds"), 256, noise=True)  # 256 KiB that does not compress, in 64 KiB shards
    with FaultServer(str(tmp_path / "srv"), bandwidth=200_000, max_life=100) as server:
        ds = pyloader.ShardDataset(f"{server.url}/ds", cache_dir=str(tmp_path / "cache"))
        ld = pyloader.DataLoader(ds, batch_size=16, num_workers=2, executor="threads", transform=lambda s: s,
                                 timeout=60)
        assert sum(len(b["label"]) for b in ld) == 256
        s = ld.stats()
    hint = check_hint(s)
    assert s["wait_fraction"] > 0.5 and s["native_wait_s"] > 0.25 * s["consumer_wait_s"] / s["wait_fraction"], s
    assert hint.startswith("reading limits"), s


def gil_bound(s: dict[str, Any]) -> dict[str, Any]:
    acc = 0
    for k in range(12000):  # ~0.6 ms of pure Python: the GIL is held throughout
        acc += k * k % 7
    return {"x": s["x"] + 0 * acc, "label": s["label"]}


@pytest.mark.timeout(120)
def test_the_epoch_that_moves_to_processes_reports_the_whole_epoch(tmp_path, monkeypatch) -> None:
    # Where the shared-memory directory has less than FORK_FIRST_ROOM free, the epoch starts on
    # threads and the probe moves it (NOTE [executor choice]); no machine has this much.
    monkeypatch.setattr(auto_mod, "FORK_FIRST_ROOM", 1 << 62)
    n = 2000  # long enough for the probe to decide in the first epoch
    path = write(str(tmp_path / "ds"), n)
    ld = pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=5), batch_size=32, num_workers=2,
                             transform=gil_bound)
    assert sum(len(b["label"]) for b in ld) == n
    s = ld.stats()
    assert s["executor_choice"]["executor"] == "processes", s["executor_choice"]
    assert s["transform_executor"] == "processes"
    assert 0 < s["transform_switched_at"] < s["transform_batches"] == 63, s  # both parts, and where they meet
    assert s["transformed_samples"] == n
    # The cost per sample is the whole epoch's (transform_s over every sample), not the new part's.
    want = (s["transform_s"] + s["decode_s"]) / n * 1e6
    assert s["transform_per_sample_us"] == pytest.approx(want, rel=1e-9) and want > 100, s
    assert 0.05 < s["transform_busy_fraction"] <= 1.0 + 1e-6, s
    check_hint(s)


def copy_sample(s: dict[str, Any]) -> dict[str, Any]:
    return {"x": s["x"] * 2, "label": s["label"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kept", [False, True])
def test_workers_started_for_the_epoch_say_when_they_began_and_what_keeps_them(shards, kept: bool) -> None:
    """See NOTE [worker start] in pyloader/transform/stage.py: a pool started for the epoch
    (persistent_workers=False) reports how long after the epoch's start its workers began, and
    the hint names persistent_workers=True exactly when that is START_SHARE of the epoch or
    more (a light transform over 256 samples: an epoch of tens of ms, of which the workers'
    start is most). Kept workers report nothing and are told nothing of it."""
    ld = pyloader.DataLoader(pyloader.ShardDataset(shards), batch_size=16, num_workers=2, executor="processes",
                             transform=copy_sample, persistent_workers=kept)
    for _ in range(2):  # (two epochs: a new pool each, or the one kept)
        assert sum(len(b["label"]) for b in ld) == 256
        s = ld.stats()
        check_hint(s)
        start, hint = s["transform_worker_start_s"], s["transform_hint"]
        wall = s["consumer_wait_s"] / s["wait_fraction"] if s["wait_fraction"] > 0 else 0.0
        if kept:  # (its first epoch forks them too, but they are kept already)
            assert start is None and "persistent_workers" not in hint, s
            continue
        assert start is not None and 0.0 < start < wall, s
        named = "persistent_workers=True keeps them" in hint
        assert named == (start >= START_SHARE * wall), (start, wall, hint)
        if named:
            assert f"{start * 1e3:.0f} ms after the epoch's start" in hint, hint
