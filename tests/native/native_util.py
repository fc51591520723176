"""Thread and process helpers shared by the tests of tests/native."""

from __future__ import annotations

import os
import signal
import time
import warnings


def threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


def wait_threads(at_most: int, timeout: float = 5.0) -> int:
    """The thread count once it is <= at_most, or the last count seen after ``timeout`` s.

    A joined thread can linger in /proc for a moment after pthread_join returns."""
    deadline = time.monotonic() + timeout
    n = threads_now()
    while n > at_most and time.monotonic() < deadline:
        time.sleep(0.005)
        n = threads_now()
    return n


def wait_child(pid: int, timeout: float) -> int | None:
    """Exit code of forked child ``pid``, or None if it outlived ``timeout`` (it is then killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def fork_quietly() -> int:
    # Python >= 3.12 warns about fork() in a multi-threaded process; forking with live
    # native threads is exactly what these tests are about.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()
