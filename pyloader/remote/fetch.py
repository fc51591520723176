"""Prefetch: downloads a remote dataset's shards into the node cache in plan order.

``open_remote`` binds a remote dataset to the node cache: a pyloader dataset by its
manifest (read and checked), any other (Parquet files) by a listing of its objects.
``check_limit`` is the cache limit check a reader runs once it knows its plan.
``ShardFetcher`` runs at most ``jobs`` downloads at once, in the order the plan first
touches each shard, and tells a pending ``_C.ShardSet`` (NOTE [shard readiness] in
csrc/core/shard_reader.h) when each shard is in place, or why it failed. Shards already
in the cache are marked ready at once, on the scheduling thread, so a warm epoch never
waits on the fetcher. Native workers never call into Python: they wait on the ShardSet.
"""

from __future__ import annotations

import atexit
import collections
import errno
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from .. import _C
from ..errors import ManifestNotFoundError
from ..format.spec import MANIFEST_FORMAT, MANIFEST_NAME, VERSION, dump_manifest
from .cache import CacheLimitError, DatasetCache, ShardCache, normalize_url
from .fs import FetchError, RetryPolicy
from .manifest import node_manifest

_IDLE, _QUEUED, _RUNNING, _DONE, _FAILED = range(5)


def open_remote(url: str, *, cache_dir: str | os.PathLike[str] | None = None, cache_limit: int | str | None = None,
                storage_options: dict[str, Any] | None = None, listing: Sequence[tuple[str, int, str]] | None = None,
                flavour: type[DatasetCache] = DatasetCache) -> DatasetCache:
    """Binds the remote dataset at ``url`` to the node cache (``cache_dir``, ``cache_limit``).

    Without ``listing``, ``url`` is a pyloader dataset directory (or its manifest): its
    manifest is read and verified. With ``listing`` -- (relative path, size, identity) per
    object under ``url`` -- the cache manifest names each object by its identity instead
    of a checksum of its bytes (``"content_hash": false``; see
    ``DatasetCache.content_problem``). ``flavour`` is the ``DatasetCache`` class, which
    decides the content check's error and retry. The reader then runs ``check_limit`` on
    the objects its plan keeps open.
    """
    policy = RetryPolicy.from_env()
    cache = ShardCache(cache_dir, limit=cache_limit)
    if listing is not None:
        body = {"format": MANIFEST_FORMAT, "version": VERSION, "fields": [], "records": 0, "content_hash": False,
                "shards": [{"path": rel, "records": 0, "bytes": int(size), "xxh64": ident}
                           for rel, size, ident in listing]}
        return cache.dataset(url, dump_manifest(body, _C.xxh64), storage_options=storage_options, policy=policy,
                             flavour=flavour)
    if url.endswith(".json") and not url.endswith("/" + MANIFEST_NAME):
        raise ValueError(f"{url!r}: a remote dataset is named by its directory (or .../{MANIFEST_NAME})")
    root = normalize_url(url)
    murl = root + "/" + MANIFEST_NAME
    try:
        data = node_manifest(root, cache.root, storage_options, policy)  # NOTE [manifest once per node]
    except FetchError as e:
        if e.errno == errno.ENOENT:
            raise ManifestNotFoundError(errno.ENOENT, f"no manifest at {murl!r}") from e
        raise
    # Parsed and checked once, by the DatasetCache (a ManifestError names murl).
    return cache.dataset(root, data, storage_options=storage_options, policy=policy, flavour=flavour)


def check_limit(dcache: DatasetCache, order: Iterable[int]) -> None:
    """Raises CacheLimitError if ``dcache``'s cache limit cannot hold the shards in ``order`` at once.

    A reader's fetcher pins every shard (or file) it fetched until it is closed, and a
    ShardDataset keeps its shards mapped across epochs, so what one reader needs at once
    is every shard its plan touches.
    """
    limit = dcache.cache.limit
    if limit is None:
        return
    idx = sorted({int(i) for i in order})
    need = sum(int(dcache.shards[i]["bytes"]) for i in idx)
    if need > limit:
        raise CacheLimitError(
            f"{dcache.url}: the cache limit of {limit} bytes cannot hold the {len(idx)} shards ({need} bytes) "
            f"this reader keeps open at once (it pins every shard its plan reads); set cache_limit >= {need}, "
            "or None for no limit")


def first_touch_order(shard_idx: Iterable[int] | np.ndarray) -> list[int]:
    """Distinct shard indices in the order a plan first reads them."""
    a = np.asarray(shard_idx)
    if a.size == 0:
        return []
    uniq, first = np.unique(a, return_index=True)
    return [int(x) for x in uniq[np.argsort(first, kind="stable")]]


def _close_at_exit(ref: weakref.ref[ShardFetcher], finish_s: float = 5.0, cancel_s: float = 2.0) -> None:
    fetcher = ref()
    if fetcher is None or os.getpid() != fetcher._pid:
        return
    # No new downloads; the running ones may finish and publish (their bytes are not
    # wasted), else they are cancelled and remove their temps.
    fetcher._drop_queue()
    fetcher.wait(timeout=finish_s)
    fetcher.close()
    fetcher.wait(timeout=cancel_s)


