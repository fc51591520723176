"""See NOTE [epoch ahead]: the next epoch's pipeline starts during the current epoch's tail,
and is adopted only when the epoch it planned is the one the next iter() reads."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from roundtrip_util import ID_FIELDS, id_samples, write

import pyloader


@pytest.fixture
def ds_path(tmp_path) -> str:
    return write(str(tmp_path / "ds"), ID_FIELDS, id_samples(300), shard_bytes=2048)


def _ids(batches: Any) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


def _epoch_of_fresh_loader(path: str, epoch: int, **kw: Any) -> list[list[int]]:
    loader = pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=7), **kw)
    loader.set_epoch(epoch)
    return _ids(loader)


def test_consecutive_epochs_start_ahead_and_read_exactly_what_a_fresh_loader_reads(ds_path) -> None:
    kw = {"batch_size": 8, "num_workers": 2}
    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path, shuffle=True, seed=7), **kw)
    seen = []
    for epoch in range(4):
        got = _ids(loader)
        st = loader.stats()
        assert st["started_ahead"], epoch  # epoch 0 in the constructor (NOTE [first epoch ahead])
        # At most prefetch (2 per worker) batches ahead; epoch 0's perhaps none yet, read at once.
        assert (epoch > 0) <= st["batches_ready_at_start"] <= 4
        assert st["batches"] == len(got) == 38 and st["records"] == 300
        assert got == _epoch_of_fresh_loader(ds_path, epoch, **kw), epoch
        assert sorted(i for b in got for i in b) == list(range(300))
        seen.append(got)
    assert seen[1] != seen[2]  # a new order each epoch: the test compares orders that differ


def test_the_constructor_starts_epoch_0_and_what_changes_its_order_drops_it(ds_path) -> None:
    """See NOTE [first epoch ahead]: the constructor's epoch 0 is read only as planned; set_epoch,
    a loaded state or skip_first_batches before the first iter() start the epoch afresh."""
    kw = {"batch_size": 8, "num_workers": 2}
    fresh = _epoch_of_fresh_loader(ds_path, 0, **kw)
    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path, shuffle=True, seed=7), **kw)
    assert loader._ahead is not None and loader._ahead[0][0] == 0
    loader.set_epoch(3)
    assert _ids(loader) == _epoch_of_fresh_loader(ds_path, 3, **kw)
    assert not loader.stats()["started_ahead"]

    donor = pyloader.DataLoader(pyloader.ShardDataset(ds_path, shuffle=True, seed=7), **kw)
    it = iter(donor)
    head = [next(it)["id"].tolist() for _ in range(5)]
    state = donor.state_dict()
    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path, shuffle=True, seed=7), **kw)
    assert loader._ahead is not None
    loader.load_state_dict(state)
    assert head + _ids(loader) == fresh
    assert not loader.stats()["started_ahead"]

    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path, shuffle=True, seed=7), **kw)
    assert _ids(loader.skip_first_batches(3)) == fresh[3:]
    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path, shuffle=True, seed=7),
                                 generator=torch.Generator().manual_seed(1), **kw)
    loader.generator.manual_seed(2)  # the seed the order is made from, changed after the constructor
    other = pyloader.DataLoader(pyloader.ShardDataset(ds_path, shuffle=True, seed=7),
                                generator=torch.Generator().manual_seed(2), **kw)
    assert _ids(loader) == _ids(other) != fresh


def test_set_epoch_to_another_epoch_drops_the_early_pipeline(ds_path) -> None:
    kw = {"batch_size": 8, "num_workers": 2}
    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path, shuffle=True, seed=7), **kw)
    _ids(loader)
    assert loader._ahead is not None  # epoch 1 was started ahead
    loader.set_epoch(5)
    got = _ids(loader)
    assert not loader.stats()["started_ahead"]
    assert got == _epoch_of_fresh_loader(ds_path, 5, **kw)
    loader.set_epoch(6)  # the epoch the early pipeline planned: it is used
    got = _ids(loader)
    assert loader.stats()["started_ahead"]
    assert got == _epoch_of_fresh_loader(ds_path, 6, **kw)


def test_changed_settings_are_never_served_from_the_early_pipeline(ds_path) -> None:
    ds = pyloader.ShardDataset(ds_path, shuffle=True, seed=7)
    loader = pyloader.DataLoader(ds, batch_size=8, num_workers=2)
    _ids(loader)
    loader.num_workers = 1  # threads are part of what the early pipeline was made with
    got = _ids(loader)
    assert not loader.stats()["started_ahead"] and loader.stats()["threads"] == 1
    assert got == _epoch_of_fresh_loader(ds_path, 1, batch_size=8, num_workers=1)
    loader.shuffle = False
    got = _ids(loader)
    assert not loader.stats()["started_ahead"]
    assert got == [list(range(i, min(i + 8, 300))) for i in range(0, 300, 8)]


def test_a_loaded_state_resumes_exactly_although_an_early_pipeline_exists(ds_path) -> None:
    kw = {"batch_size": 8, "num_workers": 2}
    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path, shuffle=True, seed=7), **kw)
    _ids(loader)
    it = iter(loader)  # epoch 1, adopted
    head = [next(it)["id"].tolist() for _ in range(10)]
    state = loader.state_dict()
    rest = _ids(it)
    assert head + rest == _epoch_of_fresh_loader(ds_path, 1, **kw)
    # An early pipeline for epoch 2 now exists; the loaded state (epoch 1, after 10 batches) wins.
    assert loader._ahead is not None
    loader.load_state_dict(state)
    resumed = _ids(loader)
    assert not loader.stats()["started_ahead"]
    assert resumed == rest
    assert _ids(loader) == _epoch_of_fresh_loader(ds_path, 2, **kw)


def test_breaking_out_of_an_epoch_keeps_epoch_numbers_and_batches_exact(ds_path) -> None:
    kw = {"batch_size": 8, "num_workers": 2}
    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path, shuffle=True, seed=7), **kw)
    for epoch in range(3):
        got = []
        for k, b in enumerate(loader):
            got.append(b["id"].tolist())
            if k == 35:  # past the point where the next epoch was started
                break
        assert got == _epoch_of_fresh_loader(ds_path, epoch, **kw)[:36]


def test_the_early_pipeline_collates_no_more_than_its_share(ds_path) -> None:
    import time

    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path), batch_size=8, num_workers=2, prefetch=3)
    it = iter(loader)
    for _ in range(len(it) - 3 * 3 + 1):  # up to the batch that starts the next epoch's pipeline
        next(it)
    early = loader._ahead[1]
    # Until this epoch's batches are all claimed it collates its first batch only; after
    # that (BatchPipeline.hand_over) prefetch batches; never more, however long it waits.
    time.sleep(0.2)
    assert early.counters()["batches"] == 1  # this epoch still has unclaimed batches
    for b in it:
        del b
    deadline = time.monotonic() + 10  # a loaded machine may take a while to collate them
    while early.counters()["batches"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # and no more after
    assert early.counters()["batches"] == 3
    assert loader._batch_pool.created <= 3 + 2 + 1 + 3  # ring, workers, the loop's batch, the early ring


def test_transformed_streams_start_each_epoch_at_iter(ds_path) -> None:
    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path), batch_size=8, num_workers=2,
                                 transform=lambda s: s)
    for _ in range(2):
        assert sum(len(b["id"]) for b in loader) == 300
    assert loader._ahead is None


def test_dropping_the_loader_stops_the_early_pipeline(ds_path) -> None:
    import gc
    import weakref

    loader = pyloader.DataLoader(pyloader.ShardDataset(ds_path), batch_size=8, num_workers=2)
    for b in loader:  # noqa: B007 - the last batch is dropped below
        pass
    del b
    assert loader._ahead is not None
    early = weakref.ref(loader._ahead[1])
    del loader
    gc.collect()
    assert early() is None  # the stream and its native pipeline (threads joined) are gone
    again = pyloader.DataLoader(pyloader.ShardDataset(ds_path), batch_size=300, num_workers=2)
    (b,) = list(again)
    assert torch.equal(b["id"], torch.arange(300))


def test_a_pipeline_made_ahead_takes_only_returned_slots_until_its_epoch_begins(ds_path) -> None:
    import time

    from pyloader import _C

    ds = pyloader.ShardDataset(ds_path)
    pool = _C.SlotPool(num_fields=len(ds.fields))
    held = list(ds.batches(100, pool=pool, num_threads=1, prefetch=1))  # 3 batches kept: 3 slots in use
    assert pool.created == 3 and pool.free == 0
    early = ds.batches(100, pool=pool, num_threads=2, ahead=2, early=True, epoch=1)
    time.sleep(0.3)
    assert early.counters()["batches"] == 0 and pool.created == 3  # it waits; it makes no slot
    del held[0]  # one slot comes back: the early stream takes it
    deadline = time.monotonic() + 10
    while early.counters()["batches"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert early.counters()["batches"] == 1 and pool.created == 3
    early.begin()  # its epoch begins: the pool may grow again
    got = [b["id"].tolist() for b in early]
    assert got == [list(range(0, 100)), list(range(100, 200)), list(range(200, 300))]
    assert pool.created > 3
    del held


def test_closing_a_waiting_early_pipeline_returns_promptly(ds_path) -> None:
    import time

    from pyloader import _C

    ds = pyloader.ShardDataset(ds_path)
    pool = _C.SlotPool(num_fields=len(ds.fields))
    held = list(ds.batches(150, pool=pool, num_threads=1, prefetch=1))
    early = ds.batches(100, pool=pool, num_threads=2, ahead=2, early=True)
    time.sleep(0.1)
    t = time.monotonic()
    early.close()  # its workers wait for a slot that never comes back
    assert time.monotonic() - t < 2.0
    assert len(held) == 2


@pytest.mark.timeout(60)
def test_an_idle_early_pipeline_reads_its_epoch_once_begun(ds_path) -> None:
    import time

    ds = pyloader.ShardDataset(ds_path)
    early = ds.batches(100, ahead=0, early=True)  # made ahead, never handed over (its epoch's loop was closed early)
    time.sleep(0.2)
    assert early.counters()["batches"] == 0
    early.begin()
    assert [b["id"].tolist() for b in early] == [list(range(0, 100)), list(range(100, 200)), list(range(200, 300))]
