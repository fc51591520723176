"""Shard format version 3: small fixed fields stored as columns (docs/format.md, "Columns").

Round trips of narrow tables through the writer and the native reader, shuffled against
sequential reads, datasets mixing versions 1, 2 and 3, and corruption: a bit flip in a
column block, in the column table or anywhere in the file, an inconsistent column table
and a truncated file must each raise an error naming the shard, never return wrong data.
The layout is parsed here from the format description (with ``xxhash`` as the checksum
oracle), not through the writer's code.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

import pyloader
from pyloader import _C
from pyloader.format import spec as _format

HEADER = struct.Struct("<8sIIQIIQQQQQQQQQQQQ")
NAMES = ("magic", "version", "header_size", "num_records", "num_fields", "entry_size", "schema_off",
         "schema_size", "index_off", "index_size", "payload_off", "payload_size", "file_size",
         "schema_checksum", "index_checksum", "columns_size", "columns_checksum", "header_checksum")
DESC = struct.Struct("<IIIIQ")  # field, row_bytes, block_rows, reserved, offset
ENTRY = struct.Struct("<QIIIB3xQ")  # offset, stored, decoded, leading, codec, checksum

# A narrow table: every field but "wide" (512 bytes) and "tokens" (variable) is a column.
FIELDS: dict[str, Any] = {
    "id": ("int64", ()),
    "x": ("float32", (4,)),
    "label": ("int32", ()),
    "flag": ("bool", ()),
    "small": ("uint8", (3,)),
    "half": ("bfloat16", (2,)),
    "wide": ("float64", (64,)),
    "tokens": ("int16", (None,)),
    "big": ("float64", (32,)),  # 256 bytes: the largest column
}
COLUMNS = ["id", "x", "label", "flag", "small", "half", "big"]


def sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    return {"id": i * 1_000_003 - 7, "x": rng.standard_normal(4).astype(np.float32), "label": i % 1000 - 500,
            "flag": bool(i % 3), "small": np.array([i % 256, (i * 7) % 256, 255], np.uint8),
            "half": np.array([i & 0xFFFF, 0x3F80], np.uint16), "wide": rng.standard_normal(64),
            "tokens": np.arange(i % 6, dtype=np.int16) - i % 100, "big": np.full(32, i / 3)}


def write(path: str, n: int, fields: dict[str, Any] = FIELDS, sample=sample, **kw: Any) -> str:
    kw.setdefault("shard_bytes", 1 << 20)
    with pyloader.ShardWriter(path, fields, **kw) as w:
        for i in range(n):
            w.write(sample(i))
    return path


def header_of(data: bytes | bytearray) -> dict[str, Any]:
    return dict(zip(NAMES, HEADER.unpack_from(data, 0)))


def columns_of(data: bytes | bytearray) -> list[dict[str, Any]]:
    """The column table of a version 3 shard, parsed as docs/format.md describes it."""
    h = header_of(data)
    t = h["schema_off"] + h["schema_size"]
    (n,) = struct.unpack_from("<I", data, t)
    out, pos = [], t + 8 + 24 * n
    for c in range(n):
        field, row, rows, reserved, off = DESC.unpack_from(data, t + 8 + 24 * c)
        blocks = -(-h["num_records"] // rows)
        out.append({"field": field, "row_bytes": row, "block_rows": rows, "offset": off, "desc_pos": t + 8 + 24 * c,
                    "checksums_pos": pos, "checksums": struct.unpack_from(f"<{blocks}Q", data, pos)})
        pos += 8 * blocks
    assert pos == t + h["columns_size"]
    return out


def rewrite(ds: str, shard: str, data: bytes) -> None:
    """Replaces a shard's bytes and updates its manifest entry (size, whole-file XXH64)."""
    with open(shard, "wb") as fh:
        fh.write(data)
    mpath = os.path.join(ds, "manifest.json")
    with open(mpath, "rb") as fh:
        body = _format.parse_manifest(fh.read(), mpath, _C.xxh64)
    for s in body["shards"]:
        if os.path.join(ds, s["path"]) == shard:
            s["bytes"], s["xxh64"] = len(data), f"{_C.xxh64(data):016x}"
    with open(mpath, "wb") as fh:
        fh.write(_format.dump_manifest(body, _C.xxh64))


