"""An HTTPS dataset behind a CONNECT proxy named by ``HTTPS_PROXY``: both transports, the same answers.

A loopback proxy started here tunnels each ``CONNECT`` to an HTTPS server with a certificate
made here. The proxy's own answer to ``CONNECT`` carries headers that look like a response
(a ``Content-Length``, a ``Content-Type``): they must never be taken for the server's. A
proxy that refuses the tunnel fails the download, with the same kind of error on both
transports and no byte written. A manifest (read by fsspec's filesystem) goes through the
proxy as the shards do.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time

import pytest
from remote_util import fetch_policy
from test_hostile_servers import DATA, KEY, SLACK, Hostile, fetch, make, permanent, serve_ranges, transient

from pyloader.remote import transport as tr
from pyloader.remote.fs import RetryPolicy, read_object

pytestmark = pytest.mark.timeout(60)
LIFE = 25.0


class ConnectProxy:
    """A CONNECT proxy on 127.0.0.1 answering each tunnel request with ``answer`` (then tunnelling on a 200)."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.connects: list[str] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.end = time.monotonic() + LIFE
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set() and time.monotonic() < self.end:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._tunnel, args=(conn,), daemon=True).start()
        self.sock.close()

    def _tunnel(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 16384:
                part = conn.recv(4096)
                if not part:
                    return
                head += part
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            method, target = line.split(" ")[:2]
            if method != "CONNECT":
                conn.sendall(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
                return
            self.connects.append(target)
            conn.sendall(self.answer)
            if not self.answer.startswith(b"HTTP/1.1 200"):
                return
            host, port = target.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as up:
                pair = {conn: up, up: conn}
                while not self.stopping.is_set() and time.monotonic() < self.end:
                    ready, _, _ = select.select(list(pair), [], [], 0.05)
                    for s in ready:
                        data = s.recv(65536)
                        if not data:
                            return
                        pair[s].sendall(data)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)

    def __enter__(self) -> ConnectProxy:
        return self

    def __exit__(self, *a: object) -> None:
        self.stop()


# A proxy's answer with what a careless client would read as the response to its GET.
TUNNEL = b"HTTP/1.1 200 Connection established\r\nContent-Length: 3\r\nContent-Type: text/plain\r\n\r\n"


@pytest.fixture
def https_env(tmp_path, monkeypatch):
    from test_redirects import _certificate

    cert = _certificate(tmp_path)
    for name in tr._CA_VARIABLES:  # both clients verify against this test's certificate
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SSL_CERT_FILE", cert[0])
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    return cert, monkeypatch


def _opts(transport: str, cert: tuple[str, str]) -> dict:
    # aiohttp builds its default context once per process: fsspec is given this one
    return {"ssl": ssl.create_default_context(cafile=cert[0])} if transport == "fsspec" else {}


@pytest.fixture
def policy(monkeypatch) -> RetryPolicy:
    return fetch_policy(monkeypatch, stall_timeout=2, attempts=2, backoff=0.01, deadline=5, throttle_deadline=2)


@pytest.mark.parametrize("transport", ["native", "fsspec"])
def test_a_download_through_a_connect_proxy_gets_the_servers_bytes(https_env, policy, tmp_path, transport):
    cert, monkeypatch = https_env
    if transport == "native" and not tr._C.http_available()[0]:
        pytest.skip("no libcurl.so.4 here")
    with Hostile(lambda h, s: serve_ranges(h, DATA), cert=cert) as srv, ConnectProxy(TUNNEL) as proxy:
        for name in ("HTTPS_PROXY", "https_proxy"):
            monkeypatch.setenv(name, proxy.url)
        took, err, got = fetch(make(transport, srv.url, _opts(transport, cert)), srv.url, len(DATA), policy, tmp_path)
    assert err is None and got == DATA, err
    host = srv.url.split("://", 1)[1]
    assert proxy.connects and set(proxy.connects) == {host}  # every request went through the tunnel
    assert srv.requests and took < SLACK * 5


def test_a_manifest_read_goes_through_the_proxy(https_env, policy):
    cert, monkeypatch = https_env
    with Hostile(lambda h, s: serve_ranges(h, DATA), cert=cert) as srv, ConnectProxy(TUNNEL) as proxy:
        for name in ("HTTPS_PROXY", "https_proxy"):
            monkeypatch.setenv(name, proxy.url)
        got = read_object(f"{srv.url}/{KEY}", _opts("fsspec", cert), policy)
    assert got == DATA and proxy.connects == [srv.url.split("://", 1)[1]]


@pytest.mark.parametrize("transport", ["native", "fsspec"])
@pytest.mark.parametrize("status", [403, 502])
def test_a_proxy_that_refuses_the_tunnel_fails_the_download(https_env, policy, tmp_path, transport, status):
    """The proxy's status is classified as a server's: 403 permanent (one request), 502 retried."""
    cert, monkeypatch = https_env
    if transport == "native" and not tr._C.http_available()[0]:
        pytest.skip("no libcurl.so.4 here")
    answer = f"HTTP/1.1 {status} No\r\nContent-Length: 6\r\n\r\nnot ok".encode()
    with Hostile(lambda h, s: serve_ranges(h, DATA), cert=cert) as srv, ConnectProxy(answer) as proxy:
        for name in ("HTTPS_PROXY", "https_proxy"):
            monkeypatch.setenv(name, proxy.url)
        took, err, got = fetch(make(transport, srv.url, _opts(transport, cert)), srv.url, len(DATA), policy, tmp_path)
    assert err is not None and got == b"" and str(status) in str(err), err
    if status == 403:
        assert permanent(err) and len(proxy.connects) == 1, err
    else:
        assert transient(err) and len(proxy.connects) == policy.attempts, err
    assert srv.requests == []  # the server was never reached
    assert took < policy.deadline + SLACK * 5
