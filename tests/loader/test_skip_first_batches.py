"""``DataLoader.skip_first_batches`` and ``set_epoch`` after ``load_state_dict``: how frameworks that count steps resume.

NOTE [skipped batches] in pyloader/loader/dataloader.py. The checks compare batch for batch
with an uninterrupted loader over the same dataset and order.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyloader

N = 203
B = 10


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("skip") / "ds")
    with pyloader.ShardWriter(path, fields={"idx": ("int64", ())}, shard_bytes=512) as w:
        for i in range(N):
            w.write({"idx": np.int64(i)})
    return path


def loader(path, **kw):
    return pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=4, **kw), batch_size=B, num_workers=2)


def epoch(dl):
    return [b["idx"].tolist() for b in dl]


def test_skip_then_set_epoch_reads_the_rest_of_that_epoch(ds_path):
    ref = loader(ds_path)
    e0, e1, e2 = epoch(ref), epoch(ref), epoch(ref)
    dl = loader(ds_path)
    assert dl.skip_first_batches(7) is dl
    dl.set_epoch(1)  # a pending skip survives set_epoch (Trainer calls it after get_resumed_dataloader)
    assert dl.state_dict()["epoch"] == 1 and dl.state_dict()["segments"] == [[1, B, 7]]
    it = iter(dl)
    assert len(it) == len(e1) - 7
    assert [b["idx"].tolist() for b in it] == e1[7:]
    assert dl.stats()["batches"] == len(e1) - 7  # the skipped batches were not read
    assert epoch(dl) == e2  # the next epoch whole
    dl.set_epoch(0)
    assert epoch(dl) == e0


def test_skip_at_two_ranks_continues_each_rank(ds_path):
    refs = [loader(ds_path, rank=r, world_size=2) for r in range(2)]
    full = [epoch(x) for x in refs]
    for r in range(2):
        dl = loader(ds_path, rank=r, world_size=2)
        dl.skip_first_batches(3)
        assert epoch(dl) == full[r][3:]


def test_load_state_then_set_epoch_of_that_state_keeps_the_position(ds_path):
    ref = loader(ds_path)
    e0, e1 = epoch(ref), epoch(ref)
    dl = loader(ds_path)
    dl.set_epoch(1)
    it = iter(dl)
    taken = [next(it)["idx"].tolist() for _ in range(4)]
    state = dl.state_dict()
    del it
    fresh = loader(ds_path)
    fresh.load_state_dict(state)
    fresh.set_epoch(1)  # the state's own epoch: the position is kept
    assert taken + epoch(fresh) == e1
    other = loader(ds_path)
    other.load_state_dict(state)
    other.set_epoch(0)  # another epoch: dropped
    assert epoch(other) == e0
    # load_state_dict replaces a pending skip
    again = loader(ds_path)
    again.skip_first_batches(2)
    again.load_state_dict(state)
    assert taken + epoch(again) == e1


def test_skip_first_batches_rejects_what_it_cannot_count(ds_path, tmp_path):
    with pytest.raises(ValueError, match="num_batches"):
        loader(ds_path).skip_first_batches(-1)
    with pytest.raises(TypeError, match="batch_size"):
        pyloader.DataLoader(pyloader.ShardDataset(ds_path), batch_size=None).skip_first_batches(1)
    with pytest.raises(TypeError, match="pyloader dataset"):
        pyloader.DataLoader(list(range(10)), batch_size=2).skip_first_batches(1)
    # skipping past the epoch's end is an error named at iter(), not silently an empty epoch
    dl = loader(ds_path)
    dl.skip_first_batches(10 ** 6)
    with pytest.raises(ValueError):
        iter(dl)
