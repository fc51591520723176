"""Shard format versions 1 to 3 and the dataset manifest (specified in docs/format.md).

Python side of the format: field specs, the binary schema block, the shard header, the
column table (version 3) and the manifest. The native reader (csrc/core/shard_reader.cpp) parses the same bytes.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

import pyloader._C as _C

from ..errors import ManifestError, SchemaError, ShardFormatError

MAGIC = b"PYLSHARD"
VERSION = 3  # the newest shard format version writers write (NOTE [column layout])
# Shard versions readers accept, each with its checksum (header, schema, column table,
# index and every stored value or column block): version 2 is version 1 with XXH3-64 in
# place of XXH64; version 3 is version 2 plus a column table.
SHARD_VERSIONS = (1, 2, 3)
CHECKSUM_NAMES = {1: "XXH64", 2: "XXH3-64", 3: "XXH3-64"}
MANIFEST_VERSION = 1  # the manifest's own "version", independent of the shards'
HEADER_SIZE = 128
INDEX_ENTRY_SIZE = 32
# NOTE [column layout]: in a version 3 shard, a fixed field of 1 to COLUMN_MAX_ROW_BYTES
# bytes per record is stored as a column: its values back to back in record order, raw,
# in blocks of a power-of-two number of rows (at most COLUMN_BLOCK_BYTES, or one row), one
# checksum per block; it has no index entries. Up to 256 bytes a 32-byte index entry costs
# at least 12.5% of the value (400% for an int64), while LZ4 per value seldom saves that
# much on so few bytes; larger values keep their entries (and per-value LZ4). A block is
# what a reader verifies on first touch: 64 KiB hashes in ~5 us, small against a batch, and
# keeps the checksums at 1/8192 of the column. The native reader (csrc/core/shard_reader.h)
# reads the same layout.
COLUMN_MAX_ROW_BYTES = 256
COLUMN_BLOCK_BYTES = 64 << 10
COLUMN_TABLE_HEAD = struct.Struct("<II")  # num_columns, reserved
COLUMN_DESC = struct.Struct("<IIIIQ")  # field, row_bytes, block_rows, reserved, data offset in the payload
CODEC_RAW = 0
CODEC_LZ4 = 1
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "pyloader-shards"

# name -> (code, itemsize, numpy dtype used to hold the bytes)
DTYPES: dict[str, tuple[int, int, str]] = {
    "bool": (1, 1, "?"),
    "uint8": (2, 1, "u1"),
    "uint16": (3, 2, "<u2"),
    "uint32": (4, 4, "<u4"),
    "uint64": (5, 8, "<u8"),
    "int8": (6, 1, "i1"),
    "int16": (7, 2, "<i2"),
    "int32": (8, 4, "<i4"),
    "int64": (9, 8, "<i8"),
    "float16": (10, 2, "<f2"),
    "bfloat16": (11, 2, "<u2"),  # numpy has no bfloat16: the bits travel as uint16
    "float32": (12, 4, "<f4"),
    "float64": (13, 8, "<f8"),
    "bytes": (14, 1, "u1"),
}
# Encodings a bytes field may be annotated with (NOTE [field encoding]). "image" is any
# format an image decoder sniffs from the bytes (a mix of formats, WebP, BMP, GIF, TIFF).
IMAGE_ENCODINGS = ("image", "jpeg", "png")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Index entry: offset, stored size, decoded size, leading length, codec, 3 pad, checksum
# of the stored bytes (the shard version's function).
INDEX_DTYPE = np.dtype(
    [("offset", "<u8"), ("stored", "<u4"), ("decoded", "<u4"), ("leading", "<u4"),
     ("codec", "u1"), ("pad", "V3"), ("checksum", "<u8")]
)
assert INDEX_DTYPE.itemsize == INDEX_ENTRY_SIZE
# Everything before the header checksum. The last two u64 are the column table's size and
# checksum in version 3, reserved (zero) before.
_HEADER = struct.Struct("<8sIIQIIQQQQQQQQQQQ")
assert _HEADER.size == HEADER_SIZE - 8
MAX_FIELD_BYTES = 2**32 - 1
# The most bytes a reader lets one stored value decode to unless told otherwise
# (``ShardDataset(max_value_bytes=...)``; NOTE [value bounds] in csrc/core/shard_reader.h).
DEFAULT_MAX_VALUE_BYTES = 1 << 30
# A checksum (seed 0) of a bytes-like object, e.g. pyloader._C.xxh64, passed in by the caller.
Hasher = Callable[[Any], int]


def shard_checksum(version: int) -> Hasher:
    """The checksum function of shard format ``version``: XXH64 (1) or XXH3-64 (2, 3), seed 0.

    Raises ShardFormatError for a version readers do not accept.
    """
    if version == 1:
        return _C.xxh64
    if version in (2, 3):
        return _C.xxh3_64
    raise ShardFormatError(f"unsupported shard version {version}")


def normalize_dtype(dtype: Any) -> str:
    """Maps a dtype given as a string, numpy dtype or torch dtype to its format name."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    name = getattr(dtype, "__module__", "")
    if name == "torch" or str(dtype).startswith("torch."):
        s = str(dtype).removeprefix("torch.")
        if s in DTYPES:
            return s
        raise SchemaError(f"unsupported torch dtype {dtype!r}")
    if dtype in (bytes, "bytes"):
        return "bytes"
    try:
        nd = np.dtype(dtype)
    except TypeError as e:
        raise SchemaError(f"unknown dtype {dtype!r}") from e
    if nd.kind in "biuf" and nd.name in DTYPES:
        return nd.name
    raise SchemaError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")


