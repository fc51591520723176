"""Shards forged with every checksum recomputed to agree: each size they state is bounded first.

A checksum catches damage, not intent: anyone can rewrite an index entry, a header field or
a schema and recompute the header, schema, column-table, index and value checksums to match
(tests/read/test_corruption.py covers the flips that the checksums catch). Every size such
a shard states must then be bounded before anything is allocated from it (NOTE [value
bounds] in csrc/core/shard_reader.h): a value may not decode to more than its stored bytes
can (255x for LZ4, 1x raw), nor to more than ``max_value_bytes``; a forged entry fails when
the shard is opened, naming shard, record and field. Schema names are checked against the
format's rule and never reach Python as undecodable bytes.

The reads of forged shards run in a child process under an address-space cap (RLIMIT_AS),
so an over-allocation fails the test (MemoryError in the child) instead of taking the
machine, and the child reports its peak RSS (``ru_maxrss``) against a read of the pristine
dataset. The fuzz is a seeded loop: ``PYLOADER_FUZZ_SEED=N`` replays another seed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import pyloader
from pyloader import _C

SEED = int(os.environ.get("PYLOADER_FUZZ_SEED", "20261204"))

FIELDS: dict[str, Any] = {
    "img": ("uint8", (4, 6)),
    "label": ("int64", ()),
    "tokens": ("int32", (None,)),
    "blob": ("bytes", ()),
    "vec": ("float32", (None, 2)),
}
ROW_BYTES = {"img": 24, "label": 8, "tokens": 4, "blob": 1, "vec": 8}
NUM_RECORDS = 40
BATCH = 16

# The shard layout, from docs/format.md (independently of pyloader.format.spec).
HEADER = struct.Struct("<8sIIQIIQQQQQQQQQQQQ")
NAMES = ("magic", "version", "header_size", "num_records", "num_fields", "entry_size", "schema_off",
         "schema_size", "index_off", "index_size", "payload_off", "payload_size", "file_size",
         "schema_checksum", "index_checksum", "columns_size", "columns_checksum", "header_checksum")
ENTRY = struct.Struct("<QIIIB3sQ")  # offset, stored, decoded, leading, codec, pad, checksum
assert HEADER.size == 128 and ENTRY.size == 32


def sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    n = i % 9
    return {"img": np.full((4, 6), i, np.uint8), "label": i,
            "tokens": np.full(4 * n, i, np.int32) if i % 2 else rng.integers(0, 9, n, dtype=np.int32),
            "blob": b"xy" * (10 * (i % 7)), "vec": np.ones((8 * (1 + i % 3), 2), np.float32)}


def write(path: str, version: int) -> str:
    with pyloader.ShardWriter(path, FIELDS, shard_bytes=1200, compression="lz4", version=version) as w:
        for i in range(NUM_RECORDS):
            w.write(sample(i))
    return path


class Shard:
    """A shard's bytes and where its parts lie, for forging."""

    def __init__(self, data: bytes) -> None:
        self.data = bytearray(data)
        self.h = dict(zip(NAMES, HEADER.unpack_from(self.data, 0)))
        self.checksum = _C.xxh64 if self.h["version"] == 1 else _C.xxh3_64
        names = list(FIELDS)
        columns: set[int] = set()
        if self.h["version"] == 3:
            ct = self.h["schema_off"] + self.h["schema_size"]
            (ncols,) = struct.unpack_from("<I", self.data, ct)
            columns = {struct.unpack_from("<I", self.data, ct + 8 + 24 * c)[0] for c in range(ncols)}
        self.indexed = [names[f] for f in range(len(names)) if f not in columns]

    def entry_pos(self, record: int, field: str) -> int:
        return self.h["index_off"] + (record * len(self.indexed) + self.indexed.index(field)) * 32

    def entry(self, record: int, field: str) -> tuple:
        return ENTRY.unpack_from(self.data, self.entry_pos(record, field))

    def set_entry(self, record: int, field: str, **kw: int) -> None:
        off, stored, decoded, leading, codec, pad, cs = self.entry(record, field)
        vals = {"offset": off, "stored": stored, "decoded": decoded, "leading": leading, "codec": codec}
        vals.update(kw)
        ENTRY.pack_into(self.data, self.entry_pos(record, field), vals["offset"], vals["stored"] & 0xFFFFFFFF,
                        vals["decoded"] & 0xFFFFFFFF, vals["leading"] & 0xFFFFFFFF, vals["codec"] & 0xFF, pad, cs)

    def seal(self) -> bytes:
        """Recomputes every checksum the (possibly forged) layout allows: values, index, schema, column table, header."""
        d, h = self.data, dict(zip(NAMES, HEADER.unpack_from(self.data, 0)))
        cs = self.checksum
        po, ps = h["payload_off"], h["payload_size"]
        io_, is_ = h["index_off"], h["index_size"]
        if io_ + is_ <= len(d) and po <= len(d):
            for pos in range(io_, io_ + is_ - 31, 32):
                off, stored = struct.unpack_from("<QI", d, pos)
                if off + stored <= min(ps, len(d) - po):
                    struct.pack_into("<Q", d, pos + 24, cs(bytes(d[po + off:po + off + stored])))
            struct.pack_into("<Q", d, 96, cs(bytes(d[io_:io_ + is_])))
        so, ss = h["schema_off"], h["schema_size"]
        if so + ss <= len(d):
            struct.pack_into("<Q", d, 88, cs(bytes(d[so:so + ss])))
            if h["version"] == 3 and so + ss + h["columns_size"] <= len(d):
                struct.pack_into("<Q", d, 112, cs(bytes(d[so + ss:so + ss + h["columns_size"]])))
        struct.pack_into("<Q", d, 120, cs(bytes(d[:120])))
        return bytes(d)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def put(path: str, data: bytes) -> None:
    with open(path, "r+b") as fh:  # same size: in place
        fh.write(data)


