"""The node cache's index: what it holds, in LRU order, shared by the node's processes.

NOTE [cache index]: making room for a download (``ShardCache.make_room``, under the
space lock) needs the bytes the cache holds and, once it is full, its shards in LRU
order, unreferenced first. Listing every dataset, manifest, shard and temp for that
costs milliseconds per download and grows with the cache, so the space lock keeps an
index instead: ``<root>/index``, a journal of text lines, each ending in the XXH64 of
the rest, appended only under the space lock:

* ``H`` (the first line): format version, the (device, inode) of the cache root and
  when the directory was last listed;
* ``A key name bytes mtime_ns ino ref`` a published shard (added or updated),
  ``D key name`` one gone;
* ``R key temp name bytes ref`` a download's temp file (its bytes reserved),
  ``Q key temp`` one settled.

Each process keeps the state in memory (a dict and a heap by ``(referenced,
mtime)``) and, under the space lock, reads only the lines appended since it last
looked: one ``lstat`` of the index and one ``pread``. A journal longer than three lines
per live entry is rewritten as a snapshot (a new file renamed over the old; the other
processes see the new inode and read it once), so the work per download is O(1)
amortized, whatever the size of the cache. A journal rather than a shared mmap'd table:
appends are atomic enough to check line by line, a reader never sees a half-updated
structure, and a torn or hostile file is detected by its checksums and thrown away.

Changes made outside the space lock are not journaled, and are found instead:

* a download publishes by rename without the lock: its ``R`` line stays until a
  holder of the lock settles it (``resolve_pending``: temp still there, published, or
  gone), which it does when the cache looks full or many are open. A temp counts its
  full size from its reservation to its settling, published or not, so these bytes are
  never missed;
* a reader's pin refreshes the shard's mtime (NOTE [cache pins] in
  pyloader/remote/pins.py): the heap is corrected lazily, each candidate's mtime is
  checked by ``lstat`` before it is evicted and a newer one puts it back. Mtimes only
  move forward under the protocol, so the order is exactly LRU;
* a file removed behind the cache's back (``discard``, a person) is dropped when it
  comes up as a candidate; a cache that still looks full is listed again before
  ``make_room`` says it is full, so an index that overcounts never refuses a download;
* the directory is listed again (``rebuild``) on first use, when the index is missing,
  unreadable, fails a checksum or names an invalid path, belongs to another root
  (a copied cache), was last listed ``REFRESH_S`` ago, or was dropped (``invalidate``)
  by ``evict``, ``clear`` or a dataset's new manifest (which changes what is referenced).
  So what the protocol cannot see (files added by hand or by an older pyloader, an mtime
  set back) is counted again within ``REFRESH_S``: that is the bounded drift. A process
  about to download lists the directory *before* taking the lock once its copy is 80%
  of ``REFRESH_S`` old (``refresh_ahead``): the next holder of the lock replays onto that
  listing the journal lines written since it began, so a large cache is listed without
  holding the lock; only the first listing of a cache, or one after ``invalidate``, is
  taken under it. A process's first read of the index is also taken before the lock
  (``preload``).

A process killed mid-update leaves either a torn last line (the next holder of the lock
truncates it) or an unjournaled change, which the rules above settle: an eviction whose
``D`` line is missing is a vanished candidate, a download killed after its rename is a
temp that is gone and a shard that is there. Nothing read from the index becomes a path
unchecked: a key and a name are each one file-name component, and a candidate is removed
only if its dataset's directories are real directories (NOTE [cache paths] in
pyloader/remote/cache.py) and it is not a directory itself.
"""

from __future__ import annotations

import errno
import heapq
import os
import re
import stat
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable

import pyloader._C as _C

__all__ = ["INDEX_FILE", "REFRESH_S", "CacheIndex", "index_for"]

