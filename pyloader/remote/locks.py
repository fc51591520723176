"""Lock files of the node cache: flock on whole files, OFD locks on bytes, the space lock.

Every lock file is opened through ``open_lockfile`` and closed through ``close_lockfile``,
so a forked child drops its copies at once (NOTE [lock files across fork]). A filesystem
whose flock or fcntl locks fail outright is one whose locks do nothing: the cache runs
without them (See NOTE [cache publish] in pyloader/remote/cache.py). Lock files are never
opened through a symbolic link (See NOTE [cache paths] in pyloader/remote/cache.py).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time

from ..errors import CacheError

__all__ = ["LOCK_POLL_S", "NO_LOCKS", "Flock", "SpaceLock", "byte_held", "byte_lock", "cache_error",
           "close_lockfile", "open_lockfile", "same_file", "try_flock"]

LOCK_POLL_S = 0.02
# flock/fcntl errors that mean "this filesystem has no locks": the cache then runs
# without them (NOTE [cache publish]); EOPNOTSUPP is ENOTSUP on Linux.
NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})


def cache_error(err: int, message: str, shard: str | None = None) -> CacheError:
    """A CacheError (``err``, ``message``) about ``shard`` (None: about no one shard)."""
    e = CacheError(err, message)
    e.shard = shard
    return e


# NOTE [lock files across fork]: flock and OFD locks belong to an open file description,
# which a forked child shares through the descriptors it inherits. A child forked while a
# thread of the parent held a lock file open -- a download's shard lock, the space lock, an
# evictor's try-lock -- kept that lock held after the parent closed its descriptor: the
# child's own fetcher then timed out waiting for a lock that only its inherited copy held,
# and the parent could not take it again until the child exited. Every lock-file descriptor
# is therefore entered here while it is open, and a forked child closes its copies at once.
# An open and its entry, and a removal and its close, happen under _LOCK_FDS_MU, which a fork
# takes first: a thread between open(2) and the entry (waiting for the GIL after the call),
# or between the removal and close(2), would otherwise hand the child a descriptor it does
# not know of -- with 3 threads locking in a loop, 4 of 5 forks inherited one.
_LOCK_FDS: set[int] = set()
_LOCK_FDS_MU = threading.Lock()


def open_lockfile(path: str) -> int | None:
    """An fd for flock on ``path`` (created if possible); None if it cannot exist (read-only dir).

    Never through a symlink (NOTE [cache paths]): a link planted at ``path`` raises CacheError.
    Close it with ``close_lockfile`` (NOTE [lock files across fork]).
    """
    with _LOCK_FDS_MU:
        fd = _open_lock(path)
        if fd is not None:
            _LOCK_FDS.add(fd)
    return fd


def _open_lock(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_error(path) from None
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOSPC, errno.EDQUOT):
            raise cache_error(e.errno or errno.EIO, f"cannot open lock file {path}: {os.strerror(e.errno or 0)}") \
                from None
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e2:
        if e2.errno == errno.ELOOP:
            raise _link_error(path) from None
        return None


def close_lockfile(fd: int) -> None:
    """Closes a descriptor from ``open_lockfile`` (NOTE [lock files across fork])."""
    with _LOCK_FDS_MU:
        _LOCK_FDS.discard(fd)
        os.close(fd)


def _close_lockfiles_in_child() -> None:
    # See NOTE [lock files across fork]: the parent's locks stay the parent's. The mutex the
    # fork took is released here, by the child's only thread.
    for fd in list(_LOCK_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCK_FDS.clear()
    _LOCK_FDS_MU.release()


os.register_at_fork(before=_LOCK_FDS_MU.acquire, after_in_parent=_LOCK_FDS_MU.release,
                    after_in_child=_close_lockfiles_in_child)


def _link_error(path: str) -> CacheError:
    return cache_error(errno.ELOOP, f"{path} is a symbolic link: pyloader writes no file of its cache through a "
                        "link; remove it (and check who can write to the cache directory: docs/security.md)")



def same_file(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st, fst = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def try_flock(fd: int, op: int) -> bool:
    """A non-blocking flock: False if another holder has it; True if taken (or flock does nothing here)."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in NO_LOCKS:
            return True  # no locks on this filesystem: run without (NOTE [cache publish])
        raise


def _wait_flock(fd: int, op: int, timeout: float, cancel: threading.Event | None,
                poll: tuple[float, float] = (LOCK_POLL_S, 0.25)) -> bool:
    """Polls a non-blocking flock so a cancel or a timeout is seen; True once locked.

    ``poll``: (first, longest) sleep between tries, growing 1.5x.
    """
    deadline = time.monotonic() + timeout
    delay, cap = poll
    while not try_flock(fd, op):
        if cancel is not None and cancel.is_set():
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 1.5, cap)
    return True


