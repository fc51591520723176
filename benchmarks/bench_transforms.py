"""Per-sample transform benchmark (CPU): pyloader's transform stage vs torch's DataLoader.

Every figure is a ratio of two things measured side by side in one run: the rounds are
interleaved (each round runs every variant once, in a rotating order) and each variant's
figure is the median over rounds, so load from other processes hits both sides alike.
The data is generated here, in a temporary directory.

  (1) Image classification: JPEG decode, random resized crop to 224, horizontal flip,
      normalisation to float CHW with ImageNet mean/std, batch 64.
      pyloader: ShardDataset(decode=ImageDecode(size=224, crop="random", flip=True,
      layout="CHW", mean=..., std=...)): all of it on the workers, the normalisation in
      ImageDecode's one native pass, num_workers 1 and 2 (threads); and, as a GPU job would
      run it (here on the CPU), uint8 batches normalised by a ``batch_transform`` on the
      consuming thread.
      torch: DataLoader (workers started per epoch) over a map-style Dataset holding the same JPEG
      bytes in a list, (a) typical ``__getitem__``: PIL open + convert, a random resized
      crop with torchvision's parameter rule as one ``resize(box=...)``, flip, to tensor,
      normalise; (b) equal decode: ``ImageDecode.decode`` with the same arguments (the
      loader's own decode and normalisation: the same work per sample). torch's num_workers 0..4 are swept first (on a subset); the
      best of each is then measured against pyloader.
  (2) A pure-Python transform that holds the GIL (string ops over each record's text):
      pyloader executor="processes", 2 workers, vs torch DataLoader num_workers=2 over the
      same records; samples/s and the peak summed PSS (main process and all its children,
      from /proc/<pid>/smaps_rollup, sampled by a background thread during each run); and
      each alone in a fresh process that holds only its own data (torch: the records as a
      list of bytes, as a map-style dataset does; pyloader: the ShardDataset), two epochs.
  (3) Tokenising on the fly (a ``tokenizers`` BPE model trained here on the generated
      corpus; a regex word tokenizer when ``tokenizers`` is missing) padded/cut to 512 ids
      vs the same records pre-tokenised into an int32 (512,) field read without a
      transform; threads executor, 2 workers.
  (4) A training loop: each batch of (1) followed by a simulated accelerator step (a sleep
      of --step-ms, which leaves the CPU to the loader as a GPU step does), pyloader (2
      threads) vs torch (num_workers=2): the busy fraction, step time x batches / wall, the
      share of the run the accelerator would compute.

Prints a table and writes JSON (config, environment, every raw time) for plotting.

    python benchmarks/bench_transforms.py [--quick] [--rounds N] [--out bench_results/transforms.json]
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no Rust thread pool next to the loader's workers

import numpy as np
import torch
import torch.utils.data
from PIL import Image

import pyloader
from pyloader.bench import measure as B
from pyloader.transform.image import ImageDecode, random_resized_crop

MEAN = torch.tensor([0.485, 0.456, 0.406])
STD = torch.tensor([0.229, 0.224, 0.225])
SEQ = 512


# -- helpers -----------------------------------------------------------------------------
def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median over rounds of a[i] / b[i] (both measured in the same round)."""
    return statistics.median([x / y for x, y in zip(a, b)])


def ratio_range(a: list[float], b: list[float]) -> list[float]:
    """[min, max] over rounds of a[i] / b[i]: how much the pairing varied (noise)."""
    r = [x / y for x, y in zip(a, b)]
    return [min(r), max(r)]


def count_samples(it: Iterable[Any], check: Callable[[Any], None] | None = None) -> int:
    """Iterates to the end; returns the samples yielded (the leading size of the batch's last tensor)."""
    n = 0
    for batch in it:
        if check is not None:
            check(batch)
        tensors = list(batch.values()) if isinstance(batch, dict) else list(batch)
        n += int(tensors[-1].shape[0])
    return n


def timed_epoch(loader: Any, counts: dict[str, int], name: str,
                check: Callable[[Any], None] | None = None) -> Callable[[], float]:
    """A variant for ``B.interleaved``: one epoch of ``loader``, its wall seconds."""
    def run() -> float:
        t0 = time.perf_counter()
        counts[name] = count_samples(loader, check)
        return time.perf_counter() - t0
    return run


# -- memory: summed PSS of a process tree ------------------------------------------------
def _children(pid: int) -> list[int]:
    out: list[int] = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            pass
    return out


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:  # the process ended between listing and reading
        pass
    return 0


