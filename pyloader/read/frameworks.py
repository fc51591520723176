"""Who reads a pyloader dataset sample by sample, and whether that reader loses data.

NOTE [per-sample path under accelerate]: a pyloader dataset is a torch ``IterableDataset``,
so a torch ``DataLoader`` can read it one sample at a time (``__iter__``), and a reader
that does not know its rank takes its rank's share from ``torch.distributed``. That is
right in a plain DDP loop, where each rank iterates its own loader. Under accelerate it is
not: Hugging Face's ``Trainer`` and ``Accelerator.prepare`` wrap a torch loader over the
dataset in ``DataLoaderDispatcher`` (rank 0 reads for every rank: the others' shares are
never read) or in ``IterableDatasetShard`` (which splits again a stream pyloader already
split). Both lose ``(N-1)/N`` of the data without a word, and on one process the
per-sample path is an order of magnitude slower than pyloader's own. So, when a dataset
is iterated sample by sample inside one of accelerate's loaders:

* with more than one process and a rank taken from the environment, it raises
  ``FrameworkPathError`` before the first sample, naming the fix;
* under ``SkipDataLoader`` (accelerate's ``skip_first_batches``, which Trainer's resume
  calls) it raises too: that loader does not forward ``set_epoch``, so it would skip into
  the dataset's own epoch, not the interrupted one;
* otherwise (one process, or ``rank``/``world_size`` set on the dataset, which tells
  accelerate's split what it needs) it warns once per process that the native pipeline
  does not run.

accelerate's loader is found on the call stack (its ``DataLoaderShard``,
``DataLoaderDispatcher``, ``SkipDataLoader`` or ``IterableDatasetShard`` object). In a torch
worker process the stack holds only torch's worker loop: there, an accelerate state of more
than one process counts as accelerate's loader. The fix in every message is the same: give
accelerate a ``pyloader.DataLoader`` (``Accelerator.prepare`` keeps it: it already reads
each rank's share natively), or, with transformers, ``pyloader.integrations.transformers.Trainer``.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import get_worker_info

from ..errors import FrameworkPathError, SlowPathWarning

# accelerate's classes that iterate a dataset sample by sample (accelerate.data_loader).
_ACCELERATE_READERS = frozenset({"DataLoaderShard", "DataLoaderDispatcher", "SkipDataLoader", "IterableDatasetShard"})
_LOSES_DATA = frozenset({"DataLoaderDispatcher", "IterableDatasetShard"})
_MAX_FRAMES = 40
_warned: set[str] = set()

FIX = ("give accelerate a pyloader.DataLoader over the dataset (Accelerator.prepare keeps it: it reads each rank's "
       "share on native threads); with transformers, use pyloader.integrations.transformers.Trainer (a Trainer that "
       "builds one). See docs/integrations.md")


def calling_selves(up: int, limit: int) -> Iterator[tuple[Any, Any]]:
    """(frame, its ``self``) of the methods on the call stack, innermost first, from ``up`` frames above.

    ``up`` counts from the function that iterates this (1: its caller); at most ``limit``
    frames are looked at. How pyloader finds the framework that called it (accelerate's
    loaders, its ``Accelerator``, Lightning's loop) without patching the framework.
    """
    frame: Any = sys._getframe(up + 1)
    for _ in range(limit):
        if frame is None:
            return
        obj = frame.f_locals.get("self")
        if obj is not None:
            yield frame, obj
        frame = frame.f_back


def _accelerate_readers() -> list[str]:
    """Class names of accelerate's loaders and dataset wrappers on the call stack, innermost first."""
    found: list[str] = []
    for _, obj in calling_selves(2, _MAX_FRAMES):
        for c in type(obj).__mro__:
            if c.__name__ in _ACCELERATE_READERS and c.__module__.startswith("accelerate."):
                if c.__name__ not in found:
                    found.append(c.__name__)
                break
    return found


def _accelerate_processes() -> int:
    """The processes of this program's accelerate state (0: no state, or accelerate not imported)."""
    state_mod = sys.modules.get("accelerate.state")
    if state_mod is None:
        return 0
    shared = getattr(getattr(state_mod, "PartialState", None), "_shared_state", None)
    if not shared:
        return 0
    n = shared.get("num_processes", 1)
    return n if isinstance(n, int) else 1


def check_per_sample_reader(dataset: Any, rank_explicit: bool, world: int) -> None:
    """Raises or warns when accelerate drives the per-sample path (NOTE [per-sample path under accelerate]).

    ``rank_explicit``: the dataset's ``rank`` and ``world_size`` were both set;
    ``world``: the world size the dataset resolved.
    """
    if "accelerate" not in sys.modules:
        return
    readers = _accelerate_readers()
    processes = _accelerate_processes()
    if readers:
        where = f"accelerate's {readers[-1]}"
        loses = any(r in _LOSES_DATA for r in readers)
    elif get_worker_info() is not None and processes > 1:
        where = "a torch worker process of a DataLoader in a program that runs accelerate"
        loses = True
    else:
        return
    name = type(dataset).__name__
    if "SkipDataLoader" in readers:
        raise FrameworkPathError(
            f"a {name} is read sample by sample by accelerate's SkipDataLoader (accelerate's skip_first_batches, "
            f"which Trainer's resume calls): it reads the dataset's own epoch ({getattr(dataset, 'epoch', '?')}), "
            f"not the one the loader was reading, so the resumed epoch would repeat some samples and miss others. "
            f"To fix: resume a pyloader.DataLoader with loader.skip_first_batches(n) or load_state_dict(); "
            f"with transformers, use pyloader.integrations.transformers.Trainer. See docs/integrations.md")
    if loses and world > 1 and not rank_explicit:
        raise FrameworkPathError(
            f"a {name} is read sample by sample by {where} on {world} processes: each process would read only its "
            f"own 1/{world} of the data and accelerate would split or dispatch it again, so most samples would never "
            f"be seen. To fix: {FIX}")
    if where in _warned:
        return
    _warned.add(where)
    warnings.warn(
        f"a {name} is read sample by sample by {where}: pyloader's native pipeline does not run (often 10x slower "
        f"per epoch) and DataLoader.stats() stays empty. To fix: {FIX}", SlowPathWarning, stacklevel=3)


__all__ = ["FIX", "calling_selves", "check_per_sample_reader"]
