"""Shard encoding: validated byte values -> shard files (format version 3 or 2) and the dataset manifest.

The one place that lays out shard bytes on the Python side. ``ShardWriter`` (one sample at
a time) and ``pyloader convert`` (chunks of columns) both feed a ``ShardEncoder``; the
native reader (csrc/core/shard_reader.cpp) parses what it writes.

NOTE [atomic publish]: every file a reader may open (a shard, a manifest, the node
cache's files) is written to a unique temp file, fsynced and renamed into place, so a
reader sees the whole file or none. The manifest goes last: a dataset exists once its
manifest does, and shards that no manifest lists are leftovers.

NOTE [overwrite]: a replacement dataset writes its shards under new names (a fresh token
in the prefix), so the old dataset stays whole until the new manifest replaces the old
one atomically; only then are the old shards deleted. A failed rewrite leaves the old
dataset as it was.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import lz4.block
import numpy as np

import pyloader._C as _C

from ..errors import FetchError
from .spec import (
    CODEC_LZ4,
    CODEC_RAW,
    INDEX_DTYPE,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    VERSION,
    ColumnDesc,
    Field,
    column_block_rows,
    dump_manifest,
    encode_column_table,
    encode_schema,
    is_column_field,
    pack_header,
    parse_manifest,
    shard_checksum,
)

MIN_GAIN = 0.1  # default: a value is stored LZ4 only when that saves at least 10% of its bytes
_INDEX_COLUMNS = ("offset", "stored", "decoded", "leading", "codec", "checksum")


def atomic_write(path: str, chunks: Iterable[Any]) -> None:
    """Writes ``chunks`` (bytes-like) to ``path`` atomically (NOTE [atomic publish]).

    Writes a unique temp file, fsyncs it, then renames it over ``path``. The temp name ends
    in ``.part`` and carries the writer's pid, which is how the node cache recognises (and
    later removes) the leftovers of a dead writer.
    """
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def remove_shards(root: str, names: Iterable[str]) -> None:
    """Deletes the shard files ``names`` under ``root``; ones already gone are skipped."""
    for name in names:
        try:
            os.unlink(os.path.join(root, name))
        except FileNotFoundError:
            pass


class DatasetStore(Protocol):
    """Where a dataset's files go: a local folder (``LocalStore``) or an object store URL.

    ``put`` publishes a whole file under ``name`` (a reader sees all of it or nothing:
    NOTE [atomic publish]); ``get`` returns a file's bytes or None if it is missing;
    ``remove`` deletes files, skipping missing ones; ``names`` lists the files directly
    in the dataset. ``location`` is the folder or URL, for messages.
    """

    location: str

    def put(self, name: str, chunks: Sequence[Any]) -> None: ...  # noqa: D102

    def get(self, name: str) -> bytes | None: ...  # noqa: D102

    def remove(self, names: Iterable[str]) -> None: ...  # noqa: D102

    def names(self) -> list[str]: ...  # noqa: D102


class LocalStore:
    """A dataset folder on this machine: files are published by ``atomic_write``."""

    def __init__(self, root: str) -> None:
        self.location = self.root = root

    def put(self, name: str, chunks: Sequence[Any]) -> None:
        """Writes ``chunks`` to ``<root>/<name>`` atomically (a ``.part`` temp file renamed into place)."""
        atomic_write(os.path.join(self.root, name), chunks)

    def get(self, name: str) -> bytes | None:
        """The bytes of ``<root>/<name>``, None if there is no such file."""
        try:
            with open(os.path.join(self.root, name), "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    def remove(self, names: Iterable[str]) -> None:
        """Deletes ``<root>/<name>`` for each name; ones already gone are skipped."""
        remove_shards(self.root, names)

    def names(self) -> list[str]:
        """The names of the files directly in the folder (none if it does not exist)."""
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_file(follow_symlinks=False))
        except FileNotFoundError:
            return []


@dataclass(frozen=True)
class ColumnBytes:
    """One field's values for ``n`` records as raw bytes, already validated against the field.

    Fixed field: record ``r`` is ``data[r * row_bytes : (r + 1) * row_bytes]``. Variable
    field (``offsets`` given): record ``r`` is ``data[offsets[r] : offsets[r + 1]]`` with
    ``lengths[r]`` leading rows.
    """

    data: memoryview  # format "B"
    row_bytes: int = 0
    offsets: list[int] | None = None
    lengths: list[int] | None = None


class ShardEncoder:
    """Encodes records into shards ``<root>/<prefix><n:06d>.pyl``.

    With ``version`` 3 (the default) the fields ``is_column_field`` picks are stored as
    columns (NOTE [column layout] in spec.py), raw whatever their ``compress`` flag; if no
    field qualifies the shards are version 2, byte for byte what version 2 writers wrote.
    ``version=2`` writes version 2 shards always. Any other value is a ValueError.
    ``store`` publishes them (default: ``LocalStore(root)``; a convert to a URL passes
    its own). A value of an indexed field is stored LZ4 when its field's ``compress`` flag
    is set and LZ4 saves at least ``min_gain`` of its size, raw otherwise. A shard is
    published (NOTE [atomic publish]) once its payload reaches ``shard_bytes``, and by
    ``close()``. ``shards`` lists the manifest entries of the shards published so far, in order.
    """

    def __init__(self, root: str, fields: Sequence[Field], compress: Sequence[bool], *, shard_bytes: int,
                 prefix: str, min_gain: float = MIN_GAIN, version: int = VERSION,
                 store: DatasetStore | None = None) -> None:
        if len(compress) != len(fields):
            raise ValueError(f"compress has {len(compress)} flags for {len(fields)} fields")
        if version not in (2, 3):
            raise ValueError(f"version must be 2 or 3 (the shard format versions written), got {version!r}")
        self.root, self.prefix = root, prefix
        self.store: DatasetStore = store if store is not None else LocalStore(root)
        self.fields = list(fields)
        self.compress = [bool(c) for c in compress]
        self.shard_bytes = shard_bytes
        self.min_gain = min_gain
        # Field numbers stored as columns; the version follows (3 only if there is one).
        self.column_fields = [i for i, f in enumerate(self.fields) if is_column_field(f)] if version == 3 else []
        self.version = 3 if self.column_fields else 2
        self._column_row = sum(self.fields[i].row_bytes for i in self.column_fields)  # bytes per record
        self.schema = encode_schema(self.fields)
        self._checksum = shard_checksum(self.version)  # of headers, schemas, tables, indexes and values
        self.schema_checksum = self._checksum(self.schema)
        self.shards: list[dict[str, Any]] = []
        self.records = 0  # records appended, published or not
        self.bytes_out = 0  # bytes of the published shard files
        self._blobs: list[Any] = []
        self._entries: list[tuple[int, int, int, int, int, int]] = []
        self._columns: list[list[Any]] = [[] for _ in self.column_fields]  # each column's parts, in record order
        self._payload = 0  # bytes of the indexed values (their offsets)
        self._records_in_shard = 0

    def append_record(self, values: Sequence[tuple[memoryview, int]]) -> None:
        """Appends one record: per field, its raw bytes and its leading length.

        Each value is a ``"B"`` memoryview; the leading length is 0 for a fixed field.
        Values stored raw are copied, so the caller may reuse its buffers.
        """
        columns = [ColumnBytes(v, 0, [0, len(v)], [leading]) for v, leading in values]
        self._append(1, columns, copy=True)

    def append_columns(self, n: int, columns: Sequence[ColumnBytes]) -> None:
        """Appends ``n`` records given column by column.

        The shard in progress keeps views of ``columns`` until it is published: the caller
        must not change their bytes.
        """
        self._append(n, columns, copy=False)

    def _append(self, n: int, columns: Sequence[ColumnBytes], copy: bool) -> None:
        if len(columns) != len(self.fields):
            raise ValueError(f"{len(columns)} columns for {len(self.fields)} fields")
        lz4_compress, checksum = lz4.block.compress, self._checksum
        entries, blobs = self._entries, self._blobs
        keep = 1.0 - self.min_gain
        is_col = set(self.column_fields)
        cols = [(c.data, c.offsets, c.lengths, c.row_bytes, comp)
                for i, (c, comp) in enumerate(zip(columns, self.compress, strict=True)) if i not in is_col]
        col_row = self._column_row
        seg = 0  # the first record of `columns` not yet added to the column parts

        def cut(end: int) -> None:  # the column values of records [seg, end) join their columns
            for parts, i in zip(self._columns, self.column_fields, strict=True):
                c = columns[i]
                if c.offsets is None:
                    rb = self.fields[i].row_bytes
                    v = c.data[seg * rb : end * rb]
                else:  # one record given as a value (append_record)
                    v = c.data[c.offsets[seg] : c.offsets[end]]
                parts.append(bytes(v) if copy else v)

        r = 0
        while r < n:
            if cols:
                for data, offs, lens, rb, comp in cols:
                    if offs is None:
                        v = data[r * rb : (r + 1) * rb]
                        leading = 0
                    else:
                        v = data[offs[r] : offs[r + 1]]
                        leading = lens[r]  # type: ignore[index]  # a ColumnBytes with offsets has lengths
                    size = len(v)
                    stored: Any = v
                    codec = CODEC_RAW
                    if comp and size:
                        z = lz4_compress(v, store_size=False)
                        if len(z) <= keep * size:
                            stored, codec = z, CODEC_LZ4
                    entries.append((self._payload, len(stored), size, leading, codec, checksum(stored)))
                    blobs.append(bytes(stored) if copy and codec == CODEC_RAW else stored)
                    self._payload += len(stored)
                k = 1
            else:  # columns only: as many records as the shard has room for, at once
                room = self.shard_bytes - self._payload - self._records_in_shard * col_row
                k = min(n - r, max(1, -(-room // col_row)))
            r += k
            self._records_in_shard += k
            self.records += k
            if self._payload + self._records_in_shard * col_row >= self.shard_bytes:
                cut(r)
                seg = r
                self.flush()
        if seg < n:
            cut(n)

    def flush(self) -> None:
        """Publishes the shard in progress, if it holds any record."""
        if self._records_in_shard == 0:
            return
        n = self._records_in_shard
        index = np.zeros(len(self._entries), dtype=INDEX_DTYPE)
        cols = np.array(self._entries, dtype=np.uint64).reshape(-1, len(_INDEX_COLUMNS))
        for k, name in enumerate(_INDEX_COLUMNS):
            index[name] = cols[:, k]
        index_bytes = index.tobytes()
        table, column_data, payload = b"", [], self._payload
        if self.version == 3:
            # See NOTE [column layout]: the columns follow the indexed values in the payload, in
            # field order, without padding (a column value is copied with memcpy, which
            # needs no alignment).
            descs = []
            for parts, i in zip(self._columns, self.column_fields, strict=True):
                data = b"".join(parts)
                rb = self.fields[i].row_bytes
                rows = column_block_rows(rb)
                view = memoryview(data)
                sums = tuple(self._checksum(view[b * rows * rb : (b + 1) * rows * rb]) for b in range(-(-n // rows)))
                descs.append(ColumnDesc(i, rb, rows, payload, sums))
                column_data.append(data)
                payload += len(data)
            table = encode_column_table(descs)
        header = pack_header(
            num_records=n, num_fields=len(self.fields), schema_size=len(self.schema),
            index_size=len(index_bytes), payload_size=payload, schema_checksum=self.schema_checksum,
            index_checksum=self._checksum(index_bytes), version=self.version, columns_size=len(table),
            columns_checksum=self._checksum(table) if self.version == 3 else 0,
        )
        data = b"".join([header, self.schema, table, index_bytes, *self._blobs, *column_data])
        name = f"{self.prefix}{len(self.shards):06d}.pyl"
        self.store.put(name, [data])
        # The manifest's whole-file checksum is XXH64 whatever the shard version.
        self.shards.append({"path": name, "records": n, "bytes": len(data),
                            "xxh64": f"{_C.xxh64(data):016x}"})
        self.bytes_out += len(data)
        self._clear()

    def _clear(self) -> None:
        self._blobs.clear()  # in place: _append holds aliases of both lists
        self._entries.clear()
        for parts in self._columns:
            parts.clear()
        self._payload = 0
        self._records_in_shard = 0

    def close(self) -> list[dict[str, Any]]:
        """Publishes the last shard; returns the manifest entries of every shard."""
        self.flush()
        return self.shards

    def abort(self) -> None:
        """Deletes every shard published so far and drops the one in progress."""
        self.store.remove([s["path"] for s in self.shards])
        self.shards = []
        self._clear()


def replace_token(root: str, *, overwrite: bool, hint: str,
                  store: DatasetStore | None = None) -> tuple[str, list[str]]:
    """(token, old shard paths) for a new dataset at ``root`` (NOTE [overwrite]).

    No dataset there: ``("", [])``. One there: a FileExistsError naming ``hint`` unless
    ``overwrite``, else a fresh token (8 hex digits and ``-``) for the new shard names and
    the old manifest's shard paths (none if that manifest is unreadable: then nothing of
    the old dataset is removed). ``store`` is where the dataset lives (default: the folder).
    """
    store = store if store is not None else LocalStore(root)
    try:
        data = store.get(MANIFEST_NAME)
    except FetchError:
        raise  # a destination that cannot be reached (no credentials, no connection) holds nothing we know of
    except OSError:
        data = b""  # there but unreadable: a dataset whose shards cannot be named
    if data is None:
        return "", []
    if not overwrite:
        raise FileExistsError(f"{root!r} already holds a dataset ({hint})")
    try:
        old = [s["path"] for s in parse_manifest(data, f"{store.location}/{MANIFEST_NAME}", _C.xxh64)["shards"]]
    except (OSError, ValueError):
        old = []
    return f"{uuid.uuid4().hex[:8]}-", old


def publish_manifest(root: str, fields: Sequence[Field], shards: list[dict[str, Any]],
                     replaced: Iterable[str] = (), store: DatasetStore | None = None) -> dict[str, Any]:
    """Writes the manifest of the finished dataset at ``root`` (or into ``store``); returns its body.

    The manifest is published atomically (NOTE [atomic publish]); then the ``replaced``
    shards it no longer lists are deleted (NOTE [overwrite]).
    """
    store = store if store is not None else LocalStore(root)
    body = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "fields": [f.to_json() for f in fields],
        "records": sum(int(s["records"]) for s in shards),
        "shards": shards,
    }
    store.put(MANIFEST_NAME, [dump_manifest(body, _C.xxh64)])
    kept = {s["path"] for s in shards}
    try:
        store.remove([old for old in replaced if old not in kept])
    except OSError:  # the new dataset is complete; a leftover old shard harms no reader
        pass
    return body


__all__ = ["MIN_GAIN", "atomic_write", "remove_shards", "DatasetStore", "LocalStore", "ColumnBytes", "ShardEncoder",
           "replace_token", "publish_manifest"]
