"""The contract every stage shares: settings and their rules, the epoch order, plans, datasets and batch streams.

It sits below ``transform/`` and ``read/`` (pyloader/README.md): the loader drives a
dataset, and the transform stage consumes one, through these types alone.

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
  ``global_index(units, records)``: the plan rows' positions in the dataset (the seeds of
  per-sample transforms); ``record_name(unit, record)``: where a record lives, for messages;
* ``fingerprint``: the identity a resumed loader checks (``None``: not resumable);
  optionally ``fingerprint_parts``, the named digests it combines, so that a state from
  other data can name what differs (``None`` by default).

A dataset whose streams are native pipelines (tunable, startable ahead of their epoch,
readable into pinned slots zero-copy, packable) subclasses ``PipelineDataset`` instead:
its ``batches`` takes the pipeline's extra arguments and returns a ``PipelineStream``.
The loader asks ``isinstance(dataset, PipelineDataset)``, never a flag.

The loader plans (``epoch_plan``), reads (``batches``) and splits (``sample``) through
these alone, so any dataset that implements them gets batching, transforms, staging,
device prefetch and (with a fingerprint) exact resumption. ``docs/extending.md`` writes
one in 40 lines.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast

import numpy as np

from .format.sizes import parse_size
from .format.spec import Field

if TYPE_CHECKING:  # torch is not imported at run time: the write stage checks its settings here too
    import torch

    from ._C import BatchPipeline, HostBatch, SlotPool

SHUFFLE_MODES = ("global", "window")
PARTITIONS = ("pad", "drop")

Plan = tuple[np.ndarray, np.ndarray]
"""(unit index int32, record index int64), C-contiguous, in read order."""

Batch: TypeAlias = "dict[str, torch.Tensor]"
"""A collated batch: one tensor per field (``<name>_lengths`` beside a variable-length one)."""


# -- settings ------------------------------------------------------------------------------
# NOTE [one rule per setting]: every setting a user gives is checked once, at the edge where
# it is given (a constructor, a setter), by the one rule of its name in ``INT_SETTINGS``
# (or ``check_bool`` / ``check_callable`` / ``check_choice``), so a value gets the same
# error whichever class receives it. An int setting takes a Python int or a numpy integer
# (kept as a Python int), never a bool, within its bounds; the native side only guards.
# ``DEFAULTS`` holds each default once.
_I64 = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class IntRule:
    """The rule of an integer setting: ``lo <= value <= hi``; ``optional``: None is allowed (and means the default)."""

    lo: int
    hi: int = _I64
    optional: bool = False
    # torch's own wording for torch's arguments (its tests and users match on it); else the rule's.
    message: str = ""
    # ``message`` is torch's for an int out of range only (torch has no words of its own for a
    # value of another type, e.g. num_workers="2"): such a value gets the rule's words.
    range_message: bool = False
    kind: str = ""  # the rule in words where "a positive int" would say less (e.g. "a positive number of bytes")

    def describe(self) -> str:
        """``"a positive int or None"``: the rule in words, as messages give it (the upper bound apart)."""
        kind = self.kind or {0: "a non-negative int", 1: "a positive int"}.get(self.lo, f"an int >= {self.lo}")
        return kind + (" or None" if self.optional else "")

    def top(self) -> str:
        """The upper bound in words."""
        return "2**64 - 1" if self.hi == 2**64 - 1 else str(self.hi)


INT_SETTINGS: dict[str, IntRule] = {
    "batch_size": IntRule(1, message="batch_size should be a positive integer value, but got batch_size={value!r}"),
    "num_threads": IntRule(1, 4096),
    "prefetch": IntRule(1, 1 << 20, optional=True),
    "seed": IntRule(0, 2**64 - 1),
    "window": IntRule(1, 2**62 - 1),
    "epoch": IntRule(0, 2**32 - 1),
    "num_batches": IntRule(0, 2**62 - 1),
    "rank": IntRule(0, 2**31 - 2, optional=True),
    "world_size": IntRule(1, 2**31 - 1, optional=True),
    "num_records": IntRule(0, 2**62 - 1),
    "samples_per_epoch": IntRule(1, 2**62 - 1, optional=True),
    "samples_per_step": IntRule(1, 2**62 - 1),
    "seq_len": IntRule(1, 2**31 - 1),
    "doc_batch": IntRule(1, 2**31 - 1),
    "lookahead": IntRule(1, 2**31 - 1),
    "pad_id": IntRule(-(2**63), 2**64 - 1, kind="an int"),
    "fetch_jobs": IntRule(1, 4096, message="fetch_jobs must be 'auto' or a positive int, got {value!r}"),
    "num_workers": IntRule(0, 4096, message="num_workers option should be non-negative; use num_workers=0 to "
                                            "disable multiprocessing.", range_message=True,
                           kind="a non-negative int or 'auto'"),
    "prefetch_factor": IntRule(0, 1 << 20, optional=True, message="prefetch_factor option should be non-negative",
                               range_message=True),
    "device_prefetch": IntRule(1, 1 << 20),
    "memory_budget": IntRule(1, optional=True, kind="a positive number of bytes (an int, or a size such as '8G')"),
}

DEFAULTS: dict[str, Any] = {
    "shuffle": False, "seed": 0, "shuffle_mode": "global", "window": 65536, "partition": "pad",
    "fetch_jobs": "auto", "device_prefetch": 2, "num_threads": 2,
}


def cpu_budget() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_memory_budget() -> int:
    """An eighth of the machine's memory, at most 4 GiB."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = 8 << 30
    return int(min(4 << 30, total // 8))


def default_prefetch(threads: int) -> int:
    """Batches collated ahead when none is given: two per collating thread (the one default of ``prefetch``)."""
    return 2 * threads


def check_int(name: str, value: object) -> int | None:
    """``value`` checked by the rule of setting ``name`` (NOTE [one rule per setting]); ValueError naming it otherwise."""
    rule = INT_SETTINGS[name]
    if value is None and rule.optional:
        return None
    not_int = isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral)
    n = rule.lo - 1 if not_int else int(cast(numbers.Integral, value))
    if n < rule.lo:
        if rule.message and not (not_int and rule.range_message):
            raise ValueError(rule.message.format(value=value))
        raise ValueError(f"{name} must be {rule.describe()}, got {value!r}")
    if n > rule.hi:
        raise ValueError(f"{name} must be at most {rule.top()}, got {value!r}")
    return n


def check_size(name: str, value: object) -> int | None:
    """``check_int`` for a setting of bytes that also takes a size string (``"1G"``, ``"512MiB"``: ``parse_size``).

    A string that is no size gets the rule's message, as a bad int does.
    """
    if isinstance(value, str):
        rule = INT_SETTINGS[name]
        try:
            parsed = parse_size(value)
        except ValueError:
            parsed = rule.lo - 1
        if not rule.lo <= parsed <= rule.hi:
            raise ValueError(f"{name} must be {rule.describe()}, got {value!r}")
        return parsed
    return check_int(name, value)


def check_count(name: str, value: object) -> int:
    """``check_int`` for a setting that is never None here."""
    out = check_int(name, value)
    if out is None:
        raise ValueError(f"{name} must be {INT_SETTINGS[name].describe().removesuffix(' or None')}, got None")
    return out


def check_bool(name: str, value: object, *, optional: bool = False) -> bool | None:
    """A bool (or numpy bool), kept as a Python bool; None too when ``optional``."""
    if value is None and optional:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be {'None, ' if optional else ''}True or False, got {value!r}")
    return bool(value)


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """One of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_callable(name: str, value: Any) -> Callable[..., Any] | None:
    """A callable or None."""
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be callable, got {value!r}")
    return value


def check_seconds(name: str, value: object) -> float:
    """A finite non-negative number of seconds (0: no limit), kept as given.

    An int (a numpy integer too) stays a Python int, another real number becomes a float.
    Messages print it as given, as torch's do: "after 2 seconds", not "2.0" (See NOTE [timeout message]).
    """
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real)
            or not math.isfinite(float(value)) or float(value) < 0):
        raise ValueError(f"{name} option should be non-negative")
    return int(value) if isinstance(value, numbers.Integral) else float(value)


# -- the epoch order -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OrderSpec:
    """How a dataset orders and partitions its samples each epoch (``pyloader.read.order``).

    ``shuffle_mode="global"``: a permutation of all samples; ``"window"``: units in a
    shuffled order, then samples shuffled within windows of ``window`` samples
    (NOTE [window size]). ``partition="pad"`` gives every rank ceil(N / world) samples,
    ``"drop"`` floor(N / world). Validated here, once (NOTE [one rule per setting]).
    """

    shuffle: bool = DEFAULTS["shuffle"]
    seed: int = DEFAULTS["seed"]
    shuffle_mode: str = DEFAULTS["shuffle_mode"]
    window: int = DEFAULTS["window"]
    partition: str = DEFAULTS["partition"]

    def __post_init__(self) -> None:
        check_choice("shuffle_mode", self.shuffle_mode, SHUFFLE_MODES)
        check_choice("partition", self.partition, PARTITIONS)
        object.__setattr__(self, "seed", check_int("seed", self.seed))
        object.__setattr__(self, "window", check_int("window", self.window))
        object.__setattr__(self, "shuffle", check_bool("shuffle", self.shuffle))

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


# -- batch streams -------------------------------------------------------------------------
class BatchStream(Protocol):
    """What ``PlannedDataset.batches`` returns: batches (dicts of tensors) in plan order.

    ``timeout`` (seconds, 0: forever) bounds each ``next()``; ``on_finish`` is called once
    with ``stats()`` when the stream ends or closes; ``close()`` stops its threads and is
    idempotent.
    """

    timeout: float
    on_finish: Callable[[dict[str, Any]], None] | None

    def __iter__(self) -> Iterator[Batch]: ...

    def __next__(self) -> Batch: ...

    def __len__(self) -> int: ...

    def close(self) -> None:
        """Stops the stream's threads. Idempotent."""

    def stats(self) -> dict[str, Any]:
        """Per-stage counters and rates of this stream (``BatchIterator.stats`` lists them)."""


class Tuner(Protocol):
    """What a ``PipelineStream`` tells the loader's auto-tuner (NOTE [autotune])."""

    def observe(self, stream: Any, batch: Batch | None) -> None:
        """A batch (None: a slice of waiting without one) of ``stream``, with its counters."""

    def report(self) -> dict[str, Any]:
        """What the tuner chose and why, for ``stats()``."""


class PipelineStream(BatchStream, Protocol):
    """A ``BatchStream`` fed by one native pipeline: tunable, startable ahead, readable zero-copy.

    What a ``PipelineDataset``'s ``batches`` returns. Used by the loader's epoch-ahead
    (NOTE [epoch ahead]), auto-tuning (NOTE [autotune]), zero-copy staging (``next_host``)
    and packing (``pipeline``).
    """

    prefetch: int
    ahead_target: int
    tuner: Tuner | None

    @property
    def pipeline(self) -> BatchPipeline:
        """The native pipeline (the packer reads its documents from it)."""

    def next_host(self) -> tuple[HostBatch, Batch]:
        """The next batch with its native slot (the copy engine keeps the slot until its copies completed)."""

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


# -- datasets ------------------------------------------------------------------------------
class PlannedDataset(abc.ABC):
    """The dataset contract (NOTE [dataset contract])."""

    order: OrderSpec
    num_records: int
    fields: list[Field]
    epoch: int
    # Per-sample work (NOTE [thread executor] in pyloader.transform.threads): the default
    # transform and image decoding of the loaders reading this dataset.
    transform: Callable[..., Any] | None = None
    decode: Any = None

    def record_name(self, unit: int, record: int) -> str:
        """Where a record lives, for messages (``"unit U, record R"``; datasets name their shards)."""
        return f"unit {unit}, record {record}"

    def set_epoch(self, epoch: int) -> None:
        """The epoch ``batches`` and per-sample iteration read when none is given."""
        self.epoch = check_count("epoch", epoch)

    @property
    def image_decoders(self) -> Mapping[str, Any]:
        """Image field name -> its decoder (``ImageDecode``), from ``decode``; empty: no image decoding."""
        return {}

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
    def global_index(self, units: np.ndarray, records: np.ndarray) -> np.ndarray:
        """The global record indices (position in the dataset) of plan rows: the seeds' ``index`` (NOTE [sample seeds])."""

    @abc.abstractmethod
    def batches(self, batch_size: int, *, plan: Plan, drop_last: bool = False, num_threads: int = 2,
                prefetch: int | None = None, pool: SlotPool | None = None, readers: int = 1) -> BatchStream:
        """The batched stream over ``plan``.

        ``pool``: the loader's slot pool, for datasets that collate into it (others ignore
        it). ``readers``: how many processes of this rank read the dataset at once, each its
        own share of the plan (a remote dataset sizes its share of the node cache by it;
        torch's worker processes are counted from ``get_worker_info()`` on top).
        """

    @abc.abstractmethod
    def sample(self, batch: Mapping[str, torch.Tensor], i: int) -> dict[str, Any]:
        """Sample ``i`` of ``batch``, as the per-sample paths yield it."""

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str | None:
        """The resumable identity (NOTE [resume state]); None when the dataset cannot resume."""

    @abc.abstractmethod
    def unread_count(self, epoch: int, segments: Sequence[Sequence[int]], *, partition: str) -> int:
        """Samples of ``epoch`` that ``segments`` left unread; ValueError for segments it cannot have.

        What a loader checks a loaded state with (NOTE [resume segments]).
        """

    @property
    def fingerprint_parts(self) -> dict[str, str] | None:
        """Named digests the fingerprint combines (a state keeps them to name what differs); None: none."""
        return None


class PipelineDataset(PlannedDataset):
    """A dataset whose batch streams are native pipelines (``PipelineStream``).

    Its ``batches`` also takes ``ahead`` (collate at most that many batches ahead at first;
    0: none until raised; None: ``prefetch``), ``early`` (a stream made ahead of its epoch,
    NOTE [epoch ahead]), ``active_threads`` (how many of the threads collate at first) and
    ``ragged`` (variable fields back to back, for the packer: NOTE [ragged batches]).
    """

    @property
    def early_streams(self) -> bool:
        """Whether a stream may be started ahead of its epoch (not while its data is still being fetched)."""
        return True

    @abc.abstractmethod
    def batches(self, batch_size: int, *, plan: Plan, drop_last: bool = False, num_threads: int = 2,
                prefetch: int | None = None, pool: SlotPool | None = None, readers: int = 1,
                ahead: int | None = None, early: bool = False, active_threads: int | None = None,
                ragged: bool = False) -> PipelineStream:
        """The native pipeline over ``plan`` (the arguments: ``PlannedDataset.batches`` and the class's)."""


def check_stream_args(batch_size: object, num_threads: object, prefetch: object) -> tuple[int, int, int]:
    """(batch_size, num_threads, prefetch) of a ``batches()`` call, checked (NOTE [one rule per setting]).

    ``prefetch`` None is the one default, ``default_prefetch(num_threads)``.
    """
    bs = check_count("batch_size", batch_size)
    threads = check_count("num_threads", num_threads)
    pf = check_int("prefetch", prefetch)
    return bs, threads, default_prefetch(threads) if pf is None else pf


__all__ = [
    "DEFAULTS", "INT_SETTINGS", "PARTITIONS", "SHUFFLE_MODES", "Batch", "BatchStream", "IntRule", "OrderSpec",
    "PipelineDataset", "PipelineStream", "Plan", "PlannedDataset", "Tuner", "check_bool", "check_callable",
    "check_choice", "check_count", "check_int", "check_seconds", "check_size", "check_stream_args", "cpu_budget",
    "default_memory_budget", "default_prefetch",
]
