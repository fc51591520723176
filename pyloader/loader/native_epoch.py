"""``NativeEpochs``: a DataLoader epoch over a pyloader dataset -- planned in Python, read by native pipelines."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler
from torch.utils.data.dataloader import _DatasetKind, _InfiniteConstantSampler

from ..contract import BatchStream, OrderSpec, PipelineDataset, PipelineStream, Plan, PlannedDataset, check_stream_args
from . import autotune as _autotune
from . import iterators as _it
from . import state as _state
from . import transfer as _transfer
from .core import LoaderCore
from .frameworks import EpochMark
from .lightning_loop import lightning_epoch

# Records per native batch when the loader yields single samples (batch_size=None).
_SAMPLE_BATCH = 64
# See NOTE [first epoch ahead]: the largest dataset whose first epoch the constructor plans.
_FIRST_AHEAD_RECORDS = 1 << 22


class NativeEpochs(LoaderCore):
    """The native path's epochs: construction checks, threads and prefetch, epoch-ahead and the epoch order."""

    def _init_native(self, shuffle: bool | None, sampler: Any, batch_sampler: Any, multiprocessing_context: Any) -> None:
        name = type(self.dataset).__name__
        for arg, value in (("sampler", sampler), ("batch_sampler", batch_sampler)):
            if value is not None:
                raise ValueError(f"DataLoader over a {name}: {arg} is not supported; the order is planned natively "
                                 f"from (seed, epoch, rank, world size): use shuffle=, generator= or the dataset's "
                                 f"shuffle/seed/shuffle_mode")
        if self.worker_init_fn is not None:
            raise ValueError(f"DataLoader over a {name}: worker_init_fn is not supported; the native path has no "
                             f"worker processes to initialise (num_workers sets native threads)")
        if multiprocessing_context is not None:
            if self.executor == "threads" or self._transform_spec(0) is None:
                raise ValueError(f"DataLoader over a {name}: multiprocessing_context is not supported here; the "
                                 f"native path starts no processes, except the transform workers of a transform= "
                                 f"(or decode=) on executor='processes' or 'auto'")
            self._mp_context = multiprocessing_context
        bs = self.batch_size
        if bs is None and self.drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")
        if self._dataset_kind == _DatasetKind.Iterable:
            # What torch's DataLoader holds for an iterable dataset (code that reads them
            # finds the same objects); the native path plans without them.
            self.sampler = _InfiniteConstantSampler()
            if bs is not None:
                self.batch_sampler = BatchSampler(self.sampler, bs, self.drop_last)
        if self.pack is not None:
            self._check_pack(name)
        self._next_epoch = self.dataset.epoch
        # Resumable state is defined for datasets with a fingerprint (NOTE [resume state]).
        self._fingerprint = self.dataset.fingerprint
        self._fingerprint_parts = self.dataset.fingerprint_parts

    @property
    def _threads(self) -> int:
        """Native collation threads (read at each iter(): ``num_workers`` may be set after construction).

        With ``num_workers="auto"``: the threads started, of which the tuner lets some collate.
        """
        if self._auto_workers:
            return self._auto().max_threads
        return max(1, self.num_workers)

    @property
    def _auto_workers(self) -> bool:
        """``num_workers="auto"`` (read at each iter(), as num_workers may be set after construction)."""
        return self.__dict__.get("num_workers") == "auto"

    def _auto(self) -> _autotune.AutoTune:
        """The tuner of ``num_workers="auto"`` (NOTE [autotune]), made at first use."""
        if self._tuner is None:
            ds = self.dataset
            if not isinstance(ds, PipelineDataset) and self._transform_spec(0) is None:
                raise ValueError(f"num_workers='auto' tunes the native threads of a ShardDataset, or the transform "
                                 f"workers of a dataset with a transform; a {type(ds).__name__} without a transform "
                                 f"has neither: give num_workers a number")
            staging = self.device_prefetch if self.device is not None else 0
            self._tuner = _autotune.AutoTune(self.memory_budget, prefetch=self.prefetch, staging_slots=staging)
        return self._tuner

    @property
    def _prefetch(self) -> int | None:
        """Batches collated ahead: ``prefetch``, else ``prefetch_factor`` per thread, else the dataset's default."""
        if self._auto_workers:
            return _autotune.MAX_PREFETCH  # the ring; the tuner sets how much of it is used
        if self.prefetch is not None:
            return self.prefetch
        return None if self.prefetch_factor is None else max(1, self.prefetch_factor * self._threads)

    @property
    def _seed(self) -> int | None:
        """The ``generator``'s seed, which replaces the dataset's (None: the dataset's)."""
        return None if self.generator is None else int(self.generator.initial_seed())

    def _iter_native(self) -> _it.LoaderIterator:
        ds: PlannedDataset = self.dataset
        loop_epoch = lightning_epoch(self)  # See NOTE [Lightning's epoch]
        if loop_epoch is not None and loop_epoch != self._next_epoch:
            self.set_epoch(loop_epoch)
        epoch = self._next_epoch
        self._next_epoch += 1
        segments, self._resume = self._resume, []
        rank, world = ds.rank_and_world()
        if self.pack is not None:
            return self._iter_packed(epoch, rank, world)
        skip, self._skip = self._skip, 0
        if skip and self.batch_size is not None:  # skip_first_batches: NOTE [skipped batches]
            segments = _state.add_segment(segments, world, self.batch_size, skip)
        native_bs = _SAMPLE_BATCH if self.batch_size is None else self.batch_size
        spec = self._transform_spec(epoch)
        ahead, self._ahead = self._ahead, None
        if (spec is None and ahead is not None and not segments
                and ahead[0] == self._ahead_key(epoch, native_bs, rank, world)):
            src: BatchStream = self._adopt_ahead(ahead[1])
        else:
            if ahead is not None:
                ahead[1].close()
            # The rest of a resumed epoch, or all of it (NOTE [dataset contract]).
            plan = ds.epoch_plan(epoch, rank, world, segments, shuffle=self.shuffle, seed=self._seed)
            if spec is not None:
                return self._iter_transformed(ds, epoch, world, segments, plan, spec, native_bs)
            pool = self._pool  # made now, in the device current now (NOTE [lazy pinned pools])
            if isinstance(ds, PipelineDataset):
                src = self._pipeline_epoch(ds, native_bs, plan, pool)
            else:
                src = ds.batches(native_bs, plan=plan, drop_last=self.drop_last, num_threads=self._threads,
                                 prefetch=self._prefetch, pool=pool)
        src.timeout = self.timeout  # as given: messages print it as torch does (See NOTE [timeout message])
        src.on_finish = self._keep_stats
        consumed = _it.ConsumedCount()
        length = len(src)
        self._start_run(epoch, world, segments, consumed, length)
        # Per-sample semantics (batch_size=None, or a collate_fn over the list of samples)
        # run on the host; their results are staged like any batch.
        per_sample = self.batch_size is None or self.collate_fn is not None
        items: Iterator[Any] = _it.Samples(src, ds, self.batch_size, self.collate_fn) if per_sample else src
        if self.batch_size is None:
            length = len(ds)
        # Batches collated into the loader's own slots (a PipelineDataset's stream), and
        # their samples, are pinned when asked: nothing to stage them into.
        in_slots = isinstance(ds, PipelineDataset) and self.collate_fn is None
        stage = self._new_stage(in_slots)
        if stage is None:
            gen = items
        elif in_slots and not per_sample:
            # Zero-copy: the pinned slot a batch was collated into is the copy's source.
            submit_host = stage.submit_host
            host: PipelineStream = src  # type: ignore[assignment]  # in_slots: the dataset's PipelineStream
            gen = _transfer.Staged(_it.host_batches(host), stage, lambda item: submit_host(*item),
                                   go_on_after_error=False)
        else:
            gen = _transfer.Staged(items, stage, stage.submit_tree, go_on_after_error=per_sample)
        it = self._loader_iterator(gen, length, src, stage, consumed)
        if it.mark is not None and not segments and not per_sample and self.batch_transform is None:
            it.mark.remainder = _last_global_rows(ds.num_records, world, self._order.partition, len(src),
                                                  native_bs, self.drop_last)
        return it

    def _adopt_ahead(self, early: PipelineStream) -> PipelineStream:
        """The stream made ahead of this epoch (NOTE [epoch ahead]): its first batches are collated already."""
        if self._tuner is not None:
            early.tune(self._tuner.threads, self._tuner.prefetch)
        early.begin()
        self._watch(early)
        return early

    def _pipeline_epoch(self, ds: PipelineDataset, native_bs: int, plan: Plan, pool: Any) -> PipelineStream:
        """This epoch's native pipeline: tuned (NOTE [autotune]), and making the next epoch ahead (NOTE [epoch ahead])."""
        tuner = self._auto() if self._auto_workers else None
        if tuner is not None:
            tuner.expect(native_bs * sum(f.row_bytes for f in ds.fields if not f.variable))
        src = ds.batches(native_bs, plan=plan, drop_last=self.drop_last, num_threads=self._threads,
                         prefetch=self._prefetch, pool=pool, ahead=None if tuner is None else tuner.prefetch,
                         active_threads=None if tuner is None else tuner.threads)
        self._watch(src)
        return src

    def _watch(self, src: PipelineStream) -> None:
        """The tuner observes ``src``; the next epoch is made ahead near its end (when the dataset allows)."""
        if self._tuner is not None:
            src.tuner = self._tuner
            src.ahead_target = self._tuner.prefetch
            self._tuner.attach(src)
        if self._reads_ahead():
            native_bs = _SAMPLE_BATCH if self.batch_size is None else self.batch_size
            src.tail_hook(lambda: self._make_ahead(native_bs, src), at=max(len(src) - 3 * src.prefetch, len(src) // 2))

    # NOTE [epoch ahead]: a for-loop over epochs leaves the data path idle at every epoch
    # boundary: the last batch of epoch e is taken, then iter() plans epoch e+1, starts its
    # pipeline and waits for its first batch. Instead, when the consumer has taken all but
    # the last `3 * prefetch` batches of an epoch (or half of a shorter one), the loader
    # plans the epoch its next iter() will read and starts that epoch's pipeline, which
    # collates its first batch only. Once every batch of the current epoch is collated, the
    # last of its workers to leave lets the new pipeline collate `prefetch` batches
    # (BatchPipeline.hand_over: a worker, not the training loop, wakes the new threads, so
    # the loop is not the thread they preempt on a busy machine; not after a failed batch;
    # not while a worker of the current epoch may still need a slot, or the pool would
    # grow past the memory budget), into slots the current
    # epoch returns to the pool: it never makes one, so the current epoch keeps its CPU and
    # a first epoch pays no extra buffer memory. The next iter() adopts the early pipeline
    # if nothing its order depends on changed -- the epoch number (set_epoch), rank and
    # world size, shuffle and seed, batch size, drop_last, threads, prefetch, the slot pool
    # -- and no resume state was loaded; the pipeline may then grow the pool again.
    # Otherwise it is closed and the epoch starts as usual, so order, resume and set_epoch
    # stay exact. Only for local ShardDatasets without transforms: a remote dataset's fetch
    # schedule belongs to the epoch being read, and a transform stream has workers of its
    # own. The early pipeline stops when the loader is dropped; after the last epoch of a
    # job its few batches are unused.
    def _reads_ahead(self) -> bool:
        ds = self.dataset
        return isinstance(ds, PipelineDataset) and ds.early_streams and self.pack is None

    def _ahead_key(self, epoch: int, native_bs: int, rank: int, world: int) -> tuple[Any, ...]:
        return (epoch, rank, world, self._order, native_bs, self.drop_last, self._threads, self._prefetch,
                self._batch_pool)

    def _make_ahead(self, native_bs: int, current: PipelineStream) -> None:
        """Starts the pipeline of the epoch the next iter() reads (NOTE [epoch ahead])."""
        if self._resume or self._batch_pool is None:
            return
        newest = self._active() if self._active is not None else None
        if newest is None or newest.source is not current:
            return  # an older iterator's stream: only the newest makes the epoch ahead (NOTE [iterators of one loader])
        current.hand_over(self._early_stream(native_bs, ahead=1))

    def _early_stream(self, native_bs: int, ahead: int, planned: tuple[int, int, int, Any] | None = None
                      ) -> PipelineStream:
        """The pipeline of the epoch the next iter() reads, made ahead (NOTE [epoch ahead]), kept in ``_ahead``.

        ``planned``: (epoch, rank, world, plan) made before, used if it is still the epoch's.
        """
        ds: PipelineDataset = self.dataset  # _reads_ahead: a PipelineDataset
        epoch = self._next_epoch
        rank, world = ds.rank_and_world()
        if planned is not None and planned[:3] == (epoch, rank, world):
            plan = planned[3]
        else:
            plan = ds.epoch_plan(epoch, rank, world, [], shuffle=self.shuffle, seed=self._seed)
        src = ds.batches(
            native_bs, plan=plan, drop_last=self.drop_last, num_threads=self._threads, prefetch=self._prefetch,
            pool=self._batch_pool, ahead=ahead, early=True,
            active_threads=self._tuner.threads if self._tuner is not None else None)
        if self._tuner is not None:
            src.ahead_target = self._tuner.prefetch
        old, self._ahead = self._ahead, (self._ahead_key(epoch, native_bs, rank, world), src)
        if old is not None:
            old[1].close()
        return src

    # NOTE [first epoch ahead]: a fresh process's first epoch paid what later epochs get
    # ahead (NOTE [epoch ahead]): iter() planned the epoch and started its pipeline (4 ms
    # for 40,000 records), whose workers then opened every shard a shuffled batch reads and
    # faulted in their first pages before the second batch came (4 ms more): the first epoch
    # of 480 MB of cached 12 KB records ran at 0.6-0.75 of the next ones, all of it start-up
    # (after its first batches it ran at the steady rate). So the constructor of a plain
    # native loader whose slots it prepares (NOTE [prepared slots] in csrc/core/slot_pool.cpp)
    # makes epoch 0's pipeline ahead too, while a script builds its model: it collates up
    # to ``prefetch`` batches into the prepared slots (an early pipeline makes none, and
    # leaves the preparing thread to finish them) and waits for iter(). As for any epoch made
    # ahead, iter() adopts it only if nothing its order depends on changed (set_epoch,
    # load_state_dict, skip_first_batches, rank and world size once a process group is up,
    # the generator's seed); otherwise it is closed and the epoch starts as before. Only for
    # datasets of up to _FIRST_AHEAD_RECORDS records, so that a plan a job may never read
    # (a resumed job's set_epoch) costs its constructor at most ~0.1 s. The epoch is planned
    # (``_first_plan``) and its pipeline started before the preparing thread starts: what they
    # do to the process's memory map (allocations, thread stacks, shard mappings) waits for
    # that thread while it populates a slot (NOTE [chunked populate] in
    # csrc/core/host_memory.cpp). Measured on 40,000 cached 12 KB records, 5 runs each: the
    # constructor returned after 3.5 ms instead of 17.8 ms (medians; the plan alone 7-10 ms of
    # wall time for 1.1-1.7 ms of CPU behind it); 150 KB records 2.6 against 38.4 ms. The
    # first epoch pays the slots' fresh pages either way (its total time unchanged within this
    # machine's noise): the script gets its constructor back sooner to build its model.
    def _first_plan(self) -> tuple[int, int, int, Any] | None:
        """(epoch, rank, world, plan) of the epoch the constructor makes ahead, if it makes one."""
        ds = self.dataset
        if (not self._reads_ahead() or self._pinned or self.pack is not None or self.batch_size is None
                or self._auto_workers or self._transform_spec(0) is not None or ds.num_records > _FIRST_AHEAD_RECORDS):
            return None
        epoch = self._next_epoch
        rank, world = ds.rank_and_world()
        try:
            return epoch, rank, world, ds.epoch_plan(epoch, rank, world, [], shuffle=self.shuffle, seed=self._seed)
        except Exception:  # noqa: BLE001 -- iter() plans the epoch again, and raises what it raises
            return None

    def _make_first_ahead(self, planned: tuple[int, int, int, Any] | None) -> None:
        if planned is None or self._batch_pool is None or self._batch_pool.pinned or self.batch_size is None:
            return
        try:
            self._early_stream(self.batch_size,
                               ahead=check_stream_args(self.batch_size, self._threads, self._prefetch)[2],
                               planned=planned)
        except Exception:  # noqa: BLE001 -- e.g. ThreadStartError: iter() starts the epoch, and raises it, as before
            self._ahead = None

    def _start_run(self, epoch: int, world: int, segments: list[list[int]], consumed: _it.ConsumedCount,
                   length: int) -> None:
        if self.batch_size is not None and self._fingerprint is not None:
            self._run = _it.Run(epoch, world, self.batch_size, segments, consumed, length)
        else:
            self._run = None

    def _loader_iterator(self, gen: Iterator[Any], length: int | None, src: Any, stage: Any,
                         consumed: _it.ConsumedCount) -> _it.LoaderIterator:
        if self.batch_transform is not None:
            gen = _it.BatchTransformed(gen, self.batch_transform)
        it = _it.LoaderIterator(gen, length, src, stage, consumed=consumed, native=True)
        it.on_close = self._keep_stats
        it.fence = self._fence(stage)
        if self._accelerate_state is not None:
            it.mark = EpochMark(self._accelerate_state)  # NOTE [accelerate keeps a native loader]
        return it

    # -- epochs and resumption (native path) ---------------------------------------------
    @property
    def _order(self) -> OrderSpec:
        """The order this loader reads.

        The dataset's (read now: it may change), with the loader's ``shuffle`` and
        ``generator`` seed overrides.
        """
        spec: OrderSpec = self.dataset.order
        return spec.with_overrides(shuffle=self.shuffle, seed=self._seed)

    @property
    def _settings(self) -> dict[str, Any]:
        """What the epoch order and partition depend on (the order keys of a state).

        A dataset whose window shuffle orders files first (``unit_files``: a ParquetDataset)
        adds ``window_units="files"`` (NOTE [resume state]).
        """
        settings = self._order.settings()
        if getattr(self.dataset, "unit_files", None) is not None:
            settings["window_units"] = "files"
        return settings


def _last_global_rows(records: int, world: int, partition: str, batches: int, batch_size: int, drop_last: bool) -> int:
    """The real samples of an epoch's last batch over all ranks, for accelerate's ``gather_for_metrics`` (-1: unknown).

    See NOTE [accelerate keeps a native loader]. accelerate gathers each rank's last batch in
    rank order and keeps the first ``remainder`` rows. partition="pad" puts its repeats at
    the end of the last rank's block (``pyloader.read.order.partition``), so they are the
    last rows of the gathered batch when they fit in the last rank's last batch.
    """
    if partition != "pad" or drop_last or batches == 0:
        return -1
    per = -(-records // world)
    pad = per * world - records
    last = per - (batches - 1) * batch_size
    if last <= 0 or pad > last:
        return -1
    return world * last - pad


__all__ = ["NativeEpochs"]
