"""A static file server on 127.0.0.1 with a fixed bandwidth and latency per request.

It stands in for object storage in ``bench_cache.py``, ``bench_stream.py`` and
``bench_parquet_stream.py``: GET with byte ranges, HEAD, 404, and a folder's GET answered
with an HTML page of links to its entries (what fsspec's HTTP filesystem lists); no faults
(the tests' servers inject those). It stops by itself after ``max_life`` seconds. Bodies
are sent with ``sendfile``: serve from tmpfs (``/dev/shm``) and the bytes come from memory.

``bandwidth`` is per connection by default. With ``link=True`` it is the bandwidth of
one link that every connection shares: a token bucket across connections, refilled at
``bandwidth`` bytes/s and holding at most ``burst`` bytes (default: 10 ms of the link,
at least two chunks), so that a sender that overslept catches up without ever
exceeding the link rate by more than one burst. ``stats_path`` (e.g. ``"/_stats"``)
answers a GET with the server's counters as JSON (requests, GETs, body bytes sent).

Run as a script it serves a directory in its own process (so that its Python threads
do not compete with the client's for one interpreter lock), prints its URL on the first
line of stdout and stops when stdin closes or ``--max-life`` seconds have passed:
``python benchmarks/throttled_http.py ROOT --bandwidth 2e8 --latency 0.02 --link``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_CHUNK = 64 << 10
_SENDFILE_CHUNK = 1 << 20  # per send on a link-throttled server (at most half its burst)


class TokenBucket:
    """A link's bandwidth shared by every sender: ``take(n)`` says how long to wait before sending ``n`` bytes."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = float(rate), float(burst)
        self._tokens = self.burst
        self._t = time.perf_counter()
        self._mu = threading.Lock()

    def take(self, n: int) -> float:
        """Reserves ``n`` bytes of the link; returns the seconds until they may go (0 if now)."""
        with self._mu:
            now = time.perf_counter()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= n  # a debt: later senders queue behind it
            return -self._tokens / self.rate if self._tokens < 0 else 0.0


class ThrottledServer:
    """Serves ``root`` at ``self.url`` while used as a context manager."""

    def __init__(self, root: str, *, bandwidth: float, latency: float, max_life: float = 900.0,
                 link: bool = False, burst: float | None = None, stats_path: str | None = None) -> None:
        self.root = os.path.abspath(root)
        self.bandwidth, self.latency = bandwidth, latency
        self.link = TokenBucket(bandwidth, burst if burst is not None else max(2 * _CHUNK, bandwidth * 0.01)) \
            if link else None
        self.stats_path = stats_path
        self._mu = threading.Lock()
        self.requests = self.gets = self.bytes_sent = 0
        self.first_byte_t: float | None = None
        self.last_byte_t: float | None = None
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

    def stats(self) -> dict[str, Any]:
        """Requests, GETs and body bytes sent so far, and when the first and last body bytes went."""
        with self._mu:
            return {"requests": self.requests, "gets": self.gets, "bytes_sent": self.bytes_sent,
                    "first_byte_t": self.first_byte_t, "last_byte_t": self.last_byte_t,
                    "bandwidth": self.bandwidth, "latency_s": self.latency, "link": self.link is not None}

    def _count(self, n: int) -> None:
        now = time.perf_counter()
        with self._mu:
            self.bytes_sent += n
            if self.first_byte_t is None:
                self.first_byte_t = now
            self.last_byte_t = now

    def _serve(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        with self._mu:
            self.requests += 1
            self.gets += not head
        if self.stats_path is not None and h.path.split("?", 1)[0] == self.stats_path:
            body = json.dumps(self.stats()).encode()
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            return
        time.sleep(self.latency)
        local = os.path.normpath(os.path.join(self.root, h.path.split("?", 1)[0].lstrip("/")))
        if (local == self.root or local.startswith(self.root + os.sep)) and os.path.isdir(local):
            self._list(h, local, head)
            return
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
        st = os.stat(local)
        h.send_header("ETag", f'"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"')  # S3 clients need one
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        h.end_headers()
        if head:
            return
        t0 = time.perf_counter()
        sent = 0
        out = h.connection.fileno()
        # sendfile: the bytes go from the page cache (tmpfs: memory) to the socket without
        # passing through this process, so the server costs little CPU per byte.
        if self.link is not None:
            chunk = max(_CHUNK, min(_SENDFILE_CHUNK, int(self.link.burst // 2)))
        else:
            chunk = 4 << 20 if self.bandwidth == float("inf") else _CHUNK
        try:
            with open(local, "rb") as f:
                while sent < end - start:
                    n = min(chunk, end - start - sent)
                    if self.link is not None:
                        wait = self.link.take(n)
                        if wait > 0:
                            time.sleep(wait)  # the link is busy with other connections' bytes
                    n = os.sendfile(out, f.fileno(), start + sent, n)
                    if n == 0:
                        break
                    sent += n
                    self._count(n)
                    if self.link is None:
                        ahead = sent / self.bandwidth - (time.perf_counter() - t0)
                        if ahead > 0:
                            time.sleep(ahead)  # hold the connection to its bandwidth
        except (BrokenPipeError, ConnectionResetError):
            pass

    @staticmethod
    def _list(h: BaseHTTPRequestHandler, folder: str, head: bool) -> None:
        """A folder as an HTML page of relative links, sub-folders ending in ``/``."""
        base = h.path.split("?", 1)[0].rstrip("/") + "/"
        links = [n + "/" if os.path.isdir(os.path.join(folder, n)) else n for n in sorted(os.listdir(folder))]
        body = ("<html><body>" + "".join(f'<a href="{base}{n}">{n}</a>' for n in links)
                + "</body></html>").encode()
        h.send_response(200)
        h.send_header("Content-Type", "text/html")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)


def main() -> int:
    ap = argparse.ArgumentParser(description="Serves a directory on 127.0.0.1 with a throttled bandwidth and latency.")
    ap.add_argument("root")
    ap.add_argument("--bandwidth", type=float, required=True, help="bytes/s (per connection, or of the link; inf: unthrottled)")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds before each response")
    ap.add_argument("--link", action="store_true", help="--bandwidth is shared by all connections")
    ap.add_argument("--stats-path", default="/_stats", help="GET it for the counters as JSON")
    ap.add_argument("--max-life", type=float, default=900.0, help="seconds before the server stops by itself")
    args = ap.parse_args()
    done = threading.Event()

    def stdin_closed() -> None:
        sys.stdin.read()
        done.set()

    with ThrottledServer(args.root, bandwidth=args.bandwidth, latency=args.latency, max_life=args.max_life,
                         link=args.link, stats_path=args.stats_path) as srv:
        print(srv.url, flush=True)
        threading.Thread(target=stdin_closed, daemon=True).start()
        done.wait(args.max_life)
    return 0


if __name__ == "__main__":
    sys.exit(main())
