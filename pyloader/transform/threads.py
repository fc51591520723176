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
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

from ..errors import LoaderStateError, LoaderTimeoutError
from .stage import BatchWork, TransformSpec, _Stopped, run_batch


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class TransformStats:
    """Counters of the transform stage, shared by both executors (``stats()`` keys ``transform_*``)."""

    def __init__(self, executor: str, workers: int) -> None:
        self.executor, self.workers = executor, workers
        self.samples = self.skipped = self.batches = 0
        self.transform_ns = self.decode_ns = self.busy_ns = self.wait_ns = 0
        self.start = time.perf_counter()
        self.end: float | None = None
        self._lock = threading.Lock()

    def add(self, work: BatchWork, busy_ns: int) -> None:
        """Counts one batch a worker made in ``busy_ns``."""
        with self._lock:
            self.batches += 1
            self.samples += work.samples
            self.skipped += work.skipped
            self.transform_ns += work.transform_ns
            self.decode_ns += work.decode_ns
            self.busy_ns += busy_ns

    def as_dict(self) -> dict[str, Any]:
        """The counters and what they imply (``transform_hint``: whether more workers would help)."""
        wall = (self.end or time.perf_counter()) - self.start
        n = max(1, self.samples + self.skipped)
        busy = self.busy_ns / 1e9 / (wall * self.workers) if wall > 0 else 0.0
        waited = self.wait_ns / 1e9
        wait_fraction = waited / wall if wall > 0 else 0.0
        per_sample_us = (self.transform_ns + self.decode_ns) / n / 1e3
        if wait_fraction < 0.05:
            hint = "enough: the consumer rarely waits for transformed batches"
        elif busy > 0.85:
            hint = (f"more workers would help: the consumer waits {wait_fraction:.0%} of the time and the "
                    f"{self.workers} transform worker(s) are busy {busy:.0%} of it (if cores are free; "
                    "a transform that holds the GIL scales on executor='processes')")
        else:
            hint = (f"the consumer waits {wait_fraction:.0%} of the time but the transform workers are busy only "
                    f"{busy:.0%}: reading, not the transform, limits (see shard_wait_s)")
        return {
            "transform_executor": self.executor,
            "transform_workers": self.workers,
            "transform_batches": self.batches,
            "transformed_samples": self.samples,
            "skipped_samples": self.skipped,
            "transform_s": self.transform_ns / 1e9,
            "decode_s": self.decode_ns / 1e9,
            "transform_per_sample_us": per_sample_us,
            "transform_busy_fraction": busy,
            "transform_hint": hint,
            "consumer_wait_s": waited,
            "wait_fraction": wait_fraction,
        }


class ThreadTransformStream:
    """Batches of transformed samples, made by ``workers`` threads in plan order (NOTE [thread executor]).

    ``source``: the native ``BatchStream`` of ``plan`` in batches of ``batch_size``;
    ``plan``: (units, records) and ``gidx`` (global record indices) of every planned row.
    Implements the ``BatchStream`` protocol (``timeout``, ``on_finish``, ``close``,
    ``stats``, ``len``).
    """

    def __init__(self, source: Any, ds: Any, spec: TransformSpec, units: np.ndarray, records: np.ndarray,
                 gidx: np.ndarray, batch_size: int, *, workers: int, depth: int) -> None:
        self._src = source
        self._ds = ds
        self._spec = spec
        self._units, self._records, self._gidx = units, records, gidx
        self._bs = batch_size
        self._len = len(source)
        self._depth = max(depth, workers)
        self._cv = threading.Condition()
        self._pull = threading.Lock()
        self._results: dict[int, Any] = {}
        self._pulled = 0  # tickets handed out
        self._delivered = 0  # tickets the consumer took
        self._src_done = False
        self._stop = False
        self._closed = False
        self.timeout = 0.0
        self.on_finish: Any = None
        self.consumed: Any = None  # the loader's ConsumedCount, if any
        self._stats = TransformStats("threads", workers)
        self._torch_threads = torch.get_num_threads()
        self._threads = [threading.Thread(target=self._work, args=(w,), name=f"pyloader-transform-{w}", daemon=True)
                         for w in range(workers)]
        for t in self._threads:
            t.start()

    def __iter__(self) -> ThreadTransformStream:
        return self

    def __len__(self) -> int:
        return self._len

    # -- workers ---------------------------------------------------------------------
    def _work(self, w: int) -> None:
        torch.set_num_threads(1)
        while True:
            with self._pull:
                with self._cv:
                    while not self._stop and not self._src_done and self._pulled >= self._delivered + self._depth:
                        self._cv.wait()
                    if self._stop or self._src_done:
                        return
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
                    self._pulled += 1
            t0 = time.perf_counter_ns()
            lo = k * self._bs
            hi = lo + len(self._units[lo:lo + self._bs])
            result: Any
            try:
                work = run_batch(self._spec, self._ds, raw, self._units[lo:hi], self._records[lo:hi],
                                 self._gidx[lo:hi], w, self._stopping)
                del raw  # the native slot goes back to its pool
                self._stats.add(work, time.perf_counter_ns() - t0)
                result = work.result
            except _Stopped:
                return
            except BaseException as e:  # noqa: BLE001 - delivered in its place, with its traceback
                result = _Failed(e)
            with self._cv:
                self._results[k] = result
                self._cv.notify_all()

    def _stopping(self) -> bool:
        return self._stop

    # -- consumer --------------------------------------------------------------------
    def __next__(self) -> Any:
        while True:
            item = self._take()
            if isinstance(item, _Failed):
                raise item.error
            if item is not None:
                return item
            if self.consumed is not None:  # a batch whose samples were all skipped still counts as read
                self.consumed.batches += 1
            # None: every sample of that batch was skipped (ImageDecode(on_error="skip")).

    def _take(self) -> Any:
        if self._closed:
            raise LoaderStateError("iterator is closed")
        t0 = time.perf_counter_ns()
        deadline = None if not self.timeout else time.monotonic() + self.timeout
        ended = False
        with self._cv:
            k = self._delivered
            while k not in self._results:
                if self._src_done and k >= self._pulled:
                    ended = True
                    break
                if deadline is None:
                    self._cv.wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    self._stats.wait_ns += time.perf_counter_ns() - t0
                    raise LoaderTimeoutError(f"no transformed batch within timeout={self.timeout} s (batch {k}; "
                                             f"{len(self._threads)} transform threads)")
                self._cv.wait(left)
            if not ended:
                item = self._results.pop(k)
                self._delivered += 1
                self._cv.notify_all()
        self._stats.wait_ns += time.perf_counter_ns() - t0
        if ended:
            if self._stats.end is None:
                self._stats.end = time.perf_counter()
            self._finish()
            raise StopIteration
        return item

    def close(self) -> None:
        """Stops the workers (a worker finishes the sample it is on) and the native stream. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._cv:
            self._stop = True
            self._results.clear()
            self._cv.notify_all()
        self._src.close()  # wakes a worker waiting for the next native batch
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join()
        torch.set_num_threads(self._torch_threads)  # the default of threads yet to use torch
        self._finish()

    def _finish(self) -> None:
        cb, self.on_finish = self.on_finish, None
        if cb is not None:
            cb(self.stats())

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    def stats(self) -> dict[str, Any]:
        """The native stream's stats with the transform stage's (``transform_*``, ``skipped_samples``).

        ``consumer_wait_s``/``wait_fraction`` are the consumer's wait for transformed batches.
        """
        s = dict(self._src.stats())
        s["native_wait_s"] = s.get("consumer_wait_s", 0.0)
        s.update(self._stats.as_dict())
        return s
