"""The node-local shard cache: one verified copy of each remote shard per node.

Layout (``root`` is ``cache_dir`` argument, else ``$PYLOADER_CACHE_DIR``, else
``$XDG_CACHE_HOME/pyloader`` or ``~/.cache/pyloader``)::

    root/v1/space.lock                  flock: held while accounting space / evicting
    root/v1/index                       what the cache holds, in LRU order (NOTE [cache index] in index.py)
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
exactly the manifest's size, (3) equal to the manifest's XXH64. So a reader that sees
the name sees a whole, verified file; a partial file only ever exists under ``tmp/``.
Shards are not fsynced: the wait would make the disk's synchronous write bandwidth (600
MB/s where the link brings 1 GB/s) the bound of every download, and a streamed shard is
often evicted before the kernel writes it back at all. A crash of the machine may leave a
published shard torn (its size right, its bytes not); every reader checks each record's
checksum on first use and a torn copy is discarded and fetched again (NOTE
[self-healing] in csrc/core/shard_reader.h), and ``pyloader cache verify`` finds it. Files
whose readers check no record (``"content_hash": false``: cached Parquet files) are
fsynced before the rename, and their directory after it. The shard's ``.lock``
flock makes it one download per node, but nothing depends on it: where flock does
nothing (some NFS, Lustre or GPFS mounts) two processes may download one shard at once,
each into its own temp, and the second rename replaces a verified file by an identical
one (a reader that opened the first keeps its inode). A writer removes only its own
temp. A temp whose writer died is reclaimed by its name's owner: at once if the owner
is this boot and pid namespace and its pid is gone (or a zombie), or an earlier boot of
this host (``owner_gone``: See NOTE [file owners]); otherwise (another host or pid
namespace, a name without an owner) once its
mtime is ``STALE_TEMP_S`` (1 h, pyloader/remote/temps.py) old. A live writer writes at least once per stall
timeout (30 s) or backoff (10 s), else gives up, so an hour-old temp has no live writer
(the hour also covers clock skew to a file server). Should its writer still be alive
anyway (stopped for an hour), it finds its temp gone at the rename and downloads again.
A temp in the older ``<name>.<pid>.<random>.part`` form is reclaimed when its pid is gone
here and nobody holds its shard's flock. Space for a download is reserved up front with
posix_fallocate, which turns a full disk into an immediate, clean error. A filesystem
whose flock or fcntl locks fail outright (ENOLCK, ENOTSUP, ENOSYS; EINVAL for OFD locks
on an old kernel) is treated as one whose locks do nothing.

A published file may still vanish between a reader's check and its open: evicted where
pins do not work (NOTE [cache pins] in pyloader/remote/pins.py), or removed by ``discard``
(pyloader/remote/bad_copies.py) because it failed a check. A reader that finds it gone
calls ``ensure`` again, which downloads it again.

The pieces this module builds on: lock files and the space lock (``locks.py``,
NOTE [lock files across fork]), pins (``pins.py``, NOTE [cache pins]), temp files and
their owners (``temps.py``, NOTE [temps at SIGTERM]); bad copies are checked and removed
by ``bad_copies.py``.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyloader._C as _C

from ..errors import CacheError, CacheLimitError, ManifestError, PyloaderError, RemoteCorruptError
from ..format.encode import atomic_write as _atomic_write
from ..format.sizes import format_size, parse_size
from ..format.spec import MANIFEST_NAME, parse_manifest
from . import temps
from .fs import FetchError, RetryPolicy, with_retries
from .index import CacheIndex, index_for
from .locks import Flock, SpaceLock, byte_lock, cache_error, close_lockfile, open_lockfile, try_flock
from .names import default_cache_dir, lock_file_name, quote_key, shard_cache_name
from .pins import PINS_FILE, DatasetPins, evict_unpinned
from .temps import new_temp_name, reclaim_temps, track_temp, untrack_temp
from .transport import Transport, transport_for

__all__ = ["DISCARD_LOG", "LAYOUT", "DatasetCache", "Entry", "ShardCache", "dataset_key", "default_cache_dir",
           "fsync_dir", "normalize_url", "shard_cache_name"]

LAYOUT = "v1"

# What to free, for a write that failed on a full disk.
_FULL_HINT = {errno.ENOSPC: " (no space or no inodes left: free some, or set a smaller cache limit or another "
                            "cache_dir)",
              errno.EDQUOT: " (disk quota exceeded: free some, or set another cache_dir)"}
DISCARD_LOG = "discarded.log"


def normalize_url(url: str) -> str:
    """The dataset's root URL: no trailing slash, no ``manifest.json``."""
    u = url.rstrip("/")
    if u.endswith("/" + MANIFEST_NAME):
        u = u[: -len(MANIFEST_NAME) - 1]
    return u


