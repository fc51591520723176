"""Small downloads into a full node cache of 1k, 10k and 100k shards: downloads per second and
the time the space lock is held per download, this checkout against a baseline checkout.

Each point runs in a fresh Python whose ``PYTHONPATH`` names the checkout measured: a cache
whose limit its ``N`` cached shards fill exactly (sparse files, created fast), then
``DatasetCache.ensure`` of 4 KiB shards from an in-memory fsspec source (so the network is
not the limit), one after another, at most as many as are cached (the manifest names the
cached shards and those to download): every download evicts one shard (NOTE [cache index] in
pyloader/remote/index.py); ``--procs`` forked processes share the work. The space lock's hold
times are taken around ``SpaceLock``. The
first download (which lists the cache once where an index is used) is reported apart.

Usage: python benchmarks/bench_cache_index.py [--baseline /work/main] [--shards 1000,10000,100000]
       [--seconds 4] [--repeat 2] [--dir /dev/shm] [--procs 1] [--quick]
Writes bench_results/cache_index.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _point(cached: int, seconds: float, max_downloads: int, where: str, procs: int) -> dict[str, object]:
    """One measurement in this process, with whatever pyloader PYTHONPATH imports."""
    import fsspec
    import numpy as np

    import pyloader
    import pyloader._C as _C
    from pyloader.format.spec import dump_manifest, parse_manifest
    from pyloader.remote import locks
    from pyloader.remote.cache import ShardCache

    holds: list[float] = []
    enter, leave = locks.SpaceLock.__enter__, locks.SpaceLock.__exit__

    def timed_enter(self: locks.SpaceLock) -> locks.SpaceLock:
        r = enter(self)
        self._bench_t0 = time.perf_counter()  # type: ignore[attr-defined]
        return r

    def timed_exit(self: locks.SpaceLock, *exc: object) -> None:
        holds.append(time.perf_counter() - self._bench_t0)  # type: ignore[attr-defined]
        leave(self, *exc)

    locks.SpaceLock.__enter__ = timed_enter  # type: ignore[method-assign]
    locks.SpaceLock.__exit__ = timed_exit  # type: ignore[method-assign]

    tmp = tempfile.mkdtemp(prefix="pyloader-bench-index-", dir=where)
    try:
        # One real shard of about 4 KiB; the manifest names it under cached + downloads paths.
        src = os.path.join(tmp, "src")
        with pyloader.ShardWriter(src, {"x": ("uint8", (3900,))}, compression="none", shard_bytes=1) as w:
            w.write({"x": np.arange(3900, dtype=np.uint8)})
        with open(os.path.join(src, "manifest.json"), "rb") as f:
            body = parse_manifest(f.read(), src, _C.xxh64)
        s0 = body["shards"][0]
        with open(os.path.join(src, s0["path"]), "rb") as f:
            shard_bytes = f.read()
        max_downloads = min(max_downloads, cached)  # the manifest names at most twice the cached shards
        total = cached + max_downloads + 1
        body["shards"] = [dict(s0, path=f"d/{i:07d}.pyl") for i in range(total)]
        body["records"] = total * s0["records"]
        manifest = dump_manifest(body, _C.xxh64)
        mem = fsspec.filesystem("memory")
        base = f"/bench-index-{os.getpid()}/ds"
        mem.pipe(base + "/manifest.json", manifest)
        for i in range(cached, total):
            mem.pipe(f"{base}/d/{i:07d}.pyl", shard_bytes)
        size = len(shard_bytes)
        cache = ShardCache(os.path.join(tmp, "cache"), limit=cached * size)
        d = cache.dataset("memory:/" + base, manifest)
        t0 = time.perf_counter()
        old = time.time_ns() - 10**9 * 3600
        for i in range(cached):  # sparse files of the shard's size, 1 ms apart, oldest first
            fd = os.open(d.shard_file(i), os.O_WRONLY | os.O_CREAT, 0o644)
            os.ftruncate(fd, size)
            os.utime(fd, ns=(old + i * 10**6, old + i * 10**6))
            os.close(fd)
        fill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        d.ensure(cached)  # the first download: lists the cache once where an index is used
        first_s = time.perf_counter() - t0

        def downloads(first: int, step: int, t0: float) -> int:
            n = 0
            for i in range(cached + 1 + procs + first, total, step):
                if time.perf_counter() - t0 >= seconds and n >= 5:
                    break
                d.ensure(i)
                n += 1
            return n

        child_first_s = 0.0  # the slowest forked process's first download (it reads the index once)
        if procs == 1:
            d.ensure(cached + 1)
            holds.clear()
            t0 = time.perf_counter()
            n = downloads(0, 1, t0)
            dt = time.perf_counter() - t0
        else:  # forked processes sharing the cache (and the in-memory source), each its own shards
            ctx = multiprocessing.get_context("fork")
            q, ready = ctx.Queue(), ctx.Barrier(procs)

            def child(k: int) -> None:
                w0 = time.perf_counter()
                d.ensure(cached + 1 + k)  # its first download: it reads the index once
                warm = time.perf_counter() - w0
                ready.wait()
                holds.clear()
                t0 = time.perf_counter()
                c = downloads(k, procs, t0)
                q.put((c, holds, t0, time.perf_counter(), warm))

            ps = [ctx.Process(target=child, args=(k,)) for k in range(procs)]
            for p in ps:
                p.start()
            got = [q.get(timeout=600) for _ in ps]
            for p in ps:
                p.join()
            n = sum(g[0] for g in got)
            holds[:] = [h for g in got for h in g[1]]
            dt = max(g[3] for g in got) - min(g[2] for g in got)
            child_first_s = max(g[4] for g in got)
        files = len(os.listdir(d.shard_dir))
        usage = cache.usage()
        assert files == cached and usage <= cache.limit, (files, cached, usage, cache.limit)
        if procs == 1:  # the oldest shards went first: one per download, the rest are there
            gone = n + 2  # with the first download and the warm-up
            assert not any(os.path.exists(d.shard_file(i)) for i in range(gone))
            assert all(os.path.exists(d.shard_file(i)) for i in range(gone, cached))
        hs = sorted(holds)
        return {"cached_shards": cached, "downloads": n, "seconds": dt, "downloads_per_s": n / dt,
                "lock_hold_mean_us": 1e6 * sum(hs) / n, "lock_hold_p50_us": 1e6 * hs[len(hs) // 2],
                "lock_hold_p99_us": 1e6 * hs[min(len(hs) - 1, int(0.99 * len(hs)))], "lock_hold_max_us": 1e6 * hs[-1],
                "lock_takes_per_download": len(hs) / n, "first_download_s": first_s, "fill_s": fill_s,
                "child_first_download_s": child_first_s, "shard_bytes": size, "manifest_shards": total,
                "processes": procs, "pyloader": os.path.dirname(pyloader.__file__)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(checkout: str, cached: int, seconds: float, max_downloads: int, where: str, procs: int) -> dict[str, object]:
    env = dict(os.environ)
    env["PYTHONPATH"] = checkout
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--point", str(cached), "--seconds", str(seconds),
                          "--max-downloads", str(max_downloads), "--dir", where, "--procs", str(procs)], env=env, capture_output=True, text=True,
                         cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise RuntimeError(f"{checkout}, {cached} cached shards: {out.stderr[-3000:]}")
    r: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="/work/main", help="the checkout to compare with ('' for none)")
    ap.add_argument("--shards", default="1000,10000,100000", help="cached shards, comma-separated")
    ap.add_argument("--seconds", type=float, default=4.0, help="downloads timed per point (at least 5 downloads)")
    ap.add_argument("--max-downloads", type=int, default=8000, help="downloads per point at most")
    ap.add_argument("--repeat", type=int, default=2, help="runs per point and checkout (the median is reported)")
    ap.add_argument("--quick", action="store_true", help="1k and 10k shards, one short run each (CI smoke)")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                    help="where the cache is made (default /dev/shm: the bookkeeping, not the disk's fsyncs, "
                         "is what is measured)")
    ap.add_argument("--procs", type=int, default=1, help="processes downloading at once into the one cache")
    ap.add_argument("--point", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "cache_index.json"))
    args = ap.parse_args()
    if args.point is not None:
        print(json.dumps(_point(args.point, args.seconds, args.max_downloads, args.dir, args.procs)))
        return 0
    sizes = [1000, 10000] if args.quick else [int(x) for x in args.shards.split(",")]
    repeat, seconds = (1, 1.0) if args.quick else (args.repeat, args.seconds)
    checkouts = {"after": ROOT}
    if args.baseline:
        checkouts["before"] = os.path.abspath(args.baseline)
    rows: dict[str, dict[int, list[dict[str, object]]]] = {k: {n: [] for n in sizes} for k in checkouts}
    for _ in range(repeat):
        for n in sizes:
            for name, path in checkouts.items():  # side by side: the two checkouts alternate
                rows[name][n].append(_run(path, n, seconds, args.max_downloads, args.dir, args.procs))

    def med(name: str, n: int, key: str) -> float:
        return statistics.median(float(r[key]) for r in rows[name][n])  # type: ignore[arg-type]

    result = {"config": {"shards": sizes, "seconds": seconds, "repeat": repeat, "checkouts": checkouts, "procs": args.procs,
                         "cache_dir_in": args.dir},
              "environment": {"python": platform.python_version(), "machine": platform.machine(),
                              "cpus": os.cpu_count()},
              "runs": {k: {str(n): v for n, v in r.items()} for k, r in rows.items()}}
    print(f"{'cached':>8} {'checkout':>8} {'downloads/s':>12} {'lock us/dl':>11} {'p50 us':>9} {'p99 us':>9} "
          f"{'max us':>10} {'first dl s':>10}")
    for n in sizes:
        for name in checkouts:
            print(f"{n:>8} {name:>8} {med(name, n, 'downloads_per_s'):>12.0f} {med(name, n, 'lock_hold_mean_us'):>11.0f} "
                  f"{med(name, n, 'lock_hold_p50_us'):>9.0f} {med(name, n, 'lock_hold_p99_us'):>9.0f} "
                  f"{med(name, n, 'lock_hold_max_us'):>10.0f} "
                  f"{med(name, n, 'first_download_s'):>10.3f}")
        if "before" in checkouts:
            print(f"{n:>8} {'ratio':>8} {med('after', n, 'downloads_per_s') / med('before', n, 'downloads_per_s'):>11.1f}x "
                  f"{med('before', n, 'lock_hold_mean_us') / med('after', n, 'lock_hold_mean_us'):>10.1f}x less")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
