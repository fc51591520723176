"""The per-sample transform stage: what one worker does with one native batch.

A worker (a thread of the thread executor or a process of the process executor) takes a
batch the native pipeline collated, splits it into samples (views of the batch), decodes
the image fields (NOTE [image decode]), calls the user's ``transform`` on each sample, and
collates the results into new batch tensors. Both executors run exactly this code, so they
give the same batches.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from ..contract import PlannedDataset, cpu_budget
from ..errors import ImageDecodeError, LoaderStateError
from .collate import _Alloc, collate_samples
from .context import SampleContext, _splitmix64, sample_seeds
from .image import ImageDecode

EXECUTORS = ("auto", "threads", "processes")  # See NOTE [executor choice] in auto.py


def takes_context(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` accepts a second positional argument (the ``SampleContext``)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    n = 0
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            return True
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            n += 1
    return n >= 2


@dataclasses.dataclass
class TransformSpec:
    """What the workers apply to every batch of one epoch.

    ``collate``: the function that makes a batch of the transformed samples
    (``collate_samples`` or the loader's ``collate_fn``); None yields the list of samples
    (a loader with ``batch_size=None``). ``seed``/``epoch``: NOTE [sample seeds].
    ``seed_globals``: also seed ``random``, ``numpy.random`` and ``torch`` from each
    sample's seed before its transform (the process executor, where a worker runs one
    sample at a time, so transforms drawing from the global generators are reproducible).
    """

    transform: Callable[..., Any] | None
    decode: dict[str, ImageDecode]
    collate: Callable[[list[Any]], Any] | None
    seed: int
    epoch: int
    seed_globals: bool = False

    def __post_init__(self) -> None:
        self.with_context = self.transform is not None and takes_context(self.transform)


def record_name(ds: PlannedDataset, unit: int, record: int) -> str:
    """Where a sample comes from, for messages: the dataset's own words (``PlannedDataset.record_name``)."""
    return str(ds.record_name(int(unit), int(record)))


def _note(e: BaseException, text: str) -> None:
    add = getattr(e, "add_note", None)  # Python >= 3.11
    if add is not None:
        add(text)


class _RemoteTraceback(Exception):
    """A worker process's traceback, the cause of the pyloader error re-raised in the parent."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class _NotedExceptionWrapper:
    """torch's ``ExceptionWrapper`` (type and traceback across a process) that keeps the exception's notes apart.

    The notes (PEP 678: the shard and record ``run_batch`` adds) are sent as notes, not folded
    into the traceback text, and the exception re-raised in the parent carries them in
    ``__notes__``, as the threads executor's does. One of pyloader's own errors (a
    ``CollateError``, an ``ImageDecodeError``: messages that name the fix) is sent whole and
    re-raised as itself, its message and attributes as the worker raised them, with the
    worker's traceback as its ``__cause__`` (as ``concurrent.futures`` does); any other
    exception is re-raised as torch's DataLoader does (``Caught ... in ...``, the traceback
    in its message).
    """

    def __init__(self, where: str) -> None:
        import pickle

        from torch._utils import ExceptionWrapper

        exc = sys.exc_info()[1]
        notes = getattr(exc, "__notes__", None)
        self.notes = [str(n) for n in notes] if isinstance(notes, list) else []
        if self.notes:
            delattr(exc, "__notes__")  # formatted without them; put back below
        self.original: bytes | None = None
        try:
            self.wrapped = ExceptionWrapper(where=where)
            if exc is not None and type(exc).__module__ == "pyloader.errors":
                try:
                    self.original = pickle.dumps(exc)
                    pickle.loads(self.original)  # (one whose constructor needs other arguments: as any other)
                except Exception:  # noqa: BLE001
                    self.original = None
        finally:
            if self.notes:
                setattr(exc, "__notes__", notes)  # noqa: B010 - an attribute mypy does not know

    def reraise(self) -> NoReturn:
        if self.original is not None:
            import pickle

            err = pickle.loads(self.original)
            for n in self.notes:
                _note(err, n)
            raise err from _RemoteTraceback(f"{self.wrapped.where}:\n{self.wrapped.exc_msg}")
        try:
            self.wrapped.reraise()
        except BaseException as e:
            for n in self.notes:
                _note(e, n)
            raise
        raise AssertionError("unreachable")  # reraise() always raises


@dataclasses.dataclass
class BatchWork:
    """One batch's outcome: the collated result (or samples), and what it cost."""

    result: Any
    samples: int = 0
    skipped: int = 0
    transform_ns: int = 0
    decode_ns: int = 0
    cpu_ns: int = 0  # the worker's CPU time for the batch (thread time: not the time it waited)
    queued_ns: int = 0  # the time it was ready to run but waited for a CPU (the probe's runs only)


