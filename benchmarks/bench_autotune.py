"""num_workers="auto" from a deliberately wrong start against the best hand-tuned setting.

On the same data, side by side in one run:

1. fast storage: a local dataset of 12 KB records (page cache hot);
2. throttled remote: the same dataset served over HTTP on 127.0.0.1 by
   benchmarks/throttled_http.py (a shared link of ``--remote-mbps`` MB/s, ``--latency`` s
   per request), read through a node cache emptied before each run; only the first epoch
   is timed, so every byte crosses the link;
3. connection-limited remote: the same records in smaller shards, served with
   ``--conn-mbps`` MB/s per connection (as object stores limit each request) and
   ``--conn-latency`` s per request, no shared link: only concurrent downloads go faster.

For each: every hand setting (threads 1..CPUs x read-ahead 1, 2, 4, 8; for case 3, every
CPU and a read-ahead of 8 x fetch jobs 1, 2, 4, 8, 16) is timed over ``--seconds`` of whole
epochs (remote: the first epoch) and the best kept; then ``num_workers="auto"`` starting
at 1 thread, a read-ahead of 1 and (remote) 1 download is run while the rate of every 0.1 s window is recorded:
the time until the rate (over a sliding 0.5 s) stays within 10% of the best hand-tuned
rate, the final values and the batch memory they imply, and the slot memory actually
allocated (every slot the loader made) against ``memory_budget``. Writes JSON and prints
a table.

    python benchmarks/bench_autotune.py [--mb 240] [--seconds 2] [--budget-mb 64]
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pyloader  # noqa: E402
from pyloader.bench import measure as B  # noqa: E402
from pyloader.loader import autotune  # noqa: E402


def _make_ds(url: str, cache: str | None, fetch_jobs: int = 4) -> pyloader.ShardDataset:
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)
    return pyloader.ShardDataset(url, shuffle=True, cache_dir=cache, fetch_jobs=fetch_jobs) if cache else \
        pyloader.ShardDataset(url, shuffle=True)


def hand(url: str, cache: str | None, threads: int, prefetch: int, batch: int, seconds: float,
         fetch_jobs: int = 4) -> float:
    loader = pyloader.DataLoader(_make_ds(url, cache, fetch_jobs), batch_size=batch, num_workers=threads,
                                 prefetch=prefetch)
    if cache is None:
        for _ in loader:  # local: the first epoch (maps the shards) apart
            pass
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for b in loader:
            n += int(b["label"].shape[0])
        if cache is not None:
            break  # remote: only the first epoch, which downloads through the throttled link
    return n / (time.perf_counter() - t0)


def auto(url: str, cache: str | None, batch: int, seconds: float, budget: int) -> dict[str, Any]:
    loader = pyloader.DataLoader(_make_ds(url, cache, fetch_jobs=1), batch_size=batch, num_workers="auto",
                                 memory_budget=budget)
    tuner = loader._auto()
    tuner.threads, tuner.prefetch = 1, 1  # the deliberately wrong start
    if cache is None:
        for _ in loader:
            pass
    marks: list[tuple[float, int]] = []
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for b in loader:
            n += int(b["label"].shape[0])
            marks.append((time.perf_counter() - t0, n))
        if cache is not None:
            break
    report = loader.stats()["autotune"]
    return {"marks": marks, "report": report, "slots_made": loader._batch_pool.created,
            "rate": n / (time.perf_counter() - t0)}


def converged_at(marks: list[tuple[float, int]], target: float, window: float = 0.5) -> float | None:
    """The first time after which every ``window``-second rate stays >= 0.9 * target."""
    j = 0
    rates = []
    for t, n in marks:
        while marks[j][0] < t - window:
            j += 1
        if t - marks[j][0] >= window * 0.9:
            rates.append((marks[j][0], (n - marks[j][1]) / (t - marks[j][0])))
    for k, (start, _) in enumerate(rates):
        if all(r >= 0.9 * target for _, r in rates[k:]):
            return start
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=240)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--budget-mb", type=float, default=64)
    ap.add_argument("--remote-mbps", type=float, default=80)
    ap.add_argument("--latency", type=float, default=0.005)
    ap.add_argument("--conn-mbps", type=float, default=10)
    ap.add_argument("--conn-latency", type=float, default=0.02)
    ap.add_argument("--conn-mb", type=float, default=48, help="MB of records for the connection-limited case")
    ap.add_argument("--out", default="bench_results/autotune.json")
    args = ap.parse_args()
    from throttled_http import ThrottledServer

    cpus = autotune.cpu_budget()
    budget = int(args.budget_mb * 2**20)
    results: dict[str, Any] = {"config": vars(args), "environment": B.environment(), "cpus": cpus, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="pyloader-autotune-") as tmp:
        p = B.PROFILES["image12k"]
        data = os.path.join(tmp, "srv", "ds")
        B.write_profile_dataset(data, p, int(args.mb * 1e6 / p.record_bytes), compression="none")
        B.write_profile_dataset(os.path.join(tmp, "srv2", "ds"), p, int(args.conn_mb * 1e6 / p.record_bytes),
                                compression="none", shard_bytes=2 << 20)
        with ThrottledServer(os.path.join(tmp, "srv"), bandwidth=args.remote_mbps * 1e6, latency=args.latency,
                             link=True) as srv, \
                ThrottledServer(os.path.join(tmp, "srv2"), bandwidth=args.conn_mbps * 1e6,
                                latency=args.conn_latency) as srv2:
            cases = {"fast storage": (data, None),
                     "throttled remote": (srv.url + "/ds", os.path.join(tmp, "cache")),
                     "per-conn remote": (srv2.url + "/ds", os.path.join(tmp, "cache"))}
            for name, (url, cache) in cases.items():
                grid = {}
                settings = [(t, pf, 4) for t in range(1, cpus + 1) for pf in (1, 2, 4, 8)]
                if name == "per-conn remote":
                    settings = [(cpus, 8, j) for j in (1, 2, 4, 8, 16)]
                for t, pf, j in settings:
                    key = f"{t}x{pf}" + (f"x{j}j" if name == "per-conn remote" else "")
                    grid[key] = hand(url, cache, t, pf, args.batch, args.seconds, fetch_jobs=j)
                    print(f"[{name}] threads {t} read-ahead {pf} fetch jobs {j}: {grid[key]:,.0f}/s",
                          file=sys.stderr, flush=True)
                best_key = max(grid, key=grid.__getitem__)
                a = auto(url, cache, args.batch, 2 * args.seconds, budget)
                conv = converged_at(a["marks"], grid[best_key])
                slot = a["report"]["slot_bytes"]
                results["cases"][name] = {
                    "hand": grid, "best_hand": best_key, "best_hand_rate": grid[best_key], "auto_rate": a["rate"],
                    "auto_vs_best": a["rate"] / grid[best_key], "converged_s": conv,
                    "auto_final": {k: a["report"][k] for k in ("threads", "prefetch", "fetch_jobs", "memory_bytes")},
                    "slots_made": a["slots_made"], "slot_bytes": slot,
                    "slot_memory_vs_budget": a["slots_made"] * slot / budget,
                    "hand_spread": max(grid.values()) / min(grid.values()),
                    "decisions": a["report"]["decisions"]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"{args.mb:.0f} MB of 12 KB records, batch {args.batch}, {cpus} CPUs, budget {args.budget_mb:.0f} MiB; "
          f"auto starts at 1 thread, read-ahead 1, 1 download")
    print(f"{'case':<18}{'best hand':>12}{'hand best/worst':>17}{'auto/best':>11}{'within 10% after':>18}"
          f"{'auto chose':>12}{'slot memory / budget':>22}")
    for name, c in results["cases"].items():
        conv = "never" if c["converged_s"] is None else f"{c['converged_s']:.2f} s"
        chose = f"{c['auto_final']['threads']}x{c['auto_final']['prefetch']}"
        if c["auto_final"]["fetch_jobs"]:
            chose += f"x{c['auto_final']['fetch_jobs']}j"
        print(f"{name:<18}{c['best_hand']:>12}{c['hand_spread']:>16.2f}x{c['auto_vs_best']:>10.2f}x{conv:>18}"
              f"{chose:>12}{c['slot_memory_vs_budget']:>22.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
