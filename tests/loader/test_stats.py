"""loader.stats(): native per-stage counters and the consumer's wait fraction."""

from __future__ import annotations

import time

import numpy as np

import pyloader
from pyloader import _C


def _dataset(tmp_path, n: int, compression: str) -> str:
    path = str(tmp_path / f"ds-{compression}")
    rng = np.random.default_rng(0)
    with pyloader.ShardWriter(path, {"x": ("uint8", (4096,)), "t": ("int32", (None,))}, compression=compression,
                              shard_bytes=256 << 10) as w:
        for i in range(n):
            x = np.full(4096, i % 7, np.uint8) if i % 2 else rng.integers(0, 255, 4096, dtype=np.uint8)
            w.write({"x": x, "t": np.arange(i % 5, dtype=np.int32)})
    return path


def test_counters_account_for_every_byte(tmp_path) -> None:
    n, b = 300, 32
    ds = pyloader.ShardDataset(_dataset(tmp_path, n, "lz4"))
    loader = pyloader.DataLoader(ds, batch_size=b, num_workers=2)
    assert loader.stats() == {}
    seen = sum(int(batch["x"].shape[0]) for batch in loader)
    st = loader.stats()  # the iterator is gone: the loader kept its last stats
    assert seen == n
    assert st["finished"] and st["records"] == n and st["batches"] == -(-n // b)
    payload = n * 4096 + sum(4 * (i % 5) for i in range(n))
    assert st["decoded_bytes"] == payload
    assert 0 < st["lz4_stored_bytes"] < st["stored_bytes"] < payload  # half the records compress
    assert st["verified_bytes"] == st["stored_bytes"]  # first read: every value was checked
    assert st["threads"] == 2 and st["collate_s"] > 0 and 0 <= st["wait_fraction"] <= 1
    # Second epoch: values already verified in this process are not hashed again.
    for _ in loader:
        pass
    st2 = loader.stats()
    assert st2["records"] == n and st2["verified_bytes"] == 0


def test_wait_fraction_reflects_the_training_loop(tmp_path) -> None:
    ds = pyloader.ShardDataset(_dataset(tmp_path, 200, "none"))
    loader = pyloader.DataLoader(ds, batch_size=20, num_workers=1, prefetch=4)
    for _ in loader:
        time.sleep(0.02)  # a "training step" much slower than loading
    busy = loader.stats()
    for _ in loader:
        pass  # no work: the loop waits on the loader
    idle = loader.stats()
    assert busy["wait_fraction"] < 0.3, busy
    assert idle["wait_fraction"] > busy["wait_fraction"]
    assert busy["wall_s"] >= 10 * 0.02


def test_host_memory_reports_the_new_batch_memory_and_its_cost(tmp_path) -> None:
    """The bytes the loader's batch buffers took from the system and the thread time that
    took (the kernel populating new pages): made in the first epoch, none later while the
    buffers are reused; a 2 MiB+ buffer (mapped and populated) and small ones alike."""
    path = str(tmp_path / "wide")
    with pyloader.ShardWriter(path, {"x": ("uint8", (64 << 10,)), "y": ("int64", ())}, shard_bytes=4 << 20) as w:
        for i in range(200):
            w.write({"x": np.full(64 << 10, i % 251, np.uint8), "y": i})
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=40, num_workers=2)  # x: 2.5 MiB a batch
    pool = loader._batch_pool
    assert pool is not None
    while pool.preparing:  # See NOTE [prepared slots]: the constructor's thread makes prefetch + 3 slots
        time.sleep(0.005)
    prepared = loader.host_memory()
    assert pool.created == 2 * 2 + 3 and prepared["driver_allocs"] == 2 * 7  # two fields in seven slots
    assert prepared["driver_alloc_bytes"] == prepared["live_bytes"] == 7 * ((4 << 20) + 4096)
    for b in loader:
        del b
    first = loader.host_memory()
    # Fixed-size fields: no buffer is regrown or freed, so every byte held came from the system once.
    assert first["driver_frees"] == 0 and first["driver_allocs"] >= 2 * 7
    assert first["driver_alloc_bytes"] == first["live_bytes"] >= 3 * 40 * ((64 << 10) + 8)
    assert first["driver_alloc_s"] > 0
    for _ in range(3):
        for b in loader:
            del b
    later = loader.host_memory()
    grown = later["driver_allocs"] - first["driver_allocs"]  # slots the next epochs added, if any
    assert later["driver_alloc_bytes"] == later["live_bytes"]
    assert grown <= 2 * 2, later  # the pool reaches its steady size within an epoch or two


def test_fixed_shape_batch_buffers_are_sized_exactly(tmp_path) -> None:
    """A fixed-shape field's batch buffer holds the same bytes every batch: sized to them
    (in whole 2 MiB for a mapped buffer), with none of the headroom a variable-length
    field's buffer gets against rising lengths -- memory the kernel would populate and no
    batch would write. A slot first used by the short last batch is sized like the others.
    The pipeline sizes them (a pool of its own: a DataLoader's pool is prepared beforehand
    with the same sizes, NOTE [prepared slots])."""
    path = str(tmp_path / "exact")
    with pyloader.ShardWriter(path, {"x": ("uint8", (64 << 10,)), "y": ("int64", ())}, shard_bytes=4 << 20) as w:
        for i in range(200):  # 6 batches of 32 and a last one of 8
            w.write({"x": np.full(64 << 10, i % 251, np.uint8), "y": i})
    ds = pyloader.ShardDataset(path, shuffle=True, seed=1)
    pool = _C.SlotPool(num_fields=2)
    for epoch in range(2):
        for b in ds.batches(32, num_threads=2, prefetch=4, pool=pool, epoch=epoch):  # x: exactly 2 MiB a batch
            assert b["x"].shape[1:] == (64 << 10,)
            del b
    mem, slots = pool.memory(), pool.created
    assert slots >= 1  # how many the two threads hold at once depends on scheduling (one on a loaded machine)
    # Per slot: x in one 2 MiB mapping (with 1/8 headroom it would take two), y in one page.
    assert mem["live_bytes"] == slots * ((2 << 20) + 4096), (mem, slots)
    assert mem["driver_frees"] == 0  # nothing was regrown