def reseal(data: bytearray) -> bytearray:
    """Recomputes the column table's checksum and the header's (version 3)."""
    h = header_of(data)
    t = h["schema_off"] + h["schema_size"]
    struct.pack_into("<Q", data, 112, xxhash.xxh3_64_intdigest(bytes(data[t:t + h["columns_size"]])))
    struct.pack_into("<Q", data, 120, xxhash.xxh3_64_intdigest(bytes(data[:120])))
    return data


def to_indexed(data: bytes, version: int) -> bytes:
    """The version 1 or 2 shard of a version 3 shard's records: every column value gets an
    index entry pointing into the unchanged payload, and every checksum is recomputed."""
    hash_ = xxhash.xxh64_intdigest if version == 1 else xxhash.xxh3_64_intdigest
    h = header_of(data)
    cols = {c["field"]: c for c in columns_of(data)}
    nf, nr = h["num_fields"], h["num_records"]
    indexed = [f for f in range(nf) if f not in cols]
    payload = data[h["payload_off"]:]
    entries = []
    for r in range(nr):
        for f in range(nf):
            if f in cols:
                c = cols[f]
                off = c["offset"] + r * c["row_bytes"]
                e = (off, c["row_bytes"], c["row_bytes"], 0, 0, 0)
            else:
                pos = h["index_off"] + (r * len(indexed) + indexed.index(f)) * 32
                e = ENTRY.unpack_from(data, pos)
            entries.append(ENTRY.pack(*e[:5], hash_(payload[e[0]:e[0] + e[1]])))
    index = b"".join(entries)
    schema = data[h["schema_off"]:h["schema_off"] + h["schema_size"]]
    body = HEADER.pack(b"PYLSHARD", version, 128, nr, nf, 32, 128, len(schema), 128 + len(schema), len(index),
                       128 + len(schema) + len(index), len(payload), 128 + len(schema) + len(index) + len(payload),
                       hash_(schema), hash_(index), 0, 0, 0)[:120]
    return body + struct.pack("<Q", hash_(body)) + schema + index + payload


def read_all(path: str, batch_size: int = 64, **kw: Any) -> dict[str, np.ndarray]:
    """Every record's fields, in plan order, concatenated over batches (numpy)."""
    parts: dict[str, list[np.ndarray]] = {}
    for b in pyloader.ShardDataset(path).batches(batch_size, num_threads=2, **kw):
        for k, v in b.items():
            a = v.view(torch.int16).numpy() if v.dtype == torch.bfloat16 else v.numpy()
            parts.setdefault(k, []).append(a)
    out = {}
    for k, v in parts.items():
        if v[0].ndim >= 2 and len({a.shape[1] for a in v}) > 1:  # a variable field: pad to the widest batch
            w = max(a.shape[1] for a in v)
            v = [np.pad(a, [(0, 0), (0, w - a.shape[1])] + [(0, 0)] * (a.ndim - 2)) for a in v]
        out[k] = np.concatenate(v)
    return out


def expected(n: int, fields: dict[str, Any] = FIELDS, sample=sample) -> dict[str, list[Any]]:
    return {k: [sample(i)[k] for i in range(n)] for k in fields}


def check_equal(got: dict[str, np.ndarray], n: int, order: np.ndarray | None = None) -> None:
    want = expected(n)
    ids = range(n) if order is None else order
    assert got["id"].tolist() == [want["id"][i] for i in ids]
    for r, i in enumerate(ids):
        for k in ("x", "label", "flag", "small", "wide", "big"):
            assert np.array_equal(got[k][r], np.asarray(want[k][i], dtype=got[k].dtype)), (k, i)
        assert got["half"][r].view(np.uint16).tolist() == want["half"][i].tolist()
        ln = int(got["tokens_lengths"][r])
        assert got["tokens"][r, :ln].tolist() == want["tokens"][i].tolist()


# -- the layout the writer produces -----------------------------------------------------------


