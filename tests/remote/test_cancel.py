"""A cancel stops a stalled download at once (NOTE [download cancel]), not after the stall
timeout; dropping a dataset or Ctrl-C during a stalled download leaves no temp file."""

from __future__ import annotations

import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from remote_servers import Fault, FaultServer
from remote_util import child_env, temp_files

import pyloader
from pyloader.remote import fs as rfs
from pyloader.remote import throttle as rthrottle

BIG = "big.bin"
BIG_SIZE = 3 << 20  # three HTTP chunks


@pytest.fixture(autouse=True, params=["native", "fsspec"])
def transport(request, monkeypatch) -> str:
    """Each test through both transports (NOTE [transport choice]): the same behaviour is asked of either."""
    monkeypatch.setenv("PYLOADER_TRANSPORT", request.param)
    return str(request.param)


@pytest.fixture(autouse=True)
def slow_stall_timeout(monkeypatch):
    # A cancel must not wait for the stall timeout: make that long.
    monkeypatch.setenv("PYLOADER_FETCH_STALL_TIMEOUT", "30")
    rthrottle.forget_limiters()
    yield
    rthrottle.forget_limiters()


@pytest.fixture
def big(srv_root) -> bytes:
    data = os.urandom(BIG_SIZE)
    with open(os.path.join(srv_root, BIG), "wb") as f:
        f.write(data)
    return data


