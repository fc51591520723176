"""A remote dataset's manifest, fetched once per node however many processes open it.

NOTE [manifest once per node]: the node cache's copy of a dataset's manifest
(``<cache>/v1/<key>/manifest.json``, the file ``DatasetCache.store_manifest`` keeps)
stands for the remote one while it is *fresh*: its mtime is when a process on this node
last fetched the manifest, and it stays fresh for ``PYLOADER_MANIFEST_TTL`` seconds
(default 60; 0: always fetch). A fresh copy serves a process's *first* open of the URL,
without a request. Otherwise ``node_manifest`` takes the flock
``locks/manifest.json.lock`` and, for a first open, looks again: the process it waited
for may have just fetched it. If it must fetch, it checks the manifest (framing,
checksum and entries: NOTE [untrusted manifest]) and stores it: an atomic replace (NOTE
[atomic publish]), so a reader sees the old copy or the new one, never part of one; or,
when the bytes did not change, a new mtime. So:

* the 8 ranks of a node that start together send one GET, not 8;
* they read the same manifest even if the dataset is rewritten while they start, where
  separate fetches could give ranks different manifests, hence different plans;
* a process that opens the URL again (a notebook that rewrote the dataset) fetches
  again, and so does a job started more than the TTL after the last fetch: both see a
  rewritten dataset. A new process within the TTL reads the copy (set
  ``PYLOADER_MANIFEST_TTL=0`` for it to see a rewrite at once).

A copy that fails its checksum is fetched again. Where the copy cannot be shared the
manifest is fetched directly: a read-only cache, a filesystem without flock, or a lock
not acquired in the longest a fetch may take (``RetryPolicy``: the larger of ``deadline``
and ``throttle_deadline``, plus twice ``stall_timeout``), as its holder hung; a fresh
copy in a read-only cache is still used.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from typing import Any

import pyloader._C as _C

from ..errors import ManifestError
from ..format.encode import atomic_write
from ..format.spec import MANIFEST_NAME, parse_manifest
from .cache import dataset_key, normalize_url
from .fs import RetryPolicy, read_object
from .locks import close_lockfile, open_lockfile

TTL_ENV = "PYLOADER_MANIFEST_TTL"
DEFAULT_TTL_S = 60.0
_LOCK_POLL_S = 0.01
# The node copies this process has opened (See NOTE [manifest once per node]: a copy serves a
# process's first open of its URL only).
_opened: set[str] = set()
# Errors that mean the copy cannot be written or locked here: fetch without it.
_CANNOT_SHARE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ENOENT,
                           errno.ENOTDIR, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})


def manifest_ttl() -> float:
    """Seconds a node's copy of a manifest stands for the remote one: ``$PYLOADER_MANIFEST_TTL``, else 60.

    Raises ``ValueError`` unless the variable is a number >= 0.
    """
    v = os.environ.get(TTL_ENV, "")
    if v == "":
        return DEFAULT_TTL_S
    try:
        ttl = float(v)
    except ValueError:
        raise ValueError(f"{TTL_ENV} must be a number of seconds, got {v!r}") from None
    if not ttl >= 0:  # also rejects nan
        raise ValueError(f"{TTL_ENV} must be >= 0, got {v!r}")
    return ttl


def node_manifest(url: str, cache_root: str, storage_options: dict[str, Any] | None, policy: RetryPolicy, *,
                  ttl: float | None = None) -> bytes:
    """The manifest bytes of the remote dataset ``url``, shared by the processes of a node that open it together.

    ``cache_root`` is the cache's layout directory (``ShardCache.root``); ``ttl`` defaults
    to ``manifest_ttl()``. The bytes are checked as ``parse_manifest`` does (framing,
    checksum and every entry: NOTE [untrusted manifest]) before they are stored or used.
    NOTE [manifest once per node]. Raises ``FetchError`` as ``read_object`` does,
    ``ManifestError`` for a fetched manifest that fails those checks.
    """
    url = normalize_url(url)
    murl = url + "/" + MANIFEST_NAME
    ttl = manifest_ttl() if ttl is None else ttl
    if ttl <= 0:
        return _fetch(murl, storage_options, policy)
    ddir = os.path.join(cache_root, dataset_key(url))
    copy = os.path.join(ddir, MANIFEST_NAME)
    first = copy not in _opened
    _opened.add(copy)
    data = _fresh_copy(copy, ttl) if first else None
    if data is not None:
        return data
    # As long as a holder may take to fetch: retries, a stalled body, a throttling server.
    wait = max(policy.deadline, policy.throttle_deadline) + 2 * policy.stall_timeout
    fd = _lock(os.path.join(ddir, "locks", MANIFEST_NAME + ".lock"), wait)
    try:
        if fd is not None and first:
            data = _fresh_copy(copy, ttl)  # the holder we waited for may have fetched it
            if data is not None:
                return data
        data = _fetch(murl, storage_options, policy)
        _store(copy, data)
        return data
    finally:
        if fd is not None:
            close_lockfile(fd)  # the only fd of its open file description: the flock goes with it


def _fetch(murl: str, storage_options: dict[str, Any] | None, policy: RetryPolicy) -> bytes:
    data: bytes = read_object(murl, storage_options, policy)
    # Nothing that fails its checksum or its entries' checks is stored (NOTE [untrusted manifest]).
    parse_manifest(data, murl, _C.xxh64)
    return data


def _open_copy(path: str) -> Any:
    """The node's copy at ``path`` opened for reading, never through a link (ELOOP for one: docs/security.md)."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")