def dataset_key(url: str) -> str:
    """The dataset's directory name in the cache: XXH64 (16 hex digits) of its normalized URL."""
    return f"{_C.xxh64(normalize_url(url).encode('utf-8')):016x}"


def fsync_dir(path: str) -> None:
    """Makes the renames in directory ``path`` durable (an fsync of the directory); errors are ignored."""
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


def _real_dir(path: str) -> None:
    """Creates directory ``path`` if needed; raises CacheError if it is a link or not a directory.

    See NOTE [cache paths]. Callers check each directory of the cache they write in, from
    the layout root down.
    """
    os.makedirs(path, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise cache_error(errno.ENOTDIR, f"{path} is {what}: "
                           "pyloader keeps its cache in real directories only; remove it "
                           "(and check who can write to the cache directory: docs/security.md)")


def _uncreatable(d: DatasetCache, err: int) -> CacheError:
    """The error of dataset ``d``'s directory that cannot be created: its cache and the settings that move it."""
    where = next(p for p in (d.cache.base, d.cache.root, d.dir) if not os.path.isdir(p))
    return cache_error(err, f"cache directory {d.cache.base}: cannot create {where} ({os.strerror(err)}) to cache "
                       f"{d.url}; give a writable one (cache_dir=, --cache-dir or PYLOADER_CACHE_DIR)")


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
    mtime_ns: int = 0  # ``mtime`` in nanoseconds (0: unknown)


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
        return temps.temp_files(self.root)

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

    def space_lock(self, timeout: float = 60.0) -> SpaceLock:
        """The node-wide lock (a context manager) held while accounting space or evicting.

        Raises ``CacheError`` when it is not acquired within ``timeout`` seconds.
        """
        os.makedirs(self.root, exist_ok=True)
        return SpaceLock(self.root, timeout)

    def make_room(self, need: int, *, shard: str | None = None) -> None:
        """With the space lock held: evicts LRU unpinned shards until ``need`` bytes fit (NOTE [cache index] in index.py)."""
        if self.limit is None:
            return
        if need > self.limit:
            raise CacheLimitError(f"shard {shard!r} ({format_size(need)}) is larger than the cache limit of "
                                  f"{format_size(self.limit)} ({self.base}); set the limit (cache_limit=, --limit) "
                                  f"to at least {format_size(need)}")
        limit = self.limit
        idx, listed = self._index()
        used = idx.used
        if used + need > limit:
            idx.resolve_pending()
            if idx.pending and idx.used + need > limit and self.clean_stale():  # dead writers' temps count too
                idx.resolve_pending()
            used = idx.evict_lru(lambda u: u + need <= limit, evict_unpinned)
            if used + need > limit and not listed and time.time_ns() - idx.scanned_at_ns > 1e9:
                # What the index holds may be gone: list the directory (at most once a second) and retry.
                idx.commit()
                idx.rebuild(*self._listing(), time.time_ns())
                used = idx.evict_lru(lambda u: u + need <= limit, evict_unpinned)
        else:
            idx.settle_if_many()
        idx.commit()
        if used + need > limit:
            raise cache_error(errno.ENOSPC, f"cache {self.base} is full: {used} of {limit} bytes are held "
                               f"by shards in use or being downloaded; cannot fit shard {shard!r} ({need} bytes). "
                               "Raise the limit or read fewer shards at once.", shard)

    def _index(self) -> tuple[CacheIndex, bool]:
        """This process's index, brought up to date under the space lock: (index, listed just now?)."""
        idx = index_for(self.root)
        return idx, idx.sync_or_list(self._listing)

    def _listing(self) -> tuple[list[tuple[str, str, int]], list[tuple[str, str, int, int, int, bool]]]:
        """The directory as the index holds it: temps, then shards (the order of ``_held``)."""
        tmps = [(os.path.basename(d), os.path.basename(p), size) for d, p, size in self.temp_files()]
        return tmps, [(e.dataset.key, e.name, e.bytes, e.mtime_ns, e.ino, e.referenced) for e in self.entries()]

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
            index_for(self.root).invalidate()  # listed again at the next make_room (NOTE [cache index])
            return evicted, busy

    def clean_stale(self) -> int:
        """Deletes temp files whose writer is gone (NOTE [cache publish]). Returns the count."""
        return temps.clean_stale(self.root)

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
            index_for(self.root).invalidate()  # See NOTE [cache index]
        return removed, busy

    def stats(self) -> dict[str, Any]:
        """Counts and bytes of the cached datasets, shards, pinned shards and temp files."""
        ds = self.datasets()
        entries, pinned = [], []
        for d in ds:
            mine = d.entries()
            held = d._pins.pinned(e.name for e in mine)  # one open of its pins.lock per dataset
            entries += mine
            pinned += [e for e in mine if e.name in held]
        temps = self.temp_files()
        return {"cache_dir": self.base, "datasets": len(ds), "shards": len(entries),
                "bytes": sum(e.bytes for e in entries), "pinned_shards": len(pinned),
                "pinned_bytes": sum(e.bytes for e in pinned), "temp_files": len(temps),
                "temp_bytes": sum(s for _, _, s in temps),
                "unreferenced_shards": sum(1 for e in entries if not e.referenced)}


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
        self._pins = DatasetPins(self._pins_path)  # the pins this object holds (a pickled copy holds none)
        self._transport: Transport | None = None
        self._transport_pid = -1

    def __getstate__(self) -> dict[str, Any]:
        s = self.__dict__.copy()
        s["_transport"], s["_transport_pid"] = None, -1
        return s

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
        path = self.shards[i]["path"]
        return self.url + "/" + (quote_key(path) if self.url.split("://", 1)[0].lower() in ("http", "https") else path)

    def lock_path(self, name: str) -> str:
        """The download lock file of shard file ``name`` (flock EX while it is downloaded or a bad copy removed)."""
        return os.path.join(self.dir, "locks", lock_file_name(name))

    @property
    def _pins_path(self) -> str:
        return os.path.join(self.dir, PINS_FILE)

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
                with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
                    same = f.read() == self.manifest_bytes
                replaced = not same
            except FileNotFoundError:
                same = replaced = False
            except OSError as e:  # a link planted there: replaced below, never followed
                if e.errno != errno.ELOOP:
                    raise
                same, replaced = False, True
            if not same:
                _atomic_write(path, [self.manifest_bytes])
            if replaced:  # what is referenced changed: the index is listed again (NOTE [cache index])
                with self.cache.space_lock():
                    index_for(self.cache.root).invalidate()
            path = os.path.join(self.dir, "url")
            if not os.path.lexists(path):
                _atomic_write(path, [self.url.encode("utf-8") + b"\n"])
        except CacheError:
            raise
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                if os.path.isdir(self.dir):
                    return  # read-only cache: usable for shards that are already there
                raise _uncreatable(self, e.errno) from None  # nothing of it there, and none can be
            raise cache_error(e.errno or errno.EIO, f"{self.url}: cannot write {path} in cache {self.cache.base}: "
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
            out.append(Entry(self, n, p, st.st_size, st.st_mtime, n in refs, st.st_ino, st.st_mtime_ns))
        return out

    # -- pins (NOTE [cache pins]) --------------------------------------------------------
    def new_pins(self) -> DatasetPins:
        """A holder of pins of one reader (a fetcher): its ``release_all`` drops its own only (NOTE [cache pins])."""
        return DatasetPins(self._pins_path)

    def pin(self, i: int, pins: DatasetPins | None = None) -> None:
        """Pins shard ``i`` through ``pins`` (else this object) until ``unpin`` or process exit (NOTE [cache pins])."""
        if not (pins or self._pins).hold(i, self.names[i]):
            return  # this holder pins it already
        try:
            os.utime(self.shard_file(i), follow_symlinks=False)  # LRU: last use (a link is never followed)
        except (OSError, NotImplementedError):
            pass

    def unpin(self, i: int, pins: DatasetPins | None = None) -> None:
        """Releases the pin on shard ``i`` that ``pins`` (else this object) holds, if any."""
        (pins or self._pins).release(i)

    def unpin_all(self) -> None:
        """Releases every pin this object holds (not those of its ``new_pins()`` holders)."""
        self._pins.release_all()

    def is_pinned(self, name: str) -> bool:
        """Whether any process (this one included) pins the shard file ``name``."""
        return name in self._pins.pinned([name])

    def evict_entry(self, e: Entry) -> bool:
        """Removes one published shard unless a reader pins it or a downloader holds it."""
        return evict_unpinned(self.dir, e.name, e.path)

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
                if not byte_lock(fd, fcntl.F_WRLCK, 0, 0):
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
                    if try_flock(fd, fcntl.LOCK_EX):
                        os.unlink(os.path.join(d, name))
                        n += 1
                    else:
                        return n  # someone holds it: keep the directory
                finally:
                    close_lockfile(fd)
        for name in (MANIFEST_NAME, "url", DISCARD_LOG):
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
    def transport(self) -> Transport:
        """How this dataset's shards are downloaded in this process (NOTE [transport choice])."""
        if self._transport is None or self._transport_pid != os.getpid():
            self._transport = transport_for(self.url, self.storage_options, stall_timeout=self.policy.stall_timeout)
            self._transport_pid = os.getpid()
        return self._transport

    def acquire(self, i: int, *, cancel: threading.Event | None = None,
                on_bytes: Callable[[int], None] | None = None,
                pins: DatasetPins | None = None) -> tuple[str, bool]:
        """Pins shard i (through ``pins``, else this object), publishes it: (local path, downloaded here?)."""
        self.pin(i, pins)
        try:
            return self.ensure(i, cancel=cancel, on_bytes=on_bytes)
        except BaseException:
            self.unpin(i, pins)
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
            raise cache_error(errno.EROFS, f"{self.shard_url(i)}: shard {shard!r} is not cached and the cache "
                               f"directory {self.dir} is not writable", shard)
        wait = self.policy.deadline + 2 * self.policy.stall_timeout
        try:
            lock = Flock(self.lock_path(self.names[i]), fcntl.LOCK_EX, wait, cancel)
            lock.__enter__()
        except CacheError as e:
            if cancel is not None and cancel.is_set():
                raise FetchError(errno.ECANCELED, f"{self.shard_url(i)}: cancelled") from None
            raise cache_error(e.errno or errno.EIO, f"{self.shard_url(i)}: shard {shard!r}: {e}", shard) from None
        try:
            lost = 0
            while not self.is_published(i):  # else another process published it while we waited
                try:
                    self._download_locked(i, cancel, on_bytes)
                    return final, True
                except _TempLost:
                    lost += 1
                    if lost == 3:
                        raise cache_error(errno.EIO, f"{self.shard_url(i)}: shard {shard!r}: the temp file of "
                                           f"its download in {self.tmp_dir} was removed by another process, "
                                           "three times", shard) from None
            return final, False
        finally:
            lock.__exit__()

    def _create_temp(self, name: str) -> tuple[str, int]:
        """A new temp file of shard ``name``, in a name only this writer uses: (path, fd)."""
        for _ in range(2):
            tmp = os.path.join(self.tmp_dir, new_temp_name(name))
            try:
                return tmp, os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except FileNotFoundError:
                _real_dir(self.tmp_dir)  # `clear` removed it meanwhile
        return tmp, os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)

    @property
    def _durable(self) -> bool:
        """Whether a download is fsynced before it is published (NOTE [cache publish])."""
        return self.manifest.get("content_hash") is False

    def _publish(self, tmp: str, final: str) -> None:
        """``os.replace`` of a verified temp onto its published name (NOTE [cache publish])."""
        try:
            os.replace(tmp, final)
        except FileNotFoundError:
            if not os.path.exists(tmp):
                raise _TempLost() from None
            _real_dir(self.shard_dir)  # `clear` removed it meanwhile
            os.replace(tmp, final)
        if self._durable:
            fsync_dir(self.shard_dir)

    def _download_locked(self, i: int, cancel: threading.Event | None,
                         on_bytes: Callable[[int], None] | None) -> None:
        name, info = self.names[i], self.shards[i]
        size, shard, url = int(info["bytes"]), info["path"], self.shard_url(i)
        reclaim_temps(self.dir, name)
        tmp, fd = "", -1
        # The transport first (its first use imports and connects, which a cancel cannot
        # interrupt): a temp then exists only while bytes can flow or be cancelled.
        transport = self.transport()
        if self.cache.limit is not None:  # before the lock: See NOTE [cache index]
            index_for(self.cache.root).ahead(self.cache._listing)
        try:
            with self.cache.space_lock():
                self.cache.make_room(size, shard=shard)
                tmp, fd = self._create_temp(name)
                track_temp(tmp)
                index_for(self.cache.root).reserve(self.key, os.path.basename(tmp), name, size)  # See NOTE [cache index]
                try:
                    os.posix_fallocate(fd, 0, size)  # reserve now: a full disk fails here, cleanly
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                        raise cache_error(e.errno, f"{url}: shard {shard!r}: no space in cache {self.cache.base} "
                                           f"for {size} bytes ({os.strerror(e.errno)})", shard) from None
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
            for attempt in range(2):
                digest = with_retries(lambda stop: transport.download_into(fd, shard, size, url=url, shard=shard,
                                                                           cancel=stop, on_bytes=on_bytes),
                                      self.policy, what="downloading", url=url, shard=shard, cancel=cancel,
                                      attempt_stop=True)
                if self._durable:  # See NOTE [cache publish]: records checked on use need no fsync
                    os.fsync(fd)
                problem = self.content_problem(fd, size, i, digest)
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
                raise cache_error(e.errno, f"{url}: shard {shard!r}: cannot write to cache {self.cache.base}: "
                                   f"{os.strerror(e.errno)}{_FULL_HINT.get(e.errno, '')}", shard) from None
            where = e.filename or tmp or self.dir
            raise cache_error(e.errno or errno.EIO, f"{url}: shard {shard!r}: {where} in cache {self.cache.base}: "
                               f"{e.strerror or e}", shard) from None
        finally:
            if fd >= 0:
                os.close(fd)
            if tmp:  # ours alone: created O_EXCL under a name no other writer uses
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                untrack_temp(tmp)

    # -- checks --------------------------------------------------------------------------
    # Whether a download whose bytes fail content_problem() is fetched once more (the object
    # may have been mid-replacement) before content_error() is raised.
    retry_bad_content = True

    def content_problem(self, fd: int, size: int, i: int, digest: int | None = None) -> str | None:
        """None if the ``size`` bytes in ``fd`` are shard ``i`` of the manifest; else what is wrong.

        ``digest``: their XXH64, when the download computed it on the way (NOTE [native
        transport] in csrc/core/http_fetch.h); else they are read back and hashed.

        The one check behind both publishing a download and ``pyloader cache verify``. A
        manifest with ``"content_hash": false`` (cached Parquet files, pyloader.read.parquet)
        names each remote object by identity, not by its bytes: there the Parquet magic at
        both ends is checked instead.
        """
        info = self.shards[i]
        if self.manifest.get("content_hash") is False:
            head, tail = os.pread(fd, 4, 0), os.pread(fd, 4, max(0, size - 4))
            return None if head == tail == b"PAR1" else "not a Parquet file (no PAR1 magic at both ends)"
        if digest is not None:
            got = digest
        else:
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


class _Empty:
    def __enter__(self) -> bytes:
        return b""

    def __exit__(self, *a: object) -> None:
        pass


__all__ = ["DISCARD_LOG", "LAYOUT", "DatasetCache", "Entry", "ShardCache", "close_lockfile", "dataset_key",
           "default_cache_dir", "fsync_dir", "normalize_url", "open_lockfile", "shard_cache_name"]