INDEX_FILE = "index"
REFRESH_S = 600.0  # the longest the index goes without a listing of the directory
_MAGIC = b"pyloader-cache-index"
_VERSION = b"1"
_MAX_BYTES = 1 << 50
_MAX_INT = 1 << 64
_MAX_FILE = 1 << 30  # an index larger than this is not read (about ten million lines)
_PENDING_SETTLE = 64  # open reservations past which they are settled on every make_room
_PLAIN = re.compile(r"[A-Za-z0-9_.~+=,@%-]+")  # written as is; any other name as "!" + its quote()


class _Bad(Exception):
    """A line of the index is torn, corrupt or names an invalid path: rebuild from the directory."""


def _enc(s: str) -> bytes:
    if _PLAIN.fullmatch(s):
        return s.encode("ascii")
    return b"!" + urllib.parse.quote(s, safe="", errors="surrogateescape").encode("ascii")


def _dec(b: bytes) -> str:
    s = b.decode("ascii")
    if s[:1] == "!":
        s = urllib.parse.unquote(s[1:], errors="surrogateescape")
    if not s or "/" in s or "\0" in s or s in (".", "..") or len(os.fsencode(s)) > 255:
        raise _Bad(f"not one file-name component: {s!r}")
    return s


def _int(b: bytes, top: int = _MAX_INT) -> int:
    if not b.isdigit() or len(b) > 20:
        raise _Bad(f"not a count: {b!r}")
    v = int(b)
    if v >= top:
        raise _Bad(f"out of range: {v}")
    return v


def _line(*fields: bytes) -> bytes:
    body = b" ".join(fields)
    return body + b" %016x\n" % _C.xxh64(body)


def _real_dir(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode)


