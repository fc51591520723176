"""Prefetch: downloads a remote dataset's shards into the node cache in plan order.

``open_remote`` binds a remote dataset to the node cache: a pyloader dataset by its
manifest (read and checked), any other (Parquet files) by a listing of its objects.
A reader checks its need against its share of the cache limit once it knows its plan
(NOTE [cache shares] in ``pyloader.remote.budget``).
``ShardFetcher`` runs at most ``jobs`` downloads at once, in the order the plan first
touches each shard, and tells a pending ``_C.ShardSet`` (NOTE [shard readiness] in
csrc/core/shard_reader.h), or a ``PendingFiles`` for a Python reader's files, when each
shard is in place, or why it failed. Shards already
in the cache are marked ready at once, on the scheduling thread, so a warm epoch never
waits on the fetcher. Native workers never call into Python: they wait on the ShardSet.
A fetcher's download threads are ``DownloadThreads`` (``download_threads.py``); what it pins
against its budget and its waits for room in a full cache are ``HeldShards`` and
``RoomWaits`` (``room.py``).
"""

from __future__ import annotations

import atexit
import collections
import errno
import heapq
import multiprocessing
import multiprocessing.util
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

import pyloader._C as _C

from ..errors import CacheError, ManifestNotFoundError
from ..format.spec import MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSION, dump_manifest
from .bad_copies import discard
from .cache import DatasetCache, ShardCache, normalize_url
from .download_threads import DownloadThreads
from .fs import FetchError, RetryPolicy
from .manifest import node_manifest
from .room import HeldShards, RoomWaits
from .temps import remove_temps_at_sigterm

