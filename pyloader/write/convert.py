"""``pyloader convert``: Parquet/Arrow, numpy, folders of files and WebDataset tars to shards.

A *source* (``open_source``) knows its pyloader schema up front and is cut into
*units* (a Parquet row group, an Arrow record batch, a range of numpy rows, a range of
files, one tar) whose record counts are known (tars: counted by a header scan). A unit
reads as *chunks*: ``n`` records of every field held column by column, so per-record
Python work is only the per-value checksum and compression.

NOTE [parallel convert]: ``jobs`` worker processes (forkserver, else spawn) each convert a
contiguous range of units into their own shards, named ``shard-[<token>-]<job>-<n>.pyl``
so no two jobs collide; the parent concatenates their shard lists in job order, so
the dataset's record order is the source order, and writes one manifest. A job that
fails stops the others; every shard written so far is removed and no manifest is
written. With ``overwrite=True`` new shards get a fresh token, the old dataset stays
whole until the new manifest replaces it, and only then are old shards removed
(the ShardWriter's NOTE [overwrite]).

NOTE [exactness]: a converted value is the source value's bytes, unchanged: no casts
except the ones the caller asks for with ``fields={name: dtype}`` (checked by pyarrow
with ``safe=True``, so out-of-range or lossy casts fail), and strings become their
UTF-8 bytes. ``verify`` re-reads the source and compares every record byte for byte
with what the native reader returns.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import re
import sys
import tarfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lz4.block
import numpy as np

from .. import _C
from ..errors import ConvertError, PyloaderError, SchemaError, VerifyError
from ..format.spec import (
    INDEX_DTYPE,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MAX_FIELD_BYTES,
    VERSION,
    Field,
    dump_manifest,
    encode_schema,
    make_field,
    pack_header,
    parse_manifest,
)
from .writer import _atomic_write

KINDS = ("parquet", "arrow", "numpy", "files", "tar")
COMPRESSIONS = ("auto", "lz4", "none")
NULL_POLICIES = ("error", "zero")
SIDECAR_NAME = "convert.json"
_MIN_GAIN = 0.1  # a value is stored LZ4 only when that saves >= 10% (as ShardWriter)
_CHUNK_BYTES = 16 << 20  # target decoded bytes per chunk (bounds a job's memory with shard_size)
_AUTO_SAMPLE_VALUES = 256
_AUTO_SAMPLE_BYTES = 8 << 20
_PARQUET_EXT = (".parquet", ".pq", ".parq")
_ARROW_EXT = (".arrow", ".feather", ".ipc", ".arrows")
_TAR_EXT = (".tar", ".tar.gz", ".tgz")
_IDENT_BAD = re.compile(r"[^A-Za-z0-9_]")


# ---------------------------------------------------------------------------------------
# Chunks: n records of every field, column by column.
@dataclass
class VarColumn:
    """A variable field's values: record r is ``data[offsets[r]:offsets[r+1]]`` (bytes) with
    ``lengths[r]`` leading rows. Offsets index ``data`` directly, so slicing copies nothing."""

    data: np.ndarray  # uint8, 1-D
    offsets: np.ndarray  # int64, n + 1 byte offsets into data
    lengths: np.ndarray  # int64, n

    def slice(self, a: int, b: int) -> VarColumn:
        return VarColumn(self.data, self.offsets[a : b + 1], self.lengths[a:b])


def var_from_bytes(values: Sequence[bytes]) -> VarColumn:
    lens = np.fromiter((len(v) for v in values), np.int64, len(values))
    offs = np.zeros(len(values) + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    data = np.frombuffer(b"".join(values), np.uint8) if values else np.zeros(0, np.uint8)
    return VarColumn(data, offs, lens)


@dataclass
class Chunk:
    n: int
    columns: list[Any]  # per field: ndarray [n, *shape] (fixed) or VarColumn
    row0: int = -1  # global source row of the first record, -1 if unknown

    def slice(self, a: int, b: int) -> Chunk:
        cols = [c.slice(a, b) if isinstance(c, VarColumn) else c[a:b] for c in self.columns]
        return Chunk(b - a, cols, self.row0 + a if self.row0 >= 0 else -1)

    def nbytes(self) -> int:
        return sum(int(c.offsets[-1] - c.offsets[0]) if isinstance(c, VarColumn) else c.nbytes for c in self.columns)


def _ident(name: str) -> str:
    """A field name for a source column or extension: invalid characters become '_'."""
    s = _IDENT_BAD.sub("_", name)
    if not s or s[0].isdigit():
        s = "_" + s
    return s[:128]


def _unique_fields(pairs: list[tuple[str, Field]], what: str) -> None:
    seen: dict[str, str] = {}
    for src, f in pairs:
        if f.name in seen:
            raise ConvertError(f"{what} {seen[f.name]!r} and {src!r} both map to field name {f.name!r}")
        seen[f.name] = src
        if f.variable:
            seen.setdefault(f"{f.name}_lengths", src)
    for src, f in pairs:  # a variable field's batch key "<name>_lengths" must stay free
        if f.variable and any(g.name == f"{f.name}_lengths" for _, g in pairs):
            raise ConvertError(f"{what} {src!r}: field {f.name}_lengths collides with its lengths tensor")


# ---------------------------------------------------------------------------------------
# Sources.
class Source:
    """A convertible source: fields, units with record counts, and ``read(unit)``."""

    kind = ""
    fields: list[Field]
    columns: list[str]  # source name of each field (column, extension, array key)
    units: list[Any]
    unit_records: list[int]
    unit_bytes: list[int]  # estimated bytes read per unit (for balancing and progress)

    def read(self, unit_index: int, row0: int = -1) -> Iterator[Chunk]:
        """Unit ``unit_index`` as chunks; ``row0`` is its first global row (for error messages)."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "columns": dict(zip((f.name for f in self.fields), self.columns))}

    @property
    def num_records(self) -> int:
        return int(sum(self.unit_records))

    def unit_row0(self) -> list[int]:
        out, acc = [], 0
        for n in self.unit_records:
            out.append(acc)
            acc += n
        return out

    def __getstate__(self) -> dict[str, Any]:
        s = self.__dict__.copy()
        s.pop("_open", None)  # file handles are per process
        return s


def _parse_field_spec(fields: Any) -> tuple[list[str] | None, dict[str, str]]:
    """``fields``: None, a list of names, or {name: dtype or None}. -> (names, casts)."""
    if fields is None:
        return None, {}
    if isinstance(fields, str):
        fields = [fields]
    if isinstance(fields, Mapping):
        names = list(fields)
        casts = {k: v for k, v in fields.items() if v is not None}
    else:
        names, casts = list(fields), {}
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError("fields must name at least one column")
    if len(set(names)) != len(names):
        raise ValueError(f"fields names a column twice: {names}")
    norm = {}
    for k, v in casts.items():
        try:
            f = make_field("x", (v, ()))
        except SchemaError as e:
            raise ValueError(f"fields: {k!r}: {e}") from None
        norm[k] = f.dtype
    return names, norm


# -- Arrow (Parquet and IPC) --------------------------------------------------------------
def _pa() -> Any:
    try:
        import pyarrow
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("Parquet and Arrow sources need pyarrow: pip install 'pyloader[parquet]'") from None
    return pyarrow


