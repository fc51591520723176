"""Lock files across fork (NOTE [lock files across fork] in pyloader/remote/locks.py).

A child forked while other threads open, lock and close lock files must inherit none of
their descriptors: one it does not know of would hold the parent's flock for as long as the
child lives, and the child's own fetcher would then time out on a lock nobody releases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from remote_util import child_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc")

# Runs in a fresh interpreter: 3 threads open, flock and close lock files in a loop while the
# main thread forks; each child counts its descriptors on the lock directory, then forks a
# grandchild (whose fork must not wait on a mutex the first fork left held) and reports.
PROGRAM = r"""
import fcntl, json, os, sys, threading, time
from pyloader.remote.locks import close_lockfile, open_lockfile
d, budget, most = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
stop = threading.Event()

def worker(i):
    p = os.path.join(d, f"shard-{i}.lock")
    while not stop.is_set():
        fd = open_lockfile(p)
        fcntl.flock(fd, fcntl.LOCK_EX)
        close_lockfile(fd)

def fds_on_dir():
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{f}").startswith(d + os.sep)
        except OSError:
            pass
    return n

threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(3)]
for t in threads:
    t.start()
forks = leaked = grand_failed = 0
deadline = time.monotonic() + budget
while time.monotonic() < deadline and forks < most:
    pid = os.fork()
    if pid == 0:
        code = 1 if fds_on_dir() else 0
        if forks % 50 == 0:  # a fork in the child: its lock-file mutex must be free
            g = os.fork()
            if g == 0:
                os._exit(0)
            code |= 2 * (os.waitstatus_to_exitcode(os.waitpid(g, 0)[1]) != 0)
        os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    forks += 1
    leaked += code & 1
    grand_failed += (code >> 1) & 1
stop.set()
for t in threads:
    t.join()
print(json.dumps({"forks": forks, "leaked": leaked, "grand_failed": grand_failed}))
"""


def test_a_child_forked_while_threads_open_and_close_lock_files_inherits_none(tmp_path) -> None:
    d = tmp_path / "locks"
    d.mkdir()
    r = subprocess.run([sys.executable, "-c", PROGRAM, str(d), "4", "600"], capture_output=True, text=True,
                       env=child_env(ROOT), timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["forks"] >= 50, got  # enough forks to have caught the threads mid-call
    assert got["leaked"] == 0, f"children that inherited a lock file's descriptor: {got}"
    assert got["grand_failed"] == 0, got
