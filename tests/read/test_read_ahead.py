"""Cold shards are queued for read-ahead whole (NOTE [read-ahead pieces] in
csrc/core/shard_reader.cpp): the kernel reads at most its read-ahead window (read_ahead_kb,
128 KiB by default, 8 MiB on some disks) per WILLNEED, so a shard much larger than that
advised in one call had only its first window queued. After the first batch of a cold
shard larger than any window, the whole file comes into the page cache without more batches
read."""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest

import pyloader
from pyloader.bench import measure as B

RECORD = 64 << 10
RECORDS = 1536  # 96 MiB in one shard


def _window_bytes(path: str) -> int | None:
    """The read-ahead window of the block device holding path (None if it cannot be read)."""
    dev = os.stat(path).st_dev
    try:
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue/read_ahead_kb") as fh:
            return int(fh.read()) << 10
    except (OSError, ValueError):
        try:  # a partition: its disk's queue
            with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/../queue/read_ahead_kb") as fh:
                return int(fh.read()) << 10
        except (OSError, ValueError):
            return None


def _drop_or_skip(files: list[str]) -> None:
    """Drops the files' pages from the page cache; skips the test where they stay (tmpfs)."""
    B.drop_pages(files)
    if B.resident_fraction(files) > 0.1:
        pytest.skip("this file system keeps the pages (tmpfs?): nothing is cold")


@pytest.mark.timeout(120)
def test_a_cold_shard_is_read_ahead_whole_after_the_first_batch(tmp_path) -> None:
    path = str(tmp_path / "ds")
    with pyloader.ShardWriter(path, {"x": ("uint8", (RECORD,))}, compression=None, shard_bytes=1 << 30) as w:
        row = np.zeros(RECORD, np.uint8)
        for i in range(RECORDS):
            row[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            w.write({"x": row})
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".pyl"))
    assert len(files) == 1
    window = _window_bytes(files[0])
    if window is None or window * 4 > os.path.getsize(files[0]):
        pytest.skip(f"no block device read-ahead window well below the shard's size here ({window})")
    _drop_or_skip(files)
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=1, num_workers=1, prefetch_factor=2)
    it = iter(loader)
    first = next(it)
    assert int.from_bytes(bytes(first["x"][0, :8].numpy()), "little") == 0
    deadline = time.monotonic() + 30
    while (got := B.resident_fraction(files)) < 0.99 and time.monotonic() < deadline:
        time.sleep(0.05)
    # without the pieces only the first window (and the few batches' read-around) came in
    assert got >= 0.99, f"{got:.1%} of the cold shard in memory after its first batch"
    del it, loader


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trusted", [False, True], ids=["new", "verified-earlier"])
def test_the_first_batch_of_cold_shards_takes_no_page_fault_that_reads(tmp_path, monkeypatch, trusted: bool) -> None:
    """NOTE [metadata first] (csrc/core/shard_reader.cpp): a shard's header is read, its index and
    column table are queued before they are checked, and a record's column blocks are queued
    with its other fields, so no access of the first batch waits on a synchronous read-around
    of the device's window (a major fault): two per shard before.

    ``verified-earlier``: the files were verified in full by an earlier reader, so a new one
    trusts them at open (NOTE [verified files]) -- a job restarted after its page cache was
    emptied. Its records are queued all the same, as whether a record was read is
    Shard::seen(), not its being verified (see NOTE [cold read-ahead] in
    csrc/core/batch_pipeline.h); before, none were, and the first batch read every shard
    through a fault of its own."""
    import resource

    from pyloader.read import verified as _verified

    monkeypatch.setenv("PYLOADER_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "ds")
    with pyloader.ShardWriter(path, {"x": "bytes", "label": "int64"}, compression=None, shard_bytes=4 << 20) as w:
        rng = np.random.default_rng(0)
        for i in range(4096):
            w.write({"x": rng.integers(0, 256, 12 << 10, dtype=np.uint8).tobytes(), "label": i})
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".pyl"))
    assert len(files) >= 8
    if trusted:
        time.sleep(_verified.RACY_NS / 1e9 + 0.2)  # older than the racy window, so they are recorded
        for _ in pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=512, num_workers=2):
            pass
        check = pyloader.ShardDataset(path).batches(512, num_threads=2)
        for _ in check:
            pass
        assert check.stats()["verified_bytes"] == 0, "the files are not trusted: the test measures nothing"
        del check
    # A fault on a page that a queued read is still bringing in counts as major too, and on a
    # loaded machine a few such collisions happen now and then (6-10 in 1 of 3 runs of the
    # suite's read tests on 2 workers, before and after the change that added this attempt
    # loop); the read-around faults this test is about come every time (two per shard). So
    # the best of three cold attempts is held to the bound.
    counts = []
    for seed in (3, 4, 5):
        gc.collect()  # the last attempt's mappings are gone, so its pages can be dropped
        _drop_or_skip(files)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        loader = pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=seed), batch_size=128,
                                     num_workers=2)
        it = iter(loader)
        first = next(it)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_majflt - before)
        it.close()
        del it, loader
        assert len(first["label"]) == 128 and len({int(x) for x in first["label"]}) == 128
        if counts[-1] <= 2:
            break
    faults = min(counts)
    assert faults <= 2, f"{faults} major faults opening {len(files)} cold shards and reading their first batch"