def tree_pss_bytes(root: int | None = None) -> tuple[int, int]:
    """(summed PSS in bytes, processes) of ``root`` (default: this process) and all its descendants."""
    todo, seen = [root or os.getpid()], set()
    total = 0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _pss_kb(pid)
        todo.extend(_children(pid))
    return total * 1024, len(seen)


class PeakPss:
    """Samples the summed PSS of this process tree every ``interval`` s on a background thread; keeps the peak."""

    def __init__(self, interval: float = 0.025) -> None:
        self.interval = interval
        self.peak = self.procs = self.ticks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            pss, procs = tree_pss_bytes()
            self.ticks += 1
            if pss > self.peak:
                self.peak = pss
            self.procs = max(self.procs, procs)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakPss:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


# -- data ----------------------------------------------------------------------------------
def make_jpegs(n: int, seed: int = 0) -> list[bytes]:
    """``n`` JPEGs (quality 90) of sizes around 320x240..500x375: smooth gradients plus noise, so they compress like photos."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        w = int(rng.integers(320, 501))
        h = int(round(w * rng.uniform(0.7, 0.8)))
        y = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
        x = np.linspace(0, 1, w, dtype=np.float32)[None, :, None]
        a, b, c, f = (rng.uniform(-1, 1, (4, 3)) * [[120], [120], [50], [1]]).astype(np.float32)
        f = 2 + 6 * np.abs(f)
        img = 128 + a * x + b * y + c * np.sin(f * (x + 0.7 * y) * math.pi)
        img = img + 9 * rng.standard_normal((h, w, 3), dtype=np.float32)
        arr = np.clip(img, 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


_SYLLABLES = ["ka", "lo", "re", "mi", "tan", "ser", "ol", "ing", "pre", "com", "ta", "de", "ver", "ent", "al", "ro",
              "na", "the", "ex", "an", "mo", "ly", "st", "qu", "ment", "ci", "po", "ur", "ble", "tion"]


def make_texts(n: int, seed: int = 0) -> list[bytes]:
    """``n`` records of English-like text (1-4 KB): Zipf-distributed pseudo-words in sentences."""
    rng = np.random.default_rng(seed)
    common = ["the", "of", "and", "to", "a", "in", "is", "that", "for", "it", "as", "was", "with", "on", "by"]
    vocab = common + ["".join(rng.choice(_SYLLABLES, int(rng.integers(1, 4)))) for _ in range(4000)]
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.05
    p /= p.sum()
    out = []
    for _ in range(n):
        target = int(rng.integers(1024, 4097))
        parts: list[str] = []
        size = 0
        while size < target:
            words = [vocab[i] for i in rng.choice(len(vocab), int(rng.integers(6, 20)), p=p)]
            s = " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!", ";"])
            parts.append(s)
            size += len(s) + 1
        out.append(" ".join(parts).encode()[:target])
    return out


# -- (1) image classification ----------------------------------------------------------
def normalise_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """uint8 [B, H, W, C] -> float [B, C, H, W], ImageNet mean/std: one vectorised pass over the batch."""
    x = batch["image"].permute(0, 3, 1, 2).float().div_(255).sub_(MEAN.view(1, 3, 1, 1)).div_(STD.view(1, 3, 1, 1))
    return {"image": x, "label": batch["label"]}


class TypicalImageDataset(torch.utils.data.Dataset):
    """JPEG bytes in a list; ``__getitem__`` as a torchvision pipeline would do it, with PIL only."""

    def __init__(self, jpegs: list[bytes], labels: list[int]) -> None:
        self.jpegs, self.labels = jpegs, labels

    def __len__(self) -> int:
        return len(self.jpegs)

    def __getitem__(self, i: int) -> dict[str, Any]:
        img = Image.open(io.BytesIO(self.jpegs[i])).convert("RGB")
        box = random_resized_crop(img.size[0], img.size[1], random)
        img = img.resize((224, 224), Image.Resampling.BILINEAR, box=box)
        if random.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float().div_(255)
        x = x.sub_(MEAN.view(3, 1, 1)).div_(STD.view(3, 1, 1))
        return {"image": x, "label": self.labels[i]}


class EqualDecodeDataset(TypicalImageDataset):
    """The same bytes, decoded by pyloader's own ``ImageDecode.decode`` (same work as the loader)."""

    decoder = ImageDecode(size=224, crop="random", flip=True, layout="CHW", mean=tuple(MEAN.tolist()),
                          std=tuple(STD.tolist()))

    def __getitem__(self, i: int) -> dict[str, Any]:
        x = torch.from_numpy(self.decoder.decode(self.jpegs[i], random.getrandbits(63)))  # float CHW, normalised
        return {"image": x, "label": self.labels[i]}


