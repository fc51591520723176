"""ShardDataset: an IterableDataset over a manifest of pyloader shards."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import time
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torch.utils.dlpack import from_dlpack as _from_dlpack

import pyloader._C as _C

from ..contract import PipelineDataset, PipelineStream, Plan, check_stream_args
from ..errors import (
    LoaderStateError,
    LoaderTimeoutError,
    ManifestError,
    ManifestNotFoundError,
    NotADatasetError,
    PyloaderError,
    SchemaError,
    ShardCorruptError,
    ShardFormatError,
    ShardNotFoundError,
)
from ..format.sizes import parse_size
from ..format.spec import (
    DEFAULT_MAX_VALUE_BYTES,
    MANIFEST_NAME,
    Field,
    encode_schema,
    fields_from_manifest,
    manifest_path,
    parse_manifest,
)
from ..remote.budget import MAX_OPEN, check_share, reader_share
from ..remote.names import is_remote
from . import verified as _verified
from .units import RemoteOptions, UnitDataset, node_readers

if TYPE_CHECKING:  # the remote stage's fetching loads with the first remote dataset
    from ..remote import fetch as _fetch


def _local_path(url: str | os.PathLike[str]) -> str:
    s = os.fspath(url)
    if s.startswith("file://"):
        return s[len("file://"):]
    if "://" in s:
        raise ValueError(
            f"{s!r}: only local paths and file:// URLs are readable directly; remote URLs go through the node cache"
        )
    return s


_PARQUET_EXT = (".parquet", ".pq", ".parq")
_TAR_EXT = (".tar", ".tar.gz", ".tgz")
_TUNE_SLICE_S = 0.2  # an auto-tuned loop's wait for a batch is looked at this often (NOTE [autotune])
_CONVERT_HINT = "or convert it to shards with `pyloader convert {src} DST`"


def _not_a_dataset(path: str, mpath: str) -> NotADatasetError | None:
    """The error for a local ``path`` that holds data but no pyloader dataset (None if it holds nothing)."""
    low = path.lower()
    if os.path.isfile(path) and not low.endswith(".json"):
        if low.endswith(_PARQUET_EXT):
            what = (f"{path!r} is a Parquet file, not a pyloader dataset: read it with "
                    f"pyloader.ParquetDataset({path!r}) " + _CONVERT_HINT.format(src=path))
        elif low.endswith(_TAR_EXT):
            what = (f"{path!r} is a tar file (WebDataset?), not a pyloader dataset: "
                    + _CONVERT_HINT.format(src=path).replace("or convert", "convert"))
        else:
            what = (f"{path!r} is a file, not a pyloader dataset: ShardDataset takes the dataset's folder "
                    f"(the one holding {MANIFEST_NAME}) or its {MANIFEST_NAME}")
        return NotADatasetError(errno.ENOTDIR, what)
    if not os.path.isdir(path):
        return None
    try:
        names = [n.lower() for n in os.listdir(path) if not n.startswith(".")]
    except OSError:
        return None
    if any(n.endswith(_PARQUET_EXT) for n in names):
        return NotADatasetError(errno.ENOENT, f"no manifest at {mpath!r}: {path!r} holds Parquet files, not a "
                                f"pyloader dataset: read them with pyloader.ParquetDataset({path!r}) "
                                + _CONVERT_HINT.format(src=path))
    if any(n.endswith(_TAR_EXT) for n in names):
        return NotADatasetError(errno.ENOENT, f"no manifest at {mpath!r}: {path!r} holds tar files (WebDataset?), "
                                "not a pyloader dataset: " + _CONVERT_HINT.format(src=path).replace("or convert",
                                                                                                   "convert"))
    return None


def manifest_fingerprint(manifest: Mapping[str, Any]) -> str:
    """XXH64 (hex) of the manifest's fields and shard list (path, records, bytes, checksum).

    The same dataset read from another URL or cache has the same fingerprint; a rewritten
    one (any shard's checksum or size changes) has another.
    """
    body = {"fields": manifest["fields"],
            "shards": [[s["path"], s["records"], s["bytes"], s["xxh64"]] for s in manifest["shards"]]}
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{_C.xxh64(raw):016x}"


def batch_to_torch(fields: list[Field], arrays: list[Any], lengths: list[Any]) -> dict[str, torch.Tensor]:
    """Wraps a native batch's DLPack capsules as tensors without copying."""
    out: dict[str, torch.Tensor] = {}
    for f, arr, ln in zip(fields, arrays, lengths, strict=True):
        out[f.name] = _from_dlpack(arr)
        if ln is not None:
            out[f"{f.name}_lengths"] = _from_dlpack(ln)
    return out


def _check_local_shards(paths: list[str], manifest: str) -> None:
    """Fails now if a shard file ``manifest`` lists is gone, not when an epoch reaches it (maybe hours later).

    One listing of each folder that holds shards, no per-file call: cheap with 10^5 shards on
    a network filesystem too. A file there but wrong (cut short, replaced) is named, with its
    fix, when the reader opens it; a folder that cannot be listed is left to the reader too.
    """
    listed: dict[str, set[str] | None] = {}
    for path in paths:
        folder, name = os.path.split(path)
        if folder not in listed:
            try:
                listed[folder] = set(os.listdir(folder))
            except FileNotFoundError:
                listed[folder] = set()
            except OSError:
                listed[folder] = None
        names = listed[folder]
        if names is not None and name not in names:
            e = ShardNotFoundError(errno.ENOENT, f"shard {path!r}: no such file")
            e.shard = path
            raise _shard_error_with_fix(e, manifest)


def _shard_error_with_fix(e: PyloaderError, manifest: str) -> PyloaderError:
    """``e`` (a native error of a local dataset's shard) with the action that fixes it (STYLE.md, convention 10).

    A shard whose bytes fail their checksum, or a shard file the manifest lists that is gone,
    cannot be read again as it is: the message names the shard (and record) as the native
    error does, the manifest that lists it, and what to do. Other errors are returned as they
    are. A remote dataset's shards are checked and healed by the node cache (README: self-healing).
    """
    shard = e.shard
    if not shard:
        return e
    if isinstance(e, ShardNotFoundError):
        text = (f"{e} -- the shard is listed in {manifest!r} but its file is gone: the dataset is incomplete; "
                f"copy the dataset folder again whole, or write it again (ShardWriter or `pyloader convert`)")
        out: PyloaderError = ShardNotFoundError(e.errno or errno.ENOENT, text)
    elif isinstance(e, ShardCorruptError) or (isinstance(e, ShardFormatError) and "truncated" in str(e)
                                               and not isinstance(e, ManifestError)):  # a file cut short or replaced
        text = (f"{e} -- the file differs from what was written (the manifest {manifest!r} lists its size and "
                f"checksums): replace {os.path.basename(shard)!r} with a good copy, or write the dataset again "
                f"(ShardWriter or `pyloader convert`)")
        out = type(e)(text)
    else:
        return e
    out.shard, out.record, out.field = e.shard, e.record, e.field
    return out


class BatchIterator:
    """Native batched iterator: dicts of tensors, collated in C++ threads, in plan order.

    Dropping it (or calling ``close()``) mid-epoch stops and joins its threads.
    """

    def __init__(self, dataset: ShardDataset, pipeline: _C.BatchPipeline, num_threads: int = 1,
                 prefetch: int = 1) -> None:
        self._fields = dataset.fields
        # Held while this reads (until it ends or closes): a dataset dropped by its caller (``for b in
        # ShardDataset(url).batches(n)``) would otherwise be collected mid-epoch, and its finaliser
        # cancel the downloads this reads.
        self._dataset: ShardDataset | None = dataset
        self._shards = dataset._shards
        self._fetcher = dataset._fetcher
        # A local dataset's shard errors name their fix (_shard_error_with_fix); the node cache heals a
        # remote one's. A Mixture's stream reads its sources' shards: the error names the source's manifest.
        sources = getattr(dataset, "sources", None) or [dataset]
        self._local_sources = [s for s in sources if isinstance(s, ShardDataset) and not s.is_remote]
        # See NOTE [verified files] in csrc/core/shard_reader.cpp: a local ShardDataset's shards read in full are recorded.
        self._verified_paths = (dataset.root, dataset.shard_paths) if (
            isinstance(dataset, ShardDataset) and not dataset.is_remote and self._shards is not None) else None
        self._pipeline = pipeline
        self._pid = os.getpid()
        self._threads = num_threads
        self._start = time.perf_counter()
        self._end: float | None = None
        self._final: dict[str, Any] | None = None  # stats() once the iterator ended or closed
        self.on_finish: Any = None  # called with stats() when the iterator ends or closes
        self.timeout = 0.0  # seconds next() waits for a batch before LoaderTimeoutError (0: forever)
        self.prefetch = prefetch  # the pipeline's ring: the most batches it may collate ahead
        self.ahead_target = prefetch  # the read-ahead once its epoch runs (an auto-tuned loader's, NOTE [autotune])
        self.tuner: Any = None  # an AutoTune observing this stream's batches
        self._delivered = 0
        self._began_ahead: int | None = None  # batches collated before begin() (None: not made ahead)
        self._tail: Any = None  # called once when _tail_at batches were delivered (tail_hook)
        self._tail_at = 0

    @property
    def pipeline(self) -> _C.BatchPipeline:
        """The native pipeline this stream reads (the packer takes its documents from it)."""
        return self._pipeline

    def tail_hook(self, fn: Any, at: int) -> None:
        """Calls ``fn()`` once, on the consumer's thread, right after batch number ``at`` (1-based) is delivered.

        An exception from ``fn`` is swallowed: the hook prepares work ahead and must never
        break this iteration.
        """
        self._tail, self._tail_at = fn, max(1, at)

    def hand_over(self, nxt: PipelineStream) -> None:
        """Once this stream's batches are all claimed, ``nxt`` (made ahead) runs at full read-ahead."""
        self._pipeline.hand_over(nxt.pipeline, nxt.ahead_target)

    def begin(self) -> None:
        """This stream was made ahead of its epoch, which starts now: full read-ahead, stats from now."""
        self._pipeline.adopt(self.ahead_target)
        self._start = time.perf_counter()
        self._began_ahead = self._pipeline.counters()["batches"]

    def tune(self, threads: int, ahead: int) -> None:
        """Sets how many of this stream's threads collate and how far ahead (NOTE [autotune])."""
        self._pipeline.threads = threads
        self._pipeline.ahead = ahead
        self.ahead_target = ahead

    def downloads(self) -> dict[str, int] | None:
        """A remote dataset's downloads: concurrent ``jobs``, ``bytes`` received so far, ``job_bytes`` of memory each, ``pending`` (queued or running).

        ``None`` for local data (NOTE [autotune]).
        """
        f = self._fetcher
        if f is None:
            return None
        return {"jobs": f.jobs, "bytes": f.bytes, "job_bytes": f.job_bytes, "pending": f.pending}

    def tune_downloads(self, jobs: int) -> None:
        """Runs at most ``jobs`` downloads at once (NOTE [autotune]); nothing for local data."""
        if self._fetcher is not None:
            self._fetcher.set_jobs(jobs)

    def _delivered_one(self, batch: Any) -> None:
        if self.tuner is not None:
            self.tuner.observe(self, batch)
        self._delivered += 1
        if self._tail is not None and self._delivered >= self._tail_at:
            fn, self._tail = self._tail, None
            try:
                fn()
            except Exception:  # noqa: BLE001 - see tail_hook
                pass

    def __iter__(self) -> BatchIterator:
        return self

    def __len__(self) -> int:
        return len(self._pipeline)

    def __next__(self) -> dict[str, torch.Tensor]:
        if os.getpid() != self._pid:
            raise LoaderStateError("iterator used in a forked child; create a new iterator after fork")
        try:
            item = self._take(self._pipeline.next)
        except LoaderTimeoutError as e:
            raise self._timeout_error(e) from None
        except (ShardCorruptError, ShardFormatError, ShardNotFoundError) as e:
            raise self._with_fix(e) from None
        if item is None:
            self._ended()
        _, _, arrays, lengths = item
        out = batch_to_torch(self._fields, arrays, lengths)
        self._delivered_one(out)
        return out

    def _take(self, fn: Callable[[float], Any]) -> Any:
        """``fn(timeout)``: the pipeline's next item.

        Under a tuner the wait is cut in slices and the tuner looks at the counters after each, so that a long wait (the first
        batch of a download-bound epoch) is tuned too, not only the batches (NOTE [autotune]).
        """
        tuner = self.tuner
        if tuner is None:
            return fn(self.timeout)
        start = time.perf_counter()
        while True:
            left = self.timeout - (time.perf_counter() - start) if self.timeout else None
            if left is not None and left <= 0:
                raise LoaderTimeoutError("no batch arrived")  # worded by _timeout_error
            try:
                return fn(_TUNE_SLICE_S if left is None else max(1e-3, min(_TUNE_SLICE_S, left)))
            except LoaderTimeoutError:
                tuner.observe(self, None)

    def _with_fix(self, e: PyloaderError) -> PyloaderError:
        for source in self._local_sources:
            if e.shard in source.shard_paths:
                return _shard_error_with_fix(e, manifest_path(source.root))
        return e

    def _timeout_error(self, e: LoaderTimeoutError, seconds: float | None = None,
                       what: str = "no batch arrived") -> LoaderTimeoutError:
        """The timeout ``e`` in torch's words, then what the readers wait on: shards, URLs, bytes arrived.

        ``seconds``: the timeout of the stream that waited (this one's by default); ``what``:
        what did not arrive. See NOTE [timeout message].
        """
        waiting = self._fetcher.describe_waiting() if self._fetcher is not None else ""
        out = LoaderTimeoutError.after(self.timeout if seconds is None else seconds,
                                       f"{what}; waiting for {waiting}" if waiting else what)
        out.shard = e.shard
        return out

    def next_host(self) -> tuple[_C.HostBatch, dict[str, torch.Tensor]]:
        """The next batch as (HostBatch, tensors), for the copy engine.

        The engine keeps the HostBatch (and so the slot) until its copies completed. Raises
        ``StopIteration`` at the end, as ``next()`` does.
        """
        if os.getpid() != self._pid:
            raise LoaderStateError("iterator used in a forked child; create a new iterator after fork")
        try:
            item = self._take(self._pipeline.next_host)
        except LoaderTimeoutError as e:
            raise self._timeout_error(e) from None
        except (ShardCorruptError, ShardFormatError, ShardNotFoundError) as e:
            raise self._with_fix(e) from None
        if item is None:
            self._ended()
        host, arrays, lengths = item
        out = host, batch_to_torch(self._fields, arrays, lengths)
        self._delivered_one(out[1])
        return out

    def _ended(self) -> NoReturn:
        if self._end is None:
            self._end = time.perf_counter()
            self._finish()
        raise StopIteration

    def close(self) -> None:
        """Stops and joins the native threads. Idempotent."""
        if os.getpid() == self._pid:
            self._pipeline.close()
            self._finish()

    def _finish(self) -> None:
        where, self._verified_paths = self._verified_paths, None
        if where is not None and os.getpid() == self._pid and self._shards is not None:
            _verified.record_verified(self._shards, *where)
        cb, self.on_finish = self.on_finish, None
        if cb is not None and os.getpid() == self._pid:
            # Not in a forked child: the native set's locks may have been held by a thread
            # of the parent at the fork, and no thread of this process will release them.
            # Built once: the loader's iterator asks again as it closes, at the epoch boundary.
            self._final = self.stats()
            cb(dict(self._final))
        self._dataset = None  # ended or closed: the stream no longer keeps its dataset alive

    def __del__(self) -> None:
        try:
            self._finish()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    def counters(self) -> dict[str, int]:
        """The native pipeline's raw counters (nanoseconds and bytes); ``stats()`` derives from them."""
        return self._pipeline.counters()

    def stats(self) -> dict[str, Any]:
        """Per-stage counters kept by the native side, plus derived rates.

        ``consumer_wait_s`` is the time the consuming thread spent blocked in ``next()``;
        ``wait_fraction`` is that over the wall time since the iterator started (or until
        it ended): the share of a training loop's time lost waiting for data.
        """
        if os.getpid() != self._pid:
            raise LoaderStateError("iterator used in a forked child; create a new iterator after fork")
        if self._final is not None:
            return dict(self._final)
        c = self._pipeline.counters()
        wall = (self._end or time.perf_counter()) - self._start
        waited = c["wait_ns"] / 1e9
        return {
            "batches": c["batches"],
            "records": c["records"],
            "stored_bytes": c["stored_bytes"],
            "decoded_bytes": c["decoded_bytes"],
            "lz4_stored_bytes": c["lz4_stored_bytes"],
            "verified_bytes": c["verified_bytes"],
            "mapped_ahead_bytes": c["mapped_ahead_bytes"],
            "threads": self._threads,
            "shard_wait_s": c["shard_wait_ns"] / 1e9,
            "collate_s": c["collate_ns"] / 1e9,
            "consumer_wait_s": waited,
            "wall_s": wall,
            "wait_fraction": waited / wall if wall > 0 else 0.0,
            "decoded_gbps": c["decoded_bytes"] / wall / 1e9 if wall > 0 else 0.0,
            "finished": self._end is not None,
            # NOTE [epoch ahead] in loader/dataloader.py: this epoch's pipeline was started
            # during the previous epoch's tail, and had collated this many batches when it began.
            "started_ahead": self._began_ahead is not None,
            "batches_ready_at_start": self._began_ahead or 0,
            **({"autotune": self.tuner.report()} if self.tuner is not None else {}),
            **self._cache_stats(),
        }

    def _cache_stats(self) -> dict[str, Any]:
        """The shard set's mappings and, for a remote dataset, the fetcher's working set (NOTE [streaming])."""
        out: dict[str, Any] = {}
        if self._shards is not None:
            n = self._shards.counts()
            out.update(mapped_shards=n["mapped"], peak_mapped_shards=n["peak_mapped"], healed_shards=n["heals"],
                       remapped_shards=n["remaps"], opened_shards=n["opens"])
        if self._fetcher is not None:
            f = self._fetcher.stats()
            out.update(cache_working_set_bytes=f["working_set_bytes"], cache_held_bytes=f["held_bytes"],
                       cache_peak_held_bytes=f["peak_held_bytes"],
                       cache_budget_bytes=f["budget_bytes"], shards_downloaded=f["downloaded"],
                       bytes_fetched=f["bytes_fetched"], shards_unloaded=f["unloaded_shards"])
        return out


def start_pipeline(shards: _C.ShardSet, pool: _C.SlotPool, plan: Plan, *, batch_size: int, drop_last: bool,
                   num_threads: int, prefetch: int, ahead: int | None, early: bool, active_threads: int | None,
                   ragged: bool) -> _C.BatchPipeline:
    """The native pipeline over ``plan`` (the one native batch call of ``ShardDataset`` and ``Mixture``).

    The arguments are ``ShardDataset.batches``', checked already (``check_stream_args``).
    """
    sidx, ridx = plan
    return _C.BatchPipeline(
        shards=shards, pool=pool, shard_idx=sidx, record_idx=ridx, batch_size=batch_size,
        drop_last=drop_last, num_threads=num_threads, prefetch=prefetch,
        ahead=-1 if ahead is None else max(0, min(ahead, prefetch)), early=early,
        active_threads=0 if active_threads is None else max(1, min(active_threads, num_threads)),
        ragged=ragged,
    )


class ShardDataset(UnitDataset, PipelineDataset, IterableDataset):
    """An iterable dataset over the shards listed in a manifest.

    With torch's ``DataLoader`` it yields samples (dicts of tensors) and splits work by
    ``get_worker_info()``; ``batches()`` is the native batched path that
    ``pyloader.DataLoader`` drives. The order is a pure function of (seed, epoch, rank,
    world size, worker): see ``pyloader.read.order``.

    Args:
        path: dataset directory (or its ``manifest.json``), a local path or ``file://`` URL.
        shuffle: shuffle samples each epoch. Iterated sample by sample (directly, or by
            torch's ``DataLoader``, workers or not), the k-th iteration since the dataset was
            built or since ``set_epoch(e)`` reads epoch ``e + k``: a new order each epoch
            without ``set_epoch``, and the order ``set_epoch`` names when a framework calls it
            (NOTE [epoch per iteration] in pyloader/read/units.py).
        seed: shuffle seed.
        shuffle_mode: ``"global"`` (a permutation of all samples: best randomness, every
            batch touches many shards -- right for local data) or ``"window"`` (shards in a
            shuffled order, then samples shuffled within windows of ``window`` samples: a
            reader touches only the shards overlapping the current window -- right for
            streaming).
        window: window size in samples for ``shuffle_mode="window"``.
        rank, world_size: override the distributed rank (default: torch.distributed, then
            the RANK/WORLD_SIZE environment variables, then 0/1).
        partition: ``"pad"`` gives every rank ceil(N / world) samples, repeating samples
            from the start of the epoch order to fill; ``"drop"`` gives floor(N / world),
            dropping the tail. Either way every rank gets the same count, so no rank waits
            on another.
        cache_dir, cache_limit, fetch_jobs, storage_options: for remote (fsspec) URLs such
            as ``s3://``, ``gs://``, ``https://``: shards are fetched ahead of the reader,
            in plan order, ``fetch_jobs`` at a time (``"auto"``: enough to keep 16 MiB in
            flight, 4 to 32; NOTE [fetch jobs] in ``pyloader.remote.fetch``), into the node cache at ``cache_dir``
            (default ``$PYLOADER_CACHE_DIR``, else the user's cache dir), whose size is
            capped at ``cache_limit`` bytes (or ``"20G"``); ``storage_options`` go to
            fsspec. See ``pyloader.remote.cache``. A reader holds only its working set in
            the cache: the shards overlapping its current window plus prefetch (NOTE
            [streaming] in ``pyloader.remote.fetch``), so ``shuffle_mode="window"`` streams
            a dataset many times larger than ``cache_limit``; the cache is shared by every
            reader on the node (``LOCAL_WORLD_SIZE`` ranks, times DataLoader worker
            processes), each held to its share of the limit. A limit below what a reader
            needs raises ``CacheLimitError`` naming both numbers.
        transform: ``fn(sample)`` or ``fn(sample, ctx)`` applied to every sample (a dict of
            tensors) before collation: by ``pyloader.DataLoader`` on its transform workers
            (docs/transforms.md), by ``iter()`` (under torch's DataLoader) in the worker
            process. ``ctx`` is a ``pyloader.SampleContext`` with generators seeded from
            (seed, epoch, sample index).
        decode: how image fields (written as ``"jpeg"``, ``"png"`` or ``"image"``) are
            decoded: None (each to a ``uint8 [H, W, C]`` tensor of its own size), a
            ``pyloader.ImageDecode`` (size, crop, flip...), a dict of them per field, or
            False (the encoded bytes).
        max_value_bytes: the most bytes one stored value may decode to (an int, or a size
            such as ``"4G"``; default 1 GiB). A shard whose index says more, or more than
            the value's stored bytes can decode to, fails when it is opened with a
            ``ShardFormatError`` naming the shard, record and field, before anything is
            allocated for it (NOTE [value bounds] in csrc/core/shard_reader.h); a schema
            whose fixed-shape field is larger raises ``SchemaError``.
    """

    # See NOTE [mapping bound] in csrc/core/shard_reader.h: a local dataset keeps at most this
    # many shards mapped at once (beyond those its workers hold), so a shuffle over more shards
    # than the kernel's vm.max_map_count works. Set before the first read to change it.
    max_mapped_shards: int = MAX_OPEN

    @property
    def early_streams(self) -> bool:
        """Whether a stream may start ahead of its epoch.

        Not for a remote dataset, whose fetch schedule belongs to the epoch being read.
        """
        return not self.is_remote

    def __init__(self, path: str | os.PathLike[str], *, shuffle: bool = False, seed: int = 0,
                 shuffle_mode: str = "global", window: int = 65536, rank: int | None = None,
                 world_size: int | None = None, partition: str = "pad", cache_dir: str | os.PathLike[str] | None = None,
                 cache_limit: int | str | None = None, fetch_jobs: int | str = "auto",
                 storage_options: dict[str, Any] | None = None, transform: Any = None,
                 decode: Any = None, max_value_bytes: int | str = DEFAULT_MAX_VALUE_BYTES) -> None:
        super().__init__()
        try:
            self.max_value_bytes = parse_size(max_value_bytes, minimum=1)
        except ValueError as e:
            raise ValueError(f"max_value_bytes: {e}") from None
        self._configure(shuffle=shuffle, seed=seed, shuffle_mode=shuffle_mode, window=window, rank=rank,
                        world_size=world_size, partition=partition, transform=transform)
        remote = RemoteOptions(cache_dir=cache_dir, cache_limit=cache_limit, fetch_jobs=fetch_jobs,
                               storage_options=storage_options)
        self.url = os.fspath(path)
        self._remote: Any = None  # the node cache of a remote dataset (pyloader.remote.cache.DatasetCache)
        self._fetcher: Any = None
        if is_remote(self.url):
            self._remote = remote.open(self.url)
            mpath, data = self._remote.url + "/" + MANIFEST_NAME, self._remote.manifest_bytes
        else:
            local = _local_path(path)
            mpath = manifest_path(local)
            try:
                with open(mpath, "rb") as fh:
                    data = fh.read()
            except (FileNotFoundError, NotADirectoryError):
                raise (_not_a_dataset(local, mpath)
                       or ManifestNotFoundError(errno.ENOENT, f"no manifest at {mpath!r}: {local!r} " + (
                           "holds no pyloader dataset" if os.path.exists(local) else "does not exist")
                           + "; check the path, or write a dataset there first (pyloader convert SRC DST, or "
                           "pyloader.ShardWriter)")) from None
        # A remote manifest was parsed (and checked) by the cache already.
        self.manifest = self._remote.manifest if self._remote is not None else parse_manifest(data, mpath, _C.xxh64)
        self.fields: list[Field] = fields_from_manifest(self.manifest, mpath)
        self.root = os.path.dirname(mpath)
        shards = self.manifest["shards"]
        prefix = os.path.join(self.root, "")
        self.shard_paths = [prefix + s["path"] for s in shards]
        self.shard_bytes = [int(s["bytes"]) for s in shards]
        self._fetch_options = remote
        self._fetch_jobs: int | None = None  # fetch_jobs, resolved on first use
        self.records_per_shard = [int(s["records"]) for s in shards]
        self.unit_records = self.records_per_shard  # UnitDataset plans by shard
        self.num_records = int(self.manifest["records"])
        if self.num_records == 0:
            raise ManifestError(f"manifest {mpath!r}: the dataset holds no records")
        if self._remote is None:
            _check_local_shards(self.shard_paths, mpath)
        self._schema = encode_schema(self.fields)
        for f in self.fields:  # See NOTE [value bounds]: before any batch buffer is sized from the schema
            if not f.variable and f.row_bytes > self.max_value_bytes:
                raise SchemaError(f"manifest {mpath!r}: field {f.name!r} makes every value {f.row_bytes} bytes, more "
                                  f"than max_value_bytes ({self.max_value_bytes}); pass a larger max_value_bytes if "
                                  "values this large are intended")
        self.decode = decode  # checked and resolved now (NOTE [decode resolved once])
        self._shards: _C.ShardSet | None = None
        self._shards_pid = -1
        self._fingerprint: str | None = None
        if self._remote is not None and self._remote.cache.limit is not None:
            self._check_working_set(self.plan()[0], 0)  # the plan's working set must fit this reader's share

    def record_name(self, unit: int, record: int) -> str:
        """``shard 'PATH', record R``: where a record lives, for messages."""
        return f"shard {self.shard_paths[unit]!r}, record {record}"

    @property
    def is_remote(self) -> bool:
        """Whether the shards come from a remote URL through the node cache."""
        return self._remote is not None

    def local_files(self) -> list[str]:
        """The shard files on this machine.

        In place for a local dataset; for a remote URL, their node-cache files (which exist
        once fetched: ``fetch_all()``).
        """
        if self._remote is None:
            return list(self.shard_paths)
        return self._remote.shard_files()

    def fetch_all(self) -> dict[str, int]:
        """Fetches every shard of a remote dataset into the node cache now (no-op when local).

        Returns ``{"bytes": received, "downloaded": shards downloaded}`` (shards already
        cached count in neither). Raises the first fetch error (``pyloader.FetchError``,
        ``pyloader.CacheError``) naming the shard and URL.
        """
        if self._remote is None:
            return {"bytes": 0, "downloaded": 0}
        from ..remote import fetch as _fetch

        fetcher = _fetch.ShardFetcher(self._remote, None, jobs=self.fetch_jobs)  # publishes, pins nothing
        try:
            fetcher.schedule(range(len(self.shard_paths)))
            fetcher.wait()
        finally:
            fetcher.close()
        if fetcher.errors:
            raise next(iter(fetcher.errors.values()))
        return {"bytes": fetcher.bytes, "downloaded": fetcher.downloaded}

    @property
    def fingerprint(self) -> str:
        """The manifest's fingerprint (``manifest_fingerprint``): what a loader state names."""
        if self._fingerprint is None:
            self._fingerprint = manifest_fingerprint(self.manifest)
        return self._fingerprint

    def _shard_set(self, readers: int = 1) -> _C.ShardSet:
        # Mappings and locks do not survive fork safely: each process opens its own set.
        if self._shards is None or self._shards_pid != os.getpid():
            remote = self._remote
            paths = self.shard_paths if remote is None else remote.shard_files()
            self._shards = _C.ShardSet(paths=paths, bytes=self.shard_bytes, records=self.records_per_shard,
                                       schema=self._schema, pending=remote is not None,
                                       max_value_bytes=self.max_value_bytes,
                                       max_mapped=self.max_mapped_shards if remote is None else 0)
            self._shards_pid = os.getpid()
            if remote is None:  # See NOTE [verified files] in csrc/core/shard_reader.cpp
                _verified.trust_recorded(self._shards, self.root, paths)
            if remote is not None:  # See NOTE [shard readiness]: the fetcher fills the pending set
                self._fetcher = self.fetcher(self._shards, readers)
                weakref.finalize(self, self._fetcher.close)
        return self._shards

    @property
    def fetch_jobs(self) -> int:
        """Downloads at once for a remote dataset (``fetch_jobs``, ``"auto"`` resolved: NOTE [fetch jobs])."""
        if self._fetch_jobs is None:
            self._fetch_jobs = self._fetch_options.jobs_for(self.shard_bytes)
        return self._fetch_jobs

    @fetch_jobs.setter
    def fetch_jobs(self, value: int | str) -> None:  # checked as the constructor's argument is
        self._fetch_options = dataclasses.replace(self._fetch_options, fetch_jobs=value)
        self._fetch_jobs = None

    @property
    def cache_limit(self) -> int | None:
        """The node cache's size limit in bytes for a remote dataset (None: local, or no limit)."""
        return None if self._remote is None else self._remote.cache.limit

    def fetcher(self, target: Any, readers: int = 1) -> _fetch.ShardFetcher:
        """A fetcher of this remote dataset's shards into ``target`` (a shard set, or a view of one).

        Held to this reader's share of the cache (NOTE [cache shares]) among ``readers``
        processes of its rank. ``ValueError`` for a local dataset.
        """
        if self._remote is None:
            raise ValueError(f"{self.url}: a local dataset has no fetcher")
        from ..remote import fetch as _fetch

        budget = reader_share(self.cache_limit, node_readers(readers))
        return _fetch.ShardFetcher(self._remote, target, jobs=self.fetch_jobs, budget=budget, max_open=MAX_OPEN)

    def working_set(self, shard_idx: Any, horizon: int) -> tuple[int, int]:
        """(bytes, shards) a reader of the plan ``shard_idx`` holds at once, at its worst.

        ``horizon``: samples collated ahead of the consumer. See ``pyloader.remote.fetch.working_set``.
        """
        from ..remote import fetch as _fetch

        return _fetch.working_set(shard_idx, self._sizes(), horizon)

    def _sizes(self) -> Any:
        if getattr(self, "_sizes_arr", None) is None:
            self._sizes_arr = np.asarray(self.shard_bytes, dtype=np.int64)
        return self._sizes_arr

    def _check_working_set(self, shard_idx: Any, horizon: int, readers: int = 1) -> tuple[int, int]:
        """Raises CacheLimitError when this reader's working set exceeds its share of the cache limit."""
        assert self._remote is not None
        need, count = self.working_set(shard_idx, horizon)
        limit = self.cache_limit
        if limit is None:
            return need, count
        o = self.order
        if o.shuffle and o.shuffle_mode == "global":
            hint = ("with shuffle_mode='global' every shard is read until the end of the epoch, so the cache "
                    "must hold the whole plan; to stream a dataset larger than the cache use "
                    "shuffle_mode='window' (a smaller window= needs fewer shards at once)")
        else:
            hint = (f"or a smaller window= (now {o.window}), a smaller batch_size or prefetch"
                    if o.shuffle else "or a smaller batch_size or prefetch")
        check_share(self._remote.url, limit, need, node_readers(readers),
                    f"{count} shards: those overlapping its shuffle window plus the batches read ahead", hint)
        return need, count

    def batches(self, batch_size: int, *, plan: Plan | None = None, drop_last: bool = False, num_threads: int = 2,
                prefetch: int | None = None, pool: _C.SlotPool | None = None, epoch: int | None = None,
                shuffle: bool | None = None, seed: int | None = None, worker: int = 0,
                num_workers: int = 1, readers: int = 1, ahead: int | None = None, early: bool = False,
                active_threads: int | None = None, ragged: bool = False) -> BatchIterator:
        """The native batched iterator over ``plan`` (the contract, NOTE [dataset contract]).

        Without ``plan``: this rank's plan of ``epoch`` (default: the current one), split
        ``worker`` of ``num_workers``, with ``shuffle``/``seed`` overriding ``order``'s.
        ``pool``: the ``_C.SlotPool`` to collate into (default: one of its own). ``ahead``:
        collate at most that many batches ahead at first (0: none until raised; default:
        ``prefetch``, which is the most). ``early``: a stream made ahead of its epoch (NOTE
        [epoch ahead]): it collates into slots others return to the pool (it makes none)
        until ``begin()``. ``active_threads``: how many of the ``num_threads`` threads collate
        at first (default: all; the ``threads`` of the native pipeline, for tuning).
        ``ragged``: variable fields without padding, rows back to back (NOTE [ragged batches] in
        csrc/core/batch_pipeline.h; for the packer, which cuts them apart by their lengths).
        """
        batch_size, num_threads, prefetch = check_stream_args(batch_size, num_threads, prefetch)
        sidx, ridx = self._own_plan(plan, epoch, worker, num_workers, shuffle, seed)
        if pool is None:
            pool = _C.SlotPool(num_fields=len(self.fields))
        shards = self._shard_set(readers)
        if self._fetcher is not None:
            if self._remote.cache.limit is not None:  # (no limit: nothing to check, so no plan scan)
                need, count = self._check_working_set(sidx, (prefetch + num_threads) * batch_size, readers)
                self._fetcher.working_set_bytes = need
                self._fetcher.max_open = max(MAX_OPEN, count + 2 * self.fetch_jobs)
            from ..remote.fetch import first_touch_order

            self._fetcher.schedule(first_touch_order(sidx))  # fetch ahead, in plan order
        pipeline = start_pipeline(shards, pool, (sidx, ridx), batch_size=batch_size, drop_last=drop_last,
                                  num_threads=num_threads, prefetch=prefetch, ahead=ahead, early=early,
                                  active_threads=active_threads, ragged=ragged)
        return BatchIterator(self, pipeline, num_threads, prefetch)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_shards"] = None  # native handles are per process
        state["_shards_pid"] = -1
        state["_fetcher"] = None  # threads and pins are per process
        state["_sizes_arr"] = None
        return state


__all__ = ["manifest_fingerprint", "batch_to_torch", "BatchIterator", "ShardDataset", "start_pipeline"]
