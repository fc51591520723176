"""Worker processes whose exit an epoch does not wait for (NOTE [late reaping]).

NOTE [late reaping]: a pool of one epoch tells each worker to exit once the parent has its
last batch (``WorkerPool.retire``, NOTE [transform pool] in pool.py); the worker that made
the final batch is still exiting when the loop asks for the batch after it. Its exit is
the kernel tearing down a process forked from one with torch loaded (its copied page
tables: 5.5-9 ms here), and the epoch's end waited for it: 8-13 ms of a 0.2-0.3 s epoch of
a numpy transform, at every epoch. Such a process has nothing left to hand over (every
batch of it is in, its slot files are the parent's to remove), so the epoch ends without
waiting, and a daemon thread of the loader's process (``pyloader-reaper``) waits for the
processes to end and reaps them, as ``_shutdown`` would have: one still running after
``grace`` seconds is terminated, then killed. The thread ends when nothing is left to
reap; interpreter exit reaps what is left (bounded the same way), and where no thread can
be started the epoch's end reaps them itself, as before. A forked child forgets
its parent's list (those processes are not its children). Measured (numpy features, 1,024
samples, 2 workers): the epoch's last batch to its end 1.6-4.8 ms against 7.8-10.9 ms; a
script's work between epochs (evaluation, a checkpoint) now overlaps the exit. Epochs run
back to back gain nothing: the exit then overlaps the next epoch's fork and first batches
instead (epochs 2-6 of 8 fresh processes each, alternated: medians 220-238 ms against
219-230 ms). The thread stays ``LINGER_S`` seconds after its last reap, waiting for the next
epoch's processes: starting a thread waits until it runs, 1-2 ms of every epoch's end on a
busy 2-core machine.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import wait as wait_handles
from typing import Any

LINGER_S = 30.0  # how long the reaper waits for more processes once it has none

_lock = threading.Lock()
_more = threading.Condition(_lock)  # notified when processes are added
_exiting: list[tuple[Any, float]] = []  # (process, when it is terminated if still running)
_thread: threading.Thread | None = None


def reap_later(procs: list[Any], grace: float) -> None:
    """Reaps ``procs`` (told to exit) on the reaper thread: terminated if still running after ``grace`` s."""
    global _thread
    deadline = time.monotonic() + grace
    started = True
    with _lock:
        _exiting.extend((p, deadline) for p in procs)
        _more.notify()
        if _thread is None or not _thread.is_alive():
            thread = threading.Thread(target=_run, name="pyloader-reaper", daemon=True)
            try:
                thread.start()
                _thread = thread
            except RuntimeError:  # no thread to be had (a process limit, interpreter shutdown)
                started = False
    if not started:
        reap_now(grace)  # reaped here, as an epoch's end did before


def _run() -> None:
    global _thread
    while True:
        with _lock:
            if not _exiting:
                _more.wait(LINGER_S)
            if not _exiting:
                if _thread is threading.current_thread():
                    _thread = None
                return
            todo = list(_exiting)
        left = min(d for _, d in todo) - time.monotonic()
        if left > 0:
            wait_handles([p.sentinel for p, _ in todo], timeout=left)
        if not _reap(todo, force=False):
            # A sentinel fires as the process closes its files, a moment before it can be
            # reaped: look again shortly rather than spin on it.
            time.sleep(0.002)


def _reap(todo: list[tuple[Any, float]], force: bool) -> int:
    """Joins those of ``todo`` that ended; stops those past their deadline (all with ``force``); how many ended."""
    ended = 0
    now = time.monotonic()
    for p, deadline in todo:
        if p.exitcode is None and (force or now >= deadline):
            p.terminate()
            p.join(2.0)
            if p.exitcode is None:
                p.kill()
                p.join(2.0)
        if p.exitcode is not None:
            p.join()
            ended += 1
            with _lock:
                if (p, deadline) in _exiting:  # (reap_now may have taken it meanwhile)
                    _exiting.remove((p, deadline))
    return ended


def reap_now(timeout: float) -> None:
    """Waits up to ``timeout`` s for the processes still exiting, then stops the rest (interpreter exit)."""
    with _lock:
        todo = list(_exiting)
    if not todo:
        return
    wait_handles([p.sentinel for p, _ in todo if p.exitcode is None], timeout=timeout)
    _reap(todo, force=True)


def _forget() -> None:
    global _lock, _more, _thread
    _lock = threading.Lock()  # (the reaper may have held it at the fork)
    _more = threading.Condition(_lock)
    _exiting.clear()
    _thread = None


os.register_at_fork(after_in_child=_forget)

__all__ = ["LINGER_S", "reap_later", "reap_now"]
