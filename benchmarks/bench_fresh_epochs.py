"""A user's own transforms, each loader in a fresh process: epoch 1 (with the loader's construction) and epoch 3.

What a user sees the first time: a new process builds the loader and iterates it. Each run
here is a child process that imports (torch.utils.data comes with torch; pyloader, a lazy
package, loads its modules when its names are first used: they are used before the clock and
that load is reported apart), loads what its loader needs (torch: the records in memory, as a
map-style dataset holds them; pyloader: nothing, the shards are on disk, read into the page
cache just before the child starts: see ``warm_files``), then times the
loader's construction plus its first epoch, and its next epochs; it also reports
the CPU time of itself and its children (every worker reaped) per sample, a measure of the
loaders' overheads that load from other processes disturbs less than their rates.

  light     a 96x96 JPEG decoded with PIL, a random 64x64 crop, a random flip, a float CHW
            tensor normalised with torch ops (well under a millisecond a sample)
  medium    bench_user_transforms.py's image pipeline: a 320-500 px JPEG, a random resized
            crop to 224 (one PIL ``resize(box=...)``), flip, normalise (~1-2 ms)
  features  bench_user_transforms.py's numpy log-mel features of a 1 s signal
  tokenize  bench_user_transforms.py's ``tokenizers`` BPE encode of a 1-4 KB text, padded to 512

pyloader: ``DataLoader(ShardDataset(path, shuffle=True, seed=0), batch_size=64,
transform=f, num_workers=2)``, every other argument its default (``executor="auto"``,
``persistent_workers=False``). torch: ``DataLoader(ds, batch_size=64, shuffle=True,
num_workers=w, persistent_workers=True)`` for each ``w`` of --torch-workers; torch's best
configuration ("torch best": of the highest median rate over the rounds, chosen per epoch
column) is the baseline, paired round by round (each round's fastest torch run, the luckiest
of several noisy runs against pyloader's one, is reported as "torch luckiest"). Same semantics side by side (``--kept``, on by
default): ``torch-w2-fresh`` (torch's own default, ``persistent_workers=False``: new worker
processes every epoch, as pyloader's default) and ``pyloader-kept`` (pyloader with
``persistent_workers=True``, as torch's best): what each loader pays for workers forked
afresh every epoch, and what a transform whose state warms up (a tokenizer's cache) loses
with them. The ceiling: 2 (the CPUs this process may use)
forked processes running the transform alone over the records at once, as
bench_user_transforms.py measures it, before and after each round's loaders (the mean of the
two). Rounds run every loader once, in an
order rotated each round; ratios are paired per round and printed as [min, max].
The collated ceiling: the same processes running the transform and torch's
``default_collate`` over every 64 of its samples (the one copy into a batch every batching
loader's workers make), nothing handed on: the most a loader could reach. ``--baseline
ROOT`` runs the pyloader of another checkout (with its built ``_C``) in the same rounds.

Each loader's module is imported before the clock starts (``torch.utils.data``, ``pyloader``);
pyloader's construction in a fresh process still includes importing the modules it loads
on first use. Where Python writes no bytecode cache (``PYTHONDONTWRITEBYTECODE=1``, as in
this repository's development container) every run compiles them first: about 0.3 s of
the construction on 2 loaded CPUs, 0.1 s with the cache. An installed package has the cache
(pip compiles a wheel's modules at install), so the benchmark compiles pyloader's modules
(and ``--baseline``'s) before the rounds, as ``python -m compileall -q pyloader`` does.

    python benchmarks/bench_fresh_epochs.py [--rounds 3] [--only light,medium,features,tokenize] \
        [--out bench_results/fresh_epochs.json]
"""

from __future__ import annotations

import argparse
import compileall
import gc
import io
import json
import os
import pickle
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

BATCH = 64
EPOCHS = 3
HERE = os.path.dirname(os.path.abspath(__file__))
_NORM: Any = None  # (mean, std) tensors, made on first use