def _arrow_leaf_dtype(t: Any) -> str | None:
    pa = _pa()
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return str(np.dtype(t.to_pandas_dtype()).name)
    return None


def _is_bytes_type(t: Any) -> bool:
    pa = _pa()
    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t)
                or pa.types.is_large_string(t) or pa.types.is_fixed_size_binary(t)
                or pa.types.is_binary_view(t) or pa.types.is_string_view(t))


def _fixed_shape(col: str, t: Any) -> tuple[str, tuple[int, ...]]:
    """(dtype, shape) of a fixed-size Arrow type: a numeric leaf or nested fixed-size lists."""
    pa = _pa()
    if isinstance(t, pa.BaseExtensionType):
        if hasattr(t, "shape") and hasattr(t, "value_type"):  # arrow.fixed_shape_tensor
            leaf = _arrow_leaf_dtype(t.value_type)
            if leaf is not None and not getattr(t, "permutation", None):
                return leaf, tuple(int(d) for d in t.shape)
        raise ConvertError(f"column {col!r} has type {t}, which has no pyloader field")
    leaf = _arrow_leaf_dtype(t)
    if leaf is not None:
        return leaf, ()
    if pa.types.is_fixed_size_list(t):
        dt, inner = _fixed_shape(col, t.value_type)
        return dt, (int(t.list_size), *inner)
    raise ConvertError(
        f"column {col!r} has type {t}, which has no pyloader field: supported are booleans, integers, floats, "
        "binary/string (-> bytes), fixed-size lists and fixed_shape_tensor of those (-> fixed shape), and one "
        "level of list of those (-> variable length); cast the column or leave it out with fields=")


def arrow_field(col: str, t: Any, cast: str | None = None) -> Field:
    """The pyloader Field a column of Arrow type ``t`` converts to (ConvertError if none)."""
    pa = _pa()
    if pa.types.is_dictionary(t):
        t = t.value_type
    if _is_bytes_type(t):
        dt, shape = "bytes", (None,)
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t) \
            or pa.types.is_large_list_view(t):
        vt = t.value_type
        if pa.types.is_list(vt) or pa.types.is_large_list(vt) or _is_bytes_type(vt):
            raise ConvertError(f"column {col!r} has type {t}: a list of variable-length values has no pyloader "
                               "field (only the leading dimension may vary)")
        dt, inner = _fixed_shape(col, vt)
        shape = (None, *inner)  # type: ignore[assignment]
    else:
        dt, shape = _fixed_shape(col, t)  # type: ignore[assignment]
    if cast is not None:
        if dt == "bytes" and cast != "bytes":
            raise ConvertError(f"column {col!r} holds {t}; it cannot be cast to {cast} (it converts to bytes)")
        dt = cast
    try:
        return make_field(_ident(col), (dt, shape))
    except SchemaError as e:
        raise ConvertError(f"column {col!r}: {e}") from None


def _with_leaf(t: Any, leaf: Any) -> Any:
    pa = _pa()
    if pa.types.is_fixed_size_list(t):
        return pa.list_(_with_leaf(t.value_type, leaf), t.list_size)
    if pa.types.is_list(t) or pa.types.is_list_view(t):
        return pa.list_(_with_leaf(t.value_type, leaf))
    if pa.types.is_large_list(t) or pa.types.is_large_list_view(t):
        return pa.large_list(_with_leaf(t.value_type, leaf))
    return leaf


_ARROW_LEAF = {"bool": "bool_", "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
               "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64", "float16": "float16",
               "float32": "float32", "float64": "float64"}


def _first_null_row(arr: Any) -> int:
    valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False))
    return int(np.flatnonzero(~valid)[0])


