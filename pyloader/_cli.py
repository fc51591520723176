"""The ``pyloader`` command line: ``pyloader bench``."""

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
import torch

from . import _bench as B
from ._dataset import ShardDataset
from ._errors import PyloaderError
from ._loader import DataLoader

BENCH_SCHEMA_VERSION = 1


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[pyloader bench] {msg}", file=sys.stderr, flush=True)


def _epoch(loader: Any, epochs: int) -> dict[str, float]:
    best: dict[str, float] | None = None
    for _ in range(epochs):
        samples, nbytes, t = B.loader_epoch(loader)
        r = {"samples": samples, "bytes": nbytes, "wall_s": t.wall, "cpu_s": t.cpu,
             "samples_per_s": samples / t.wall, "gbps": nbytes / t.wall / 1e9}
        if isinstance(loader, DataLoader):
            r["counters"] = loader.stats()  # native counters of this very epoch
        if best is None or r["samples_per_s"] > best["samples_per_s"]:
            best = r
    assert best is not None
    return best


def _torch_over_dataset(ds: ShardDataset, batch_size: int, workers: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers,
                                       prefetch_factor=4 if workers else None)


def run_bench(url: str | None, *, batch_size: int, threads: int, epochs: int, torch_workers: int,
              records: int, quiet: bool) -> dict[str, Any]:
    tmp = None
    result: dict[str, Any] = {"schema_version": BENCH_SCHEMA_VERSION, "environment": B.environment(),
                              "config": {"batch_size": batch_size, "threads": threads, "epochs": epochs,
                                         "torch_workers": torch_workers}}
    try:
        if url is None:
            tmp = tempfile.mkdtemp(prefix="pyloader-bench-")
            p = B.PROFILES["image12k"]
            _progress(f"generating the embedded dataset: {records} x {p.description}", quiet)
            url = os.path.join(tmp, "data")
            B.write_profile_dataset(url, p, records, compression="lz4", seed=0)
            result["dataset"] = {"generated": True, "profile": p.name, "records": records, "compression": "lz4"}
        ds = ShardDataset(url)
        size = sum(ds.shard_bytes)
        result.setdefault("dataset", {}).update({"url": url, "records": ds.num_records, "shards": len(ds.shard_paths),
                                                  "bytes": size, "fields": [f.to_json() for f in ds.fields]})

        _progress("stage: storage read", quiet)
        stages: dict[str, Any] = {}
        with B.CpuTimer() as t:
            gbps = B.read_gbps(ds.shard_paths)
        stages["storage_read"] = {"gbps": gbps, "cpu_s": t.cpu, "wall_s": t.wall}

        _progress("stage: native decode + collate (no consumer work)", quiet)
        loader = DataLoader(ds, batch_size=batch_size, num_workers=threads)
        e2e = _epoch(loader, epochs)
        counters = e2e.pop("counters")
        decoded = counters.get("decoded_bytes", 0)
        collate_s = counters.get("collate_ns", 0) / 1e9
        stages["decode_collate"] = {
            "gbps_per_thread": decoded / collate_s / 1e9 if collate_s else 0.0,
            "stored_bytes": counters.get("stored_bytes", 0), "decoded_bytes": decoded,
            "compression_ratio": counters.get("stored_bytes", 0) / decoded if decoded else 1.0,
        }
        stages["pyloader"] = {**e2e, "threads": threads,
                              "consumer_wait_fraction": counters.get("wait_ns", 0) / 1e9 / e2e["wall_s"]}

        _progress(f"baseline: torch DataLoader over the same dataset, num_workers={torch_workers}", quiet)
        stages["torch_dataloader"] = {**_epoch(_torch_over_dataset(ds, batch_size, torch_workers), epochs),
                                      "num_workers": torch_workers}
        if torch.cuda.is_available():
            _progress("stage: host-to-device copy (torch pinned)", quiet)
            x = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
            y = torch.empty_like(x, device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                y.copy_(x, non_blocking=True)
            torch.cuda.synchronize()
            stages["h2d_torch_pinned"] = {"gbps": 10 * x.numel() / (time.perf_counter() - t0) / 1e9}
        result["stages"] = stages
        result["speedup_vs_torch"] = stages["pyloader"]["samples_per_s"] / stages["torch_dataloader"]["samples_per_s"]
        result["diagnosis"] = _diagnose(stages)
        return result
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _diagnose(st: dict[str, Any]) -> list[str]:
    notes = []
    e2e = st["pyloader"]["gbps"]
    read = st["storage_read"]["gbps"]
    dec = st["decode_collate"]
    if read < 1.5 * e2e:
        notes.append(f"storage read ({read:.2f} GB/s) bounds the loader ({e2e:.2f} GB/s): warm the node "
                     "cache or use faster storage; LZ4 compression pays here.")
    per_thread = dec["gbps_per_thread"]
    threads = st["pyloader"]["threads"]
    if per_thread and per_thread * threads < 1.3 * e2e * (1 / max(dec["compression_ratio"], 1e-9)) and dec["compression_ratio"] < 0.95:
        notes.append(f"LZ4 decode bounds the loader ({per_thread:.2f} GB/s per thread): add threads, or store "
                     "records raw if storage is fast (compression pays only when storage or network is slower).")
    if st["pyloader"]["consumer_wait_fraction"] < 0.05:
        notes.append("the consumer almost never waits for data: the loader is ahead of this (empty) training loop.")
    if not notes:
        notes.append(f"collation on {threads} threads bounds the loader; more threads or larger records raise it.")
    return notes


def _print_bench(r: dict[str, Any]) -> None:
    st = r["stages"]
    d = r["dataset"]
    print(f"\npyloader bench: {d['records']} records in {d['shards']} shards, {d['bytes'] / 1e6:.1f} MB stored")
    print(f"{'stage':<34}{'throughput':>22}{'CPU s':>9}")
    print(f"{'storage read (page cache)':<34}{st['storage_read']['gbps']:>17.2f} GB/s{st['storage_read']['cpu_s']:>9.2f}")
    dc = st["decode_collate"]
    print(f"{'decode+collate per thread':<34}{dc['gbps_per_thread']:>17.2f} GB/s{'':>9}")
    for key, label in (("pyloader", f"pyloader ({st['pyloader']['threads']} threads)"),
                       ("torch_dataloader", f"torch DataLoader (workers={st['torch_dataloader']['num_workers']})")):
        s = st[key]
        print(f"{label:<34}{s['samples_per_s']:>11,.0f} samples/s{s['cpu_s']:>9.2f}")
        print(f"{'':<34}{s['gbps']:>17.2f} GB/s")
    if "h2d_torch_pinned" in st:
        print(f"{'H2D (torch pinned copy)':<34}{st['h2d_torch_pinned']['gbps']:>17.2f} GB/s")
    print(f"\npyloader / torch DataLoader: {r['speedup_vs_torch']:.2f}x samples/s "
          f"(compression ratio {dc['compression_ratio']:.2f}; consumer waited "
          f"{100 * st['pyloader']['consumer_wait_fraction']:.0f}% of the time)")
    for n in r["diagnosis"]:
        print(f"- {n}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pyloader", description="pyloader command line")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="measure the data path (default: a generated dataset)")
    b.add_argument("url", nargs="?", help="dataset directory or manifest (default: generate one)")
    b.add_argument("--batch-size", type=int, default=256)
    b.add_argument("--threads", type=int, default=max(1, min(os.cpu_count() or 1, 8)))
    b.add_argument("--epochs", type=int, default=3, help="epochs per measurement (best is kept)")
    b.add_argument("--torch-workers", type=int, default=2)
    b.add_argument("--records", type=int, default=20000, help="records in the generated dataset")
    b.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    args = ap.parse_args(argv)
    if args.cmd == "bench":
        for name in ("batch_size", "threads", "epochs", "records"):
            if getattr(args, name) < 1:
                ap.error(f"--{name.replace('_', '-')} must be >= 1")
        try:
            r = run_bench(args.url, batch_size=args.batch_size, threads=args.threads, epochs=args.epochs,
                          torch_workers=args.torch_workers, records=args.records, quiet=args.json)
        except (PyloaderError, OSError, ValueError) as e:
            print(f"pyloader bench: error: {e}", file=sys.stderr)
            return 2
        if args.json:
            json.dump(r, sys.stdout, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
            print()
        else:
            _print_bench(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