def _mapped_bytes(files: list[str]) -> int:
    """Bytes of ``files`` mapped into this process now (the Rss of their mappings in smaps)."""
    want, total, inside = set(files), 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                inside = len(head) >= 6 and head[5] in want
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) << 10
    return total


def _cold_dataset(tmp_path, records: int = 512, record: int = 64 << 10) -> tuple[str, list[str]]:
    path = str(tmp_path / "ds")
    with pyloader.ShardWriter(path, {"x": ("uint8", (record,)), "label": "int64"}, compression=None,
                              shard_bytes=4 << 20) as w:
        row = np.zeros(record, np.uint8)
        for i in range(records):
            row[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            w.write({"x": row, "label": i})
    files = sorted(os.path.realpath(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".pyl"))
    return path, files


@pytest.mark.timeout(120)
def test_cold_shards_are_mapped_ahead_of_their_readers(tmp_path) -> None:
    """See NOTE [map ahead] in csrc/core/batch_pipeline.h: the shards a shuffled epoch queues
    whole while they are cold are mapped into the process by one thread while the device reads
    them, so the workers that later collate them take no page fault. After the first batch of
    eight cold shards, whole files are mapped that no batch has read yet; without the mapper
    only the few records collated so far are (the test fails on the code before it)."""
    path, files = _cold_dataset(tmp_path)
    assert len(files) >= 8
    _drop_or_skip(files)
    size = sum(os.path.getsize(f) for f in files)
    loader = pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=3), batch_size=32, num_workers=2,
                                 prefetch_factor=2)
    it = iter(loader)
    labels = [int(x) for x in next(it)["label"]]
    # Most, not all: on a loaded machine the first batches' workers may have read half of a
    # shard by the time the epoch queues it, and a shard is mapped ahead only while less than
    # half resident (NOTE [map ahead]); 94% was seen once in CI. Without the mapper only what
    # the first batches collated is mapped (the batch and the read-ahead: about a quarter).
    want = 0.75 * size
    deadline = time.monotonic() + 30
    while (mapped := _mapped_bytes(files)) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mapped >= want, f"{mapped / size:.1%} of the cold shards mapped after the first batch"
    while (ahead := loader.stats()["mapped_ahead_bytes"]) < want and time.monotonic() < deadline:
        time.sleep(0.05)  # the count follows each 1 MiB piece
    assert want <= ahead <= size, (ahead, size)
    for b in it:  # and the epoch reads what was written, in the planned order
        for x, label in zip(b["x"], b["label"]):
            assert int.from_bytes(bytes(x[:8].numpy()), "little") == int(label)
            labels.append(int(label))
    assert sorted(labels) == list(range(512))


