"""A pyloader dataset read as torch reads an ``IterableDataset``: iterated, never indexed."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch

import pyloader


@pytest.mark.timeout(60)
def test_indexing_says_to_iterate(write_dataset, tmp_path) -> None:
    from convert_util import mixed_table, write_parquet

    shards = write_dataset(8)
    parquet = write_parquet(tmp_path / "a.parquet", mixed_table(8))
    for ds in (pyloader.ShardDataset(shards), pyloader.ParquetDataset(parquet),
               pyloader.Mixture([pyloader.ShardDataset(shards)])):
        name = type(ds).__name__
        with pytest.raises(NotImplementedError) as e:
            ds[3]
        msg = str(e.value)
        assert msg.startswith(f"{name}[3]: a {name} is an iterable-style dataset"), msg
        assert "next(iter(ds))" in msg and "pyloader.DataLoader(ds" in msg, msg
        assert "Subclasses of Dataset" not in msg
        assert next(iter(ds)) is not None  # what the message says works


# --- epochs of per-sample iteration (NOTE [epoch per iteration]) ----------------------------

N = 40
FIELDS = {"label": ("int64", ())}


def _dataset(path: str, **kw: Any) -> pyloader.ShardDataset:
    return pyloader.ShardDataset(path, shuffle=True, seed=3, **kw)


def _labels_of(batches: Any) -> list[int]:
    return [int(x) for b in batches for x in b["label"]]


def _epoch_order(path: str, epoch: int, **kw: Any) -> list[int]:
    """What a fresh dataset reads after set_epoch(epoch), iterated once in this process."""
    ds = _dataset(path, **kw)
    ds.set_epoch(epoch)
    return [int(s["label"]) for s in ds]


@pytest.fixture
def shards(write_dataset) -> str:
    return write_dataset(N, FIELDS, lambda i: {"label": i}, shard_bytes=64)


@pytest.mark.timeout(60)
def test_each_iteration_reads_the_next_epoch_and_set_epoch_names_one(shards) -> None:
    ds = _dataset(shards)
    orders = [[int(s["label"]) for s in ds] for _ in range(3)]
    assert all(sorted(o) == list(range(N)) for o in orders)
    assert len({tuple(o) for o in orders}) == 3, "every iteration repeated one order"
    for k, o in enumerate(orders):  # the k-th iteration read epoch k: plan() agrees
        units, records = ds.plan(epoch=k)
        assert o == [int(x) for x in ds.global_index(units, records)]
    assert ds.epoch == 0  # the epoch set_epoch named (none: 0)
    ds.set_epoch(1)
    assert [int(s["label"]) for s in ds] == orders[1]
    assert [int(s["label"]) for s in ds] == orders[2]  # and on from there
    ds.set_epoch(1)
    ds.set_epoch(1)  # the same epoch twice: still the next iteration's
    assert [int(s["label"]) for s in ds] == orders[1]
    # Iterators made one after the other read successive epochs, whenever they are consumed.
    first, second = iter(ds), iter(ds)
    assert [int(s["label"]) for s in second] == _epoch_order(shards, 3)
    assert [int(s["label"]) for s in first] == orders[2]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kw", [{}, {"num_workers": 2}, {"num_workers": 2, "persistent_workers": True}],
                         ids=["main", "workers", "persistent"])
def test_torch_dataloader_epochs_advance_and_workers_agree(shards, kw: dict[str, Any]) -> None:
    """Each epoch of torch's DataLoader reads the next epoch, every worker of it the same one: each sample once."""
    kw = {**kw, "timeout": 60} if kw else kw  # (torch takes a timeout with workers only)
    loader = torch.utils.data.DataLoader(_dataset(shards), batch_size=4, **kw)
    orders = [_labels_of(loader) for _ in range(3)]
    for k, o in enumerate(orders):
        assert sorted(o) == list(range(N)), f"epoch {k}: workers read different epochs ({sorted(o)})"
    assert len({tuple(o) for o in orders}) == 3, "every epoch repeated one order"
    # Epoch k is the order of a fresh dataset set to epoch k, read by the same loader.
    for k in (0, 2):
        ref = _dataset(shards)
        ref.set_epoch(k)
        assert _labels_of(torch.utils.data.DataLoader(ref, batch_size=4, **kw)) == orders[k]
    # set_epoch in the parent reaches the workers, kept ones too.
    loader.dataset.set_epoch(1)
    assert _labels_of(loader) == orders[1]
    assert _labels_of(loader) == orders[2]


@pytest.mark.timeout(180)
def test_ranks_stay_in_step_under_torch_workers(shards) -> None:
    """Two ranks, each with torch workers: every epoch, the ranks' shares are one epoch's partition."""
    loaders = [torch.utils.data.DataLoader(_dataset(shards, rank=r, world_size=2), batch_size=4, num_workers=2,
                                           timeout=60) for r in range(2)]
    seen = []
    for _ in range(2):
        a, b = (_labels_of(dl) for dl in loaders)
        assert sorted(a + b) == list(range(N)) and len(a) == len(b) == N // 2
        seen.append(a)
    assert seen[0] != seen[1]


@pytest.mark.timeout(240)
def test_spawned_workers_share_the_count(shards, tmp_path) -> None:
    script = tmp_path / ("spawned" + ".py")  # (written here: no file of the repository)
    script.write_text(f"""
import torch
import pyloader

if __name__ == "__main__":
    ds = pyloader.ShardDataset({shards!r}, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn",
                                         timeout=120)
    orders = [[int(x) for b in loader for x in b["label"]] for _ in range(2)]
    assert all(sorted(o) == list(range({N})) for o in orders), orders
    assert orders[0] != orders[1]
    ref = pyloader.ShardDataset({shards!r}, shuffle=True, seed=3)
    ref.set_epoch(1)
    again = torch.utils.data.DataLoader(ref, batch_size=4, num_workers=2, multiprocessing_context="spawn",
                                        timeout=120)
    assert [int(x) for b in again for x in b["label"]] == orders[1]
    print("ok")
""")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.mark.timeout(60)
def test_a_copy_counts_on_its_own(shards) -> None:
    """A deepcopy or pickle (not a spawned worker) starts at the next epoch, then counts alone."""
    ds = _dataset(shards)
    assert [int(s["label"]) for s in ds] == _epoch_order(shards, 0)
    twin, pickled = copy.deepcopy(ds), pickle.loads(pickle.dumps(ds))
    e1 = _epoch_order(shards, 1)
    assert [int(s["label"]) for s in twin] == e1 and [int(s["label"]) for s in pickled] == e1
    assert [int(s["label"]) for s in ds] == e1  # the copies' iterations did not move the original's count
    assert [int(s["label"]) for s in twin] == _epoch_order(shards, 2)
