"""The node cache's shared index (NOTE [cache index] in pyloader/remote/index.py): processes
sharing one cache under a limit, a corrupt or hostile index, a process killed mid-download or
mid-append, files removed behind the cache's back, and LRU order as the directory says."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from remote_servers import Fault
from remote_util import child_env, published, temp_files

import pyloader._C as _C
from pyloader.remote import index as index_mod
from pyloader.remote.cache import ShardCache
from pyloader.remote.fetch import open_remote
from pyloader.remote.index import INDEX_FILE, index_for

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

_WORKER = """
import json, os, sys, time
from pyloader.remote.fetch import open_remote
url, cache, limit, seed, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
d = open_remote(url, cache_dir=cache, cache_limit=limit)
n = len(d.shards)
order = [(seed * 7 + k * (seed + 3)) % n for k in range(n * rounds)]
downloaded = 0
for i in order:
    while True:
        try:
            path, new = d.acquire(i)  # pinned while its bytes are checked
            break
        except OSError as e:  # every other shard pinned by the others at this instant
            if "is full" not in str(e):
                raise
            time.sleep(0.01)
    try:
        with open(path, "rb") as f:
            fd = f.fileno()
            assert d.content_problem(fd, d.shards[i]["bytes"], i) is None, i
    finally:
        d.unpin(i)
    downloaded += new
