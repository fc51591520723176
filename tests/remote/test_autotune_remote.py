"""NOTE [autotune] over remote data: the concurrent downloads are tuned when they bind,
within the memory budget, and changing them changes no batch."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from remote_servers import FaultServer

import pyloader
from pyloader.loader import autotune
from pyloader.remote.fetch import ShardFetcher, open_remote

RECORD = 32 << 10  # bytes per record
N = 240


def _write(root: str, records_per_shard: int = 2) -> str:
    path = os.path.join(root, "ds")
    rng = np.random.default_rng(0)
    with pyloader.ShardWriter(path, {"x": ("uint8", (RECORD,)), "id": ("int64", ())}, compression="none",
                              shard_bytes=records_per_shard * RECORD) as w:
        for i in range(N):
            w.write({"x": rng.integers(0, 255, RECORD, dtype=np.uint8), "id": i})
    return path


@pytest.mark.timeout(120)
def test_downloads_limited_per_connection_are_raised_by_trial(tmp_path, cache_dir) -> None:
    # Each connection gets 1 MB/s: one download at a time starves the loop, and every
    # doubling of the downloads doubles the bytes received.
    _write(str(tmp_path / "srv"))
    with FaultServer(str(tmp_path / "srv"), bandwidth=1e6, latency=0.005, max_life=100) as srv:
        ds = pyloader.ShardDataset(srv.url + "/ds", cache_dir=cache_dir, fetch_jobs=1)
        loader = pyloader.DataLoader(ds, batch_size=4, num_workers="auto")
        ids = [int(i) for b in loader for i in b["id"]]
        report = loader.stats()["autotune"]
        fetcher_jobs = ds._fetcher.jobs
        del loader, ds
    assert sorted(ids) == list(range(N))  # the tuning changed no batch
    tries = [d for d in report["decisions"] if "waiting for downloads" in d["why"]]
    assert tries and all("fetch_jobs" in d for d in report["decisions"]), report["decisions"]
    assert report["fetch_jobs"] >= 4, report["decisions"]
    assert fetcher_jobs == report["fetch_jobs"]  # what the report says is what runs
    assert report["memory_bytes"] <= report["memory_budget"]
    assert report["memory_bytes"] >= report["fetch_jobs"] * (1 << 20)  # a read buffer per download counted


def test_a_doubling_that_gains_nothing_is_undone_and_not_retried_at_once() -> None:
    # The controller's verdict on a trial, fed measured intervals of a link that is full:
    # twice the downloads received the same bytes per second.
    class Stream:
        jobs: list[int] = []
        pending = 1000  # shards queued or downloading

        def tune_downloads(self, jobs: int) -> None:
            self.jobs.append(jobs)

        def downloads(self) -> dict[str, int]:
            return {"jobs": self.jobs[-1] if self.jobs else 4, "bytes": 0, "job_bytes": 1 << 20,
                    "pending": self.pending}

    t = autotune.AutoTune(1 << 30, max_threads=2, threads=2, prefetch=4)
    t.fetch_jobs, t.job_bytes = 4, 1 << 20
    s = Stream()
    start = time.perf_counter()
    t._step(s, wait=0.5, collate=0.1, shard_wait=0.8, rate=50e6, since=start)
    assert t.fetch_jobs == 8 and s.jobs == [8]
    t._step(s, wait=0.5, collate=0.1, shard_wait=0.8, rate=52e6, since=start - 1)  # began before the change
    assert t.fetch_jobs == 8
    t._step(s, wait=0.5, collate=0.1, shard_wait=0.8, rate=52e6, since=time.perf_counter())
    assert t.fetch_jobs == 4 and s.jobs == [8, 4]
    assert "back to 4" in t.decisions[-1]["why"]
    t._step(s, wait=0.5, collate=0.1, shard_wait=0.8, rate=50e6, since=time.perf_counter())
    assert t.fetch_jobs == 4 and "did not receive more" in t.decisions[-1]["why"]
    # A gain is kept, and the next doubling tried.
    t._fetch_ceiling = None
    t._step(s, wait=0.5, collate=0.1, shard_wait=0.8, rate=50e6, since=time.perf_counter())
    t._step(s, wait=0.5, collate=0.1, shard_wait=0.8, rate=90e6, since=time.perf_counter())
    assert s.jobs[-2:] == [8, 16] and t.fetch_jobs == 16
    # Every shard left is downloading already: no trial (it would judge more jobs on nothing).
    s.pending = 16
    t._trial = None
    t._step(s, wait=0.5, collate=0.1, shard_wait=0.8, rate=90e6, since=time.perf_counter())
    assert t.fetch_jobs == 16 and "left all run at once" in t.decisions[-1]["why"]
    s.pending = 1000
    # Threads that collate more than they wait for shards are not a download problem.
    t._step(s, wait=0.5, collate=0.9, shard_wait=0.05, rate=90e6, since=time.perf_counter())
    assert t.fetch_jobs == 16 and "waiting for downloads" not in t.decisions[-1]["why"]


def test_download_memory_counts_against_the_budget() -> None:
    t = autotune.AutoTune(20 << 20, max_threads=1, threads=1, prefetch=1)
    t.slot_bytes, t.fetch_jobs, t.job_bytes = 1 << 20, 2, 1 << 20
    t._step(None, wait=0.5, collate=0.1, shard_wait=0.8, rate=1e6, since=time.perf_counter())
    assert t.memory_bytes() <= t.memory_budget
    assert t.fetch_jobs > 2  # some room: raised, not past the budget
    for _ in range(10):
        t._trial = None
        t._step(None, wait=0.5, collate=0.1, shard_wait=0.8, rate=1e6, since=time.perf_counter())
        assert t.memory_bytes() <= t.memory_budget
    assert "memory budget" in t.decisions[-1]["why"]


@pytest.mark.timeout(60)
def test_the_fetcher_follows_a_lowered_and_a_raised_job_count(tmp_path, cache_dir) -> None:
    _write(str(tmp_path / "srv"), records_per_shard=1)
    with FaultServer(str(tmp_path / "srv"), bandwidth=2e6, max_life=50) as srv:
        dcache = open_remote(srv.url + "/ds", cache_dir=cache_dir)
        f = ShardFetcher(dcache, None, jobs=8)
        f.schedule(range(len(dcache.shards)))
        time.sleep(0.2)
        assert f._threads.count == 8
        f.set_jobs(2)
        deadline = time.monotonic() + 5
        while f._threads.count > 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert f._threads.count == 2  # running downloads finished, then their threads left
        f.set_jobs(5)
        assert f._threads.count == 5
        assert f.wait(60)
        f.close()
    assert f.errors == {} and all(dcache.is_published(i) for i in range(len(dcache.shards)))
    with pytest.raises(ValueError):
        f.set_jobs(0)
