"""ShardWriter: validates samples and writes them into shard files (format version 3 or 2) and the dataset manifest.

The bytes are laid out by ``pyloader.format.encode.ShardEncoder``, as for ``pyloader convert``.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import numpy as np

from ..errors import SchemaError
from ..format.encode import MIN_GAIN, ShardEncoder, publish_manifest, replace_token
from ..format.spec import VERSION, Field, make_fields

_COMPRESSIONS = ("lz4", "none")


def _writable_dir(path: str | os.PathLike[str]) -> str:
    """The local folder a writer may create: a path or a ``file://`` URL; other URLs raise ValueError."""
    s = os.fspath(path)
    if s.startswith("file://"):
        return s[len("file://"):]
    if "://" in s:
        raise ValueError(
            f"{s!r}: ShardWriter writes to a local folder only, not to a remote URL. Write the dataset "
            "to a local folder, upload that folder (shards and manifest.json) as is, e.g. with "
            "`aws s3 cp --recursive` or fsspec's put(recursive=True), then read the URL with "
            "pyloader.ShardDataset(url); pyloader.convert(src, url) writes to a URL directly")
    return s


def _make_dirs(path: str) -> list[str]:
    """``os.makedirs(path)``; returns the folders it created, outermost first (none if ``path`` existed)."""
    created: list[str] = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        created.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    os.makedirs(path, exist_ok=True)
    return created[::-1]


def _remove_created(dirs: list[str]) -> None:
    """Removes the folders a writer created (``_make_dirs``), innermost first, while they are empty.

    A folder that holds anything (a file someone else put there) stays, with those above it.
    """
    for d in reversed(dirs):
        try:
            os.rmdir(d)
        except OSError:
            return


def _unclosed(path: str, encoder: ShardEncoder, pid: int, created: list[str] | None = None) -> None:
    """NOTE [unclosed writer]: a ShardWriter dropped without close() publishes nothing.

    Its records are not written as a dataset: a writer abandoned half way (an exception
    outside a ``with`` block, a forgotten ``close()``) must not leave something that reads
    as complete. So at garbage collection or interpreter exit the shards it already wrote
    are removed (no manifest lists them) and a RuntimeWarning names the folder and the
    records lost. RuntimeWarning, not ResourceWarning: Python hides ResourceWarning by
    default, and lost data must be seen. Only the process that created the writer acts.
    """
    if os.getpid() != pid:
        return
    n, on_disk = encoder.records, len(encoder.shards)
    encoder.abort()
    _remove_created(created or [])
    warnings.warn(
        f"ShardWriter({path!r}) was never closed: its {n} records were not published "
        f"({on_disk} shard files removed, no manifest written). Call close() or use `with ShardWriter(...)`.",
        RuntimeWarning, stacklevel=2)


