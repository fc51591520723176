"""The node-local shard cache: one verified copy of each remote shard per node.

Layout (``root`` is ``cache_dir`` argument, else ``$PYLOADER_CACHE_DIR``, else
``$XDG_CACHE_HOME/pyloader`` or ``~/.cache/pyloader``)::

    root/v1/space.lock                  flock: held while accounting space / evicting
    root/v1/<key>/url                   the dataset URL (key = XXH64 of the URL)
    root/v1/<key>/manifest.json         the manifest copy the shards below were checked against
    root/v1/<key>/shards/<name>         published shards; name = quote(path) + "." + manifest xxh64
    root/v1/<key>/locks/<name>.lock     flock EX: held by the one process downloading <name>
    root/v1/<key>/pins/<name>.pin       flock SH: held by every process that has <name> open
    root/v1/<key>/tmp/<name>.<pid>.<random>.part   a download in progress

A shard's cached name carries the manifest's checksum, so a dataset rewritten at the
same URL never reuses a file verified against the old manifest: old and new copies are
never mixed. Everything is a plain file in ``root``; nothing lives in /dev/shm.

NOTE [cache publish]: a shard file appears under ``shards/`` only by ``os.replace`` of a
temp file that was (1) written by the one process holding the shard's ``.lock`` flock,
(2) exactly the manifest's size, (3) equal to the manifest's XXH64, (4) fsynced, and
the directory is fsynced after the rename. So a reader that sees the name sees a whole,
verified file; a partial file only ever exists under ``tmp/``. The flock is released by
the kernel when its holder dies (kill -9 included), so a dead downloader blocks nobody;
the next holder of the lock deletes every temp file of that shard (only a lock holder
writes them, so any it finds are dead). Space for a download is reserved up front with
posix_fallocate, which turns a full disk into an immediate, clean error.

NOTE [cache pins]: a reader takes a shared flock on the shard's ``.pin`` file *before*
checking that the shard is published and keeps it while the shard may be mapped.
Eviction takes an exclusive, non-blocking flock on the ``.pin`` (and on the ``.lock``)
and skips the shard when either is held, so a shard in use is never evicted. Should a
file be unlinked anyway (``cache clear --force``), a process that has it mapped keeps
reading the same inode safely; its disk space is freed only when the last mapping goes.
LRU order is the shard file's mtime, refreshed each time a reader pins it.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _C
from ..errors import CacheError, CacheLimitError, PyloaderError
from ..format.encode import atomic_write as _atomic_write
from ..format.sizes import parse_size
from ..format.spec import MANIFEST_NAME, parse_manifest
from .fs import (
    FetchError,
    RemoteChangedError,
    RetryPolicy,
    download_into,
    filesystem,
    with_retries,
)

LAYOUT = "v1"
_LOCK_POLL_S = 0.02


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


def _open_lockfile(path: str) -> int | None:
    """An fd for flock on ``path`` (created if possible); None if it cannot exist (read-only dir)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOSPC):
            raise
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _try_flock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _wait_flock(fd: int, op: int, timeout: float, cancel: threading.Event | None) -> bool:
    """Polls a non-blocking flock so a cancel or a timeout is seen; True once locked."""
    deadline = time.monotonic() + timeout
    delay = _LOCK_POLL_S
    while not _try_flock(fd, op):
        if cancel is not None and cancel.is_set():
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)
    return True


def _lock_fd(path: str, op: int, timeout: float, cancel: threading.Event | None) -> int | None:
    """An fd holding flock ``op`` on ``path``; None if the file cannot exist (read-only cache).

    Lock files are removed only by ``clear`` (while it holds them), so after locking we
    check that the path still names the inode we locked, and retry if it does not.
    """
    while True:
        fd = _open_lockfile(path)
        if fd is None:
            return None
        if not _wait_flock(fd, op, timeout, cancel):
            os.close(fd)
            what = "cancelled" if cancel is not None and cancel.is_set() else f"timed out after {timeout:.0f} s"
            raise _cache_error(errno.ETIMEDOUT, f"{what} waiting for lock {path}")
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _quote(path: str) -> str:
    return urllib.parse.quote(path, safe="")