print(json.dumps({"downloaded": downloaded}))
"""


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _listed(cache: ShardCache) -> tuple[int, int]:
    """(published bytes, temp bytes) from a listing of the directory."""
    return sum(e.bytes for e in cache.entries()), sum(s for _, _, s in cache.temp_files())


def _index_matches_directory(cache: ShardCache) -> None:
    """Under the space lock, with nothing in flight: the index counts what the directory holds."""
    with cache.space_lock():
        idx, _ = cache._index()
        idx.resolve_pending()
        idx.commit()
        pub, tmp = _listed(cache)
        assert idx.used == pub + tmp, (idx.used, pub, tmp)
        assert idx.shards == len(cache.entries())


def _sizes(d) -> list[int]:
    return [int(s["bytes"]) for s in d.shards]


@pytest.mark.timeout(180)
def test_processes_share_one_index_under_a_limit(server, cache_dir):
    url = server.url + "/ds"
    d = open_remote(url, cache_dir=cache_dir)
    sizes = _sizes(d)
    limit = sum(sorted(sizes)[-6:])  # six of the sixteen shards at most
    cache = ShardCache(cache_dir, limit=limit)
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, url, cache_dir, str(limit), str(k), "3"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(ROOT))
             for k in range(3)]
    worst_published = worst_total = 0
    deadline = time.monotonic() + 150
    while any(p.poll() is None for p in procs):
        assert time.monotonic() < deadline
        with cache.space_lock():  # no reservation or eviction meanwhile: published bytes are exact
            pub, tmp = _listed(cache)
        worst_published, worst_total = max(worst_published, pub), max(worst_total, pub + tmp)
        time.sleep(0.005)
    outs = [p.communicate(timeout=30) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    downloads = sum(json.loads(o[0])["downloaded"] for o in outs)
    assert downloads > 16  # evictions made them download again: the limit was hit
    assert worst_published <= limit, (worst_published, limit)
    # Temps are listed before shards: one renamed in between counts twice in a listing.
    assert worst_total <= limit + max(sizes), (worst_total, limit)
    assert sum(_listed(cache)) <= limit
    _index_matches_directory(cache)


@pytest.mark.timeout(60)
def test_corrupt_index_is_rebuilt_from_the_directory(server, cache_dir):
    d = open_remote(server.url + "/ds", cache_dir=cache_dir, cache_limit="1M")
    for i in range(8):
        d.ensure(i)
    cache = ShardCache(cache_dir, limit="1M")
    path = os.path.join(cache.root, INDEX_FILE)
    good = _read(path)
    assert good.startswith(b"H pyloader-cache-index ") and good.count(b"\nR ") == 8
    for bad in (b"garbage\x00\xff" * 100,  # not an index
                good[:40] + b"X" + good[41:],  # a header that fails its checksum
                good.replace(b" 1 ", b" 7 ", 1),  # a flipped field under a stale checksum
                b"",  # empty
                good + good):  # a second header in the journal
        with open(path, "wb") as f:
            f.write(bad)
        index_for(cache.root)._reset()  # as a process that reads it for the first time
        for i in range(8, 16):
            d.ensure(i)
        _index_matches_directory(cache)
        d.ensure(0)
        for i in range(8, 16):
            os.unlink(d.shard_file(i))
        good = _read(path)
    # Not a regular file: a directory, then a link to a file outside the cache.
    os.unlink(path)
    os.mkdir(path)
    _index_matches_directory(cache)
    os.rmdir(path)
    outside = os.path.join(os.path.dirname(cache_dir), "outside-index")
    with open(outside, "wb") as f:
        f.write(b"keep")
    os.symlink(outside, path)
    _index_matches_directory(cache)
    assert _read(outside) == b"keep"
    assert not os.path.islink(path)


def _forged(line: bytes) -> bytes:
    return line + b" %016x\n" % _C.xxh64(line)


@pytest.mark.timeout(60)
def test_hostile_index_never_removes_a_file_outside_the_cache(server, cache_dir, tmp_path):
    d = open_remote(server.url + "/ds", cache_dir=cache_dir)
    size = _sizes(d)
    cache = ShardCache(cache_dir, limit=sum(size) + 10)
    for i in range(16):
        d.ensure(i)
    with cache.space_lock():
        cache._index()
    victims = tmp_path / "victims"
    (victims / "shards").mkdir(parents=True)
    (victims / "locks").mkdir()
    (victims / "shards" / "victim").write_bytes(b"v" * 10)
    st = os.stat(victims / "shards" / "victim")
    (tmp_path / "victim2").write_bytes(b"w")
    os.symlink(victims, os.path.join(cache.root, "feedfeedfeedfeed"))  # a planted dataset dir
    path = os.path.join(cache.root, INDEX_FILE)
    for i in range(4):  # room to make: the planted entries are the oldest of all and come first
        os.unlink(d.shard_file(i))
    for line in (b"A feedfeedfeedfeed victim 10 %d %d 0" % (st.st_mtime_ns, st.st_ino),  # through a planted link
                 b"A " + d.key.encode() + b" !..%2F..%2F..%2Fvictim2 10 1 1 0"):  # a name that climbs out
        with open(path, "ab") as f:
            f.write(_forged(line))
        with cache.space_lock():
            cache.make_room(size[0] + 200, shard="x")
    assert (victims / "shards" / "victim").read_bytes() == b"v" * 10
    assert (tmp_path / "victim2").read_bytes() == b"w"
    os.unlink(os.path.join(cache.root, "feedfeedfeedfeed"))
    _index_matches_directory(cache)
    # A hostile count: the index says the cache is empty; a rebuild is never needed for
    # correctness of paths, and the next listing (REFRESH_S) brings the truth back.
    with open(path, "ab") as f:
        f.write(_forged(b"A " + d.key.encode() + b" huge 1125899906842623 1 1 1"))  # 2^50 - 1 bytes
    with cache.space_lock():
        cache.make_room(100, shard="y")  # the huge phantom is not on disk: dropped, room made
    _index_matches_directory(cache)


@pytest.mark.timeout(90)
def test_a_killed_downloader_and_a_torn_line_leave_no_lasting_drift(server, cache_dir):
    url = server.url + "/ds"
    d = open_remote(url, cache_dir=cache_dir)
    sizes = _sizes(d)
    limit = sum(sizes) + 10
    server.inject("ds/shard-000003.pyl", Fault("stall", seconds=30))
    env = child_env(ROOT)
    env["PYLOADER_FETCH_STALL_TIMEOUT"] = "30"
    code = ("import sys\nfrom pyloader.remote.fetch import open_remote\n"
            "d = open_remote(sys.argv[1], cache_dir=sys.argv[2], cache_limit=int(sys.argv[3]))\n"
            "d.ensure(0); d.ensure(3)\n")
    p = subprocess.Popen([sys.executable, "-c", code, url, cache_dir, str(limit)], env=env)
    deadline = time.monotonic() + 30
    while not any("shard-000003" in t for t in temp_files(cache_dir)):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    cache = ShardCache(cache_dir, limit=limit)
    path = os.path.join(cache.root, INDEX_FILE)
    before = _read(path)
    assert before.count(b"\nR ") == 2  # its reservation outlives it...
    with open(path, "ab") as f:  # ...and so does half a line, as from a kill mid-append
        f.write(b"A " + d.key.encode() + b" shard-0000")
    index_for(cache.root)._reset()  # as a process that reads it for the first time
    with cache.space_lock():
        cache.make_room(10, shard="z")
    after = _read(path)
    assert after.startswith(before) and after.endswith(b"\n")  # the torn line was cut, the journal kept
    for line in after.split(b"\n")[:-1]:
        body, digest = line.rsplit(b" ", 1)
        assert _C.xxh64(body) == int(digest, 16), line
    d = open_remote(url, cache_dir=cache_dir, cache_limit=limit)
    for i in range(16):  # fills the cache to its limit: the dead temp must not count
        d.ensure(i)
    assert temp_files(cache_dir) == []
    with cache.space_lock():
        cache.make_room(10, shard="z")
    assert len(published(cache_dir)) == 16
    _index_matches_directory(cache)


@pytest.mark.timeout(60)
def test_files_removed_behind_the_cache_are_not_counted(server, cache_dir, monkeypatch):
    d = open_remote(server.url + "/ds", cache_dir=cache_dir)
    sizes = _sizes(d)
    cache = ShardCache(cache_dir, limit=sum(sizes))
    for i in range(16):
        d.ensure(i)
    with cache.space_lock():
        cache._index()
    for i in (0, 1, 2):
        os.unlink(d.shard_file(i))  # a person, or a bad copy discarded
    for i in range(3, 16):
        d.pin(i)  # everything else in use: only the vanished files can make room
    try:
        with cache.space_lock():
            cache.make_room(sizes[0] + sizes[1] + sizes[2], shard="x")
        assert len(published(cache_dir)) == 13
        # A file added by hand is outside the protocol: seen at the next listing, REFRESH_S later.
        with open(d.shard_file(0), "wb") as f:
            f.write(b"\0" * sizes[0])
        with cache.space_lock():
            idx, listed = cache._index()
            assert not listed and idx.used == sum(sizes[3:])
        monkeypatch.setattr(index_mod, "REFRESH_S", 0.0)
        with cache.space_lock():
            idx, listed = cache._index()
            assert listed and idx.used == sum(sizes[3:]) + sizes[0]
        _index_matches_directory(cache)
    finally:
        d.unpin_all()


@pytest.mark.timeout(60)
def test_eviction_order_is_the_directorys(tmp_path, cache_dir):
    """Unreferenced first, then least recently used, as a listing sorts them, pins' touches included."""
    from test_cache_pins import _local_dataset_cache

    d = _local_dataset_cache(tmp_path, cache_dir)
    n = len(d.shards)
    old = time.time_ns() - 10**12
    for i, k in enumerate(random.Random(0).sample(range(n), n)):  # a known order, not the publishing order
        t = old + (20 + k) * 10**9
        os.utime(d.shard_file(i), ns=(t, t))
    for k in range(3):  # shards of an older manifest: evicted first, oldest first
        p = os.path.join(d.shard_dir, f"gone-{k}.pyl.{k:016x}")
        with open(p, "wb") as f:
            f.write(b"x" * 100)
        os.utime(p, ns=(old + (10 - k) * 10**9,) * 2)
    cache = ShardCache(cache_dir, limit=10**9)
    with cache.space_lock():
        cache._index()  # listed now; the touches below happen after
    for i in (0, 1, 2):
        d.pin(i)  # a reader's use: its mtime moves to now
        d.unpin(i)
    got = []
    while cache.entries():
        expect = sorted(cache.entries(), key=lambda e: (e.referenced, e.mtime_ns))[0].name
        used = sum(_listed(cache))
        small = ShardCache(cache_dir, limit=used)
        with small.space_lock():
            small.make_room(1, shard="x")  # one byte over: exactly one shard goes
        left = {e.name for e in cache.entries()}
        gone = [e for e in [expect] if e not in left]
        assert gone == [expect], (expect, len(left))
        got.append(expect)
    assert got[:3] == [f"gone-{k}.pyl.{k:016x}" for k in (2, 1, 0)]
    assert got[-3:] == [d.names[i] for i in (0, 1, 2)]


