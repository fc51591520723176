"""``pyloader convert``: Parquet/Arrow, numpy, folders of files and WebDataset tars to shards.

The sources live in sources.py (``open_source``): each is cut into units that read as
chunks of columns. Here: choosing compression, running the jobs that encode chunks into
shards (``pyloader.format.encode.ShardEncoder``), progress, and ``convert()`` itself.

NOTE [parallel convert]: ``jobs`` worker processes (forkserver, else spawn) each convert a
contiguous range of units into their own shards, named ``shard-[<token>-]<job>-<n>.pyl``
so no two jobs collide; the parent concatenates their shard lists in job order, so
the dataset's record order is the source order, and writes one manifest. A job that
fails stops the others; every shard written so far is removed and no manifest is
written. With ``overwrite=True`` new shards get a fresh token, the old dataset stays
whole until the new manifest replaces it, and only then are old shards removed
(NOTE [overwrite] in pyloader/format/encode.py). ``engine="dask"`` runs finer tasks on
a Dask cluster instead (NOTE [dask convert] in cluster.py).

NOTE [convert leftovers]: a run that was killed (SIGKILL, a lost machine) leaves files
no manifest lists: shards of its finished parts and ``.part`` temp files of the shards
being written (NOTE [atomic publish]). Readers never see them: only the manifest names
shards, and it is written last. Every run removes them (``remove_leftovers``): before
it starts, every ``shard-*.pyl`` the existing manifest (if any) does not list and every
temp file; after it publishes, every shard the new manifest does not list; after a
failure, everything it wrote. So a re-run leaves exactly the shards of its manifest.

NOTE [exactness]: a converted value is the source value's bytes, unchanged: no casts
except the ones the caller asks for with ``fields={name: dtype}`` (checked by pyarrow
with ``safe=True``, so out-of-range or lossy casts fail), and strings become their
UTF-8 bytes. ``verify`` re-reads the source and compares every record byte for byte
with what the native reader returns (verify.py).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lz4.block
import numpy as np

from ..errors import ConvertError
from ..format.arrow import VarColumn
from ..format.encode import (
    MIN_GAIN,
    ColumnBytes,
    DatasetStore,
    LocalStore,
    ShardEncoder,
    publish_manifest,
    replace_token,
)
from ..format.sizes import parse_size
from ..format.spec import MAX_FIELD_BYTES, Field
from .cluster import plan_tasks, run_tasks
from .sources import Chunk, Source, open_source
from .store import open_store
from .verify import verify_dataset

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event

    # A job's progress report: (job, records, bytes).
    _ProgressQueue = Queue[tuple[int, int, int]]

COMPRESSIONS = ("auto", "lz4", "none")
ENGINES = ("local", "dask")
SIDECAR_NAME = "convert.json"
# What a convert writes into its destination (NOTE [convert leftovers]): shards, and the
# temp files of atomic_write (``<name>.<pid>.<8 hex>.part``).
_SHARD_NAME = re.compile(r"shard-[0-9A-Za-z-]*\.pyl")
_TEMP_NAME = re.compile(r"(shard-[0-9A-Za-z-]*\.pyl|manifest\.json|convert\.json)\.[0-9]+\.[0-9a-f]{8}\.part")
_AUTO_SAMPLE_VALUES = 256
_AUTO_SAMPLE_BYTES = 8 << 20


# ---------------------------------------------------------------------------------------
# Compression.
def _sample_values(c: Any, k: int) -> list[memoryview]:
    if isinstance(c, VarColumn):
        return [np.ascontiguousarray(c.data[c.offsets[r] : c.offsets[r + 1]]).data
                for r in range(min(k, len(c.lengths)))]
    a = np.ascontiguousarray(c[:k])
    return [a[r].reshape(-1).view(np.uint8).data for r in range(a.shape[0])]


def choose_compression(source: Source, compression: str | Mapping[str, str]) -> dict[str, str]:
    """Per field, "lz4" or "none".

    ``"auto"`` compresses a sample of each field from the start of the source and keeps the
    field raw unless LZ4 saves at least 10% of it. Raises ValueError for an unknown
    compression or, given a mapping, one that names a field the source lacks.
    """
    if isinstance(compression, Mapping):
        out = {}
        for f in source.fields:
            c = compression.get(f.name, "none")
            if c not in ("lz4", "none"):
                raise ValueError(f"compression for {f.name!r} must be 'lz4' or 'none', got {c!r}")
            out[f.name] = c
        unknown = set(compression) - set(out)
        if unknown:
            raise ValueError(f"compression names unknown fields: {sorted(unknown)}")
        return out
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if compression != "auto":
        return {f.name: compression for f in source.fields}
    raw = [0] * len(source.fields)
    packed = [0] * len(source.fields)
    seen = 0
    row0 = source.unit_row0()
    for u in range(len(source.units)):
        for chunk in source.read(u, row0[u]):
            k = min(chunk.n, _AUTO_SAMPLE_VALUES - seen)
            for j, c in enumerate(chunk.columns):
                for v in _sample_values(c, k):
                    if raw[j] >= _AUTO_SAMPLE_BYTES or not len(v):
                        continue
                    z = lz4.block.compress(v, store_size=False)
                    raw[j] += len(v)
                    packed[j] += min(len(z), len(v))
            seen += k
            if seen >= _AUTO_SAMPLE_VALUES:
                break
        if seen >= _AUTO_SAMPLE_VALUES:
            break
    return {f.name: "lz4" if raw[j] and packed[j] <= (1 - MIN_GAIN) * raw[j] else "none"
            for j, f in enumerate(source.fields)}


# ---------------------------------------------------------------------------------------
# Jobs (NOTE [parallel convert]).
def _split_units(weights: list[int], jobs: int) -> list[tuple[int, int]]:
    """``jobs`` contiguous, non-empty unit ranges of near-equal total weight."""
    n = len(weights)
    jobs = max(1, min(jobs, n))
    if n == 0:
        return [(0, 0)]
    cum = np.cumsum(np.maximum(np.asarray(weights, np.float64), 1.0))
    total = cum[-1]
    bounds = [0]
    for k in range(1, jobs):
        b = int(np.searchsorted(cum, total * k / jobs, side="left")) + 1
        b = max(b, bounds[-1] + 1)
        b = min(b, n - (jobs - k))
        bounds.append(b)
    bounds.append(n)
    return [(bounds[k], bounds[k + 1]) for k in range(jobs)]


def _column_bytes(fields: list[Field], chunk: Chunk) -> list[ColumnBytes]:
    """The chunk's columns as byte views for the encoder, checked against the fields."""
    out = []
    for f, c in zip(fields, chunk.columns, strict=True):
        if isinstance(c, VarColumn):
            big = np.flatnonzero(np.diff(c.offsets) > MAX_FIELD_BYTES)
            if big.size:
                raise ConvertError(f"record {chunk.row0 + int(big[0])} field {f.name!r}: a value is over 4 GiB")
            data = np.ascontiguousarray(c.data)
            out.append(ColumnBytes(data.data.cast("B") if data.size else memoryview(b""), 0,
                                   c.offsets.tolist(), c.lengths.tolist()))
        else:
            a = np.ascontiguousarray(c)
            if a.dtype != f.np_dtype or a.shape[1:] != f.shape or a.shape[0] != chunk.n:
                raise ConvertError(f"field {f.name!r}: chunk holds {a.dtype}{list(a.shape)}, "
                                   f"expected {f.dtype}{[chunk.n, *f.shape]}")
            out.append(ColumnBytes(a.reshape(-1).view(np.uint8).data if a.size else memoryview(b""),
                                   f.row_bytes))
    return out


