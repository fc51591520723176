"""Streaming remote datasets far larger than the node cache (NOTE [streaming] in pyloader.remote.fetch).

Real loopback servers (HTTP, S3-compatible); every sample's bytes are checked, the cache
directory's size is sampled while the readers run, and the epoch order is compared with
the same dataset read from local files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from remote_servers import Fault, S3Server
from remote_util import sample, write_ds

import pyloader
import pyloader._C as _C
from pyloader.bench.measure import CachePeak
from pyloader.remote.bad_copies import verify_entry
from pyloader.remote.fetch import working_set

N = 2400  # about 126 shards of 4 KB
HERE = os.path.dirname(__file__)


def shard_files(d: str) -> list[str]:
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".pyl"))


def dataset_bytes(d: str) -> tuple[int, int]:
    """(total, largest) shard bytes of the dataset written at ``d``."""
    sizes = [os.path.getsize(p) for p in shard_files(d)]
    return sum(sizes), max(sizes)


def check_batch(b: dict) -> list[int]:
    """Every sample's bytes equal what was written; returns the labels in order."""
    out = []
    for k in range(len(b["label"])):
        i = int(b["label"][k])
        s = sample(i)
        assert np.array_equal(b["image"][k].numpy(), s["image"]), i
        n = int(b["tokens_lengths"][k])
        assert np.array_equal(b["tokens"][k, :n].numpy(), s["tokens"]), i
        out.append(i)
    return out


@pytest.fixture
def big(srv_root) -> str:
    write_ds(os.path.join(srv_root, "big"), n=N)
    return os.path.join(srv_root, "big")


def _stream_and_check(url: str, local: str, cache_dir: str, limit: int, largest: int, epochs: int = 2,
                      **opts: object) -> dict:
    kw = dict(shuffle=True, shuffle_mode="window", window=64, seed=5)
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir, cache_limit=limit, fetch_jobs=4, **kw, **opts)
    ref = pyloader.ShardDataset(local, **kw)
    stats = {}
    with CachePeak(cache_dir) as usage:
        for ep in range(epochs):
            it = ds.batches(16, epoch=ep)
            got = [i for b in it for i in check_batch(b)]
            want = [int(x) for b in ref.batches(16, epoch=ep) for x in b["label"]]
            assert got == want, f"epoch {ep}: the streamed order differs from the local order"
            stats = it.stats()
    assert usage.samples > 10
    assert usage.peak <= limit, (usage.peak, limit)  # published and in-flight bytes together
    assert stats["shards_unloaded"] > 0 and stats["cache_peak_held_bytes"] <= stats["cache_budget_bytes"] + largest
    return stats


@pytest.mark.timeout(120)
def test_window_mode_streams_a_dataset_eight_times_the_cache_over_http(server, big, cache_dir):
    total, largest = dataset_bytes(big)
    limit = total // 8
    stats = _stream_and_check(server.url + "/big", big, cache_dir, limit, largest)
    gets = server.shard_gets()
    assert sum(gets.values()) > len(gets)  # the second epoch fetched again what the cache had to drop
    assert stats["mapped_shards"] <= 64  # mappings follow the working set, not the dataset


@pytest.mark.timeout(180)
def test_window_mode_streams_a_dataset_eight_times_the_cache_over_s3(big, cache_dir):
    pytest.importorskip("moto.server")
    import boto3
    import s3fs

    s3 = S3Server(max_life=150).start()
    try:
        boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket="bucket")
        fs = s3fs.S3FileSystem(**s3.storage_options())
        for name in sorted(os.listdir(big)):
            fs.put_file(os.path.join(big, name), f"bucket/big/{name}")
        total, largest = dataset_bytes(big)
        _stream_and_check("s3://bucket/big", big, cache_dir, total // 8, largest, epochs=1,
                          storage_options=s3.storage_options())
    finally:
        s3.stop()


WORKER = r"""
import json, os, sys
sys.path.insert(0, {here!r})
import numpy as np
import pyloader
from remote_util import sample
rank = int(os.environ["RANK"])
ds = pyloader.ShardDataset({url!r}, cache_dir={cache!r}, cache_limit={limit}, shuffle=True, shuffle_mode="window",
                           window=32, seed=1, fetch_jobs=2)
labels = []
for b in ds.batches(8):
    for k in range(len(b["label"])):
        i = int(b["label"][k])
        assert np.array_equal(b["image"][k].numpy(), sample(i)["image"]), i
        labels.append(i)
print(json.dumps(labels))
"""


@pytest.mark.timeout(180)
def test_several_processes_stream_through_one_small_cache(server, big, cache_dir):
    total, largest = dataset_bytes(big)
    limit = total // 4  # three readers: each holds at most a third of that
    script = WORKER.format(here=HERE, url=server.url + "/big", cache=cache_dir, limit=limit)
    env = dict(os.environ, WORLD_SIZE="3", LOCAL_WORLD_SIZE="3")
    with CachePeak(cache_dir) as usage:
        procs = [subprocess.Popen([sys.executable, "-c", script], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(3)]
        outs = [p.communicate(timeout=150) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    got = sorted(i for out, _ in outs for i in json.loads(out))
    assert got == list(range(N))
    assert usage.peak <= limit, (usage.peak, limit)


def _flip_payload_byte(path: str) -> None:
    with open(path, "r+b") as f:
        # The payload's end: header, schema, column table and index stay intact. In a version 3
        # shard that is the last column's last block (NOTE [column layout]), else a stored value.
        f.seek(-10, os.SEEK_END)
        b = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x55]))


