"""The node-local shard cache: one verified copy of each remote shard per node.

Layout (``root`` is ``cache_dir`` argument, else ``$PYLOADER_CACHE_DIR``, else
``$XDG_CACHE_HOME/pyloader`` or ``~/.cache/pyloader``)::

    root/v1/space.lock                  flock: held while accounting space / evicting
    root/v1/<key>/url                   the dataset URL (key = XXH64 of the URL)
    root/v1/<key>/manifest.json         the manifest copy the shards below were checked against
    root/v1/<key>/shards/<name>         published shards; name = quote(path) + "." + manifest xxh64
                                        (a long quoted path is shortened: see NOTE [cache paths])
    root/v1/<key>/locks/<name>.lock     flock EX: held by the process downloading <name>
    root/v1/<key>/pins.lock             OFD read lock on one byte per shard a process may have mapped
    root/v1/<key>/tmp/<name>.<owner>.<pid>.<random>.part   a download in progress
    root/v1/<key>/discarded.log         one line per cached copy that failed a check and was removed

``<owner>`` is ``<host>-<boot>-<pidns>``: the writer's host name, the first 16 hex digits
of its kernel's boot id and the inode of its pid namespace, which is what a later
process needs to tell whether the writer is still alive (See NOTE [file owners] in
``pyloader/format/owner.py``; NOTE [cache publish]).

NOTE [cache paths]: every file the cache creates is under its dataset's directory, in a
name built from manifest entries that ``parse_manifest`` validated (NOTE [untrusted
manifest] in pyloader/format/spec.py): the shard path percent-quoted into one component
(``%2F`` for "/"), a dot and the 16 hex digits of its checksum; a quoted path that would
take the name past 255 bytes keeps its first 160 characters and adds ``~`` and the XXH64
of the whole path. ``DatasetCache`` checks each name is one component before it is used.
On a cache shared by several users a planted symlink could still redirect a write or a
read, so lock, pin, log and temp files are opened with ``O_NOFOLLOW`` (temps also
``O_EXCL``), a published shard counts only as a regular file (``lstat``), and the
dataset's directories are checked to be real directories, not links, before anything is
written in them (``_real_dir``); ``os.replace`` and ``os.unlink`` act on a link itself,
never on what it points to.

A shard's cached name carries the manifest's checksum, so a dataset rewritten at the
same URL never reuses a file verified against the old manifest: old and new copies are
never mixed. Everything is a plain file in ``root``; nothing lives in /dev/shm.

NOTE [cache publish]: a shard file appears under ``shards/`` only by ``os.replace`` of a
temp file that was (1) created (``O_EXCL``) under a name no other writer uses, (2)
exactly the manifest's size, (3) equal to the manifest's XXH64, (4) fsynced, and the
directory is fsynced after the rename. So a reader that sees the name sees a whole,
verified file; a partial file only ever exists under ``tmp/``. The shard's ``.lock``
flock makes it one download per node, but nothing depends on it: where flock does
nothing (some NFS, Lustre or GPFS mounts) two processes may download one shard at once,
each into its own temp, and the second rename replaces a verified file by an identical
one (a reader that opened the first keeps its inode). A writer removes only its own
temp. A temp whose writer died is reclaimed by its name's owner: at once if the owner
is this boot and pid namespace and its pid is gone (or a zombie), or an earlier boot of
this host (``owner_gone``: See NOTE [file owners]); otherwise (another host or pid
namespace, a name without an owner) once its
mtime is ``_STALE_TEMP_S`` (1 h) old. A live writer writes at least once per stall
timeout (30 s) or backoff (10 s), else gives up, so an hour-old temp has no live writer
(the hour also covers clock skew to a file server). Should its writer still be alive
anyway (stopped for an hour), it finds its temp gone at the rename and downloads again.
A temp in the older ``<name>.<pid>.<random>.part`` form is reclaimed when its pid is gone
here and nobody holds its shard's flock. Space for a download is reserved up front with
posix_fallocate, which turns a full disk into an immediate, clean error. A filesystem
whose flock or fcntl locks fail outright (ENOLCK, ENOTSUP, ENOSYS; EINVAL for OFD locks
on an old kernel) is treated as one whose locks do nothing.

A published file may still vanish between a reader's check and its open: evicted where
pins do not work (below), or removed by ``discard`` because it failed a check. A reader
that finds it gone calls ``ensure`` again, which downloads it again.

NOTE [cache pins]: a process pins a shard *before* checking that it is published and
keeps the pin while the shard may be mapped. A pin is a read lock on one byte of the
dataset's ``pins.lock``, at ``XXH64(cached file name) >> 2``, taken with an open file
description lock (``F_OFD_SETLK``). Each process opens ``pins.lock`` once per dataset
(``_PinFile``, shared by its threads, with a count per byte) however many shards it
pins, so pins cost no file descriptor per shard, and closes it when its last pin goes.
Eviction opens its own description, takes a non-blocking write lock on the byte (and
the shard's ``.lock`` flock) and skips the shard when either is held. OFD locks, unlike
classic fcntl locks, conflict between two descriptions of one process, so an evictor
sees its own process's pins, and closing some other descriptor of the file drops none.
The byte comes from the file name, not the shard's index, so processes holding
different manifests of one URL agree; two names on one byte (a 62-bit hash collision)
only make an unpinned shard look pinned: it is kept, never removed early. A forked child
holds none of its parent's pins: it closes its copy of the parent's descriptor (whose
locks stay with the parent) and opens its own. ``clear`` removes ``pins.lock`` only
under a write lock of the whole file, and a pinner checks after its first lock that
the path still names the file it locked. Should a mapped file be unlinked anyway (a bad
copy removed by ``discard`` or ``pyloader cache verify``, or locks that do nothing), a
process that has it mapped keeps reading the same inode safely; its disk space is freed
only when the last mapping goes. LRU order is the shard file's mtime, refreshed each
time a reader pins it.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import signal
import stat
import struct
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pyloader._C as _C

from ..errors import CacheError, CacheLimitError, ManifestError, PyloaderError, RemoteCorruptError
from ..format.encode import atomic_write as _atomic_write
from ..format.owner import owner as _owner
from ..format.owner import owner_gone
from ..format.owner import pid_alive as _pid_alive
from ..format.sizes import format_size, parse_size
from ..format.spec import MANIFEST_NAME, parse_manifest
from .fs import (
    FetchError,
    RetryPolicy,
    download_into,
    filesystem,
    with_retries,
)

LAYOUT = "v1"
_LOCK_POLL_S = 0.02
# A temp file whose writer cannot be checked (another host or pid namespace) is reclaimed
# once its mtime is this old (NOTE [cache publish] says why an hour is safe).
_STALE_TEMP_S = 3600.0
# flock/fcntl errors that mean "this filesystem has no locks": the cache then runs
# without them (NOTE [cache publish]); EOPNOTSUPP is ENOTSUP on Linux.
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
_PINS_FILE = "pins.lock"
# What to free, for a write that failed on a full disk.
_FULL_HINT = {errno.ENOSPC: " (no space or no inodes left: free some, or set a smaller cache limit or another "
                            "cache_dir)",
              errno.EDQUOT: " (disk quota exceeded: free some, or set another cache_dir)"}
_DISCARD_LOG = "discarded.log"


def _cache_error(err: int, message: str, shard: str | None = None) -> CacheError:
    e = CacheError(err, message)
    e.shard = shard
    return e


def default_cache_dir() -> str:
    """The cache root when none is given.

    ``$PYLOADER_CACHE_DIR``, else ``$XDG_CACHE_HOME/pyloader``, else ``~/.cache/pyloader``.
    """
    env = os.environ.get("PYLOADER_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pyloader")


def normalize_url(url: str) -> str:
    """The dataset's root URL: no trailing slash, no ``manifest.json``."""
    u = url.rstrip("/")
    if u.endswith("/" + MANIFEST_NAME):
        u = u[: -len(MANIFEST_NAME) - 1]
    return u


