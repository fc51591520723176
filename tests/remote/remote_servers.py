"""Loopback servers for the remote tests and the cache benchmark.

``FaultServer`` is an HTTP/1.1 file server on 127.0.0.1 that serves a directory and
can, per path, inject faults into its next responses (drops mid-body, status codes
with Retry-After, truncation, a flipped byte, stalls, resets, replaced content) and
throttle every connection to a bandwidth and a latency. It counts requests per path.
Every server shuts itself down after ``max_life`` seconds even if nobody stops it.
"""

from __future__ import annotations

import collections
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Fault:
    """One injected behaviour. ``times`` responses get it (None: every response)."""

    kind: str  # status | drop | truncate | flip | stall | reset | replace | norange | redirect
    status: int = 500
    retry_after: str | None = None
    seconds: float = 0.0
    data: bytes = b""
    times: int | None = 1


class FaultServer:
    def __init__(self, root: str, *, bandwidth: float | None = None, latency: float = 0.0,
                 max_life: float = 300.0) -> None:
        self.root = os.path.abspath(root)
        self.bandwidth = bandwidth  # bytes/s per connection
        self.latency = latency  # seconds before each response's first byte
        self.faults: dict[str, list[Fault]] = collections.defaultdict(list)
        self.gets: collections.Counter[str] = collections.Counter()
        self.log: list[tuple[float, str, str, int]] = []
        self.get_times: list[tuple[float, str]] = []  # (time.monotonic() of arrival, path) of every GET
        self.request_headers: list[tuple[str, dict[str, str]]] = []  # (path, headers) of every GET
        self._mu = threading.Lock()
        self._stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                server._serve(self, head=True)

            def do_GET(self) -> None:
                server._serve(self, head=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._timer = threading.Timer(max_life, self.stop)
        self._timer.daemon = True

    def start(self) -> FaultServer:
        self._thread.start()
        self._timer.start()
        return self

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(self, *a: object) -> None:
        self.stop()

    def inject(self, path: str, *faults: Fault) -> None:
        with self._mu:
            self.faults["/" + path.lstrip("/")].extend(faults)

    def count(self, path: str) -> int:
        with self._mu:
            return self.gets["/" + path.lstrip("/")]

    def shard_gets(self) -> dict[str, int]:
        with self._mu:
            return {p: n for p, n in self.gets.items() if not p.endswith(".json")}

    # -- serving -----------------------------------------------------------------------
    def _take_fault(self, path: str) -> Fault | None:
        with self._mu:
            q = self.faults.get(path)
            if not q:
                return None
            f = q[0]
            if f.times is not None:
                f.times -= 1
                if f.times <= 0:
                    q.pop(0)
            return f

    def _send(self, h: BaseHTTPRequestHandler, data: bytes | memoryview) -> None:
        view = memoryview(data)
        if not self.bandwidth:
            h.wfile.write(view)
            return
        chunk = max(4096, int(self.bandwidth / 50))
        t0 = time.monotonic()
        sent = 0
        while sent < len(view) and not self._stop.is_set():
            h.wfile.write(view[sent:sent + chunk])
            sent += min(chunk, len(view) - sent)
            ahead = sent / self.bandwidth - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)

    def _serve(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        path = h.path.split("?", 1)[0]
        with self._mu:
            if not head:
                self.gets[path] += 1
                self.get_times.append((time.monotonic(), path))
                self.request_headers.append((path, {k.lower(): v for k, v in h.headers.items()}))
        if self.latency:
            time.sleep(self.latency)
        fault = None if head else self._take_fault(path)
        status = 200
        try:
            local = os.path.normpath(os.path.join(self.root, path.lstrip("/")))
            if not local.startswith(self.root + os.sep) or not os.path.isfile(local):
                status = 404
                self._status(h, 404)
                return
            with open(local, "rb") as f:
                data = f.read()
            if fault is not None and fault.kind == "replace":
                data = fault.data
            if fault is not None and fault.kind == "reset":
                status = -1
                h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                h.close_connection = True
                h.connection.close()
                return
            if fault is not None and fault.kind == "status":
                status = fault.status
                self._status(h, fault.status, fault.retry_after, fault.data or None)
                return
            if fault is not None and fault.kind == "redirect":  # data: the Location
                status = 302
                h.send_response(302)
                h.send_header("Location", fault.data.decode())
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
            start, end = 0, len(data)
            rng = h.headers.get("Range")
            if rng and rng.startswith("bytes=") and not (fault is not None and fault.kind == "norange"):
                a, _, b = rng[6:].partition("-")
                start = int(a) if a else max(0, len(data) - int(b))
                end = min(len(data), int(b) + 1) if a and b else len(data)
                status = 206
            body = data[start:end]
            if fault is not None and fault.kind == "flip" and body:
                body = bytearray(body)
                body[len(body) // 2] ^= 0x40
                body = bytes(body)
            length = len(body)
            if fault is not None and fault.kind == "truncate":
                body = body[: len(body) // 2]
                length = len(body)  # a consistent but short response
            h.send_response(status)
            h.send_header("Content-Type", "application/octet-stream")
            h.send_header("Content-Length", str(length))
            h.send_header("Accept-Ranges", "bytes")
            h.send_header("ETag", f'"{hash(data) & 0xFFFFFFFF:08x}"')
            if status == 206:
                h.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            h.end_headers()
            if head:
                return
            if fault is not None and fault.kind in ("drop", "stall"):
                self._send(h, body[: len(body) // 2])
                h.wfile.flush()
                if fault.kind == "stall":
                    self._stop.wait(fault.seconds)
                h.close_connection = True
                try:
                    h.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                return
            self._send(h, body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with self._mu:
                self.log.append((time.monotonic(), "HEAD" if head else "GET", path, status))

    @staticmethod
    def _status(h: BaseHTTPRequestHandler, code: int, retry_after: str | None = None,
                body: bytes | None = None) -> None:
        body = body or f"status {code}".encode()
        h.send_response(code)
        if retry_after is not None:
            h.send_header("Retry-After", retry_after)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)


class S3Server:
    """moto's S3-compatible server on 127.0.0.1 (a random port), stopped at exit or after max_life."""

    def __init__(self, max_life: float = 300.0) -> None:
        from moto.server import ThreadedMotoServer

        self._srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._timer = threading.Timer(max_life, self.stop)
        self._timer.daemon = True
        self._stopped = False
        self.endpoint = ""

    def start(self) -> S3Server:
        self._srv.start()
        host, port = self._srv.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self._timer.start()
        return self

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._timer.cancel()
            self._srv.stop()

    def storage_options(self) -> dict[str, Any]:
        return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": self.endpoint,
                                                                         "region_name": "us-east-1"},
                "skip_instance_cache": True}


class ThrottlingServer(FaultServer):
    """A ``FaultServer`` that throttles its shard GETs as a busy object store does.

    A GET (of anything but a ``.json``) is answered ``status`` (503) with ``retry_after``
    (None: no Retry-After header) when ``max_concurrent`` GETs are already being served,
    when more than ``rate`` GETs arrived in the last second, or always (``always``).
    ``latency`` delays each admitted GET, so that concurrency is visible. ``arrivals``
    records (time, GETs open at arrival including this one, throttled?) per GET.
    """

    def __init__(self, root: str, *, max_concurrent: int | None = None, rate: float | None = None,
                 always: bool = False, retry_after: str | None = "1", status: int = 503, **kw: Any) -> None:
        super().__init__(root, **kw)
        self.max_concurrent, self.rate, self.always = max_concurrent, rate, always
        self.retry_after, self.status = retry_after, status
        self.arrivals: list[tuple[float, int, bool]] = []
        self._tmu = threading.Lock()
        self._open = 0  # GETs being answered
        self._admitted = 0  # of them, those not throttled
        self._recent: collections.deque[float] = collections.deque()

    def _serve(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        path = h.path.split("?", 1)[0]
        if head or path.endswith(".json"):
            super()._serve(h, head=head)
            return
        with self._tmu:
            now = time.monotonic()
            self._open += 1
            self._recent.append(now)
            while self._recent and self._recent[0] < now - 1.0:
                self._recent.popleft()
            throttle = (self.always or (self.max_concurrent is not None and self._admitted >= self.max_concurrent)
                        or (self.rate is not None and len(self._recent) > self.rate))
            if not throttle:
                self._admitted += 1
            self.arrivals.append((now, self._open, throttle))
        try:
            if throttle:
                with self._mu:
                    self.gets[path] += 1
                try:
                    self._status(h, self.status, self.retry_after)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                with self._mu:
                    self.log.append((time.monotonic(), "GET", path, self.status))
                return
            super()._serve(h, head=False)
        finally:
            with self._tmu:
                self._open -= 1
                if not throttle:
                    self._admitted -= 1

    def first_throttle(self) -> float | None:
        with self._tmu:
            return next((t for t, _, thr in self.arrivals if thr), None)