@dataclass(frozen=True)
class Field:
    """One named field of a dataset: a dtype and a shape whose leading dim may be None.

    NOTE [field encoding]: ``encoding`` says what the bytes of a ``"bytes"`` field hold
    (one of IMAGE_ENCODINGS: encoded images), or is None. It lives in the manifest only:
    the shard's schema block stores the field as plain bytes, so readers that ignore the
    annotation (the native reader included) read the same bytes either way. Other dtypes
    never have an encoding.
    """

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    encoding: str | None = None

    def __post_init__(self) -> None:
        if self.encoding is not None:
            if self.encoding not in IMAGE_ENCODINGS:
                raise SchemaError(f"field {self.name!r}: unknown encoding {self.encoding!r}; "
                                  f"supported: {', '.join(IMAGE_ENCODINGS)}")
            if self.dtype != "bytes":
                raise SchemaError(f"field {self.name!r}: encoding {self.encoding!r} applies to a bytes field "
                                  f"only, not to dtype {self.dtype}")

    @property
    def is_image(self) -> bool:
        """Whether the field holds encoded images (its encoding is one of IMAGE_ENCODINGS)."""
        return self.encoding in IMAGE_ENCODINGS

    @property
    def variable(self) -> bool:
        """Whether the leading dimension varies from record to record (it is None)."""
        return len(self.shape) > 0 and self.shape[0] is None

    @property
    def itemsize(self) -> int:
        """Bytes of one element of the field's dtype."""
        return DTYPES[self.dtype][1]

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype that holds the field's bytes (uint16 for bfloat16, uint8 for bytes)."""
        return np.dtype(DTYPES[self.dtype][2])

    @property
    def row_bytes(self) -> int:
        """Bytes of one leading row (variable fields) or of one whole record (fixed fields)."""
        dims = self.shape[1:] if self.variable else self.shape
        n = self.itemsize
        for d in dims:
            n *= int(d)  # type: ignore[arg-type]  # only a leading dim may be None, and `variable` dropped it
        return n

    def to_json(self) -> dict[str, Any]:
        """The field as the manifest stores it: ``{"name", "dtype", "shape"}``, plus ``"encoding"`` if set.

        A varying dim is None. ``"encoding"`` is left out when None (NOTE [field encoding]), so
        manifests of fields without one are unchanged.
        """
        out: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.encoding is not None:
            out["encoding"] = self.encoding
        return out