def _cached_file(ds: pyloader.ShardDataset, i: int) -> str:
    return ds.local_files()[i]


@pytest.mark.timeout(60)
def test_a_corrupt_cached_shard_is_discarded_fetched_again_and_read_correctly(server, cache_dir):
    url = server.url + "/ds"
    warm = pyloader.ShardDataset(url, cache_dir=cache_dir)
    warm.fetch_all()
    victim = len(warm.shard_paths) // 2
    _flip_payload_byte(_cached_file(warm, victim))
    before = server.shard_gets()
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir, cache_limit="1G")
    it = ds.batches(16)
    got = sorted(i for b in it for i in check_batch(b))
    assert got == list(range(len(got))) and len(got) == ds.num_records
    assert it.stats()["healed_shards"] == 1
    after = server.shard_gets()
    name = "/ds/" + ds.manifest["shards"][victim]["path"]
    assert after[name] == before.get(name, 0) + 1  # fetched once more, nothing else
    assert sum(after.values()) == sum(before.values()) + 1
    assert verify_entry(ds._remote, next(e for e in ds._remote.entries() if e.name == ds._remote.names[victim])) is None
    with open(os.path.join(ds._remote.dir, "discarded.log")) as f:
        # The shards are format version 2: their values' checksum is XXH3-64.
        assert "column block checksum mismatch (corrupt data): XXH3-64 " in f.read()


@pytest.mark.timeout(60)
def test_a_shard_torn_by_a_crash_is_healed_on_read(server, cache_dir):
    """Shards are published without fsync (NOTE [cache publish]): a crash before writeback
    may leave one at its size with zeros for bytes. Readers catch it and fetch it again."""
    url = server.url + "/ds"
    warm = pyloader.ShardDataset(url, cache_dir=cache_dir)
    warm.fetch_all()
    path = _cached_file(warm, 2)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(bytes(size))
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir)
    it = ds.batches(16)
    got = sorted(i for b in it for i in check_batch(b))
    assert got == list(range(ds.num_records))
    assert it.stats()["healed_shards"] == 1


@pytest.mark.timeout(60)
def test_a_shard_bad_in_the_cache_and_at_the_source_raises_naming_both(server, cache_dir):
    url = server.url + "/ds"
    warm = pyloader.ShardDataset(url, cache_dir=cache_dir)
    warm.fetch_all()
    victim = 1
    _flip_payload_byte(_cached_file(warm, victim))
    name = warm.manifest["shards"][victim]["path"]
    server.faults["/ds/" + name].append(Fault("flip", times=None))  # every fetch of it now arrives corrupt
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir)
    with pytest.raises(pyloader.PyloaderError) as ei:
        for _ in ds.batches(16):
            pass
    msg = str(ei.value)
    assert "column table says" in msg and "manifest says" in msg, msg  # the cached copy's digests, then the download's
    assert name in msg


