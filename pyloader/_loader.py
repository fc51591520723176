"""pyloader.DataLoader over a ShardDataset: the native batched path."""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import torch

from . import _C
from ._dataset import BatchIterator, ShardDataset


class DataLoader:
    """Batches a :class:`ShardDataset` with native threads and yields dicts of tensors.

    ``num_workers`` sets the number of native collation threads (0 means one); there are
    no worker processes, no pickling and no shared-memory files. ``shuffle=None`` keeps
    the dataset's setting; ``True``/``False`` overrides it.

    Epochs: the k-th ``iter()`` of this loader reads epoch ``e + k``, where ``e`` is the
    dataset's epoch when the loader was built, so a shuffled order changes every epoch
    as with torch's DataLoader. ``set_epoch(n)`` makes the next ``iter()`` read epoch ``n``.
    """

    def __init__(self, dataset: ShardDataset, batch_size: int | None = 1, shuffle: bool | None = None,
                 num_workers: int = 0, drop_last: bool = False, *, prefetch: int | None = None) -> None:
        if not isinstance(dataset, ShardDataset):
            raise TypeError(f"pyloader.DataLoader needs a pyloader.ShardDataset, got {type(dataset).__name__}")
        if batch_size is None or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError("batch_size must be a positive int")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError("num_workers must be a non-negative int")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.prefetch = prefetch
        self._next_epoch = dataset.epoch
        self._pool = _C.SlotPool(num_fields=len(dataset.fields))
        # A weak reference: an epoch abandoned by the user (`for b in loader: break`) must
        # stop its threads as soon as the iterator is dropped, as torch's workers do.
        self._active: weakref.ref[BatchIterator] | None = None
        self._last_stats: dict[str, Any] = {}

    def set_epoch(self, epoch: int) -> None:
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError("epoch must be a non-negative int")
        self._next_epoch = epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        prev = self._active() if self._active is not None else None
        if prev is not None:
            prev.close()  # like torch: a new iter() ends the previous one
        epoch = self._next_epoch
        self._next_epoch += 1
        it = self.dataset.batches(
            self.batch_size, drop_last=self.drop_last, num_threads=max(1, self.num_workers),
            prefetch=self.prefetch, epoch=epoch, shuffle=self.shuffle, pool=self._pool,
        )
        self._active = weakref.ref(it)
        it.on_finish = self._keep_stats
        return it

    def _keep_stats(self, stats: dict[str, Any]) -> None:
        self._last_stats = stats

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def stats(self) -> dict[str, Any]:
        """Per-stage counters of the current (or last) epoch: see ``BatchIterator.stats``.

        Empty before the first ``iter()``.
        """
        it = self._active() if self._active is not None else None
        return it.stats() if it is not None else dict(self._last_stats)