def arrow_to_column(arr: Any, f: Field, col: str, where: str, row0: int, nulls: str, cast: str | None = None) -> Any:
    """One Arrow array -> an ndarray [n, *shape] or a VarColumn (zero-copy where possible)."""
    pa = _pa()
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if isinstance(arr.type, pa.BaseExtensionType):
        arr = arr.storage
    if cast is not None and f.dtype != "bytes":
        if cast == "bfloat16":
            raise ConvertError(f"{where}: column {col!r}: Arrow has no bfloat16; convert to float32 instead")
        target = _with_leaf(arr.type, getattr(pa, _ARROW_LEAF[cast])())
        if target != arr.type:
            try:
                arr = arr.cast(target, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise ConvertError(f"{where}: column {col!r} of type {arr.type} cannot be cast to {cast}: {e}") from None
    n = len(arr)
    null_rows = None
    if arr.null_count:
        if nulls == "error":
            r = _first_null_row(arr)
            raise ConvertError(f"{where}: column {col!r} is null at row {row0 + r if row0 >= 0 else r} "
                               "(pass nulls='zero' to store zeros / empty values instead)")
        t = arr.type
        if pa.types.is_fixed_size_binary(t):
            arr = arr.fill_null(pa.scalar(b"\0" * t.byte_width, t))
        elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
            arr = arr.fill_null(pa.scalar("", t))
        elif f.dtype == "bytes":
            arr = arr.fill_null(pa.scalar(b"", t))
        elif f.variable:
            arr = arr.fill_null(pa.scalar([], t))
        elif pa.types.is_fixed_size_list(t):
            null_rows = ~np.asarray(arr.is_valid().to_numpy(zero_copy_only=False))  # zeroed below
        else:
            arr = arr.fill_null(pa.scalar(False if f.dtype == "bool" else 0, t))
    if f.dtype == "bytes":
        t = arr.type
        if pa.types.is_fixed_size_binary(t):
            w = t.byte_width
            data = np.frombuffer(arr.buffers()[1], np.uint8) if n else np.zeros(0, np.uint8)
            offs = (np.arange(n + 1, dtype=np.int64) + arr.offset) * w
            return VarColumn(data, offs, np.full(n, w, np.int64))
        if not (pa.types.is_large_binary(t) or pa.types.is_binary(t)):
            arr = arr.cast(pa.large_binary() if (pa.types.is_large_string(t) or pa.types.is_string_view(t)
                                                 or pa.types.is_binary_view(t)) else pa.binary())
        bufs = arr.buffers()
        odt = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
        offs = np.frombuffer(bufs[1], odt)[arr.offset : arr.offset + n + 1].astype(np.int64) if n else \
            np.zeros(1, np.int64)
        data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        return VarColumn(data, offs, np.diff(offs))
    if f.variable:
        if pa.types.is_list_view(arr.type) or pa.types.is_large_list_view(arr.type):
            arr = arr.cast(pa.large_list(arr.type.value_type))
        offs = arr.offsets.to_numpy().astype(np.int64)
        values = _leaf_numpy(arr.values, f, col, where, nulls, row_of=lambda i: int(
            np.searchsorted(offs, i, side="right") - 1))
        rb = f.row_bytes
        data = values.reshape(-1).view(np.uint8)
        return VarColumn(data, offs * rb, np.diff(offs))
    values = _leaf_numpy(arr, f, col, where, "zero" if null_rows is not None else nulls, row_of=None)
    values = values.reshape((n, *f.shape))
    if null_rows is not None:
        values = values.copy()
        values[null_rows] = 0
    return values


def _leaf_numpy(arr: Any, f: Field, col: str, where: str, nulls: str, row_of: Callable[[int], int] | None) -> np.ndarray:
    """The leaf values below fixed-size lists as a flat ndarray; nulls inside are errors or zeros."""
    pa = _pa()
    if isinstance(arr.type, pa.BaseExtensionType):
        arr = arr.storage
    while pa.types.is_fixed_size_list(arr.type):
        if arr.null_count and nulls == "error":
            raise ConvertError(f"{where}: column {col!r} holds a null list element")
        arr = arr.flatten()
    if arr.null_count:
        if nulls == "error":
            i = _first_null_row(arr)
            at = f" in row {row_of(i)}" if row_of is not None else ""
            raise ConvertError(f"{where}: column {col!r} holds a null element{at} "
                               "(pass nulls='zero' to store zeros instead)")
        arr = arr.fill_null(pa.scalar(0, arr.type) if f.dtype != "bool" else False)
    out = arr.to_numpy(zero_copy_only=False)
    if out.dtype != f.np_dtype:
        out = out.astype(f.np_dtype)  # bool/float16 representations only; casts were checked above
    return out


class ArrowSource(Source):
    """Parquet files (``kind="parquet"``, unit = row group) or Arrow IPC files (unit = record batch)."""

    def __init__(self, paths: list[str], kind: str, fields: Any, nulls: str) -> None:
        pa = _pa()
        self.kind, self.paths, self.nulls = kind, paths, nulls
        names, self.casts = _parse_field_spec(fields)
        self._open: dict[int, Any] = {}
        schema0 = None
        self.units, self.unit_records, self.unit_bytes = [], [], []
        self.unit_file_row0: list[int] = []  # first row of each unit within its file (for errors)
        for i, p in enumerate(paths):
            schema, counts, sizes = self._inspect(i, p)
            if names is None:
                names = [schema.names[j] for j in range(len(schema.names))]
            cols = []
            for c in names:
                if c not in schema.names:
                    raise ConvertError(f"{p}: has no column {c!r} (columns: {', '.join(schema.names)})")
                cols.append((c, arrow_field(c, schema.field(c).type, self.casts.get(c))))
            if schema0 is None:
                schema0 = cols
                _unique_fields(cols, "column")
            elif [f for _, f in cols] != [f for _, f in schema0]:
                for (c, f), (_, g) in zip(cols, schema0):
                    if f != g:
                        raise ConvertError(f"{p}: column {c!r} converts to {f.dtype}{list(f.shape)} but in "
                                           f"{paths[0]} to {g.dtype}{list(g.shape)}: every file needs the same schema")
            r = 0
            for j, (nr, nb) in enumerate(zip(counts, sizes)):
                self.unit_file_row0.append(r)
                r += int(nr)
                self.units.append((i, j))
                self.unit_records.append(int(nr))
                self.unit_bytes.append(int(nb))
        assert schema0 is not None and names is not None
        self.columns = names
        self.fields = [f for _, f in schema0]
        del pa

    def _inspect(self, i: int, p: str) -> tuple[Any, list[int], list[int]]:
        pa = _pa()
        try:
            if self.kind == "parquet":
                import pyarrow.parquet as pq

                pf = pq.ParquetFile(p, memory_map=True)
                md = pf.metadata
                counts = [md.row_group(j).num_rows for j in range(md.num_row_groups)]
                sizes = [md.row_group(j).total_byte_size for j in range(md.num_row_groups)]
                self._open[i] = pf
                return pf.schema_arrow, counts, sizes
            reader = self._open_ipc(p)
            counts, sizes = [], []
            for j in range(reader.num_record_batches):
                b = reader.get_batch(j)
                counts.append(b.num_rows)
                sizes.append(b.nbytes)
            self._open[i] = reader
            return reader.schema, counts, sizes
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise ConvertError(f"{p}: not a readable {'Parquet' if self.kind == 'parquet' else 'Arrow IPC'} "
                               f"file: {e}") from None

    @staticmethod
    def _open_ipc(p: str) -> Any:
        pa = _pa()
        src = pa.memory_map(p, "r")
        try:
            return pa.ipc.open_file(src)
        except pa.ArrowInvalid:
            # The IPC stream format has no footer: read it whole into a table of batches.
            table = pa.ipc.open_stream(pa.memory_map(p, "r")).read_all()
            return _BatchList(table.schema, table.to_batches())

    def _file(self, i: int) -> Any:
        f = self._open.get(i) if hasattr(self, "_open") else None
        if f is None:
            if not hasattr(self, "_open"):
                self._open = {}
            self._inspect(i, self.paths[i])
            f = self._open[i]
        return f

    def read(self, unit_index: int, row0: int = -1) -> Iterator[Chunk]:
        pa = _pa()
        i, j = self.units[unit_index]
        p = self.paths[i]
        where = f"{p}: row group {j}" if self.kind == "parquet" else f"{p}: record batch {j}"
        try:
            f = self._file(i)
            if self.kind == "parquet":
                nb = max(1, self.unit_bytes[unit_index] // max(1, self.unit_records[unit_index]))
                rows = max(1024, min(1 << 20, _CHUNK_BYTES // nb))
                batches: Any = f.iter_batches(batch_size=rows, row_groups=[j], columns=self.columns,
                                              use_threads=False)
            else:
                batches = [f.get_batch(j).select(self.columns)]
            r, fr = row0, self.unit_file_row0[unit_index]  # global row, row within the file
            for b in batches:
                cols = [arrow_to_column(b.column(k), fl, c, where, fr, self.nulls, self.casts.get(c))
                        for k, (c, fl) in enumerate(zip(self.columns, self.fields))]
                yield Chunk(b.num_rows, cols, r)
                fr += b.num_rows
                if r >= 0:
                    r += b.num_rows
        except (pa.ArrowInvalid, pa.ArrowIOError) as e:
            raise ConvertError(f"{where}: cannot be read: {e}") from None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "paths": self.paths}


class _BatchList:
    def __init__(self, schema: Any, batches: list[Any]) -> None:
        self.schema, self._b = schema, batches
        self.num_record_batches = len(batches)

    def get_batch(self, j: int) -> Any:
        return self._b[j]


# -- numpy ---------------------------------------------------------------------------------
class NumpySource(Source):
    """A dict of arrays (first axis = records) or of ``.npy`` paths (memory-mapped), or an ``.npz``."""

    kind = "numpy"

    def __init__(self, arrays: Mapping[str, Any], fields: Any, nulls: str) -> None:
        names, casts = _parse_field_spec(fields)
        if casts:
            raise ValueError("fields= may only select arrays of a numpy source, not cast them")
        self.paths: dict[str, str] = {}
        arrs: dict[str, np.ndarray] = {}
        for k, v in arrays.items():
            if isinstance(v, (str, os.PathLike)):
                self.paths[k] = os.fspath(v)
                try:
                    arrs[k] = np.load(self.paths[k], mmap_mode="r", allow_pickle=False)
                except (ValueError, OSError) as e:
                    if isinstance(e, FileNotFoundError):
                        raise
                    raise ConvertError(f"{self.paths[k]}: not a readable .npy file: {e}") from None
            else:
                arrs[k] = np.asarray(v)
        if names is not None:
            missing = [n for n in names if n not in arrs]
            if missing:
                raise ConvertError(f"numpy source has no array {missing[0]!r} (arrays: {', '.join(arrs)})")
            arrs = {n: arrs[n] for n in names}
        if not arrs:
            raise ConvertError("numpy source holds no arrays")
        n = None
        pairs = []
        for k, a in arrs.items():
            if a.ndim == 0:
                raise ConvertError(f"array {k!r} is 0-dimensional; the first axis must number the records")
            if n is None:
                n = a.shape[0]
            elif a.shape[0] != n:
                raise ConvertError(f"array {k!r} has {a.shape[0]} records, others {n}")
            if a.dtype.kind in "SU":
                if a.ndim != 1:
                    raise ConvertError(f"array {k!r}: a string array must be 1-D")
                spec: Any = ("bytes", ())
            elif a.dtype.kind in "biuf" and a.dtype.name in ("bool", "uint8", "uint16", "uint32", "uint64", "int8",
                                                             "int16", "int32", "int64", "float16", "float32",
                                                             "float64"):
                spec = (a.dtype.name, a.shape[1:])
            else:
                raise ConvertError(f"array {k!r} has dtype {a.dtype}, which has no pyloader field")
            try:
                pairs.append((k, make_field(_ident(k), spec)))
            except SchemaError as e:
                raise ConvertError(f"array {k!r}: {e}") from None
        _unique_fields(pairs, "array")
        self.columns = list(arrs)
        self.fields = [f for _, f in pairs]
        self._arrays = arrs
        self.nulls = nulls
        assert n is not None
        row_bytes = sum(max(1, a.dtype.itemsize * int(np.prod(a.shape[1:]))) for a in arrs.values())
        step = max(1, _CHUNK_BYTES // row_bytes)
        self.units = [(a, min(a + step, n)) for a in range(0, n, step)]
        self.unit_records = [b - a for a, b in self.units]
        self.unit_bytes = [(b - a) * row_bytes for a, b in self.units]

    def __getstate__(self) -> dict[str, Any]:
        s = super().__getstate__()
        # Arrays loaded from paths are re-mapped in the worker instead of pickled.
        s["_arrays"] = {k: (None if k in self.paths else v) for k, v in self._arrays.items()}
        return s

    def __setstate__(self, s: dict[str, Any]) -> None:
        self.__dict__.update(s)
        for k, p in self.paths.items():
            if k in self._arrays:
                self._arrays[k] = np.load(p, mmap_mode="r", allow_pickle=False)

    def read(self, unit_index: int, row0: int = -1) -> Iterator[Chunk]:
        a, b = self.units[unit_index]
        cols: list[Any] = []
        for k, f in zip(self.columns, self.fields):
            x = self._arrays[k][a:b]
            if f.dtype == "bytes":
                if x.dtype.kind == "U":
                    cols.append(var_from_bytes([str(s).encode("utf-8") for s in x]))
                else:
                    cols.append(var_from_bytes([bytes(s) for s in x]))
            else:
                cols.append(np.ascontiguousarray(x))
        yield Chunk(b - a, cols, a)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "paths": self.paths or None}


# -- a folder of files ---------------------------------------------------------------------
class FilesSource(Source):
    """Every file under a folder (sorted by relative path) as a record: ``data`` (bytes),
    ``path`` (the relative path, UTF-8 bytes, '/'-separated) and with ``labels=True`` a
    ``label`` (int64): the index of the file's top-level folder among the sorted folder names."""

    kind = "files"

    def __init__(self, root: str, fields: Any, labels: bool, files_per_unit: int = 1024) -> None:
        names, casts = _parse_field_spec(fields)
        if casts:
            raise ValueError("fields= may only select fields of a files source (data, path, label)")
        self.root = root
        rels: list[str] = []
        sizes: list[int] = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames.sort()
            for fn in sorted(filenames):
                full = os.path.join(dirpath, fn)
                if not os.path.isfile(full):
                    continue
                rels.append(os.path.relpath(full, root).replace(os.sep, "/"))
                sizes.append(os.path.getsize(full))
        order = sorted(range(len(rels)), key=lambda i: rels[i])  # one global order, not per-walk
        self.rels = [rels[i] for i in order]
        sizes = [sizes[i] for i in order]
        self.classes: list[str] = []
        self.labels: list[int] = []
        if labels:
            top = []
            for r in self.rels:
                if "/" not in r:
                    raise ConvertError(f"{os.path.join(root, r)}: with labels every file must be inside a class "
                                       "folder (root/<class>/...)")
                top.append(r.split("/", 1)[0])
            self.classes = sorted(set(top))
            idx = {c: i for i, c in enumerate(self.classes)}
            self.labels = [idx[t] for t in top]
        all_fields = {"data": ("bytes", ()), "path": ("bytes", ())}
        if labels:
            all_fields["label"] = ("int64", ())
        chosen = names or list(all_fields)
        for n in chosen:
            if n not in all_fields:
                raise ConvertError(f"a files source has fields {', '.join(all_fields)}; not {n!r}")
        self.columns = chosen
        self.fields = [make_field(n, all_fields[n]) for n in chosen]
        self.units, self.unit_records, self.unit_bytes = [], [], []
        a = 0
        while a < len(self.rels):
            b, nb = a, 0
            while b < len(self.rels) and (b == a or (b - a < files_per_unit and nb < _CHUNK_BYTES)):
                nb += sizes[b]
                b += 1
            self.units.append((a, b))
            self.unit_records.append(b - a)
            self.unit_bytes.append(nb)
            a = b

    def read(self, unit_index: int, row0: int = -1) -> Iterator[Chunk]:
        a, b = self.units[unit_index]
        cols: list[Any] = []
        for name in self.columns:
            if name == "data":
                blobs = []
                for r in self.rels[a:b]:
                    with open(os.path.join(self.root, r), "rb") as fh:
                        blobs.append(fh.read())
                cols.append(var_from_bytes(blobs))
            elif name == "path":
                cols.append(var_from_bytes([r.encode("utf-8") for r in self.rels[a:b]]))
            else:
                cols.append(np.asarray(self.labels[a:b], np.int64))
        yield Chunk(b - a, cols, a)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "root": self.root, "classes": self.classes or None}


# -- WebDataset tars -------------------------------------------------------------------------
_KEY_FIELD = "__key__"


def _split_member(name: str) -> tuple[str, str] | None:
    """WebDataset naming: key = path up to the first '.' of the basename, extension = the rest."""
    d, _, base = name.rpartition("/")
    if "." not in base or base.startswith("."):
        return None
    stem, ext = base.split(".", 1)
    return (f"{d}/{stem}" if d else stem), ext


def _tar_samples(path: str) -> Iterator[tuple[str, dict[str, tarfile.TarInfo], tarfile.TarFile]]:
    """(key, {extension: member}) of each sample, in tar order; members of a sample are consecutive."""
    try:
        tf = tarfile.open(path, "r:*")  # noqa: SIM115 - closed by the with below
    except (tarfile.TarError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ConvertError(f"{path}: not a readable tar file: {e}") from None
    with tf:
        seen: set[str] = set()
        key: str | None = None
        members: dict[str, tarfile.TarInfo] = {}
        try:
            for m in tf:
                if not m.isfile():
                    continue
                ke = _split_member(m.name)
                if ke is None:
                    raise ConvertError(f"{path}: member {m.name!r} has no extension: WebDataset members are "
                                       "named <key>.<extension>")
                k, ext = ke
                if k != key:
                    if key is not None:
                        yield key, members, tf
                    if k in seen:
                        raise ConvertError(f"{path}: the members of sample {k!r} are not consecutive")
                    seen.add(k)
                    key, members = k, {}
                if ext in members:
                    raise ConvertError(f"{path}: sample {k!r} holds two members with extension {ext!r}")
                members[ext] = m
        except (tarfile.TarError, EOFError) as e:
            raise ConvertError(f"{path}: the tar is damaged: {e}") from None
        # tarfile takes a cut header for the end of the archive: an uncompressed tar must
        # still hold the two zero blocks that end it after the last member.
        if tf.fileobj is not None and not path.lower().endswith((".gz", ".tgz")) and \
                os.path.getsize(path) < tf.offset + 1024:
            raise ConvertError(f"{path}: the tar ends inside a member or header (truncated?)")
        if key is not None:
            yield key, members, tf


class TarSource(Source):
    """WebDataset-style tars: one record per sample key, a bytes field per extension, plus ``__key__``."""

    kind = "tar"

    def __init__(self, paths: list[str], fields: Any, nulls: str) -> None:
        names, casts = _parse_field_spec(fields)
        if casts:
            raise ValueError("fields= may only select extensions of a tar source, not cast them")
        self.paths, self.nulls = paths, nulls
        exts: dict[str, None] = {}
        self.units, self.unit_records, self.unit_bytes = [], [], []
        for i, p in enumerate(paths):  # a header scan: counts samples and collects extensions
            n = 0
            for _, members, _ in _tar_samples(p):
                n += 1
                for e in members:
                    exts.setdefault(e)
            self.units.append(i)
            self.unit_records.append(n)
            self.unit_bytes.append(os.path.getsize(p))
        ordered = sorted(exts)
        if names is not None:
            for n_ in names:
                if n_ not in ordered and n_ != _KEY_FIELD:
                    raise ConvertError(f"no tar member has extension {n_!r} (extensions: {', '.join(ordered)})")
            ordered = [n_ for n_ in names]
        else:
            ordered = [_KEY_FIELD, *ordered]
        pairs = [(e, make_field(e if e == _KEY_FIELD else _ident(e), ("bytes", ()))) for e in ordered]
        _unique_fields(pairs, "extension")
        self.columns = ordered
        self.fields = [f for _, f in pairs]

    def read(self, unit_index: int, row0: int = -1) -> Iterator[Chunk]:
        p = self.paths[self.units[unit_index]]
        want = [e for e in self.columns if e != _KEY_FIELD]
        buf: dict[str, list[bytes]] = {e: [] for e in self.columns}
        nb, n, r = 0, 0, row0
        for key, members, tf in _tar_samples(p):
            buf.setdefault(_KEY_FIELD, []).append(key.encode("utf-8"))
            for e in want:
                m = members.get(e)
                if m is None:
                    if self.nulls == "error":
                        raise ConvertError(f"{p}: sample {key!r} has no member with extension {e!r} "
                                           "(pass nulls='zero' to store an empty value instead)")
                    buf[e].append(b"")
                    continue
                fh = tf.extractfile(m)
                data = fh.read() if fh is not None else b""
                if len(data) != m.size:
                    raise ConvertError(f"{p}: member {m.name!r} is truncated ({len(data)} of {m.size} bytes)")
                buf[e].append(data)
                nb += len(data)
            n += 1
            if nb >= _CHUNK_BYTES:
                yield self._chunk(buf, n, r)
                r = r + n if r >= 0 else -1
                buf, nb, n = {e: [] for e in self.columns}, 0, 0
        if n != self.unit_records[unit_index]:
            raise ConvertError(f"{p}: holds {n} samples now, {self.unit_records[unit_index]} when scanned")
        if n:
            yield self._chunk(buf, n, r)

    def _chunk(self, buf: dict[str, list[bytes]], n: int, r: int) -> Chunk:
        return Chunk(n, [var_from_bytes(buf.get(e, [])) for e in self.columns], r)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "paths": self.paths}


# -- dispatch ---------------------------------------------------------------------------------
def _list_files(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "_")))
        out.extend(os.path.join(dirpath, f) for f in filenames if not f.startswith((".", "_")))
    return sorted(out)


