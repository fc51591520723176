"""Sources for ``pyloader convert``: Parquet/Arrow, numpy, folders of files and WebDataset tars.

A *source* (``open_source``) knows its pyloader schema up front and is cut into
*units* (a Parquet row group, an Arrow record batch, a range of numpy rows, a range of
files, one tar) whose record counts are known (tars: counted by a header scan). A unit
reads as *chunks*: ``n`` records of every field held column by column, so per-record
Python work is only the per-value checksum and compression. Sources are pickled into
convert's worker processes (NOTE [parallel convert] in convert.py): open file handles
are not, each process reopens its own.
"""

from __future__ import annotations

import glob
import os
import tarfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConvertError, SchemaError
from ..format.arrow import (
    ARROW_EXT,
    PARQUET_EXT,
    VarColumn,
    arrow_field,
    arrow_to_column,
    field_name,
    pyarrow_module,
    var_from_bytes,
)
from ..format.spec import IMAGE_ENCODINGS, Field, make_field
from .hf_saved import hf_saved_files

KINDS = ("parquet", "arrow", "numpy", "files", "tar")
NULL_POLICIES = ("error", "zero")
_CHUNK_BYTES = 16 << 20  # target decoded bytes per chunk (bounds a job's memory with shard_size)
_TAR_EXT = (".tar", ".tar.gz", ".tgz")
# File extension (lowercase, no dot) -> the encoding of a field of such files
# (NOTE [field encoding] in pyloader/format/spec.py).
_IMAGE_EXT = {"jpg": "jpeg", "jpeg": "jpeg", "png": "png", "webp": "image", "bmp": "image", "gif": "image",
              "tif": "image", "tiff": "image"}


def image_encoding(exts: Iterable[str]) -> str | None:
    """The encoding of a bytes field whose values are files with extensions ``exts`` (no dot).

    ``"jpeg"`` (.jpg, .jpeg) or ``"png"`` when all are of that format, ``"image"`` for
    another image format or a mix of image formats, None (plain bytes) if any is not an
    image extension or there are none.
    """
    found = set()
    for e in exts:
        enc = _IMAGE_EXT.get(e.lower())
        if enc is None:
            return None
        found.add(enc)
    if not found:
        return None
    return found.pop() if len(found) == 1 else "image"


# ---------------------------------------------------------------------------------------
# Chunks: n records of every field, column by column.
@dataclass
class Chunk:
    """``n`` records of every field, column by column."""

    n: int
    columns: list[Any]  # per field: ndarray [n, *shape] (fixed) or VarColumn
    row0: int = -1  # global source row of the first record, -1 if unknown

    def slice(self, a: int, b: int) -> Chunk:
        """Records ``a`` to ``b`` (exclusive) as a chunk of views (no copy)."""
        cols = [c.slice(a, b) if isinstance(c, VarColumn) else c[a:b] for c in self.columns]
        return Chunk(b - a, cols, self.row0 + a if self.row0 >= 0 else -1)

    def nbytes(self) -> int:
        """Decoded bytes of the chunk's values, all fields together."""
        return sum(int(c.offsets[-1] - c.offsets[0]) if isinstance(c, VarColumn) else c.nbytes for c in self.columns)


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
        """What was converted, for convert's sidecar file: the kind and each field's source column."""
        return {"kind": self.kind, "columns": dict(zip((f.name for f in self.fields), self.columns, strict=True))}

    @property
    def num_records(self) -> int:
        """Records in the whole source."""
        return int(sum(self.unit_records))

    def unit_row0(self) -> list[int]:
        """The global row of each unit's first record."""
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
        if isinstance(v, str) and v in IMAGE_ENCODINGS:
            # A cast changes values; an encoding only annotates bytes. Convert sets it itself
            # for folders of images and image members of tars.
            raise ValueError(f"fields: {k!r}: {v!r} is an encoding, not a dtype to cast to")
        try:
            f = make_field("x", (v, ()))
        except SchemaError as e:
            raise ValueError(f"fields: {k!r}: {e}") from None
        norm[k] = f.dtype
    return names, norm



