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
    """No batch arrived within the DataLoader's ``timeout`` (torch raises RuntimeError too).

    NOTE [timeout message]: ``timeout`` is torch's argument, so its message is torch's
    first, word for word: "DataLoader timed out after N seconds", N printed as the user gave
    it (``check_seconds`` keeps an int an int, so code written for torch that matches an
    integer N still matches). Then, after a colon, what pyloader was waiting for: the stage,
    the batch, the shards and the bytes that arrived. Every stream that takes the loader's
    ``timeout`` raises through ``after``, in Python; the native core's own timeout text
    (``csrc/bindings/interruptible_wait.h``) is replaced where it is caught.
    """

    @classmethod
    def after(cls, seconds: float, detail: str) -> LoaderTimeoutError:
        """The message torch gives for a ``timeout`` of ``seconds``, then ``detail``."""
        return cls(f"DataLoader timed out after {seconds} seconds: {detail}")


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
    """A remote object changed since its manifest was read (its size or identity differs): re-open the dataset."""


class RemoteCorruptError(FetchError):
    """A remote shard's bytes do not match the manifest's checksum, downloaded twice with the same result.

    The object is corrupt at the source or the manifest that lists it is stale: re-opening the
    dataset does not help; re-writing and re-uploading that shard (or its manifest) does.
    """


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


class PlanMemoryError(PyloaderError, MemoryError):
    """An epoch's plan would not fit in memory: the manifest claims more records than this machine can plan."""


class FrameworkPathError(PyloaderError, ValueError):
    """A training framework reads a pyloader dataset in a way that would lose or repeat samples.

    The message names the framework's loader and the fix (docs/integrations.md).
    """


class SlowPathWarning(UserWarning):
    """pyloader's native pipeline does not run for a dataset a framework reads sample by sample."""


class TransformWorkerError(PyloaderError, RuntimeError):
    """A transform worker process exited without reporting an error (killed, out of memory).

    Its message and attributes say which: ``worker`` (index), ``pid``, ``exitcode`` (minus
    the signal number when killed), and the ``batches`` and ``samples`` (indices) it held.
    """


# -- exit codes ------------------------------------------------------------------------------
# NOTE [exit codes]: every ``pyloader`` command exits with the code of its condition, from this
# one table, so a script can tell what happened whichever command it ran:
#   0 done; 1 failed or done in part (data that cannot be read, converted or downloaded: a
#   corrupt or missing shard, a source that does not convert); 2 bad usage (an option, a path
#   or URL that holds no dataset, a malformed manifest); 3 the cache cannot take the data (size
#   limit too small, disk full, read-only); 4 cannot reach the data (no answer, refused, timed
#   out, credentials missing or denied); 5 verification found a record that differs from its
#   source; 130 interrupted. ``exit_code(exc)`` maps an exception that ends a command to its
#   code (the first class in ``EXIT_CODES`` it is an instance of).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CACHE, EXIT_UNREACHABLE, EXIT_MISMATCH, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 5, 130
EXIT_HELP = ("Exit codes: 0 done; 1 failed or done in part; 2 bad usage, path, URL or manifest; 3 the cache cannot "
             "take the data; 4 cannot reach the data (no answer, refused, timed out, credentials missing or denied); "
             "5 verification found a difference; 130 interrupted.")


EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (KeyboardInterrupt, EXIT_INTERRUPTED),
    (VerifyError, EXIT_MISMATCH),
    (CacheLimitError, EXIT_CACHE),
    (CacheError, EXIT_CACHE),
    (ManifestError, EXIT_USAGE),  # no manifest (a path or URL that holds no dataset), or a malformed one
    (RemoteChangedError, EXIT_FAILED),
    (RemoteCorruptError, EXIT_FAILED),
    (FetchNotFoundError, EXIT_USAGE),  # the URL names nothing
    (FetchError, EXIT_UNREACHABLE),  # after retries, refused, timed out, denied
    (PyloaderError, EXIT_FAILED),
    (ValueError, EXIT_USAGE),  # a bad argument found after parsing
    (TypeError, EXIT_USAGE),
    (OSError, EXIT_FAILED),
)


def exit_code(exc: BaseException) -> int | None:
    """The exit code of a command ended by ``exc`` (NOTE [exit codes]); None for an exception no row covers.

    The first row of ``EXIT_CODES`` whose class ``exc`` is an instance of; a ``FetchError``
    whose errno says the object is missing (``ENOENT``) is a usage error, one cancelled
    (``ECANCELED``) an interruption.
    """
    if isinstance(exc, FetchError) and not isinstance(exc, (RemoteChangedError, RemoteCorruptError)):
        if exc.errno == _errno.ENOENT:
            return EXIT_USAGE
        if exc.errno == _errno.ECANCELED:
            return EXIT_INTERRUPTED
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return None


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
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "EXIT_CACHE",
    "EXIT_UNREACHABLE",
    "EXIT_MISMATCH",
    "EXIT_INTERRUPTED",
    "EXIT_HELP",
    "EXIT_CODES",
    "exit_code",
    "PyloaderError",
    "ConvertError",
    "VerifyError",
    "FetchError",
    "FetchNotFoundError",
    "FetchPermissionError",
    "RemoteChangedError",
    "RemoteCorruptError",
    "CacheError",
    "CacheLimitError",
    "ParquetReadError",
    "ResumeError",
    "ImageDecodeError",
    "CollateError",
    "SharedMemoryError",
    "TransformWorkerError",
    "ThreadStartError",
    "FrameworkPathError",
    "PlanMemoryError",
    "SlowPathWarning",
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
