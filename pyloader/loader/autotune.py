"""Online tuning of the native path's threads and read-ahead under a memory budget.

NOTE [autotune]: ``DataLoader(num_workers="auto", memory_budget=B)`` starts every epoch's
pipeline with as many threads as this process may run on (the most it will use) and a
ring of ``MAX_PREFETCH`` batch positions, and lets only ``threads`` of those threads
collate, at most ``prefetch`` batches ahead of the training loop. Every ``INTERVAL``
seconds of iteration (checked as batches are handed out, on the loop's thread: no thread
of its own), it reads the pipeline's counters over the interval -- the share of time the
loop waited for a batch (``wait``) and the share of time the active threads were busy
reading, verifying and copying (``busy``) -- and takes at most one step:

* the loop waited (``wait > WAIT_HIGH``) and the threads were busy (``busy > BUSY_HIGH``):
  one more thread, if the CPU has one and the budget allows;
* the loop waited but the threads were not busy (bursts, shard opens, a busy machine):
  twice the read-ahead up to two batches per thread, then one more thread, then (all
  threads running) twice the read-ahead, if the budget allows;
* the loop did not wait and the threads were mostly idle for ``IDLE_STEPS`` intervals in
  a row: one thread fewer (a CPU given back to the training step);
* otherwise nothing: a steady machine keeps steady values.

Remote data adds the downloads (``fetch_jobs``, the fetcher's concurrent downloads,
starting at the dataset's ``fetch_jobs``). When the loop waited and the threads spent more
of the interval waiting for shards to arrive than collating, the downloads bind, and the
only step taken is on them, by trial: twice the downloads, kept if the bytes received per
second over the next whole interval grew by ``FETCH_GAIN``, else back to the count before
(a link that is full, or a store that throttles, gains nothing from more requests). A
count that did not help is not tried again for ``FETCH_RETRY_S`` seconds, and none is
tried while every shard left to fetch is downloading already. Downloads are
never lowered for being idle: an idle download thread costs nothing.

Memory: every batch in flight holds one slot of the batch's size, so the loader holds at
most ``(prefetch + threads + 2) * slot_bytes`` (the read-ahead, one per thread being
collated, the loop's current and previous batch), plus ``device_prefetch`` staging slots
when batches are copied to a device from pageable memory, plus one read buffer per
download (``fetch_jobs * job_bytes``). ``slot_bytes`` is the largest
batch seen; a step that would exceed the budget is not taken, and values that exceed it
(a larger batch arrived) are lowered, read-ahead first. The values reached carry over to
the next epoch. ``stats()["autotune"]`` has the current values, the budget, the memory
they imply and the last decisions with their reasons.
"""

from __future__ import annotations

import time
from typing import Any

from ..contract import cpu_budget, default_memory_budget, default_prefetch

INTERVAL = 0.2  # seconds between decisions
MIN_BATCHES = 4  # and at least this many batches
LONG_INTERVAL = 0.5  # or this long, whatever the batches (a loop waiting on downloads)
WAIT_HIGH = 0.02  # the loop waited more than this share of the interval: starved
BUSY_HIGH = 0.7  # active threads busy more than this: CPU-bound
IDLE_BUSY = 0.3  # threads busy less than this while the loop did not wait: idle
IDLE_STEPS = 3
MAX_PREFETCH = 32  # ring positions (a position costs memory only when used)
MAX_FETCH_JOBS = 64
FETCH_GAIN = 1.1  # more downloads are kept if they received this much more per second
FETCH_RETRY_S = 5.0  # a download count that did not help is tried again after this long
_KEEP_DECISIONS = 32


