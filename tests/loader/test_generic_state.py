"""The generic path's state: a DataLoader over any torch dataset resumes mid-epoch exactly.

NOTE [generic loader state] in pyloader/loader/torch_compat.py. Frameworks call
``state_dict()``/``load_state_dict()`` on any loader that has them (Lightning's checkpoints,
accelerate's DataLoaderAdapter); the checks compare the batches of a loader restored in a
state -- with torch's global RNG moved on, as in a fresh process -- against those the
interrupted loader went on to read.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import IterableDataset, RandomSampler, TensorDataset

import pyloader

DS = TensorDataset(torch.arange(100))


def values(batches):
    return [b[0].tolist() for b in batches]


def interrupted(make, taken):
    """(state after ``taken`` batches, the rest of that epoch, the next epoch) of a loader from ``make``."""
    dl = make()
    it = iter(dl)
    for _ in range(taken):
        next(it)
    state = dl.state_dict()
    json.dumps(state)  # JSON-able, as a checkpoint needs
    rest = values(it)
    nxt = values(dl)
    return state, rest, nxt


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_shuffled_map_dataset_resumes_exactly(workers):
    def make():
        return pyloader.DataLoader(DS, batch_size=8, shuffle=True, num_workers=workers)

    torch.manual_seed(1)
    state, rest, nxt = interrupted(make, 5)
    assert state["batches"] == 5 and state["epoch"] == 0
    torch.manual_seed(99)  # a fresh process's RNG
    fresh = make()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state  # reported until iteration starts
    it = iter(fresh)
    assert len(it) == 13 - 5
    assert values(it) == rest
    assert fresh.state_dict() == {"version": 1, "loader": "torch", "epoch": 1, "batches": 0, "rng": None}
    assert values(fresh) == nxt  # the next epoch too: the RNG went on as the interrupted job's


def test_generators_and_unbatched_iteration():
    def make():
        sampler = RandomSampler(DS, generator=torch.Generator().manual_seed(3))
        return pyloader.DataLoader(DS, batch_size=None, sampler=sampler, generator=torch.Generator().manual_seed(4))

    dl = make()
    it = iter(dl)
    for _ in range(3):
        next(it)
    dl.sampler.generator.manual_seed(77)  # a sampler generator that moved on does not matter: its state is kept
    state = dl.state_dict()
    rest = [x[0].item() for x in it]
    fresh = make()
    fresh.load_state_dict(state)
    assert [x[0].item() for x in fresh] == rest


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(30))


def test_iterable_dataset_reads_and_drops_the_taken_batches():
    def make():
        return pyloader.DataLoader(Stream(), batch_size=4)

    dl = make()
    it = iter(dl)
    next(it), next(it)
    state = dl.state_dict()
    assert state["batches"] == 2
    fresh = make()
    fresh.load_state_dict(state)
    assert [b.tolist() for b in fresh] == [list(range(i, min(i + 4, 30))) for i in range(8, 30, 4)]
    assert fresh.state_dict()["batches"] == 0 and fresh.state_dict()["epoch"] == 1  # the end, with no len()


def test_end_of_epoch_names_the_next_epoch():
    dl = pyloader.DataLoader(DS, batch_size=50)
    assert dl.state_dict() == {"version": 1, "loader": "torch", "epoch": 0, "batches": 0, "rng": None}
    list(dl)
    list(dl)
    assert dl.state_dict()["epoch"] == 2 and dl.state_dict()["batches"] == 0


def test_bad_states_raise_resume_error():
    dl = pyloader.DataLoader(DS, batch_size=10)
    with pytest.raises(pyloader.ResumeError, match="not a pyloader dataset's state"):
        dl.load_state_dict({"version": 1, "dataset": "00", "records": 3})
    with pytest.raises(pyloader.ResumeError, match="batches"):
        dl.load_state_dict({"version": 1, "loader": "torch", "epoch": 0, "batches": -1, "rng": None})
    with pytest.raises(pyloader.ResumeError, match="random state"):
        dl.load_state_dict({"version": 1, "loader": "torch", "epoch": 0, "batches": 2, "rng": None})
    good = pyloader.DataLoader(DS, batch_size=10)
    it = iter(good)
    next(it)
    state = good.state_dict()
    state["batches"] = 11  # past the epoch's 10 batches
    dl.load_state_dict(state)
    with pytest.raises(pyloader.ResumeError, match="batch 11 of an epoch of 10"):
        iter(dl)
    state["rng"] = {"torch": "not base64!"}
    dl.load_state_dict(state)
    with pytest.raises(pyloader.ResumeError, match="base64"):
        iter(dl)