@pytest.fixture(scope="module", params=[2, 3], ids=["v2", "v3-columns"])
def pristine(request, tmp_path_factory) -> str:
    return write(str(tmp_path_factory.mktemp(f"forge-v{request.param}") / "ds"), request.param)


@pytest.fixture
def ds(pristine, tmp_path) -> str:
    d = str(tmp_path / "ds")
    shutil.copytree(pristine, d)
    return d


def lz4_entry(path: str, field: str) -> tuple[int, tuple]:
    """A record whose ``field`` is stored LZ4 with a nonzero length."""
    sh = Shard(read_bytes(path))
    for r in range(sh.h["num_records"]):
        e = sh.entry(r, field)
        if e[4] == 1 and e[3] > 0:
            return r, e
    raise AssertionError(f"no LZ4 entry of {field} in {path}")


# --- a child process that reads under an address-space cap and reports its peak RSS --------

_CHILD = textwrap.dedent("""
    import json, resource, sys
    import pyloader

    def read(ds, batch):
        try:
            for _ in pyloader.ShardDataset(ds).batches(batch, num_threads=2):
                pass
        except pyloader.PyloaderError as e:
            return {"error": type(e).__name__, "message": str(e), "shard": e.shard, "record": e.record,
                    "field": e.field}
        except BaseException as e:  # anything else fails the test (MemoryError: an over-allocation)
            return {"error": "foreign:" + type(e).__name__, "message": str(e)[:500]}
        return {"error": None}

    ds, batch = sys.argv[1], int(sys.argv[2])
    # Cap the address space at what the process maps now plus 1 GiB: an allocation from a
    # forged size (batch rows x up to 4 GiB) fails here instead of taking the machine.
    vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
    out = read(ds, batch)
    out["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(out))
""")


def read_in_child(ds: str, batch: int = BATCH) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-c", _CHILD, ds, str(batch)], capture_output=True, text=True, timeout=120,
                       check=False)
    assert p.returncode == 0, f"child exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("field", ["tokens", "vec", "blob"])
