"""num_workers="auto" with a transform against the best hand-picked count (NOTE [transform autotune]).

Two transforms at the ends of the range: ``wait`` sleeps 1 ms per sample (a network or disk
wait: many workers help) and ``compute`` runs ~0.15 ms of pure Python per sample (CPU-bound
and holding the GIL: the cores are the most that helps). For each, the loader with
``num_workers="auto"`` and with each fixed count (the default executor, ``"auto"``: NOTE
[executor choice]; ``persistent_workers=True``) is built once per round and read for
--epochs epochs; the figure is samples/s of the last epoch ("after two epochs" with the
default 3). Rounds are interleaved (every variant once per round, the order rotated);
figures are medians over rounds, and auto's ratio to the best fixed count is paired per
round. Writes JSON with the config, environment and every raw figure.

    python benchmarks/bench_transform_autotune.py [--rounds 2] [--epochs 3] [--out bench_results/transform_autotune.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import pyloader
from pyloader.bench import measure as B

BATCH = 64


def wait(sample: dict[str, Any]) -> dict[str, Any]:
    """A 1 ms wait per sample, as a fetch from a slow store would take."""
    time.sleep(0.001)
    return {"x": sample["x"], "label": sample["label"]}


def compute(sample: dict[str, Any]) -> dict[str, Any]:
    """About 0.15 ms of pure Python per sample (holds the GIL)."""
    t = 0
    for i in range(3000):
        t += i * i
    return {"x": sample["x"] + (t & 1), "label": sample["label"]}


def run(make: Callable[[], Any], epochs: int, n: int, out: dict[str, Any]) -> Callable[[], float]:
    """A variant for ``B.interleaved``: builds the loader, reads ``epochs`` epochs, returns the last one's samples/s."""
    def go() -> float:
        loader = make()
        rate = 0.0
        for _ in range(epochs):
            t0 = time.perf_counter()
            count = sum(int(b["label"].shape[0]) for b in loader)
            rate = count / (time.perf_counter() - t0)
            if count != n:
                raise AssertionError(f"an epoch yielded {count} samples, expected {n}")
        st = loader.stats()
        out.setdefault("chosen", []).append({"executor": st.get("transform_executor"),
                                             "workers": st.get("transform_workers"),
                                             "choice": (st.get("executor_choice") or {}).get("why")})
        del loader
        return rate
    return go


def bench(name: str, fn: Callable[..., Any], path: str, n: int, counts: list[int], args: argparse.Namespace
          ) -> dict[str, Any]:
    def make(workers: int | str) -> Callable[[], Any]:
        return lambda: pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=0), batch_size=BATCH,
                                           num_workers=workers, transform=fn, persistent_workers=True)
    info: dict[str, dict[str, Any]] = {}
    variants = {"auto": run(make("auto"), args.epochs, n, info.setdefault("auto", {}))}
    for c in counts:
        variants[f"fixed-{c}"] = run(make(c), args.epochs, n, info.setdefault(f"fixed-{c}", {}))
    print(f"== {name}: {list(variants)} x {args.rounds} rounds", file=sys.stderr, flush=True)
    rates = B.interleaved(variants, args.rounds)
    med = {k: statistics.median(v) for k, v in rates.items()}
    best = max((k for k in med if k != "auto"), key=lambda k: med[k])
    ratio = [a / b for a, b in zip(rates["auto"], rates[best])]
    return {"samples_per_s": med, "rounds": rates, "best_fixed": best, "auto_over_best": statistics.median(ratio),
            "auto_over_best_range": [min(ratio), max(ratio)], "chosen": info}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--records", type=int, default=6400)
    ap.add_argument("--out", default="bench_results/transform_autotune.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ds")
        with pyloader.ShardWriter(path, {"x": ("float32", (16,)), "label": "int64"}) as w:
            for i in range(args.records):
                w.write({"x": np.full(16, i, np.float32), "label": i})
        res = {"wait": bench("wait (1 ms sleep)", wait, path, args.records, [4, 16, 32, 64], args),
               "compute": bench("compute (pure Python)", compute, path, args.records, [1, 2, 3, 4], args)}
    cfg = {"rounds": args.rounds, "epochs": args.epochs, "records": args.records, "batch": BATCH}
    env = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
           "affinity": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg()}
    print(f"\nnum_workers='auto' vs fixed counts ({env['affinity']} cpus, {args.records} records, batch {BATCH}, "
          f"samples/s of epoch {args.epochs}, median of {args.rounds} interleaved rounds)")
    for name, r in res.items():
        row = "  ".join(f"{k}={v:.0f}" for k, v in r["samples_per_s"].items())
        auto = r["chosen"]["auto"]["chosen"][-1]
        print(f"  {name:<8} {row}")
        print(f"           auto / best fixed ({r['best_fixed']}): {r['auto_over_best']:.2f}x "
              f"[{r['auto_over_best_range'][0]:.2f}, {r['auto_over_best_range'][1]:.2f}]; auto ended on "
              f"{auto['workers']} {auto['executor']} workers")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": cfg, "environment": env, "results": res, "wall_s": time.perf_counter() - t0}, f,
                  indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
