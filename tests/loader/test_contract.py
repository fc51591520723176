"""The dataset contract (pyloader.contract): one OrderSpec, both datasets behind one
interface, the loader driving any dataset that implements it, and ParquetDataset's
staging buffers never reused under a live view (NOTE [staging reuse])."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import pyloader
from pyloader.contract import BatchStream, OrderSpec, Plan, PlannedDataset
from pyloader.read import order as _order
from pyloader.read.units import UnitDataset


# -- OrderSpec ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"shuffle_mode": "shards"}, r"shuffle_mode must be one of \('global', 'window'\), got 'shards'"),
    ({"partition": "wrap"}, r"partition must be one of \('pad', 'drop'\), got 'wrap'"),
    ({"seed": -1}, "seed must be a non-negative int"),
    ({"seed": 1.0}, "seed must be a non-negative int"),
    ({"seed": True}, "seed must be a non-negative int"),
    ({"window": 0}, "window must be a positive int"),
    ({"window": 2.5}, "window must be a positive int"),
    ({"shuffle": "yes"}, "shuffle must be True or False, got 'yes'"),
])
def test_order_spec_validates_once(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OrderSpec(**kwargs)


def test_order_spec_overrides_and_settings() -> None:
    spec = OrderSpec(shuffle=np.bool_(False), seed=3, shuffle_mode="window", window=8, partition="drop")
    assert spec.shuffle is False
    assert spec.with_overrides() is spec
    over = spec.with_overrides(shuffle=True, seed=9)
    assert (over.shuffle, over.seed, over.shuffle_mode, over.window, over.partition) == (True, 9, "window", 8, "drop")
    assert spec.settings() == {"shuffle": False, "seed": 3, "shuffle_mode": "window", "window": 8,
                               "partition": "drop"}
    with pytest.raises(ValueError, match="shuffle must be True or False"):
        spec.with_overrides(shuffle=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"shuffle_mode": "x"}, {"partition": "x"}, {"seed": -1}, {"window": 0}])
def test_both_datasets_reject_bad_order_settings_with_the_same_message(write_dataset, tmp_path,
                                                                       kwargs: dict[str, Any]) -> None:
    from convert_util import mixed_table, write_parquet

    pq = write_parquet(tmp_path / "a.parquet", mixed_table(10))
    with pytest.raises(ValueError) as a:
        pyloader.ShardDataset(write_dataset(4), **kwargs)
    with pytest.raises(ValueError) as b:
        pyloader.ParquetDataset(str(pq), **kwargs)
    assert str(a.value) == str(b.value)


def test_shard_dataset_order_attributes_read_and_replace_the_spec(write_dataset) -> None:
    ds = pyloader.ShardDataset(write_dataset(20), shuffle=True, seed=4, shuffle_mode="window", window=5)
    assert ds.order == OrderSpec(shuffle=True, seed=4, shuffle_mode="window", window=5)
    assert (ds.shuffle, ds.seed, ds.shuffle_mode, ds.window, ds.partition) == (True, 4, "window", 5, "pad")
    ds.seed = 7
    assert ds.order.seed == 7
    with pytest.raises(ValueError, match="window must be a positive int"):
        ds.window = 0


# -- both datasets implement the contract ----------------------------------------------
def test_both_datasets_implement_the_contract(write_dataset, tmp_path) -> None:
    from convert_util import mixed_table, write_parquet

    shards = pyloader.ShardDataset(write_dataset(30), shuffle=True, seed=2, rank=1, world_size=2)
    pq = pyloader.ParquetDataset(str(write_parquet(tmp_path / "a.parquet", mixed_table(30), row_group_size=7)),
                                 columns=["id"], shuffle=True, seed=2, rank=1, world_size=2)
    for ds in (shards, pq):
        assert isinstance(ds, PlannedDataset) and isinstance(ds, UnitDataset)
        assert ds.rank_and_world() == (1, 2) and len(ds) == 15 and ds.num_records == 30
        plan = ds.epoch_plan(3, 1, 2)
        assert all(np.array_equal(a, b) for a, b in zip(plan, ds.plan(epoch=3), strict=True))
        it = ds.batches(4, plan=plan, num_threads=1)
        assert len(it) == 4
        batches = list(it)
        first = ds.sample(batches[0], 0)
        assert set(first) == {f.name for f in ds.fields}
    assert isinstance(shards.fingerprint, str) and len(shards.fingerprint) == 16
    assert isinstance(pq.fingerprint, str) and len(pq.fingerprint) == 16
    assert set(pq.fingerprint_parts) == {"paths", "row_groups", "footers", "columns"}
    assert shards.fingerprint_parts is None


def test_epoch_plan_with_segments_is_resume_plan(write_dataset) -> None:
    ds = pyloader.ShardDataset(write_dataset(50), shuffle=True, seed=1, shuffle_mode="window", window=8)
    segs = [[2, 4, 3], [3, 2, 1]]
    got = ds.epoch_plan(5, 2, 4, segs, seed=11)
    want = _order.resume_plan(ds.records_per_shard, shuffle=True, seed=11, epoch=5, rank=2, world_size=4,
                              segments=segs, shuffle_mode="window", window=8, partition="pad")
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


class _Repeated(UnitDataset):
    """A dataset written against the contract only: a shard dataset with every sample twice."""

    def __init__(self, inner: pyloader.ShardDataset) -> None:
        self.inner = inner
        self.order, self.fields, self.epoch = inner.order, inner.fields, 0
        self.rank, self.world_size = inner.rank, inner.world_size
        self.unit_records = [2 * n for n in inner.records_per_shard]
        self.num_records = 2 * inner.num_records

    @property
    def fingerprint(self) -> str | None:
        return None

    def batches(self, batch_size: int, *, plan: Plan, drop_last: bool = False, num_threads: int = 2,
                prefetch: int | None = None, pool: Any = None) -> BatchStream:
        unit, rec = plan
        return self.inner.batches(batch_size, plan=(unit, rec // 2), drop_last=drop_last, num_threads=num_threads,
                                  prefetch=prefetch, pool=pool)


def test_the_loader_drives_any_dataset_that_implements_the_contract(write_dataset) -> None:
    ds = _Repeated(pyloader.ShardDataset(write_dataset(12), rank=0, world_size=1))
    got = [int(x) for b in pyloader.DataLoader(ds, batch_size=5, num_workers=2) for x in b["label"]]
    assert got == [i // 2 for i in range(24)]
    samples = list(pyloader.DataLoader(ds, batch_size=None))
    assert [int(s["label"]) for s in samples] == got
    assert samples[7]["blob"] == b"\x03" * 3  # sample 3 of conftest.mixed_sample
    with pytest.raises(TypeError, match="need a resumable dataset"):
        pyloader.DataLoader(ds, batch_size=5).state_dict()


# -- ParquetDataset staging reuse (NOTE [staging reuse]) ---------------------------------
@pytest.fixture
def pq_dir(tmp_path) -> str:
    from convert_util import mixed_table, write_parquet

    d = tmp_path / "pq"
    d.mkdir()
    write_parquet(d / "a.parquet", mixed_table(200), row_group_size=40)
    return str(d)


def _views(batch: dict[str, torch.Tensor]) -> Iterator[tuple[str, Any, Any]]:
    """(name, a view that outlives the batch, a copy of what it must keep showing)."""
    ids, tok = batch["id"], batch["tokens"]
    yield "slice", ids[2:5], ids[2:5].clone()
    yield "view-as", ids.view(torch.uint8), ids.view(torch.uint8).clone()
    yield "row", tok[1], tok[1].clone()
    yield "numpy", ids.numpy()[::2], ids.numpy()[::2].copy()
    yield "dlpack", torch.utils.dlpack.to_dlpack(ids), ids.clone()


def test_a_view_kept_across_batches_is_never_overwritten(pq_dir) -> None:
    ds = pyloader.ParquetDataset(pq_dir, columns=["id", "tokens"], rank=0, world_size=1)
    it = ds.batches(8, num_threads=2, prefetch=2)
    kept = []
    for k, batch in enumerate(it):
        if k % 5 == 0:
            kept.extend(_views(batch))
        del batch  # only the views keep the buffers
        gc.collect()
    assert len(kept) == 25
    for name, view, want in kept:
        if name == "dlpack":
            view = torch.utils.dlpack.from_dlpack(view)
        got = view if isinstance(view, np.ndarray) else view.clone()
        assert np.array_equal(np.asarray(got), np.asarray(want)), name
    assert it.stats()["staging_buffers"] < 2 * 25  # batches without kept views reused their buffers


def test_a_buffer_returns_when_its_last_view_is_gone() -> None:
    from pyloader.read.parquet import _Staging

    st = _Staging(limit=4)
    a = st.tensor(np.dtype(np.int64), (4,))
    base = a.data_ptr()
    view = a[1:]
    del a
    b = st.tensor(np.dtype(np.int64), (4,))  # the view holds the first buffer: a second one
    assert st.created == 2 and b.data_ptr() != base
    del b
    c = st.tensor(np.dtype(np.int64), (2, 2))  # the second buffer is free again
    assert st.created == 2 and view.data_ptr() == base + 8
    del view, c
    d = st.tensor(np.dtype(np.int32), (3,))
    assert st.created == 2 and d.data_ptr() == base


def test_pyloader_loader_keeps_parquet_views_intact(pq_dir) -> None:
    ds = pyloader.ParquetDataset(pq_dir, columns=["id"], rank=0, world_size=1)
    kept = [b["id"][:3] for b in pyloader.DataLoader(ds, batch_size=16, num_workers=2)]
    gc.collect()
    assert [v.tolist() for v in kept] == [[i, i + 1, i + 2] for i in range(0, 200, 16)]
