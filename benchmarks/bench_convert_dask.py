"""Convert throughput on a Dask LocalCluster of 1, 2 and 4 workers vs ``pyloader convert --jobs`` 1, 2 and 4.

    python benchmarks/bench_convert_dask.py [--mb 300] [--workers 1,2,4] [--out bench_results/convert_dask.json]

Generates one Parquet corpus (several files of many row groups: a variable-length int32
token column, an int64 id, a float32 score and an int32 length), then converts it, in
this run, with ``convert(jobs=N)`` (N local processes, contiguous parts) and with
``convert(engine="dask", jobs=N)`` (a LocalCluster of N worker processes, one thread
each, started and closed by convert: its start-up is in the time, as a user pays it) for
each N. Also the dask engine on a cluster already running (``scheduler=`` a Client),
which leaves out the cluster's start-up. MB/s = decoded source bytes / wall seconds;
records/s likewise. Every output is read back and checked for the record count.
Writes JSON with the config, the environment and every number, and prints a table.
On a machine with fewer cores than N, N workers share them: the figure shows the
oversubscription, not scaling.
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
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pyloader


def make_corpus(root: str, mb: int, files: int, row_group: int, seed: int = 0) -> int:
    """Parquet files totalling about ``mb`` MB of decoded values; returns the records."""
    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    per_row = 4 * 512 + 8 + 4 + 4  # mean tokens 512
    rows = mb * 1_000_000 // per_row // files
    total_rows, rid = 0, 0
    for f in range(files):
        lens = rng.integers(0, 1024, rows).astype(np.int32)
        offs = np.zeros(rows + 1, np.int32)
        np.cumsum(lens, out=offs[1:])
        tok = pa.ListArray.from_arrays(pa.array(offs), pa.array(rng.integers(0, 50_000, int(offs[-1]),
                                                                          dtype=np.int32)))
        table = pa.table({"tokens": tok, "id": pa.array(np.arange(rid, rid + rows, dtype=np.int64)),
                          "score": pa.array(rng.random(rows).astype(np.float32)), "length": pa.array(lens)})
        pq.write_table(table, os.path.join(root, f"part-{f:03d}.parquet"), row_group_size=row_group,
                       compression="snappy")
        rid += rows
        total_rows += rows
    return total_rows


def run(label: str, fn: Any, dst: str, records: int) -> dict[str, Any]:
    shutil.rmtree(dst, ignore_errors=True)
    t = time.perf_counter()
    res = fn(dst)
    dt = time.perf_counter() - t
    ds = pyloader.ShardDataset(dst)
    assert len(ds) == records == res.records, (len(ds), records, res.records)
    out = {"label": label, "engine": res.engine, "workers": res.jobs, "tasks": res.tasks, "shards": res.shards,
           "seconds": dt, "bytes_in": res.bytes_in, "mb_per_s": res.bytes_in / dt / 1e6,
           "records_per_s": res.records / dt}
    print(f"{label:<34} {res.jobs:>3} {res.tasks:>5} {res.shards:>6} {dt:>8.2f} {out['mb_per_s']:>8.1f} "
          f"{out['records_per_s']:>12,.0f}", flush=True)
    shutil.rmtree(dst, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=300, help="decoded MB of the corpus")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--row-group", type=int, default=500, help="rows per Parquet row group")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--shard-size", default="8M")
    ap.add_argument("--task-size", default="16M", help="source bytes per dask task")
    ap.add_argument("--tmp", default=None, help="folder for the corpus and outputs (default: a temp folder)")
    ap.add_argument("--out", default="bench_results/convert_dask.json")
    args = ap.parse_args()
    import dask
    import distributed

    workers = [int(w) for w in args.workers.split(",")]
    res: dict[str, Any] = {"config": vars(args), "environment": {
        "python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
        "pyarrow": pa.__version__, "dask": dask.__version__, "distributed": distributed.__version__,
        "note": "N workers on fewer than N cores oversubscribe them"}, "runs": []}
    tmp = tempfile.mkdtemp(prefix="bench-convert-dask-", dir=args.tmp)
    try:
        src = os.path.join(tmp, "src")
        t = time.perf_counter()
        records = make_corpus(src, args.mb, args.files, args.row_group)
        size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
        meta = [pq.ParquetFile(os.path.join(src, f)).metadata for f in sorted(os.listdir(src))]
        res["corpus"] = {"records": records, "files": args.files, "row_groups": sum(m.num_row_groups for m in meta),
                         "parquet_bytes": size, "seconds_to_make": time.perf_counter() - t}
        print(f"corpus: {records:,} records, {res['corpus']['row_groups']} row groups in {args.files} files, "
              f"{size / 1e6:.0f} MB of Parquet; {os.cpu_count()} CPUs", flush=True)
        print(f"{'run':<34} {'wrk':>3} {'tasks':>5} {'shards':>6} {'seconds':>8} {'MB/s':>8} {'records/s':>12}")
        opts = {"shard_size": args.shard_size, "compression": "none"}
        dst = os.path.join(tmp, "out")
        pyloader.convert(src, dst, **opts)  # warm-up: the corpus in the page cache for every run alike
        shutil.rmtree(dst)
        for n in workers:
            res["runs"].append(run(f"convert --jobs {n}", lambda d, n=n: pyloader.convert(src, d, jobs=n, **opts),
                                   dst, records))
            res["runs"].append(run(f"convert --engine dask --jobs {n}",
                                   lambda d, n=n: pyloader.convert(src, d, engine="dask", jobs=n,
                                                                   task_size=args.task_size, **opts), dst, records))
            with distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None,
                                          scheduler_kwargs={"dashboard_address": ":0"}) as lc, \
                    distributed.Client(lc) as client:
                client.wait_for_workers(n)
                res["runs"].append(run(f"dask, running cluster of {n}",
                                       lambda d, c=client: pyloader.convert(src, d, engine="dask", scheduler=c,
                                                                            task_size=args.task_size, **opts),
                                       dst, records))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
