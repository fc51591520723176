"""Each shard is mapped and checked once, however many workers need it at the same moment
(NOTE [one open per shard] in csrc/core/shard_reader.cpp; NOTE [open apart] in
csrc/core/batch_pipeline.cpp).

The first batches of an epoch in order are collated by both workers from the first shard,
and every batch of a global shuffle reads every shard: before, two workers that wanted a
shard at once each mapped and validated it and one mapping was dropped. The loader's
``opened_shards`` counts the shards mapped (remaps included); with no mapping bound it is
the number of shards read, in every fresh loader.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyloader

SHARDS = 12
PER_SHARD = 64
WORKERS = 2


def _write(path: str) -> str:
    with pyloader.ShardWriter(path, {"id": ("int64", ()), "x": ("uint8", (4096,))}, compression=None,
                              shard_bytes=PER_SHARD * 4096) as w:
        for i in range(SHARDS * PER_SHARD):
            w.write({"id": np.int64(i), "x": np.full(4096, i % 251, dtype=np.uint8)})
    return path


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_workers_that_need_a_shard_at_once_map_it_once(tmp_path, shuffle: bool) -> None:
    path = _write(str(tmp_path / "ds"))
    shards = len(pyloader.ShardDataset(path).shard_paths)
    assert shards >= SHARDS
    # In order, batches of half a shard: the two workers' first batches read the first shard
    # together, and each later pair of batches one shard. Shuffled, batches of a whole shard's
    # rows: each reads records of most shards. Ten fresh loaders: the race it guards against
    # came in most first epochs of two workers.
    batch = PER_SHARD // 2 if not shuffle else PER_SHARD
    for attempt in range(10):
        ds = pyloader.ShardDataset(path, shuffle=shuffle, seed=attempt)
        loader = pyloader.DataLoader(ds, batch_size=batch, num_workers=WORKERS)
        ids = np.concatenate([b["id"].numpy() for b in loader])
        assert sorted(ids.tolist()) == list(range(SHARDS * PER_SHARD))
        stats = loader.stats()
        assert stats["opened_shards"] == stats["mapped_shards"] == shards, (attempt, stats)