class AutoTune:
    """The tuned values of one loader and the controller that moves them (NOTE [autotune])."""

    def __init__(self, memory_budget: int | None = None, *, max_threads: int | None = None,
                 threads: int | None = None, prefetch: int | None = None, staging_slots: int = 0) -> None:
        self.max_threads = max_threads or cpu_budget()
        self.memory_budget = default_memory_budget() if memory_budget is None else int(memory_budget)
        self.threads = max(1, min(self.max_threads, threads or self.max_threads))
        self.prefetch = max(1, min(MAX_PREFETCH, prefetch or default_prefetch(self.threads)))
        self.staging_slots = staging_slots
        self.slot_bytes = 0
        self.fetch_jobs: int | None = None  # remote data only: concurrent downloads
        self.job_bytes = 0  # the read buffer of one download
        self._trial: tuple[int, float, float] | None = None  # (jobs before, their rate, when doubled)
        self._fetch_ceiling: tuple[int, float] | None = None  # (jobs that did not help, when)
        self.decisions: list[dict[str, Any]] = []
        self._t0 = time.perf_counter()
        self._idle = 0
        self._stream: Any = None
        # (time, wait_ns, collate_ns, shard_wait_ns, batches, bytes downloaded)
        self._mark: tuple[float, int, int, int, int, int] | None = None
        # The counters of the streams already done: counters are per stream, and an interval
        # may span epochs (the bytes downloaded are the fetcher's, which outlives streams).
        self._done = (0, 0, 0, 0)

    # -- memory -------------------------------------------------------------------------
    def memory_bytes(self, threads: int | None = None, prefetch: int | None = None,
                     fetch_jobs: int | None = None) -> int:
        """What ``threads``, ``prefetch`` and ``fetch_jobs`` hold at most: batch slots of ``slot_bytes``, download buffers."""
        t = self.threads if threads is None else threads
        p = self.prefetch if prefetch is None else prefetch
        j = (self.fetch_jobs or 0) if fetch_jobs is None else fetch_jobs
        return (p + t + 2 + self.staging_slots) * self.slot_bytes + j * self.job_bytes

    def _fits(self, threads: int, prefetch: int, fetch_jobs: int | None = None) -> bool:
        return self.memory_bytes(threads, prefetch, fetch_jobs) <= self.memory_budget

    def expect(self, slot_bytes: int) -> None:
        """Sets a lower bound of the batch size, known before the first batch.

        The fixed-shape fields give it, so that even the first pipeline starts within the budget.
        """
        if slot_bytes > self.slot_bytes:
            self.slot_bytes = slot_bytes
            self._enforce_budget(None)

    # -- the stream of one epoch --------------------------------------------------------
    def attach(self, stream: Any) -> None:
        """Watches ``stream`` (a BatchIterator running with this tuner's values) from now on.

        Intervals run on across epochs: a short epoch still adds up to decisions.
        """
        if self._stream is not None:
            self._done = tuple(a + b for a, b in zip(self._done, self._totals(self._stream)[:4]))  # type: ignore[assignment]
        self._stream = stream
        d = stream.downloads() if hasattr(stream, "downloads") else None
        if d is not None:
            self.job_bytes = d["job_bytes"]
            if self.fetch_jobs is None:
                self.fetch_jobs = d["jobs"]
                self._enforce_budget(stream)
            elif d["jobs"] != self.fetch_jobs:
                stream.tune_downloads(self.fetch_jobs)

    def forget_stream(self) -> None:
        """Stops watching the stream attached last, without reading it.

        In a forked child that stream is the parent's, whose fetcher's locks a parent thread may
        have held (NOTE [loader across fork] in dataloader.py).
        """
        self._stream = None

    def _totals(self, stream: Any) -> tuple[int, int, int, int, int]:
        c = stream.counters()
        d = stream.downloads() if self.fetch_jobs is not None else None
        return c["wait_ns"], c["collate_ns"], c["shard_wait_ns"], c["batches"], d["bytes"] if d else 0

    def observe(self, stream: Any, batch: Any) -> None:
        """Called for every batch handed out, and with ``batch=None`` while the loop waits for one; decides once per interval."""
        if stream is not self._stream:
            return
        if batch is not None:
            nbytes = 0
            for t in batch.values():
                nbytes += t.nelement() * t.element_size()
            if nbytes > self.slot_bytes:
                self.slot_bytes = nbytes
                self._enforce_budget(stream)
        now = time.perf_counter()
        if self._mark is not None and now - self._mark[0] < INTERVAL:
            return  # the pipeline's counters are read once per interval, not per batch
        tot = self._totals(stream)
        w, c, sw, n = (d + s for d, s in zip(self._done, tot[:4]))
        if self._mark is None:
            self._mark = (now, w, c, sw, n, tot[4])
            return
        t0, w0, c0, sw0, n0, dl0 = self._mark
        dt = now - t0
        if n - n0 < MIN_BATCHES and dt < LONG_INTERVAL:
            return  # too few batches to judge, unless the loop has been waiting that long
        self._mark = (now, w, c, sw, n, tot[4])
        span = dt * self.threads
        self._step(stream, (w - w0) / 1e9 / dt, (c - c0) / 1e9 / span, (sw - sw0) / 1e9 / span,
                   (tot[4] - dl0) / dt, t0, now)

    def _step(self, stream: Any, wait: float, collate: float, shard_wait: float, rate: float = 0.0,
              since: float = 0.0, now: float | None = None) -> None:
        """One decision from an interval's shares (NOTE [autotune]).

        ``wait``: the loop's; ``collate`` and ``shard_wait``: the active threads' (collating,
        waiting for shards to arrive); ``rate``: bytes downloaded per second; ``since``: when
        the interval began; ``now``: when it ended.
        """
        busy = collate + shard_wait
        seen = f"the loop waited {100 * wait:.0f}% of the time, {self.threads} thread(s) busy {100 * min(busy, 1):.0f}%"
        if wait <= WAIT_HIGH:
            self._trial = None  # the downloads keep up: a trial under way is kept
        elif self.fetch_jobs is not None and (shard_wait > collate or (busy < IDLE_BUSY and rate > 0)):
            # Threads waiting for shards (their wait is counted when a batch gets its shards),
            # or idle while bytes arrive: the downloads bind.
            self._idle = 0
            share = f" ({100 * min(shard_wait, 1):.0f}% of their time)" if shard_wait > 0 else ""
            self._fetch_step(stream, rate, since, time.perf_counter() if now is None else now,
                             f"{seen}, waiting for downloads{share}")
            return
        if wait > WAIT_HIGH:
            self._idle = 0
            if self.prefetch < self.threads:
                self._grow(stream, self.threads, 2 * self.threads, f"{seen}: a read-ahead below the threads "
                           "leaves some idle: deeper read-ahead")
            elif busy > BUSY_HIGH:
                if self.threads < self.max_threads:
                    self._grow(stream, self.threads + 1, max(self.prefetch, 2 * (self.threads + 1)),
                               f"{seen}: one more thread")
                else:
                    self._note(f"{seen}: CPU-bound on all {self.max_threads} CPUs of this process; "
                               "nothing to add")
            elif self.prefetch < 2 * self.threads or (self.threads >= self.max_threads
                                                       and self.prefetch < MAX_PREFETCH):
                self._grow(stream, self.threads, 2 * self.prefetch, f"{seen}: deeper read-ahead")
            elif self.threads < self.max_threads:
                # Threads waiting for a CPU (a busy machine) or for storage do not count as
                # busy; with a read-ahead of two per thread already, try one more.
                self._grow(stream, self.threads + 1, max(self.prefetch, 2 * (self.threads + 1)),
                           f"{seen}: a deep read-ahead did not help: one more thread")
            return
        if busy < IDLE_BUSY and self.threads > 1:
            self._idle += 1
            if self._idle >= IDLE_STEPS:
                self._idle = 0
                self._set(stream, self.threads - 1, self.prefetch, f"{seen}: one thread fewer (idle)")
        else:
            self._idle = 0

    def _fetch_step(self, stream: Any, rate: float, since: float, now: float, seen: str) -> None:
        """The downloads bind: a trial of twice as many, or its verdict (NOTE [autotune])."""
        assert self.fetch_jobs is not None
        mbs = f"{rate / 1e6:.0f} MB/s"
        if self._trial is not None:
            before, before_rate, started = self._trial
            if since < started:
                return  # the interval began before the change: wait for a whole one after it
            self._trial = None
            if rate < FETCH_GAIN * before_rate:
                self._fetch_ceiling = (self.fetch_jobs, now)
                self._set_fetch(stream, before, f"{seen}: {self.fetch_jobs} downloads received {mbs} against "
                                f"{before_rate / 1e6:.0f} MB/s with {before}: back to {before}")
                return
        want = min(MAX_FETCH_JOBS, 2 * self.fetch_jobs)
        d = stream.downloads() if stream is not None else None
        if d is not None and d["pending"] <= self.fetch_jobs:
            # Every shard left to fetch is downloading already (the end of a plan): more
            # jobs could not start, and a trial now would judge them on nothing.
            self._note(f"{seen}: the {d['pending']} downloads left all run at once")
            return
        if self._fetch_ceiling is not None:
            jobs, when = self._fetch_ceiling
            if want >= jobs and now - when < FETCH_RETRY_S:
                self._note(f"{seen}: bound by the downloads; {jobs} at once did not receive more than "
                           f"{self.fetch_jobs}")
                return
        if want == self.fetch_jobs:
            self._note(f"{seen}: bound by the downloads at the most, {MAX_FETCH_JOBS} at once")
            return
        while want > self.fetch_jobs and not self._fits(self.threads, self.prefetch, want):
            want -= 1
        if want == self.fetch_jobs:
            self._note(f"{seen}: more downloads would exceed the memory budget")
            return
        self._trial = (self.fetch_jobs, rate, now)
        self._set_fetch(stream, want, f"{seen}, {self.fetch_jobs} downloads received {mbs}: try {want}")

    def _set_fetch(self, stream: Any, jobs: int, why: str) -> None:
        self.fetch_jobs = jobs
        if stream is not None:
            stream.tune_downloads(jobs)
        self._note(why)

    def _grow(self, stream: Any, threads: int, prefetch: int, why: str) -> None:
        """Moves towards (threads, prefetch), as far as the memory budget allows."""
        prefetch = min(MAX_PREFETCH, prefetch)
        while prefetch > self.prefetch and not self._fits(threads, prefetch):
            prefetch -= 1
        if threads > self.threads and not self._fits(threads, max(prefetch, self.prefetch)):
            threads = self.threads
        prefetch = max(prefetch, self.prefetch)
        if (threads, prefetch) == (self.threads, self.prefetch):
            self._note(f"{why.rsplit(':', 1)[0]}: more would exceed the memory budget")
        else:
            self._set(stream, threads, prefetch, why)

    def _enforce_budget(self, stream: Any) -> None:
        threads, prefetch = self.threads, self.prefetch
        while prefetch > 1 and not self._fits(threads, prefetch):
            prefetch -= 1
        if self.fetch_jobs is not None and not self._fits(threads, prefetch):
            jobs = self.fetch_jobs
            while jobs > 1 and not self._fits(threads, prefetch, jobs):
                jobs -= 1
            if jobs != self.fetch_jobs:
                self._set_fetch(stream, jobs, f"batches of {self.slot_bytes} bytes: downloads lowered to fit "
                                "the memory budget")
        while threads > 1 and not self._fits(threads, prefetch):
            threads -= 1
        if (threads, prefetch) != (self.threads, self.prefetch):
            self._set(stream, threads, prefetch,
                      f"batches of {self.slot_bytes} bytes: lowered to fit the memory budget")
        if not self._fits(threads, prefetch):
            self._note(f"batches of {self.slot_bytes} bytes: even 1 thread and a read-ahead of 1 need "
                       f"{self.memory_bytes()} bytes, over the memory budget of {self.memory_budget}")

    def _set(self, stream: Any, threads: int, prefetch: int, why: str) -> None:
        self.threads, self.prefetch = threads, prefetch
        if stream is not None:
            stream.tune(threads, prefetch)
        self._note(why)

    def _note(self, why: str) -> None:
        if self.decisions and self.decisions[-1]["why"] == why:
            return
        self.decisions.append({"t": round(time.perf_counter() - self._t0, 3), "threads": self.threads,
                               "prefetch": self.prefetch, "fetch_jobs": self.fetch_jobs, "why": why})
        del self.decisions[:-_KEEP_DECISIONS]

    def report(self) -> dict[str, Any]:
        """What ``stats()["autotune"]`` shows."""
        return {"threads": self.threads, "prefetch": self.prefetch, "fetch_jobs": self.fetch_jobs,
                "max_threads": self.max_threads,
                "memory_budget": self.memory_budget, "slot_bytes": self.slot_bytes,
                "memory_bytes": self.memory_bytes(), "decisions": list(self.decisions)}


__all__ = ["INTERVAL", "MIN_BATCHES", "LONG_INTERVAL", "WAIT_HIGH", "BUSY_HIGH", "IDLE_BUSY", "IDLE_STEPS",
           "MAX_PREFETCH", "MAX_FETCH_JOBS", "FETCH_GAIN", "FETCH_RETRY_S", "cpu_budget", "default_memory_budget",
           "AutoTune"]
