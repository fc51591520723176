"""Hugging Face ``Trainer`` reading pyloader datasets through pyloader's own loader.

``from pyloader.integrations.transformers import Trainer`` (in place of ``from transformers
import Trainer``) is the whole change: a pyloader dataset given as ``train_dataset``,
``eval_dataset`` or to ``predict`` is read by a ``pyloader.DataLoader`` -- native threads,
each rank its own share -- instead of torch's per-sample path, and
``train(resume_from_checkpoint=...)`` resumes mid-epoch exactly. Any other dataset goes
through ``transformers.Trainer`` unchanged. ``PyloaderTrainerMixin`` gives the same to a
Trainer subclass of your own (``class MyTrainer(PyloaderTrainerMixin, SFTTrainer)``).

NOTE [Trainer over a pyloader dataset]: transformers' Trainer builds a torch ``DataLoader``
over its dataset (torch's class, bound at import) and hands it to ``accelerator.prepare``;
over a pyloader dataset that is the per-sample path, which loses data on N processes
(NOTE [per-sample path under accelerate] in ``pyloader/read/frameworks.py``). The mixin
overrides the documented hooks instead: ``get_train_dataloader``, ``get_eval_dataloader``
and ``get_test_dataloader`` build a ``pyloader.DataLoader`` (which ``accelerator.prepare``
keeps: NOTE [accelerate keeps a native loader] in ``pyloader/loader/frameworks.py``), and
``get_resumed_dataloader`` turns Trainer's count of the batches it had trained on in the
interrupted epoch into ``skip_first_batches`` (NOTE [skipped batches] in
``pyloader/loader/dataloader.py``): Trainer then calls ``set_epoch(epoch)``, which keeps the
skip, and the loader reads exactly the rest of that epoch in the interrupted run's order.
From ``TrainingArguments`` the loader takes ``dataloader_drop_last``,
``dataloader_num_workers`` (native threads; 0 means 2, since threads cost no process),
``dataloader_prefetch_factor`` and ``dataloader_pin_memory`` (on a GPU). Collation is
pyloader's own when ``data_collator`` is transformers' ``default_data_collator``: the
fields ``label`` and ``label_ids`` are named ``labels`` as that collator names them, and
with ``remove_unused_columns`` the fields the model's ``forward`` does not take are left
out of each batch, as Trainer's column filter does. Another collator runs on each batch's
list of samples (after Trainer's column filter), as torch's loader would run it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import transformers
from transformers.data.data_collator import default_data_collator

from ..contract import PlannedDataset
from ..loader.dataloader import DataLoader

_LABEL_NAMES = ("label", "label_ids")
_DEFAULT_THREADS = 2


class TrainerColumns:
    """A batch as Trainer's default collator and column filter leave it (NOTE [Trainer over a pyloader dataset]).

    ``keep``: the names the model takes (None: every field).
    """

    def __init__(self, keep: frozenset[str] | None) -> None:
        self.keep = keep

    def __call__(self, batch: Any) -> Any:
        """``batch`` with ``label``/``label_ids`` named ``labels`` and only the kept fields."""
        if not isinstance(batch, Mapping):
            return batch
        out = {}
        for name, value in batch.items():
            if name in _LABEL_NAMES and "labels" not in batch:
                name = "labels"
            if self.keep is None or name in self.keep:
                out[name] = value
        if not out:
            raise ValueError(f"none of the batch's fields ({', '.join(batch)}) is an argument of the model's forward; "
                             "name the dataset's fields after forward's arguments, or set remove_unused_columns=False")
        return out


class PyloaderTrainerMixin:
    """Makes a ``transformers.Trainer`` (subclass) read pyloader datasets with ``pyloader.DataLoader``.

    Put it first among the bases: ``class MyTrainer(PyloaderTrainerMixin, Trainer)``. See
    NOTE [Trainer over a pyloader dataset] for what it takes from ``TrainingArguments``.
    """

    args: Any
    data_collator: Any
    train_dataset: Any
    eval_dataset: Any
    _train_batch_size: int
    _signature_columns: Any
    accelerator: Any

    def pyloader_loader(self, dataset: Any, batch_size: int, *, training: bool = False) -> DataLoader[Any]:
        """The ``pyloader.DataLoader`` this Trainer reads ``dataset`` with, prepared by its accelerator."""
        args = self.args
        collate = self.data_collator
        native = collate is None or collate is default_data_collator
        keep: frozenset[str] | None = None
        if args.remove_unused_columns:
            self._set_signature_columns_if_needed()  # type: ignore[attr-defined]  # Trainer's
            keep = frozenset(self._signature_columns) | {"labels"}
        columns = TrainerColumns(keep)
        workers = int(args.dataloader_num_workers) or _DEFAULT_THREADS
        loader: DataLoader[Any] = DataLoader(
            dataset, batch_size=batch_size, num_workers=workers,
            collate_fn=None if native else self._get_collator_with_removed_columns(collate),  # type: ignore[attr-defined]
            batch_transform=columns if native else None,
            drop_last=bool(args.dataloader_drop_last) if training else False,
            pin_memory=bool(args.dataloader_pin_memory) and args.device.type == "cuda",
            prefetch_factor=args.dataloader_prefetch_factor)
        prepared: DataLoader[Any] = self.accelerator.prepare(loader)
        return prepared

    def get_train_dataloader(self) -> Any:
        """A ``pyloader.DataLoader`` over a pyloader ``train_dataset``, else Trainer's loader."""
        ds = self.train_dataset
        if isinstance(ds, PlannedDataset):
            return self.pyloader_loader(ds, self._train_batch_size, training=True)
        return super().get_train_dataloader()  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """A ``pyloader.DataLoader`` over a pyloader evaluation dataset, else Trainer's loader."""
        ds = eval_dataset
        if isinstance(ds, str):
            ds = self.eval_dataset[ds]
        elif ds is None:
            ds = self.eval_dataset
        if isinstance(ds, PlannedDataset):
            return self.pyloader_loader(ds, self.args.eval_batch_size)
        return super().get_eval_dataloader(eval_dataset)  # type: ignore[misc]

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """A ``pyloader.DataLoader`` over a pyloader test dataset, else Trainer's loader."""
        if isinstance(test_dataset, PlannedDataset):
            return self.pyloader_loader(test_dataset, self.args.eval_batch_size)
        return super().get_test_dataloader(test_dataset)  # type: ignore[misc]

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """A pyloader loader skips ``num_batches`` of its next epoch unread; any other goes to Trainer's way."""
        if isinstance(dataloader, DataLoader) and isinstance(dataloader.dataset, PlannedDataset):
            return dataloader.skip_first_batches(num_batches)
        return super().get_resumed_dataloader(dataloader, num_batches)  # type: ignore[misc]


class Trainer(PyloaderTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` that reads pyloader datasets with ``pyloader.DataLoader`` (see the module docstring)."""


__all__ = ["PyloaderTrainerMixin", "Trainer", "TrainerColumns"]
