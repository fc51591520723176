"""Epoch time under the training frameworks: pyloader against torch's DataLoader, same framework, same data.

For each framework (accelerate, transformers' Trainer, Lightning, Fabric) and process count
(1, and 2 under torchrun with gloo on the CPU), the same tiny model trains for ``--epochs``
epochs on the same records, read either by pyloader (a ``pyloader.DataLoader`` over a
ShardDataset, as docs/integrations.md hands it to each framework) or by torch's DataLoader
(a map-style dataset over the same arrays in ``.npy`` files, memory-mapped, with
``num_workers`` worker processes and persistent workers: the usual torch setup, each
framework adding its own DistributedSampler or batch-sampler sharding). With ``--per-sample``
also accelerate over a torch DataLoader over the ShardDataset itself: what a user got before
pyloader's loader was kept by ``prepare`` (the per-sample path; one process, where it only
warns). The model's step is a few microseconds, so the epoch time is the data path's plus the
framework's per-step cost, which both loaders pay.

Each run is a fresh job; the runs alternate loaders, ``--rounds`` times. Reported per
(framework, processes, loader): the median over rounds of the median steady epoch (every
epoch after the first), the first epoch, and every sample counted (each epoch's union over
ranks must be the dataset). The ratio is torch's epoch time over pyloader's: above 1,
pyloader is faster. Writes bench_results/frameworks.json.

Usage: python benchmarks/bench_frameworks.py [--records 20000] [--epochs 3] [--rounds 2]
           [--frameworks accelerate,trainer,lightning,fabric] [--procs 1,2] [--per-sample]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (3, 64, 64)  # 12 KB uint8 records, the image-like profile of pyloader bench
BATCH = 128
WORKERS = 2


# -- the worker: one rank of one run ------------------------------------------------------------
class NpyImages:
    """torch's side: a map-style dataset over the same records as ``.npy`` arrays (memory-mapped)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.image: Any = None
        self.n = int(np.load(os.path.join(folder, "idx.npy"), mmap_mode="r").shape[0])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        if self.image is None:  # opened in each worker process
            self.image = np.load(os.path.join(self.folder, "image.npy"), mmap_mode="r")
            self.idx = np.load(os.path.join(self.folder, "idx.npy"), mmap_mode="r")
        return {"image": torch.from_numpy(np.array(self.image[i])), "idx": torch.tensor(int(self.idx[i]))}


def _model() -> Any:
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(3))

            self.ids: list[int] = []  # what the Trainer's steps read

        def forward(self, image: Any, idx: Any = None) -> Any:
            if idx is not None and self.training:
                self.ids += idx.tolist()
            return {"loss": (image[:, :, 0, 0].float().mean(0) * self.w).sum()}

    return Tiny()


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.utils.data

    import pyloader

    rank = int(os.environ.get("RANK", "0"))
    times: list[float] = []
    seen: list[list[int]] = []
    native = a.loader == "pyloader"

    def pyloader_loader() -> Any:
        return pyloader.DataLoader(pyloader.ShardDataset(a.shards, shuffle=True, seed=0), batch_size=BATCH,
                                   num_workers=WORKERS)

    def torch_loader(sampler: Any = None) -> Any:
        ds: Any = NpyImages(a.npy) if a.loader == "torch" else pyloader.ShardDataset(a.shards, shuffle=True)
        shuffle = None if isinstance(ds, torch.utils.data.IterableDataset) or sampler is not None else True
        return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=shuffle, sampler=sampler,
                                           num_workers=0 if a.loader == "per-sample" else WORKERS,
                                           persistent_workers=a.loader == "torch")

    t = [time.perf_counter()]

    def mark(epoch_seen: list[int]) -> None:
        now = time.perf_counter()
        times.append(now - t[0])
        t[0] = now
        seen.append(epoch_seen)

    if a.framework == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model, opt, dl = acc.prepare(model, opt, pyloader_loader() if native else torch_loader())
        t[0] = time.perf_counter()
        for epoch in range(a.epochs):
            dl.set_epoch(epoch)
            ids: list[int] = []
            for batch in dl:
                acc.backward(model(batch["image"])["loss"])
                opt.step()
                opt.zero_grad()
                ids += batch["idx"].tolist()
            mark(ids)
    elif a.framework == "trainer":
        import transformers

        from pyloader.integrations.transformers import Trainer

        class Marks(transformers.TrainerCallback):
            def on_epoch_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if not times and not seen:
                    t[0] = time.perf_counter()

            def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                mark(model.ids)
                model.ids = []

        args = transformers.TrainingArguments(
            os.path.join(a.tmp, f"trainer-{rank}"), per_device_train_batch_size=BATCH, num_train_epochs=a.epochs,
            use_cpu=True, report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
            dataloader_num_workers=WORKERS, dataloader_persistent_workers=not native, remove_unused_columns=False)
        ds = pyloader.ShardDataset(a.shards, shuffle=True, seed=0) if native else NpyImages(a.npy)
        cls = Trainer if native else transformers.Trainer
        model = _model()
        cls(model=model, args=args, train_dataset=ds, callbacks=[Marks()]).train()
    elif a.framework == "lightning":
        import lightning

        class Module(lightning.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = _model()
                self.ids: list[int] = []

            def training_step(self, batch: Any, i: int) -> Any:
                self.ids += batch["idx"].tolist()
                return self.net(batch["image"])["loss"]

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.01)

            def train_dataloader(self) -> Any:
                return pyloader_loader() if native else torch_loader()

            def on_train_epoch_start(self) -> None:
                if not times:
                    t[0] = time.perf_counter()

            def on_train_epoch_end(self) -> None:
                mark(self.ids)
                self.ids = []

        trainer = lightning.Trainer(accelerator="cpu", devices=a.world, strategy="ddp" if a.world > 1 else "auto",
                                    max_epochs=a.epochs, enable_checkpointing=False, logger=False,
                                    enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Module())
    elif a.framework == "fabric":
        import lightning

        fabric = lightning.Fabric(accelerator="cpu", devices=a.world, strategy="ddp" if a.world > 1 else "auto")
        fabric.launch()
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model, opt = fabric.setup(model, opt)
        dl = fabric.setup_dataloaders(pyloader_loader() if native else torch_loader())
        t[0] = time.perf_counter()
        for _ in range(a.epochs):
            ids = []
            for batch in dl:
                fabric.backward(model(batch["image"])["loss"])
                opt.step()
                opt.zero_grad()
                ids += batch["idx"].tolist()
            mark(ids)
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump({"times": times, "seen": seen}, f)


