"""The dataset contract: what ``pyloader.DataLoader`` needs from a dataset, and nothing more.

NOTE [dataset contract]: a pyloader dataset subclasses ``PlannedDataset`` and provides

* ``order``: its ``OrderSpec`` (shuffle, seed, shuffle_mode, window, partition), one name
  per setting, validated once when the spec is built;
* ``num_records``, ``fields``, ``epoch`` / ``set_epoch(epoch)``, ``len()`` (samples this
  rank reads per epoch) and ``rank_and_world()`` (the rank it reads as);
* ``epoch_plan(epoch, rank, world, segments, ...)``: the ``Plan`` (unit index, record
  index) this rank (and worker) reads, in order; with ``segments`` it is the rest of an
  epoch already consumed that way (NOTE [resume segments] in ``pyloader.read.order``);
* ``batches(batch_size, plan=..., ...)``: a ``BatchStream`` reading exactly that plan;
* ``sample(batch, i)``: sample ``i`` of a batch, as the per-sample paths yield it;
* ``fingerprint``: the identity a resumed loader checks (``None``: not resumable);
  optionally ``fingerprint_parts``, the named digests it combines, so that a state from
  other data can name what differs (``None`` by default).

The loader plans (``epoch_plan``), reads (``batches``) and splits (``sample``) through
these alone, so any dataset that implements them -- shards, Parquet row groups, and
next mixtures or packed token streams -- gets batching, staging, device prefetch and
(with a fingerprint) exact resumption. ``UnitDataset`` implements the planning part for
datasets made of units of records (shards, row groups) ordered by ``pyloader.read.order``.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ..format.spec import Field
from . import order as _order

SHUFFLE_MODES, PARTITIONS = _order.SHUFFLE_MODES, _order.PARTITIONS
# Records per internal batch when yielding single samples to torch's DataLoader.
_SAMPLE_MODE_BATCH = 64

Plan = tuple[np.ndarray, np.ndarray]
"""(unit index int32, record index int64), C-contiguous, in read order."""


@dataclasses.dataclass(frozen=True)
class OrderSpec:
    """How a dataset orders and partitions its samples each epoch (``pyloader.read.order``).

    ``shuffle_mode="global"``: a permutation of all samples; ``"window"``: units in a
    shuffled order, then samples shuffled within windows of ``window`` samples
    (NOTE [window size]). ``partition="pad"`` gives every rank ceil(N / world) samples,
    ``"drop"`` floor(N / world). Validated here, once; raises ``ValueError``.
    """

    shuffle: bool = False
    seed: int = 0
    shuffle_mode: str = "global"
    window: int = 65536
    partition: str = "pad"

    def __post_init__(self) -> None:
        if self.shuffle_mode not in SHUFFLE_MODES:
            raise ValueError(f"shuffle_mode must be one of {SHUFFLE_MODES}, got {self.shuffle_mode!r}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError("seed must be a non-negative int")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError("window must be a positive int")
        if not isinstance(self.shuffle, (bool, np.bool_)):
            raise ValueError(f"shuffle must be a bool, got {type(self.shuffle).__name__}")  # noqa: TRY004
        object.__setattr__(self, "shuffle", bool(self.shuffle))

    def with_overrides(self, *, shuffle: bool | None = None, seed: int | None = None) -> OrderSpec:
        """This spec with ``shuffle`` and ``seed`` replaced where not None (the loader's overrides)."""
        changes: dict[str, Any] = {}
        if shuffle is not None:
            changes["shuffle"] = shuffle
        if seed is not None:
            changes["seed"] = seed
        return dataclasses.replace(self, **changes) if changes else self

    def settings(self) -> dict[str, Any]:
        """The settings as a plain dict (the keys of a loader state, NOTE [resume state])."""
        return dataclasses.asdict(self)


def _reader_value(name: str, value: object, lo: int, optional: bool = True) -> int | None:
    """``value`` as an int >= ``lo`` (or None if ``optional``); else a ValueError naming it (bools are not ints)."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < lo:
        kind = "a non-negative int" if lo == 0 else f"an int >= {lo}"
        raise ValueError(f"{name} must be {kind}{' or None' if optional else ''}, got {value!r}")
    return int(value)


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): explicit values, else torch.distributed, else RANK/WORLD_SIZE, else (0, 1).

    Raises ValueError naming both values (and where they came from) unless
    ``0 <= rank < world_size``.
    """
    rank = _reader_value("rank", rank, 0)
    world_size = _reader_value("world_size", world_size, 1)
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


def check_batch_args(batch_size: object, num_threads: object, prefetch: object) -> int:
    """Checks the reading arguments of ``batches()``; returns ``prefetch`` (default: two batches per thread).

    Raises:
        ValueError: ``batch_size``, ``num_threads`` or ``prefetch`` is not a positive int.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError("batch_size must be a positive int")
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError("num_threads must be a positive int")
    prefetch = 2 * num_threads if prefetch is None else prefetch
    if not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError("prefetch must be a positive int")
    return prefetch


class BatchStream(Protocol):
    """What ``PlannedDataset.batches`` returns: batches (dicts of tensors) in plan order.

    ``timeout`` (seconds, 0: forever) bounds each ``next()``; ``on_finish`` is called once
    with ``stats()`` when the stream ends or closes; ``close()`` stops its threads and is
    idempotent. A stream whose batches live in the loader's slot pool (the ``pool`` given
    to ``batches``) also has ``next_host()`` -> (host batch, tensors), for the copy engine.
    """

    timeout: float
    on_finish: Callable[[dict[str, Any]], None] | None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]: ...

    def __next__(self) -> dict[str, torch.Tensor]: ...

    def __len__(self) -> int: ...

    def close(self) -> None:
        """Stops the stream's threads. Idempotent."""

    def stats(self) -> dict[str, Any]:
        """Per-stage counters and rates of this stream (``BatchIterator.stats`` lists them)."""


