"""Mixture: a weighted, optionally scheduled mixture of ShardDatasets, read as one dataset.

NOTE [mixture plan]: Python plans, C++ moves bytes. A mixture of sources is one plan over
the union of their shards: one native ``ShardSet`` whose shard list is the sources' lists
concatenated (global shard = the source's offset + its local shard), so the native
pipeline runs unchanged. For epoch ``e`` the plan is a sequence of ``N`` *positions*;
position ``p`` takes

* its source from a golden-ratio Weyl sequence: ``x_p = U + p * G`` (mod 2**64, ``G`` =
  0x9E3779B97F4A7C15 = 2**64 / phi, ``U`` a splitmix64 hash of (seed, epoch)); the source
  is the one whose interval of the cumulative weights in effect at ``p`` holds ``x_p``.
  Any run of consecutive positions of such a sequence is again one (shifted), and its
  points are spread evenly (low discrepancy), so the realised counts of every source match
  the weights over *any* window, not only on average (the bound: docs/mixtures.md,
  tested in tests/read/test_mixture.py); every stride of it (what a rank reads, below) is
  again a Weyl sequence, so each rank's share is balanced too;
* its record from that source's own epoch order: the ``j``-th position that picks source
  ``k`` reads record ``j mod n_k`` of the source's order in source epoch
  ``e + (j // n_k) * 2**32`` (``order.epoch_order`` with the source's shuffle mode and
  window, seeded by (seed, k)): each source is read in its own shuffled order and a source
  that runs out continues into a fresh order of itself (``policy="cycle"``).

The weights in effect at ``p`` are the schedule's at step ``(e * num_records + p) //
samples_per_step``. ``policy="stop"`` ends the epoch at the first position that would read
a source past its last record; ``"renormalise"`` drops an exhausted source (the others'
weights are scaled to sum to 1), so the epoch reads every record of every source once.
Everything is a pure function of (seed, epoch, weights, schedule): no rank talks to another.

NOTE [mixture partition]: positions are dealt to ranks by stride, not in blocks: rank
``r`` of ``W`` reads positions ``a + r, a + r + W, a + r + 2W, ...``, so at every step the
world reads one contiguous run of the sequence, and a schedule's step means the same thing
on every rank. Consumption is then always a prefix: after a segment ``(W, B, s)`` of the
resume state (NOTE [resume segments]) each rank read ``c = min(s * B, per)`` of its
``per`` positions, i.e. every position below ``a + W * c``, so the rest of the epoch is the
suffix from there. ``partition="pad"`` gives every rank ``ceil(n / W)`` positions of the
``n`` left; the ones past the end are fillers, position ``q >= N`` reading position
``q - N`` (fewer than ``W`` of them, in the segment that ends the epoch);
``"drop"`` gives ``floor(n / W)`` and leaves the tail to a later segment or epoch. Hence
resuming at the same world size reads exactly what the uninterrupted epoch would have,
and at another world size every position not yet read is read once. A rank's positions are
split among ``num_workers`` in contiguous blocks, as ``order.split_workers`` does.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

import pyloader._C as _C

from ..contract import OrderSpec, PipelineDataset, Plan, check_count, check_stream_args
from ..errors import SchemaError
from ..format.spec import Field, encode_schema
from ..remote import fetch as _fetch
from . import order as _order
from .shards import BatchIterator, ShardDataset, start_pipeline
from .units import UnitDataset

POLICIES = ("cycle", "stop", "renormalise")
_G = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio, odd
_STREAM_MIX, _STREAM_SOURCE = 3, 4  # order.sample_keys streams of the interleaving and the source seeds
_CYCLE_SHIFT = 32  # source epoch of cycle c of mixture epoch e: e + (c << 32)
_CHUNK = 1 << 20
_MAX_SCHEDULE_CALLS = 1 << 22  # a callable schedule is called once per step of an epoch


def _check_weights(what: str, w: object, k: int) -> np.ndarray:
    arr = np.asarray(w, dtype=np.float64) if not isinstance(w, (str, bytes)) else np.zeros(0)
    if arr.shape != (k,) or not np.all(np.isfinite(arr)) or (arr < 0).any() or arr.sum() <= 0:
        raise ValueError(f"{what} must be {k} finite non-negative numbers (one per source) with a positive sum, "
                         f"got {w!r}")
    return arr / arr.sum()


def _thresholds(w: np.ndarray) -> np.ndarray:
    """The K - 1 upper interval ends of the cumulative weights ``w`` in 64-bit fixed point."""
    cum = np.cumsum(w)[:-1]
    return np.array([min(int(c * 2.0**64), (1 << 64) - 1) for c in cum], dtype=np.uint64)


def _weyl(seed: int, epoch: int, lo: int, hi: int) -> np.ndarray:
    """x_p = U + p * G (mod 2**64) for p in [lo, hi) (NOTE [mixture plan])."""
    u = _order.sample_keys(np.array([0]), seed=seed, epoch=epoch, stream=_STREAM_MIX)[0]
    p = np.arange(lo, hi, dtype=np.uint64)
    return p * _G + u  # uint64 arrays wrap silently


class _SourceView:
    """One remote source's shards within the mixture's pending set, for its ``ShardFetcher``.

    Local shard ``i`` is shard ``offset + i`` of the set. The set's events are taken by
    whichever view asks first and handed to the view they belong to (``_EventHub``).
    """

    def __init__(self, hub: _EventHub, k: int, offset: int, count: int) -> None:
        self._hub, self._k, self._off, self._n = hub, k, offset, count
        self._set = hub.shards

    def mark_ready(self, i: int, path: str) -> None:
        self._set.mark_ready(self._off + i, path)

    def mark_failed(self, i: int, message: str, errno: int = 0) -> None:
        self._set.mark_failed(self._off + i, message, errno=errno)

    def retry(self, i: int) -> bool:
        return bool(self._set.retry(self._off + i))

    def unload(self, i: int, force: bool = False) -> bool:
        return bool(self._set.unload(self._off + i, force))

    def waiting(self) -> list[int]:
        return self._local(self._set.waiting())

    def _local(self, idx: Sequence[int]) -> list[int]:
        return [i - self._off for i in idx if self._off <= i < self._off + self._n]

    def wait_events(self, timeout: float = 0.0) -> tuple[list[int], list[int], list[tuple[int, str]]]:
        return self._hub.wait_events(self, timeout)


class _EventHub:
    """Shares one set's events (releases, waits, corrupt copies) among the views of its sources."""

    def __init__(self, shards: _C.ShardSet) -> None:
        import threading

        self.shards = shards
        self._lock = threading.Lock()
        self._queued: dict[int, tuple[list[int], list[tuple[int, str]]]] = {}
        self._waiting: list[int] = []

    def wait_events(self, view: _SourceView, timeout: float) -> tuple[list[int], list[int], list[tuple[int, str]]]:
        if self._lock.acquire(timeout=max(timeout, 0.001)):
            try:
                released, corrupt = self._queued.pop(view._k, ([], []))
                if not (released or corrupt):
                    rel, self._waiting, bad = self.shards.wait_events(timeout)
                    for v in self._views:
                        mine = v._local(rel), [(i - v._off, m) for i, m in bad if v._off <= i < v._off + v._n]
                        if v is view:
                            released, corrupt = mine
                        elif mine[0] or mine[1]:
                            q = self._queued.setdefault(v._k, ([], []))
                            q[0].extend(mine[0])
                            q[1].extend(mine[1])
                return released, view._local(self._waiting), corrupt
            finally:
                self._lock.release()
        return [], view._local(self._waiting), []

    _views: list[_SourceView]


