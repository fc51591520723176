"""The thread executor: per-sample transforms on a pool of threads in the loader's process.

NOTE [thread executor]: ``workers`` threads share one native batch stream. A worker takes
the next batch (and its ticket, the batch's position in the plan) under one lock, so
tickets follow the plan; it then decodes, transforms and collates that batch
(``stage.run_batch``) outside every lock, and files the result under its ticket. The
consumer takes tickets in order, so batches arrive in plan order whatever the timing.
Workers run at most ``depth`` tickets ahead of the consumer. The samples a worker sees are
views of the native batch's slot (no copy, no pickling); the work scales with the threads
where it releases the GIL (Pillow's decoders and resampling, numpy and torch ops, and every
call on free-threaded Python). A transform's exception is delivered in its batch's place
and the iteration goes on, as torch's DataLoader does; an error of the native stream ends
it. ``close()`` (or dropping the stream) stops the workers and joins them.

Each worker runs torch ops on one thread (``torch.set_num_threads(1)`` in the worker, as
torch's DataLoader does in its worker processes): intra-op threads of W workers at once
oversubscribe the cores (measured: a resize on two workers ran slower than on one). The
setting is per thread for the calling thread, but torch also keeps it as the default of
threads that start using torch later; ``close()`` puts that default back to the value the
constructing thread had.

NOTE [transform threads at exit]: a script may end with an epoch in progress (``it =
iter(loader); next(it)``, or a loop that stops after N steps with ``zip(range(N), loader)``):
its workers are daemon threads, and at interpreter exit CPython ends a daemon thread that
asks for the GIL back with ``pthread_exit()``. A worker inside a torch op is then unwound
through torch's C++ frames, a noexcept one among them, and the process aborts
("terminate called without an active exception", exit status 134 -- 5 of 6 runs of such a
script). So every stream still open is closed by an ``atexit`` handler, which runs before
the interpreter finalises: its workers stop after the sample they are on and are joined.
Not from ``threading``'s own exit hooks, which run before non-daemon threads are joined:
a non-daemon thread may still be iterating the loader then, as a program's training thread
does when the main thread returns first.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch

from ..contract import BatchStream, PlannedDataset, default_prefetch
from ..errors import LoaderStateError, LoaderTimeoutError
from .stage import TransformSpec, TransformStream, _Stopped, limit_native_threads, run_batch, unlimit_native_threads

# NOTE [fork gate]: a fork copies the memory of every thread of the process but runs only the
# forking one, so a lock another thread held at that instant stays held in the child for
# good. The thread executor runs the user's transform on threads of the loader's process --
# torch ops, a tokenizer, Pillow -- and the process executor forks workers from the same
# process: the "auto" executor's switch to processes (its thread stream's last batches are
# still being made), or a second loader (or torch's own DataLoader) starting its epoch while
# this one runs. A worker forked while a transform thread was inside ``torch.randint`` waited
# forever on a futex of torch's in its first sample (seen in CI, and in 1 of 41 runs of two
# such loaders on a loaded machine); the loop then waited for that worker's batch. So every
# fork of the process (``os.register_at_fork``: pyloader's pools, ``multiprocessing``, a
# user's ``os.fork``) first parks the transform threads between two samples: the hook counts
# the fork and waits until no thread is inside a sample; a thread starting a sample (or
# collating) sees the count and waits until the forks are done. A thread marks itself inside
# before it reads the count and the hook counts before it reads the marks, so one of the two
# always sees the other. The wait is bounded (``FORK_GATE_S``, then the fork goes on as
# before: a transform whose single sample takes longer than that is not waited for), and
# costs a fork of a process without thread streams nothing. A transform thread that forks
# itself (its transform starting a subprocess) is outside while it forks: two such threads
# forking at once do not wait for each other.
FORK_GATE_S = 2.0
_gate_forks = 0  # forks between their before- and after-hooks (a count: threads may fork at once)
_gate_open = threading.Event()  # set but while a fork waits or runs
_gate_open.set()
_gate_inside: set[int] = set()  # idents of the transform threads inside a sample
_gate_mu = threading.Lock()  # guards _gate_forks and _gate_installed
_gate_local = threading.local()  # .forking_inside: this thread forks from inside a sample


def _gate_enter() -> None:
    """Marks the calling transform thread inside a sample; first waits for a fork in progress (NOTE [fork gate])."""
    me = threading.get_ident()
    _gate_inside.add(me)
    while _gate_forks:
        _gate_inside.discard(me)
        _gate_open.wait(2 * FORK_GATE_S)
        _gate_inside.add(me)
        if not _gate_open.is_set():
            break  # never waits for ever (a fork whose after-hooks did not run)


def _gate_leave() -> None:
    _gate_inside.discard(threading.get_ident())


def _gate_before_fork() -> None:
    global _gate_forks
    me = threading.get_ident()
    with _gate_mu:
        _gate_forks += 1
        _gate_open.clear()
    _gate_local.forking_inside = me in _gate_inside
    _gate_inside.discard(me)
    deadline = time.monotonic() + FORK_GATE_S
    pause = 0.0001
    while _gate_inside and time.monotonic() < deadline:
        time.sleep(pause)  # releases the GIL: the threads finish their sample
        pause = min(pause * 2, 0.002)


def _gate_after_fork_in_parent() -> None:
    global _gate_forks
    if getattr(_gate_local, "forking_inside", False):
        _gate_inside.add(threading.get_ident())  # back inside its sample
    with _gate_mu:
        _gate_forks = max(0, _gate_forks - 1)
        if not _gate_forks:
            _gate_open.set()


def _gate_after_fork_in_child() -> None:
    global _gate_forks, _gate_open, _gate_inside, _gate_mu, _gate_local
    _gate_forks = 0  # no transform thread runs in the child
    _gate_open = threading.Event()
    _gate_open.set()
    _gate_inside = set()
    _gate_mu = threading.Lock()
    _gate_local = threading.local()


_gate_installed = False


def _gate_install() -> None:
    """Registers the gate's fork hooks, once, when the first thread stream starts (NOTE [fork gate]).

    Before-fork hooks run in the reverse order of their registration, and some hold a lock
    from the fork's start to its end (``logging``'s, pyloader's lock-file registry's): a
    transform thread forking at the same time waits on that lock in its hooks, before the
    gate's hook could mark it outside, and the first fork would wait the whole bound for it.
    Registered this late, the gate's hook runs before those of every module imported so far.
    """
    global _gate_installed
    with _gate_mu:
        if _gate_installed:
            return
        _gate_installed = True
    os.register_at_fork(before=_gate_before_fork, after_in_parent=_gate_after_fork_in_parent,
                        after_in_child=_gate_after_fork_in_child)


# Streams whose workers may be running (NOTE [transform threads at exit]).
_LIVE: weakref.WeakSet[ThreadTransformStream] = weakref.WeakSet()


def _close_live() -> None:
    for stream in list(_LIVE):
        try:
            stream.close()
        except Exception:  # noqa: BLE001 - the process is exiting; the next stream still needs closing
            pass


atexit.register(_close_live)


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class ThreadTransformStream(TransformStream):
    """Batches of transformed samples, made by ``workers`` threads in plan order (NOTE [thread executor]).

    ``source``: the native ``BatchStream`` of ``plan`` in batches of ``batch_size``;
    ``plan``: (units, records) and ``gidx`` (global record indices) of every planned row.
    Implements the ``BatchStream`` protocol (``timeout``, ``on_finish``, ``close``,
    ``stats``, ``len``).
    """

    def __init__(self, source: BatchStream, ds: PlannedDataset, spec: TransformSpec, units: np.ndarray, records: np.ndarray,
                 gidx: np.ndarray, batch_size: int, *, workers: int, depth: int | None,
                 active: int | None = None) -> None:
        super().__init__("threads", workers, len(source))
        self._src = source
        self._ds = ds
        self._spec = spec
        self._units, self._records, self._gidx = units, records, gidx
        self._bs = batch_size
        self._depth_given = depth  # None: two tickets per active worker (default_prefetch)
        # Workers that may pull tickets (set_workers); ``active`` fewer at first (the scaling
        # probe's first phase: NOTE [executor choice]).
        self._active = workers if active is None else max(1, min(active, workers))
        self.planned = workers  # the workers it was made for (the probe puts them back when done)
        self._limit: int | None = None  # no ticket from here on (limit)
        self.tuner: Any = None  # called with the stream at every batch taken (num_workers="auto")
        self._cv = threading.Condition()
        self._pull = threading.Lock()
        self._results: dict[int, Any] = {}
        self._pulled = 0  # tickets handed out
        self._delivered = 0  # tickets the consumer took
        self._src_done = False
        self._stop = False
        self._closed = False
        self._torch_threads = torch.get_num_threads()
        limit_native_threads(process=False)  # See NOTE [worker threads]; given back at close()
        self._limited = True
        self._threads: list[threading.Thread] = []
        # Per worker: the samples it transformed, and whether it is inside a batch (progress()).
        self._done: list[int] = []
        self._in_batch: list[bool] = []
        _gate_install()
        _LIVE.add(self)
        try:
            self._start(self._active)
        except BaseException:
            # No thread for a worker (a limit on threads): stop and join those that started,
            # close the native stream, and raise the error.
            self.close()
            raise

    def _start(self, workers: int) -> None:
        for w in range(len(self._threads), workers):
            self._done.append(0)
            self._in_batch.append(False)
            t = threading.Thread(target=self._work, args=(w,), name=f"pyloader-transform-{w}", daemon=True)
            self._threads.append(t)
            t.start()

    @property
    def _depth(self) -> int:
        """Tickets the workers may run ahead of the consumer: at least one per active worker."""
        d = self._depth_given if self._depth_given is not None else default_prefetch(self._active)
        return max(d, self._active)

    @property
    def workers(self) -> int:
        """The workers that take batches now."""
        return self._active

    def progress(self) -> tuple[int, int]:
        """(samples transformed so far, workers inside a batch now): the scaling probe's clock."""
        return sum(self._done), sum(self._in_batch)

    def set_workers(self, workers: int) -> None:
        """From now on ``workers`` threads take batches (more are started; extra ones idle)."""
        with self._cv:
            self._active = max(1, workers)
            self._stats.workers = self._active
            if self._stop:
                return
            self._cv.notify_all()
        self._start(self._active)

    def limit(self) -> int:
        """No ticket is handed out from now on; returns how many were (the stream ends after them)."""
        with self._cv:
            self._limit = self._pulled
            self._cv.notify_all()
            return self._limit

    def idle(self) -> bool:
        """Whether every worker thread has exited (after ``limit()``, once the batches handed out are made)."""
        return not any(t.is_alive() for t in self._threads)

    def close_source(self) -> None:
        """Closes the native stream once the workers are idle (no batch is pulled from it again)."""
        if self.idle():
            self._src.close()

    def _no_more(self) -> bool:
        return self._stop or self._src_done or (self._limit is not None and self._pulled >= self._limit)

    # -- workers ---------------------------------------------------------------------
    def _work(self, w: int) -> None:
        torch.set_num_threads(1)
        while True:
            with self._cv:  # an idle worker (set_workers) waits outside the pull lock
                while not self._no_more() and w >= self._active:
                    self._cv.wait()
                if self._no_more():
                    return
            with self._pull:
                with self._cv:
                    while not self._no_more() and w < self._active and self._pulled >= self._delivered + self._depth:
                        self._cv.wait()
                    if self._no_more():
                        return
                    if w >= self._active:
                        continue
                k = self._pulled
                try:
                    raw = next(self._src)
                except StopIteration:
                    with self._cv:
                        self._src_done = True
                        self._cv.notify_all()
                    return
                except BaseException as e:  # noqa: BLE001 - delivered in its place; the stream ends there
                    with self._cv:
                        if not self._stop:
                            self._results[k] = _Failed(e)
                            self._pulled += 1
                        self._src_done = True
                        self._cv.notify_all()
                    return
                with self._cv:
                    if self._limit is not None and k >= self._limit:
                        return  # limit() came while this batch was read: its ticket is not this stream's
                    self._pulled += 1
            t0 = time.perf_counter_ns()
            lo = k * self._bs
            hi = lo + len(self._units[lo:lo + self._bs])
            result: Any
            self._in_batch[w] = True
            try:
                work = run_batch(self._spec, self._ds, raw, self._units[lo:hi], self._records[lo:hi],
                                 self._gidx[lo:hi], w, self._next_sample, progress=self._done)
                del raw  # the native slot goes back to its pool
                self._stats.add(work, time.perf_counter_ns() - t0)
                result = work.result
            except _Stopped:
                return
            except BaseException as e:  # noqa: BLE001 - delivered in its place, with its traceback
                result = _Failed(e)
            finally:
                _gate_leave()
                self._in_batch[w] = False
            with self._cv:
                self._results[k] = result
                self._cv.notify_all()

    def _next_sample(self) -> bool:
        """Called before each sample of a batch (and its collation): whether to stop; else inside the fork gate."""
        if self._stop:
            return True
        _gate_enter()
        return False

    # -- consumer --------------------------------------------------------------------
    def _take(self) -> Any:
        if self._closed:
            raise LoaderStateError("iterator is closed")
        t0 = time.perf_counter_ns()
        deadline = None if not self.timeout else time.monotonic() + self.timeout
        ended = False
        with self._cv:
            k = self._delivered
            while k not in self._results:
                if (self._src_done and k >= self._pulled) or (self._limit is not None and k >= self._limit):
                    ended = True
                    break
                if deadline is None:
                    self._cv.wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    self._stats.wait_ns += time.perf_counter_ns() - t0
                    raise LoaderTimeoutError.after(self.timeout, f"no transformed batch arrived (batch {k}; "
                                                                 f"{len(self._threads)} transform threads)")
                self._cv.wait(left)
            if not ended:
                item = self._results.pop(k)
                self._delivered += 1
                self._cv.notify_all()
        self._stats.wait_ns += time.perf_counter_ns() - t0
        if ended:
            self._end()
        if self.tuner is not None:
            self.tuner.observe(self, item)
        if isinstance(item, _Failed):
            raise item.error
        return item

    def close(self) -> None:
        """Stops the workers (a worker finishes the sample it is on) and the native stream. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if os.getpid() != self._pid:
            # A forked child: the workers are the parent's (no thread of this process runs
            # them), and one of them may have held the condition's lock at the fork.
            return
        with self._cv:
            self._stop = True
            self._results.clear()
            self._cv.notify_all()
        self._src.close()  # wakes a worker waiting for the next native batch
        me = threading.current_thread()
        for t in self._threads:
            if t is not me and t.ident is not None:  # started
                t.join()
        torch.set_num_threads(self._torch_threads)  # the default of threads yet to use torch
        if self._limited:
            self._limited = False
            unlimit_native_threads()
        self._finish()

    def stats(self) -> dict[str, Any]:
        """The native stream's stats with the transform stage's (``transform_*``, ``skipped_samples``).

        ``consumer_wait_s``/``wait_fraction`` are the consumer's wait for transformed batches.
        """
        s = dict(self._src.stats())
        s["native_wait_s"] = s.get("consumer_wait_s", 0.0)
        s.update(self._stats.as_dict(read_wait_s=s["native_wait_s"]))
        return self._with_extra(s)


__all__ = ["FORK_GATE_S", "ThreadTransformStream"]