class PipelineStream(BatchStream, Protocol):
    """A ``BatchStream`` fed by one native pipeline that can be made ahead of its epoch and tuned.

    What a dataset whose ``pipeline_streams`` is true returns from ``batches``, which then
    also takes ``ahead=``, ``early=`` and ``active_threads=`` (``ShardDataset.batches``
    documents them). Used by the loader's epoch-ahead (NOTE [epoch ahead] in
    ``pyloader.loader.dataloader``) and auto-tuning (NOTE [autotune]).
    """

    prefetch: int
    ahead_target: int
    tuner: Any

    def counters(self) -> dict[str, int]:
        """The native pipeline's raw counters."""

    def tail_hook(self, fn: Callable[[], None], at: int) -> None:
        """Calls ``fn()`` once, right after batch number ``at`` is handed out."""

    def hand_over(self, nxt: PipelineStream) -> None:
        """Once this stream's batches are all claimed, ``nxt`` (made ahead) runs at ``nxt.ahead_target``."""

    def begin(self) -> None:
        """This stream, made ahead of its epoch, starts its epoch now."""

    def tune(self, threads: int, ahead: int) -> None:
        """How many of its threads collate, and how far ahead."""

    def downloads(self) -> dict[str, int] | None:
        """Remote data: ``{"jobs", "bytes", "job_bytes", "pending"}`` of its downloads; local data: None."""

    def tune_downloads(self, jobs: int) -> None:
        """Remote data: how many downloads run at once."""


