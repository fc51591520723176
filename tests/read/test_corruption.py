"""Corrupt shards and manifests must fail loudly, in the right place, never with wrong data.

Every byte of a shard is covered by a checksum (header, schema block, index, and each
index entry's stored payload bytes), so any bit flip must surface as a
``pyloader.ShardFormatError`` (or its subclass ``ShardCorruptError``) that names the shard
-- never as wrong data, a crash or a hang. The fuzz loops are seeded: every assertion
message carries the seed, shard, offset and bit so a failure can be replayed.

A crash in the native reader would kill pytest itself, so the same fuzz loop also runs
a chunk of mutations in a subprocess (``test_fuzz_in_subprocess_exits_cleanly``).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import pyloader
from pyloader import _C
from pyloader.format import spec as _format

# Override to replay another seed: PYLOADER_FUZZ_SEED=123 pytest tests/read/test_corruption.py
SEED = int(os.environ.get("PYLOADER_FUZZ_SEED", "20240611"))

# ---------------------------------------------------------------------------------------
# The dataset under attack: a few shards, fixed, scalar, variable and bytes fields, some
# entries LZ4-compressed and some stored raw (incompressible records and "none" fields).
FIELDS: dict[str, Any] = {
    "img": ("uint8", (4, 6)),
    "label": ("int64", ()),
    "tokens": ("int32", (None,)),
    "blob": ("bytes", ()),
    "vec": ("float32", (None, 2)),
}
COMPRESSION = {"img": "lz4", "label": "none", "tokens": "lz4", "blob": "lz4", "vec": "none"}
NUM_RECORDS = 44
SHARD_BYTES = 900
BATCH = 5


def make_sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(7919 + i)
    compressible = i % 2 == 0
    n = i % 11  # 0 for records 0, 11, 22, 33: empty variable rows
    if compressible:
        img = np.full((4, 6), i % 256, np.uint8)
        tokens = np.full(3 * n, i, np.int32)
        blob = b"ab" * (i % 13)
    else:
        img = rng.integers(0, 256, (4, 6), dtype=np.uint8)
        tokens = rng.integers(-(2**31), 2**31, n, dtype=np.int32)
        blob = rng.bytes(i % 13)
    return {"img": img, "label": i * 1_000_003, "tokens": tokens, "blob": blob,
            # (None, 2) rows are never empty here; tokens and blob cover empty rows. Empty
            # multi-dim rows: tests/write/test_writer_roundtrip.py::test_empty_rows_multidim
            # (and ::test_empty_rows_and_all_empty_batch for 1-d and bytes fields).
            "vec": rng.standard_normal((1 + i % 3, 2)).astype(np.float32)}


def write_dataset(path: str, n: int = NUM_RECORDS, fields: dict[str, Any] | None = None,
                  sample=make_sample, **kwargs: Any) -> str:
    kwargs.setdefault("shard_bytes", SHARD_BYTES)
    kwargs.setdefault("compression", COMPRESSION if fields is None else "lz4")
    # The attacks below address the version 2 layout (an index entry per value); the column
    # layout of version 3 is attacked in tests/read/test_compact_layout.py.
    kwargs.setdefault("version", 2)
    with pyloader.ShardWriter(path, fields or FIELDS, **kwargs) as w:
        for i in range(n):
            w.write(sample(i))
    return path


# ---------------------------------------------------------------------------------------
# Shard layout, written from the format description (independently of pyloader.format.spec).
HEADER = struct.Struct("<8sIIQIIQQQQQQQQQ16sQ")
HEADER_NAMES = ("magic", "version", "header_size", "num_records", "num_fields", "entry_size",
                "schema_off", "schema_size", "index_off", "index_size", "payload_off",
                "payload_size", "file_size", "schema_checksum", "index_checksum", "reserved", "header_checksum")
ENTRY = struct.Struct("<QIIIB3sQ")  # offset, stored, decoded, leading, codec, pad, checksum
assert HEADER.size == 128 and ENTRY.size == 32
# Each shard version's checksum function (docs/format.md, "Versions").
CHECKSUMS = {1: _C.xxh64, 2: _C.xxh3_64}


def checksum_of(data: bytes | bytearray) -> Any:
    """The checksum function of the shard ``data`` by its header's version.

    A version readers reject gets version 2's: the reader refuses it before any checksum.
    """
    (version,) = struct.unpack_from("<I", data, 8)
    return CHECKSUMS.get(version, _C.xxh3_64)


@dataclass
class ShardLayout:
    size: int
    header: dict[str, Any]
    entries: list[list[tuple]]  # [record][field] -> ENTRY tuple

    @property
    def regions(self) -> dict[str, tuple[int, int]]:
        h = self.header
        return {
            "header": (0, 128),
            "schema": (h["schema_off"], h["schema_off"] + h["schema_size"]),
            "index": (h["index_off"], h["index_off"] + h["index_size"]),
            "payload": (h["payload_off"], h["payload_off"] + h["payload_size"]),
        }

    def entry_at_payload(self, file_offset: int) -> tuple[int, int]:
        """(record, field) whose stored bytes hold file byte ``file_offset``."""
        rel = file_offset - self.header["payload_off"]
        for r, row in enumerate(self.entries):
            for f, e in enumerate(row):
                if e[0] <= rel < e[0] + e[1]:
                    return r, f
        raise AssertionError(f"payload byte {file_offset} belongs to no entry")


def parse_layout(data: bytes) -> ShardLayout:
    h = dict(zip(HEADER_NAMES, HEADER.unpack_from(data, 0)))
    entries = [[ENTRY.unpack_from(data, h["index_off"] + (r * h["num_fields"] + f) * 32)
                for f in range(h["num_fields"])] for r in range(h["num_records"])]
    return ShardLayout(len(data), h, entries)


def refresh_checksums(data: bytearray) -> bytearray:
    """Recomputes schema, index and header checksums: forges a self-consistent shard."""
    h = dict(zip(HEADER_NAMES, HEADER.unpack_from(data, 0)))
    checksum = checksum_of(data)
    so, ss, io_, is_ = h["schema_off"], h["schema_size"], h["index_off"], h["index_size"]
    if so + ss <= len(data):
        struct.pack_into("<Q", data, 88, checksum(bytes(data[so:so + ss])))
    if io_ + is_ <= len(data):
        struct.pack_into("<Q", data, 96, checksum(bytes(data[io_:io_ + is_])))
    struct.pack_into("<Q", data, 120, checksum(bytes(data[:120])))
    return data


def refresh_entry_checksum(data: bytearray, layout: ShardLayout, r: int, f: int) -> None:
    e = layout.entries[r][f]
    start = layout.header["payload_off"] + e[0]
    pos = layout.header["index_off"] + (r * layout.header["num_fields"] + f) * 32
    struct.pack_into("<Q", data, pos + 24, checksum_of(data)(bytes(data[start:start + e[1]])))


def flip(data: bytes | bytearray, offset: int, bit: int) -> bytearray:
    out = bytearray(data)
    out[offset] ^= 1 << bit
    return out


def load_manifest(ds: str) -> dict[str, Any]:
    with open(os.path.join(ds, "manifest.json"), "rb") as fh:
        return _format.parse_manifest(fh.read(), "test", _C.xxh64)


def save_manifest(ds: str, body: dict[str, Any]) -> None:
    with open(os.path.join(ds, "manifest.json"), "wb") as fh:
        fh.write(_format.dump_manifest(body, _C.xxh64))


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def replace_file(path: str, data: bytes) -> None:
    """Gives ``path`` the content ``data``.

    Same size: rewritten in place (cheap; no reader of an earlier mutation is alive, as
    every pipeline is closed by then). Otherwise a new inode is renamed over it, so a
    mapping of the old file could never see a shorter file.
    """
    if os.path.exists(path) and os.path.getsize(path) == len(data):
        with open(path, "r+b") as fh:
            fh.write(data)
        return
    tmp = path + ".fuzz-tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------
# Reading and comparing.
Snapshot = dict[str, tuple[str, tuple[int, ...], bytes]]


def snapshot(batch: dict[str, torch.Tensor]) -> Snapshot:
    """dtype, shape and exact bytes (padding included) of every tensor of a batch."""
    return {k: (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
            for k, t in batch.items()}


def read_epoch(ds: str, batch_size: int = BATCH, num_threads: int = 2) -> list[Snapshot]:
    return [snapshot(b) for b in pyloader.ShardDataset(ds).batches(batch_size, num_threads=num_threads)]


def to_records(snaps: list[Snapshot]) -> list[dict[str, bytes]]:
    """Per-record bytes of every field (variable rows cut to their lengths)."""
    out: list[dict[str, bytes]] = []
    for s in snaps:
        rows = s["label"][1][0]
        for i in range(rows):
            rec = {}
            for name in FIELDS:
                _, shape, raw = s[name]
                row_bytes = len(raw) // rows if rows else 0
                cut = raw[i * row_bytes:(i + 1) * row_bytes]
                if f"{name}_lengths" in s:
                    n = int(np.frombuffer(s[f"{name}_lengths"][2], "<i8")[i])
                    per = row_bytes // shape[1] if shape[1] else 0
                    cut = cut[:n * per]
                rec[name] = cut
            out.append(rec)
    return out


class Outcome:
    DETECTED = "detected"
    UNDETECTED = "undetected"


def read_mutated(ds: str, shard: str, ref: list[Snapshot], what: str, *, num_threads: int,
                 batch_size: int = BATCH) -> tuple[str, pyloader.ShardFormatError | None, list[Snapshot]]:
    """Reads the whole epoch of a (possibly) corrupt dataset and checks the universal rules.

    Every batch delivered must equal the reference batch at that position; the only
    acceptable exception is a ShardFormatError naming ``shard`` (message and ``.shard``).
    """
    got: list[Snapshot] = []
    try:
        it = pyloader.ShardDataset(ds).batches(batch_size, num_threads=num_threads)
        for b in it:
            got.append(snapshot(b))
            k = len(got) - 1
            assert k < len(ref) and got[k] == ref[k], f"{what}: batch {k} differs from the original (wrong data)"
    except pyloader.ShardFormatError as e:
        assert not isinstance(e, pyloader.ManifestError), f"{what}: unexpected ManifestError {e}"
        assert e.shard == shard, f"{what}: exc.shard={e.shard!r}, expected {shard!r} ({e})"
        assert shard in str(e), f"{what}: message does not name the shard: {e}"
        return Outcome.DETECTED, e, got
    assert got == ref, f"{what}: undetected corruption changed the data"
    return Outcome.UNDETECTED, None, got


class FuzzSession:
    """A working copy of a pristine dataset: mutate one shard, read, restore."""

    def __init__(self, pristine: str, work: str) -> None:
        shutil.copytree(pristine, work)
        self.dir = work
        self.paths = pyloader.ShardDataset(work).shard_paths
        self.original = {p: read_bytes(p) for p in self.paths}
        self.layout = {p: parse_layout(d) for p, d in self.original.items()}
        self.ref = {bs: read_epoch(work, bs) for bs in (BATCH, 16)}
        self.stats: dict[str, int] = {}

    def count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1

    def attempt(self, shard: str, data: bytes, what: str, *, num_threads: int, batch_size: int = BATCH):
        replace_file(shard, data)
        try:
            return read_mutated(self.dir, shard, self.ref[batch_size], what, num_threads=num_threads,
                                batch_size=batch_size)
        finally:
            replace_file(shard, self.original[shard])


def check_bit_flip(sess: FuzzSession, shard: str, offset: int, bit: int, rng: random.Random, tag: str,
                   seed: int) -> None:
    """One single-bit flip: it must be detected, by the right check, in the right place."""
    lay = sess.layout[shard]
    region = next(name for name, (a, b) in lay.regions.items() if a <= offset < b)
    what = f"[{tag} seed={seed}] flip bit {bit} at offset {offset} ({region}) of {shard}"
    nt, bs = rng.choice((1, 2, 3)), rng.choice((BATCH, 16))
    outcome, exc, got = sess.attempt(shard, flip(sess.original[shard], offset, bit), what,
                                     num_threads=nt, batch_size=bs)
    sess.count(f"{region}:{outcome}")
    # Every byte is under a checksum, so no single-bit flip may go unnoticed.
    assert outcome == Outcome.DETECTED, f"{what}: the flip was not detected"
    assert exc is not None
    if region in ("schema", "index"):
        assert isinstance(exc, pyloader.ShardCorruptError), f"{what}: expected a checksum error, got {exc!r}"
    if region == "payload":
        r, f = lay.entry_at_payload(offset)
        name = list(FIELDS)[f]
        assert isinstance(exc, pyloader.ShardCorruptError), f"{what}: expected a checksum error, got {exc!r}"
        assert (exc.record, exc.field) == (r, name), f"{what}: blamed record {exc.record} field {exc.field}, expected {r} {name}"
        assert f"record {r}" in str(exc) and name in str(exc), f"{what}: {exc}"
        # The error surfaces at the batch holding that record: all earlier batches arrived.
        shard_no = sess.paths.index(shard)
        global_idx = sum(sess.layout[p].header["num_records"] for p in sess.paths[:shard_no]) + r
        assert len(got) == global_idx // bs, f"{what}: error surfaced after {len(got)} batches"
    else:
        # A broken header/schema/index fails the shard at open, i.e. at the first batch touching it.
        first = sum(sess.layout[p].header["num_records"] for p in sess.paths[:sess.paths.index(shard)])
        assert len(got) == first // bs, f"{what}: error surfaced after {len(got)} batches"


def fuzz(sess: FuzzSession, seed: int, n: int, *, mode: str) -> None:
    """``n`` single-bit flips. mode: 'uniform' (any byte of any shard) or a region name."""
    rng = random.Random(seed)
    for _ in range(n):
        shard = rng.choice(sess.paths)
        lay = sess.layout[shard]
        if mode == "uniform":
            offset = rng.randrange(lay.size)
        else:
            a, b = lay.regions[mode]
            offset = rng.randrange(a, b)
        check_bit_flip(sess, shard, offset, rng.randrange(8), rng, mode, seed)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> str:
    d = write_dataset(str(tmp_path_factory.mktemp("pristine") / "ds"))
    assert len(pyloader.ShardDataset(d).shard_paths) >= 3
    return d


@pytest.fixture
def sess(pristine, tmp_path) -> FuzzSession:
    return FuzzSession(pristine, str(tmp_path / "work"))


def test_dataset_under_attack_has_the_intended_layout(sess):
    """The fuzz targets what it claims: several shards, LZ4 and raw entries, empty rows."""
    codecs = {e[4] for lay in sess.layout.values() for row in lay.entries for e in row}
    assert codecs == {0, 1}
    assert sum(lay.header["num_records"] for lay in sess.layout.values()) == NUM_RECORDS
    for lay in sess.layout.values():
        for name, (a, b) in lay.regions.items():
            assert b > a, name
        assert lay.regions["payload"][1] == lay.size
    records = to_records(sess.ref[BATCH])
    assert len(records) == NUM_RECORDS
    for i, rec in enumerate(records):
        s = make_sample(i)
        assert rec["tokens"] == s["tokens"].tobytes() and rec["blob"] == s["blob"], i
    assert to_records(sess.ref[16]) == records


# --- exhaustive and sampled single-bit flips ---------------------------------------------


@pytest.mark.timeout(120)
def test_every_header_bit_of_a_shard_is_checked(sess):
    rng = random.Random(SEED)
    shard = sess.paths[1]
    for offset in range(128):
        for bit in range(8):
            check_bit_flip(sess, shard, offset, bit, rng, "header-exhaustive", SEED)
    assert sess.stats == {"header:detected": 1024}


@pytest.mark.timeout(120)
def test_every_schema_bit_of_a_shard_is_checked(sess):
    rng = random.Random(SEED + 1)
    shard = sess.paths[0]
    a, b = sess.layout[shard].regions["schema"]
    for offset in range(a, b):
        for bit in range(8):
            check_bit_flip(sess, shard, offset, bit, rng, "schema-exhaustive", SEED)
    assert sess.stats == {"schema:detected": 8 * (b - a)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("region", ["header", "schema", "index", "payload"])
def test_random_bit_flips_in_region(sess, region):
    seed = SEED + {"header": 101, "schema": 202, "index": 303, "payload": 404}[region]
    fuzz(sess, seed, 400, mode=region)
    assert sess.stats == {f"{region}:detected": 400}


@pytest.mark.timeout(120)
def test_random_bit_flips_anywhere(sess):
    fuzz(sess, SEED + 7, 1200, mode="uniform")
    assert sum(sess.stats.values()) == 1200
    assert all(k.endswith(":detected") for k in sess.stats), sess.stats
    # Uniform offsets land mostly in index and payload; both must have been hit.
    assert sess.stats.get("index:detected", 0) > 50 and sess.stats.get("payload:detected", 0) > 50


@pytest.mark.timeout(120)
def test_multi_bit_flips(sess):
    rng = random.Random(SEED + 11)
    for i in range(400):
        shard = rng.choice(sess.paths)
        lay = sess.layout[shard]
        data = bytearray(sess.original[shard])
        k = rng.randint(2, 16)
        if i % 2:  # a burst: several bits within a few bytes (a typical media error)
            start = rng.randrange(lay.size)
            offsets = [min(lay.size - 1, start + rng.randrange(8)) for _ in range(k)]
        else:
            offsets = [rng.randrange(lay.size) for _ in range(k)]
        bits = [rng.randrange(8) for _ in offsets]
        for o, b in zip(offsets, bits):
            data[o] ^= 1 << b
        what = f"[multi seed={SEED + 11} iter={i}] flips {list(zip(offsets, bits))} of {shard}"
        outcome, _, _ = sess.attempt(shard, bytes(data), what, num_threads=rng.choice((1, 2, 4)))
        if bytes(data) != sess.original[shard]:  # flips may cancel out pairwise
            assert outcome == Outcome.DETECTED, what


@pytest.mark.timeout(120)
def test_byte_overwrites(sess):
    """Whole bytes set to 0x00 / 0xFF / random, as a bad sector or a stray write would."""
    rng = random.Random(SEED + 13)
    for i in range(300):
        shard = rng.choice(sess.paths)
        lay = sess.layout[shard]
        data = bytearray(sess.original[shard])
        start = rng.randrange(lay.size)
        length = rng.choice((1, 4, 8, 32, 100))
        fill = rng.choice((0x00, 0xFF, None))
        for o in range(start, min(lay.size, start + length)):
            data[o] = rng.randrange(256) if fill is None else fill
        what = f"[overwrite seed={SEED + 13} iter={i}] {length} bytes at {start} := {fill} in {shard}"
        outcome, _, _ = sess.attempt(shard, bytes(data), what, num_threads=2)
        if bytes(data) != sess.original[shard]:
            assert outcome == Outcome.DETECTED, what


# --- forged shards: checksums recomputed, so the structural checks must hold alone ----------


HEADER_FIELD_OFFSETS = {"version": 8, "header_size": 12, "num_records": 16, "num_fields": 24,
                        "entry_size": 28, "schema_off": 32, "schema_size": 40, "index_off": 48,
                        "index_size": 56, "payload_off": 64, "payload_size": 72, "file_size": 80}


@pytest.mark.timeout(120)
def test_forged_header_fields_are_validated(sess):
    """Header values rewritten with a valid header checksum: offsets, sizes and counts are
    cross-checked against each other and the file, so nothing out of bounds is ever read."""
    rng = random.Random(SEED + 17)
    n = 0
    for shard in sess.paths:
        orig = sess.original[shard]
        for name, off in HEADER_FIELD_OFFSETS.items():
            width = 4 if name in ("version", "header_size", "num_fields", "entry_size") else 8
            fmt = "<I" if width == 4 else "<Q"
            (cur,) = struct.unpack_from(fmt, orig, off)
            top = (1 << (8 * width)) - 1
            values = {0, 1, cur - 1, cur + 1, cur + 32, cur - 32, cur * 2, top, top // 2 + 1,
                      rng.randrange(top + 1), len(orig), len(orig) + 1}
            values |= {cur ^ (1 << b) for b in range(8 * width)}
            for v in sorted(x for x in values if 0 <= x <= top and x != cur):
                data = bytearray(orig)
                struct.pack_into(fmt, data, off, v)
                refresh_checksums(data)
                what = f"[forged header seed={SEED + 17}] {name}={v} (was {cur}) in {shard}"
                replace_file(shard, bytes(data))
                try:
                    with pytest.raises((pyloader.ShardFormatError, pyloader.SchemaError)) as ei:
                        for _ in pyloader.ShardDataset(sess.dir).batches(BATCH, num_threads=2):
                            pass
                finally:
                    replace_file(shard, orig)
                assert ei.value.shard == shard and shard in str(ei.value), what
                assert not isinstance(ei.value, pyloader.ManifestError), what
                n += 1
    assert n > 1000


@pytest.mark.timeout(120)
def test_forged_index_entries_are_validated(sess):
    """Index bits flipped with valid index and header checksums: every entry is checked
    against the payload bounds, the codec, the field shape and its own checksum."""
    rng = random.Random(SEED + 19)
    pad_hits = 0
    for i in range(1200):
        shard = rng.choice(sess.paths)
        lay = sess.layout[shard]
        r = rng.randrange(lay.header["num_records"])
        f = rng.randrange(lay.header["num_fields"])
        within = rng.randrange(32)
        bit = rng.randrange(8)
        offset = lay.header["index_off"] + (r * lay.header["num_fields"] + f) * 32 + within
        data = refresh_checksums(flip(sess.original[shard], offset, bit))
        what = (f"[forged index seed={SEED + 19} iter={i}] record {r} field {f} entry byte {within} "
                f"bit {bit} in {shard}")
        if within == 20 and lay.entries[r][f][4] == 0:
            # raw -> "LZ4" (or another codec) is the only flip whose result cannot be predicted:
            # the raw bytes may even be a valid LZ4 block. It must still never crash or misreport.
            replace_file(shard, bytes(data))
            try:
                for _ in pyloader.ShardDataset(sess.dir).batches(BATCH, num_threads=2):
                    pass
            except pyloader.ShardFormatError as e:
                assert e.shard == shard and shard in str(e), what
            finally:
                replace_file(shard, sess.original[shard])
            continue
        outcome, exc, _ = sess.attempt(shard, bytes(data), what, num_threads=rng.choice((1, 3)))
        if 21 <= within < 24:  # the 3 pad bytes carry nothing (read_mutated checked the data)
            pad_hits += 1
            continue
        if within < 8 and lay.entries[r][f][1] == 0 and outcome == Outcome.UNDETECTED:
            continue  # the offset of an empty entry: still in bounds, it addresses no bytes
        assert outcome == Outcome.DETECTED, what
        assert (exc.record, exc.field) == (r, list(FIELDS)[f]), f"{what}: blamed {exc.record} {exc.field}: {exc}"
    assert pad_hits > 0


@pytest.mark.timeout(120)
def test_forged_lz4_payload_never_crashes_or_spills(sess):
    """LZ4 blocks mutated with a matching entry checksum reach the decoder itself: it must
    reject the block (naming shard, record, field) or decode exactly the declared size,
    changing nothing but that record's field."""
    rng = random.Random(SEED + 23)
    lz4_entries = [(p, r, f) for p in sess.paths for r, row in enumerate(sess.layout[p].entries)
                   for f, e in enumerate(row) if e[4] == 1]
    assert len(lz4_entries) >= 10
    ref_records = to_records(sess.ref[BATCH])
    rejected = 0
    for i in range(800):
        shard, r, f = rng.choice(lz4_entries)
        lay = sess.layout[shard]
        e = lay.entries[r][f]
        start = lay.header["payload_off"] + e[0]
        data = bytearray(sess.original[shard])
        for _ in range(rng.choice((1, 1, 2, 4))):
            o = start + rng.randrange(e[1])
            if rng.random() < 0.5:
                data[o] ^= 1 << rng.randrange(8)
            else:
                data[o] = rng.choice((0x00, 0xFF, 0xF0, 0x0F, rng.randrange(256)))
        refresh_entry_checksum(data, lay, r, f)
        refresh_checksums(data)
        name = list(FIELDS)[f]
        what = f"[forged lz4 seed={SEED + 23} iter={i}] {shard} record {r} field {name}"
        replace_file(shard, bytes(data))
        try:
            snaps = []
            try:
                for b in pyloader.ShardDataset(sess.dir).batches(BATCH, num_threads=rng.choice((1, 2))):
                    snaps.append(snapshot(b))
            except pyloader.ShardFormatError as exc:
                rejected += 1
                assert exc.shard == shard and shard in str(exc), what
                assert (exc.record, exc.field) == (r, name), f"{what}: {exc}"
                assert "LZ4" in str(exc), f"{what}: {exc}"
                continue
        finally:
            replace_file(shard, sess.original[shard])
        got = to_records(snaps)
        g = sum(sess.layout[p].header["num_records"] for p in sess.paths[:sess.paths.index(shard)]) + r
        assert len(got) == len(ref_records), what
        for k, (a, b) in enumerate(zip(got, ref_records)):
            for fname in FIELDS:
                if (k, fname) != (g, name):
                    assert a[fname] == b[fname], f"{what}: record {k} field {fname} changed"
        assert len(got[g][name]) == len(ref_records[g][name]), what
    assert rejected > 60