def _lock_fd(path: str, op: int, timeout: float, cancel: threading.Event | None,
             poll: tuple[float, float] = (LOCK_POLL_S, 0.25)) -> int | None:
    """An fd holding flock ``op`` on ``path``; None if the file cannot exist (read-only cache).

    Lock files are removed only by ``clear`` (while it holds them), so after locking we
    check that the path still names the inode we locked, and retry if it does not.
    """
    while True:
        fd = open_lockfile(path)
        if fd is None:
            return None
        if not _wait_flock(fd, op, timeout, cancel, poll):
            close_lockfile(fd)
            what = "cancelled" if cancel is not None and cancel.is_set() else f"timed out after {timeout:.0f} s"
            raise cache_error(errno.ETIMEDOUT, f"{what} waiting for lock {path}")
        if same_file(path, fd):
            return fd
        close_lockfile(fd)


# -- byte-range locks on pins.lock (See NOTE [cache pins] in pyloader/remote/pins.py) ------
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)  # Linux values, for Pythons that lack the names
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_FLOCK = struct.Struct("hhqqi0q")  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
# Errors of an OFD lock call that mean no such locks here (an old kernel: EINVAL; a huge
# offset a filesystem cannot take: EOVERFLOW).
_NO_OFD_LOCKS = NO_LOCKS | {errno.EINVAL, errno.EOVERFLOW}


def byte_lock(fd: int, kind: int, offset: int, length: int = 1) -> bool:
    """``F_OFD_SETLK`` of ``kind`` (F_RDLCK, F_WRLCK, F_UNLCK) on a byte range, never waiting.

    False if another open file description holds a conflicting lock, or ``fd``'s mode
    cannot take a write lock (a read-only cache, where nothing can be removed anyway);
    True once set, or when this filesystem has no such locks.
    """
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, offset, length, 0))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EBADF):
            return False
        if e.errno in _NO_OFD_LOCKS:
            return True
        raise


def byte_held(fd: int, offset: int, length: int = 1) -> bool:
    """``F_OFD_GETLK``: whether any open file description other than ``fd``'s locks the range."""
    try:
        out = fcntl.fcntl(fd, _F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, length, 0))
    except OSError as e:
        if e.errno in _NO_OFD_LOCKS:
            return False
        raise
    return bool(_FLOCK.unpack(out)[0] != fcntl.F_UNLCK)


class Flock:
    """Context manager: an flock on a file, waited for with a timeout."""

    def __init__(self, path: str, op: int, timeout: float, cancel: threading.Event | None = None,
                 poll: tuple[float, float] = (LOCK_POLL_S, 0.25)) -> None:
        self.path, self.op, self.timeout, self.cancel, self.poll = path, op, timeout, cancel, poll
        self.fd: int | None = None

    def __enter__(self) -> Flock:
        fd = _lock_fd(self.path, self.op, self.timeout, self.cancel, self.poll)
        if fd is None:
            raise cache_error(errno.EROFS, f"cannot create lock file {self.path}: the cache directory is read-only")
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            close_lockfile(self.fd)  # closing the only fd of the open file description releases the flock
            self.fd = None


# One lock per cache root and process, taken before the space flock: the threads of a
# process queue on it in order and wake at once, instead of polling the flock (held for
# milliseconds) with growing sleeps while their downloads wait. New in a forked child.
_SPACE_MUTEXES: dict[str, threading.Lock] = {}
_SPACE_MUTEXES_MU = threading.Lock()


def _reset_space_mutexes() -> None:
    global _SPACE_MUTEXES_MU
    _SPACE_MUTEXES.clear()
    _SPACE_MUTEXES_MU = threading.Lock()


os.register_at_fork(after_in_child=_reset_space_mutexes)


def _space_mutex(root: str) -> threading.Lock:
    with _SPACE_MUTEXES_MU:
        return _SPACE_MUTEXES.setdefault(root, threading.Lock())


class SpaceLock:
    """The node-wide space lock: this process's mutex for the root, then the flock (polled from 1 ms)."""

    def __init__(self, root: str, timeout: float) -> None:
        self.root, self.timeout = root, timeout
        self._mutex = _space_mutex(root)
        self._flock: Flock | None = None

    def __enter__(self) -> SpaceLock:
        start = time.monotonic()
        if not self._mutex.acquire(timeout=self.timeout):
            raise cache_error(errno.ETIMEDOUT, f"timed out after {self.timeout:.0f} s waiting for the space lock "
                               f"of {self.root}")
        try:
            left = max(0.0, self.timeout - (time.monotonic() - start))
            self._flock = Flock(os.path.join(self.root, "space.lock"), fcntl.LOCK_EX, left, poll=(0.001, 0.02))
            self._flock.__enter__()
        except BaseException:
            self._mutex.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._flock is not None:
                self._flock.__exit__()
        finally:
            self._flock = None
            self._mutex.release()
