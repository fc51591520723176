"""DataLoader layer benchmark (CPU): what pyloader.DataLoader adds on top of its engines.

Every figure is a ratio of two things measured side by side in one run: the rounds are
interleaved (each round runs every variant once, in a rotating order) and each variant's
figure is the median over rounds, so load from other processes hits both sides alike.

  (a) pyloader.DataLoader over a ShardDataset vs the bare native iterator
      ``ds.batches(bs, num_threads=T, pool=...)`` on the same data (12 KB and 150 KB raw
      records, T = num_workers = 2): the loader's overhead in %; and with device="cpu"
      (the copy engine's CPU twin: one extra copy per batch, on the engine thread) vs the
      bare iterator plus ``.clone()`` of every tensor on the consuming thread, and plus
      one numpy memcpy into preallocated buffers (the cost of the copy alone).
  (b) pyloader.DataLoader vs torch.utils.data.DataLoader over ordinary map-style
      Datasets (a dict of tensors from a preloaded numpy array; the same plus per-sample
      CPU work), num_workers 0 and 2, batch 64: samples/s ratio (the generic path
      delegates to torch, so ~1.0 is the target); and with pin_memory=True on both,
      recording what each did (without a CUDA driver pyloader's copy engine stages into
      pageable memory, torch skips pinning).
  (c) the copy engine's staging throughput (device=None + pin_memory: one copy into a
      staging slot; device="cpu": staging plus the copy to the destination) vs numpy
      memcpy of the same bytes into a preallocated buffer (the 1-thread physical limit)
      and torch ``clone()``.

Prints a table and writes JSON (config, environment, every raw time) for plotting.

    python benchmarks/bench_loader.py [--quick] [--rounds N] [--out bench_results/loader.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data

import pyloader
from pyloader import _C
from pyloader.bench import measure as B
from pyloader.loader import transfer as _transfer


# -- helpers -----------------------------------------------------------------------------
def drain(it: Iterator[Any], consume: Callable[[Any], Any] | None = None) -> tuple[int, int]:
    """Iterates to the end; returns (samples, bytes of every tensor yielded)."""
    n = nbytes = 0
    for batch in it:
        if consume is not None:
            batch = consume(batch)
        tensors = list(batch.values()) if isinstance(batch, dict) else list(batch)
        n += int(tensors[-1].shape[0])
        for t in tensors:
            nbytes += t.nelement() * t.element_size()
    return n, nbytes


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a[i] / b[i] (both measured in the same round)."""
    return statistics.median([x / y for x, y in zip(a, b)])


def ratio_range(a: list[float], b: list[float]) -> list[float]:
    """[min, max] over rounds of a[i] / b[i]: how much the pairing varied (noise)."""
    r = [x / y for x, y in zip(a, b)]
    return [min(r), max(r)]


def clone_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in batch.items()}


def time_epochs(make_iter: Callable[[], Iterator[Any]], epochs: int,
                consume: Callable[[Any], Any] | None = None) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    n = nb = 0
    for _ in range(epochs):
        s, b = drain(make_iter(), consume)
        n += s
        nb += b
    return time.perf_counter() - t0, n, nb


