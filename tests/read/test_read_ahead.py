"""Cold shards are queued for read-ahead whole (NOTE [read-ahead pieces] in
csrc/core/shard_reader.cpp): the kernel reads at most its read-ahead window (read_ahead_kb,
128 KiB by default, 8 MiB on some disks) per WILLNEED, so a shard much larger than that
advised in one call had only its first window queued. After the first batch of a cold
shard larger than any window, the whole file comes into the page cache without more batches
read."""

from __future__ import annotations

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
    B.drop_pages(files)
    if B.resident_fraction(files) > 0.1:
        pytest.skip("this file system keeps the pages (tmpfs?): nothing is cold")
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
