"""Narrow tables: bytes on disk and read rate, shard format version 2 against version 3.

Two tables of small fixed fields (NOTE [column layout] in pyloader/format/spec.py):

- ``mixed``: int64 ``id``, float32 ``x`` [4], int32 ``label`` (28 bytes a record);
- ``f64x8``: eight float64 scalar columns (64 bytes a record).

Each is written twice by the same encoder, once as version 2 (a 32-byte index entry per
value: ``version=2``) and once as version 3 (the fields stored as columns), values raw in
both. Reported per layout: dataset bytes on disk over raw value bytes, and the read rate
(samples/s) through ``pyloader.DataLoader`` (its native batches), sequential and shuffled:
the first epoch (every checksum verified) and the best of the later epochs. Runs are
interleaved (v2, v3, v2, v3...) because this machine is shared and noisy. Writes JSON
(config, environment, every time) and prints a table.

    python benchmarks/bench_narrow.py [--rows 2000000] [--epochs 3] [--batch 4096] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pyloader  # noqa: I001
from pyloader.bench import measure as B
from pyloader.format.encode import ColumnBytes, ShardEncoder, publish_manifest
from pyloader.format.spec import make_fields

TABLES: dict[str, dict[str, Any]] = {
    "mixed": {"id": ("int64", ()), "x": ("float32", (4,)), "label": ("int32", ())},
    "f64x8": {f"c{k}": ("float64", ()) for k in range(8)},
}


def columns(table: str, lo: int, hi: int) -> list[np.ndarray]:
    """Rows [lo, hi) of ``table``, one array per field (deterministic)."""
    rng = np.random.default_rng(lo)
    n = hi - lo
    if table == "mixed":
        return [np.arange(lo, hi, dtype=np.int64), rng.standard_normal((n, 4)).astype(np.float32),
                rng.integers(0, 1000, n).astype(np.int32)]
    return [rng.standard_normal(n) for _ in range(8)]


def write(path: str, table: str, rows: int, version: int, shard_bytes: int) -> dict[str, Any]:
    """Writes ``rows`` records of ``table`` as shard format ``version``; returns sizes and time."""
    fields = make_fields(TABLES[table])
    os.makedirs(path)
    t0 = time.perf_counter()
    enc = ShardEncoder(path, fields, [False] * len(fields), shard_bytes=shard_bytes, prefix="shard-",
                       version=version)
    chunk = 1 << 16
    for lo in range(0, rows, chunk):
        hi = min(rows, lo + chunk)
        cols = [np.ascontiguousarray(a) for a in columns(table, lo, hi)]
        enc.append_columns(hi - lo, [ColumnBytes(a.reshape(-1).view(np.uint8).data, f.row_bytes)
                                     for a, f in zip(cols, fields)])
    shards = enc.close()
    publish_manifest(path, fields, shards)
    raw = rows * sum(f.row_bytes for f in fields)
    disk = sum(int(s["bytes"]) for s in shards)
    return {"version": enc.version, "shards": len(shards), "disk_bytes": disk, "raw_bytes": raw,
            "disk_over_raw": disk / raw, "write_s": time.perf_counter() - t0}


def epoch_rate(loader: Any) -> float:
    """Samples per second of one epoch of ``loader``."""
    n = 0
    t0 = time.perf_counter()
    for batch in loader:
        n += int(next(iter(batch.values())).shape[0])
        del batch
    return n / (time.perf_counter() - t0)


def read(path: str, *, shuffle: bool, batch: int, threads: int, epochs: int) -> dict[str, Any]:
    """The first epoch's rate (checksums verified) and the best later epoch's, samples/s."""
    ds = pyloader.ShardDataset(path, shuffle=shuffle, seed=1)
    loader = pyloader.DataLoader(ds, batch_size=batch, num_workers=threads)
    first = epoch_rate(loader)
    later = [epoch_rate(loader) for _ in range(epochs)]
    return {"first_epoch_samples_per_s": first, "steady_samples_per_s": max(later), "epochs_samples_per_s": later}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--tables", default="mixed,f64x8")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2, help="DataLoader num_workers (native threads)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs after the first, per run")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved runs per layout and order")
    ap.add_argument("--shard-bytes", type=int, default=64 << 20)
    ap.add_argument("--out", default="bench_results/narrow.json")
    args = ap.parse_args()
    res: dict[str, Any] = {"config": vars(args), "environment": B.environment(), "tables": {}}
    tmp = tempfile.mkdtemp(prefix="bench_narrow-")
    try:
        for table in args.tables.split(","):
            out: dict[str, Any] = {}
            for version in (2, 3):
                path = os.path.join(tmp, f"{table}-v{version}")
                out[f"v{version}"] = {"write": write(path, table, args.rows, version, args.shard_bytes),
                                      "sequential": [], "shuffled": []}
            for _ in range(args.rounds):
                for order in ("sequential", "shuffled"):
                    for version in (2, 3):
                        path = os.path.join(tmp, f"{table}-v{version}")
                        out[f"v{version}"][order].append(read(path, shuffle=order == "shuffled", batch=args.batch,
                                                              threads=args.threads, epochs=args.epochs))
            res["tables"][table] = out
            w2, w3 = out["v2"]["write"], out["v3"]["write"]
            print(f"{table}: {args.rows} rows, raw {w2['raw_bytes'] / 1e6:.1f} MB; on disk v2 {w2['disk_bytes'] / 1e6:.1f}"
                  f" MB ({w2['disk_over_raw']:.2f}x raw), v3 {w3['disk_bytes'] / 1e6:.1f} MB "
                  f"({w3['disk_over_raw']:.3f}x raw)")
            for order in ("sequential", "shuffled"):
                def best(v: str, key: str) -> float:
                    return max(r[key] for r in out[v][order])
                for key, label in (("first_epoch_samples_per_s", "first epoch"), ("steady_samples_per_s", "steady")):
                    a, b = best("v2", key), best("v3", key)
                    print(f"  {order:10s} {label:11s} v2 {a / 1e6:6.2f} M samples/s  v3 {b / 1e6:6.2f} M samples/s"
                          f"  (v3/v2 {b / a:.2f}x)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
