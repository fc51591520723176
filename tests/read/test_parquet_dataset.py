"""pyloader.ParquetDataset: values, plan equality with ShardDataset, lifetime, errors, cache."""

from __future__ import annotations

import glob
import os
import warnings

import numpy as np
import pytest
import torch
from convert_util import mixed_table, pa, write_parquet

import pyloader
from pyloader.read.parquet import ParquetReadError


@pytest.fixture
def pq_dir(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    write_parquet(d / "a.parquet", mixed_table(130), row_group_size=25)
    write_parquet(d / "b.parquet", mixed_table(77, start=130), row_group_size=30)
    return str(d)


def _ids(it) -> list[int]:
    return [int(x) for b in it for x in b["id"]]


def test_batches_hold_the_right_values(pq_dir):
    ds = pyloader.ParquetDataset(pq_dir, columns=["id", "vec", "mat", "tokens", "pairs", "text", "flag"],
                                 shuffle=True, seed=1, window=60, rank=0, world_size=1)
    assert ds.num_records == 207 and len(ds.records_per_group) == 6 + 3
    tab = pa.concat_tables([mixed_table(130), mixed_table(77, start=130)]).to_pydict()
    seen = []
    for b in ds.batches(32):
        assert b["vec"].dtype == torch.float32 and b["mat"].shape[1:] == (2, 2) and b["flag"].dtype == torch.bool
        for r, i in enumerate(b["id"].tolist()):
            seen.append(i)
            assert np.array_equal(b["vec"][r].numpy(), np.asarray(tab["vec"][i], np.float32))
            assert b["mat"][r].tolist() == tab["mat"][i]
            n = int(b["tokens_lengths"][r])
            assert b["tokens"][r, :n].tolist() == tab["tokens"][i] and not b["tokens"][r, n:].any()
            assert b["pairs"][r, : int(b["pairs_lengths"][r])].tolist() == tab["pairs"][i]
            assert bytes(b["text"][r, : int(b["text_lengths"][r])].numpy()) == tab["text"][i].encode()
    assert sorted(seen) == list(range(207)) and seen != sorted(seen)


@pytest.mark.parametrize("world,policy", [(1, "pad"), (3, "pad"), (4, "drop")])
def test_order_equals_shard_dataset_order(pq_dir, tmp_path, world, policy):
    # Global shuffle and unshuffled orders depend only on the record count, so a converted
    # copy read by ShardDataset must give the same ids in the same order, rank by rank.
    out = str(tmp_path / "conv")
    pyloader.convert(pq_dir, out, fields=["id"], shard_size=300)
    for shuffle in (False, True):
        for rank in range(world):
            kw = {"shuffle": shuffle, "seed": 7, "shuffle_mode": "global", "rank": rank, "world_size": world,
                  "partition": policy}
            a = pyloader.ParquetDataset(pq_dir, columns=["id"], **kw)
            b = pyloader.ShardDataset(out, **kw)
            for worker in range(2):
                assert _ids(a.batches(16, epoch=3, worker=worker, num_workers=2)) == \
                    _ids(b.batches(16, epoch=3, worker=worker, num_workers=2))
            assert len(a) == len(b)


def test_window_shuffle_is_deterministic_and_changes_by_epoch(pq_dir):
    def mk():
        return pyloader.ParquetDataset(pq_dir, columns=["id"], shuffle=True, seed=5, window=50,
                                             rank=0, world_size=1)
    e0, again, e1 = _ids(mk().batches(20, epoch=0)), _ids(mk().batches(20, epoch=0)), _ids(mk().batches(20, epoch=1))
    assert e0 == again and e0 != e1 and sorted(e0) == sorted(e1) == list(range(207))


def test_row_groups_are_dropped_after_their_last_batch(pq_dir):
    ds = pyloader.ParquetDataset(pq_dir, columns=["id"], rank=0, world_size=1)
    it = ds.batches(10, num_threads=1, prefetch=1)
    live = []
    for _ in it:
        live.append(len(it._decoded))
    # the group being read, one a batch may straddle into, and num_threads=1 decoded ahead
    assert max(live) <= 3 and it.stats()["row_groups"] == 9


def test_staging_buffers_are_reused_but_never_under_a_live_tensor(pq_dir):
    ds = pyloader.ParquetDataset(pq_dir, columns=["id", "tokens"], rank=0, world_size=1)
    it = ds.batches(8, num_threads=1, prefetch=2)
    first = next(it)
    keep_ids, keep_tok = first["id"].clone(), first["tokens"].clone()
    n = 0
    for b in it:
        n += 1
        del b  # refcounting frees the batch's tensors: their buffers can be reused
    assert torch.equal(first["id"], keep_ids) and torch.equal(first["tokens"], keep_tok)
    assert it.stats()["staging_buffers"] < 2 * n  # reused: not one buffer per field per batch


def test_nulls_wrong_types_and_corrupt_footers(tmp_path):
    p = write_parquet(tmp_path / "n.parquet", pa.table({"x": pa.array([1, 2, 3, None], pa.int32())}),
                      row_group_size=2)
    ds = pyloader.ParquetDataset(p, rank=0, world_size=1)
    with pytest.raises(ParquetReadError, match=r"n.parquet: row group 1: column 'x' is null at row 3"):
        list(ds.batches(4))
    assert _ids_x(pyloader.ParquetDataset(p, nulls="zero", rank=0, world_size=1)) == [1, 2, 3, 0]
    s = write_parquet(tmp_path / "s.parquet", pa.table({"st": pa.array([{"a": 1}])}))
    with pytest.raises(ParquetReadError, match=r"column 'st' has type struct"):
        pyloader.ParquetDataset(s)
    c = tmp_path / "c.parquet"
    c.write_bytes(b"PAR1" + b"\0" * 100)
    with pytest.raises(ParquetReadError, match=r"c.parquet: not a readable Parquet file"):
        pyloader.ParquetDataset(str(c))


def _ids_x(ds) -> list[int]:
    return [int(v) for b in ds.batches(4) for v in b["x"]]


def test_torch_dataloader_workers_split_the_rows(pq_dir):
    ds = pyloader.ParquetDataset(pq_dir, columns=["id", "text"], rank=0, world_size=1)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    ids = [int(s["id"]) for s in dl]
    assert sorted(ids) == list(range(207))


def test_pyloader_dataloader_drives_it(pq_dir):
    ds = pyloader.ParquetDataset(pq_dir, columns=["id"], shuffle=True, rank=0, world_size=1)
    loader = pyloader.DataLoader(ds, batch_size=50, num_workers=2)
    e0 = [int(x) for b in loader for x in b["id"]]
    e1 = [int(x) for b in loader for x in b["id"]]
    assert sorted(e0) == sorted(e1) == list(range(207)) and e0 != e1 and len(loader) == 5


def test_remote_url_through_the_node_cache(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    mem = fsspec.filesystem("memory")
    import io

    import pyarrow.parquet as pq

    for k in range(2):
        buf = io.BytesIO()
        pq.write_table(mixed_table(40, start=40 * k), buf, row_group_size=15)
        mem.pipe(f"/pyl-test/data/p{k}.parquet", buf.getvalue())
    try:
        cache = str(tmp_path / "cache")
        ds = pyloader.ParquetDataset("memory://pyl-test/data", columns=["id", "text"], cache_dir=cache,
                                     rank=0, world_size=1)
        assert _ids(ds.batches(16)) == list(range(80))
        assert ds._fetcher.downloaded == 2
        again = pyloader.ParquetDataset("memory://pyl-test/data", columns=["id"], cache_dir=cache,
                                        rank=0, world_size=1)
        assert _ids(again.batches(16)) == list(range(80)) and again._fetcher.downloaded == 0
        del ds, again
        # `pyloader cache verify` accepts the cached Parquet files (their manifest entry
        # names the remote object, not its bytes) and still catches a damaged one.
        from pyloader.remote.cli import main as cache_main

        assert cache_main(["cache", "verify", "--cache-dir", cache]) == 0
        victim = next(p for p in glob.glob(os.path.join(cache, "**", "shards", "p0.parquet.*"), recursive=True)
                      if os.path.isfile(p))
        with open(victim, "r+b") as f:
            f.write(b"XXXX")
        assert cache_main(["cache", "verify", "--cache-dir", cache]) == 1
    finally:
        mem.rm("/pyl-test", recursive=True)


@pytest.mark.parametrize("kwargs", [{"device": "cpu"}, {"pin_memory": True}, {"device": "cpu", "num_workers": 2}],
                         ids=["device-cpu", "pin-memory", "device-cpu-2-threads"])
def test_dataloader_staging_keeps_parquet_batches(pq_dir, kwargs):
    """ParquetDataset collates into its own pageable buffers: the loader stages them
    (device="cpu": through the copy engine) and must deliver the same batches."""
    cols = ["id", "vec", "mat", "tokens", "flag"]
    ds = pyloader.ParquetDataset(pq_dir, columns=cols, shuffle=True, seed=3)
    ref = [{k: v.clone() for k, v in b.items()} for b in pyloader.DataLoader(ds, batch_size=20)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="pyloader: pin_memory", category=RuntimeWarning)  # no driver here
        loader = pyloader.DataLoader(ds, batch_size=20, **kwargs)
        got = [{k: v.clone() for k, v in b.items()} for b in loader]
    assert len(got) == len(ref) == 11
    for a, b in zip(ref, got):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    if kwargs.get("device") == "cpu":
        assert loader.stats()["copy"]["jobs"] == 11


def test_unsupported_column_names_the_columns_option(tmp_path):
    """Issue 27 item 2: the message names ParquetDataset's own option (``columns=``), with the columns to keep."""
    import pyarrow.parquet as pq

    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"a": pa.array([1, 2, 3], pa.int64()),
                             "s": pa.array([{"x": 1}, {"x": 2}, {"x": 3}]),
                             "b": pa.array([1.0, 2.0, 3.0])}), path)
    with pytest.raises(ParquetReadError) as e:
        pyloader.ParquetDataset(path)
    msg = str(e.value)
    assert "column 's'" in msg and path in msg and "leave it out with columns=['a', 'b']" in msg, msg
    assert "fields=" not in msg, msg
    # Following the advice works.
    ds = pyloader.ParquetDataset(path, columns=["a", "b"])
    assert [f.name for f in ds.fields] == ["a", "b"]
    with pytest.raises(ParquetReadError, match=r"name columns of the supported types with columns="):
        pyloader.ParquetDataset(path, columns=["s"])
    # pyloader.convert names its own option.
    with pytest.raises(pyloader.ConvertError, match=r"leave it out with fields="):
        pyloader.convert(path, str(tmp_path / "out"))
