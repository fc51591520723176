"""pyloader.DataLoader: a drop-in replacement for ``torch.utils.data.DataLoader``."""

from __future__ import annotations

import collections
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.utils.data
from torch.utils.data import BatchSampler, IterableDataset

# torch's class, bound now: a program that drops pyloader in with
# ``torch.utils.data.DataLoader = pyloader.DataLoader`` must not make the generic path (and
# the base class) find pyloader's class again. The defining module's name is the one such a
# patch leaves alone.
from torch.utils.data.dataloader import DataLoader as _TorchDataLoader
from torch.utils.data.dataloader import _DatasetKind, _InfiniteConstantSampler

import pyloader._C as _C

from ..errors import LoaderStateError
from ..read.contract import BatchStream, OrderSpec, PipelineStream, PlannedDataset, check_batch_args
from ..transform import stage as _stage
from ..transform.image import resolve_decode as _resolve_decode
from . import autotune as _autotune
from . import packing as _packing
from . import state as _state
from . import transfer as _transfer

# Records per native batch when the loader yields single samples (batch_size=None).
_SAMPLE_BATCH = 64

_T_co = TypeVar("_T_co", covariant=True)

# Attributes torch reads when it makes an iterator: assigned after construction, they are
# passed on to the generic path's torch loader, so the next iter() uses them as torch's would.
_PASSED_ON = frozenset({"num_workers", "collate_fn", "timeout", "worker_init_fn", "generator", "prefetch_factor",
                        "in_order", "pin_memory_device"})


class ConsumedCount:
    """How many batches an iterator has returned to its caller."""

    __slots__ = ("batches",)

    def __init__(self) -> None:
        self.batches = 0


@dataclass
class _Run:
    """The iteration in progress (or the last one): enough to describe its position."""

    epoch: int
    world_size: int
    batch_size: int
    segments: list[list[int]]  # how the epoch was consumed before this iteration
    consumed: ConsumedCount  # shared with the iterator, so it outlives it
    batches: int  # this iteration's batches per rank


def _is_native(dataset: Any) -> bool:
    """A pyloader dataset (NOTE [dataset contract]): planned and collated natively."""
    return isinstance(dataset, PlannedDataset)


def _check_common(num_workers: Any, timeout: Any, prefetch_factor: Any, persistent_workers: bool,
                  device_prefetch: Any, pin_memory_device: Any) -> None:
    """The checks torch's DataLoader makes, with its messages, plus pyloader's own."""
    if num_workers == "auto":
        num_workers = 1  # NOTE [autotune]; its own checks are made with the dataset
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
        raise ValueError("num_workers option should be non-negative; use num_workers=0 to disable multiprocessing.")
    if not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError("timeout option should be non-negative")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError("prefetch_factor option could only be specified in multiprocessing."
                         "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None.")
    if prefetch_factor is not None and (not isinstance(prefetch_factor, int) or prefetch_factor < 0):
        raise ValueError("prefetch_factor option should be non-negative")
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    if not isinstance(device_prefetch, int) or isinstance(device_prefetch, bool) or device_prefetch < 1:
        raise ValueError("device_prefetch must be a positive int (batches in flight to the device)")
    if not isinstance(pin_memory_device, str):
        raise ValueError(f"pin_memory_device must be a str, got {pin_memory_device!r}")