class ShardFetcher:
    """Fetches shards of ``dcache`` in scheduled order on up to ``jobs`` threads.

    With ``shards`` (a pending ``_C.ShardSet``) each shard is pinned (NOTE [cache pins])
    and reported with ``mark_ready``/``mark_failed``; pins last until ``close()``.
    Without it (``pyloader cache warm``) shards are only published.
    """

    def __init__(self, dcache: DatasetCache, shards: Any = None, *, jobs: int = 4,
                 on_done: Callable[[int, int, BaseException | None], None] | None = None) -> None:
        if not isinstance(jobs, int) or jobs < 1:
            raise ValueError("jobs must be a positive int")
        self.dcache = dcache
        self.shards = shards
        self.jobs = jobs
        self.on_done = on_done
        n = len(dcache.shards)
        self._state = [_IDLE] * n
        self._errors: dict[int, BaseException] = {}
        self._queue: collections.deque[int] = collections.deque()
        self._cv = threading.Condition()
        self._threads = 0
        self._stop = threading.Event()
        self.downloaded = 0  # shards this fetcher downloaded (not found in the cache)
        self.bytes = 0  # bytes received so far
        self._pid = os.getpid()
        # At interpreter exit the download threads (daemons) would be stopped mid-file,
        # leaving their temp files for a later process to clean: cancel them first.
        ref = weakref.ref(self)
        atexit.register(_close_at_exit, ref)

    # -- control -------------------------------------------------------------------------
    def schedule(self, order: Iterable[int]) -> None:
        """Fetches ``order``'s shards next, first to last (earlier schedules follow)."""
        order = [i for i in order if self._state[i] in (_IDLE, _QUEUED)]
        if not order:
            return
        for i in order:
            if self.shards is not None and self._state[i] == _IDLE and self.dcache.is_published(i):
                self._run_one(i)  # cached: pin and report now, no thread, no wait
        with self._cv:
            head = [i for i in order if self._state[i] in (_IDLE, _QUEUED)]
            hs = set(head)
            self._queue = collections.deque(head + [i for i in self._queue if i not in hs])
            for i in head:
                self._state[i] = _QUEUED
            want = min(self.jobs, len(self._queue)) - self._threads
            for _ in range(max(0, want)):
                self._threads += 1
                threading.Thread(target=self._worker, name="pyloader-fetch", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or running. True if done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue or self._threads:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(0.1 if left is None else min(left, 0.1))
        return True

    def close(self) -> None:
        """Cancels queued and running downloads (their temps are removed) and drops pins.

        Does not wait: a running download sees the cancel between chunks, or within the
        stall timeout. Readers still waiting on a cancelled shard get an error.
        """
        if os.getpid() != self._pid:
            return
        self._stop.set()
        self._drop_queue()
        if self.shards is not None:
            self.dcache.unpin_all()

    def _drop_queue(self) -> None:
        """Forgets the queued (not yet running) downloads; their readers get an error."""
        with self._cv:
            dropped = list(self._queue)
            self._queue.clear()
        for i in dropped:
            self._state[i] = _FAILED
            if self.shards is not None:
                self.shards.mark_failed(i, f"{self.dcache.shard_url(i)}: the fetcher was closed")

    @property
    def errors(self) -> dict[int, BaseException]:
        """The error of each shard whose fetch failed, by shard index (a copy)."""
        return dict(self._errors)

    # -- work --------------------------------------------------------------------------
    def _add_bytes(self, n: int) -> None:
        self.bytes += n  # one int add under the GIL: a good-enough counter for progress

    def _run_one(self, i: int) -> None:
        self._state[i] = _RUNNING
        err: BaseException | None = None
        try:
            if self.shards is not None:
                path, fetched = self.dcache.acquire(i, cancel=self._stop, on_bytes=self._add_bytes)
            else:
                path, fetched = self.dcache.ensure(i, cancel=self._stop, on_bytes=self._add_bytes)
            if fetched:
                self.downloaded += 1
            self._state[i] = _DONE
            if self.shards is not None:
                self.shards.mark_ready(i, path)
                if self._stop.is_set():
                    self.dcache.unpin(i)  # closed meanwhile: hold nothing
        except BaseException as e:
            err = e
            self._state[i] = _FAILED
            self._errors[i] = e
            if self.shards is not None:
                msg = str(e)
                url = self.dcache.shard_url(i)
                if url not in msg:
                    msg = f"{url}: shard {self.dcache.shards[i]['path']!r}: {msg}"
                self.shards.mark_failed(i, msg)
            if not isinstance(e, Exception):
                raise
        finally:
            if self.on_done is not None:
                self.on_done(i, int(self.dcache.shards[i]["bytes"]), err)

    def _worker(self) -> None:
        try:
            while not self._stop.is_set():
                with self._cv:
                    if not self._queue:
                        return
                    i = self._queue.popleft()
                self._run_one(i)
                with self._cv:
                    self._cv.notify_all()
        finally:
            with self._cv:
                self._threads -= 1
                self._cv.notify_all()
