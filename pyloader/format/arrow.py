"""Arrow <-> pyloader fields: which field an Arrow column becomes, and its values as arrays.

Shared by ``pyloader convert`` (pyloader/write) and ``ParquetDataset`` (pyloader/read), so a
Parquet column reads the same whether converted to shards or read in place. Values are
never changed on the way (NOTE [exactness] in pyloader/write/convert.py): only casts the
caller asks for, checked by pyarrow with ``safe=True``. pyarrow is imported on first use.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConvertError, SchemaError
from .spec import Field, make_field

PARQUET_EXT = (".parquet", ".pq", ".parq")
ARROW_EXT = (".arrow", ".feather", ".ipc", ".arrows")
_NAME_BAD = re.compile(r"[^A-Za-z0-9_]")


@dataclass
class VarColumn:
    """A variable field's values, as one byte buffer with per-record offsets.

    Record r is ``data[offsets[r]:offsets[r+1]]`` (bytes) with ``lengths[r]`` leading rows.
    Offsets index ``data`` directly, so slicing copies nothing.
    """

    data: np.ndarray  # uint8, 1-D
    offsets: np.ndarray  # int64, n + 1 byte offsets into data
    lengths: np.ndarray  # int64, n

    def slice(self, a: int, b: int) -> VarColumn:
        """Records ``a`` to ``b`` (exclusive), sharing ``data`` (no copy)."""
        return VarColumn(self.data, self.offsets[a : b + 1], self.lengths[a:b])


def var_from_bytes(values: Sequence[bytes]) -> VarColumn:
    """A VarColumn holding ``values`` (copied into one buffer), one record each."""
    lens = np.fromiter((len(v) for v in values), np.int64, len(values))
    offs = np.zeros(len(values) + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    data = np.frombuffer(b"".join(values), np.uint8) if values else np.zeros(0, np.uint8)
    return VarColumn(data, offs, lens)


def field_name(name: str) -> str:
    """A field name for a source column or extension: invalid characters become '_'."""
    s = _NAME_BAD.sub("_", name)
    if not s or s[0].isdigit():
        s = "_" + s
    return s[:128]


def pyarrow_module() -> Any:
    """The pyarrow module, imported on first use (an ImportError that says how to install it)."""
    try:
        import pyarrow
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("Parquet and Arrow sources need pyarrow: pip install 'pyloader[parquet]'") from None
    return pyarrow


def _arrow_leaf_dtype(t: Any) -> str | None:
    pa = pyarrow_module()
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return str(np.dtype(t.to_pandas_dtype()).name)
    return None


def _is_bytes_type(t: Any) -> bool:
    pa = pyarrow_module()
    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t)
                or pa.types.is_large_string(t) or pa.types.is_fixed_size_binary(t)
                or pa.types.is_binary_view(t) or pa.types.is_string_view(t))


# The one action that fixes an unsupported column, as the caller's own option spells it
# (convert's ``fields=``; ParquetDataset names its ``columns=``).
_LEAVE_OUT = "cast the column or leave it out with fields="


def _fixed_shape(col: str, t: Any, fix: str = _LEAVE_OUT) -> tuple[str, tuple[int, ...]]:
    """(dtype, shape) of a fixed-size Arrow type: a numeric leaf or nested fixed-size lists."""
    pa = pyarrow_module()
    if isinstance(t, pa.BaseExtensionType):
        if hasattr(t, "shape") and hasattr(t, "value_type"):  # arrow.fixed_shape_tensor
            leaf = _arrow_leaf_dtype(t.value_type)
            if leaf is not None and not getattr(t, "permutation", None):
                return leaf, tuple(int(d) for d in t.shape)
        raise ConvertError(f"column {col!r} has type {t}, which has no pyloader field; {fix}")
    leaf = _arrow_leaf_dtype(t)
    if leaf is not None:
        return leaf, ()
    if pa.types.is_fixed_size_list(t):
        dt, inner = _fixed_shape(col, t.value_type, fix)
        return dt, (int(t.list_size), *inner)
    raise ConvertError(
        f"column {col!r} has type {t}, which has no pyloader field: supported are booleans, integers, floats, "
        "binary/string (-> bytes), fixed-size lists and fixed_shape_tensor of those (-> fixed shape), and one "
        f"level of list of those (-> variable length); {fix if fix != _LEAVE_OUT else _unsupported_fix(col, t)}")


def _is_temporal(t: Any) -> bool:
    pa = pyarrow_module()
    return bool(pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_time(t)
                or pa.types.is_duration(t))


def _unsupported_fix(col: str, t: Any) -> str:
    """The one way to convert a column of unsupported type ``t``."""
    pa = pyarrow_module()
    if _is_temporal(t):
        return (f"cast it to its integer count, {col}:int64 in fields= (from Python the dict "
                f"{{{col!r}: 'int64'}}), or leave it out with fields=")
    if pa.types.is_decimal(t):
        return ("convert only makes exact casts, and a decimal is not exact as a float: cast it yourself before "
                f"converting (pyarrow.compute.cast(table[{col!r}], 'float64'), or to an integer of its "
                "smallest unit) or leave it out with fields=")
    return "leave it out with fields="


def _temporal_cast(col: str, t: Any, cast: str) -> str:
    """The dtype a date/time column cast to ``cast`` converts to: its integer count (ConvertError otherwise)."""
    pa = pyarrow_module()
    width = t.bit_width
    if cast not in (f"int{width}", "int64"):
        raise ConvertError(f"column {col!r} has type {t}: it casts to its integer count, int64"
                           f"{'' if width == 64 else f' or int{width}'}, not to {cast} (fields: {col}:int64)")
    try:
        t_int = getattr(pa, cast)()
        pa.array([], t).cast(t_int)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ConvertError(f"column {col!r} has type {t}: it cannot be cast to {cast}: {e}") from None
    return cast


def arrow_field(col: str, t: Any, cast: str | None = None, *, fix: str = _LEAVE_OUT) -> Field:
    """The pyloader Field a column of Arrow type ``t`` converts to (ConvertError if none).

    ``fix``: the action that ends the message of a column with no pyloader field, in the
    words of the caller's option (convert's ``fields=`` by default).
    """
    pa = pyarrow_module()
    if pa.types.is_dictionary(t):
        t = t.value_type
    shape: tuple[int | None, ...]
    if _is_bytes_type(t):
        dt, shape = "bytes", (None,)
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t) \
            or pa.types.is_large_list_view(t):
        vt = t.value_type
        if pa.types.is_list(vt) or pa.types.is_large_list(vt) or _is_bytes_type(vt):
            raise ConvertError(f"column {col!r} has type {t}: a list of variable-length values has no pyloader "
                               "field (only the leading dimension may vary)")
        dt, inner = _fixed_shape(col, vt, fix)
        shape = (None, *inner)
    elif cast is not None and _is_temporal(t):
        dt, shape = _temporal_cast(col, t, cast), ()
    else:
        dt, shape = _fixed_shape(col, t, fix)
    if cast is not None:
        if dt == "bytes" and cast != "bytes":
            raise ConvertError(f"column {col!r} holds {t}; it cannot be cast to {cast} (it converts to bytes)")
        dt = cast
    try:
        return make_field(field_name(col), (dt, shape))
    except SchemaError as e:
        raise ConvertError(f"column {col!r}: {e}") from None


def _with_leaf(t: Any, leaf: Any) -> Any:
    pa = pyarrow_module()
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
    pa = pyarrow_module()
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
                raise ConvertError(
                    f"{where}: column {col!r} of type {arr.type} cannot be cast to {cast}: {e}") from None
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


def _leaf_numpy(arr: Any, f: Field, col: str, where: str, nulls: str,
                row_of: Callable[[int], int] | None) -> np.ndarray:
    """The leaf values below fixed-size lists as a flat ndarray; nulls inside are errors or zeros."""
    pa = pyarrow_module()
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


__all__ = ["PARQUET_EXT", "ARROW_EXT", "VarColumn", "var_from_bytes", "field_name", "pyarrow_module", "arrow_field",
           "arrow_to_column"]