def make_field(name: str, spec: Any) -> Field:
    """Builds a Field from ``(dtype, shape)`` (shape optional for scalars) and validates it.

    The dtype may also be an image encoding, ``"image"``, ``"jpeg"`` or ``"png"`` (shape
    ``()`` or ``(None,)``): a bytes field with that encoding (NOTE [field encoding]).
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise SchemaError(f"field name {name!r} must be an identifier of at most 128 characters")
    if isinstance(spec, tuple) and len(spec) == 2:
        dtype, shape = spec
    else:
        dtype, shape = spec, ()
    encoding: str | None = None
    if isinstance(dtype, str) and dtype in IMAGE_ENCODINGS:
        encoding, dt = dtype, "bytes"
    else:
        dt = normalize_dtype(dtype)
    if isinstance(shape, int):
        shape = (shape,)
    try:
        shape = tuple(shape)
    except TypeError as e:
        raise SchemaError(f"field {name!r}: shape {shape!r} is not a tuple") from e
    if dt == "bytes":
        if shape not in ((), (None,)):
            kind = f"an {encoding} field" if encoding == "image" else f"a {encoding or 'bytes'} field"
            raise SchemaError(f"field {name!r}: {kind} has no shape (got {shape!r})")
        shape = (None,)
    for i, d in enumerate(shape):
        if d is None and i == 0:
            continue
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 0:
            raise SchemaError(
                f"field {name!r}: shape {shape!r} must hold non-negative ints (only the leading dim may be None)"
            )
    shape = tuple(None if d is None else int(d) for d in shape)
    if len(shape) > 16:
        raise SchemaError(f"field {name!r}: at most 16 dimensions")
    f = Field(name, dt, shape, encoding)
    if f.row_bytes > MAX_FIELD_BYTES:
        raise SchemaError(f"field {name!r}: a record may hold at most 4 GiB per field")
    return f


def make_fields(fields: Mapping[str, Any]) -> list[Field]:
    """Builds the Fields of ``{name: (dtype, shape)}``, in order (see ``make_field``).

    Raises SchemaError if the mapping is empty, a field is invalid, or a field is named
    like a variable field's ``<name>_lengths`` batch key.
    """
    if not isinstance(fields, Mapping) or not fields:
        raise SchemaError("fields must be a non-empty mapping of name -> (dtype, shape)")
    out = [make_field(n, s) for n, s in fields.items()]
    names = {f.name for f in out}
    for f in out:
        if f.variable and f"{f.name}_lengths" in names:
            raise SchemaError(f"field {f.name}_lengths collides with the lengths of variable field {f.name!r}")
    return out


def encode_schema(fields: Iterable[Field]) -> bytes:
    """The binary schema block stored in every shard (docs/format.md, "Schema block")."""
    fields = list(fields)
    parts = [struct.pack("<I", len(fields))]
    for f in fields:
        name = f.name.encode("utf-8")
        parts.append(struct.pack("<H", len(name)) + name)
        parts.append(struct.pack("<BBBB", DTYPES[f.dtype][0], 1 if f.variable else 0, len(f.shape), 0))
        parts.append(struct.pack(f"<{len(f.shape)}q", *(-1 if d is None else d for d in f.shape)))
    return b"".join(parts)


def pack_header(*, num_records: int, num_fields: int, schema_size: int, index_size: int,
                payload_size: int, schema_checksum: int, index_checksum: int, version: int = VERSION,
                columns_size: int = 0, columns_checksum: int = 0) -> bytes:
    """The shard header bytes (docs/format.md, "Header"), checksum included.

    The sections follow the header in the order schema, column table (version 3 only:
    ``columns_size`` bytes, else 0), index, payload; their offsets and the file size are
    computed from the sizes given. The checksums given, and the header's own, are those of
    ``version`` (``shard_checksum(version)``).
    """
    if version != 3 and (columns_size or columns_checksum):
        raise ValueError(f"a version {version} shard has no column table")
    schema_off = HEADER_SIZE
    index_off = schema_off + schema_size + columns_size
    payload_off = index_off + index_size
    file_size = payload_off + payload_size
    body = _HEADER.pack(MAGIC, version, HEADER_SIZE, num_records, num_fields, INDEX_ENTRY_SIZE,
                        schema_off, schema_size, index_off, index_size, payload_off, payload_size,
                        file_size, schema_checksum, index_checksum, columns_size, columns_checksum)
    return body + struct.pack("<Q", shard_checksum(version)(body))


def is_column_field(f: Field) -> bool:
    """Whether a version 3 writer stores field ``f`` as a column (NOTE [column layout])."""
    return not f.variable and 1 <= f.row_bytes <= COLUMN_MAX_ROW_BYTES


def column_block_rows(row_bytes: int) -> int:
    """Rows per checksummed block of a column of ``row_bytes`` per record.

    The largest power of two whose block fits COLUMN_BLOCK_BYTES, at least 1 (NOTE [column layout]).
    """
    rows = 1
    while rows * 2 * row_bytes <= COLUMN_BLOCK_BYTES:
        rows *= 2
    return rows


class ColumnDesc(NamedTuple):
    """One column of a version 3 shard (docs/format.md, "Column table")."""

    field: int  # the field's position in the schema
    row_bytes: int
    block_rows: int
    offset: int  # of the value of record 0, from the payload's start
    checksums: tuple[int, ...]  # one per block, the shard's checksum of the block's bytes


def encode_column_table(columns: Iterable[ColumnDesc]) -> bytes:
    """The column table bytes of a version 3 shard (docs/format.md, "Column table")."""
    columns = list(columns)
    parts = [COLUMN_TABLE_HEAD.pack(len(columns), 0)]
    parts += [COLUMN_DESC.pack(c.field, c.row_bytes, c.block_rows, 0, c.offset) for c in columns]
    parts += [struct.pack(f"<{len(c.checksums)}Q", *c.checksums) for c in columns]
    return b"".join(parts)


def decode_column_table(data: bytes | memoryview, num_records: int) -> list[ColumnDesc]:
    """The columns a version 3 column table lists.

    Checks the table's framing only (the native reader validates a shard); raises
    ShardFormatError if it is malformed.
    """
    if len(data) < COLUMN_TABLE_HEAD.size:
        raise ShardFormatError("column table truncated")
    n, _ = COLUMN_TABLE_HEAD.unpack_from(data, 0)
    pos = COLUMN_TABLE_HEAD.size + n * COLUMN_DESC.size
    if len(data) < pos:
        raise ShardFormatError("column table truncated")
    out = []
    for c in range(n):
        field, row_bytes, block_rows, _, offset = COLUMN_DESC.unpack_from(data, COLUMN_TABLE_HEAD.size + c * COLUMN_DESC.size)
        if block_rows < 1 or block_rows & (block_rows - 1):
            raise ShardFormatError(f"column table: column {c} has {block_rows} block rows, not a power of two")
        blocks = -(-num_records // block_rows)
        if len(data) < pos + 8 * blocks:
            raise ShardFormatError("column table truncated")
        out.append(ColumnDesc(field, row_bytes, block_rows, offset, struct.unpack_from(f"<{blocks}Q", data, pos)))
        pos += 8 * blocks
    if pos != len(data):
        raise ShardFormatError("column table has trailing bytes")
    return out


class ShardHeader(NamedTuple):
    """The fields of a shard header (docs/format.md, "Header"), offsets from the file start."""

    version: int
    header_size: int
    num_records: int
    num_fields: int
    index_entry_size: int
    schema_offset: int
    schema_size: int
    index_offset: int
    index_size: int
    payload_offset: int
    payload_size: int
    file_size: int
    schema_checksum: int
    index_checksum: int
    columns_size: int  # version 3: bytes of the column table (between schema and index); else 0
    columns_checksum: int


def unpack_header(data: bytes | memoryview) -> ShardHeader:
    """The header at the start of a shard's bytes.

    Checks the magic only (ShardFormatError if it or the size is wrong): the native reader
    is what validates a shard (checksums, sizes); this serves tools that read shards it wrote.
    """
    if len(data) < HEADER_SIZE:
        raise ShardFormatError(f"a shard header is {HEADER_SIZE} bytes, got {len(data)}")
    magic, *values = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ShardFormatError(f"not a pyloader shard (magic {bytes(magic)!r})")
    h = ShardHeader(*values)
    return h if h.version == 3 else h._replace(columns_size=0, columns_checksum=0)  # reserved below 3


def shard_columns(data: bytes | memoryview, header: ShardHeader) -> list[ColumnDesc]:
    """The columns of a shard whose bytes (at least up to its index) are ``data``: none below version 3.

    Checks the column table's checksum; raises ShardFormatError if it is corrupt or malformed.
    """
    if header.version != 3:
        return []
    start = header.schema_offset + header.schema_size
    table = data[start : start + header.columns_size]
    if len(table) != header.columns_size or shard_checksum(3)(table) != header.columns_checksum:
        raise ShardFormatError("column table checksum mismatch (corrupt column table)")
    return decode_column_table(table, header.num_records)


# ---------------------------------------------------------------------------------------
# Manifest. NOTE [manifest checksum]: the file is
#   {"checksum":"<16 hex digits>","manifest":<body>}\n
# where the checksum is XXH64 (seed 0) of the exact bytes of <body>. So the file is plain
# JSON, yet any change to the body, even one that still parses, is detected.
_MANIFEST_PREFIX = b'{"checksum":"'
_MANIFEST_MID = b'","manifest":'
_MANIFEST_SUFFIX = b"}\n"
_PREFIX_LEN = len(_MANIFEST_PREFIX) + 16 + len(_MANIFEST_MID)
_HEX16 = re.compile(rb"[0-9a-f]{16}")


def dump_manifest(body: Mapping[str, Any], xxh64: Hasher) -> bytes:
    """The manifest file's bytes for ``body``, framed with its checksum (NOTE [manifest checksum])."""
    raw = json.dumps(body, separators=(",", ":"), sort_keys=False).encode("utf-8")
    digest = f"{xxh64(raw):016x}".encode()
    return _MANIFEST_PREFIX + digest + _MANIFEST_MID + raw + _MANIFEST_SUFFIX


