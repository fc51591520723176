"""One rank of an accelerate job (run under torchrun, or alone, by test_accelerate.py).

Runs the scenarios named on the command line, one after another in this process, each
with an ``Accelerator`` of its own configuration, and writes OUT/<scenario>-rank{R}.json:
the record indices each epoch delivered, the class of the loader ``prepare`` returned,
the loader's native batch count, the steps at which ``accelerator.accumulate`` synced,
the SlowPathWarnings seen, or the FrameworkPathError that stopped the scenario.
``gather`` writes what ``gather_for_metrics`` returned over an epoch instead.

Scenarios: ``default``, ``nodispatch`` (dispatch_batches=False), ``uneven``
(even_batches=False), ``split`` (split_batches=True), ``torch`` (a torch DataLoader over
the dataset: the per-sample path), ``stop`` (``save_state`` after STOP_AT batches of
epoch 1, then stop, as a killed job would), ``resume`` (a fresh job: ``load_state``
and the rest) and ``swap`` (the one-import swap: ``torch.utils.data.DataLoader`` is
``pyloader.DataLoader`` before accelerate is imported, over a TensorDataset; run it alone
in its job: ``--patch``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from typing import Any

import torch
import torch.utils.data
from framework_util import end_job

import pyloader

STOP_AT = 5  # batches of epoch 1 taken before the checkpoint of "stop"


def run(scenario: str, a: argparse.Namespace) -> dict[str, Any]:
    from accelerate import Accelerator, DataLoaderConfiguration

    cfg = DataLoaderConfiguration(dispatch_batches=False if scenario == "nodispatch" else None,
                                  split_batches=scenario == "split", even_batches=scenario != "uneven")
    acc = Accelerator(dataloader_config=cfg, cpu=True, gradient_accumulation_steps=4)
    ds = pyloader.ShardDataset(a.data, shuffle=True, seed=3)
    loader: Any
    if scenario == "swap":
        n = pyloader.ShardDataset(a.data).num_records
        tensors = torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 8),
                                                 torch.arange(n))
        loader = torch.utils.data.DataLoader(tensors, batch_size=a.batch, shuffle=True)  # pyloader's, patched
    elif scenario == "torch":
        loader = torch.utils.data.DataLoader(ds, batch_size=a.batch)
    else:
        loader = pyloader.DataLoader(ds, batch_size=a.batch, num_workers=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out: dict[str, Any] = {"rank": acc.process_index}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model, opt, dl = acc.prepare(model, opt, loader)
            out["kept"] = dl is loader
            out["class"] = type(dl).__module__ + "." + type(dl).__name__
            first = 0
            if scenario in ("stop", "resume"):
                acc.register_for_checkpointing(dl)
            if scenario == "resume":
                acc.load_state(os.path.join(a.out, "ckpt"))
                first = dl.state_dict()["epoch"]
            if scenario == "gather":  # evaluation: every rank's batches gathered, the pad left out
                gathered: list[int] = []
                for batch in dl:
                    gathered += acc.gather_for_metrics(batch["idx"]).tolist()
                out["gathered"] = gathered
                return out
            epochs, syncs, times = [], [], []
            for epoch in range(first, a.epochs):
                dl.set_epoch(epoch)
                seen: list[int] = []
                t0 = time.perf_counter()
                for step, batch in enumerate(dl):
                    if scenario == "swap":
                        batch = {"x": batch[0], "idx": batch[1]}
                    seen += batch["idx"].tolist()
                    with acc.accumulate(model):
                        acc.backward(model(batch["x"]).pow(2).mean())
                        if acc.sync_gradients:
                            syncs.append([epoch, step])
                        opt.step()
                        opt.zero_grad()
                    if scenario == "stop" and epoch == 1 and step + 1 == STOP_AT:
                        acc.save_state(os.path.join(a.out, "ckpt"))
                        break
                times.append(time.perf_counter() - t0)
                epochs.append([epoch, seen])
                if scenario == "stop" and epoch == 1:
                    break
            out.update(epochs=epochs, syncs=syncs, length=len(dl), times=times)
            out["native_batches"] = dl.stats().get("batches", 0) if isinstance(dl, pyloader.DataLoader) else 0
            if scenario == "swap":
                out["base"] = type(getattr(dl, "base_dataloader", None)).__name__
                out["state"] = dl.state_dict()
        except pyloader.FrameworkPathError as e:
            out["error"] = str(e)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, pyloader.SlowPathWarning)]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("scenarios", nargs="+")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--patch", action="store_true", help="torch.utils.data.DataLoader = pyloader.DataLoader first")
    a = p.parse_args()
    if a.patch:
        torch.utils.data.DataLoader = pyloader.DataLoader  # type: ignore[misc]
        torch.utils.data.dataloader.DataLoader = pyloader.DataLoader  # type: ignore[misc]
    rank = int(os.environ.get("RANK", "0"))
    for scenario in a.scenarios:
        result = run(scenario, a)
        with open(os.path.join(a.out, f"{scenario}-rank{rank}.json"), "w") as f:
            json.dump(result, f)
    end_job()  # not the interpreter's exit: see framework_util.end_job


if __name__ == "__main__":
    main()
