"""A three-source ``pyloader.Mixture`` against one source alone, side by side in one run.

Three local datasets with the same fields and record size; the baseline reads one dataset
as large as the three together (the same records and bytes per epoch, so the same page-cache
footprint) through ``pyloader.DataLoader``, the mixture reads
all three at weights 0.5 / 0.3 / 0.2 for an epoch of their records summed (the target: >= 0.9x the baseline's samples/s). Both
shuffled globally, page cache warm (one untimed epoch each), best of ``--repeat`` epochs.
Also times the mixture's planning alone (``epoch_plan``) for the epoch. Prints a table and
writes bench_results/mixture.json.
Usage: python benchmarks/bench_mixture.py [--quick]
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pyloader


def write_dataset(d: str, records: int, record_bytes: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    payload = rng.integers(0, 255, (256, record_bytes), dtype=np.uint8)
    with pyloader.ShardWriter(d, {"x": ("uint8", (record_bytes,)), "label": ("int64", ())},
                              compression="none", shard_bytes=4 << 20) as w:
        for i in range(records):
            w.write({"x": payload[i % 256], "label": i})


def epoch_rate(loader: pyloader.DataLoader) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for b in loader:
        n += int(b["label"].shape[0])
    return n / (time.perf_counter() - t0), n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller dataset (CI smoke run)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--record-bytes", type=int, default=4096)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "mixture.json"))
    args = ap.parse_args()
    per_source = 10_000 if args.quick else 40_000
    cfg: dict[str, Any] = {"records_per_source": per_source, "record_bytes": args.record_bytes,
                           "batch": args.batch, "threads": args.threads, "repeat": args.repeat,
                           "weights": [0.5, 0.3, 0.2], "shuffle": "global", "policy": "cycle"}
    tmp = tempfile.mkdtemp(prefix="pyloader-bench-mixture-")
    try:
        paths = [os.path.join(tmp, f"s{k}") for k in range(3)]
        for k, p in enumerate(paths):
            write_dataset(p, per_source, args.record_bytes, k)
        alone = os.path.join(tmp, "alone")  # one source as large as the three: the same bytes per epoch
        write_dataset(alone, 3 * per_source, args.record_bytes, 0)

        def single() -> pyloader.DataLoader:
            return pyloader.DataLoader(pyloader.ShardDataset(alone, shuffle=True, seed=1),
                                       batch_size=args.batch, num_workers=args.threads)

        def mixture() -> tuple[pyloader.DataLoader, pyloader.Mixture]:
            mix = pyloader.Mixture([pyloader.ShardDataset(p) for p in paths], cfg["weights"], shuffle=True, seed=1)
            return pyloader.DataLoader(mix, batch_size=args.batch, num_workers=args.threads), mix

        rows: dict[str, dict[str, float]] = {}
        loaders = {"one source": single(), "mixture of 3": mixture()[0]}
        for loader in loaders.values():
            epoch_rate(loader)  # warm: page cache, first verification
        rates: dict[str, list[float]] = {k: [] for k in loaders}
        for _ in range(args.repeat):  # interleaved, so drift on a shared machine hits both
            for name, loader in loaders.items():
                rates[name].append(epoch_rate(loader)[0])
        for name, r in rates.items():
            rows[name] = {"samples_per_s": max(r), "median_samples_per_s": float(np.median(r))}
        _, mix = mixture()
        t0 = time.perf_counter()
        mix.epoch_plan(5, 0, 1)
        plan_s = time.perf_counter() - t0
        ratio = rows["mixture of 3"]["samples_per_s"] / rows["one source"]["samples_per_s"]
        print(f"{'reader':<14} {'samples/s (best)':>18} {'median':>12}")
        for name, row in rows.items():
            print(f"{name:<14} {row['samples_per_s']:>18,.0f} {row['median_samples_per_s']:>12,.0f}")
        print(f"mixture / one source: {ratio:.3f}x (target >= 0.9x); planning an epoch of {3 * per_source} "
              f"positions: {plan_s * 1e3:.1f} ms; realised {mix.realised(5)}")
        out = {"config": cfg, "results": rows, "ratio": ratio, "plan_epoch_s": plan_s,
               "realised": mix.realised(5),
               "env": {"python": platform.python_version(), "machine": platform.machine(),
                       "cpus": os.cpu_count(), "pyloader": pyloader.__version__}}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=2)
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
