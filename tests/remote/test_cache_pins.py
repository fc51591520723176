"""Pins of the node cache (NOTE [cache pins] in pyloader/remote/pins.py): one pin file
per dataset, no file descriptor per pinned shard, seen by evictors in other processes
and in the pinning process itself, not inherited across fork."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest
from remote_util import N_RECORDS, child_env, labels, published, write_ds, write_one_record_shards

import pyloader
from pyloader.errors import CacheError
from pyloader.remote import pins
from pyloader.remote.cache import ShardCache

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
N_SHARDS = 520


def _fds_on(path: str) -> int:
    """How many of this process's descriptors are open on ``path``."""
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{f}") == path
        except OSError:
            pass
    return n


def _evict_cli(cache_dir: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "pyloader", "cache", "evict", "--to", "0", "--cache-dir", cache_dir,
                        "--json"], capture_output=True, text=True, env=child_env(ROOT), timeout=60)
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)


_MANY_SHARDS_READER = """
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
import pyloader
from pyloader.remote.cache import ShardCache

url, cache = sys.argv[1:3]
def fds():
    return len(os.listdir("/proc/self/fd"))
ds = pyloader.ShardDataset(url, cache_dir=cache, fetch_jobs=4)
before = fds()
got = sorted(int(x) for b in ds.batches(16) for x in b["label"])
after = fds()
pin_fds = sum(1 for f in os.listdir("/proc/self/fd")
              if os.path.exists(f"/proc/self/fd/{f}") and os.readlink(f"/proc/self/fd/{f}").endswith("pins.lock"))
print(json.dumps({"labels_ok": got == list(range(len(ds.shard_paths))), "n": len(got), "before": before,
                  "after": after, "pin_fds": pin_fds, "stats": ShardCache(cache).stats()}), flush=True)
sys.stdin.readline()  # keeps the dataset, and so its pins, until told to go
"""


@pytest.mark.timeout(240)
def test_more_shards_than_open_files_read_with_one_pin_fd(srv_root, server, cache_dir):
    """520 one-record shards read under ``ulimit -n 64``: every one pinned at once, one fd for all."""
    write_one_record_shards(os.path.join(srv_root, "many"), N_SHARDS)
    p = subprocess.Popen([sys.executable, "-c", _MANY_SHARDS_READER, server.url + "/many", cache_dir],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=child_env(ROOT))
    try:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        out = json.loads(line)
        assert out["labels_ok"] and out["n"] == N_SHARDS
        assert out["pin_fds"] == 1  # all 520 pins of the dataset on one open file description
        assert out["after"] - out["before"] <= 8, out  # no fd per shard: not for pins, not for mappings
        assert out["stats"]["pinned_shards"] == N_SHARDS and out["stats"]["shards"] == N_SHARDS
        # Another process sees the pins: `pyloader cache evict` keeps every shard.
        assert ShardCache(cache_dir).stats()["pinned_shards"] == N_SHARDS
        r = _evict_cli(cache_dir)
        assert r["evicted"] == 0 and r["in_use_skipped"] == N_SHARDS
        assert len(published(cache_dir)) == N_SHARDS
    finally:
        p.communicate("go\n", timeout=60)
    assert p.returncode == 0
    # The reader exited: its pins went with it.
    assert ShardCache(cache_dir).stats()["pinned_shards"] == 0
    assert _evict_cli(cache_dir)["evicted"] == N_SHARDS
    assert published(cache_dir) == []


_PIN_HOLDER = """
import json, sys
from pyloader.remote.cache import ShardCache

cache, url, shards = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
d = ShardCache(cache).find(url)
for i in shards:
    d.pin(i)
print("pinned", flush=True)
for line in sys.stdin:
    if line.strip() == "unpin":
        d.unpin_all()
        print("unpinned", flush=True)
"""