# -- Arrow (Parquet and IPC) --------------------------------------------------------------
class ArrowSource(Source):
    """Parquet files (``kind="parquet"``, unit = row group) or Arrow IPC files (unit = record batch)."""

    def __init__(self, paths: list[str], kind: str, fields: Any, nulls: str) -> None:
        pa = pyarrow_module()
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
                for (c, f), (_, g) in zip(cols, schema0, strict=True):
                    if f != g:
                        raise ConvertError(f"{p}: column {c!r} converts to {f.dtype}{list(f.shape)} but in "
                                           f"{paths[0]} to {g.dtype}{list(g.shape)}: every file needs the same schema")
            r = 0
            for j, (nr, nb) in enumerate(zip(counts, sizes, strict=True)):
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
        pa = pyarrow_module()
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
            raise _not_readable(p, self.kind, f"not a readable {'Parquet' if self.kind == 'parquet' else 'Arrow IPC'} "
                                f"file: {e}") from None

    @staticmethod
    def _open_ipc(p: str) -> Any:
        pa = pyarrow_module()
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
        """A row group as chunks of about 16 MB, or a record batch as one chunk; ConvertError if unreadable."""
        pa = pyarrow_module()
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
                        for k, (c, fl) in enumerate(zip(self.columns, self.fields, strict=True))]
                yield Chunk(b.num_rows, cols, r)
                fr += b.num_rows
                if r >= 0:
                    r += b.num_rows
        except (pa.ArrowInvalid, pa.ArrowIOError) as e:
            raise ConvertError(f"{where}: cannot be read: {e}") from None

    def describe(self) -> dict[str, Any]:
        """``Source.describe()`` plus the source files."""
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
                    raise _not_readable(self.paths[k], "numpy", f"not a readable .npy file: {e}") from None
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
                pairs.append((k, make_field(field_name(k), spec)))
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
        """A range of rows as one chunk; string arrays become UTF-8 bytes."""
        a, b = self.units[unit_index]
        cols: list[Any] = []
        for k, f in zip(self.columns, self.fields, strict=True):
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
        """``Source.describe()`` plus the ``.npy`` path of each array loaded from one (None if none was)."""
        return {**super().describe(), "paths": self.paths or None}


# -- a folder of files ---------------------------------------------------------------------
class FilesSource(Source):
    """Every file under a folder, sorted by relative path, as a record.

    Fields: ``data`` (bytes), ``path`` (the relative path, UTF-8 bytes, '/'-separated) and
    with ``labels=True`` a ``label`` (int64): the index of the file's top-level folder among
    the sorted folder names. When every file has an image extension, ``data`` carries that
    image encoding (``image_encoding``: .jpg/.jpeg -> "jpeg", .png -> "png", else "image").
    """

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
        data_enc = image_encoding(os.path.splitext(r)[1][1:] for r in self.rels)
        all_fields = {"data": (data_enc or "bytes", ()), "path": ("bytes", ())}
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
        """A unit's files (at most ``files_per_unit``, about 16 MB) as one chunk."""
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
        """``Source.describe()`` plus the folder and the class names (with labels)."""
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
        raise _not_readable(path, "tar", "not a readable tar file: " + " ".join(str(e).split())) from None
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


def _tar_field(ext: str) -> Field:
    """The field of tar members with extension ``ext`` (``seg.png`` -> ``seg_png``, a png field)."""
    if ext == _KEY_FIELD:
        return make_field(ext, ("bytes", ()))
    return make_field(field_name(ext), (image_encoding([ext.rsplit(".", 1)[-1]]) or "bytes", ()))


