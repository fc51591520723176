"""A native ``pyloader.DataLoader`` handed to accelerate: kept as it is, checked, and seen by its gradient state.

NOTE [accelerate keeps a native loader]: ``Accelerator.prepare`` rebuilds every torch
``DataLoader`` it is given (``accelerate.data_loader.prepare_data_loader``): it copies the
loader's attributes into its own ``DataLoaderShard`` or ``DataLoaderDispatcher``, which are
torch's class. A native pyloader loader rebuilt so would read its dataset sample by sample,
and, with N processes, lose data (NOTE [per-sample path under accelerate] in
``pyloader/read/frameworks.py``). accelerate leaves alone a loader whose
``_is_accelerate_prepared`` is true (its guard against wrapping a loader twice); a native
loader answers true, because it already does what the rebuild is for: each rank reads its
own share of the epoch (the dataset's rank and world size, from ``torch.distributed``),
ranks take the same number of batches, and ``set_epoch`` sets the order. When accelerate
asks, the loader first checks the ``Accelerator`` that asks (found on the call stack) and
raises ``FrameworkPathError`` at ``prepare()`` for what it cannot serve:

* ``split_batches=True`` with more than one process: accelerate would cut each batch of
  ``batch_size`` into N; the loader's batches are per rank already (the fix: build it with
  ``batch_size // N`` and leave ``split_batches`` off);
* a dataset whose rank or world size differs from the accelerator's process index and
  count (set by hand): its shares would repeat or miss data.

``dispatch_batches`` and ``even_batches`` need nothing: each rank reads its own batches in
either mode, every rank has the same number (the dataset's ``partition``: "pad" repeats at
most N-1 samples at the epoch's end, "drop" leaves out at most N-1). With
``device_placement`` on a GPU accelerator, a loader without ``device=`` is given the
accelerator's device, so its copy engine moves batches there, as accelerate's wrapper would.
Each iterator then registers with accelerate's ``GradientState`` as accelerate's own loaders
do, and marks its last batch ``end_of_dataloader``, so ``accelerator.accumulate`` syncs
gradients at the epoch's end, and names the real rows of the epoch's last global batch
(``remainder``), so ``gather_for_metrics`` leaves out the pad.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..errors import FrameworkPathError
from ..read.frameworks import calling_selves

_MAX_FRAMES = 8


def calling_accelerator() -> tuple[Any, bool | None] | None:
    """(the ``accelerate.Accelerator`` whose method is on the call stack, its ``device_placement`` argument), or None."""
    mod = sys.modules.get("accelerate.accelerator")
    cls = getattr(mod, "Accelerator", None)
    if cls is None:
        return None
    for frame, obj in calling_selves(1, _MAX_FRAMES):
        if isinstance(obj, cls):
            placement = frame.f_locals.get("device_placement")
            return obj, placement if isinstance(placement, bool) else None
    return None


def check_for_accelerate(loader: Any) -> None:
    """What a native loader checks when accelerate prepares it (NOTE [accelerate keeps a native loader])."""
    found = calling_accelerator()
    if found is None:
        return
    acc, placement = found
    processes, index = int(acc.num_processes), int(acc.process_index)
    rank, world = loader.dataset.rank_and_world()
    name = type(loader.dataset).__name__
    if processes > 1 and acc.split_batches:
        bs = loader.batch_size
        fix = f"batch_size={bs // processes}" if bs is not None and bs % processes == 0 else "batch_size=B // N"
        raise FrameworkPathError(
            f"Accelerator(split_batches=True) on {processes} processes: accelerate would split each batch of "
            f"batch_size={bs} over the processes, but a pyloader.DataLoader already reads each rank's own batches. "
            f"To fix: build the loader with {fix} (the batch each process takes) and leave split_batches off")
    if (rank, world) != (index, processes):
        raise FrameworkPathError(
            f"a pyloader.DataLoader over a {name} that reads rank {rank} of {world} was given to accelerate's "
            f"process {index} of {processes}: its ranks' shares would repeat or miss samples. To fix: leave the "
            f"dataset's rank and world_size unset (they are taken from torch.distributed) or set them to the "
            f"accelerator's process_index and num_processes")
    if placement is None:
        placement = bool(getattr(acc, "device_placement", True))
    device = getattr(acc, "device", None)
    if placement and isinstance(device, torch.device) and device.type == "cuda" and loader.device is None:
        loader.device = device
    loader._accelerate_state = gradient_state()


def gradient_state() -> Any:
    """Accelerate's ``GradientState`` (a process-wide singleton), or None when accelerate is not loaded."""
    mod = sys.modules.get("accelerate.state")
    cls = getattr(mod, "GradientState", None)
    return None if cls is None else cls()


class EpochMark:
    """What accelerate's ``GradientState`` reads of the loader being iterated (``end_of_dataloader``, ``remainder``).

    Registered with the state at the epoch's first batch and removed when the iterator ends
    or is closed. ``remainder``: the real samples of the epoch's last batch over all ranks,
    so that ``gather_for_metrics`` leaves out partition="pad"'s repeats (set by the native
    epoch where it can tell, else -1: every gathered sample is returned, the repeats too).
    """

    def __init__(self, state: Any) -> None:
        self._state = state
        self._registered = False
        self.end_of_dataloader = False
        self.remainder = -1

    def batch(self, taken: int, length: int | None) -> None:
        """The iterator returned its ``taken``-th batch of ``length``."""
        if not self._registered:
            self._registered = True
            self._state._add_dataloader(self)
        if length is not None and taken >= length:
            self.end_of_dataloader = True

    def close(self) -> None:
        """The epoch ended: the state no longer sees this loader."""
        if self._registered:
            self._registered = False
            self._state._remove_dataloader(self)


__all__ = ["EpochMark", "calling_accelerator", "check_for_accelerate", "gradient_state"]