def test_forged_value_size_fails_at_open_without_allocating(ds, field):
    """The issue's attack: an LZ4 entry that says it decodes to ~4 GiB, consistent with its
    length, the field's shape and every checksum. Refused at open, naming shard, record and
    field; the read's peak memory stays that of reading the pristine dataset."""
    path = pyloader.ShardDataset(ds).shard_paths[-1]
    baseline = read_in_child(ds)
    assert baseline["error"] is None, baseline
    r, e = lz4_entry(path, field)
    leading = (2**32 - 1) // ROW_BYTES[field]
    sh = Shard(read_bytes(path))
    sh.set_entry(r, field, leading=leading, decoded=leading * ROW_BYTES[field])
    put(path, sh.seal())
    got = read_in_child(ds)
    assert got["error"] == "ShardFormatError", got
    assert (got["shard"], got["record"], got["field"]) == (path, r, field), got
    assert f"more than an LZ4 block of {e[1]} bytes can hold" in got["message"], got
    assert path in got["message"] and f"record {r}" in got["message"], got
    grew = (got["peak_rss_kb"] - baseline["peak_rss_kb"]) / 1024
    assert grew < 16, f"reading the forged shard took {grew:.1f} MB more than the pristine one"


def test_a_claim_within_the_lz4_bound_is_still_decoded_and_checked(ds):
    """255x the stored bytes passes the open-time bound; the decoder then finds the block too
    short: a ShardFormatError naming the record, never a wrong value."""
    path = pyloader.ShardDataset(ds).shard_paths[0]
    r, e = lz4_entry(path, "tokens")
    leading = e[1] * 255 // 4
    sh = Shard(read_bytes(path))
    sh.set_entry(r, "tokens", leading=leading, decoded=leading * 4)
    put(path, sh.seal())
    with pytest.raises(pyloader.ShardFormatError, match="LZ4 block is malformed") as ei:
        for _ in pyloader.ShardDataset(ds).batches(BATCH):
            pass
    assert (ei.value.shard, ei.value.record, ei.value.field) == (path, r, "tokens")


def test_max_value_bytes_limits_real_values(tmp_path):
    """Values that really are that large: the per-value limit refuses them at open with a
    message saying how to allow them; the default reads them."""
    d = str(tmp_path / "big")
    with pyloader.ShardWriter(d, {"blob": "bytes", "label": "int64"}, compression="none") as w:
        for i in range(4):
            w.write({"blob": bytes([i]) * (3000 if i == 2 else 100), "label": i})
    assert sum(b["label"].shape[0] for b in pyloader.ShardDataset(d).batches(2)) == 4
    with pytest.raises(pyloader.ShardFormatError, match="per-value limit of 2048 bytes.*max_value_bytes") as ei:
        for _ in pyloader.ShardDataset(d, max_value_bytes="2K").batches(2):
            pass
    assert (ei.value.record, ei.value.field) == (2, "blob") and ei.value.shard.endswith(".pyl")
    with pytest.raises(ValueError, match="must be >= 1"):
        pyloader.ShardDataset(d, max_value_bytes=0)


def test_max_value_bytes_bounds_a_fixed_field_from_the_schema(tmp_path):
    """A fixed-shape field's every value is its record size: checked once, when the dataset is
    opened, before any batch buffer is sized from it."""
    d = str(tmp_path / "fixed")
    with pyloader.ShardWriter(d, {"x": ("float32", (64, 64))}) as w:
        w.write({"x": np.zeros((64, 64), np.float32)})
    with pytest.raises(pyloader.SchemaError, match="field 'x' makes every value 16384 bytes.*max_value_bytes"):
        pyloader.ShardDataset(d, max_value_bytes=16383)
    assert pyloader.ShardDataset(d, max_value_bytes=16384).num_records == 1
    schema = pyloader.ShardDataset(d)._schema
    with pytest.raises(pyloader.SchemaError, match="per-value limit") as ei:
        _C.ShardSet(paths=[], bytes=[], records=[], schema=schema, max_value_bytes=1000)
    assert ei.value.field == "x"


def test_lz4_entry_point_refuses_a_size_its_block_cannot_hold():
    """The benchmark's decode entry point sizes its output from a shard's index too."""
    with pytest.raises(pyloader.ShardFormatError, match="more than a block of 16 bytes can decode to"):
        _C.lz4_decode_block(b"\x00" * 16, 2**32 - 1)
    with pytest.raises(pyloader.ShardFormatError, match="more than the block can decode to"):
        _C.lz4_decode_into(b"\x00" * 2, bytearray(511))