def dataset_key(url: str) -> str:
    """The dataset's directory name in the cache: XXH64 (16 hex digits) of its normalized URL."""
    return f"{_C.xxh64(normalize_url(url).encode('utf-8')):016x}"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# NOTE [lock files across fork]: flock and OFD locks belong to an open file description,
# which a forked child shares through the descriptors it inherits. A child forked while a
# thread of the parent held a lock file open -- a download's shard lock, the space lock, an
# evictor's try-lock -- kept that lock held after the parent closed its descriptor: the
# child's own fetcher then timed out waiting for a lock that only its inherited copy held,
# and the parent could not take it again until the child exited. Every lock-file descriptor
# is therefore entered here while it is open (entered after the open, dropped before the
# close, so the set never names a closed one), and a forked child closes its copies at once.
_LOCK_FDS: set[int] = set()


def open_lockfile(path: str) -> int | None:
    """An fd for flock on ``path`` (created if possible); None if it cannot exist (read-only dir).

    Never through a symlink (NOTE [cache paths]): a link planted at ``path`` raises CacheError.
    Close it with ``close_lockfile`` (NOTE [lock files across fork]).
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_error(path) from None
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOSPC, errno.EDQUOT):
            raise _cache_error(e.errno or errno.EIO, f"cannot open lock file {path}: {os.strerror(e.errno or 0)}") \
                from None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e2:
            if e2.errno == errno.ELOOP:
                raise _link_error(path) from None
            return None
    _LOCK_FDS.add(fd)
    return fd


def close_lockfile(fd: int) -> None:
    """Closes a descriptor from ``open_lockfile`` (NOTE [lock files across fork])."""
    _LOCK_FDS.discard(fd)
    os.close(fd)


def _close_lockfiles_in_child() -> None:
    # See NOTE [lock files across fork]: the parent's locks stay the parent's.
    for fd in list(_LOCK_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_lockfiles_in_child)


def _link_error(path: str) -> CacheError:
    return _cache_error(errno.ELOOP, f"{path} is a symbolic link: pyloader writes no file of its cache through a "
                        "link; remove it (and check who can write to the cache directory: docs/security.md)")


def _real_dir(path: str) -> None:
    """Creates directory ``path`` if needed; raises CacheError if it is a link or not a directory.

    See NOTE [cache paths]. Callers check each directory of the cache they write in, from
    the layout root down.
    """
    os.makedirs(path, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise _cache_error(errno.ENOTDIR, f"{path} is {what}: "
                           "pyloader keeps its cache in real directories only; remove it "
                           "(and check who can write to the cache directory: docs/security.md)")


_NAME_MAX = 255


def shard_cache_name(path: str, digest: str) -> str:
    """The cached file name of shard ``path`` whose manifest checksum is ``digest`` (NOTE [cache paths]).

    Raises ValueError unless the result is one file-name component.
    """
    q = _quote(path)
    if len(q) + 17 > _NAME_MAX:
        q = f"{q[:160]}~{_C.xxh64(path.encode('utf-8')):016x}"
    name = f"{q}.{digest}"
    if "/" in name or "\0" in name or name in (".", "..") or len(name.encode("utf-8")) > _NAME_MAX:
        raise ValueError(f"shard {path!r}: its cache name {name!r} is not one file-name component")
    return name


def _same_file(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st, fst = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _try_flock(fd: int, op: int) -> bool:
    """A non-blocking flock: False if another holder has it; True if taken (or flock does nothing here)."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _NO_LOCKS:
            return True  # no locks on this filesystem: run without (NOTE [cache publish])
        raise


def _wait_flock(fd: int, op: int, timeout: float, cancel: threading.Event | None,
                poll: tuple[float, float] = (_LOCK_POLL_S, 0.25)) -> bool:
    """Polls a non-blocking flock so a cancel or a timeout is seen; True once locked.

    ``poll``: (first, longest) sleep between tries, growing 1.5x.
    """
    deadline = time.monotonic() + timeout
    delay, cap = poll
    while not _try_flock(fd, op):
        if cancel is not None and cancel.is_set():
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 1.5, cap)
    return True


def _lock_fd(path: str, op: int, timeout: float, cancel: threading.Event | None,
             poll: tuple[float, float] = (_LOCK_POLL_S, 0.25)) -> int | None:
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
            raise _cache_error(errno.ETIMEDOUT, f"{what} waiting for lock {path}")
        if _same_file(path, fd):
            return fd
        close_lockfile(fd)


# -- byte-range locks on pins.lock (NOTE [cache pins]) ----------------------------------
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)  # Linux values, for Pythons that lack the names
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_FLOCK = struct.Struct("hhqqi0q")  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
# Errors of an OFD lock call that mean no such locks here (an old kernel: EINVAL; a huge
# offset a filesystem cannot take: EOVERFLOW).
_NO_OFD_LOCKS = _NO_LOCKS | {errno.EINVAL, errno.EOVERFLOW}