@pytest.mark.timeout(90)
def test_a_listing_taken_ahead_of_the_lock_keeps_what_others_wrote_meanwhile(server, cache_dir, monkeypatch):
    url = server.url + "/ds"
    d = open_remote(url, cache_dir=cache_dir)
    sizes = _sizes(d)
    limit = sum(sizes) + 10
    cache = ShardCache(cache_dir, limit=limit)
    for i in range(8):
        d.ensure(i)
    with cache.space_lock():
        idx, _ = cache._index()
    with open(d.shard_file(15), "wb") as f:  # outside the protocol: only a listing sees it
        f.write(b"\0" * sizes[15])
    monkeypatch.setattr(index_mod, "REFRESH_S", 0.2)
    time.sleep(0.3)
    assert idx.refresh_due()
    index_for(cache.root).ahead(cache._listing)  # lists the directory without the lock
    assert idx._refresh is not None
    # Another process downloads meanwhile (its index is fresh by the default REFRESH_S).
    code = ("import sys\nfrom pyloader.remote.fetch import open_remote\n"
            "d = open_remote(sys.argv[1], cache_dir=sys.argv[2], cache_limit=int(sys.argv[3]))\n"
            "d.ensure(9); d.ensure(10)\n")
    subprocess.run([sys.executable, "-c", code, url, cache_dir, str(limit)], env=child_env(ROOT), check=True,
                   timeout=60)
    monkeypatch.setattr(index_mod, "REFRESH_S", 600.0)
    with cache.space_lock():
        idx, listed = cache._index()
        assert not listed and idx._refresh is None  # the listing taken ahead was adopted
        head = _read(os.path.join(cache.root, INDEX_FILE)).split(b"\n", 1)[0]
        assert int(head.split(b" ")[5]) == idx.scanned_at_ns
    assert _read(os.path.join(cache.root, INDEX_FILE)).count(b"\nR ") >= 2  # the other's lines, replayed
    _index_matches_directory(cache)
    assert idx.shards == 11