@pytest.mark.timeout(60)
def test_global_shuffle_streams_when_the_cache_holds_the_plan_and_says_what_to_use_when_not(server, big, cache_dir):
    total, largest = dataset_bytes(big)
    url = server.url + "/big"
    with pytest.raises(pyloader.CacheLimitError, match="shuffle_mode='window'") as ei:
        pyloader.ShardDataset(url, cache_dir=cache_dir, cache_limit=total // 2, shuffle=True)
    assert str(total // 2) in str(ei.value)
    assert server.shard_gets() == {}
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir, cache_limit=total + largest, shuffle=True, seed=2)
    ref = pyloader.ShardDataset(big, shuffle=True, seed=2)
    got = [i for b in ds.batches(32) for i in check_batch(b)]
    assert got == [int(x) for b in ref.batches(32) for x in b["label"]]


@pytest.mark.timeout(60)
def test_a_limit_below_what_one_reader_needs_fails_at_construction_naming_both_numbers(server, big, cache_dir):
    _, largest = dataset_bytes(big)
    with pytest.raises(pyloader.CacheLimitError, match=r"needs at once: [\d.]+ [KMG]?i?B \(\d+ bytes") as ei:
        pyloader.ShardDataset(server.url + "/big", cache_dir=cache_dir, cache_limit=largest // 2)
    assert f"({largest // 2} bytes) is below" in str(ei.value) and "set cache_limit >=" in str(ei.value)
    # Unshuffled, a few shards stream a dataset of any size.
    ds = pyloader.ShardDataset(server.url + "/big", cache_dir=cache_dir, cache_limit=4 * largest)
    assert [i for b in ds.batches(16, num_threads=1, prefetch=1) for i in check_batch(b)] == list(range(N))


@pytest.mark.timeout(60)
def test_the_loader_timeout_names_the_shard_url_and_bytes_arrived(server, cache_dir):
    url = server.url + "/ds"
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir)
    first = ds.manifest["shards"][0]["path"]
    server.faults["/ds/" + first].append(Fault("stall", seconds=30))
    loader = pyloader.DataLoader(ds, batch_size=8, timeout=1)
    t0 = time.monotonic()
    with pytest.raises(pyloader.LoaderTimeoutError) as ei:
        next(iter(loader))
    assert time.monotonic() - t0 < 10
    msg = str(ei.value)
    assert msg.startswith("DataLoader timed out after 1 seconds: no batch arrived; waiting for "), msg
    assert first in msg and url + "/" + first in msg and "bytes arrived" in msg, msg
    del loader, ds


def test_working_set_follows_the_plan() -> None:
    sizes = np.array([10, 20, 30, 40])
    assert working_set([0, 0, 1, 1, 2, 2, 3, 3], sizes, 0) == (40, 1)  # sequential: one shard at a time
    assert working_set([0, 0, 1, 1, 2, 2, 3, 3], sizes, 2) == (70, 2)  # reading ahead overlaps the next
    assert working_set([0, 1, 2, 3, 0, 1, 2, 3], sizes, 0) == (100, 4)  # every shard open until the end
    assert working_set([], sizes, 4) == (0, 0)


@pytest.mark.timeout(60)
def test_a_shard_that_failed_for_one_iterator_is_fetched_again_for_the_next(server, cache_dir):
    url = server.url + "/ds"
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir)
    name = ds.manifest["shards"][2]["path"]
    server.inject("ds/" + name, Fault("status", status=404, times=1))
    with pytest.raises(FileNotFoundError, match=name):
        for _ in ds.batches(16):
            pass
    got = sorted(i for b in ds.batches(16) for i in check_batch(b))  # the next epoch's iterator
    assert got == list(range(ds.num_records))
    assert server.count("ds/" + name) == 2


def _label_plus(sample: dict) -> dict:
    return {"label": sample["label"] + 1000000, "image": sample["image"]}


@pytest.mark.timeout(180)
def test_transform_processes_stream_through_a_small_cache(server, big, cache_dir):
    """Each transform process reads its own share through the node cache, held to its part of the limit."""
    total, _ = dataset_bytes(big)
    limit = total // 4
    kw = dict(shuffle=True, shuffle_mode="window", window=64, seed=5)
    ds = pyloader.ShardDataset(server.url + "/big", cache_dir=cache_dir, cache_limit=limit, **kw)
    ref = pyloader.ShardDataset(big, **kw)
    want = [int(x) for b in pyloader.DataLoader(ref, batch_size=16, transform=_label_plus) for x in b["label"]]
    with CachePeak(cache_dir) as usage:
        got = [int(x) for b in pyloader.DataLoader(ds, batch_size=16, transform=_label_plus, executor="processes",
                                                   num_workers=2) for x in b["label"]]
    assert got == want and len(got) == N
    assert usage.samples > 3 and usage.peak <= limit, (usage.peak, limit)


def test_remote_epochs_start_at_iter_not_ahead(server, cache_dir) -> None:
    # See NOTE [epoch ahead]: a remote dataset's fetch schedule belongs to the epoch being read.
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir, shuffle=True)
    assert ds.is_remote
    loader = pyloader.DataLoader(ds, batch_size=4, num_workers=2)
    for _ in range(2):
        assert sum(len(next(iter(b.values()))) for b in loader) == ds.num_records
        assert not loader.stats()["started_ahead"]
    assert loader._ahead is None


def test_remote_dataset_with_auto_threads(server, cache_dir) -> None:
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir, shuffle=True)
    loader = pyloader.DataLoader(ds, batch_size=4, num_workers="auto", memory_budget=64 << 20)
    for _ in range(2):
        assert sum(len(next(iter(b.values()))) for b in loader) == ds.num_records
        st = loader.stats()
        assert not st["started_ahead"] and 0 < st["autotune"]["memory_bytes"] <= 64 << 20


@pytest.mark.timeout(60)
def test_a_cached_copy_that_vanishes_again_is_fetched_again(server, cache_dir, monkeypatch):
    """A copy removed after it was published (another process's eviction or ``cache clear``) is
    no sign of a bad source: it is fetched again each time, not only once (See NOTE [self-healing])."""
    victim = 2
    removed: list[str] = []

    class VanishingSet(_C.ShardSet):
        def mark_ready(self, index, path):  # the file disappears just after its download, twice
            if index == victim and len(removed) < 2:
                os.unlink(path)
                removed.append(path)
            return super().mark_ready(index, path)

    monkeypatch.setattr(_C, "ShardSet", VanishingSet)
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir)
    it = ds.batches(16)
    got = sorted(i for b in it for i in check_batch(b))
    assert got == list(range(ds.num_records))
    assert len(removed) == 2 and it.stats()["healed_shards"] == 2
    name = ds.manifest["shards"][victim]["path"]
    assert server.count("ds/" + name) == 3  # fetched, and fetched again after each vanishing
