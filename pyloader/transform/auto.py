"""``executor="auto"``: threads or processes for the per-sample transform, chosen from a measurement.

NOTE [executor choice]: threads cost nothing to start and share the loader's memory,
but they run Python one at a time: a transform that holds the GIL (pure Python, PIL's
``Image.open``, many small numpy calls) gets no faster with more of them. Processes run
it in parallel, at the price of a fork and of shared memory for the batches they make
(collated straight into it: NOTE [collate into the slot] in pool.py).

A user's transform (``transform=``) on 2 workers or more, with 2 CPUs or more, the ``fork``
start method and ``FORK_FIRST_ROOM`` free in the shared-memory directory, starts on
processes at once (``ExecutorChoice.start_on_processes``): nearly every such transform in
practice computes (PIL, numpy, torch ops, a tokenizer), and the probe below cost its first
epoch what torch's DataLoader does not pay. Measured on 2 CPUs, a light PIL pipeline
(~0.25 ms a sample, 4,096 samples): the probe ran the first 8 batches on one thread while
the other CPU idled (decided at 237 ms), waited for them, forked (33 ms) and the first
batch of a worker came 100 ms later (its copy-on-write faults): 0.85 s for the first epoch
against 0.65 s for the next. The workers measure what the probe would have: each batch's
time making it (not waiting for records), its CPU time and its wait for a CPU (schedstat);
at the end of the first epoch with ``PHASE_SAMPLES`` per worker and ``PHASE_S`` of work,
``ExecutorChoice.check`` keeps processes for a transform that computes over
``EARLY_COMPUTING`` of its working time, and moves one that waits (a sleep, the network)
to threads from the next epoch (they can outnumber the CPUs). A batch too large for the
shared-memory directory moves the rest of that epoch, from that batch, to threads
(``ForkFirstStream``). Everywhere else (one worker, ``num_workers="auto"``, a decode
without a transform, ``spawn``, a small ``/dev/shm``) the probe decides:

Which one a transform needs is measured, not guessed from what it is: an epoch whose
executor is not chosen yet starts on threads and runs a *scaling probe* over its first batches: phases of
1 and of ``W' = max(2, min(W, CPUs))`` working threads, alternated (1, W', 1, W'), each at
least ``PHASE_S`` seconds and ``PHASE_SAMPLES`` samples per thread, counting the samples the
threads transform per second (no more threads than CPUs: beyond them a transform without
the GIL stops scaling too, and the formula below would read the CPUs' limit as the
GIL's). A phase is timed by samples, not by the batches the loop
takes: the loop takes batches made earlier (prefetched), and a phase of a few batches of
100 ms samples counted whole batches either side of its ends (measured: a pure-Python
transform scattered from g 0.47 to 1.0, a PIL pipeline from 0.03 to 1.0; counted by
samples, 1.0 in 4 runs of 4 and 0.09-0.12). A phase with fewer threads starts once the threads it
stopped have finished their batch. The scaling ``s`` is the rate with ``W'`` threads over
the rate with one: ``W'`` when the transform releases the GIL (pyloader's decode, a sleep
or a network wait), 1 when it holds it throughout. The share of a sample's time that holds
the GIL follows (Amdahl): ``g = (W' / s - 1) / (W' - 1)``. (Rates, not each thread's busy
time: under the GIL a thread also waits for it outside the transform, between batches,
which a per-thread measure would leave out.) Then:

* a user's transform, 2 workers or more, that computes (its thread's CPU time over
  ``EARLY_COMPUTING`` of its working time: a transform that waits, a sleep or the network,
  reads under 0.1, one that computes 0.9-1.0 on a quiet machine and 0.5 on one whose CPUs
  others keep busy, as the thread also waits for the GIL a descheduled loop holds) while
  the loop waits for it (over ``LOOP_WAIT`` of the time), both read from the first
  1-thread phase alone: **processes**, at once. The
  rules below give processes to every such transform that holds the GIL over
  ``GIL_COMPUTING`` of its time, and one that holds it less (native code throughout) makes
  as many samples on processes (measured: ``ImageDecode``, g 0.03-0.09, 1.09x on
  processes); the other three phases, on one core out of two for a transform that holds
  the GIL, cost the first epoch more than the choice could gain (a light PIL pipeline:
  0.3 s of a 1.1 s first epoch, with the fork). ``gil_held`` and ``scaling`` are then not
  measured (None);
* one worker (``num_workers`` 0 or 1): **threads**. No worker waits for another, and one
  worker process gains nothing over one thread (measured, one process over one thread:
  1.09x on a PIL pipeline, 0.87x on a tokenizer, 0.97x on numpy features, 1.00x on
  ``ImageDecode``). The probe still runs, so ``gil_held`` is reported;
* the loop waited less than ``LOOP_WAIT`` of the ``W'`` phases: it, not the workers, set
  the pace, and nothing was learned about scaling: **threads** (they are enough);
* ``g`` over ``GIL_HIGH``: **processes**. The thread stream stops handing out batches
  (``ThreadTransformStream.limit``), the batches it has handed out are still delivered,
  and the rest of the epoch is made by worker processes, in plan order: the loop sees one
  stream;
* ``g`` over ``GIL_COMPUTING`` for a transform that computes (its thread's CPU time over
  ``COMPUTING`` of its working time in the 1-thread phases, from ``time.thread_time``; the
  time it was ready but waited for a CPU taken by another process, from Linux's
  schedstat, is not working time -- on a loaded machine a light PIL pipeline measured
  0.30 without that, a transform that waits):
  **processes** too. Threads that compute lose to processes long before the GIL is held
  half the time: each hand-over of the GIL stalls the thread that waits for it, and the
  consuming thread (the training step) takes the GIL too. Measured on 2 CPUs, 2 workers:
  a PIL decode + crop + normalise pipeline (g 0.09-0.12) made 1.21x the samples on
  processes, ``ImageDecode`` (g 0.03-0.09) 1.09x;
* otherwise **threads**, for this epoch and the next ones: a transform that waits (a sleep,
  the network) scales on threads, and threads can outnumber the CPUs
  (``num_workers="auto"`` grows them to dozens).

Processes are not taken where the shared-memory directory has no room for them: under
``(prefetch + SLOTS_HELD)`` times the largest batch the probe saw free (a container's
64 MB ``/dev/shm`` and 38 MB image batches); threads then, with the reason.

The choice is the loader's: made once, kept for every later epoch, and reported in
``stats()["executor_choice"]`` (the executor, ``gil_held`` ``g``, the scaling, why) and
by ``pyloader bench --transform``. An epoch that ends before the probe is done leaves the
choice open, and the next epoch goes on with the phases it had not finished. Where the interpreter runs without a GIL
(free-threaded CPython, ``sys._is_gil_enabled()`` false) threads are chosen at once: they
scale there. A process pool that cannot start (a transform that cannot be pickled for
``spawn``) leaves threads, with the reason. ``executor="threads"``/``"processes"`` skip all
of it. A machine whose cores are all taken by others makes every transform look as if it
held the GIL (nothing scales); processes then cost a little more than threads would and
gain as little. The batches are the same on either executor (NOTE [sample seeds]); only
transforms that draw from the global generators (``random``, ``numpy.random``, ``torch``)
rather than their ``SampleContext`` can see a difference, as those are seeded per sample
on processes alone.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ..contract import cpu_budget, default_prefetch
from ..errors import LoaderStateError, SharedMemoryError
from .pool import flatten, shm_dir
from .stage import TransformStream, stage_figures
from .threads import ThreadTransformStream

PHASE_S = 0.1  # a probe phase lasts at least this long...
PHASE_SAMPLES = 8  # ...and makes at least this many samples per working thread
GIL_HIGH = 0.5  # a sample holds the GIL more than this share of its time: processes
LOOP_WAIT = 0.05  # the loop waited less than this share of the W'-thread phases: it set the pace
GIL_COMPUTING = 0.05  # ...or more than this, for a transform that computes: processes
COMPUTING = 0.5  # a thread whose CPU time is more than this share of its working time computes
EARLY_COMPUTING = 0.25  # ...for the choice from the first phase alone (a user's transform, 2 workers or more)
SLOTS_HELD = 2  # batches a loop is assumed to hold besides the prefetched ones (the room check)
FORK_FIRST_ROOM = 1 << 30  # shared memory free for a user's transform to start on processes at once


def gil_enabled() -> bool:
    """Whether this interpreter has a GIL (False on free-threaded CPython with the GIL off)."""
    check = getattr(sys, "_is_gil_enabled", None)
    return True if check is None else bool(check())


class ScalingProbe:
    """Measures how a thread stream's transform scales with threads (NOTE [executor choice]).

    Driven by the consumer: ``step()`` after every batch taken; True once done (the stream's
    workers are then back at their count).
    """

    def __init__(self, stream: ThreadTransformStream,
                 earlier: tuple[int, int, dict[int, list[float]]] | None = None, *, shortcut: bool = False) -> None:
        self.stream = stream
        self.workers = stream.planned
        # A computing transform may be decided after the first phase (NOTE [executor choice]).
        self.shortcut = shortcut and self.workers >= 2
        self.early = False  # decided after the first 1-thread phase, the scaling unmeasured
        # No more threads than CPUs: beyond them even a transform without the GIL stops
        # scaling, and the formula would read the CPUs' limit as the GIL's.
        self.wide = max(2, min(self.workers, cpu_budget()))
        self.phases = [1, self.wide, 1, self.wide]
        self.i = 0
        # samples, wall seconds, busy and CPU seconds of the working threads, the loop's wait,
        # the working threads' wait for a CPU
        self.rates: dict[int, list[float]] = {1: [0.0] * 6, self.wide: [0.0] * 6}
        if earlier is not None and earlier[0] == self.wide:
            # The phases an earlier epoch (too short to finish them) completed count.
            self.i, self.rates = earlier[1], earlier[2]
        self._mark: tuple[float, int, int, int, int, int, int] | None = None
        stream.set_workers(self.phases[self.i])

    def step(self) -> bool:
        """Counts the samples made so far; moves to the next phase when this one is long enough."""
        st = self.stream._stats
        now = time.perf_counter()
        done, working = self.stream.progress()
        phase = self.phases[self.i]
        snap = (now, done, st.busy_ns, st.batches, st.cpu_ns, st.wait_ns, st.queued_ns)
        if self._mark is None:
            if working > phase:
                return False  # a thread of the wider phase is still finishing its batch
            self._mark = snap
            return False
        t0, n0, b0, k0, c0, w0, q0 = self._mark
        if now - t0 < PHASE_S or done - n0 < PHASE_SAMPLES * phase:
            return False
        acc = self.rates[self.phases[self.i]]
        acc[0] += snap[1] - n0
        acc[1] += now - t0
        acc[2] += (snap[2] - b0) / 1e9
        acc[3] += (snap[4] - c0) / 1e9
        acc[4] += (snap[5] - w0) / 1e9
        acc[5] += (snap[6] - q0) / 1e9
        self.i += 1
        self._mark = None
        if (self.i == 1 and self.shortcut and self.computing > EARLY_COMPUTING and acc[1] > 0
                and acc[4] / acc[1] > LOOP_WAIT):
            self.early = True  # (one thread on: the rest of the epoch goes to processes)
            return True
        if self.i == len(self.phases):
            self.stream.set_workers(self.workers)
            return True
        self.stream.set_workers(self.phases[self.i])
        return False

    def abandon(self) -> None:
        """The epoch ended first: the workers' count goes back."""
        self.stream.set_workers(self.workers)

    @property
    def scaling(self) -> float:
        """The samples per second with ``W'`` threads over those with one (1: no gain, ``W'``: full)."""
        n1, t1 = self.rates[1][:2]
        nw, tw = self.rates[self.wide][:2]
        if n1 <= 0 or t1 <= 0 or tw <= 0:
            return float(self.wide)
        return (nw / tw) / (n1 / t1)

    @property
    def loop_bound(self) -> bool:
        """Whether the loop, not the workers, set the pace with ``W'`` threads (it hardly waited for them)."""
        _, tw, _, _, ww, _ = self.rates[self.wide]
        return tw > 0 and ww / tw < LOOP_WAIT

    @property
    def computing(self) -> float:
        """The share of one thread's working time that is CPU time (not a wait), from the 1-thread phases.

        The time the thread was ready but waited for a CPU (other processes on the machine)
        is not working time: it computes for all that.
        """
        b1, c1, q1 = self.rates[1][2], self.rates[1][3], self.rates[1][5]
        b1 = max(c1, b1 - q1)
        return min(1.0, c1 / b1) if b1 > 0 else 0.0

    @property
    def gil_held(self) -> float:
        """The share of a sample's time that holds the GIL, from the scaling (Amdahl's law), 0..1."""
        s = max(self.scaling, 1e-9)
        return min(1.0, max(0.0, (self.wide / s - 1) / (self.wide - 1)))


