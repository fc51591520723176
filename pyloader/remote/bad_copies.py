"""Cached copies that fail their check: finding them (``verify_entry``) and removing them.

A reader that meets a corrupt cached shard (a checksum that does not match on read)
``discard``s that copy and fetches it again (See NOTE [self-healing] in
csrc/core/shard_reader.h); ``pyloader cache verify`` checks every copy (``verify_entry``)
and removes the bad ones (``remove_entry``). The check itself is the dataset's
``DatasetCache.content_problem``, the one behind publishing a download
(See NOTE [cache publish] in pyloader/remote/cache.py). A bad copy is removed even while
pinned: a process that has it mapped keeps its inode
(See NOTE [cache pins] in pyloader/remote/pins.py).
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

from .cache import DISCARD_LOG, DatasetCache, Entry, fsync_dir
from .locks import Flock, cache_error

__all__ = ["discard", "remove_entry", "verify_entry"]


def verify_entry(dcache: DatasetCache, e: Entry) -> str | None:
    """None if a published file matches the manifest; else what is wrong."""
    if not e.referenced:
        return None  # from an older manifest: nothing to check it against (evicted first)
    i = dcache.names.index(e.name)
    info = dcache.shards[i]
    if e.bytes != info["bytes"]:
        return f"size {e.bytes}, manifest says {info['bytes']}"
    try:
        fd = os.open(e.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None  # evicted meanwhile: nothing cached, nothing wrong
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "a symbolic link, not a shard file (see NOTE [cache paths])"
        raise cache_error(err.errno or errno.EIO, f"cannot open cached shard {e.path}: "
                          f"{err.strerror or err}", e.name) from None
    try:
        return dcache.content_problem(fd, e.bytes, i)
    finally:
        os.close(fd)


def remove_entry(dcache: DatasetCache, e: Entry) -> None:
    """Removes a bad file even if pinned: a mapper keeps its inode (NOTE [cache pins]).

    Only the file ``e`` listed: a copy published since (another inode) stays.
    """
    _remove_bad(dcache, e.name, e.ino or None, e.path)


def discard(dcache: DatasetCache, i: int, *, reason: str,
            expect: int | os.stat_result | tuple[int, int] | None = None) -> bool:
    """Removes the published copy of shard ``i`` that failed a check, so ``dcache.ensure(i)`` downloads it again.

    For a reader that found the cached shard corrupt (a checksum that does not match
    on read), then calls ``dcache.ensure(i)`` once more. Safe while other processes have the
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
            st = os.stat(dcache.shard_file(i))
        except FileNotFoundError:
            return False
        entry = Entry(dcache, dcache.names[i], dcache.shard_file(i), st.st_size, st.st_mtime, True, st.st_ino)
        if verify_entry(dcache, entry) is None:
            return False
        want = (st.st_dev, st.st_ino)
    removed = _remove_bad(dcache, dcache.names[i], want, dcache.shard_file(i))
    if removed:
        line = (f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {os.uname().nodename} pid {os.getpid()} "
                f"{dcache.names[i]}: {reason}").replace("\n", " ")
        try:
            fd = os.open(os.path.join(dcache.dir, DISCARD_LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT
                         | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                os.write(fd, line.encode("utf-8", "replace") + b"\n")  # one append: whole lines
            finally:
                os.close(fd)
        except OSError:
            pass  # the log is a record for people, not part of the protocol
    return removed


def _remove_bad(dcache: DatasetCache, name: str, want: int | tuple[int, int] | None, path: str) -> bool:
    """Unlinks ``path`` if it still is the file ``want`` names (inode, or (dev, inode)).

    Under the shard's download lock, so no copy is published meanwhile (where flock
    works; elsewhere a good copy removed in that instant costs one more download).
    """
    wait = dcache.policy.deadline + 2 * dcache.policy.stall_timeout
    with Flock(dcache.lock_path(name), fcntl.LOCK_EX, wait):
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
                raise cache_error(e.errno, f"cannot remove the bad copy {path}: the cache is read-only "
                                  f"({os.strerror(e.errno)})", name) from None
            raise cache_error(e.errno or errno.EIO, f"cannot remove the bad copy {path}: "
                              f"{e.strerror or e}", name) from None
        fsync_dir(os.path.dirname(path))
        return True
