"""pyloader.DataLoader over a ShardDataset: the native batched path."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import _C, _plan, _state
from ._dataset import BatchIterator, ConsumedCount, ShardDataset, resolve_rank


@dataclass
class _Run:
    """The iteration in progress (or the last one): enough to describe its position."""

    epoch: int
    world_size: int
    batch_size: int
    segments: list[list[int]]  # how the epoch was consumed before this iteration
    consumed: ConsumedCount  # shared with the iterator, so it outlives it
    batches: int  # this iteration's batches per rank


class DataLoader:
    """Batches a :class:`ShardDataset` with native threads and yields dicts of tensors.

    ``num_workers`` sets the number of native collation threads (0 means one); there are
    no worker processes, no pickling and no shared-memory files. ``shuffle=None`` keeps
    the dataset's setting; ``True``/``False`` overrides it.

    Epochs: the k-th ``iter()`` of this loader reads epoch ``e + k``, where ``e`` is the
    dataset's epoch when the loader was built, so a shuffled order changes every epoch
    as with torch's DataLoader. ``set_epoch(n)`` makes the next ``iter()`` read epoch ``n``.

    Resumption (torchdata's ``StatefulDataLoader`` names): ``state_dict()`` may be called at
    any step and returns a small JSON-able dict (NOTE [resume state] in pyloader/_state.py);
    ``load_state_dict(state)`` makes the next ``iter()`` read exactly the rest of that
    epoch, without reading what was consumed, at this loader's world size and batch size,
    which may differ from the saving job's (NOTE [resume segments] in pyloader/_plan.py).
    See docs/resume.md.
    """

    def __init__(self, dataset: ShardDataset, batch_size: int | None = 1, shuffle: bool | None = None,
                 num_workers: int = 0, drop_last: bool = False, *, prefetch: int | None = None) -> None:
        if not isinstance(dataset, ShardDataset) and not callable(getattr(dataset, "batches", None)):
            raise TypeError(f"pyloader.DataLoader needs a pyloader.ShardDataset or ParquetDataset, "
                            f"got {type(dataset).__name__}")
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
        self._run: _Run | None = None
        self._resume: list[list[int]] = []  # segments the next iter() resumes after (load_state_dict)
        # Resumable state is defined for shard datasets (their manifest fingerprints them).
        self._fingerprint = (_state.dataset_fingerprint(dataset.manifest)
                             if isinstance(dataset, ShardDataset) else None)

    @property
    def _settings(self) -> dict[str, Any]:
        """What the epoch order and partition depend on (read now: the dataset's may change)."""
        ds = self.dataset
        return _state.order_settings(
            shuffle=ds.shuffle if self.shuffle is None else self.shuffle, seed=ds.seed,
            shuffle_mode=ds.shuffle_mode, window=ds.window, partition=ds.partition)

    def set_epoch(self, epoch: int) -> None:
        """The next ``iter()`` reads epoch ``epoch`` from its start (a loaded state is dropped)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError("epoch must be a non-negative int")
        self._next_epoch = epoch
        self._run = None
        self._resume = []

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        prev = self._active() if self._active is not None else None
        if prev is not None:
            prev.close()  # like torch: a new iter() ends the previous one
        epoch = self._next_epoch
        self._next_epoch += 1
        segments, self._resume = self._resume, []
        rank, world = resolve_rank(self.dataset.rank, self.dataset.world_size)
        plan = None
        if segments:
            ds, st = self.dataset, self._settings
            plan = _plan.resume_plan(
                ds.records_per_shard, shuffle=st["shuffle"], seed=ds.seed, epoch=epoch, rank=rank,
                world_size=world, segments=segments, mode=ds.shuffle_mode, window=ds.window,
                policy=ds.partition)
        kwargs: dict[str, Any] = {} if plan is None else {"plan": plan}
        it = self.dataset.batches(
            self.batch_size, drop_last=self.drop_last, num_threads=max(1, self.num_workers),
            prefetch=self.prefetch, epoch=epoch, shuffle=self.shuffle, pool=self._pool, **kwargs,
        )
        consumed = getattr(it, "consumed", None)
        self._run = None if consumed is None else _Run(epoch, world, self.batch_size, segments, consumed, len(it))
        self._active = weakref.ref(it)
        it.on_finish = self._keep_stats
        return it

    def state_dict(self) -> dict[str, Any]:
        """This loader's position: where the next ``iter()`` of a restored loader starts.

        Mid-epoch it counts the batches the caller received (not those prefetched). Once
        every batch of an epoch was received the state names the next epoch's start.
        Cheap: no per-sample work (NOTE [resume state]).
        """
        self._require_resumable()
        run = self._run
        if run is None:  # nothing read since construction, set_epoch or load_state_dict
            epoch, segments = self._next_epoch, self._resume
        elif run.consumed.batches >= run.batches:
            epoch, segments = self._next_epoch, []
        else:
            epoch = run.epoch
            segments = _state.add_segment(run.segments, run.world_size, run.batch_size, run.consumed.batches)
        return _state.make_state(self._fingerprint, self.dataset.num_records, self._settings, epoch, segments)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next ``iter()`` read the rest of ``state``'s epoch, then epochs continue.

        The state may come from a job with another world size or batch size: the samples
        it had not consumed are spread over this loader's ranks with the same pad/drop rule
        (docs/resume.md). Raises ``ResumeError`` (a ``ValueError``) for a state taken on
        another dataset or epoch order, or one that is malformed or inconsistent.
        """
        self._require_resumable()
        epoch, segments = _state.check_state(
            state, fingerprint=self._fingerprint, records=self.dataset.num_records, settings=self._settings)
        try:  # validates the segments against the dataset now, not at the next iter()
            _plan.unread_count(self.dataset.num_records, policy=self.dataset.partition, segments=segments)
        except ValueError as e:
            raise _state.ResumeError(f"inconsistent loader state: {e}") from None
        self._next_epoch = epoch
        self._resume = segments
        self._run = None

    def _require_resumable(self) -> None:
        if self._fingerprint is None:
            raise TypeError(f"state_dict()/load_state_dict() need a ShardDataset, not {type(self.dataset).__name__}")

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
