"""Shard format versions 1 and 2 (docs/format.md, "Versions").

The writer writes version 2 (asked for with ``version=2``: by default a dataset with small
fixed fields, like this one's ``label``, is written as version 3, whose column layout
tests/read/test_compact_layout.py covers), whose checksums (header, schema, index and
every stored value) are XXH3-64; readers also read version 1, whose checksums are XXH64,
and datasets that mix the two. Version 1 shards are made here from written ones by
rewriting every checksum with XXH64 (``to_v1``), following the format description rather
than the writer.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

import pyloader
from pyloader import _C
from pyloader.bench import stages as bench_stages
from pyloader.format import spec as _format

HEADER = struct.Struct("<8sIIQIIQQQQQQQQQ16sQ")
HEADER_NAMES = ("magic", "version", "header_size", "num_records", "num_fields", "entry_size",
                "schema_off", "schema_size", "index_off", "index_size", "payload_off",
                "payload_size", "file_size", "schema_checksum", "index_checksum", "reserved", "header_checksum")
ENTRY = struct.Struct("<QIIIB3sQ")  # offset, stored, decoded, leading, codec, pad, checksum

FIELDS: dict[str, Any] = {
    "blob": ("bytes", ()),  # raw values of every length class, short and long
    "tokens": ("int32", (None,)),  # LZ4-compressed values (compressible rows)
    "label": ("int64", ()),
}
COMPRESSION = {"blob": "none", "tokens": "lz4", "label": "none"}
N = 60


def sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(1000 + i)
    sizes = (0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 1025, 5000)
    blob = rng.bytes(sizes[i % len(sizes)] + (i // len(sizes)) * 37)
    return {"blob": blob, "tokens": np.full(50 + i, i, np.int32), "label": i * 7919}


def write_dataset(path: str, n: int = N) -> str:
    with pyloader.ShardWriter(path, FIELDS, compression=COMPRESSION, shard_bytes=6000, version=2) as w:
        for i in range(n):
            w.write(sample(i))
    return path


def read_records(path: str, batch_size: int = 7) -> list[tuple[bytes, bytes, int]]:
    """(blob, tokens bytes, label) of every record, in order, cut to each row's length."""
    out = []
    for b in pyloader.ShardDataset(path).batches(batch_size, num_threads=2):
        for r in range(b["label"].shape[0]):
            blob = b["blob"][r, : int(b["blob_lengths"][r])].numpy().tobytes()
            tokens = b["tokens"][r, : int(b["tokens_lengths"][r])].numpy().tobytes()
            out.append((blob, tokens, int(b["label"][r])))
    return out


def expected_records(n: int = N) -> list[tuple[bytes, bytes, int]]:
    return [(s["blob"], s["tokens"].tobytes(), s["label"]) for s in map(sample, range(n))]


def header_of(data: bytes | bytearray) -> dict[str, Any]:
    return dict(zip(HEADER_NAMES, HEADER.unpack_from(data, 0)))


def entries_of(data: bytes | bytearray) -> list[tuple[int, tuple]]:
    """(file position of the entry, entry) of every index entry."""
    h = header_of(data)
    count = h["num_records"] * h["num_fields"]
    return [(h["index_off"] + k * 32, ENTRY.unpack_from(data, h["index_off"] + k * 32)) for k in range(count)]


def rechecksum(data: bytearray, version: int, checksum: Any) -> bytearray:
    """Sets the shard's version and recomputes every checksum in it (values, schema, index, header)."""
    h = header_of(data)
    for pos, e in entries_of(data):
        start = h["payload_off"] + e[0]
        struct.pack_into("<Q", data, pos + 24, checksum(bytes(data[start:start + e[1]])))
    struct.pack_into("<I", data, 8, version)
    struct.pack_into("<Q", data, 88, checksum(bytes(data[h["schema_off"]:h["schema_off"] + h["schema_size"]])))
    struct.pack_into("<Q", data, 96, checksum(bytes(data[h["index_off"]:h["index_off"] + h["index_size"]])))
    struct.pack_into("<Q", data, 120, checksum(bytes(data[:120])))
    return data