def _pin_device_index(pin_memory_device: str) -> int | None:
    """The GPU named by ``pin_memory_device`` (None: not named). Validates the string."""
    if not pin_memory_device:
        return None
    try:
        dev = torch.device(pin_memory_device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type != "cuda":
        raise ValueError(f"pin_memory_device={pin_memory_device!r}: pyloader pins memory for 'cuda[:N]' only")
    return dev.index


class DataLoader(_TorchDataLoader[_T_co]):
    """A drop-in replacement for ``torch.utils.data.DataLoader``.

    Same constructor, same iteration semantics, plus native staging and device prefetch.

    Two paths, chosen by the dataset:

    * A pyloader dataset (``ShardDataset``, ``ParquetDataset``: any
      ``pyloader.read.contract.PlannedDataset``) takes the native path: the epoch
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
    read epoch ``n``. ``state_dict()``/``load_state_dict()`` resume a native loader over a
    resumable dataset (one with a ``fingerprint``: ShardDataset, ParquetDataset) mid-epoch
    (docs/resume.md).

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
                 executor: str = "threads", batch_transform: Callable[[Any], Any] | None = None,
                 memory_budget: int | None = None, pack: _packing.PackSpec | None = None) -> None:
        # torch's __init__ is not run: the attributes torch's own code reads are set here
        # (NOTE [torch's DataLoader attributes]).
        _check_common(num_workers, timeout, prefetch_factor, persistent_workers, device_prefetch, pin_memory_device)
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers  # type: ignore[assignment]  # "auto" too (NOTE [autotune])
        self.collate_fn = collate_fn
        self.pin_memory = bool(pin_memory)
        self.pin_memory_device = pin_memory_device
        self.drop_last = drop_last
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.generator = generator
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers
        self.in_order = in_order
        self.device = _transfer.resolve_device(device)
        self.device_prefetch = device_prefetch
        self.prefetch = prefetch
        if memory_budget is not None and (not isinstance(memory_budget, int) or isinstance(memory_budget, bool)
                                          or memory_budget <= 0):
            raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
        if memory_budget is not None and num_workers != "auto":
            raise ValueError("memory_budget= bounds what num_workers='auto' may use; give num_workers='auto'")
        self.memory_budget = memory_budget
        if pack is not None and not isinstance(pack, _packing.PackSpec):
            raise ValueError(f"pack must be a pyloader.PackSpec, got {pack!r}")
        self.pack = pack
        self._pack_field = -1
        self._pack_resume: list[dict[str, Any]] = []  # packing phases of a loaded state (NOTE [packing resume])
        self._pack_run: tuple[Any, ...] | None = None  # (epoch, world, rank, phases, stream, consumed)
        self._doc_pool: _C.SlotPool | None = None  # the packer's input documents (NOTE [ragged batches])
        self._tuner: _autotune.AutoTune | None = None  # NOTE [autotune], made with the dataset's checks
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable, got {transform!r}")
        if batch_transform is not None and not callable(batch_transform):
            raise ValueError(f"batch_transform must be callable, got {batch_transform!r}")
        if executor not in _stage.EXECUTORS:
            raise ValueError(f"executor must be one of {_stage.EXECUTORS}, got {executor!r}")
        self.transform = transform
        self.batch_transform = batch_transform
        self.executor = executor
        self._mp_context: Any = None
        self._pin_named = _pin_device_index(pin_memory_device)
        if self.device is not None and self.device.type == "cuda":
            self._pin_named = self.device.index
        self._active: weakref.ref[Any] | None = None
        self._pid = os.getpid()  # NOTE [loader across fork]
        self._last_stats: dict[str, Any] = {}
        self._run: _Run | None = None
        self._resume: list[list[int]] = []
        self._fingerprint: str | None = None  # the dataset's, when it is resumable
        self._fingerprint_parts: dict[str, str] | None = None  # its fingerprint_parts, if any
        self.sampler: Any = None
        self.batch_sampler: Any = None
        self.shuffle: bool | None = shuffle
        self._dataset_kind = _DatasetKind.Iterable if isinstance(dataset, IterableDataset) else _DatasetKind.Map
        self._len_called: int | None = None  # _IterableDataset_len_called of the native path
        # Host buffers are made at the first iter(), not here (NOTE [lazy pinned pools]).
        self._batch_pool: _C.SlotPool | None = None  # see _pool
        self._ahead: tuple[tuple[Any, ...], PipelineStream] | None = None  # (key, stream): NOTE [epoch ahead]
        self._staging_pool: _C.SlotPool | None = None  # see _staging()
        self._kept_stage: _transfer.DeviceStage | None = None  # NOTE [stage across epochs]
        self._kept_fence: _transfer.PinnedFence | None = None  # NOTE [pinned batch fence]
        self._inner: _TorchDataLoader[Any] | None = None  # the generic path's torch loader
        self._native = _is_native(dataset)
        if self._native:
            self._init_native(shuffle, sampler, batch_sampler, multiprocessing_context)
            if num_workers == "auto":
                self._auto()  # raises now for what it cannot tune
            self._prepare_slots()
        else:
            if num_workers == "auto":
                raise ValueError("num_workers='auto' tunes the native threads of a ShardDataset; torch's "
                                 f"DataLoader over a {type(dataset).__name__} needs a number of worker processes")
            if prefetch is not None:
                raise ValueError("prefetch= sets native collation depth and needs a pyloader dataset; "
                                 "use prefetch_factor with worker processes")
            if pack is not None:
                raise ValueError("pack= packs the token field of a pyloader dataset (ShardDataset or Mixture) on "
                                 f"native threads, not a {type(dataset).__name__}")
            if transform is not None or executor != "threads":
                raise ValueError("transform= and executor= run per-sample transforms on a pyloader dataset's "
                                 "native path; over another dataset, apply the transform in its __getitem__ "
                                 "(torch's worker processes run it)")
            self._init_torch(shuffle, sampler, batch_sampler, multiprocessing_context)
        # From now on torch's __setattr__ refuses to change the attributes that fix the order.
        self._DataLoader__initialized = True

    # -- construction ------------------------------------------------------------------
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
            if self.executor != "processes":
                raise ValueError(f"DataLoader over a {name}: multiprocessing_context is not supported; the native "
                                 f"path starts no processes (except executor='processes', the transform workers)")
            self._mp_context = multiprocessing_context
        _resolve_decode(self.dataset.fields, self.dataset.decode)  # a bad decode= fails now
        bs = self.batch_size
        if bs is not None and (not isinstance(bs, int) or isinstance(bs, bool) or bs < 1):
            raise ValueError(f"batch_size should be a positive integer value, but got batch_size={bs}")
        if bs is None and self.drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")
        if shuffle is not None and not isinstance(shuffle, bool):
            raise ValueError(f"shuffle must be None, True or False, got {shuffle!r}")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(self.generator).__name__}")
        if self.prefetch is not None and (not isinstance(self.prefetch, int) or self.prefetch < 1):
            raise ValueError("prefetch must be a positive int")
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
        self._fingerprint_parts = getattr(self.dataset, "fingerprint_parts", None)

    def _check_pack(self, name: str) -> None:
        """What packing needs (NOTE [packing rule] in csrc/core/packer.h); ValueError naming what is missing."""
        if not self.dataset.pipeline_streams:
            raise ValueError(f"pack= needs a dataset read by the native pipeline (ShardDataset or Mixture), not a {name}")
        if self.batch_size is None:
            raise ValueError("pack= needs batch_size= (packed rows per batch)")
        if self.collate_fn is not None or self.transform is not None or self.dataset.transform is not None:
            raise ValueError("pack= makes the batches natively: collate_fn= and transform= do not apply "
                             "(use batch_transform= on the packed batch)")
        if self._auto_workers:
            raise ValueError("num_workers='auto' does not tune a packing loader yet; give num_workers a number")
        self._pack_field = self.pack.resolve_field(self.dataset.fields)  # type: ignore[union-attr]

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
            if not self._native or not ds.pipeline_streams or self._transform_spec(0) is not None:
                raise ValueError("num_workers='auto' tunes the native threads of a ShardDataset without transforms; "
                                 "give num_workers a number here")
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

    def _init_torch(self, shuffle: bool | None, sampler: Any, batch_sampler: Any, multiprocessing_context: Any) -> None:
        # torch's DataLoader does the loading (and its own argument checks); pyloader's copy
        # engine does the pinning and the device copies, so torch's pin thread is off.
        inner: _TorchDataLoader[Any] = _TorchDataLoader(
            self.dataset, batch_size=self.batch_size, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
            num_workers=self.num_workers, collate_fn=self.collate_fn, pin_memory=False, drop_last=self.drop_last,
            timeout=self.timeout, worker_init_fn=self.worker_init_fn,
            multiprocessing_context=multiprocessing_context, generator=self.generator,
            prefetch_factor=self.prefetch_factor, persistent_workers=self.persistent_workers, in_order=self.in_order)
        self._inner = inner
        self.dataset = inner.dataset
        self.batch_size = inner.batch_size
        self.drop_last = inner.drop_last
        self.sampler = inner.sampler
        self.batch_sampler = inner.batch_sampler
        self.collate_fn = inner.collate_fn
        self.prefetch_factor = inner.prefetch_factor

    # -- torch's DataLoader attributes ---------------------------------------------------
    # NOTE [torch's DataLoader attributes]: pyloader.DataLoader subclasses torch's DataLoader
    # (isinstance checks and frameworks that re-build a loader from its attributes, as
    # Lightning and Accelerate do, see a torch DataLoader) without running its __init__. The
    # constructor arguments are public attributes of the same names, as torch's; torch's
    # __setattr__ refuses batch_size, sampler, batch_sampler, drop_last, dataset and
    # persistent_workers once built (``_DataLoader__initialized``); the private attributes
    # torch's own methods and iterators read (``_dataset_kind``, ``_iterator``,
    # ``_IterableDataset_len_called``, ``multiprocessing_context``) are kept here, and on
    # the generic path are those of the torch loader that does the loading, to which later
    # assignments of the attributes torch reads at iter() are passed on (``_PASSED_ON``).
    def __setattr__(self, attr: str, val: Any) -> None:
        super().__setattr__(attr, val)  # torch's: raises ValueError for the attributes it freezes
        if attr in _PASSED_ON:
            inner = self.__dict__.get("_inner")
            if inner is not None:
                setattr(inner, attr, val)

    @property
    def multiprocessing_context(self) -> Any:
        """The ``multiprocessing_context`` of torch (a context object once set; None on the native path)."""
        inner = self.__dict__.get("_inner")
        return self.__dict__.get("_mp_context") if inner is None else inner.multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, value: Any) -> None:
        inner = self.__dict__.get("_inner")
        if inner is not None:
            inner.multiprocessing_context = value  # torch validates it against num_workers
        elif self.__dict__.get("executor") == "processes":
            self._mp_context = value
        elif value is not None:
            raise ValueError(f"DataLoader over a {type(self.dataset).__name__}: multiprocessing_context is not "
                             f"supported; the native path starts no processes")

    @property
    def _iterator(self) -> Any:
        """The persistent workers' iterator (torch's ``_iterator``; None on the native path)."""
        inner = self.__dict__.get("_inner")
        return None if inner is None else inner._iterator

    @_iterator.setter
    def _iterator(self, value: Any) -> None:
        inner = self.__dict__.get("_inner")
        if inner is not None:
            inner._iterator = value

    @property  # type: ignore[override]
    def _IterableDataset_len_called(self) -> int | None:  # noqa: N802 - torch's name
        """What ``len()`` last reported for an iterable dataset (torch warns when iteration yields more)."""
        inner = self.__dict__.get("_inner")
        return self._len_called if inner is None else inner._IterableDataset_len_called

    @_IterableDataset_len_called.setter
    def _IterableDataset_len_called(self, value: int | None) -> None:  # noqa: N802 - torch's name
        inner = self.__dict__.get("_inner")
        if inner is None:
            self._len_called = value
        else:
            inner._IterableDataset_len_called = value

    @property
    def _pool(self) -> _C.SlotPool | None:
        """The native path's batch buffers (None on the generic path), made on first use.

        Collation writes straight into them: pinned when asked (NOTE [slot reuse]).

        NOTE [lazy pinned pools]: a pinned pool retains a GPU's primary context and allocates
        through the CUDA driver, so it is made at the first ``iter()`` (as is the staging pool,
        ``_staging()``), never in the constructor: building a loader initialises no CUDA (as
        torch's does not), so a program may build it and then fork, and the pinning context
        is the device current at the first ``iter()`` -- after ``torch.cuda.set_device(local_rank)``
        -- not the one current at construction. Both pools are then kept across epochs.
        """
        if not self._native:
            return None
        if self._batch_pool is None:
            fields = 4 if self.pack is not None else len(self.dataset.fields)  # packed batches: 4 outputs
            self._batch_pool = _transfer.slot_pool(fields, pinned=self._pinned,
                                                   device_index=self._pin_index if self._pinned else 0)
        return self._batch_pool

    def _prepare_slots(self) -> None:
        """Starts making the first epoch's batch slots now, on a native thread (NOTE [prepared slots]).

        As many as the pipeline's read-ahead and the loop hold at once (``prefetch`` + 1, the
        size the pool reaches in an epoch or two anyway), each with its fixed-shape fields'
        buffers populated: the memory a first epoch would otherwise wait for the kernel to
        hand over, made while the training script builds its model. Pageable pools of the
        plain native path only: a pinned pool is made at the first ``iter()`` (NOTE [lazy
        pinned pools]), the transform and packing paths collate into pools of their own, and
        ``num_workers="auto"`` sizes memory against its budget (NOTE [autotune]).
        """
        ds = self.dataset
        if (self._pinned or self.pack is not None or self.batch_size is None or self._auto_workers
                or not getattr(ds, "pipeline_streams", False) or self._transform_spec(0) is not None):
            return
        pool = self._pool
        assert pool is not None
        sizes = [0 if f.variable else self.batch_size * f.row_bytes for f in ds.fields]
        depth = check_batch_args(self.batch_size, self._threads, self._prefetch)  # the pipeline's ring
        pool.prepare(count=depth + 1, field_bytes=sizes)

    @property
    def _pin_index(self) -> int:
        """The GPU whose context pins memory (the memory is portable to every GPU).

        Asked only when pinning: as torch pins, in the current device's context, so that each
        rank of a job (after torch.cuda.set_device(local_rank)) touches only its own GPU.
        """
        if self._pin_named is not None:
            return self._pin_named
        return torch.cuda.current_device() if torch.cuda.is_available() else 0

    @property
    def _pinned(self) -> bool:
        """Whether host buffers should be page-locked: asked for, or needed by a GPU copy."""
        return self.pin_memory or (self.device is not None and self.device.type == "cuda")

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if os.getpid() != self._pid:
            self._forked()
        prev = self._active() if self._active is not None else None
        if prev is not None:
            prev.close()  # a new iter() ends the previous one (torch's own iterators manage themselves)
        it = self._get_iterator()
        self._active = weakref.ref(it) if isinstance(it, _LoaderIterator) else None
        return it

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
        if self._tuner is not None:
            self._tuner.forget_stream()
        if self._batch_pool is not None and self._batch_pool.pinned:
            self._batch_pool = None
        if self._staging_pool is not None and self._staging_pool.pinned:
            self._staging_pool = None

    def _get_iterator(self) -> Any:
        """A new iterator of this loader (torch's hook; ``iter()`` also closes the previous one)."""
        return self._iter_native() if self._native else self._iter_torch()

    def _new_stage(self, in_slots: bool) -> _transfer.DeviceStage | None:
        """The copy engine for this epoch's batches, or None when they need none.

        None: no device, and either no pinning asked, batches already in pinned slots
        (``in_slots``), or no pinned memory to stage into (no driver: warned once; a pageable
        copy would only cost time). No timeout on the engine: ``timeout`` bounds waiting for
        data (as torch's bounds waiting for workers), not waiting for the GPU to finish the
        loop's own work.
        """
        if self.device is None and (not self.pin_memory or in_slots or not self._staging().pinned):
            return None
        # See NOTE [stage across epochs]: the last epoch's engine, if it ended with every job taken
        # and nothing it was made for changed.
        kept, self._kept_stage = self._kept_stage, None
        if (kept is not None and not kept.closed and kept.device == self.device and kept.depth == self.device_prefetch
                and kept.staging_pool is self._staging() and kept.outstanding() == 0):
            stage = kept
        else:
            if kept is not None:
                kept.close()
            stage = _transfer.DeviceStage(self.device, pin=self.pin_memory, depth=self.device_prefetch,
                                          staging_pool=self._staging())
        stage.begin_epoch()
        self._kept_stage = stage
        return stage

    def _iter_torch(self) -> Any:
        assert self._inner is not None
        source = iter(self._inner)
        stage = self._new_stage(in_slots=False)
        if stage is None and self.batch_transform is None:
            return source  # torch's own iterator: nothing to add
        gen: Iterator[Any] = source if stage is None else _transfer.Staged(source, stage, stage.submit_tree,
                                                                            go_on_after_error=True)
        if self.batch_transform is not None:
            gen = _BatchTransformed(gen, self.batch_transform)
        it = _LoaderIterator(gen, len(self._inner) if _has_len(self._inner) else None, source, stage)
        it.fence = self._fence(stage)
        return it

    def _iter_native(self) -> _LoaderIterator:
        ds: PlannedDataset = self.dataset
        epoch = self._next_epoch
        self._next_epoch += 1
        segments, self._resume = self._resume, []
        rank, world = ds.rank_and_world()
        if self.pack is not None:
            return self._iter_packed(epoch, rank, world)
        batched = self.batch_size is not None
        native_bs = _SAMPLE_BATCH if self.batch_size is None else self.batch_size
        spec = self._transform_spec(epoch)
        ahead, self._ahead = self._ahead, None
        src: BatchStream
        if (spec is None and ahead is not None and not segments
                and ahead[0] == self._ahead_key(epoch, native_bs, rank, world)):
            early: PipelineStream = ahead[1]  # See NOTE [epoch ahead]: its first batches are collated already
            if self._tuner is not None:
                early.tune(self._tuner.threads, self._tuner.prefetch)
            early.begin()
            src = early
        else:
            if ahead is not None:
                ahead[1].close()
            # The rest of a resumed epoch, or all of it (NOTE [dataset contract]).
            plan = ds.epoch_plan(epoch, rank, world, segments, shuffle=self.shuffle, seed=self._seed)
            if spec is not None:
                return self._iter_transformed(ds, epoch, world, segments, plan, spec, native_bs)
            pool = self._pool  # made now, in the device current now (NOTE [lazy pinned pools])
            src = ds.batches(native_bs, plan=plan, drop_last=self.drop_last, num_threads=self._threads,
                             prefetch=self._prefetch, pool=pool, **self._tuned())
        if self._tuner is not None:  # See NOTE [autotune]: only over datasets with pipeline_streams
            tuned: PipelineStream = src  # type: ignore[assignment]
            tuned.tuner = self._tuner
            tuned.ahead_target = self._tuner.prefetch
            self._tuner.attach(tuned)
        if spec is None and self._reads_ahead():
            cur: PipelineStream = src  # type: ignore[assignment]  # the dataset says so (pipeline_streams)
            cur.tail_hook(lambda: self._make_ahead(native_bs, cur), at=max(len(cur) - 3 * cur.prefetch, len(cur) // 2))
        src.timeout = float(self.timeout)
        src.on_finish = self._keep_stats
        consumed = ConsumedCount()
        length = len(src)
        self._start_run(epoch, world, segments, consumed, length)
        # Per-sample semantics (batch_size=None, or a collate_fn over the list of samples)
        # run on the host; their results are staged like any batch.
        per_sample = not batched or self.collate_fn is not None
        items: Iterator[Any] = _Samples(src, ds, self.batch_size, self.collate_fn) if per_sample else src
        if not batched:
            length = len(ds)
        # Batches collated into the loader's own slots (a stream with next_host: ShardDataset),
        # and their samples, are pinned when asked: nothing to stage them into.
        in_slots = hasattr(src, "next_host") and self.collate_fn is None
        stage = self._new_stage(in_slots)
        if stage is None:
            gen = items
        elif in_slots and not per_sample:
            # Zero-copy: the pinned slot a batch was collated into is the copy's source.
            submit_host = stage.submit_host
            gen = _transfer.Staged(_host_batches(src), stage, lambda item: submit_host(*item),
                                   go_on_after_error=False)
        else:
            gen = _transfer.Staged(items, stage, stage.submit_tree, go_on_after_error=per_sample)
        return self._loader_iterator(gen, length, src, stage, consumed)

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
        return bool(self.dataset.early_streams) and self.pack is None

    def _tuned(self) -> dict[str, Any]:
        """batches() arguments that start a pipeline at the tuner's values (NOTE [autotune])."""
        if not self._auto_workers:
            return {}
        t = self._auto()
        rows = _SAMPLE_BATCH if self.batch_size is None else self.batch_size
        t.expect(rows * sum(f.row_bytes for f in self.dataset.fields if not f.variable))
        return {"ahead": t.prefetch, "active_threads": t.threads}

    def _ahead_key(self, epoch: int, native_bs: int, rank: int, world: int) -> tuple[Any, ...]:
        return (epoch, rank, world, self._order, native_bs, self.drop_last, self._threads, self._prefetch,
                self._batch_pool)

    def _make_ahead(self, native_bs: int, current: PipelineStream) -> None:
        """Starts the pipeline of the epoch the next iter() reads (NOTE [epoch ahead])."""
        if self._resume or self._batch_pool is None:
            return
        ds: PlannedDataset = self.dataset
        epoch = self._next_epoch
        rank, world = ds.rank_and_world()
        plan = ds.epoch_plan(epoch, rank, world, [], shuffle=self.shuffle, seed=self._seed)
        # pipeline_streams: batches() returns a PipelineStream and takes its arguments.
        src: PipelineStream = ds.batches(  # type: ignore[assignment,call-arg]
            native_bs, plan=plan, drop_last=self.drop_last, num_threads=self._threads, prefetch=self._prefetch,
            pool=self._batch_pool, ahead=1, early=True,
            active_threads=self._tuner.threads if self._tuner is not None else None)
        if self._tuner is not None:
            src.ahead_target = self._tuner.prefetch
        old, self._ahead = self._ahead, (self._ahead_key(epoch, native_bs, rank, world), src)
        if old is not None:
            old[1].close()
        current.hand_over(src)

    def _start_run(self, epoch: int, world: int, segments: list[list[int]], consumed: ConsumedCount,
                   length: int) -> None:
        if self.batch_size is not None and self._fingerprint is not None:
            self._run = _Run(epoch, world, self.batch_size, segments, consumed, length)
        else:
            self._run = None

    def _loader_iterator(self, gen: Iterator[Any], length: int, src: Any, stage: Any,
                         consumed: ConsumedCount) -> _LoaderIterator:
        if self.batch_transform is not None:
            gen = _BatchTransformed(gen, self.batch_transform)
        it = _LoaderIterator(gen, length, src, stage, consumed=consumed, native=True)
        it.on_close = self._keep_stats
        it.fence = self._fence(stage)
        return it

    # -- packing (native path) ----------------------------------------------------------
    def _iter_packed(self, epoch: int, rank: int, world: int) -> _LoaderIterator:
        """An epoch of packed rows (NOTE [packing rule] in csrc/core/packer.h, NOTE [packing resume])."""
        ds: PlannedDataset = self.dataset
        spec = self.pack
        assert spec is not None
        phases_in, self._pack_resume = self._pack_resume, []
        phases, items, rows_before = self._phase_plans(epoch, phases_in).resume_items(rank, world)
        entry = phases[-1]["ranks"].get(str(rank))
        if entry is None:
            entry = {"cursor": [int(items.pos[0]), int(items.start[0])] if len(items) else [-1, 0],
                     "window": [], "rows": 0}
        if self._doc_pool is None:  # the documents' buffers, kept across epochs like the batches'
            self._doc_pool = _C.SlotPool(num_fields=len(ds.fields))
        docs = ds.batches(spec.doc_batch, plan=(items.units, items.records), drop_last=False,  # type: ignore[call-arg]
                          num_threads=self._threads, prefetch=self._prefetch, pool=self._doc_pool, ragged=True)
        prefetch = self._prefetch if self._prefetch is not None else 2
        pool, rows = self._pool, self.batch_size
        assert pool is not None and rows is not None  # the native path, batched (_check_pack)
        try:
            packer = _C.Packer(docs=docs._pipeline, field=self._pack_field, pool=pool,  # type: ignore[attr-defined]
                               pos=items.pos, start=items.start, end=items.end, seq_len=spec.seq_len,
                               rows=rows, lookahead=spec.window, split=spec.split,
                               drop_last=self.drop_last, prefetch=prefetch, pad_id=spec.pad_id)
        except BaseException:
            docs.close()
            raise
        src = _packing.PackedStream(docs, packer, spec, entry, rows_before)
        src.timeout = float(self.timeout)
        src.on_finish = self._keep_stats
        consumed = ConsumedCount()
        src.consumed = consumed
        self._run = None
        self._pack_run = (epoch, world, rank, phases, src, consumed)
        stage = self._new_stage(True)
        gen: Iterator[Any]
        if stage is None:
            gen = src
        else:
            submit_host = stage.submit_host
            gen = _transfer.Staged(_host_batches(src), stage, lambda item: submit_host(*item),
                                   go_on_after_error=False)
        it = self._loader_iterator(gen, None, src, stage, consumed)  # type: ignore[arg-type]
        it.len_error = "a packed epoch's number of batches depends on its documents' lengths; it is known at its end"
        return it

    def _phase_plans(self, epoch: int, phases: list[dict[str, Any]]) -> _packing.PhasePlans:
        """The packing phases of ``epoch`` over this loader's epoch order (NOTE [packing resume])."""
        ds = self.dataset

        def plan(r: int, w: int) -> Any:
            return ds.epoch_plan(epoch, r, w, [], shuffle=self.shuffle, seed=self._seed)

        return _packing.PhasePlans(plan, phases)

    def _packed_state(self, fingerprint: str) -> dict[str, Any]:
        """``state_dict()`` of a packing loader (NOTE [packing resume]).

        Under an initialised process group of the loader's world size it is a collective:
        every rank's entry is gathered (a rank that received its epoch's last batch sends
        its final entry), so each rank returns the same state.
        """
        run = self._pack_run
        if run is None:
            epoch, phases = self._next_epoch, self._pack_resume
        else:
            run_epoch, world, rank, run_phases, src, consumed = run
            entry = dict(src.state_after(consumed.batches))
            entry["done"] = src.finished_after(consumed.batches)
            ranks = {str(rank): entry}
            dist = torch.distributed
            if world > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() == world:
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, (rank, entry))
                ranks = {str(r): e for r, e in gathered}
            if len(ranks) == world and all(e["done"] for e in ranks.values()):
                epoch, phases = self._next_epoch, []  # every rank read its whole epoch
            else:
                epoch = run_epoch
                phases = [dict(p) for p in run_phases]
                phases[-1] = {"world": world, "ranks": ranks}
        state = _state.make_state(fingerprint, self.dataset.num_records, self._settings, epoch, [],
                                  parts=self._fingerprint_parts)
        field = self.dataset.fields[self._pack_field].name
        state["packing"] = {"spec": self.pack.settings(field), "phases": phases}  # type: ignore[union-attr]
        return state

    # -- per-sample transforms (native path) -------------------------------------------
    def _transform_spec(self, epoch: int) -> _stage.TransformSpec | None:
        """What the transform workers do this epoch; None when there is nothing per sample to do."""
        ds = self.dataset
        fn = self.transform if self.transform is not None else ds.transform
        decode = _resolve_decode(ds.fields, ds.decode)
        if fn is None and not decode:
            return None
        if self.batch_size is None:
            collate = None  # the workers return samples; collate_fn applies to each (as torch's)
        else:
            collate = self.collate_fn if self.collate_fn is not None else _stage.collate_samples
        return _stage.TransformSpec(fn, decode, collate, self._order.seed, epoch,
                                    seed_globals=self.executor == "processes")

    def _iter_transformed(self, ds: PlannedDataset, epoch: int, world: int, segments: list[list[int]], plan: Any,
                          spec: _stage.TransformSpec, native_bs: int) -> _LoaderIterator:
        """An epoch through the transform workers (NOTE [thread executor], NOTE [process executor])."""
        from ..transform.processes import ProcessTransformStream
        from ..transform.threads import ThreadTransformStream

        units, records = plan
        gidx = ds.global_index(units, records)
        workers = self._threads
        depth = self._prefetch if self._prefetch is not None else 2 * workers
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
        consumed = ConsumedCount()
        length = len(src)
        src.consumed = consumed  # a batch whose samples were all skipped still counts as read
        self._start_run(epoch, world, segments, consumed, length)
        items: Iterator[Any] = src
        if self.batch_size is None:
            items = _Flattened(src, self.collate_fn)
            length = len(ds)
        stage = self._new_stage(in_slots=False)
        gen = items if stage is None else _transfer.Staged(items, stage, stage.submit_tree, go_on_after_error=True)
        return self._loader_iterator(gen, length, src, stage, consumed)

    def _fence(self, stage: _transfer.DeviceStage | None) -> _transfer.PinnedFence | None:
        """A fence for batches the loop receives in pyloader's pinned memory (NOTE [pinned batch fence]).

        The loop could queue GPU copies from them. None when it receives none: a ``device``
        is set, CUDA is unavailable, or the buffers are pageable.
        """
        if self.device is not None or not torch.cuda.is_available():
            return None
        pool = self._pool
        pinned = stage.pinned if stage is not None else pool is not None and pool.pinned
        if not pinned:
            return None
        # Kept across epochs: the batches it holds carry over, so an epoch's end waits for nothing.
        if self._kept_fence is None:
            self._kept_fence = _transfer.PinnedFence()
        return self._kept_fence

    def _staging(self) -> _C.SlotPool:
        """The engine's staging buffers, made on first use (NOTE [lazy pinned pools]) and kept across epochs."""
        if self._staging_pool is None:
            self._staging_pool = _transfer.slot_pool(1, pinned=self._pinned,
                                                     device_index=self._pin_index if self._pinned else 0)
        return self._staging_pool

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
        """What the epoch order and partition depend on (the order keys of a state)."""
        return self._order.settings()

    def set_epoch(self, epoch: int) -> None:
        """The next ``iter()`` reads epoch ``epoch`` from its start (a loaded state is dropped)."""
        self._require_native("set_epoch()")
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError("epoch must be a non-negative int")
        self._next_epoch = epoch
        self._run = None
        self._resume = []
        self._pack_run = None
        self._pack_resume = []

    def state_dict(self) -> dict[str, Any]:
        """This loader's position: where the next ``iter()`` of a restored loader starts.

        Mid-epoch it counts the batches the caller received (not those prefetched or in
        flight to the device). Once every batch of an epoch was received the state names
        the next epoch's start. Cheap: no per-sample work (NOTE [resume state]).
        """
        fingerprint = self._require_resumable()
        if self.pack is not None:
            return self._packed_state(fingerprint)
        run = self._run
        if run is None:  # nothing read since construction, set_epoch or load_state_dict
            epoch, segments = self._next_epoch, self._resume
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
        self._run = None

    def _load_packed(self, state: dict[str, Any], epoch: int, segments: list[list[int]]) -> None:
        if self.pack is None:
            raise _state.ResumeError("the state was saved by a packing loader (pack=PackSpec); this loader does not "
                                     "pack: give it the same pack=")
        phases = _packing.check_packing(state, self.pack, self.dataset.fields[self._pack_field].name)
        if segments:
            raise _state.ResumeError("a packing loader's state names its position in its packing phases, not "
                                     "in segments")
        rank, world = self.dataset.rank_and_world()
        self._phase_plans(epoch, phases).resume_items(rank, world)  # a state it cannot resume fails now
        self._next_epoch = epoch
        self._pack_resume = phases
        self._pack_run = None
        self._run = None

    def _require_native(self, what: str) -> None:
        if not self._native:
            raise TypeError(f"{what} needs a pyloader dataset (ShardDataset, ParquetDataset or another "
                            f"pyloader.read.contract.PlannedDataset), not {type(self.dataset).__name__}")

    def _require_resumable(self) -> str:
        if self._fingerprint is None or not self._native:
            raise TypeError(f"state_dict()/load_state_dict() need a resumable dataset (one with a fingerprint, "
                            f"e.g. ShardDataset or ParquetDataset), not {type(self.dataset).__name__}")
        if self.batch_size is None:
            raise TypeError("state_dict()/load_state_dict() need batched iteration (batch_size=None counts samples)")
        return self._fingerprint

    def _keep_stats(self, stats: dict[str, Any]) -> None:
        self._last_stats = stats

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
        s = it.stats() if isinstance(it, _LoaderIterator) else dict(self._last_stats)
        if s:
            pinned = self.host_memory(pinned_only=True)
            if pinned["bytes"] or pinned["driver_allocs"]:
                s["pinned"] = pinned
        return s

    def host_memory(self, *, pinned_only: bool = False) -> dict[str, Any]:
        """The host memory of this loader's batch and staging buffers (NOTE [pinned cache]).

        ``bytes``: held from the allocator (``live_bytes`` in slots + ``cached_bytes`` kept for
        reuse, at most ``cache_limit`` per pool); ``allocs``: buffers handed out, ``reused`` of
        them from the cache; ``driver_allocs`` / ``driver_frees``: the calls that reached the
        system or, when pinned, the CUDA driver (each of which synchronises the device);
        ``driver_alloc_bytes`` / ``driver_alloc_s``: the bytes of those allocations and the
        thread time they took -- the kernel handing out and zeroing new pages, or the driver
        pinning them: in a first epoch of large records, most of what it costs beyond the
        steady state (``pyloader bench`` reports it).
        """
        keys = ("bytes", "live_bytes", "cached_bytes", "cache_limit", "allocs", "reused", "driver_allocs",
                "driver_frees", "driver_alloc_bytes", "driver_alloc_s")
        out: dict[str, Any] = dict.fromkeys(keys, 0)
        pools = [p for p in (self._batch_pool, self._staging_pool) if p is not None]
        for pool in pools:
            if pinned_only and not pool.pinned:
                continue
            m = pool.memory()
            for k in keys:
                out[k] += m[k]
        return out


def _has_len(loader: Any) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


def _host_batches(src: Any) -> Iterator[Any]:
    while True:
        try:
            item = src.next_host()
        except StopIteration:
            return
        yield item


class _Samples:
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

    def __iter__(self) -> _Samples:
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


class _Flattened:
    """The samples of a transform stream that yields lists of samples (``batch_size=None``).

    ``collate_fn``, when given, is applied to each sample, as torch applies it without batching.
    """

    def __init__(self, src: Any, collate_fn: Callable[[Any], Any] | None) -> None:
        self._src = src
        self._fn = collate_fn
        self._buf: collections.deque[Any] = collections.deque()

    def __iter__(self) -> _Flattened:
        return self

    def __next__(self) -> Any:
        while not self._buf:
            self._buf.extend(next(self._src))
        sample = self._buf.popleft()
        return sample if self._fn is None else self._fn(sample)


class _BatchTransformed:
    """``batch_transform`` applied to each batch the loop receives, on the consumer's thread.

    After the device copy when ``device=`` is set, so it runs on the consumer's current CUDA
    stream, which the copy engine ordered after the batch's copies: GPU augmentation of one
    batch overlaps the copy of the next.
    """

    def __init__(self, src: Iterator[Any], fn: Callable[[Any], Any]) -> None:
        self._src = src
        self._fn = fn

    def __iter__(self) -> _BatchTransformed:
        return self

    def __next__(self) -> Any:
        return self._fn(next(self._src))

    def close(self) -> None:
        close = getattr(self._src, "close", None)
        if close is not None:
            close()


class _LoaderIterator:
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
        if not native and hasattr(source, "_workers"):
            # torch's worker processes, as its iterator lists them (code written for torch
            # joins them); kept after close(), which lets go of the torch iterator.
            self._workers: list[Any] = source._workers

    def __iter__(self) -> _LoaderIterator:
        return self

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


__all__ = ["ConsumedCount", "DataLoader"]
