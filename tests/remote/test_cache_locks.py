"""The node cache without working locks (NOTE [cache publish] in pyloader/remote/cache.py):
readers on a filesystem where flock (and the pins' OFD locks) do nothing never crash and
never see a partial file; each writer removes only its own temp file, and temps of dead
writers are reclaimed by their owner's liveness; ``discard`` removes a bad copy only."""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import subprocess
import sys
import threading
import time

import pytest
from remote_servers import FaultServer
from remote_util import N_RECORDS, child_env, labels, temp_files

import pyloader
from pyloader.format.owner import owner
from pyloader.remote import locks, temps
from pyloader.remote.bad_copies import discard, verify_entry
from pyloader.remote.cache import ShardCache
from pyloader.remote.fetch import open_remote

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
READERS = 8

# Makes flock (and, with "ofd", the pins' OFD locks) do nothing, as on a filesystem without
# locks, before pyloader is imported.
_NO_LOCKS = """
import fcntl, struct, sys
fcntl.flock = lambda *a, **k: None
if "ofd" in sys.argv[1].split("+"):
    _real, _flock = fcntl.fcntl, struct.Struct("hhqqi0q")
    def _fcntl(fd, cmd, arg=0, *rest):
        if cmd == getattr(fcntl, "F_OFD_SETLK", 37):
            return arg
        if cmd == getattr(fcntl, "F_OFD_GETLK", 36):
            return _flock.pack(fcntl.F_UNLCK, 0, 0, 0, 0)
        return _real(fd, cmd, arg, *rest)
    fcntl.fcntl = _fcntl
"""

_READER = _NO_LOCKS + """
import json, os, time
sys.path.insert(0, sys.argv[4])
import numpy as np
import pyloader
from remote_util import sample

url, cache, ready = sys.argv[2], sys.argv[3], sys.argv[5]
ds = pyloader.ShardDataset(url, cache_dir=cache, fetch_jobs=2)
open(os.path.join(ready, str(os.getpid())), "w").close()
while not os.path.exists(os.path.join(ready, "go")):  # all readers start together
    time.sleep(0.01)
seen, bad = [], []
for b in ds.batches(32):
    for k, label in enumerate(int(x) for x in b["label"]):
        s = sample(label)
        n = int(b["tokens_lengths"][k])
        if not (np.array_equal(b["image"][k].numpy(), s["image"])
                and np.array_equal(b["tokens"][k, :n].numpy(), s["tokens"])):
            bad.append(label)
        seen.append(label)
print(json.dumps({"labels_ok": sorted(seen) == list(range(len(seen))), "n": len(seen), "bad": bad}), flush=True)
"""

# Evicts (where pins work) and reclaims stale temps in a loop until told to stop.
_CHURN = _NO_LOCKS + """
import os, time
from pyloader.remote.cache import ShardCache
cache, stop, evict = sys.argv[2], sys.argv[3], sys.argv[4] == "1"
evicted = reclaimed = 0
while True:
    last = os.path.exists(stop)
    c = ShardCache(cache)
    reclaimed += c.clean_stale()
    if evict:
        evicted += len(c.evict(to_bytes=0)[0])
    if last:
        break
    time.sleep(0.005)
print(evicted, reclaimed, flush=True)
"""


class _Watcher(threading.Thread):
    """Lists ``shards/`` over and over; records any file whose size is not its manifest's."""

    def __init__(self, dcache) -> None:
        super().__init__(daemon=True)
        self.sizes = dict(zip(dcache.names, (int(s["bytes"]) for s in dcache.shards)))
        self.dir = dcache.shard_dir
        self.stop = threading.Event()
        self.bad: list[tuple[str, int]] = []
        self.looks = 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                ents = list(os.scandir(self.dir))
            except FileNotFoundError:
                ents = []
            for e in ents:
                try:
                    size = e.stat().st_size
                except FileNotFoundError:
                    continue  # evicted between the listing and the stat
                if self.sizes.get(e.name) != size:
                    self.bad.append((e.name, size))
            self.looks += 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("broken", ["flock", "flock+ofd"])