# -- the driver ------------------------------------------------------------------------------------
def write_data(folder: str, n: int) -> tuple[str, str]:
    import pyloader

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (n, *SHAPE), dtype=np.uint8)
    idx = np.arange(n, dtype=np.int64)
    npy = os.path.join(folder, "npy")
    os.makedirs(npy)
    np.save(os.path.join(npy, "image.npy"), image)
    np.save(os.path.join(npy, "idx.npy"), idx)
    shards = os.path.join(folder, "shards")
    with pyloader.ShardWriter(shards, fields={"image": ("uint8", SHAPE), "idx": ("int64", ())},
                              shard_bytes=64 << 20) as w:
        for i in range(n):
            w.write({"image": image[i], "idx": idx[i]})
    return npy, shards


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(framework: str, loader: str, nproc: int, a: argparse.Namespace, npy: str, shards: str,
           tmp: str) -> dict[str, Any]:
    out = tempfile.mkdtemp(dir=tmp)
    args = ["--worker", "--framework", framework, "--loader", loader, "--world", str(nproc), "--epochs",
            str(a.epochs), "--npy", npy, "--shards", shards, "--out", out, "--tmp", tmp]
    script = os.path.abspath(__file__)
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", "--max-restarts=0", script, *args]
    else:
        cmd = [sys.executable, script, *args]
    env = dict(os.environ, PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TMPDIR=tmp,
               HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{framework}/{loader}/{nproc}: rc {proc.returncode}\n{proc.stderr[-3000:]}")
    ranks = []
    for r in range(nproc):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    epochs = [max(r["times"][e] for r in ranks) for e in range(a.epochs)]
    complete = None
    if ranks[0]["seen"] and ranks[0]["seen"][0]:
        complete = all(set().union(*(set(r["seen"][e]) for r in ranks)) == set(range(a.records))
                       for e in range(a.epochs))
    return {"epochs": epochs, "complete": complete}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=20000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--frameworks", default="accelerate,trainer,lightning,fabric")
    p.add_argument("--procs", default="1,2")
    p.add_argument("--per-sample", action="store_true")
    p.add_argument("--json", default=os.path.join(ROOT, "bench_results", "frameworks.json"))
    # worker arguments
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", help=argparse.SUPPRESS)
    p.add_argument("--loader", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--npy", help=argparse.SUPPRESS)
    p.add_argument("--shards", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    tmp = tempfile.mkdtemp(prefix="bench_frameworks_")
    npy, shards = write_data(tmp, a.records)
    combos = [(f, n) for f in a.frameworks.split(",") for n in map(int, a.procs.split(","))]
    rows: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for rnd in range(a.rounds):
        for f, n in combos:
            loaders = ["pyloader", "torch"] if rnd % 2 == 0 else ["torch", "pyloader"]
            if a.per_sample and f == "accelerate" and n == 1:
                loaders.append("per-sample")
            for loader in loaders:
                r = launch(f, loader, n, a, npy, shards, tmp)
                rows.setdefault((f, n, loader), []).append(r)
                print(f"round {rnd} {f:10s} x{n} {loader:10s} epochs " + " ".join(f"{e:.3f}" for e in r["epochs"])
                      + f" s, every sample: {r['complete']}", flush=True)
    table = []
    print(f"\n{a.records} records of {np.prod(SHAPE)} B, batch {BATCH} per process, {WORKERS} workers or threads, "
          f"{a.epochs} epochs, {a.rounds} rounds; epoch times in s (median over rounds)")
    print(f"{'framework':10s} {'procs':>5s} {'loader':10s} {'first':>7s} {'steady':>7s} {'torch/this':>10s}  all")
    for (f, n, loader), rs in sorted(rows.items()):
        first = statistics.median(r["epochs"][0] for r in rs)
        steady = statistics.median(statistics.median(r["epochs"][1:] or r["epochs"]) for r in rs)
        table.append({"framework": f, "processes": n, "loader": loader, "first_epoch_s": first, "steady_epoch_s": steady,
                      "every_sample": [r["complete"] for r in rs], "runs": rs})
    for row in table:
        ref = next(x for x in table if x["framework"] == row["framework"] and x["processes"] == row["processes"]
                   and x["loader"] == "torch")
        row["torch_over_this_steady"] = ref["steady_epoch_s"] / row["steady_epoch_s"]
        row["torch_over_this_first"] = ref["first_epoch_s"] / row["first_epoch_s"]
        print(f"{row['framework']:10s} {row['processes']:5d} {row['loader']:10s} {row['first_epoch_s']:7.3f} "
              f"{row['steady_epoch_s']:7.3f} {row['torch_over_this_steady']:9.2f}x  {row['every_sample']}")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump({"config": {"records": a.records, "record_bytes": int(np.prod(SHAPE)), "batch": BATCH,
                              "workers": WORKERS, "epochs": a.epochs, "rounds": a.rounds},
                   "environment": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                   "machine": platform.machine()},
                   "rows": table}, fh, indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
