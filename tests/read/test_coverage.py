"""Coverage and determinism of what each (rank, worker) reads, on real shard files.

The full grid (world sizes x worker counts x shuffle x shuffle mode x partition x N) runs
through ``ShardDataset.plan()`` and the native ``ShardDataset.batches()``; a few cells
also run through torch's ``DataLoader`` with worker processes (slow, so only a few).
Each sample's ``label`` is its global id, and ``img`` is derived from it, so a reader
that returned the right label with the wrong payload is caught too.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

import pyloader

FIELDS: dict[str, Any] = {"label": ("int64", ()), "img": ("uint8", (4,))}
SHARD_BYTES = 60  # ~5 records per shard: many shards, so window mode has shards to shuffle
WINDOW = 7
BATCH = 4
SEED = 7
# torch warns when num_workers exceeds the CPUs it may use; the grid is about coverage.
TORCH_WORKERS_WARNING = "ignore:This DataLoader will create"


def sample(i: int) -> dict[str, Any]:
    return {"label": i, "img": np.array([i % 256, (i * 3) % 256, 255 - i % 256, 7], np.uint8)}


def check_rows(batch: dict[str, torch.Tensor]) -> list[int]:
    """The batch's labels, after checking every row's payload belongs to its label."""
    labels = batch["label"].tolist()
    expected = np.stack([sample(i)["img"] for i in labels]) if labels else np.zeros((0, 4), np.uint8)
    assert np.array_equal(batch["img"].numpy(), expected), "payload does not match its label"
    return labels


def make_ds(path: str, *, rank: int, world: int, shuffle: bool = True, mode: str = "global",
            partition: str = "pad", seed: int = SEED) -> pyloader.ShardDataset:
    return pyloader.ShardDataset(path, shuffle=shuffle, seed=seed, shuffle_mode=mode, window=WINDOW,
                                 rank=rank, world_size=world, partition=partition)


def plan_ids(ds: pyloader.ShardDataset, **kw: Any) -> list[int]:
    sidx, ridx = ds.plan(**kw)
    offsets = np.cumsum(ds.records_per_shard) - np.asarray(ds.records_per_shard)
    return (offsets[sidx] + ridx).tolist()


def native_labels(ds: pyloader.ShardDataset, **kw: Any) -> tuple[list[int], int]:
    """(labels in order, number of batches) read by ds.batches()."""
    labels: list[int] = []
    n = 0
    for batch in ds.batches(BATCH, num_threads=2, **kw):
        labels += check_rows(batch)
        n += 1
    return labels, n


def check_coverage(per_rank: list[list[int]], n: int, world: int, partition: str,
                   epoch_order: list[int]) -> None:
    """The union of all ranks' samples against the partition policy."""
    counts = Counter(itertools.chain.from_iterable(per_rank))
    total = sum(counts.values())
    assert set(counts) <= set(range(n))
    per = -(-n // world) if partition == "pad" else n // world
    assert [len(r) for r in per_rank] == [per] * world, "every rank gets the same number of samples"
    assert total == per * world
    if n % world == 0:
        assert counts == Counter(range(n)), "world size divides N: every sample exactly once"
    elif partition == "pad":
        assert set(counts) == set(range(n)), "pad: every sample at least once"
        padded = per * world - n
        dups = Counter({i: c - 1 for i, c in counts.items() if c > 1})
        assert sum(dups.values()) == padded, "the duplicates are exactly the padded count"
        assert max(counts.values()) <= 1 + -(-padded // n)
        # The padding repeats the epoch order from its start (pyloader.read.order.partition).
        assert dups == Counter(epoch_order[i % n] for i in range(padded))
    else:
        assert max(counts.values()) == 1, "drop: every sample at most once"
        assert len(counts) == n - n % world


# --- the full grid through plan() and batches() -------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [24, 29])
@pytest.mark.parametrize("partition", ["pad", "drop"])
@pytest.mark.parametrize("shuffle,mode", [(False, "global"), (False, "window"), (True, "global"),
                                          (True, "window")])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_grid_coverage_plan_and_native_batches(write_dataset, world: int, shuffle: bool, mode: str,
                                               partition: str, n: int) -> None:
    path = write_dataset(n, FIELDS, sample, shard_bytes=SHARD_BYTES)
    whole = make_ds(path, rank=0, world=1, shuffle=shuffle, mode=mode, partition=partition)
    assert len(whole.shard_paths) >= 4
    epoch_order = plan_ids(whole)
    assert sorted(epoch_order) == list(range(n))
    for workers in (1, 2, 3):
        per_rank: list[list[int]] = []
        batch_counts: list[list[int]] = []
        for rank in range(world):
            ds = make_ds(path, rank=rank, world=world, shuffle=shuffle, mode=mode, partition=partition)
            mine: list[int] = []
            counts: list[int] = []
            for w in range(workers):
                planned = plan_ids(ds, worker=w, num_workers=workers)
                read, nb = native_labels(ds, worker=w, num_workers=workers)
                assert read == planned, f"rank {rank} worker {w}: batches() does not follow plan()"
                assert nb == -(-len(planned) // BATCH)
                mine += read
                counts.append(nb)
            # Splitting a rank among workers neither loses nor duplicates its samples.
            assert mine == plan_ids(ds), f"rank {rank}: workers' blocks do not tile the rank's plan"
            assert len(mine) == len(ds)
            per_rank.append(mine)
            batch_counts.append(counts)
        check_coverage(per_rank, n, world, partition, epoch_order)
        assert all(c == batch_counts[0] for c in batch_counts), (
            f"{workers} workers: ranks produce different batch counts {batch_counts}")
    # pyloader.DataLoader: len() equals the batches it actually produces, on every rank.
    produced = []
    for rank in range(world):
        ds = make_ds(path, rank=rank, world=world, shuffle=shuffle, mode=mode, partition=partition)
        for drop_last in (False, True):
            loader = pyloader.DataLoader(ds, batch_size=BATCH, num_workers=2, drop_last=drop_last)
            batches = [check_rows(b) for b in loader]
            assert len(batches) == len(loader), f"rank {rank} drop_last={drop_last}"
            assert all(len(b) == BATCH for b in batches[:-1])
            if drop_last:
                assert all(len(b) == BATCH for b in batches)
            produced.append((drop_last, len(batches)))
    assert len(set(produced)) <= 2  # one count per drop_last setting, the same on every rank


# --- a few cells through torch's DataLoader with worker processes --------------------------


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings(TORCH_WORKERS_WARNING)
@pytest.mark.parametrize("world,workers,shuffle,mode,partition,n", [
    (2, 2, True, "global", "pad", 29),
    (3, 3, True, "window", "drop", 29),
    (4, 1, False, "global", "pad", 24),
    (1, 2, True, "window", "pad", 29),
])
def test_torch_dataloader_coverage(write_dataset, world: int, workers: int, shuffle: bool, mode: str,
                                   partition: str, n: int) -> None:
    path = write_dataset(n, FIELDS, sample, shard_bytes=SHARD_BYTES)
    epoch_order = plan_ids(make_ds(path, rank=0, world=1, shuffle=shuffle, mode=mode))
    per_rank = []
    for rank in range(world):
        ds = make_ds(path, rank=rank, world=world, shuffle=shuffle, mode=mode, partition=partition)
        dl = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers, timeout=60)
        got: list[int] = []
        for batch in dl:
            got += check_rows(batch)
        assert len(got) == len(ds)
        assert sorted(got) == sorted(plan_ids(ds)), f"rank {rank}: torch workers read another set"
        per_rank.append(got)
    check_coverage(per_rank, n, world, partition, epoch_order)


# --- determinism --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_same_seed_epoch_rank_worker_gives_the_same_order(write_dataset) -> None:
    path = write_dataset(97, FIELDS, sample, shard_bytes=SHARD_BYTES)
    for mode in ("global", "window"):
        for seed, epoch, rank, world, worker, workers in [(0, 0, 0, 1, 0, 1), (5, 3, 1, 3, 1, 2),
                                                          (2**40, 7, 3, 4, 2, 3)]:
            a = make_ds(path, rank=rank, world=world, mode=mode, seed=seed)
            b = make_ds(path, rank=rank, world=world, mode=mode, seed=seed)
            a.set_epoch(epoch)
            b.set_epoch(epoch)
            la, _ = native_labels(a, worker=worker, num_workers=workers)
            lb, _ = native_labels(b, worker=worker, num_workers=workers)
            assert la == lb and len(la) > 3
            assert la == plan_ids(a, worker=worker, num_workers=workers)
            # Another epoch, or another seed, reorders the same rank's data.
            b.set_epoch(epoch + 1)
            assert native_labels(b, worker=worker, num_workers=workers)[0] != la
            c = make_ds(path, rank=rank, world=world, mode=mode, seed=seed + 1)
            c.set_epoch(epoch)
            assert native_labels(c, worker=worker, num_workers=workers)[0] != la
            # The explicit epoch argument and set_epoch agree.
            assert native_labels(b, epoch=epoch, worker=worker, num_workers=workers)[0] == la


@pytest.mark.timeout(180)
def test_torch_dataloader_two_workers_is_deterministic(write_dataset) -> None:
    path = write_dataset(61, FIELDS, sample, shard_bytes=SHARD_BYTES)

    def read(epoch: int, seed: int = SEED) -> list[int]:
        ds = make_ds(path, rank=1, world=2, seed=seed)
        ds.set_epoch(epoch)
        dl = torch.utils.data.DataLoader(ds, batch_size=5, num_workers=2, timeout=60)
        return [x for b in dl for x in check_rows(b)]

    first = read(epoch=2)
    assert len(first) == 31
    assert read(epoch=2) == first
    assert read(epoch=3) != first
    assert read(epoch=2, seed=SEED + 1) != first
    ds = make_ds(path, rank=1, world=2)
    ds.set_epoch(2)
    assert sorted(first) == sorted(plan_ids(ds))


@pytest.mark.timeout(60)
def test_pyloader_dataloader_shuffles_each_epoch_and_set_epoch_replays(write_dataset) -> None:
    n = 64
    path = write_dataset(n, FIELDS, sample, shard_bytes=SHARD_BYTES)
    ds = make_ds(path, rank=0, world=1, shuffle=False)
    loader = pyloader.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)
    orders = [[x for b in loader for x in check_rows(b)] for _ in range(3)]
    for o in orders:
        assert sorted(o) == list(range(n))
        assert o != list(range(n))
    assert len({tuple(o) for o in orders}) == 3, "each iteration is a new epoch with a new order"
    # The k-th iteration read epoch k: plan() agrees, and set_epoch(k) replays it.
    for k, o in enumerate(orders):
        assert plan_ids(ds, epoch=k, shuffle=True) == o
    loader.set_epoch(1)
    assert [x for b in loader for x in check_rows(b)] == orders[1]
    assert [x for b in loader for x in check_rows(b)] == orders[2]  # and continues from there
    # A loader built on a dataset at epoch 2 starts there.
    ds2 = make_ds(path, rank=0, world=1, shuffle=False)
    ds2.set_epoch(2)
    loader2 = pyloader.DataLoader(ds2, batch_size=8, shuffle=True)
    assert [x for b in loader2 for x in check_rows(b)] == orders[2]
    # shuffle=False on the loader overrides a shuffled dataset.
    loader3 = pyloader.DataLoader(make_ds(path, rank=0, world=1, shuffle=True), batch_size=8, shuffle=False)
    assert [x for b in loader3 for x in check_rows(b)] == list(range(n))


# --- environment ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_rank_and_world_size_from_the_environment(write_dataset, monkeypatch) -> None:
    n = 29
    path = write_dataset(n, FIELDS, sample, shard_bytes=SHARD_BYTES)
    per_rank = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        ds = pyloader.ShardDataset(path, shuffle=True, seed=SEED)
        explicit = make_ds(path, rank=rank, world=3)
        assert len(ds) == 10
        assert plan_ids(ds) == plan_ids(explicit)
        labels, nb = native_labels(ds)
        assert labels == plan_ids(explicit)
        assert len(pyloader.DataLoader(ds, batch_size=BATCH)) == nb == 3
        per_rank.append(labels)
    check_coverage(per_rank, n, 3, "pad", plan_ids(make_ds(path, rank=0, world=1)))
    # One explicit value wins; the other still comes from the environment.
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert plan_ids(pyloader.ShardDataset(path, shuffle=True, seed=SEED, rank=1)) == \
        plan_ids(make_ds(path, rank=1, world=4))
    assert plan_ids(pyloader.ShardDataset(path, shuffle=True, seed=SEED, world_size=3)) == \
        plan_ids(make_ds(path, rank=2, world=3))
    # Without the variables: rank 0 of 1.
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert sorted(plan_ids(pyloader.ShardDataset(path))) == list(range(n))
    # A rank outside the world is an error, not a silent empty plan.
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError):
        pyloader.ShardDataset(path).plan()
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError):
        len(pyloader.ShardDataset(path))


