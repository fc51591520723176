"""Helpers shared by the tests of tests/native and the stand-in driver's child programs
(fake_cuda/children.py, which finds this module on its PYTHONPATH): thread counts, the one
way to run code in a forked child, and the image dataset of the copy-engine tests."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

# --- threads ---------------------------------------------------------------------------------


# (pid, thread ids) when the running test started (tests/native/conftest.py); None: not known.
_AT_START: tuple[int, frozenset[str]] | None = None


def note_threads_at_start() -> None:
    """Remembers the threads this process has now: the running test's start."""
    global _AT_START
    _AT_START = (os.getpid(), frozenset(os.listdir("/proc/self/task")))


def threads_now() -> int:
    """This process's threads: every one it had when the test started, whether or not it has ended since,
    plus those started since.

    A background thread of an earlier test in the same process (a reaper lingering for the next
    epoch's workers, NOTE [late reaping]) may end at any moment: counted as it was at the test's start,
    it cannot make a test's own threads look gone. In a forked child (no start known there): the plain count.
    """
    tids = os.listdir("/proc/self/task")
    if _AT_START is None or _AT_START[0] != os.getpid():
        return len(tids)
    return len(_AT_START[1]) + sum(t not in _AT_START[1] for t in tids)


def wait_threads(at_most: int, timeout: float = 5.0) -> int:
    """The thread count once it is <= at_most, or the last count seen after ``timeout`` s.

    A joined thread can linger in /proc for a moment after pthread_join returns."""
    deadline = time.monotonic() + timeout
    n = threads_now()
    while n > at_most and time.monotonic() < deadline:
        time.sleep(0.005)
        n = threads_now()
    return n


# --- forked children -------------------------------------------------------------------------


class ForkedChild(NamedTuple):
    pid: int
    code: int | None  # its exit code; None: it outlived the timeout and was killed
    log: str  # the steps it logged, then the traceback of what it raised, if anything


def run_in_forked_child(fn: Callable[[Callable[[str], None]], int], log_path: str, timeout: float, *,
                        normal_exit: bool = False) -> ForkedChild:
    """Runs ``fn(step)`` in a forked child, waits for it and returns what it reported.

    ``step(msg)`` appends a line to ``log_path`` as the child goes, so a child that hangs
    shows the last step it reached. ``fn`` returns the child's exit code (0: all good, else
    the check that failed); an exception is logged with its traceback and exits 99. The
    child leaves through ``os._exit``, so nothing of the parent (a pytest session, atexit
    handlers) runs twice. With ``normal_exit`` a child whose ``fn`` returned 0 leaves through
    ``sys.exit(0)`` instead and runs its finalizers and destructors: only for children of a
    standalone program, since in pytest the SystemExit would carry on the session in the child.
    A child still running after ``timeout`` s is killed; its log then ends with the stacks
    of its Python threads (faulthandler, 2 s before) and the state of every thread."""

    def step(msg: str) -> None:
        with open(log_path, "a") as fh:
            fh.write(msg + "\n")

    # Python >= 3.12 warns about fork() in a multi-threaded process; forking with live
    # native threads is exactly what these tests are about.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code and its log
        code = 99
        # a child that hangs writes its Python threads' stacks to the log before it is killed
        dump = open(log_path, "a")  # noqa: SIM115 - open until os._exit
        faulthandler.dump_traceback_later(max(0.5, timeout - 2.0), file=dump)
        try:
            code = int(fn(step))
        except BaseException:  # noqa: BLE001 - whatever happens, the child must not return
            step(traceback.format_exc())
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            if code != 0 or not normal_exit:
                os._exit(code)
        sys.exit(0)
    code = _wait_child(pid, timeout, log_path)
    try:
        with open(log_path) as fh:
            log = fh.read()
    except FileNotFoundError:
        log = "(no log)\n"
    return ForkedChild(pid, code, log)


def _wait_child(pid: int, timeout: float, log_path: str) -> int | None:
    """Exit code of forked child ``pid``, or None if it outlived ``timeout`` (it is then
    killed, after its threads were listed in ``log_path``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    with contextlib.suppress(OSError), open(log_path, "a") as fh:
        fh.write(_threads_of(pid))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _threads_of(pid: int) -> str:
    """Each thread of a hung child: its name, state and where the kernel has it waiting."""
    lines = [f"threads of the hung child {pid} (name, state, wchan):"]
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        def read(name: str, tid: str = tid) -> str:
            try:
                with open(f"/proc/{pid}/task/{tid}/{name}") as fh:
                    return fh.read().strip()
            except OSError:
                return "?"
        state = read("stat").rsplit(")", 1)[-1].split()[:1]
        lines.append(f"  {tid} {read('comm')} {state[0] if state else '?'} {read('wchan')}")
    return "\n".join(lines) + "\n"


# --- the copy-engine dataset (test_copy_engine, test_fake_driver, fake_cuda/children.py) -------

IMG = 512
FIELDS: dict[str, Any] = {"label": ("int64", ()), "img": ("uint8", (IMG,))}


def expected_img(i: int) -> np.ndarray:
    return ((np.arange(IMG, dtype=np.int64) * 13 + i) % 251).astype(np.uint8)


def sample(i: int) -> dict[str, Any]:
    return {"label": i, "img": expected_img(i)}