def test_readers_without_working_locks(srv_root, cache_dir, tmp_path, broken):
    """8 processes read one remote dataset through one cache whose locks do nothing.

    With only flock broken the pins still work, so a process evicting in a loop meanwhile
    must not disturb the readers; with the pins broken too nothing is evicted (a reader
    may then find its shard gone before it maps it: the fetcher's business).
    """
    ready = tmp_path / "ready"
    ready.mkdir()
    stop = str(tmp_path / "stop")
    with FaultServer(srv_root, bandwidth=40_000, latency=0.01, max_life=200) as server:
        url = server.url + "/ds"
        watcher = _Watcher(open_remote(url, cache_dir=cache_dir))
        watcher.start()
        churn = subprocess.Popen([sys.executable, "-c", _CHURN, broken, cache_dir, stop,
                                  "1" if broken == "flock" else "0"], stdout=subprocess.PIPE, text=True,
                                 env=child_env(ROOT))
        procs = [subprocess.Popen([sys.executable, "-c", _READER, broken, url, cache_dir, HERE, str(ready)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(ROOT))
                 for _ in range(READERS)]
        try:
            deadline = time.monotonic() + 150
            while len(os.listdir(ready)) < READERS:
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
                time.sleep(0.02)
            (ready / "go").touch()
            results = [p.communicate(timeout=150) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
            open(stop, "w").close()
            churn_out = churn.communicate(timeout=60)[0]
            watcher.stop.set()
            watcher.join()
        errors = [err for p, (_, err) in zip(procs, results) if p.returncode != 0]
        assert errors == []
        assert [json.loads(out) for out, _ in results] == [{"labels_ok": True, "n": N_RECORDS, "bad": []}] * READERS
        gets = server.shard_gets()
    assert churn.returncode == 0
    evicted, reclaimed = map(int, churn_out.split())
    assert reclaimed == 0  # every temp it saw had a live writer
    assert watcher.looks > 0 and watcher.bad == []  # never a partial or foreign file under shards/
    assert temp_files(cache_dir) == []
    assert max(gets.values()) > 1, gets  # the locks really did nothing: shards were downloaded in parallel
    d = ShardCache(cache_dir).find(url)
    assert all(verify_entry(d, e) is None for e in d.entries())
    if broken == "flock":
        assert evicted > 0  # its last pass, at least, once the readers were gone


def test_filesystem_without_locks_reads(server, cache_dir, monkeypatch):
    """flock and the OFD locks fail with ENOLCK/EINVAL (no locks there): the cache runs without."""
    def no_flock(*a, **k):
        raise OSError(errno.ENOLCK, "No locks available")

    real = fcntl.fcntl

    def no_ofd(fd, cmd, arg=0, *rest):
        if cmd in (locks._F_OFD_SETLK, locks._F_OFD_GETLK):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg, *rest)

    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(fcntl, "fcntl", no_ofd)
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir)
    assert labels(ds) == list(range(N_RECORDS))
    assert ShardCache(cache_dir).stats()["pinned_shards"] == 0  # nothing can tell
    del ds


# -- temp files of dead and live writers -----------------------------------------------------
_MAKE_TEMP = """
import os, sys
from pyloader.remote.temps import new_temp_name
path = os.path.join(sys.argv[1], new_temp_name(sys.argv[2]))
with open(path, "wb") as f:
    f.write(b"partial")
print(path, flush=True)
if sys.argv[3] == "wait":
    sys.stdin.readline()
"""


