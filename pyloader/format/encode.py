"""Shard encoding: validated byte values -> shard files (format version 2) and the dataset manifest.

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

from .. import _C
from .spec import (
    CODEC_LZ4,
    CODEC_RAW,
    INDEX_DTYPE,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    VERSION,
    Field,
    dump_manifest,
    encode_schema,
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

    ``store`` publishes them (default: ``LocalStore(root)``; a convert to a URL passes
    its own). A value is stored LZ4 when its field's ``compress`` flag is set and LZ4
    saves at least ``min_gain`` of its size, raw otherwise. A shard is published (NOTE [atomic publish])
    once its payload reaches ``shard_bytes``, and by ``close()``. ``shards`` lists the
    manifest entries of the shards published so far, in order.
    """

    def __init__(self, root: str, fields: Sequence[Field], compress: Sequence[bool], *, shard_bytes: int,
                 prefix: str, min_gain: float = MIN_GAIN, store: DatasetStore | None = None) -> None:
        if len(compress) != len(fields):
            raise ValueError(f"compress has {len(compress)} flags for {len(fields)} fields")
        self.root, self.prefix = root, prefix
        self.store: DatasetStore = store if store is not None else LocalStore(root)
        self.fields = list(fields)
        self.compress = [bool(c) for c in compress]
        self.shard_bytes = shard_bytes
        self.min_gain = min_gain
        self.schema = encode_schema(self.fields)
        self._checksum = shard_checksum(VERSION)  # of headers, schemas, indexes and values
        self.schema_checksum = self._checksum(self.schema)
        self.shards: list[dict[str, Any]] = []
        self.records = 0  # records appended, published or not
        self.bytes_out = 0  # bytes of the published shard files
        self._blobs: list[Any] = []
        self._entries: list[tuple[int, int, int, int, int, int]] = []
        self._payload = 0
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
        cols = [(c.data, c.offsets, c.lengths, c.row_bytes, comp)
                for c, comp in zip(columns, self.compress, strict=True)]
        for r in range(n):
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
            self._records_in_shard += 1
            self.records += 1
            if self._payload >= self.shard_bytes:
                self.flush()

    def flush(self) -> None:
        """Publishes the shard in progress, if it holds any record."""
        if self._records_in_shard == 0:
            return
        index = np.zeros(len(self._entries), dtype=INDEX_DTYPE)
        cols = np.array(self._entries, dtype=np.uint64).reshape(-1, len(_INDEX_COLUMNS))
        for k, name in enumerate(_INDEX_COLUMNS):
            index[name] = cols[:, k]
        index_bytes = index.tobytes()
        header = pack_header(
            num_records=self._records_in_shard, num_fields=len(self.fields), schema_size=len(self.schema),
            index_size=len(index_bytes), payload_size=self._payload, schema_checksum=self.schema_checksum,
            index_checksum=self._checksum(index_bytes),
        )
        data = b"".join([header, self.schema, index_bytes, *self._blobs])
        name = f"{self.prefix}{len(self.shards):06d}.pyl"
        self.store.put(name, [data])
        # The manifest's whole-file checksum is XXH64 whatever the shard version.
        self.shards.append({"path": name, "records": self._records_in_shard, "bytes": len(data),
                            "xxh64": f"{_C.xxh64(data):016x}"})
        self.bytes_out += len(data)
        self._blobs.clear()  # in place: _append holds aliases of both lists
        self._entries.clear()
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
        self._blobs.clear()
        self._entries.clear()
        self._payload = 0
        self._records_in_shard = 0


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
