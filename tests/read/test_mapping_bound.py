"""A local dataset of more shards than its mapping bound (NOTE [mapping bound] in
csrc/core/shard_reader.h): a global shuffle reads the same batches as an unbounded set,
resumes exactly, and never holds more mappings than the bound plus what its workers hold.
The run over 200,000 shards is ``benchmarks/bench_many_shards.py``.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np

import pyloader

N = 400
BOUND = 4
BATCH = 8
WORKERS = 2
FIELDS = {"id": ("int64", ()), "tokens": ("int32", (None,))}


def _sample(i: int) -> dict[str, Any]:
    return {"id": np.int64(i), "tokens": np.arange(i, i + i % 5 + 1, dtype=np.int32)}


def _write(path: str) -> str:
    with pyloader.ShardWriter(path, FIELDS, compression=None, shard_bytes=100) as w:
        for i in range(N):
            w.write(_sample(i))
    return path


def _dataset(path: str, bound: int | None) -> pyloader.ShardDataset:
    ds = pyloader.ShardDataset(path, shuffle=True, seed=3)
    if bound is not None:
        ds.max_mapped_shards = bound
    return ds


def _maps_of(path: str) -> int:
    with open("/proc/self/maps") as fh:
        return sum(1 for line in fh if path in line)


def _check_values(batch: dict[str, Any]) -> None:
    for row, i in enumerate(batch["id"].tolist()):
        n = int(batch["tokens_lengths"][row])
        assert batch["tokens"][row, :n].tolist() == list(range(i, i + i % 5 + 1))


def test_a_global_shuffle_over_more_shards_than_the_bound_reads_every_sample(tmp_path) -> None:
    path = _write(str(tmp_path / "ds"))
    ds = _dataset(path, BOUND)
    shards = len(ds.shard_paths)
    assert shards >= 2 * (BOUND + WORKERS * BATCH + 1)
    unbounded = pyloader.DataLoader(_dataset(path, None), batch_size=BATCH, num_workers=WORKERS)
    reference = [b["id"].tolist() for b in unbounded]
    # The unbounded set maps every shard: gone before the maps are counted, even if a cycle
    # held it (a collection that ran late once left 8 of its mappings in the count).
    del unbounded
    gc.collect()
    assert _maps_of(path) == 0
    loader = pyloader.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    got, peak_maps = [], 0
    for b in loader:
        _check_values(b)
        got.append(b["id"].tolist())
        peak_maps = max(peak_maps, _maps_of(path))
    assert got == reference
    assert sorted(i for b in got for i in b) == list(range(N))
    stats = loader.stats()
    # Beyond the bound: only the shards the workers hold (each batch reads at most BATCH shards),
    # and the one just mapped before another is unmapped.
    held = WORKERS * BATCH
    assert stats["peak_mapped_shards"] <= BOUND + held + 1 < shards
    assert peak_maps <= BOUND + held + 1
    assert stats["remapped_shards"] > 0
    # A second epoch maps the shards again as it needs them.
    assert sorted(i for b in loader for i in b["id"].tolist()) == list(range(N))


def test_a_bounded_epoch_resumes_exactly(tmp_path) -> None:
    path = _write(str(tmp_path / "ds"))
    loader = pyloader.DataLoader(_dataset(path, BOUND), batch_size=BATCH, num_workers=WORKERS)
    it = iter(loader)
    head = [next(it)["id"].tolist() for _ in range(7)]
    state = loader.state_dict()
    rest = [b["id"].tolist() for b in it]
    again = pyloader.DataLoader(_dataset(path, BOUND), batch_size=BATCH, num_workers=WORKERS)
    again.load_state_dict(state)
    resumed = []
    for b in again:
        _check_values(b)
        resumed.append(b["id"].tolist())
    assert resumed == rest
    assert sorted(i for b in head + resumed for i in b) == list(range(N))
    assert again.stats()["remapped_shards"] > 0


def test_an_unbounded_set_keeps_every_shard_it_read_mapped(tmp_path) -> None:
    # The contrast that makes the bound necessary: without it a shuffled epoch maps every shard.
    path = _write(str(tmp_path / "ds"))
    ds = _dataset(path, 0)
    loader = pyloader.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    assert sum(len(b["id"]) for b in loader) == N
    stats = loader.stats()
    assert stats["peak_mapped_shards"] == len(ds.shard_paths)
    assert stats["remapped_shards"] == 0