def _pin_offset(name: str) -> int:
    """The byte of ``pins.lock`` that pins the cached file ``name``: 62 bits of its XXH64."""
    return _C.xxh64(name.encode("utf-8")) >> 2


def _byte_lock(fd: int, kind: int, offset: int, length: int = 1) -> bool:
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


def _byte_held(fd: int, offset: int, length: int = 1) -> bool:
    """``F_OFD_GETLK``: whether any open file description other than ``fd``'s locks the range."""
    try:
        out = fcntl.fcntl(fd, _F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, length, 0))
    except OSError as e:
        if e.errno in _NO_OFD_LOCKS:
            return False
        raise
    return bool(_FLOCK.unpack(out)[0] != fcntl.F_UNLCK)


class _PinFile:
    """This process's one open file description of a dataset's ``pins.lock`` (NOTE [cache pins]).

    Holds a read lock on each pinned byte, counted so that two pins of one byte (two
    DatasetCache objects, or a hash collision) release it only with the last. The file
    is open only while some byte is pinned.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        self.counts: dict[int, int] = {}
        self.mu = threading.Lock()

    def hold(self, offset: int, timeout: float) -> None:
        """Pins byte ``offset``, waiting while an evictor holds it (one unlink)."""
        with self.mu:
            n = self.counts.get(offset, 0)
            if n:
                self.counts[offset] = n + 1
                return
            deadline = time.monotonic() + timeout
            delay = _LOCK_POLL_S
            while True:
                first = not self.counts
                if first and self.fd is None:
                    self.fd = open_lockfile(self.path)
                if self.fd is None:
                    break  # a read-only cache without pins.lock: nothing there can evict
                if _byte_lock(self.fd, fcntl.F_RDLCK, offset):
                    if not first or _same_file(self.path, self.fd):
                        break
                    self._close()  # `clear` replaced pins.lock before our first lock: use the new one
                    continue
                if time.monotonic() >= deadline:
                    if first:
                        self._close()
                    raise _cache_error(errno.ETIMEDOUT, f"timed out after {timeout:.0f} s waiting to pin byte "
                                       f"{offset} of {self.path}")
                time.sleep(delay)
                delay = min(delay * 1.5, 0.25)
            self.counts[offset] = 1

    def release(self, offset: int) -> None:
        """Drops one pin of byte ``offset``; the lock goes with the last."""
        with self.mu:
            n = self.counts.get(offset, 0)
            if n > 1:
                self.counts[offset] = n - 1
                return
            if n == 0:
                return
            del self.counts[offset]
            if self.fd is not None:
                _byte_lock(self.fd, fcntl.F_UNLCK, offset)
                if not self.counts:
                    self._close()

    def _close(self) -> None:
        if self.fd is not None:
            close_lockfile(self.fd)
            self.fd = None


_pin_files: dict[str, _PinFile] = {}
_pin_files_mu = threading.Lock()


def _pin_file(path: str) -> _PinFile:
    """This process's ``_PinFile`` for ``path``."""
    with _pin_files_mu:
        pf = _pin_files.get(path)
        if pf is None:
            pf = _pin_files[path] = _PinFile(path)
        return pf


def _forget_pins_in_child() -> None:
    # The child's copies of the parent's descriptors share the parent's open file
    # descriptions: unlocking through them would drop the parent's pins, and keeping
    # them open would keep those pins alive after the parent let go. Close them (the
    # parent's locks stay) and start empty; the locks may have been held mid-operation.
    global _pin_files, _pin_files_mu
    for pf in _pin_files.values():
        if pf.fd is not None:
            try:
                os.close(pf.fd)
            except OSError:
                pass
    _pin_files, _pin_files_mu = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_pins_in_child)


# -- temp files and their owners (NOTE [cache publish], See NOTE [file owners]) ------------

# NOTE [temps at SIGTERM]: a download's temp file is removed by its writer on every way
# out of the download, and by the fetchers' exit hook (NOTE [downloads at exit]) at an
# orderly exit; a process killed outright leaves it for the next writer of that shard
# (NOTE [cache publish]). One kill is routine: the parent of multiprocessing children
# (torch's DataLoader workers) terminates them with SIGTERM as it exits, a moment after a
# Ctrl-C, while their downloads run. So a multiprocessing child that fetches installs,
# from its main thread and only where SIGTERM has its default action, a handler that
# unlinks this process's live temps (``_live_temps``) and then dies of SIGTERM as before
# (the default action restored and the signal sent again). A forked child forgets the
# parent's temps.
_live_temps: set[str] = set()


