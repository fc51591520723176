"""Temp files of the node cache: downloads in progress, their owners, and the ones left behind.

A download writes into ``<dataset>/tmp/<name>.<owner>.<pid>.<random>.part``, a name only
its writer uses, and publishes it by rename (See NOTE [cache publish] in
pyloader/remote/cache.py, which also says when a temp's writer is gone;
See NOTE [file owners] in pyloader/format/owner.py). This module names temps, tells whose writer is
gone (``temp_is_stale``), removes those (``reclaim_temps``, ``clean_stale``), and removes
this process's own at SIGTERM (NOTE [temps at SIGTERM]).
"""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
import uuid

import pyloader._C as _C

from ..format.owner import owner, owner_gone, pid_alive
from .locks import close_lockfile, open_lockfile, try_flock
from .names import lock_file_name

__all__ = ["STALE_TEMP_S", "clean_stale", "new_temp_name", "reclaim_temps", "remove_temps_at_sigterm",
           "temp_files", "temp_is_stale", "temp_stem", "track_temp", "untrack_temp"]

# A temp file whose writer cannot be checked (another host or pid namespace) is reclaimed
# once its mtime is this old (NOTE [cache publish] says why an hour is safe).
STALE_TEMP_S = 3600.0

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


def temp_stem(name: str) -> str:
    """The part of a temp's name that names its shard: the shard's name, shortened if long."""
    if len(name) <= 128:
        return name
    return f"{name[:100]}~{_C.xxh64(name.encode('utf-8')):016x}"


def new_temp_name(name: str) -> str:
    """A new temp file name for shard file ``name``, one only this writer uses (its owner, pid and 8 random hex digits)."""
    return f"{temp_stem(name)}.{owner()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"


def temp_is_stale(ddir: str, path: str, now: float) -> bool:
    """Whether the writer of temp file ``path`` (in dataset dir ``ddir``) is gone (NOTE [cache publish])."""
    try:
        old = now - os.stat(path).st_mtime > STALE_TEMP_S
    except FileNotFoundError:
        return False
    n = os.path.basename(path)
    parts = n.rsplit(".", 4)
    if len(parts) == 5 and parts[4] == "part" and parts[2].isdigit() and parts[1].count("-") == 2:
        return owner_gone(parts[1], int(parts[2])) is True or old
    parts = n.rsplit(".", 3)
    if len(parts) == 4 and parts[3] == "part" and parts[1].isdigit():
        # The older <name>.<pid>.<random>.part form: its writer ran here and held the flock.
        if pid_alive(int(parts[1])):
            return old
        fd = open_lockfile(os.path.join(ddir, "locks", lock_file_name(parts[0])))
        if fd is None:
            return False
        try:
            return try_flock(fd, fcntl.LOCK_EX)
        finally:
            close_lockfile(fd)
    return old


def track_temp(path: str) -> None:
    """Enters ``path``, a temp this process writes, among those removed at SIGTERM (NOTE [temps at SIGTERM])."""
    _live_temps.add(path)


def untrack_temp(path: str) -> None:
    """Drops ``path`` from this process's live temps, once it is renamed or removed."""
    _live_temps.discard(path)


def reclaim_temps(ddir: str, name: str) -> None:
    """Removes the temps of shard file ``name`` in dataset dir ``ddir`` whose writers are gone (NOTE [cache publish])."""
    tmp_dir = os.path.join(ddir, "tmp")
    stem, now = temp_stem(name) + ".", time.time()
    try:
        names = os.listdir(tmp_dir)
    except FileNotFoundError:
        return
    for n in names:
        p = os.path.join(tmp_dir, n)
        if n.startswith(stem) and temp_is_stale(ddir, p, now):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def temp_files(root: str) -> list[tuple[str, str, int]]:
    """(dataset dir, temp path, size) of every temp under cache layout ``root``, live or left by a dead process."""
    out = []
    try:
        keys = os.listdir(root)
    except FileNotFoundError:
        return []
    for key in keys:
        tdir = os.path.join(root, key, "tmp")
        try:
            names = os.listdir(tdir)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for n in names:
            p = os.path.join(tdir, n)
            try:
                out.append((os.path.join(root, key), p, os.stat(p).st_size))
            except FileNotFoundError:
                pass
    return out


def clean_stale(root: str) -> int:
    """Deletes the temps under cache layout ``root`` whose writer is gone (NOTE [cache publish]). Returns the count."""
    now = time.time()
    n = 0
    for ddir, p, _ in temp_files(root):
        if temp_is_stale(ddir, p, now):
            try:
                os.unlink(p)
                n += 1
            except FileNotFoundError:
                pass
    return n
