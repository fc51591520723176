"""Datasets made of units of records (shards, Parquet row groups): ``UnitDataset``.

The contract it implements (NOTE [dataset contract]) lives in ``pyloader.contract``; a
``UnitDataset`` orders and partitions its samples with ``pyloader.read.order`` over the
records of each unit, checks its readers when it is built (NOTE [reader checks]), and
gives torch's ``DataLoader`` per-sample iteration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import mmap
import os
import struct
import tempfile
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing import context as _mp_context
from multiprocessing.reduction import DupFd
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ..contract import DEFAULTS, OrderSpec, Plan, PlannedDataset, check_callable, check_count, check_int
from ..errors import PlanMemoryError
from ..format.sizes import parse_size
from ..remote import locks as _locks  # noqa: F401 - its fork hooks, registered early (see below)
from ..remote.budget import readers_on_node
from . import order as _order
from .frameworks import check_per_sample_reader

# The lock-file registry (``pyloader.remote.locks``) holds a lock from a fork's start to its
# end. It is imported with every dataset, so before any transform thread stream can start:
# the fork gate's hook (NOTE [fork gate] in pyloader/transform/threads.py) runs first only
# among hooks registered before it, and a hook registered later that holds a lock makes a
# transform thread that forks wait the gate's bound for another that forks at once. The rest
# of the remote stage loads with the first remote dataset.
if TYPE_CHECKING:
    from ..remote.cache import DatasetCache

# Records per internal batch when yielding single samples to torch's DataLoader.
_SAMPLE_MODE_BATCH = 64


@dataclasses.dataclass(frozen=True)
class RemoteOptions:
    """The node-cache keywords of ``ShardDataset`` and ``ParquetDataset``, checked once (NOTE [one rule per setting]).

    ``cache_dir`` (default ``$PYLOADER_CACHE_DIR``, else the user's cache dir),
    ``cache_limit`` (bytes, or a size such as ``"20G"``), ``fetch_jobs`` (downloads at once,
    or ``"auto"``: See NOTE [fetch jobs] in pyloader/remote/fetch.py) and ``storage_options``
    (for fsspec and the native transport). Checked for local data too: a bad value fails
    whichever dataset gets it.
    """

    cache_dir: str | os.PathLike[str] | None = None
    cache_limit: int | str | None = None
    fetch_jobs: int | str = DEFAULTS["fetch_jobs"]
    storage_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        if self.cache_dir is not None:
            try:
                put(self, "cache_dir", os.fspath(self.cache_dir))
            except TypeError:
                raise ValueError(f"cache_dir must be a path or None, got {self.cache_dir!r}") from None
        if self.cache_limit is not None:
            try:
                put(self, "cache_limit", parse_size(self.cache_limit))
            except ValueError as e:
                raise ValueError(f"cache_limit: {e}") from None
        if self.fetch_jobs != "auto":
            put(self, "fetch_jobs", check_count("fetch_jobs", self.fetch_jobs))
        if self.storage_options is not None:
            if not isinstance(self.storage_options, Mapping):
                raise ValueError(f"storage_options must be a dict or None, got {self.storage_options!r}")
            put(self, "storage_options", dict(self.storage_options))

    def jobs_for(self, sizes: list[int]) -> int:
        """``fetch_jobs``, with ``"auto"`` resolved for shards of ``sizes`` bytes (NOTE [fetch jobs])."""
        from ..remote.fetch import auto_fetch_jobs

        return auto_fetch_jobs(sizes) if self.fetch_jobs == "auto" else int(self.fetch_jobs)

    def open(self, url: str, **kwargs: Any) -> DatasetCache:
        """``url`` bound to the node cache with these options (``pyloader.remote.fetch.open_remote``)."""
        from ..remote.fetch import open_remote  # (the remote stage loads with the first remote dataset)

        return open_remote(url, cache_dir=self.cache_dir, cache_limit=self.cache_limit,
                           storage_options=self.storage_options, **kwargs)


def node_readers(readers: int = 1) -> int:
    """Readers sharing the node cache (NOTE [cache shares]): this rank's reading processes on every local rank.

    A rank's reading processes: torch's DataLoader workers when iterated by one, else
    ``readers`` (the transform processes of ``executor="processes"``).
    """
    info = get_worker_info()
    return readers_on_node(info.num_workers if info is not None else readers)


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): explicit values, else torch.distributed, else RANK/WORLD_SIZE, else (0, 1).

    Raises ValueError naming both values (and where they came from) unless
    ``0 <= rank < world_size``.
    """
    rank = check_int("rank", rank)
    world_size = check_int("world_size", world_size)
    if rank is not None and world_size is not None:
        r, w, where = rank, world_size, ""
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        r, w, where = torch.distributed.get_rank(), torch.distributed.get_world_size(), "torch.distributed"
    else:
        try:
            r = int(os.environ.get("RANK", "0"))
            w = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            raise ValueError("RANK and WORLD_SIZE must be integers") from None
        where = "the RANK/WORLD_SIZE environment variables"
    r = r if rank is None else rank
    w = w if world_size is None else world_size
    if w < 1 or not 0 <= r < w:
        src = f" (from {where})" if where else ""
        raise ValueError(f"rank={r}, world_size={w}{src}: a reader needs world_size >= 1 and 0 <= rank < world_size")
    return r, w


# NOTE [plan memory]: an epoch's plan holds, per sample of this rank's share, its unit and
# record (two int64) and the order they came from, with the temporaries that build them:
# about 32 bytes. The record count comes from a manifest (hostile until checked, NOTE
# [untrusted manifest]): a few hundred bytes can claim 2^36 records, which would make every
# rank allocate terabytes before the first shard is fetched. So each plan is checked
# against the machine's memory before it is built: more than half of RAM is refused.
PLAN_BYTES_PER_SAMPLE = 32


def physical_memory() -> int:
    """This machine's physical memory in bytes (8 GiB when it cannot be read)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 8 << 30


class _OrderField:
    """``dataset.shuffle`` etc.: one setting of ``dataset.order``.

    Assigning replaces the spec (validated), as assigning the attribute did before ``OrderSpec``.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj.order, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.order = dataclasses.replace(obj.order, **{self.name: value})


# NOTE [epoch per iteration]: a dataset iterated sample by sample -- directly (``for s in
# ds``), or by torch's ``DataLoader`` -- reads on its k-th iteration since it was built or
# since ``set_epoch(e)`` epoch ``e + k``: pyloader.DataLoader's rule for its ``iter()``s
# (NOTE [iterators of one loader]). So ``shuffle=True`` gives each epoch a new order
# without ``set_epoch``, as LitData's StreamingDataset does, while ``set_epoch`` (which
# transformers' Trainer and accelerate call, and a DistributedSampler loop calls by habit)
# names the epoch outright, so a resumed job that calls it reads the right order.
# ``ds.epoch`` stays the epoch set_epoch named. Under torch's DataLoader with workers the
# iteration starts in each worker process, on a copy of the dataset: a non-persistent worker
# is a fresh copy each epoch, so a count kept in the object would never move (and a
# persistent worker never saw the parent's set_epoch). The count lives in a small shared
# file instead (a memfd, mapped; a fork inherits it, a spawned worker gets its descriptor,
# a plain pickle or deepcopy gets a file of its own at the same count), under a lock
# (lockf between processes, a mutex between threads): the next epoch, and the epochs of
# recent iterations by key. The workers of one iteration share torch's base seed
# (``seed - id``) and, persistent, their copy's count of iterations: the first to arrive
# takes the next epoch, the others (``num_workers`` in all) find it by that key, so every
# worker of an iteration reads the same epoch and the ranks, each counting its own
# iterations, stay in step. pyloader.DataLoader plans its epochs itself and never runs this.
_RING = 32  # iterations whose epoch workers may still ask for
_WORDS = 2 + 4 * _RING  # int64: the next epoch, the ring's cursor, then (key, epoch, claimed, workers) each
_SHARED_BYTES = 8 * _WORDS


def _shared_file() -> int:
    """The descriptor of ``_SHARED_BYTES`` zero bytes in memory (a memfd; an unlinked temp file elsewhere)."""
    try:
        fd = os.memfd_create("pyloader-epochs")
    except (AttributeError, OSError):
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, _SHARED_BYTES)
    return fd