def remove_temps_at_sigterm() -> None:
    """Installs the handler of NOTE [temps at SIGTERM], from the main thread, where SIGTERM's action is the default."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    signal.signal(signal.SIGTERM, _unlink_temps_and_die)


def _unlink_temps_and_die(signum: int, frame: object) -> None:
    for p in list(_live_temps):  # one C call under the GIL: the download threads cannot change it meanwhile
        try:
            os.unlink(p)
        except OSError:
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


os.register_at_fork(after_in_child=_live_temps.clear)


def _temp_stem(name: str) -> str:
    """The part of a temp's name that names its shard: the shard's name, shortened if long."""
    if len(name) <= 128:
        return name
    return f"{name[:100]}~{_C.xxh64(name.encode('utf-8')):016x}"


def _new_temp_name(name: str) -> str:
    return f"{_temp_stem(name)}.{_owner()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"


def _temp_is_stale(ddir: str, path: str, now: float) -> bool:
    """Whether the writer of temp file ``path`` (in dataset dir ``ddir``) is gone (NOTE [cache publish])."""
    try:
        old = now - os.stat(path).st_mtime > _STALE_TEMP_S
    except FileNotFoundError:
        return False
    n = os.path.basename(path)
    parts = n.rsplit(".", 4)
    if len(parts) == 5 and parts[4] == "part" and parts[2].isdigit() and parts[1].count("-") == 2:
        return owner_gone(parts[1], int(parts[2])) is True or old
    parts = n.rsplit(".", 3)
    if len(parts) == 4 and parts[3] == "part" and parts[1].isdigit():
        # The older <name>.<pid>.<random>.part form: its writer ran here and held the flock.
        if _pid_alive(int(parts[1])):
            return old
        fd = open_lockfile(os.path.join(ddir, "locks", parts[0] + ".lock"))
        if fd is None:
            return False
        try:
            return _try_flock(fd, fcntl.LOCK_EX)
        finally:
            close_lockfile(fd)
    return old


_PLAIN = re.compile(r"[A-Za-z0-9_.~-]+")  # what quote(safe="") leaves as it is


def _quote(path: str) -> str:
    return path if _PLAIN.fullmatch(path) else urllib.parse.quote(path, safe="")


class _TempLost(Exception):
    """Our temp file vanished before its rename (reclaimed as stale): download again."""


@dataclass
class Entry:
    """One published shard file in the cache."""

    dataset: DatasetCache
    name: str
    path: str
    bytes: int
    mtime: float
    referenced: bool  # named by the dataset's current manifest
    ino: int = 0  # the file's inode when listed (0: unknown); remove_entry removes only that file


class ShardCache:
    """A node-local cache directory shared by every process on the node.

    ``limit`` (bytes) caps the published and in-progress shards together; making room
    evicts least-recently-used shards that no process has pinned (NOTE [cache pins]).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, limit: int | str | None = None) -> None:
        self.base = os.path.abspath(os.fspath(root) if root is not None else default_cache_dir())
        self.root = os.path.join(self.base, LAYOUT)
        self.limit = None if limit is None else parse_size(limit)

    # -- datasets ----------------------------------------------------------------------
    def dataset(self, url: str, manifest_bytes: bytes, *, storage_options: dict[str, Any] | None = None,
                policy: RetryPolicy | None = None, flavour: type[DatasetCache] | None = None) -> DatasetCache:
        """The cache of dataset ``url`` whose (already verified) manifest is ``manifest_bytes``.

        Stores the URL and manifest in the dataset's directory. ``flavour``: a DatasetCache
        subclass with its own content check error.
        """
        url = normalize_url(url)
        d = (flavour or DatasetCache)(self, url, manifest_bytes, storage_options=storage_options, policy=policy)
        d.store_manifest()
        return d

    def datasets(self) -> list[DatasetCache]:
        """Every dataset cached here, sorted by key; half-created or foreign directories are skipped."""
        out = []
        try:
            keys = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        for key in keys:
            d = os.path.join(self.root, key)
            try:
                with open(os.path.join(d, "url"), encoding="utf-8") as f:
                    url = f.read().strip()
                with open(os.path.join(d, MANIFEST_NAME), "rb") as f:
                    data = f.read()
                # The cache's own copy: checked before it was stored, and it may be a
                # listing pyloader built itself (NOTE [untrusted manifest]).
                out.append(DatasetCache(self, url, data, identity=True))
            except (OSError, PyloaderError, ValueError):
                continue  # not a dataset dir (or half-created): ignored, `clear` removes it
        return out

    def find(self, url: str) -> DatasetCache | None:
        """The cached dataset of ``url`` (with the manifest cached for it), or None."""
        key = dataset_key(url)
        for d in self.datasets():
            if d.key == key:
                return d
        return None

    # -- accounting and eviction -------------------------------------------------------
    def entries(self) -> list[Entry]:
        """The published shard files of every dataset cached here."""
        out = []
        for d in self.datasets():
            out.extend(d.entries())
        return out

    def temp_files(self) -> list[tuple[str, str, int]]:
        """(dataset dir, temp path, size) of every download in progress or left by a dead process."""
        out = []
        try:
            keys = os.listdir(self.root)
        except FileNotFoundError:
            return []
        for key in keys:
            tdir = os.path.join(self.root, key, "tmp")
            try:
                names = os.listdir(tdir)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for n in names:
                p = os.path.join(tdir, n)
                try:
                    out.append((os.path.join(self.root, key), p, os.stat(p).st_size))
                except FileNotFoundError:
                    pass
        return out

    def usage(self) -> int:
        """Bytes held: published shards plus temp files (what ``limit`` caps)."""
        return self._held()[1]

    def _held(self) -> tuple[list[Entry], int]:
        """(published entries, bytes of temps plus entries).

        Temps are listed first: a download renamed from ``tmp/`` into ``shards/`` between
        the two listings is then counted twice (safe), never missed.
        """
        temps = sum(s for _, _, s in self.temp_files())
        entries = self.entries()
        return entries, temps + sum(e.bytes for e in entries)

    def space_lock(self, timeout: float = 60.0) -> _SpaceLock:
        """The node-wide lock (a context manager) held while accounting space or evicting.

        Raises ``CacheError`` when it is not acquired within ``timeout`` seconds.
        """
        os.makedirs(self.root, exist_ok=True)
        return _SpaceLock(self.root, timeout)

    def make_room(self, need: int, *, shard: str | None = None) -> None:
        """With the space lock held: evicts LRU unpinned shards until ``need`` more bytes fit the limit."""
        if self.limit is None:
            return
        if need > self.limit:
            raise CacheLimitError(f"shard {shard!r} ({format_size(need)}) is larger than the cache limit of "
                                  f"{format_size(self.limit)} ({self.base}); set the limit (cache_limit=, --limit) "
                                  f"to at least {format_size(need)}")
        entries, used = self._held()
        if used + need <= self.limit:
            return
        if self.clean_stale():  # dead writers' temps count against the limit too
            entries, used = self._held()
        # Shards the current manifests no longer name go first, then least recently used.
        for e in sorted(entries, key=lambda e: (e.referenced, e.mtime)):
            if used + need <= self.limit:
                break
            if e.dataset.evict_entry(e):
                used -= e.bytes
        if used + need > self.limit:
            raise _cache_error(errno.ENOSPC, f"cache {self.base} is full: {used} of {self.limit} bytes are held "
                               f"by shards in use or being downloaded; cannot fit shard {shard!r} ({need} bytes). "
                               "Raise the limit or read fewer shards at once.", shard)

    def evict(self, *, to_bytes: int = 0, url: str | None = None) -> tuple[list[Entry], list[Entry]]:
        """Evicts unpinned shards, LRU first, until usage <= ``to_bytes``. Returns (evicted, skipped as in use)."""
        with self.space_lock():
            entries, used = self._held()
            if url is not None:
                key = dataset_key(url)
                entries = [e for e in entries if e.dataset.key == key]
            evicted, busy = [], []
            for e in sorted(entries, key=lambda e: (e.referenced, e.mtime)):
                if used <= to_bytes:
                    break
                if e.dataset.evict_entry(e):
                    evicted.append(e)
                    used -= e.bytes
                else:
                    busy.append(e)
            return evicted, busy

    def clean_stale(self) -> int:
        """Deletes temp files whose writer is gone (NOTE [cache publish]). Returns the count."""
        now = time.time()
        n = 0
        for ddir, p, _ in self.temp_files():
            if _temp_is_stale(ddir, p, now):
                try:
                    os.unlink(p)
                    n += 1
                except FileNotFoundError:
                    pass
        return n

    def clear(self, url: str | None = None) -> tuple[int, int]:
        """Removes every shard not in use (and stale temps); a dataset dir goes once empty.

        Returns (files removed, shards skipped as in use).
        """
        removed = self.clean_stale()
        busy = 0
        with self.space_lock():
            for d in self.datasets():
                if url is not None and d.key != dataset_key(url):
                    continue
                for e in d.entries():
                    if d.evict_entry(e):
                        removed += 1
                    else:
                        busy += 1
                removed += d.remove_if_idle()
        return removed, busy

    def stats(self) -> dict[str, Any]:
        """Counts and bytes of the cached datasets, shards, pinned shards and temp files."""
        ds = self.datasets()
        entries, pinned = [], []
        for d in ds:
            mine = d.entries()
            held = d._pinned(e.name for e in mine)  # one open of its pins.lock per dataset
            entries += mine
            pinned += [e for e in mine if e.name in held]
        temps = self.temp_files()
        return {"cache_dir": self.base, "datasets": len(ds), "shards": len(entries),
                "bytes": sum(e.bytes for e in entries), "pinned_shards": len(pinned),
                "pinned_bytes": sum(e.bytes for e in pinned), "temp_files": len(temps),
                "temp_bytes": sum(s for _, _, s in temps),
                "unreferenced_shards": sum(1 for e in entries if not e.referenced)}


