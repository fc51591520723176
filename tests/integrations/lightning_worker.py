"""One process of a Lightning or Fabric job (run alone, or under torchrun, by test_lightning.py).

Runs the scenarios named on the command line one after another in this process and writes
OUT/<scenario>-rank{R}.json: per epoch the batches each training step received (the
records' ``idx`` field; for the packing loader the non-padding tokens of each batch),
the batches pyloader's pipeline made (``loader.stats()["batches"]``), the class of what
the framework iterated, and the warnings Lightning emitted while it ran.

A scenario is ``<framework>-<data>-<run>``: ``trainer`` (a ``Trainer`` on as many CPU
devices as the job has processes, strategy "ddp" under torchrun) or ``fabric``; ``vec``
(a native ``pyloader.DataLoader``), ``pack`` (``pack=PackSpec(...)``, through the copy engine) or ``torch``
(torch's DataLoader over the same ShardDataset: the per-sample path); ``full`` (two
uninterrupted epochs), ``stop`` (a checkpoint after STOP_AT steps of epoch 1, then the job
stops; ModelCheckpoint also writes one at each epoch's end), ``resume`` (a fresh job: the
checkpoint of step STOP_AT, then the rest) or ``epochend`` (a fresh Trainer job from the
checkpoint of epoch 0's end).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Any

import torch
import torch.utils.data
from framework_util import end_job

import pyloader

EPOCHS = 2
STOP_EPOCH, STOP_AT = 1, 5  # the "stop" runs checkpoint after step STOP_AT of epoch STOP_EPOCH, then stop
BATCH = 8
SEQ_LEN, ROWS = 48, 2  # the packing loader's rows and rows per batch


def make_loader(data: str, a: argparse.Namespace) -> Any:
    if data == "pack":
        ds = pyloader.ShardDataset(os.path.join(a.data, "docs"), shuffle=True, seed=11)
        # device="cpu": the copy engine takes batches ahead of the caller, as on a GPU.
        return pyloader.DataLoader(ds, batch_size=ROWS, num_workers=2, pack=pyloader.PackSpec(seq_len=SEQ_LEN),
                                   device="cpu")
    ds = pyloader.ShardDataset(os.path.join(a.data, "vec"), shuffle=True, seed=3)
    if data == "torch":
        return torch.utils.data.DataLoader(ds, batch_size=BATCH)
    return pyloader.DataLoader(ds, batch_size=BATCH, num_workers=2)


def ids(batch: dict[str, torch.Tensor]) -> list[int]:
    """What a batch holds: its records' idx, or a packed batch's non-padding tokens in row order."""
    if "document_ids" in batch:
        return batch["tokens"][batch["document_ids"] >= 0].tolist()
    return batch["idx"].tolist()


def features(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "document_ids" in batch:
        return batch["tokens"].float().reshape(-1, 8)[:4] * 1e-6
    return batch["x"] / 1000


def native_batches(loader: Any) -> int:
    return int(loader.stats().get("batches", 0)) if isinstance(loader, pyloader.DataLoader) else 0


# -- Lightning's Trainer -----------------------------------------------------------------------

def run_trainer(data: str, run: str, a: argparse.Namespace, out: dict[str, Any]) -> None:
    import lightning.pytorch as pl

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)
            self.seen: list[list[Any]] = []  # [epoch, [batch, ...]]
            self.loader: Any = None

        def train_dataloader(self) -> Any:
            self.loader = make_loader(data, a)
            return self.loader

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if not self.seen or self.seen[-1][0] != self.current_epoch:  # a resumed epoch has no epoch start
                self.seen.append([self.current_epoch, []])
            self.seen[-1][1].append(ids(batch))
            return self.lin(features(batch)).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StopAt(pl.Callback):
        """Checkpoint after step STOP_AT of epoch STOP_EPOCH, then stop (a job that ends there)."""

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.current_epoch == STOP_EPOCH and batch_idx + 1 == STOP_AT:
                trainer.save_checkpoint(ckpt)
                trainer.should_stop = True

    ckpt = os.path.join(a.out, f"trainer-{data}.ckpt")
    ends = os.path.join(a.out, f"trainer-{data}-ends")  # ModelCheckpoint's, at each epoch's end
    world = int(os.environ.get("WORLD_SIZE", "1"))
    callbacks = [StopAt(), pl.callbacks.ModelCheckpoint(ends, filename="{epoch}", save_top_k=-1)] if run == "stop" else []
    trainer = pl.Trainer(
        max_epochs=EPOCHS, accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
        logger=False, enable_checkpointing=run == "stop", enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=callbacks)
    model = Recorder()
    path = {"resume": ckpt, "epochend": os.path.join(ends, "epoch=0.ckpt")}.get(run)
    trainer.fit(model, ckpt_path=path)
    out.update(epochs=model.seen, native_batches=native_batches(model.loader),
               iterated=type(trainer.train_dataloader).__name__, global_step=trainer.global_step)


# -- Fabric ----------------------------------------------------------------------------------

def run_fabric(data: str, run: str, a: argparse.Namespace, out: dict[str, Any]) -> None:
    import lightning.fabric as lf

    world = int(os.environ.get("WORLD_SIZE", "1"))
    fabric = lf.Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto")
    fabric.launch()
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    loader = make_loader(data, a)
    dl = fabric.setup_dataloaders(loader)
    out["kept"] = getattr(dl, "_dataloader", None) is loader
    ckpt = os.path.join(a.out, f"fabric-{data}.ckpt")
    first = 0
    if run == "resume":
        state: dict[str, Any] = {"loader": dl, "epoch": 0}  # Fabric unwraps dl: the loader's load_state_dict
        fabric.load(ckpt, state)
        first = state["epoch"]
    seen: list[list[Any]] = []
    for epoch in range(first, EPOCHS):
        seen.append([epoch, []])
        for step, batch in enumerate(dl):
            seen[-1][1].append(ids(batch))
            fabric.backward(model(features(batch)).pow(2).mean())
            opt.step()
            opt.zero_grad()
            if run == "stop" and epoch == STOP_EPOCH and step + 1 == STOP_AT:
                fabric.save(ckpt, {"loader": dl, "epoch": epoch})  # Fabric unwraps dl: the loader's state_dict
                break
        if run == "stop" and epoch == STOP_EPOCH:
            break
    out.update(epochs=seen, native_batches=native_batches(loader), iterated=type(dl).__name__)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("scenarios", nargs="+")
    a = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    for scenario in a.scenarios:
        framework, data, run = scenario.split("-")
        out: dict[str, Any] = {"rank": rank}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (run_trainer if framework == "trainer" else run_fabric)(data, run, a, out)
        out["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
        with open(os.path.join(a.out, f"{scenario}-rank{rank}.json"), "w") as f:
            json.dump(out, f)
    end_job()  # not the interpreter's exit: see framework_util.end_job


if __name__ == "__main__":
    main()
