"""A local global shuffle over more shards than the kernel's mapping limit, and the usual case.

(a) writes ``--shards`` tiny shards (default 200,000: 3x vm.max_map_count) with
    ``pyloader.ShardWriter`` and a tiny ``shard_bytes`` (``--per-shard`` records each), timed;
    its fsync of every shard (NOTE [atomic publish]) is skipped unless ``--fsync``: at
    ~3 ms a shard on a shared disk it would take ten minutes;
(b) reads one globally shuffled epoch of them with ``pyloader.DataLoader`` in a fresh
    process: rate, every id read exactly once, the most mappings of the dataset's files
    ``/proc/self/maps`` ever listed (sampled every 2 ms and after every batch) against
    the set's bound (NOTE [mapping bound] in csrc/core/shard_reader.h), and how many shards
    were mapped again; with ``--unbounded`` also the same epoch with no bound (it fails at
    mmap, as every build before the bound did);
(c) with ``--baseline ROOT`` (a checkout with its own built ``pyloader/_C*.so``): the usual
    case -- a few shards, all mapped -- with this tree's build and ROOT's, interleaved in
    fresh processes, 12 KB records, global shuffle: the ratio of their rates.

    python benchmarks/bench_many_shards.py [--shards 200000] [--baseline /path/to/old/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_tiny(path: str, n: int, per_shard: int, fsync: bool) -> float:
    """``n`` shards of ``per_shard`` records; without ``fsync`` each is renamed into place unsynced (a benchmark's scratch data)."""
    import numpy as np

    import pyloader
    from pyloader.format.encode import LocalStore

    class UnsyncedStore(LocalStore):
        def put(self, name: str, chunks: Any) -> None:
            dst = os.path.join(self.root, name)
            with open(dst + ".part", "wb") as fh:
                for c in chunks:
                    fh.write(c)
            os.replace(dst + ".part", dst)

    t0 = time.perf_counter()
    # An id is 8 bytes of payload (a column): a shard is published once it holds per_shard of them.
    with pyloader.ShardWriter(path, {"id": ("int64", ())}, compression=None, shard_bytes=8 * per_shard) as w:
        if not fsync:
            w._encoder.store = UnsyncedStore(w._encoder.root)
        for i in range(n * per_shard):
            w.write({"id": np.int64(i)})
    return time.perf_counter() - t0


def child_epoch(path: str, bound: int | None, batch: int, workers: int) -> dict:
    """One shuffled epoch; runs in a fresh process (the mapping count is the process's)."""
    import threading

    import numpy as np

    import pyloader

    def maps() -> int:
        with open("/proc/self/maps") as fh:
            return sum(1 for line in fh if path in line)

    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            peak[0] = max(peak[0], maps())

    t0 = time.perf_counter()
    ds = pyloader.ShardDataset(path, shuffle=True, seed=1)
    if bound is not None:
        ds.max_mapped_shards = bound
    t_open = time.perf_counter() - t0
    seen = np.zeros(ds.num_records, np.int64)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    loader = pyloader.DataLoader(ds, batch_size=batch, num_workers=workers)
    t1 = time.perf_counter()
    out: dict = {"shards": len(ds.shard_paths), "bound": ds.max_mapped_shards, "open_s": t_open}
    try:
        for b in loader:
            np.add.at(seen, b["id"].numpy(), 1)
            peak[0] = max(peak[0], maps())
    except Exception as e:  # the unbounded run: reported, not raised
        out["error"] = f"{type(e).__name__}: {e}"[:400]
    wall = time.perf_counter() - t1
    stop.set()
    sampler.join()
    stats = loader.stats()
    out.update(epoch_s=wall, samples_per_s=int(seen.sum()) / wall, every_sample_once=bool((seen == 1).all()),
               peak_maps=peak[0], peak_mapped_shards=stats.get("peak_mapped_shards"),
               remapped_shards=stats.get("remapped_shards"), max_map_count=int(open("/proc/sys/vm/max_map_count").read()))
    return out


def child_usual(path: str, batch: int, workers: int, epochs: int) -> dict:
    import pyloader

    ds = pyloader.ShardDataset(path, shuffle=True, seed=1)
    loader = pyloader.DataLoader(ds, batch_size=batch, num_workers=workers)
    for _ in loader:  # first epoch: maps and verifies
        pass
    best = 0.0
    for _ in range(epochs):
        t0, n = time.perf_counter(), 0
        for b in loader:
            n += len(b["image"])
        best = max(best, n / (time.perf_counter() - t0))
    return {"samples_per_s": best, "shards": len(ds.shard_paths)}


def run_child(root: str, args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *args], env=env, check=True,
                         capture_output=True, text=True, cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=200_000)
    ap.add_argument("--per-shard", type=int, default=2, help="records per shard (2: a shard stays planned "
                    "until its second record, so without a bound most shards are mapped at once)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--fsync", action="store_true", help="write the shards as ShardWriter does, each fsynced")
    ap.add_argument("--unbounded", action="store_true", help="also the epoch with no bound (fails at mmap)")
    ap.add_argument("--baseline", help="a checkout with a built _C to compare the usual case against")
    ap.add_argument("--usual-mb", type=float, default=120)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="where to write (default: a temporary folder, removed after)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "many_shards.json"))
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind == "epoch":
            bound = None if rest[1] == "default" else int(rest[1])
            res = child_epoch(rest[0], bound, a.batch, a.workers)
        else:
            res = child_usual(rest[0], a.batch, a.workers, int(rest[1]))
        print(json.dumps(res))
        return
    tmp = a.dir or tempfile.mkdtemp(prefix="pyloader-bench-many-")
    result: dict = {"config": vars(a), "cpus": os.cpu_count()}
    try:
        path = os.path.join(tmp, "tiny")
        if not os.path.exists(os.path.join(path, "manifest.json")):
            result["write_s"] = write_tiny(path, a.shards, a.per_shard, a.fsync)
            print(f"(a) wrote {a.shards} shards in {result['write_s']:.1f} s "
                  f"({result['write_s'] / a.shards * 1e6:.0f} us a shard)", flush=True)
        r = run_child(ROOT, ["epoch", path, "default"])
        result["bounded"] = r
        print(f"(b) {r['shards']} shards, bound {r['bound']}: epoch {r['epoch_s']:.1f} s, "
              f"{r['samples_per_s']:.0f} samples/s, every sample once: {r['every_sample_once']}, "
              f"peak maps of the dataset {r['peak_maps']} (peak_mapped_shards {r['peak_mapped_shards']}, "
              f"vm.max_map_count {r['max_map_count']}), remapped {r['remapped_shards']}, "
              f"error: {r.get('error')}", flush=True)
        if a.unbounded:
            u = run_child(ROOT, ["epoch", path, "0"])
            result["unbounded"] = u
            print(f"    no bound: peak maps {u['peak_maps']}, error: {u.get('error')}", flush=True)
        if a.baseline:
            sys.path.insert(0, ROOT)
            from pyloader.bench import measure as B

            p = B.PROFILES["image12k"]
            usual = os.path.join(tmp, "usual")
            B.write_profile_dataset(usual, p, int(a.usual_mb * 1e6 / p.record_bytes), compression="none")
            rates: dict[str, list[float]] = {"this": [], "baseline": []}
            for _ in range(a.rounds):
                for name, root in (("this", ROOT), ("baseline", a.baseline)):
                    rates[name].append(run_child(root, ["usual", usual, "3"])["samples_per_s"])
            med = {k: statistics.median(v) for k, v in rates.items()}
            result["usual"] = {"rates": rates, "median": med, "ratio": med["this"] / med["baseline"]}
            print(f"(c) usual case, 12 KB records, global shuffle, {a.rounds} interleaved rounds: this "
                  f"{med['this']:.0f} samples/s, baseline {med['baseline']:.0f}: ratio "
                  f"{med['this'] / med['baseline']:.3f} (each round: {rates})", flush=True)
    finally:
        if not a.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