@pytest.mark.parametrize("name", [b"t\xffkens", b"\xc3\xa9tiquette"[:6], b"1okens", b"tok-ns"])
def test_forged_schema_name_is_a_schema_error_naming_the_shard(ds, name):
    """A shard schema whose name breaks [A-Za-z_][A-Za-z0-9_]* (not UTF-8, or another
    character), checksums forged: a SchemaError naming the shard, the name escaped, never a
    UnicodeDecodeError."""
    path = pyloader.ShardDataset(ds).shard_paths[1]
    sh = Shard(read_bytes(path))
    so, ss = sh.h["schema_off"], sh.h["schema_size"]
    schema = bytes(sh.data[so:so + ss])
    at = schema.index(b"tokens")
    assert len(name) == 6
    sh.data[so + at:so + at + 6] = name
    put(path, sh.seal())
    with pytest.raises(pyloader.SchemaError) as ei:
        for _ in pyloader.ShardDataset(ds).batches(BATCH):
            pass
    msg = str(ei.value)
    assert ei.value.shard == path and path in msg, msg
    assert "is not [A-Za-z_][A-Za-z0-9_]*" in msg, msg
    if name[1] == 0xFF:
        assert "'t\\xffkens'" in msg, msg


def test_dataset_schema_names_are_checked_natively():
    """The same rule for a schema block handed to the reader directly (the dataset's)."""
    def block(name: bytes) -> bytes:
        return struct.pack("<IH", 1, len(name)) + name + struct.pack("<BBBB", 9, 0, 0, 0)

    _C.ShardSet(paths=[], bytes=[], records=[], schema=block(b"_ok_9"))
    for bad in (b"\xff", b"9x", b"a b", b"a" * 129, b"caf\xc3\xa9"):
        with pytest.raises(pyloader.SchemaError, match="dataset schema.*is not"):
            _C.ShardSet(paths=[], bytes=[], records=[], schema=block(bad))


# --- the fuzz: forged-but-consistent shards, read in a child under an address-space cap -----

_MAX32 = 2**32 - 1


