"""ParquetDataset: Parquet read directly, with pyloader's plan, node cache, prefetch and staging.

Row groups play the part of shards: the epoch plan (``pyloader.read.order``) orders and
partitions rows exactly as ``ShardDataset`` orders records, with row group ``g`` as
"shard" ``g`` (row groups numbered file by file, files sorted by path), except that
window mode shuffles the files and then the row groups within each file
(``order.epoch_order``'s ``shard_files``), so that a shuffled epoch holds a file only
while a window overlaps it (NOTE [window size] in ``pyloader.read.order``).

NOTE [row group lifetime]: a batch iterator knows the whole plan, so it decodes a row
group when the first batch that reads it is submitted (or up to ``num_threads`` row
groups earlier, so decoding overlaps) and drops it right after the last batch that reads
it has been handed out. Memory is therefore the row groups the plan
keeps open at once: one or two unshuffled; about ``window / rows_per_group + 1`` in
``shuffle_mode="window"`` (the default here); every row group in ``"global"`` mode, which
is only sensible for data that fits in memory.

Remote files stream as ``ShardDataset``'s shards do (one ``ShardFetcher`` per process), into
a ``PendingFiles`` in place of a native shard set: each row group decoded is one planned read
of its file (NOTE [pending files] in pyloader/remote/pending_files.py).

What is native and what is not: pyarrow (C++) reads and decodes row groups on
``num_threads`` threads without the GIL; Arrow's buffers become numpy arrays without a
copy where a column is fixed-width and null-free; collation into reusable staging
buffers is numpy (fancy-index copies, which release the GIL), on ``num_threads``
threads. pyloader's C++ batch pipeline is not involved: it reads pyloader shards.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import json
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

import pyloader._C as _C

from ..contract import Plan, check_choice, check_stream_args
from ..errors import ConvertError, LoaderTimeoutError, ParquetReadError, PyloaderError
from ..format.arrow import PARQUET_EXT as _PARQUET_EXT
from ..format.arrow import VarColumn, arrow_field, arrow_to_column
from ..format.arrow import pyarrow_module as _pa
from ..format.spec import Field
from ..remote import fetch as _fetch
from ..remote.budget import MAX_OPEN, check_share, reader_share
from ..remote.cache import DatasetCache
from ..remote.fs import is_remote
from ..remote.pending_files import PendingFiles
from .parquet_remote import ParquetFileCache, fetch_error, list_remote, remote_path
from .units import RemoteOptions, UnitDataset, node_readers


# ---------------------------------------------------------------------------------------
# NOTE [parquet fingerprint]: what a resumed loader must find again, from the files'
# footers alone (no data page is read to compute it). ``fingerprint`` is XXH64 (hex) of
# the JSON of four named digests, ``fingerprint_parts``, each XXH64 (hex) of a JSON list:
#
# * ``paths``: each file's path relative to the folder it was found in (its name when it
#   was named alone), in reading order (sorted by path): the names and their order;
# * ``row_groups``: each file's row counts, row group by row group: the units the epoch
#   plan orders (NOTE [row group lifetime]);
# * ``footers``: each file's size in bytes and ``_footer_digest``, XXH64 of its Parquet
#   footer (the Thrift file metadata, its length and the closing ``PAR1``). The footer
#   holds every column chunk's offsets, compressed and uncompressed sizes, value counts
#   and (as most writers store them) min/max statistics, so rewriting a file almost always
#   changes it, even at the same size and mtime; it is no checksum of every byte: a
#   rewrite that keeps every one of those equal is not seen;
# * ``columns``: the columns selected, in order, and the fields they map to.
#
# Locations are not part of it: the same files read from another folder, URL or cache
# match (remote files are fetched under names from their ETag or mtime, NOTE [cache
# publish], which guards the cache, not the identity). A state from other data names the
# parts that differ (``pyloader.loader.state.check_state``).
def _footer_digest(fh: Any, size: int, name: str) -> str:
    """XXH64 (hex) of the footer of the Parquet file open as ``fh`` (``size`` bytes): its last 8 + n bytes.

    n is the footer length stored before the closing magic. Raises ``ParquetReadError``
    when the file is shorter than its footer says.
    """
    fh.seek(size - 8)
    tail = fh.read(8)
    n = int.from_bytes(tail[:4], "little") if len(tail) == 8 else -1
    if n < 0 or n + 8 > size:
        raise ParquetReadError(f"{name}: not a readable Parquet file: its footer does not fit in {size} bytes")
    fh.seek(size - 8 - n)
    footer = fh.read(n)
    if len(footer) != n:
        raise ParquetReadError(f"{name}: not a readable Parquet file: its footer is cut short")
    return f"{_C.xxh64(footer + tail):016x}"


def _xxh64_json(value: Any) -> str:
    return f"{_C.xxh64(json.dumps(value, sort_keys=True, separators=(',', ':')).encode()):016x}"


def _parquet_fingerprint_parts(columns: list[str], fields: list[Field], named: list[tuple[str, int]],
                               footers: list[str], metas: list[Any]) -> dict[str, str]:
    """The named digests of NOTE [parquet fingerprint]."""
    return {
        "paths": _xxh64_json([rel for rel, _ in named]),
        "row_groups": _xxh64_json([[md.row_group(j).num_rows for j in range(md.num_row_groups)] for md in metas]),
        "footers": _xxh64_json([[size, digest] for (_, size), digest in zip(named, footers, strict=True)]),
        "columns": _xxh64_json({"columns": columns, "fields": [f.to_json() for f in fields]}),
    }


class ParquetDataset(UnitDataset, IterableDataset):
    """An iterable dataset over Parquet files, local or at any fsspec URL.

    ``columns`` selects and orders the columns (default: all); each must map to a
    pyloader field (see ``docs/convert.md``): numeric and bool columns become fixed
    fields, fixed-size lists fixed shapes, lists variable fields (batched as
    ``name`` + ``name_lengths``, zero-padded), binary/string columns bytes (UTF-8).
    Nulls raise ``ParquetReadError`` naming the column and row unless ``nulls="zero"``.

    Ordering, shuffling and partitioning are ``ShardDataset``'s (same arguments, same
    guarantees), with row groups as shards, except that window mode shuffles files, then
    the row groups within each file (``unit_files``: NOTE [window size] in
    ``pyloader.read.order``), so a file's rows are read within ``rows of the file + 2 *
    window`` positions of the epoch; ``shuffle_mode`` defaults to ``"window"``
    because a row group is decoded whole (NOTE [row group lifetime]). Remote URLs stream
    through the node cache (``cache_dir``, ``cache_limit``, ``fetch_jobs``,
    ``storage_options`` as for ShardDataset): each file is fetched whole, ahead of the
    reader in plan order within its share of ``cache_limit``, and released (unpinned, so
    evictable) once the last of its row groups the plan reads is decoded (NOTE [streaming]
    in ``pyloader.remote.fetch``, NOTE [pending files] in ``pyloader.remote.pending_files``):
    a dataset many times the cache limit reads through it. What must fit is the plan's
    working set (``CacheLimitError`` otherwise): unshuffled, the files a few batches span;
    window-shuffled, the files a window and the batches read ahead overlap (about
    ``window / rows per file + 2``); a global shuffle holds every file.
    Resumable: ``pyloader.DataLoader.state_dict()`` / ``load_state_dict()`` work as for
    ``ShardDataset`` (docs/resume.md). ``fingerprint`` (what a state names) identifies the
    files by relative path, row-group row counts, size and footer bytes, and the columns
    and fields selected, not by location (NOTE [parquet fingerprint]); a state from other
    data raises ``ResumeError`` naming the ``fingerprint_parts`` that differ.
    ``transform`` and ``decode``: as for ``ShardDataset`` (docs/transforms.md).
    """

    # A kept sample would hold its whole staging buffer out of reuse (NOTE [staging reuse]).
    clone_samples = True

    def __init__(self, url: str | os.PathLike[str] | list[str], columns: list[str] | None = None, *,
                 shuffle: bool = False, seed: int = 0, shuffle_mode: str = "window", window: int = 65536,
                 rank: int | None = None, world_size: int | None = None, partition: str = "pad",
                 nulls: str = "error", cache_dir: str | os.PathLike[str] | None = None,
                 cache_limit: int | str | None = None, fetch_jobs: int = 4,
                 storage_options: dict[str, Any] | None = None, transform: Any = None,
                 decode: Any = None) -> None:
        super().__init__()
        pa = _pa()
        import pyarrow.parquet as pq

        self._configure(shuffle=shuffle, seed=seed, shuffle_mode=shuffle_mode, window=window, rank=rank,
                        world_size=world_size, partition=partition, transform=transform)
        remote_options = RemoteOptions(cache_dir=cache_dir, cache_limit=cache_limit, fetch_jobs=fetch_jobs,
                                       storage_options=storage_options)
        self.nulls = check_choice("nulls", nulls, ("error", "zero"))
        self.fetch_jobs = remote_options.jobs_for([])
        self._cache: DatasetCache | None = None
        self._pending: PendingFiles | None = None
        self._remote_metas: tuple[int, dict[int, Any]] | None = None  # (pid, footer of each remote file read)
        self._fetcher: Any = None
        self._fetch_pid = -1
        urls = [os.fspath(u) for u in url] if isinstance(url, (list, tuple)) else [os.fspath(url)]
        self.url = urls[0] if len(urls) == 1 else urls
        remote = [is_remote(u) for u in urls]
        metas: list[Any] = []
        named: list[tuple[str, int]] = []  # (path relative to its folder, bytes) per file
        footers: list[str] = []  # _footer_digest per file
        if any(remote):
            if len(urls) != 1:
                raise ValueError("a remote ParquetDataset takes one URL (a file or a folder)")
            fs, root, root_url, files = list_remote(urls[0], remote_options.storage_options)
            if not files:
                raise ParquetReadError(f"{urls[0]}: holds no Parquet files")
            self._cache = remote_options.open(root_url, listing=files, flavour=ParquetFileCache)
            self.files = [self._cache.shard_url(i) for i in range(len(files))]
            for i, (rel, size, _) in enumerate(files):
                if self._cache.is_published(i):
                    local = self._cache.shard_file(i)
                    metas.append(self._metadata(local, self.files[i]))
                    with open(local, "rb") as fh:
                        footers.append(_footer_digest(fh, size, self.files[i]))
                else:  # only the footer is read: the file is fetched whole when the plan needs it
                    with fs.open(remote_path(root, root_url, rel), "rb") as fh:
                        metas.append(self._metadata(fh, self.files[i]))
                        footers.append(_footer_digest(fh, size, self.files[i]))
                named.append((rel, size))
        else:
            files_local: list[str] = []
            for u in urls:
                p = u.removeprefix("file://")
                if os.path.isdir(p):
                    found = sorted(os.path.join(d, f) for d, _, fs_ in os.walk(p) for f in fs_
                                   if f.lower().endswith(_PARQUET_EXT) and not f.startswith((".", "_")))
                    if not found:
                        raise ParquetReadError(f"{p}: holds no Parquet files")
                    files_local.extend(found)
                    named.extend((os.path.relpath(f, p).replace(os.sep, "/"), os.path.getsize(f)) for f in found)
                elif os.path.exists(p):
                    files_local.append(p)
                    named.append((os.path.basename(p), os.path.getsize(p)))
                else:
                    raise FileNotFoundError(f"no such Parquet file or folder: {p!r}")
            self.files = files_local
            for p, (_, size) in zip(files_local, named, strict=True):
                metas.append(self._metadata(p, p))
                with open(p, "rb") as fh:
                    footers.append(_footer_digest(fh, size, p))
        # Fields: the same mapping as `pyloader convert` (pyloader.format.arrow.arrow_field).
        schema0 = metas[0].schema.to_arrow_schema()
        self.columns = list(columns) if columns is not None else list(schema0.names)
        if not self.columns:
            raise ValueError("columns must name at least one column")
        self.fields: list[Field] = []
        for i, md in enumerate(metas):
            schema = md.schema.to_arrow_schema()
            fl = []
            for c in self.columns:
                if c not in schema.names:
                    raise ParquetReadError(f"{self.files[i]}: has no column {c!r} (columns: {', '.join(schema.names)})")
                others = [o for o in self.columns if o != c]
                fix = (f"leave it out with columns={others!r}" if others else
                       "name columns of the supported types with columns=[...]")
                try:
                    fl.append(arrow_field(c, schema.field(c).type, fix=fix))
                except ConvertError as e:
                    raise ParquetReadError(f"{self.files[i]}: {e}") from None
            if i == 0:
                self.fields = fl
            elif fl != self.fields:
                bad = next(c for c, a, b in zip(self.columns, fl, self.fields, strict=True) if a != b)
                raise ParquetReadError(f"{self.files[i]}: column {bad!r} has another type than in {self.files[0]}")
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names) or any(f"{f.name}_lengths" in names for f in self.fields if f.variable):
            raise ParquetReadError(f"columns {self.columns} map to colliding field names {names}")
        self.decode = decode  # checked and resolved now (NOTE [decode resolved once])
        self.group_file: list[int] = []
        self.group_index: list[int] = []
        self.records_per_group: list[int] = []
        self.unit_records = self.records_per_group  # UnitDataset plans by row group...
        self.unit_files = self.group_file  # ...and window mode shuffles them file by file (NOTE [window size])
        self.group_row0: list[int] = []  # first row of each group within its file (for errors)
        for i, md in enumerate(metas):
            r = 0
            for j in range(md.num_row_groups):
                self.group_file.append(i)
                self.group_index.append(j)
                self.group_row0.append(r)
                self.records_per_group.append(md.row_group(j).num_rows)
                r += md.row_group(j).num_rows
        self.num_records = int(sum(self.records_per_group))
        if self.num_records == 0:
            raise ParquetReadError(f"{self.url}: the Parquet data holds no rows")
        self._local = threading.local()
        self._fingerprint_parts = _parquet_fingerprint_parts(self.columns, self.fields, named, footers, metas)
        self._fingerprint = _xxh64_json(self._fingerprint_parts)
        del pa, pq
        self._check_share(self.plan()[0], 1, 0)

    @property
    def fingerprint(self) -> str:
        """The identity a loader state names (NOTE [parquet fingerprint]): XXH64 of ``fingerprint_parts``."""
        return self._fingerprint

    @property
    def fingerprint_parts(self) -> dict[str, str]:
        """The digests the fingerprint combines (NOTE [parquet fingerprint]), by name."""
        return dict(self._fingerprint_parts)

    def _plan_files(self, gidx: np.ndarray) -> np.ndarray:
        """The file of each row group in ``gidx``."""
        return np.asarray(self.group_file, np.int64)[gidx] if gidx.size else gidx

    @staticmethod
    def _metadata(src: Any, name: str) -> Any:
        pa = _pa()
        import pyarrow.parquet as pq

        try:
            return pq.read_metadata(src)
        except (pa.ArrowInvalid, OSError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise ParquetReadError(f"{name}: not a readable Parquet file: {e}") from None

    # -- reading -------------------------------------------------------------------------
    def _check_share(self, groups: np.ndarray, readers: int, horizon: int) -> tuple[int, int, bool]:
        """(bytes, files, tight) a remote reader of the plan ``groups`` holds at once; ``CacheLimitError`` above its share.

        A file is held from ``horizon`` rows before the plan first reads it until the last
        of its row groups is decoded (NOTE [pending files] in ``pyloader.remote.pending_files``);
        the working set is ``fetch.working_set`` of the plan's files (NOTE [cache shares]).
        NOTE [tight cache]: where the share holds what the plan reads at once (the files of
        one window, of a batch that spans two) but not the read-ahead on top of it (at each
        file boundary the next file is wanted ``horizon`` rows before the last one is
        released: 16 files of 8 row groups through a cache of 1/8 of them, two files, hold
        the two largest neighbours at once), the reader goes on with ``tight`` True: its
        fetcher fetches a file a decode thread waits for only once it fits
        (``ShardFetcher.strict``), so the read-ahead stops at the boundary until the last
        file's final row group is decoded and released, and the cache stays within its limit.
        """
        if self._cache is None or self._cache.cache.limit is None:
            return 0, 0, False
        files, sizes = self._plan_files(groups), self._file_sizes()
        need, count = _fetch.working_set(files, sizes, horizon)
        tight = False
        share = reader_share(self._cache.cache.limit, node_readers(readers))
        if share is not None and need > share and horizon > 0:
            least, files_at_once = _fetch.working_set(files, sizes, 0)
            if least <= share:
                need, count, tight = least, files_at_once, True
        o = self.order
        if o.shuffle and o.shuffle_mode == "global":
            hint = ("or shuffle_mode='window': a global shuffle spreads every file's rows over the whole epoch, "
                    "so every file is held from its first row read to its last")
        elif o.shuffle:
            hint = (f"or a smaller window (now {o.window} rows: a window shuffles the rows of the files it "
                    "overlaps, each held until its last row is read), batch_size or prefetch, or smaller files")
        else:
            hint = "or a smaller batch_size or prefetch, or smaller files"
        check_share(self._cache.url, self._cache.cache.limit, need, node_readers(readers),
                    f"{count} files: those its plan reads at once plus the batches read ahead", hint)
        return need, count, tight

    def _file_sizes(self) -> np.ndarray:
        assert self._cache is not None
        return np.asarray([int(s["bytes"]) for s in self._cache.shards], np.int64)

    def _ensure_fetcher(self, readers: int = 1) -> None:
        """This process's fetcher of the remote files, held to its share of the cache (NOTE [streaming])."""
        if self._cache is None or self._fetch_pid == os.getpid():
            return
        self._pending = PendingFiles(len(self.files), functools.partial(fetch_error, self._cache))
        budget = reader_share(self._cache.cache.limit, node_readers(readers))
        self._fetcher = _fetch.ShardFetcher(self._cache, self._pending, jobs=self.fetch_jobs, budget=budget,
                                            max_open=MAX_OPEN)
        self._fetch_pid = os.getpid()
        weakref.finalize(self, self._fetcher.close)

    def _parquet_file(self, i: int) -> Any:
        """Local file ``i``'s reader of this thread (its reader is not shared across threads)."""
        import pyarrow.parquet as pq

        if not hasattr(self, "_local"):
            self._local = threading.local()
        files = getattr(self._local, "files", None)
        if files is None or getattr(self._local, "pid", -1) != os.getpid():
            files = self._local.files = {}
            self._local.pid = os.getpid()
        pf = files.get(i)
        if pf is None:
            pf = files[i] = pq.ParquetFile(self.files[i], memory_map=True)
        return pf

    def _read_group(self, i: int, j: int) -> Any:
        """Row group ``j`` of file ``i`` as a pyarrow Table.

        A remote file is read from its cached copy, opened for this read alone: a file is
        unpinned and may be evicted between reads (NOTE [pending files]).
        """
        if self._cache is None:
            return self._parquet_file(i).read_row_group(j, columns=self.columns, use_threads=False)
        import pyarrow.parquet as pq

        if self._fetch_pid != os.getpid():  # decode_group called alone: fetch this file now
            self._ensure_fetcher()
            self._fetcher.schedule([i])
        assert self._pending is not None
        metas = self._remote_metas
        if metas is None or metas[0] != os.getpid():
            metas = self._remote_metas = (os.getpid(), {})
        with self._pending.reading(i) as path:
            # Its footer is parsed once per process (a parse can cost more than a row group's read).
            pf = pq.ParquetFile(path, memory_map=True, metadata=metas[1].get(i))
            try:
                metas[1].setdefault(i, pf.metadata)
                return pf.read_row_group(j, columns=self.columns, use_threads=False)
            finally:
                pf.close()

    def decode_group(self, g: int) -> list[Any]:
        """Row group ``g``'s columns: ndarrays ``[rows, *shape]`` or VarColumns.

        Runs without the GIL inside pyarrow; zero-copy for fixed-width null-free columns.
        Raises ``ParquetReadError`` when the row group cannot be read or converted.
        """
        pa = _pa()
        i, j = self.group_file[g], self.group_index[g]
        where = f"{self.files[i]}: row group {j}"
        try:
            table = self._read_group(i, j)
        except (pa.ArrowInvalid, OSError) as e:
            raise ParquetReadError(f"{where}: cannot be read: {e}") from None
        if table.num_rows != self.records_per_group[g]:
            raise ParquetReadError(f"{where}: holds {table.num_rows} rows, its footer said {self.records_per_group[g]}")
        row0 = self.group_row0[g]
        try:
            return [arrow_to_column(table.column(k), f, c, where, row0, self.nulls)
                    for k, (c, f) in enumerate(zip(self.columns, self.fields, strict=True))]
        except ConvertError as e:
            raise ParquetReadError(str(e)) from None

    def batches(self, batch_size: int, *, plan: Plan | None = None, drop_last: bool = False, num_threads: int = 2,
                prefetch: int | None = None, pool: Any = None, readers: int = 1, epoch: int | None = None,
                shuffle: bool | None = None, seed: int | None = None, worker: int = 0,
                num_workers: int = 1) -> ParquetBatchIterator:
        """Batches (dicts of tensors) over ``plan`` (NOTE [dataset contract]).

        Without ``plan``: this rank's plan of ``epoch`` (and optional worker split), as
        ``ShardDataset.batches``. ``pool`` is accepted for ``pyloader.DataLoader`` and
        ignored: staging buffers are this iterator's own (reused once no tensor uses them,
        NOTE [staging reuse]). ``readers``: the processes of this rank reading at once
        (``executor="processes"``), which share its part of a remote dataset's cache.

        A remote dataset streams (NOTE [streaming] in ``pyloader.remote.fetch``): its files
        are fetched ahead in plan order within this reader's share of the cache limit and
        released after the last of their row groups the plan reads is decoded (NOTE
        [pending files] in ``pyloader.remote.pending_files``). ``CacheLimitError`` when the
        plan's working set does not fit that share.
        """
        batch_size, num_threads, prefetch = check_stream_args(batch_size, num_threads, prefetch)
        gidx, ridx = self._own_plan(plan, epoch, worker, num_workers, shuffle, seed)
        self._ensure_fetcher(readers)
        if self._fetcher is not None:
            if self._cache is not None and self._cache.cache.limit is not None:
                # Decoding runs `prefetch` batches and `num_threads` row groups ahead of the consumer.
                horizon = (prefetch + 1) * batch_size + num_threads * max(self.records_per_group)
                need, count, tight = self._check_share(gidx, readers, horizon)
                self._fetcher.working_set_bytes = need
                self._fetcher.strict = tight  # See NOTE [tight cache]
                self._fetcher.max_open = max(MAX_OPEN, count + 2 * self.fetch_jobs)
        it = ParquetBatchIterator(self, gidx, ridx, batch_size, drop_last, num_threads, prefetch)  # retains its files
        if self._fetcher is not None:
            self._fetcher.schedule(_fetch.first_touch_order(self._plan_files(gidx)))  # fetch ahead, in plan order
        return it

    # -- per-sample iteration for torch's DataLoader -----------------------------------
    def __getstate__(self) -> dict[str, Any]:
        s = self.__dict__.copy()
        s["_local"] = None
        s["_fetcher"], s["_pending"], s["_fetch_pid"], s["_remote_metas"] = None, None, -1, None
        return s

    def __setstate__(self, s: dict[str, Any]) -> None:
        self.__dict__.update(s)
        self._local = threading.local()