class TarSource(Source):
    """WebDataset-style tars: one record per sample key, a bytes field per extension, plus ``__key__``.

    The field of an image extension (``jpg``, ``seg.png``, ...) carries that image encoding
    (``image_encoding`` of the extension's last part).
    """

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
        pairs = [(e, _tar_field(e)) for e in ordered]
        _unique_fields(pairs, "extension")
        self.columns = ordered
        self.fields = [f for _, f in pairs]

    def read(self, unit_index: int, row0: int = -1) -> Iterator[Chunk]:
        """One tar as chunks of about 16 MB of samples.

        Raises ConvertError for a missing member (unless ``nulls="zero"``), a truncated
        member, or a tar whose sample count changed since it was scanned.
        """
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
        """``Source.describe()`` plus the source files."""
        return {**super().describe(), "paths": self.paths}


# -- dispatch ---------------------------------------------------------------------------------
def _files_source(root: str, fields: Any, labels: bool) -> FilesSource:
    src = FilesSource(root, fields, labels)
    if not src.rels:
        raise ConvertError(f"{root}: the folder holds no files to convert")
    return src


def _list_files(root: str) -> list[str]:
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "_")))
        out.extend(os.path.join(dirpath, f) for f in filenames if not f.startswith((".", "_")))
    return sorted(out)


def _kind_of(path: str) -> str | None:
    p = path.lower()
    if p.endswith(PARQUET_EXT):
        return "parquet"
    if p.endswith(ARROW_EXT):
        return "arrow"
    if p.endswith((".npy", ".npz")):
        return "numpy"
    if p.endswith(_TAR_EXT):
        return "tar"
    return None


_GLOB_CHARS = frozenset("*?[")
_TEXT_EXT = (".csv", ".tsv", ".json", ".jsonl", ".txt")


def expand_paths(src: str | os.PathLike[str] | list[Any] | tuple[Any, ...]) -> str | list[str]:
    """``src`` with glob patterns expanded: one path stays a str, several become a sorted list.

    A pattern (``*``, ``?``, ``[``) that names no existing path is expanded (sorted, like a
    shell); one that matches nothing raises ConvertError. An existing path is taken as is,
    even if its name holds such characters.
    """
    items = [src] if isinstance(src, (str, os.PathLike)) else list(src)
    out: list[str] = []
    for item in items:
        s = os.fspath(item)
        if "://" in s or os.path.exists(s) or not _GLOB_CHARS & set(s):
            out.append(s)
            continue
        hits = sorted(glob.glob(s, recursive=True))
        if not hits:
            raise ConvertError(f"the pattern {s!r} matches no file")
        out.extend(hits)
    if not out:
        raise ConvertError("the source lists no files")
    return out[0] if len(out) == 1 else out


# The first bytes of each kind's files (a tar's "ustar" sits at offset 257).
_MAGIC = (("parquet", 0, b"PAR1"), ("arrow", 0, b"ARROW1"), ("numpy", 0, b"\x93NUMPY"), ("numpy", 0, b"PK\x03\x04"),
          ("tar", 257, b"ustar"))