def forge(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """One forgery of a shard, every checksum resealed; returns it and what was done."""
    sh = Shard(data)
    h = sh.h
    kind = rng.choice(("claim", "claim", "claim", "entry", "entry", "header", "schema")
                      + (("columns",) if h["version"] == 3 else ()))
    if kind in ("claim", "entry"):
        field = rng.choice(sh.indexed)
        r = rng.randrange(h["num_records"])
        if kind == "claim":  # a decoded size that agrees with the length and the field's shape
            leading = rng.choice((_MAX32 // ROW_BYTES[field], 2**31 // ROW_BYTES[field], 1 << 24,
                                  rng.randrange(1, 1 << 20)))
            kw = {"leading": leading, "decoded": leading * ROW_BYTES[field]}
            if rng.random() < 0.3:
                kw["codec"] = rng.choice((0, 1))
            if rng.random() < 0.3:
                kw["stored"] = rng.choice((1, 16, kw["decoded"] // 255, kw["decoded"] // 254))
        else:
            key = rng.choice(("offset", "stored", "decoded", "leading", "codec"))
            kw = {key: rng.choice((0, 1, 16, 255, _MAX32, 2**31, rng.randrange(1 << 32)))}
            if key == "offset":
                kw[key] = rng.choice((h["payload_size"], 2**63, 2**64 - 1, rng.randrange(h["payload_size"] + 1)))
        sh.set_entry(r, field, **kw)
        what = f"{kind} record {r} field {field} {kw}"
    elif kind == "header":
        name = rng.choice(("num_records", "num_fields", "schema_size", "index_off", "index_size", "payload_off",
                           "payload_size", "columns_size"))
        fmt = {"num_fields": "<I"}.get(name, "<Q")
        pos = {"num_records": 16, "num_fields": 24, "schema_size": 40, "index_off": 48, "index_size": 56,
               "payload_off": 64, "payload_size": 72, "columns_size": 104}[name]
        value = rng.choice((0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, h[name] + rng.choice((-32, -1, 1, 32)) if
                            h[name] >= 32 else 7))
        struct.pack_into(fmt, sh.data, pos, value & (0xFFFFFFFF if fmt == "<I" else 2**64 - 1))
        what = f"header {name}={value}"
    elif kind == "schema":  # a dimension of the shard's schema (it then differs from the dataset's)
        so, ss = h["schema_off"], h["schema_size"]
        pos = so + rng.randrange(max(1, ss - 8))
        struct.pack_into("<q", sh.data, pos, rng.choice((-1, 0, 2**32, 2**62, -(2**63))))
        what = f"schema bytes at {pos - so}"
    else:  # a column descriptor (version 3)
        ct = h["schema_off"] + h["schema_size"]
        (ncols,) = struct.unpack_from("<I", sh.data, ct)
        c = rng.randrange(max(1, ncols))
        slot = rng.choice((4, 8, 16))
        fmt = "<Q" if slot == 16 else "<I"
        value = rng.choice((0, 1, 2**31, _MAX32, 2**63 if fmt == "<Q" else 7))
        struct.pack_into(fmt, sh.data, ct + 8 + 24 * c + slot, value)
        what = f"column {c} +{slot}={value}"
    return sh.seal(), what


_FUZZ_CHILD = textwrap.dedent("""
    import json, random, resource, sys
    sys.path.insert(0, sys.argv[1])
    import pyloader
    import test_forged_sizes as t

    ds, seed, n = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    paths = pyloader.ShardDataset(ds).shard_paths
    original = {p: t.read_bytes(p) for p in paths}
    for _ in pyloader.ShardDataset(ds).batches(t.BATCH, num_threads=2):  # warm: the pristine read's memory
        pass
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))
    rng = random.Random(seed)
    outcomes, bad = {}, []
    for i in range(n):
        path = rng.choice(paths)
        data, what = t.forge(rng, original[path])
        t.put(path, data)
        try:
            for _ in pyloader.ShardDataset(ds).batches(rng.choice((1, t.BATCH)), num_threads=rng.choice((1, 2))):
                pass
            key = "read"
        except pyloader.PyloaderError as e:
            key = type(e).__name__
            if e.shard != path or path not in str(e):
                bad.append(f"iter {i} {what}: {key} does not name the shard: {e}")
        except BaseException as e:
            key = "foreign"
            bad.append(f"iter {i} {what}: {type(e).__name__}: {str(e)[:300]}")
        finally:
            t.put(path, original[path])
        outcomes[key] = outcomes.get(key, 0) + 1
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(json.dumps({"outcomes": outcomes, "bad": bad[:10], "rss_growth_mb": grew}))
""")


@pytest.mark.timeout(240)
def test_fuzz_forged_consistent_shards_only_raise_pyloader_errors_within_bounded_memory(ds):
    """Seeded forgeries of index entries (sizes that agree with the field's shape, offsets,
    codecs), header fields, schema dimensions and column descriptors, every checksum
    resealed. Each read ends in a pyloader error naming the shard, or reads; none allocates
    beyond a bound (the child's address space is capped; its peak RSS may grow by a few MB
    over the pristine read), hangs (the timeout) or crashes (the child's exit status)."""
    n = 300
    p = subprocess.run([sys.executable, "-c", _FUZZ_CHILD, os.path.dirname(os.path.abspath(__file__)), ds,
                        str(SEED), str(n)], capture_output=True, text=True, timeout=220, check=False)
    assert p.returncode == 0, f"fuzz child (seed {SEED}) exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert not got["bad"], f"seed {SEED}: {json.dumps(got, indent=1)}"
    assert sum(got["outcomes"].values()) == n, got
    assert got["outcomes"].get("ShardFormatError", 0) > n // 3, got  # the forgeries do reach the checks
    assert got["rss_growth_mb"] < 32, f"seed {SEED}: peak RSS grew {got['rss_growth_mb']:.1f} MB over the pristine read"


@pytest.mark.parametrize("bad, why", [("lots", "invalid size 'lots'"), (0, "must be >= 1")])
def test_a_bad_max_value_bytes_names_the_option(tmp_path, bad, why):
    d = str(tmp_path / "ds")
    with pyloader.ShardWriter(d, {"x": ("uint8", (4,))}) as w:
        w.write({"x": np.zeros(4, np.uint8)})
    with pytest.raises(ValueError, match=f"^max_value_bytes: .*{why}"):
        pyloader.ShardDataset(d, max_value_bytes=bad)
