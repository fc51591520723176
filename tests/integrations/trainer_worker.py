"""One rank of a Hugging Face Trainer job (run under torchrun by test_transformers.py).

The model records the ``idx`` field of every batch it trains on; a callback marks each
epoch's start. Writes OUT/<tag>-rank{R}.json: the indices per epoch, the global step, the
loader class and its native batch count (or the error that stopped the job).
``--plain`` uses ``transformers.Trainer`` with ``train_dataset=`` a ShardDataset (the
per-sample path); otherwise ``pyloader.integrations.transformers.Trainer``.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
import transformers
from framework_util import end_job

import pyloader
from pyloader.integrations.transformers import Trainer


class Recorder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)
        self.seen: list[list[int]] = []

    def forward(self, x: torch.Tensor, idx: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        if self.training:
            self.seen[-1].extend(int(i) for i in idx)
        return {"loss": self.lin(x).pow(2).mean()}


class EpochMarks(transformers.TrainerCallback):
    def __init__(self, model: Recorder) -> None:
        self.model = model

    def on_epoch_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
        self.model.seen.append([])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--tag", default="run")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--epochs", type=float, default=2)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--resume", default=None)
    p.add_argument("--plain", action="store_true")
    a = p.parse_args()
    ds = pyloader.ShardDataset(a.data, shuffle=True, seed=5)
    model = Recorder()
    args = transformers.TrainingArguments(
        output_dir=os.path.join(a.out, "ckpt"), per_device_train_batch_size=a.batch, num_train_epochs=a.epochs,
        max_steps=a.max_steps, gradient_accumulation_steps=a.accum, use_cpu=True, report_to="none",
        logging_strategy="no", disable_tqdm=True, save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500, save_only_model=False, learning_rate=1e-3, seed=1)
    cls = transformers.Trainer if a.plain else Trainer
    trainer = cls(model=model, args=args, train_dataset=ds, callbacks=[EpochMarks(model)])
    result: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.train(resume_from_checkpoint=a.resume)
        except pyloader.FrameworkPathError as e:
            result["error"] = f"{type(e).__name__}: {e}"
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, pyloader.SlowPathWarning)]
    result["epochs"] = model.seen
    result["global_step"] = trainer.state.global_step
    loader = trainer.callback_handler.train_dataloader
    result["class"] = type(loader).__module__ + "." + type(loader).__name__ if loader is not None else None
    result["native_batches"] = loader.stats().get("batches", 0) if isinstance(loader, pyloader.DataLoader) else 0
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(a.out, f"{a.tag}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    end_job()  # not the interpreter's exit: see framework_util.end_job


if __name__ == "__main__":
    main()
