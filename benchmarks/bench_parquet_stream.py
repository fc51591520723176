"""Streaming a remote ``ParquetDataset`` through a cache eight times smaller than it vs the same
dataset fully cached, over a loopback HTTP server with a shared-bandwidth link and a fixed
latency per request (benchmarks/throttled_http.py, in its own process), all in one run:

1. ``stream 1/8``: ``ParquetDataset(url, cache_limit=dataset/8)`` with a fresh cache dir, one
   epoch of ``ds.batches(batch)``: files fetched ahead in plan order within the limit and
   released (then evicted) after their last row group is decoded (NOTE [pending files] in
   pyloader/remote/pending_files.py);
2. ``full, cold``: the same with no cache limit and a fresh cache dir: the same downloads,
   nothing released or evicted;
3. ``full, warm``: a second epoch of pass 2's dataset: the cache alone, no network.

The passes alternate, ``--repeat`` times; the table shows each pass's median and min-max,
and the ratio of the streaming epoch's time to the fully cached cold epoch's, repeat by
repeat (1.0: streaming costs nothing). ``--shuffle`` reads every pass window-shuffled
(``--window`` rows, default one row group): files in a shuffled order, then their row
groups, so a file is held only while a window overlaps it (NOTE [window size] in
pyloader/read/order.py). The consumer only iterates (no step). For each
pass: wall seconds, samples/s, the consumer's wait fraction, the cache's peak size on disk
(published files plus download temps, sampled every few ms) against the limit, files
downloaded and unloaded (released to make room).

Writes bench_results/parquet_stream.json. Usage: python benchmarks/bench_parquet_stream.py [--quick] [--shuffle]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

import pyloader  # noqa: E402
from pyloader.bench.measure import CachePeak  # noqa: E402

MB = 1 << 20


def write_files(d: str, files: int, rows: int, group: int, tokens: int) -> int:
    """``files`` Parquet files of ``rows`` rows (an id, a token list of about ``tokens`` int32) in row groups of ``group``."""
    os.makedirs(d)
    rng = np.random.default_rng(0)
    for k in range(files):
        lens = rng.integers(tokens // 2, tokens * 3 // 2 + 1, rows)
        offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        values = rng.integers(0, 50_000, int(offs[-1]), dtype=np.int32)
        table = pa.table({"id": np.arange(k * rows, (k + 1) * rows, dtype=np.int64),
                          "tokens": pa.ListArray.from_arrays(pa.array(offs), pa.array(values))})
        pq.write_table(table, os.path.join(d, f"part-{k:04d}.parquet"), row_group_size=group)
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def epoch(ds: pyloader.ParquetDataset, batch: int, epoch_no: int, cache_dir: str, interval: float) -> dict[str, Any]:
    with CachePeak(cache_dir, interval) as peak:
        t0 = time.perf_counter()
        it = ds.batches(batch, epoch=epoch_no, num_threads=2)
        ids = [b["id"].numpy().copy() for b in it]
        wall = time.perf_counter() - t0
    s = it.stats()
    seen = np.sort(np.concatenate(ids))
    n = int(seen.size)
    return {"wall_s": wall, "samples": n, "samples_per_s": n / wall, "wait_fraction": s["consumer_wait_s"] / wall,
            "every_row_once": bool(np.array_equal(seen, np.arange(ds.num_records))),
            "cache_peak_bytes": peak.peak, "cache_samples": peak.samples,
            "files_downloaded": s.get("files_downloaded"), "files_unloaded": s.get("files_unloaded"),
            "peak_held_bytes": s.get("cache_peak_held_bytes"), "budget_bytes": s.get("cache_budget_bytes"),
            "working_set_bytes": s.get("cache_working_set_bytes")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="token lists a quarter as long, one repeat (smoke run)")
    ap.add_argument("--files", type=int, default=32, help="Parquet files (default 32)")
    ap.add_argument("--rows", type=int, default=2048, help="rows per file (default 2048)")
    ap.add_argument("--group", type=int, default=512, help="rows per row group (default 512)")
    ap.add_argument("--tokens", type=int, default=256, help="average token-list length, int32 (default 256)")
    ap.add_argument("--link-mbps", type=float, default=200, help="link bandwidth shared by all connections, MB/s")
    ap.add_argument("--latency-ms", type=float, default=20, help="latency of every request, ms (default 20)")
    ap.add_argument("--cache-fraction", type=float, default=8, help="dataset size / cache limit (default 8)")
    ap.add_argument("--jobs", type=int, default=4, help="fetch_jobs (default 4)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--shuffle", action="store_true", help="window-shuffled epochs (default: in order)")
    ap.add_argument("--window", type=int, default=None, help="shuffle window in rows (default: --group)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the three passes (default 3)")
    ap.add_argument("--sample-ms", type=float, default=5, help="cache-size sampler interval, ms (default 5)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "parquet_stream.json"))
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeat = 64, 1
    interval = args.sample_ms / 1e3
    window = args.window or args.group
    tmp = tempfile.mkdtemp(prefix="pyloader-bench-pqstream-")
    proc: subprocess.Popen[str] | None = None
    try:
        data = os.path.join(tmp, "srv", "data")
        total = write_files(data, args.files, args.rows, args.group, args.tokens)
        limit = int(total / args.cache_fraction)
        cmd = [sys.executable, os.path.join(HERE, "throttled_http.py"), os.path.join(tmp, "srv"),
               "--bandwidth", str(args.link_mbps * MB), "--latency", str(args.latency_ms / 1e3), "--link",
               "--max-life", "900"]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        url = proc.stdout.readline().strip() + "/data/"
        print(f"{args.files} files, {args.files * args.rows} rows in row groups of {args.group}, "
              f"{total / MB:.1f} MB; link {args.link_mbps:g} MB/s shared, {args.latency_ms:g} ms per request; "
              f"cache limit {limit / MB:.2f} MB (dataset / {args.cache_fraction:g}); batch {args.batch}, "
              f"fetch_jobs {args.jobs}; " + (f"window shuffle of {window} rows" if args.shuffle else "in order"))
        kw: dict[str, Any] = dict(columns=["id", "tokens"], shuffle=args.shuffle, window=window, seed=7,
                                  fetch_jobs=args.jobs)
        passes: list[dict[str, Any]] = []
        for r in range(args.repeat):
            c1 = os.path.join(tmp, f"cache-stream-{r}")
            ds = pyloader.ParquetDataset(url, cache_dir=c1, cache_limit=limit, **kw)
            passes.append({"kind": "stream 1/8", "repeat": r, **epoch(ds, args.batch, 0, c1, interval)})
            ds._fetcher.close()
            del ds
            c2 = os.path.join(tmp, f"cache-full-{r}")
            ds = pyloader.ParquetDataset(url, cache_dir=c2, **kw)
            passes.append({"kind": "full, cold", "repeat": r, **epoch(ds, args.batch, 0, c2, interval)})
            passes.append({"kind": "full, warm", "repeat": r, **epoch(ds, args.batch, 1, c2, interval)})
            ds._fetcher.close()
            del ds
            shutil.rmtree(c1, ignore_errors=True)
            shutil.rmtree(c2, ignore_errors=True)
        kinds = ["stream 1/8", "full, cold", "full, warm"]
        print(f"{'pass':<12} {'wall s':>16} {'samples/s':>10} {'wait':>6} {'cache peak MB':>14} {'limit MB':>9} "
              f"{'downloaded':>10} {'unloaded':>9}")
        for k in kinds:
            ps = [p for p in passes if p["kind"] == k]
            walls = [p["wall_s"] for p in ps]
            lim = f"{limit / MB:.2f}" if k == "stream 1/8" else "-"
            print(f"{k:<12} {statistics.median(walls):6.2f} ({min(walls):.2f}-{max(walls):.2f}) "
                  f"{statistics.median(p['samples_per_s'] for p in ps):10.0f} "
                  f"{statistics.median(p['wait_fraction'] for p in ps):6.2f} "
                  f"{max(p['cache_peak_bytes'] for p in ps) / MB:14.2f} {lim:>9} "
                  f"{ps[0]['files_downloaded']!s:>10} {ps[0]['files_unloaded']!s:>9}")
        ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(
            [p for p in passes if p["kind"] == "stream 1/8"], [p for p in passes if p["kind"] == "full, cold"],
            strict=True)]
        warm = [a["wall_s"] / b["wall_s"] for a, b in zip(
            [p for p in passes if p["kind"] == "stream 1/8"], [p for p in passes if p["kind"] == "full, warm"],
            strict=True)]
        print("stream 1/8 / full cold, per repeat: " + ", ".join(f"{x:.2f}" for x in ratios)
              + f" (median {statistics.median(ratios):.2f})")
        print("stream 1/8 / full warm, per repeat: " + ", ".join(f"{x:.2f}" for x in warm)
              + f" (median {statistics.median(warm):.2f})")
        print("every row read once in every pass" if all(p["every_row_once"] for p in passes) else
              "SOME PASS DID NOT READ EVERY ROW ONCE")
        over = [p for p in passes if p["kind"] == "stream 1/8" and p["cache_peak_bytes"] > limit]
        print("cache peak within the limit in every streaming pass" if not over else
              f"cache peak ABOVE the limit in {len(over)} streaming pass(es)")
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"config": {"files": args.files, "rows_per_file": args.rows, "group_rows": args.group,
                                  "tokens": args.tokens, "dataset_bytes": total, "cache_limit": limit,
                                  "cache_fraction": args.cache_fraction, "link_bytes_per_s": args.link_mbps * MB,
                                  "latency_s": args.latency_ms / 1e3, "fetch_jobs": args.jobs, "batch": args.batch,
                                  "num_threads": 2, "repeat": args.repeat, "shuffle": args.shuffle,
                                  "window": window},
                       "environment": {"python": sys.version.split()[0], "platform": platform.platform(),
                                       "cpus": os.cpu_count(), "pyloader": pyloader.__version__},
                       "passes": passes, "ratio_stream_over_full_cold": ratios,
                       "ratio_stream_over_full_warm": warm}, f, indent=1)
        print(f"wrote {args.out}")
    finally:
        if proc is not None and proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
