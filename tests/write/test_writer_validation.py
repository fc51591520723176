"""ShardWriter's validation: bad values, field names and schemas, shard rollover, a failed
``with`` block, overwrite and argument checks; rejected input is a SchemaError (a ValueError)
and leaves the writer and the dataset usable. Shared checks: tests/roundtrip_util.py.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np
import pytest
import torch
from roundtrip_util import check_batches, check_samples, field_dtypes, write

import pyloader
from pyloader import _C

# --- writer validation ------------------------------------------------------------------------


VALIDATION_FIELDS = {"i8": ("int8", ()), "u8": ("uint8", (2,)), "i64": ("int64", (None,)),
                     "f": ("float32", (2, 2)), "b": ("bytes", ()), "flag": ("bool", ())}


def good_sample(i: int) -> dict[str, Any]:
    return {"i8": -i, "u8": [i, 255], "i64": np.arange(i, dtype=np.int64), "f": np.eye(2, dtype=np.float32) * i,
            "b": b"x" * i, "flag": i % 2 == 0}


@pytest.mark.parametrize("field,value,match", [
    ("i8", 1.5, "floating"),
    ("i8", np.float32(2.0), "float"),
    ("u8", np.array([1.0, 2.0]), "float"),
    ("u8", torch.tensor([1.0, 2.0]), "float"),
    ("i64", np.array([0.5]), "float"),
    ("i64", ["a", "b"], "expected int64"),
    ("f", "abcd", "expected float32"),
    ("b", "text", "expected bytes"),
    ("b", [1, 2, 3], "expected bytes"),
    ("b", np.array([1, 2], np.int32), "expected bytes"),
    ("f", torch.zeros(2, 2, dtype=torch.bfloat16), "bfloat16"),
    ("flag", np.array(1.0), "float"),
    ("i8", 128, "out of range"),
    ("i8", -129, "out of range"),
    ("u8", [256, 0], "out of range"),
    ("u8", [-1, 0], "out of range"),
    ("i64", [2**63], "out of range"),
    ("i64", [2**64 + 5], "expected int64|out of range"),
    ("u8", [1, 2, 3], "shape"),
    ("u8", 7, "shape"),
    ("i8", [1], "shape"),
    ("f", np.zeros((4,), np.float32), "shape"),
    ("f", np.zeros((2, 2, 1), np.float32), "shape"),
    ("i64", np.zeros((2, 2), np.int64), "shape"),
    ("i64", 5, "shape"),
])
def test_writer_rejects_bad_value(tmp_path, field, value, match):
    d = str(tmp_path / "ds")
    with pyloader.ShardWriter(d, VALIDATION_FIELDS) as w:
        for i in range(3):
            w.write(good_sample(i))
        bad = good_sample(3)
        bad[field] = value
        with pytest.raises(pyloader.SchemaError, match=match) as ei:
            w.write(bad)
        assert isinstance(ei.value, ValueError)
        assert "sample 3" in str(ei.value) and f"'{field}'" in str(ei.value), str(ei.value)
        assert w.records_written == 3
        w.write(good_sample(3))  # a rejected sample leaves the writer usable
        bad2 = good_sample(4)
        bad2[field] = value
        with pytest.raises(pyloader.SchemaError, match="sample 4"):
            w.write(bad2)
    ds = pyloader.ShardDataset(d)
    assert ds.num_records == 4
    check_batches(ds, [good_sample(i) for i in range(4)], 2)


@pytest.mark.parametrize("field,value", [
    ("i8", np.array(300, np.int16)),             # int16 ndarray -> int8 field
    ("u8", np.array([2**40, 1], np.uint64)),     # uint64 ndarray -> uint8 field
    ("u8", torch.tensor([256, 1], dtype=torch.int16).to(torch.uint16)),  # uint16 tensor -> uint8
    ("i64", np.array([2**63], np.uint64)),       # uint64 ndarray -> int64 field
])
def test_writer_rejects_out_of_range_arrays(tmp_path, field, value):
    # BUG (pyloader/write/writer.py, ShardWriter._to_array, the `isinstance(value, np.ndarray)`
    # branch): an ndarray (or tensor) of a wider integer dtype of the same kind passes
    # np.can_cast(..., casting="same_kind") and is narrowed with astype(), which wraps
    # silently: np.array([2**40], np.uint64) into a uint8 field is stored as 0. Only Python
    # ints and lists are range-checked. Out-of-range values must raise SchemaError.
    with pyloader.ShardWriter(str(tmp_path / "ds"), VALIDATION_FIELDS) as w:
        bad = good_sample(0)
        bad[field] = value
        with pytest.raises(pyloader.SchemaError, match="sample 0"):
            w.write(bad)


def test_writer_accepts_in_range_narrowing_arrays(tmp_path):
    """Wider integer arrays whose values fit are fine (and stored exactly)."""
    s = good_sample(2)
    s.update(i8=np.array(-100, np.int64), u8=np.array([7, 255], np.uint64))
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), VALIDATION_FIELDS, [s]))
    b = next(iter(ds.batches(1)))
    assert b["i8"].tolist() == [-100] and b["u8"].tolist() == [[7, 255]]


def test_writer_bool_field_rejects_non_boolean_ints(tmp_path):
    # BUG (pyloader/write/writer.py, ShardWriter._to_array): a Python int other than 0/1 written
    # to a bool field is silently stored as True (np.asarray(5).astype(bool)); the range
    # check only covers integer targets. 5 is out of range for bool and must raise.
    with pyloader.ShardWriter(str(tmp_path / "ds"), {"flag": ("bool", ())}) as w:
        w.write({"flag": 1})
        with pytest.raises(pyloader.SchemaError, match="sample 1"):
            w.write({"flag": 5})


def test_writer_rejects_missing_extra_and_non_mapping(tmp_path):
    with pyloader.ShardWriter(str(tmp_path / "ds"), VALIDATION_FIELDS) as w:
        w.write(good_sample(0))
        s = good_sample(1)
        del s["i64"]
        with pytest.raises(pyloader.SchemaError, match=r"sample 1: missing field 'i64'"):
            w.write(s)
        s = good_sample(1)
        s["extra"] = 1
        with pytest.raises(pyloader.SchemaError, match=r"sample 1: unknown fields \['extra'\]"):
            w.write(s)
        for bad in ([1, 2], None, ("i8", 1), "i8", 3):
            with pytest.raises(pyloader.SchemaError, match="sample 1: expected a mapping") as ei:
                w.write(bad)  # type: ignore[arg-type]
            assert isinstance(ei.value, ValueError)
        assert w.records_written == 1


@pytest.mark.parametrize("name", ["", "1abc", "a-b", "a b", "x" * 129, "ünï", "a.b", 5, None, b"abc"])
def test_bad_field_names(tmp_path, name):
    with pytest.raises(pyloader.SchemaError, match="field name"):
        pyloader.ShardWriter(str(tmp_path / "ds"), {name: ("int8", ())})


@pytest.mark.parametrize("fields", [
    {}, {"t": ("int8", (None,)), "t_lengths": ("int64", ())}, {"x": ("int8", (2, None))},
    {"x": ("int8", (-1,))}, {"x": ("int8", (2.0,))}, {"x": ("int8", (True,))}, {"x": ("bytes", (3,))},
    {"x": ("int8", (1,) * 17)}, {"x": ("int8", 5.5)}, {"x": ("int64", (2**30, 2**30))},
])
def test_bad_schemas(tmp_path, fields):
    with pytest.raises(pyloader.SchemaError):
        pyloader.ShardWriter(str(tmp_path / "ds"), fields)


def test_longest_field_name_is_accepted(tmp_path):
    name = "n" * 128
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), {name: ("int8", ()), "_": ("int8", (None,))},
                                     [{name: 3, "_": [1, 2]}]))
    b = next(iter(ds.batches(1)))
    assert b[name].tolist() == [3] and b["__lengths"].tolist() == [2]


def test_shard_rollover(tmp_path):
    rng = np.random.default_rng(1)
    samples = [{"v": rng.integers(0, 2**31, 1 + i % 13, dtype=np.int32), "id": i} for i in range(300)]
    shard_bytes = 256
    d = write(str(tmp_path / "ds"), {"v": ("int32", (None,)), "id": ("int64", ())}, samples,
              shard_bytes=shard_bytes, compression="none")
    ds = pyloader.ShardDataset(d)
    with open(os.path.join(d, "manifest.json"), "rb") as fh:
        raw = fh.read()
    manifest = json.loads(raw)["manifest"]
    assert len(manifest["shards"]) >= 20
    assert manifest["records"] == 300 == sum(s["records"] for s in manifest["shards"])
    assert sorted(os.listdir(d)) == sorted(["manifest.json"] + [s["path"] for s in manifest["shards"]])
    first = 0
    for k, s in enumerate(manifest["shards"]):
        with open(os.path.join(d, s["path"]), "rb") as fh:
            data = fh.read()
        assert s["bytes"] == len(data) and s["xxh64"] == f"{_C.xxh64(data):016x}"
        (num_records,) = struct.unpack_from("<Q", data, 16)
        (payload_size,) = struct.unpack_from("<Q", data, 72)
        assert num_records == s["records"] >= 1
        recs = samples[first:first + num_records]
        assert payload_size == sum(8 + 4 * len(r["v"]) for r in recs)
        if k < len(manifest["shards"]) - 1:
            # A shard closes with the first record that brings its payload to shard_bytes.
            assert payload_size >= shard_bytes > payload_size - (8 + 4 * len(recs[-1]["v"]))
        first += num_records
    assert first == 300
    check_batches(ds, samples, 16, num_threads=3)
    check_samples(list(ds), samples, field_dtypes(ds))
    # shard_bytes=1: one record per shard.
    d1 = write(str(tmp_path / "one"), {"v": ("int32", (None,)), "id": ("int64", ())}, samples[:9], shard_bytes=1)
    ds1 = pyloader.ShardDataset(d1)
    assert ds1.records_per_shard == [1] * 9
    check_batches(ds1, samples[:9], 4)


def test_exception_inside_with_leaves_nothing(tmp_path):
    d = str(tmp_path / "ds")
    with pytest.raises(RuntimeError, match="boom"), \
            pyloader.ShardWriter(d, VALIDATION_FIELDS, shard_bytes=64) as w:
        for i in range(50):
            w.write(good_sample(i))
        assert len([f for f in os.listdir(d) if f.endswith(".pyl")]) > 3  # shards were flushed
        raise RuntimeError("boom")
    assert not os.path.exists(d)  # its shards, and the folder it made
    with pytest.raises(pyloader.ManifestError):
        pyloader.ShardDataset(d)


def test_existing_dataset_needs_overwrite(tmp_path):
    d = str(tmp_path / "ds")
    write(d, VALIDATION_FIELDS, [good_sample(i) for i in range(5)])
    with pytest.raises(FileExistsError, match="overwrite"):
        pyloader.ShardWriter(d, VALIDATION_FIELDS)
    check_batches(pyloader.ShardDataset(d), [good_sample(i) for i in range(5)], 2)  # untouched
    new = [good_sample(i + 10) for i in range(3)]
    write(d, VALIDATION_FIELDS, new, overwrite=True)
    check_batches(pyloader.ShardDataset(d), new, 2)


def test_failed_overwrite_does_not_leave_a_broken_dataset(tmp_path):
    # BUG (pyloader/write/writer.py, ShardWriter._flush/abort with overwrite=True): the new
    # shards are written under the same names as the old ones (shard-000000.pyl, ...) and
    # abort() deletes them, while the old manifest.json stays. After a failed overwrite
    # the directory holds a manifest naming shards that were replaced or deleted: the old
    # dataset is lost and reading fails with FileNotFoundError. Expected: the previous
    # dataset still reads intact, or at least no manifest is left pointing at missing shards.
    d = str(tmp_path / "ds")
    old = [good_sample(i) for i in range(40)]
    write(d, VALIDATION_FIELDS, old, shard_bytes=128)
    with pytest.raises(RuntimeError), \
            pyloader.ShardWriter(d, VALIDATION_FIELDS, shard_bytes=128, overwrite=True) as w:
        for i in range(20):
            w.write(good_sample(100 + i))
        raise RuntimeError("boom")
    try:
        ds = pyloader.ShardDataset(d)
    except pyloader.ManifestError:
        return  # acceptable: the dataset is clearly gone
    check_batches(ds, old, 8)


def test_writer_argument_validation(tmp_path):
    d = str(tmp_path / "ds")
    with pytest.raises(ValueError, match="compression"):
        pyloader.ShardWriter(d, {"x": ("int8", ())}, compression="zstd")
    with pytest.raises(ValueError, match="unknown fields"):
        pyloader.ShardWriter(d, {"x": ("int8", ())}, compression={"y": "lz4"})
    for sb in (0, -1, 1.5):
        with pytest.raises(ValueError, match="shard_bytes"):
            pyloader.ShardWriter(d, {"x": ("int8", ())}, shard_bytes=sb)  # type: ignore[arg-type]
    w = pyloader.ShardWriter(d, {"x": ("int8", ())})
    w.write({"x": 1})
    w.close()
    w.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        w.write({"x": 2})