@dataclass
class Entry:
    """One published shard file in the cache."""

    dataset: DatasetCache
    name: str
    path: str
    bytes: int
    mtime: float
    referenced: bool  # named by the dataset's current manifest


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
                out.append(DatasetCache(self, url, data))
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
        return sum(e.bytes for e in self.entries()) + sum(s for _, _, s in self.temp_files())

    def space_lock(self, timeout: float = 60.0) -> _Flock:
        """The node-wide lock (a context manager) held while accounting space or evicting.

        Raises ``CacheError`` when it is not acquired within ``timeout`` seconds.
        """
        os.makedirs(self.root, exist_ok=True)
        return _Flock(os.path.join(self.root, "space.lock"), fcntl.LOCK_EX, timeout)

    def make_room(self, need: int, *, shard: str | None = None) -> None:
        """With the space lock held: evicts LRU unpinned shards until ``need`` more bytes fit the limit."""
        if self.limit is None:
            return
        if need > self.limit:
            raise CacheLimitError(f"shard {shard!r} ({need} bytes) is larger than the cache limit of "
                                  f"{self.limit} bytes ({self.base})")
        entries = self.entries()
        used = sum(e.bytes for e in entries) + sum(s for _, _, s in self.temp_files())
        if used + need <= self.limit:
            return
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
            entries = self.entries()
            used = sum(e.bytes for e in entries) + sum(s for _, _, s in self.temp_files())
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
        """Deletes temp files whose shard lock nobody holds (their writer died). Returns the count."""
        n = 0
        for ddir, p, _ in self.temp_files():
            name = os.path.basename(p).rsplit(".", 3)[0]
            fd = _open_lockfile(os.path.join(ddir, "locks", name + ".lock"))
            if fd is None:
                continue
            try:
                if _try_flock(fd, fcntl.LOCK_EX):
                    try:
                        os.unlink(p)
                        n += 1
                    except FileNotFoundError:
                        pass
            finally:
                os.close(fd)
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
        entries = [e for d in ds for e in d.entries()]
        temps = self.temp_files()
        pinned = [e for e in entries if e.dataset.is_pinned(e.name)]
        return {"cache_dir": self.base, "datasets": len(ds), "shards": len(entries),
                "bytes": sum(e.bytes for e in entries), "pinned_shards": len(pinned),
                "pinned_bytes": sum(e.bytes for e in pinned), "temp_files": len(temps),
                "temp_bytes": sum(s for _, _, s in temps),
                "unreferenced_shards": sum(1 for e in entries if not e.referenced)}


class _Flock:
    """Context manager: an flock on a file, waited for with a timeout."""

    def __init__(self, path: str, op: int, timeout: float, cancel: threading.Event | None = None) -> None:
        self.path, self.op, self.timeout, self.cancel = path, op, timeout, cancel
        self.fd: int | None = None

    def __enter__(self) -> _Flock:
        fd = _lock_fd(self.path, self.op, self.timeout, self.cancel)
        if fd is None:
            raise _cache_error(errno.EROFS, f"cannot create lock file {self.path}: the cache directory is read-only")
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only fd of the open file description releases the flock
            self.fd = None


