"""Remote datasets over a loopback HTTP server through fsspec: reads, faults, retries."""

from __future__ import annotations

import os
import time

import pytest
from remote_servers import Fault
from remote_util import N_RECORDS, labels, published, write_ds

import pyloader
from pyloader.errors import RemoteCorruptError
from pyloader.remote.bad_copies import verify_entry
from pyloader.remote.cache import ShardCache
from pyloader.remote.fetch import open_remote
from pyloader.remote.fs import FetchError, RemoteChangedError

SHARD1 = "ds/shard-000001.pyl"


def assert_all_verified(cache_dir: str) -> None:
    """Every published file matches its manifest: nothing corrupt was ever published."""
    for d in ShardCache(cache_dir).datasets():
        for e in d.entries():
            assert verify_entry(d, e) is None, e.path


@pytest.mark.timeout(60)
def test_cold_then_warm_reads_same_samples_and_fetches_each_shard_once(server, cache_dir):
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir, shuffle=True, seed=3)
    assert labels(ds) == list(range(N_RECORDS))
    gets = server.shard_gets()
    assert len(gets) == len(ds.shard_paths) and set(gets.values()) == {1}
    # A second dataset object (and a second epoch) reads from the cache only.
    ds2 = pyloader.ShardDataset(server.url + "/ds/", cache_dir=cache_dir, shuffle=True, seed=3)
    loader = pyloader.DataLoader(ds2, batch_size=50, num_workers=2)
    for _ in range(2):
        got = sorted(int(x) for b in loader for x in b["label"])
        assert got == list(range(N_RECORDS))
    assert server.shard_gets() == gets
    assert len(published(cache_dir)) == len(ds.shard_paths)
    assert_all_verified(cache_dir)


@pytest.mark.timeout(60)
def test_torch_dataloader_workers_share_the_cache(server, cache_dir):
    import torch

    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    got = sorted(int(s["label"]) for s in dl)
    assert got == list(range(N_RECORDS))
    assert set(server.shard_gets().values()) == {1}


@pytest.mark.timeout(60)
def test_cache_dir_from_environment(server, tmp_path, monkeypatch):
    env_dir = str(tmp_path / "envcache")
    monkeypatch.setenv("PYLOADER_CACHE_DIR", env_dir)
    ds = pyloader.ShardDataset(server.url + "/ds")
    assert labels(ds) == list(range(N_RECORDS))
    assert len(published(env_dir)) == len(ds.shard_paths)
    arg_dir = str(tmp_path / "argcache")
    ds2 = pyloader.ShardDataset(server.url + "/ds", cache_dir=arg_dir)  # the argument wins
    assert labels(ds2) == list(range(N_RECORDS))
    assert len(published(arg_dir)) == len(ds.shard_paths)


@pytest.mark.timeout(60)
def test_memory_filesystem_and_file_url(srv_root, cache_dir):
    import fsspec

    mem = fsspec.filesystem("memory")
    src = os.path.join(srv_root, "ds")
    try:
        for name in os.listdir(src):
            with open(os.path.join(src, name), "rb") as f:
                mem.pipe_file(f"/pyl-test/ds/{name}", f.read())
        ds = pyloader.ShardDataset("memory://pyl-test/ds", cache_dir=cache_dir)
        assert labels(ds) == list(range(N_RECORDS))
        assert len(published(cache_dir)) == len(ds.shard_paths)
    finally:
        mem.rm("/pyl-test", recursive=True)
    local = pyloader.ShardDataset("file://" + src, cache_dir=cache_dir)  # local: read in place
    assert labels(local) == list(range(N_RECORDS))
    assert local._remote is None


FAULTS = {
    "drop": [Fault("drop")],
    "reset": [Fault("reset")],
    "500": [Fault("status", status=500)],
    "429": [Fault("status", status=429, retry_after="0")],
    "flip": [Fault("flip")],
    "stall": [Fault("stall", seconds=10)],
    "mixed": [Fault("status", status=502), Fault("drop"), Fault("flip")],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_transient_faults_are_retried_and_nothing_corrupt_is_published(server, cache_dir, fault):
    faults = FAULTS[fault]
    server.inject(SHARD1, *faults)
    t0 = time.monotonic()
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir)
    assert labels(ds) == list(range(N_RECORDS))
    assert server.count(SHARD1) == len(faults) + 1
    assert time.monotonic() - t0 < 8  # a stall costs the stall timeout (1 s), not the stall (10 s)
    assert_all_verified(cache_dir)


@pytest.mark.timeout(60)
def test_retry_after_is_honoured(server, cache_dir):
    server.inject(SHARD1, Fault("status", status=503, retry_after="1"))
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir)
    assert labels(ds) == list(range(N_RECORDS))
    times = [t for t, m, p, _ in server.log if p == "/" + SHARD1 and m == "GET"]
    assert len(times) == 2 and times[1] - times[0] >= 0.9  # our own backoff would be ~10 ms