class _Stopped(Exception):
    """The executor is shutting down: the batch in progress is abandoned (between two samples)."""


# NOTE [stop checks]: between two samples a process worker asks whether its job is still on
# (``jobs[w]``, in memory shared with the parent) and whether its parent lives (``getppid``).
# Right after a transform both are slow: the shared page has left the caches and the TLB,
# and the system call enters a kernel that has too. Measured in a worker of the numpy
# features transform (~440 us a sample): 2.0 us for the read and 4.0 us for the call, every
# sample, 1.4% of its time. So ``run_batch`` calls ``stop`` at most every ``STOP_CHECK_S``
# (a clock read in the vDSO, warm: the loop times the transform with it), on either
# executor: an epoch left early stops its workers after the sample they are on, or within
# ``STOP_CHECK_S`` where samples are quicker.
STOP_CHECK_S = 0.02


def run_batch(spec: TransformSpec, ds: PlannedDataset, raw: Mapping[str, torch.Tensor], units: np.ndarray,
              records: np.ndarray, gidx: np.ndarray, worker: int,
              stop: Callable[[], bool] | None = None, alloc: _Alloc | None = None,
              progress: list[int] | None = None) -> BatchWork:
    """Decodes, transforms and collates one native batch (rows ``units``/``records``, global indices ``gidx``).

    Exceptions from ``transform`` propagate with their type and traceback, a note naming
    the sample's shard, record and worker added (Python >= 3.11); decode errors are
    ``ImageDecodeError`` naming them (or skipped, ``on_error="skip"``). ``stop``, checked
    before a sample (at most every ``STOP_CHECK_S``, NOTE [stop checks]), abandons the batch
    (``_Stopped``) so that shutting down waits for one sample (or ``STOP_CHECK_S``), not a
    batch. ``alloc``: where the default collation writes the batch's tensors
    (``collate_samples``); a ``collate_fn`` of the user's does not use it.
    ``progress[worker]`` counts the samples done (only this worker writes its entry), for
    the scaling probe (NOTE [executor choice]).
    """
    rows = len(units)
    seeds_u64 = sample_seeds(spec.seed, spec.epoch, gidx) if rows else np.empty(0, np.uint64)
    seeds: list[int] = seeds_u64.tolist()
    decode = list(spec.decode.items())
    with np.errstate(over="ignore"):
        dseeds = [_splitmix64(seeds_u64 ^ np.uint64(j + 1)).tolist() for j in range(len(decode))]
    fn = spec.transform
    seed_globals = _seed_globals if fn is not None and spec.seed_globals else None
    with_context = spec.with_context
    out: list[Any] = []
    skipped = 0
    t_dec = t_tr = 0
    clock = time.perf_counter_ns
    cpu0 = time.thread_time_ns()
    queued0 = queued_ns() if progress is not None else 0
    split = getattr(ds, "samples", None)  # every row at once, where the dataset can (UnitDataset.samples)
    rows_split: list[Any] | None = split(raw) if split is not None and rows else None
    stop_due = 0.0
    for i in range(rows):
        if stop is not None:  # NOTE [stop checks]
            now = time.monotonic()
            if now >= stop_due:
                stop_due = now + STOP_CHECK_S
                if stop():
                    raise _Stopped
        if rows_split is not None:
            sample, rows_split[i] = rows_split[i], None
        else:
            sample = ds.sample(raw, i)
        seed = seeds[i]
        if decode:
            t0 = clock()
            skip = False
            for j, (name, dec) in enumerate(decode):
                try:
                    sample[name] = torch.from_numpy(dec.decode(sample[name], dseeds[j][i]))
                except ImageDecodeError as e:
                    if dec.on_error == "skip":
                        skip = True
                        break
                    err = ImageDecodeError(f"{record_name(ds, units[i], records[i])}, field {name!r}: {e}")
                    err.shard = record_name(ds, units[i], records[i])
                    err.record, err.field = int(records[i]), name
                    raise err from e.__cause__
            t_dec += clock() - t0
            if skip:
                skipped += 1
                continue
        if fn is not None:
            if seed_globals is not None:
                seed_globals(seed)
            t1 = clock()
            try:
                if with_context:
                    ctx = SampleContext(seed, spec.epoch, int(gidx[i]), record_name(ds, units[i], records[i]),
                                        int(records[i]), worker)
                    sample = fn(sample, ctx)
                else:
                    sample = fn(sample)
            except Exception as e:
                _note(e, f"raised by the transform in pyloader transform worker {worker}, on the sample at "
                         f"{record_name(ds, units[i], records[i])} (global index {int(gidx[i])})")
                raise
            t_tr += clock() - t1
        if progress is not None:
            progress[worker] += 1
        out.append(sample)
    result: Any = out
    if spec.collate is not None:
        if not out:
            result = None  # every sample skipped: no batch
        else:
            result = (collate_samples(out, alloc) if alloc is not None and spec.collate is collate_samples
                      else spec.collate(out))
    return BatchWork(result, len(out), skipped, t_tr, t_dec, time.thread_time_ns() - cpu0,
                     queued_ns() - queued0 if progress is not None else 0)


