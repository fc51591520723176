"""What a native loader reads of Lightning's training loop: the epoch it runs, and the batches it holds ahead.

Lightning drives a native ``pyloader.DataLoader`` as it drives torch's: it iterates it once
per epoch, saves its ``state_dict()`` in each checkpoint and loads it when it restarts inside
an epoch. Two things it does for torch's loaders do not reach a native loader; the loader
reads them off Lightning's loop instead, found as accelerate's ``Accelerator`` is (NOTE
[accelerate keeps a native loader]): on the call stack, through the Lightning loop whose
method called the loader (its ``trainer.fit_loop``). Only attributes are read; nothing of
Lightning is replaced. Both apply to the fit loop's train loaders only, and only while a
Lightning loop is the caller: outside one (a script, Fabric, accelerate) nothing changes.

NOTE [Lightning's epoch]: Lightning sets the epoch of torch's loaders through their
samplers: at each epoch's start it calls ``set_epoch(fit_loop.epoch_progress.current.processed)``
on ``loader.sampler`` (and ``loader.batch_sampler.sampler``). A native loader has neither,
so it would read epochs by its own count (the k-th ``iter()`` reads epoch k). That count is
Lightning's epoch in an uninterrupted run and after a resume inside an epoch (Lightning loads
the loader's state, whose epoch is Lightning's), but not after a resume from a checkpoint
taken at an epoch's end (``ModelCheckpoint``'s default) or after ``fit`` returned at
``max_steps``: Lightning loads no loader state then, and the new loader read epoch 0's order
again in Lightning's epoch 1 (measured: the resumed job's epoch 1 was, batch for batch, the
first job's epoch 0). So when Lightning's loop calls ``iter()`` on one of its train loaders,
the loader takes the epoch Lightning gives its samplers -- at that moment it already counts
the epochs Lightning has processed -- as ``set_epoch`` would (a position loaded for that
epoch is kept; ``set_epoch`` is called only when the epoch differs).

NOTE [batches Lightning holds]: a loader's state counts the batches its caller received
(NOTE [resume state]). Lightning's training loop is that caller, but for a loader without a
length (``pack=``) it is one batch ahead of the step: its ``_PrefetchDataFetcher`` takes a
batch before the step that uses it, to know whether it is the epoch's last. When Lightning
saves a checkpoint (``CombinedLoader._state_dicts`` from the fit loop's
``on_save_checkpoint``, at any hook), the loader has delivered the batches of the steps taken
plus the one the fetcher holds, so a state counting them all would make the resumed job
skip that batch (measured: 1 batch of 102, 94 tokens, never trained after a resume at step 5
of an epoch). The loader asks here, when its state is taken, how many of its batches the
fetcher holds, and describes its position before them, so the resumed job starts with the
batch the fetcher held. A held batch is one of this loader's when, in Lightning's
"sequential" mode, the held item names its index (every other mode takes one batch from each
loader per step). The caller counts it only while its own iterator has not ended: once it
has, what the fetcher holds for it is the end (Lightning's fetchers hold at most one batch).
A state taken after ``fit`` returned (``trainer.save_checkpoint`` from a script) sees no
fetcher and counts every batch; Lightning counts that epoch as ended and loads no loader state
from such a checkpoint. A loader with a length needs none of this: Lightning does
not prefetch when the train loaders' combined length is known.
"""

from __future__ import annotations

import sys
from typing import Any

from ..read.frameworks import calling_selves

_LOOP_MODULES = ("lightning.pytorch.loops.loop", "pytorch_lightning.loops.loop")
_MAX_FRAMES = 16  # the loader's iter() or state_dict() is within ten frames of the loop that called it


def _calling_fit_loop(loader: Any) -> tuple[Any, Any, int] | None:
    """(fit loop, train ``CombinedLoader``, ``loader``'s index) of the Lightning loop on the call stack, or None.

    None also when that loop's Trainer does not train on ``loader``.
    """
    bases = tuple(cls for name in _LOOP_MODULES if (cls := getattr(sys.modules.get(name), "_Loop", None)) is not None)
    if not bases:
        return None
    for _, obj in calling_selves(2, _MAX_FRAMES):
        if isinstance(obj, bases):
            fit_loop = getattr(getattr(obj, "trainer", None), "fit_loop", None)
            combined = getattr(fit_loop, "_combined_loader", None)
            flat = list(getattr(combined, "flattened", None) or [])
            index = next((i for i, dl in enumerate(flat) if dl is loader), None)
            return None if index is None else (fit_loop, combined, index)
    return None


def lightning_epoch(loader: Any) -> int | None:
    """The epoch Lightning's training loop runs when it calls ``iter()`` on ``loader``, else None (NOTE [Lightning's epoch])."""
    found = _calling_fit_loop(loader)
    if found is None:
        return None
    progress = getattr(getattr(found[0], "epoch_progress", None), "current", None)
    epoch = getattr(progress, "processed", None)
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 else None


def held_by_lightning(loader: Any) -> int:
    """How many of ``loader``'s batches Lightning's training fetcher holds ahead of the step (NOTE [batches Lightning holds])."""
    found = _calling_fit_loop(loader)
    if found is None:
        return 0
    fit_loop, combined, index = found
    held = getattr(getattr(fit_loop, "_data_fetcher", None), "batches", None)
    if not held or not isinstance(held, list):
        return 0
    if getattr(combined, "_mode", None) == "sequential" and len(combined.flattened) > 1:
        return sum(1 for item in held if isinstance(item, tuple) and len(item) == 3 and item[2] == index)
    return len(held)


__all__ = ["held_by_lightning", "lightning_epoch"]
