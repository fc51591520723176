"""The shared node cache: many processes, kill -9, eviction with pins, limits, full and
read-only disks."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from remote_servers import Fault, FaultServer
from remote_util import N_RECORDS, labels, published, temp_files, write_ds

import pyloader
from pyloader.errors import CacheLimitError
from pyloader.remote.bad_copies import verify_entry
from pyloader.remote.cache import ShardCache
from pyloader.remote.fetch import open_remote
from pyloader.remote.room import RoomWaits

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.timeout(90)
def test_many_processes_share_one_download_per_shard(srv_root, cache_dir):
    # Slow enough that the four readers overlap on every shard.
    with FaultServer(srv_root, bandwidth=200_000, latency=0.01, max_life=80) as server:
        procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "remote_worker.py"), "read",
                                   server.url + "/ds", cache_dir], stdout=subprocess.PIPE, env=_env())
                 for _ in range(4)]
        outs = [json.loads(p.communicate(timeout=80)[0]) for p in procs]
        assert all(p.returncode == 0 for p in procs)
        assert outs == [{"n": N_RECORDS, "labels_ok": True}] * 4
        gets = server.shard_gets()
        assert len(gets) == 16 and set(gets.values()) == {1}, gets


@pytest.mark.timeout(60)
def test_kill_9_of_a_downloader_mid_shard_blocks_nobody(server, cache_dir):
    shard0 = "ds/shard-000000.pyl"
    server.inject(shard0, Fault("stall", seconds=30))  # the victim gets half a body, then nothing
    env = _env()
    env["PYLOADER_FETCH_STALL_TIMEOUT"] = "30"
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "remote_worker.py"), "read", server.url + "/ds",
                          cache_dir], stdout=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 30
    while not any("shard-000000" in t for t in temp_files(cache_dir)):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.02)
    time.sleep(0.2)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert any("shard-000000" in t for t in temp_files(cache_dir))  # its partial file is left behind...
    t0 = time.monotonic()
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir)
    assert labels(ds) == list(range(N_RECORDS))
    assert time.monotonic() - t0 < 10  # ...but its lock died with it
    assert temp_files(cache_dir) == []  # and the next lock holder removed the partial file
    assert server.count(shard0) == 2
    d = ShardCache(cache_dir).find(server.url + "/ds")
    assert all(verify_entry(d, e) is None for e in d.entries())


@pytest.mark.timeout(60)
def test_stale_temp_files_are_cleaned(server, cache_dir):
    dcache = open_remote(server.url + "/ds", cache_dir=cache_dir)
    stale = os.path.join(dcache.tmp_dir, f"{dcache.names[3]}.999999.deadbeef.part")
    with open(stale, "wb") as f:
        f.write(b"partial")
    assert ShardCache(cache_dir).stats()["temp_files"] == 1
    assert ShardCache(cache_dir).clean_stale() == 1  # nobody holds its lock: its writer is dead
    assert not os.path.exists(stale)


def _sizes(root: str, name: str) -> int:
    ds = pyloader.ShardDataset(os.path.join(root, name))
    return sum(ds.shard_bytes)


@pytest.mark.timeout(60)
def test_limit_evicts_lru_but_never_a_shard_a_reader_needs(srv_root, server, cache_dir, monkeypatch):
    monkeypatch.setenv("PYLOADER_FETCH_DEADLINE", "2")  # how long a fetch waits for room in a full cache
    write_ds(os.path.join(srv_root, "ds2"), offset=5000)
    a, b = _sizes(srv_root, "ds"), _sizes(srv_root, "ds2")
    limit = max(a, b) + 4096  # room for one dataset at a time
    # Global shuffle: every shard of ds_a is in its working set until its epoch ends.
    ds_a = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir, cache_limit=limit, shuffle=True)
    it = ds_a.batches(32)
    got = [int(x) for x in next(it)["label"]]
    assert ds_a._fetcher.wait(timeout=20)
    ds_b = pyloader.ShardDataset(server.url + "/ds2", cache_dir=cache_dir, cache_limit=limit, shuffle=True)
    with pytest.raises(pyloader.ShardIOError, match="is full"):
        labels(ds_b)
    assert len(published(cache_dir)) >= len(ds_a.shard_paths)  # nothing ds_a needs was evicted
    got += [int(x) for bt in it for x in bt["label"]]
    assert sorted(got) == list(range(N_RECORDS))
    # ds_a's epoch is over: its shards are released (still cached, evictable), ds_a lives on.
    ds_b = pyloader.ShardDataset(server.url + "/ds2", cache_dir=cache_dir, cache_limit=limit)
    assert labels(ds_b) == list(range(5000, 5000 + N_RECORDS))
    assert ShardCache(cache_dir).usage() <= limit
    del ds_a, ds_b
    gc.collect()


@pytest.mark.timeout(30)
def test_limit_too_small_for_a_reader_fails_at_construction(server, cache_dir):
    with pytest.raises(CacheLimitError, match="needs at once"):
        pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir, cache_limit="2K")
    with pytest.raises(CacheLimitError, match="shuffle_mode='window'"):
        pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir, cache_limit="20K", shuffle=True)
    assert server.shard_gets() == {}


def _can_mount() -> bool:
    return os.geteuid() == 0 and os.path.exists("/bin/mount")


@contextlib.contextmanager
def _small_tmpfs(mnt, options: str, other_test: str):
    """A tmpfs mounted at ``mnt`` with ``options`` for the test's body; skipped where it cannot be."""
    if not _can_mount():
        pytest.skip(f"needs root to mount a small tmpfs; {other_test} covers the same path")
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.timeout(60)
def test_full_disk_tmpfs(server, tmp_path, monkeypatch):
    """A real ENOSPC: the cache on an 40 KB tmpfs (the dataset is ~100 KB)."""
    # A full cache is waited out (other readers may release) until the fetch deadline: a
    # short one, so the test does not wait 20 s for what it checks.
    monkeypatch.setenv("PYLOADER_FETCH_DEADLINE", "2")
    with _small_tmpfs(tmp_path / "small", "size=40k", "test_full_disk_rlimit") as mnt:
        ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=mnt, fetch_jobs=1)
        with pytest.raises(pyloader.ShardIOError, match="no space"):
            labels(ds)
        del ds
        gc.collect()
        time.sleep(0.2)
        assert temp_files(mnt) == []
        d = ShardCache(mnt).find(server.url + "/ds")
        ents = d.entries()
        assert 0 < len(ents) < 16 and all(verify_entry(d, e) is None for e in ents)


