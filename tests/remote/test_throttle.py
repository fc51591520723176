"""Fetching adapts to a throttling server (NOTE [fetch throttling]): the per-host window
halves on 503/429/SlowDown and grows on success, Retry-After pauses the host, a storm
slows ``pyloader cache warm`` down instead of failing it, and a server that never stops
throttling fails the fetch after PYLOADER_FETCH_THROTTLE_DEADLINE with the numbers."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
from remote_servers import Fault, ThrottlingServer
from remote_util import write_one_record_shards

import pyloader
from pyloader.remote import throttle as rthrottle
from pyloader.remote.cli import EXIT_OK, EXIT_UNREACHABLE, main
from pyloader.remote.fetch import open_remote
from pyloader.remote.throttle import host_limiter

N_SHARDS = 48


@pytest.fixture(autouse=True)
def fresh_limiters():
    rthrottle.forget_limiters()  # a port reused from an earlier test must not inherit its throttling
    yield
    rthrottle.forget_limiters()


@pytest.fixture
def many_root(tmp_path) -> str:
    """A served dataset of N_SHARDS one-record shards: many small requests."""
    root = str(tmp_path / "srv")
    write_one_record_shards(os.path.join(root, "ds"), N_SHARDS)
    return root


def warm(capsys, url: str, cache_dir: str, jobs: int = 8) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    code = main(["cache", "warm", url, "--cache-dir", cache_dir, "--jobs", str(jobs), "--json"])
    took = time.monotonic() - t0
    return code, json.loads(capsys.readouterr().out), took


def assert_cached_copies_match(cache_dir: str, url: str, src: str) -> None:
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir)
    files = ds.local_files()
    assert len(files) == len(ds.manifest["shards"])
    for f, rel in zip(files, ds.manifest["shards"]):
        with open(f, "rb") as a, open(os.path.join(src, rel["path"]), "rb") as b:
            assert a.read() == b.read(), rel["path"]


# -- the limiter alone ---------------------------------------------------------------------
def test_window_halves_once_per_round_and_grows_by_one_per_round():
    lim = rthrottle.HostLimiter(ceiling=64)
    assert lim.window == 64
    slots = [lim.slot() for _ in range(8)]
    started = [s.__enter__() for s in slots]
    assert lim.in_flight == 8 and lim.peak == 8
    lim.throttled(started[0], 0.0)  # cut from the 8 in flight, not from the ceiling
    assert lim.window == 4
    lim.throttled(started[1], 0.0)  # sent before the cut: already accounted for
    assert lim.window == 4 and lim.throttles == 2 and lim.streak == 2
    for s in slots:
        s.__exit__(None, None, None)
    # Additive increase: about one place per window of successes, only while the window is full.
    for _ in range(12):
        with lim.slot():
            lim.ok()  # one in flight of a window of 4: not limiting, no growth
    assert lim.window == 4 and lim.streak == 0
    held = [lim.slot() for _ in range(4)]
    for s in held:
        s.__enter__()
    for _ in range(4):
        lim.ok()
    assert lim.window == 4  # 4 + 1/4 + 1/4.25 + ...: one place per round, give or take
    lim.ok()
    assert lim.window == 5
    for s in held:
        s.__exit__(None, None, None)


def test_pause_blocks_every_request_and_cancel_ends_a_wait():
    lim = rthrottle.HostLimiter()
    with lim.slot() as t:
        lim.throttled(t, 0.4)
    t0 = time.monotonic()
    with lim.slot():
        assert time.monotonic() - t0 >= 0.35
    with lim.slot() as t:
        lim.throttled(t, 30.0)
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(rthrottle._Cancelled):
        with lim.slot(cancel):
            pass
    assert time.monotonic() - t0 < 0.6


def test_a_wait_gives_up_only_when_the_host_throttles_past_the_deadline_with_nothing_in_flight():
    lim = rthrottle.HostLimiter()
    with lim.slot() as t:
        lim.throttled(t, 0.3)
    with lim.slot(give_up_after=5.0):  # a throttle, but not for long: waits out the pause
        pass
    with lim.slot() as t:
        lim.throttled(t, 5.0)
    t0 = time.monotonic()
    with pytest.raises(rthrottle._ThrottleExpired):
        with lim.slot(give_up_after=0.2):
            pass
    assert time.monotonic() - t0 < 1.0


def test_throttled_responses_do_not_use_up_attempts(server, cache_dir):
    shard = "ds/shard-000001.pyl"
    server.inject(shard, Fault("status", status=503, retry_after="0", times=6),
                  Fault("status", status=429, times=2))
    dcache = open_remote(server.url + "/ds", cache_dir=cache_dir)
    dcache.ensure(1)  # 8 throttles, 4 attempts allowed: still fetched
    assert dcache.is_published(1) and server.count(shard) == 9


# -- against a throttling server -------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("retry_after", ["1", None], ids=["retry-after", "no-retry-after"])
def test_warm_under_a_concurrency_limit_slows_down_and_converges(many_root, cache_dir, capsys, retry_after):
    allowed = 3
    with ThrottlingServer(many_root, max_concurrent=allowed, retry_after=retry_after, latency=0.04,
                          max_life=100) as srv:
        url = srv.url + "/ds"
        code, r, took = warm(capsys, url, cache_dir, jobs=8)
        arrivals = list(srv.arrivals)
        first = srv.first_throttle()
    assert code == EXIT_OK and r["failed"] == [] and r["downloaded"] == N_SHARDS
    assert_cached_copies_match(cache_dir, url, os.path.join(many_root, "ds"))
    assert first is not None, "8 jobs never went over the 3 the server allows"
    lim = rthrottle.host_limiter(url)
    assert lim.lowest <= allowed < lim.peak
    # After the first cut has taken effect the client keeps near what the server allows:
    # it probes one above (AIMD) and is cut back; noisy machine, loose bounds.
    late = [(open_, thr) for t, open_, thr in arrivals if t > first + 0.3]
    assert len(late) >= N_SHARDS // 2
    concurrency = sorted(o for o, _ in late)
    assert concurrency[len(concurrency) // 2] <= allowed + 1, concurrency
    assert concurrency[int(len(concurrency) * 0.9)] <= allowed + 3, concurrency
    throttled_late = sum(thr for _, thr in late)
    assert throttled_late <= 0.5 * len(late), (throttled_late, len(late))


@pytest.mark.timeout(120)
def test_fetch_all_under_a_rate_limit_with_retry_after_completes(many_root, cache_dir):
    rate = 20
    with ThrottlingServer(many_root, rate=rate, retry_after="1", max_life=100) as srv:
        ds = pyloader.ShardDataset(srv.url + "/ds", cache_dir=cache_dir, fetch_jobs=8)
        got = ds.fetch_all()
        arrivals = list(srv.arrivals)
        first = srv.first_throttle()
    assert got["downloaded"] == N_SHARDS
    assert_cached_copies_match(cache_dir, srv.url + "/ds", os.path.join(many_root, "ds"))
    assert first is not None
    # After the first throttle, no second sees many more requests than the server allows:
    # each throttle pauses the host for its Retry-After.
    times = [t for t, _, _ in arrivals if t > first + 1.0]
    worst = max((sum(1 for u in times if t <= u < t + 1.0) for t in times), default=0)
    assert worst <= rate + 10, worst
    assert sum(thr for t, _, thr in arrivals if t > first + 1.0) <= N_SHARDS // 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("retry_after", ["1", None], ids=["retry-after", "no-retry-after"])
def test_a_server_that_always_throttles_fails_after_the_throttle_deadline(many_root, cache_dir, monkeypatch,
                                                                         retry_after):
    deadline = 1.5
    monkeypatch.setenv("PYLOADER_FETCH_THROTTLE_DEADLINE", str(deadline))
    with ThrottlingServer(many_root, always=True, retry_after=retry_after, max_life=50) as srv:
        dcache = open_remote(srv.url + "/ds", cache_dir=cache_dir)
        t0 = time.monotonic()
        with pytest.raises(pyloader.FetchError) as ei:
            dcache.ensure(3)
        took = time.monotonic() - t0
        gets = srv.count("ds/shard-000003.pyl")
    e = ei.value
    assert deadline <= took < deadline + 3.0
    assert e.transient and e.attempts == gets >= 2 and not dcache.is_published(3)
    msg = str(e)
    assert e.url in msg and "'shard-000003.pyl'" in msg and "PYLOADER_FETCH_THROTTLE_DEADLINE" in msg
    assert f"{deadline:g} s" in msg and "HTTP 503" in msg and f"{gets} throttled responses" in msg
    assert "concurrency cut from 1 to 1" in msg and f"gave up after {gets} attempts" in msg
    if retry_after:
        assert "Retry-After 1 s" in msg


@pytest.mark.timeout(60)
def test_a_throttle_storm_ends_a_warm_after_the_deadline(many_root, cache_dir, capsys, monkeypatch):
    deadline = 1.5
    monkeypatch.setenv("PYLOADER_FETCH_THROTTLE_DEADLINE", str(deadline))
    with ThrottlingServer(many_root, always=True, retry_after=None, max_life=50) as srv:
        code, r, took = warm(capsys, srv.url + "/ds", cache_dir, jobs=8)
        gets = sum(srv.shard_gets().values())
    # Nothing came: the store could not be reached for the whole deadline (exit 4, not "done in part").
    assert code == EXIT_UNREACHABLE and r["downloaded"] == 0 and len(r["failed"]) == N_SHARDS
    assert took < deadline + 4.0
    assert gets < 40 * N_SHARDS  # paused, not hammering
    assert "throttle deadline" in r["failed"][0]["error"], r["failed"][0]


@pytest.mark.timeout(60)
def test_a_throttled_fetch_says_so_while_it_waits(many_root, cache_dir, monkeypatch, caplog):
    """The streak is reported on the "pyloader.remote" logger when it is report_first_s old and
    every report_every_s after (5 s and 30 s by default; shortened here), with what a user needs."""
    monkeypatch.setenv("PYLOADER_FETCH_THROTTLE_DEADLINE", "3.5")
    with ThrottlingServer(many_root, always=True, retry_after="1", max_life=50) as srv:
        lim = host_limiter(srv.url)
        assert (lim.report_first_s, lim.report_every_s) == (5.0, 30.0)
        lim.report_first_s, lim.report_every_s = 0.5, 1.0
        dcache = open_remote(srv.url + "/ds", cache_dir=cache_dir)
        with caplog.at_level(logging.WARNING, logger="pyloader.remote"):
            with pytest.raises(pyloader.FetchError, match="throttle deadline"):
                dcache.ensure(3)
    reports = [r.getMessage() for r in caplog.records if r.name == "pyloader.remote"]
    assert 3 <= len(reports) <= 4 and lim.reports == len(reports), reports
    first = reports[0]
    host = srv.url.split("://")[1]
    assert host in first and "is throttling" in first and "throttled responses in" in first, first
    assert "HTTP 503, Retry-After 1 s" in first and "request window 1" in first, first
    assert "fail once it has throttled for 3.5 s" in first and "PYLOADER_FETCH_THROTTLE_DEADLINE" in first, first
