"""pyloader's exception classes.

Each subclasses the built-in exception a caller would naturally catch, so
``except ValueError`` / ``except OSError`` keep working. Errors raised by the native
core carry the shard path, record index and field name that failed.
"""

from __future__ import annotations

import errno as _errno


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


class ShardIOError(PyloaderError, OSError):
    """A shard could not be opened or mapped."""


class LoaderStateError(PyloaderError, RuntimeError):
    """An iterator was used after close or in a forked child."""


class LoaderTimeoutError(PyloaderError, RuntimeError):
    """No batch arrived within the DataLoader's ``timeout`` (torch raises RuntimeError too)."""


class DeviceError(PyloaderError, RuntimeError):
    """A CUDA driver call failed (or no driver is available for a device that was asked for)."""


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


class _ShardNotFound(ShardIOError, FileNotFoundError):
    """A shard file does not exist."""

    def __str__(self) -> str:  # OSError's default str() would prefix "[Errno 2]" twice
        return str(self.args[1]) if len(self.args) > 1 else super().__str__()


__all__ = [
    "PyloaderError",
    "ShardFormatError",
    "ShardCorruptError",
    "SchemaError",
    "ManifestError",
    "ShardIOError",
    "LoaderStateError",
    "LoaderTimeoutError",
    "DeviceError",
]