def check_image_batch(batch: dict[str, torch.Tensor]) -> None:
    """A batch of normalised images: float [B, 3, 224, 224] and B labels."""
    x, y = batch["image"], batch["label"]
    if x.dtype != torch.float32 or tuple(x.shape[1:]) != (3, 224, 224) or y.shape[0] != x.shape[0]:
        raise AssertionError(f"unexpected batch: image {x.dtype} {tuple(x.shape)}, label {tuple(y.shape)}")


def bench_images(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    n, bs = args.images, 64
    t0 = time.perf_counter()
    jpegs = make_jpegs(n)
    labels = [i % 1000 for i in range(n)]
    gen_s = time.perf_counter() - t0
    path = os.path.join(tmp, "images")
    with pyloader.ShardWriter(path, {"image": "jpeg", "label": "int64"}, compression="none",
                              shard_bytes=16 << 20) as w:
        for b, y in zip(jpegs, labels):
            w.write({"image": b, "label": y})
    # pyloader's CPU pipeline: decode, crop, flip and normalise on the workers (the
    # normalisation in ImageDecode's one native pass); and the GPU-style one run on the CPU:
    # uint8 batches normalised by a batch_transform on the consuming thread.
    fused = ImageDecode(size=224, crop="random", flip=True, layout="CHW", mean=tuple(MEAN.tolist()),
                        std=tuple(STD.tolist()))
    ds = pyloader.ShardDataset(path, shuffle=True, seed=0, decode=fused)
    ds_u8 = pyloader.ShardDataset(path, shuffle=True, seed=0, decode=ImageDecode(size=224, crop="random", flip=True))
    py = {
        "pyloader_w1": pyloader.DataLoader(ds, batch_size=bs, num_workers=1),
        "pyloader_w2": pyloader.DataLoader(ds, batch_size=bs, num_workers=2),
        "pyloader_w2_batch_norm": pyloader.DataLoader(ds_u8, batch_size=bs, num_workers=2,
                                                      batch_transform=normalise_batch),
    }
    # Same images from every variant: a fresh loader per variant reads the dataset's epoch 0.
    firsts = {}
    for k in py:
        fresh = pyloader.DataLoader(py[k].dataset, batch_size=bs, num_workers=py[k].num_workers,
                                    transform=py[k].transform, batch_transform=py[k].batch_transform)
        firsts[k] = next(iter(fresh))["image"]
        del fresh
    same = all(torch.allclose(firsts["pyloader_w1"], v, atol=1e-5) for v in firsts.values())

    typical, equal = TypicalImageDataset(jpegs, labels), EqualDecodeDataset(jpegs, labels)
    sub = list(range(min(n, args.sweep_images)))

    def torch_loader(d: torch.utils.data.Dataset, w: int, subset: bool) -> torch.utils.data.DataLoader:
        if subset:
            d = torch.utils.data.Subset(d, sub)
        # Not persistent: no variant's idle workers stay alive while another is measured
        # (with them, num_workers=0 in the main process measured slower here); every epoch
        # starts its workers (a fork, tens of ms), as torch's default does.
        return torch.utils.data.DataLoader(d, batch_size=bs, shuffle=True, num_workers=w)

    counts: dict[str, int] = {}
    # Sweep torch's num_workers on a subset (every figure side by side, interleaved).
    sweep = {f"torch_{kind}_w{w}": torch_loader(d, w, True)
             for kind, d in (("typical", typical), ("equal", equal)) for w in args.torch_workers}
    print(f"   sweep: torch num_workers {args.torch_workers} on {len(sub)} images", file=sys.stderr, flush=True)
    for ldr in sweep.values():  # warm-up: one batch each (imports, first decode)
        check_image_batch(next(iter(ldr)))
    raw_sweep = B.interleaved({k: timed_epoch(v, counts, k, check_image_batch) for k, v in sweep.items()},
                              args.sweep_rounds)
    sweep_sps = {k: counts[k] / statistics.median(v) for k, v in raw_sweep.items()}
    best = {kind: max(args.torch_workers, key=lambda w: sweep_sps[f"torch_{kind}_w{w}"])
            for kind in ("typical", "equal")}

    main = dict(py)
    main["torch_typical_best"] = torch_loader(typical, best["typical"], False)
    main["torch_equal_best"] = torch_loader(equal, best["equal"], False)
    print(f"   main: {list(main)} on {n} images, {args.rounds} rounds", file=sys.stderr, flush=True)
    for k, ldr in main.items():
        timed_epoch(ldr, counts, k, check_image_batch)()
    loader_stats: dict[str, Any] = {}

    def with_stats(k: str) -> Callable[[], float]:
        run = timed_epoch(main[k], counts, k, check_image_batch)
        if not k.startswith("pyloader"):
            return run

        def run_and_record() -> float:
            dt = run()
            st = main[k].stats()
            loader_stats[k] = {s: st.get(s) for s in ("transform_per_sample_us", "transform_busy_fraction",
                                                      "wait_fraction", "transform_hint", "decode_s", "transform_s")}
            return dt
        return run_and_record

    raw = B.interleaved({k: with_stats(k) for k in main}, args.rounds)
    sps = {k: counts[k] / statistics.median(v) for k, v in raw.items()}
    ratios = {
        "pyloader_w2_over_torch_typical_best": paired_ratio(raw["torch_typical_best"], raw["pyloader_w2"]),
        "pyloader_w2_over_torch_equal_best": paired_ratio(raw["torch_equal_best"], raw["pyloader_w2"]),
        "pyloader_w2_over_w1": paired_ratio(raw["pyloader_w1"], raw["pyloader_w2"]),
        "fused_norm_over_batch_norm": paired_ratio(raw["pyloader_w2_batch_norm"], raw["pyloader_w2"]),
    }
    ranges = {
        "pyloader_w2_over_torch_typical_best": ratio_range(raw["torch_typical_best"], raw["pyloader_w2"]),
        "pyloader_w2_over_torch_equal_best": ratio_range(raw["torch_equal_best"], raw["pyloader_w2"]),
        "pyloader_w2_over_w1": ratio_range(raw["pyloader_w1"], raw["pyloader_w2"]),
        "fused_norm_over_batch_norm": ratio_range(raw["pyloader_w2_batch_norm"], raw["pyloader_w2"]),
    }
    overlap = bench_overlap(args, ds, typical, bs)
    sizes = [len(b) for b in jpegs]
    return {"overlap": overlap, "images": n, "batch_size": bs, "generate_s": gen_s, "jpeg_bytes_mean": statistics.mean(sizes),
            "same_first_batch_across_pyloader_variants": same,
            "sweep_images": len(sub), "sweep_seconds": raw_sweep, "sweep_samples_per_s": sweep_sps,
            "torch_best_workers": best, "seconds": raw, "samples": counts, "samples_per_s": sps,
            "ratios": ratios, "ranges": ranges, "pyloader_stats_last_epoch": loader_stats}


def bench_overlap(args: argparse.Namespace, ds: Any, typical: torch.utils.data.Dataset, bs: int) -> dict[str, Any]:
    """(4): the busy fraction of a loop whose every batch is followed by a --step-ms step."""
    step = args.step_ms / 1e3
    batches = args.overlap_batches
    loaders = {
        "pyloader_w2": lambda: pyloader.DataLoader(ds, batch_size=bs, num_workers=2),
        "torch_w2": lambda: torch.utils.data.DataLoader(typical, batch_size=bs, shuffle=True, num_workers=2),
    }

    def run(make: Callable[[], Any]) -> Callable[[], float]:
        def go() -> float:
            it = iter(make())
            next(it)  # start-up (worker processes, first batch) is not the steady state
            t0 = time.perf_counter()
            for _ in range(batches):
                check_image_batch(next(it))
                time.sleep(step)
            dt = time.perf_counter() - t0
            del it
            return dt
        return go

    raw = B.interleaved({k: run(v) for k, v in loaders.items()}, args.rounds)
    busy = {k: batches * step / statistics.median(v) for k, v in raw.items()}
    return {"step_ms": args.step_ms, "batches": batches, "seconds": raw, "busy_fraction": busy}


# -- (2) pure-Python transform: processes vs torch workers --------------------------------
_WORD = re.compile(r"[A-Za-z]+")


def text_features(text: bytes) -> np.ndarray:
    """Pure-Python work over one record (holds the GIL): a 64-bin histogram of hashed, normalised words."""
    counts = [0] * 64
    for word in text.decode().split():
        w = word.strip(".,;!?").lower()
        if not w:
            continue
        vowels = h = 0
        for ch in w:
            if ch in "aeiou":
                vowels += 1
            h = (h * 31 + ord(ch)) & 0xFFFF
        counts[(h + len(w) * 7 + vowels * 13) % 64] += 1
    return np.array(counts, dtype=np.int64)


def py_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """pyloader's per-sample transform for (2)."""
    return {"feat": torch.from_numpy(text_features(sample["text"])), "label": sample["label"]}


class TextFeatureDataset(torch.utils.data.Dataset):
    """The same records in a list, the same work in ``__getitem__``."""

    def __init__(self, texts: list[bytes], labels: list[int]) -> None:
        self.texts, self.labels = texts, labels

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"feat": torch.from_numpy(text_features(self.texts[i])), "label": self.labels[i]}