@pytest.mark.timeout(120)
def test_warm_shards_are_not_mapped_ahead_and_a_closed_epoch_leaves_no_mapper(tmp_path) -> None:
    """See NOTE [map ahead] in csrc/core/batch_pipeline.h: shards mostly in memory already get
    no mapper (nothing waits for the device there). And an epoch closed while its mapper maps
    cold shards leaves no thread."""
    path, files = _cold_dataset(tmp_path)
    for f in files:  # warm: every page in the page cache
        with open(f, "rb") as fh:
            while fh.read(1 << 20):
                pass
    if B.resident_fraction(files) < 0.9:
        pytest.skip("the page cache does not keep these files")
    loader = pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=3), batch_size=32, num_workers=2,
                                 prefetch_factor=2)
    it = iter(loader)
    next(it)
    time.sleep(0.5)
    assert loader.stats()["mapped_ahead_bytes"] == 0
    assert sum(1 for _ in it) == 512 // 32 - 1
    assert loader.stats()["mapped_ahead_bytes"] == 0
    B.drop_pages(files)
    if B.resident_fraction(files) > 0.1:
        return  # nothing is cold here; the warm half was checked
    tasks = len(os.listdir("/proc/self/task"))
    loader = pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=4), batch_size=32, num_workers=2,
                                 prefetch_factor=2)
    it = iter(loader)
    next(it)
    del it, loader  # mid-epoch, the mapper perhaps mapping
    deadline = time.monotonic() + 10
    while len(os.listdir("/proc/self/task")) > tasks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(os.listdir("/proc/self/task")) <= tasks


def _write(path: str, records: int, record: int, fill: int, shard_bytes: int) -> list[str]:
    with pyloader.ShardWriter(path, {"x": ("uint8", (record,)), "label": "int64"}, compression=None,
                              shard_bytes=shard_bytes) as w:
        row = np.full(record, fill, np.uint8)
        for i in range(records):
            row[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            w.write({"x": row, "label": i})
    return sorted(os.path.realpath(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".pyl"))


@pytest.mark.timeout(120)
def test_a_cold_epoch_in_order_reads_its_records_with_read_not_through_the_mapping(tmp_path) -> None:
    """See NOTE [cold spans] in csrc/core/batch_pipeline.h: an epoch in order from a cold page
    cache reads each batch's run of records with pread(), so the records' pages come into the
    page cache but are mostly never mapped into the process (no page fault per page), and
    the batches hold what was written, in order. Before, the read-ahead and the workers' page
    faults mapped every page of the files (the test fails on that code)."""
    path, files = _cold_dataset(tmp_path)
    size = sum(os.path.getsize(f) for f in files)
    _drop_or_skip(files)
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=32, num_workers=2, prefetch_factor=2)
    labels: list[int] = []
    for b in loader:
        for x, label in zip(b["x"], b["label"]):
            assert int.from_bytes(bytes(x[:8].numpy()), "little") == int(label)
            labels.append(int(label))
    assert labels == list(range(512))
    assert B.resident_fraction(files) > 0.9  # read through the page cache
    mapped = _mapped_bytes(files)
    # Not none: the index, and the batches whose pages the kernel's read-ahead behind an
    # earlier batch's read had brought in already (read through the mapping, as warm ones).
    assert mapped < 0.5 * size, f"{mapped / size:.1%} of the cold shards mapped by an in-order epoch"
    assert loader.stats()["mapped_ahead_bytes"] == 0