class DatasetCache:
    """The cached shards of one dataset (one manifest) inside a ShardCache."""

    def __init__(self, cache: ShardCache, url: str, manifest_bytes: bytes, *,
                 storage_options: dict[str, Any] | None = None, policy: RetryPolicy | None = None) -> None:
        self.cache = cache
        self.url = normalize_url(url)
        self.key = dataset_key(self.url)
        self.dir = os.path.join(cache.root, self.key)
        self.manifest_bytes = manifest_bytes
        self.manifest = parse_manifest(manifest_bytes, self.url + "/" + MANIFEST_NAME, _C.xxh64)
        self.shards: list[dict[str, Any]] = self.manifest["shards"]
        self.names = [f"{_quote(s['path'])}.{s['xxh64']}" for s in self.shards]
        self.storage_options = storage_options
        self.policy = policy or RetryPolicy.from_env()
        self._pins: dict[int, int] = {}
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
        return os.path.join(self.shard_dir, self.names[i])

    def shard_url(self, i: int) -> str:
        """The remote URL of shard ``i``."""
        return self.url + "/" + self.shards[i]["path"]

    def _lock_path(self, name: str) -> str:
        return os.path.join(self.dir, "locks", name + ".lock")

    def _pin_path(self, name: str) -> str:
        return os.path.join(self.dir, "pins", name + ".pin")

    def store_manifest(self) -> None:
        """Writes the URL and this manifest into the dataset dir (skipped where read-only)."""
        try:
            for sub in ("shards", "locks", "pins", "tmp"):
                os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
            mpath = os.path.join(self.dir, MANIFEST_NAME)
            try:
                with open(mpath, "rb") as f:
                    same = f.read() == self.manifest_bytes
            except FileNotFoundError:
                same = False
            if not same:
                _atomic_write(mpath, [self.manifest_bytes])
            upath = os.path.join(self.dir, "url")
            if not os.path.exists(upath):
                _atomic_write(upath, [self.url.encode("utf-8") + b"\n"])
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            # Read-only cache: usable for shards that are already there.

    def is_published(self, i: int) -> bool:
        """Whether shard ``i`` is in the cache at its manifest size (NOTE [cache publish])."""
        try:
            return os.stat(self.shard_file(i)).st_size == self.shards[i]["bytes"]
        except FileNotFoundError:
            return False

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
                st = os.stat(p)
            except FileNotFoundError:
                continue
            out.append(Entry(self, n, p, st.st_size, st.st_mtime, n in refs))
        return out

    # -- pins (NOTE [cache pins]) --------------------------------------------------------
    def pin(self, i: int) -> None:
        """Holds a shared flock on shard i's pin until ``unpin`` (or process exit)."""
        with self._mu:
            if self._pins_pid != os.getpid():  # after fork the inherited fds are not ours to manage
                self._pins, self._pins_pid = {}, os.getpid()
            if i in self._pins:
                return
            try:
                os.makedirs(os.path.join(self.dir, "pins"), exist_ok=True)
            except OSError:
                pass  # read-only cache: _lock_fd opens what exists
            # Waits only while an evictor holds it (one unlink).
            fd = _lock_fd(self._pin_path(self.names[i]), fcntl.LOCK_SH, 60.0, None)
            self._pins[i] = -1 if fd is None else fd  # None: read-only cache, nothing can evict
        try:
            os.utime(self.shard_file(i))  # LRU: last use
        except OSError:
            pass

    def unpin(self, i: int) -> None:
        """Releases this process's pin on shard ``i``, if it holds one."""
        with self._mu:
            fd = self._pins.pop(i, None) if self._pins_pid == os.getpid() else None
        if fd is not None and fd >= 0:
            os.close(fd)

    def unpin_all(self) -> None:
        """Releases every pin this object holds."""
        for i in list(self._pins):
            self.unpin(i)

    def is_pinned(self, name: str) -> bool:
        """Whether any process (this one included) pins the shard file ``name``."""
        fd = _open_lockfile(self._pin_path(name))
        if fd is None:
            return False
        try:
            return not _try_flock(fd, fcntl.LOCK_EX)
        finally:
            os.close(fd)

    def evict_entry(self, e: Entry) -> bool:
        """Removes one published shard unless a reader pins it or a downloader holds it."""
        lfd = _open_lockfile(self._lock_path(e.name))
        pfd = _open_lockfile(self._pin_path(e.name))
        try:
            if lfd is None or pfd is None:
                return False
            if not _try_flock(lfd, fcntl.LOCK_EX) or not _try_flock(pfd, fcntl.LOCK_EX):
                return False
            try:
                os.unlink(e.path)
            except FileNotFoundError:
                pass
            return True
        finally:
            for fd in (lfd, pfd):
                if fd is not None:
                    os.close(fd)

    def remove_if_idle(self) -> int:
        """Removes this dataset's directory if it holds no shards or temp files. Returns files removed."""
        if self.entries() or (os.path.isdir(self.tmp_dir) and os.listdir(self.tmp_dir)):
            return 0
        n = 0
        for sub in ("locks", "pins"):
            d = os.path.join(self.dir, sub)
            for name in os.listdir(d) if os.path.isdir(d) else []:
                fd = _open_lockfile(os.path.join(d, name))
                if fd is None:
                    continue
                try:
                    if _try_flock(fd, fcntl.LOCK_EX):
                        os.unlink(os.path.join(d, name))
                        n += 1
                    else:
                        return n  # someone holds it: keep the directory
                finally:
                    os.close(fd)
        for name in (MANIFEST_NAME, "url"):
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
        """Publishes shard i unless it already is (one download per node). Returns (path, downloaded?)."""
        final = self.shard_file(i)
        if self.is_published(i):
            return final, False
        shard = self.shards[i]["path"]
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
            if self.is_published(i):  # another process published it while we waited
                return final, False
            self._download_locked(i, cancel, on_bytes)
            return final, True
        finally:
            lock.__exit__()

    def _download_locked(self, i: int, cancel: threading.Event | None,
                         on_bytes: Callable[[int], None] | None) -> None:
        name, info = self.names[i], self.shards[i]
        size, shard, url = int(info["bytes"]), info["path"], self.shard_url(i)
        # Only the lock holder writes temps of this shard: any left are from dead writers.
        for n in os.listdir(self.tmp_dir):
            if n.startswith(name + ".") and n.endswith(".part"):
                try:
                    os.unlink(os.path.join(self.tmp_dir, n))
                except FileNotFoundError:
                    pass
        tmp = os.path.join(self.tmp_dir, f"{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part")
        fd = -1
        try:
            with self.cache.space_lock():
                self.cache.make_room(size, shard=shard)
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                try:
                    os.posix_fallocate(fd, 0, size)  # reserve now: a full disk fails here, cleanly
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                        raise _cache_error(e.errno, f"{url}: shard {shard!r}: no space in cache {self.cache.base} "
                                           f"for {size} bytes ({os.strerror(e.errno)})", shard) from None
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
            fs, root = self._filesystem()
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
            os.replace(tmp, self.shard_file(i))
            _fsync_dir(self.shard_dir)
        except OSError as e:
            if isinstance(e, PyloaderError):
                raise
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES):
                raise _cache_error(e.errno, f"{url}: shard {shard!r}: cannot write to cache {self.cache.base}: "
                                   f"{os.strerror(e.errno)}", shard) from None
            raise
        finally:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    # -- checks --------------------------------------------------------------------------
    def verify_entry(self, e: Entry) -> str | None:
        """None if a published file matches the manifest; else what is wrong."""
        if not e.referenced:
            return None  # from an older manifest: nothing to check it against (evicted first)
        i = self.names.index(e.name)
        info = self.shards[i]
        if e.bytes != info["bytes"]:
            return f"size {e.bytes}, manifest says {info['bytes']}"
        fd = os.open(e.path, os.O_RDONLY | os.O_CLOEXEC)
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
        changed = RemoteChangedError(
            errno.EIO, f"{url}: shard {shard!r}: {problem} (twice): the object changed after the manifest "
            "was read; re-open the dataset to read the new manifest")
        changed.url, changed.shard = url, shard
        return changed

    def remove_entry(self, e: Entry) -> None:
        """Removes a bad file even if pinned: a mapper keeps its inode (NOTE [cache pins])."""
        with _Flock(self._lock_path(e.name), fcntl.LOCK_EX, 60.0):
            try:
                os.unlink(e.path)
            except FileNotFoundError:
                pass


class _Empty:
    def __enter__(self) -> bytes:
        return b""

    def __exit__(self, *a: object) -> None:
        pass
