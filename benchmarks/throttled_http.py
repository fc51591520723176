"""A static file server on 127.0.0.1 with a fixed bandwidth and latency per connection.

It stands in for object storage in ``bench_cache.py``: GET with byte ranges, HEAD, 404;
no faults (the tests' servers inject those). It stops by itself after ``max_life`` seconds.
"""

from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_CHUNK = 64 << 10


class ThrottledServer:
    """Serves ``root`` at ``self.url`` while used as a context manager."""

    def __init__(self, root: str, *, bandwidth: float, latency: float, max_life: float = 900.0) -> None:
        self.root = os.path.abspath(root)
        self.bandwidth, self.latency = bandwidth, latency
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                srv._serve(self, head=True)

            def do_GET(self) -> None:
                srv._serve(self, head=False)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._timer = threading.Timer(max_life, self.httpd.shutdown)
        self._timer.daemon = True

    def __enter__(self) -> ThrottledServer:
        self._thread.start()
        self._timer.start()
        return self

    def __exit__(self, *a: object) -> None:
        self._timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()

    def _serve(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        time.sleep(self.latency)
        local = os.path.normpath(os.path.join(self.root, h.path.split("?", 1)[0].lstrip("/")))
        if not local.startswith(self.root + os.sep) or not os.path.isfile(local):
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        size = os.path.getsize(local)
        start, end, status = 0, size, 200
        rng = h.headers.get("Range", "")
        if rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start = int(a) if a else max(0, size - int(b))
            end = min(size, int(b) + 1) if a and b else size
            status = 206
        h.send_response(status)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(end - start))
        h.send_header("Accept-Ranges", "bytes")
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        h.end_headers()
        if head:
            return
        t0 = time.perf_counter()
        sent = 0
        try:
            with open(local, "rb") as f:
                f.seek(start)
                while sent < end - start:
                    chunk = f.read(min(_CHUNK, end - start - sent))
                    h.wfile.write(chunk)
                    sent += len(chunk)
                    ahead = sent / self.bandwidth - (time.perf_counter() - t0)
                    if ahead > 0:
                        time.sleep(ahead)  # hold the connection to its bandwidth
        except (BrokenPipeError, ConnectionResetError):
            pass