@pytest.mark.timeout(60)
def test_a_wait_for_room_in_a_full_cache_says_so(server, tmp_path, monkeypatch, caplog):
    """A full cache is waited out until the fetch deadline (others may release): the wait is
    reported on the "pyloader.remote" logger (at 5 s and every 30 s by default; shortened here)."""
    monkeypatch.setenv("PYLOADER_FETCH_DEADLINE", "2")
    monkeypatch.setattr(RoomWaits, "first_report_s", 0.3)
    monkeypatch.setattr(RoomWaits, "report_every_s", 0.6)
    with _small_tmpfs(tmp_path / "small", "size=40k", "none"):
        ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=str(tmp_path / "small"), fetch_jobs=1)
        with caplog.at_level(logging.WARNING, logger="pyloader.remote"):
            with pytest.raises(pyloader.ShardIOError, match="no space"):
                labels(ds)
        del ds
        gc.collect()
    reports = [r.getMessage() for r in caplog.records if r.name == "pyloader.remote"]
    assert 2 <= len(reports) <= 5, reports
    first = reports[0]
    assert str(tmp_path / "small") in first and "is full" in first and server.url + "/ds" in first, first
    assert "fails once it has waited 2 s" in first and "PYLOADER_FETCH_DEADLINE" in first, first
    assert "no space" in first and "cache_limit" in first, first


@pytest.mark.timeout(60)
def test_no_inodes_left_for_a_new_datasets_metadata(server, tmp_path):
    """A real ENOSPC while the cache writes a new dataset's directories and manifest copy (a
    tmpfs with a handful of inodes): a CacheError naming the path and what to do, not a bare OSError."""
    with _small_tmpfs(tmp_path / "few-inodes", "size=4m,nr_inodes=6", "test_a_failed_metadata_write_names_the_path") as mnt:
        with pytest.raises(pyloader.CacheError) as ei:
            pyloader.ShardDataset(server.url + "/ds", cache_dir=mnt)
        e = ei.value
        assert e.errno == errno.ENOSPC and mnt in str(e) and "no space or no inodes left" in str(e), e
        assert server.url + "/ds" in str(e), e
        assert temp_files(mnt) == []


