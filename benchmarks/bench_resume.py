"""The cost of exact resumption, measured side by side in one run:

1. ``state_dict()`` per call, mid-epoch, against the loader's time per batch;
2. resuming at the middle of an epoch (``load_state_dict`` + ``iter()`` + the rest of the
   epoch, and the time to the first batch), against restarting the epoch from its start
   (the whole epoch) and against fast-forwarding (read and discard the consumed half, as a
   loader without a position would);
3. the planning part alone at scale (no data read): ``resume_plan`` with 1 and 3 segments
   against ``plan``, for ``--plan-records`` samples.

Rank 0 of a simulated world of ``--world`` ranks reads; the dataset is local (page cache
warm), shuffled globally. Writes bench_results/resume.json.
Usage: python benchmarks/bench_resume.py [--quick]
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
from collections.abc import Callable
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pyloader
from pyloader.read import order as _plan


def write_dataset(d: str, records: int, record_bytes: int) -> None:
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 255, (256, record_bytes), dtype=np.uint8)
    with pyloader.ShardWriter(d, {"x": ("uint8", (record_bytes,)), "label": ("int64", ())},
                              compression="none", shard_bytes=4 << 20) as w:
        for i in range(records):
            w.write({"x": payload[i % 256], "label": i})


def best(fn: Callable[[], float], repeat: int) -> float:
    return min(fn() for _ in range(repeat))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller dataset (CI smoke run)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--plan-records", type=int, default=None, help="samples for the planning-only part")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "resume.json"))
    args = ap.parse_args()
    records = 8_000 if args.quick else 40_000
    plan_records = args.plan_records or (2_000_000 if args.quick else 10_000_000)
    cfg = {"records": records, "record_bytes": 8192, "world": args.world, "batch": args.batch,
           "threads": args.threads, "repeat": args.repeat, "plan_records": plan_records, "shuffle": "global"}
    tmp = tempfile.mkdtemp(prefix="pyloader-bench-resume-")
    try:
        path = os.path.join(tmp, "ds")
        write_dataset(path, records, cfg["record_bytes"])

        def loader() -> pyloader.DataLoader:
            ds = pyloader.ShardDataset(path, shuffle=True, seed=1, rank=0, world_size=args.world)
            return pyloader.DataLoader(ds, batch_size=args.batch, num_workers=args.threads)

        warm = loader()
        for _ in warm:  # page cache and verification warm, as in a long run
            pass
        batches = len(warm)  # per rank: len(dataset) counts this rank's samples
        half = batches // 2

        # -- 1. state_dict() per call, mid-epoch ------------------------------------------
        lo = loader()
        it = iter(lo)
        for _ in range(half):
            next(it)
        calls = 20_000
        t0 = time.perf_counter()
        for _ in range(calls):
            state = lo.state_dict()
        state_us = (time.perf_counter() - t0) / calls * 1e6
        state_bytes = len(json.dumps(state))
        del it

        # -- 2. resume at the middle vs restart vs fast-forward ---------------------------
        def full_epoch() -> float:  # restart the epoch from its beginning
            lo = loader()
            t0 = time.perf_counter()
            n = sum(1 for _ in lo)
            assert n == batches
            return time.perf_counter() - t0

        def fast_forward() -> float:  # read and discard the consumed half, then the rest
            lo = loader()
            t0 = time.perf_counter()
            it = iter(lo)
            for _ in range(half):
                next(it)
            n = sum(1 for _ in it)
            assert n == batches - half
            return time.perf_counter() - t0

        def resume() -> float:
            lo = loader()
            t0 = time.perf_counter()
            lo.load_state_dict(state)
            n = sum(1 for _ in lo)
            assert n == batches - half
            return time.perf_counter() - t0

        def first_batch(resumed: bool) -> float:
            lo = loader()
            t0 = time.perf_counter()
            if resumed:
                lo.load_state_dict(state)
            next(iter(lo))
            return time.perf_counter() - t0

        # Interleaved, so that drift (thermal, page cache) hits all alike.
        runs: dict[str, list[float]] = {"restart": [], "fast_forward": [], "resume": [], "first_fresh": [],
                                        "first_resumed": []}
        for _ in range(args.repeat):
            runs["restart"].append(full_epoch())
            runs["fast_forward"].append(fast_forward())
            runs["resume"].append(resume())
            runs["first_fresh"].append(first_batch(False))
            runs["first_resumed"].append(first_batch(True))
        t = {k: min(v) for k, v in runs.items()}
        per_batch_us = t["restart"] / batches * 1e6

        # -- 3. planning alone at scale ---------------------------------------------------
        counts = [4096] * (plan_records // 4096)
        kw: dict[str, Any] = {"shuffle": True, "seed": 1, "epoch": 0, "rank": 0, "world_size": 8}
        segs1 = [[8, 256, (plan_records // 8 // 256) // 2]]
        segs3: list[list[int]] = []
        for w, b in ((8, 256), (6, 300), (16, 100)):  # each resize reads a fifth of what is left
            left = _plan.unread_count(len(counts) * 4096, segments=segs3)
            segs3.append([w, b, -(-left // w) // b // 5])

        def timed(fn: Callable[[], Any]) -> Callable[[], float]:
            def run() -> float:
                t0 = time.perf_counter()
                fn()
                return time.perf_counter() - t0
            return run

        p_plan = best(timed(lambda: _plan.plan(counts, **kw)), args.repeat)
        p_res1 = best(timed(lambda: _plan.resume_plan(counts, segments=segs1, **kw)), args.repeat)
        p_res3 = best(timed(lambda: _plan.resume_plan(counts, segments=segs3, **kw)), args.repeat)

        result = {
            "config": cfg,
            "environment": {"python": platform.python_version(), "machine": platform.machine(),
                            "cpus": os.cpu_count(), "pyloader": pyloader.__version__, "numpy": np.__version__},
            "batches_per_rank": batches,
            "state": state,
            "state_json_bytes": state_bytes,
            "state_dict_us_per_call": state_us,
            "loader_us_per_batch": per_batch_us,
            "state_dict_over_batch": state_us / per_batch_us,
            "seconds": t,
            "seconds_all_runs": runs,
            "resume_over_restart": t["resume"] / t["restart"],
            "resume_over_fast_forward": t["resume"] / t["fast_forward"],
            "first_batch_resumed_over_fresh": t["first_resumed"] / t["first_fresh"],
            "plan_seconds": {"plan": p_plan, "resume_plan_1_segment": p_res1, "resume_plan_3_segments": p_res3},
            "resume_plan_over_plan": {"1_segment": p_res1 / p_plan, "3_segments": p_res3 / p_plan},
        }
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        mb = records * cfg["record_bytes"] / 1e6
        print(f"dataset {records} x {cfg['record_bytes']} B ({mb:.0f} MB), rank 0 of {args.world}, batch "
              f"{args.batch}, {args.threads} threads: {batches} batches per rank per epoch; best of {args.repeat}")
        print(f"state_dict(): {state_us:.2f} us per call, {state_bytes} bytes of JSON; "
              f"{state_us / per_batch_us:.5f} x the time of one batch ({per_batch_us:.0f} us)")
        print(f"rest of the epoch from the middle:   resume {t['resume']:.3f} s | restart epoch "
              f"{t['restart']:.3f} s | fast-forward {t['fast_forward']:.3f} s")
        print(f"  resume / restart {t['resume'] / t['restart']:.2f}x, resume / fast-forward "
              f"{t['resume'] / t['fast_forward']:.2f}x")
        print(f"time to first batch: resumed {t['first_resumed'] * 1e3:.1f} ms, fresh epoch "
              f"{t['first_fresh'] * 1e3:.1f} ms ({t['first_resumed'] / t['first_fresh']:.2f}x)")
        print(f"planning only, {plan_records:,} samples, world 8: plan {p_plan * 1e3:.0f} ms, resume_plan "
              f"1 segment {p_res1 * 1e3:.0f} ms ({p_res1 / p_plan:.2f}x), 3 segments {p_res3 * 1e3:.0f} ms "
              f"({p_res3 / p_plan:.2f}x)")
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