def _fresh_copy(path: str, ttl: float) -> bytes | None:
    """The copy at ``path`` if its mtime is within ``ttl`` seconds of now and its checksum holds."""
    try:
        with _open_copy(path) as f:
            age = time.time() - os.fstat(f.fileno()).st_mtime
            if abs(age) > ttl:  # a far-future mtime (a clock set back) counts as stale too
                return None
            data = f.read()
    except OSError:
        return None
    try:
        parse_manifest(data, path, _C.xxh64)
    except ManifestError:
        return None  # damaged on disk, or not a dataset's manifest: fetch again
    return data


def _lock(path: str, timeout: float) -> int | None:
    """An fd holding an exclusive flock on ``path``; None where it cannot be had (the caller fetches alone).

    Only ``DatasetCache.remove_if_idle`` removes lock files, and only while it holds them;
    after locking we check that ``path`` still names the file we locked.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = open_lockfile(path)  # never through a link; closed in a forked child
        except OSError as e:  # (a CacheError from open_lockfile keeps the errno)
            if e.errno in _CANNOT_SHARE:
                return None
            raise
        if fd is None:
            return None
        delay = _LOCK_POLL_S
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        close_lockfile(fd)
                        return None
                    time.sleep(delay)
                    delay = min(delay * 1.5, 0.1)
            st, fst = os.stat(path), os.fstat(fd)
            if (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino):
                return fd
        except OSError as e:
            close_lockfile(fd)
            if isinstance(e, FileNotFoundError):
                continue  # removed after we locked it: lock the new one
            if e.errno in _CANNOT_SHARE:
                return None
            raise
        close_lockfile(fd)


def _store(path: str, data: bytes) -> None:
    """Makes ``data`` the node's copy at ``path``, fetched now (skipped where the cache cannot be written)."""
    try:
        same = False
        try:
            with _open_copy(path) as f:
                same = os.fstat(f.fileno()).st_size == len(data) and f.read() == data
                if same:
                    os.utime(f.fileno())  # the mtime says when it was last fetched (the file, not a link)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
        if not same:
            atomic_write(path, [data])  # a link planted there is replaced, never followed
    except OSError as e:
        if e.errno not in _CANNOT_SHARE:
            raise


__all__ = ["TTL_ENV", "DEFAULT_TTL_S", "manifest_ttl", "node_manifest"]