@pytest.mark.timeout(120)
def test_a_cold_run_of_a_file_replaced_under_its_mapping_is_read_from_the_mapped_file(tmp_path) -> None:
    """See NOTE [cold spans]: a batch reads its run with pread() only from the file it mapped
    (device, inode, size). A shard file replaced mid-epoch by another of the same layout and
    other bytes: the later batches still read the mapped file's records through the mapping
    (read from the new file, their checksums would not match the mapped index)."""
    path = str(tmp_path / "ds")
    files = _write(path, 512, 64 << 10, 1, 1 << 30)
    other = _write(str(tmp_path / "other"), 512, 64 << 10, 2, 1 << 30)
    assert len(files) == len(other) == 1 and os.path.getsize(files[0]) == os.path.getsize(other[0])
    _drop_or_skip(files)
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=32, num_workers=1, prefetch_factor=1)
    it = iter(loader)
    seen = [next(it)]
    os.replace(other[0], files[0])  # a new inode at the path; the old one stays mapped
    seen.extend(it)
    labels = [int(v) for b in seen for v in b["label"]]
    assert labels == list(range(512))
    for b in seen:
        assert bool((b["x"][:, 8:] == 1).all())  # the mapped file's bytes, never the new file's



@pytest.mark.timeout(120)
@pytest.mark.parametrize("width", [8, 32])
def test_a_cold_batch_in_order_queues_its_shards_columns_before_its_records(tmp_path, width: int) -> None:
    """See NOTE [cold spans]: a batch in order reads its records with pread() and its column
    values through the mapping. The first such batch of a shard queues the shard's columns
    whole (up to 1 MiB: an 8-wide int64 column and a label, 576 KiB) or else its own column
    blocks (a 32-wide one, 2 MiB) before it reads its records, so they are in memory when
    they are reached. Before, the first touch of a shard's columns was a major fault: a
    synchronous read of the device's read-around window, queued behind the batches' reads
    (the first batch of 64 MB shards of 12 KB records took 21-27 ms, and 11-14 ms with the
    queue)."""
    path = str(tmp_path / "ds")
    n = 8192
    with pyloader.ShardWriter(path, {"x": ("uint8", (4096,)), "emb": ("int64", (width,)), "label": "int64"},
                              compression=None, shard_bytes=1 << 30) as w:
        row = np.zeros(4096, np.uint8)
        for i in range(n):
            row[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
            w.write({"x": row, "emb": np.full(width, i, np.int64), "label": i})
    files = sorted(os.path.realpath(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".pyl"))
    assert len(files) == 1
    with open(files[0], "rb") as fh:
        data = fh.read()
    emb = data.find(np.repeat(np.arange(4, dtype=np.int64), width).tobytes())  # the emb column, then label's
    label = emb + n * width * 8
    assert emb > 0 and data.find(np.arange(4, dtype=np.int64).tobytes(), emb) == label
    del data
    # What the first batch's queue brings in: both columns whole, or the first 64 KiB block
    # of each (the first batches' rows).
    want = [(emb, label + n * 8)] if width == 8 else [(emb, emb + (64 << 10)), (label, label + (64 << 10))]
    _drop_or_skip(files)
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=128, num_workers=1, prefetch_factor=1)
    it = iter(loader)
    first = next(it)
    assert [int(v) for v in first["label"]] == list(range(128))
    assert (first["emb"] == first["label"][:, None]).all()
    deadline = time.monotonic() + 10
    while (got := min(B.resident_range_fraction(files[0], a, z) for a, z in want)) < 0.99 and time.monotonic() < deadline:
        time.sleep(0.02)
    tail = B.resident_range_fraction(files[0], emb - (1 << 20), emb)  # the records just before the columns
    it.close()
    # Without the queue, a fault on the first column block read the device's read-around
    # window: where that is small (128 KiB), the columns did not come in whole; where it is
    # large (8 MiB here), it came in with the megabytes of records before them, which no batch
    # had asked for (the last MiB of 32: 100% in memory; with the queue, 0%).
    assert got >= 0.99, f"{got:.1%} of the columns' first rows in memory after the first batch in order"
    assert tail < 0.5, f"{tail:.1%} of the shard's last records in memory after its first batch in order"


