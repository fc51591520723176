"""Streaming a remote dataset eight times larger than the node cache, against a loopback
HTTP server whose bandwidth is one link shared by every connection (a token bucket) and
whose every request waits a fixed latency (benchmarks/throttled_http.py, run in its own
process so that it does not share the client's interpreter lock), all measured in one run:

1. ``raw GETs`` (the baseline): every shard by a plain GET, ``jobs`` threads with one
   keep-alive connection each, bodies dropped: what a Python client gets of the link;
2. ``fetch only``: ``pyloader cache warm``'s path (a ``ShardFetcher`` without a reader)
   into a cache limited to dataset/8: download, checksum, fsync, publish, evict; no reader;
3. ``window``: ``ShardDataset(url, shuffle=True, shuffle_mode="window",
   cache_limit=dataset/8, fetch_jobs=jobs)`` with a fresh cache dir, one epoch of
   ``ds.batches(batch)``; the consumer only iterates (no step), so the link, not the
   consumer, sets the pace;
4. ``paced``: the same with a simulated step per batch sized so that the consumer asks for
   ``--paced`` (default 75%) of the link: does the consumer still wait when the network
   is fast enough?
5. ``global``: ``shuffle=True`` (global shuffle) with a cache that holds the whole dataset
   (limit 1.1x its size): a cold first epoch, then a second epoch of the same dataset
   object (does it read the cache alone?). Memory of 1.5x the dataset is touched and freed
   before it (``pyloader.bench.measure.pretouch``): the pass grows the page cache by the
   whole dataset, which on a VM that backs memory at first touch cost more than the download.
With ``--transport native fsspec``, passes 2 and 3 run once for each transport (NOTE [transport
choice] in pyloader/remote/transport.py), side by side. ``--jobs auto`` is what
``fetch_jobs="auto"`` picks for these shards (NOTE [fetch jobs] in pyloader/remote/fetch.py).
Passes 1-3 run for each ``--jobs`` value, ``--repeat`` times each (fresh cache each time);
the table shows the median, and the min-max of the steady rate.

Steady state: each pass's bytes between the moments 10% and 90% of them had arrived,
over that time (a sampler thread records the bytes fetched, samples consumed, consumer
wait and the cache's size every ``--sample-ms``). It leaves out the start (manifest,
the first requests' latency, an empty pipeline) and the tail (the last shards, with
fewer than ``jobs`` downloads left). Cache bytes on disk: the files under
``<cache>/v1/<key>/shards/`` plus temps under ``tmp/`` (allocated in full when a download
starts), from a listing of ``shards/`` that did not change while ``tmp/`` was listed,
at its peak, against the limit. CPU: the client's and the server's CPU seconds over the
pass's wall time (cores), and the machine's busy share of all its CPUs (/proc/stat):
other work on the machine shows there.

The CPU each kind of client thread used (fetch threads, fsspec's event loop, native
collation threads, the consumer, the sampler itself) is read from /proc every 50 ms and
printed per pass kind. ``--profile`` also samples the stacks of the fetch threads every
10 ms in the first window pass of each ``jobs`` value and prints where they spend their
time (the innermost pyloader frame, then the frame it waits in).

Writes bench_results/stream.json. Usage: python benchmarks/bench_stream.py [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import platform
import queue
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

import pyloader
from pyloader.bench.measure import cache_disk_bytes, pretouch
from pyloader.remote.fetch import ShardFetcher, auto_fetch_jobs, open_remote

MB = 1e6
Row = tuple[float, int, int, float, int]  # t, bytes fetched, samples consumed, consumer wait s, cache bytes


# -- the dataset and the server ------------------------------------------------------------
def write_dataset(d: str, total: int, shard_bytes: int, rec_min: int, rec_max: int) -> int:
    """Records of ``rec_min``..``rec_max`` random bytes (log-uniform) until ``total`` bytes; returns the count."""
    rng = np.random.default_rng(0)
    lo, hi = np.log(rec_min), np.log(rec_max)
    pool = rng.integers(0, 256, rec_max + (1 << 20), dtype=np.uint8)  # slices of it: fast and incompressible
    n = written = 0
    with pyloader.ShardWriter(d, {"x": ("uint8", (None,)), "label": ("int64", ())}, compression="none",
                              shard_bytes=shard_bytes) as w:
        while written < total:
            size = int(np.exp(rng.uniform(lo, hi)))
            off = int(rng.integers(0, 1 << 20))
            w.write({"x": pool[off:off + size], "label": n})
            written += size
            n += 1
    return n


class ServerProcess:
    """``throttled_http.py --link`` in its own process; it stops when its stdin closes, or after ``max_life`` s."""

    def __init__(self, root: str, bandwidth: float, latency: float, max_life: float) -> None:
        cmd = [sys.executable, os.path.join(HERE, "throttled_http.py"), root, "--bandwidth", str(bandwidth),
               "--latency", str(latency), "--link", "--stats-path", "/_stats", "--max-life", str(max_life)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://127.0.0.1:"):
            self.close()
            raise RuntimeError(f"the server did not start: {self.url!r}")

    def stats(self) -> dict[str, Any]:
        """The server's counters: requests, GETs, body bytes sent."""
        u = urllib.parse.urlsplit(self.url)
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        try:
            c.request("GET", "/_stats")
            return dict(json.loads(c.getresponse().read()))
        finally:
            c.close()

    def cpu_s(self) -> float:
        return proc_cpu_s(self.proc.pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- measuring -----------------------------------------------------------------------------
def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all the machine's CPUs."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)


def self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds of each thread of this process, by thread id."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                v = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended meanwhile
        out[int(tid)] = (int(v[11]) + int(v[12])) / tick
    return out


def thread_group(name: str | None) -> str:
    """What a thread of the client is, from its Python name (None: a native thread)."""
    if name is None:
        return "native threads (collation)"
    if name == "pyloader-fetch":
        return "fetch threads"
    return {"fsspecIO": "fsspec event loop", "MainThread": "consumer (main thread)", "bench-sampler": "sampler",
            "pyloader-fetch-pilot": "fetch pilot", "raw-get": "raw GET threads"}.get(name, name)


class Sampler:
    """Every ``interval`` s a ``Row``: ``progress()`` gives (bytes fetched, samples consumed, consumer wait s).

    Every 50 ms it also reads each thread's CPU time (``cpu_by_thread()``: CPU seconds
    by what the thread is); with ``profile``, every 10 ms it counts where each fetch
    thread is.
    """

    def __init__(self, progress: Callable[[], tuple[int, int, float]], cache_dir: str | None, interval: float,
                 profile: bool = False) -> None:
        self.progress, self.cache_dir, self.interval, self.profile = progress, cache_dir, interval, profile
        self.rows: list[Row] = []
        self.peak_cache = 0
        self.stacks: collections.Counter[str] = collections.Counter()
        self.t0 = 0.0
        self._cpu0: dict[int, float] = {}
        self._cpu: dict[int, float] = {}
        self._names: dict[int, str] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def _sample(self) -> None:
        t = time.perf_counter()
        b, n, w = self.progress()
        c = cache_disk_bytes(self.cache_dir) if self.cache_dir else 0
        self.peak_cache = max(self.peak_cache, c)
        self.rows.append((t, b, n, w, c))

    def _sample_threads(self) -> None:
        for th in threading.enumerate():
            if th.native_id is not None:
                self._names[th.native_id] = th.name
        self._cpu.update(thread_cpu_s())

    def _run(self) -> None:
        next_prof = next_cpu = 0.0
        while not self._stop.is_set():
            self._sample()
            now = self.rows[-1][0]
            if now >= next_cpu:
                next_cpu = now + 0.05
                self._sample_threads()
            if self.profile and now >= next_prof:
                next_prof = now + 0.01
                self._sample_stacks()
            self._stop.wait(self.interval)

    def _sample_stacks(self) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if names.get(ident) == "pyloader-fetch":
                self.stacks[where(frame)] += 1

    def cpu_by_thread(self) -> dict[str, float]:
        """CPU seconds over the block by what each thread is; threads that ended between two reads are missed."""
        out: dict[str, float] = collections.defaultdict(float)
        for tid, cpu in self._cpu.items():
            out[thread_group(self._names.get(tid))] += cpu - self._cpu0.get(tid, 0.0)
        return {k: v for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0}

    def __enter__(self) -> Sampler:
        self.t0 = time.perf_counter()
        self._cpu0 = thread_cpu_s()
        self._sample_threads()
        self._sample()
        self._t.start()
        return self

    def __exit__(self, *a: object) -> None:
        self._stop.set()
        self._t.join()
        self._sample_threads()
        self._sample()


def where(frame: Any) -> str:
    """``pyloader/<file>:<function>:<line>`` of the innermost pyloader frame, then the frame it is blocked in."""
    leaf = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
    pkg = os.path.join(ROOT, "pyloader", "")
    f = frame
    while f is not None:
        if f.f_code.co_filename.startswith(pkg):
            mine = f"{os.path.relpath(f.f_code.co_filename, ROOT)}:{f.f_code.co_name}:{f.f_lineno}"
            return mine if f is frame else f"{mine} > {leaf}"
        f = f.f_back
    return leaf


def steady(rows: list[Row], lo: float = 0.1, hi: float = 0.9) -> dict[str, float] | None:
    """Rates between the moments ``lo`` and ``hi`` of the pass's bytes had arrived (see the module docstring)."""
    total = rows[-1][1]
    if total <= 0:
        return None
    a = next(r for r in rows if r[1] >= lo * total)
    b = next(r for r in rows if r[1] >= hi * total)
    dt = b[0] - a[0]
    if dt <= 0:
        return None
    # A wait is counted when it ends, so one that spans the interval can count more than it: capped at 1.
    return {"bytes_per_s": (b[1] - a[1]) / dt, "samples_per_s": (b[2] - a[2]) / dt,
            "wait_fraction": min(1.0, (b[3] - a[3]) / dt), "seconds": dt, "from_s": a[0] - rows[0][0],
            "to_s": b[0] - rows[0][0]}


class Usage:
    """CPU seconds of this process and of the server, the machine's busy share and the server's counters."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.result: dict[str, Any] = {}

    def __enter__(self) -> Usage:
        self.c0, self.s0, self.m0 = self_cpu_s(), self.server.cpu_s(), machine_jiffies()
        self.g0, self.t0 = self.server.stats(), time.perf_counter()
        return self

    def __exit__(self, *a: object) -> None:
        dt = time.perf_counter() - self.t0
        m1, g1 = machine_jiffies(), self.server.stats()
        self.result = {"client_cores": (self_cpu_s() - self.c0) / dt, "server_cores": (self.server.cpu_s() - self.s0) / dt,
                       "machine_busy": (m1[0] - self.m0[0]) / max(1, m1[1] - self.m0[1]),
                       "server_gets": g1["gets"] - self.g0["gets"] - 1,  # less this block's own stats GET
                       "server_bytes_sent": g1["bytes_sent"] - self.g0["bytes_sent"]}


# -- the passes ----------------------------------------------------------------------------
def raw_gets(srv: ServerProcess, url: str, paths: list[str], jobs: int, interval: float) -> dict[str, Any]:
    """Every shard by a plain GET, ``jobs`` threads with one keep-alive connection each, bodies dropped."""
    u = urllib.parse.urlsplit(url)
    todo: queue.SimpleQueue[str] = queue.SimpleQueue()
    for p in paths:
        todo.put(p)
    got = [0] * jobs
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        try:
            while True:
                try:
                    p = todo.get_nowait()
                except queue.Empty:
                    return
                conn.request("GET", f"{u.path}/{p}")
                r = conn.getresponse()
                if r.status != 200:
                    raise RuntimeError(f"GET {p}: HTTP {r.status}")
                while True:
                    b = r.read(1 << 20)
                    if not b:
                        break
                    got[k] += len(b)
        except BaseException as e:  # noqa: BLE001 - raised again on the main thread
            errors.append(e)
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, args=(k,), name="raw-get", daemon=True) for k in range(jobs)]
    with Usage(srv) as use, Sampler(lambda: (sum(got), 0, 0.0), None, interval) as s:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    wall = s.rows[-1][0] - s.t0
    return {"bytes": sum(got), "wall_s": wall, "avg_bytes_per_s": sum(got) / wall, "steady": steady(s.rows),
            "cpu_s_by_thread": s.cpu_by_thread(), **use.result}


def fetch_only(srv: ServerProcess, url: str, cache: str, limit: int, jobs: int, interval: float) -> dict[str, Any]:
    """``pyloader cache warm``'s download path: a ShardFetcher without a reader (publishes, pins nothing)."""
    d = open_remote(url, cache_dir=cache, cache_limit=limit)
    f = ShardFetcher(d, None, jobs=jobs)
    try:
        with Usage(srv) as use, Sampler(lambda: (f.bytes, 0, 0.0), cache, interval) as s:
            f.schedule(range(len(d.shards)))
            f.wait()
    finally:
        f.close()
    if f.errors:
        raise next(iter(f.errors.values()))
    wall = s.rows[-1][0] - s.t0
    return {"bytes": f.bytes, "wall_s": wall, "avg_bytes_per_s": f.bytes / wall, "steady": steady(s.rows),
            "peak_cache_bytes": s.peak_cache, "cache_limit": limit, "shards_downloaded": f.downloaded,
            "cpu_s_by_thread": s.cpu_by_thread(), **use.result}


def stream(srv: ServerProcess, url: str, cache: str, limit: int, *, jobs: int, shuffle_mode: str, window: int,
           batch: int, step_s: float, epochs: int, interval: float, profile: bool = False) -> list[dict[str, Any]]:
    """Epochs of ``ds.batches(batch, epoch=e)`` of one ShardDataset; each batch consumed sleeps ``step_s``."""
    ds = pyloader.ShardDataset(url, cache_dir=cache, cache_limit=limit, fetch_jobs=jobs, shuffle=True, seed=1,
                               shuffle_mode=shuffle_mode, window=window)
    out = []
    before = {"bytes_fetched": 0, "shards_downloaded": 0, "shards_unloaded": 0}
    try:
        for ep in range(epochs):
            it = ds.batches(batch, epoch=ep)
            consumed = [0]
            first: list[float] = []
            base = dict(before)

            def progress(it: Any = it, consumed: list[int] = consumed,
                         base: dict[str, int] = base) -> tuple[int, int, float]:
                st = it.stats()
                return st["bytes_fetched"] - base["bytes_fetched"], consumed[0], st["consumer_wait_s"]

            with Usage(srv) as use, Sampler(progress, cache, interval, profile=profile and ep == 0) as s:
                t0 = time.perf_counter()
                for b in it:
                    if not first:
                        first.append(time.perf_counter() - t0)
                    consumed[0] += int(b["label"].shape[0])
                    if step_s:
                        time.sleep(step_s)  # the training step the loader should overlap with
            st = it.stats()
            it.close()
            if consumed[0] < ds.num_records:
                raise RuntimeError(f"epoch {ep}: {consumed[0]} of {ds.num_records} samples")
            fetched = st["bytes_fetched"] - before["bytes_fetched"]
            e = {"epoch": ep, "samples": consumed[0], "wall_s": st["wall_s"], "bytes": fetched,
                 "avg_bytes_per_s": fetched / st["wall_s"], "avg_samples_per_s": consumed[0] / st["wall_s"],
                 "first_batch_s": first[0],
                 "shards_downloaded": st["shards_downloaded"] - before["shards_downloaded"],
                 "shards_unloaded": st["shards_unloaded"] - before["shards_unloaded"],
                 "consumer_wait_s": st["consumer_wait_s"], "wait_fraction": st["wait_fraction"],
                 "cache_peak_held_bytes": st["cache_peak_held_bytes"], "cache_budget_bytes": st["cache_budget_bytes"],
                 "peak_cache_bytes": s.peak_cache, "cache_limit": limit, "peak_mapped_shards": st["peak_mapped_shards"],
                 "healed_shards": st["healed_shards"], "steady": steady(s.rows),
                 "cpu_s_by_thread": s.cpu_by_thread(), **use.result}
            if s.profile:
                e["profile"] = {"samples": sum(s.stacks.values()), "top": dict(s.stacks.most_common(12))}
            out.append(e)
            before = {k: st[k] for k in before}
    finally:
        if ds._fetcher is not None:
            ds._fetcher.close()
    return out


# -- the run -------------------------------------------------------------------------------
def pick_window(local: str, window: int, batch: int, limit: int) -> tuple[int, int, int]:
    """(window, working set bytes, shards): ``window``, or the largest power of two whose working set <= limit/2."""
    def ws(w: int) -> tuple[int, int]:
        ds = pyloader.ShardDataset(local, shuffle=True, seed=1, shuffle_mode="window", window=w)
        # batches() holds (prefetch + num_threads) batches ahead: 2 * 2 + 2 by default
        return ds.working_set(ds.plan(epoch=0)[0], 6 * batch)

    if window:
        return (window, *ws(window))
    w = 4096
    while w > batch and ws(w)[0] > limit // 2:
        w //= 2
    need = ws(w)
    if need[0] > limit:
        raise SystemExit(f"even a window of {w} samples needs {need[0]} bytes at once, over the cache limit of "
                         f"{limit}: use a bigger --total-mb, a smaller --batch or --shard-mb")
    return (w, *need)


def environment() -> dict[str, Any]:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True, timeout=10).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "pyloader": pyloader.__version__, "git_commit": git("rev-parse", "HEAD"),
            "git_modified": git("status", "--porcelain", "--untracked-files=no").splitlines(),
            "load_average_1m": os.getloadavg()[0]}