def test_narrow_fields_are_columns_with_block_checksums(tmp_path):
    n = 5000  # not a multiple of any column's block rows
    ds = write(str(tmp_path / "ds"), n, shard_bytes=1 << 30)
    (path,) = pyloader.ShardDataset(ds).shard_paths
    with open(path, "rb") as fh:
        data = fh.read()
    h = header_of(data)
    assert h["version"] == 3 and h["num_records"] == n
    assert h["header_checksum"] == xxhash.xxh3_64_intdigest(data[:120])
    t = h["schema_off"] + h["schema_size"]
    assert h["columns_checksum"] == xxhash.xxh3_64_intdigest(data[t:t + h["columns_size"]])
    assert h["index_off"] == t + h["columns_size"]
    cols = columns_of(data)
    names = list(FIELDS)
    assert [names[c["field"]] for c in cols] == COLUMNS
    assert h["index_size"] == n * 2 * 32  # only "wide" and "tokens" have index entries
    assert max(len(c["checksums"]) for c in cols) == 20  # "big": 256 rows per block, the last one short
    want = expected(n)
    for c in cols:
        name, rb, rows = names[c["field"]], c["row_bytes"], c["block_rows"]
        assert rows & (rows - 1) == 0 and (rows * rb <= 65536 < 2 * rows * rb)
        col = data[h["payload_off"] + c["offset"]:h["payload_off"] + c["offset"] + n * rb]
        assert len(c["checksums"]) == -(-n // rows)
        for k, digest in enumerate(c["checksums"]):  # the last block is the short remainder
            assert digest == xxhash.xxh3_64_intdigest(col[k * rows * rb:(k + 1) * rows * rb])
        f = _format.make_field(name, FIELDS[name])
        values = np.frombuffer(col, f.np_dtype).reshape(n, *f.shape)
        for i in {0, 1, min(rows, n) - 1, min(rows, n - 1), n - 1}:
            assert np.array_equal(values[i], np.asarray(want[name][i], f.np_dtype)), (name, i)


def test_narrow_table_costs_about_its_raw_bytes(tmp_path):
    fields = {"id": ("int64", ()), "x": ("float32", (4,)), "label": ("int32", ())}

    def row(i: int) -> dict[str, Any]:
        return {"id": i, "x": np.full(4, i, np.float32), "label": i % 10}

    n, raw = 20_000, 20_000 * 28
    v3 = pyloader.ShardDataset(write(str(tmp_path / "v3"), n, fields, row, shard_bytes=200_000))
    v2 = pyloader.ShardDataset(write(str(tmp_path / "v2"), n, fields, row, shard_bytes=200_000, version=2))
    size = {k: sum(s["bytes"] for s in d.manifest["shards"]) for k, d in (("v3", v3), ("v2", v2))}
    assert size["v3"] < 1.02 * raw < size["v2"] / 4
    assert np.array_equal(read_all(str(tmp_path / "v3"))["id"], np.arange(n))


def test_wide_only_dataset_stays_version_2(tmp_path):
    ds = write(str(tmp_path / "ds"), 10, {"img": ("uint8", (300,)), "t": ("int32", (None,))},
               lambda i: {"img": np.full(300, i, np.uint8), "t": np.arange(i, dtype=np.int32)})
    for p in pyloader.ShardDataset(ds).shard_paths:
        with open(p, "rb") as fh:
            assert header_of(fh.read())["version"] == 2


def test_writer_version_option(tmp_path):
    ds = write(str(tmp_path / "ds"), 50, version=2)
    for p in pyloader.ShardDataset(ds).shard_paths:
        with open(p, "rb") as fh:
            assert header_of(fh.read())["version"] == 2
    check_equal(read_all(ds), 50)
    for bad in (1, 4, "3", True):
        with pytest.raises(ValueError, match="version must be 2 or 3"):
            pyloader.ShardWriter(str(tmp_path / f"bad{bad}"), FIELDS, version=bad)


# -- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 4097])
def test_round_trip_sequential_and_shuffled(tmp_path, n):
    ds = write(str(tmp_path / "ds"), n, shard_bytes=150_000)
    seq = read_all(ds)
    check_equal(seq, n)
    check_equal(read_all(ds, batch_size=5), n)  # a second read: the blocks are already verified
    shuf = read_all(ds, batch_size=37, shuffle=True, seed=3)
    order = shuf["id"]
    ids = [(v + 7) // 1_000_003 for v in order.tolist()]
    assert sorted(ids) == list(range(n)) and (n < 10 or ids != list(range(n)))
    for k in seq:
        if k != "tokens":
            assert np.array_equal(shuf[k], seq[k][ids]), k


def test_columns_only_table_round_trips_across_shards(tmp_path):
    fields = {"a": ("int64", ()), "b": ("float64", (4,))}
    n = 30_000
    ds = write(str(tmp_path / "ds"), 0, fields)  # an empty dataset first: no shards
    with open(os.path.join(ds, "manifest.json"), "rb") as fh:
        assert _format.parse_manifest(fh.read(), ds, _C.xxh64)["shards"] == []
    with pyloader.ShardWriter(str(tmp_path / "ds2"), fields, shard_bytes=100_000) as w:
        for i in range(n):
            w.write({"a": i, "b": np.arange(4.0) + i})
    d = pyloader.ShardDataset(str(tmp_path / "ds2"))
    assert len(d.shard_paths) >= 9
    got = read_all(str(tmp_path / "ds2"), batch_size=1000, shuffle=True, seed=1)
    assert sorted(got["a"].tolist()) == list(range(n))
    assert np.array_equal(got["b"][:, 0], got["a"].astype(np.float64))


def test_empty_version_3_shard_reads_beside_others(tmp_path):
    """A 0-record version 3 shard, built from the format description, reads as no records."""
    ds = write(str(tmp_path / "ds"), 20)
    fields = pyloader.ShardDataset(ds).fields
    schema = _format.encode_schema(fields)
    cols = [_format.ColumnDesc(i, f.row_bytes, 1024, 0, ()) for i, f in enumerate(fields)
            if _format.is_column_field(f)]
    table = _format.encode_column_table(cols)
    h3 = xxhash.xxh3_64_intdigest
    header = _format.pack_header(num_records=0, num_fields=len(fields), schema_size=len(schema), index_size=0,
                                 payload_size=0, schema_checksum=h3(schema), index_checksum=h3(b""), version=3,
                                 columns_size=len(table), columns_checksum=h3(table))
    data = header + schema + table
    with open(os.path.join(ds, "empty.pyl"), "wb") as fh:
        fh.write(data)
    mpath = os.path.join(ds, "manifest.json")
    with open(mpath, "rb") as fh:
        body = _format.parse_manifest(fh.read(), mpath, _C.xxh64)
    body["shards"].insert(0, {"path": "empty.pyl", "records": 0, "bytes": len(data),
                              "xxh64": f"{_C.xxh64(data):016x}"})
    with open(mpath, "wb") as fh:
        fh.write(_format.dump_manifest(body, _C.xxh64))
    check_equal(read_all(ds), 20)


def test_versions_1_2_and_3_mixed_in_one_dataset(tmp_path):
    n = 600
    ds = write(str(tmp_path / "ds"), n, shard_bytes=40_000)
    paths = pyloader.ShardDataset(ds).shard_paths
    assert len(paths) >= 4
    for k, p in enumerate(paths[:-1]):
        with open(p, "rb") as fh:
            data = fh.read()
        if k % 3 != 2:
            rewrite(ds, p, to_indexed(data, 1 + k % 3))
    versions = []
    for p in paths:
        with open(p, "rb") as fh:
            versions.append(header_of(fh.read())["version"])
    assert set(versions) == {1, 2, 3}, versions
    check_equal(read_all(ds), n)
    shuf = read_all(ds, batch_size=50, shuffle=True, seed=9)
    ids = [(v + 7) // 1_000_003 for v in shuf["id"].tolist()]
    assert sorted(ids) == list(range(n))
    assert np.array_equal(shuf["big"], read_all(ds)["big"][ids])


# -- corruption ---------------------------------------------------------------------------------


def _flip(path: str, pos: int, bit: int = 0) -> None:
    with open(path, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ (1 << bit)]))


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_bit_flip_in_a_column_block_names_shard_record_and_field(tmp_path, where):
    n = 5000
    ds = write(str(tmp_path / "ds"), n, shard_bytes=1 << 30)
    (path,) = pyloader.ShardDataset(ds).shard_paths
    with open(path, "rb") as fh:
        data = fh.read()
    h, names = header_of(data), list(FIELDS)
    col = next(c for c in columns_of(data) if names[c["field"]] == "x")
    rec = {"first": 0, "middle": 2500, "last": n - 1}[where]
    _flip(path, h["payload_off"] + col["offset"] + rec * col["row_bytes"] + 2, 5)
    with pytest.raises(pyloader.ShardCorruptError) as ei:
        read_all(ds, batch_size=1)  # one record per batch: the first value read from the block fails
    e = ei.value
    block = rec // col["block_rows"]
    assert e.shard == path and e.field == "x" and e.record == block * col["block_rows"]
    msg = str(e)
    assert path in msg and "column block checksum mismatch (corrupt data): XXH3-64" in msg
    # Any record of the block fails, in a shuffled read too: never the flipped value.
    with pytest.raises(pyloader.ShardCorruptError, match="column block checksum mismatch"):
        read_all(ds, batch_size=64, shuffle=True, seed=2)


@pytest.mark.parametrize("target", ["descriptor", "checksum", "count"])
def test_bit_flip_in_the_column_table_is_caught_at_open(tmp_path, target):
    ds = write(str(tmp_path / "ds"), 3000)
    path = pyloader.ShardDataset(ds).shard_paths[0]
    with open(path, "rb") as fh:
        data = fh.read()
    h, c = header_of(data), columns_of(data)[1]
    pos = {"descriptor": c["desc_pos"] + 16, "checksum": c["checksums_pos"] + 3,
           "count": h["schema_off"] + h["schema_size"]}[target]
    _flip(path, pos, 1)
    with pytest.raises(pyloader.ShardCorruptError, match="column table checksum mismatch") as ei:
        read_all(ds)
    assert ei.value.shard == path and path in str(ei.value)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d, c: struct.pack_into("<I", d, c["desc_pos"] + 8, 3), "block rows must be a power of two"),
    (lambda d, c: struct.pack_into("<I", d, c["desc_pos"] + 4, 9), "only a fixed field"),
    (lambda d, c: struct.pack_into("<I", d, c["desc_pos"], 7), "only a fixed field"),  # "tokens": variable
    (lambda d, c: struct.pack_into("<I", d, c["desc_pos"], 0), "out of field order"),
    (lambda d, c: struct.pack_into("<Q", d, c["desc_pos"] + 16, 1 << 40), "points outside the payload"),
    (lambda d, c: struct.pack_into("<I", d, c["desc_pos"] + 12, 1), "reserved bytes are not zero"),
])
def test_inconsistent_column_table_is_rejected_naming_the_shard(tmp_path, edit, message):
    ds = write(str(tmp_path / "ds"), 3000)
    path = pyloader.ShardDataset(ds).shard_paths[0]
    with open(path, "rb") as fh:
        data = bytearray(fh.read())
    edit(data, columns_of(data)[1])  # the column of field "x"
    rewrite(ds, path, bytes(reseal(data)))  # checksums valid: the contents themselves are wrong
    with pytest.raises(pyloader.ShardFormatError, match=message) as ei:
        read_all(ds)
    assert ei.value.shard == path and "column table" in str(ei.value)
    assert not isinstance(ei.value, pyloader.ShardCorruptError)


