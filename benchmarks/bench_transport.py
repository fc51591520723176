"""The CPU each HTTP/S3 client spends per gigabyte downloaded, side by side in one run.

One loopback server (benchmarks/throttled_http.py in its own process, unthrottled, bodies
sent with ``sendfile`` from tmpfs, so the server is not the bottleneck and its CPU is not
the client's) serves ``--objects`` objects of ``--object-mb`` MB. Each client downloads
all of them with ``--jobs`` threads, in rounds interleaved so that the machine's other
load falls on every client alike, into:
  - ``file``: a new file on the cache's disk per object, space reserved first as the
    cache does (what a shard download costs); memory of the pass's size is touched and
    freed before it (``pyloader.bench.measure.pretouch``), so that no client pays a VM's
    first touch of the page cache it grows;
  - ``null``: /dev/null (what moving the bytes costs, without the page-cache write).
Clients (those not installed are skipped):
  - ``pyloader-native``: ``NativeTransport`` (libcurl from the extension; NOTE [transport
    choice] in pyloader/remote/transport.py) over http:// and over s3:// (presigned);
  - ``pyloader-fsspec``: ``FsspecTransport`` (fsspec's HTTP filesystem, and s3fs);
  - ``http.client``: the standard library, 1 MiB ``readinto`` then ``os.write``;
  - ``pycurl``: libcurl from Python, its write callback calling ``os.write``;
  - ``obstore``: Rust ``object_store`` (HTTPStore and S3Store), its stream's chunks written;
  - ``s3torchconnectorclient``: AWS's CRT client (S3 only), its stream's parts written;
  - ``socket-floor``: the floor under every client that receives through a socket: a plain
    socket, one GET per object on a kept connection, the headers skipped, the body taken
    with ``recv_into`` a 4 MiB buffer and written (no HTTP parsing, no checks, no hash).
For each: GB/s (wall) and the client's CPU seconds per GB (``RUSAGE_SELF``: every thread of
the process, the kernel's share included), the median over rounds and the min-max;
``ratio`` is the client's CPU per GB over pyloader-native's on the same destination. The
physical costs measured in the same run are printed beside them: memcpy of the same
bytes and writing them to a file from memory (GB/s, and CPU s/GB).

Writes bench_results/transport.json. Usage: python benchmarks/bench_transport.py [--quick]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

import pyloader._C as _C
from pyloader.bench.measure import pretouch
from pyloader.remote.transport import FsspecTransport, NativeTransport

BUCKET = "bucket"
S3_OPTS = {"key": "bench", "secret": "bench", "client_kwargs": {"region_name": "us-east-1"}}
Download = Callable[[int, str, int], None]  # (fd, object name, size)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_all(fd: int, data: Any) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# -- clients: each returns a download function, or None when it is not installed -----------
def native(url: str, s3: bool) -> Download:
    t = NativeTransport(f"s3://{BUCKET}" if s3 else f"{url}/{BUCKET}", dict(S3_OPTS, endpoint_url=url) if s3 else None,
                        connect_timeout=10, stall_timeout=30)
    return lambda fd, name, size: t.download_into(fd, name, size, url=name, shard=name, cancel=None, on_bytes=None)


def fsspec_client(url: str, s3: bool) -> Download:
    opts = {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"}}
    t = FsspecTransport(f"s3://{BUCKET}" if s3 else f"{url}/{BUCKET}", opts if s3 else None, 30)
    return lambda fd, name, size: t.download_into(fd, name, size, url=name, shard=name, cancel=None, on_bytes=None)


def plain_client(url: str, s3: bool) -> Download | None:
    if s3:
        return None
    u = urllib.parse.urlsplit(url)
    local = threading.local()

    def get(fd: int, name: str, size: int) -> None:
        if getattr(local, "conn", None) is None:
            local.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
            local.buf = bytearray(1 << 20)
        local.conn.request("GET", f"/{BUCKET}/{name}")
        r = local.conn.getresponse()
        view = memoryview(local.buf)
        while n := r.readinto(local.buf):
            write_all(fd, view[:n])

    return get


def socket_floor(url: str, s3: bool) -> Download | None:
    if s3:
        return None
    u = urllib.parse.urlsplit(url)
    local = threading.local()

    def get(fd: int, name: str, size: int) -> None:
        if getattr(local, "sock", None) is None:
            local.sock = socket.create_connection((u.hostname, u.port), timeout=30)
            local.buf = bytearray(4 << 20)
        sock, buf = local.sock, local.buf
        sock.sendall(f"GET /{BUCKET}/{name} HTTP/1.1\r\nHost: {u.netloc}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096, socket.MSG_PEEK)
            if not chunk:
                raise ConnectionError("closed in the headers")
            end = (head + chunk).find(b"\r\n\r\n")
            take = len(chunk) if end < 0 else end + 4 - len(head)
            head += sock.recv(take)
        view, left = memoryview(buf), size
        while left:
            n = sock.recv_into(view[:min(left, len(buf))])
            if not n:
                raise ConnectionError("closed in the body")
            write_all(fd, view[:n])
            left -= n

    return get


def pycurl_client(url: str, s3: bool) -> Download | None:
    try:
        import pycurl
    except ImportError:
        return None
    if s3:
        return None
    local = threading.local()

    def get(fd: int, name: str, size: int) -> None:
        if getattr(local, "c", None) is None:
            local.c = pycurl.Curl()
            local.c.setopt(pycurl.BUFFERSIZE, 512 << 10)
        c = local.c
        c.setopt(pycurl.URL, f"{url}/{BUCKET}/{name}")
        c.setopt(pycurl.WRITEFUNCTION, lambda b: os.write(fd, b))
        c.perform()

    return get


def obstore_client(url: str, s3: bool) -> Download | None:
    try:
        import obstore
        from obstore.store import HTTPStore, S3Store
    except ImportError:
        return None
    if s3:
        store: Any = S3Store(BUCKET, endpoint=url, region="us-east-1", access_key_id="bench",
                             secret_access_key="bench", client_options={"allow_http": True})
    else:
        store = HTTPStore.from_url(f"{url}/{BUCKET}", client_options={"allow_http": True})

    def get(fd: int, name: str, size: int) -> None:
        for chunk in obstore.get(store, name).stream(min_chunk_size=1 << 20):
            write_all(fd, chunk)

    return get


def s3tc_client(url: str, s3: bool) -> Download | None:
    try:
        from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client
    except ImportError:
        return None
    if not s3:
        return None
    client = MountpointS3Client("us-east-1", endpoint=url, force_path_style=True, unsigned=True)

    def get(fd: int, name: str, size: int) -> None:
        for chunk in client.get_object(BUCKET, name):
            write_all(fd, chunk)

    return get


CLIENTS: dict[str, Callable[[str, bool], Download | None]] = {
    "pyloader-native": native, "pyloader-fsspec": fsspec_client, "http.client": plain_client,
    "pycurl": pycurl_client, "obstore": obstore_client, "s3torchconnectorclient": s3tc_client,
    "socket-floor": socket_floor}


# -- one pass ----------------------------------------------------------------------------
def run_pass(get: Download, names: list[str], size: int, jobs: int, dest: str, out_dir: str) -> tuple[float, float]:
    """(GB/s, client CPU s per GB) of downloading every object with ``jobs`` threads."""
    todo = list(names)
    mu = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with mu:
                if not todo or errors:
                    return
                name = todo.pop()
            try:
                if dest == "null":
                    fd = os.open(os.devnull, os.O_WRONLY)
                    path = ""
                else:
                    path = os.path.join(out_dir, name)
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.posix_fallocate(fd, 0, size)
                try:
                    get(fd, name, size)
                    if path and os.fstat(fd).st_size != size:
                        raise RuntimeError(f"{name}: {os.fstat(fd).st_size} bytes, not {size}")
                finally:
                    os.close(fd)
                    if path:
                        os.unlink(path)
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors.append(e)
                return

    if dest == "file":
        pretouch(len(names) * size)  # the files' page cache gets memory the machine has backed
    c0, t0 = cpu_s(), time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt, dc = time.perf_counter() - t0, cpu_s() - c0
    if errors:
        raise errors[0]
    gb = len(names) * size / 1e9
    return gb / dt, dc / gb


def physical(size: int, out_dir: str) -> dict[str, float]:
    """memcpy and file writes of ``size`` bytes from memory: (GB/s, CPU s/GB) each."""
    src = bytearray(os.urandom(4 << 20)) * (max(size, 4 << 20) // (4 << 20))
    dst = bytearray(len(src))
    out: dict[str, float] = {}
    c0, t0 = cpu_s(), time.perf_counter()
    for _ in range(4):
        dst[:] = src
    dt, dc = time.perf_counter() - t0, cpu_s() - c0
    gb = 4 * len(src) / 1e9
    out["memcpy_gbps"], out["memcpy_cpu_s_per_gb"] = gb / dt, dc / gb
    c0, t0 = cpu_s(), time.perf_counter()
    for i in range(4):
        p = os.path.join(out_dir, f"w{i}")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.posix_fallocate(fd, 0, len(src))
        for off in range(0, len(src), 1 << 20):
            write_all(fd, memoryview(src)[off:off + (1 << 20)])
        os.close(fd)
        os.unlink(p)
    dt, dc = time.perf_counter() - t0, cpu_s() - c0
    out["write_gbps"], out["write_cpu_s_per_gb"] = gb / dt, dc / gb
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 objects of 32 MB, 2 rounds (smoke run)")
    ap.add_argument("--objects", type=int, default=16)
    ap.add_argument("--object-mb", type=float, default=64)
    ap.add_argument("--jobs", type=int, default=2, help="download threads (default 2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dest", nargs="+", default=["file", "null"], choices=["file", "null"])
    ap.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    ap.add_argument("--cache-dir", default=None, help="where 'file' downloads go (default: a temp dir on disk)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "transport.json"))
    args = ap.parse_args()
    if args.quick:
        args.objects, args.object_mb, args.rounds = 8, 32, 2
    size = int(args.object_mb * (1 << 20))
    ok, why = _C.http_available()
    if not ok:
        print(f"no native transport here: {why}")
    shm = tempfile.mkdtemp(prefix="pyloader-transport-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    out_dir = tempfile.mkdtemp(prefix="pyloader-transport-out-", dir=args.cache_dir)
    names = [f"obj-{i:04d}" for i in range(args.objects)]
    os.makedirs(os.path.join(shm, BUCKET))
    for n in names:
        with open(os.path.join(shm, BUCKET, n), "wb") as f:
            f.write(os.urandom(size))
    srv = subprocess.Popen([sys.executable, os.path.join(HERE, "throttled_http.py"), shm, "--bandwidth", "inf",
                            "--max-life", "1800"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None
        url = srv.stdout.readline().strip()
        clients: dict[str, Download] = {}
        for name in args.clients:
            for s3 in (False, True):
                if name == "pyloader-native" and not ok:
                    continue
                get = CLIENTS[name](url, s3)
                if get is not None:
                    clients[f"{name} ({'s3' if s3 else 'http'})"] = get
        runs: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        phys: list[dict[str, float]] = []
        for r in range(args.rounds):
            phys.append(physical(size, out_dir))
            for dest in args.dest:
                for cname, get in clients.items():
                    s0 = proc_cpu_s(srv.pid)
                    gbps, cpg = run_pass(get, names, size, args.jobs, dest, out_dir)
                    srv_cpg = (proc_cpu_s(srv.pid) - s0) / (len(names) * size / 1e9)
                    runs.setdefault((cname, dest), []).append((gbps, cpg, srv_cpg))
                    print(f"  round {r + 1} {dest:4s} {cname:32s} {gbps:6.2f} GB/s  {cpg:6.3f} CPU s/GB", flush=True)
    finally:
        if srv.stdin:
            srv.stdin.close()
        srv.wait(timeout=30)
        subprocess.run(["rm", "-rf", shm, out_dir], check=False)

    rows = []
    for dest in args.dest:
        base_name = next((k for k in clients if k.startswith("pyloader-native (http")), None)
        base = statistics.median(c for _, c, _ in runs[(base_name, dest)]) if base_name else None
        print(f"\n{dest}: {args.objects} x {args.object_mb:g} MB, {args.jobs} threads, {args.rounds} rounds "
              "(median [min, max])")
        print(f"{'client':34s} {'GB/s':>6s} {'CPU s/GB':>20s} {'ratio':>6s} {'server s/GB':>11s}")
        for cname in clients:
            v = runs[(cname, dest)]
            cpg = [c for _, c, _ in v]
            med = statistics.median(cpg)
            ratio = med / base if base else float("nan")
            rows.append({"client": cname, "dest": dest, "gbps": statistics.median(g for g, _, _ in v),
                         "cpu_s_per_gb": med, "cpu_s_per_gb_min": min(cpg), "cpu_s_per_gb_max": max(cpg),
                         "ratio_to_native": ratio, "server_cpu_s_per_gb": statistics.median(s for _, _, s in v)})
            print(f"{cname:34s} {rows[-1]['gbps']:6.2f} {med:7.3f} [{min(cpg):.3f}, {max(cpg):.3f}] {ratio:6.2f} "
                  f"{rows[-1]['server_cpu_s_per_gb']:11.3f}")
    p = {k: statistics.median(d[k] for d in phys) for k in phys[0]}
    print(f"\nphysical (same run): memcpy {p['memcpy_gbps']:.1f} GB/s = {p['memcpy_cpu_s_per_gb']:.3f} CPU s/GB; "
          f"file write from memory {p['write_gbps']:.1f} GB/s = {p['write_cpu_s_per_gb']:.3f} CPU s/GB")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "libcurl": _C.http_version(), "cpus": os.cpu_count(),
                   "python": platform.python_version(), "rows": rows, "physical": p}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
