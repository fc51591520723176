"""The iterators of a ``pyloader.DataLoader`` epoch, and the per-sample views of its batches."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..contract import Batch, BatchStream, PlannedDataset
from ..errors import LoaderStateError
from . import transfer as _transfer


class ConsumedCount:
    """How many batches an iterator has returned to its caller."""

    __slots__ = ("batches",)

    def __init__(self) -> None:
        self.batches = 0


@dataclass
class Run:
    """The iteration in progress (or the last one): enough to describe its position."""

    epoch: int
    world_size: int
    batch_size: int
    segments: list[list[int]]  # how the epoch was consumed before this iteration
    consumed: ConsumedCount  # shared with the iterator, so it outlives it
    batches: int  # this iteration's batches per rank


def has_len(loader: Any) -> bool:
    """Whether ``len(loader)`` answers."""
    try:
        len(loader)
    except TypeError:
        return False
    return True


class HostSource(Protocol):
    """A stream whose batches live in native slots: ``PipelineStream``, or a packed stream."""

    def next_host(self) -> tuple[Any, Batch]:
        """The next batch with its native slot."""


def host_batches(src: HostSource) -> Iterator[Any]:
    """``src.next_host()`` items until the stream ends."""
    while True:
        try:
            item = src.next_host()
        except StopIteration:
            return
        yield item


class Samples:
    """Per-sample semantics on top of native batches.

    With ``batch_size=None`` yields each sample (through ``collate_fn`` when given, as torch
    applies it to single samples); else ``collate_fn(list of the batch's samples)``. An
    exception from ``collate_fn`` leaves the iteration usable (as torch's); one from the
    native pipeline ends it.
    """

    def __init__(self, src: BatchStream, ds: PlannedDataset, batch_size: int | None,
                 collate_fn: Callable[[Any], Any] | None) -> None:
        self._src = src
        self._ds = ds
        self._batch_size = batch_size
        self._collate_fn = collate_fn
        self._buf: collections.deque[Any] = collections.deque()
        self._ended = False

    def __iter__(self) -> Samples:
        return self

    def _next_samples(self) -> list[Any]:
        if self._ended:
            raise StopIteration
        try:
            batch = next(self._src)
        except BaseException:
            self._ended = True
            raise
        rows = next(iter(batch.values())).shape[0]
        return [self._ds.sample(batch, i) for i in range(rows)]

    def __next__(self) -> Any:
        fn = self._collate_fn
        if self._batch_size is None:
            while not self._buf:
                self._buf.extend(self._next_samples())
            sample = self._buf.popleft()
            return sample if fn is None else fn(sample)
        assert fn is not None
        return fn(self._next_samples())


class Flattened:
    """The samples of a transform stream that yields lists of samples (``batch_size=None``).

    ``collate_fn``, when given, is applied to each sample, as torch applies it without batching.
    """

    def __init__(self, src: Any, collate_fn: Callable[[Any], Any] | None) -> None:
        self._src = src
        self._fn = collate_fn
        self._buf: collections.deque[Any] = collections.deque()

    def __iter__(self) -> Flattened:
        return self

    def __next__(self) -> Any:
        while not self._buf:
            self._buf.extend(next(self._src))
        sample = self._buf.popleft()
        return sample if self._fn is None else self._fn(sample)


class BatchTransformed:
    """``batch_transform`` applied to each batch the loop receives, on the consumer's thread.

    After the device copy when ``device=`` is set, so it runs on the consumer's current CUDA
    stream, which the copy engine ordered after the batch's copies: GPU augmentation of one
    batch overlaps the copy of the next.
    """

    def __init__(self, src: Iterator[Any], fn: Callable[[Any], Any]) -> None:
        self._src = src
        self._fn = fn

    def __iter__(self) -> BatchTransformed:
        return self

    def __next__(self) -> Any:
        return self._fn(next(self._src))

    def close(self) -> None:
        """Closes the source (when it can be closed)."""
        close = getattr(self._src, "close", None)
        if close is not None:
            close()


class LoaderIterator:
    """The iterator of a pyloader.DataLoader epoch (native path, or a staged torch path).

    Dropping it or ``close()`` stops its native threads (the collation pipeline and the
    copy engine) as torch's iterators stop their workers. ``native``: ``source`` is a
    dataset's ``BatchStream`` (closed here, its stats reported), not torch's iterator.
    """

    def __init__(self, gen: Iterator[Any], length: int | None, source: Any, stage: Any,
                 consumed: ConsumedCount | None = None, *, native: bool = False) -> None:
        self._gen = gen
        self._len = length
        self._source: Any = source
        self._native = native
        self._stage = stage
        self._consumed = consumed if consumed is not None else ConsumedCount()
        self._closed = False
        self._final_stats: dict[str, Any] | None = None
        self.fence: _transfer.PinnedFence | None = None
        self.len_error = "this loader's dataset has no len()"
        self.on_close: Callable[[dict[str, Any]], None] | None = None
        self.mark: Any = None  # an EpochMark for accelerate (NOTE [accelerate keeps a native loader])
        if not native and hasattr(source, "_workers"):
            # torch's worker processes, as its iterator lists them (code written for torch
            # joins them); kept after close(), which lets go of the torch iterator.
            self._workers: list[Any] = source._workers

    def __iter__(self) -> LoaderIterator:
        return self

    @property
    def source(self) -> Any:
        """What it reads: the dataset's stream (native), torch's iterator, or None once closed."""
        return self._source

    def __len__(self) -> int:
        if self._len is None:
            raise TypeError(self.len_error)
        return self._len

    def __next__(self) -> Any:
        try:
            item = next(self._gen)
        except StopIteration:
            self.close()
            raise
        self._consumed.batches += 1
        if self.mark is not None:
            self.mark.batch(self._consumed.batches, self._len)
        if self.fence is not None:
            self.fence.hold(item)  # NOTE [pinned batch fence]
        return item

    def close(self) -> None:
        """Stops the native threads and the copy engine. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._final_stats = self.stats()
        except LoaderStateError:
            # A parent's iterator closed in a forked child: its native counters belong to
            # the parent, so the child keeps none (and the close below touches no lock).
            self._final_stats = {}
        if self.on_close is not None:
            self.on_close(self._final_stats)  # the loader keeps the last epoch's figures
        if self.mark is not None:
            self.mark.close()
        gen, self._gen = self._gen, iter(())
        close = getattr(gen, "close", None)
        if close is not None:
            close()
        src = self._source
        if self._native and src is not None:
            src.close()
        # torch's own iterator is left to torch (its workers stop when it is dropped, or
        # persist with persistent_workers=True).
        self._source = None
        if self._stage is not None:
            self._stage.end_epoch()  # NOTE [stage across epochs]
        # The fence is the loader's: the batches it holds are let go by the next epoch's
        # hold() once the GPU read them, or with the loader (NOTE [pinned batch fence]).

    def stats(self) -> dict[str, Any]:
        """The source's stage counters (frozen at ``close()``), with the copy engine's under ``"copy"``."""
        if self._final_stats is not None:
            return dict(self._final_stats)
        src = self._source
        s = dict(src.stats()) if self._native and src is not None else {}
        if self._stage is not None:
            s["copy"] = self._stage.counters()
        return s

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


__all__ = ["BatchTransformed", "ConsumedCount", "Flattened", "HostSource", "LoaderIterator", "Run", "Samples", "has_len",
           "host_batches"]
