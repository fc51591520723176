"""``num_workers="auto"`` with a per-sample transform: how many workers, tuned as the loader runs.

NOTE [transform autotune]: the right count differs by an order of magnitude between a
transform that waits (a network call, a sleep: many threads) and one that computes (the
CPUs). So the count is measured, not guessed. It starts at the CPUs this process may run on
(``cpu_budget()``) and moves by what the training loop sees:

* **threads** (online, every ``INTERVAL_S`` seconds and ``MIN_BATCHES`` batches, checked
  on the loop's thread as it takes a batch): when the loop waited for batches more than
  ``WAIT_HIGH`` of the interval -- unless the CPUs in use already fill ``CORES_FULL`` of
  them (a computing transform: more threads cannot help; the CPUs in use are the workers'
  CPU time, or for workers that compute, over ``COMPUTING_SHARE`` of their working time,
  the process's but for the loop's thread where more) -- a *trial* of twice the threads;
  after one whole interval with them, they are kept if the transformed samples per second
  grew by ``GAIN`` (or the loop stopped waiting and the rate did not fall: the loop sets the
  pace now), else the count goes back and that count is not tried again for ``RETRY_S``
  seconds (a CPU-bound transform gains nothing past the cores; a waiting one doubles its
  rate with each doubling, up to ``MAX_THREADS``). Threads busy less than
  ``IDLE_BUSY`` of ``IDLE_STEPS`` intervals in a row while the loop did not wait: one fewer.
  When the executor was just chosen by the scaling probe (NOTE [executor choice]), the
  threads first jump to ``cpu_budget() / c`` (rounded), where ``c`` is the share of its
  working time one thread computes (the probe measures it): a transform that waits 95% of its time
  needs about 20 threads per CPU to keep the CPUs busy, and gets them at once.
* **processes**: as many as the CPUs (a transform that holds the GIL computes; one that
  waits runs on threads), set between epochs (a worker process's share of an epoch is
  fixed when the epoch starts): workers busy less than half an epoch while the loop did
  not wait, one fewer for the next; the loop waiting more than ``EPOCH_WAIT`` with the
  workers busy more than ``EPOCH_BUSY``, one more, up to the CPUs. The pool keeps its
  processes (NOTE [transform pool]); an epoch uses the first ones.

Memory: a step that would take the loader past ``memory_budget`` is not taken. The estimate
counts what the workers hold at most: with threads, ``3 * threads + 3`` native batches (the
read-ahead, one per thread being transformed, the reader's own) and ``3 * threads + 2``
transformed ones (two tickets ahead per thread, one being made per thread, the loop's
current and previous); with processes, five native batches per process (each reads its own
share) and the same transformed ones, in shared memory. A native batch is the batch size
times the fixed fields' record size; a transformed one is measured on the batches the loop
takes. ``stats()["autotune"]`` has the counts, the estimate, the budget and the last
decisions with their reasons; the executor is chosen apart from the count (NOTE [executor
choice]).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..contract import cpu_budget, default_memory_budget

INTERVAL_S = 0.5
MIN_BATCHES = 4
LONG_INTERVAL_S = 2.0  # an interval ends after this long whatever the batches
WAIT_HIGH = 0.02
GAIN = 1.1
RETRY_S = 10.0
IDLE_BUSY = 0.3
IDLE_STEPS = 3
MAX_THREADS = 64
CORES_FULL = 0.85  # the CPUs in use over this share of them: no trial of more threads
COMPUTING_SHARE = 0.5  # workers whose CPU time is over this share of their working time compute
EPOCH_WAIT = 0.05
EPOCH_BUSY = 0.85
_KEEP_DECISIONS = 32


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors and arrays in a batch (dicts, lists and tuples walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class TransformTune:
    """The transform workers' counts of one loader and the controller that moves them (NOTE [transform autotune])."""

    def __init__(self, memory_budget: int | None = None, *, cpus: int | None = None) -> None:
        self.cpus = cpus or cpu_budget()
        self.memory_budget = default_memory_budget() if memory_budget is None else int(memory_budget)
        self.threads = self.cpus
        self.processes = self.cpus
        self.max_threads = MAX_THREADS
        self.max_processes = self.cpus
        self.raw_bytes = 0  # a native batch
        self.out_bytes = 0  # a transformed batch (the largest seen)
        self.decisions: list[dict[str, Any]] = []
        self._t0 = time.perf_counter()
        self._stream: Any = None
        # (time, samples, wait_ns, busy_ns, batches, workers' cpu_ns, the process's cpu_ns but the loop's)
        self._mark: tuple[float, int, int, int, int, int, int] | None = None
        self._trial: tuple[int, float, float] | None = None  # (threads before, their rate, when changed)
        self._ceiling: tuple[int, float] | None = None  # (threads that did not help, when)
        self._idle = 0

    # -- memory -------------------------------------------------------------------------
    def memory_bytes(self, executor: str, workers: int) -> int:
        """What ``workers`` of ``executor`` hold at most (NOTE [transform autotune])."""
        raw = (3 * workers + 3) if executor == "threads" else 5 * workers
        return raw * self.raw_bytes + (3 * workers + 2) * self.out_bytes

    def _fits(self, executor: str, workers: int) -> bool:
        return self.memory_bytes(executor, workers) <= self.memory_budget

    def start(self, executor: str, raw_bytes: int) -> int:
        """The count an epoch on ``executor`` starts with (lowered to fit the budget); ``raw_bytes``: a native batch."""
        self.raw_bytes = max(self.raw_bytes, raw_bytes)
        n = self.threads if executor == "threads" else self.processes
        while n > 1 and not self._fits(executor, n):
            n -= 1
        if executor == "threads":
            self.threads = n
        else:
            self.processes = n
        return n

    # -- threads, online ---------------------------------------------------------------------
    def observe(self, stream: Any, item: Any) -> None:
        """Called by a thread stream for every batch the loop takes; decides once per interval."""
        now = time.perf_counter()
        if stream is not self._stream:
            self._stream, self._mark, self._trial = stream, None, None
        st = stream._stats
        snap = (now, st.samples + st.skipped, st.wait_ns, st.busy_ns, st.batches, st.cpu_ns,
                time.process_time_ns() - time.thread_time_ns())  # the loop's own thread (this one) aside
        if self._mark is None:
            self._mark = snap
            self._measure(stream, item)
            return
        t0, n0, w0, b0, k0, c0, p0 = self._mark
        dt = now - t0
        if dt < INTERVAL_S or (snap[4] - k0 < MIN_BATCHES and dt < LONG_INTERVAL_S):
            return
        self._mark = snap
        self._measure(stream, item)
        workers = stream.workers
        busy = (snap[3] - b0) / 1e9 / (dt * workers)
        # The CPUs in use: the workers' own; for workers that compute (their CPU time is most
        # of their working time), the process's but for the loop's thread where more -- the
        # reader and the threads a library starts count against the same CPUs. A transform
        # that waits is judged by its own CPU alone: threads that sleep cost the CPUs nothing,
        # whatever else (a training step on every core) keeps them busy.
        cores = (snap[5] - c0) / 1e9 / dt
        if cores > COMPUTING_SHARE * busy * workers:
            cores = max(cores, (snap[6] - p0) / 1e9 / dt)
        self._step(stream, (snap[2] - w0) / 1e9 / dt, (snap[1] - n0) / dt, busy, t0, now, cores)

    def _measure(self, stream: Any, item: Any) -> None:
        nbytes = tensor_bytes(item)
        if nbytes > self.out_bytes:
            self.out_bytes = nbytes
            n = stream.workers
            while n > 1 and not self._fits("threads", n):
                n -= 1
            if n != stream.workers:
                self._set(stream, n, f"transformed batches of {nbytes} bytes: lowered to fit the memory budget")

    def _step(self, stream: Any, wait: float, rate: float, busy: float, since: float, now: float,
              cores: float = 0.0) -> None:
        n = stream.workers
        seen = f"the loop waited {wait:.0%} of the time, {n} thread(s) busy {min(busy, 1):.0%}, {rate:.0f} samples/s"
        if self._trial is not None:
            before, before_rate, started = self._trial
            if since < started:
                return  # the interval began before the change: judge a whole one after it
            self._trial = None
            if rate < GAIN * before_rate and (wait > WAIT_HIGH or rate < before_rate):
                self._ceiling = (n, now)
                self._set(stream, before, f"{seen} against {before_rate:.0f} with {before}: back to {before}")
                return
            self._note(f"{seen} against {before_rate:.0f} with {before}: kept")
            return
        if wait > WAIT_HIGH:
            self._idle = 0
            want = min(self.max_threads, 2 * n)
            if cores >= CORES_FULL * self.cpus:
                self._note(f"{seen}: the workers compute on {cores:.1f} of the {self.cpus} CPUs already: more "
                           "threads would not help")
                return
            if self._ceiling is not None and want >= self._ceiling[0] and now - self._ceiling[1] < RETRY_S:
                self._note(f"{seen}: {self._ceiling[0]} threads did not make more")
                return
            while want > n and not self._fits("threads", want):
                want -= 1
            if want <= n:
                self._note(f"{seen}: more threads would exceed the memory budget or the most ({self.max_threads})")
                return
            self._trial = (n, rate, now)
            self._set(stream, want, f"{seen}: try {want}")
        elif busy < IDLE_BUSY and n > 1:
            self._idle += 1
            if self._idle >= IDLE_STEPS:
                self._idle = 0
                self._set(stream, n - 1, f"{seen}: one thread fewer (idle)")
        else:
            self._idle = 0

    def jump(self, stream: Any, computing: float) -> None:
        """Sets the threads from the share of its time one thread computes (the scaling probe's).

        A thread that computes a share ``c`` of its working time keeps ``c`` of a CPU busy, so
        ``cpu_budget() / c`` threads keep every CPU busy: a waiting transform starts near its
        count at once instead of doubling its way there. Trials go on from there.
        """
        # rounded, not ceiled: a thread measured computing 98.5% of its time (the rest the
        # loop's share of the GIL) is a computing transform, not one that needs a third thread
        # on 2 CPUs -- which then led to a kept trial of 6 (0.93x torch's DataLoader, 0.96x at 2)
        want = max(self.cpus, min(self.max_threads, round(self.cpus / max(computing, 1 / self.max_threads))))
        while want > self.threads and not self._fits("threads", want):
            want -= 1
        if want > stream.workers:
            self._mark = None  # the next interval starts with the new count
            self._set(stream, want, f"one thread computes {computing:.0%} of its working time: {want} threads "
                                    f"keep the {self.cpus} CPUs busy")

    def _set(self, stream: Any, n: int, why: str) -> None:
        self.threads = n
        stream.set_workers(n)
        self._note(why)

    # -- processes, between epochs ------------------------------------------------------------
    def end_epoch(self, stats: dict[str, Any]) -> None:
        """Called with an epoch's final stats; moves the process count for the next epoch."""
        if stats.get("transform_executor") != "processes":
            return
        n = self.processes
        wait = float(stats.get("wait_fraction", 0.0))
        busy = float(stats.get("transform_busy_fraction", 0.0))
        seen = f"the loop waited {wait:.0%} of the epoch, {n} process(es) busy {min(busy, 1):.0%}"
        if wait <= WAIT_HIGH and busy < 0.5 and n > 1:
            self.processes = n - 1
            self._note(f"{seen}: one process fewer next epoch (idle)")
        elif wait > EPOCH_WAIT and busy > EPOCH_BUSY and n < self.cpus and self._fits("processes", n + 1):
            self.processes = n + 1  # back towards the CPUs, after an idle epoch lowered it
            self._note(f"{seen}: one more process next epoch")

    # -- report -------------------------------------------------------------------------------
    def _note(self, why: str) -> None:
        if self.decisions and self.decisions[-1]["why"] == why:
            return
        self.decisions.append({"t": round(time.perf_counter() - self._t0, 3), "threads": self.threads,
                               "processes": self.processes, "why": why})
        del self.decisions[:-_KEEP_DECISIONS]

    def report(self, executor: str | None) -> dict[str, Any]:
        """What ``stats()["autotune"]`` shows with a transform."""
        ex = executor or "threads"
        workers = self.threads if ex == "threads" else self.processes
        return {"executor": executor, "workers": workers, "threads": self.threads, "processes": self.processes,
                "max_threads": self.max_threads, "max_processes": self.max_processes,
                "memory_budget": self.memory_budget, "raw_batch_bytes": self.raw_bytes,
                "transformed_batch_bytes": self.out_bytes, "memory_bytes": self.memory_bytes(ex, workers),
                "decisions": list(self.decisions)}


__all__ = ["INTERVAL_S", "MIN_BATCHES", "LONG_INTERVAL_S", "WAIT_HIGH", "GAIN", "RETRY_S", "IDLE_BUSY", "IDLE_STEPS", "MAX_THREADS",
           "CORES_FULL", "COMPUTING_SHARE", "EPOCH_WAIT", "EPOCH_BUSY", "tensor_bytes", "TransformTune"]
