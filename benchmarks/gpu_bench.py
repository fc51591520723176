"""GPU-side measurements for benchmarks/gpu_check.sh, printed as one short table.

(a) host-to-device GB/s: torch pinned `copy_(non_blocking=True)`, torch pageable, and
    pyloader batches (pyloader's own pinned ring and copy engine are the DataLoader
    issue's work; until then its batches are pageable and copied by torch);
(b) busy fraction of a synthetic training step (a fixed chain of matmuls of about 5 ms)
    fed by pyloader vs torch's DataLoader (pin_memory=True, best num_workers), on 12 KB
    and 150 KB record datasets: busy = GPU time of the steps / wall time of the loop,
    with GPU time taken from CUDA events around each step.

    python benchmarks/gpu_bench.py [--device cuda] [--json FILE]
`--device cpu` runs the same code paths without a GPU (for checking the script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

import pyloader
from pyloader import _bench as B


def h2d(device: str, nbytes: int = 256 << 20, reps: int = 10) -> dict[str, float]:
    out = {}
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for name, pin in (("torch_pinned", True), ("torch_pageable", False)):
        src = torch.empty(nbytes, dtype=torch.uint8)
        if pin and device.startswith("cuda"):
            src = src.pin_memory()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        _sync(device)
        out[name] = reps * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_step(device: str, target_ms: float = 5.0):
    """A fixed chain of matmuls calibrated to take about target_ms on this device."""
    n = 2048 if device.startswith("cuda") else 256
    w = torch.randn(n, n, device=device, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32)

    def chain(k: int) -> torch.Tensor:
        x = w
        for _ in range(k):
            x = x @ w
        return x

    chain(2)
    _sync(device)
    k = 1
    while True:
        t0 = time.perf_counter()
        chain(k)
        _sync(device)
        if (time.perf_counter() - t0) * 1e3 >= target_ms or k > 1 << 16:
            break
        k *= 2
    return lambda batch: chain(k) + batch.float().mean()


def busy_fraction(loader, device: str, step, steps: int) -> float:
    is_cuda = device.startswith("cuda")
    events = []
    it = iter(loader)
    first = next(it)
    x = first[next(iter(first))] if isinstance(first, dict) else first[0]
    step(x.to(device, non_blocking=True))
    _sync(device)
    t0 = time.perf_counter()
    busy_cpu = 0.0
    n = 0
    while n < steps:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        x = batch[next(iter(batch))] if isinstance(batch, dict) else batch[0]
        x = x.to(device, non_blocking=True)
        if is_cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step(x)
            e.record()
            events.append((s, e))
        else:
            c0 = time.perf_counter()
            step(x)
            busy_cpu += time.perf_counter() - c0
        n += 1
    _sync(device)
    wall = time.perf_counter() - t0
    busy = sum(s.elapsed_time(e) for s, e in events) / 1e3 if is_cuda else busy_cpu
    return busy / wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu to check the script", file=sys.stderr)
        return 2
    res: dict = {"environment": B.environment(), "device": args.device}
    if args.device.startswith("cuda"):
        res["gpu"] = torch.cuda.get_device_name()
    res["h2d_gbps"] = h2d(args.device)
    step = make_step(args.device)
    res["busy"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pname, n in (("image12k", 20000), ("blob150k", 2000)):
            p = B.PROFILES[pname]
            path = os.path.join(tmp, pname)
            recs = B.write_profile_dataset(path, p, n)
            npy = path + ".npy"
            import numpy as np

            np.save(npy, recs)
            ds = pyloader.ShardDataset(path, shuffle=True)
            threads = min(8, os.cpu_count() or 1)
            py = busy_fraction(pyloader.DataLoader(ds, batch_size=256, num_workers=threads), args.device, step,
                               args.steps)
            best_t, best_w = 0.0, 0
            for w in (2, 4, 8):
                dl = torch.utils.data.DataLoader(B.MemmapDataset(npy, recs.shape, str(recs.dtype)), batch_size=256,
                                                 shuffle=True, num_workers=w, pin_memory=args.device != "cpu",
                                                 persistent_workers=True)
                b = busy_fraction(dl, args.device, step, args.steps)
                if b > best_t:
                    best_t, best_w = b, w
            res["busy"][pname] = {"pyloader": py, "torch": best_t, "torch_workers": best_w}
    print(f"\n{'H2D (256 MB)':<34}{'GB/s':>10}")
    for k, v in res["h2d_gbps"].items():
        print(f"  {k:<32}{v:>10.2f}")
    print(f"\n{'busy fraction, ~5 ms step':<34}{'pyloader':>10}{'torch DL':>10}")
    for k, v in res["busy"].items():
        print(f"  {k:<32}{100 * v['pyloader']:>9.1f}%{100 * v['torch']:>9.1f}%  (torch workers={v['torch_workers']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