class ShardWriter:
    """Writes a dataset of shards plus ``manifest.json`` into directory ``path``.

    ``fields`` maps a name to ``(dtype, shape)``: dtype is a name (``"uint8"``,
    ``"bfloat16"``, ``"bytes"``...), a numpy dtype or a torch dtype; shape is a tuple whose
    leading entry may be ``None`` for a variable length. The dtype ``"jpeg"``, ``"png"`` or
    ``"image"`` (any image format) makes a bytes field annotated with that encoding in the
    manifest (NOTE [field encoding] in pyloader/format/spec.py), e.g.
    ``fields={"image": "jpeg", "label": "int64"}``: its values are the encoded files as
    bytes, bytearray, memoryview or a 1-D uint8 array, stored exactly as a bytes field. They
    are not decoded or checked at write time (writing stays a copy): a value that is not a
    valid image of that format is written as given and fails only when a reader decodes it.
    ``compression`` is ``"lz4"`` or
    ``"none"`` (None means ``"none"``), or a dict per field; a record is stored raw whenever
    LZ4 does not save at least ``min_gain`` of its size. Shards roll over once their payload
    reaches ``shard_bytes``. ``path`` is a local folder (or ``file://`` URL): to publish to
    object storage, write locally and upload the folder.

    ``version`` is the newest shard format version written. With 3 (the default), fixed
    fields of at most 256 bytes per record (ids, labels, a few floats) are stored as
    columns without per-value index entries, raw whatever ``compression`` says (NOTE
    [column layout] in pyloader/format/spec.py); a dataset with no such field is written
    as version 2, as before. ``version=2`` writes the version 2 layout always (e.g. for
    readers older than version 3).

    The manifest is written on a clean ``close()``; until then the dataset does not exist.
    If the ``with`` block raises, the shards written so far are removed and no manifest is
    written, and so are the folders the writer created (a schema error at the first
    ``write()`` leaves nothing behind; a folder that existed, or holds other files, stays).
    ``compression`` is checked before anything is created. A writer garbage-collected (or alive at interpreter exit) without ``close()``
    publishes nothing either: it removes its shards and emits a RuntimeWarning naming the
    folder and the records lost (NOTE [unclosed writer]).
    """

    def __init__(self, path: str | os.PathLike[str], fields: Mapping[str, Any], *,
                 compression: str | Mapping[str, str | None] | None = "lz4", shard_bytes: int = 64 << 20,
                 min_gain: float = MIN_GAIN, overwrite: bool = False, version: int = VERSION) -> None:
        self._closed = True  # until constructed: nothing to close
        self._dir = _writable_dir(path)
        self.fields: list[Field] = make_fields(fields)
        if isinstance(compression, str) and compression not in _COMPRESSIONS:
            raise ValueError(f"compression must be one of {_COMPRESSIONS} or None (or a dict of them per field), "
                             f"got {compression!r}")
        if compression is None or isinstance(compression, str):
            compression = {f.name: compression for f in self.fields}
        elif not isinstance(compression, Mapping):
            raise ValueError(f"compression must be one of {_COMPRESSIONS}, None or a dict per field, "
                             f"got {type(compression).__name__}")
        self._codec: list[bool] = []
        for f in self.fields:
            c = compression.get(f.name, "none")
            c = "none" if c is None else c
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
        if version not in (2, 3) or isinstance(version, bool):
            raise ValueError(f"version must be 2 or 3 (the shard format versions written), got {version!r}")
        self._created = _make_dirs(self._dir)  # removed again by abort() while empty
        try:
            # NOTE [overwrite] (pyloader/format/encode.py): new shards get a fresh token; the old
            # ones are deleted only once the new manifest is in place.
            token, self._replaced = replace_token(self._dir, overwrite=overwrite,
                                                  hint="pass overwrite=True to replace it")
            self._encoder = ShardEncoder(self._dir, self.fields, self._codec, shard_bytes=shard_bytes,
                                         prefix=f"shard-{token}", min_gain=min_gain, version=version)
        except BaseException:
            _remove_created(self._created)
            raise
        self._closed = False
        self._finalizer = weakref.finalize(self, _unclosed, self._dir, self._encoder, os.getpid(), self._created)

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
        if arr.dtype.kind == "O" and target.kind in "iu":
            self._check_big_ints(f, arr, where)
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

    @staticmethod
    def _check_big_ints(f: Field, arr: np.ndarray, where: str) -> None:
        """Python ints beyond 64 bits make numpy fall back to objects: name the value out of range."""
        flat = arr.reshape(-1)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            return
        info = np.iinfo(f.np_dtype)
        for v in flat:
            if not info.min <= v <= info.max:
                raise SchemaError(f"{where}: value {v} is out of range for {f.dtype} "
                                  f"([{info.min}, {info.max}])")

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
        n = self._encoder.records
        if not isinstance(sample, Mapping):
            raise SchemaError(f"sample {n}: expected a mapping of field -> value, got {type(sample).__name__}")
        extra = set(sample) - {f.name for f in self.fields}
        if extra:
            raise SchemaError(f"sample {n}: unknown fields {sorted(extra)}")
        values = []
        for f in self.fields:
            if f.name not in sample:
                raise SchemaError(f"sample {n}: missing field {f.name!r}")
            arr = self._to_array(f, sample[f.name], n)
            leading = self._check_shape(f, arr, n)
            values.append((np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data, leading))
        self._encoder.append_record(values)  # only a sample valid in every field is appended

    def close(self) -> None:
        """Flushes the last shard and writes the manifest. Idempotent."""
        if self._closed:
            return
        self._finalizer.detach()  # See NOTE [unclosed writer]: a failed close warns through its exception
        shards = self._encoder.close()
        publish_manifest(self._dir, self.fields, shards, self._replaced)  # NOTE [overwrite]
        self._closed = True

    def abort(self) -> None:
        """Discards everything this writer wrote (shards and no manifest), and the folders it created while empty."""
        if not self._closed:
            self._finalizer.detach()
            self._encoder.abort()
            _remove_created(self._created)
        self._closed = True

    @property
    def records_written(self) -> int:
        """Samples accepted so far, including those of the shard not yet published."""
        return self._encoder.records

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


__all__ = ["ShardWriter"]
