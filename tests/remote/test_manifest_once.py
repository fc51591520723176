"""A remote manifest is fetched once per node: NOTE [manifest once per node] in pyloader.remote.manifest."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest
from remote_servers import Fault
from remote_util import N_RECORDS, child_env, labels, write_ds

import pyloader
from pyloader import _C
from pyloader.format.spec import MANIFEST_NAME, dump_manifest, parse_manifest
from pyloader.remote import manifest as _manifest
from pyloader.remote.cache import ShardCache, dataset_key
from pyloader.remote.fetch import open_remote
from pyloader.remote.fs import RetryPolicy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MANIFEST = "ds/" + MANIFEST_NAME


def copy_path(cache_dir: str, url: str) -> str:
    return os.path.join(ShardCache(cache_dir).root, dataset_key(url), MANIFEST_NAME)


def new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on this process opens URLs as a process that never opened them would."""
    monkeypatch.setattr(_manifest, "_opened", set())


@pytest.mark.timeout(120)
def test_eight_processes_opening_together_send_one_get(server, cache_dir, tmp_path):
    server.latency = 0.3  # the first fetch is still running when the others look for the copy
    go = tmp_path / "go"
    code = f"""
import json, os, sys, time
import pyloader
open({str(tmp_path)!r} + f"/ready-{{os.getpid()}}", "w").close()
while not os.path.exists({str(go)!r}):
    time.sleep(0.005)
ds = pyloader.ShardDataset({server.url + "/ds"!r}, cache_dir={cache_dir!r})
print(json.dumps([ds.fingerprint, ds.num_records]))
"""
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=child_env(ROOT)) for _ in range(8)]
    try:
        deadline = time.monotonic() + 90
        while len([p for p in os.listdir(tmp_path) if p.startswith("ready-")]) < 8:
            assert time.monotonic() < deadline, "the processes did not start"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.02)
        go.touch()
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    results = {out.strip() for out, _ in outs}
    assert len(results) == 1 and f", {N_RECORDS}]" in results.pop()  # the same manifest everywhere
    assert server.count(MANIFEST) == 1


@pytest.mark.timeout(60)
def test_a_new_process_within_the_ttl_reuses_the_copy_and_later_fetches_again(server, srv_root, cache_dir,
                                                                               monkeypatch):
    url = server.url + "/ds"
    first = open_remote(url, cache_dir=cache_dir)
    assert server.count(MANIFEST) == 1
    new_process(monkeypatch)
    again = open_remote(url, cache_dir=cache_dir)
    assert server.count(MANIFEST) == 1 and again.manifest_bytes == first.manifest_bytes
    # The dataset is rewritten; a job started after the TTL sees it.
    write_ds(os.path.join(srv_root, "ds"), offset=1000)
    copy = copy_path(cache_dir, url)
    old = time.time() - _manifest.DEFAULT_TTL_S - 1
    os.utime(copy, (old, old))
    new_process(monkeypatch)
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir)
    assert server.count(MANIFEST) == 2
    assert labels(ds) == list(range(1000, 1000 + N_RECORDS))
    with open(copy, "rb") as f:
        assert f.read() == ds._remote.manifest_bytes  # the copy was replaced by what was fetched
    assert abs(time.time() - os.stat(copy).st_mtime) < 30


@pytest.mark.timeout(60)
def test_a_process_that_opens_a_url_again_fetches_again(server, cache_dir):
    url = server.url + "/ds"
    for n in (1, 2, 3):
        open_remote(url, cache_dir=cache_dir)
        assert server.count(MANIFEST) == n


@pytest.mark.timeout(60)
def test_an_unchanged_manifest_refetched_only_renews_the_copy(server, cache_dir, monkeypatch):
    url = server.url + "/ds"
    open_remote(url, cache_dir=cache_dir)
    copy = copy_path(cache_dir, url)
    ino = os.stat(copy).st_ino
    old = time.time() - 3600
    os.utime(copy, (old, old))
    new_process(monkeypatch)
    open_remote(url, cache_dir=cache_dir)
    assert server.count(MANIFEST) == 2
    st = os.stat(copy)
    assert st.st_ino == ino and abs(time.time() - st.st_mtime) < 30


@pytest.mark.timeout(60)
def test_ttl_zero_fetches_every_time_and_bad_values_are_named(server, cache_dir, monkeypatch):
    url = server.url + "/ds"
    monkeypatch.setenv(_manifest.TTL_ENV, "0")
    for n in (1, 2):
        new_process(monkeypatch)
        open_remote(url, cache_dir=cache_dir)
        assert server.count(MANIFEST) == n
    monkeypatch.setenv(_manifest.TTL_ENV, "2.5")
    assert _manifest.manifest_ttl() == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(_manifest.TTL_ENV, bad)
        with pytest.raises(ValueError, match=f"PYLOADER_MANIFEST_TTL must be .*{bad}"):
            open_remote(url, cache_dir=cache_dir)


