"""What the transform tests look at outside the loader: worker processes and slot files."""

from __future__ import annotations

import gc
import glob
import multiprocessing
import os
import time

from pyloader.transform.processes import shm_dir, slot_prefix


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def slot_files() -> list[str]:
    """This process's shared-memory slot files (NOTE [process executor])."""
    return glob.glob(os.path.join(shm_dir(), glob.escape(slot_prefix(os.getpid())) + "*"))


def wait_gone(pids: set[int], within: float = 5.0) -> set[int]:
    """The pids still alive after ``within`` seconds (reaping this process's exited children)."""
    deadline = time.monotonic() + within
    while True:
        multiprocessing.active_children()  # joins the children that exited
        left = {p for p in pids if alive(p)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def assert_nothing_left(pids: set[int]) -> None:
    """Once the loaders are dropped: the workers ``pids`` exited and no slot file is left."""
    gc.collect()
    assert not wait_gone(pids)
    assert not slot_files()
