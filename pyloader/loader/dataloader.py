"""pyloader.DataLoader: a drop-in replacement for ``torch.utils.data.DataLoader``.

The class is assembled from its rooms (``pyloader.loader.core`` lists them); this module
holds the constructor, ``iter()``, the epoch counter and resumption, and the figures.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.utils.data
from torch.utils.data import IterableDataset

# torch's class, bound now: a program that drops pyloader in with
# ``torch.utils.data.DataLoader = pyloader.DataLoader`` must not make the generic path (and
# the base class) find pyloader's class again. The defining module's name is the one such a
# patch leaves alone.
from torch.utils.data.dataloader import DataLoader as _TorchDataLoader
from torch.utils.data.dataloader import _DatasetKind

from ..contract import PlannedDataset, check_count
from . import iterators as _it
from . import state as _state
from .buffers import HostBuffers
from .frameworks import check_for_accelerate
from .native_epoch import NativeEpochs
from .options import LoaderOptions
from .packed_epoch import PackedEpochs
from .packing import PackSpec
from .torch_compat import TorchCompat
from .transform_epoch import TransformEpochs

_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(TorchCompat, NativeEpochs, TransformEpochs, PackedEpochs, HostBuffers,  # type: ignore[misc]
                 _TorchDataLoader[_T_co]):
    """A drop-in replacement for ``torch.utils.data.DataLoader``.

    Same constructor, same iteration semantics, plus native staging and device prefetch.

    Two paths, chosen by the dataset:

    * A pyloader dataset (``ShardDataset``, ``ParquetDataset``: any
      ``pyloader.contract.PlannedDataset``) takes the native path: the epoch
      order is planned in Python, and reading, decoding and collation run on
      ``max(1, num_workers)`` native threads -- no worker processes, no pickling, no
      ``/dev/shm``. ``prefetch_factor`` batches per thread are collated ahead. ``shuffle``
      (None: the dataset's setting) and ``generator`` (its ``initial_seed()`` replaces the
      dataset's seed) set the order; ``sampler``, ``batch_sampler``, ``worker_init_fn`` and
      ``multiprocessing_context`` need worker processes or per-index sampling and raise
      ``ValueError``. ``collate_fn`` receives the list of samples, as torch's does.
    * Any other dataset is loaded exactly as ``torch.utils.data.DataLoader`` loads it (its
      samplers, worker processes, ``get_worker_info()``, error re-raising), and pyloader
      adds the staging and device prefetch below.

    Staging and device prefetch (keyword-only extras):

    * ``pin_memory=True``: batches land in page-locked host memory from the CUDA driver --
      for the native path collated there directly, in a ring of buffers allocated once.
      Without a driver, pageable buffers are used, with one warning.
    * ``device="cuda[:N]"``: a native thread copies each batch to the GPU on its own
      non-blocking stream, ``device_prefetch`` batches ahead; the consumer's current stream
      is ordered after the copies with an event, so batches arrive as CUDA tensors ready to
      use. ``device="cpu"`` runs the same engine with its CPU copy backend.

    Epochs: the k-th ``iter()`` of a native loader reads epoch ``e + k``, where ``e`` is the
    dataset's epoch when the loader was built; ``set_epoch(n)`` makes the next ``iter()``
    read epoch ``n``. Each ``iter()`` returns an iterator of its own and leaves the earlier
    ones running, as torch's does: ``zip(loader, loader)`` yields pairs (NOTE [iterators of
    one loader]). ``state_dict()``/``load_state_dict()`` resume a native loader over a
    resumable dataset (one with a ``fingerprint``: ShardDataset, ParquetDataset) mid-epoch
    (docs/resume.md); ``state_dict()`` describes the newest iterator.

    It is a ``torch.utils.data.DataLoader`` (a subclass, generic like it:
    ``DataLoader[T]``) with torch's public attributes; ``batch_size``, ``sampler``,
    ``batch_sampler``, ``drop_last``, ``dataset`` and ``persistent_workers`` cannot be
    assigned once it is built (NOTE [torch's DataLoader attributes]).
    """

    # The native path uses the dataset contract (PlannedDataset), not torch's Dataset type.
    dataset: Any
    collate_fn: Any


    def __init__(self, dataset: torch.utils.data.Dataset[_T_co], batch_size: int | None = 1,
                 shuffle: bool | None = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int | str = 0,
                 collate_fn: Callable[[Any], Any] | None = None, pin_memory: bool = False, drop_last: bool = False,
                 timeout: float = 0, worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, generator: torch.Generator | None = None, *,
                 prefetch_factor: int | None = None, persistent_workers: bool = False, pin_memory_device: str = "",
                 in_order: bool = True, device: str | torch.device | int | None = None, device_prefetch: int = 2,
                 prefetch: int | None = None, transform: Callable[..., Any] | None = None,
                 executor: str = "auto", batch_transform: Callable[[Any], Any] | None = None,
                 memory_budget: int | None = None, pack: PackSpec | None = None) -> None:
        # torch's __init__ is not run: the attributes torch's own code reads are set here
        # (NOTE [torch's DataLoader attributes]), from the options checked once (NOTE [loader options]).
        try:
            opts = LoaderOptions(
                batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, collate_fn=collate_fn,
                pin_memory=pin_memory, drop_last=drop_last, timeout=timeout, worker_init_fn=worker_init_fn,
                generator=generator, prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                pin_memory_device=pin_memory_device, in_order=in_order, device=device,  # type: ignore[arg-type]
                device_prefetch=device_prefetch, prefetch=prefetch, transform=transform, executor=executor,
                batch_transform=batch_transform, memory_budget=memory_budget, pack=pack)
        except ValueError:
            if (not isinstance(dataset, PlannedDataset) and not isinstance(num_workers, str)
                    and (sampler is not None or batch_sampler is not None)):
                # torch's words for torch's arguments (STYLE 11): over a torch dataset, a
                # combination with a sampler that torch itself refuses gets torch's message,
                # whichever check pyloader's options would have made first (a bad value alone
                # gets its setting's one rule, the same from every receiver: test_settings).
                try:
                    _TorchDataLoader(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                                     batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
                                     pin_memory=False, drop_last=drop_last, timeout=timeout,
                                     worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                                     generator=generator, prefetch_factor=prefetch_factor,
                                     persistent_workers=persistent_workers, in_order=in_order)
                except Exception as torch_says:  # noqa: BLE001 - re-raised as torch raised it
                    raise torch_says from None
            raise
        self._options = opts
        for name in ("batch_size", "shuffle", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout",
                     "worker_init_fn", "generator", "prefetch_factor", "persistent_workers", "pin_memory_device",
                     "in_order", "device", "device_prefetch", "prefetch", "transform", "executor", "batch_transform",
                     "memory_budget", "pack"):
            setattr(self, name, getattr(opts, name))
        self.dataset = dataset
        self._pack_field = -1
        self._pack_resume = []  # packing phases of a loaded state (NOTE [packing resume])
        self._pack_run = None  # (epoch, world, rank, phases, stream, consumed)
        self._doc_pool = None  # the packer's input documents (NOTE [ragged batches])
        self._tuner = None  # NOTE [autotune], made with the dataset's checks
        self._choice = None  # See NOTE [executor choice]; made at the first transform epoch
        self._ttune = None  # See NOTE [transform autotune]; likewise
        self._tpool = None  # the process pool kept across epochs: See NOTE [transform pool]
        self._mp_context = None
        self._active = None
        self._pid = os.getpid()  # NOTE [loader across fork]
        self._last_stats = {}
        self._run = None
        self._resume = []
        self._skip = 0  # NOTE [skipped batches]
        self._torch_run = None  # NOTE [generic loader state]
        self._torch_resume = None
        self._torch_epoch = 0
        self._accelerate_state = None  # NOTE [accelerate keeps a native loader]
        self._accelerate_prepared = False
        self._fingerprint = None  # the dataset's, when it is resumable
        self._fingerprint_parts = None  # its fingerprint_parts, if any
        self.sampler: Any = None
        self.batch_sampler: Any = None
        self._dataset_kind = _DatasetKind.Iterable if isinstance(dataset, IterableDataset) else _DatasetKind.Map
        self._len_called: int | None = None  # _IterableDataset_len_called of the native path
        # Host buffers are made at the first iter(), not here (NOTE [lazy pinned pools]).
        self._batch_pool = None  # see _pool
        self._ahead = None  # (key, stream): NOTE [epoch ahead]
        self._staging_pool = None  # see _staging()
        self._kept_stage = None  # NOTE [stage across epochs]
        self._kept_fence = None  # NOTE [pinned batch fence]
        self._inner = None  # the generic path's torch loader
        self._native = isinstance(dataset, PlannedDataset)  # NOTE [dataset contract]
        if self._native:
            self._init_native(shuffle, sampler, batch_sampler, multiprocessing_context)
            if num_workers == "auto":
                self._auto()  # raises now for what it cannot tune
            # Planned and started before the slots are prepared (See NOTE [first epoch ahead]).
            first = self._first_plan()
            slots = self._slots_to_prepare()
            self._make_first_ahead(first)
            if slots is not None:
                slots[0].prepare(count=slots[1], field_bytes=slots[2])
        else:
            self._check_generic()
            self._init_torch(shuffle, sampler, batch_sampler, multiprocessing_context)
        # From now on torch's __setattr__ refuses to change the attributes that fix the order.
        self._DataLoader__initialized = True

    def _check_generic(self) -> None:
        """What the generic path cannot do (the pyloader-only options need a pyloader dataset)."""
        name = type(self.dataset).__name__
        if self._options.num_workers == "auto":
            raise ValueError("num_workers='auto' tunes the native threads of a ShardDataset; torch's "
                             f"DataLoader over a {name} needs a number of worker processes")
        if self.prefetch is not None:
            raise ValueError("prefetch= sets native collation depth and needs a pyloader dataset; "
                             "use prefetch_factor with worker processes")
        if self.pack is not None:
            raise ValueError("pack= packs the token field of a pyloader dataset (ShardDataset or Mixture) on "
                             f"native threads, not a {name}")
        if self.transform is not None or self.executor != "auto":
            raise ValueError("transform= and executor= run per-sample transforms on a pyloader dataset's "
                             "native path; over another dataset, apply the transform in its __getitem__ "
                             "(torch's worker processes run it)")

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if os.getpid() != self._pid:
            self._forked()
        # See NOTE [iterators of one loader]: the previous iterator is left running.
        it = self._get_iterator()
        self._active = weakref.ref(it) if isinstance(it, _it.LoaderIterator) else None
        return it

    # NOTE [iterators of one loader]: as with torch's DataLoader, every iter() returns an
    # iterator of its own, and a new one leaves the earlier ones running: ``zip(loader,
    # loader)`` yields pairs, and interleaved next() calls on two iterators each get their
    # own epoch's batches. Each native iterator has its own pipeline (its own threads and
    # read-ahead) and its own copy engine; what they share is safe to share: the slot pool
    # (each slot is handed to one pipeline at a time, and freed when Python drops the batch),
    # the pinned fence (it holds delivered batches in delivery order, whichever iterator
    # delivered them) and the autotuner (it watches the newest stream). The k-th iter() reads
    # epoch e + k, as documented in the class docstring; without shuffling every epoch has
    # the same order, so two iterators of an unshuffled loader yield the same batches, as
    # torch's do. The newest iterator is the loader's current one: ``stats()`` and
    # ``state_dict()`` describe it, and only its stream makes the next epoch ahead (NOTE
    # [epoch ahead]). An iterator stops its threads when it is exhausted, closed or dropped.

    # NOTE [loader across fork]: a program may build a loader, or run epochs of it, and then
    # fork -- at any moment: while its slots are prepared, while its pipelines, the epoch made
    # ahead, a transform epoch or a copy engine run. The child has none of the parent's
    # threads, and the locks they held at the fork stay held in the child. What the loader
    # keeps across epochs is therefore split at the first iter() in the child: the pageable
    # slot pools are kept (the native pool makes itself whole in a child: NOTE [slot pools
    # across fork] in csrc/core/slot_pool.cpp), everything that has threads or a GPU context
    # -- the parent's epoch in progress, the epoch made ahead (NOTE [epoch ahead]), the copy
    # engine kept across epochs, the fence, pinned pools -- is let go without closing (each
    # refuses to touch its threads or locks in a child) and made anew on demand. The child
    # then reads its own epochs, from the epoch number the parent had reached. An iterator of
    # the parent's used in the child raises LoaderStateError.
    def _forked(self) -> None:
        self._pid = os.getpid()
        self._active = None
        self._ahead = None
        self._kept_stage = None
        self._kept_fence = None
        self._tpool = None  # the parent's (WorkerPool.usable is false here): a new one on demand
        if self._tuner is not None:
            self._tuner.forget_stream()
        if self._batch_pool is not None and self._batch_pool.pinned:
            self._batch_pool = None
        if self._staging_pool is not None and self._staging_pool.pinned:
            self._staging_pool = None

    def _get_iterator(self) -> Any:
        """A new iterator of this loader (torch's hook; NOTE [iterators of one loader])."""
        return self._iter_native() if self._native else self._iter_torch()

    # -- epochs and resumption (native path) ---------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """The next ``iter()`` reads epoch ``epoch`` from its start.

        A position loaded by ``load_state_dict`` is kept when ``epoch`` is its epoch (the
        loop ``for e in range(start, n): loader.set_epoch(e)`` of a resumed job reads the
        rest of that epoch) and dropped for any other epoch. A pending
        ``skip_first_batches`` is kept.
        """
        self._require_native("set_epoch()")
        epoch = check_count("epoch", epoch)
        if epoch == self._next_epoch and self._run is None and (self._resume or self._pack_resume):
            return  # the loaded position's own epoch
        self._next_epoch = epoch
        self._run = None
        self._resume = []
        self._pack_run = None
        self._pack_resume = []

    # NOTE [skipped batches]: ``skip_first_batches(n)`` makes the next iter() start n batches
    # into the epoch it reads (whichever set_epoch names, or the next one), as if the
    # caller had received those batches: they are not read, and its state counts them. It
    # is how a framework that counts steps resumes (transformers' Trainer hands its step
    # count to ``get_resumed_dataloader``, accelerate's ``skip_first_batches`` has the same
    # meaning); the order of the epoch is the same as the interrupted run's when the epoch
    # number, seed, rank and world size are. ``set_epoch`` keeps it; ``load_state_dict``,
    # which names a whole position, drops it.
    def skip_first_batches(self, num_batches: int) -> DataLoader[_T_co]:
        """Makes the next ``iter()`` skip the first ``num_batches`` batches of its epoch, without reading them.

        Returns the loader itself (accelerate's ``skip_first_batches`` returns a loader too).
        ``set_epoch`` before that ``iter()`` keeps the skip. The order of the skipped epoch
        is the one the loader would read for that epoch number, so a resumed job that calls
        ``set_epoch(e)`` and skips the batches it had taken reads exactly the rest of epoch
        ``e``. Needs a pyloader dataset and ``batch_size`` set; not with ``pack=``.
        """
        self._require_native("skip_first_batches()")
        n = check_count("num_batches", num_batches)
        if self.batch_size is None:
            raise TypeError("skip_first_batches() counts batches: it needs batch_size set (batch_size=None counts "
                            "samples)")
        if self.pack is not None:
            raise TypeError("skip_first_batches() cannot count a packing loader's batches ahead of reading them; "
                            "resume a packing loader with state_dict()/load_state_dict()")
        self._skip = n
        self._run = None
        return self

    @property
    def _is_accelerate_prepared(self) -> bool:
        """True for a native loader: accelerate keeps it unchanged (NOTE [accelerate keeps a native loader])."""
        if self.__dict__.get("_native"):
            if not self.__dict__.get("_accelerate_prepared"):
                check_for_accelerate(self)
            return True
        return bool(self.__dict__.get("_accelerate_prepared"))

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:
        self.__dict__["_accelerate_prepared"] = bool(value)

    def state_dict(self) -> dict[str, Any]:
        """This loader's position: where the next ``iter()`` of a restored loader starts.

        Mid-epoch it counts the batches the caller received (not those prefetched or in
        flight to the device). Once every batch of an epoch was received the state names
        the next epoch's start. Cheap: no per-sample work (NOTE [resume state]).
        """
        if not self._native:
            return self._torch_state()  # NOTE [generic loader state]
        fingerprint = self._require_resumable()
        if self.pack is not None:
            return self._packed_state(fingerprint)
        run = self._run
        if run is None:  # nothing read since construction, set_epoch, load_state_dict or skip_first_batches
            epoch, segments = self._next_epoch, self._resume
            if self._skip and self.batch_size is not None:
                world = self.dataset.rank_and_world()[1]
                segments = _state.add_segment(segments, world, self.batch_size, self._skip)
        elif run.consumed.batches >= run.batches:
            epoch, segments = self._next_epoch, []
        else:
            epoch = run.epoch
            segments = _state.add_segment(run.segments, run.world_size, run.batch_size, run.consumed.batches)
        return _state.make_state(fingerprint, self.dataset.num_records, self._settings, epoch, segments,
                                 parts=self._fingerprint_parts)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next ``iter()`` read the rest of ``state``'s epoch, then epochs continue.

        The state may come from a job with another world size or batch size: the samples
        it had not consumed are spread over this loader's ranks with the same pad/drop rule
        (docs/resume.md). Raises ``ResumeError`` (a ``ValueError``) for a state taken on
        another dataset or epoch order, or one that is malformed or inconsistent.
        """
        if not self._native:
            self._load_torch_state(state)  # NOTE [generic loader state]
            return
        fingerprint = self._require_resumable()
        epoch, segments = _state.check_state(
            state, fingerprint=fingerprint, records=self.dataset.num_records, settings=self._settings,
            parts=self._fingerprint_parts)
        if self.pack is not None or "packing" in state:
            self._load_packed(state, epoch, segments)
            return
        try:  # validates the segments against the dataset now, not at the next iter()
            self.dataset.unread_count(epoch, segments, partition=self._order.partition)
        except ValueError as e:
            raise _state.ResumeError(f"inconsistent loader state: {e}") from None
        self._next_epoch = epoch
        self._resume = segments
        self._skip = 0
        self._run = None

    def _require_native(self, what: str) -> None:
        if not self._native:
            raise TypeError(f"{what} needs a pyloader dataset (ShardDataset, ParquetDataset or another "
                            f"pyloader.contract.PlannedDataset), not {type(self.dataset).__name__}")

    def _require_resumable(self) -> str:
        if self._fingerprint is None or not self._native:
            raise TypeError(f"state_dict()/load_state_dict() need a resumable dataset (one with a fingerprint, "
                            f"e.g. ShardDataset or ParquetDataset), not {type(self.dataset).__name__}")
        if self.batch_size is None:
            raise TypeError("state_dict()/load_state_dict() need batched iteration (batch_size=None counts samples)")
        return self._fingerprint

    def __len__(self) -> int:
        if not self._native:
            assert self._inner is not None
            return len(self._inner)
        if self.pack is not None:
            raise TypeError("a packing loader's batches per epoch depend on its documents' lengths; "
                            "stats()['packing'] counts them as they are made")
        n = self._len_called = len(self.dataset)
        if self.batch_size is None:
            return n
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def stats(self) -> dict[str, Any]:
        """Per-stage counters of the current (or last) epoch.

        See ``BatchIterator.stats``; with a copy engine, its counters under ``"copy"``; with
        pinned buffers, their memory under ``"pinned"`` (``host_memory()``). Empty before the
        first ``iter()``.
        """
        it = self._active() if self._active is not None else None
        s = it.stats() if isinstance(it, _it.LoaderIterator) else dict(self._last_stats)
        if s:
            pinned = self.host_memory(pinned_only=True)
            if pinned["bytes"] or pinned["driver_allocs"]:
                s["pinned"] = pinned
        return s


__all__ = ["DataLoader"]