class Download:
    """``download_into`` on a thread, into a temp file, with a cancel event."""

    def __init__(self, tmp_path, fs, path: str, size: int, url: str) -> None:
        self.fd = os.open(str(tmp_path / "dl.part"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.cancel = threading.Event()
        self.error: BaseException | None = None
        self.ended = 0.0

        def run() -> None:
            try:
                rfs.download_into(self.fd, fs, path, size, url=url, shard=BIG, cancel=self.cancel)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                self.error = e
            self.ended = time.monotonic()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def cancel_and_time(self) -> float:
        t0 = time.monotonic()
        self.cancel.set()
        self.thread.join(10)
        assert not self.thread.is_alive(), "download_into did not return after the cancel"
        return self.ended - t0

    def close(self) -> None:
        os.close(self.fd)


def wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.01)


def assert_cancelled(e: BaseException | None) -> None:
    assert isinstance(e, pyloader.FetchError) and e.errno == errno.ECANCELED, repr(e)
    assert "cancelled" in str(e) and not str(e).startswith("[Errno")


@pytest.mark.timeout(60)
def test_cancel_ends_a_download_stalled_mid_body_at_once(server, big, tmp_path):
    server.inject(BIG, Fault("stall", seconds=30))  # half the body, then nothing
    url = server.url + "/" + BIG
    fs, path = rfs.filesystem(url, None, stall_timeout=30.0)
    dl = Download(tmp_path, fs, path, BIG_SIZE, url)
    try:
        wait_for(lambda: dl.size() >= 1 << 20)  # the first chunk is written, the second never completes
        time.sleep(0.3)
        at_cancel = dl.size()
        took = dl.cancel_and_time()
        assert took < 1.0, f"cancel took {took:.2f} s"
        assert_cancelled(dl.error)
        time.sleep(0.3)
        assert dl.size() == at_cancel == 1 << 20  # nothing written after the cancel
        with open(tmp_path / "dl.part", "rb") as f:
            assert f.read() == big[: 1 << 20]
    finally:
        dl.close()
    assert server.count(BIG) == 1


@pytest.mark.timeout(60)
def test_cancel_ends_a_download_whose_headers_never_come(srv_root, big, tmp_path):
    with FaultServer(srv_root, latency=30, max_life=40) as slow:
        url = slow.url + "/" + BIG
        fs, path = rfs.filesystem(url, None, stall_timeout=30.0)
        dl = Download(tmp_path, fs, path, BIG_SIZE, url)
        try:
            wait_for(lambda: slow.count(BIG) == 1)
            time.sleep(0.3)
            took = dl.cancel_and_time()
            assert took < 1.0, f"cancel took {took:.2f} s"
            assert_cancelled(dl.error)
            assert dl.size() == 0
        finally:
            dl.close()


@pytest.mark.timeout(60)
def test_a_cancel_is_not_retried_and_a_download_after_it_works(server, big, tmp_path):
    server.inject(BIG, Fault("stall", seconds=30))
    url = server.url + "/" + BIG
    policy = rfs.RetryPolicy.from_env()
    fs, path = rfs.filesystem(url, None, policy.stall_timeout)
    fd = os.open(str(tmp_path / "a.part"), os.O_RDWR | os.O_CREAT, 0o644)
    cancel = threading.Event()
    threading.Timer(0.4, cancel.set).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(pyloader.FetchError) as ei:
            rfs.with_retries(lambda: rfs.download_into(fd, fs, path, BIG_SIZE, url=url, shard=BIG, cancel=cancel),
                             policy, what="downloading", url=url, shard=BIG, cancel=cancel)
        assert time.monotonic() - t0 < 1.5
        assert_cancelled(ei.value)
        assert ei.value.attempts == 1 and server.count(BIG) == 1
        # The filesystem (its session, its event loop) is still fine.
        rfs.download_into(fd, fs, path, BIG_SIZE, url=url, shard=BIG)
        os.lseek(fd, 0, os.SEEK_SET)
        assert os.read(fd, BIG_SIZE + 1) == big
    finally:
        os.close(fd)


@pytest.mark.timeout(30)
def test_cancel_ends_a_wait_for_a_throttled_host(server):
    url = server.url + "/x"
    lim = rthrottle.host_limiter(url)
    with lim.slot() as t:
        lim.throttled(t, 30.0)  # the host is paused for 30 s
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    calls = []
    t0 = time.monotonic()
    with pytest.raises(pyloader.FetchError) as ei:
        rfs.with_retries(lambda: calls.append(1), rfs.RetryPolicy.from_env(), what="reading", url=url, shard=None,
                         cancel=cancel)
    assert time.monotonic() - t0 < 1.0 and calls == []
    assert_cancelled(ei.value)


@pytest.mark.timeout(30)
def test_synchronous_filesystems_download_and_see_a_cancel(tmp_path):
    import fsspec

    mem = fsspec.filesystem("memory")
    data = os.urandom(100_000)
    mem.pipe_file("/pyl-cancel/obj", data)
    fd = os.open(str(tmp_path / "m.part"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        rfs.download_into(fd, mem, "/pyl-cancel/obj", len(data), url="memory://pyl-cancel/obj", shard="obj")
        os.lseek(fd, 0, os.SEEK_SET)
        assert os.read(fd, len(data) + 1) == data
        cancel = threading.Event()
        cancel.set()
        with pytest.raises(pyloader.FetchError) as ei:
            rfs.download_into(fd, mem, "/pyl-cancel/obj", len(data), url="memory://pyl-cancel/obj", shard="obj",
                              cancel=cancel)
        assert_cancelled(ei.value)
    finally:
        os.close(fd)
        mem.rm("/pyl-cancel", recursive=True)


@pytest.mark.timeout(60)
def test_dropping_a_dataset_during_a_stalled_download_removes_its_temp_at_once(server, cache_dir):
    server.inject("ds/shard-000000.pyl", Fault("stall", seconds=30, times=None))
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir, fetch_jobs=2)
    it = ds.batches(4)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            next(it)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_for(lambda: server.count("ds/shard-000000.pyl") >= 1 and temp_files(cache_dir))
    time.sleep(0.3)
    t0 = time.monotonic()
    # A stream holds its dataset until it ends or closes (test_dropped_dataset.py): closed, it
    # lets the dataset go, and the dataset's finalizer closes its fetcher: its downloads are
    # cancelled.
    del ds
    it.close()
    gc.collect()
    wait_for(lambda: not temp_files(cache_dir), timeout=5)
    took = time.monotonic() - t0
    reader.join(5)
    assert took < 1.5, f"the temp file stayed {took:.2f} s"
    # the waiting next() ends with the close (or the cancelled download, whichever it sees first)
    assert not reader.is_alive() and len(errors) == 1
    assert isinstance(errors[0], (pyloader.ShardIOError, pyloader.LoaderStateError)), errors
    assert "cancelled" in str(errors[0]) or "closed" in str(errors[0])
    assert server.count("ds/shard-000000.pyl") == 1  # cancelled, not retried


CHILD = textwrap.dedent("""
    import signal
    import sys
    import pyloader

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C's default, even where SIGINT was ignored at start

    ds = pyloader.ShardDataset(sys.argv[1], cache_dir=sys.argv[2], fetch_jobs=2)
    print("reading", flush=True)
    for _ in ds.batches(4):
        pass
""")


@pytest.mark.timeout(60)
def test_ctrl_c_during_a_stalled_download_exits_promptly_and_leaves_no_temp(server, cache_dir, tmp_path):
    for name in ("ds/shard-000000.pyl", "ds/shard-000001.pyl"):
        server.inject(name, Fault("stall", seconds=40, times=None))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = child_env(root)
    env["PYLOADER_FETCH_STALL_TIMEOUT"] = "30"
    proc = subprocess.Popen([sys.executable, str(script), server.url + "/ds", cache_dir], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "reading"
        wait_for(lambda: server.count("ds/shard-000000.pyl") >= 1 and len(temp_files(cache_dir)) >= 1)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
    assert temp_files(cache_dir) == []
    assert took < EXIT_BOUND_S, f"the child took {took:.2f} s to exit"


# ShardFetcher's exit hook (fetch._close_at_exit) lets running downloads finish only while
# bytes keep arriving (a stalled one is cancelled after 0.25 s); the cancel itself takes
# about 50 ms.
EXIT_BOUND_S = 2.0