def test_columns_size_that_breaks_the_tiling_is_rejected(tmp_path):
    ds = write(str(tmp_path / "ds"), 100)
    path = pyloader.ShardDataset(ds).shard_paths[0]
    with open(path, "rb") as fh:
        data = bytearray(fh.read())
    struct.pack_into("<Q", data, 104, header_of(data)["columns_size"] + 8)
    rewrite(ds, path, bytes(reseal(data)))
    with pytest.raises(pyloader.ShardFormatError, match="header region offsets are inconsistent") as ei:
        read_all(ds)
    assert ei.value.shard == path


def test_truncated_shard_is_rejected(tmp_path):
    ds = write(str(tmp_path / "ds"), 3000)
    path = pyloader.ShardDataset(ds).shard_paths[0]
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:  # the manifest still says the full size
        fh.write(data[:-100])
    with pytest.raises(pyloader.ShardFormatError, match="truncated") as ei:
        read_all(ds)
    assert ei.value.shard == path
    rewrite(ds, path, data[:-100])  # the manifest agrees: the header does not
    with pytest.raises(pyloader.ShardFormatError, match="header file size disagrees") as ei:
        read_all(ds)
    assert ei.value.shard == path


def test_random_bit_flips_anywhere_never_give_wrong_data(tmp_path):
    """Every byte of a version 3 shard is covered by a checksum: any flip fails the read."""
    seed = 20250101
    rng = random.Random(seed)
    clean = write(str(tmp_path / "clean"), 900, shard_bytes=1 << 30)
    (clean_path,) = pyloader.ShardDataset(clean).shard_paths
    with open(clean_path, "rb") as fh:
        original = fh.read()
    for trial in range(30):
        ds = str(tmp_path / f"t{trial}")
        os.makedirs(ds)
        for name in os.listdir(clean):
            with open(os.path.join(clean, name), "rb") as src, open(os.path.join(ds, name), "wb") as dst:
                dst.write(src.read())
        path = os.path.join(ds, os.path.basename(clean_path))
        pos, bit = rng.randrange(len(original)), rng.randrange(8)
        _flip(path, pos, bit)
        with pytest.raises(pyloader.ShardFormatError) as ei:
            read_all(ds, batch_size=128)
        assert ei.value.shard == path, f"seed {seed} trial {trial}: flip at {pos} bit {bit}: {ei.value}"


