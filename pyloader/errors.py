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



class NotADatasetError(ManifestNotFoundError, NotADirectoryError):
    """A local path names no pyloader dataset: a file, or a folder of other data without a manifest.

    The message says what the path holds (Parquet, WebDataset tars, ...) and how to read or
    convert it. ``errno`` is ``ENOTDIR`` for a file, ``ENOENT`` for a folder; it is a
    ``ManifestNotFoundError``, a ``FileNotFoundError`` and a ``NotADirectoryError``.
    """


class ShardIOError(_MessageOnly, PyloaderError, OSError):
    """A shard could not be opened, mapped or fetched. Built as ``cls(errno, message)``."""


class ShardNotFoundError(ShardIOError, FileNotFoundError):
    """A shard file (or remote object) does not exist; errno ``ENOENT``.

    Both ``except ShardIOError`` and ``except FileNotFoundError`` catch it.
    """


class ShardPermissionError(ShardIOError, PermissionError):
    """A shard file (or remote object) may not be read; errno ``EACCES`` or ``EPERM``.

    Both ``except ShardIOError`` and ``except PermissionError`` catch it.
    """


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
    """A remote object could not be fetched (after retries, or at once for a permanent error).

    ``url`` is the object's URL, ``shard`` its path in the dataset (None for a manifest or
    listing), ``attempts`` how many requests were made, ``transient`` whether retrying
    later may succeed. Built as ``cls(errno, message)``; its ``str()`` is the message.
    """

    url: str | None = None
    transient: bool = False
    attempts: int = 0


class FetchNotFoundError(FetchError, FileNotFoundError):
    """The remote object does not exist (HTTP 404 or 410, S3 ``NoSuchKey``); errno ``ENOENT``.

    Both ``except FetchError`` and ``except FileNotFoundError`` catch it.
    """


class FetchPermissionError(FetchError, PermissionError):
    """The remote object may not be read (HTTP 401 or 403, S3 ``AccessDenied``); errno ``EACCES``.

    Both ``except FetchError`` and ``except PermissionError`` catch it.
    """


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


class ImageDecodeError(PyloaderError, ValueError):
    """An encoded image field could not be decoded; names the shard, record and field."""


class CollateError(PyloaderError, ValueError):
    """Transformed samples cannot be collated into one batch: names the field and the shapes or types."""


class SharedMemoryError(_MessageOnly, PyloaderError, OSError):
    """The process executor could not get shared memory (``/dev/shm`` full or missing). Built as ``cls(errno, message)``."""


class ThreadStartError(_MessageOnly, PyloaderError, OSError):
    """A native thread could not be started, usually ``EAGAIN`` under a limit on threads.

    The message names the limits that apply (``RLIMIT_NPROC``, a cgroup's ``pids.max``,
    ``kernel.threads-max``). Nothing the failed constructor started is left running. Built as
    ``cls(errno, message)``.
    """


class TransformWorkerError(PyloaderError, RuntimeError):
    """A transform worker process exited without reporting an error (killed, out of memory).

    Its message and attributes say which: ``worker`` (index), ``pid``, ``exitcode`` (minus
    the signal number when killed), and the ``batches`` and ``samples`` (indices) it held.
    """


# Kind codes are those of csrc/core/errors.h (ErrorKind).
_KINDS: dict[int, type[PyloaderError]] = {
    0: ShardFormatError,
    1: ShardCorruptError,
    2: SchemaError,
    3: ShardIOError,
    4: LoaderStateError,
    5: LoaderTimeoutError,
    6: DeviceError,
    7: ThreadStartError,
}


def from_native(kind: int, message: str, shard: str, record: int, field: str, sys_errno: int) -> PyloaderError:
    """Builds the Python exception for a native LoaderError (called from the bindings)."""
    cls = _KINDS.get(kind, PyloaderError)
    if cls is ShardIOError:
        err = sys_errno or _errno.EIO  # a failure without an OS error (a fetch) still has an errno
        exc: PyloaderError = _SHARD_IO_BY_ERRNO.get(err, ShardIOError)(err, message)
    elif cls is ThreadStartError:
        exc = ThreadStartError(sys_errno or _errno.EAGAIN, message)
    else:
        exc = cls(message)
    exc.shard = shard or None
    exc.record = record if record >= 0 else None
    exc.field = field or None
    return exc


_SHARD_IO_BY_ERRNO: dict[int, type[ShardIOError]] = {
    _errno.ENOENT: ShardNotFoundError,
    _errno.EACCES: ShardPermissionError,
    _errno.EPERM: ShardPermissionError,
}


__all__ = [
    "PyloaderError",
    "ConvertError",
    "VerifyError",
    "FetchError",
    "FetchNotFoundError",
    "FetchPermissionError",
    "RemoteChangedError",
    "CacheError",
    "CacheLimitError",
    "ParquetReadError",
    "ResumeError",
    "ImageDecodeError",
    "CollateError",
    "SharedMemoryError",
    "TransformWorkerError",
    "ThreadStartError",
    "ShardFormatError",
    "ShardCorruptError",
    "SchemaError",
    "ManifestError",
    "ManifestNotFoundError",
    "NotADatasetError",
    "ShardIOError",
    "ShardNotFoundError",
    "ShardPermissionError",
    "LoaderStateError",
    "LoaderTimeoutError",
    "DeviceError",
]