@pytest.mark.timeout(60)
@pytest.mark.parametrize("status", [403, 404])
def test_permanent_errors_fail_at_once_naming_url_and_shard(server, cache_dir, status):
    server.inject(SHARD1, Fault("status", status=status, times=None))
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir)
    with pytest.raises(pyloader.ShardIOError) as ei:
        labels(ds)
    msg = str(ei.value)
    assert server.url + "/" + SHARD1 in msg and "shard-000001.pyl" in msg and "permanent" in msg
    assert server.count(SHARD1) == 1
    assert not any("shard-000001" in p for p in published(cache_dir))


@pytest.mark.timeout(60)
def test_persistent_5xx_gives_up_after_bounded_attempts(server, cache_dir):
    server.inject(SHARD1, Fault("status", status=500, times=None))
    dcache = open_remote(server.url + "/ds", cache_dir=cache_dir)
    t0 = time.monotonic()
    with pytest.raises(FetchError) as ei:
        dcache.ensure(1)
    assert time.monotonic() - t0 < 5
    assert "gave up after 4 attempts" in str(ei.value) and SHARD1 in str(ei.value)
    assert ei.value.shard == "shard-000001.pyl" and ei.value.url.endswith(SHARD1)
    assert server.count(SHARD1) == 4
    assert not dcache.is_published(1)


@pytest.mark.timeout(60)
def test_changed_or_corrupt_object_is_detected_and_never_published(server, srv_root, cache_dir):
    path = os.path.join(srv_root, SHARD1)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[-1] ^= 1  # same size, different content: corrupt at the source, or a stale manifest
    server.inject(SHARD1, Fault("replace", data=bytes(data), times=None))
    dcache = open_remote(server.url + "/ds", cache_dir=cache_dir)
    with pytest.raises(RemoteCorruptError, match="do not match the manifest's checksum") as ei:
        dcache.ensure(1)
    assert not isinstance(ei.value, RemoteChangedError) and "re-upload that shard" in str(ei.value)
    assert server.count(SHARD1) == 2  # one retry in case a byte flipped in transit
    assert not dcache.is_published(1)
    # A bigger object is a changed object at once.
    server.inject("ds/shard-000002.pyl", Fault("replace", data=bytes(data) * 2, times=None))
    with pytest.raises(RemoteChangedError, match="larger than the manifest"):
        dcache.ensure(2)
    assert server.count("ds/shard-000002.pyl") == 1


@pytest.mark.timeout(60)
def test_dataset_rewritten_at_same_url_never_mixes_old_and_new(server, srv_root, cache_dir):
    url = server.url + "/ds"
    assert labels(pyloader.ShardDataset(url, cache_dir=cache_dir)) == list(range(N_RECORDS))
    write_ds(os.path.join(srv_root, "ds"), offset=1000)  # new content, same names and sizes
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir)
    assert labels(ds) == list(range(1000, 1000 + N_RECORDS))
    d = ShardCache(cache_dir).find(url)
    assert d is not None
    ents = d.entries()
    assert sum(e.referenced for e in ents) == len(ds.shard_paths)
    assert sum(not e.referenced for e in ents) == len(ds.shard_paths)  # old copies, evicted first
    assert_all_verified(cache_dir)


@pytest.mark.timeout(30)
def test_missing_manifest_names_the_url(server, cache_dir):
    with pytest.raises(pyloader.ManifestError, match="nope/manifest.json") as ei:
        pyloader.ShardDataset(server.url + "/nope", cache_dir=cache_dir)
    assert isinstance(ei.value, FileNotFoundError)  # a 404: `except FileNotFoundError` works too
    assert isinstance(ei.value.__cause__, pyloader.FetchError)


@pytest.mark.timeout(60)
def test_fetch_all_fills_the_cache_once_and_local_files_are_the_cached_shards(server, cache_dir, srv_root):
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir)
    assert ds.is_remote
    first = ds.fetch_all()
    n = len(ds.shard_paths)
    assert first["downloaded"] == n and first["bytes"] == sum(ds.shard_bytes)
    files = ds.local_files()
    assert len(files) == n and all(f.startswith(os.path.abspath(cache_dir)) or f.startswith(cache_dir) for f in files)
    for f, rel in zip(files, ds.manifest["shards"]):
        with open(f, "rb") as a, open(os.path.join(srv_root, "ds", rel["path"]), "rb") as b:
            assert a.read() == b.read()
    again = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir).fetch_all()
    assert again == {"bytes": 0, "downloaded": 0}
    assert set(server.shard_gets().values()) == {1}  # each shard fetched once per node
    local = pyloader.ShardDataset(os.path.join(srv_root, "ds"))
    assert not local.is_remote and local.fetch_all() == {"bytes": 0, "downloaded": 0}
    assert local.local_files() == local.shard_paths