def remove_leftovers(store: DatasetStore, keep: Any = ()) -> list[str]:
    """Deletes convert's shards that ``keep`` does not name and its temp files (NOTE [convert leftovers]).

    Returns the names removed.
    """
    kept = set(keep)
    stray = [n for n in store.names()
             if (_SHARD_NAME.fullmatch(n) and n not in kept) or _TEMP_NAME.fullmatch(n)]
    store.remove(stray)
    return stray


def run_job(source: Source, store: DatasetStore, compress: list[bool], shard_bytes: int, prefix: str,
            lo: int, hi: int, report: Callable[[int, int], None] | None,
            stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Converts units ``lo`` to ``hi`` of ``source`` into shards ``<prefix><n:06d>.pyl`` in ``store``.

    ``report(records, bytes)`` is called after each chunk; ``stop()`` is asked before
    each: once it is true the shards written so far are removed. Returns ``{"shards"``
    (their manifest entries), ``"records"``, ``"bytes_in"`` (decoded source bytes),
    ``"stopped"}``. On an error the shards written so far are removed too.
    """
    encoder = ShardEncoder(store.location, source.fields, compress, shard_bytes=shard_bytes, prefix=prefix,
                           store=store)
    row0 = source.unit_row0()
    nbytes = 0
    try:
        for u in range(lo, hi):
            for chunk in source.read(u, row0[u]):
                if stop is not None and stop():
                    encoder.abort()
                    return {"shards": [], "records": 0, "bytes_in": 0, "stopped": True}
                encoder.append_columns(chunk.n, _column_bytes(source.fields, chunk))
                nb = chunk.nbytes()
                nbytes += nb
                if report is not None:
                    report(chunk.n, nb)
        shards = encoder.close()
    except BaseException:
        encoder.abort()
        raise
    return {"shards": shards, "records": encoder.records, "bytes_in": nbytes, "stopped": False}


_WORKER: dict[str, Any] = {}


def _worker_init(progress_q: _ProgressQueue, stop: Event) -> None:
    _WORKER["q"], _WORKER["stop"] = progress_q, stop


def _worker_main(job: int, source: Source, store: DatasetStore, compress: list[bool], shard_bytes: int,
                 prefix: str, lo: int, hi: int) -> dict[str, Any]:
    q, stop = _WORKER.get("q"), _WORKER.get("stop")

    def report(n: int, nb: int) -> None:
        if q is not None:
            q.put((job, n, nb))

    try:
        return run_job(source, store, compress, shard_bytes, prefix, lo, hi, report,
                       stop.is_set if stop is not None else None)
    except BaseException:
        if stop is not None:
            stop.set()  # the others stop at their next chunk
        raise


class Progress:
    """Prints ``records, MB read, MB/s, ETA`` to stderr at most twice a second."""

    def __init__(self, total: int, total_bytes: int, enabled: bool | Callable[[dict[str, Any]], None]) -> None:
        self.total, self.total_bytes = total, total_bytes
        self.callback = enabled if callable(enabled) else None
        self.enabled = bool(enabled)
        self.records = 0
        self.bytes = 0
        self.start = time.perf_counter()
        self._last = 0.0
        # (time, records) of the first report: the ETA comes from the rate since then, so the
        # start-up (processes, a cluster, the first reads) does not stretch it.
        self._first: tuple[float, int] | None = None
        self._tty = sys.stderr.isatty()
        self._mu = threading.Lock()

    def add(self, n: int, nb: int) -> None:
        """Counts ``n`` more records of ``nb`` bytes (from any thread), then shows progress."""
        with self._mu:
            self.records += n
            self.bytes += nb
            if self._first is None:
                self._first = (time.perf_counter(), self.records)
        self.show()

    def show(self, final: bool = False) -> None:
        """Reports progress: prints a line to stderr, or passes the figures to the callback.

        At most every 0.5 s, unless ``final``, which also ends the printed line. Does
        nothing when progress is disabled.
        """
        if not self.enabled:
            return
        now = time.perf_counter()
        if not final and now - self._last < 0.5:
            return
        self._last = now
        dt = max(now - self.start, 1e-9)
        info = {"records": self.records, "total": self.total, "bytes": self.bytes, "seconds": dt,
                "mb_per_s": self.bytes / dt / 1e6}
        if self.callback is not None:
            self.callback(info)
            return
        pct = f" ({100 * self.records / self.total:.1f}%)" if self.total else ""
        eta = ""
        first = self._first
        if first is not None and self.records > first[1] and self.total and not final:
            rate = (self.records - first[1]) / max(now - first[0], 1e-9)
            eta = f", ETA {(self.total - self.records) / rate:.0f}s"
        line = (f"converted {self.records:,}/{self.total:,} records{pct}, {self.bytes / 1e6:.1f} MB, "
                f"{info['mb_per_s']:.1f} MB/s{eta}")
        end = "\n" if final or not self._tty else ""
        print(("\r" if self._tty else "") + line, end=end, file=sys.stderr, flush=True)


@dataclass
class ConvertResult:
    """What ``convert()`` wrote: the dataset folder, its size, the time taken and the choices made.

    ``fields`` are the manifest's field entries, ``compression`` the codec chosen per field,
    ``verified`` the summary of ``verify_dataset`` when ``convert(verify=True)`` ran it.
    ``path`` is the folder or URL written; ``jobs`` the processes (``engine="local"``) or
    the cluster's workers (``engine="dask"``) and ``tasks`` the parts the source was cut into.
    """

    path: str
    records: int
    shards: int
    bytes_in: int  # decoded bytes of the converted values
    bytes_out: int  # bytes of the shard files
    seconds: float
    jobs: int
    fields: list[dict[str, Any]]
    compression: dict[str, str]
    verified: dict[str, Any] | None = field(default=None)
    engine: str = "local"
    tasks: int = 1

    @property
    def mb_per_s(self) -> float:
        """Conversion speed: MB of values converted per second (0.0 if no time was measured)."""
        return self.bytes_in / self.seconds / 1e6 if self.seconds > 0 else 0.0


def convert(src: Any, dst: str | os.PathLike[str], *, kind: str | None = None, fields: Any = None,
            compression: str | Mapping[str, str] = "auto", shard_size: int | str = "64M", jobs: int = 1,
            nulls: str = "error", labels: bool = False, overwrite: bool = False,
            progress: bool | Callable[[dict[str, Any]], None] = False, verify: bool = False,
            engine: str = "local", scheduler: Any = None, task_size: int | str | None = None,
            storage_options: dict[str, Any] | None = None) -> ConvertResult:
    """Converts ``src`` into a pyloader dataset at ``dst`` (shards + manifest.json).

    Args:
        src: a Parquet file or folder of Parquet files, an Arrow IPC file, a ``.npy``/``.npz``
            file, a folder of ``.npy`` files, a dict of arrays or ``.npy`` paths, a folder of
            files, or WebDataset ``.tar`` shards (a file, a folder or a list); a glob pattern
            (``"wds/*.tar"``) or a list of files and patterns; see ``open_source``.
        dst: the dataset folder to write (created if missing), or an fsspec URL
            (``s3://bucket/prefix``, ``memory://...``): shards are uploaded as they are
            made, the manifest last (NOTE [remote publish] in store.py).
        kind: the source kind (``"parquet"``, ``"arrow"``, ``"numpy"``, ``"files"``, ``"tar"``);
            None guesses it from the file names.
        fields: which columns (arrays, extensions) to convert, in order: a list of names,
            or ``{name: dtype or None}`` to also cast Parquet/Arrow columns (checked: a
            lossy or out-of-range cast fails).
        compression: ``"auto"`` (LZ4 only for fields where it saves >= 10% on a sample),
            ``"lz4"``, ``"none"``, or ``{field: "lz4" | "none"}``.
        shard_size: payload bytes per shard before it rolls over (``"64M"``, ``1 << 26``).
        jobs: worker processes, each converting a contiguous part of the source
            (NOTE [parallel convert]); the record order is the source order. With
            ``engine="dask"`` and no ``scheduler``: the local cluster's worker processes.
        nulls: ``"error"`` (a null raises ConvertError naming the column and row) or
            ``"zero"`` (a null becomes zeros, an empty list or empty bytes; a tar sample
            missing a member gets an empty value).
        labels: for a folder of files, add ``label`` from the top-level folder name.
        overwrite: replace an existing dataset at ``dst`` (atomically, via the manifest).
        progress: ``True`` prints progress to stderr; a callable receives progress dicts.
        verify: after converting, compare every record with its source (``verify()``).
        engine: ``"local"`` (this machine's processes) or ``"dask"`` (tasks on a Dask
            cluster, NOTE [dask convert] in cluster.py; needs ``pyloader[dask]``).
        scheduler: with ``engine="dask"``, the scheduler's address (``"tcp://host:8786"``)
            or a ``distributed.Client``; None starts a ``LocalCluster`` of ``jobs`` processes.
        task_size: with ``engine="dask"``, source bytes per task (default: 4 shards'
            worth); the tasks, hence the shards, depend on it and on nothing else.
        storage_options: for a URL ``dst``, options for its fsspec filesystem (by
            default the backend's own configuration: for S3 the ``AWS_*`` variables).

    Returns:
        A ConvertResult; with ``verify``, its ``verified`` holds the comparison's summary.

    Raises:
        ConvertError: the source cannot be converted (the message names file, column and row).
        ImportError: ``engine="dask"`` without dask and distributed installed.
        FileExistsError: ``dst`` already holds a dataset and ``overwrite`` is False.
        ValueError: an invalid option.
        VerifyError: with ``verify``, a record differs from its source.
    """
    t0 = time.perf_counter()
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError("jobs must be a positive int")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine != "dask" and (scheduler is not None or task_size is not None):
        raise ValueError("scheduler= and task_size= apply to engine='dask'")
    if scheduler is not None and jobs != 1:
        raise ValueError("jobs= sets the processes of the local cluster; with scheduler= the cluster's "
                         "own workers run the tasks")
    shard_bytes = parse_size(shard_size, minimum=1)
    task_bytes = parse_size(task_size, minimum=1) if task_size is not None else 4 * shard_bytes
    store = open_store(dst, storage_options)
    if store.location.startswith("memory://") and (engine == "dask" or jobs > 1):
        raise ValueError(f"{store.location}: a memory:// filesystem lives in one process, so only "
                         "engine='local' with jobs=1 can write there")
    source = src if isinstance(src, Source) else open_source(src, kind=kind, fields=fields, nulls=nulls,
                                                             labels=labels)
    if source.num_records == 0:  # a dataset of no records cannot be read: refuse to write one
        where = getattr(source, "root", None) or ", ".join(getattr(source, "paths", None) or []) or "the source"
        raise ConvertError(f"{where}: the {source.kind} source holds no records; nothing to convert "
                           "(a dataset needs at least one record)")
    comp = choose_compression(source, compression)
    root = store.location
    created = isinstance(store, LocalStore) and not os.path.isdir(root)  # removed again if the run fails
    if isinstance(store, LocalStore):
        os.makedirs(root, exist_ok=True)
    token, old = replace_token(root, overwrite=overwrite, hint="pass overwrite=True to replace it", store=store)
    remove_leftovers(store, keep=old)  # See NOTE [convert leftovers]: a killed run's files
    compress = [comp[f.name] == "lz4" for f in source.fields]
    ranges = _split_units(source.unit_bytes, jobs) if engine == "local" else plan_tasks(source.unit_bytes, task_bytes)
    prog = Progress(source.num_records, int(sum(source.unit_bytes)), progress)
    results: list[dict[str, Any]] = []
    workers = len(ranges)
    try:
        if engine == "dask":
            results, workers = run_tasks(run_job, source, store, compress, shard_bytes, token, ranges, prog.add,
                                         scheduler, jobs)
        elif len(ranges) == 1:
            lo, hi = ranges[0]
            results.append(run_job(source, store, compress, shard_bytes, f"shard-{token}00000-", lo, hi, prog.add))
        else:
            results = _run_parallel(source, store, compress, shard_bytes, token, ranges, prog)
    except BaseException:
        try:
            for r in results:
                store.remove([s["path"] for s in r["shards"]])
            remove_leftovers(store, keep=old)
            if created:
                os.rmdir(root)  # a folder this run made and that holds nothing: no trace of a dataset
        except OSError:  # the run's own error is the one to report; the next run removes the rest
            pass
        raise
    prog.show(final=True)
    shards = [s for r in results for s in r["shards"]]
    records = sum(r["records"] for r in results)
    # See NOTE [parallel convert]: the manifest is the commit point; old shards go after it.
    body = publish_manifest(root, source.fields, shards, old, store=store)
    remove_leftovers(store, keep=[s["path"] for s in shards])
    sidecar = {"source": source.describe(), "compression": comp, "nulls": getattr(source, "nulls", nulls),
               "engine": engine, "jobs": workers, "tasks": len(ranges), "shard_size": shard_bytes}
    if engine == "dask":
        sidecar["task_size"] = task_bytes
    store.put(SIDECAR_NAME, [json.dumps(sidecar, indent=1).encode() + b"\n"])
    res = ConvertResult(root, records, len(shards), prog.bytes, sum(s["bytes"] for s in shards),
                        time.perf_counter() - t0, workers, body["fields"], comp, engine=engine, tasks=len(ranges))
    if verify:
        res.verified = verify_dataset(source, root, storage_options=storage_options)
    return res


def _run_parallel(source: Source, store: DatasetStore, compress: list[bool], shard_bytes: int, token: str,
                  ranges: list[tuple[int, int]], prog: Progress) -> list[dict[str, Any]]:
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

    # forkserver: this module (numpy, lz4, the native core) is imported once, in the server;
    # jobs fork from that clean, thread-free process instead of importing anew. spawn elsewhere.
    ctx: BaseContext
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["pyloader.write.convert"])
    else:
        ctx = mp.get_context("spawn")
    q: _ProgressQueue = ctx.Queue()
    stop = ctx.Event()
    done: list[dict[str, Any] | None] = [None] * len(ranges)
    with ProcessPoolExecutor(max_workers=len(ranges), mp_context=ctx, initializer=_worker_init,
                             initargs=(q, stop)) as ex:
        futs = [ex.submit(_worker_main, k, source, store, compress, shard_bytes, f"shard-{token}{k:05d}-", lo, hi)
                for k, (lo, hi) in enumerate(ranges)]
        pending = set(futs)
        error: BaseException | None = None
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
            _drain(q, prog)
            for f in finished:
                k = futs.index(f)
                try:
                    done[k] = f.result()
                except BaseException as e:  # noqa: BLE001 - re-raised below, first failure wins
                    stop.set()
                    if error is None:
                        error = e
        _drain(q, prog)
    if error is not None:
        for r in done:
            if r is not None:
                store.remove([s["path"] for s in r["shards"]])
        raise error
    return [r for r in done if r is not None]


def _drain(q: _ProgressQueue, prog: Progress) -> None:
    while True:
        try:
            _, n, nb = q.get_nowait()
        except queue.Empty:
            return
        prog.add(n, nb)


__all__ = ["COMPRESSIONS", "ENGINES", "SIDECAR_NAME", "choose_compression", "remove_leftovers", "run_job", "Progress",
           "ConvertResult", "convert"]
