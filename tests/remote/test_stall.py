"""A server that stops sending is noticed within the stall timeout, on both transports.

NOTE [stall] in csrc/core/http_fetch.h. PYLOADER_FETCH_STALL_TIMEOUT=1 and 2 attempts, as a
user would set them; the servers are real loopback ones: one that accepts connections and
never answers, and the fault server stalling mid-body. Each attempt must end within 1.5x
the stall timeout (plus a bounded margin for a loaded machine: the backoff between
attempts is set to almost nothing), with a transient error (a retry may fix a stall).
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from remote_servers import Fault
from remote_util import fetch_policy

import pyloader._C as _C
from pyloader.errors import FetchError
from pyloader.remote import transport as tr
from pyloader.remote.fs import RetryPolicy, with_retries

pytestmark = pytest.mark.timeout(90)
STALL = 1.0
ATTEMPTS = 2
SLACK = 0.6  # one loop step, process start of the request, a loaded machine


@pytest.fixture
def policy(monkeypatch) -> RetryPolicy:
    return fetch_policy(monkeypatch, stall_timeout=STALL, attempts=ATTEMPTS, backoff=0.01, backoff_cap=0.01)


class Silent:
    """Accepts connections on 127.0.0.1 and never sends a byte; closes them after ``life`` s."""

    def __init__(self, life: float = 60) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._deadline = time.monotonic() + life
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            self.conns.append(c)

    def close(self) -> None:
        self._stop.set()
        self._t.join()
        for c in self.conns:
            c.close()
        self.sock.close()


def transports(url: str) -> list[tr.Transport]:
    out: list[tr.Transport] = [tr.transport_for(url, None, stall_timeout=STALL, setting="fsspec")]
    if _C.http_available()[0]:
        out.append(tr.transport_for(url, None, stall_timeout=STALL, setting="native"))
    return out


def timed_failure(t: tr.Transport, key: str, size: int, policy: RetryPolicy, tmp_path) -> tuple[float, Exception]:
    path = str(tmp_path / f"out-{t.name}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.monotonic()
    try:
        with pytest.raises(FetchError) as ei:
            with_retries(lambda: t.download_into(fd, key, size, url=f"u/{key}", shard=key, cancel=None, on_bytes=None),
                         policy, what="downloading", url=f"u/{key}", shard=key)
    finally:
        os.close(fd)
    return time.monotonic() - t0, ei.value


def test_a_server_that_never_answers(policy, tmp_path):
    srv = Silent()
    try:
        for t in transports(srv.url):
            before = srv.accepted
            took, err = timed_failure(t, "ds/shard-000001.pyl", 1000, policy, tmp_path)
            assert err.transient and err.attempts == ATTEMPTS, (t.name, err)
            assert took < ATTEMPTS * (1.5 * STALL + SLACK), (t.name, took)
            assert srv.accepted - before == ATTEMPTS  # one connection per attempt, each given up
    finally:
        srv.close()


def test_a_body_that_stops_halfway(server, srv_root, policy, tmp_path):
    key = "ds/shard-000001.pyl"
    size = os.path.getsize(os.path.join(srv_root, key))
    for t in transports(server.url):
        server.inject(key, *[Fault("stall", seconds=20) for _ in range(ATTEMPTS)])
        before = server.count(key)
        took, err = timed_failure(t, key, size, policy, tmp_path)
        assert err.transient and server.count(key) - before == ATTEMPTS, (t.name, err)
        assert took < ATTEMPTS * (1.5 * STALL + SLACK), (t.name, took)