def sniff_kind(path: str) -> str | None:
    """The source kind the first bytes of file ``path`` show (None: none of them, or unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return None
    for kind, at, magic in _MAGIC:
        if head[at:at + len(magic)] == magic:
            return kind
    if head[:4] == b"\xff\xff\xff\xff" and head[8:14] == b"ARROW1":  # an Arrow IPC stream
        return "arrow"
    return None


def _not_readable(path: str, kind: str, problem: str) -> ConvertError:
    """The error for a file that cannot be read as ``kind``: names the kind it is when its bytes tell."""
    actual = sniff_kind(path)
    if actual is not None and actual != kind:
        return ConvertError(f"{path}: is a {_KIND_NAMES[actual]} file, not {_KIND_NAMES[kind]}: pass kind={actual!r} "
                            "(or leave kind= out to guess it from the file names)")
    return ConvertError(f"{path}: {problem}")


_KIND_NAMES = {"parquet": "Parquet", "arrow": "Arrow IPC", "numpy": "numpy (.npy/.npz)", "tar": "tar",
               "files": "plain"}


def _unknown_kind(path: str) -> ConvertError:
    low = path.lower()
    if low.endswith(_TEXT_EXT):
        return ConvertError(f"{path!r}: {os.path.splitext(low)[1]} is not a convert source (Parquet, Arrow IPC, "
                            ".npy/.npz, WebDataset .tar or a folder of files): write it as Parquet first (e.g. "
                            "pyarrow.csv.read_csv then pyarrow.parquet.write_table) and convert that")
    return ConvertError(f"cannot tell the kind of {path!r} from its name; pass kind= (one of {', '.join(KINDS)})")


def open_source(src: Any, *, kind: str | None = None, fields: Any = None, nulls: str = "error",
                labels: bool = False) -> Source:
    """The Source for ``src``: a path (file or folder), a glob pattern, a list of files, or a dict of arrays.

    ``kind`` (``"parquet"``, ``"arrow"``, ``"numpy"``, ``"files"``, ``"tar"``) overrides the
    guess: a file by its extension; a folder is Parquet, Arrow, tar or numpy when every
    (non-hidden) file in it is of that kind, the Arrow files of a Hugging Face dataset when
    ``save_to_disk`` wrote it (``hf_saved.py``), else a folder of files. Patterns are expanded
    as a shell would (``expand_paths``); a list may mix patterns and files.
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if nulls not in NULL_POLICIES:
        raise ValueError(f"nulls must be one of {NULL_POLICIES}, got {nulls!r}")
    if isinstance(src, Mapping):
        if kind not in (None, "numpy"):
            raise ValueError("a dict source is a numpy source")
        return NumpySource(src, fields, nulls)
    if isinstance(src, (str, os.PathLike, list, tuple)):
        src = expand_paths(src)
    if isinstance(src, list):
        paths = src
        for p in paths:
            if os.path.isdir(p):
                raise ConvertError(f"{p!r} is a folder: give one folder, or a list of files")
            if not os.path.exists(p):
                raise FileNotFoundError(f"no such file: {p!r}")
    else:
        s = os.fspath(src)
        if "://" in s:
            raise ConvertError(f"{s!r}: convert reads local files; copy the data first (or read Parquet directly "
                               "with pyloader.ParquetDataset, which fetches through the node cache)")
        if not os.path.exists(s):
            raise FileNotFoundError(f"no such file or folder: {s!r}")
        hf = hf_saved_files(s) if os.path.isdir(s) and kind in (None, "arrow") else None
        if hf is not None:  # a Hugging Face save_to_disk folder: its Arrow files' rows
            paths, kind = hf, "arrow"
        elif os.path.isdir(s):
            if kind == "files" or (kind is None and not _list_files(s)):
                return _files_source(s, fields, labels)
            paths = _list_files(s)
            kinds = {_kind_of(p) for p in paths}
            if kind is None:
                kind = kinds.pop() if len(kinds) == 1 and None not in kinds else "files"
            if kind == "files":
                return _files_source(s, fields, labels)
            paths = [p for p in paths if _kind_of(p) == kind] if kind != "numpy" else \
                [p for p in paths if p.endswith(".npy")]
            if not paths:
                raise ConvertError(f"{s}: holds no {kind} files")
        else:
            paths = [s]
    if kind is None:
        kinds = {_kind_of(p) for p in paths}
        if len(kinds) != 1 or None in kinds:
            if None in kinds:
                raise _unknown_kind(next(p for p in paths if _kind_of(p) is None))
            raise ConvertError(f"the files are of several kinds ({', '.join(sorted(str(k) for k in kinds))}); "
                               "convert one kind at a time")
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


__all__ = ["KINDS", "NULL_POLICIES", "image_encoding", "Chunk", "Source", "ArrowSource", "NumpySource", "FilesSource",
           "TarSource", "expand_paths", "open_source", "sniff_kind"]