class _State:
    """What the index holds, in memory: shards, reservations, bytes, the LRU heap (NOTE [cache index])."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._reset()

    def _reset(self) -> None:
        self._entries: dict[tuple[str, str], list[int]] = {}  # (key, name) -> [bytes, mtime_ns, ino, ref]
        self._pending: dict[tuple[str, str], tuple[str, int, int]] = {}  # (key, temp) -> (name, bytes, ref)
        self._heap: list[tuple[int, int, str, str]] = []  # (ref, mtime_ns, key, name); lazily deleted
        self.used = 0
        self._out: list[bytes] = []  # lines to append at commit
        self._bulk = False  # loading many lines: the heap is built once at the end

    @property
    def shards(self) -> int:
        """Published shards in the index."""
        return len(self._entries)

    def _put(self, key: str, name: str, size: int, mtime: int, ino: int, ref: int) -> None:
        old = self._entries.get((key, name))
        if old is not None:
            self.used -= old[0]
        self._entries[(key, name)] = [size, mtime, ino, ref]
        self.used += size
        if not self._bulk:
            heapq.heappush(self._heap, (ref, mtime, key, name))

    def _drop(self, key: str, name: str) -> None:
        old = self._entries.pop((key, name), None)
        if old is not None:
            self.used -= old[0]

    def _reserve(self, key: str, temp: str, name: str, size: int, ref: int) -> None:
        self._settle(key, temp)
        self._pending[(key, temp)] = (name, size, ref)
        self.used += size

    def _settle(self, key: str, temp: str) -> None:
        old = self._pending.pop((key, temp), None)
        if old is not None:
            self.used -= old[1]

    def _apply(self, line: bytes) -> None:
        """Applies one line (with its newline); raises _Bad for one that is corrupt or names an invalid path."""
        if not line.endswith(b"\n"):
            raise _Bad("torn line")
        line = line[:-1]
        f = line.split(b" ")
        if len(f) < 2 or len(f[-1]) != 16 or _C.xxh64(line[:-17]) != int(f[-1], 16):
            raise _Bad("checksum mismatch")
        op = f[0]
        if op == b"A" and len(f) == 8:
            self._put(_dec(f[1]), _dec(f[2]), _int(f[3], _MAX_BYTES), _int(f[4]), _int(f[5]), _int(f[6], 2))
        elif op == b"D" and len(f) == 4:
            self._drop(_dec(f[1]), _dec(f[2]))
        elif op == b"R" and len(f) == 7:
            self._reserve(_dec(f[1]), _dec(f[2]), _dec(f[3]) if f[3] != b"-" else "", _int(f[4], _MAX_BYTES),
                          _int(f[5], 2))
        elif op == b"Q" and len(f) == 4:
            self._settle(_dec(f[1]), _dec(f[2]))
        else:
            raise _Bad(f"unknown line {op!r}")

    def _emit_put(self, key: str, name: str, size: int, mtime: int, ino: int, ref: int) -> None:
        self._put(key, name, size, mtime, ino, ref)
        self._out.append(_line(b"A", _enc(key), _enc(name), b"%d" % size, b"%d" % mtime, b"%d" % ino, b"%d" % ref))

    def _emit_drop(self, key: str, name: str) -> None:
        self._drop(key, name)
        self._out.append(_line(b"D", _enc(key), _enc(name)))

    def _fill(self, temps: Iterable[tuple[str, str, int]],
              entries: Iterable[tuple[str, str, int, int, int, bool]]) -> None:
        self._reset()
        for key, temp, size in temps:
            try:
                _dec(_enc(key)), _dec(_enc(temp))
            except _Bad:
                continue
            self._reserve(key, temp, _temp_shard(temp), max(0, size), 1)
        for key, name, size, mtime, ino, ref in entries:
            try:
                _dec(_enc(key)), _dec(_enc(name))
            except _Bad:
                continue
            self._put(key, name, max(0, size), max(0, mtime), max(0, ino), int(bool(ref)))

    def resolve_pending(self) -> None:
        """Settles the reservations whose temp is gone: published (now a shard) or given up."""
        for (key, temp), (name, _size, ref) in list(self._pending.items()):
            d = os.path.join(self.root, key)
            if os.path.lexists(os.path.join(d, "tmp", temp)):
                continue
            if name:
                try:
                    st = os.lstat(os.path.join(d, "shards", name))
                    if not stat.S_ISDIR(st.st_mode):
                        self._emit_put(key, name, st.st_size, st.st_mtime_ns, st.st_ino, ref)
                except OSError:
                    pass
            self._settle(key, temp)
            self._out.append(_line(b"Q", _enc(key), _enc(temp)))

    @property
    def pending(self) -> int:
        """Open reservations (downloads in progress or not yet settled)."""
        return len(self._pending)

    def settle_if_many(self) -> None:
        """Settles the reservations once there are many (a process that never fills the cache)."""
        if len(self._pending) > _PENDING_SETTLE:
            self.resolve_pending()

    def evict_lru(self, fits: Callable[[int], bool], evict: Callable[[str, str, str], bool]) -> int:
        """Evicts shards, unreferenced first then least recently used, until ``fits(used)``.

        ``evict(dataset dir, name, path)`` removes one unless it is in use (False). Returns
        the bytes held after.
        """
        kept: list[tuple[int, int, str, str]] = []
        dirs: dict[str, bool] = {}
        while self._heap and not fits(self.used):
            item = heapq.heappop(self._heap)
            ref, mtime, key, name = item
            e = self._entries.get((key, name))
            if e is None or e[1] != mtime or e[3] != ref:
                continue  # an older position of an entry since updated or dropped
            d = os.path.join(self.root, key)
            if key not in dirs:
                dirs[key] = _real_dir(d) and _real_dir(os.path.join(d, "shards"))
            path = os.path.join(d, "shards", name)
            try:
                st = os.lstat(path) if dirs[key] else None
            except FileNotFoundError:
                st = None
            if st is None or stat.S_ISDIR(st.st_mode):
                self._emit_drop(key, name)  # gone behind our back (or never ours)
                continue
            if st.st_mtime_ns != mtime or st.st_size != e[0] or st.st_ino != e[2]:
                # used since it was indexed (a pin), or replaced: back at its true place
                self._emit_put(key, name, st.st_size, st.st_mtime_ns, st.st_ino, ref)
                continue
            if evict(d, name, path):
                self._emit_drop(key, name)
            else:
                kept.append(item)
        for item in kept:
            heapq.heappush(self._heap, item)
        if len(self._heap) > 2 * len(self._entries) + 1024:
            self._heap = [(e[3], e[1], k, n) for (k, n), e in self._entries.items()]
            heapq.heapify(self._heap)
        return self.used


class CacheIndex(_State):
    """This process's copy of the index of cache layout ``root`` (NOTE [cache index]).

    Every method but ``preload`` runs with the space lock held (so one thread of one
    process at a time); ``preload`` reads into a copy of its own.
    """

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, INDEX_FILE)
        self._fd = -1
        self._pre: CacheIndex | None = None  # a copy read without the lock, for the next holder to take
        # a listing taken without the lock: (state, its file, fd, bytes, lines, the journal's end when it began)
        self._refresh: tuple[CacheIndex, str, int, int, int, tuple[int, int, int]] | None = None
        self._refreshing = False
        self._pre_mu = threading.Lock()
        super().__init__(root)

    def _reset(self) -> None:
        """Forgets the state and the file (closing this process's descriptor of it)."""
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = -1
        self._pid = os.getpid()
        self._id: tuple[int, int] | None = None  # (st_dev, st_ino) of the file read
        self._off = 0  # bytes of it applied
        self._lines = 0
        self.scanned_at_ns = 0
        super()._reset()

    # -- reading ---------------------------------------------------------------------
    def preload(self) -> None:
        """Reads the index once without the space lock, so that the lock is held only for the lines after.

        For a process's first use: the lines are checked as always; a torn last line is
        left to the next holder of the lock.
        """
        if self._fd >= 0 or self._pre is not None:
            return
        fresh = CacheIndex(self.root)  # its own state: a thread holding the lock may be using ours
        if not fresh.sync(locked=False) and fresh._fd < 0:
            return  # (a copy only due for a listing is kept: refresh_ahead lists it)
        old = self._swap_preloaded(fresh)
        if old is not None:
            old._reset()

    def _swap_preloaded(self, new: CacheIndex | None) -> CacheIndex | None:
        with self._pre_mu:
            old, self._pre = self._pre, new
        return old

    def _take_preloaded(self) -> None:
        pre = self._swap_preloaded(None)
        if pre is None:
            return
        if self._fd >= 0 or pre._pid != os.getpid():
            pre._reset()
            return
        for name in ("_fd", "_id", "_off", "_lines", "scanned_at_ns", "_entries", "_pending", "_heap", "used"):
            setattr(self, name, getattr(pre, name))
        pre._fd = -1

    def sync(self, *, locked: bool = True) -> bool:
        """Brings this copy up to date with the file; False if the directory must be listed (``rebuild``).

        ``locked``: the space lock is held (so a torn last line is a dead writer's, and is cut).
        """
        if self._pid != os.getpid():
            self._fd = -1  # the parent's descriptor: our copy of it is closed below with the state
            self._reset()
        if locked:
            self._take_preloaded()
            self._take_refresh()
        self._out = []
        try:
            st = os.lstat(self.path)
        except OSError:
            self._reset()
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_FILE:
            return False
        try:
            if self._id != (st.st_dev, st.st_ino) or st.st_size < self._off:
                self._reset()
                if not self._open_current():
                    return False
                st = os.fstat(self._fd)
            if st.st_size > self._off:
                self._read_tail(st.st_size, locked)
        except (_Bad, UnicodeDecodeError, ValueError):
            self._reset()
            return False
        except OSError:
            self._reset()
            return False
        age = time.time_ns() - self.scanned_at_ns
        return -60e9 < age < REFRESH_S * 1e9  # (a listing "from the future" is not trusted either)

    def _open_current(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        st = os.fstat(fd)
        self._fd, self._id = fd, (st.st_dev, st.st_ino)
        if not stat.S_ISREG(st.st_mode):
            raise _Bad("not a regular file")
        head = os.pread(fd, 256, 0)
        end = head.find(b"\n")
        if end < 0:
            raise _Bad("no header")
        line = head[:end]
        f = line.split(b" ")
        if len(f) != 7 or f[0] != b"H" or f[1] != _MAGIC or f[2] != _VERSION or len(f[-1]) != 16 \
                or _C.xxh64(line[:-17]) != int(f[-1], 16):
            raise _Bad("bad header")
        rst = os.stat(self.root)
        if (_int(f[3]), _int(f[4])) != (rst.st_dev, rst.st_ino):
            raise _Bad("the index of another cache root")
        self.scanned_at_ns = _int(f[5])
        self._off, self._lines = end + 1, 1
        return True

    def _read_tail(self, size: int, locked: bool) -> None:
        data = os.pread(self._fd, size - self._off, self._off)
        end = data.rfind(b"\n") + 1
        lines = data[:end].split(b"\n")[:-1]
        self._bulk = len(lines) > 1024
        try:
            for line in lines:
                self._apply(line + b"\n")
        finally:
            if self._bulk:
                self._bulk = False
                self._heap = [(e[3], e[1], k, n) for (k, n), e in self._entries.items()]
                heapq.heapify(self._heap)
        self._lines += len(lines)
        self._off += end
        if end < len(data) and locked:
            # A torn last line: its writer died mid-append while holding the lock we hold now.
            os.ftruncate(self._fd, self._off)

    # -- writing ---------------------------------------------------------------------
    def commit(self) -> None:
        """Appends the lines this holder of the lock emitted; rewrites a long journal as a snapshot."""
        if not self._out or self._fd < 0:
            self._out = []
            return
        data, n = b"".join(self._out), len(self._out)
        self._out = []
        try:
            wrote = os.write(self._fd, data)
            if wrote != len(data):
                raise OSError(errno.ENOSPC, "short write")
            self._off += wrote
            self._lines += n
            if os.fstat(self._fd).st_size != self._off:  # someone wrote without the lock (no flock here)
                self._reset()
                return
            if self._lines > max(4096, 3 * (len(self._entries) + len(self._pending))):
                self._write_snapshot(self.scanned_at_ns)
        except OSError:
            self.invalidate()  # a full disk: the next holder of the lock lists the directory

    def _write_file(self, tmp: str, scanned_at_ns: int) -> tuple[int, int, int]:
        """Writes this state as a snapshot into new file ``tmp``: (its fd, bytes, lines)."""
        rst = os.stat(self.root)
        fd = os.open(tmp, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            lines = [_line(b"H", _MAGIC, _VERSION, b"%d" % rst.st_dev, b"%d" % rst.st_ino, b"%d" % scanned_at_ns)]
            enc: dict[str, bytes] = {}  # a dataset's key, encoded once
            lines += [_line(b"A", enc.get(k) or enc.setdefault(k, _enc(k)), _enc(n), b"%d" % e[0], b"%d" % e[1],
                            b"%d" % e[2], b"%d" % e[3]) for (k, n), e in self._entries.items()]
            lines += [_line(b"R", _enc(k), _enc(t), _enc(p[0]) if p[0] else b"-", b"%d" % p[1], b"%d" % p[2])
                      for (k, t), p in self._pending.items()]
            data = b"".join(lines)
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write")
        except BaseException:
            _discard(fd, tmp)
            raise
        return fd, len(data), len(lines)

    def _write_snapshot(self, scanned_at_ns: int) -> None:
        tmp = f"{self.path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        fd, size, lines = self._write_file(tmp, scanned_at_ns)
        try:
            os.replace(tmp, self.path)
        except BaseException:
            _discard(fd, tmp)
            raise
        self._adopt_file(fd, size, lines, scanned_at_ns)

    def _adopt_file(self, fd: int, size: int, lines: int, scanned_at_ns: int) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        st = os.fstat(fd)
        self._fd, self._id, self._off, self._lines = fd, (st.st_dev, st.st_ino), size, lines
        self.scanned_at_ns = scanned_at_ns
        self._heap = [(e[3], e[1], k, n) for (k, n), e in self._entries.items()]
        heapq.heapify(self._heap)

    # -- a listing ahead of the lock -------------------------------------------------
    def ahead(self, listing: Callable[[], tuple[list[tuple[str, str, int]],
                                                list[tuple[str, str, int, int, int, bool]]]]) -> None:
        """Before the space lock: a process's first read of the index, or a listing due (``refresh_ahead``)."""
        self.preload()
        if self.refresh_due():
            self.refresh_ahead(listing)

    def sync_or_list(self, listing: Callable[[], tuple[list[tuple[str, str, int]],
                                                       list[tuple[str, str, int, int, int, bool]]]]) -> bool:
        """``sync``, else ``rebuild`` from ``listing()``; whether the directory was listed."""
        if self.sync():
            return False
        now = time.time_ns()
        self.rebuild(*listing(), now)
        return True

    def refresh_due(self) -> bool:
        """Whether this process's copy (or the one it preloaded) is due for a listing, ``REFRESH_S`` near."""
        pre = self._pre
        seen = max(self.scanned_at_ns if self._fd >= 0 else 0, pre.scanned_at_ns if pre is not None else 0)
        return seen > 0 and self._refresh is None and time.time_ns() - seen > 0.8 * REFRESH_S * 1e9

    def refresh_ahead(self, listing: Callable[[], tuple[list[tuple[str, str, int]],
                                                        list[tuple[str, str, int, int, int, bool]]]]) -> None:
        """Lists the directory without the space lock, for the next holder to take with the lines since.

        The end of the journal is marked first (a line boundary); the holder of the lock
        replays the lines after the mark onto the listing (they are idempotent: the state
        they leave does not depend on whether the listing saw their change already),
        appends them to the new file and renames it over the index, so the lock is held
        for the lines written meanwhile, not for the listing.
        """
        with self._pre_mu:
            if self._refreshing:
                return
            self._refreshing = True
        try:
            mark = self._journal_end()
            if mark is None:
                return
            now = time.time_ns()
            temps, entries = listing()
            fresh = CacheIndex(self.root)
            fresh._fill(temps, entries)
            tmp = f"{self.path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.refresh"
            fd, size, lines = fresh._write_file(tmp, now)
            fresh.scanned_at_ns = now
            with self._pre_mu:
                old, self._refresh = self._refresh, (fresh, tmp, fd, size, lines, mark)
            if old is not None:
                _discard(old[2], old[1])
        except OSError:
            return
        finally:
            self._refreshing = False

    def _journal_end(self) -> tuple[int, int, int] | None:
        """(st_dev, st_ino, offset just past the last whole line) of the index file, or None."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            tail = os.pread(fd, 1 << 16, max(0, st.st_size - (1 << 16)))
            cut = tail.rfind(b"\n")
            if cut < 0:
                return None
            return st.st_dev, st.st_ino, st.st_size - len(tail) + cut + 1
        finally:
            os.close(fd)

    def _take_refresh(self) -> None:
        with self._pre_mu:
            r, self._refresh = self._refresh, None
        if r is None:
            return
        fresh, tmp, fd, size, lines, (dev, ino, off) = r
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) != (dev, ino) or st.st_size < off or fresh._pid != os.getpid():
                raise _Bad("the index was replaced since the listing began")
            rfd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                data = os.pread(rfd, st.st_size - off, off)
            finally:
                os.close(rfd)
            data = data[: data.rfind(b"\n") + 1]
            for line in data.split(b"\n")[:-1]:
                fresh._apply(line + b"\n")
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write")
            os.replace(tmp, self.path)
        except (_Bad, OSError, ValueError):
            _discard(fd, tmp)
            return
        self._reset()
        self._entries, self._pending, self.used = fresh._entries, fresh._pending, fresh.used
        self._adopt_file(fd, size + len(data), lines + data.count(b"\n"), fresh.scanned_at_ns)

    def rebuild(self, temps: Iterable[tuple[str, str, int]],
                entries: Iterable[tuple[str, str, int, int, int, bool]], scanned_at_ns: int) -> None:
        """Replaces the index by a listing of the directory taken at ``scanned_at_ns``.

        ``temps``: (key, temp name, bytes); ``entries``: (key, name, bytes, mtime_ns, inode,
        referenced). Names that are not one component are left out. Where the file cannot
        be written (a full disk) the state serves this holder of the lock, and the next
        lists the directory again.
        """
        self._fill(temps, entries)
        self._remove_left_snapshots()
        try:
            self._write_snapshot(scanned_at_ns)
        except OSError:
            if self._fd >= 0:
                os.close(self._fd)
            self._fd, self._id = -1, None

    def _remove_left_snapshots(self) -> None:
        # Snapshots are written only under the space lock: one still here was left by a crash.
        try:
            names = os.listdir(self.root)
        except OSError:
            return
        now = time.time()
        for n in names:
            if not n.startswith(INDEX_FILE + "."):
                continue
            p = os.path.join(self.root, n)
            try:
                # A listing ahead of the lock (.refresh) is its writer's until it is REFRESH_S old.
                if n.endswith(".tmp") or n.endswith(".refresh") and now - os.lstat(p).st_mtime > REFRESH_S:
                    os.unlink(p)
            except OSError:
                pass

    def invalidate(self) -> None:
        """Drops the index file: the next holder of the lock lists the directory."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self._reset()

    # -- the accounting --------------------------------------------------------------
    def reserve(self, key: str, temp: str, name: str, size: int) -> None:
        """Counts ``size`` bytes for download temp ``temp`` of shard file ``name`` in dataset ``key``.

        Without a loaded copy (a process that never makes room) the line is only appended
        to an index that exists.
        """
        line = _line(b"R", _enc(key), _enc(temp), _enc(name), b"%d" % size, b"1")
        if self._fd >= 0 and self._pid == os.getpid() and self.sync():
            self._reserve(key, temp, name, size, 1)
            self._out.append(line)
            self.commit()
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return  # no index yet: the first process that makes room lists the directory
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.write(fd, line)
        except OSError:
            self.invalidate()
        finally:
            os.close(fd)

def _discard(fd: int, tmp: str) -> None:
    os.close(fd)
    try:
        os.unlink(tmp)
    except OSError:
        pass


def _temp_shard(temp: str) -> str:
    """The shard file a temp's name names (See NOTE [cache publish] in pyloader/remote/cache.py); "" if shortened."""
    parts = temp.rsplit(".", 4)
    if len(parts) == 5 and parts[4] == "part":
        stem = parts[0]
    else:
        parts = temp.rsplit(".", 3)
        if len(parts) != 4 or parts[3] != "part":
            return ""
        stem = parts[0]
    if len(stem) == 117 and stem[100] == "~":
        return ""  # a long name shortened (temps.temp_stem): the shard is found at the next listing
    return stem


_indexes: dict[str, CacheIndex] = {}


def index_for(root: str) -> CacheIndex:
    """This process's ``CacheIndex`` of cache layout ``root`` (a forked child starts its own)."""
    idx = _indexes.get(root)
    if idx is None or idx._pid != os.getpid():
        idx = _indexes[root] = CacheIndex(root)
    return idx


def _forget_indexes_in_child() -> None:
    # The parent's descriptors (its index, a preloaded copy, a listing taken ahead) are its own.
    fds = []
    for idx in _indexes.values():
        fds += [idx._fd, idx._pre._fd if idx._pre is not None else -1, idx._refresh[2] if idx._refresh else -1]
    for fd in fds:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    _indexes.clear()


os.register_at_fork(after_in_child=_forget_indexes_in_child)
