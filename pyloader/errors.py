"""pyloader's exception classes.

Each subclasses the built-in exception a caller would naturally catch, so
``except ValueError`` / ``except OSError`` keep working. Errors raised by the native
core carry the shard path, record index and field name that failed.
"""

from __future__ import annotations

import errno as _errno
from typing import Any


class _MessageOnly:
    """For an OSError built as ``cls(errno, message)``: ``str()`` is the message alone.

    OSError's own ``str()`` would prefix ``[Errno N]`` to a message that already says what failed.
    """

    args: tuple[Any, ...]

    def __str__(self) -> str:
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()


class PyloaderError(Exception):
    """Base class of every pyloader error."""

    shard: str | None = None
    record: int | None = None
    field: str | None = None


class ShardFormatError(PyloaderError, ValueError):
    """A shard (or manifest) is malformed: bad magic, version, sizes, index or block."""


class ShardCorruptError(ShardFormatError):
    """A checksum did not match: the stored bytes were altered."""


class SchemaError(PyloaderError, ValueError):
    """A sample or a shard does not match the dataset's schema."""


class ManifestError(ShardFormatError):
    """The dataset manifest is missing, malformed or corrupt."""


class ManifestNotFoundError(_MessageOnly, ManifestError, FileNotFoundError):
    """No manifest where a dataset was named (a local path or a remote URL).

    Both ``except ManifestError`` and ``except FileNotFoundError`` catch it.
    """

    def __init__(self, err: int, message: str) -> None:
        super().__init__(err, message)
        # ValueError precedes OSError in the MRO, so OSError does not fill these itself.
        self.errno, self.strerror = err, message



class ShardIOError(PyloaderError, OSError):
    """A shard could not be opened or mapped."""


class LoaderStateError(PyloaderError, RuntimeError):
    """An iterator was used after close or in a forked child."""


class LoaderTimeoutError(PyloaderError, RuntimeError):
    """No batch arrived within the DataLoader's ``timeout`` (torch raises RuntimeError too)."""


class DeviceError(PyloaderError, RuntimeError):
    """A CUDA driver call failed (or no driver is available for a device that was asked for)."""


class ConvertError(PyloaderError, ValueError):
    """A source cannot be converted; the message names the file, column/field and row."""


class VerifyError(ConvertError):
    """``verify`` found a converted record that differs from its source record."""


class FetchError(_MessageOnly, PyloaderError, OSError):
    """A remote object could not be fetched (after retries, or at once for a permanent error)."""

    url: str | None = None
    transient: bool = False



class RemoteChangedError(FetchError):
    """A remote shard no longer matches the manifest (size or checksum): re-read the manifest."""


class CacheError(_MessageOnly, PyloaderError, OSError):
    """The cache directory cannot take a shard: full, read-only or unusable."""



class CacheLimitError(PyloaderError, ValueError):
    """The cache's size limit cannot hold the shards that must be on disk at once."""


class ParquetReadError(PyloaderError, ValueError):
    """A Parquet file or row group cannot be read or does not match the dataset's columns."""


class ResumeError(PyloaderError, ValueError):
    """A loader state does not fit this loader: another dataset, order or a malformed state."""


# Kind codes are those of csrc/core/errors.h (ErrorKind).
_KINDS: dict[int, type[PyloaderError]] = {
    0: ShardFormatError,
    1: ShardCorruptError,
    2: SchemaError,
    3: ShardIOError,
    4: LoaderStateError,
    5: LoaderTimeoutError,
    6: DeviceError,
}


def from_native(kind: int, message: str, shard: str, record: int, field: str, sys_errno: int) -> PyloaderError:
    """Builds the Python exception for a native LoaderError (called from the bindings)."""
    cls = _KINDS.get(kind, PyloaderError)
    if cls is ShardIOError:
        if sys_errno == _errno.ENOENT:
            exc: PyloaderError = _ShardNotFound(sys_errno, message)
        else:
            exc = ShardIOError(sys_errno, message)
    else:
        exc = cls(message)
    exc.shard = shard or None
    exc.record = record if record >= 0 else None
    exc.field = field or None
    return exc


class _ShardNotFound(_MessageOnly, ShardIOError, FileNotFoundError):
    """A shard file does not exist."""



__all__ = [
    "PyloaderError",
    "ConvertError",
    "VerifyError",
    "FetchError",
    "RemoteChangedError",
    "CacheError",
    "CacheLimitError",
    "ParquetReadError",
    "ResumeError",
    "ShardFormatError",
    "ShardCorruptError",
    "SchemaError",
    "ManifestError",
    "ManifestNotFoundError",
    "ShardIOError",
    "LoaderStateError",
    "LoaderTimeoutError",
    "DeviceError",
]