# -- convert and verify -----------------------------------------------------------------------


def test_convert_narrow_parquet_then_verify(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    n = 50_000
    rng = np.random.default_rng(0)
    table = pa.table({"id": pa.array(np.arange(n, dtype=np.int64)),
                      "a": pa.array(rng.standard_normal(n).astype(np.float32)),
                      "b": pa.array(rng.integers(0, 100, n).astype(np.int32)),
                      "c": pa.array(rng.standard_normal(n))})
    src = str(tmp_path / "narrow.parquet")
    pq.write_table(table, src, row_group_size=7000)
    dst = str(tmp_path / "out")
    res = subprocess.run([sys.executable, "-m", "pyloader", "convert", src, dst, "--verify", "--json", "--quiet",
                          "--shard-size", "300K"], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["records"] == n
    ds = pyloader.ShardDataset(dst)
    assert len(ds.shard_paths) >= 2
    total = 0
    for p in ds.shard_paths:
        with open(p, "rb") as fh:
            data = fh.read()
        assert header_of(data)["version"] == 3 and header_of(data)["index_size"] == 0
        total += len(data)
    assert total < 1.02 * n * 24  # about what the values weigh
    got = read_all(dst, batch_size=4096)
    assert np.array_equal(got["id"], np.arange(n))
    assert np.array_equal(got["c"], table.column("c").to_numpy())
    # --verify catches a changed value (a valid shard with different data).
    p = ds.shard_paths[0]
    with open(p, "rb") as fh:
        data = bytearray(fh.read())
    h = header_of(data)
    c = columns_of(data)[3]  # "c"
    data[h["payload_off"] + c["offset"] + 8 * 5] ^= 1
    rows = c["block_rows"]
    col = bytes(data[h["payload_off"] + c["offset"]:h["payload_off"] + c["offset"] + 8 * rows])
    struct.pack_into("<Q", data, c["checksums_pos"], xxhash.xxh3_64_intdigest(col))
    rewrite(dst, p, bytes(reseal(data)))
    res = subprocess.run([sys.executable, "-m", "pyloader", "convert", src, dst, "--verify-only", "--quiet"],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode != 0 and "record 5 field 'c' differs" in res.stderr, res.stderr