def bench_python(args: argparse.Namespace, path: str, texts: list[bytes], labels: list[int]) -> dict[str, Any]:
    bs, w = 64, 2
    t0 = time.perf_counter()
    for t in texts[:200]:
        text_features(t)
    per_sample_us = (time.perf_counter() - t0) / 200 * 1e6
    ds = pyloader.ShardDataset(path, shuffle=True, seed=0)
    loaders: dict[str, Any] = {
        "pyloader_processes_w2": pyloader.DataLoader(ds, batch_size=bs, num_workers=w, transform=py_transform,
                                                     executor="processes"),
        "torch_w2": torch.utils.data.DataLoader(TextFeatureDataset(texts, labels), batch_size=bs, shuffle=True,
                                                num_workers=w),
    }
    counts: dict[str, int] = {}
    peaks: dict[str, list[int]] = {k: [] for k in loaders}
    procs: dict[str, int] = {}

    def check(batch: dict[str, torch.Tensor]) -> None:
        if tuple(batch["feat"].shape[1:]) != (64,) or batch["label"].shape[0] != batch["feat"].shape[0]:
            raise AssertionError(f"unexpected batch: feat {tuple(batch['feat'].shape)}")

    def measured(k: str) -> Callable[[], float]:
        run = timed_epoch(loaders[k], counts, k, check)

        def go() -> float:
            with PeakPss() as mem:
                dt = run()
            peaks[k].append(mem.peak)
            procs[k] = mem.procs
            return dt
        return go

    alone = memory_alone(path, 1 if args.quick else 3)
    idle_pss = tree_pss_bytes()[0]
    for k in loaders:
        measured(k)()
    for v in peaks.values():
        v.clear()
    raw = B.interleaved({k: measured(k) for k in loaders}, args.rounds)
    st = loaders["pyloader_processes_w2"].stats()
    sps = {k: counts[k] / statistics.median(v) for k, v in raw.items()}
    return {"records": len(texts), "batch_size": bs, "workers": w, "transform_us_per_sample_1_thread": per_sample_us,
            "seconds": raw, "samples": counts, "samples_per_s": sps,
            "pyloader_over_torch": paired_ratio(raw["torch_w2"], raw["pyloader_processes_w2"]),
            "range": ratio_range(raw["torch_w2"], raw["pyloader_processes_w2"]),
            "idle_pss_bytes": idle_pss, "peak_pss_bytes": peaks,
            "peak_pss_median_bytes": {k: statistics.median(v) for k, v in peaks.items()},
            "max_processes_seen": procs, "memory_alone": alone,
            "pyloader_stats_last_epoch": {s: st.get(s) for s in ("transform_per_sample_us", "transform_busy_fraction",
                                                                 "wait_fraction", "transform_hint")}}