class _Flock:
    """Context manager: an flock on a file, waited for with a timeout."""

    def __init__(self, path: str, op: int, timeout: float, cancel: threading.Event | None = None,
                 poll: tuple[float, float] = (_LOCK_POLL_S, 0.25)) -> None:
        self.path, self.op, self.timeout, self.cancel, self.poll = path, op, timeout, cancel, poll
        self.fd: int | None = None

    def __enter__(self) -> _Flock:
        fd = _lock_fd(self.path, self.op, self.timeout, self.cancel, self.poll)
        if fd is None:
            raise _cache_error(errno.EROFS, f"cannot create lock file {self.path}: the cache directory is read-only")
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


class _SpaceLock:
    """The node-wide space lock: this process's mutex for the root, then the flock (polled from 1 ms)."""

    def __init__(self, root: str, timeout: float) -> None:
        self.root, self.timeout = root, timeout
        self._mutex = _space_mutex(root)
        self._flock: _Flock | None = None

    def __enter__(self) -> _SpaceLock:
        start = time.monotonic()
        if not self._mutex.acquire(timeout=self.timeout):
            raise _cache_error(errno.ETIMEDOUT, f"timed out after {self.timeout:.0f} s waiting for the space lock "
                               f"of {self.root}")
        try:
            left = max(0.0, self.timeout - (time.monotonic() - start))
            self._flock = _Flock(os.path.join(self.root, "space.lock"), fcntl.LOCK_EX, left, poll=(0.001, 0.02))
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