def summarize(passes: list[dict[str, Any]], link: float) -> list[dict[str, Any]]:
    """One row per (kind, jobs): medians over the repeats; the steady rate's min and max."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for p in passes:
        groups[(p["kind"], p["jobs"])].append(p)
    raw_best = max((statistics.median(q["steady"]["bytes_per_s"] for q in g) for (k, _), g in groups.items()
                    if k == "raw GETs"), default=0.0)

    def med(g: list[dict[str, Any]], f: Callable[[dict[str, Any]], Any]) -> Any:
        vals = [f(q) for q in g]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    rows = []
    for (kind, jobs), g in groups.items():
        rates = [q["steady"]["bytes_per_s"] for q in g if q.get("steady")]
        raw = groups.get(("raw GETs", jobs))
        raw_same = statistics.median(q["steady"]["bytes_per_s"] for q in raw) if raw else None
        rate = statistics.median(rates) if rates else None
        rows.append({
            "kind": kind, "jobs": jobs, "passes": len(g), "wall_s": med(g, lambda q: q["wall_s"]),
            "avg_bytes_per_s": med(g, lambda q: q["avg_bytes_per_s"]),
            "steady_bytes_per_s": rate, "steady_min": min(rates) if rates else None,
            "steady_max": max(rates) if rates else None,
            "of_link": rate / link if rate else None,
            "of_raw_same_jobs": rate / raw_same if rate and raw_same else None,
            "of_raw_best": rate / raw_best if rate and raw_best else None,
            "steady_samples_per_s": med(g, lambda q: (q.get("steady") or {}).get("samples_per_s")
                                        if "samples" in q else None),
            "avg_samples_per_s": med(g, lambda q: q.get("avg_samples_per_s")),
            "wait_fraction": med(g, lambda q: q.get("wait_fraction")),
            "steady_wait_fraction": med(g, lambda q: (q.get("steady") or {}).get("wait_fraction")
                                        if "samples" in q else None),
            "first_batch_s": med(g, lambda q: q.get("first_batch_s")),
            "peak_cache_bytes": max((q.get("peak_cache_bytes") or 0) for q in g) or None,
            "cache_limit": g[0].get("cache_limit"),
            "peak_held_bytes": max((q.get("cache_peak_held_bytes") or 0) for q in g) or None,
            "budget_bytes": g[0].get("cache_budget_bytes"),
            "server_gets": med(g, lambda q: q["server_gets"]),
            "bytes": med(g, lambda q: q["bytes"]),
            "client_cores": med(g, lambda q: q["client_cores"]), "server_cores": med(g, lambda q: q["server_cores"]),
            "machine_busy": med(g, lambda q: q["machine_busy"]),
        })
    return rows


def fmt(v: Any, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}{spec}}"


def print_table(rows: list[dict[str, Any]], passes: list[dict[str, Any]]) -> None:
    print()
    print(f"{'pass':<22} {'jobs':>4} {'n':>2} {'steady MB/s (min-max)':>22} {'link':>6} {'raw=j':>6} "
          f"{'raw*':>6} {'avg MB/s':>8} {'samples/s':>9} {'wait':>5} {'wait st':>7} {'1st b s':>7} "
          f"{'cache peak/limit MB':>19} {'held/budget MB':>14} {'GETs':>5} {'cores c+s':>9} {'busy':>5}")
    for r in rows:
        rng = (f"{r['steady_bytes_per_s'] / MB:6.1f} ({r['steady_min'] / MB:5.1f}-{r['steady_max'] / MB:5.1f})"
               if r["steady_bytes_per_s"] else "-")
        pct = [fmt(None if v is None else 100 * v, ".1f", 5) + ("%" if v is not None else " ")
               for v in (r["of_link"], r["of_raw_same_jobs"] if r["kind"] != "raw GETs" else None, r["of_raw_best"])]
        cache = (f"{r['peak_cache_bytes'] / MB:7.1f}/{r['cache_limit'] / MB:<7.1f}" if r["peak_cache_bytes"]
                 else "-")
        held = (f"{r['peak_held_bytes'] / MB:6.1f}/{r['budget_bytes'] / MB:<6.1f}"
                if r["peak_held_bytes"] and r["budget_bytes"] else "-")
        print(f"{r['kind']:<22} {r['jobs']:>4} {r['passes']:>2} {rng:>22} {pct[0]} {pct[1]} {pct[2]} "
              f"{fmt(r['avg_bytes_per_s'] and r['avg_bytes_per_s'] / MB, '.1f', 8)} "
              f"{fmt(r['steady_samples_per_s'] or r['avg_samples_per_s'], '.0f', 9)} "
              f"{fmt(r['wait_fraction'], '.2f', 5)} {fmt(r['steady_wait_fraction'], '.3f', 7)} "
              f"{fmt(r['first_batch_s'], '.2f', 7)} {cache:>19} {held:>14} {fmt(r['server_gets'], '.0f', 5)} "
              f"{r['client_cores']:>4.2f}+{r['server_cores']:<4.2f} {100 * r['machine_busy']:>4.0f}%")
    print("steady: MB/s of shard bytes between the moments 10% and 90% of the pass's bytes had arrived (median "
          "of n passes, min-max); link: over the link rate; raw=j: over the raw GETs' steady rate with as many jobs; "
          "raw*: over the best raw GETs rate; samples/s: steady (avg for a pass with no bytes fetched); wait: the "
          "consumer's wait fraction over the epoch, wait st: over the steady interval; 1st b s: seconds to the "
          "first batch; cache peak: shards + temps on disk, sampled; held/budget: the fetcher's own peak and "
          "budget; GETs: as the server counted them; cores: client + server CPU; busy: the whole machine's CPUs")
    print("client CPU by thread, cores (CPU seconds / wall seconds), first pass of each kind:")
    seen = set()
    for p in passes:
        if (p["kind"], p["jobs"]) in seen or not p.get("cpu_s_by_thread"):
            continue
        seen.add((p["kind"], p["jobs"]))
        by = dict(p["cpu_s_by_thread"])
        by["other (ended between reads, HTTP stats)"] = max(0.0, p["client_cores"] * p["wall_s"] - sum(by.values()))
        parts = ", ".join(f"{k} {v / p['wall_s']:.2f}" for k, v in by.items() if v / p["wall_s"] >= 0.01)
        print(f"  {p['kind']:<16} jobs {p['jobs']:>2} ({p['client_cores']:.2f} in all): {parts}")
    for p in passes:
        if p["kind"] == "global, epoch 1":
            print(f"global shuffle, second epoch of the same dataset object: {p['shards_downloaded']} shards "
                  f"downloaded, {p['bytes']} bytes fetched, {p['server_gets']} GETs: "
                  + ("it reads the cache alone" if p["bytes"] == 0 else "it does NOT read the cache alone"))
        if "profile" in p:
            n = p["profile"]["samples"]
            print(f"where the fetch threads are: window, {p['jobs']} jobs ({n} samples; pyloader frame > "
                  "the frame it waits in):")
            for k, v in p["profile"]["top"].items():
                print(f"  {100 * v / n:5.1f}%  {k}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="96 MB, batch 16, jobs 4, one pass each (smoke run)")
    ap.add_argument("--total-mb", type=float, default=384, help="dataset size, MB (default 384)")
    ap.add_argument("--shard-mb", type=float, default=2.0, help="shard size the writer aims for, MB (default 2)")
    ap.add_argument("--record-kb", type=float, nargs=2, default=(4, 100), metavar=("MIN", "MAX"),
                    help="record sizes, KiB, log-uniform (default 4 100)")
    ap.add_argument("--link-mbps", type=float, default=200, help="link bandwidth shared by all connections, MB/s")
    ap.add_argument("--latency-ms", type=float, default=20, help="latency of every request, ms (default 20)")
    ap.add_argument("--cache-fraction", type=float, default=8, help="dataset size / cache limit (default 8)")
    ap.add_argument("--jobs", nargs="+", default=["4", "8", "16"],
                    help="fetch_jobs values, or auto (what ShardDataset's default picks for these shards; default "
                         "4 8 16)")
    ap.add_argument("--transport", nargs="+", default=["native"], choices=["native", "fsspec"],
                    help="transports to compare (PYLOADER_TRANSPORT; default native): the fetch only and window "
                         "passes run once for each, the paced and global passes with the first")
    ap.add_argument("--repeat", type=int, default=3, help="passes of raw, fetch only and window per jobs value")
    ap.add_argument("--window", type=int, default=0,
                    help="window shuffle size, samples (default: the largest power of two up to 4096 whose "
                         "working set is at most half the cache limit)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--paced", type=float, default=0.75,
                    help="the paced pass's consumer asks for this fraction of the link (0: no paced pass)")
    ap.add_argument("--sample-ms", type=float, default=5, help="sampler interval, ms (default 5)")
    ap.add_argument("--profile", action="store_true", help="sample the fetch threads' stacks in window passes")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "stream.json"))
    args = ap.parse_args()
    if args.quick:
        args.total_mb, args.jobs, args.batch, args.repeat = 96, [4], 16, 1
    link, latency, interval = args.link_mbps * MB, args.latency_ms / 1e3, args.sample_ms / 1e3
    transports = list(dict.fromkeys(args.transport))

    def tag(kind: str, transport: str) -> str:
        return kind if len(transports) == 1 else f"{kind} [{transport}]"

    tmp = tempfile.mkdtemp(prefix="pyloader-bench-stream-")
    srv: ServerProcess | None = None
    try:
        srv_root = os.path.join(tmp, "srv")
        local_dir = os.path.join(srv_root, "ds")
        t = time.perf_counter()
        n_records = write_dataset(local_dir, int(args.total_mb * MB), int(args.shard_mb * MB),
                                  int(args.record_kb[0] * 1024), int(args.record_kb[1] * 1024))
        local = pyloader.ShardDataset(local_dir)
        sizes = local.shard_bytes
        auto = auto_fetch_jobs(sizes)
        args.jobs = list(dict.fromkeys(auto if j == "auto" else int(j) for j in args.jobs))
        total = sum(sizes)
        limit = int(total / args.cache_fraction)
        names = [os.path.relpath(p, local_dir) for p in local.shard_paths]
        window, wbytes, wshards = pick_window(local_dir, args.window, args.batch, limit)
        print(f"wrote {n_records} records ({total / n_records / 1024:.0f} KiB on average) in {len(sizes)} shards "
              f"({total / MB:.1f} MB; shards {min(sizes) / MB:.2f}-{max(sizes) / MB:.2f} MB, median "
              f"{statistics.median(sizes) / MB:.2f}) in {time.perf_counter() - t:.1f} s")
        print(f"link {link / MB:.0f} MB/s shared by all connections, {latency * 1e3:.0f} ms per request; cache limit "
              f"{limit / MB:.1f} MB (dataset / {args.cache_fraction:g}); window {window} samples, batch {args.batch}: "
              f"working set {wbytes / MB:.1f} MB ({wshards} shards) with the batches read ahead; fetch_jobs='auto' "
              f"is {auto} here; transports {', '.join(transports)}")
        cfg = {"dataset_bytes": total, "records": n_records, "shards": len(sizes),
               "shard_bytes_target": int(args.shard_mb * MB), "shard_bytes_min": min(sizes),
               "shard_bytes_median": statistics.median(sizes), "shard_bytes_max": max(sizes),
               "record_bytes_range": [int(args.record_kb[0] * 1024), int(args.record_kb[1] * 1024)],
               "link_bytes_per_s": link, "link": "one token bucket shared by all connections", "latency_s": latency,
               "cache_limit": limit, "cache_fraction": args.cache_fraction, "jobs": args.jobs, "repeat": args.repeat,
               "window": window, "batch": args.batch, "num_threads": 2, "prefetch": "default (2 per thread)",
               "window_working_set_bytes": wbytes, "window_working_set_shards": wshards,
               "sample_interval_s": interval, "paced_fraction": args.paced, "global_cache_limit": int(total * 1.1),
               "steady_state": "bytes between the moments 10% and 90% of the pass's bytes had arrived, over that time"}
        srv = ServerProcess(srv_root, link, latency, max_life=1800)
        url = srv.url + "/ds"
        passes: list[dict[str, Any]] = []

        def record(kind: str, jobs: int, rep: int, p: dict[str, Any]) -> None:
            p.update(kind=kind, jobs=jobs, repeat=rep)
            passes.append(p)
            sd = p.get("steady")
            print(f"  {kind:<16} jobs {jobs:>2} #{rep}: "
                  + (f"{sd['bytes_per_s'] / MB:6.1f} MB/s steady, " if sd else "")
                  + f"{p['avg_bytes_per_s'] / MB:6.1f} MB/s avg, {p['wall_s']:.2f} s", flush=True)

        def fresh(name: str) -> str:
            d = os.path.join(tmp, name)
            shutil.rmtree(d, ignore_errors=True)
            return d

        for rep in range(args.repeat):  # interleaved, so that a slow spell of the machine hits every kind
            for j in args.jobs:
                record("raw GETs", j, rep, raw_gets(srv, url, names, j, interval))
                for tr in transports:
                    os.environ["PYLOADER_TRANSPORT"] = tr
                    record(tag("fetch only", tr), j, rep, fetch_only(srv, url, fresh("c-fetch"), limit, j, interval))
                    for e in stream(srv, url, fresh("c-window"), limit, jobs=j, shuffle_mode="window",
                                    window=window, batch=args.batch, step_s=0.0, epochs=1, interval=interval,
                                    profile=args.profile and rep == 0):
                        record(tag("window", tr), j, rep, e)
        os.environ["PYLOADER_TRANSPORT"] = transports[0]
        med = {j: statistics.median(p["steady"]["bytes_per_s"] for p in passes
                                    if p["kind"] == tag("window", transports[0]) and p["jobs"] == j)
               for j in args.jobs}
        best = max(args.jobs, key=lambda j: med[j])
        if args.paced > 0:
            step = args.batch * (total / n_records) / (args.paced * link)
            for e in stream(srv, url, fresh("c-window"), limit, jobs=best, shuffle_mode="window", window=window,
                            batch=args.batch, step_s=step, epochs=1, interval=interval):
                e["step_s"] = step
                record(f"paced {100 * args.paced:.0f}%", best, 0, e)
        pretouch(int(total * 1.5))  # the global pass grows the page cache by the whole dataset
        for e in stream(srv, url, fresh("c-global"), int(total * 1.1), jobs=best, shuffle_mode="global",
                        window=window, batch=args.batch, step_s=0.0, epochs=2, interval=interval):
            record(f"global, epoch {e['epoch']}", best, 0, e)
        shutil.rmtree(os.path.join(tmp, "c-global"), ignore_errors=True)
        rows = summarize(passes, link)
        result = {"config": cfg, "environment": environment(), "summary": rows, "passes": passes,
                  "server": srv.stats()}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print_table(rows, passes)
        reach = [j for j in args.jobs if med[j] >= 0.9 * link]
        print(f"window streaming at >= 90% of the link ({0.9 * link / MB:.0f} MB/s, median steady): "
              + (f"fetch_jobs {', '.join(map(str, reach))}" if reach
                 else f"none of fetch_jobs {', '.join(map(str, args.jobs))}")
              + f"; best: fetch_jobs {best} ({100 * med[best] / link:.1f}% of the link; {transports[0]} transport); "
              f"load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(f"wrote {args.out}")
    finally:
        if srv is not None:
            srv.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