def _kind_of(path: str) -> str | None:
    p = path.lower()
    if p.endswith(_PARQUET_EXT):
        return "parquet"
    if p.endswith(_ARROW_EXT):
        return "arrow"
    if p.endswith((".npy", ".npz")):
        return "numpy"
    if p.endswith(_TAR_EXT):
        return "tar"
    return None


def open_source(src: Any, *, kind: str | None = None, fields: Any = None, nulls: str = "error",
                labels: bool = False) -> Source:
    """The Source for ``src``: a path (file or folder), a list of files, or a dict of arrays.

    ``kind`` (``"parquet"``, ``"arrow"``, ``"numpy"``, ``"files"``, ``"tar"``) overrides the
    guess: a file by its extension; a folder is Parquet, Arrow, tar or numpy when every
    (non-hidden) file in it is of that kind, else a folder of files.
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if nulls not in NULL_POLICIES:
        raise ValueError(f"nulls must be one of {NULL_POLICIES}, got {nulls!r}")
    if isinstance(src, Mapping):
        if kind not in (None, "numpy"):
            raise ValueError("a dict source is a numpy source")
        return NumpySource(src, fields, nulls)
    if isinstance(src, (list, tuple)):
        paths = [os.fspath(p) for p in src]
        if not paths:
            raise ConvertError("the source lists no files")
    else:
        s = os.fspath(src)
        if "://" in s:
            raise ConvertError(f"{s!r}: convert reads local files; copy the data first (or read Parquet directly "
                               "with pyloader.ParquetDataset, which fetches through the node cache)")
        if not os.path.exists(s):
            raise FileNotFoundError(f"no such file or folder: {s!r}")
        if os.path.isdir(s):
            if kind == "files" or (kind is None and not _list_files(s)):
                return FilesSource(s, fields, labels)
            paths = _list_files(s)
            kinds = {_kind_of(p) for p in paths}
            if kind is None:
                kind = kinds.pop() if len(kinds) == 1 and None not in kinds else "files"
            if kind == "files":
                return FilesSource(s, fields, labels)
            paths = [p for p in paths if _kind_of(p) == kind] if kind != "numpy" else \
                [p for p in paths if p.endswith(".npy")]
            if not paths:
                raise ConvertError(f"{s}: holds no {kind} files")
        else:
            paths = [s]
    if kind is None:
        kinds = {_kind_of(p) for p in paths}
        if len(kinds) != 1 or None in kinds:
            raise ConvertError(f"cannot tell the kind of {paths[0]!r}; pass kind= (one of {', '.join(KINDS)})")
        kind = kinds.pop()
    if labels and kind != "files":
        raise ValueError("labels= applies to a folder of files only")
    if kind in ("parquet", "arrow"):
        return ArrowSource(paths, kind, fields, nulls)
    if kind == "tar":
        return TarSource(paths, fields, nulls)
    if kind == "numpy":
        if len(paths) == 1 and paths[0].endswith(".npz"):
            with np.load(paths[0], allow_pickle=False) as z:
                return NumpySource({k: z[k] for k in z.files}, fields, nulls)
        return NumpySource({os.path.basename(p)[: -len(".npy")]: p for p in paths}, fields, nulls)
    raise ConvertError(f"kind {kind!r} takes a folder, not {paths[0]!r}")


# ---------------------------------------------------------------------------------------
# Writing: columns -> shard files (format v1, docs/format.md).
class ShardSink:
    """Writes chunks into shards named ``<prefix><n>.pyl``; values go LZ4 only where that pays."""

    def __init__(self, root: str, fields: list[Field], compress: list[bool], shard_bytes: int, prefix: str) -> None:
        self.root, self.fields, self.compress = root, fields, compress
        self.shard_bytes, self.prefix = shard_bytes, prefix
        self.schema = encode_schema(fields)
        self.schema_xxh = _C.xxh64(self.schema)
        self.shards: list[dict[str, Any]] = []
        self._blobs: list[Any] = []
        self._entries: list[tuple[int, int, int, int, int, int]] = []
        self._payload = 0
        self._records = 0
        self.records = 0
        self.bytes_out = 0

    def write(self, chunk: Chunk) -> None:
        views: list[tuple[memoryview, list[int] | None, list[int] | None, int, bool]] = []
        for f, c, comp in zip(self.fields, chunk.columns, self.compress):
            if isinstance(c, VarColumn):
                data = np.ascontiguousarray(c.data)
                lens = c.lengths.tolist()
                offs = c.offsets.tolist()
                big = np.flatnonzero(np.diff(c.offsets) > MAX_FIELD_BYTES)
                if big.size:
                    raise ConvertError(f"record {chunk.row0 + int(big[0])} field {f.name!r}: a value is over 4 GiB")
                views.append((memoryview(data).cast("B") if data.size else memoryview(b""), offs, lens, 0, comp))
            else:
                a = np.ascontiguousarray(c)
                if a.dtype != f.np_dtype or a.shape[1:] != f.shape or a.shape[0] != chunk.n:
                    raise ConvertError(f"field {f.name!r}: chunk holds {a.dtype}{list(a.shape)}, "
                                       f"expected {f.dtype}{[chunk.n, *f.shape]}")
                views.append((memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b""),
                              None, None, f.row_bytes, comp))
        compress, xxh = lz4.block.compress, _C.xxh64
        entries, blobs = self._entries, self._blobs
        keep = 1.0 - _MIN_GAIN
        for r in range(chunk.n):
            for mv, offs, lens, rb, comp in views:
                if offs is None:
                    v = mv[r * rb : (r + 1) * rb]
                    leading = 0
                else:
                    v = mv[offs[r] : offs[r + 1]]
                    leading = lens[r]  # type: ignore[index]
                size = len(v)
                stored, codec = v, 0
                if comp and size:
                    z = compress(v, store_size=False)
                    if len(z) <= keep * size:
                        stored, codec = z, 1
                entries.append((self._payload, len(stored), size, leading, codec, xxh(stored)))
                blobs.append(stored)
                self._payload += len(stored)
            self._records += 1
            if self._payload >= self.shard_bytes:
                self._flush()
        self.records += chunk.n

    def _flush(self) -> None:
        if self._records == 0:
            return
        index = np.zeros(len(self._entries), dtype=INDEX_DTYPE)
        cols = np.array(self._entries, dtype=np.uint64).reshape(-1, 6)
        for k, name in enumerate(("offset", "stored", "decoded", "leading", "codec", "xxh64")):
            index[name] = cols[:, k]
        ib = index.tobytes()
        header = pack_header(num_records=self._records, num_fields=len(self.fields), schema_size=len(self.schema),
                             index_size=len(ib), payload_size=self._payload, schema_xxh64=self.schema_xxh,
                             index_xxh64=_C.xxh64(ib), xxh64=_C.xxh64)
        data = b"".join([header, self.schema, ib, *self._blobs])
        name = f"{self.prefix}{len(self.shards):06d}.pyl"
        _atomic_write(os.path.join(self.root, name), [data])
        self.shards.append({"path": name, "records": self._records, "bytes": len(data),
                            "xxh64": f"{_C.xxh64(data):016x}"})
        self.bytes_out += len(data)
        self._blobs.clear()  # in place: write() holds aliases of both lists
        self._entries.clear()
        self._payload, self._records = 0, 0

    def close(self) -> list[dict[str, Any]]:
        self._flush()
        return self.shards

    def abort(self) -> None:
        _remove(self.root, [s["path"] for s in self.shards])
        self.shards = []


def _remove(root: str, names: Sequence[str]) -> None:
    for n in names:
        try:
            os.unlink(os.path.join(root, n))
        except FileNotFoundError:
            pass


def _sample_values(c: Any, k: int) -> list[memoryview]:
    if isinstance(c, VarColumn):
        return [memoryview(np.ascontiguousarray(c.data[c.offsets[r] : c.offsets[r + 1]]))
                for r in range(min(k, len(c.lengths)))]
    a = np.ascontiguousarray(c[:k])
    return [memoryview(a[r].reshape(-1).view(np.uint8)) for r in range(a.shape[0])]


def choose_compression(source: Source, compression: str | Mapping[str, str]) -> dict[str, str]:
    """Per field "lz4" or "none". ``"auto"`` compresses a sample of each field from the
    start of the source and keeps the field raw unless LZ4 saves at least 10% of it."""
    if isinstance(compression, Mapping):
        out = {}
        for f in source.fields:
            c = compression.get(f.name, "none")
            if c not in ("lz4", "none"):
                raise ValueError(f"compression for {f.name!r} must be 'lz4' or 'none', got {c!r}")
            out[f.name] = c
        unknown = set(compression) - set(out)
        if unknown:
            raise ValueError(f"compression names unknown fields: {sorted(unknown)}")
        return out
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if compression != "auto":
        return {f.name: compression for f in source.fields}
    raw = [0] * len(source.fields)
    packed = [0] * len(source.fields)
    seen = 0
    row0 = source.unit_row0()
    for u in range(len(source.units)):
        for chunk in source.read(u, row0[u]):
            k = min(chunk.n, _AUTO_SAMPLE_VALUES - seen)
            for j, c in enumerate(chunk.columns):
                for v in _sample_values(c, k):
                    if raw[j] >= _AUTO_SAMPLE_BYTES or not len(v):
                        continue
                    z = lz4.block.compress(v, store_size=False)
                    raw[j] += len(v)
                    packed[j] += min(len(z), len(v))
            seen += k
            if seen >= _AUTO_SAMPLE_VALUES:
                break
        if seen >= _AUTO_SAMPLE_VALUES:
            break
    return {f.name: "lz4" if raw[j] and packed[j] <= (1 - _MIN_GAIN) * raw[j] else "none"
            for j, f in enumerate(source.fields)}


def parse_size(s: str | int) -> int:
    """``"64M"``, ``"1G"``, ``"512K"`` or an int -> bytes."""
    if isinstance(s, int) and not isinstance(s, bool):
        v = s
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(s), re.IGNORECASE)
        if not m:
            raise ValueError(f"invalid size {s!r}; use e.g. 64M, 1G or a number of bytes")
        v = int(float(m.group(1)) * (1 << (10 * " KMGT".index(m.group(2).upper() or " "))))
    if v < 1:
        raise ValueError(f"size must be positive, got {s!r}")
    return v


# ---------------------------------------------------------------------------------------
# Jobs (NOTE [parallel convert]).
def _split_units(weights: list[int], jobs: int) -> list[tuple[int, int]]:
    """``jobs`` contiguous, non-empty unit ranges of near-equal total weight."""
    n = len(weights)
    jobs = max(1, min(jobs, n))
    if n == 0:
        return [(0, 0)]
    cum = np.cumsum(np.maximum(np.asarray(weights, np.float64), 1.0))
    total = cum[-1]
    bounds = [0]
    for k in range(1, jobs):
        b = int(np.searchsorted(cum, total * k / jobs, side="left")) + 1
        b = max(b, bounds[-1] + 1)
        b = min(b, n - (jobs - k))
        bounds.append(b)
    bounds.append(n)
    return [(bounds[k], bounds[k + 1]) for k in range(jobs)]


def _run_job(source: Source, root: str, compress: list[bool], shard_bytes: int, prefix: str,
             lo: int, hi: int, report: Callable[[int, int], None] | None,
             stop: Any = None) -> dict[str, Any]:
    sink = ShardSink(root, source.fields, compress, shard_bytes, prefix)
    row0 = source.unit_row0()
    try:
        for u in range(lo, hi):
            for chunk in source.read(u, row0[u]):
                if stop is not None and stop.is_set():
                    sink.abort()
                    return {"shards": [], "records": 0, "stopped": True}
                sink.write(chunk)
                if report is not None:
                    report(chunk.n, chunk.nbytes())
        shards = sink.close()
    except BaseException:
        sink.abort()
        raise
    return {"shards": shards, "records": sink.records, "stopped": False}


_WORKER: dict[str, Any] = {}


def _worker_init(progress_q: Any, stop: Any) -> None:
    _WORKER["q"], _WORKER["stop"] = progress_q, stop


def _worker_main(job: int, source: Source, root: str, compress: list[bool], shard_bytes: int, prefix: str,
                 lo: int, hi: int) -> dict[str, Any]:
    q, stop = _WORKER.get("q"), _WORKER.get("stop")

    def report(n: int, nb: int) -> None:
        if q is not None:
            q.put((job, n, nb))

    try:
        return _run_job(source, root, compress, shard_bytes, prefix, lo, hi, report, stop)
    except BaseException:
        if stop is not None:
            stop.set()  # the others stop at their next chunk
        raise


class Progress:
    """Prints ``records, MB read, MB/s, ETA`` to stderr at most twice a second."""

    def __init__(self, total: int, total_bytes: int, enabled: bool | Callable[[dict[str, Any]], None]) -> None:
        self.total, self.total_bytes = total, total_bytes
        self.callback = enabled if callable(enabled) else None
        self.enabled = bool(enabled)
        self.records = 0
        self.bytes = 0
        self.start = time.perf_counter()
        self._last = 0.0
        self._tty = sys.stderr.isatty()
        self._mu = threading.Lock()

    def add(self, n: int, nb: int) -> None:
        with self._mu:
            self.records += n
            self.bytes += nb
        self.show()

    def show(self, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not final and now - self._last < 0.5:
            return
        self._last = now
        dt = max(now - self.start, 1e-9)
        info = {"records": self.records, "total": self.total, "bytes": self.bytes, "seconds": dt,
                "mb_per_s": self.bytes / dt / 1e6}
        if self.callback is not None:
            self.callback(info)
            return
        pct = f" ({100 * self.records / self.total:.1f}%)" if self.total else ""
        eta = ""
        if self.records and self.total and not final:
            eta = f", ETA {dt * (self.total - self.records) / self.records:.0f}s"
        line = (f"converted {self.records:,}/{self.total:,} records{pct}, {self.bytes / 1e6:.1f} MB, "
                f"{info['mb_per_s']:.1f} MB/s{eta}")
        end = "\n" if final or not self._tty else ""
        print(("\r" if self._tty else "") + line, end=end, file=sys.stderr, flush=True)


@dataclass
class ConvertResult:
    path: str
    records: int
    shards: int
    bytes_in: int  # decoded bytes of the converted values
    bytes_out: int  # bytes of the shard files
    seconds: float
    jobs: int
    fields: list[dict[str, Any]]
    compression: dict[str, str]
    verified: dict[str, Any] | None = field(default=None)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_in / self.seconds / 1e6 if self.seconds > 0 else 0.0


def convert(src: Any, dst: str | os.PathLike[str], *, kind: str | None = None, fields: Any = None,
            compression: str | Mapping[str, str] = "auto", shard_size: int | str = "64M", jobs: int = 1,
            nulls: str = "error", labels: bool = False, overwrite: bool = False,
            progress: bool | Callable[[dict[str, Any]], None] = False, verify: bool = False) -> ConvertResult:
    """Converts ``src`` into a pyloader dataset at ``dst`` (shards + manifest.json).

    Args:
        src: a Parquet file or folder of Parquet files, an Arrow IPC file, a ``.npy``/``.npz``
            file, a folder of ``.npy`` files, a dict of arrays or ``.npy`` paths, a folder of
            files, or WebDataset ``.tar`` shards (a file, a folder or a list); see ``open_source``.
        fields: which columns (arrays, extensions) to convert, in order: a list of names,
            or ``{name: dtype or None}`` to also cast Parquet/Arrow columns (checked: a
            lossy or out-of-range cast fails).
        compression: ``"auto"`` (LZ4 only for fields where it saves >= 10% on a sample),
            ``"lz4"``, ``"none"``, or ``{field: "lz4" | "none"}``.
        shard_size: payload bytes per shard before it rolls over (``"64M"``, ``1 << 26``).
        jobs: worker processes, each converting a contiguous part of the source
            (NOTE [parallel convert]); the record order is the source order.
        nulls: ``"error"`` (a null raises ConvertError naming the column and row) or
            ``"zero"`` (a null becomes zeros, an empty list or empty bytes; a tar sample
            missing a member gets an empty value).
        labels: for a folder of files, add ``label`` from the top-level folder name.
        overwrite: replace an existing dataset at ``dst`` (atomically, via the manifest).
        progress: ``True`` prints progress to stderr; a callable receives progress dicts.
        verify: after converting, compare every record with its source (``verify()``).
    """
    t0 = time.perf_counter()
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError("jobs must be a positive int")
    shard_bytes = parse_size(shard_size)
    source = src if isinstance(src, Source) else open_source(src, kind=kind, fields=fields, nulls=nulls,
                                                             labels=labels)
    comp = choose_compression(source, compression)
    root = os.fspath(dst)
    os.makedirs(root, exist_ok=True)
    mpath = os.path.join(root, MANIFEST_NAME)
    old: list[str] = []
    token = ""
    if os.path.exists(mpath):
        if not overwrite:
            raise FileExistsError(f"{root!r} already holds a dataset (pass overwrite=True / --overwrite)")
        token = uuid.uuid4().hex[:8] + "-"
        try:
            with open(mpath, "rb") as fh:
                old = [s["path"] for s in parse_manifest(fh.read(), mpath, _C.xxh64)["shards"]]
        except (OSError, ValueError):
            old = []
    compress = [comp[f.name] == "lz4" for f in source.fields]
    ranges = _split_units(source.unit_bytes, jobs)
    prog = Progress(source.num_records, int(sum(source.unit_bytes)), progress)
    results: list[dict[str, Any]] = []
    try:
        if len(ranges) == 1:
            lo, hi = ranges[0]
            results.append(_run_job(source, root, compress, shard_bytes, f"shard-{token}00000-", lo, hi, prog.add))
        else:
            results = _run_parallel(source, root, compress, shard_bytes, token, ranges, prog)
    except BaseException:
        for r in results:
            _remove(root, [s["path"] for s in r["shards"]])
        raise
    prog.show(final=True)
    shards = [s for r in results for s in r["shards"]]
    records = sum(r["records"] for r in results)
    body = {"format": MANIFEST_FORMAT, "version": VERSION, "fields": [f.to_json() for f in source.fields],
            "records": records, "shards": shards}
    _atomic_write(mpath, [dump_manifest(body, _C.xxh64)])
    kept = {s["path"] for s in shards}
    _remove(root, [p for p in old if p not in kept])  # NOTE [parallel convert]: manifest replaced first
    sidecar = {"source": source.describe(), "compression": comp, "nulls": getattr(source, "nulls", nulls),
               "jobs": len(ranges), "shard_size": shard_bytes}
    _atomic_write(os.path.join(root, SIDECAR_NAME), [json.dumps(sidecar, indent=1).encode() + b"\n"])
    res = ConvertResult(root, records, len(shards), prog.bytes, sum(s["bytes"] for s in shards),
                        time.perf_counter() - t0, len(ranges), body["fields"], comp)  # type: ignore[arg-type]
    if verify:
        res.verified = verify_dataset(source, root)
    return res


def _run_parallel(source: Source, root: str, compress: list[bool], shard_bytes: int, token: str,
                  ranges: list[tuple[int, int]], prog: Progress) -> list[dict[str, Any]]:
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

    # forkserver: torch and pyarrow are imported once, in the server, instead of once per job
    # (seconds each); workers fork from that clean, thread-free process. spawn elsewhere.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["pyloader.write.convert"])
    else:
        ctx = mp.get_context("spawn")
    q = ctx.Queue()
    stop = ctx.Event()
    done: list[dict[str, Any] | None] = [None] * len(ranges)
    with ProcessPoolExecutor(max_workers=len(ranges), mp_context=ctx, initializer=_worker_init,
                             initargs=(q, stop)) as ex:
        futs = [ex.submit(_worker_main, k, source, root, compress, shard_bytes, f"shard-{token}{k:05d}-", lo, hi)
                for k, (lo, hi) in enumerate(ranges)]
        pending = set(futs)
        error: BaseException | None = None
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
            _drain(q, prog)
            for f in finished:
                k = futs.index(f)
                try:
                    done[k] = f.result()
                except BaseException as e:  # noqa: BLE001 - re-raised below, first failure wins
                    stop.set()
                    if error is None:
                        error = e
        _drain(q, prog)
    if error is not None:
        for r in done:
            if r is not None:
                _remove(root, [s["path"] for s in r["shards"]])
        raise error
    return [r for r in done if r is not None]


def _drain(q: Any, prog: Progress) -> None:
    while True:
        try:
            _, n, nb = q.get_nowait()
        except queue.Empty:
            return
        prog.add(n, nb)


# ---------------------------------------------------------------------------------------
# Verify (NOTE [exactness]).
def _as_u8_rows(t: Any, n: int) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    a = t.numpy()
    return a.reshape(n, -1).view(np.uint8) if a.size else np.zeros((n, 0), np.uint8)


def verify_dataset(src: Any, dst: str | os.PathLike[str], *, kind: str | None = None, fields: Any = None,
                   nulls: str = "error", labels: bool = False, batch_size: int = 1024,
                   num_threads: int = 2) -> dict[str, Any]:
    """Proves that dataset ``dst`` holds exactly the records of ``src``, in order.

    ``src`` and the options are those given to ``convert``. Reads every record back with
    the native reader (which checks every checksum) and compares it byte for byte with
    the source. Returns ``{"records", "fields", "bytes", "seconds"}``; raises VerifyError
    naming the first record and field that differ.
    """
    from ..read.shards import ShardDataset

    t0 = time.perf_counter()
    source = src if isinstance(src, Source) else open_source(src, kind=kind, fields=fields, nulls=nulls,
                                                             labels=labels)
    root = os.fspath(dst)
    with open(os.path.join(root, MANIFEST_NAME), "rb") as fh:
        body = parse_manifest(fh.read(), root, _C.xxh64)
    got_fields = [tuple(f.values()) for f in body["fields"]]
    want_fields = [tuple(f.to_json().values()) for f in source.fields]
    if got_fields != want_fields:
        raise VerifyError(f"{root}: fields {got_fields} differ from the source's {want_fields}")
    n = source.num_records
    if body["records"] != n:
        raise VerifyError(f"{root}: holds {body['records']} records, the source {n}")
    if n == 0:
        return {"records": 0, "fields": len(source.fields), "bytes": 0, "seconds": time.perf_counter() - t0}
    ds = ShardDataset(root, rank=0, world_size=1)
    it = ds.batches(batch_size, shuffle=False, num_threads=num_threads)

    def source_chunks() -> Iterator[Chunk]:
        row0 = source.unit_row0()
        for u in range(len(source.units)):
            yield from source.read(u, row0[u])

    chunks = source_chunks()
    pending: Chunk | None = None
    pos = 0
    nbytes = 0
    try:
        for batch in it:
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
        it.close()
    if pending is not None and pending.n:
        raise VerifyError(f"{root}: the source has more records than the dataset's {pos}")
    for extra in chunks:
        if extra.n:
            raise VerifyError(f"{root}: the source has more records than the dataset's {pos}")
    return {"records": pos, "fields": len(source.fields), "bytes": nbytes, "seconds": time.perf_counter() - t0}


def _compare(fields: list[Field], batch: dict[str, Any], at: int, part: Chunk, rec0: int, root: str) -> int:
    k = part.n
    nbytes = 0
    for f, c in zip(fields, part.columns):
        t = batch[f.name][at : at + k]
        if not f.variable:
            got = _as_u8_rows(t, k)
            want = np.ascontiguousarray(c).reshape(k, -1).view(np.uint8) if c.size else np.zeros((k, 0), np.uint8)
            if not np.array_equal(got, want):
                r = int(np.flatnonzero((got != want).any(axis=1))[0])
                raise VerifyError(f"{root}: record {rec0 + r} field {f.name!r} differs from the source")
            nbytes += want.nbytes
            continue
        lens = batch[f"{f.name}_lengths"][at : at + k].numpy()
        if not np.array_equal(lens, c.lengths):
            r = int(np.flatnonzero(lens != c.lengths)[0])
            raise VerifyError(f"{root}: record {rec0 + r} field {f.name!r} has length {int(lens[r])}, "
                              f"the source {int(c.lengths[r])}")
        got = _as_u8_rows(t, k)
        mv = memoryview(np.ascontiguousarray(c.data)) if c.data.size else memoryview(b"")
        offs = c.offsets.tolist()
        for r in range(k):
            a, e = offs[r], offs[r + 1]
            if got[r, : e - a].tobytes() != mv[a:e]:
                raise VerifyError(f"{root}: record {rec0 + r} field {f.name!r} differs from the source")
        nbytes += offs[-1] - offs[0]
    return nbytes