class _Staging:
    """Reusable byte buffers for batches.

    NOTE [staging reuse]: ``tensor()`` hands out a tensor made by ``torch.from_numpy`` of a
    view of a pooled buffer. That view object is referenced by the tensor's storage and by
    nothing else, so it lives exactly as long as the storage: as long as any tensor (a
    slice, ``.view()``, ``.numpy()`` array, DLPack export of it) still uses the memory.
    A ``weakref.finalize`` on it returns the buffer (its lease ends) when the storage is
    freed, and a buffer is handed out again only after its lease ended, so a live view of
    an old batch never sees its bytes overwritten. The finalizer may run on any thread
    (whichever drops the last tensor), so it only appends to a deque that ``tensor()``
    drains under the lock. Buffers beyond ``limit`` are not pooled (plain allocations).
    """

    def __init__(self, limit: int) -> None:
        self._free: list[np.ndarray] = []  # pooled buffers, leased or not
        self._leased: set[int] = set()  # indices into _free whose lease has not ended
        self._returned: collections.deque[int] = collections.deque()  # ended leases, from finalizers
        self._mu = threading.Lock()
        self._limit = limit
        self.created = 0

    def tensor(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> torch.Tensor:
        """A C-contiguous tensor of ``dtype``/``shape`` over a free buffer (contents undefined)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        with self._mu:
            while self._returned:
                self._leased.discard(self._returned.popleft())
            idx = next((i for i, b in enumerate(self._free) if i not in self._leased and b.nbytes >= nbytes), -1)
            if idx < 0:
                buf = np.empty(max(nbytes, 1), np.uint8)
                self.created += 1
                if len(self._free) < self._limit:
                    idx = len(self._free)
                    self._free.append(buf)
            else:
                buf = self._free[idx]
            view = buf[:nbytes].view(dtype).reshape(shape)
            out = torch.from_numpy(view)  # the storage now holds `view`, and only it does
            if idx >= 0:
                self._leased.add(idx)
                weakref.finalize(view, self._returned.append, idx).atexit = False
        return out


class ParquetBatchIterator:
    """Batches of a ParquetDataset, in plan order.

    Row groups decode and batches collate ahead on ``num_threads`` threads each
    (NOTE [row group lifetime]). Errors surface in ``next()`` with the file, row group and
    column. Dropping it or ``close()`` stops the work.
    """

    def __init__(self, ds: ParquetDataset, gidx: np.ndarray, ridx: np.ndarray, batch_size: int, drop_last: bool,
                 num_threads: int, prefetch: int) -> None:
        self._ds = ds
        self._fields = ds.fields
        self._g, self._r = gidx, ridx
        n = gidx.size
        self._bs = batch_size
        self._nb = n // batch_size if drop_last else -(-n // batch_size)
        self._prefetch = prefetch
        self._threads = num_threads
        # Last batch that reads each row group: dropped right after it (NOTE [row group lifetime]).
        used = gidx[: self._nb * batch_size] if drop_last else gidx
        self._last: dict[int, int] = {}
        if used.size:
            rev_u, rev_first = np.unique(used[::-1], return_index=True)
            for g, k in zip(rev_u.tolist(), ((used.size - 1 - rev_first) // batch_size).tolist(), strict=True):
                self._last[g] = k
        # Each row group decoded is a planned read of its file (See NOTE [pending files] in
        # pyloader/remote/pending_files.py): retained now, released once decoded or closed.
        self._pending = ds._pending if ds._fetch_pid == os.getpid() else None
        self._unreleased: set[int] = set(self._last) if self._pending is not None else set()
        if self._pending is not None and self._unreleased:
            files, reads = np.unique(np.asarray(ds.group_file, np.int64)[sorted(self._unreleased)], return_counts=True)
            for i, n in zip(files.tolist(), reads.tolist(), strict=True):
                self._pending.retain(i, n)
        # Row groups in the order the plan first reads them, and the batch that first does:
        # decoding runs up to `num_threads` row groups ahead of the batches submitted.
        if gidx.size:
            uniq, first = np.unique(gidx, return_index=True)
            o = np.argsort(first, kind="stable")
            self._touch, self._touch_batch = uniq[o].tolist(), (first[o] // batch_size).tolist()
        else:
            self._touch, self._touch_batch = [], []
        self._touch_next = 0
        self._decoded: dict[int, Future] = {}
        self._queue: collections.deque[Future] = collections.deque()
        self._submitted = 0
        self._yielded = 0
        self._decode_pool = ThreadPoolExecutor(num_threads, thread_name_prefix="pyloader-parquet-decode")
        self._collate_pool = ThreadPoolExecutor(num_threads, thread_name_prefix="pyloader-parquet-collate")
        self._staging = _Staging(limit=4 * len(ds.fields) * (prefetch + 2))
        self._mu = threading.Lock()
        self._counters = {"decode_ns": 0, "collate_ns": 0, "wait_ns": 0, "groups": 0, "records": 0, "bytes": 0}
        self._start = time.perf_counter()
        self._end: float | None = None
        self._closed = False
        self._pid = os.getpid()
        self.on_finish: Any = None
        self.timeout = 0.0  # seconds next() waits for a batch before LoaderTimeoutError (0: forever)

    def __iter__(self) -> ParquetBatchIterator:
        return self

    def __len__(self) -> int:
        return self._nb

    def _decode(self, g: int) -> list[Any]:
        t = time.perf_counter_ns()
        try:
            cols = self._ds.decode_group(g)
        finally:
            self._release(g)
        with self._mu:
            self._counters["decode_ns"] += time.perf_counter_ns() - t
            self._counters["groups"] += 1
        return cols

    def _release(self, g: int) -> None:
        """Row group ``g``'s read of its file is done, or will never run (NOTE [pending files])."""
        with self._mu:
            if g not in self._unreleased:
                return
            self._unreleased.discard(g)
        assert self._pending is not None
        self._pending.release(self._ds.group_file[g])

    def _submit(self, k: int) -> None:
        a, b = k * self._bs, min((k + 1) * self._bs, self._g.size)
        groups = np.unique(self._g[a:b]).tolist()
        t = self._touch_next
        due = bisect.bisect_right(self._touch_batch, k)  # groups that batches <= k read
        while t < len(self._touch) and (t < due or t - due < self._threads):
            g = self._touch[t]
            if g not in self._decoded and self._last.get(g, -1) >= k:
                self._decoded[g] = self._decode_pool.submit(self._decode, g)
            t += 1
        self._touch_next = t
        futs = {}
        for g in groups:
            f = self._decoded.get(g)
            if f is None:
                f = self._decoded[g] = self._decode_pool.submit(self._decode, g)
            futs[g] = f
        self._queue.append(self._collate_pool.submit(self._collate, a, b, futs))

    def _collate(self, a: int, b: int, futs: dict[int, Future]) -> dict[str, torch.Tensor]:
        cols = {g: f.result() for g, f in futs.items()}  # re-raises a decode error here
        t0 = time.perf_counter_ns()
        gs, rs = self._g[a:b], self._r[a:b]
        n = b - a
        groups: list[tuple[int, Any, np.ndarray]]
        if len(cols) == 1:
            groups = [(next(iter(cols)), slice(None), rs)]
        else:
            order = np.argsort(gs, kind="stable")
            sg = gs[order]
            cuts = np.flatnonzero(np.diff(sg)) + 1
            groups = [(int(gs[p[0]]), p, rs[p]) for p in np.split(order, cuts)]
        out: dict[str, torch.Tensor] = {}
        nbytes = 0
        for j, f in enumerate(self._fields):
            if not f.variable:
                t = self._staging.tensor(f.np_dtype, (n, *[int(d or 0) for d in f.shape]))  # fixed: no None
                buf = t.numpy()  # a view that holds `t`: the buffer stays leased while we write
                for g, pos, rows in groups:
                    src = cols[g][j]
                    if isinstance(pos, slice) and rows.size and rows[-1] - rows[0] == n - 1 and \
                            np.array_equal(rows, np.arange(rows[0], rows[0] + n)):
                        buf[...] = src[rows[0] : rows[0] + n]  # contiguous rows: one memcpy
                    else:
                        buf[pos] = src[rows]
                out[f.name] = t
                nbytes += buf.nbytes
                continue
            lens = np.empty(n, np.int64)
            for g, pos, rows in groups:
                lens[pos] = cols[g][j].lengths[rows]
            lmax = int(lens.max()) if n else 0
            rb = f.row_bytes
            width = lmax * rb
            t = self._staging.tensor(f.np_dtype, (n, lmax, *[int(d or 0) for d in f.shape[1:]]))
            rows2d = t.numpy().view(np.uint8).reshape(n, width)  # holds `t`, as above
            rows2d[...] = 0  # padding is zeros (docs/format.md, "Batches")
            for g, pos, rows in groups:
                vc: VarColumn = cols[g][j]
                data, offs = vc.data, vc.offsets
                dst_rows = range(n)[pos] if isinstance(pos, slice) else pos.tolist()
                for d, r in zip(dst_rows, rows.tolist(), strict=True):
                    o0, o1 = int(offs[r]), int(offs[r + 1])
                    rows2d[d, : o1 - o0] = data[o0:o1]
            out[f.name] = t
            out[f"{f.name}_lengths"] = torch.from_numpy(lens)
            nbytes += int(lens.sum()) * rb
        with self._mu:
            self._counters["collate_ns"] += time.perf_counter_ns() - t0
            self._counters["records"] += n
            self._counters["bytes"] += nbytes
        return out

    def __next__(self) -> dict[str, torch.Tensor]:
        if os.getpid() != self._pid:
            raise PyloaderError("iterator used in a forked child; create a new iterator after fork")
        if self._closed or self._yielded >= self._nb:
            self._finish()
            raise StopIteration
        while self._submitted < self._nb and self._submitted < self._yielded + self._prefetch:
            self._submit(self._submitted)
            self._submitted += 1
        fut = self._queue.popleft()
        t = time.perf_counter_ns()
        try:
            batch = fut.result(timeout=self.timeout or None)
        except FuturesTimeout:
            self.close()
            raise LoaderTimeoutError.after(self.timeout, "no batch arrived") from None
        except BaseException:
            self.close()
            raise
        self._counters["wait_ns"] += time.perf_counter_ns() - t
        k = self._yielded
        self._yielded += 1
        for g in np.unique(self._g[k * self._bs : (k + 1) * self._bs]).tolist():
            if self._last.get(g) == k:
                self._decoded.pop(g, None)
        return batch

    def close(self) -> None:
        """Cancels pending work and stops the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for f in self._queue:
            f.cancel()
        self._queue.clear()
        self._decoded.clear()
        self._collate_pool.shutdown(wait=False, cancel_futures=True)
        self._decode_pool.shutdown(wait=False, cancel_futures=True)
        with self._mu:
            left = sorted(self._unreleased)
        for g in left:  # (a decode running now releases its own, once)
            self._release(g)
        self._finish()

    def _finish(self) -> None:
        if self._end is None:
            self._end = time.perf_counter()
        if self._yielded >= self._nb and not self._closed:
            self._closed = True
            self._collate_pool.shutdown(wait=False)
            self._decode_pool.shutdown(wait=False)
        cb, self.on_finish = self.on_finish, None
        if cb is not None:
            cb(self.stats())

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # never raise from a finalizer
            self.close()

    def counters(self) -> dict[str, int]:
        """Raw counters (nanoseconds, bytes, records, row groups, batches yielded); ``stats()`` derives from them."""
        with self._mu:
            return dict(self._counters, batches=self._yielded)

    def stats(self) -> dict[str, Any]:
        """Per-stage counters and rates, like ``BatchIterator.stats``.

        Decode and collate time (summed over threads), the consumer's wait, and rates.
        """
        c = self.counters()
        wall = (self._end or time.perf_counter()) - self._start
        waited = c["wait_ns"] / 1e9
        return {
            "batches": c["batches"], "records": c["records"], "row_groups": c["groups"],
            "decoded_bytes": c["bytes"], "threads": self._threads, "decode_s": c["decode_ns"] / 1e9,
            "collate_s": c["collate_ns"] / 1e9, "consumer_wait_s": waited, "wall_s": wall,
            "wait_fraction": waited / wall if wall > 0 else 0.0,
            "decoded_gbps": c["bytes"] / wall / 1e9 if wall > 0 else 0.0,
            "staging_buffers": self._staging.created, "finished": self._end is not None,
            **self._fetch_stats(),
        }

    def _fetch_stats(self) -> dict[str, Any]:
        """A remote dataset's fetcher: its working set, what it holds and held at most, its budget (NOTE [streaming])."""
        f = self._ds._fetcher
        if f is None or self._pending is None:
            return {}
        s = f.stats()
        return {"cache_working_set_bytes": s["working_set_bytes"], "cache_held_bytes": s["held_bytes"],
                "cache_peak_held_bytes": s["peak_held_bytes"], "cache_budget_bytes": s["budget_bytes"],
                "files_downloaded": s["downloaded"], "bytes_fetched": s["bytes_fetched"],
                "files_unloaded": s["unloaded_shards"]}


__all__ = ["ParquetBatchIterator", "ParquetDataset", "ParquetReadError"]
