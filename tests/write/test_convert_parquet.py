"""pyloader.convert from Parquet and Arrow IPC: round trips, parallel jobs, nulls, bad input, verify."""

from __future__ import annotations

import os

import numpy as np
import pytest
from convert_util import mixed_table, pa, read_all, write_parquet

import pyloader
from pyloader.write import convert as C


def _expected(table) -> list[dict]:
    """Record i of ``table`` as pyloader stores it (independent of the converter's code paths)."""
    cols = table.to_pydict()
    out = []
    for i in range(table.num_rows):
        out.append({
            "id": np.int64(cols["id"][i]), "flag": np.bool_(cols["flag"][i]), "u8": np.uint8(cols["u8"][i]),
            "half": np.float16(cols["half"][i]), "vec": np.asarray(cols["vec"][i], np.float32),
            "mat": np.asarray(cols["mat"][i], np.int16),
            "tokens": np.asarray(cols["tokens"][i], np.int32).reshape(-1),
            "pairs": np.asarray(cols["pairs"][i], np.int64).reshape(-1, 2),
            "text": cols["text"][i].encode("utf-8"), "blob": cols["blob"][i], "cat": cols["cat"][i].encode(),
            "fixed": cols["fixed"][i],
        })
    return out


def _assert_records_equal(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for k in w:
            if isinstance(w[k], bytes):
                assert g[k] == w[k], (i, k)
            else:
                assert g[k].dtype == np.asarray(w[k]).dtype, (i, k)
                assert np.array_equal(g[k], w[k]), (i, k, g[k], w[k])


def test_every_column_kind_round_trips_across_files_and_row_groups(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    t1, t2 = mixed_table(150), mixed_table(70, start=150)
    write_parquet(src / "part-0.parquet", t1, row_group_size=40)
    write_parquet(src / "part-1.parquet", t2, row_group_size=1000)
    res = pyloader.convert(str(src), str(tmp_path / "out"), shard_size=4096, verify=True)
    assert res.records == 220 and res.shards > 1
    assert res.verified["records"] == 220
    ds = pyloader.ShardDataset(str(tmp_path / "out"))
    shapes = {f.name: (f.dtype, f.shape) for f in ds.fields}
    assert shapes == {"id": ("int64", ()), "flag": ("bool", ()), "u8": ("uint8", ()), "half": ("float16", ()),
                      "vec": ("float32", (3,)), "mat": ("int16", (2, 2)), "tokens": ("int32", (None,)),
                      "pairs": ("int64", (None, 2)), "text": ("bytes", (None,)), "blob": ("bytes", (None,)),
                      "cat": ("bytes", (None,)), "fixed": ("bytes", (None,))}
    _assert_records_equal(read_all(str(tmp_path / "out")), _expected(t1) + _expected(t2))


def test_parallel_jobs_write_the_same_records_in_source_order(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for k in range(3):
        write_parquet(src / f"p{k}.parquet", mixed_table(90, start=90 * k), row_group_size=30)
    one = pyloader.convert(str(src), str(tmp_path / "one"), shard_size=2048)
    two = pyloader.convert(str(src), str(tmp_path / "two"), shard_size=2048, jobs=2, verify=True)
    assert two.jobs == 2 and two.records == one.records == 270
    names = [s["path"] for s in pyloader.ShardDataset(str(tmp_path / "two")).manifest["shards"]]
    assert len(names) == len(set(names)) and any("-00001-" in n for n in names)
    a, b = read_all(str(tmp_path / "one")), read_all(str(tmp_path / "two"))
    _assert_records_equal(b, a)
    assert [int(r["id"]) for r in b] == list(range(270))


def test_null_is_an_error_naming_column_and_row_unless_filled(tmp_path):
    t = pa.table({"x": pa.array([1, 2, None, 4], pa.int32()), "s": pa.array(["a", None, "c", "d"]),
                  "v": pa.array([[1], None, [], [2, 3]], pa.list_(pa.int64()))})
    src = write_parquet(tmp_path / "n.parquet", t, row_group_size=2)
    with pytest.raises(pyloader.ConvertError, match=r"column 's' is null at row 1"):
        pyloader.convert(src, str(tmp_path / "bad"))
    assert not os.path.exists(tmp_path / "bad")  # found while sampling, before anything was written
    pyloader.convert(src, str(tmp_path / "ok"), nulls="zero", verify=True)
    recs = read_all(str(tmp_path / "ok"))
    assert [int(r["x"]) for r in recs] == [1, 2, 0, 4]
    assert [r["s"] for r in recs] == [b"a", b"", b"c", b"d"]
    assert [r["v"].tolist() for r in recs] == [[1], [], [], [2, 3]]


def test_unmappable_and_wrong_type_columns_fail_naming_the_column(tmp_path):
    t = pa.table({"ok": pa.array([1, 2]), "st": pa.array([{"a": 1}, {"a": 2}]),
                  "ll": pa.array([[[1]], [[2, 3]]], pa.list_(pa.list_(pa.int8()))),
                  "word": pa.array(["x", "y"]), "big": pa.array([1, 300], pa.int64())})
    src = write_parquet(tmp_path / "t.parquet", t)
    with pytest.raises(pyloader.ConvertError, match=r"column 'st' has type struct"):
        pyloader.convert(src, str(tmp_path / "a"))
    with pytest.raises(pyloader.ConvertError, match=r"column 'll'.*variable-length"):
        pyloader.convert(src, str(tmp_path / "a"), fields=["ok", "ll"])
    with pytest.raises(pyloader.ConvertError, match=r"column 'word'.*cannot be cast to int32"):
        pyloader.convert(src, str(tmp_path / "a"), fields={"word": "int32"})
    with pytest.raises(pyloader.ConvertError, match=r"column 'big'.*cannot be cast to uint8"):
        pyloader.convert(src, str(tmp_path / "a"), fields={"big": "uint8"})
    with pytest.raises(pyloader.ConvertError, match=r"has no column 'nope'"):
        pyloader.convert(src, str(tmp_path / "a"), fields=["nope"])
    res = pyloader.convert(src, str(tmp_path / "b"), fields={"big": "int16", "ok": None}, verify=True)
    assert [f["dtype"] for f in res.fields] == ["int16", "int64"]
    assert [int(r["big"]) for r in read_all(str(tmp_path / "b"))] == [1, 300]


def test_files_with_different_schemas_are_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_parquet(src / "a.parquet", pa.table({"x": pa.array([1], pa.int32())}))
    write_parquet(src / "b.parquet", pa.table({"x": pa.array([1.5], pa.float64())}))
    with pytest.raises(pyloader.ConvertError, match=r"b.parquet: column 'x' converts to float64"):
        pyloader.convert(str(src), str(tmp_path / "out"))


def test_corrupt_footer_is_a_clear_error(tmp_path):
    src = write_parquet(tmp_path / "c.parquet", mixed_table(20))
    path = tmp_path / "c.parquet"
    data = bytearray(path.read_bytes())
    data[-8:-4] = b"\xff\xff\xff\x7f"  # footer length beyond the file
    path.write_bytes(bytes(data))
    with pytest.raises(pyloader.ConvertError, match=r"c.parquet: not a readable Parquet file"):
        pyloader.convert(src, str(tmp_path / "out"))
    path.write_bytes(bytes(data[:-1]))  # no trailing magic
    with pytest.raises(pyloader.ConvertError, match=r"c.parquet: not a readable Parquet file"):
        pyloader.convert(src, str(tmp_path / "out"))


def test_empty_parquet_is_refused(tmp_path):
    # A dataset of no records cannot be read (ShardDataset refuses it): convert writes none.
    src = write_parquet(tmp_path / "e.parquet", mixed_table(1).slice(0, 0))
    with pytest.raises(pyloader.ConvertError, match="no records"):
        pyloader.convert(src, str(tmp_path / "out"), verify=True)
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("stream", [False, True])
def test_arrow_ipc_file_and_stream(tmp_path, stream):
    t = mixed_table(50)
    path = str(tmp_path / ("d.arrows" if stream else "d.arrow"))
    with pa.OSFile(path, "wb") as sink:
        w = (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, t.schema)
        for b in t.to_batches(max_chunksize=16):
            w.write_batch(b)
        w.close()
    res = pyloader.convert(path, str(tmp_path / "out"), verify=True)
    assert res.records == 50
    _assert_records_equal(read_all(str(tmp_path / "out")), _expected(t))


def test_auto_compression_keeps_incompressible_fields_raw(tmp_path):
    rng = np.random.default_rng(0)
    t = pa.table({"noise": pa.array(rng.integers(0, 256, (300, 512), dtype=np.uint8).tolist(),
                                    pa.list_(pa.uint8(), 512)),
                  "zeros": pa.array(np.zeros((300, 512), np.uint8).tolist(), pa.list_(pa.uint8(), 512))})
    src = write_parquet(tmp_path / "z.parquet", t)
    res = pyloader.convert(src, str(tmp_path / "out"), compression="auto", verify=True)
    assert res.compression == {"noise": "none", "zeros": "lz4"}
    assert res.bytes_out < 300 * 512 + 300 * 200  # zeros compressed away


def test_verify_finds_a_changed_record(tmp_path):
    t = mixed_table(40)
    src = write_parquet(tmp_path / "v.parquet", t)
    pyloader.convert(src, str(tmp_path / "out"))
    ids = t.column("id").to_numpy().copy()
    ids[17] = -1
    write_parquet(src, t.set_column(0, "id", pa.array(ids)))
    with pytest.raises(pyloader.VerifyError, match=r"record 17 field 'id' differs"):
        pyloader.verify_conversion(src, str(tmp_path / "out"))
    write_parquet(src, mixed_table(41))
    with pytest.raises(pyloader.VerifyError, match=r"holds 40 records, the source 41"):
        pyloader.verify_conversion(src, str(tmp_path / "out"))


def test_overwrite_replaces_the_dataset_and_removes_old_shards(tmp_path):
    src = write_parquet(tmp_path / "o.parquet", mixed_table(30))
    out = str(tmp_path / "out")
    pyloader.convert(src, out, shard_size=1024)
    old = set(os.listdir(out))
    with pytest.raises(FileExistsError):
        pyloader.convert(src, out)
    pyloader.convert(src, out, overwrite=True, shard_size=1 << 20, verify=True)
    new = {f for f in os.listdir(out) if f.endswith(".pyl")}
    assert len(new) == 1 and not (new & old)


def test_a_failing_job_leaves_no_dataset(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_parquet(src / "a.parquet", pa.table({"x": pa.array(range(100), pa.int64())}), row_group_size=10)
    write_parquet(src / "b.parquet", pa.table({"x": pa.array([1] * 15 + [None] * 85, pa.int64())}),
                  row_group_size=10)
    with pytest.raises(pyloader.ConvertError, match=r"b.parquet: row group 1: column 'x' is null at row 15\b"):
        pyloader.convert(str(src), str(tmp_path / "out"), jobs=2, shard_size=64, compression="none")
    assert not (tmp_path / "out").exists()  # nor the folder the run made


def test_split_units_is_contiguous_and_balanced():
    r = C._split_units([10, 10, 10, 10, 100, 10], 3)
    assert r[0][0] == 0 and r[-1][1] == 6 and all(a < b for a, b in r)
    assert all(r[k][1] == r[k + 1][0] for k in range(len(r) - 1))
    assert C._split_units([5], 4) == [(0, 1)]