def _temp_by_child(tmp_dir: str, name: str, wait: bool) -> tuple[str, subprocess.Popen]:
    p = subprocess.Popen([sys.executable, "-c", _MAKE_TEMP, tmp_dir, name, "wait" if wait else "exit"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(ROOT))
    path = p.stdout.readline().strip()
    assert os.path.exists(path)
    if not wait:
        p.communicate(timeout=30)  # reaped: its pid is gone
    return path, p


@pytest.mark.timeout(60)
def test_temps_are_reclaimed_by_their_writers_liveness(server, cache_dir):
    d = open_remote(server.url + "/ds", cache_dir=cache_dir)
    name = d.names[2]
    host, boot, ns = owner().split("-")
    dead, _ = _temp_by_child(d.tmp_dir, name, wait=False)
    live, live_proc = _temp_by_child(d.tmp_dir, d.names[3], wait=True)
    old = time.time() - 2 * temps.STALE_TEMP_S

    def fake(owner: str, pid: int, tag: str, mtime: float | None = None) -> str:
        p = os.path.join(d.tmp_dir, f"{name}.{owner}.{pid}.{tag}.part")
        with open(p, "wb") as f:
            f.write(b"x")
        if mtime is not None:
            os.utime(p, (mtime, mtime))
        return p

    kept = {
        live,
        fake(owner(), os.getpid(), "00000001"),  # this process: alive
        fake(f"otherhost-0123456789abcdef-{ns}", 4242, "00000002"),  # another host: too young to judge
        fake(f"{host}-{boot}-{int(ns) + 1}", 999999, "00000003"),  # another pid namespace here: cannot check
        os.path.join(d.tmp_dir, "unrecognised.part"),
    }
    open(os.path.join(d.tmp_dir, "unrecognised.part"), "wb").close()
    other_boot = "f" * 16 if boot != "f" * 16 else "e" * 16
    gone = {
        dead,
        fake(f"otherhost-0123456789abcdef-{ns}", 4242, "00000004", old),  # another host, an hour idle
        fake(f"{host}-{other_boot}-{ns}", os.getpid(), "00000005"),  # an earlier boot of this host
        fake(owner(), 999999, "00000006"),  # this boot and namespace, no such pid
    }
    assert ShardCache(cache_dir).stats()["temp_files"] == len(kept) + len(gone)
    assert ShardCache(cache_dir).clean_stale() == len(gone)
    assert set(temp_files(cache_dir)) == kept
    # A download of shard 3 leaves the live writer's temp of shard 3 alone.
    assert d.ensure(3)[1] and os.path.exists(live)
    live_proc.communicate("go\n", timeout=30)
    assert ShardCache(cache_dir).clean_stale() == 1 and not os.path.exists(live)
    for p in kept - {live}:
        os.unlink(p)


@pytest.mark.timeout(60)
def test_a_writer_whose_temp_is_removed_downloads_again(server, cache_dir, monkeypatch):
    d = open_remote(server.url + "/ds", cache_dir=cache_dir)
    transport = d.transport()
    real, calls = transport.download_into, []

    def download_then_lose_the_temp(fd, *a, **k):
        real(fd, *a, **k)
        calls.append(fd)
        if len(calls) == 1:  # as if another process judged it stale
            for n in os.listdir(d.tmp_dir):
                os.unlink(os.path.join(d.tmp_dir, n))

    monkeypatch.setattr(transport, "download_into", download_then_lose_the_temp)
    assert d.ensure(5) == (d.shard_file(5), True)
    assert len(calls) == 2 and verify_entry(d, next(e for e in d.entries() if e.name == d.names[5])) is None
    assert temp_files(cache_dir) == []


# -- discard ---------------------------------------------------------------------------------
def _corrupt(path: str) -> None:
    """Flips one byte in place: same inode, same size."""
    with open(path, "r+b") as f:
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.timeout(60)
def test_discard_a_corrupt_copy_then_fetch_it_again(server, cache_dir):
    d = open_remote(server.url + "/ds", cache_dir=cache_dir)
    path, _ = d.ensure(4)
    _corrupt(path)
    assert d.is_published(4)  # the right size: only its checksum tells
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        before = bytes(mm)
        assert discard(d, 4, reason="xxh64 mismatch in record 0", expect=os.fstat(f.fileno()))
        assert not d.is_published(4)
        assert bytes(mm) == before  # a mapper keeps its inode
    assert d.ensure(4) == (path, True)
    assert verify_entry(d, next(e for e in d.entries() if e.name == d.names[4])) is None
    assert server.count("ds/" + d.shards[4]["path"]) == 2
    with open(os.path.join(d.dir, "discarded.log")) as f:
        log = f.read().splitlines()
    assert len(log) == 1 and d.names[4] in log[0] and "xxh64 mismatch in record 0" in log[0]


@pytest.mark.timeout(60)
def test_discard_leaves_a_copy_published_since(server, cache_dir):
    d = open_remote(server.url + "/ds", cache_dir=cache_dir)
    path, _ = d.ensure(6)
    _corrupt(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        assert discard(d, 6, reason="bad", expect=fd)  # removed by one reader...
        assert d.ensure(6)[1]  # ...and published again
        # A second reader that saw the same bad copy: the good new one stays.
        assert not discard(d, 6, reason="bad", expect=fd)
        assert not discard(d, 6, reason="bad", expect=st)
        assert not discard(d, 6, reason="bad", expect=(st.st_dev, st.st_ino))
        assert d.is_published(6)
    finally:
        os.close(fd)
    # Without expect the copy is checked first: a good one stays, a bad one goes.
    assert not discard(d, 6, reason="suspect")
    _corrupt(path)
    assert discard(d, 6, reason="suspect") and not d.is_published(6)
    assert not discard(d, 6, reason="gone already")
    assert d.ensure(6)[1]
