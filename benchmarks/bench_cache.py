"""Remote reads through the node cache, against a loopback server with a fixed bandwidth
and latency per connection (benchmarks/throttled_http.py), all measured in one run:

1. network only: ``pyloader cache warm``-style download of the whole dataset (T_net);
2. a cold-cache epoch with a simulated training step per batch (T_cold);
3. a warm-cache epoch with the same step (T_warm);
   prefetch hides ``1 - (T_cold - T_warm) / T_net`` of the network time
   (1.0: a cold epoch costs no more than a warm one; 0.0: no overlap at all);
4. download throughput vs the number of parallel downloads (``--jobs``).

Writes bench_results/cache.json. Usage: python benchmarks/bench_cache.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from throttled_http import ThrottledServer

import pyloader
from pyloader.remote.fetch import ShardFetcher, open_remote


def write_dataset(d: str, records: int, record_bytes: int, shard_bytes: int) -> None:
    rng = np.random.default_rng(0)
    with pyloader.ShardWriter(d, {"x": ("uint8", (record_bytes,)), "label": ("int64", ())},
                              compression="none", shard_bytes=shard_bytes) as w:
        for i in range(records):
            w.write({"x": rng.integers(0, 255, record_bytes, dtype=np.uint8), "label": i})


def epoch(url: str, cache: str, batch: int, step_s: float, jobs: int) -> tuple[float, int]:
    ds = pyloader.ShardDataset(url, cache_dir=cache, fetch_jobs=jobs)
    t0 = time.perf_counter()
    n = 0
    for b in ds.batches(batch, num_threads=2):
        n += int(b["label"].shape[0])
        time.sleep(step_s)  # the training step the loader should overlap with
    dt = time.perf_counter() - t0
    ds._fetcher.close()
    return dt, n


def warm(url: str, cache: str, jobs: int) -> tuple[float, int]:
    d = open_remote(url, cache_dir=cache)
    f = ShardFetcher(d, None, jobs=jobs)
    t0 = time.perf_counter()
    f.schedule(range(len(d.shards)))
    f.wait()
    dt = time.perf_counter() - t0
    if f.errors:
        raise RuntimeError(f"warm failed: {next(iter(f.errors.values()))}")
    return dt, f.bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller dataset (CI smoke run)")
    ap.add_argument("--bandwidth", type=float, default=8e6, help="bytes/s per connection (default 8 MB/s)")
    ap.add_argument("--latency", type=float, default=0.02, help="seconds to first byte (default 0.02)")
    ap.add_argument("--jobs", type=int, default=4, help="parallel downloads for the epochs")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "cache.json"))
    args = ap.parse_args()
    records = 256 if args.quick else 512
    cfg = {"records": records, "record_bytes": 65536, "shard_bytes": 1 << 20, "batch": 16, "step_s": 0.06,
           "bandwidth_per_connection": args.bandwidth, "latency_s": args.latency, "epoch_jobs": args.jobs,
           "jobs_sweep": [1, 2, 4, 8]}
    tmp = tempfile.mkdtemp(prefix="pyloader-bench-cache-")
    try:
        srv_root = os.path.join(tmp, "srv")
        write_dataset(os.path.join(srv_root, "ds"), records, cfg["record_bytes"], cfg["shard_bytes"])
        total = sum(pyloader.ShardDataset(os.path.join(srv_root, "ds")).shard_bytes)
        with ThrottledServer(srv_root, bandwidth=args.bandwidth, latency=args.latency, max_life=900) as srv:
            url = srv.url + "/ds"
            t_net, _ = warm(url, os.path.join(tmp, "c-net"), args.jobs)
            cache = os.path.join(tmp, "c-epoch")
            t_cold, n = epoch(url, cache, cfg["batch"], cfg["step_s"], args.jobs)
            t_warm, n2 = epoch(url, cache, cfg["batch"], cfg["step_s"], args.jobs)
            assert n == n2 == records
            sweep = {}
            for j in cfg["jobs_sweep"]:
                dt, nbytes = warm(url, os.path.join(tmp, f"c-jobs{j}"), j)
                sweep[j] = nbytes / dt
        hidden = 1.0 - (t_cold - t_warm) / t_net
        result = {
            "config": cfg,
            "environment": {"python": platform.python_version(), "machine": platform.machine(),
                            "cpus": os.cpu_count(), "pyloader": pyloader.__version__},
            "dataset_bytes": total,
            "seconds": {"network_only": t_net, "cold_epoch": t_cold, "warm_epoch": t_warm},
            "cold_over_warm": t_cold / t_warm,
            "network_over_warm": t_net / t_warm,
            "network_time_hidden": hidden,
            "throughput_bytes_per_s_by_jobs": {str(k): v for k, v in sweep.items()},
            "throughput_vs_jobs1": {str(k): v / sweep[1] for k, v in sweep.items()},
        }
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"dataset {total / 1e6:.1f} MB; {args.bandwidth / 1e6:.0f} MB/s and {args.latency * 1e3:.0f} ms per "
              f"connection; {args.jobs} parallel downloads during epochs")
        print(f"cold epoch / warm epoch        {t_cold / t_warm:6.2f}x")
        print(f"network only / warm epoch      {t_net / t_warm:6.2f}x")
        print(f"network time hidden by prefetch {100 * hidden:5.0f}%")
        print("download throughput vs --jobs 1: " + ", ".join(
            f"jobs {k}: {v / sweep[1]:.2f}x" for k, v in sweep.items()))
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