def manifest_body(data: bytes, where: str, xxh64: Hasher) -> bytes:
    """The body bytes of manifest ``data`` once its framing and checksum check out.

    Cheap (one XXH64 pass, no JSON): what a copy of a manifest is checked with before it
    is stored or reused. Raises ManifestError naming ``where``.
    """
    if (
        len(data) < _PREFIX_LEN + len(_MANIFEST_SUFFIX)
        or not data.startswith(_MANIFEST_PREFIX)
        or data[len(_MANIFEST_PREFIX) + 16 : _PREFIX_LEN] != _MANIFEST_MID
        or not data.endswith(_MANIFEST_SUFFIX)
    ):
        raise ManifestError(f"manifest {where!r}: not a pyloader manifest (bad framing)")
    raw = data[_PREFIX_LEN : -len(_MANIFEST_SUFFIX)]
    digest = data[len(_MANIFEST_PREFIX) : len(_MANIFEST_PREFIX) + 16]
    if not _HEX16.fullmatch(digest):
        raise ManifestError(f"manifest {where!r}: malformed checksum (16 lowercase hex digits expected)")
    if xxh64(raw) != int(digest, 16):
        raise ManifestError(f"manifest {where!r}: checksum mismatch (corrupt manifest)")
    return raw


def parse_manifest(data: bytes, where: str, xxh64: Hasher, *, identity: bool = False) -> dict[str, Any]:
    """Checks and parses manifest bytes; raises ManifestError naming ``where``.

    Every entry is validated strictly (NOTE [untrusted manifest]). ``identity``: the
    manifest was built by pyloader itself from a listing of objects (Parquet files), so
    ``"content_hash": false`` is allowed; a manifest read from a dataset never may say it.
    """
    raw = manifest_body(data, where, xxh64)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ManifestError(f"manifest {where!r}: invalid JSON: {e}") from None
    _validate_manifest(body, where, identity)
    return body