def _descriptors_of(files: list[str]) -> int:
    """How many of this process's open descriptors are of ``files``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") in files
        except OSError:
            pass  # closed meanwhile
    return n


@pytest.mark.timeout(120)
def test_a_cold_epoch_in_order_reads_each_shard_through_one_descriptor_it_closes_when_done(tmp_path) -> None:
    """See NOTE [span descriptor] in csrc/core/shard_reader.cpp: the spans of a cold shard are
    read through one descriptor of the shard's, kept from its first span to its last batch (the
    kernel's read-ahead then grows along the file), and every batch of it is read so, whatever
    that read-ahead brought in already; the descriptor is closed once no batch needs the
    shard. Before, each span opened a descriptor of its own and closed it after the read, and
    the batches behind the read-ahead were read through the mapping (page faults): 75-87% of
    the files ended up mapped, against 7% now (the index); the test fails on that code."""
    path = str(tmp_path / "ds")
    files = _write(path, 2048, 16 << 10, 3, 16 << 20)  # 2 shards of 16 MiB, 32 batches each
    size = sum(os.path.getsize(f) for f in files)
    assert len(files) == 2
    _drop_or_skip(files)
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=32, num_workers=2, prefetch_factor=2)
    labels: list[int] = []
    open_during: list[int] = []
    for b in loader:
        open_during.append(_descriptors_of(files))
        assert bool((b["x"][:, 8:] == 3).all())
        labels.extend(int(v) for v in b["label"])
    assert labels == list(range(2048))
    assert max(open_during) <= len(files), open_during
    assert sum(n > 0 for n in open_during) >= 3 * len(open_during) // 4, open_during  # kept along the epoch
    assert _descriptors_of(files) == 0  # every shard idle: closed
    mapped = _mapped_bytes(files)
    assert mapped < 0.2 * size, f"{mapped / size:.1%} of the cold shards mapped by an in-order epoch"


@pytest.mark.timeout(120)
def test_a_partly_cached_shard_is_read_through_the_mapping_where_cached_and_with_pread_where_not(tmp_path) -> None:
    """See NOTE [cold spans] in csrc/core/batch_pipeline.h: a shard not wholly in the page cache
    when it is opened (NOTE [whole file cached] in shard_reader.cpp) has each span-shaped
    batch's run asked whether it is in memory (mincore() over the run). Here the first half of
    a 16 MiB shard is cached and the second half is not: read in order, the cached half is read
    through the mapping (mapped into the process); the rest is read with pread() if it is still
    cold when its batches come, or through the mapping if the read-ahead queued at the shard's
    open (NOTE [read-ahead at open]) brought it in first; every batch holds what was written. A
    run's share taken from the wrong range or in the wrong unit reads the cached half with
    pread() too (nothing mapped but the index)."""
    path = str(tmp_path / "ds")
    files = _write(path, 1024, 16 << 10, 5, 32 << 20)  # 1 shard of 16 MiB, 32 batches of 512 KiB
    assert len(files) == 1
    size = os.path.getsize(files[0])
    fd = os.open(files[0], os.O_RDONLY)
    try:  # the second half out of the page cache (written back first: dirty pages stay)
        os.fsync(fd)
        os.posix_fadvise(fd, (size // 2) & ~((2 << 20) - 1), 0, os.POSIX_FADV_DONTNEED)  # (whole 2 MiB folios)
    finally:
        os.close(fd)
    if not 0.35 < B.resident_fraction(files) < 0.65:
        pytest.skip("this file system keeps the pages (tmpfs?), or did not hold the first half")
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=32, num_workers=2, prefetch_factor=2)
    labels: list[int] = []
    for b in loader:
        assert bool((b["x"][:, 8:] == 5).all())
        labels.extend(int(v) for v in b["label"])
    assert labels == list(range(1024))
    mapped = _mapped_bytes(files)
    assert mapped > 0.35 * size, f"{mapped / size:.1%} of the shard mapped: its cached half was read with pread()"
