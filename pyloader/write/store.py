"""Where convert writes a dataset: a local folder, or an fsspec URL (``s3://bucket/prefix``, ``memory://``).

NOTE [remote publish]: a dataset written to a URL is published file by file with one
PUT each (``pipe_file``), never a temp object renamed: object stores have no rename
(S3 would copy the bytes again), and a PUT is itself atomic: the object appears whole
or not at all (an interrupted multipart upload leaves no object). So what NOTE [atomic
publish] asks of a local folder holds: shards first, the manifest last, and a dataset
exists once its manifest does. A shard is built in memory (the encoder holds one
shard's payload anyway) and uploaded from there: nothing is staged on local disk.

The filesystem is made as the readers' (``pyloader.remote.fs.filesystem``) makes it:
``fsspec.core.url_to_fs(url, **storage_options)``, so the standard variables of each
backend apply (for S3: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``...).
A store pickles as its URL and options, and makes its own filesystem in each process
(convert's worker processes, a Dask cluster's workers).
"""

from __future__ import annotations

import errno
import functools
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ..errors import FetchError, FetchPermissionError
from ..format.encode import DatasetStore, LocalStore

_T = TypeVar("_T")

__all__ = ["RemoteStore", "is_url", "local_path", "open_store"]

# A process's filesystems, by (URL, options): each task of a worker pickles a store anew,
# and a new S3 client per task (its session, its connections) costs more than a small task.
_FILESYSTEMS: dict[tuple[str, str], tuple[Any, str]] = {}


def is_url(dst: str) -> bool:
    """True for an fsspec URL other than ``file://`` (which is a local folder)."""
    return "://" in dst and not dst.startswith("file://")


def local_path(dst: str) -> str:
    """``dst`` as a local path: a ``file://`` URL loses its scheme."""
    return dst[len("file://"):] if dst.startswith("file://") else dst


class RemoteStore:
    """A dataset under an fsspec URL; files are uploaded whole (NOTE [remote publish])."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.location = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self._fs: Any = None
        self._path = ""

    def __getstate__(self) -> dict[str, Any]:
        s = self.__dict__.copy()
        s["_fs"] = None  # each process makes its own (its connections and event loop are per process)
        return s

    @property
    def fs(self) -> Any:
        """The fsspec filesystem, made on first use in this process (one per URL and options)."""
        if self._fs is None:
            key = (self.location, json.dumps(self.storage_options, sort_keys=True, default=repr))
            made = _FILESYSTEMS.get(key)
            if made is None:
                import fsspec

                fs, path = fsspec.core.url_to_fs(self.location, **self.storage_options)
                made = _FILESYSTEMS[key] = (fs, path.rstrip("/"))
            self._fs, self._path = made
        return self._fs

    def path(self, name: str) -> str:
        """The filesystem's path of file ``name`` of the dataset."""
        _ = self.fs  # sets self._path
        return f"{self._path}/{name}"

    def url(self, name: str) -> str:
        """The URL of file ``name`` of the dataset, for messages."""
        return f"{self.location}/{name}"

    def _call(self, what: str, name: str, fn: Callable[[], _T]) -> _T:
        """``fn()``; a destination it cannot reach (no credentials, denied, no connection) raises ``FetchError``."""
        try:
            return fn()
        except Exception as e:
            err = _unreachable(f"{what} {self.url(name)}", self.location, e)
            if err is None:
                raise
            raise err from e

    def put(self, name: str, chunks: Sequence[Any]) -> None:
        """Uploads the file ``name`` in one PUT (NOTE [remote publish])."""
        data = chunks[0] if len(chunks) == 1 and isinstance(chunks[0], bytes) else b"".join(chunks)
        try:
            self._call("uploading", name, lambda: self.fs.pipe_file(self.path(name), data))
        except FetchError:
            raise
        except OSError as e:
            msg = f"uploading {self.url(name)}: {e.strerror or e}"
            raise (type(e)(msg) if e.errno is None else type(e)(e.errno, msg)) from e
        except Exception as e:  # botocore's and the backends' own errors
            raise OSError(f"uploading {self.url(name)}: {type(e).__name__}: {e}") from e

    def get(self, name: str) -> bytes | None:
        """The bytes of file ``name``, None if it does not exist."""
        try:
            data: bytes = self._call("reading", name, lambda: self.fs.cat_file(self.path(name)))
        except FileNotFoundError:
            return None
        return data

    def remove(self, names: Iterable[str]) -> None:
        """Deletes the files ``names``; ones already gone are skipped."""
        for name in names:
            try:
                self._call("removing", name, functools.partial(self.fs.rm_file, self.path(name)))
            except FileNotFoundError:
                pass

    def names(self) -> list[str]:
        """The names of the files directly under the URL (none if there is nothing there)."""
        fs = self.fs
        fs.invalidate_cache(self._path)  # a listing cached before this process's own writes is stale
        try:
            entries = self._call("listing", "", lambda: fs.ls(self._path, detail=True))
        except FileNotFoundError:
            return []
        return sorted(os.path.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file")


# What a backend raises when the destination cannot be reached: no credentials found,
# credentials refused, or no connection (botocore's, aiohttp's and the builtins' names).
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "NoAuthTokenError",
                   "DefaultCredentialsError", "RefreshError"}
_DENIED_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                 "AllAccessDisabled"}
_NO_CONNECTION = {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ClientConnectorError",
                  "ServerDisconnectedError", "ReadTimeoutError"}


def _unreachable(what: str, url: str, e: BaseException) -> FetchError | None:
    """The ``FetchError`` (exit code 4, NOTE [exit codes]) for a destination ``e`` says cannot be reached, else None."""
    chain: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in chain and len(chain) < 8:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    err: FetchError | None = None
    for x in chain:
        name = type(x).__name__
        resp = getattr(x, "response", None)
        code = str((resp.get("Error") or {}).get("Code", "")) if isinstance(resp, dict) else ""
        if name in _NO_CREDENTIALS:
            err = FetchPermissionError(errno.EACCES, f"{what}: no credentials to write to {url} ({name}: {x}); give "
                                       "them as the backend reads them (for S3: AWS_ACCESS_KEY_ID and "
                                       "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) or in storage_options=")
        elif code in _DENIED_CODES or isinstance(x, PermissionError):
            err = FetchPermissionError(errno.EACCES, f"{what}: access denied ({code or name}: {x}); check that the "
                                       f"credentials are right and may write to {url}")
        elif name in _NO_CONNECTION or isinstance(x, (ConnectionError, TimeoutError)):
            err = FetchError(errno.ECONNREFUSED, f"{what}: cannot reach the destination ({name}: {x}); check the "
                             "endpoint (for S3: AWS_ENDPOINT_URL, or endpoint_url in storage_options=) and that it "
                             "is up and reachable from here")
        if err is not None:
            err.url = url
            return err
    return None


def open_store(dst: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> DatasetStore:
    """The store of dataset ``dst``: a ``LocalStore`` for a path or ``file://`` URL, else a ``RemoteStore``.

    ``storage_options`` go to fsspec for a URL; for a local folder they must be empty.
    """
    s = os.fspath(dst)
    if is_url(s):
        return RemoteStore(s, storage_options)
    if storage_options:
        raise ValueError(f"storage_options apply to a URL, not to the local folder {s!r}")
    return LocalStore(local_path(s))