# NOTE [untrusted manifest]: a manifest comes from whoever serves the dataset, and its
# entries become cache file names, download sizes and plan arrays, so each is checked at
# parse time before anything uses it:
# * a shard's ``path`` is relative: "/"-separated components, none empty, "." or "..",
#   none longer than NAME_MAX (255 bytes) and the whole at most PATH_MAX_BYTES; no NUL,
#   backslash or control character (C0, DEL, C1) anywhere;
# * its ``xxh64`` is exactly 16 lowercase hex digits (it is part of the cached name);
# * ``bytes`` is at least a shard header and at most MAX_SHARD_BYTES; ``records`` is at
#   most the bytes after the header (every record takes at least one stored byte) and the
#   total at most MAX_RECORDS;
# * ``"content_hash": false`` (name objects by identity, check only Parquet magic) is
#   accepted only where pyloader built the manifest itself (``identity=True``): a
#   manifest read from a URL or a folder can never turn the content check off.
# The cache then builds every path from these components alone and checks that each
# stays in its own directory (pyloader.remote.cache, NOTE [cache paths]).
NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4096
MAX_SHARD_BYTES = 1 << 40  # 1 TiB: far above any shard a writer makes (default 64 MiB)
MAX_RECORDS = 1 << 40
_BAD_PATH_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f\\]")
_HEX16_STR = re.compile(r"[0-9a-f]{16}")