def memory_child(variant: str, path: str) -> None:
    """One loader alone in this process (``--memory-run``): prints its tree's idle and peak PSS as JSON.

    torch's side holds its records as a map-style dataset does (a list of bytes, read from
    the same shards first); pyloader's side holds only the ShardDataset (the shards mapped).
    """
    bs, w = 64, 2
    if variant == "torch":
        src = pyloader.ShardDataset(path, decode=False)
        texts, labels = [], []
        for s in src:
            texts.append(s["text"])
            labels.append(int(s["label"]))
        del src, s
        loader: Any = torch.utils.data.DataLoader(TextFeatureDataset(texts, labels), batch_size=bs, shuffle=True,
                                                  num_workers=w)
    else:
        loader = pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=0), batch_size=bs, num_workers=w,
                                     transform=py_transform, executor="processes")
    import gc as _gc

    _gc.collect()
    idle = tree_pss_bytes()[0]
    with PeakPss() as mem:
        n = sum(int(b["label"].shape[0]) for _ in range(2) for b in loader)
    print(json.dumps({"idle_pss_bytes": idle, "peak_pss_bytes": mem.peak, "samples": n}))


def memory_alone(path: str, rounds: int) -> dict[str, Any]:
    """Each side of (2) in its own fresh process, alternating: peak PSS of its tree over two epochs."""
    out: dict[str, list[dict[str, int]]] = {"pyloader": [], "torch": []}
    for _ in range(rounds):
        for variant in out:
            res = subprocess.run([sys.executable, __file__, "--memory-run", variant, path], capture_output=True,
                                 text=True, timeout=600)
            if res.returncode != 0:
                raise RuntimeError(f"--memory-run {variant} failed:\n{res.stderr}")
            out[variant].append(json.loads(res.stdout.strip().splitlines()[-1]))
    med = {k: statistics.median(r["peak_pss_bytes"] for r in v) for k, v in out.items()}
    idle = {k: statistics.median(r["idle_pss_bytes"] for r in v) for k, v in out.items()}
    return {"runs": out, "peak_pss_median_bytes": med, "idle_pss_median_bytes": idle,
            "pyloader_over_torch": med["pyloader"] / med["torch"]}


