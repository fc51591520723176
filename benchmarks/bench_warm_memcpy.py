"""Warm arrays against the machine: a reused DataLoader's steady rate vs 2-thread memcpy, side by side.

For 12 KB image-like, 8 KB token and 150 KB raw records (page cache warm, one loader reused
over every epoch, ``num_workers=2``, batch 256), each round runs, in alternating order:

* ``memcpy2t``: ``measure.memcpy_gbps(2)``, numpy copies of 64 MiB anonymous buffers on two
  threads (the figure the loader is held to);
* ``mmap_copy``: the same shard bytes copied from their (already mapped) files in batch-sized
  pieces into a reused ring of 4 batch buffers per thread, two threads: the loader's one copy
  per byte without anything else (read from the page cache, written to reused memory);
* ``loader``: a block of back-to-back epochs (``--epochs``, so the epoch boundary counts as
  often as in training), with what went into it: the process's CPU over wall time (2.0 = both
  cores busy), the consuming thread's share of that CPU, page faults (``ru_minflt``) and the
  bytes hashed (``verified_bytes``, See NOTE [verify once] in csrc/core/shard_reader.h: zero
  once every record was read once).

Every ratio is taken within one round and reported as median and range over rounds,
because this machine is shared. Writes JSON (every raw figure) and prints a table.

With ``--baseline ROOT`` (another checkout, its ``_C`` built) every round runs in two fresh
processes instead, this checkout's and the baseline's (order alternating), each importing
its own pyloader, over the same files: the table then has a row per checkout.

    python benchmarks/bench_warm_memcpy.py [--mb 240] [--rounds 5] [--epochs 4] [--profiles image12k,tokens8k,blob150k]
        [--baseline ROOT]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from pyloader.bench import measure as B

BATCH = 256


def mmap_copy_gbps(maps: list[np.ndarray], rings: list[list[np.ndarray]]) -> float:
    """GB/s of copying every batch-sized piece of ``maps`` into the threads' rings (one thread per ring)."""
    chunk = rings[0][0].nbytes
    work: list[list[tuple[np.ndarray, int]]] = [[] for _ in rings]
    k = 0
    for m in maps:
        for off in range(0, len(m) - chunk + 1, chunk):
            work[k % len(rings)].append((m, off))
            k += 1

    def run(i: int) -> None:
        ring = rings[i]
        for j, (m, off) in enumerate(work[i]):
            np.copyto(ring[j % len(ring)], m[off : off + chunk])

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(rings))]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return k * chunk / (time.perf_counter() - t0) / 1e9