def _validate_manifest(body: Any, where: str, identity: bool = False) -> None:
    def bad(msg: str) -> ManifestError:
        return ManifestError(f"manifest {where!r}: {msg}")

    if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
        raise bad("not a pyloader-shards manifest")
    if body.get("version") != MANIFEST_VERSION:
        raise bad(f"unsupported version {body.get('version')!r}")
    if not isinstance(body.get("fields"), list) or not isinstance(body.get("shards"), list):
        raise bad("missing fields or shards")
    if "content_hash" in body:
        if not identity:
            raise bad('"content_hash" is not allowed in a dataset\'s manifest: pyloader checks every shard it '
                      "downloads against its xxh64 (only the manifests pyloader builds for Parquet files name "
                      "objects by identity); rewrite the manifest without it")
        if body["content_hash"] is not False:
            raise bad(f'"content_hash" must be false, got {body["content_hash"]!r}')
    total = _valid_records(body["shards"])
    if total is None:  # some entry is invalid: the per-entry checks below say which and why
        total = 0
        for i, s in enumerate(body["shards"]):
            _check_shard_entry(i, s, bad)
            total += s["records"]
    rec = body.get("records")
    if type(rec) is not int or rec != total:
        raise bad("total record count disagrees with the shard entries")
    if total > MAX_RECORDS:
        raise bad(f"{total} records in all: more than the {MAX_RECORDS} a manifest may list")


def _unsafe_path(p: str) -> str | None:
    """Why shard path ``p`` is unsafe to use as a relative path (NOTE [untrusted manifest]); None if it is safe."""
    if not p:
        return "it is empty"
    if p[0] == "/":
        return "it is absolute"
    if _BAD_PATH_CHARS.search(p):
        return "it holds a NUL, backslash or control character"
    try:
        b = p.encode("utf-8")
    except UnicodeEncodeError:
        return "it is not valid Unicode"
    if len(b) > PATH_MAX_BYTES:
        return f"it is longer than {PATH_MAX_BYTES} bytes"
    for c in p.split("/"):
        if c in ("", ".", ".."):
            return f"it has a component {c!r}" if c else "it has an empty component"
        if len(c) > NAME_MAX_BYTES // 4 and len(c.encode("utf-8")) > NAME_MAX_BYTES:
            return f"a component is longer than {NAME_MAX_BYTES} bytes"
    return None


def _check_shard_entry(i: int, s: Any, bad: Callable[[str], ManifestError]) -> None:
    if not isinstance(s, dict):
        raise bad(f"shard entry {i} is not an object")
    for key, typ in (("path", str), ("records", int), ("bytes", int), ("xxh64", str)):
        if not isinstance(s.get(key), typ) or isinstance(s.get(key), bool):
            raise bad(f"shard entry {i} lacks a valid {key!r}")
    why = _unsafe_path(s["path"])
    if why is not None:
        raise bad(f"shard entry {i} has an unsafe path {s['path']!r}: {why}")
    if not _HEX16_STR.fullmatch(s["xxh64"]):
        raise bad(f"shard entry {i} ({s['path']!r}): xxh64 {s['xxh64']!r} is not 16 lowercase hex digits")
    if not HEADER_SIZE <= s["bytes"] <= MAX_SHARD_BYTES:
        raise bad(f"shard entry {i} ({s['path']!r}): size {s['bytes']} bytes is outside "
                  f"[{HEADER_SIZE}, {MAX_SHARD_BYTES}]")
    if not 0 <= s["records"] <= s["bytes"] - HEADER_SIZE:
        raise bad(f"shard entry {i} ({s['path']!r}): {s['records']} records cannot fit in "
                  f"{s['bytes']} bytes")


