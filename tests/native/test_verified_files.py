"""Shard files verified in full by one reader are not hashed again by the next, unless written since.

NOTE [verified files] in csrc/core/shard_reader.cpp. Each test keeps its records in its own
cache dir (``PYLOADER_CACHE_DIR``), and waits until the files it wrote are older than
``RACY_NS`` (a file changed within it of its open is never recorded).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
import pytest

import pyloader
from pyloader.format import spec as _format
from pyloader.read import verified as _verified

pytestmark = pytest.mark.timeout(120)

FIELDS: dict[str, Any] = {"label": ("int64", ()), "img": ("uint8", (3000,))}


def sample(i: int) -> dict[str, Any]:
    return {"label": i, "img": np.full(3000, i % 251, np.uint8)}


@pytest.fixture
def dataset(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("PYLOADER_CACHE_DIR", str(tmp_path / "cache"))
    d = str(tmp_path / "ds")
    # version 2: every value has an index entry with its own checksum (the helper below finds it).
    with pyloader.ShardWriter(d, FIELDS, shard_bytes=64 << 10, compression="none", version=2) as w:
        for i in range(100):
            w.write(sample(i))
    time.sleep(_verified.RACY_NS / 1e9 + 0.2)  # older than the racy window
    return d


def epoch(path: str) -> dict[str, Any]:
    """One full epoch of a new ShardDataset over ``path`` (a new shard set, as a new process has); its stats."""
    it = pyloader.ShardDataset(path, rank=0, world_size=1).batches(16, num_threads=2)
    for _ in it:
        pass
    return it.stats()


def flip_payload_byte(path: str, rec: int, field: int) -> None:
    """Flips one payload byte of ``field`` of record ``rec`` in the shard file ``path``, in place."""
    with open(path, "r+b") as fh:
        vals = _format._HEADER.unpack_from(fh.read(_format.HEADER_SIZE))
        num_fields, index_off, payload_off = vals[4], vals[8], vals[10]
        fh.seek(index_off + (rec * num_fields + field) * _format.INDEX_ENTRY_SIZE)
        entry = np.frombuffer(fh.read(_format.INDEX_ENTRY_SIZE), dtype=_format.INDEX_DTYPE)[0]
        pos = payload_off + int(entry["offset"]) + int(entry["stored"]) // 2
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_a_verified_shard_is_not_hashed_again(dataset) -> None:
    first = epoch(dataset)
    assert first["records"] == 100 and first["verified_bytes"] == first["stored_bytes"] > 0
    assert len(os.listdir(_verified.store_dir())) == 1
    second = epoch(dataset)
    assert second["records"] == 100 and second["verified_bytes"] == 0  # before: every byte hashed again


def test_a_shard_rewritten_in_place_is_verified_again(dataset) -> None:
    epoch(dataset)
    assert epoch(dataset)["verified_bytes"] == 0
    ds = pyloader.ShardDataset(dataset, rank=0, world_size=1)
    shard, rec = ds.shard_paths[1], 3
    before = os.stat(shard)
    flip_payload_byte(shard, rec, [f.name for f in ds.fields].index("img"))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same mtime: only ctime tells
    after = os.stat(shard)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    with pytest.raises(pyloader.ShardCorruptError) as ei:
        epoch(dataset)
    assert ei.value.shard == shard and ei.value.record == rec and ei.value.field == "img"


def test_a_record_file_that_cannot_be_parsed_is_not_trusted(dataset) -> None:
    epoch(dataset)
    (name,) = os.listdir(_verified.store_dir())
    record = os.path.join(_verified.store_dir(), name)
    with open(record, encoding="utf-8") as fh:
        body = json.load(fh)
    for bad in (b"{not json", json.dumps({**body, "format": 99}).encode(),
                json.dumps({**body, "root": "/elsewhere"}).encode()):
        with open(record, "wb") as fh:
            fh.write(bad)
        st = epoch(dataset)
        assert st["verified_bytes"] == st["stored_bytes"] > 0
        os.unlink(record)  # so the next variant is written over a missing record, not a good one
        assert epoch(dataset)["verified_bytes"] > 0  # and is recorded again ...
        assert epoch(dataset)["verified_bytes"] == 0  # ... then trusted


def test_a_freshly_written_file_is_not_recorded(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PYLOADER_CACHE_DIR", str(tmp_path / "cache"))
    d = str(tmp_path / "ds")
    with pyloader.ShardWriter(d, FIELDS, shard_bytes=64 << 10, compression="none", version=2) as w:
        for i in range(20):
            w.write(sample(i))
    newest = max(os.stat(os.path.join(d, n)).st_ctime_ns for n in os.listdir(d))
    opened = time.time_ns()
    assert epoch(d)["verified_bytes"] > 0
    if opened - newest >= _verified.RACY_NS:
        pytest.skip("the machine took longer than the racy window between writing and reading")
    # A write in the same tick of the kernel's clock would not have changed ctime: not recorded.
    assert not os.path.exists(_verified.store_dir()) or not os.listdir(_verified.store_dir())
    st = epoch(d)
    assert st["verified_bytes"] == st["stored_bytes"] > 0