def light_transform(sample: dict[str, Any]) -> dict[str, Any]:
    """A 96x96 JPEG -> float32 [3, 64, 64]: a random crop, a random flip, normalised."""
    global _NORM
    import torch
    from PIL import Image

    if _NORM is None:
        _NORM = (torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1))
    img = Image.open(io.BytesIO(sample["jpeg"])).convert("RGB")
    w, h = img.size
    x0, y0 = random.randint(0, w - 64), random.randint(0, h - 64)
    img = img.crop((x0, y0, x0 + 64, y0 + 64))
    if random.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float().div_(255)
    return {"image": (x - _NORM[0]) / _NORM[1], "label": sample["label"]}


def make_small_jpegs(n: int, seed: int = 0) -> list[bytes]:
    """``n`` 96x96 JPEGs (quality 90): gradients plus noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    y = np.linspace(0, 1, 96, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 1, 96, dtype=np.float32)[None, :, None]
    for _ in range(n):
        a, b = rng.uniform(-120, 120, (2, 3)).astype(np.float32)
        img = 128 + a * x + b * y + 9 * rng.standard_normal((96, 96, 3), dtype=np.float32)
        buf = io.BytesIO()
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _user_module() -> Any:
    sys.path.insert(0, HERE)
    import bench_user_transforms as user

    return user


def transform_of(name: str, data: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The user's function of transform ``name`` (the tokenizer loaded from ``data``)."""
    if name == "light":
        return light_transform
    user = _user_module()
    if name == "tokenize":
        from tokenizers import Tokenizer

        user.TOKENIZER = Tokenizer.from_file(os.path.join(data, "tokenizer.json"))
    return {"medium": user.image_transform, "features": user.features_transform,
            "tokenize": user.tokenize_transform}[name]


def make_data(name: str, n: int, data: str) -> int:
    """Writes transform ``name``'s records: a shard dataset and a pickle of the columns; returns the count."""
    import pyloader

    user = _user_module()
    if name == "light":
        cols: dict[str, list[Any]] = {"jpeg": make_small_jpegs(n), "label": [i % 1000 for i in range(n)]}
        schema: dict[str, Any] = {"jpeg": "bytes", "label": "int64"}
    elif name == "medium":
        from bench_transforms import make_jpegs

        cols = {"jpeg": make_jpegs(n), "label": [i % 1000 for i in range(n)]}
        schema = {"jpeg": "bytes", "label": "int64"}
    elif name == "features":
        cols = {"audio": user.make_audio(n), "label": [i % 35 for i in range(n)]}
        schema = {"audio": ("float32", (user.AUDIO,)), "label": "int64"}
    else:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        texts = user.make_texts(n)
        bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
        bpe.pre_tokenizer = pre_tokenizers.Whitespace()
        bpe.train_from_iterator((t.decode() for t in texts), trainers.BpeTrainer(
            vocab_size=8000, special_tokens=["[PAD]", "[UNK]"], show_progress=False))
        bpe.save(os.path.join(data, "tokenizer.json"))
        cols = {"text": texts, "label": [i % 10 for i in range(n)]}
        schema = {"text": "bytes", "label": "int64"}
    with pyloader.ShardWriter(os.path.join(data, name), schema, compression="none") as w:
        for i in range(n):
            w.write({k: v[i] for k, v in cols.items()})
    with open(os.path.join(data, f"{name}.pkl"), "wb") as f:
        pickle.dump(cols, f)
    return n


