"""No temp file left in the cache by a Ctrl-C, on every path (NOTE [downloads at exit],
NOTE [temps at SIGTERM]); a reader after a killed downloader proceeds at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from remote_util import temp_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TORCH_WORKERS = """
import sys, torch, pyloader
ds = pyloader.ShardDataset(sys.argv[1], cache_dir=sys.argv[2], fetch_jobs=2)
print("start", flush=True)
for b in torch.utils.data.DataLoader(ds, batch_size=64, num_workers=2):
    pass
"""
NATIVE = """
import sys, pyloader
ds = pyloader.ShardDataset(sys.argv[1], cache_dir=sys.argv[2], fetch_jobs=2)
print("start", flush=True)
for b in pyloader.DataLoader(ds, batch_size=64, num_workers=2):
    pass
"""
READ = """
import sys, time, pyloader
ds = pyloader.ShardDataset(sys.argv[1], cache_dir=sys.argv[2], fetch_jobs=2)
print("start", flush=True)
t = time.monotonic()
n = sum(len(b["x"]) for b in ds.batches(64))
print("read", n, time.monotonic() - t, flush=True)
"""


def _default_sigint() -> None:
    # The test run may have SIGINT ignored (nohup, a background job): the child must not inherit that.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def slow_ds(slow_server, tmp_path):
    return slow_server.url + "/ds", str(tmp_path / "cache"), slow_server


def _start(code: str, url: str, cache: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", code, url, cache], start_new_session=True, preexec_fn=_default_sigint,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "start"
    return p


def _wait_for_temps(cache: str, timeout: float = 30.0) -> None:
    """Until a download is under way (a temp exists)."""
    deadline = time.monotonic() + timeout
    while not temp_files(cache):
        assert time.monotonic() < deadline, "no download started"
        time.sleep(0.02)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("code", [TORCH_WORKERS, NATIVE], ids=["torch-workers", "pyloader-native"])
def test_ctrl_c_mid_download_leaves_no_temp(slow_ds, code):
    url, cache, _ = slow_ds
    for _ in range(2):
        p = _start(code, url, cache)
        _wait_for_temps(cache)
        os.killpg(p.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole process group
        _, err = p.communicate(timeout=60)
        assert p.returncode in (1, -signal.SIGINT), err
        assert "KeyboardInterrupt" in err
        # Every process of the group is gone (a torch worker ends at its parent's SIGTERM).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        assert temp_files(cache) == []


@pytest.mark.timeout(240)
def test_a_reader_after_a_killed_downloader_proceeds_at_once(slow_ds):
    """The killed writer's flock goes with it and its temp is reclaimed by the next writer:
    the next reader waits for nothing but its own downloads."""
    url, cache, server = slow_ds
    p = _start(READ, url, cache)
    _wait_for_temps(cache)
    os.killpg(p.pid, signal.SIGKILL)
    p.communicate(timeout=60)
    dead = temp_files(cache)
    assert dead  # SIGKILL leaves the temp: nothing can run in the process
    server.bandwidth = 1e12
    t = time.monotonic()
    q = _start(READ, url, cache)
    out, err = q.communicate(timeout=120)
    took = time.monotonic() - t
    assert q.returncode == 0, err
    assert out.split()[:2] == ["read", "1200"]
    assert took < 30, f"the next reader took {took:.1f} s"
    assert not set(dead) & set(temp_files(cache))  # the dead writer's temps were reclaimed