def _close_shared(m: mmap.mmap, fd: int) -> None:
    with contextlib.suppress(Exception):
        m.close()
    with contextlib.suppress(OSError):
        os.close(fd)


def _attach_epochs(dup: Any, count: int) -> _IterationEpochs:
    return _IterationEpochs(0, dup.detach(), count)


class _IterationEpochs:
    """The epoch each per-sample iteration of a dataset reads, shared with torch's workers (NOTE [epoch per iteration])."""

    def __init__(self, epoch: int, fd: int | None = None, count: int = 0) -> None:
        self._fd = _shared_file() if fd is None else fd
        self._map = mmap.mmap(self._fd, _SHARED_BYTES)
        weakref.finalize(self, _close_shared, self._map, self._fd)
        self._count = count  # this copy's iterations: a persistent worker's part of the key
        self._lock = threading.Lock()
        self._pid = os.getpid()
        if fd is None:
            self.restart(epoch)

    def __reduce__(self) -> tuple[Any, ...]:
        if _mp_context.get_spawning_popen() is not None:  # a worker being spawned shares the file
            return _attach_epochs, (DupFd(self._fd), self._count)
        return _IterationEpochs, (self.next_epoch(), None, self._count)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self._pid != os.getpid():  # a forked copy: a thread of the parent may have held the mutex
            self._lock, self._pid = threading.Lock(), os.getpid()
        with self._lock:
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def _get(self, i: int) -> int:
        return int(struct.unpack_from("<q", self._map, 8 * i)[0])

    def _put(self, i: int, value: int) -> None:
        struct.pack_into("<q", self._map, 8 * i, value)

    def restart(self, epoch: int) -> None:
        """The next iteration reads ``epoch`` (``set_epoch``)."""
        with self._locked():
            self._put(0, epoch)

    def next_epoch(self) -> int:
        """The epoch a new iteration would read."""
        with self._locked():
            return self._get(0)

    def take(self, info: Any) -> int:
        """The epoch of a new iteration; ``info``: ``get_worker_info()`` (None outside torch's workers)."""
        self._count += 1
        with self._locked():
            nxt = self._get(0)
            if info is None:
                self._put(0, nxt + 1)
                return nxt
            key = (hash((int(info.seed) - int(info.id), self._count)) & (2**62 - 1)) | 1  # 0 marks a free slot
            for k in range(_RING):
                at = 2 + 4 * k
                if self._get(at) == key and self._get(at + 2) < self._get(at + 3):
                    self._put(at + 2, self._get(at + 2) + 1)
                    return self._get(at + 1)
            cursor = self._get(1)
            at = 2 + 4 * (cursor % _RING)
            for i, v in enumerate((key, nxt, 1, int(info.num_workers))):
                self._put(at + i, v)
            self._put(1, cursor + 1)
            self._put(0, nxt + 1)
            return nxt