# --- the fuzz loop in a child process, so a crash is a failure, not a dead pytest ---------


def _child_main(pristine: str, work: str, seed: int, n: int) -> None:
    s = FuzzSession(pristine, work)
    rng = random.Random(seed)
    for i in range(n):
        mode = ("uniform", "header", "schema", "index", "payload")[i % 5]
        fuzz(s, rng.randrange(1 << 30), 1, mode=mode)
    print(json.dumps(s.stats))


@pytest.mark.timeout(180)
def test_fuzz_in_subprocess_exits_cleanly(pristine, tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import test_corruption as t
        t._child_main({pristine!r}, {str(tmp_path / 'work')!r}, {SEED + 29}, 800)
    """)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=170,
                       check=False)
    assert p.returncode == 0, f"fuzz child (seed {SEED + 29}) exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    stats = json.loads(p.stdout.strip().splitlines()[-1])
    assert sum(stats.values()) == 800 and all(k.endswith(":detected") for k in stats), stats


# --- truncation and appended bytes ---------------------------------------------------------


def truncation_lengths(lay: ShardLayout) -> list[int]:
    h = lay.header
    regions = lay.regions
    return sorted({0, 1, 8, 64, 119, 120, 127, 128, 129, h["schema_off"] + h["schema_size"] // 2,
                   regions["schema"][1], regions["schema"][1] + 1, (regions["index"][0] + regions["index"][1]) // 2,
                   regions["index"][1] - 1, regions["index"][1], (regions["payload"][0] + lay.size) // 2,
                   lay.size - 1})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fix_manifest", [False, True], ids=["manifest-stale", "manifest-fixed"])
def test_truncated_shard(sess, fix_manifest):
    """Caught at open from the manifest's size; and, when the manifest is rewritten to agree,
    by the header's own file size and region checks."""
    shard = sess.paths[1]
    lay = sess.layout[shard]
    manifest_bytes = read_bytes(os.path.join(sess.dir, "manifest.json"))
    for n in truncation_lengths(lay):
        what = f"truncate {shard} to {n} of {lay.size} bytes (manifest fixed: {fix_manifest})"
        replace_file(shard, sess.original[shard][:n])
        try:
            if fix_manifest:
                body = load_manifest(sess.dir)
                body["shards"][1]["bytes"] = n
                save_manifest(sess.dir, body)
                if n < 128:  # the manifest itself rejects a shard smaller than a header
                    with pytest.raises(pyloader.ManifestError, match=f"size {n} bytes is outside"):
                        pyloader.ShardDataset(sess.dir)
                    continue
                if body["shards"][1]["records"] > n - 128:  # or too small for its records (a byte each)
                    with pytest.raises(pyloader.ManifestError, match=f"records cannot fit in {n} bytes"):
                        pyloader.ShardDataset(sess.dir)
                    continue
            outcome, exc, _ = read_mutated(sess.dir, shard, sess.ref[BATCH], what, num_threads=2)
            assert outcome == Outcome.DETECTED, what
            if not fix_manifest:
                assert "manifest says" in str(exc) and str(lay.size) in str(exc), f"{what}: {exc}"
        finally:
            replace_file(shard, sess.original[shard])
            replace_file(os.path.join(sess.dir, "manifest.json"), manifest_bytes)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fix_manifest", [False, True], ids=["manifest-stale", "manifest-fixed"])
@pytest.mark.parametrize("extra", [b"\0", b"x" * 31, b"\0" * 32, bytes(range(256)) * 4])
def test_appended_garbage(sess, extra, fix_manifest):
    shard = sess.paths[2]
    data = sess.original[shard] + extra
    if fix_manifest:
        body = load_manifest(sess.dir)
        body["shards"][2]["bytes"] = len(data)
        save_manifest(sess.dir, body)
    outcome, exc, _ = sess.attempt(shard, data, f"append {len(extra)} bytes to {shard}", num_threads=2)
    assert outcome == Outcome.DETECTED
    assert "header file size" in str(exc) if fix_manifest else "manifest says" in str(exc), str(exc)


@pytest.mark.parametrize("kind", ["empty-file", "directory", "symlink-to-other-shard"])
def test_shard_replaced_by_something_else(sess, kind):
    shard = sess.paths[0]
    os.unlink(shard)
    if kind == "empty-file":
        open(shard, "wb").close()
    elif kind == "directory":
        os.mkdir(shard)
    else:
        # Caught by size/record count only: the reader does not hash whole files (per
        # docs/format.md the manifest's xxh64 is for caches and downloads).
        assert (sess.layout[sess.paths[1]].size, sess.layout[sess.paths[1]].header["num_records"]) != \
            (sess.layout[shard].size, sess.layout[shard].header["num_records"])
        os.symlink(sess.paths[1], shard)
    with pytest.raises((pyloader.ShardFormatError, pyloader.ShardIOError)) as ei:
        list(pyloader.ShardDataset(sess.dir).batches(BATCH))
    assert ei.value.shard == shard and shard in str(ei.value)


# --- manifest corruption --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_manifest_bit_flips(sess):
    mpath = os.path.join(sess.dir, "manifest.json")
    orig = read_bytes(mpath)
    rng = random.Random(SEED + 31)
    digest = (len(b'{"checksum":"'), len(b'{"checksum":"') + 16)
    offsets = list(range(len(orig))) + [rng.randrange(len(orig)) for _ in range(500)]
    tolerated = 0
    for i, o in enumerate(offsets):
        bit = i % 8 if i < len(orig) else rng.randrange(8)
        data = flip(orig, o, bit)
        replace_file(mpath, bytes(data))
        what = f"[manifest seed={SEED + 31}] flip bit {bit} at offset {o} ({orig[o:o+1]!r})"
        try:
            ds = pyloader.ShardDataset(sess.dir)
        except pyloader.ManifestError as e:
            assert isinstance(e, ValueError)
            assert mpath in str(e), f"{what}: message does not name the manifest: {e}"
            continue
        finally:
            replace_file(mpath, orig)
        # The only flips that may pass leave the checksum's value unchanged: the case bit of
        # a hex letter ("a" -> "A"), or a leading/trailing "0" turned into a space, which
        # int(..., 16) ignores. The body is intact, so the data must be too.
        assert digest[0] <= o < digest[1], f"{what}: accepted"
        assert int(data[digest[0]:digest[1]].decode("ascii"), 16) == int(orig[digest[0]:digest[1]], 16), what
        tolerated += 1
        assert [snapshot(b) for b in ds.batches(BATCH)] == sess.ref[BATCH], what
    assert tolerated <= 16


def test_manifest_checksum_must_be_lowercase_hex(sess):
    # BUG (pyloader/format/spec.py, parse_manifest: `int(data[...].decode("ascii"), 16)`):
    # docs/format.md specifies the checksum as 16 *lowercase* hex digits, but int(..., 16)
    # also accepts uppercase digits, surrounding spaces and "_" separators. So a bit flip
    # that turns "a" into "A" (bit 5), or a leading "0" into " " (bit 4), goes unnoticed.
    # (The body is still checksummed, so no data changes; the framing check is what is lax.)
    mpath = os.path.join(sess.dir, "manifest.json")
    orig = read_bytes(mpath)
    a, b = len(b'{"checksum":"'), len(b'{"checksum":"') + 16
    digest = orig[a:b].decode("ascii")
    variants = [digest.upper(), " " + digest[1:] if digest[0] == "0" else digest[:15].upper() + " "]
    for v in variants:
        assert v != digest and len(v) == 16
        replace_file(mpath, orig[:a] + v.encode("ascii") + orig[b:])
        with pytest.raises(pyloader.ManifestError) as ei:
            pyloader.ShardDataset(sess.dir)
        assert mpath in str(ei.value)


def test_manifest_truncations_and_garbage(sess):
    mpath = os.path.join(sess.dir, "manifest.json")
    orig = read_bytes(mpath)
    cuts = sorted({0, 1, 2, 10, 13, 29, 30, 42, 43, len(orig) // 2, len(orig) - 2, len(orig) - 1})
    variants = [orig[:n] for n in cuts] + [orig + b"\n", orig + b"x", b"{}", b"[]", b"null", b"\xff" * 64,
                                            orig.replace(b'"checksum":"', b'"checksum": "')]
    for data in variants:
        replace_file(mpath, data)
        with pytest.raises(pyloader.ManifestError) as ei:
            pyloader.ShardDataset(sess.dir)
        assert mpath in str(ei.value), (data[:60], str(ei.value))
        assert isinstance(ei.value, ValueError)
    os.unlink(mpath)
    with pytest.raises(pyloader.ManifestError, match="no manifest") as ei:
        pyloader.ShardDataset(sess.dir)
    # What it names: a missing file, so `except FileNotFoundError` catches it too.
    assert isinstance(ei.value, FileNotFoundError) and ei.value.errno == errno.ENOENT
    assert isinstance(ei.value, pyloader.ManifestNotFoundError) and str(ei.value).startswith("no manifest at")


@pytest.mark.parametrize("edit", [
    lambda b: b["shards"][0].update(records=b["shards"][0]["records"] + 1),  # total disagrees
    lambda b: b.update(records=b["records"] + 1),
    lambda b: b["shards"][0].update(bytes=64),
    lambda b: b["shards"][0].update(records=-1),
    lambda b: b["shards"][0].update(records=True),
    lambda b: b["shards"][0].pop("xxh64"),
    lambda b: b["shards"].__setitem__(0, "shard-000000.pyl"),
    lambda b: b.update(version=2),
    lambda b: b.update(format="other"),
    lambda b: b.pop("fields"),
    lambda b: b["fields"][0].update(dtype="complex64"),
    lambda b: b["fields"][0].update(name="not an identifier"),
    lambda b: b.update(shards=[], records=0),
], ids=["shard-records", "total-records", "small-bytes", "negative-records", "bool-records", "no-xxh64",
        "entry-not-object", "version", "format", "no-fields", "bad-dtype", "bad-name", "no-records"])
def test_manifest_with_valid_checksum_but_invalid_body(sess, edit):
    body = load_manifest(sess.dir)
    edit(body)
    save_manifest(sess.dir, body)
    with pytest.raises(pyloader.ManifestError) as ei:
        pyloader.ShardDataset(sess.dir)
    assert os.path.join(sess.dir, "manifest.json") in str(ei.value)


@pytest.mark.parametrize("bad", ["../x.pyl", "/abs/x.pyl", "a/../../x.pyl", "..", "", "a\\..\\x.pyl",
                                 "sub/../../etc/passwd"])
def test_manifest_with_unsafe_shard_path(sess, bad):
    body = load_manifest(sess.dir)
    body["shards"][1]["path"] = bad
    save_manifest(sess.dir, body)
    with pytest.raises(pyloader.ManifestError, match="unsafe path|lacks a valid") as ei:
        pyloader.ShardDataset(sess.dir)
    assert os.path.join(sess.dir, "manifest.json") in str(ei.value)


def test_missing_shard_file_is_named_when_read(sess):
    """A shard gone after the dataset was opened: named when the epoch reaches it (the reader opens shards lazily)."""
    shard = sess.paths[1]
    ds = pyloader.ShardDataset(sess.dir)
    os.unlink(shard)
    got = []
    with pytest.raises(FileNotFoundError) as ei:
        for b in ds.batches(BATCH, num_threads=2):
            got.append(snapshot(b))
    e = ei.value
    assert isinstance(e, pyloader.ShardNotFoundError) and e.errno == errno.ENOENT
    assert e.shard == shard and shard in str(e)
    # Issue 27 item 12: not a raw [Errno 2]: the manifest that lists it, and what to do.
    assert "[Errno" not in str(e) and os.path.join(sess.dir, "manifest.json") in str(e), str(e)
    assert "its file is gone" in str(e) and "copy the dataset folder again whole, or write it again" in str(e)
    assert got == sess.ref[BATCH][:len(got)]
    first = sess.layout[sess.paths[0]].header["num_records"]
    assert len(got) == first // BATCH


def test_missing_and_corrupt_shards_of_a_mixture_name_their_source(tmp_path):
    """Issue 27 item 12 through a Mixture: the error names the manifest of the source whose shard failed."""
    dirs = []
    for k in range(2):
        d = str(tmp_path / f"src{k}")
        with pyloader.ShardWriter(d, {"x": ("uint8", (1000,))}, shard_bytes=8000, compression=None) as w:
            for i in range(40):
                w.write({"x": np.random.default_rng(i).integers(0, 256, 1000, dtype=np.uint8)})
        dirs.append(d)

    def read() -> None:
        mix = pyloader.Mixture([pyloader.ShardDataset(d) for d in dirs], (0.5, 0.5), seed=1)
        for _ in pyloader.DataLoader(mix, batch_size=8):
            pass

    victim = pyloader.ShardDataset(dirs[1]).shard_paths[2]
    original = read_bytes(victim)
    replace_file(victim, bytes(flip(original, len(original) - 500, 1)))
    with pytest.raises(pyloader.ShardCorruptError) as ei:
        read()
    assert ei.value.shard == victim and os.path.join(dirs[1], "manifest.json") in str(ei.value), str(ei.value)
    assert "with a good copy" in str(ei.value)
    os.unlink(victim)
    with pytest.raises(pyloader.ShardNotFoundError) as ei:
        read()
    assert os.path.join(dirs[1], "manifest.json") in str(ei.value) and "its file is gone" in str(ei.value)
    replace_file(victim, original)  # following the advice: the good copy back, and it reads
    read()


# --- schema mismatch ---------------------------------------------------------------------------


OTHER_FIELDS = [
    {"x": ("float64", (3,)), "y": ("int8", (None,))},                      # fewer fields
    {"img": ("uint8", (4, 6)), "label": ("int32", ()), "tokens": ("int32", (None,)),  # one dtype differs
     "blob": ("bytes", ()), "vec": ("float32", (None, 2))},
    {"img": ("uint8", (6, 4)), "label": ("int64", ()), "tokens": ("int32", (None,)),  # one shape differs
     "blob": ("bytes", ()), "vec": ("float32", (None, 2))},
    {"pic": ("uint8", (4, 6)), "label": ("int64", ()), "tokens": ("int32", (None,)),  # a name differs
     "blob": ("bytes", ()), "vec": ("float32", (None, 2))},
]


def _other_sample(fields: dict[str, Any]):
    def sample(i: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, (dt, shape) in fields.items():
            if dt == "bytes":
                out[name] = bytes(i % 5)
                continue
            shp = tuple(1 + i % 3 if d is None else d for d in shape)  # no empty rows: see make_sample
            out[name] = np.full(shp, i % 7, dtype=dt)
        return out
    return sample


@pytest.mark.parametrize("other", OTHER_FIELDS, ids=["fewer-fields", "dtype", "shape", "name"])
def test_shard_from_another_dataset(sess, tmp_path, other):
    foreign = write_dataset(str(tmp_path / "foreign"), n=9, fields=other, sample=_other_sample(other),
                            shard_bytes=1 << 20)
    src = pyloader.ShardDataset(foreign).shard_paths[0]
    shard = sess.paths[1]
    shutil.copyfile(src, shard)
    body = load_manifest(sess.dir)
    body["shards"][1]["bytes"] = os.path.getsize(shard)
    body["shards"][1]["records"] = 9
    body["records"] = sum(s["records"] for s in body["shards"])
    save_manifest(sess.dir, body)
    ds = pyloader.ShardDataset(sess.dir)
    got = []
    with pytest.raises(pyloader.SchemaError) as ei:
        for b in ds.batches(BATCH):
            got.append(snapshot(b))
    assert isinstance(ei.value, ValueError)
    assert ei.value.shard == shard and shard in str(ei.value)
    assert got == sess.ref[BATCH][:len(got)]


# --- the error surfaces at the right place ---------------------------------------------------


def _single_shard(tmp_path) -> tuple[str, str, ShardLayout]:
    d = write_dataset(str(tmp_path / "one"), n=20, shard_bytes=1 << 20)
    ds = pyloader.ShardDataset(d)
    assert len(ds.shard_paths) == 1
    shard = ds.shard_paths[0]
    return d, shard, parse_layout(read_bytes(shard))


@pytest.mark.parametrize("field", ["tokens", "img", "vec", "blob", "label"])
@pytest.mark.parametrize("num_threads", [1, 4])
def test_corrupt_record_in_third_batch(tmp_path, field, num_threads):
    d, shard, lay = _single_shard(tmp_path)
    ref = read_epoch(d, 4)
    f = list(FIELDS).index(field)
    # Record 9 of 20 sits in the third batch of 4; pick one of 8..11 whose field is nonempty.
    rec = next(r for r in (9, 10, 8, 11) if lay.entries[r][f][1] > 0)
    e = lay.entries[rec][f]
    data = flip(read_bytes(shard), lay.header["payload_off"] + e[0] + e[1] // 2, 3)
    replace_file(shard, bytes(data))
    it = pyloader.ShardDataset(d).batches(4, num_threads=num_threads)
    assert snapshot(next(it)) == ref[0]
    assert snapshot(next(it)) == ref[1]
    with pytest.raises(pyloader.ShardCorruptError) as ei:
        next(it)
    exc = ei.value
    assert (exc.shard, exc.record, exc.field) == (shard, rec, field)
    assert shard in str(exc) and f"record {rec}" in str(exc) and f"'{field}'" in str(exc)
    assert "checksum" in str(exc)
    # Issue 27 item 12: and the fix.
    assert f"replace {os.path.basename(shard)!r} with a good copy, or write the dataset again" in str(exc), str(exc)
    # The failed batch ends the iteration.
    with pytest.raises((StopIteration, pyloader.LoaderStateError)):
        next(it)


def test_malformed_lz4_block_names_record_and_field(tmp_path):
    """A forged LZ4 block (entry checksum recomputed) is rejected by the decoder itself."""
    d, shard, lay = _single_shard(tmp_path)
    f = list(FIELDS).index("tokens")
    rec = next(r for r in range(8, 20) if lay.entries[r][f][4] == 1)
    e = lay.entries[rec][f]
    data = bytearray(read_bytes(shard))
    start = lay.header["payload_off"] + e[0]
    data[start] = 0xF0  # a first token claiming 15+ literals: they run past the input
    refresh_entry_checksum(data, lay, rec, f)
    refresh_checksums(data)
    replace_file(shard, bytes(data))
    with pytest.raises(pyloader.ShardFormatError) as ei:
        list(pyloader.ShardDataset(d).batches(4))
    assert not isinstance(ei.value, pyloader.ShardCorruptError)
    assert (ei.value.shard, ei.value.record, ei.value.field) == (shard, rec, "tokens")
    assert "LZ4" in str(ei.value) and shard in str(ei.value)


# --- errors through the DataLoaders ------------------------------------------------------------


def drain(loader: torch.utils.data.DataLoader, exc_type: type[BaseException]) -> tuple[list[Any], list[BaseException]]:
    """Runs a torch DataLoader to its end, collecting the errors it re-raises on the way.

    Draining (rather than abandoning the iterator after the first error) lets torch shut
    its workers down at once; an abandoned iterator whose worker raised costs a 2 x 5 s
    join timeout when it is garbage-collected (torch behaviour, not pyloader's).
    """
    it = iter(loader)
    samples: list[Any] = []
    errors: list[BaseException] = []
    while True:
        try:
            samples.append(next(it))
        except StopIteration:
            return samples, errors
        except exc_type as e:
            errors.append(e)
            assert len(errors) <= 8, "the loader keeps failing"


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # few-CPU CI machines
@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_torch_dataloader_reraises_with_shard_path(sess, num_workers):
    shard = sess.paths[-1]
    lay = sess.layout[shard]
    e = lay.entries[0][0]
    replace_file(shard, bytes(flip(sess.original[shard], lay.header["payload_off"] + e[0], 0)))
    loader = torch.utils.data.DataLoader(pyloader.ShardDataset(sess.dir), batch_size=None,
                                         num_workers=num_workers)
    samples, errors = drain(loader, pyloader.PyloaderError)
    assert len(errors) == 1, errors
    err = errors[0]
    assert isinstance(err, pyloader.ShardCorruptError), repr(err)  # the type survives the worker
    assert shard in str(err) and "record 0" in str(err) and "'img'" in str(err), str(err)
    # Whatever was delivered is correct: each label is unique, so check record by record.
    ref = {int(np.frombuffer(r["label"], "<i8")[0]): r for r in to_records(sess.ref[BATCH])}
    for s in samples:
        r = ref[int(s["label"])]
        assert s["img"].numpy().tobytes() == r["img"] and s["tokens"].numpy().tobytes() == r["tokens"]
        assert s["blob"] == r["blob"] and s["vec"].numpy().tobytes() == r["vec"]
    first_bad = NUM_RECORDS - lay.header["num_records"]  # record 0 of the last shard
    labels = [int(s["label"]) for s in samples]
    assert len(set(labels)) == len(labels) and first_bad * 1_000_003 not in labels
    if num_workers == 0:  # one process: what arrived is a prefix of the plan order
        assert labels == [i * 1_000_003 for i in range(len(labels))] and len(labels) <= first_bad


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # few-CPU CI machines
@pytest.mark.timeout(120)
def test_torch_dataloader_workers_reraise_missing_shard(sess):
    shard = sess.paths[0]
    ds = pyloader.ShardDataset(sess.dir)  # opened before the shard goes: an opened one is caught by the constructor
    os.unlink(shard)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    _, errors = drain(loader, pyloader.PyloaderError)
    assert 1 <= len(errors) <= 2
    for err in errors:
        assert isinstance(err, FileNotFoundError) and isinstance(err, pyloader.ShardIOError), repr(err)
        assert shard in str(err), str(err)


def test_pyloader_dataloader_raises_with_shard_path(sess):
    shard = sess.paths[1]
    replace_file(shard, bytes(flip(sess.original[shard], 40, 2)))  # schema_size in the header
    loader = pyloader.DataLoader(pyloader.ShardDataset(sess.dir), batch_size=BATCH, num_workers=3)
    got = []
    with pytest.raises(pyloader.ShardCorruptError) as ei:
        for b in loader:
            got.append(snapshot(b))
    assert ei.value.shard == shard and shard in str(ei.value) and "header checksum" in str(ei.value)
    assert "with a good copy" in str(ei.value), str(ei.value)  # the fix, which the end of this test follows
    assert got == sess.ref[BATCH][:len(got)] and len(got) == sess.layout[sess.paths[0]].header["num_records"] // BATCH
    # The next epoch fails the same way; repairing the file makes it read again.
    with pytest.raises(pyloader.ShardCorruptError):
        list(loader)
    replace_file(shard, sess.original[shard])
    assert [snapshot(b) for b in pyloader.DataLoader(pyloader.ShardDataset(sess.dir), batch_size=BATCH)] == sess.ref[BATCH]