__all__ = ["FETCH_IN_FLIGHT", "FETCH_JOBS_MAX", "FETCH_JOBS_MIN", "ShardFetcher", "auto_fetch_jobs",
           "first_touch_order", "open_remote", "working_set"]

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
    decides the content check's error and retry. The reader then checks its plan's need
    against its share of the cache (``pyloader.remote.budget``).
    """
    policy = RetryPolicy.from_env()
    cache = ShardCache(cache_dir, limit=cache_limit)
    if listing is not None:
        body = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "fields": [], "records": 0, "content_hash": False,
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
            raise ManifestNotFoundError(errno.ENOENT, f"no manifest at {murl!r}: check the URL (a dataset's "
                                        f"folder), or write a dataset there first (pyloader convert SRC {root})") from e
        raise
    # Parsed and checked once, by the DatasetCache (a ManifestError names murl).
    return cache.dataset(root, data, storage_options=storage_options, policy=policy, flavour=flavour)


def working_set(shard_idx: np.ndarray | Sequence[int], sizes: np.ndarray, horizon: int) -> tuple[int, int]:
    """(bytes, shards) a reader of the plan ``shard_idx`` must hold at once, at its worst.

    A shard is held from ``horizon`` samples before the plan first reads it (the batches
    collated ahead of the consumer) until its last read (NOTE [working set] in
    csrc/core/shard_reader.h). ``sizes``: bytes of every shard of the dataset.
    """
    a = np.asarray(shard_idx, dtype=np.int64)
    n = int(a.size)
    if n == 0:
        return 0, 0
    uniq, first = np.unique(a, return_index=True)
    _, rfirst = np.unique(a[::-1], return_index=True)
    last = n - 1 - rfirst
    start = np.maximum(first - max(0, int(horizon)), 0)
    size = np.asarray(sizes, dtype=np.int64)[uniq]
    live_bytes = np.zeros(n + 1, np.int64)
    live_count = np.zeros(n + 1, np.int64)
    np.add.at(live_bytes, start, size)
    np.add.at(live_bytes, last + 1, -size)
    np.add.at(live_count, start, 1)
    np.add.at(live_count, last + 1, -1)
    bytes_at = np.cumsum(live_bytes[:-1])
    k = int(np.argmax(bytes_at))
    return int(bytes_at[k]), int(np.cumsum(live_count[:-1])[k])


# NOTE [fetch jobs]: ``fetch_jobs="auto"`` (the default) runs enough downloads at once to
# keep ``FETCH_IN_FLIGHT`` bytes on their way: a request's latency (10-50 ms to an object
# store) is paid per shard, so small shards need many at once to fill a link (at 10 ms per
# request, 4 downloads of 256 KiB shards carry at most ~85 MB/s however fast the link).
# From the median shard size: ceil(FETCH_IN_FLIGHT / median), at least FETCH_JOBS_MIN and at
# most FETCH_JOBS_MAX. The host's AIMD window (NOTE [fetch throttling]) still bounds what
# is in flight when the server pushes back, and a loader's autotune moves the count from
# there (NOTE [autotune] in pyloader/loader/autotune.py). The open-file limit caps it
# too: each download holds up to 4 descriptors (socket, temp file, lock files), so auto
# takes no more jobs than the descriptors left under ``ulimit -n`` allow, after what the
# process has open and a reserve (at least one job).
FETCH_IN_FLIGHT = 16 << 20
FETCH_JOBS_MIN = 4
FETCH_JOBS_MAX = 32


def auto_fetch_jobs(sizes: Sequence[int] | np.ndarray) -> int:
    """The downloads at once for shards of ``sizes`` bytes (NOTE [fetch jobs]), within the open-file limit."""
    if len(sizes) == 0:
        jobs = FETCH_JOBS_MIN
    else:
        median = max(1, int(np.median(np.asarray(sizes, dtype=np.int64))))
        jobs = max(FETCH_JOBS_MIN, min(FETCH_JOBS_MAX, -(-FETCH_IN_FLIGHT // median)))
    return max(1, min(jobs, _jobs_the_fd_limit_allows()))


# What a process keeps open besides its downloads, beyond what it has open now: a reader's
# pin and manifest files, the native set's shard files while they are mapped and checked,
# torch's and the program's own (NOTE [fetch jobs]).
_FD_RESERVE = 32


def _jobs_the_fd_limit_allows() -> int:
    """Downloads this process can run at once under ``ulimit -n``: the descriptors left, 4 each."""
    limit = _nofile_limit()
    if limit <= 0 or limit >= 1 << 20:
        return FETCH_JOBS_MAX
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 16
    return (limit - open_now - _FD_RESERVE) // _fds_per_job()


def first_touch_order(shard_idx: Iterable[int] | np.ndarray) -> list[int]:
    """Distinct shard indices in the order a plan first reads them."""
    a = np.asarray(shard_idx)
    if a.size == 0:
        return []
    uniq, first = np.unique(a, return_index=True)
    return [int(x) for x in uniq[np.argsort(first, kind="stable")]]


def _exit_is_abrupt() -> bool:
    """Whether this process ends in a way that leaves no time to finish downloads.

    A multiprocessing child (a torch DataLoader worker) is ended by its parent soon after
    the parent stops (``terminate()``, at the latest when the parent exits), and a Ctrl-C
    (an uncaught KeyboardInterrupt, which ``sys.last_value`` holds at exit) asks for a
    prompt stop.
    """
    if multiprocessing.parent_process() is not None:
        return True
    last = getattr(sys, "last_value", None)
    return isinstance(last, KeyboardInterrupt)


def _close_at_exit(ref: weakref.ref[ShardFetcher], finish_s: float = 5.0, cancel_s: float = 2.0) -> None:
    """Cancels ``ref``'s downloads before this process ends.

    NOTE [downloads at exit]: at interpreter exit (``atexit``) or a multiprocessing
    child's end (``multiprocessing.util.Finalize``: such a child leaves by ``os._exit``,
    which skips ``atexit``), the download threads -- daemons, which the exit would stop
    mid-file -- are cancelled before the process goes, so each removes its temp file.
    After a normal end the running downloads may first finish and publish (their bytes
    are not wasted) while bytes keep arriving, up to ``finish_s``; where the end is abrupt
    (``_exit_is_abrupt``: a worker whose parent will terminate it, a Ctrl-C) they are
    cancelled at once. A cancel is seen within about 50 ms.
    """
    fetcher = ref()
    if fetcher is None or os.getpid() != fetcher._pid:
        return
    fetcher._drop_queue()
    if not _exit_is_abrupt():
        deadline = time.monotonic() + finish_s
        seen = fetcher.bytes
        while time.monotonic() < deadline and not fetcher.wait(timeout=0.25):
            if fetcher.bytes == seen:
                break  # a stalled download is cancelled at once
            seen = fetcher.bytes
    fetcher.close()
    fetcher.wait(timeout=cancel_s)


def _nofile_limit() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _fds_per_job() -> int:
    """File descriptors one download holds at most: its socket, temp file and lock files."""
    return 4


def _failure_message(dcache: DatasetCache, i: int, e: BaseException, jobs: int, heal: str | None) -> str:
    """What the readers waiting on shard ``i`` are told when its fetch failed with ``e``.

    ``jobs``: the fetcher's download threads; ``heal``: why its cached copy was being
    fetched again, if it was (NOTE [self-healing]).
    """
    msg = str(e)
    url = dcache.shard_url(i)
    if url not in msg:
        msg = f"{url}: shard {dcache.shards[i]['path']!r}: {msg}"
    if isinstance(e, OSError) and e.errno == errno.EMFILE:
        msg += (f" (this process reached its open-file limit, `ulimit -n` = {_nofile_limit()}; a reader "
                f"needs about {_fds_per_job() * jobs} for its {jobs} fetch jobs, plus what "
                "the rest of the program keeps open)")
    if heal is not None:
        msg = f"{msg} (fetching it again after its cached copy failed: {heal})"
    return msg


# Shards a schedule() call pins on the calling thread when already cached (the rest go
# through the download threads, so scheduling a 100k-shard plan returns at once).
_SYNC_READY = 256
# Every live fetcher of this process: one short of room asks the others to drop the
# released shards they still hold (NOTE [streaming]).
_FETCHERS: weakref.WeakSet[ShardFetcher] = weakref.WeakSet()


class ShardFetcher:
    """Fetches shards of ``dcache`` in scheduled order on up to ``jobs`` threads.

    With ``shards`` (a pending ``_C.ShardSet``) each shard is pinned (NOTE [cache pins])
    and reported with ``mark_ready``/``mark_failed``. Without it (``pyloader cache warm``)
    shards are only published.

    NOTE [streaming]: a reader holds (pins, and the native set maps) only its working
    set. ``budget`` bounds the bytes this fetcher pins at once and ``max_open`` their
    count: it fetches ahead in plan order while the next shard fits; the native set
    reports each shard whose last planned batch was collated (*released*) to the pilot
    thread, which queues it for unloading, least recently released first, whenever the
    next shard does not fit (``_C.ShardSet.unload`` unmaps it, then its pin is dropped
    and it becomes evictable). A shard a native worker waits on is fetched next even
    past the budget (``strict``: only when nothing else is held, NOTE [tight cache] in
    pyloader/read/parquet.py), so a misjudged plan slows down, never deadlocks. It heals
    (fetches again once) a copy that failed its checksum (NOTE [self-healing] in
    csrc/core/shard_reader.h); without ``budget``/``max_open`` all stays pinned to ``close()``.
    """

    def __init__(self, dcache: DatasetCache, shards: Any = None, *, jobs: int = 4,
                 on_done: Callable[[int, int, BaseException | None], None] | None = None,
                 budget: int | None = None, max_open: int | None = None) -> None:
        if not isinstance(jobs, int) or jobs < 1:
            raise ValueError("jobs must be a positive int")
        self.dcache = dcache
        self.pins = dcache.new_pins()  # this fetcher's own pins: closing it drops only these (NOTE [cache pins])
        self.shards = shards
        self.on_done = on_done
        self.budget = budget
        self.max_open = max_open
        n = len(dcache.shards)
        self._sizes = [int(s["bytes"]) for s in dcache.shards]
        self._state = [_IDLE] * n
        self._errors: dict[int, BaseException] = {}
        # Queued shards by rank: a heap of (rank, shard), stale entries skipped (NOTE [streaming]).
        # A schedule ranks its order before everything queued earlier.
        self._heap: list[tuple[int, int]] = []
        self._rank: dict[int, int] = {}
        self._min_rank = 0
        self._nqueued = 0
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._threads = DownloadThreads(self._cv, self._stop, jobs, self._next_job_locked, lambda: self._nqueued,
                                        self._run_one)
        self.downloaded = 0  # shards this fetcher downloaded (not found in the cache)
        self.bytes = 0  # bytes received so far
        # NOTE [streaming] bookkeeping, under _cv.
        self._held = HeldShards(self._sizes)  # the shards this fetcher pins (running, ready or idle)
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # released, LRU first
        self._urgent: set[int] = set()  # shards native workers wait on
        self._progress: dict[int, int] = {}  # bytes received by each running download
        self._heal: dict[int, str] = {}  # shard -> why its cached copy is fetched again
        self._room = RoomWaits()  # shards waiting for room in a full cache
        self.working_set_bytes, self.strict = 0, False  # what the plan needs at once; NOTE [streaming]
        self.heals = 0  # cached copies discarded and fetched again
        self.unloads = 0  # released shards unmapped and unpinned to make room
        self._pilot: threading.Thread | None = None
        self._pid = os.getpid()
        _FETCHERS.add(self)
        # See NOTE [downloads at exit].
        ref = weakref.ref(self)
        atexit.register(_close_at_exit, ref)
        if multiprocessing.parent_process() is not None:
            multiprocessing.util.Finalize(None, _close_at_exit, args=(ref,), exitpriority=100)
            remove_temps_at_sigterm()

    @property
    def jobs(self) -> int:
        """Downloads run at once at most (``set_jobs`` changes it)."""
        return self._threads.jobs

    @property
    def streaming(self) -> bool:
        """Whether this fetcher follows a native set's releases (NOTE [streaming])."""
        return self.shards is not None and hasattr(self.shards, "wait_events")

    # -- control -------------------------------------------------------------------------
    def schedule(self, order: Iterable[int]) -> None:
        """Fetches ``order``'s shards next, first to last (earlier schedules follow)."""
        order = list(order)
        with self._cv:  # every shard of the order gets its rank: its next use, for _make_room_locked
            base = self._min_rank - len(order)
            self._min_rank = base
            for k, i in enumerate(order):
                self._rank[i] = base + k
        if self.streaming:  # a shard that failed for an earlier iterator is tried again for this one
            with self._cv:
                for i in order:
                    if self._state[i] == _FAILED and self.shards.retry(i):
                        self._state[i] = _IDLE
                        self._errors.pop(i, None)
        order = [i for i in order if self._state[i] in (_IDLE, _QUEUED)]
        if not order:
            return
        if self.shards is not None:
            # Cached shards at the head: pin and report now, no thread, no wait.
            for i in order[:_SYNC_READY]:
                with self._cv:
                    if self._state[i] not in (_IDLE, _QUEUED) or not self._fits_locked(i):
                        break
                if not self.dcache.is_published(i):
                    break
                with self._cv:
                    if self._take_locked(i) is None:
                        break
                self._run_one(i)
        with self._cv:
            for i in order:
                if self._state[i] in (_IDLE, _QUEUED):
                    self._enqueue_locked(i)
            self._threads.spawn_locked()
            if self.streaming and self._pilot is None:
                self._pilot = threading.Thread(target=self._pilot_loop, name="pyloader-fetch-pilot", daemon=True)
                self._pilot.start()

    def set_jobs(self, jobs: int) -> None:
        """Runs at most ``jobs`` downloads at once from now on (NOTE [autotune] in ``pyloader.loader.autotune``).

        More start at once when shards are queued; fewer take effect as running downloads
        finish (none is cut short).
        """
        if not isinstance(jobs, int) or jobs < 1:
            raise ValueError("jobs must be a positive int")
        with self._cv:
            self._threads.jobs = jobs
            self._threads.spawn_locked()
            self._cv.notify_all()

    @property
    def pending(self) -> int:
        """Downloads queued or running: more jobs than this cannot run at once."""
        return self._nqueued + len(self._progress)

    @property
    def job_bytes(self) -> int:
        """Memory one running download holds: its read buffer (what an auto-tuned loader counts per job)."""
        return self.dcache.transport().buffer_bytes(max(self._sizes, default=0))

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or running. True if done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._nqueued or self._threads.count:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(0.1 if left is None else min(left, 0.1))
        return True

    def close(self) -> None:
        """Cancels queued and running downloads (their temps are removed) and drops pins.

        Does not wait: a running download sees the cancel within about 50 ms (NOTE
        [download cancel] in ``pyloader.remote.fs``). Readers still waiting on a cancelled
        shard get an error.
        """
        if os.getpid() != self._pid:
            return
        self._stop.set()
        self._drop_queue()
        if self.shards is not None:
            self.pins.release_all()
        with self._cv:
            self._cv.notify_all()

    def _drop_queue(self) -> None:
        """Forgets the queued (not yet running) downloads; their readers get an error."""
        with self._cv:
            dropped = sorted({i for _, i in self._heap if self._state[i] == _QUEUED})
            self._heap.clear()
            self._nqueued = 0
            for i in dropped:
                self._state[i] = _FAILED
            self._cv.notify_all()
        for i in dropped:
            if self.shards is not None:
                self.shards.mark_failed(i, f"{self.dcache.shard_url(i)}: the fetcher was closed")

    @property
    def errors(self) -> dict[int, BaseException]:
        """The error of each shard whose fetch failed, by shard index (a copy)."""
        return dict(self._errors)

    def stats(self) -> dict[str, Any]:
        """What this fetcher holds and did: pinned bytes now and at peak, heals, unloads."""
        with self._cv:
            return {"held_shards": len(self._held), "held_bytes": self._held.bytes,
                    "working_set_bytes": self.working_set_bytes,
                    "peak_held_bytes": self._held.peak_bytes, "budget_bytes": self.budget,
                    "downloaded": self.downloaded, "bytes_fetched": self.bytes,
                    "healed_shards": self.heals, "unloaded_shards": self.unloads}

    def describe_waiting(self) -> str:
        """What the native readers wait on now: each shard, its URL and the bytes arrived ('' if none)."""
        if not self.streaming:
            return ""
        waiting = self.shards.waiting()
        parts = []
        with self._cv:
            for i in waiting[:4]:
                what = {_QUEUED: "queued", _RUNNING: "downloading", _DONE: "ready", _FAILED: "failed"}.get(
                    self._state[i], "not scheduled")
                got = self._progress.get(i)
                arrived = f", {got} of {self._sizes[i]} bytes arrived" if got is not None else ""
                parts.append(f"shard {self.dcache.shards[i]['path']!r} ({self.dcache.shard_url(i)}): {what}{arrived}")
        more = f" and {len(waiting) - 4} more" if len(waiting) > 4 else ""
        return "; ".join(parts) + more

    # -- NOTE [streaming] ----------------------------------------------------------------
    def _fits_locked(self, i: int) -> bool:
        return self._held.fits(i, self.budget, self.max_open)

    def _make_room_locked(self, i: int) -> bool:
        """Unloads shards until shard ``i`` fits; True if it does.

        Released shards go first, least recently released first; then shards planned
        batches need after ``i``, furthest first (they are queued again).
        """
        self._unload_idle_locked(lambda: self._fits_locked(i))
        if self._fits_locked(i):
            return True
        mine = self._rank.get(i, 0)
        later = sorted((j for j in self._held if self._state[j] == _DONE and self._rank.get(j, 0) > mine),
                       key=lambda j: self._rank.get(j, 0), reverse=True)
        for j in later:
            if self._fits_locked(i):
                break
            if not self.shards.unload(j, True):
                continue  # a worker reads it now
            self.pins.release(j)
            self._held.drop(j)
            self._state[j] = _IDLE
            self._idle.pop(j, None)
            self._enqueue_locked(j)
            self.unloads += 1
        return self._fits_locked(i)

    def _unload_idle_locked(self, enough: Callable[[], bool]) -> None:
        while self._idle and not enough():
            j, _ = self._idle.popitem(last=False)
            if self._state[j] != _DONE or j not in self._held:
                continue
            if not self.shards.unload(j):
                continue  # a batch needs it again: no longer idle
            self.pins.release(j)
            self._held.drop(j)
            self._state[j] = _IDLE
            self.unloads += 1

    def _take_locked(self, i: int) -> int | None:
        """Marks shard ``i`` running and counts it held, if it fits (or is waited on); else None."""
        if i not in self._held:
            if not self._fits_locked(i) and not (self.streaming and self._make_room_locked(i)):
                if i not in self._urgent or (self.strict and self._held):
                    return None
            self._held.add(i)
        self._state[i] = _RUNNING
        return i

    def _enqueue_locked(self, i: int, rank: int | None = None) -> None:
        """Queues shard ``i`` at ``rank`` (default: its scheduled rank)."""
        if rank is None:
            rank = self._rank.get(i, 0)
        else:
            self._rank[i] = rank
        if self._state[i] != _QUEUED:
            self._state[i] = _QUEUED
            self._nqueued += 1
        heapq.heappush(self._heap, (rank, i))

    def _enqueue_first_locked(self, i: int) -> None:
        self._min_rank -= 1
        self._enqueue_locked(i, self._min_rank)

    def _next_job_locked(self) -> int | None:
        heap = self._heap
        while heap and (self._state[heap[0][1]] != _QUEUED or self._rank.get(heap[0][1]) != heap[0][0]):
            heapq.heappop(heap)  # stale: started, or queued again at another rank
        if not heap:
            return None
        i = heap[0][1]
        for j in self._urgent:
            if self._state[j] == _QUEUED:
                i = j
                break
        if self.shards is not None and self._take_locked(i) is None:
            return None
        if self.shards is None:
            self._state[i] = _RUNNING
        self._nqueued -= 1  # its heap entry is stale now
        return i

    def _pilot_loop(self) -> None:
        shards = self.shards
        while not self._stop.is_set():
            try:
                released, waiting, corrupt = shards.wait_events(0.2)
            except Exception:  # noqa: BLE001 - a set used after fork: nothing to follow
                return
            if not (released or waiting or corrupt or self._urgent):
                continue
            with self._cv:
                for i in released:
                    if self._state[i] == _DONE and i in self._held:
                        self._idle[i] = None
                        self._idle.move_to_end(i)
                self._urgent = set(waiting)
                front = []
                for i in waiting:  # unloaded, then needed again before it was rescheduled
                    if self._state[i] == _IDLE:
                        front.append(i)
                for i, reason in corrupt:
                    self._heal[i] = reason
                    self._idle.pop(i, None)
                    if self._state[i] != _RUNNING:
                        front.append(i)
                for i in reversed(front):
                    self._enqueue_first_locked(i)
                self._threads.spawn_locked()
                self._cv.notify_all()

    # -- work --------------------------------------------------------------------------
    def _add_bytes(self, i: int, n: int) -> None:
        self.bytes += n  # one int add under the GIL: a good-enough counter for progress
        self._progress[i] = self._progress.get(i, 0) + n

    def _run_one(self, i: int) -> None:
        err: BaseException | None = None
        heal = self._heal.pop(i, None)
        self._progress[i] = 0

        def on_bytes(n: int) -> None:
            self._add_bytes(i, n)
        try:
            if self.shards is not None:
                if heal is not None:  # See NOTE [self-healing]: drop the bad copy, then fetch it again
                    discard(self.dcache, i, reason=heal)
                    self.heals += 1
                path, fetched = self.dcache.acquire(i, cancel=self._stop, on_bytes=on_bytes, pins=self.pins)
            else:
                path, fetched = self.dcache.ensure(i, cancel=self._stop, on_bytes=on_bytes)
            if fetched:
                self.downloaded += 1
            with self._cv:
                self._state[i] = _DONE
            self._room.done(i)
            if self.shards is not None:
                self.shards.mark_ready(i, path)
                if self._stop.is_set():
                    self.pins.release(i)  # closed meanwhile: hold nothing
        except BaseException as e:
            if self._room_wait(i, e):
                return
            err = e
            with self._cv:
                self._state[i] = _FAILED
                self._held.drop(i)
            self._errors[i] = e
            if self.shards is not None:
                err_no = e.errno if isinstance(e, OSError) and isinstance(e.errno, int) else 0
                self.shards.mark_failed(i, _failure_message(self.dcache, i, e, self.jobs, heal), errno=err_no)
            if not isinstance(e, Exception):
                raise
        finally:
            self._progress.pop(i, None)
            if self.on_done is not None and (err is not None or self._state[i] == _DONE):
                self.on_done(i, self._sizes[i], err)

    def shed_idle(self) -> int:
        """Unloads and unpins every released shard this fetcher still holds. Returns how many."""
        if not self.streaming or os.getpid() != self._pid:
            return 0
        with self._cv:
            before = self.unloads
            self._unload_idle_locked(lambda: False)
            return self.unloads - before

    def _room_wait(self, i: int, e: BaseException) -> bool:
        """A full cache is waited out for a while (other readers release): requeues ``i``; True if so.

        Released shards held by this process's other fetchers are dropped first. A wait
        that lasts is reported, and one past the fetch deadline fails (``RoomWaits``).
        """
        if not (isinstance(e, CacheError) and e.errno == errno.ENOSPC) or self._stop.is_set():
            return False
        if not self._room.wait(i, e, deadline=self.dcache.policy.deadline, cache_dir=self.dcache.cache.base,
                               url=self.dcache.url):
            return False
        shed = self.shed_idle()
        for other in list(_FETCHERS):
            if other is not self and other.dcache.cache.root == self.dcache.cache.root:
                shed += other.shed_idle()
        with self._cv:
            self._held.drop(i)
            self._state[i] = _IDLE
            self._enqueue_locked(i)
        if not shed:
            self._stop.wait(0.2)
        return True