def batch_bytes(item: Any) -> int:
    """The bytes of the tensors and arrays in a batch: what a process worker's slot would hold (``flatten``)."""
    leaves: list[torch.Tensor] = []
    flatten(item, leaves)
    return sum(x.numel() * x.element_size() for x in leaves)


class ExecutorChoice:
    """A loader's choice of executor under ``executor="auto"``: open until decided, then kept (NOTE [executor choice])."""

    def __init__(self) -> None:
        self.executor: str | None = None if gil_enabled() else "threads"
        self.pending = False  # processes taken at once, to be checked by what the workers measure
        # (W', phases done, their counts) of a probe an epoch ended before it was done
        self.unfinished: tuple[int, int, dict[int, list[float]]] | None = None
        self.report: dict[str, Any] = {} if self.executor is None else {
            "executor": "threads", "why": "this interpreter runs without a GIL: threads scale"}

    def decide(self, probe: ScalingProbe, room: tuple[str, int, int] | None = None) -> str:
        """Decides from ``probe``; returns the executor.

        ``room``: (the shared-memory directory, its free bytes, the bytes the process
        executor's slots would take), or None where that is not known.
        """
        self.unfinished = None
        g, scaling, computing = probe.gil_held, probe.scaling, probe.computing
        if probe.early:
            return self._decide_early(probe, room)
        seen = (f"{probe.wide} threads made {scaling:.2f}x the samples of 1: a sample holds the GIL about "
                f"{g:.0%} of its time")
        processes = None
        if probe.workers == 1:
            self.executor = "threads"
            why = (f"{seen}, but with one worker none waits for another, and a worker process gains nothing "
                   f"over a thread: threads")
        elif probe.loop_bound:
            g = 0.0
            self.executor = "threads"
            why = (f"the loop took the batches of {probe.wide} threads as fast as they came (it waited under "
                   f"{LOOP_WAIT:.0%} of the time): threads are enough")
        elif g > GIL_HIGH:
            processes = f"{seen} (over {GIL_HIGH:.0%}): threads wait for each other, processes do not"
        elif computing > COMPUTING and g > GIL_COMPUTING:
            processes = (f"{seen}, and computes {computing:.0%} of its time: a transform that computes and holds "
                         f"the GIL over {GIL_COMPUTING:.0%} of its time makes more samples on processes")
        else:
            self.executor = "threads"
            why = (f"{seen} (at most {GIL_COMPUTING:.0%}" + (")" if computing > COMPUTING else
                   f"; it waits {1 - computing:.0%} of its time, and threads can outnumber the CPUs)")
                   + ": threads scale")
        if processes is not None:
            if room is not None and room[1] < room[2]:
                self.executor = "threads"
                why = (f"{processes}; but {room[0]} has {room[1]} bytes free, under the {room[2]} the process "
                       f"executor's batches would take there: threads (make it larger, or set PYLOADER_SHM_DIR)")
            else:
                self.executor = "processes"
                why = processes
        self.report = {"executor": self.executor, "gil_held": round(g, 3), "scaling": round(scaling, 3),
                       "computing": round(computing, 3),
                       "threads_compared": [1, probe.wide], "why": why}
        assert self.executor is not None
        return self.executor

    def _decide_early(self, probe: ScalingProbe, room: tuple[str, int, int] | None) -> str:
        """Processes for a transform that computes, from the first 1-thread phase (NOTE [executor choice])."""
        why = (f"one thread of it computes {probe.computing:.0%} of its working time while the loop waits: a "
               f"transform that computes makes at least as many samples on processes (the scaling was not measured)")
        self.executor = "processes"
        if room is not None and room[1] < room[2]:
            self.executor = "threads"
            why = (f"{why}; but {room[0]} has {room[1]} bytes free, under the {room[2]} the process executor's "
                   f"batches would take there: threads (make it larger, or set PYLOADER_SHM_DIR)")
        self.report = {"executor": self.executor, "gil_held": None, "scaling": None,
                       "computing": round(probe.computing, 3), "threads_compared": [1], "why": why}
        return self.executor

    def start_on_processes(self, workers: int) -> None:
        """A user's transform on ``workers`` forked processes from its first batch; checked by ``check``."""
        self.executor = "processes"
        self.pending = True
        self.report = {"executor": "processes", "gil_held": None, "scaling": None, "computing": None,
                       "threads_compared": [], "why": (
                           f"a user's transform on {workers} workers starts on forked worker processes (no probe "
                           f"on threads first); kept if its workers compute over {EARLY_COMPUTING:.0%} of their "
                           f"working time, else threads from the next epoch (checked over the first epoch)")}

    def check(self, workers: int, samples: int, busy_ns: int, cpu_ns: int, queued_ns: int) -> None:
        """Keeps processes, or moves to threads, from what the workers of ``start_on_processes`` measured.

        ``busy_ns``/``cpu_ns``/``queued_ns``: the workers' summed time making batches, their
        CPU time in it and their wait for a CPU (NOTE [executor choice]). Too little work
        measured (an epoch left after a few samples) leaves it pending.
        """
        if not self.pending or samples < PHASE_SAMPLES * workers or busy_ns < PHASE_S * 1e9:
            return
        self.pending = False
        working = max(cpu_ns, busy_ns - queued_ns)
        computing = min(1.0, cpu_ns / working) if working > 0 else 0.0
        self.report = dict(self.report, computing=round(computing, 3))
        if computing > EARLY_COMPUTING:
            self.report["why"] = (f"a user's transform started on {workers} forked worker processes, which "
                                  f"computed {computing:.0%} of their working time: processes")
            return
        self.executor = "threads"
        self.report.update(executor="threads", why=(
            f"a user's transform started on {workers} forked worker processes, which computed only "
            f"{computing:.0%} of their working time (it waits: a sleep, the network): threads from the next "
            f"epoch, as many as num_workers (they cost no fork and can outnumber the CPUs)"))

    def no_room(self, error: BaseException) -> None:
        """A batch of ``start_on_processes``'s workers did not fit in shared memory: threads, with the reason."""
        self.pending = False
        self.executor = "threads"
        self.report = dict(self.report, executor="threads", why=(
            f"a user's transform started on forked worker processes, but a batch did not fit in the shared-memory "
            f"directory ({error}): threads from that batch on (make it larger, or set PYLOADER_SHM_DIR)"))

    def fall_back(self, error: BaseException) -> None:
        """The process pool could not start: threads, with the reason."""
        self.executor = "threads"
        self.report = dict(self.report, executor="threads",
                           why=f"{self.report.get('why', '')}; but no process pool could start ({error}): threads")


