"""pyloader.DataLoader.state_dict()/load_state_dict(): exact stop and resume, in one process.

Ranks are simulated by one loader per rank (explicit rank/world_size) stepped in lockstep,
as DDP steps them. Batches are read with several native threads and deep prefetch, so a
state is often taken while batches the caller never saw are already collated.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import time
from typing import Any

import numpy as np
import pytest
from resume_util import common_state, lockstep

import pyloader
from pyloader.loader.state import ResumeError
from pyloader.read import order as _plan

N = 203
FIELDS = {"label": ("int64", ()), "tokens": ("int32", (None,))}


def sample(i: int) -> dict[str, Any]:
    return {"label": i, "tokens": np.arange(i % 5, dtype=np.int32)}


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("resume") / "ds")
    with pyloader.ShardWriter(d, FIELDS, shard_bytes=256) as w:  # about 16 shards
        for i in range(N):
            w.write(sample(i))
    return d


def loaders(path: str, world: int, batch: int, *, threads: int = 2, prefetch: int = 6, drop_last: bool = False,
            **ds_kw: Any) -> list[pyloader.DataLoader]:
    ds_kw.setdefault("shuffle", True)
    ds_kw.setdefault("seed", 11)
    return [pyloader.DataLoader(pyloader.ShardDataset(path, rank=r, world_size=world, **ds_kw), batch_size=batch,
                                num_workers=threads, prefetch=prefetch, drop_last=drop_last)
            for r in range(world)]


def uninterrupted(path: str, world: int, batch: int, epoch: int = 0, **kw: Any) -> list[list[list[int]]]:
    ls = loaders(path, world, batch, **kw)
    for loader in ls:
        loader.set_epoch(epoch)
    return lockstep([iter(loader) for loader in ls], None, "label")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["global", "window"])
@pytest.mark.parametrize("stops", [[0], [1], [3, 2], [5, 1, 4]])
def test_same_world_size_stops_resume_batch_for_batch(ds_path, mode, stops):
    kw = dict(shuffle_mode=mode, window=16)
    want = uninterrupted(ds_path, 3, 4, threads=3, **kw)
    got: list[list[list[int]]] = [[] for _ in range(3)]
    state = None
    for steps in stops + [None]:
        ls = loaders(ds_path, 3, 4, threads=3, prefetch=8, **kw)  # a fresh job each time
        if state is not None:
            for loader in ls:
                loader.load_state_dict(state)
        its = [iter(loader) for loader in ls]
        for r, batches in enumerate(lockstep(its, steps, "label")):
            got[r] += batches
        state = common_state(ls)
        del its, ls
    assert got == want
    assert state["epoch"] == 1 and state["segments"] == []  # the epoch is done


@pytest.mark.timeout(60)
@pytest.mark.parametrize("partition", ["pad", "drop"])
@pytest.mark.parametrize("jobs", [[(4, 3, 5), (3, 4, 4), (2, 6, None)],
                                  [(2, 8, 3), (5, 2, None)],
                                  [(1, 7, 2), (3, 1, 1), (3, 5, 2), (7, 2, None)]])
def test_elastic_resume_reads_the_rest_of_the_epoch_once(ds_path, partition, jobs):
    seen: collections.Counter[int] = collections.Counter()
    state = None
    worlds = []
    for world, batch, steps in jobs:
        worlds.append(world)
        ls = loaders(ds_path, world, batch, partition=partition, threads=2, prefetch=5)
        if state is not None:
            for loader in ls:
                loader.load_state_dict(state)
        for batches in lockstep([iter(loader) for loader in ls], steps, "label"):
            for b in batches:
                seen.update(b)
        state = common_state(ls)
        assert len(json.dumps(state)) < 400
    assert state["epoch"] == 1 and state["segments"] == []
    repeats = sum(seen.values()) - len(seen)
    if partition == "pad":
        assert sorted(seen) == list(range(N))
        assert max(seen.values()) <= 2 and repeats <= sum(w - 1 for w in worlds)
        order = _plan.epoch_order([N], shuffle=True, seed=11, epoch=0)  # labels are global ids
        assert {k for k, v in seen.items() if v == 2} <= set(order[:sum(worlds)].tolist())
    else:
        assert repeats == 0 and N - len(seen) < worlds[-1]


@pytest.mark.timeout(60)
def test_prefetched_batches_are_not_consumed(ds_path):
    ls = loaders(ds_path, 2, 4, threads=3, prefetch=12)
    its = [iter(loader) for loader in ls]
    first = lockstep(its, 2, "label")
    deadline = time.monotonic() + 10
    while min(loader.stats()["batches"] for loader in ls) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)  # let the threads run ahead
    assert min(loader.stats()["batches"] for loader in ls) >= 8
    state = common_state(ls)
    assert state["segments"] == [[2, 4, 2]]
    del its
    ls2 = loaders(ds_path, 2, 4)
    for loader in ls2:
        loader.load_state_dict(state)
    rest = lockstep([iter(loader) for loader in ls2], None, "label")
    assert [a + b for a, b in zip(first, rest, strict=False)] == uninterrupted(ds_path, 2, 4)


@pytest.mark.timeout(60)
def test_state_survives_an_abandoned_iterator_and_epochs_continue(ds_path):
    (loader,) = loaders(ds_path, 1, 10)
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["segments"] == []
    for k, _ in enumerate(loader):
        if k == 4:
            break
    gc.collect()  # the iterator is gone; its count is not
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["segments"] == [[1, 10, 5]]
    (fresh,) = loaders(ds_path, 1, 10)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state  # a loaded state is reported until iteration starts
    rest = [x for b in fresh for x in b["label"].tolist()]
    order0 = _plan.epoch_order([N], shuffle=True, seed=11, epoch=0).tolist()
    assert rest == order0[50:]
    assert fresh.state_dict()["epoch"] == 1 and fresh.state_dict()["segments"] == []
    # The next iter() reads epoch 1 from its start, as an uninterrupted loader would.
    assert [x for b in fresh for x in b["label"].tolist()] == _plan.epoch_order(
        [N], shuffle=True, seed=11, epoch=1).tolist()
    fresh.load_state_dict(state)
    fresh.set_epoch(3)  # drops the loaded position
    assert fresh.state_dict()["epoch"] == 3 and fresh.state_dict()["segments"] == []


@pytest.mark.timeout(60)
def test_end_of_epoch_and_drop_last(ds_path):
    ls = loaders(ds_path, 2, 8, drop_last=True)
    its = [iter(loader) for loader in ls]
    per_rank = -(-N // 2) // 8  # 102 samples per rank, 12 full batches
    lockstep(its, per_rank, "label")
    state = common_state(ls)  # every batch taken, StopIteration not yet seen
    assert state["epoch"] == 1 and state["segments"] == []
    ls = loaders(ds_path, 2, 8, drop_last=True)
    for loader in ls:
        loader.load_state_dict(dict(state, epoch=0, segments=[[2, 8, 7]]))
    rest = lockstep([iter(loader) for loader in ls], None, "label")
    assert [len(r) for r in rest] == [5, 5]
    assert [len(b) for b in rest[0]] == [8] * 5


@pytest.mark.timeout(60)
def test_resume_with_nothing_left_yields_an_empty_epoch_then_continues(ds_path):
    (loader,) = loaders(ds_path, 1, 50)
    state = loader.state_dict()
    loader.load_state_dict(dict(state, segments=[[1, 50, 5]]))  # 203 samples = 5 batches
    assert list(loader) == []
    assert len(list(loader)) == 5  # epoch 1


@pytest.mark.timeout(60)
def test_mismatched_or_malformed_states_raise(ds_path, tmp_path):
    (loader,) = loaders(ds_path, 1, 4)
    good = loader.state_dict()

    def bad(match: str, **change: Any) -> None:
        with pytest.raises(ResumeError, match=match):
            loader.load_state_dict(dict(good, **change))

    bad("another dataset", dataset="0123456789abcdef")
    bad("another dataset", records=N + 1)
    bad("seed=12", seed=12)
    bad("shuffle=False", shuffle=False)
    bad("partition='drop'", partition="drop")
    bad("shuffle_mode", shuffle_mode="window")
    bad("version", version=2)
    bad("epoch", epoch=-1)
    bad("segment 0", segments=[[0, 4, 1]])
    bad("segment 0", segments=[[1, 4]])
    bad("took 60 steps", segments=[[1, 4, 60]])  # 203 samples = 51 batches of 4
    with pytest.raises(ResumeError, match="missing"):
        loader.load_state_dict({"version": 1})
    with pytest.raises(ValueError, match="must be a dict"):
        loader.load_state_dict([1, 2])
    # A different dataset (same size, other content) has another fingerprint.
    other = str(tmp_path / "other")
    with pyloader.ShardWriter(other, FIELDS, shard_bytes=1024) as w:
        for i in range(N):
            w.write(sample(i + 1))
    (loader2,) = loaders(other, 1, 4)
    with pytest.raises(ResumeError, match="another dataset"):
        loader2.load_state_dict(good)
    # Settings that do not change the order do not matter: seed when unshuffled.
    (plain,) = loaders(ds_path, 1, 4, shuffle=False)
    plain.load_state_dict(dict(plain.state_dict(), seed=99))


@pytest.mark.timeout(60)
def test_state_dict_is_small_and_constant_size(ds_path):
    (loader,) = loaders(ds_path, 1, 2)
    it = iter(loader)
    sizes = set()
    for _ in range(40):
        next(it)
        sizes.add(len(json.dumps(loader.state_dict())))
    assert max(sizes) < 300 and max(sizes) - min(sizes) <= 2  # only the step count's digits change


@pytest.mark.timeout(60)
def test_resume_reads_no_consumed_data(ds_path, tmp_path, monkeypatch):
    """Through the node cache, a fresh node resuming near the end downloads only the shards
    the rest of the epoch needs."""
    from remote_servers import FaultServer

    monkeypatch.delenv("PYLOADER_CACHE_DIR", raising=False)
    srv_root = os.path.dirname(ds_path)
    with FaultServer(srv_root, max_life=60) as srv:
        url = f"{srv.url}/{os.path.basename(ds_path)}"
        ds = pyloader.ShardDataset(url, cache_dir=str(tmp_path / "cache-a"))
        loader = pyloader.DataLoader(ds, batch_size=50)
        state = dict(loader.state_dict(), segments=[[1, 50, 3]])  # 150 of 203 consumed
        ds2 = pyloader.ShardDataset(url, cache_dir=str(tmp_path / "cache-b"))
        loader2 = pyloader.DataLoader(ds2, batch_size=50, num_workers=2)
        loader2.load_state_dict(state)
        assert [x for b in loader2 for x in b["label"].tolist()] == list(range(150, N))
        need = set(_plan.locate(np.arange(150, N), ds2.records_per_shard)[0].tolist())
        assert len(need) < len(ds2.shard_paths) // 2
        gets = srv.shard_gets()
        names = [u.rsplit("/", 1)[-1] for u in ds2.shard_paths]
        assert {names.index(p.rsplit("/", 1)[-1]) for p in gets} == need
        assert set(gets.values()) == {1}
        del loader, loader2, ds, ds2
        gc.collect()
