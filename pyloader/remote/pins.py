"""Pins of the node cache: the shards some process may have mapped, which eviction skips.

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
time a reader pins it (``os.utime`` without following a link). Within a process each
reader -- each fetcher, so a dataset read directly and as a Mixture source counts twice --
holds its pins through a ``DatasetPins`` of its own (``DatasetCache.new_pins``), counted
per byte by the ``_PinFile``: closing one reader drops its pins only, never a shard
another reader of the same dataset still pins.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import pyloader._C as _C

from .locks import (
    LOCK_POLL_S,
    byte_held,
    byte_lock,
    cache_error,
    close_lockfile,
    open_lockfile,
    same_file,
    try_flock,
)
from .names import lock_file_name

__all__ = ["PINS_FILE", "DatasetPins", "evict_unpinned", "lock_unpinned", "pin_offset"]

PINS_FILE = "pins.lock"


def pin_offset(name: str) -> int:
    """The byte of ``pins.lock`` that pins the cached file ``name``: 62 bits of its XXH64."""
    return _C.xxh64(name.encode("utf-8")) >> 2


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
            delay = LOCK_POLL_S
            while True:
                first = not self.counts
                if first and self.fd is None:
                    self.fd = open_lockfile(self.path)
                if self.fd is None:
                    break  # a read-only cache without pins.lock: nothing there can evict
                if byte_lock(self.fd, fcntl.F_RDLCK, offset):
                    if not first or same_file(self.path, self.fd):
                        break
                    self._close()  # `clear` replaced pins.lock before our first lock: use the new one
                    continue
                if time.monotonic() >= deadline:
                    if first:
                        self._close()
                    raise cache_error(errno.ETIMEDOUT, f"timed out after {timeout:.0f} s waiting to pin byte "
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
                byte_lock(self.fd, fcntl.F_UNLCK, offset)
                if not self.counts:
                    self._close()

    def _close(self) -> None:
        if self.fd is not None:
            close_lockfile(self.fd)
            self.fd = None


_pin_files: dict[str, _PinFile] = {}
_pin_files_mu = threading.Lock()
_live_pins: weakref.WeakSet[DatasetPins] = weakref.WeakSet()


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
    # Each DatasetPins starts empty too, with a new mutex: a thread of the parent (a
    # download pinning its shard) may have held the old one at the fork, and in the child
    # no thread would ever release it (the child's first pin hung on it).
    for pins in list(_live_pins):
        pins._held, pins._mu = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_pins_in_child)



def lock_unpinned(fd: int, name: str) -> bool:
    """A write lock on the byte of shard file ``name`` through ``fd``, never waiting: False while it is pinned.

    ``fd`` is the evictor's own description of ``pins.lock`` (``open_lockfile``); its
    lock goes when it is closed (See NOTE [cache pins]).
    """
    return byte_lock(fd, fcntl.F_WRLCK, pin_offset(name))


def evict_unpinned(ddir: str, name: str, path: str) -> bool:
    """Removes shard file ``name`` (at ``path``) of dataset dir ``ddir`` unless a reader pins it or a downloader holds it."""
    lfd = open_lockfile(os.path.join(ddir, "locks", lock_file_name(name)))
    pfd = open_lockfile(os.path.join(ddir, PINS_FILE))
    try:
        if lfd is None or pfd is None:
            return False
        if not try_flock(lfd, fcntl.LOCK_EX) or not lock_unpinned(pfd, name):
            return False
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return True
    finally:
        for fd in (lfd, pfd):
            if fd is not None:
                close_lockfile(fd)  # the only fd of its open file description: its locks go with it


class DatasetPins:
    """The pins one ``DatasetCache`` object holds in its dataset's ``pins.lock``, by shard index.

    Through this process's ``_PinFile`` of the path (See NOTE [cache pins]). Pins taken
    before a fork are the parent's: a forked child neither sees nor releases them. A
    pickled copy holds no pins.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._held: dict[int, int] = {}  # shard index -> its byte in pins.lock
        self._mu = threading.Lock()
        _live_pins.add(self)  # reset in a forked child (_forget_pins_in_child)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, s: dict[str, Any]) -> None:
        self.__init__(s["path"])  # type: ignore[misc]  # a copy starts with no pins

    def hold(self, i: int, name: str, timeout: float = 60.0) -> bool:
        """Pins shard ``i`` (cached file ``name``); False if this object already pins it."""
        with self._mu:
            if i in self._held:
                return False
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)  # `clear` may have removed an idle dataset dir
            except OSError:
                pass  # read-only cache: the pin file is opened if it exists
            off = pin_offset(name)
            # Waits only while an evictor holds the byte (one unlink).
            _pin_file(self.path).hold(off, timeout)
            self._held[i] = off
            return True

    def release(self, i: int) -> None:
        """Drops this object's pin on shard ``i``, if it holds one."""
        with self._mu:
            off = self._held.pop(i, None)
            if off is not None:
                _pin_file(self.path).release(off)

    def release_all(self) -> None:
        """Drops every pin this object holds."""
        for i in list(self._held):
            self.release(i)

    def pinned(self, names: Iterable[str]) -> set[str]:
        """Which of the shard files ``names`` some process (this one included) pins: one open of ``pins.lock``."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return set()  # no pins.lock: nobody pins anything here
        try:
            return {n for n in names if byte_held(fd, pin_offset(n))}
        finally:
            os.close(fd)