def rewrite_shard(ds: str, shard: str, data: bytes) -> None:
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


def to_v1(ds: str, shard: str) -> None:
    """Turns a version 2 shard into the version 1 shard of the same records (XXH64 checksums)."""
    with open(shard, "rb") as fh:
        data = bytearray(fh.read())
    assert header_of(data)["version"] == 2
    rewrite_shard(ds, shard, bytes(rechecksum(data, 1, _C.xxh64)))


@pytest.fixture
def ds(tmp_path) -> str:
    path = write_dataset(str(tmp_path / "ds"))
    assert len(pyloader.ShardDataset(path).shard_paths) >= 4
    return path


def test_writer_writes_version_2_with_xxh3_checksums(ds):
    dataset = pyloader.ShardDataset(ds)
    codecs = set()
    lengths = set()
    for path in dataset.shard_paths:
        with open(path, "rb") as fh:
            data = fh.read()
        assert data[8:12] == (2).to_bytes(4, "little")
        h = header_of(data)
        xxh3 = xxhash.xxh3_64_intdigest
        assert h["header_checksum"] == xxh3(data[:120])
        assert h["schema_checksum"] == xxh3(data[h["schema_off"]:h["schema_off"] + h["schema_size"]])
        assert h["index_checksum"] == xxh3(data[h["index_off"]:h["index_off"] + h["index_size"]])
        for _, e in entries_of(data):
            stored = data[h["payload_off"] + e[0]:h["payload_off"] + e[0] + e[1]]
            assert e[6] == xxh3(stored)
            codecs.add(e[4])
            lengths.add(e[1])
    assert codecs == {0, 1}
    assert min(lengths) == 0 and max(lengths) > 240  # short and long inputs were both hashed
    # The manifest is unchanged by the shard version: version 1, whole-file XXH64.
    assert dataset.manifest["version"] == 1
    for path, s in zip(dataset.shard_paths, dataset.manifest["shards"], strict=True):
        with open(path, "rb") as fh:
            assert s["xxh64"] == f"{_C.xxh64(fh.read()):016x}"


def test_version_2_reads_back_exactly(ds):
    want = expected_records()
    assert read_records(ds) == want
    assert read_records(ds, batch_size=16) == want  # a second read (values already verified)