@pytest.mark.timeout(60)
def test_full_disk_rlimit(server, cache_dir):
    """Always runs: a file-size limit makes the reservation of a big shard fail (EFBIG)."""
    code = f"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (5000, 5000))
import pyloader
ds = pyloader.ShardDataset({server.url + '/ds'!r}, cache_dir={cache_dir!r}, fetch_jobs=1)
try:
    sorted(int(x) for b in ds.batches(32) for x in b["label"])
except pyloader.ShardIOError as e:
    print("ERR", e)
    sys.exit(3)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=50)
    assert r.returncode == 3, r.stderr
    assert "no space" in r.stdout and "shard-0000" in r.stdout and "File too large" in r.stdout
    assert temp_files(cache_dir) == []
    d = ShardCache(cache_dir).find(server.url + "/ds")
    assert all(e.bytes <= 5000 and verify_entry(d, e) is None for e in d.entries())


@pytest.mark.timeout(60)
def test_read_only_cache_serves_cached_shards_and_names_missing_ones(server, srv_root, tmp_path):
    cache = str(tmp_path / "rocache")
    assert labels(pyloader.ShardDataset(server.url + "/ds", cache_dir=cache)) == list(range(N_RECORDS))
    write_ds(os.path.join(srv_root, "other"))
    gc.collect()
    if os.geteuid() == 0:
        subprocess.run(["mount", "--bind", cache, cache], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", cache, cache], check=True)
        undo = ["umount", "-l", cache]
    else:
        subprocess.run(["chmod", "-R", "a-w", cache], check=True)
        undo = ["chmod", "-R", "u+w", cache]
    try:
        before = dict(server.shard_gets())
        ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache)
        assert labels(ds) == list(range(N_RECORDS))
        assert server.shard_gets() == before
        # Nothing of "other" is cached, nor can be: the constructor says so (issue 40 item 12).
        with pytest.raises(pyloader.CacheError, match="cannot create .* give a writable one"):
            pyloader.ShardDataset(server.url + "/other", cache_dir=cache)
    finally:
        del ds
        gc.collect()
        subprocess.run(undo, check=True)


def test_parquet_dataset_goes_through_the_same_limit_check(tmp_path):
    """ParquetDataset binds its files with remote.fetch.open_remote, as ShardDataset binds
    its shards, and runs the same check: a limit below its plan's working set raises."""
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("pyarrow")
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    mem = fsspec.filesystem("memory")
    sizes = []
    for k in range(2):
        buf = io.BytesIO()
        pq.write_table(pa.table({"x": list(range(50 * k, 50 * k + 50))}), buf, row_group_size=10)
        mem.pipe(f"/pyl-limit/data/p{k}.parquet", buf.getvalue())
        sizes.append(len(buf.getvalue()))
    try:
        cache = str(tmp_path / "cache")
        with pytest.raises(CacheLimitError, match="1 files: those its plan reads at once"):
            pyloader.ParquetDataset("memory://pyl-limit/data", cache_dir=cache, cache_limit=max(sizes) - 1,
                                    rank=0, world_size=1)
        # Shuffled by a window wider than the data: both files at once, and the fix names the window.
        with pytest.raises(CacheLimitError, match="2 files: .*a smaller window"):
            pyloader.ParquetDataset("memory://pyl-limit/data", cache_dir=cache, cache_limit=sum(sizes) - 1,
                                    rank=0, world_size=1, shuffle=True)
        ds = pyloader.ParquetDataset("memory://pyl-limit/data", cache_dir=cache, cache_limit=sum(sizes),
                                     rank=0, world_size=1)
        assert [int(v) for b in ds.batches(32) for v in b["x"]] == list(range(100))
        # The cache binds the listing (no content hash); the resume fingerprint comes from
        # the files' footers (NOTE [parquet fingerprint]).
        assert ds._cache.manifest["content_hash"] is False and len(ds.fingerprint) == 16
    finally:
        mem.rm("/pyl-limit", recursive=True)
