"""A torch user's own per-sample Python transforms: pyloader.DataLoader vs torch's DataLoader, equal cores.

Three transforms as a user writes them (module-level functions, so they pickle), each run
on the same records by both loaders:

  image      PIL decode of JPEG bytes (stored as a plain ``bytes`` field, so pyloader does
             not decode it: the user's code does), a random resized crop to 224 with
             torchvision's RandomResizedCrop parameter rule as one ``resize(box=...)``, a
             random horizontal flip, to a float CHW tensor normalised by ImageNet mean/std.
  tokenize   a ``tokenizers`` BPE model (vocab ~8000) trained here on the generated corpus;
             ``encode(text).ids`` padded/cut to 512, int64.
  features   an audio-like float32 [16000] vector per record: 25 ms Hann windows with a
             10 ms hop (400/160), rfft, power, a 64-band mel-like filterbank, log, per-band
             mean/std normalisation -> float32 [64, frames]; numpy on one sample.

torch: a map-style Dataset holding the records in memory (a list of bytes or arrays: reading
costs it nothing), ``DataLoader(batch_size=64, shuffle=True, num_workers=w,
persistent_workers=w > 0)``; w in 0..4 is swept on a subset first and the best is measured
(and w=2 as well when the best is another: the sweep is short, and load from other
processes can make it pick fewer workers than torch scales to).
pyloader: ``ShardDataset(shuffle=True, seed=0)`` over the same records, batch 64, variants
``pyloader-default`` (torch's best loader's num_workers and persistent_workers, the executor
left to its default, "auto": NOTE [executor choice]), ``pyloader-auto`` (num_workers="auto":
NOTE [transform autotune]), ``pyloader-w1``/``-w2`` (1 and 2 workers, default executor),
``pyloader-threads-2``, ``pyloader-processes-2`` (its pool kept across epochs) and
``pyloader-processes-2-fresh`` (a pool per epoch: persistent_workers=False), for the
per-epoch start-up.

Each variant is built once per round and iterated for --epochs epochs: its figure is
samples/s over epochs 2..N (steady state); the time to the first batch of epoch 1 and of
epoch 2 (per-epoch start-up) is recorded too. Rounds are interleaved (every variant once
per round, the order rotated), figures are medians over rounds, and ratios are paired per
round (median and [min, max]). Every batch's shape and dtype are checked.

The physical limit beside them (the *ceiling*): as many forked processes as this process
may run on CPUs, each running the user's code alone on its share of the records at once
(one torch and one BLAS thread each, as both loaders' workers), the best of 3 runs of
about a second. Both loaders run that code once per sample on the same CPUs, so neither
can pass it; each variant's share of it is printed (``/ ceiling``). The rate of the code
on one thread in the main process (the fastest of 3 passes over 100 samples) is printed
too: the ceiling over it bounds "2 workers / 1 worker" (two CPUs of this VM do not make
twice one).

    python benchmarks/bench_user_transforms.py [--quick] [--rounds N] [--epochs N] \
        [--only image,tokenize,features] [--out bench_results/user_transforms.json]
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no Rust thread pool next to the loaders' workers

import numpy as np
import torch
import torch.utils.data
from bench_transforms import _SYLLABLES, make_jpegs  # (this folder: the same images and syllables)
from PIL import Image

import pyloader
from pyloader.bench import measure as B

BATCH = 64
SEQ = 512
IMG = 224
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
AUDIO = 16000  # 1 s at 16 kHz
WIN, HOP, NFFT, BANDS = 400, 160, 512, 64
FRAMES = 1 + (AUDIO - WIN) // HOP


# -- the user's transforms ------------------------------------------------------------------
def crop_params(width: int, height: int) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop rule (scale 0.08..1, ratio 3/4..4/3): a (left, top, right, bottom) box."""
    area = width * height
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * random.uniform(0.08, 1.0)
        aspect = math.exp(random.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = random.randint(0, height - h)
            left = random.randint(0, width - w)
            return left, top, left + w, top + h
    in_ratio = width / height  # fallback: a centre crop
    if in_ratio < 3 / 4:
        w, h = width, int(round(width / (3 / 4)))
    elif in_ratio > 4 / 3:
        h, w = height, int(round(height * (4 / 3)))
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return left, top, left + w, top + h


def image_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """JPEG bytes -> float32 [3, 224, 224], randomly cropped, flipped and normalised (torchvision-style, PIL only)."""
    img = Image.open(io.BytesIO(sample["jpeg"])).convert("RGB")
    img = img.resize((IMG, IMG), resample=Image.Resampling.BILINEAR, box=crop_params(*img.size))
    if random.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float().div_(255)
    return {"image": x.sub_(MEAN).div_(STD), "label": sample["label"]}


TOKENIZER: Any = None  # trained in main(); a module global, so fork-started workers inherit it


def tokenize_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """Text bytes -> int64 [512] BPE ids, zero-padded or cut."""
    ids = TOKENIZER.encode(sample["text"].decode()).ids[:SEQ]
    out = torch.zeros(SEQ, dtype=torch.int64)
    out[: len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return {"ids": out, "label": sample["label"]}


def mel_filterbank(bands: int = BANDS, nfft: int = NFFT, rate: int = 16000) -> np.ndarray:
    """A triangular mel filterbank, float32 [bands, nfft // 2 + 1]."""
    def mel(f: np.ndarray) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + f / 700.0)

    def hz(m: np.ndarray) -> np.ndarray:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    edges = hz(np.linspace(mel(np.array(0.0)), mel(np.array(rate / 2)), bands + 2))
    freqs = np.linspace(0, rate / 2, nfft // 2 + 1)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    up = (freqs[None] - lo) / (mid - lo)
    down = (hi - freqs[None]) / (hi - mid)
    return np.maximum(0.0, np.minimum(up, down)).astype(np.float32)


MEL = mel_filterbank()
HANN = np.hanning(WIN).astype(np.float32)


def features_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """float32 [16000] signal -> log-mel features float32 [64, frames], normalised per band."""
    x = np.asarray(sample["audio"], dtype=np.float32)
    frames = np.lib.stride_tricks.sliding_window_view(x, WIN)[::HOP] * HANN
    power = np.abs(np.fft.rfft(frames, n=NFFT, axis=1)) ** 2
    logmel = np.log(power.astype(np.float32) @ MEL.T + 1e-6).T
    logmel = (logmel - logmel.mean(axis=1, keepdims=True)) / (logmel.std(axis=1, keepdims=True) + 1e-5)
    return {"features": torch.from_numpy(logmel.astype(np.float32)), "label": sample["label"]}


# -- batch checks: a broken transform must not make a fast wrong number -------------------------
def _check(batch: dict[str, torch.Tensor], key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x, y = batch[key], batch["label"]
    if x.dtype != dtype or tuple(x.shape[1:]) != shape or not 0 < x.shape[0] <= BATCH:
        raise AssertionError(f"unexpected batch: {key} {x.dtype} {tuple(x.shape)}, want {dtype} [B, {shape}]")
    if y.dtype != torch.int64 or tuple(y.shape) != (x.shape[0],):
        raise AssertionError(f"unexpected labels: {y.dtype} {tuple(y.shape)} for {x.shape[0]} samples")


def check_image(batch: dict[str, torch.Tensor]) -> None:
    """float32 [B, 3, 224, 224], int64 labels [B]."""
    _check(batch, "image", torch.float32, (3, IMG, IMG))


def check_tokens(batch: dict[str, torch.Tensor]) -> None:
    """int64 [B, 512], int64 labels [B]."""
    _check(batch, "ids", torch.int64, (SEQ,))


def check_features(batch: dict[str, torch.Tensor]) -> None:
    """float32 [B, 64, frames], int64 labels [B]."""
    _check(batch, "features", torch.float32, (BANDS, FRAMES))


def check_values(key: str, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Once per variant: the values are finite and not all zero (a summary to compare across variants)."""
    x = batch[key].double()
    if not bool(torch.isfinite(x).all()) or float(x.abs().sum()) == 0.0:
        raise AssertionError(f"{key}: non-finite or all-zero values")
    return {"mean": float(x.mean()), "std": float(x.std())}


# -- data -------------------------------------------------------------------------------------------
def make_texts(n: int, seed: int = 0) -> list[bytes]:
    """``n`` records of English-like text (1-4 KB): Zipf-distributed pseudo-words (from syllables) in sentences."""
    rng = np.random.default_rng(seed)
    common = ["the", "of", "and", "to", "a", "in", "is", "that", "for", "it", "as", "was", "with", "on", "by"]
    # 16000 pseudo-words: enough distinct words that a BPE model trained on them reaches its ~8000 vocab.
    vocab = common + ["".join(rng.choice(_SYLLABLES, int(rng.integers(1, 5)))) for _ in range(16000)]
    cdf = np.cumsum(1.0 / np.arange(1, len(vocab) + 1) ** 1.05)
    cdf /= cdf[-1]
    out = []
    for _ in range(n):
        target = int(rng.integers(1024, 4097))
        parts: list[str] = []
        size = 0
        while size < target:
            picks = np.searchsorted(cdf, rng.random(int(rng.integers(6, 20))))
            s = " ".join(vocab[i] for i in picks).capitalize()
            s += str(rng.choice([".", ".", ".", "?", "!", ";"]))
            parts.append(s)
            size += len(s) + 1
        out.append(" ".join(parts).encode()[:target])
    return out


def make_audio(n: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` float32 [16000] signals: a few chirping partials with an envelope, plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(AUDIO, dtype=np.float32) / 16000
    out = []
    for _ in range(n):
        f0 = rng.uniform(80, 400)
        sig = np.zeros(AUDIO, np.float32)
        for k in range(1, 5):
            sig += np.sin(2 * np.pi * (f0 * k * t + rng.uniform(-30, 30) * t * t)).astype(np.float32) / k
        env = np.abs(np.sin(np.pi * t * rng.uniform(1, 6))).astype(np.float32)
        out.append((0.3 * sig * env + 0.02 * rng.standard_normal(AUDIO, dtype=np.float32)).astype(np.float32))
    return out


class RecordDataset(torch.utils.data.Dataset):
    """The torch side: the records in memory (lists), ``__getitem__`` is the user's transform of the record dict."""

    def __init__(self, columns: dict[str, list[Any]], fn: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.columns, self.fn = columns, fn
        self.n = len(next(iter(columns.values())))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.fn({k: v[i] for k, v in self.columns.items()})


# -- measuring ------------------------------------------------------------------------------------------
def parallel_rate(fn: Callable[[dict[str, Any]], Any], columns: dict[str, list[Any]], procs: int,
                  per_proc: int, collate: int = 0) -> float:
    """Samples/s of ``procs`` forked processes each running ``fn`` alone over ``per_proc`` records at once.

    Each runs as pyloader's transform workers do (one torch and one BLAS thread, the heap kept).
    ``collate``: also ``default_collate`` every that many outputs (a batching loader's copy).
    """
    n = len(next(iter(columns.values())))
    t0 = time.perf_counter()
    pids = []
    for p in range(procs):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                # A worker's threads: one for torch, one for BLAS/OpenMP, OpenBLAS's spinning
                # server stopped (See NOTE [worker threads] in pyloader/transform/stage.py), and
                # its heap kept between batches (NOTE [worker heap]).
                from pyloader.transform.stage import as_worker_process

                as_worker_process()
                outs = []
                for i in range(per_proc):
                    k = (p * per_proc + i) % n
                    outs.append(fn({c: v[k] for c, v in columns.items()}))
                    if len(outs) >= max(1, collate):
                        if collate:
                            torch.utils.data.default_collate(outs)
                        outs = []
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"a process running the transform alone failed (wait status {status})")
    return procs * per_proc / (time.perf_counter() - t0)


def run_epochs(make: Callable[[], Any], epochs: int, n: int, check: Callable[[Any], None]) -> dict[str, Any]:
    """Builds a loader, iterates it ``epochs`` times: per-epoch seconds and time to the first batch."""
    loader = make()
    secs, ttfb = [], []
    try:
        for _ in range(epochs):
            t0 = time.perf_counter()
            it = iter(loader)
            count = 0
            first = None
            for batch in it:
                if first is None:
                    first = time.perf_counter() - t0
                check(batch)
                count += int(batch["label"].shape[0])
            secs.append(time.perf_counter() - t0)
            ttfb.append(first)
            del it
            if count != n:
                raise AssertionError(f"an epoch yielded {count} samples, expected {n}")
        st = loader.stats() if isinstance(loader, pyloader.DataLoader) else {}
        chosen = {"executor": st.get("transform_executor"), "workers": st.get("transform_workers"),
                  "choice": st.get("executor_choice"),
                  "autotune": {k: v for k, v in st.get("autotune", {}).items() if k != "decisions"} or None}
    finally:
        del loader
        gc.collect()  # torch's persistent workers and pyloader's worker processes end with their loader
    return {"epoch_s": secs, "ttfb_s": ttfb, "chosen": chosen}


def steady_sps(rec: dict[str, Any], n: int) -> float:
    """Samples/s over epochs 2..N (epoch 1 if there is only one)."""
    s = rec["epoch_s"][1:] or rec["epoch_s"]
    return n * len(s) / sum(s)


def paired(a: list[float], b: list[float]) -> dict[str, Any]:
    """a[i] / b[i] over rounds (both from the same round): median, [min, max]."""
    r = [x / y for x, y in zip(a, b)]
    return {"median": statistics.median(r), "range": [min(r), max(r)], "rounds": r}


def pyloader_variants(path: str, fn: Callable[..., Any], torch_best: int) -> dict[str, Callable[[], Any]]:
    """The pyloader loaders of one transform, each a function that builds it."""
    def make(**kw: Any) -> Callable[[], Any]:
        return lambda: pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=0), batch_size=BATCH,
                                           drop_last=False, transform=fn, **kw)
    # pyloader-default: the arguments of torch's best loader (num_workers, persistent_workers), the
    # executor left to its default; pyloader-auto: the workers' count left to pyloader too.
    return {
        "pyloader-default": make(num_workers=torch_best, persistent_workers=torch_best > 0),
        "pyloader-auto": make(num_workers="auto", persistent_workers=True),
        "pyloader-w1": make(num_workers=1, persistent_workers=True),
        "pyloader-w2": make(num_workers=2, persistent_workers=True),
        "pyloader-threads-2": make(num_workers=2, executor="threads"),
        "pyloader-processes-2": make(num_workers=2, executor="processes", persistent_workers=True),
        "pyloader-processes-2-fresh": make(num_workers=2, executor="processes"),
    }


def torch_variant(ds: torch.utils.data.Dataset, w: int) -> Callable[[], Any]:
    """A function that builds torch's loader with ``w`` worker processes."""
    return lambda: torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=w,
                                               persistent_workers=w > 0, drop_last=False)


def bench_one(name: str, args: argparse.Namespace, columns: dict[str, list[Any]], schema: dict[str, Any],
              fn: Callable[..., Any], check: Callable[[Any], None], key: str, tmp: str) -> dict[str, Any]:
    """Sweep torch's workers, then every variant over --rounds interleaved rounds of --epochs epochs."""
    n = len(next(iter(columns.values())))
    path = os.path.join(tmp, name)
    t0 = time.perf_counter()
    with pyloader.ShardWriter(path, schema, compression="none") as w:
        for i in range(n):
            w.write({k: v[i] for k, v in columns.items()})
    write_s = time.perf_counter() - t0
    # The user's code alone, on one thread: the fastest of 3 passes over the first 100
    # samples. Its rate times the CPUs is the ceiling no loader passes (see print_tables).
    passes = []
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(min(n, 100)):
            fn({k: v[i] for k, v in columns.items()})
        passes.append((time.perf_counter() - t0) / min(n, 100) * 1e6)
    us = min(passes)
    cpus = len(os.sched_getaffinity(0))
    ceilings = [parallel_rate(fn, columns, cpus, max(20, int(1e6 / us))) for _ in range(3)]
    ceiling = max(ceilings)
    print(f"== {name}: {n} records, {us:.0f} us/sample in the main process; {cpus} processes running it at once: "
          f"{ceiling:.0f} samples/s ({ceiling * us / 1e6:.2f}x one thread)", file=sys.stderr, flush=True)
    ds = RecordDataset(columns, fn)

    # torch's num_workers sweep on a subset: steady state of 2 epochs per loader.
    sub_n = max(1, n // args.sweep_fraction)
    sub = torch.utils.data.Subset(ds, list(range(sub_n)))
    sweep_runs: dict[str, list[dict[str, Any]]] = {f"w{w}": [] for w in args.torch_workers}

    def sweep_one(w: int) -> Callable[[], float]:
        def go() -> float:
            rec = run_epochs(torch_variant(sub, w), 2, sub_n, check)
            sweep_runs[f"w{w}"].append(rec)
            return steady_sps(rec, sub_n)
        return go

    sweep = B.interleaved({f"w{w}": sweep_one(w) for w in args.torch_workers}, args.sweep_rounds)
    sweep_sps = {k: statistics.median(v) for k, v in sweep.items()}
    best = max(args.torch_workers, key=lambda w: sweep_sps[f"w{w}"])
    print(f"   torch sweep ({sub_n} samples, samples/s): "
          + ", ".join(f"{k}={v:.0f}" for k, v in sweep_sps.items()) + f" -> best num_workers={best}",
          file=sys.stderr, flush=True)

    makers: dict[str, Callable[[], Any]] = {"torch-best": torch_variant(ds, best)}
    if best != 2:  # equal workers too: a sweep on a loaded machine can pick fewer workers than torch scales to
        makers["torch-2"] = torch_variant(ds, 2)
    makers.update(pyloader_variants(path, fn, best))
    # Warm-up and availability: each variant built once, its first batch checked (values too).
    unavailable: dict[str, str] = {}
    values: dict[str, dict[str, float]] = {}
    executors: dict[str, Any] = {}
    for k in list(makers):
        try:
            ldr = makers[k]()
            executors[k] = {"executor": getattr(ldr, "executor", "torch worker processes"),
                            "num_workers": ldr.num_workers}
            it = iter(ldr)
            b = next(it)
            check(b)
            values[k] = check_values(key, b)
            del it, ldr, b
            gc.collect()
        except Exception as e:  # noqa: BLE001 - recorded: the variant is reported as unavailable
            unavailable[k] = f"{type(e).__name__}: {e}"
            if not (k == "pyloader-auto" and isinstance(e, ValueError)):
                traceback.print_exc()
            makers.pop(k)
            print(f"   {k}: unavailable ({unavailable[k]})", file=sys.stderr, flush=True)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in makers}

    def one(k: str) -> Callable[[], float]:
        def go() -> float:
            rec = run_epochs(makers[k], args.epochs, n, check)
            runs[k].append(rec)
            return steady_sps(rec, n)
        return go

    print(f"   {list(makers)}: {args.rounds} rounds x {args.epochs} epochs", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    sps = B.interleaved({k: one(k) for k in makers}, args.rounds)
    main_s = time.perf_counter() - t0
    print(f"   done in {main_s:.0f} s", file=sys.stderr, flush=True)
    res_variants: dict[str, Any] = {}
    for k in makers:
        res_variants[k] = {
            **executors[k],
            "samples_per_s": statistics.median(sps[k]), "samples_per_s_rounds": sps[k],
            "chosen": runs[k][-1]["chosen"],
            "ttfb_epoch1_ms": 1e3 * statistics.median(r["ttfb_s"][0] for r in runs[k]),
            "ttfb_epoch2_ms": (1e3 * statistics.median(r["ttfb_s"][1] for r in runs[k])
                               if args.epochs > 1 else None),
            "over_torch_best": paired(sps[k], sps["torch-best"]) if "torch-best" in sps else None,
            "runs": runs[k], "first_batch_values": values.get(k)}

    def fig(a: str, b: str) -> dict[str, Any] | str:
        if a not in sps or b not in sps:
            return f"unavailable ({a if a not in sps else b}: {unavailable.get(a if a not in sps else b, '?')})"
        return paired(sps[a], sps[b])

    figures = {
        "pyloader-default / torch-best": fig("pyloader-default", "torch-best"),
        "pyloader-auto / torch-best": fig("pyloader-auto", "torch-best"),
        "2 workers / 1 worker (default executor)": fig("pyloader-w2", "pyloader-w1"),
        "2 workers / torch 2 workers": fig("pyloader-w2", "torch-2" if best != 2 else "torch-best"),
        "default executor / threads (2 workers)": fig("pyloader-w2", "pyloader-threads-2"),
        "default executor / processes (2 workers)": fig("pyloader-w2", "pyloader-processes-2"),
        "kept pool / pool per epoch (processes-2)": fig("pyloader-processes-2", "pyloader-processes-2-fresh"),
    }
    for v in res_variants.values():
        v["of_ceiling"] = v["samples_per_s"] / ceiling
    return {"records": n, "write_s": write_s, "transform_us_per_sample_main": us,
            "transform_us_per_sample_passes": passes, "ceiling_samples_per_s": ceiling,
            "ceiling_runs_samples_per_s": ceilings, "one_thread_samples_per_s": 1e6 / us,
            "sweep_samples": sub_n, "sweep_samples_per_s": sweep_sps, "sweep_rounds_samples_per_s": sweep,
            "sweep_runs": sweep_runs, "torch_best_workers": best, "variants": res_variants,
            "unavailable": unavailable, "figures": figures, "main_s": main_s}


# -- report ---------------------------------------------------------------------------------------------
def print_tables(res: dict[str, Any]) -> None:
    env, cfg = res["environment"], res["config"]
    print(f"\nuser transforms: pyloader vs torch DataLoader  (cpus={env['cpus']}, affinity={len(env['affinity'])}, "
          f"torch {env['torch']}, load avg {env['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}; "
          f"batch {BATCH}; {cfg['rounds']} interleaved rounds x {cfg['epochs']} epochs; samples/s over epochs "
          f"2..{cfg['epochs']}, medians)")
    print(f"  numpy BLAS {env['numpy_blas']}; " + ", ".join(f"{k}={v}" for k, v in env["thread_env"].items()))
    for name, r in res["transforms"].items():
        print(f"\n[{name}] {r['records']} records, {r['transform_us_per_sample_main']:.0f} us/sample in the main process; "
              f"torch sweep on {r['sweep_samples']}: "
              + " ".join(f"{k}={v:.0f}" for k, v in r["sweep_samples_per_s"].items())
              + f" -> best num_workers={r['torch_best_workers']}")
        print(f"  ceiling: {len(env['affinity'])} processes running the user's code alone at once = "
              f"{r['ceiling_samples_per_s']:.0f} samples/s (no loader can pass it: both run the same code per sample); "
              f"one thread: {r['one_thread_samples_per_s']:.0f} samples/s, so 2 workers / 1 is at most "
              f"{r['ceiling_samples_per_s'] / r['one_thread_samples_per_s']:.2f}x here")
        print(f"  {'variant':<26}{'executor':>10}{'workers':>8}{'samples/s':>11}{'/ torch-best':>14}"
              f"{'[min, max]':>14}{'/ ceiling':>10}{'ttfb ep1 ms':>13}{'ttfb ep2 ms':>13}")
        for k, v in r["variants"].items():
            o = v["over_torch_best"] or {"median": math.nan, "range": [math.nan, math.nan]}
            rng = f"{o['range'][0]:.2f}..{o['range'][1]:.2f}"
            ch = v.get("chosen") or {}
            ex = "torch" if k.startswith("torch") else str(ch.get("executor") or v["executor"])
            nw = v["num_workers"] if k.startswith("torch") or not ch.get("workers") else ch["workers"]
            if v["num_workers"] == "auto":
                nw = f"a{nw}"
            print(f"  {k:<26}{ex:>10}{str(nw):>8}{v['samples_per_s']:>11.0f}"
                  f"{o['median']:>13.2f}x{rng:>14}{v['of_ceiling']:>10.2f}"
                  f"{v['ttfb_epoch1_ms']:>13.0f}"
                  + (f"{v['ttfb_epoch2_ms']:>13.0f}" if v["ttfb_epoch2_ms"] is not None else f"{'-':>13}"))
        for k, msg in r["unavailable"].items():
            print(f"  {k:<22} unavailable: {msg}")
        for label, f in r["figures"].items():
            if isinstance(f, str):
                print(f"  {label:<42} {f}")
            else:
                extra = f" ({f['best']})" if "best" in f else ""
                print(f"  {label:<42} {f['median']:.2f}x  [{f['range'][0]:.2f}, {f['range'][1]:.2f}]{extra}")
    print(f"\nwrote {cfg['out']}  ({res['wall_s']:.0f} s)")


THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM")


def numpy_blas() -> str:
    """numpy's BLAS (its thread pool runs in every worker process unless OPENBLAS_NUM_THREADS etc. limit it)."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name')} {blas.get('version')}"
    except Exception as e:  # noqa: BLE001 - older numpy: no dicts mode
        return f"unknown ({type(e).__name__})"


def main() -> int:
    global TOKENIZER
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: less data, one round, 2 epochs (~1 min)")
    ap.add_argument("--images", type=int, help="JPEG records (default 1000, --quick 192)")
    ap.add_argument("--texts", type=int, help="text records (default 4000, --quick 768)")
    ap.add_argument("--audio", type=int, help="audio records (default 3000, --quick 512)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 3, --quick 1)")
    ap.add_argument("--epochs", type=int, help="epochs per loader per round (default 3, --quick 2)")
    ap.add_argument("--only", default="image,tokenize,features", help="comma-separated transforms to run")
    ap.add_argument("--out", default="bench_results/user_transforms.json")
    args = ap.parse_args()
    # The sweep runs torch with more workers than cores on purpose.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    q = args.quick
    args.images = args.images or (192 if q else 1000)
    args.texts = args.texts or (768 if q else 4000)
    args.audio = args.audio or (512 if q else 3000)
    args.rounds = args.rounds or (1 if q else 3)
    args.epochs = args.epochs or (2 if q else 3)
    args.sweep_fraction = 2 if q else 3  # the sweep's subset: 1/this of the records (an epoch of ~0.4 s)
    args.sweep_rounds = 1 if q else 2
    args.torch_workers = [0, 1, 2, 3, 4]
    args.vocab = 8000
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    t_start = time.perf_counter()
    env = B.environment()
    import tokenizers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    env.update({"pillow": Image.__version__, "tokenizers": tokenizers.__version__, "pyloader": pyloader.__version__,
                "affinity": sorted(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
                "loadavg_start": list(os.getloadavg()),
                "thread_env": {k: os.environ.get(k) for k in THREAD_ENV}, "numpy_blas": numpy_blas()})
    config = {k: v for k, v in vars(args).items()}
    config.update({"batch_size": BATCH, "seq": SEQ, "image_size": IMG, "audio_samples": AUDIO,
                   "window": WIN, "hop": HOP, "nfft": NFFT, "bands": BANDS, "frames": FRAMES, "shuffle": True,
                   "drop_last": False, "figure": "samples/s over epochs 2..N of a loader built once per round"})
    res: dict[str, Any] = {"config": config, "environment": env, "transforms": {}}
    with tempfile.TemporaryDirectory(prefix="pyloader-bench-user-") as tmp:
        if "image" in only:
            jpegs = make_jpegs(args.images)
            res["transforms"]["image"] = bench_one(
                "image", args, {"jpeg": jpegs, "label": [i % 1000 for i in range(len(jpegs))]},
                {"jpeg": "bytes", "label": "int64"}, image_transform, check_image, "image", tmp)
            res["transforms"]["image"]["jpeg_bytes_mean"] = statistics.mean(len(b) for b in jpegs)
            del jpegs
        if "tokenize" in only:
            texts = make_texts(args.texts)
            t0 = time.perf_counter()
            bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
            bpe.pre_tokenizer = pre_tokenizers.Whitespace()
            bpe.train_from_iterator((t.decode() for t in texts), trainers.BpeTrainer(
                vocab_size=args.vocab, special_tokens=["[PAD]", "[UNK]"], show_progress=False))
            TOKENIZER = bpe
            train_s = time.perf_counter() - t0
            r = bench_one("tokenize", args, {"text": texts, "label": [i % 10 for i in range(len(texts))]},
                          {"text": "bytes", "label": "int64"}, tokenize_transform, check_tokens, "ids", tmp)
            r.update({"train_s": train_s, "vocab": bpe.get_vocab_size(),
                      "mean_tokens_first_200": statistics.mean(len(bpe.encode(t.decode()).ids) for t in texts[:200])})
            res["transforms"]["tokenize"] = r
            del texts
        if "features" in only:
            audio = make_audio(args.audio)
            res["transforms"]["features"] = bench_one(
                "features", args, {"audio": audio, "label": [i % 35 for i in range(len(audio))]},
                {"audio": ("float32", (AUDIO,)), "label": "int64"}, features_transform, check_features,
                "features", tmp)
            del audio
    res["loadavg_end"] = list(os.getloadavg())
    res["wall_s"] = time.perf_counter() - t_start
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print_tables(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