# --- tiny datasets ------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings(TORCH_WORKERS_WARNING)
def test_tiny_dataset_pad_gives_every_rank_the_same_batches(write_dataset) -> None:
    path = write_dataset(3, FIELDS, sample, shard_bytes=SHARD_BYTES)
    per_rank, counts = [], []
    for rank in range(4):
        ds = make_ds(path, rank=rank, world=4, partition="pad")
        assert len(ds) == 1
        labels, nb = native_labels(ds)
        loader = pyloader.DataLoader(ds, batch_size=2, num_workers=2)
        assert len(loader) == len(list(loader)) == 1
        counts.append(nb)
        per_rank.append(labels)
        # More workers than samples: the extra workers read nothing and do not hang.
        split = [native_labels(ds, worker=w, num_workers=3)[0] for w in range(3)]
        assert split == [labels, [], []]
        dl = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=3, timeout=60)
        assert [x for b in dl for x in check_rows(b)] == labels
    assert counts == [1, 1, 1, 1]
    check_coverage(per_rank, 3, 4, "pad", plan_ids(make_ds(path, rank=0, world=1)))


def test_tiny_dataset_drop_fails_at_construction(write_dataset) -> None:
    # Fewer records than ranks would give every rank an empty epoch: an error, not silence
    # (tests/read/test_rank_checks.py has the rest).
    path = write_dataset(3, FIELDS, sample, shard_bytes=SHARD_BYTES)
    for rank in range(4):
        with pytest.raises(ValueError, match=r"partition='drop' with world_size=4 and 3 records"):
            make_ds(path, rank=rank, world=4, partition="drop")