@pytest.mark.timeout(60)
def test_a_damaged_copy_is_fetched_again_and_repaired(server, cache_dir, monkeypatch):
    url = server.url + "/ds"
    good = open_remote(url, cache_dir=cache_dir).manifest_bytes
    copy = copy_path(cache_dir, url)
    with open(copy, "r+b") as f:  # a flipped byte in the body; the mtime stays fresh
        f.seek(len(good) // 2)
        b = f.read(1)
        f.seek(len(good) // 2)
        f.write(bytes([b[0] ^ 0x20]))
    new_process(monkeypatch)
    assert open_remote(url, cache_dir=cache_dir).manifest_bytes == good
    assert server.count(MANIFEST) == 2
    with open(copy, "rb") as f:
        assert f.read() == good


@pytest.mark.timeout(60)
def test_a_corrupt_manifest_from_the_server_is_never_stored(server, cache_dir, monkeypatch):
    url = server.url + "/ds"
    good = open_remote(url, cache_dir=cache_dir).manifest_bytes
    copy = copy_path(cache_dir, url)
    old = time.time() - 3600
    os.utime(copy, (old, old))
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x20
    server.inject(MANIFEST, Fault("replace", data=bytes(bad), times=None))
    new_process(monkeypatch)
    with pytest.raises(pyloader.ManifestError, match=f"{MANIFEST}.*checksum mismatch"):
        open_remote(url, cache_dir=cache_dir)
    with open(copy, "rb") as f:
        assert f.read() == good  # the old copy, still stale: the next process fetches again


@pytest.mark.timeout(60)
def test_readers_never_see_a_partial_copy(server, cache_dir, monkeypatch):
    """A copy rewritten over and over while processes start: each reads one whole copy, no GET."""
    url = server.url + "/ds"
    a = open_remote(url, cache_dir=cache_dir).manifest_bytes
    body = parse_manifest(a, "a", _C.xxh64)
    body["shards"] = body["shards"] * 40  # another manifest, and one large enough to be read in pieces
    body["records"] *= 40
    b = dump_manifest(body, _C.xxh64)
    copy = copy_path(cache_dir, url)
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            for data in (b, a):
                _manifest._store(copy, data)

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        seen: set[bytes] = set()
        reads, deadline = 0, time.monotonic() + 30
        # At least 300 reads, and on until both copies were seen: which copy a read meets
        # depends on how the GIL switches between this thread and the writer.
        while reads < 300 or (len(seen) < 2 and reads < 5000 and time.monotonic() < deadline):
            reads += 1
            new_process(monkeypatch)
            data = _manifest.node_manifest(url, ShardCache(cache_dir).root, None, RetryPolicy.from_env())
            assert data in (a, b)
            seen.add(data)
    finally:
        stop.set()
        writer.join()
    assert server.count(MANIFEST) == 1, "a reader saw a partial copy and fetched"
    assert seen == {a, b}


@pytest.mark.timeout(60)
def test_a_lock_held_too_long_falls_back_to_a_direct_fetch(server, cache_dir, monkeypatch):
    url = server.url + "/ds"
    open_remote(url, cache_dir=cache_dir)
    copy = copy_path(cache_dir, url)
    old = time.time() - 3600
    os.utime(copy, (old, old))
    lock = os.path.join(os.path.dirname(copy), "locks", MANIFEST_NAME + ".lock")
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a holder that hangs (its own open file description)
    try:
        monkeypatch.setenv("PYLOADER_FETCH_DEADLINE", "0.3")
        monkeypatch.setenv("PYLOADER_FETCH_THROTTLE_DEADLINE", "0.2")
        monkeypatch.setenv("PYLOADER_FETCH_STALL_TIMEOUT", "0.05")
        new_process(monkeypatch)
        t0 = time.monotonic()
        open_remote(url, cache_dir=cache_dir)
        assert 0.3 <= time.monotonic() - t0 < 10
        assert server.count(MANIFEST) == 2
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_a_cache_that_cannot_hold_the_copy_fetches_directly(server, tmp_path):
    url = server.url + "/ds"
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    policy = RetryPolicy.from_env()
    for n in (1, 2):  # nothing can be stored under a regular file: every open fetches
        data = _manifest.node_manifest(url, str(blocker / "v1"), None, policy)
        assert server.count(MANIFEST) == n
    assert parse_manifest(data, "m", _C.xxh64)["records"] == N_RECORDS


@pytest.mark.timeout(60)
def test_a_read_only_cache_uses_a_fresh_copy_and_fetches_past_it(server, tmp_path, monkeypatch):
    url = server.url + "/ds"
    cache = str(tmp_path / "rocache")
    good = open_remote(url, cache_dir=cache).manifest_bytes
    if os.geteuid() == 0:
        subprocess.run(["mount", "--bind", cache, cache], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", cache, cache], check=True)
        undo = ["umount", "-l", cache]
    else:
        subprocess.run(["chmod", "-R", "a-w", cache], check=True)
        undo = ["chmod", "-R", "u+w", cache]
    try:
        new_process(monkeypatch)
        assert open_remote(url, cache_dir=cache).manifest_bytes == good
        assert server.count(MANIFEST) == 1
        monkeypatch.setenv(_manifest.TTL_ENV, "1e-9")  # the copy is stale now
        new_process(monkeypatch)
        assert open_remote(url, cache_dir=cache).manifest_bytes == good
        assert server.count(MANIFEST) == 2
    finally:
        subprocess.run(undo, check=True)
