"""``verify_dataset``: proves a converted dataset holds exactly its source's records.

Every record is compared byte for byte (NOTE [exactness] in convert.py). The dataset
is read back by the native core alone (``_C.ShardSet`` and ``_C.BatchPipeline`` over an
in-order plan), which checks every checksum on the way; the write stage does not depend
on the read stage's datasets. A dataset at a URL is fetched a few shards at a time into a
temporary folder (each checked against the manifest's size and XXH64), compared, and
deleted: the local disk holds at most about ``_SEGMENT_BYTES`` of it at once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

import pyloader._C as _C

from ..contract import check_count, default_prefetch
from ..errors import VerifyError
from ..format.encode import DatasetStore, LocalStore
from ..format.spec import MANIFEST_NAME, Field, encode_schema, parse_manifest
from .sources import Chunk, Source, open_source
from .store import RemoteStore, open_store

_SEGMENT_BYTES = 256 << 20  # shards of a remote dataset held on local disk at once, at least one


class _Capsule:
    """Hands a native batch's ``"dltensor"`` capsule to ``np.from_dlpack``.

    ``np.from_dlpack`` takes an object with ``__dlpack__``, not a capsule. The array keeps
    the batch slot alive (NOTE [DLPack lifetime]).
    """

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, *, stream: Any = None, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU: batches of a pool without pinning live in host memory


def _host_array(capsule: Any, f: Field | None) -> np.ndarray:
    """A batch array as numpy; bfloat16 (which numpy lacks) as its uint16 bits."""
    if f is not None and f.dtype == "bfloat16":
        import torch
        from torch.utils.dlpack import from_dlpack

        return from_dlpack(capsule).view(torch.int16).numpy().view("<u2")
    return np.from_dlpack(_Capsule(capsule))


def _read_in_order(root: str, shards: list[dict[str, Any]], fields: list[Field], batch_size: int,
                   num_threads: int) -> Any:
    """A BatchPipeline over every record of the shards ``shards`` (manifest entries) in ``root``, in order."""
    records = [int(s["records"]) for s in shards]
    shard_set = _C.ShardSet(paths=[os.path.join(root, s["path"]) for s in shards],
                            bytes=[int(s["bytes"]) for s in shards], records=records,
                            schema=encode_schema(fields))
    shard_idx = np.repeat(np.arange(len(shards), dtype=np.int32), records)
    record_idx = np.concatenate([np.arange(n, dtype=np.int64) for n in records])
    return _C.BatchPipeline(shards=shard_set, pool=_C.SlotPool(num_fields=len(fields)), shard_idx=shard_idx,
                            record_idx=record_idx, batch_size=batch_size, drop_last=False,
                            num_threads=num_threads, prefetch=default_prefetch(num_threads))


def _batch_arrays(fields: list[Field], item: Any) -> dict[str, np.ndarray]:
    """A pipeline result as ``{name: array, "<name>_lengths": array}`` (the loader's batch keys)."""
    _, _, arrays, lengths = item
    out: dict[str, np.ndarray] = {}
    for f, arr, ln in zip(fields, arrays, lengths, strict=True):
        out[f.name] = _host_array(arr, f)
        if ln is not None:
            out[f"{f.name}_lengths"] = _host_array(ln, None)
    return out


def _segments(store: DatasetStore,
              shards: list[dict[str, Any]]) -> Generator[tuple[str, list[dict[str, Any]]], None, None]:
    """(folder, shards) to read in turn: the dataset's own folder, or remote shards fetched a few at a time."""
    if isinstance(store, LocalStore):
        yield store.root, shards
        return
    tmp = tempfile.mkdtemp(prefix="pyloader-verify-")
    try:
        k = 0
        while k < len(shards):
            seg: list[dict[str, Any]] = []
            held = 0
            while k < len(shards) and (not seg or held + int(shards[k]["bytes"]) <= _SEGMENT_BYTES):
                s = shards[k]
                data = store.get(s["path"])
                where = f"{store.location}/{s['path']}"
                if data is None:
                    raise VerifyError(f"{where}: the manifest lists this shard but it does not exist")
                if len(data) != int(s["bytes"]) or f"{_C.xxh64(data):016x}" != s["xxh64"]:
                    raise VerifyError(f"{where}: {len(data)} bytes with XXH64 {_C.xxh64(data):016x}, the "
                                      f"manifest says {s['bytes']} bytes with {s['xxh64']}")
                with open(os.path.join(tmp, s["path"]), "wb") as fh:
                    fh.write(data)
                del data
                seg.append(s)
                held += int(s["bytes"])
                k += 1
            yield tmp, seg
            for s in seg:
                os.unlink(os.path.join(tmp, s["path"]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def verify_dataset(src: Any, dst: str | os.PathLike[str], *, kind: str | None = None, fields: Any = None,
                   nulls: str = "error", labels: bool = False, batch_size: int = 1024,
                   num_threads: int = 2, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Proves that dataset ``dst`` holds exactly the records of ``src``, in order.

    ``src`` and the options are those given to ``convert``; ``dst`` is a folder or a URL
    (``storage_options`` go to its fsspec filesystem; its shards are fetched a few at a
    time into a temporary folder). Reads every record back with the native reader (which
    checks every checksum) and compares it byte for byte with the source. Returns
    ``{"records", "fields", "bytes", "seconds"}``; raises VerifyError naming the first
    record and field that differ.
    """
    batch_size, num_threads = check_count("batch_size", batch_size), check_count("num_threads", num_threads)
    t0 = time.perf_counter()
    source = src if isinstance(src, Source) else open_source(src, kind=kind, fields=fields, nulls=nulls,
                                                             labels=labels)
    store = open_store(dst, storage_options)
    root = store.location
    if isinstance(store, RemoteStore):
        data = store.get(MANIFEST_NAME)
        if data is None:
            raise FileNotFoundError(f"{root}/{MANIFEST_NAME}: no manifest: not a dataset")
    else:
        with open(os.path.join(root, MANIFEST_NAME), "rb") as fh:
            data = fh.read()
    body = parse_manifest(data, root, _C.xxh64)
    got_fields = [tuple(f.values()) for f in body["fields"]]
    want_fields = [tuple(f.to_json().values()) for f in source.fields]
    if got_fields != want_fields:
        raise VerifyError(f"{root}: fields {got_fields} differ from the source's {want_fields}")
    n = source.num_records
    if body["records"] != n:
        raise VerifyError(f"{root}: holds {body['records']} records, the source {n}")
    if n == 0:
        return {"records": 0, "fields": len(source.fields), "bytes": 0, "seconds": time.perf_counter() - t0}

    def source_chunks() -> Iterator[Chunk]:
        row0 = source.unit_row0()
        for u in range(len(source.units)):
            yield from source.read(u, row0[u])

    chunks = source_chunks()
    pending: Chunk | None = None
    pos = 0
    nbytes = 0
    segments = _segments(store, body["shards"])
    try:
        for folder, shards in segments:
            pipeline = _read_in_order(folder, shards, source.fields, batch_size, num_threads)
            try:
                while (item := pipeline.next()) is not None:
                    batch = _batch_arrays(source.fields, item)
                    b = next(iter(batch.values())).shape[0]
                    got = 0
                    while got < b:
                        if pending is None or pending.n == 0:
                            try:
                                pending = next(chunks)
                            except StopIteration:
                                raise VerifyError(f"{root}: holds more records than the source ({pos + got}+)") from None
                            continue
                        k = min(b - got, pending.n)
                        part = pending.slice(0, k)
                        pending = pending.slice(k, pending.n)
                        nbytes += _compare(source.fields, batch, got, part, pos + got, root)
                        got += k
                    pos += b
            finally:
                pipeline.close()
    finally:
        segments.close()  # its temporary folder goes now, also after an error
    if pending is not None and pending.n:
        raise VerifyError(f"{root}: the source has more records than the dataset's {pos}")
    for extra in chunks:
        if extra.n:
            raise VerifyError(f"{root}: the source has more records than the dataset's {pos}")
    return {"records": pos, "fields": len(source.fields), "bytes": nbytes, "seconds": time.perf_counter() - t0}


def _as_u8_rows(a: np.ndarray, n: int) -> np.ndarray:
    return a.reshape(n, -1).view(np.uint8) if a.size else np.zeros((n, 0), np.uint8)


def _compare(fields: list[Field], batch: dict[str, np.ndarray], at: int, part: Chunk, rec0: int, root: str) -> int:
    k = part.n
    nbytes = 0
    for f, c in zip(fields, part.columns, strict=True):
        t = batch[f.name][at : at + k]
        if not f.variable:
            got = _as_u8_rows(t, k)
            want = np.ascontiguousarray(c).reshape(k, -1).view(np.uint8) if c.size else np.zeros((k, 0), np.uint8)
            if not np.array_equal(got, want):
                r = int(np.flatnonzero((got != want).any(axis=1))[0])
                raise VerifyError(f"{root}: record {rec0 + r} field {f.name!r} differs from the source")
            nbytes += want.nbytes
            continue
        lens = batch[f"{f.name}_lengths"][at : at + k]
        if not np.array_equal(lens, c.lengths):
            r = int(np.flatnonzero(lens != c.lengths)[0])
            raise VerifyError(f"{root}: record {rec0 + r} field {f.name!r} has length {int(lens[r])}, "
                              f"the source {int(c.lengths[r])}")
        got = _as_u8_rows(t, k)
        mv = np.ascontiguousarray(c.data).data if c.data.size else memoryview(b"")
        offs = c.offsets.tolist()
        for r in range(k):
            a, e = offs[r], offs[r + 1]
            if got[r, : e - a].tobytes() != mv[a:e]:
                raise VerifyError(f"{root}: record {rec0 + r} field {f.name!r} differs from the source")
        nbytes += offs[-1] - offs[0]
    return nbytes


__all__ = ["verify_dataset"]