def queued_ns() -> int:
    """The nanoseconds the calling thread has been ready to run but waited for a CPU; 0 where unknown.

    Linux's schedstat (its second field). On a machine whose CPUs others keep busy, a thread
    that computes throughout gets a CPU only part of its time: its CPU time alone would read
    as a transform that waits (NOTE [executor choice]). About 20 us a call.
    """
    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        return 0
    try:
        return int(os.read(fd, 128).split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    finally:
        os.close(fd)


# NOTE [worker threads]: a transform worker computes on one core, so the libraries it calls
# must not start threads of their own: with W workers each running a library that starts a
# thread per core, W x cores threads fight for the cores (measured: two worker processes of
# a numpy transform whose matrix product ran on OpenBLAS's threads made 0.14x the samples of
# one). So every worker runs torch on one thread (``torch.set_num_threads(1)``, as torch's
# DataLoader does in its workers) and the BLAS and OpenMP libraries loaded in the process on
# one thread (``threadpoolctl``; an environment variable such as ``OPENBLAS_NUM_THREADS`` is
# read once, when the library loads, and numpy has loaded it long before). A worker process
# sets both for good. In the loader's own process (the thread executor) both are process-wide
# -- torch's thread count too: ``torch.set_num_threads`` sets it for every thread -- so they
# hold while a thread stream is open, and the values from before the first such stream are
# put back when the last one closes (the training loop's own torch and numpy run on one
# thread meanwhile).
# OpenBLAS stops its thread server in a process that forks, and setting its thread count in
# the forked worker starts the server again: a thread that spins for ~0.1 s of CPU waiting
# for work before it sleeps (measured: 103 ms of CPU in a 0.3 s sleep right after the limit)
# -- in each worker of each epoch's pool (``persistent_workers=False``), on the cores the
# transform needs. One BLAS thread needs no server, so a worker process stops it again
# (``blas_thread_shutdown_``, the function OpenBLAS itself calls before a fork); a BLAS
# call then runs on the calling thread. Measured on a light image transform (2 workers, a
# pool per epoch): the first batch of each epoch 74-83 ms after iter() before, the workers'
# first two batches 50 and 40 ms of CPU against 17 for later ones. The libraries are looked
# up once in the loader's process before a pool forks (``prepare_native_limits``): a worker
# then sets their limits in 0.6 ms instead of 5-6 ms, at every epoch's pool.
_blas_lock = threading.Lock()
_blas_users = 0
_blas_limiter: Any = None
_torch_threads: int | None = None  # torch's intra-op thread count before the first thread stream
_found_libraries: Any = None  # (threadpoolctl's ThreadpoolController, len(sys.modules) when made): _libraries


# NOTE [worker heap]: a transform worker process allocates the same buffers sample after
# sample (a decoded image, its float tensor, a batch of outputs until they are collated), and
# frees them batch after batch. glibc's malloc serves a block over its mmap threshold (128 KiB
# at start, raised only when such a block is freed) with a fresh mapping, and gives the top
# of its heap back to the kernel once more than the trim threshold (twice the other) is
# free: so a worker whose samples' tensors were larger, or whose batch of outputs outgrew
# the trim threshold, faulted their pages in again after every batch (on the ~2 ms image
# pipeline of bench_user_transforms.py, 602 KB float tensors kept 64 at a time: 37-72 page
# faults a sample in a loop of its batches, none with the thresholds below), and a new
# worker of every epoch's pool started from thresholds its parent's history set. A worker
# process is the transform's alone, so it sets both thresholds for good at start: blocks up
# to 32 MiB (glibc's largest mmap threshold) come from the heap, and the heap keeps up to
# 256 MiB free for the next batch. Its memory at rest is then its largest batch's, which it
# needed anyway; the loader's own process (the thread executor) is the user's and is not
# touched. The same holds for the shared-memory slots a worker writes its batches into
# (NOTE [process executor] in processes.py): a new slot, and every slot a worker of a new pool
# inherits (a fork copies no page table entry of a shared mapping), would fault once per 4 KiB
# page of its first batch (1.3 us a page here: 12 ms for a 38 MB batch of 224 px float
# images), so a worker maps a slot's pages in one ``MADV_POPULATE_WRITE`` call (3-5 ms) before
# it first writes there (``_Slot.warm`` in pool.py). Measured together on that image
# pipeline (2 workers, a pool per epoch, 6 alternated runs of 3 epochs): 2-4% more samples/s
# and 2-4% less CPU a sample (medians).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt() parameters
_KEEP_HEAP_BYTES, _HEAP_BLOCK_BYTES = 256 << 20, 32 << 20


def keep_worker_heap() -> bool:
    """Sets a worker process's malloc to keep its freed memory (NOTE [worker heap]); False where it cannot."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (or no mallopt at all)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCK_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_HEAP_BYTES))


def as_worker_process() -> None:
    """What a transform worker process sets for good at its start, and a ceiling's process to run as one.

    One thread for torch and the BLAS libraries (NOTE [worker threads]) and a malloc that keeps
    the memory its batches free (NOTE [worker heap]).
    """
    limit_native_threads(process=True)
    keep_worker_heap()


def _reset_blas_lock() -> None:
    global _blas_lock
    _blas_lock = threading.Lock()  # (a thread of the parent may have held it at the fork)


os.register_at_fork(after_in_child=_reset_blas_lock)


def limit_native_threads(process: bool) -> None:
    """One torch thread and one BLAS/OpenMP thread (NOTE [worker threads]).

    ``process``: in a worker process, for good; else as one more user of the process-wide
    limits, given back by ``unlimit_native_threads()``.
    """
    global _blas_users, _blas_limiter, _torch_threads
    with _blas_lock:
        _blas_users += 1
        if _torch_threads is None and not process:
            _torch_threads = torch.get_num_threads()  # (before the limit below: torch's setting moves OpenMP's)
        if _blas_limiter is None:
            found = _libraries()
            if found is not None:
                _blas_limiter = found.limit(limits=1)
                if process:
                    _stop_blas_servers(found)
        if process:
            _blas_limiter = False  # never restored in a worker process
        torch.set_num_threads(1)


def prepare_native_limits() -> None:
    """Finds the loaded BLAS/OpenMP libraries before a pool forks its workers (NOTE [worker threads]).

    Each forked worker then only sets their limits (0.5 ms) instead of looking them up
    again (4-6 ms a worker, every epoch's pool).
    """
    _libraries()


def _libraries() -> Any:
    """The controller (threadpoolctl's) of the BLAS/OpenMP libraries loaded; None without threadpoolctl.

    Kept and looked up again when modules were imported since (a library loads with a module).
    """
    global _found_libraries
    if _found_libraries is None or _found_libraries[1] != len(sys.modules):
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # (a dependency; an install without it runs, oversubscribed)
            return None
        _found_libraries = (ThreadpoolController(), len(sys.modules))
    return _found_libraries[0]


def _stop_blas_servers(found: Any) -> None:
    """Stops the OpenBLAS thread servers that setting the limit started in this worker (NOTE [worker threads])."""
    for lib in found.lib_controllers:
        if lib.internal_api == "openblas":
            stop = getattr(lib.dynlib, "blas_thread_shutdown_", None)
            if stop is not None:
                stop()


def unlimit_native_threads() -> None:
    """One user of the process-wide limits less; the last one restores the values from before."""
    global _blas_users, _blas_limiter, _torch_threads
    with _blas_lock:
        _blas_users = max(0, _blas_users - 1)
        if _blas_users:
            return
        try:
            if _blas_limiter:
                _blas_limiter.restore_original_limits()
        finally:
            _blas_limiter = None
            if _torch_threads is not None:
                torch.set_num_threads(_torch_threads)
                _torch_threads = None


def _seed_globals(seed: int) -> None:
    """Seeds ``random``, ``numpy.random`` and torch's CPU generator from a sample's seed (NOTE [sample seeds]).

    The same state as ``random.seed(seed)``, ``np.random.seed(seed & 0xFFFFFFFF)`` and
    ``torch.default_generator.manual_seed(seed)``, through the functions those call (bound
    once per process): 8.0-8.1 us a sample where the three calls took 8.9-9.0, most of it
    the Mersenne Twister's own initialisation (``random``: 4.6 us).
    """
    seeders = _seeders or _bind_seeders()
    seeders[0](seeders[1], seed)
    seeders[1].gauss_next = None  # as random.Random.seed leaves it
    seeders[2](seed & 0xFFFFFFFF)
    # The CPU generator only: torch.manual_seed also queues a seed for every lazy device
    # module (CUDA, XPU, MTIA), recording a stack trace each time (about 1 ms per sample).
    seeders[3](seed)


_seeders: tuple[Any, ...] = ()


def _bind_seeders() -> tuple[Any, ...]:
    """(``_random.Random.seed``, ``random``'s shared instance, ``np.random.seed``, the torch generator's ``manual_seed``)."""
    global _seeders
    import _random
    import random

    _seeders = (_random.Random.seed, random._inst, np.random.seed, torch.default_generator.manual_seed)
    return _seeders


class TransformStats:
    """Counters of the transform stage, shared by both executors (``stats()`` keys ``transform_*``)."""

    def __init__(self, executor: str, workers: int) -> None:
        self.executor, self.workers = executor, workers
        self.samples = self.skipped = self.batches = 0
        self.transform_ns = self.decode_ns = self.busy_ns = self.wait_ns = self.cpu_ns = self.queued_ns = 0
        self.start = time.perf_counter()
        self.end: float | None = None
        self.first_ns: dict[int, int] = {}  # worker -> when it began its first batch (NOTE [worker start])
        self._lock = threading.Lock()

    def began(self, worker: int, ns: int) -> None:
        """Worker ``worker`` began a batch at ``ns`` (``time.perf_counter_ns()``, one clock for every process)."""
        if worker not in self.first_ns or ns < self.first_ns[worker]:
            self.first_ns[worker] = ns

    def start_delay_s(self) -> float | None:
        """How long after this stage began its workers began their first batches (their mean); None: not measured."""
        firsts = list(self.first_ns.values())  # (a copy: stats() may be read from another thread)
        if not firsts:
            return None
        return sum(max(0.0, ns / 1e9 - self.start) for ns in firsts) / len(firsts)

    def add(self, work: BatchWork, busy_ns: int) -> None:
        """Counts one batch a worker made in ``busy_ns``."""
        with self._lock:
            self.batches += 1
            self.samples += work.samples
            self.skipped += work.skipped
            self.transform_ns += work.transform_ns
            self.cpu_ns += work.cpu_ns
            self.queued_ns += work.queued_ns
            self.decode_ns += work.decode_ns
            self.busy_ns += busy_ns

    def worker_s(self) -> float:
        """The workers' time available so far: the wall time since the start times the workers."""
        return ((self.end or time.perf_counter()) - self.start) * self.workers

    def as_dict(self, read_wait_s: float | None = None) -> dict[str, Any]:
        """The counters and what they imply (``transform_hint``, ``stage_figures``)."""
        return stage_figures([self], wall_s=(self.end or time.perf_counter()) - self.start, executor=self.executor,
                             workers=self.workers, read_wait_s=read_wait_s)


# The transform stage's verdicts (``transform_hint``; pyloader/bench/diagnosis.py draws the
# bench's from the same shares): the consumer "rarely waits" under RARELY_WAITS of its time;
# the workers bind at or above BUSY_AT busy; reading binds when the workers waited for the
# native pipeline's batches at least READ_SHARE as long as the consumer waited for theirs.
RARELY_WAITS = 0.05
BUSY_AT = 0.85
READ_SHARE = 0.5
# Workers on a CPU under this share of their busy time are waiting (sleep, I/O): more of them help.
WAITING_CPU = 0.3


# NOTE [worker start]: the process executor's workers of a pool started for the epoch
# (``persistent_workers=False``, torch's default and the loader's) are forked at ``iter()``
# and begin their first batch only after the fork, their setup and the shards' opening: 16-38
# ms here, two workers, a light image transform; and whatever the transform keeps warm in a
# worker (a tokenizer's cache) starts cold every epoch. On epochs of a second or less that is
# up to a tenth of the epoch (a pool kept across epochs ran 0.89-1.28x as fast in epoch 3 on
# light, medium and numpy transforms, mostly above 1: bench_fresh_epochs.py), on an epoch of
# minutes nothing. So each worker's first batch sends
# when it began (``time.perf_counter_ns()``: one clock for every process), ``stats()`` prints
# their mean delay after the epoch's start (``transform_worker_start_s``; None where the
# workers were kept from an earlier epoch, or are threads), and the hint names
# ``persistent_workers=True`` where that delay is at least START_SHARE of the epoch -- a
# choice the user makes (the kept workers keep the dataset and transform as they were when
# they started), not one the loader makes for them.
START_SHARE = 0.05


def transform_hint(*, wait_fraction: float, busy: float, workers: int, executor: str, wall_s: float,
                   read_wait_s: float | None, cpus: int, cpu_share: float | None = None,
                   start_s: float | None = None) -> str:
    """Whether the transform, reading or neither binds, from the figures ``stats()`` prints beside it.

    ``read_wait_s``: the workers' wait for native batches (``native_wait_s``; None where the
    workers read their own shards, as processes do: their reading is then in ``busy``);
    ``cpu_share``: the share of the workers' busy time they ran on a CPU (None: not measured);
    ``start_s``: how long after the epoch began the workers began (NOTE [worker start]).
    """
    verdict = _verdict(wait_fraction=wait_fraction, busy=busy, workers=workers, executor=executor, wall_s=wall_s,
                       read_wait_s=read_wait_s, cpus=cpus, cpu_share=cpu_share)
    if start_s is None or wall_s <= 0 or start_s < START_SHARE * wall_s:
        return verdict
    return (f"{verdict}; the worker processes began {start_s * 1e3:.0f} ms after the epoch's start "
            f"({start_s / wall_s:.0%} of its {wall_s:.3f} s): persistent_workers=True keeps them from one epoch to "
            "the next (with the dataset and transform as they were when they started, and what the transform keeps "
            "warm in them, such as a tokenizer's cache)")


def _verdict(*, wait_fraction: float, busy: float, workers: int, executor: str, wall_s: float,
             read_wait_s: float | None, cpus: int, cpu_share: float | None) -> str:
    waits, busy_s = f"{wait_fraction:.0%}", f"{busy:.0%}"
    if wait_fraction < RARELY_WAITS:
        return f"enough: the consumer waited only {waits} of the time for transformed batches"
    if busy >= BUSY_AT:
        binds = f"the consumer waits {waits} of the time and the {workers} transform worker(s) are busy {busy_s} of it"
        gil = "; a transform that holds the GIL scales on executor='processes'" if executor == "threads" else ""
        if workers < cpus:
            return f"more workers would help: {binds} ({workers} of the {cpus} CPUs this process may use{gil})"
        if cpu_share is not None and cpu_share < WAITING_CPU:
            return (f"more workers would help: {binds}, but on a CPU only {cpu_share:.0%} of that: the transform "
                    f"waits (sleep, I/O), so workers beyond the {cpus} CPUs this process may use still help")
        if cpu_share is None:
            return (f"the transform binds: {binds}, and the workers match the {cpus} CPUs this process may use: more "
                    "workers would help only a transform that waits (sleep, I/O); else a cheaper transform or more "
                    f"CPUs{gil}")
        return (f"the transform binds: {binds}, on a CPU {cpu_share:.0%} of that, and the workers already match the "
                f"{cpus} CPUs this process may use: a cheaper transform or more CPUs{gil}")
    idle = f"the consumer waits {waits} of the time but the transform workers are busy only {busy_s}"
    if read_wait_s is None:
        return (f"neither the transform nor reading binds: {idle}, their own reading included: the wait is in "
                "handing batches to the consumer and the start of the epoch")
    read = f"the workers waited {read_wait_s:.3f} s of the {wall_s:.3f} s for the native pipeline (native_wait_s)"
    if read_wait_s >= READ_SHARE * wait_fraction * wall_s and read_wait_s >= RARELY_WAITS * wall_s:
        return f"reading limits, not the transform: {idle}, and {read}; see shard_wait_s for opening shards"
    return (f"neither the transform nor reading binds: {idle}, and {read}: the wait is in handing batches to the "
            "consumer and the start of the epoch")


def stage_figures(parts: Sequence[TransformStats], *, wall_s: float, executor: str, workers: int,
                  read_wait_s: float | None = None) -> dict[str, Any]:
    """The ``transform_*`` figures of an epoch made by ``parts`` (two where executor="auto" switched).

    Counters add up over the parts; the busy share is their busy time over their workers'
    time; the consumer's wait is over ``wall_s``, the epoch's wall time.
    """
    samples = sum(p.samples for p in parts)
    skipped = sum(p.skipped for p in parts)
    work_ns = sum(p.transform_ns + p.decode_ns for p in parts)
    capacity = sum(p.worker_s() for p in parts)
    busy_ns = sum(p.busy_ns for p in parts)
    busy = busy_ns / 1e9 / capacity if capacity > 0 else 0.0
    waited = sum(p.wait_ns for p in parts) / 1e9
    measured = all(p.cpu_ns > 0 for p in parts if p.busy_ns > 0)  # processes do not send theirs
    cpu_share = sum(p.cpu_ns for p in parts) / busy_ns if measured and busy_ns > 0 else None
    wait_fraction = waited / wall_s if wall_s > 0 else 0.0
    delays = [d for d in (p.start_delay_s() for p in parts) if d is not None]
    start_s = max(delays) if delays else None
    return {
        "transform_executor": executor,
        "transform_workers": workers,
        "transform_batches": sum(p.batches for p in parts),
        "transformed_samples": samples,
        "skipped_samples": skipped,
        "transform_s": sum(p.transform_ns for p in parts) / 1e9,
        "decode_s": sum(p.decode_ns for p in parts) / 1e9,
        "transform_per_sample_us": work_ns / max(1, samples + skipped) / 1e3,
        "transform_busy_fraction": busy,
        "transform_hint": transform_hint(wait_fraction=wait_fraction, busy=busy, workers=workers, executor=executor,
                                         wall_s=wall_s, read_wait_s=read_wait_s, cpus=cpu_budget(),
                                         cpu_share=cpu_share, start_s=start_s),
        "transform_worker_start_s": start_s,
        "consumer_wait_s": waited,
        "wait_fraction": wait_fraction,
    }


class TransformStream:
    """What both executors' streams share: the ``BatchStream`` protocol around ``_take()``.

    ``_take()`` returns the next batch in plan order, None for a batch whose samples were
    all skipped (``ImageDecode(on_error="skip")``: it still counts as read, in ``consumed``),
    or raises (the batch's error, ``StopIteration`` at the end via ``_end()``).
    """

    def __init__(self, executor: str, workers: int, length: int) -> None:
        self._len = length
        self._stats = TransformStats(executor, workers)
        self.timeout = 0.0  # seconds each next() may wait (0: forever)
        self.on_finish: Any = None  # called once with stats() at the end or at close()
        self.consumed: Any = None  # the loader's ConsumedCount, if any
        self.extra: dict[str, Callable[[], Any]] = {}  # stats() keys the loader adds (executor_choice, autotune)
        self._pid = os.getpid()

    def __iter__(self) -> TransformStream:
        return self

    def __len__(self) -> int:
        return self._len

    def __next__(self) -> Any:
        if os.getpid() != self._pid:
            # A forked child: the workers are the parent's (NOTE [loader across fork] in
            # pyloader/loader/dataloader.py); a process worker's pipe would hand the parent's
            # batches to the child.
            raise LoaderStateError("iterator used in a forked child; create a new iterator after fork")
        while True:
            item = self._take()
            if item is not None:
                return item
            if self.consumed is not None:
                self.consumed.batches += 1

    def _take(self) -> Any:
        raise NotImplementedError

    def _end(self) -> NoReturn:
        """The epoch is over: freeze the wall time, report the stats once, stop."""
        if self._stats.end is None:
            self._stats.end = time.perf_counter()
        self._finish()
        raise StopIteration

    def close(self) -> None:
        """Stops the workers. Idempotent."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """The stage's counters (``TransformStats.as_dict``), with the loader's ``extra`` keys."""
        return self._with_extra(self._stats.as_dict())

    def _with_extra(self, s: dict[str, Any]) -> dict[str, Any]:
        for k, f in self.extra.items():
            s[k] = f()
        return s

    def _finish(self) -> None:
        cb, self.on_finish = self.on_finish, None
        if cb is not None:
            cb(self.stats())

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


__all__ = ["EXECUTORS", "STOP_CHECK_S", "queued_ns", "limit_native_threads", "keep_worker_heap", "as_worker_process", "unlimit_native_threads", "prepare_native_limits", "takes_context", "TransformSpec", "record_name", "BatchWork", "run_batch", "TransformStats",
           "RARELY_WAITS", "BUSY_AT", "READ_SHARE", "WAITING_CPU", "START_SHARE", "transform_hint", "stage_figures",
           "TransformStream", "collate_samples"]