class DatasetCache:
    """The cached shards of one dataset (one manifest) inside a ShardCache."""

    # Whether this flavour's manifests are built by pyloader from a listing of objects
    # named by identity (``"content_hash": false``; NOTE [untrusted manifest]).
    identity_listing = False

    def __init__(self, cache: ShardCache, url: str, manifest_bytes: bytes, *,
                 storage_options: dict[str, Any] | None = None, policy: RetryPolicy | None = None,
                 identity: bool | None = None) -> None:
        self.cache = cache
        self.url = normalize_url(url)
        self.key = dataset_key(self.url)
        self.dir = os.path.join(cache.root, self.key)
        self.manifest_bytes = manifest_bytes
        where = self.url + "/" + MANIFEST_NAME
        self.manifest = parse_manifest(manifest_bytes, where, _C.xxh64,
                                       identity=self.identity_listing if identity is None else identity)
        self.shards: list[dict[str, Any]] = self.manifest["shards"]
        try:
            self.names = [shard_cache_name(s["path"], s["xxh64"]) for s in self.shards]
        except ValueError as e:
            raise ManifestError(f"manifest {where!r}: {e}") from None
        self.storage_options = storage_options
        self.policy = policy or RetryPolicy.from_env()
        self._pins: dict[int, int] = {}  # shard index -> its byte in pins.lock, pinned by this object
        self._pins_pid = os.getpid()
        self._mu = threading.Lock()
        self._fs: Any = None
        self._fs_pid = -1

    def __getstate__(self) -> dict[str, Any]:
        s = self.__dict__.copy()
        s["_pins"], s["_pins_pid"], s["_fs"], s["_fs_pid"], s["_mu"] = {}, -1, None, -1, None
        return s

    def __setstate__(self, s: dict[str, Any]) -> None:
        self.__dict__.update(s)
        self._mu = threading.Lock()

    # -- layout ------------------------------------------------------------------------
    @property
    def shard_dir(self) -> str:
        """The directory of this dataset's published shards."""
        return os.path.join(self.dir, "shards")

    @property
    def tmp_dir(self) -> str:
        """The directory of this dataset's downloads in progress."""
        return os.path.join(self.dir, "tmp")

    def shard_file(self, i: int) -> str:
        """The local path shard ``i`` is published at (whether or not it is yet)."""
        return self._shard_prefix + self.names[i]

    def shard_files(self) -> list[str]:
        """``shard_file(i)`` of every shard, in manifest order."""
        prefix = self._shard_prefix
        return [prefix + n for n in self.names]

    @property
    def _shard_prefix(self) -> str:
        return os.path.join(self.dir, "shards", "")

    def shard_url(self, i: int) -> str:
        """The remote URL of shard ``i``."""
        return self.url + "/" + self.shards[i]["path"]

    def _lock_path(self, name: str) -> str:
        return os.path.join(self.dir, "locks", name + ".lock")

    @property
    def _pins_path(self) -> str:
        return os.path.join(self.dir, _PINS_FILE)

    def store_manifest(self) -> None:
        """Writes the URL and this manifest into the dataset dir (skipped where read-only).

        Raises CacheError naming the path for a full disk (no space or no inodes left) or
        a link planted in the cache (NOTE [cache paths]).
        """
        path = self.cache.root
        try:
            _real_dir(path)
            _real_dir(self.dir)
            for sub in ("shards", "locks", "tmp"):
                path = os.path.join(self.dir, sub)
                _real_dir(path)
            path = os.path.join(self.dir, MANIFEST_NAME)
            try:
                with open(path, "rb") as f:
                    same = f.read() == self.manifest_bytes
            except FileNotFoundError:
                same = False
            if not same:
                _atomic_write(path, [self.manifest_bytes])
            path = os.path.join(self.dir, "url")
            if not os.path.lexists(path):
                _atomic_write(path, [self.url.encode("utf-8") + b"\n"])
        except CacheError:
            raise
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                return  # read-only cache: usable for shards that are already there
            raise _cache_error(e.errno or errno.EIO, f"{self.url}: cannot write {path} in cache {self.cache.base}: "
                               f"{os.strerror(e.errno or errno.EIO)}{_FULL_HINT.get(e.errno or 0, '')}") from None

    def is_published(self, i: int) -> bool:
        """Whether shard ``i`` is in the cache at its manifest size (NOTE [cache publish]).

        A regular file only: a link at its name is not a published shard (NOTE [cache paths]).
        """
        try:
            st = os.lstat(self.shard_file(i))
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == self.shards[i]["bytes"]

    def entries(self) -> list[Entry]:
        """This dataset's published shard files, including those an older manifest named."""
        refs = set(self.names)
        out = []
        try:
            names = os.listdir(self.shard_dir)
        except FileNotFoundError:
            return []
        for n in names:
            p = os.path.join(self.shard_dir, n)
            try:
                st = os.lstat(p)  # a link is listed as itself, and fails verify_entry
            except FileNotFoundError:
                continue
            out.append(Entry(self, n, p, st.st_size, st.st_mtime, n in refs, st.st_ino))
        return out

    # -- pins (NOTE [cache pins]) --------------------------------------------------------
    def pin(self, i: int) -> None:
        """Pins shard ``i`` (a read lock on its byte of ``pins.lock``) until ``unpin`` or process exit."""
        with self._mu:
            if self._pins_pid != os.getpid():  # after fork the parent's pins are not ours to release
                self._pins, self._pins_pid = {}, os.getpid()
            if i in self._pins:
                return
            try:
                os.makedirs(self.dir, exist_ok=True)  # `clear` may have removed an idle dataset dir
            except OSError:
                pass  # read-only cache: the pin file is opened if it exists
            off = _pin_offset(self.names[i])
            # Waits only while an evictor holds the byte (one unlink).
            _pin_file(self._pins_path).hold(off, 60.0)
            self._pins[i] = off
        try:
            os.utime(self.shard_file(i))  # LRU: last use
        except OSError:
            pass

    def unpin(self, i: int) -> None:
        """Releases this object's pin on shard ``i``, if it holds one."""
        with self._mu:
            off = self._pins.pop(i, None) if self._pins_pid == os.getpid() else None
            if off is not None:
                _pin_file(self._pins_path).release(off)

    def unpin_all(self) -> None:
        """Releases every pin this object holds."""
        for i in list(self._pins):
            self.unpin(i)

    def is_pinned(self, name: str) -> bool:
        """Whether any process (this one included) pins the shard file ``name``."""
        return name in self._pinned([name])

    def _pinned(self, names: Iterable[str]) -> set[str]:
        """Which of the shard files ``names`` some process pins (one open of ``pins.lock``)."""
        try:
            fd = os.open(self._pins_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return set()  # no pins.lock: nobody pins anything here
        try:
            return {n for n in names if _byte_held(fd, _pin_offset(n))}
        finally:
            os.close(fd)

    def evict_entry(self, e: Entry) -> bool:
        """Removes one published shard unless a reader pins it or a downloader holds it."""
        lfd = open_lockfile(self._lock_path(e.name))
        pfd = open_lockfile(self._pins_path)
        try:
            if lfd is None or pfd is None:
                return False
            if not _try_flock(lfd, fcntl.LOCK_EX) or not _byte_lock(pfd, fcntl.F_WRLCK, _pin_offset(e.name)):
                return False
            try:
                os.unlink(e.path)
            except FileNotFoundError:
                pass
            return True
        finally:
            for fd in (lfd, pfd):
                if fd is not None:
                    close_lockfile(fd)  # the only fd of its open file description: its locks go with it

    def remove_if_idle(self) -> int:
        """Removes this dataset's directory if it holds no shards or temp files. Returns files removed."""
        if self.entries() or (os.path.isdir(self.tmp_dir) and os.listdir(self.tmp_dir)):
            return 0
        n = 0
        fd = open_lockfile(self._pins_path)
        if fd is not None:
            try:
                # All of pins.lock, write-locked: no pin is held, and none is taken before the
                # unlink (a pinner that opened it checks the path again: NOTE [cache pins]).
                if not _byte_lock(fd, fcntl.F_WRLCK, 0, 0):
                    return 0
                os.unlink(self._pins_path)
                n += 1
            except FileNotFoundError:
                pass
            finally:
                close_lockfile(fd)
        for sub in ("locks", "pins"):  # pins/: one flock file per shard, as older versions pinned
            d = os.path.join(self.dir, sub)
            for name in os.listdir(d) if os.path.isdir(d) else []:
                fd = open_lockfile(os.path.join(d, name))
                if fd is None:
                    continue
                try:
                    if _try_flock(fd, fcntl.LOCK_EX):
                        os.unlink(os.path.join(d, name))
                        n += 1
                    else:
                        return n  # someone holds it: keep the directory
                finally:
                    close_lockfile(fd)
        for name in (MANIFEST_NAME, "url", _DISCARD_LOG):
            try:
                os.unlink(os.path.join(self.dir, name))
                n += 1
            except FileNotFoundError:
                pass
        for sub in ("locks", "pins", "tmp", "shards", ""):
            try:
                os.rmdir(os.path.join(self.dir, sub))
            except OSError:
                pass
        return n

    # -- fetching (NOTE [cache publish]) ---------------------------------------------------
    def _filesystem(self) -> Any:
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs = filesystem(self.url, self.storage_options, self.policy.stall_timeout)
            self._fs_pid = os.getpid()
        return self._fs

    def acquire(self, i: int, *, cancel: threading.Event | None = None,
                on_bytes: Callable[[int], None] | None = None) -> tuple[str, bool]:
        """Pins shard i and makes sure it is published. Returns (local path, downloaded here?)."""
        self.pin(i)
        try:
            return self.ensure(i, cancel=cancel, on_bytes=on_bytes)
        except BaseException:
            self.unpin(i)
            raise

    def ensure(self, i: int, *, cancel: threading.Event | None = None,
               on_bytes: Callable[[int], None] | None = None) -> tuple[str, bool]:
        """Publishes shard i unless it already is (one download per node). Returns (path, downloaded?).

        A reader that then finds the file gone before it could open it (NOTE [cache
        publish]) calls this again.
        """
        final = self.shard_file(i)
        if self.is_published(i):
            return final, False
        shard = self.shards[i]["path"]
        if not os.path.isdir(self.tmp_dir) or not os.path.exists(os.path.join(self.dir, MANIFEST_NAME)):
            self.store_manifest()  # `clear` removed the idle dataset dir since we opened it
        if not os.access(self.dir, os.W_OK) or not os.access(self.shard_dir, os.W_OK):
            raise _cache_error(errno.EROFS, f"{self.shard_url(i)}: shard {shard!r} is not cached and the cache "
                               f"directory {self.dir} is not writable", shard)
        wait = self.policy.deadline + 2 * self.policy.stall_timeout
        try:
            lock = _Flock(self._lock_path(self.names[i]), fcntl.LOCK_EX, wait, cancel)
            lock.__enter__()
        except CacheError as e:
            if cancel is not None and cancel.is_set():
                raise FetchError(errno.ECANCELED, f"{self.shard_url(i)}: cancelled") from None
            raise _cache_error(e.errno or errno.EIO, f"{self.shard_url(i)}: shard {shard!r}: {e}", shard) from None
        try:
            lost = 0
            while not self.is_published(i):  # else another process published it while we waited
                try:
                    self._download_locked(i, cancel, on_bytes)
                    return final, True
                except _TempLost:
                    lost += 1
                    if lost == 3:
                        raise _cache_error(errno.EIO, f"{self.shard_url(i)}: shard {shard!r}: the temp file of "
                                           f"its download in {self.tmp_dir} was removed by another process, "
                                           "three times", shard) from None
            return final, False
        finally:
            lock.__exit__()

    def _create_temp(self, name: str) -> tuple[str, int]:
        """A new temp file of shard ``name``, in a name only this writer uses: (path, fd)."""
        for _ in range(2):
            tmp = os.path.join(self.tmp_dir, _new_temp_name(name))
            try:
                return tmp, os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except FileNotFoundError:
                _real_dir(self.tmp_dir)  # `clear` removed it meanwhile
        return tmp, os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)

    def _reclaim_temps(self, name: str) -> None:
        """Removes the temps of shard ``name`` whose writers are gone (NOTE [cache publish])."""
        stem, now = _temp_stem(name) + ".", time.time()
        try:
            names = os.listdir(self.tmp_dir)
        except FileNotFoundError:
            return
        for n in names:
            p = os.path.join(self.tmp_dir, n)
            if n.startswith(stem) and _temp_is_stale(self.dir, p, now):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass

    def _publish(self, tmp: str, final: str) -> None:
        """``os.replace`` of a verified temp onto its published name (NOTE [cache publish])."""
        try:
            os.replace(tmp, final)
        except FileNotFoundError:
            if not os.path.exists(tmp):
                raise _TempLost() from None
            _real_dir(self.shard_dir)  # `clear` removed it meanwhile
            os.replace(tmp, final)
        _fsync_dir(self.shard_dir)

    def _download_locked(self, i: int, cancel: threading.Event | None,
                         on_bytes: Callable[[int], None] | None) -> None:
        name, info = self.names[i], self.shards[i]
        size, shard, url = int(info["bytes"]), info["path"], self.shard_url(i)
        self._reclaim_temps(name)
        tmp, fd = "", -1
        # The filesystem first (its first use imports and connects, which a cancel cannot
        # interrupt): a temp then exists only while bytes can flow or be cancelled.
        fs, root = self._filesystem()
        try:
            with self.cache.space_lock():
                self.cache.make_room(size, shard=shard)
                tmp, fd = self._create_temp(name)
                _live_temps.add(tmp)
                try:
                    os.posix_fallocate(fd, 0, size)  # reserve now: a full disk fails here, cleanly
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                        raise _cache_error(e.errno, f"{url}: shard {shard!r}: no space in cache {self.cache.base} "
                                           f"for {size} bytes ({os.strerror(e.errno)})", shard) from None
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
            path = root.rstrip("/") + "/" + shard
            for attempt in range(2):
                with_retries(lambda: download_into(fd, fs, path, size, url=url, shard=shard, cancel=cancel,
                                                   on_bytes=on_bytes),
                             self.policy, what="downloading", url=url, shard=shard, cancel=cancel)
                os.fsync(fd)
                problem = self.content_problem(fd, size, i)
                if problem is None:
                    break
                if attempt == 1 or not self.retry_bad_content:
                    raise self.content_error(url, shard, problem)
            os.close(fd)
            fd = -1
            self._publish(tmp, self.shard_file(i))
        except OSError as e:
            if isinstance(e, PyloaderError):
                raise
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES):
                raise _cache_error(e.errno, f"{url}: shard {shard!r}: cannot write to cache {self.cache.base}: "
                                   f"{os.strerror(e.errno)}{_FULL_HINT.get(e.errno, '')}", shard) from None
            where = e.filename or tmp or self.dir
            raise _cache_error(e.errno or errno.EIO, f"{url}: shard {shard!r}: {where} in cache {self.cache.base}: "
                               f"{e.strerror or e}", shard) from None
        finally:
            if fd >= 0:
                os.close(fd)
            if tmp:  # ours alone: created O_EXCL under a name no other writer uses
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                _live_temps.discard(tmp)

    # -- checks --------------------------------------------------------------------------
    def verify_entry(self, e: Entry) -> str | None:
        """None if a published file matches the manifest; else what is wrong."""
        if not e.referenced:
            return None  # from an older manifest: nothing to check it against (evicted first)
        i = self.names.index(e.name)
        info = self.shards[i]
        if e.bytes != info["bytes"]:
            return f"size {e.bytes}, manifest says {info['bytes']}"
        try:
            fd = os.open(e.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None  # evicted meanwhile: nothing cached, nothing wrong
        except OSError as err:
            if err.errno == errno.ELOOP:
                return "a symbolic link, not a shard file (see NOTE [cache paths])"
            raise _cache_error(err.errno or errno.EIO, f"cannot open cached shard {e.path}: "
                               f"{err.strerror or err}", e.name) from None
        try:
            return self.content_problem(fd, e.bytes, i)
        finally:
            os.close(fd)

    # Whether a download whose bytes fail content_problem() is fetched once more (the object
    # may have been mid-replacement) before content_error() is raised.
    retry_bad_content = True

    def content_problem(self, fd: int, size: int, i: int) -> str | None:
        """None if the ``size`` bytes in ``fd`` are shard ``i`` of the manifest; else what is wrong.

        The one check behind both publishing a download and ``pyloader cache verify``. A
        manifest with ``"content_hash": false`` (cached Parquet files, pyloader.read.parquet)
        names each remote object by identity, not by its bytes: there the Parquet magic at
        both ends is checked instead.
        """
        info = self.shards[i]
        if self.manifest.get("content_hash") is False:
            head, tail = os.pread(fd, 4, 0), os.pread(fd, 4, max(0, size - 4))
            return None if head == tail == b"PAR1" else "not a Parquet file (no PAR1 magic at both ends)"
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else _Empty() as mm:
            got = _C.xxh64(mm)
        if got != int(info["xxh64"], 16):
            return f"XXH64 {got:016x}, manifest says {info['xxh64']}"
        return None

    def content_error(self, url: str, shard: str, problem: str) -> PyloaderError:
        """The error for a download that failed content_problem() (twice, if retried)."""
        changed = RemoteCorruptError(
            errno.EIO, f"{url}: shard {shard!r}: its bytes do not match the manifest's checksum ({problem}; "
            "downloaded twice, the same both times): the object is corrupt at the source, or the manifest is "
            "stale; re-opening the dataset will not help: re-write and re-upload that shard (or the manifest)")
        changed.url, changed.shard = url, shard
        return changed

    def remove_entry(self, e: Entry) -> None:
        """Removes a bad file even if pinned: a mapper keeps its inode (NOTE [cache pins]).

        Only the file ``e`` listed: a copy published since (another inode) stays.
        """
        self._remove_bad(e.name, e.ino or None, e.path)

    def discard(self, i: int, *, reason: str, expect: int | os.stat_result | tuple[int, int] | None = None) -> bool:
        """Removes the published copy of shard ``i`` that failed a check, so ``ensure(i)`` downloads it again.

        For a reader that found the cached shard corrupt (a checksum that does not match
        on read), then calls ``ensure(i)`` once more. Safe while other processes have the
        bad copy mapped (they keep its inode) and against a concurrent re-publish: only
        the copy ``expect`` names is removed -- an fd open on it, its ``os.stat_result``
        or ``(st_dev, st_ino)`` taken while the caller still has it open or mapped (an
        inode number names one file only while that file lives). Without ``expect`` the
        current copy is checked against the manifest and removed only if it fails.
        ``reason`` (what failed) is appended to the dataset's ``discarded.log``. Returns
        whether a file was removed; raises ``CacheError`` if the cache is read-only.
        """
        if isinstance(expect, int):
            st = os.fstat(expect)
            want: tuple[int, int] | None = (st.st_dev, st.st_ino)
        elif isinstance(expect, os.stat_result):
            want = (expect.st_dev, expect.st_ino)
        else:
            want = None if expect is None else (int(expect[0]), int(expect[1]))
        if want is None:
            try:
                st = os.stat(self.shard_file(i))
            except FileNotFoundError:
                return False
            entry = Entry(self, self.names[i], self.shard_file(i), st.st_size, st.st_mtime, True, st.st_ino)
            if self.verify_entry(entry) is None:
                return False
            want = (st.st_dev, st.st_ino)
        removed = self._remove_bad(self.names[i], want, self.shard_file(i))
        if removed:
            line = (f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {os.uname().nodename} pid {os.getpid()} "
                    f"{self.names[i]}: {reason}").replace("\n", " ")
            try:
                fd = os.open(os.path.join(self.dir, _DISCARD_LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT
                             | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
                try:
                    os.write(fd, line.encode("utf-8", "replace") + b"\n")  # one append: whole lines
                finally:
                    os.close(fd)
            except OSError:
                pass  # the log is a record for people, not part of the protocol
        return removed

    def _remove_bad(self, name: str, want: int | tuple[int, int] | None, path: str) -> bool:
        """Unlinks ``path`` if it still is the file ``want`` names (inode, or (dev, inode)).

        Under the shard's download lock, so no copy is published meanwhile (where flock
        works; elsewhere a good copy removed in that instant costs one more download).
        """
        wait = self.policy.deadline + 2 * self.policy.stall_timeout
        with _Flock(self._lock_path(name), fcntl.LOCK_EX, wait):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return False
            if isinstance(want, int) and st.st_ino != want:
                return False
            if isinstance(want, tuple) and (st.st_dev, st.st_ino) != want:
                return False
            try:
                os.unlink(path)
            except FileNotFoundError:
                return False
            except OSError as e:
                if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise _cache_error(e.errno, f"cannot remove the bad copy {path}: the cache is read-only "
                                       f"({os.strerror(e.errno)})", name) from None
                raise _cache_error(e.errno or errno.EIO, f"cannot remove the bad copy {path}: "
                                   f"{e.strerror or e}", name) from None
            _fsync_dir(os.path.dirname(path))
            return True


class _Empty:
    def __enter__(self) -> bytes:
        return b""

    def __exit__(self, *a: object) -> None:
        pass


__all__ = ["LAYOUT", "default_cache_dir", "normalize_url", "dataset_key", "open_lockfile", "close_lockfile",
           "shard_cache_name", "remove_temps_at_sigterm", "Entry", "ShardCache", "DatasetCache"]