# NOTE [reader checks]: a dataset that cannot be read as configured fails when it is
# built, naming the values, not at its first epoch. ``rank`` and ``world_size`` (None:
# found at plan time by ``resolve_rank``) and ``num_records`` are checked when assigned;
# once a constructor has assigned all three and ``order`` (in any order), every
# assignment also runs ``UnitDataset.check_readers``: the resolved rank must lie in
# [0, world size), and ``partition="drop"`` must leave every rank a sample (which fewer
# records than ranks would not: floor(N / world) = 0). ``rank_and_world`` checks again
# each time, as torch.distributed may have started since.
_READER_KEYS = ("order", "rank", "world_size", "num_records")


class _ReaderSetting:
    """``dataset.rank``, ``world_size`` (an int or None) or ``num_records`` (an int): checked when assigned.

    See NOTE [reader checks]. A value that fails the dataset-wide check is not kept.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        try:
            return obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj: Any, value: Any) -> None:
        d = obj.__dict__
        missing = object()
        old = d.get(self.name, missing)
        d[self.name] = check_int(self.name, value)
        if all(k in d for k in _READER_KEYS):
            try:
                obj.check_readers()
            except BaseException:
                if old is missing:
                    del d[self.name]
                else:
                    d[self.name] = old
                raise


class UnitDataset(PlannedDataset):
    """A ``PlannedDataset`` made of units of records (shards, Parquet row groups).

    Its samples are ordered and partitioned by ``pyloader.read.order`` over ``unit_records``
    (records per unit).

    A subclass sets ``unit_records``, ``num_records``, ``fields``, ``order``, ``rank``,
    ``world_size`` and ``epoch``, and implements ``batches`` and ``fingerprint``; units that
    are parts of files (Parquet row groups) also set ``unit_files``, the file of each unit,
    which window mode shuffles file by file (``order.epoch_order``'s ``shard_files``). It also
    gets the per-sample iteration torch's ``DataLoader`` uses (``__iter__``, split by
    ``get_worker_info()``) and ``plan()`` for its own epoch.
    """

    unit_records: list[int]
    unit_files: list[int] | None = None
    rank = _ReaderSetting()
    world_size = _ReaderSetting()
    num_records = _ReaderSetting()
    # Per-sample tensors are views of the batch unless a subclass clones them, so that one
    # kept sample does not hold a whole reusable batch buffer (ParquetDataset's staging).
    clone_samples = False
    _unit_offsets: np.ndarray | None = None

    # NOTE [decode resolved once]: ``decode`` and ``transform`` are checked where they are
    # assigned (the constructor, or later by the user), and ``decode`` is resolved there into
    # ``image_decoders`` (field name -> ``ImageDecode``) against ``fields``, which a subclass
    # sets first; the loader, the transform stage and per-sample iteration all read that.
    @property
    def decode(self) -> Any:
        """How image fields are decoded, as given (None, an ``ImageDecode``, a dict of them per field, or False)."""
        return self.__dict__.get("_decode")

    @decode.setter
    def decode(self, value: Any) -> None:
        from ..transform.image import resolve_decode

        decoders = resolve_decode(self.fields, value)  # ValueError naming a field that is no image field
        self.__dict__["_decode"], self.__dict__["_decoders"] = value, decoders

    @property
    def image_decoders(self) -> Mapping[str, Any]:
        """Image field name -> its ``ImageDecode`` (NOTE [decode resolved once])."""
        decoders = self.__dict__.get("_decoders")
        if decoders is None:
            self.decode = self.__dict__.get("_decode")
            decoders = self.__dict__["_decoders"]
        return decoders

    @property
    def transform(self) -> Any:
        """``fn(sample)`` or ``fn(sample, ctx)`` applied to every sample (None: none)."""
        return self.__dict__.get("_transform")

    @transform.setter
    def transform(self, value: Any) -> None:
        self.__dict__["_transform"] = check_callable("transform", value)

    def _configure(self, *, shuffle: bool, seed: int, rank: int | None, world_size: int | None, partition: str,
                   transform: Any, shuffle_mode: str = DEFAULTS["shuffle_mode"],
                   window: int = DEFAULTS["window"]) -> None:
        """The keywords every dataset takes, checked in this one place (NOTE [one rule per setting]).

        ``decode`` is set by the subclass once its ``fields`` are known (NOTE [decode resolved once]).
        """
        self.order = OrderSpec(shuffle=shuffle, seed=seed, shuffle_mode=shuffle_mode, window=window,
                               partition=partition)
        self.rank = rank
        self.world_size = world_size
        self.transform = transform
        self.epoch = 0

    @property
    def epoch(self) -> int:
        """The epoch ``set_epoch`` named (0 by default).

        What ``plan()`` and ``batches()`` read when given none, and what the first per-sample
        iteration after ``set_epoch`` reads; each further iteration reads the next epoch
        (NOTE [epoch per iteration]).
        """
        return int(self.__dict__.get("_epoch_set", 0))

    @epoch.setter
    def epoch(self, value: int) -> None:
        value = check_count("epoch", value)
        self.__dict__["_epoch_set"] = value
        shared = self.__dict__.get("_epochs")
        if shared is None:
            self.__dict__["_epochs"] = _IterationEpochs(value)
        else:
            shared.restart(value)

    def global_index(self, units: np.ndarray, records: np.ndarray) -> np.ndarray:
        """The global record indices of plan rows (see ``PlannedDataset``): unit offset + record."""
        offsets = self._unit_offsets
        if offsets is None:
            counts = np.asarray(self.unit_records, dtype=np.int64)
            offsets = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts, out=offsets[1:])
            self._unit_offsets = offsets
        return offsets[np.asarray(units, dtype=np.int64)] + np.asarray(records, dtype=np.int64)

    def unread_count(self, epoch: int, segments: Sequence[Sequence[int]], *, partition: str) -> int:
        """Samples of ``epoch`` that ``segments`` left unread (see ``PlannedDataset``).

        A dataset that partitions otherwise (a ``Mixture``, NOTE [mixture partition]) says so here.
        """
        return _order.unread_count(self.num_records, partition=partition, segments=segments)

    shuffle = _OrderField()
    seed = _OrderField()
    shuffle_mode = _OrderField()
    window = _OrderField()
    partition = _OrderField()

    def rank_and_world(self) -> tuple[int, int]:
        """(rank, world size): ``rank``/``world_size`` where set, else as ``resolve_rank`` finds them.

        Checked by ``check_readers`` (ValueError).
        """
        return self.check_readers()

    def check_readers(self) -> tuple[int, int]:
        """(rank, world size), once this rank can read the dataset as configured (NOTE [reader checks]).

        Raises:
            ValueError: the rank is outside ``[0, world_size)``, or ``partition="drop"``
                with fewer records than ranks would give every rank an empty epoch.
        """
        rank, world = resolve_rank(self.rank, self.world_size)
        n = self.num_records
        if self.order.partition == "drop" and 0 < n < world:
            raise ValueError(
                f"partition='drop' with world_size={world} and {n} records gives every rank floor({n} / {world}) "
                "= 0 samples: use partition='pad' (which repeats samples so that each rank reads one) or fewer ranks")
        return rank, world

    def _check_plan_memory(self, world: int) -> None:
        """Raises ``PlanMemoryError`` before a plan that would not fit in memory is built (NOTE [plan memory])."""
        n = self.num_records
        per_rank = -(-n // max(1, world))
        need = per_rank * PLAN_BYTES_PER_SAMPLE
        ram = physical_memory()
        if need > ram // 2:
            where = getattr(self, "url", None) or type(self).__name__
            raise PlanMemoryError(
                f"{where}: its manifest lists {n} records, {per_rank} for each of {world} ranks; planning an "
                f"epoch needs about {need / 2**30:.1f} GiB per rank ({PLAN_BYTES_PER_SAMPLE} bytes a sample), more "
                f"than half of this machine's {ram / 2**30:.1f} GiB. A manifest that claims that many records is "
                "wrong or hostile; a real dataset that large needs more ranks (world_size) or more memory")

    def epoch_plan(self, epoch: int, rank: int, world: int, segments: Sequence[Sequence[int]] = (), *,
                   worker: int = 0, num_workers: int = 1, shuffle: bool | None = None,
                   seed: int | None = None) -> Plan:
        """The ``pyloader.read.order`` plan of ``epoch`` over the units (see ``PlannedDataset``)."""
        self._check_plan_memory(world)
        o = self.order.with_overrides(shuffle=shuffle, seed=seed)
        kw: dict[str, Any] = dict(shuffle=o.shuffle, seed=o.seed, epoch=epoch, rank=rank, world_size=world,
                                  worker=worker, num_workers=num_workers, shuffle_mode=o.shuffle_mode,
                                  window=o.window, partition=o.partition, shard_files=self.unit_files)
        if segments:
            return _order.resume_plan(self.unit_records, segments=segments, **kw)
        return _order.plan(self.unit_records, **kw)

    def plan(self, *, epoch: int | None = None, worker: int = 0, num_workers: int = 1,
             shuffle: bool | None = None, seed: int | None = None) -> Plan:
        """``epoch_plan`` for this dataset's rank and (default) its current epoch."""
        rank, world = self.rank_and_world()
        return self.epoch_plan(self.epoch if epoch is None else epoch, rank, world, worker=worker,
                               num_workers=num_workers, shuffle=shuffle, seed=seed)

    def _own_plan(self, plan: Plan | None, epoch: int | None, worker: int, num_workers: int,
                  shuffle: bool | None, seed: int | None) -> Plan:
        """``plan`` if given, else this rank's plan of ``epoch`` (the ``batches`` convenience)."""
        return self.plan(epoch=epoch, worker=worker, num_workers=num_workers, shuffle=shuffle,
                         seed=seed) if plan is None else plan

    def __len__(self) -> int:
        """Samples this rank reads per epoch (after padding or dropping)."""
        _, world = self.rank_and_world()
        n = self.num_records
        return -(-n // world) if self.order.partition == "pad" else n // world

    def __getitem__(self, index: Any) -> dict[str, Any]:
        """Not supported: a pyloader dataset is iterable-style (read in its epoch's order), with no ``ds[i]``.

        Raises ``NotImplementedError`` (the type torch's ``Dataset.__getitem__`` raises)
        saying how to read it: iterate it, or give it to a ``DataLoader``.
        """
        name = type(self).__name__
        raise NotImplementedError(
            f"{name}[{index!r}]: a {name} is an iterable-style dataset (torch.utils.data.IterableDataset): its "
            f"samples are read in each epoch's order and it has no random access by index; iterate it "
            f"instead: next(iter(ds)) or `for sample in ds` for samples, pyloader.DataLoader(ds, batch_size=...) "
            f"for batches")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # See NOTE [per-sample path under accelerate]: checked before the first sample.
        _, world = self.rank_and_world()
        check_per_sample_reader(self, self.rank is not None and self.world_size is not None, world)
        info = get_worker_info()
        epoch = self.__dict__["_epochs"].take(info)  # See NOTE [epoch per iteration]
        return self._samples(epoch, info)

    def _samples(self, epoch: int, info: Any) -> Iterator[dict[str, Any]]:
        """The samples of this rank's (and torch worker's) share of ``epoch``."""
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        units, records = self.plan(epoch=epoch, worker=worker, num_workers=num_workers)
        it = self.batches(_SAMPLE_MODE_BATCH, plan=(units, records), num_threads=1, prefetch=2)
        spec = self._sample_spec(epoch)
        try:
            if spec is None:
                for batch in it:
                    rows = next(iter(batch.values())).shape[0]
                    for i in range(rows):
                        yield self.sample(batch, i)
                return
            # The dataset's decode and transform, sample by sample, in this (torch worker) process.
            from ..transform.stage import run_batch

            gidx = self.global_index(units, records)
            pos = 0
            for batch in it:
                rows = next(iter(batch.values())).shape[0]
                sl = slice(pos, pos + rows)
                pos += rows
                yield from run_batch(spec, self, batch, units[sl], records[sl], gidx[sl], worker).result
        finally:
            it.close()

    def _sample_spec(self, epoch: int) -> Any:
        """The ``TransformSpec`` of this dataset's own transform and decoding (None: nothing to do)."""
        from ..transform.stage import TransformSpec

        decode = dict(self.image_decoders)
        if self.transform is None and not decode:
            return None
        return TransformSpec(self.transform, decode, None, self.order.seed, epoch)

    def sample(self, batch: Mapping[str, torch.Tensor], i: int) -> dict[str, Any]:
        """Row ``i`` of ``batch`` per field (views unless ``clone_samples``).

        Variable-length rows are cut to their length; ``bytes`` fields come as ``bytes``.
        """
        out: dict[str, Any] = {}
        for f in self.fields:
            t = batch[f.name][i]
            if f.variable:
                t = t[: int(batch[f"{f.name}_lengths"][i])]
            if f.dtype == "bytes":
                out[f.name] = bytes(t.numpy())
            else:
                out[f.name] = t.clone() if self.clone_samples else t
        return out

    def samples(self, batch: Mapping[str, torch.Tensor]) -> list[dict[str, Any]]:
        """Every row of ``batch`` as ``sample(batch, i)`` gives it, split one field at a time.

        What a transform worker takes its samples from: about 1 us a row where ``sample`` takes
        7 (a torch index and, for a variable field, its length, per field and row). A
        subclass that overrides ``sample`` gets its own, row by row.
        """
        rows = int(batch[self.fields[0].name].shape[0]) if self.fields else 0
        if type(self).sample is not UnitDataset.sample:
            return [self.sample(batch, i) for i in range(rows)]
        out: list[dict[str, Any]] = [{} for _ in range(rows)]
        for f in self.fields:
            t = batch[f.name]
            lengths = batch[f"{f.name}_lengths"].tolist() if f.variable else None
            if f.dtype == "bytes":
                a = t.numpy()
                for i in range(rows):
                    out[i][f.name] = (a[i, : lengths[i]] if lengths is not None else a[i]).tobytes()
                continue
            views = torch.unbind(t)
            for i in range(rows):
                v = views[i] if lengths is None else views[i][: lengths[i]]
                out[i][f.name] = v.clone() if self.clone_samples else v
        return out


__all__ = ["PLAN_BYTES_PER_SAMPLE", "RemoteOptions", "UnitDataset", "node_readers", "physical_memory", "resolve_rank"]