class PlannedDataset(abc.ABC):
    """The dataset contract (NOTE [dataset contract])."""

    # ``batches`` returns a PipelineStream and takes its extra arguments: the loader may
    # tune its threads (datasets that can say so set it); ``early_streams``: and may start
    # the next epoch's stream ahead of its iter().
    pipeline_streams: bool = False
    early_streams: bool = False

    order: OrderSpec
    num_records: int
    fields: list[Field]
    epoch: int
    # Per-sample work (NOTE [thread executor] in pyloader.transform.threads): the default
    # transform and image decoding of the loaders reading this dataset.
    transform: Callable[..., Any] | None = None
    decode: Any = None

    def global_index(self, units: np.ndarray, records: np.ndarray) -> np.ndarray:
        """The global record indices (position in the dataset) of plan rows: the seeds' ``index`` (NOTE [sample seeds])."""
        offsets = getattr(self, "_unit_offsets", None)
        if offsets is None:
            counts = np.asarray(self.unit_records, dtype=np.int64)  # type: ignore[attr-defined]
            offsets = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts, out=offsets[1:])
            self._unit_offsets = offsets
        return offsets[np.asarray(units, dtype=np.int64)] + np.asarray(records, dtype=np.int64)

    def record_name(self, unit: int, record: int) -> str:
        """Where a record lives, for messages (``"unit U, record R"``; datasets name their shards)."""
        return f"unit {unit}, record {record}"

    def set_epoch(self, epoch: int) -> None:
        """The epoch ``batches`` and per-sample iteration read when none is given."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError("epoch must be a non-negative int")
        self.epoch = epoch

    @abc.abstractmethod
    def rank_and_world(self) -> tuple[int, int]:
        """(rank, world size) this dataset reads as."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Samples this rank reads per epoch."""

    @abc.abstractmethod
    def epoch_plan(self, epoch: int, rank: int, world: int, segments: Sequence[Sequence[int]] = (), *,
                   worker: int = 0, num_workers: int = 1, shuffle: bool | None = None,
                   seed: int | None = None) -> Plan:
        """What (rank, worker) reads in ``epoch``.

        With ``segments`` (``(world_size, batch_size, steps)`` each), the rest of the epoch
        after them. ``shuffle``/``seed`` override ``order``'s.
        """

    @abc.abstractmethod
    def batches(self, batch_size: int, *, plan: Plan, drop_last: bool = False, num_threads: int = 2,
                prefetch: int | None = None, pool: Any = None) -> BatchStream:
        """The batched stream over ``plan``.

        ``pool``: the loader's slot pool, for datasets that collate into it (others ignore it).
        """

    @abc.abstractmethod
    def sample(self, batch: dict[str, torch.Tensor], i: int) -> dict[str, Any]:
        """Sample ``i`` of ``batch``, as the per-sample paths yield it."""

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str | None:
        """The resumable identity (NOTE [resume state]); None when the dataset cannot resume."""

    def unread_count(self, epoch: int, segments: Sequence[Sequence[int]], *, partition: str) -> int:
        """Samples of ``epoch`` that ``segments`` left unread; ValueError for segments it cannot have.

        What a loader checks a loaded state with (NOTE [resume segments]); a dataset that
        partitions otherwise (a ``Mixture``, NOTE [mixture partition]) says so here.
        """
        return _order.unread_count(self.num_records, partition=partition, segments=segments)

    @property
    def fingerprint_parts(self) -> dict[str, str] | None:
        """Named digests the fingerprint combines (a state keeps them to name what differs); None: none."""
        return None


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

    NOTE [reader checks]. A value that fails the dataset-wide check is not kept.
    """

    def __init__(self, lo: int, optional: bool) -> None:
        self.lo, self.optional = lo, optional

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
        d[self.name] = _reader_value(self.name, value, self.lo, self.optional)
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
    ``world_size`` and ``epoch``, and implements ``batches`` and ``fingerprint``. It also
    gets the per-sample iteration torch's ``DataLoader`` uses (``__iter__``, split by
    ``get_worker_info()``) and ``plan()`` for its own epoch.
    """

    unit_records: list[int]
    rank = _ReaderSetting(0, optional=True)
    world_size = _ReaderSetting(1, optional=True)
    num_records = _ReaderSetting(0, optional=False)
    # Per-sample tensors are views of the batch unless a subclass clones them, so that one
    # kept sample does not hold a whole reusable batch buffer (ParquetDataset's staging).
    clone_samples = False

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

    def epoch_plan(self, epoch: int, rank: int, world: int, segments: Sequence[Sequence[int]] = (), *,
                   worker: int = 0, num_workers: int = 1, shuffle: bool | None = None,
                   seed: int | None = None) -> Plan:
        """The ``pyloader.read.order`` plan of ``epoch`` over the units (see ``PlannedDataset``)."""
        o = self.order.with_overrides(shuffle=shuffle, seed=seed)
        kw: dict[str, Any] = dict(shuffle=o.shuffle, seed=o.seed, epoch=epoch, rank=rank, world_size=world,
                                  worker=worker, num_workers=num_workers, shuffle_mode=o.shuffle_mode,
                                  window=o.window, partition=o.partition)
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

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        units, records = self.plan(worker=worker, num_workers=num_workers)
        it = self.batches(_SAMPLE_MODE_BATCH, plan=(units, records), num_threads=1, prefetch=2)
        spec = self._sample_spec()
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

    def _sample_spec(self) -> Any:
        """The ``TransformSpec`` of this dataset's own transform and decoding (None: nothing to do)."""
        from ..transform.image import resolve_decode
        from ..transform.stage import TransformSpec

        decode = resolve_decode(self.fields, self.decode)
        if self.transform is None and not decode:
            return None
        return TransformSpec(self.transform, decode, None, self.order.seed, self.epoch)

    def sample(self, batch: dict[str, torch.Tensor], i: int) -> dict[str, Any]:
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


__all__ = ["PARTITIONS", "SHUFFLE_MODES", "BatchStream", "OrderSpec", "Plan", "PlannedDataset", "UnitDataset",
           "PipelineStream", "check_batch_args", "resolve_rank"]
