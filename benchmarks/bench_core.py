"""Core engine benchmark: LZ4 decode, loader throughput, and the memcpy limit.

One run measures, on the same data in the page cache, side by side:
  (a) native LZ4 decode GB/s vs the `lz4` package, on 1 and 2 threads;
  (b) pyloader.DataLoader samples/s vs torch's DataLoader over a per-sample numpy-memmap
      Dataset (at its best num_workers) and vs a batch-gather baseline (one np.take per
      batch, num_workers=0);
  (c) pyloader payload GB/s vs 1- and 2-thread memcpy bandwidth;
for 12 KB image-like, 8 KB token and 150 KB records. Writes JSON (config, environment,
every figure) and prints a table of ratios.

    python benchmarks/bench_core.py [--mb 240] [--batch 256] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import lz4.block
import numpy as np

from pyloader.bench import measure as B


def measure_profile(p: B.Profile, args: argparse.Namespace, tmp: str) -> dict:
    n = max(args.batch * 4, int(args.mb * 1e6 / p.record_bytes))
    raw_dir, lz_dir, npy = (os.path.join(tmp, f"{p.name}-{k}") for k in ("raw", "lz4", "npy"))
    recs = B.write_profile_dataset(raw_dir, p, n, compression="none")
    B.write_profile_dataset(lz_dir, p, n, compression="lz4")
    np.save(npy + ".npy", recs)
    npy += ".npy"
    shape, dtype = recs.shape, str(recs.dtype)
    res: dict = {"profile": p.name, "records": n, "record_bytes": p.record_bytes,
                 "dataset_bytes": int(recs.nbytes)}

    # (a) decode, on the exact blocks the lz4 dataset stores (records LZ4 did not shrink stay raw)
    blocks = [(lz4.block.compress(recs[i].tobytes(), store_size=False), p.record_bytes)
              for i in range(min(n, max(64, int(32e6 / p.record_bytes))))]
    ratio = sum(len(b) for b, _ in blocks) / sum(k for _, k in blocks)
    res["lz4_ratio"] = ratio
    for t in (1, 2):
        res[f"decode_native_gbps_{t}t"] = B.best_of(lambda: B.native_decode_gbps(blocks, t), args.repeats)
        res[f"decode_lz4pkg_gbps_{t}t"] = B.best_of(lambda: B.lz4_package_decode_gbps(blocks, t), args.repeats)

    # (c) physical limit
    res["memcpy_gbps_1t"] = B.best_of(lambda: B.memcpy_gbps(1), args.repeats)
    res["memcpy_gbps_2t"] = B.best_of(lambda: B.memcpy_gbps(2), args.repeats)

    def run(loader_fn) -> dict:
        # One loader, as in training: its first epoch (which also verifies checksums and
        # faults in pages and buffers) is reported apart; the best later epoch is the
        # steady state.
        ldr = loader_fn()
        samples, nbytes, t = B.loader_epoch(ldr)
        first = {"samples_per_s": samples / t.wall, "gbps": nbytes / t.wall / 1e9}
        best = None
        for _ in range(args.repeats):
            samples, nbytes, t = B.loader_epoch(ldr)
            r = {"samples_per_s": samples / t.wall, "gbps": nbytes / t.wall / 1e9, "cpu_s": t.cpu,
                 "wall_s": t.wall}
            if best is None or r["samples_per_s"] > best["samples_per_s"]:
                best = r
        best["first_epoch"] = first
        return best

    # (b) loaders
    for shuffle in (False, True):
        tag = "shuf" if shuffle else "seq"
        res[f"pyloader_raw_{tag}"] = run(lambda: B.pyloader_loader(raw_dir, args.batch, shuffle=shuffle))
        res[f"pyloader_lz4_{tag}"] = run(lambda: B.pyloader_loader(lz_dir, args.batch, shuffle=shuffle))
        res[f"gather_{tag}"] = run(lambda: B.gather_loader(npy, shape, dtype, args.batch, shuffle=shuffle))
        best_torch, best_w = None, None
        for w in args.torch_workers:
            r = run(lambda: B.torch_loader(npy, shape, dtype, args.batch, shuffle=shuffle, num_workers=w))
            r["num_workers"] = w
            res[f"torch_w{w}_{tag}"] = r
            if best_torch is None or r["samples_per_s"] > best_torch["samples_per_s"]:
                best_torch, best_w = r, w
        res[f"torch_best_{tag}"] = {**best_torch, "num_workers": best_w}
    return res


def summarize(r: dict) -> list[tuple[str, float]]:
    rows = [
        ("decode native/lz4pkg 1 thread", r["decode_native_gbps_1t"] / r["decode_lz4pkg_gbps_1t"]),
        ("decode native 2t / lz4pkg 1t", r["decode_native_gbps_2t"] / r["decode_lz4pkg_gbps_1t"]),
    ]
    for tag in ("seq", "shuf"):
        py, pz = r[f"pyloader_raw_{tag}"], r[f"pyloader_lz4_{tag}"]
        rows += [
            (f"[{tag}] raw pyloader / torch best (w={r[f'torch_best_{tag}']['num_workers']})",
             py["samples_per_s"] / r[f"torch_best_{tag}"]["samples_per_s"]),
            (f"[{tag}] raw pyloader / batch-gather", py["samples_per_s"] / r[f"gather_{tag}"]["samples_per_s"]),
            (f"[{tag}] raw pyloader GB/s / memcpy 2t", py["gbps"] / r["memcpy_gbps_2t"]),
            (f"[{tag}] raw pyloader GB/s / memcpy 1t", py["gbps"] / r["memcpy_gbps_1t"]),
            (f"[{tag}] lz4 pyloader GB/s / lz4pkg 2t decode", pz["gbps"] / r["decode_lz4pkg_gbps_2t"]),
        ]
    rows.append(("raw shuffle / no shuffle", r["pyloader_raw_shuf"]["samples_per_s"] / r["pyloader_raw_seq"]["samples_per_s"]))
    rows.append(("lz4 shuffle / no shuffle", r["pyloader_lz4_shuf"]["samples_per_s"] / r["pyloader_lz4_seq"]["samples_per_s"]))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=240, help="dataset size per profile (MB)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profiles", default=",".join(B.PROFILES))
    ap.add_argument("--torch-workers", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2, 4])
    ap.add_argument("--out", default="bench_results/core.json")
    args = ap.parse_args()
    results = {"config": vars(args), "environment": B.environment(), "started": time.time(), "profiles": []}
    with tempfile.TemporaryDirectory(prefix="pyloader-bench-") as tmp:
        for name in args.profiles.split(","):
            p = B.PROFILES[name]
            print(f"== {p.description}", file=sys.stderr, flush=True)
            r = measure_profile(p, args, tmp)
            results["profiles"].append(r)
            print(f"\n{p.description}: {r['records']} records, lz4 ratio {r['lz4_ratio']:.2f}, "
                  f"memcpy {r['memcpy_gbps_1t']:.1f} GB/s (1t) {r['memcpy_gbps_2t']:.1f} GB/s (2t)")
            print(f"  pyloader raw seq {r['pyloader_raw_seq']['samples_per_s']:,.0f} samples/s "
                  f"({r['pyloader_raw_seq']['gbps']:.2f} GB/s); torch best "
                  f"{r['torch_best_seq']['samples_per_s']:,.0f}; gather {r['gather_seq']['samples_per_s']:,.0f}")
            for label, v in summarize(r):
                print(f"  {label:<48s} {v:6.2f}x")
            sys.stdout.flush()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