@pytest.mark.timeout(120)
def test_pins_of_another_process_stop_evict_and_make_room(srv_root, server, cache_dir):
    url = server.url + "/ds"
    assert labels(pyloader.ShardDataset(url, cache_dir=cache_dir)) == list(range(N_RECORDS))
    d = ShardCache(cache_dir).find(url)
    n = len(d.shards)
    held = list(range(0, n, 2))
    with subprocess.Popen([sys.executable, "-c", _PIN_HOLDER, cache_dir, url, json.dumps(held)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(ROOT)) as p:
        assert p.stdout.readline().strip() == "pinned"
        assert ShardCache(cache_dir).stats()["pinned_shards"] == len(held)
        assert {i for i in range(n) if d.is_pinned(d.names[i])} == set(held)
        # make_room (a reader with a limit) evicts the others, then finds no room.
        limit = sum(int(d.shards[i]["bytes"]) for i in held) + 100
        cache = ShardCache(cache_dir, limit=limit)
        with cache.space_lock(), pytest.raises(CacheError, match="is full"):
            cache.make_room(1000, shard="x")
        assert {i for i in range(n) if d.is_published(i)} == set(held)
        # `pyloader cache evict` keeps them too.
        r = _evict_cli(cache_dir)
        assert r["evicted"] == 0 and r["in_use_skipped"] == len(held)
        p.stdin.write("unpin\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "unpinned"
        assert ShardCache(cache_dir).stats()["pinned_shards"] == 0
        assert _evict_cli(cache_dir)["evicted"] == len(held)
        assert published(cache_dir) == []
        p.stdin.close()
        assert p.wait(timeout=30) == 0


def _local_dataset_cache(tmp_path, cache_dir: str, n_records: int = N_RECORDS):
    """A DatasetCache of a dataset written locally (pins need no server); its shards published by hand."""
    src = write_ds(str(tmp_path / "src"), n=n_records)
    with open(os.path.join(src, "manifest.json"), "rb") as f:
        d = ShardCache(cache_dir).dataset("http://pins.invalid/ds", f.read())
    for i, s in enumerate(d.shards):
        with open(os.path.join(src, s["path"]), "rb") as f, open(d.shard_file(i), "wb") as g:
            g.write(f.read())
    return d


def test_evictor_in_the_pinning_process_sees_its_pins(tmp_path, cache_dir):
    d = _local_dataset_cache(tmp_path, cache_dir)
    n = len(d.shards)
    for i in range(n):
        d.pin(i)
    assert _fds_on(d._pins_path) == 1
    evicted, busy = ShardCache(cache_dir).evict(to_bytes=0)
    assert evicted == [] and len(busy) == n
    for i in range(0, n, 2):
        d.unpin(i)
    assert _fds_on(d._pins_path) == 1
    evicted, busy = ShardCache(cache_dir).evict(to_bytes=0)
    assert sorted(e.name for e in evicted) == sorted(d.names[i] for i in range(0, n, 2))
    assert sorted(e.name for e in busy) == sorted(d.names[i] for i in range(1, n, 2))
    d.unpin_all()
    assert _fds_on(d._pins_path) == 0  # the pin file is closed with the last pin
    assert ShardCache(cache_dir).stats()["pinned_shards"] == 0
    assert len(ShardCache(cache_dir).evict(to_bytes=0)[0]) == n - len(range(0, n, 2))


def test_two_objects_of_one_dataset_share_the_pin_file(tmp_path, cache_dir):
    a = _local_dataset_cache(tmp_path, cache_dir)
    b = ShardCache(cache_dir).find("http://pins.invalid/ds")
    a.pin(0)
    a.pin(0)  # idempotent per object
    b.pin(0)
    b.pin(1)
    assert _fds_on(a._pins_path) == 1
    a.unpin(0)
    assert a.is_pinned(a.names[0])  # b still holds it
    b.unpin(0)
    assert not a.is_pinned(a.names[0]) and a.is_pinned(a.names[1])
    b.unpin_all()
    assert not a.is_pinned(a.names[1]) and _fds_on(a._pins_path) == 0


def test_a_hash_collision_only_keeps_a_shard(tmp_path, cache_dir, monkeypatch):
    """Two names on one byte: the unpinned one looks pinned (kept), and both go once unpinned."""
    d = _local_dataset_cache(tmp_path, cache_dir)
    monkeypatch.setattr(pins, "pin_offset", lambda name: 12345)
    d.pin(0)
    assert d.is_pinned(d.names[1])
    evicted, _ = ShardCache(cache_dir).evict(to_bytes=0)
    assert evicted == [] and all(d.is_published(i) for i in range(len(d.shards)))
    d.unpin(0)
    assert len(ShardCache(cache_dir).evict(to_bytes=0)[0]) == len(d.shards)


_FORK = """
import json, os, sys
from pyloader.remote.cache import ShardCache

def fds_on(path):
    return sum(1 for f in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{f}") and os.readlink(f"/proc/self/fd/{f}") == path)

d = ShardCache(sys.argv[1]).find(sys.argv[2])
d.pin(0)
d.pin(1)
r, w = os.pipe()
pid = os.fork()  # a fresh interpreter: no other thread to warn about
if pid == 0:
    code = 1
    try:
        os.close(r)
        inherited = fds_on(d._pins_path)  # the parent's descriptor was closed at fork
        d.unpin_all()  # releases nothing of the parent's
        d.unpin(0)
        still = d.is_pinned(d.names[0]) and d.is_pinned(d.names[1])
        d.pin(2)
        os.write(w, json.dumps([inherited, still, fds_on(d._pins_path), d.is_pinned(d.names[2])]).encode())
        code = 0
    finally:
        os._exit(code)
os.close(w)
with os.fdopen(r) as f:
    child = json.loads(f.read())
_, status = os.waitpid(pid, 0)
after = [d.is_pinned(n) for n in d.names[:3]]
d.unpin_all()
print(json.dumps({"exit": os.waitstatus_to_exitcode(status), "child": child, "parent_after": after,
                  "parent_fds": fds_on(d._pins_path), "any_left": any(d.is_pinned(n) for n in d.names)}))
"""


def test_a_forked_child_holds_none_of_its_parents_pins(tmp_path, cache_dir):
    _local_dataset_cache(tmp_path, cache_dir)
    r = subprocess.run([sys.executable, "-c", _FORK, cache_dir, "http://pins.invalid/ds"], capture_output=True,
                       text=True, env=child_env(ROOT), timeout=60)
    assert r.returncode == 0, r.stderr
    # The child saw no inherited descriptor, kept the parent's pins, and pinned with its own
    # file; once it exited the parent still held 0 and 1, and 2 (the child's) was free.
    assert json.loads(r.stdout) == {"exit": 0, "child": [0, True, 1, True], "parent_after": [True, True, False],
                                    "parent_fds": 0, "any_left": False}


_FORK_MID_PIN = """
import os, signal, sys, threading, time
from pyloader.remote import pins
from pyloader.remote.cache import ShardCache
from pyloader.remote.locks import close_lockfile, open_lockfile

d = ShardCache(sys.argv[1]).find(sys.argv[2])
evictor = open_lockfile(d._pins_path)  # an evictor's own description, holding shard 0's byte
assert pins.lock_unpinned(evictor, d.names[0])
t = threading.Thread(target=d.pin, args=(0,))  # waits for the evictor, inside the pin's bookkeeping
t.start()
time.sleep(0.3)
pid = os.fork()
if pid == 0:
    code = 1
    try:
        signal.alarm(20)  # a child that hangs ends by SIGALRM
        d.pin(1)  # another shard: nothing in this process holds it
        code = 0 if d.is_pinned(d.names[1]) else 2
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
close_lockfile(evictor)
t.join(10)
print(os.waitstatus_to_exitcode(status), t.is_alive(), d.is_pinned(d.names[0]))
"""


def test_a_child_forked_while_a_thread_waits_to_pin_pins_at_once(tmp_path, cache_dir):
    """A thread of the parent waiting to pin (an evictor holds the byte) owns the pins' mutex
    at the fork; the child's own pins must not wait for that thread, which it does not have."""
    _local_dataset_cache(tmp_path, cache_dir)
    r = subprocess.run([sys.executable, "-c", _FORK_MID_PIN, cache_dir, "http://pins.invalid/ds"],
                       capture_output=True, text=True, env=child_env(ROOT), timeout=60)
    assert r.returncode == 0, r.stderr
    # the child pinned shard 1 (exit 0, not SIGALRM's -14); the parent's thread pinned shard 0
    # once the evictor let go
    assert r.stdout.split() == ["0", "False", "True"]


def test_clear_keeps_the_pin_file_while_pinned_and_a_pinner_follows_a_new_one(tmp_path, cache_dir):
    d = _local_dataset_cache(tmp_path, cache_dir)
    d.pin(0)
    removed, busy = ShardCache(cache_dir).clear()
    assert busy == 1 and os.path.exists(d._pins_path)
    d.unpin(0)
    ShardCache(cache_dir).clear()
    assert not os.path.exists(d.dir)
    # The dataset dir is gone; pinning and fetching make it again.
    dd = _local_dataset_cache(tmp_path, cache_dir)
    dd.pin(3)
    assert ShardCache(cache_dir).stats()["pinned_shards"] == 1
    assert ShardCache(cache_dir).evict(to_bytes=0)[1][0].name == dd.names[3]
    dd.unpin_all()


@pytest.mark.timeout(120)
def test_closing_one_reader_keeps_another_readers_pins(srv_root, server, cache_dir):
    """One dataset in two Mixtures: two fetchers over one DatasetCache.

    Dropping the first mixture (its fetcher closes) must leave every shard the second holds
    pinned, so `pyloader cache evict` (another process) removes none of them while the
    second reads on (NOTE [cache pins]).
    """
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir)
    keep = pyloader.Mixture([ds])
    kept = keep.batches(16)
    first = next(kept)
    gone = pyloader.Mixture([ds])
    it = gone.batches(16)
    next(it)
    held = ShardCache(cache_dir).stats()["pinned_shards"]
    assert held > 0
    it.close()
    del it, gone
    gc.collect()  # the first mixture's fetcher closes and drops its pins
    assert ShardCache(cache_dir).stats()["pinned_shards"] > 0  # the other mixture's pins stand
    r = _evict_cli(cache_dir)
    assert r["in_use_skipped"] > 0
    got = sorted(int(x) for b in [first, *kept] for x in b["label"])
    assert got == list(range(N_RECORDS))  # read to the end, no shard deleted under it
    kept.close()


_LOW_NOFILE_READER = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
import pyloader
from pyloader.remote.fetch import auto_fetch_jobs

url, cache = sys.argv[1:3]
ds = pyloader.ShardDataset(url, cache_dir=cache)  # fetch_jobs="auto"
jobs = auto_fetch_jobs(ds.shard_bytes)
got = sorted(int(x) for b in ds.batches(16) for x in b["label"])
print(json.dumps({"jobs": jobs, "labels_ok": got == list(range(len(ds.shard_paths))), "n": len(got)}), flush=True)
"""


@pytest.mark.timeout(240)
def test_auto_fetch_jobs_fit_the_open_file_limit(srv_root, server, cache_dir):
    """1,200 one-record shards (auto would take its maximum, 32 jobs of 4 descriptors) under ``ulimit -n 128``."""
    write_one_record_shards(os.path.join(srv_root, "many"), 1200)
    r = subprocess.run([sys.executable, "-c", _LOW_NOFILE_READER, server.url + "/many", cache_dir],
                       capture_output=True, text=True, env=child_env(ROOT), timeout=220)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["labels_ok"] and out["n"] == 1200
    assert 1 <= out["jobs"] < 32 and out["jobs"] * 4 < 128
