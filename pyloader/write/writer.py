"""ShardWriter: writes samples into shard files (format v1) and the dataset manifest."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

import lz4.block
import numpy as np

from .. import _C
from ..errors import SchemaError
from ..format.spec import (
    CODEC_LZ4,
    CODEC_RAW,
    INDEX_DTYPE,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    VERSION,
    Field,
    dump_manifest,
    encode_schema,
    make_fields,
    pack_header,
    parse_manifest,
)

_COMPRESSIONS = ("lz4", "none")


def _xxh64(b: Any) -> int:
    return _C.xxh64(b)


def _atomic_write(path: str, chunks: list[Any]) -> None:
    """Writes to a unique temp file, fsyncs, then renames: readers never see a partial file.

    The temp name ends in ``.part`` and carries the writer's pid, which is how the node
    cache recognises (and later removes) the leftovers of a dead writer."""
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


class ShardWriter:
    """Writes a dataset of shards plus ``manifest.json`` into directory ``path``.

    ``fields`` maps a name to ``(dtype, shape)``: dtype is a name (``"uint8"``,
    ``"bfloat16"``, ``"bytes"``...), a numpy dtype or a torch dtype; shape is a tuple whose
    leading entry may be ``None`` for a variable length. ``compression`` is ``"lz4"`` or
    ``"none"``, or a dict per field; a record is stored raw whenever LZ4 does not save at
    least ``min_gain`` of its size. Shards roll over once their payload reaches
    ``shard_bytes``. The manifest is written on a clean ``close()``; if the ``with`` block
    raises, the shards written so far are removed and no manifest is written.
    """

    def __init__(self, path: str | os.PathLike[str], fields: Mapping[str, Any], *,
                 compression: str | Mapping[str, str] = "lz4", shard_bytes: int = 64 << 20,
                 min_gain: float = 0.1, overwrite: bool = False) -> None:
        self._dir = os.fspath(path)
        self.fields: list[Field] = make_fields(fields)
        if isinstance(compression, str):
            compression = {f.name: compression for f in self.fields}
        self._codec: list[bool] = []
        for f in self.fields:
            c = compression.get(f.name, "none")
            if c not in _COMPRESSIONS:
                raise ValueError(f"compression for field {f.name!r} must be one of {_COMPRESSIONS}, got {c!r}")
            self._codec.append(c == "lz4")
        unknown = set(compression) - {f.name for f in self.fields}
        if unknown:
            raise ValueError(f"compression names unknown fields: {sorted(unknown)}")
        if not isinstance(shard_bytes, int) or shard_bytes < 1:
            raise ValueError("shard_bytes must be a positive int")
        if not 0.0 <= min_gain < 1.0:
            raise ValueError("min_gain must be in [0, 1)")
        self._shard_bytes = shard_bytes
        self._min_gain = min_gain
        os.makedirs(self._dir, exist_ok=True)
        mpath = os.path.join(self._dir, MANIFEST_NAME)
        if os.path.exists(mpath) and not overwrite:
            raise FileExistsError(f"{self._dir!r} already holds a dataset (pass overwrite=True to replace it)")
        # NOTE [overwrite]: a replacement dataset writes its shards under new names, so the
        # old dataset stays whole until the new manifest replaces the old one atomically;
        # only then are the old shards deleted. A failed rewrite leaves the old dataset.
        self._prefix = "shard-"
        self._replaced: list[str] = []
        if os.path.exists(mpath):
            self._prefix = f"shard-{uuid.uuid4().hex[:8]}-"
            try:
                with open(mpath, "rb") as fh:
                    old = parse_manifest(fh.read(), mpath, _xxh64)
                self._replaced = [sh["path"] for sh in old["shards"]]
            except (OSError, ValueError):
                self._replaced = []  # an unreadable old manifest: nothing of it is kept or removed
        self._schema = encode_schema(self.fields)
        self._schema_xxh = _xxh64(self._schema)
        self._shards: list[dict[str, Any]] = []
        self._blobs: list[Any] = []
        self._entries: list[tuple[int, int, int, int, int, int]] = []
        self._payload = 0
        self._records_in_shard = 0
        self._count = 0
        self._closed = False

    # -- sample validation -------------------------------------------------------------
    def _to_array(self, f: Field, value: Any, sample_no: int) -> np.ndarray:
        where = f"sample {sample_no} field {f.name!r}"
        if f.dtype == "bytes":
            if isinstance(value, (bytes, bytearray, memoryview)):
                return np.frombuffer(bytes(value), dtype=np.uint8)
            arr = np.asarray(value)
            if arr.dtype != np.uint8 or arr.ndim != 1:
                raise SchemaError(f"{where}: expected bytes, got {type(value).__name__}")
            return arr
        if type(value).__module__.startswith("torch"):
            import torch

            if not isinstance(value, torch.Tensor):
                raise SchemaError(f"{where}: expected an array, got {type(value).__name__}")
            t = value.detach().cpu()
            if t.dtype == torch.bfloat16:
                if f.dtype != "bfloat16":
                    raise SchemaError(f"{where}: expected dtype {f.dtype}, got bfloat16")
                return t.contiguous().view(torch.int16).numpy().view("<u2")
            value = t.numpy()
        if f.dtype == "bfloat16":
            arr = np.asarray(value)
            if arr.dtype == np.uint16:
                return arr  # already raw bfloat16 bits
            if arr.dtype.kind not in "fiub":
                raise SchemaError(f"{where}: cannot store {arr.dtype} as bfloat16")
            import torch

            t = torch.from_numpy(np.array(arr, dtype=np.float32, order="C")).to(torch.bfloat16)
            return t.view(torch.int16).numpy().view("<u2")
        target = f.np_dtype
        if isinstance(value, np.ndarray):
            if value.dtype != target and not np.can_cast(value.dtype, target, casting="same_kind"):
                if not (value.dtype.kind in "iub" and target.kind in "iub"):
                    raise SchemaError(f"{where}: expected dtype {f.dtype}, got {value.dtype}")
            if value.dtype.kind == "f" and target.kind in "iub":
                raise SchemaError(f"{where}: expected dtype {f.dtype}, got {value.dtype}")
            self._check_range(f, value, where)
            return value.astype(target, copy=False)
        try:
            arr = np.asarray(value)
        except Exception as e:  # noqa: BLE001 - any conversion failure is a schema error
            raise SchemaError(f"{where}: cannot convert {type(value).__name__} to an array: {e}") from None
        if arr.dtype.kind not in "biuf":
            raise SchemaError(f"{where}: expected {f.dtype} data, got {type(value).__name__}")
        if arr.dtype.kind == "f" and target.kind in "iub":
            raise SchemaError(f"{where}: expected dtype {f.dtype}, got floating-point values")
        self._check_range(f, arr, where)
        return arr.astype(target)

    @staticmethod
    def _check_range(f: Field, arr: np.ndarray, where: str) -> None:
        """Integer and bool values must fit the field's dtype exactly (no silent wrapping)."""
        target = f.np_dtype
        if arr.size == 0 or arr.dtype == target or arr.dtype.kind not in "iub":
            return
        if target.kind == "b":
            if arr.dtype.kind != "b" and not np.isin(arr, (0, 1)).all():
                raise SchemaError(f"{where}: a bool field takes only True/False or 0/1")
            return
        if target.kind in "iu":
            info = np.iinfo(target)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise SchemaError(f"{where}: value out of range for {f.dtype} ([{lo}, {hi}])")

    def _check_shape(self, f: Field, arr: np.ndarray, sample_no: int) -> int:
        where = f"sample {sample_no} field {f.name!r}"
        if f.variable:
            if arr.ndim != len(f.shape) or tuple(arr.shape[1:]) != f.shape[1:]:
                raise SchemaError(f"{where}: expected shape {f.shape}, got {tuple(arr.shape)}")
            if arr.shape[0] > 2**32 - 1:
                raise SchemaError(f"{where}: leading dimension too long")
            return int(arr.shape[0])
        if tuple(arr.shape) != f.shape:
            raise SchemaError(f"{where}: expected shape {f.shape}, got {tuple(arr.shape)}")
        return 0

    # -- writing -----------------------------------------------------------------------
    def write(self, sample: Mapping[str, Any]) -> None:
        """Validates one sample (a mapping with exactly the schema's fields) and appends it."""
        if self._closed:
            raise ValueError("ShardWriter is closed")
        n = self._count
        if not isinstance(sample, Mapping):
            raise SchemaError(f"sample {n}: expected a mapping of field -> value, got {type(sample).__name__}")
        extra = set(sample) - {f.name for f in self.fields}
        if extra:
            raise SchemaError(f"sample {n}: unknown fields {sorted(extra)}")
        staged = []
        for f, compress in zip(self.fields, self._codec):
            if f.name not in sample:
                raise SchemaError(f"sample {n}: missing field {f.name!r}")
            arr = self._to_array(f, sample[f.name], n)
            leading = self._check_shape(f, arr, n)
            raw = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
            stored, codec = raw, CODEC_RAW
            if compress and len(raw) > 0:
                comp = lz4.block.compress(raw, store_size=False)
                if len(comp) <= (1.0 - self._min_gain) * len(raw):
                    stored, codec = memoryview(comp), CODEC_LZ4
            staged.append((stored, len(raw), leading, codec))
        for stored, decoded, leading, codec in staged:
            self._entries.append((self._payload, len(stored), decoded, leading, codec, _xxh64(stored)))
            self._blobs.append(bytes(stored) if codec == CODEC_RAW else stored)
            self._payload += len(stored)
        self._records_in_shard += 1
        self._count += 1
        if self._payload >= self._shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if self._records_in_shard == 0:
            return
        index = np.zeros(len(self._entries), dtype=INDEX_DTYPE)
        if self._entries:
            cols = list(zip(*self._entries))
            for name, col in zip(("offset", "stored", "decoded", "leading", "codec", "xxh64"), cols):
                index[name] = np.asarray(col, dtype=np.uint64)
        index_bytes = index.tobytes()
        header = pack_header(
            num_records=self._records_in_shard, num_fields=len(self.fields), schema_size=len(self._schema),
            index_size=len(index_bytes), payload_size=self._payload, schema_xxh64=self._schema_xxh,
            index_xxh64=_xxh64(index_bytes), xxh64=_xxh64,
        )
        name = f"{self._prefix}{len(self._shards):06d}.pyl"
        data = b"".join([header, self._schema, index_bytes, *self._blobs])
        file_hash = _xxh64(data)
        _atomic_write(os.path.join(self._dir, name), [data])
        size = len(data)
        self._shards.append({"path": name, "records": self._records_in_shard, "bytes": size,
                             "xxh64": f"{file_hash:016x}"})
        self._blobs, self._entries = [], []
        self._payload = 0
        self._records_in_shard = 0

    def close(self) -> None:
        """Flushes the last shard and writes the manifest. Idempotent."""
        if self._closed:
            return
        self._flush()
        body = {
            "format": MANIFEST_FORMAT,
            "version": VERSION,
            "fields": [f.to_json() for f in self.fields],
            "records": self._count,
            "shards": self._shards,
        }
        _atomic_write(os.path.join(self._dir, MANIFEST_NAME), [dump_manifest(body, _xxh64)])
        self._closed = True
        kept = {sh["path"] for sh in self._shards}
        for old in self._replaced:  # NOTE [overwrite]: the new manifest is in place
            if old not in kept:
                try:
                    os.unlink(os.path.join(self._dir, old))
                except OSError:
                    pass

    def abort(self) -> None:
        """Discards everything this writer wrote (shards and no manifest)."""
        self._closed = True
        for s in self._shards:
            try:
                os.unlink(os.path.join(self._dir, s["path"]))
            except FileNotFoundError:
                pass
        self._shards, self._blobs, self._entries = [], [], []

    @property
    def records_written(self) -> int:
        return self._count

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
