"""``TransformEpochs``: a DataLoader epoch through per-sample transform workers (threads or processes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..contract import PlannedDataset, default_prefetch
from ..transform import stage as _stage
from . import iterators as _it
from . import transfer as _transfer
from .core import LoaderCore


class TransformEpochs(LoaderCore):
    """``transform=`` / ``decode=`` / ``executor=`` (NOTE [thread executor], NOTE [process executor])."""

    # -- per-sample transforms (native path) -------------------------------------------
    def _transform_spec(self, epoch: int) -> _stage.TransformSpec | None:
        """What the transform workers do this epoch; None when there is nothing per sample to do."""
        ds = self.dataset
        fn = self.transform if self.transform is not None else ds.transform
        decode = dict(ds.image_decoders)
        if fn is None and not decode:
            return None
        if self.batch_size is None:
            collate = None  # the workers return samples; collate_fn applies to each (as torch's)
        else:
            collate = self.collate_fn if self.collate_fn is not None else _stage.collate_samples
        return _stage.TransformSpec(fn, decode, collate, self._order.seed, epoch,
                                    seed_globals=self.executor == "processes")

    def _iter_transformed(self, ds: PlannedDataset, epoch: int, world: int, segments: list[list[int]], plan: Any,
                          spec: _stage.TransformSpec, native_bs: int) -> _it.LoaderIterator:
        """An epoch through the transform workers (NOTE [thread executor], NOTE [process executor])."""
        from ..transform.processes import ProcessTransformStream
        from ..transform.threads import ThreadTransformStream

        units, records = plan
        gidx = ds.global_index(units, records)
        workers = self._threads
        depth = self._prefetch if self._prefetch is not None else default_prefetch(workers)
        src: Any
        if self.executor == "processes":
            src = ProcessTransformStream(ds, spec, units, records, gidx, native_bs, self.drop_last, workers=workers,
                                         depth=depth, context=self._mp_context)
        else:
            # One native thread reads and collates the raw records (memory speed); the
            # transform threads do the per-sample work.
            raw = ds.batches(native_bs, plan=plan, drop_last=self.drop_last, num_threads=1 if workers < 4 else 2,
                             prefetch=depth + workers)
            src = ThreadTransformStream(raw, ds, spec, units, records, gidx, native_bs, workers=workers, depth=depth)
        src.timeout = float(self.timeout)
        src.on_finish = self._keep_stats
        consumed = _it.ConsumedCount()
        length = len(src)
        src.consumed = consumed  # a batch whose samples were all skipped still counts as read
        self._start_run(epoch, world, segments, consumed, length)
        items: Iterator[Any] = src
        if self.batch_size is None:
            items = _it.Flattened(src, self.collate_fn)
            length = len(ds)
        stage = self._new_stage(in_slots=False)
        gen = items if stage is None else _transfer.Staged(items, stage, stage.submit_tree, go_on_after_error=True)
        return self._loader_iterator(gen, length, src, stage, consumed)


__all__ = ["TransformEpochs"]