# Counters of a stream that add up across the two parts of an epoch that changed executor.
_SUMMED = ("transform_batches", "transformed_samples", "skipped_samples", "transform_s", "decode_s",
           "consumer_wait_s", "batches", "records")


class AutoTransformStream(TransformStream):
    """An epoch under ``executor="auto"`` whose executor is not chosen yet (NOTE [executor choice]).

    ``head``: the thread stream the epoch starts on; ``make_tail(start, executor)``: a stream
    of the epoch's batches from batch ``start`` on, on ``executor``; ``shortcut``: the epoch
    runs a user's transform, which the probe may decide after its first phase.
    """

    def __init__(self, head: ThreadTransformStream, choice: ExecutorChoice,
                 make_tail: Callable[[int, str], TransformStream], *, shortcut: bool = False) -> None:
        super().__init__("threads", head.planned, len(head))
        self._head = head
        self._tail: TransformStream | None = None
        self._head_done = False  # every batch of the head was delivered
        self._start: int | None = None  # the first batch of the tail, once processes are chosen
        self._choice = choice
        self._make_tail = make_tail
        self._probe: ScalingProbe | None = (ScalingProbe(head, choice.unfinished, shortcut=shortcut)
                                            if choice.executor is None else None)
        if self._probe is not None:
            choice.report = {"executor": None, "why": "the scaling probe is running (threads meanwhile; an epoch that "
                                                      "ends first leaves it to the next)"}
        self._tuner, head.tuner = head.tuner, None  # the count stays put while the probe moves it
        self._closed = False
        self._t0 = time.perf_counter()
        self._batch_bytes = 0  # the largest batch the probe saw (the room check)

    def _take(self) -> Any:
        if self._closed:
            raise LoaderStateError("iterator is closed")
        if not self._head_done:
            self._head.timeout = self.timeout
            try:
                item = self._head._take()
            except StopIteration:
                self._head_done = True
                self._head.close()  # its batches are all delivered: its threads and reader go
                if self._start is not None and self._tail is None:
                    self._switch()
                if self._tail is None:  # the epoch ended on threads
                    self._stop_probe()
                    self._end()
                return self._next_from_tail()
            probe = self._probe
            if probe is not None:
                self._batch_bytes = max(self._batch_bytes, batch_bytes(item))
                if probe.step():
                    self._decide(probe)
            if self._start is not None and self._tail is None and self._head.idle():
                self._switch()
            return item
        return self._next_from_tail()

    def _next_from_tail(self) -> Any:
        tail = self._tail
        assert tail is not None
        tail.timeout = self.timeout
        try:
            return tail._take()
        except StopIteration:
            self._end()

    def _decide(self, probe: ScalingProbe) -> None:
        self._probe = None
        self._head.tuner = self._tuner
        directory = shm_dir()
        try:
            st = os.statvfs(directory)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
        need = (default_prefetch(self._head.workers) + SLOTS_HELD) * self._batch_bytes
        executor = self._choice.decide(probe, (directory, free, need))
        if probe.early and executor == "threads":
            self._head.set_workers(probe.workers)  # the probe left one working
        if executor == "threads" and self._tuner is not None:
            self._tuner.jump(self._head, probe.computing)  # See NOTE [transform autotune]
        if executor == "processes":
            # The head hands out no more batches; once its threads have made those it handed
            # out and exited, the pool is forked (never while a thread may hold a lock the
            # children would inherit held), and the loop takes the head's batches meanwhile.
            self._start = self._head.limit()

    def _switch(self) -> None:
        """The rest of the epoch, from batch ``_start`` on, on processes (threads if no pool can start)."""
        assert self._start is not None
        self._head.close_source()  # (no native thread of the head runs at the fork either)
        try:
            self._tail = self._make_tail(self._start, "processes")
        except Exception as e:  # noqa: BLE001 - no pool: the rest of the epoch on threads, with the reason
            self._choice.fall_back(e)
            self._tail = self._make_tail(self._start, "threads")

    def _stop_probe(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.abandon()
            self._choice.unfinished = (probe.wide, probe.i, probe.rates)  # the next epoch goes on from there
            if self._choice.executor is None:
                self._choice.report = {"executor": None, "why": "the epoch ended before the scaling probe was done "
                                                                "(threads for now; the next epoch goes on with it)"}

    def close(self) -> None:
        """Stops the probe and both parts' workers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_probe()
        self._head.close()
        if self._tail is not None:
            self._tail.close()
        self._finish()

    def stats(self) -> dict[str, Any]:
        """The whole epoch's figures (``joined_stats``), with the loader's ``extra`` keys."""
        return self._with_extra(joined_stats(self._head, self._tail, self._start, self._t0, self._stats.end))


def joined_stats(head: TransformStream, tail: TransformStream | None, start: int | None, t0: float,
                 end: float | None) -> dict[str, Any]:
    """An epoch's figures over the two parts of an epoch that changed executor at batch ``start``.

    Counters add up; the busy share, cost per sample and hint are the whole epoch's;
    ``transform_executor``/``transform_workers`` are the current part's, and
    ``transform_switched_at`` the batch the switch began from.
    """
    s = dict(head.stats())
    if tail is not None:
        t = tail.stats()
        for k in _SUMMED:
            if k in t:
                s[k] = s.get(k, 0) + t[k]
        wall = (end or time.perf_counter()) - t0
        # The workers' wait for native batches: the thread part's (a process part reads in its
        # workers and reports none), the one figure the hint prints and the key holds.
        read = (s.get("native_wait_s", 0.0) + t.get("native_wait_s", 0.0)
                if "native_wait_s" in s or "native_wait_s" in t else None)
        if read is not None:
            s["native_wait_s"] = read
        s.update(stage_figures([head._stats, tail._stats], wall_s=wall,
                               executor=t["transform_executor"], workers=t["transform_workers"], read_wait_s=read))
        s["transform_switched_at"] = start
    return s


class ForkFirstStream(TransformStream):
    """An epoch of a user's transform started on processes at once (``ExecutorChoice.start_on_processes``).

    ``head``: the process stream; ``make_tail(start, executor)``: as ``AutoTransformStream``'s.
    While the choice is pending, a batch too large for the shared-memory directory
    (``SharedMemoryError`` from a worker) moves the epoch to threads from that batch on,
    and the choice with it (the probe's room check, made here by the first batch that
    does not fit). ``ProcessTransformStream.made`` is what ``ExecutorChoice.check`` reads.
    """

    def __init__(self, head: TransformStream, choice: ExecutorChoice,
                 make_tail: Callable[[int, str], TransformStream]) -> None:
        super().__init__("processes", head._stats.workers, len(head))
        self.head = head
        self._tail: TransformStream | None = None
        self._start: int | None = None
        self._choice = choice
        self._make_tail = make_tail
        self._closed = False
        self._t0 = time.perf_counter()

    def _take(self) -> Any:
        if self._closed:
            raise LoaderStateError("iterator is closed")
        if self._tail is None:
            self.head.timeout = self.timeout
            try:
                return self.head._take()
            except StopIteration:
                self._end()
            except SharedMemoryError as e:
                if not self._choice.pending:
                    raise
                self._start = max(0, getattr(self.head, "_delivered", 1) - 1)  # the batch that did not fit
                self.head.close()
                self._choice.no_room(e)
                self._tail = self._make_tail(self._start, "threads")
        tail = self._tail
        tail.timeout = self.timeout
        try:
            return tail._take()
        except StopIteration:
            self._end()

    def close(self) -> None:
        """Stops both parts' workers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.head.close()
        if self._tail is not None:
            self._tail.close()
        self._finish()

    def stats(self) -> dict[str, Any]:
        """The whole epoch's figures (``joined_stats``), with the loader's ``extra`` keys."""
        return self._with_extra(joined_stats(self.head, self._tail, self._start, self._t0, self._stats.end))


__all__ = ["PHASE_S", "PHASE_SAMPLES", "GIL_HIGH", "LOOP_WAIT", "GIL_COMPUTING", "SLOTS_HELD", "FORK_FIRST_ROOM",
           "batch_bytes", "COMPUTING",
           "EARLY_COMPUTING", "gil_enabled", "ScalingProbe", "ExecutorChoice",
           "AutoTransformStream", "ForkFirstStream", "joined_stats"]