def loader_block(loader: Any, epochs: int) -> dict[str, float]:
    """Back-to-back epochs of ``loader``: GB/s, CPU/wall, the consumer's CPU share, faults, bytes hashed."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0, m0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
    nbytes = verified = 0
    for _ in range(epochs):
        for batch in loader:
            nbytes += B.batch_payload(batch)[1]
        verified += int(loader.stats().get("verified_bytes", 0))
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    return {"gbps": nbytes / wall / 1e9, "cpu_over_wall": cpu / wall,
            "consumer_share": (time.thread_time() - m0) / cpu if cpu > 0 else 0.0,
            "minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, "verified_bytes": verified}


def measure_profile(p: B.Profile, args: argparse.Namespace, tmp: str, write: bool = True) -> dict[str, Any]:
    path = os.path.join(tmp, p.name)
    n = max(BATCH * 4, int(args.mb * 1e6 / p.record_bytes))
    if write:
        B.write_profile_dataset(path, p, n, compression="none")
    loader = B.pyloader_loader(path, BATCH)
    for _ in range(2):  # the first epoch verifies every record and makes the batch slots
        B.epoch_samples(loader)
    maps = [np.memmap(f, np.uint8, mode="r") for f in sorted(glob.glob(os.path.join(path, "*.pyl")))]
    for m in maps:
        int(m[::4096].sum())  # every page mapped once, as the loader's mappings are
    rings = [[np.ones(BATCH * p.record_bytes, np.uint8) for _ in range(4)] for _ in range(2)]
    raw: dict[str, list[Any]] = {"memcpy2t": [], "mmap_copy": [], "loader": []}
    for r in range(args.rounds):
        steps = [("memcpy2t", lambda: B.memcpy_gbps(2)),
                 ("mmap_copy", lambda: statistics.mean(mmap_copy_gbps(maps, rings) for _ in range(args.epochs))),
                 ("loader", lambda: loader_block(loader, args.epochs))]
        for name, fn in steps[r % 3:] + steps[: r % 3]:
            raw[name].append(fn())
    maps.clear()  # unmapped before the next profile
    lg = [x["gbps"] for x in raw["loader"]]
    out: dict[str, Any] = {"profile": p.name, "records": n, "raw": raw}
    for base in ("memcpy2t", "mmap_copy"):
        rs = [a / b for a, b in zip(lg, raw[base])]
        out[f"loader_over_{base}"] = {"median": statistics.median(rs), "min": min(rs), "max": max(rs)}
    return out


def with_baseline(args: argparse.Namespace, tmp: str, name: str) -> dict[str, dict[str, Any]]:
    """Rounds of ``name`` in fresh processes of this checkout and of ``args.baseline``, alternating."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = B.PROFILES[name]
    B.write_profile_dataset(os.path.join(tmp, name), p, max(BATCH * 4, int(args.mb * 1e6 / p.record_bytes)),
                            compression="none")
    per: dict[str, list[dict[str, Any]]] = {"this": [], "base": []}
    for r in range(args.rounds):
        for tag in (("this", "base") if r % 2 == 0 else ("base", "this")):
            root = here if tag == "this" else args.baseline
            out = os.path.join(tmp, f"{name}-{tag}-{r}.json")
            env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
            subprocess.run([sys.executable, os.path.abspath(__file__), "--rounds", "1", "--mb", str(args.mb),
                            "--epochs", str(args.epochs), "--profiles", name, "--data", tmp, "--out", out],
                           env=env, check=True, capture_output=True, timeout=900)
            with open(out) as fh:
                per[tag].append(json.load(fh)["profiles"][0])
    merged = {}
    for tag, rs in per.items():
        raw = {k: [x for r in rs for x in r["raw"][k]] for k in ("memcpy2t", "mmap_copy", "loader")}
        m: dict[str, Any] = {"profile": name, "checkout": here if tag == "this" else args.baseline, "raw": raw}
        lg = [x["gbps"] for x in raw["loader"]]
        for base in ("memcpy2t", "mmap_copy"):
            q = [a / b for a, b in zip(lg, raw[base])]
            m[f"loader_over_{base}"] = {"median": statistics.median(q), "min": min(q), "max": max(q)}
        merged[tag] = m
    return merged


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=240, help="dataset size per profile (MB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=4, help="back-to-back epochs per loader block")
    ap.add_argument("--profiles", default="image12k,tokens8k,blob150k")
    ap.add_argument("--baseline", help="another checkout (its _C built), measured in alternating processes")
    ap.add_argument("--data", help=argparse.SUPPRESS)  # a folder holding the datasets already (baseline runs)
    ap.add_argument("--out", default="bench_results/warm_memcpy.json")
    args = ap.parse_args()
    if args.baseline and not os.path.isdir(os.path.join(args.baseline, "pyloader")):
        ap.error(f"--baseline {args.baseline!r}: not a checkout (no pyloader/ in it); pass the root of one")
    results: dict[str, Any] = {"config": vars(args), "environment": B.environment(), "profiles": []}
    print(f"{'profile':<10}{'loader GB/s':>12}{'memcpy2t':>10}{'mmap copy':>11}{'/memcpy2t (range)':>20}"
          f"{'/mmap copy (range)':>20}{'cpu/wall':>9}{'consumer':>9}{'faults':>8}{'hashed':>8}")
    with tempfile.TemporaryDirectory(prefix="pyloader-warm-") as tmp:
        for name in args.profiles.split(","):
            if args.baseline:
                rows = with_baseline(args, tmp, name)
                results["profiles"] += list(rows.values())
                rows_named = [(f"{name}", rows["this"]), ("  base", rows["base"])]
            else:
                r = measure_profile(B.PROFILES[name], args, args.data or tmp, write=not args.data)
                results["profiles"].append(r)
                rows_named = [(name, r)]
            for label, r in rows_named:
                _print_row(label, r)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"wrote {args.out}")
    return 0


def _print_row(name: str, r: dict[str, Any]) -> None:
    raw, med = r["raw"], statistics.median
    a, b = r["loader_over_memcpy2t"], r["loader_over_mmap_copy"]
    print(f"{name:<10}{med(x['gbps'] for x in raw['loader']):>12.1f}{med(raw['memcpy2t']):>10.1f}"
          f"{med(raw['mmap_copy']):>11.1f}{a['median']:>7.2f} ({a['min']:.2f}-{a['max']:.2f})"
          f"{b['median']:>7.2f} ({b['min']:.2f}-{b['max']:.2f})"
          f"{med(x['cpu_over_wall'] for x in raw['loader']):>9.2f}"
          f"{med(x['consumer_share'] for x in raw['loader']):>9.2f}"
          f"{max(x['minflt'] for x in raw['loader']):>8d}{max(x['verified_bytes'] for x in raw['loader']):>8d}",
          flush=True)

if __name__ == "__main__":
    sys.exit(main())