class _Fetchers:
    """The remote sources' fetchers, seen by ``BatchIterator`` as one (downloads, tuning, waits, stats)."""

    def __init__(self, fetchers: list[Any]) -> None:
        self.all = fetchers

    @property
    def jobs(self) -> int:
        return sum(f.jobs for f in self.all)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.all)

    @property
    def job_bytes(self) -> int:
        return max(f.job_bytes for f in self.all)

    @property
    def pending(self) -> int:
        return sum(f.pending for f in self.all)

    def set_jobs(self, jobs: int) -> None:
        for f in self.all:
            f.set_jobs(max(1, jobs // len(self.all)))

    def describe_waiting(self) -> str:
        return "; ".join(w for w in (f.describe_waiting() for f in self.all) if w)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in self.all:
            for key, v in f.stats().items():
                out[key] = (out.get(key) or 0) + (v or 0) if key != "budget_bytes" else v
        return out

    def close(self) -> None:
        for f in self.all:
            f.close()


class MixtureBatches(BatchIterator):
    """The mixture's native batched iterator; ``stats()["sources"]``: records its plan reads per source."""

    def __init__(self, dataset: Mixture, pipeline: _C.BatchPipeline, num_threads: int, prefetch: int,
                 per_source: dict[str, int]) -> None:
        super().__init__(dataset, pipeline, num_threads, prefetch)  # type: ignore[arg-type]
        self._per_source = per_source

    def stats(self) -> dict[str, Any]:
        """``BatchIterator.stats`` plus ``sources``: {source name: records of this plan from it}."""
        return {**super().stats(), "sources": dict(self._per_source)}


class WeightSchedule:
    """A ``Mixture``'s weights over its epochs: base ``weights``, then a ``schedule`` by step (NOTE [mixture plan]).

    ``schedule``: ``[(step, weights), ...]`` with increasing steps, or ``fn(step) -> weights``;
    a step is ``samples_per_step`` positions of the mixture's order. Checked when built.
    """

    def __init__(self, names: list[str], weights: np.ndarray, schedule: Any, samples_per_step: int,
                 policy: str) -> None:
        k = len(names)
        self.names, self.policy = names, policy
        self.weights = weights
        self.fn: Callable[[int], Any] | None = None
        self.steps: list[tuple[int, np.ndarray]] = []
        if callable(schedule):
            self.fn = schedule
        elif schedule is not None:
            prev = -1
            for i, item in enumerate(schedule):
                if not isinstance(item, (tuple, list)) or len(item) != 2:
                    raise ValueError(f"schedule entry {i} must be (step, weights), got {item!r}")
                step = _order._int_arg(f"schedule entry {i} step", item[0], 0, 1 << 62)
                if step <= prev:
                    raise ValueError(f"schedule steps must increase, got {step} after {prev}")
                prev = step
                self.steps.append((step, _check_weights(f"schedule entry {i} weights", item[1], k)))
        self.samples_per_step = check_count("samples_per_step", samples_per_step)

    def describe(self) -> Any:
        """The schedule as the fingerprint names it (a callable by its qualified name)."""
        if self.fn is not None:
            fn = self.fn
            return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
        return [[s, w.tolist()] for s, w in self.steps]

    def segments(self, epoch: int, n: int, epoch_records: int) -> list[tuple[int, int, np.ndarray]]:
        """[(lo, hi, weights)]: the positions of epoch ``epoch`` (of ``n``; ``epoch_records`` a full one) by the weights in effect."""
        base, sps = epoch * epoch_records, self.samples_per_step
        out: list[tuple[int, int, np.ndarray]] = []

        def add(lo: int, hi: int, w: np.ndarray) -> None:
            lo, hi = max(lo, 0), min(hi, n)
            if hi <= lo:
                return
            if out and out[-1][1] == lo and np.array_equal(out[-1][2], w):
                out[-1] = (out[-1][0], hi, w)
            else:
                out.append((lo, hi, w))
        if self.fn is not None:
            first, last = base // sps, (base + n - 1) // sps
            if last - first + 1 > _MAX_SCHEDULE_CALLS:
                raise ValueError(f"a callable schedule is called once per step: {last - first + 1} steps in epoch "
                                 f"{epoch} is too many; give a larger samples_per_step or a list schedule")
            for step in range(first, last + 1):
                w = _check_weights(f"schedule({step})", self.fn(step), len(self.names))
                add(step * sps - base, (step + 1) * sps - base, w)
            return out
        starts = [(0, self.weights)] + [(s * sps - base, w) for s, w in self.steps]
        for i, (lo, w) in enumerate(starts):
            hi = starts[i + 1][0] if i + 1 < len(starts) else n
            add(lo if i else -(1 << 62), hi, w)
        return out

    def choices(self, seed: int, epoch: int, lo: int, hi: int, segs: list[tuple[int, int, np.ndarray]],
                 active: np.ndarray) -> np.ndarray:
        """The source of positions [lo, hi) with the weights of ``segs`` restricted to ``active`` sources."""
        out = np.empty(hi - lo, dtype=np.int16)
        for a, b, w in segs:
            a, b = max(a, lo), min(b, hi)
            if b <= a:
                continue
            wa = w * active
            if wa.sum() <= 0:
                left = ", ".join(n for n, on in zip(self.names, active, strict=True) if on)
                raise ValueError(f"epoch {epoch}, position {a}: every source with records left ({left}) has weight "
                                 f"0 in the weights in effect ({w.tolist()}), so policy={self.policy!r} cannot go on")
            thr = _thresholds(wa / wa.sum())
            for c in range(a, b, _CHUNK):
                d = min(b, c + _CHUNK)
                out[c - lo:d - lo] = np.searchsorted(thr, _weyl(seed, epoch, c, d), side="right")
        return out


class Mixture(UnitDataset, PipelineDataset, IterableDataset):
    """A mixture of ``ShardDataset`` sources with weights, a schedule and an exhaustion policy.

    Reads through ``pyloader.DataLoader`` on the native path like a ``ShardDataset``, with
    resume (``state_dict()``) and ``set_epoch``. NOTE [mixture plan] says which record each
    position reads; docs/mixtures.md has the guarantees.

    Args:
        sources: the ``ShardDataset`` s, a list or a dict {name: dataset} (names appear in
            ``stats()`` and ``realised()``; a list names them ``source0``, ...). Their own
            ``shuffle_mode`` and ``window`` order each source; the mixture's ``shuffle`` and
            ``seed`` replace theirs.
        weights: one non-negative number per source, normalised (default: proportional
            to their records).
        schedule: weights that change with the step: a list of ``(step, weights)`` with
            increasing steps (before the first, ``weights`` apply), or ``fn(step) ->
            weights``. Step of position ``p`` of epoch ``e``: ``(e * num_records + p) //
            samples_per_step``.
        policy: ``"cycle"`` (a source that runs out starts a new order of itself; an epoch
            is ``samples_per_epoch`` positions), ``"stop"`` (the epoch ends before the first
            position that would read a source past its end, at the latest after
            ``samples_per_epoch``), ``"renormalise"`` (an exhausted source is dropped and
            the others' weights rescaled; the epoch reads every record of every source once).
        samples_per_epoch: positions per epoch (default: the sources' records summed);
            ``"renormalise"`` takes no other value.
        samples_per_step: samples per step of the schedule (the global batch: ranks times
            batch size; default 1: the schedule counts samples).
        field_map: per source (a list aligned with ``sources``, or a dict by name) a dict
            ``{source field: mixture field}`` renaming its fields; after renaming every
            source must have the same fields, in the same order, with the same dtype and
            shape (``SchemaError`` otherwise).
        shuffle, seed, rank, world_size, partition, transform, decode: as ``ShardDataset``.
    """

    def __init__(self, sources: Sequence[ShardDataset] | Mapping[str, ShardDataset],
                 weights: Sequence[float] | None = None, *, schedule: Any = None, policy: str = "cycle",
                 samples_per_epoch: int | None = None, samples_per_step: int = 1,
                 field_map: Sequence[Mapping[str, str] | None] | Mapping[str, Mapping[str, str]] | None = None,
                 shuffle: bool = False, seed: int = 0, rank: int | None = None, world_size: int | None = None,
                 partition: str = "pad", transform: Any = None, decode: Any = None) -> None:
        super().__init__()
        if isinstance(sources, Mapping):
            names, srcs = [str(n) for n in sources], list(sources.values())
        else:
            srcs = list(sources)
            names = [f"source{k}" for k in range(len(srcs))]
        if not srcs:
            raise ValueError("a Mixture needs at least one source")
        for name, s in zip(names, srcs, strict=True):
            if not isinstance(s, ShardDataset):
                raise TypeError(f"Mixture source {name!r} must be a pyloader.ShardDataset, got {type(s).__name__}")
            if s.num_records == 0:
                raise ValueError(f"Mixture source {name!r} ({s.url}) holds no records")
        self.sources, self.names = srcs, names
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.source_records = np.array([s.num_records for s in srcs], dtype=np.int64)
        total = int(self.source_records.sum())
        k = len(srcs)
        self.weights = _check_weights("weights", self.source_records if weights is None else weights, k)
        self._weights = WeightSchedule(names, self.weights, schedule, samples_per_step, policy)
        self.schedule = schedule
        if samples_per_epoch is None:
            samples_per_epoch = total
        samples_per_epoch = check_count("samples_per_epoch", samples_per_epoch)
        if policy == "renormalise" and samples_per_epoch != total:
            raise ValueError(f"policy='renormalise' reads every record once: samples_per_epoch is the sources' "
                             f"{total} records, got {samples_per_epoch}")
        self.samples_per_step = self._weights.samples_per_step
        self.fields = self._mapped_fields(field_map)
        self._schema = encode_schema(self.fields)
        self._source_schemas = [encode_schema(s.fields) for s in srcs]
        self._configure(shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, partition=partition,
                        transform=transform)
        units: list[int] = []
        self._unit_source = np.zeros(sum(len(s.records_per_shard) for s in srcs), dtype=np.int64)
        self._unit_offset = np.zeros(k + 1, dtype=np.int64)
        for i, s in enumerate(srcs):
            self._unit_offset[i + 1] = self._unit_offset[i] + len(s.records_per_shard)
            self._unit_source[self._unit_offset[i]:self._unit_offset[i + 1]] = i
            units += s.records_per_shard
        self.unit_records = units
        self.num_records = samples_per_epoch
        self.decode = decode  # checked and resolved now (NOTE [decode resolved once])
        self._shards: _C.ShardSet | None = None
        self._shards_pid = -1
        self._fetcher: _Fetchers | None = None
        self._cache: dict[tuple[Any, ...], tuple[np.ndarray, int, np.ndarray]] = {}

    # -- construction ----------------------------------------------------------------------
    def _mapped_fields(self, field_map: Any) -> list[Field]:
        k = len(self.sources)
        if field_map is None:
            maps: list[Mapping[str, str]] = [{}] * k
        elif isinstance(field_map, Mapping):
            unknown = [n for n in field_map if n not in self.names]
            if unknown:
                raise ValueError(f"field_map names no source {unknown[0]!r} (sources: {', '.join(self.names)})")
            maps = [field_map.get(n) or {} for n in self.names]
        else:
            maps = [m or {} for m in field_map]
            if len(maps) != k:
                raise ValueError(f"field_map must have one entry per source ({k}), got {len(maps)}")
        out: list[list[Field]] = []
        for name, s, m in zip(self.names, self.sources, maps, strict=True):
            have = {f.name for f in s.fields}
            bad = [f for f in m if f not in have]
            if bad:
                raise SchemaError(f"field_map of source {name!r} ({s.url}) renames {bad[0]!r}, which it does not "
                                  f"have (its fields: {', '.join(sorted(have))})")
            out.append([Field(m.get(f.name, f.name), f.dtype, f.shape, f.encoding) for f in s.fields])
        ref = out[0]
        for name, s, fields in zip(self.names[1:], self.sources[1:], out[1:], strict=True):
            if [(f.name, f.dtype, f.shape) for f in fields] != [(f.name, f.dtype, f.shape) for f in ref]:
                def show(fs: list[Field]) -> str:
                    return ", ".join(f"{f.name}: {f.dtype}{list(f.shape)}" for f in fs)
                raise SchemaError(
                    f"source {name!r} ({s.url}) has fields ({show(fields)}) after field_map, but source "
                    f"{self.names[0]!r} has ({show(ref)}): a mixture's sources need the same fields in the same "
                    "order with the same dtype and shape (rename with field_map={source: {its field: mixture "
                    "field}})")
        return ref

    @property
    def is_remote(self) -> bool:
        """Whether any source comes from a remote URL through the node cache."""
        return any(s.is_remote for s in self.sources)

    @property
    def early_streams(self) -> bool:
        """As ``ShardDataset``: not when a source is remote."""
        return not self.is_remote

    def record_name(self, unit: int, record: int) -> str:
        """``source 'NAME' shard 'PATH', record R``."""
        k = int(self._unit_source[unit])
        local = unit - int(self._unit_offset[k])
        return f"source {self.names[k]!r} {self.sources[k].record_name(local, record)}"

    # -- identity ----------------------------------------------------------------------------
    @property
    def fingerprint_parts(self) -> dict[str, str]:
        """Named digests: ``sources``, ``weights``, ``policy``.

        ``sources``: each one's fingerprint and order settings, and the field names;
        ``weights``: weights and schedule; ``policy``: policy, epoch and step lengths.
        """
        sched = self._weights.describe()
        parts = {
            "sources": [[n, s.fingerprint, s.order.shuffle_mode, s.order.window] for n, s in
                        zip(self.names, self.sources, strict=True)] + [[f.name for f in self.fields]],
            "weights": [self.weights.tolist(), sched],
            "policy": [self.policy, self.num_records, self.samples_per_step],
        }
        return {k: f"{_C.xxh64(json.dumps(v, separators=(',', ':')).encode()):016x}" for k, v in parts.items()}

    @property
    def fingerprint(self) -> str:
        """XXH64 of ``fingerprint_parts``: what a loader state names."""
        raw = json.dumps(self.fingerprint_parts, sort_keys=True).encode()
        return f"{_C.xxh64(raw):016x}"

    # -- planning (NOTE [mixture plan]) -------------------------------------------------------
    def epoch_sources(self, epoch: int, *, shuffle: bool | None = None, seed: int | None = None) -> np.ndarray:
        """The source (int16) of every position of ``epoch``; its length is the epoch's."""
        o = self.order.with_overrides(shuffle=shuffle, seed=seed)
        return self._epoch(epoch, o)[0]

    def _epoch(self, epoch: int, o: OrderSpec) -> tuple[np.ndarray, int, np.ndarray]:
        key = (epoch, o.shuffle, o.seed)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        seed = o.seed if o.shuffle else 0  # unshuffled: the state does not compare seeds (NOTE [resume state])
        k, cap = len(self.sources), self.num_records
        segs = self._weights.segments(epoch, cap, self.num_records)
        active = np.ones(k, dtype=np.float64)
        if self.policy == "cycle":
            ch = self._weights.choices(seed, epoch, 0, cap, segs, active)
        elif self.policy == "stop":
            ch = self._weights.choices(seed, epoch, 0, cap, segs, active)
            end = cap
            for i in range(k):
                idx = np.flatnonzero(ch == i)
                if idx.size > self.source_records[i]:
                    end = min(end, int(idx[self.source_records[i]]))
            ch = ch[:end]
        else:  # renormalise: at most one source runs out per round
            ch = np.empty(cap, dtype=np.int16)
            left = self.source_records.copy()
            pos = 0
            while pos < cap:
                part = self._weights.choices(seed, epoch, pos, cap, segs, active)
                end = cap
                for i in np.flatnonzero(active).tolist():
                    idx = np.flatnonzero(part == i)
                    if idx.size >= left[i]:
                        end = min(end, pos + int(idx[left[i] - 1]) + 1)
                ch[pos:end] = part[:end - pos]
                left -= np.bincount(ch[pos:end], minlength=k)
                active[left == 0] = 0
                pos = end
        n = int(ch.size)
        if n == 0:
            raise ValueError(f"epoch {epoch} of the mixture is empty")
        # The ordinal of each position among its source's positions: which of its records it reads.
        ordinal = np.empty(n, dtype=np.int64)
        for i in range(k):
            idx = np.flatnonzero(ch == i)
            ordinal[idx] = np.arange(idx.size, dtype=np.int64)
        self._cache = {key: (ch, n, ordinal)}  # the latest epoch only: a loader plans each epoch once per rank
        return ch, n, ordinal

    def _source_order(self, k: int, source_epoch: int, o: OrderSpec) -> np.ndarray:
        s = self.sources[k]
        seed = int(_order.sample_keys(np.array([k]), seed=o.seed, epoch=0, stream=_STREAM_SOURCE)[0])
        return _order.epoch_order(s.records_per_shard, shuffle=o.shuffle, seed=seed, epoch=source_epoch,
                                  shuffle_mode=s.order.shuffle_mode, window=s.order.window)

    def _positions(self, n: int, rank: int, world: int, segments: Sequence[Sequence[int]], partition: str,
                   worker: int, num_workers: int) -> np.ndarray:
        """The positions (fillers folded back) this (rank, worker) reads (NOTE [mixture partition])."""
        world, num_workers = _order._reader_args(rank, world, worker, num_workers, partition)
        a = n - self._unread(n, segments, partition)
        left = n - a
        if left == 0:
            return np.zeros(0, np.int64)
        per = _order._per_rank(left, world, partition)
        q, rem = divmod(per, num_workers)
        j0 = worker * q + min(worker, rem)
        j = np.arange(j0, j0 + q + (worker < rem), dtype=np.int64)
        pos = a + rank + world * j
        return np.where(pos >= n, (pos - n) % n, pos)

    @staticmethod
    def _unread(n: int, segments: Sequence[Sequence[int]], partition: str) -> int:
        a = 0
        for i, seg in enumerate(segments):
            w, b, s = _order._segment_arg(i, seg)
            _, c = _order._segment_read(i, n - a, w, b, s, partition)
            a += min(w * c, n - a)
        return n - a

    def unread_count(self, epoch: int, segments: Sequence[Sequence[int]], *, partition: str) -> int:
        """Positions of ``epoch`` that ``segments`` left unread (ValueError for impossible segments)."""
        return self._unread(self.epoch_length(epoch), segments, partition)

    def epoch_length(self, epoch: int | None = None) -> int:
        """Positions in ``epoch`` (default: the current one): ``num_records`` but under ``policy="stop"``."""
        if self.policy != "stop":
            return int(self.num_records)
        return self._epoch(self.epoch if epoch is None else epoch, self.order)[1]

    def __len__(self) -> int:
        """Samples this rank reads in the current epoch."""
        _, world = self.rank_and_world()
        n = self.epoch_length()
        return -(-n // world) if self.order.partition == "pad" else n // world

    def epoch_plan(self, epoch: int, rank: int, world: int, segments: Sequence[Sequence[int]] = (), *,
                   worker: int = 0, num_workers: int = 1, shuffle: bool | None = None,
                   seed: int | None = None) -> Plan:
        """(global shard, record) of the positions (rank, worker) reads (NOTE [mixture partition])."""
        o = self.order.with_overrides(shuffle=shuffle, seed=seed)
        ch, n, ordinal = self._epoch(epoch, o)
        pos = self._positions(n, rank, world, segments, o.partition, worker, num_workers)
        units = np.empty(pos.size, dtype=np.int32)
        records = np.empty(pos.size, dtype=np.int64)
        mine, jall = ch[pos], ordinal[pos]
        for k in range(len(self.sources)):
            sel = np.flatnonzero(mine == k)
            if not sel.size:
                continue
            nk = int(self.source_records[k])
            j = jall[sel]
            cycles = int(j.max()) // nk + 1
            for c in range(int(j.min()) // nk, cycles):
                at, jc = (sel, j) if cycles == 1 else (sel[j // nk == c], j[j // nk == c])
                if not at.size:
                    continue
                ids = self._source_order(k, epoch + (c << _CYCLE_SHIFT), o)[jc - c * nk]
                u, r = _order.locate(ids, self.sources[k].records_per_shard)
                units[at] = u + self._unit_offset[k]
                records[at] = r
        return np.ascontiguousarray(units), np.ascontiguousarray(records)

    def realised(self, epoch: int | None = None, *, rank: int | None = None,
                 world_size: int | None = None) -> dict[str, int]:
        """{source name: samples} that ``epoch`` (default: the current one) reads from each source.

        Of the whole epoch, or of one rank's plan when ``rank`` and ``world_size`` are given.
        """
        epoch = self.epoch if epoch is None else epoch
        if rank is None:
            ch = self._epoch(epoch, self.order)[0]
            counts = np.bincount(ch, minlength=len(self.sources))
        else:
            units, _ = self.epoch_plan(epoch, rank, 1 if world_size is None else world_size)
            counts = np.bincount(self._unit_source[units], minlength=len(self.sources))
        return {n: int(c) for n, c in zip(self.names, counts, strict=True)}

    # -- reading -----------------------------------------------------------------------------
    def _shard_set(self, readers: int = 1) -> _C.ShardSet:
        """One set over every source's shards (NOTE [mixture plan]); remote sources' fetchers fill their part."""
        if self._shards is not None and self._shards_pid == os.getpid():
            return self._shards
        paths: list[str] = []
        sizes: list[int] = []
        schema_of: list[int] = []
        for k, s in enumerate(self.sources):
            paths += s.local_files()
            sizes += s.shard_bytes
            schema_of += [k] * len(s.shard_paths)
        # See NOTE [renamed schemas]: each source's shards keep their own names.
        renamed = any(b != self._schema for b in self._source_schemas)
        remote = self.is_remote
        shards = _C.ShardSet(paths=paths, bytes=sizes, records=list(self.unit_records), schema=self._schema,
                             pending=remote, shard_schemas=self._source_schemas if renamed else [],
                             schema_of=schema_of if renamed else [],
                             # one limit for the set: the largest a source allows (NOTE [value bounds])
                             max_value_bytes=max(s.max_value_bytes for s in self.sources),
                             # See NOTE [mapping bound] in csrc/core/shard_reader.h
                             max_mapped=0 if remote else min(s.max_mapped_shards for s in self.sources))
        self._shards, self._shards_pid = shards, os.getpid()
        self._fetcher = None
        if remote:
            hub = _EventHub(shards)
            hub._views = []
            fetchers = []
            for k, s in enumerate(self.sources):
                off = int(self._unit_offset[k])
                if not s.is_remote:  # See NOTE [shard readiness]: a local source's shards are ready now
                    for i, p in enumerate(s.shard_paths):
                        shards.mark_ready(off + i, p)
                    continue
                view = _SourceView(hub, k, off, len(s.shard_paths))
                hub._views.append(view)
                fetchers.append(s.fetcher(view, readers))
            self._fetcher = _Fetchers(fetchers)
            weakref.finalize(self, self._fetcher.close)
        return shards

    def batches(self, batch_size: int, *, plan: Plan | None = None, drop_last: bool = False, num_threads: int = 2,
                prefetch: int | None = None, pool: _C.SlotPool | None = None, epoch: int | None = None,
                shuffle: bool | None = None, seed: int | None = None, worker: int = 0,
                num_workers: int = 1, readers: int = 1, ahead: int | None = None, early: bool = False,
                active_threads: int | None = None, ragged: bool = False) -> MixtureBatches:
        """The native batched iterator over ``plan``; the arguments are ``ShardDataset.batches``'."""
        batch_size, num_threads, prefetch = check_stream_args(batch_size, num_threads, prefetch)
        sidx, ridx = self._own_plan(plan, epoch, worker, num_workers, shuffle, seed)
        if pool is None:
            pool = _C.SlotPool(num_fields=len(self.fields))
        shards = self._shard_set(readers)
        if self._fetcher is not None:
            src = self._unit_source[sidx]
            for f, k in zip(self._fetcher.all, [k for k, s in enumerate(self.sources) if s.is_remote], strict=True):
                local = sidx[src == k] - self._unit_offset[k]
                f.schedule(_fetch.first_touch_order(local))
        pipeline = start_pipeline(shards, pool, (sidx, ridx), batch_size=batch_size, drop_last=drop_last,
                                  num_threads=num_threads, prefetch=prefetch, ahead=ahead, early=early,
                                  active_threads=active_threads, ragged=ragged)
        counts = np.bincount(self._unit_source[sidx], minlength=len(self.sources))
        per_source = {n: int(c) for n, c in zip(self.names, counts, strict=True)}
        return MixtureBatches(self, pipeline, num_threads, prefetch, per_source)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_shards"] = None  # native handles, threads and pins are per process
        state["_shards_pid"] = -1
        state["_fetcher"] = None
        state["_cache"] = {}
        return state


__all__ = ["POLICIES", "Mixture", "MixtureBatches", "WeightSchedule"]