def test_version_1_shards_read_back_identically(ds):
    dataset = pyloader.ShardDataset(ds)
    before = [b for b in dataset.batches(7, num_threads=2)]
    for path in dataset.shard_paths:
        to_v1(ds, path)
        with open(path, "rb") as fh:
            assert fh.read(12)[8:] == (1).to_bytes(4, "little")
    after = [b for b in pyloader.ShardDataset(ds).batches(7, num_threads=2)]
    assert len(after) == len(before)
    for a, b in zip(before, after, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert read_records(ds) == expected_records()


def test_a_dataset_mixing_versions_reads(ds):
    paths = pyloader.ShardDataset(ds).shard_paths
    for path in paths[::2]:
        to_v1(ds, path)
    versions = []
    for path in paths:
        with open(path, "rb") as fh:
            versions.append(header_of(fh.read(128))["version"])
    assert set(versions) == {1, 2}
    assert read_records(ds) == expected_records()
    # The benchmark's own checked reader follows each shard's version too.
    blocks = bench_stages.lz4_blocks(paths)
    assert blocks and all(_C.lz4_decode_block(b, n) for b, n in blocks)


def _flip_raw_value(ds: str, shard_no: int) -> tuple[str, int]:
    """Flips a byte in the middle of a non-empty raw ``blob`` value; returns (shard, record)."""
    path = pyloader.ShardDataset(ds).shard_paths[shard_no]
    with open(path, "rb") as fh:
        data = bytearray(fh.read())
    h = header_of(data)
    for k, (_, e) in enumerate(entries_of(data)):
        rec, f = divmod(k, h["num_fields"])
        if f == 0 and e[4] == 0 and e[1] > 300:
            data[h["payload_off"] + e[0] + e[1] // 2] ^= 0x10
            with open(path, "r+b") as fh:  # in place: the manifest's whole-file checksum is not checked on read
                fh.write(data)
            return path, rec
    raise AssertionError("no long raw blob value in the shard")


@pytest.mark.parametrize(("version", "name"), [(2, "XXH3-64"), (1, "XXH64")])
def test_payload_bit_flip_names_shard_record_field_and_checksum(ds, version, name):
    if version == 1:
        for path in pyloader.ShardDataset(ds).shard_paths:
            to_v1(ds, path)
    shard, rec = _flip_raw_value(ds, 1)
    with pytest.raises(pyloader.ShardCorruptError) as ei:
        read_records(ds)
    e = ei.value
    assert (e.shard, e.record, e.field) == (shard, rec, "blob")
    msg = str(e)
    assert shard in msg and f"record {rec}" in msg and "blob" in msg
    assert f"payload checksum mismatch (corrupt data): {name} " in msg, msg


def _rewrite_header(ds: str, shard: str, edit: Any) -> None:
    with open(shard, "rb") as fh:
        data = bytearray(fh.read())
    edit(data)
    rewrite_shard(ds, shard, bytes(data))


def test_version_2_header_with_a_wrong_checksum_is_rejected(ds):
    shard = pyloader.ShardDataset(ds).shard_paths[0]
    # A version 2 header whose checksum is XXH64's (version 1's function) is corrupt.
    _rewrite_header(ds, shard, lambda d: struct.pack_into("<Q", d, 120, _C.xxh64(bytes(d[:120]))))
    with pytest.raises(pyloader.ShardCorruptError, match="header checksum mismatch") as ei:
        read_records(ds)
    assert ei.value.shard == shard


def test_version_1_header_with_an_xxh3_checksum_is_rejected(ds):
    shard = pyloader.ShardDataset(ds).shard_paths[0]
    # Version 1 in a header whose checksums are all XXH3-64: not a valid version 1 header.
    _rewrite_header(ds, shard, lambda d: rechecksum(d, 1, _C.xxh3_64))
    with pytest.raises(pyloader.ShardCorruptError, match="header checksum mismatch"):
        read_records(ds)


@pytest.mark.parametrize("version", [0, 4, 0xFFFFFFFF])
@pytest.mark.parametrize("checksum", [_C.xxh3_64, _C.xxh64], ids=["xxh3", "xxh64"])
def test_other_versions_are_unsupported(ds, version, checksum):
    shard = pyloader.ShardDataset(ds).shard_paths[0]
    _rewrite_header(ds, shard, lambda d: rechecksum(d, version, checksum))
    with pytest.raises(pyloader.ShardFormatError, match=f"unsupported shard version {version}$") as ei:
        read_records(ds)
    assert ei.value.shard == shard and not isinstance(ei.value, pyloader.ShardCorruptError)
    with pytest.raises(pyloader.ShardFormatError, match=f"unsupported shard version {version}"):
        bench_stages.lz4_blocks([shard])


def test_shard_checksum_by_version():
    data = b"pyloader" * 40
    assert _format.shard_checksum(1)(data) == xxhash.xxh64_intdigest(data)
    assert _format.shard_checksum(2)(data) == xxhash.xxh3_64_intdigest(data)
    assert _format.shard_checksum(3)(data) == xxhash.xxh3_64_intdigest(data)
    assert _format.VERSION == 3 and _format.SHARD_VERSIONS == (1, 2, 3)
    with pytest.raises(pyloader.ShardFormatError, match="unsupported shard version 4"):
        _format.shard_checksum(4)