def _valid_records(shards: list[Any]) -> int | None:
    """The total record count if every shard entry is valid, else None.

    The checks of ``_check_shard_entry`` done a column at a time, so that a manifest of
    100,000 shards validates in milliseconds; which entry is bad is left to it.
    """
    if not shards:
        return 0
    if set(map(type, shards)) != {dict}:
        return None
    try:
        paths = [s["path"] for s in shards]
        records = [s["records"] for s in shards]
        sizes = [s["bytes"] for s in shards]
        sums = [s["xxh64"] for s in shards]
    except KeyError:
        return None
    # type() is exact: a bool (an int subclass) is not a valid count.
    if (set(map(type, paths)) != {str} or set(map(type, sums)) != {str} or set(map(type, records)) != {int}
            or set(map(type, sizes)) != {int}):
        return None
    if min(records) < 0 or min(sizes) < HEADER_SIZE or max(sizes) > MAX_SHARD_BYTES:
        return None
    if any(r > b - HEADER_SIZE for r, b in zip(records, sizes)):
        return None
    joined = "".join(sums)
    if len(joined) != 16 * len(sums) or not _HEX_RUN.fullmatch(joined):
        return None
    # One pass over every path joined by "/": a non-ASCII or bad character, an absolute
    # path, an empty, "." or ".." component or a long path sends them to the exact check.
    joined = "/" + "/".join(paths) + "/"
    if (not joined.isascii() or _BAD_PATH_CHARS.search(joined) or "//" in joined or "/./" in joined
            or "/../" in joined or max(map(len, paths)) > NAME_MAX_BYTES // 4):
        if any(map(_unsafe_path, paths)):
            return None
    return sum(records)


_HEX_RUN = re.compile(r"[0-9a-f]*")


def _manifest_field_spec(entry: Mapping[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """The ``(dtype, shape)`` spec of a manifest field entry, its optional ``"encoding"`` applied."""
    dtype, shape = entry["dtype"], tuple(entry["shape"])
    if isinstance(dtype, str) and dtype in IMAGE_ENCODINGS:  # a spelling make_field takes, not a dtype
        raise SchemaError(f"field {entry['name']!r}: dtype {dtype!r} is an encoding; the manifest stores "
                          f'"dtype": "bytes", "encoding": {json.dumps(dtype)}')
    if "encoding" not in entry:
        return dtype, shape
    enc = entry["encoding"]
    if not isinstance(enc, str) or enc not in IMAGE_ENCODINGS:
        raise SchemaError(f"field {entry['name']!r}: unknown encoding {enc!r}; "
                          f"supported: {', '.join(IMAGE_ENCODINGS)}")
    if dtype != "bytes":
        raise SchemaError(f"field {entry['name']!r}: encoding {enc!r} applies to a bytes field only, "
                          f"not to dtype {dtype!r}")
    return enc, shape


def fields_from_manifest(body: Mapping[str, Any], where: str) -> list[Field]:
    """The Fields a parsed manifest lists; raises ManifestError naming ``where`` if they are invalid.

    A field entry is ``{"name", "dtype", "shape"}`` plus an optional ``"encoding"`` (one of
    IMAGE_ENCODINGS, on a bytes field only: NOTE [field encoding]).
    """
    try:
        return make_fields({f["name"]: _manifest_field_spec(f) for f in body["fields"]})
    except (KeyError, TypeError, SchemaError) as e:
        raise ManifestError(f"manifest {where!r}: invalid fields: {e}") from None


def manifest_path(path: str | os.PathLike[str]) -> str:
    """The manifest file of a dataset given as its folder or as the manifest (a ``.json`` path) itself."""
    p = os.fspath(path)
    return p if p.endswith(".json") else os.path.join(p, MANIFEST_NAME)


__all__ = ["MAGIC", "VERSION", "SHARD_VERSIONS", "CHECKSUM_NAMES", "MANIFEST_VERSION", "HEADER_SIZE",
           "INDEX_ENTRY_SIZE", "COLUMN_MAX_ROW_BYTES", "COLUMN_BLOCK_BYTES", "COLUMN_TABLE_HEAD", "COLUMN_DESC",
           "CODEC_RAW", "CODEC_LZ4", "MANIFEST_NAME", "MANIFEST_FORMAT", "DTYPES", "IMAGE_ENCODINGS", "INDEX_DTYPE",
           "MAX_FIELD_BYTES", "DEFAULT_MAX_VALUE_BYTES", "Hasher", "shard_checksum", "normalize_dtype", "Field",
           "make_field", "make_fields", "encode_schema", "pack_header", "is_column_field", "column_block_rows",
           "ColumnDesc", "encode_column_table", "decode_column_table", "ShardHeader", "unpack_header", "shard_columns",
           "dump_manifest", "manifest_body", "parse_manifest", "NAME_MAX_BYTES", "PATH_MAX_BYTES", "MAX_SHARD_BYTES",
           "MAX_RECORDS", "fields_from_manifest", "manifest_path"]