# -- (3) tokenise on the fly vs pre-tokenised --------------------------------------------
class RegexTokenizer:
    """Fallback when ``tokenizers`` is missing: words and punctuation, ids from a dict built on the corpus."""

    pattern = re.compile(r"\w+|[^\w\s]")

    def __init__(self, texts: list[str], vocab_size: int) -> None:
        freq: dict[str, int] = {}
        for t in texts:
            for tok in self.pattern.findall(t.lower()):
                freq[tok] = freq.get(tok, 0) + 1
        words = sorted(freq, key=lambda k: -freq[k])[: vocab_size - 2]
        self.vocab = {w: i + 2 for i, w in enumerate(words)}  # 0: padding, 1: unknown

    def ids(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        v = self.vocab
        return [v.get(tok, 1) for tok in self.pattern.findall(text.lower())]


def make_tokenizer(texts: list[str], vocab_size: int) -> tuple[Callable[[str], list[int]], str]:
    """A tokenizer trained on ``texts``: (text -> ids, what it is)."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    except ImportError:
        tok = RegexTokenizer(texts, vocab_size)
        return tok.ids, "regex word tokenizer (the tokenizers package is not installed)"
    import tokenizers

    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]"],
                                                       show_progress=False))

    def ids(text: str) -> list[int]:
        return bpe.encode(text).ids
    return ids, f"tokenizers {tokenizers.__version__} BPE, vocab {bpe.get_vocab_size()}"


def pad_cut(ids: list[int]) -> np.ndarray:
    """``ids`` cut or zero-padded to SEQ, as int32."""
    out = np.zeros(SEQ, np.int32)
    ids = ids[:SEQ]
    out[: len(ids)] = ids
    return out


def bench_tokenise(args: argparse.Namespace, tmp: str, path: str, texts: list[bytes],
                   labels: list[int]) -> dict[str, Any]:
    bs, w = 64, 2
    strs = [t.decode() for t in texts]
    t0 = time.perf_counter()
    tokenize, what = make_tokenizer(strs, args.vocab)
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pre = [pad_cut(tokenize(s)) for s in strs]
    pretok_s = time.perf_counter() - t0
    lengths = [len(tokenize(s)) for s in strs[:200]]
    pre_path = os.path.join(tmp, "pretokenised")
    with pyloader.ShardWriter(pre_path, {"ids": ("int32", (SEQ,)), "label": "int64"}, compression="none") as wr:
        for ids, y in zip(pre, labels):
            wr.write({"ids": ids, "label": y})

    def tokenise(sample: dict[str, Any]) -> dict[str, Any]:
        return {"ids": torch.from_numpy(pad_cut(tokenize(sample["text"].decode()))), "label": sample["label"]}

    loaders = {
        "on_the_fly": pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=0), batch_size=bs,
                                          num_workers=w, transform=tokenise),
        "pretokenised": pyloader.DataLoader(pyloader.ShardDataset(pre_path, shuffle=True, seed=0), batch_size=bs,
                                            num_workers=w),
    }
    # Both read the same records in the same order: their first batches must hold the same ids.
    a, b = (next(iter(pyloader.DataLoader(ldr.dataset, batch_size=bs, num_workers=w, transform=ldr.transform)))
            for ldr in loaders.values())
    same = bool(torch.equal(a["ids"], b["ids"].to(a["ids"].dtype)) and torch.equal(a["label"], b["label"]))

    def check(batch: dict[str, torch.Tensor]) -> None:
        if tuple(batch["ids"].shape[1:]) != (SEQ,) or batch["ids"].dtype != torch.int32:
            raise AssertionError(f"unexpected batch: ids {batch['ids'].dtype} {tuple(batch['ids'].shape)}")

    counts: dict[str, int] = {}
    for k, ldr in loaders.items():
        timed_epoch(ldr, counts, k, check)()
    raw = B.interleaved({k: timed_epoch(v, counts, k, check) for k, v in loaders.items()}, args.rounds)
    st = loaders["on_the_fly"].stats()
    sps = {k: counts[k] / statistics.median(v) for k, v in raw.items()}
    return {"tokenizer": what, "train_s": train_s, "pretokenise_s": pretok_s,
            "mean_tokens_per_record_first_200": statistics.mean(lengths), "records": len(texts), "batch_size": bs,
            "workers": w, "same_first_batch": same, "seconds": raw, "samples": counts, "samples_per_s": sps,
            "pretokenised_over_on_the_fly": paired_ratio(raw["on_the_fly"], raw["pretokenised"]),
            "range": ratio_range(raw["on_the_fly"], raw["pretokenised"]),
            "pyloader_stats_last_epoch": {s: st.get(s) for s in ("transform_per_sample_us", "transform_busy_fraction",
                                                                 "wait_fraction", "transform_hint")}}


# -- report --------------------------------------------------------------------------------
def print_table(res: dict[str, Any]) -> None:
    env = res["environment"]
    print(f"\npyloader transform benchmark  (cpus={env['cpus']}, torch {env['torch']}, "
          f"load avg {env['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}; medians of interleaved rounds)")
    im = res["images"]
    print(f"\n(1) image classification: {im['images']} JPEGs (mean {im['jpeg_bytes_mean'] / 1e3:.0f} KB), "
          f"decode + random resized crop 224 + flip + normalise, batch {im['batch_size']}")
    print(f"  torch num_workers sweep ({im['sweep_images']} images, {res['config']['sweep_rounds']} rounds), samples/s:")
    print(f"  {'':<10}" + "".join(f"{f'w={w}':>9}" for w in res["config"]["torch_workers"]))
    for kind in ("typical", "equal"):
        print(f"  {kind:<10}" + "".join(f"{im['sweep_samples_per_s'][f'torch_{kind}_w{w}']:>9.0f}"
                                        for w in res["config"]["torch_workers"]) +
              f"   best w={im['torch_best_workers'][kind]}")
    print(f"  {'variant':<36}{'samples/s':>10}")
    names = {"pyloader_w1": "pyloader threads w=1",
             "pyloader_w2": "pyloader threads w=2",
             "pyloader_w2_batch_norm": "pyloader w=2, norm as batch_transform",
             "torch_typical_best": f"torch (a) typical, w={im['torch_best_workers']['typical']}",
             "torch_equal_best": f"torch (b) equal decode, w={im['torch_best_workers']['equal']}"}
    for k, label in names.items():
        print(f"  {label:<36}{im['samples_per_s'][k]:>10.0f}")
    rows = [("pyloader w2 / torch (a) best", "pyloader_w2_over_torch_typical_best", ">= 1.5"),
            ("pyloader w2 / torch (b) best", "pyloader_w2_over_torch_equal_best", ">= 1.5"),
            ("pyloader w2 / w1 (scaling)", "pyloader_w2_over_w1", ">= 1.7"),
            ("norm in ImageDecode / batch_transform", "fused_norm_over_batch_norm", "")]
    print(f"  {'ratio (samples/s)':<36}{'median':>8}{'rounds min..max':>18}{'target':>9}")
    for label, key, target in rows:
        lo, hi = im["ranges"][key]
        print(f"  {label:<36}{im['ratios'][key]:>7.2f}x{f'{lo:.2f}..{hi:.2f}':>18}{target:>9}")
    for k, s in im["pyloader_stats_last_epoch"].items():
        print(f"  {k}: {s['transform_per_sample_us']:.0f} us/sample, workers busy {s['transform_busy_fraction']:.0%}, "
              f"consumer waits {s['wait_fraction']:.0%}: {s['transform_hint']}")
    ov = im["overlap"]
    print(f"\n(4) training loop: each batch of (1) then a {ov['step_ms']:.0f} ms simulated accelerator step, "
          f"{ov['batches']} batches after the first")
    for k, label in (("pyloader_w2", "pyloader threads w=2"), ("torch_w2", "torch DataLoader w=2")):
        print(f"  {label:<36} accelerator busy {ov['busy_fraction'][k]:.0%}")
    if not im["same_first_batch_across_pyloader_variants"]:
        print("  WARNING: the pyloader variants' first batches differ")
    py = res["python"]
    mb = 1 << 20
    print(f"\n(2) pure-Python transform ({py['transform_us_per_sample_1_thread']:.0f} us/sample on one thread, "
          f"holds the GIL), {py['records']} records, batch {py['batch_size']}, {py['workers']} workers "
          f"(idle PSS of this process {py['idle_pss_bytes'] / mb:.0f} MiB)")
    print(f"  {'variant':<36}{'samples/s':>10}{'peak PSS MiB':>14}{'processes':>11}")
    for k, label in (("pyloader_processes_w2", "pyloader executor='processes'"), ("torch_w2", "torch DataLoader")):
        print(f"  {label:<36}{py['samples_per_s'][k]:>10.0f}{py['peak_pss_median_bytes'][k] / mb:>14.0f}"
              f"{py['max_processes_seen'][k]:>11}")
    lo, hi = py["range"]
    print(f"  pyloader / torch samples/s: {py['pyloader_over_torch']:.2f}x (rounds {lo:.2f}..{hi:.2f}; target >= 1.0); "
          f"peak PSS pyloader / torch: {py['peak_pss_median_bytes']['pyloader_processes_w2'] / py['peak_pss_median_bytes']['torch_w2']:.2f}")
    al = py["memory_alone"]
    print(f"  each alone in a fresh process holding only its own data (2 epochs, peak summed PSS): pyloader "
          f"{al['peak_pss_median_bytes']['pyloader'] / mb:.0f} MiB, torch {al['peak_pss_median_bytes']['torch'] / mb:.0f} "
          f"MiB (idle {al['idle_pss_median_bytes']['pyloader'] / mb:.0f} / {al['idle_pss_median_bytes']['torch'] / mb:.0f}); "
          f"pyloader / torch {al['pyloader_over_torch']:.2f}")
    tk = res["tokenise"]
    print(f"\n(3) tokenise on the fly vs pre-tokenised ({tk['tokenizer']}; {tk['records']} records, "
          f"~{tk['mean_tokens_per_record_first_200']:.0f} tokens each, padded/cut to {SEQ}; threads, "
          f"{tk['workers']} workers)")
    print(f"  {'variant':<36}{'samples/s':>10}")
    for k in ("on_the_fly", "pretokenised"):
        print(f"  {k:<36}{tk['samples_per_s'][k]:>10.0f}")
    lo, hi = tk["range"]
    s = tk["pyloader_stats_last_epoch"]
    print(f"  pre-tokenised / on the fly: {tk['pretokenised_over_on_the_fly']:.2f}x (rounds {lo:.2f}..{hi:.2f}); "
          f"on the fly: {s['transform_per_sample_us']:.0f} us/sample, workers busy {s['transform_busy_fraction']:.0%}, "
          f"consumer waits {s['wait_fraction']:.0%}")
    if not tk["same_first_batch"]:
        print("  WARNING: the two first batches differ")
    print(f"\nwrote {res['config']['out']}  ({res['wall_s']:.0f} s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="less data and fewer rounds (< 1.5 min on 2 cores)")
    ap.add_argument("--images", type=int, help="JPEGs generated for (1) (default 3000, --quick 600)")
    ap.add_argument("--texts", type=int, help="text records for (2) and (3) (default 3000, --quick 1200)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds of every comparison")
    ap.add_argument("--step-ms", type=float, default=100.0, help="(4): simulated accelerator step per batch of 64")
    ap.add_argument("--out", default="bench_results/transforms.json")
    ap.add_argument("--memory-run", nargs=2, metavar=("VARIANT", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_run:
        memory_child(*args.memory_run)
        return 0
    # The sweep runs torch with more workers than cores on purpose.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    q = args.quick
    args.images = args.images or (600 if q else 3000)
    args.texts = args.texts or (1200 if q else 3000)
    args.rounds = args.rounds or (3 if q else 5)
    args.sweep_images = 192 if q else 640
    args.sweep_rounds = 1 if q else 2
    args.torch_workers = [0, 1, 2, 3, 4]
    args.vocab = 8000
    args.overlap_batches = 6 if q else 12
    t_start = time.perf_counter()
    env = B.environment()
    env["loadavg_start"] = list(os.getloadavg())
    env["torch_threads"] = torch.get_num_threads()
    env["pillow"] = Image.__version__
    res: dict[str, Any] = {"config": dict(vars(args)), "environment": env}
    with tempfile.TemporaryDirectory(prefix="pyloader-bench-transforms-") as tmp:
        print("== (1) image classification", file=sys.stderr, flush=True)
        res["images"] = bench_images(args, tmp)
        texts = make_texts(args.texts)
        labels = [i % 10 for i in range(len(texts))]
        text_path = os.path.join(tmp, "texts")
        with pyloader.ShardWriter(text_path, {"text": "bytes", "label": "int64"}, compression="none") as wr:
            for t, y in zip(texts, labels):
                wr.write({"text": t, "label": y})
        print("== (2) pure-Python transform", file=sys.stderr, flush=True)
        res["python"] = bench_python(args, text_path, texts, labels)
        print("== (3) tokenise", file=sys.stderr, flush=True)
        res["tokenise"] = bench_tokenise(args, tmp, text_path, texts, labels)
    res["loadavg_end"] = list(os.getloadavg())
    res["wall_s"] = time.perf_counter() - t_start
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
