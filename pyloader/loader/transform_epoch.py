"""``TransformEpochs``: a DataLoader epoch through per-sample transform workers (threads or processes)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..contract import PlannedDataset, cpu_budget, default_prefetch
from ..transform import auto as _auto
from ..transform import stage as _stage
from ..transform.auto import AutoTransformStream, ExecutorChoice, ForkFirstStream
from ..transform.tuning import TransformTune
from . import iterators as _it
from . import transfer as _transfer
from .core import LoaderCore


class TransformEpochs(LoaderCore):
    """``transform=`` / ``decode=`` / ``executor=`` (NOTE [thread executor], NOTE [process executor]).

    The executor ``"auto"`` is chosen by measurement (NOTE [executor choice]), the workers'
    count by ``num_workers="auto"`` (NOTE [transform autotune]); a process pool is kept
    across epochs with ``persistent_workers=True`` (NOTE [transform pool]).
    """

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
        return _stage.TransformSpec(fn, decode, collate, self._order.seed, epoch)

    def _executor_choice(self) -> ExecutorChoice:
        """The loader's choice under ``executor="auto"`` (NOTE [executor choice]), made at first use."""
        if self._choice is None:
            self._choice = ExecutorChoice()
        return self._choice

    def _transform_tuner(self) -> TransformTune:
        """The transform workers' tuner of ``num_workers="auto"`` (NOTE [transform autotune]), made at first use."""
        if self._ttune is None:
            self._ttune = TransformTune(self.memory_budget)
        return self._ttune

    def _iter_transformed(self, ds: PlannedDataset, epoch: int, world: int, segments: list[list[int]], plan: Any,
                          spec: _stage.TransformSpec, native_bs: int) -> _it.LoaderIterator:
        """An epoch through the transform workers (NOTE [thread executor], NOTE [process executor])."""
        units, records = plan
        gidx = ds.global_index(units, records)
        tune = self._transform_tuner() if self._auto_workers else None
        fields = getattr(ds, "fields", None) or ()
        raw_bytes = native_bs * sum(int(f.row_bytes) for f in fields if not getattr(f, "variable", True))
        choice = self._executor_choice() if self.executor == "auto" else None
        executor = self.executor if choice is None else choice.executor

        def stream(start: int, ex: str, active: int | None = None) -> _stage.TransformStream:
            return self._transform_stream(ds, spec, units, records, gidx, native_bs, start, ex, tune, raw_bytes,
                                          active)

        if choice is not None and executor == "threads" and self._tpool is not None and self._tpool.busy_with() is None:
            self._tpool.shutdown()  # processes were left for threads (ExecutorChoice.check): of no more use
            self._tpool = None
        if choice is not None and executor == "threads":
            self.__dict__.pop("_slot_reserve", None)  # (NOTE [slots across pools]): no pool will take them
        src: _stage.TransformStream | None = None
        if choice is not None and executor is None and self._fork_first(spec, tune, choice):
            # A user's transform on several workers starts on processes at once (NOTE [executor choice]).
            try:
                head = stream(0, "processes")
            except Exception:  # noqa: BLE001 - no pool could start: the probe on threads, as without it
                src = None
            else:
                choice.start_on_processes(self._threads)
                src = ForkFirstStream(head, choice, stream)
        if src is None:
            # A stream whose executor is still to be chosen starts with the one thread of the
            # scaling probe's first phase (NOTE [executor choice]).
            src = stream(0, executor or "threads", 1 if choice is not None and executor is None else None)
            if choice is not None and executor is None:
                src = AutoTransformStream(src, choice, stream,  # type: ignore[arg-type]  # a thread stream
                                          shortcut=spec.transform is not None)
        if choice is not None:
            src.extra["executor_choice"] = lambda: dict(choice.report)
        if tune is not None:
            src.extra["autotune"] = lambda: tune.report(choice.executor if choice is not None else self.executor)
        src.timeout = self.timeout  # as given: messages print it as torch does (See NOTE [timeout message])

        from ..transform.processes import ProcessTransformStream

        made = src.head if isinstance(src, ForkFirstStream) else src

        def finish(stats: dict[str, Any]) -> None:
            if choice is not None and choice.pending and isinstance(made, ProcessTransformStream):
                st = made._stats
                choice.check(st.workers, made.made[0], made.made[1], st.cpu_ns, st.queued_ns)
            self._keep_stats(stats)
            if tune is not None:
                tune.end_epoch(stats)

        src.on_finish = finish
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

    def _fork_first(self, spec: _stage.TransformSpec, tune: TransformTune | None, choice: ExecutorChoice) -> bool:
        """Whether an epoch whose executor is still open starts on processes (NOTE [executor choice])."""
        from ..transform.pool import shm_dir

        if spec.transform is None or tune is not None or self._threads < 2 or cpu_budget() < 2:
            return False
        if choice.unfinished is not None:
            return False  # a probe an earlier epoch began goes on
        ctx = self._mp_context
        method = ctx if isinstance(ctx, str) or ctx is None else ctx.get_start_method()
        if method is None:
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        if method != "fork":
            return False  # spawned workers start in seconds: the probe decides whether they pay off
        try:
            st = os.statvfs(shm_dir())
        except OSError:
            return False
        return st.f_bavail * st.f_frsize >= _auto.FORK_FIRST_ROOM

    def _transform_stream(self, ds: PlannedDataset, spec: _stage.TransformSpec, units: np.ndarray,
                          records: np.ndarray, gidx: np.ndarray, native_bs: int, start: int, executor: str,
                          tune: TransformTune | None, raw_bytes: int,
                          active: int | None = None) -> _stage.TransformStream:
        """The epoch's batches from batch ``start`` on, made by ``executor``'s workers."""
        from ..transform.threads import ThreadTransformStream

        lo = start * native_bs
        units, records, gidx = units[lo:], records[lo:], gidx[lo:]
        workers = tune.start(executor, raw_bytes) if tune is not None else self._threads
        depth = None if tune is not None else self._prefetch
        if executor == "processes":
            # Global generators are seeded per sample where a worker runs one sample at a time.
            spec = dataclasses.replace(spec, seed_globals=True)
            return self._process_stream(ds, spec, units, records, gidx, native_bs, workers,
                                        depth if depth is not None else default_prefetch(workers))
        # One native thread reads and collates the raw records (memory speed); the
        # transform threads do the per-sample work.
        raw = ds.batches(native_bs, plan=(units, records), drop_last=self.drop_last,
                         num_threads=1 if workers < 4 else 2,
                         prefetch=(depth if depth is not None else default_prefetch(workers)) + workers)
        src = ThreadTransformStream(raw, ds, spec, units, records, gidx, native_bs, workers=workers, depth=depth,
                                    active=active)
        src.tuner = tune
        return src

    def _process_stream(self, ds: PlannedDataset, spec: _stage.TransformSpec, units: np.ndarray, records: np.ndarray,
                        gidx: np.ndarray, native_bs: int, workers: int, depth: int) -> _stage.TransformStream:
        """A process stream on the loader's kept pool, or on a pool of its own (NOTE [transform pool])."""
        from ..transform.pool import SlotReserve, WorkerPool, pool_key
        from ..transform.processes import ProcessTransformStream

        keep = self.persistent_workers
        max_workers = max(workers, self._ttune.max_processes if self._ttune is not None else workers)
        kept = self._tpool if keep else None
        if kept is not None and kept.busy_with() is not None:
            kept = None  # another live iterator's: this epoch gets a pool of its own
        elif kept is not None and not (kept.usable and kept.key == pool_key(ds, spec)
                                       and kept.context == self._mp_context and workers <= kept.max_workers):
            kept.shutdown()  # a dead worker, another transform or dataset: of no more use
            self._tpool = kept = None
        pool = kept
        if pool is None:
            reserve = None
            if not keep:  # the slots of the last epoch's pool (NOTE [slots across pools])
                reserve = self.__dict__.get("_slot_reserve")
                if reserve is None:
                    reserve = self._slot_reserve = SlotReserve()
            # Its workers start with the stream, on their first job (NOTE [first job at fork]).
            pool = WorkerPool(ds, spec, 0, context=self._mp_context, max_workers=max_workers, reserve=reserve)
            if keep and self._tpool is None:
                self._tpool = pool
        owns = pool is not self._tpool
        return ProcessTransformStream(pool, spec, units, records, gidx, native_bs, self.drop_last, workers=workers,
                                      depth=depth, owns_pool=owns)


__all__ = ["TransformEpochs"]