# -- (a) DataLoader vs the bare native iterator ------------------------------------------
def bench_native(p: B.Profile, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    n = max(4 * args.native_batch[p.name], int(args.mb * 1e6 / p.record_bytes))
    path = os.path.join(tmp, p.name)
    B.write_profile_dataset(path, p, n, compression="none")
    ds = pyloader.ShardDataset(path)
    bs, t = args.native_batch[p.name], args.workers
    pool = _C.SlotPool(num_fields=len(ds.fields))  # as the loader: one pool kept across epochs
    loader = pyloader.DataLoader(ds, batch_size=bs, num_workers=t)
    loader_cpu = pyloader.DataLoader(ds, batch_size=bs, num_workers=t, device="cpu")

    def bare() -> Iterator[Any]:
        return ds.batches(bs, num_threads=t, pool=pool)

    # The extra copy as one plain memcpy (numpy: single-threaded, no allocation) into
    # destinations allocated once. torch's .clone() allocates per batch and runs on its
    # intra-op (OpenMP) threads, which on a small machine compete with the native threads:
    # its cost swings widely from round to round (see the raw times in the JSON).
    first = next(iter(bare()))
    prealloc = {k: np.empty_like(v.numpy()) for k, v in first.items()}
    del first

    def copy_prealloc(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in batch.items():
            d = prealloc[k][: v.shape[0]]
            np.copyto(d, v.numpy())
            out[k] = torch.from_numpy(d)
        return out

    iters: dict[str, tuple[Callable[[], Iterator[Any]], Callable[[Any], Any] | None]] = {
        "bare": (bare, None),
        "loader": (lambda: iter(loader), None),
        "bare_clone": (bare, clone_batch),
        "bare_copy_prealloc": (bare, copy_prealloc),
        "loader_cpu": (lambda: iter(loader_cpu), None),
    }
    # Warm-up: verifies the checksums once (the ShardSet is shared), faults in the pools.
    for make, consume in iters.values():
        drain(make(), consume)
    it_cpu = iter(loader_cpu)
    drain(it_cpu)
    copy_counters = it_cpu.stats().get("copy")  # while the iterator lives (loader.stats() drops them)
    del it_cpu
    # Epochs per timed sample: enough for ~0.25 s on the bare iterator.
    t1, _, _ = time_epochs(bare, 1)
    epochs = max(1, min(50, int(args.sample_s / max(t1, 1e-6))))
    counts: dict[str, tuple[int, int]] = {}

    def timer(name: str) -> Callable[[], float]:
        make, consume = iters[name]

        def run() -> float:
            dt, s, b = time_epochs(make, epochs, consume)
            counts[name] = (s, b)
            return dt
        return run

    raw = B.interleaved({k: timer(k) for k in iters}, args.rounds_a)
    res = {"profile": p.name, "records": n, "record_bytes": p.record_bytes, "batch_size": bs, "threads": t,
           "epochs_per_sample": epochs, "seconds": raw,
           "samples_per_sample": {k: v[0] for k, v in counts.items()},
           "bytes_per_sample": {k: v[1] for k, v in counts.items()},
           "copy_counters_one_epoch": copy_counters}
    res["overhead_pct"] = 100 * (paired_ratio(raw["loader"], raw["bare"]) - 1)
    res["overhead_pct_range"] = [100 * (x - 1) for x in ratio_range(raw["loader"], raw["bare"])]
    res["overhead_pct_of_medians"] = 100 * (statistics.median(raw["loader"]) / statistics.median(raw["bare"]) - 1)
    res["cpu_overhead_pct"] = 100 * (paired_ratio(raw["loader_cpu"], raw["bare_clone"]) - 1)
    res["cpu_overhead_pct_of_medians"] = 100 * (statistics.median(raw["loader_cpu"]) / statistics.median(raw["bare_clone"]) - 1)
    res["cpu_vs_prealloc_pct"] = 100 * (paired_ratio(raw["loader_cpu"], raw["bare_copy_prealloc"]) - 1)
    res["clone_vs_prealloc_pct"] = 100 * (paired_ratio(raw["bare_clone"], raw["bare_copy_prealloc"]) - 1)
    res["bare_gbps"] = counts["bare"][1] / statistics.median(raw["bare"]) / 1e9
    return res


# -- (b) generic path: map-style datasets -------------------------------------------------
class ArrayDataset(torch.utils.data.Dataset):
    """A dict of tensors per sample from a preloaded numpy array (zero-copy views)."""

    def __init__(self, images: np.ndarray) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": torch.from_numpy(self.images[i]), "label": torch.tensor(i)}


class AugmentDataset(ArrayDataset):
    """The same plus typical per-sample CPU work: crop, flip, float conversion, normalisation."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        img = self.images[i]
        c, h, w = img.shape
        rng = np.random.default_rng(i)
        y, x = rng.integers(0, 9, 2)
        crop = img[:, y:y + h - 8, x:x + w - 8]
        if i & 1:
            crop = crop[:, :, ::-1]
        f = crop.astype(np.float32) * (1 / 255.0)
        f = (f - f.mean(axis=(1, 2), keepdims=True)) / (f.std(axis=(1, 2), keepdims=True) + 1e-6)
        return {"image": torch.from_numpy(np.ascontiguousarray(f)), "label": torch.tensor(i)}


def bench_generic(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    side = 64
    images = rng.integers(0, 256, (args.generic_samples, 3, side, side), dtype=np.uint8)
    datasets = {"array": ArrayDataset(images), "augment": AugmentDataset(images[: args.generic_samples // 2])}
    bs = 64
    loaders: dict[str, Any] = {}
    for dname, ds in datasets.items():
        for w in (0, 2):
            for pin in (False, True):
                if pin and dname != "array":
                    continue
                tag = f"{dname}_w{w}" + ("_pin" if pin else "")
                loaders[f"{tag}/torch"] = torch.utils.data.DataLoader(ds, batch_size=bs, num_workers=w,
                                                                      pin_memory=pin)
                loaders[f"{tag}/pyloader"] = pyloader.DataLoader(ds, batch_size=bs, num_workers=w, pin_memory=pin)
    what: dict[str, Any] = {}
    counts: dict[str, int] = {}

    def timer(name: str) -> Callable[[], float]:
        ldr = loaders[name]

        def run() -> float:
            t0 = time.perf_counter()
            it = iter(ldr)
            s, _ = drain(it)
            dt = time.perf_counter() - t0
            counts[name] = s
            if name.endswith("_pin/torch") and name not in what:
                what[name] = {"requested": True, "pinned_by_loader": bool(getattr(it, "_pin_memory", False))}
            elif name.endswith("_pin/pyloader") and name not in what:
                st = ldr.stats().get("copy", {})
                what[name] = {"requested": True, "copy_engine": st}
            return dt
        return run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Warm-up (imports, first fork, pyloader's one pageable-memory warning).
        for name in loaders:
            timer(name)()
        what.clear()
        raw = B.interleaved({k: timer(k) for k in loaders}, args.rounds_b)
    warned = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    res: dict[str, Any] = {"batch_size": bs, "image_shape": [3, side, side], "seconds": raw,
                           "samples": counts, "pin_memory_behaviour": what, "warnings": warned, "ratios": {}}
    for tag in sorted({k.split("/")[0] for k in loaders}):
        t_torch, t_py = raw[f"{tag}/torch"], raw[f"{tag}/pyloader"]
        res["ratios"][tag] = {
            "pyloader_over_torch_samples_per_s": paired_ratio(t_torch, t_py),
            "range": ratio_range(t_torch, t_py),
            "torch_samples_per_s": counts[f"{tag}/torch"] / statistics.median(t_torch),
            "pyloader_samples_per_s": counts[f"{tag}/pyloader"] / statistics.median(t_py),
        }
    return res


# -- (c) staging throughput of the copy engine ----------------------------------------------
def bench_staging(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for seg_mb in args.segment_mb:
        nbytes = seg_mb << 20
        # Sources cycled over > L3 (~200 MB in all) so every figure is memory-bound.
        nsrc = max(2, (200 << 20) // nbytes)
        srcs = [torch.full((nbytes,), i % 251, dtype=torch.uint8) for i in range(nsrc)]
        jobs = max(nsrc, int(args.staging_gb * (1 << 30) / nbytes))
        total = jobs * nbytes
        dst = np.empty(nbytes, np.uint8)
        np_srcs = [s.numpy() for s in srcs]
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            stage_pool = _transfer.slot_pool(1, pinned=True)  # pageable (one warning) without a driver
        pinned = bool(stage_pool.pinned)

        def memcpy() -> float:
            t0 = time.perf_counter()
            for j in range(jobs):
                np.copyto(dst, np_srcs[j % nsrc])
            return time.perf_counter() - t0

        def clone() -> float:
            t0 = time.perf_counter()
            for j in range(jobs):
                srcs[j % nsrc].clone()
            return time.perf_counter() - t0

        def engine(device: torch.device | None) -> Callable[[], float]:
            def run() -> float:
                stage = _transfer.DeviceStage(device, pin=pinned, depth=2, staging_pool=stage_pool)
                batches = ({"x": srcs[j % nsrc]} for j in range(jobs))
                t0 = time.perf_counter()
                for b in _transfer.Staged(batches, stage, stage.submit_tree, go_on_after_error=False):
                    assert b["x"].shape[0] == nbytes
                dt = time.perf_counter() - t0
                return dt
            return run

        variants = {"numpy_memcpy": memcpy, "torch_clone": clone, "engine_stage": engine(None),
                    "engine_stage_copy_cpu": engine(torch.device("cpu"))}
        for fn in variants.values():  # warm-up: faults in destinations and staging slots
            fn()
        raw = B.interleaved(variants, args.rounds_c)
        gbps = {k: total / statistics.median(v) / 1e9 for k, v in raw.items()}
        out[f"{seg_mb}MB"] = {
            "segment_bytes": nbytes, "jobs": jobs, "bytes": total, "staging_pinned": pinned, "seconds": raw,
            "gbps": gbps,
            "stage_over_memcpy": paired_ratio(raw["numpy_memcpy"], raw["engine_stage"]),
            "stage_copy_over_memcpy": paired_ratio(raw["numpy_memcpy"], raw["engine_stage_copy_cpu"]),
            "stage_copy_over_clone": paired_ratio(raw["torch_clone"], raw["engine_stage_copy_cpu"]),
            "staging_slots_created": stage_pool.created,
        }
    return out


# -- report --------------------------------------------------------------------------------
def print_table(res: dict[str, Any]) -> None:
    env = res["environment"]
    print(f"\npyloader DataLoader benchmark  (cpus={env['cpus']}, torch {env['torch']}, "
          f"load avg {env['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}; medians of interleaved rounds)")
    print("\n(a) DataLoader over ShardDataset vs bare native iterator "
          f"(num_workers = num_threads = {res['config']['workers']}, raw records)")
    print(f"  {'':<16}{'':>11}{'loader time':>13}{'':>18}{'device=cpu time vs bare +':>30}")
    print(f"  {'records':<10}{'batch':>6}{'bare GB/s':>11}{'vs bare':>13}{'(rounds min..max)':>18}"
          f"{'.clone()':>10}{'np memcpy':>16}{'(clone vs memcpy)':>21}")
    for r in res["native"]:
        lo, hi = r["overhead_pct_range"]
        print(f"  {r['profile']:<10}{r['batch_size']:>6}{r['bare_gbps']:>11.2f}{r['overhead_pct']:>+12.1f}%"
              f"{f'{lo:+.1f}%..{hi:+.1f}%':>18}{r['cpu_overhead_pct']:>+9.1f}%{r['cpu_vs_prealloc_pct']:>+15.1f}%"
              f"{r['clone_vs_prealloc_pct']:>+20.1f}%")
    g = res["generic"]
    print("\n(b) pyloader.DataLoader vs torch DataLoader, map-style Dataset, batch 64 "
          "(samples/s ratio, target ~1.0)")
    print(f"  {'dataset':<18}{'torch samples/s':>16}{'pyloader/torch':>16}{'(rounds: min..max)':>20}")
    for tag, r in g["ratios"].items():
        lo, hi = r["range"]
        print(f"  {tag:<18}{r['torch_samples_per_s']:>16,.0f}{r['pyloader_over_torch_samples_per_s']:>15.3f}x"
              f"{f'{lo:.2f}..{hi:.2f}':>20}")
    for name, w in g["pin_memory_behaviour"].items():
        if "copy_engine" in w:
            c = w["copy_engine"]
            print(f"  {name}: copy engine backend={c.get('backend')} pinned={c.get('pinned')} "
                  f"staged {c.get('staged_bytes', 0) / 1e6:.0f} MB in the last epoch")
        else:
            print(f"  {name}: torch pinned batches: {w['pinned_by_loader']}")
    print("\n(c) copy engine staging vs numpy memcpy (1 thread, preallocated destination)")
    print(f"  {'':<9}{'':>12}{'':>12}{'':>14}{'device=cpu: stage + copy (2x bytes)':>37}")
    print(f"  {'segment':<9}{'memcpy GB/s':>12}{'stage GB/s':>12}{'stage/memcpy':>14}"
          f"{'GB/s':>12}{'/memcpy':>9}{'/clone':>8}")
    for seg, r in res["staging"].items():
        gb = r["gbps"]
        print(f"  {seg:<9}{gb['numpy_memcpy']:>12.2f}{gb['engine_stage']:>12.2f}{r['stage_over_memcpy']:>13.2f}x"
              f"{gb['engine_stage_copy_cpu']:>12.2f}{r['stage_copy_over_memcpy']:>8.2f}x"
              f"{r['stage_copy_over_clone']:>7.2f}x")
    print(f"\nwrote {res['config']['out']}  ({res['wall_s']:.0f} s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller data and fewer rounds (< 3 min on 2 cores)")
    ap.add_argument("--mb", type=float, help="dataset size per profile for (a), MB")
    ap.add_argument("--workers", type=int, default=2, help="num_workers / native threads for (a)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds for (a), (b) and (c)")
    ap.add_argument("--out", default="bench_results/loader.json")
    args = ap.parse_args()
    q = args.quick
    args.mb = args.mb or (96 if q else 256)
    args.rounds_a = args.rounds or (7 if q else 11)
    args.rounds_b = args.rounds or (7 if q else 9)
    args.rounds_c = args.rounds or (3 if q else 7)
    args.sample_s = 0.25 if q else 0.5
    args.native_batch = {"image12k": 256, "blob150k": 32}
    args.generic_samples = 8192 if q else 16384
    args.segment_mb = [4, 64]
    args.staging_gb = 0.75 if q else 2.0
    t_start = time.perf_counter()
    env = B.environment()
    env["loadavg_start"] = list(os.getloadavg())
    env["torch_threads"] = torch.get_num_threads()
    env["cuda_driver"] = _transfer.driver_error() or "loaded"
    res: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()}, "environment": env, "native": []}
    with tempfile.TemporaryDirectory(prefix="pyloader-bench-loader-") as tmp:
        for name in ("image12k", "blob150k"):
            print(f"== (a) {B.PROFILES[name].description}", file=sys.stderr, flush=True)
            res["native"].append(bench_native(B.PROFILES[name], args, tmp))
    print("== (b) map-style datasets", file=sys.stderr, flush=True)
    res["generic"] = bench_generic(args)
    print("== (c) staging", file=sys.stderr, flush=True)
    res["staging"] = bench_staging(args)
    res["loadavg_end"] = list(os.getloadavg())
    res["wall_s"] = time.perf_counter() - t_start
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
