"""Who reads what: rank and world size checked when a dataset is built (NOTE [reader checks]),
and each (rank, worker) planning only its own block of the epoch order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyloader
from pyloader.read.order import epoch_order, locate, partition, plan, split_workers

N = 6  # records in each dataset below

Make = Callable[..., Any]


@pytest.fixture(params=["shards", "parquet"])
def make(request, write_dataset, tmp_path) -> Make:
    """make(**kw) -> a dataset of N records, a ShardDataset or a ParquetDataset."""
    if request.param == "shards":
        path = write_dataset(N, {"label": ("int64", ())}, lambda i: {"label": i})
        return lambda **kw: pyloader.ShardDataset(path, **kw)
    from convert_util import mixed_table, write_parquet

    path = write_parquet(tmp_path / "a.parquet", mixed_table(N), row_group_size=2)
    return lambda **kw: pyloader.ParquetDataset(path, columns=["id"], **kw)


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize("kw,match", [
    ({"rank": 2, "world_size": 2}, r"rank=2, world_size=2: a reader needs world_size >= 1 and 0 <= rank < world_size"),
    ({"rank": 5, "world_size": 3}, r"rank=5, world_size=3"),
    ({"rank": -1, "world_size": 2}, r"rank must be a non-negative int or None, got -1"),
    ({"rank": 0, "world_size": 0}, r"world_size must be a positive int or None, got 0"),
    ({"rank": 0, "world_size": -4}, r"world_size must be a positive int or None, got -4"),
    ({"rank": 1.0, "world_size": 2}, r"rank must be a non-negative int or None, got 1\.0"),
    ({"rank": "1", "world_size": 2}, r"rank must be a non-negative int or None, got '1'"),
    ({"rank": True, "world_size": 2}, r"rank must be a non-negative int or None, got True"),
    ({"rank": 0, "world_size": 2.0}, r"world_size must be a positive int or None, got 2\.0"),
    ({"rank": 3}, r"rank=3, world_size=1 \(from the RANK/WORLD_SIZE environment variables\)"),
])
def test_rank_or_world_size_out_of_range_fails_at_construction(make: Make, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_explicit_rank_against_the_environment_world_size(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"rank=2, world_size=2 \(from the RANK/WORLD_SIZE environment"):
        make(rank=2)
    assert make(rank=1).rank_and_world() == (1, 2)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match=r"rank=4, world_size=3"):
        make(world_size=3)


def test_numpy_ints_are_taken_as_ints(make: Make) -> None:
    ds = make(rank=np.int64(1), world_size=np.int32(3))
    assert ds.rank_and_world() == (1, 3) and type(ds.rank) is int and type(ds.world_size) is int
    assert len(ds) == 2


@pytest.mark.parametrize("world", [N + 1, 4 * N])
def test_drop_with_fewer_records_than_ranks_fails_at_construction(make: Make, world: int) -> None:
    for rank in (0, world - 1):
        with pytest.raises(ValueError, match=rf"partition='drop' with world_size={world} and {N} records gives "
                                             rf"every rank floor\({N} / {world}\) = 0 samples: use partition='pad'"):
            make(rank=rank, world_size=world, partition="drop")


def test_drop_and_pad_that_leave_every_rank_a_sample_are_fine(make: Make) -> None:
    for rank in range(N):
        ds = make(rank=rank, world_size=N, partition="drop")
        assert len(ds) == 1 and ds.plan()[0].size == 1
    for rank in (0, 2 * N - 1):
        ds = make(rank=rank, world_size=2 * N, partition="pad")  # pad repeats samples instead
        assert len(ds) == 1 and ds.plan()[0].size == 1


def test_drop_from_the_environment_fails_at_construction(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(N + 2))
    with pytest.raises(ValueError, match=rf"partition='drop' with world_size={N + 2}"):
        make(partition="drop")


def test_a_bad_assignment_is_refused_and_the_old_value_kept(make: Make) -> None:
    ds = make(rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"rank=2, world_size=2"):
        ds.rank = 2
    with pytest.raises(ValueError, match=r"rank=1, world_size=1"):
        ds.world_size = 1
    assert (ds.rank, ds.world_size) == (1, 2) and ds.rank_and_world() == (1, 2)
    ds.world_size = 3
    ds.rank = 2
    assert ds.rank_and_world() == (2, 3)
    ds.rank = None  # back to the environment's rank 0
    assert ds.rank_and_world() == (0, 3)


def test_the_check_runs_again_at_plan_time(make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = make(partition="drop")  # rank 0 of 1 when built
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(N + 1))  # as a launcher that starts later would say
    for call in (ds.plan, ds.rank_and_world, lambda: len(ds)):
        with pytest.raises(ValueError, match="partition='drop'"):
            call()


# -- each reader plans its own block -----------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(counts=st.lists(st.integers(0, 9), min_size=1, max_size=10), data=st.data())
def test_plan_equals_the_sliced_epoch_order(counts: list[int], data: st.DataObject) -> None:
    if sum(counts) == 0:
        counts[0] = 1
    n = sum(counts)
    world = data.draw(st.integers(1, 2 * n + 2), label="world")
    workers = data.draw(st.integers(1, 4), label="workers")
    kw: dict[str, Any] = {
        "shuffle": data.draw(st.booleans(), label="shuffle"),
        "seed": data.draw(st.integers(0, 2**64 - 1), label="seed"),
        "epoch": data.draw(st.integers(0, 3), label="epoch"),
        "shuffle_mode": data.draw(st.sampled_from(["global", "window"]), label="mode"),
        "window": data.draw(st.integers(1, n + 2), label="window"),
    }
    policy = data.draw(st.sampled_from(["pad", "drop"]), label="partition")
    whole = epoch_order(counts, **kw)
    for rank in sorted({0, world - 1, data.draw(st.integers(0, world - 1), label="rank")}):
        for worker in range(workers):
            got = plan(counts, rank=rank, world_size=world, worker=worker, num_workers=workers, partition=policy,
                       **kw)
            block = split_workers(partition(whole, rank=rank, world_size=world, partition=policy), worker=worker,
                                  num_workers=workers)
            want = locate(block, counts)
            assert all(np.array_equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want, strict=True))


def test_window_plan_of_a_large_epoch_is_its_slice_of_the_order() -> None:
    counts = [100] * 2000  # 200,000 samples, 8 ranks
    kw: dict[str, Any] = {"shuffle": True, "seed": 3, "epoch": 1, "shuffle_mode": "window", "window": 1000}
    whole = epoch_order(counts, **kw)
    for rank in (0, 5, 7):
        shard, record = plan(counts, rank=rank, world_size=8, **kw)
        mine = np.cumsum([0] + counts[:-1])[shard] + record
        assert np.array_equal(mine, whole[rank * 25000 : (rank + 1) * 25000])
