"""Batches a training framework took from a loader but has not yet given to a training step.

NOTE [batches Lightning holds]: a loader's state counts the batches its caller received
(NOTE [resume state]). Lightning's training loop is that caller, but for a loader without a
length (``pack=``) it is one batch ahead of the step: its ``_PrefetchDataFetcher`` takes a
batch before the step that uses it, to know whether it is the epoch's last. When Lightning
saves a checkpoint (``CombinedLoader._state_dicts`` from the fit loop's
``on_save_checkpoint``, at any hook), the loader has delivered the batches of the steps taken
plus the one the fetcher holds, so a state counting them all would make the resumed job
skip that batch (measured: 1 batch of 102, 94 tokens, never trained after a resume at
step 5 of an epoch). The loader asks here, when its state is taken, how many of its batches
Lightning's fetcher holds, and describes its position before them, so the resumed job
starts with the batch the fetcher held.

The fetcher is found as accelerate's ``Accelerator`` is (NOTE [accelerate keeps a native
loader]): on the call stack, through the Lightning loop whose method called ``state_dict()``
(its ``trainer.fit_loop``); only its attributes are read, nothing of Lightning is replaced.
A held batch is one of this loader's when the loader is among the fit loop's train loaders
and, in Lightning's "sequential" mode, the held item names its index (every other mode takes
one batch from each loader per step). The caller counts it only while its own iterator has
not ended: once it has, what the fetcher holds for it is the end (Lightning's fetchers hold at
most one batch). A state taken outside a Lightning loop (``trainer.save_checkpoint`` from a
script after ``fit`` returned, a state taken by hand) sees no fetcher and counts every batch.
A loader with a length needs none of this: Lightning does not prefetch when the train
loaders' combined length is known.
"""

from __future__ import annotations

import sys
from typing import Any

_LOOP_MODULES = ("lightning.pytorch.loops.loop", "pytorch_lightning.loops.loop")
_MAX_FRAMES = 12  # a hook's state_dict() is within a few frames of the loop that called it


def _calling_trainer() -> Any:
    """The Lightning ``Trainer`` whose loop is on the call stack, or None."""
    bases = tuple(cls for name in _LOOP_MODULES if (cls := getattr(sys.modules.get(name), "_Loop", None)) is not None)
    if not bases:
        return None
    frame: Any = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, bases):
            return getattr(obj, "trainer", None)
        frame = frame.f_back
    return None


def held_by_lightning(loader: Any) -> int:
    """How many of ``loader``'s batches Lightning's training fetcher holds ahead of the step (NOTE [batches Lightning holds])."""
    trainer = _calling_trainer()
    fit_loop = getattr(trainer, "fit_loop", None)
    fetcher = getattr(fit_loop, "_data_fetcher", None)
    combined = getattr(fit_loop, "_combined_loader", None)
    held = getattr(fetcher, "batches", None)
    if not held or not isinstance(held, list) or combined is None:
        return 0
    flat = list(getattr(combined, "flattened", []))
    index = next((i for i, dl in enumerate(flat) if dl is loader), None)
    if index is None:
        return 0
    if getattr(combined, "_mode", None) == "sequential" and len(flat) > 1:
        return sum(1 for item in held if isinstance(item, tuple) and len(item) == 3 and item[2] == index)
    return len(held)


__all__ = ["held_by_lightning"]