class RecordDataset:
    """torch's side: the records in memory; ``__getitem__`` is the user's transform of one record."""

    def __init__(self, cols: dict[str, list[Any]], fn: Callable[[dict[str, Any]], Any]) -> None:
        self.cols, self.fn = cols, fn
        self.n = len(cols["label"])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.fn({k: v[i] for k, v in self.cols.items()})


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def child(kind: str, name: str, data: str, workers: int) -> dict[str, Any]:
    """One loader in this (fresh) process: construction + epoch 1, then epochs 2..EPOCHS.

    ``kind``: torch, torch-fresh (``persistent_workers=False``), pyloader or pyloader-kept
    (``persistent_workers=True``).
    """
    import multiprocessing

    import torch.utils.data

    fn = transform_of(name, data)
    cols = None
    imported = None
    if kind.startswith("torch"):
        with open(os.path.join(data, f"{name}.pkl"), "rb") as f:
            cols = pickle.load(f)
    else:
        # Imported before the clock starts, as torch.utils.data is. pyloader loads the modules
        # behind a name on its first use (a lazy package), so the names are used here: their
        # modules' load is timed apart ("import_s"), not counted as the loader's construction.
        t_imp = time.perf_counter()
        import pyloader

        _ = (pyloader.DataLoader, pyloader.ShardDataset)
        imported = time.perf_counter() - t_imp
    # A full collection before the clock, as a script's startup would have run some: else where
    # the interpreter's next one falls (50 ms over torch's objects here) depends on how many
    # objects the imports before the clock made, not on the loader timed.
    gc.collect()
    cpu0 = _cpu(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if cols is not None:
        loader: Any = torch.utils.data.DataLoader(RecordDataset(cols, fn), batch_size=BATCH, shuffle=True,
                                                  num_workers=workers,
                                                  persistent_workers=workers > 0 and kind != "torch-fresh")
    else:
        loader = pyloader.DataLoader(pyloader.ShardDataset(os.path.join(data, name), shuffle=True, seed=0),
                                     batch_size=BATCH, transform=fn, num_workers=workers,
                                     persistent_workers=kind == "pyloader-kept")
    built = time.perf_counter() - t0
    epochs, n = [], 0
    for _ in range(EPOCHS):
        t1 = time.perf_counter()
        n = 0
        for b in loader:
            n += int(b["label"].shape[0])
        epochs.append(time.perf_counter() - t1)
    out: dict[str, Any] = {"built_s": built, "epoch_s": epochs, "samples": n, "import_s": imported}
    if not kind.startswith("torch"):
        st = loader.stats()
        out["executor"] = st.get("transform_executor")
        out["executor_choice"] = st.get("executor_choice")
    del loader
    gc.collect()
    for c in multiprocessing.active_children():
        c.join(5)
    out["cpu_self_s"] = _cpu(resource.RUSAGE_SELF) - cpu0
    out["cpu_children_s"] = _cpu(resource.RUSAGE_CHILDREN)
    return out


def ceiling(name: str, data: str, seconds: float = 1.0) -> tuple[float, float]:
    """(samples/s of the CPUs' processes running the transform alone at once, CPU us a sample on one thread)."""
    import bench_user_transforms as user

    fn = transform_of(name, data)
    with open(os.path.join(data, f"{name}.pkl"), "rb") as f:
        cols = pickle.load(f)
    n = len(cols["label"])
    for i in range(10):
        fn({k: v[i] for k, v in cols.items()})
    t = time.thread_time()
    for i in range(100):
        fn({k: v[i % n] for k, v in cols.items()})
    us = (time.thread_time() - t) / 100 * 1e6
    procs = len(os.sched_getaffinity(0))
    per = max(50, int(seconds * 1e6 / us))
    return user.parallel_rate(fn, cols, procs, per), us


def collated_ceiling(name: str, data: str, seconds: float = 1.0) -> float:
    """Samples/s of the CPUs' processes each running the transform and collating every ``BATCH`` of it.

    What every batching loader's workers must do at the least (torch's ``default_collate``:
    one copy of each sample into its batch), with nothing handed to a consumer.
    """
    import bench_user_transforms as user

    fn = transform_of(name, data)
    with open(os.path.join(data, f"{name}.pkl"), "rb") as f:
        cols = pickle.load(f)
    n = len(cols["label"])
    t = time.thread_time()
    for i in range(100):
        fn({k: v[i % n] for k, v in cols.items()})
    us = (time.thread_time() - t) / 100 * 1e6
    per = max(BATCH, int(seconds * 1e6 / us) // BATCH * BATCH)
    return user.parallel_rate(fn, cols, len(os.sched_getaffinity(0)), per, collate=BATCH)


def warm_files(folder: str) -> float:
    """Reads every file of ``folder`` into the page cache; returns the share of its pages that were there before.

    A torch run loads its records into memory before its clock starts; a pyloader run reads
    its shards during its epochs, from the page cache if they are there. This machine's kernel
    reclaims page-cache pages left untouched for a while by itself (a DAMON ``pageout``
    scheme): shards written minutes before were 8-58% cached, and an epoch that reads the rest
    from the disk measures the disk, not the loader. So each pyloader run starts with its
    shards read just before, as each torch run starts with its records loaded.
    """
    from pyloader.bench import measure as B

    paths = [os.path.join(folder, n) for n in sorted(os.listdir(folder))]
    paths = [p for p in paths if os.path.isfile(p)]
    before = B.resident_fraction(paths) if paths else 1.0
    B.stream_read_gbps(paths)  # (each file read start to end, as cat reads it)
    return before


def run_child(kind: str, name: str, data: str, workers: int, root: str | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    if root is not None:  # pyloader from another checkout (--baseline)
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        kind = "pyloader"
    cached = warm_files(os.path.join(data, name)) if not kind.startswith("torch") else None
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, name, data, str(workers)],
                         capture_output=True, text=True, timeout=600, env=env)
    if out.returncode:
        raise RuntimeError(f"{kind} {name} failed:\n{out.stderr[-4000:]}")
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    res["shards_cached_before_warm"] = cached
    return res


def _span(xs: list[float]) -> str:
    return f"{min(xs):.2f}..{max(xs):.2f}"


def bench(name: str, n: int, args: argparse.Namespace, data: str) -> dict[str, Any]:
    make_data(name, n, data)
    loaders = [(f"torch-w{w}", "torch", w) for w in args.torch_workers] + [("pyloader", "pyloader", 2)]
    if args.kept:
        loaders += [("torch-w2-fresh", "torch-fresh", 2), ("pyloader-kept", "pyloader-kept", 2)]
    if args.baseline:
        loaders.append(("pyloader-base", "base", 2))
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k, _, _ in loaders}
    ceilings: list[float] = []
    collated: list[float] = []
    us = 0.0
    for r in range(args.rounds):
        c, us = ceiling(name, data)
        cc = collated_ceiling(name, data)
        order = loaders[r % len(loaders):] + loaders[:r % len(loaders)]
        for label, kind, w in order:
            runs[label].append(run_child(kind, name, data, w, args.baseline if kind == "base" else None))
        # Both ceilings again after the round's loaders: a round's ceiling is the mean of the two,
        # so a machine that slows down or speeds up within the round moves both sides alike.
        ceilings.append((c + ceiling(name, data)[0]) / 2)
        collated.append((cc + collated_ceiling(name, data)) / 2)
    rate1 = {k: [n / (d["built_s"] + d["epoch_s"][0]) for d in v] for k, v in runs.items()}
    rate3 = {k: [n / d["epoch_s"][-1] for d in v] for k, v in runs.items()}
    # torch's best: per epoch column, the torch configuration (torch-w2-fresh too) of the highest
    # median rate over the rounds, paired round by round. (The fastest torch run of each round
    # instead would pick the luckiest of three noisy runs against pyloader's one: reported too,
    # as "torch luckiest".)
    torch_keys = [k for k in runs if k.startswith("torch")]
    key1 = max(torch_keys, key=lambda k: statistics.median(rate1[k]))
    key3 = max(torch_keys, key=lambda k: statistics.median(rate3[k]))
    best1, best3 = rate1[key1], rate3[key3]
    lucky1 = [max(rate1[k][r] for k in torch_keys) for r in range(args.rounds)]
    lucky3 = [max(rate3[k][r] for k in torch_keys) for r in range(args.rounds)]
    py1, py3 = rate1["pyloader"], rate3["pyloader"]
    res = {
        "records": n, "transform_cpu_us": us, "ceiling_samples_per_s": ceilings, "runs": runs,
        "samples_per_s_epoch1": rate1, "samples_per_s_epoch3": rate3,
        "torch_best": {"epoch1": key1, "epoch3": key3},
        "pyloader_over_torch_best": {"epoch1": [a / b for a, b in zip(py1, best1)],
                                     "epoch3": [a / b for a, b in zip(py3, best3)]},
        "pyloader_over_torch_luckiest": {"epoch1": [a / b for a, b in zip(py1, lucky1)],
                                         "epoch3": [a / b for a, b in zip(py3, lucky3)]},
        "pyloader_over_ceiling": {"epoch1": [a / b for a, b in zip(py1, ceilings)],
                                  "epoch3": [a / b for a, b in zip(py3, ceilings)]},
        "torch_best_over_ceiling": {"epoch1": [a / b for a, b in zip(best1, ceilings)],
                                    "epoch3": [a / b for a, b in zip(best3, ceilings)]},
        "collated_ceiling_samples_per_s": collated,
        "pyloader_over_collated_ceiling": {"epoch1": [a / b for a, b in zip(py1, collated)],
                                           "epoch3": [a / b for a, b in zip(py3, collated)]},
        "torch_best_over_collated_ceiling": {"epoch3": [a / b for a, b in zip(best3, collated)]},
        "collated_ceiling_over_ceiling": [a / b for a, b in zip(collated, ceilings)],
        "cpu_us_per_sample": {k: [1e6 * (d["cpu_self_s"] + d["cpu_children_s"]) / (n * EPOCHS) for d in v]
                              for k, v in runs.items()},
    }
    f, c = res["pyloader_over_torch_best"], res["pyloader_over_ceiling"]
    tc = res["torch_best_over_ceiling"]
    print(f"[{name}] {n} records, {us:.0f} us CPU a sample on one thread; ceiling {min(ceilings):.0f}..{max(ceilings):.0f}"
          f" samples/s; load {os.getloadavg()[0]:.1f}", flush=True)
    for k in runs:
        cpu = res["cpu_us_per_sample"][k]
        print(f"  {k:<10} epoch 1 (with construction) {min(rate1[k]):6.0f}..{max(rate1[k]):6.0f} samples/s, "
              f"epoch {EPOCHS} {min(rate3[k]):6.0f}..{max(rate3[k]):6.0f}; CPU {min(cpu):.0f}..{max(cpu):.0f} us a sample",
              flush=True)
    lk = res["pyloader_over_torch_luckiest"]
    print(f"  pyloader / torch best ({key1}, {key3}): epoch 1 {_span(f['epoch1'])}, epoch {EPOCHS} "
          f"{_span(f['epoch3'])}; / torch luckiest (each round's fastest torch run): epoch 1 {_span(lk['epoch1'])}, "
          f"epoch {EPOCHS} {_span(lk['epoch3'])}", flush=True)
    print(f"  pyloader / torch best: epoch 1 {_span(f['epoch1'])}, epoch {EPOCHS} {_span(f['epoch3'])}; "
          f"pyloader / ceiling: epoch 1 {_span(c['epoch1'])}, epoch {EPOCHS} {_span(c['epoch3'])}; "
          f"torch best / ceiling: epoch 1 {_span(tc['epoch1'])}, epoch {EPOCHS} {_span(tc['epoch3'])}", flush=True)
    cc = res["pyloader_over_collated_ceiling"]
    print(f"  collated ceiling (the transform and its collation alone) / ceiling: "
          f"{_span(res['collated_ceiling_over_ceiling'])}; pyloader / collated ceiling: epoch 1 {_span(cc['epoch1'])}, "
          f"epoch {EPOCHS} {_span(cc['epoch3'])}; torch best / collated ceiling: epoch {EPOCHS} "
          f"{_span(res['torch_best_over_collated_ceiling']['epoch3'])}", flush=True)
    if "pyloader-kept" in runs:
        def ratio(xs: list[float], ys: list[float]) -> list[float]:
            return [x / y for x, y in zip(xs, ys)]

        same = {"epoch1": ratio(py1, rate1["torch-w2-fresh"]), "epoch3": ratio(py3, rate3["torch-w2-fresh"])}
        kept = {"epoch1": ratio(rate1["pyloader-kept"], py1), "epoch3": ratio(rate3["pyloader-kept"], py3)}
        kt, kc = ratio(rate3["pyloader-kept"], best3), ratio(rate3["pyloader-kept"], ceilings)
        res["same_semantics"] = {"pyloader_over_torch_fresh": same, "kept_over_pyloader": kept,
                                 "kept_over_torch_best_epoch3": kt, "kept_over_ceiling_epoch3": kc}
        print(f"  workers forked every epoch (both loaders' default): pyloader / torch-w2-fresh: epoch 1 "
              f"{_span(same['epoch1'])}, epoch {EPOCHS} {_span(same['epoch3'])}", flush=True)
        print(f"  workers kept (persistent_workers=True): pyloader-kept / pyloader: epoch 1 {_span(kept['epoch1'])}, "
              f"epoch {EPOCHS} {_span(kept['epoch3'])}; pyloader-kept / torch best: epoch {EPOCHS} {_span(kt)}; "
              f"/ ceiling: epoch {EPOCHS} {_span(kc)}", flush=True)
    if "pyloader-base" in runs:
        b1 = [a / b for a, b in zip(py1, rate1["pyloader-base"])]
        b3 = [a / b for a, b in zip(py3, rate3["pyloader-base"])]
        base_t = [a / b for a, b in zip(rate1["pyloader-base"], best1)]
        print(f"  pyloader / --baseline: epoch 1 {_span(b1)}, epoch {EPOCHS} {_span(b3)}; --baseline / torch best: "
              f"epoch 1 {_span(base_t)}", flush=True)
    warm = [r["shards_cached_before_warm"] for k, v in runs.items() for r in v
            if r.get("shards_cached_before_warm") is not None]
    if warm:
        print(f"  shards in the page cache before each pyloader run's warm read: {_span(warm)} of their pages "
              f"(each pyloader run starts with them read, as each torch run with its records loaded)", flush=True)
    choice = runs["pyloader"][-1].get("executor_choice") or {}
    print(f"  pyloader executor: {runs['pyloader'][-1].get('executor')} ({choice.get('why', '')}); its modules "
          f"loaded before the clock in {statistics.median(r['import_s'] for r in runs['pyloader']) * 1e3:.0f} ms "
          f"(median, once per process; 0 where the transform's own module had loaded them)", flush=True)
    return res


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="light,medium,features,tokenize")
    ap.add_argument("--records", default="light=4096,medium=768,features=1024,tokenize=2048",
                    help="records per transform, name=count pairs")
    ap.add_argument("--torch-workers", default="2,3", help="torch's num_workers to run (the best of them per round)")
    ap.add_argument("--out", default="bench_results/fresh_epochs.json")
    ap.add_argument("--kept", action=argparse.BooleanOptionalAction, default=True,
                    help="also run torch-w2-fresh and pyloader-kept (each loader with the other's worker lifetime)")
    ap.add_argument("--baseline", default=None,
                    help="a checkout with a built _C: its pyloader runs too (pyloader-base), in the same rounds")
    args = ap.parse_args()
    names = [s.strip() for s in args.only.split(",") if s.strip()]
    known = ("light", "medium", "features", "tokenize")
    if not names or any(n not in known for n in names):
        ap.error(f"--only {args.only!r}: choose among {', '.join(known)} (comma-separated)")
    args.torch_workers = [int(w) for w in args.torch_workers.split(",")]
    for root in filter(None, (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), args.baseline)):
        compileall.compile_dir(os.path.join(root, "pyloader"), quiet=1)  # the bytecode an installed package has
    counts = {"light": 4096, "medium": 768, "features": 1024, "tokenize": 2048}  # (--records' default)
    counts.update({k: int(v) for k, v in (kv.split("=") for kv in args.records.split(","))})
    res: dict[str, Any] = {"config": {**vars(args), "batch_size": BATCH, "epochs": EPOCHS},
                           "cpus": len(os.sched_getaffinity(0)), "loadavg_start": list(os.getloadavg()),
                           "transforms": {}}
    with tempfile.TemporaryDirectory(prefix="pyloader-bench-fresh-") as data:
        for name in names:
            res["transforms"][name] = bench(name, counts[name], args, data)
    res["loadavg_end"] = list(os.getloadavg())
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"wrote {args.out}; median pyloader / torch best, epoch 1: "
          + ", ".join(f"{k} {statistics.median(v['pyloader_over_torch_best']['epoch1']):.2f}"
                      for k, v in res["transforms"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
