"""The worker processes of the process executor, kept across epochs (NOTE [transform pool]).

NOTE [transform pool]: a ``WorkerPool`` is a set of worker processes started once for a
(dataset, transform, decoders, collate) and given one *job* per epoch: the rows of the
batches it is to make (See NOTE [process executor] in processes.py for what a worker does
with them). A job has a number (``jid``); the pool's shared array ``jobs`` holds, per
worker, the job it is to work on (-1: none). The parent sends a worker ``("job", jid,
payload)`` (a new pool's workers are forked with theirs, See NOTE [first job at fork]) and
then credits (the tickets it may make next, in order); the worker makes a
credited ticket only while ``jobs[w]`` is that job, and checks it between two samples, so
an epoch the loop leaves early (a ``break``, a closed iterator) stops its workers after the
sample they are on (NOTE [stop checks]): the parent sets ``jobs[w] = -1``, the next job finds them idle.
Every result carries its job's number; a result of a job that is over is dropped by the
parent, and the slot it filled is released at once. The pool lives as long as the loader
that made it (``persistent_workers=True``, as torch's) or one epoch (``persistent_workers
=False``: the epoch's stream shuts it down), and is shut down (workers stopped, slot files
removed) when it is dropped, at interpreter exit, or when one of its workers died (a
pool with a dead worker is never reused: the next epoch makes a new one). A pool of one
epoch tells each worker to exit as soon as the parent has its last batch (``retire``),
while the loop still takes the batches before it, and the epoch ends without waiting for
the last of them to exit (See NOTE [late reaping] in reap.py; the two took 11-12 ms and
8-13 ms here at every epoch's end, a 0.2-0.3 s epoch of a numpy transform). A forked child
never uses its parent's pool (``WorkerPool.usable``). Workers read the dataset object
they were started with: changes made to it, or to what the transform reads, after the pool
started are not seen by them (as with torch's persistent workers).

NOTE [slots across pools]: with ``persistent_workers=False`` every epoch forks a new pool, and its workers made their
slots afresh: new shared memory, each page allocated, zeroed and faulted in again (a 38.5 MB batch of 224 px float
images: ~30 ms to allocate and 65-110 ms to fault in here, three slots a worker); the workers used 8% more CPU a
sample than a kept pool's. So a pool that ends normally leaves its slots to the loader (``SlotReserve``): its ``busy``
flags and the parent's mappings of every slot it saw. The next pool (forked, of no more workers) adopts them: its
workers are forked with those mappings and start with them as their slots (same generation, so the parent reuses its
mapping too), sized for the batches before, so a worker's first batch is collated straight into one (``_Slots.hint``;
without it, into new tensors copied there after: 25-30 ms more of each new worker's first batch of those images); a
slot whose tensors the loop still holds stays busy until they are dropped, as within an epoch. A broken pool (a worker
died), another start method or more workers start afresh. The memory stays allocated between epochs, as a kept pool's
does; it goes with the loader. The new workers still fault the inherited pages into their own page tables (a fork does
not copy a shared mapping's), but nothing is allocated or zeroed: the workers' CPU a sample 2360-2458 us against
2412-2586 us (system time 264-275 against 321-387 us), 3 runs each.

NOTE [warm imports]: a worker forked from a process that never ran the transform imports
what the transform imports (PIL and its image plugins, a tokenizer's bindings) on its first
sample: 60-70 ms a worker here for a PIL pipeline, in every worker of every epoch's pool
with ``persistent_workers=False`` (the default), where the thread probe of executor="auto"
once ran the transform in the loader's process first (NOTE [executor choice]). So each
worker sends the names of the modules it imported that its parent had not (``("mods",
names)``, after a batch, once), and before the next pool forks its workers the loader's
process imports them (``warm_imports``; at most ``MAX_IMPORTS`` names, each tried once, a
failure ignored): the next epoch's workers start with them imported. Only modules are
imported, never the transform called, so nothing of the user's runs in the loader's process
but module imports its transform already made in the workers. A worker's new modules are the
entries of ``sys.modules`` (in import order) past its count at the fork, read from the end:
a set of every name made at its start wrote to each name's object, and a fresh fork copies
each page it writes (1.6-2.0 ms before its first sample, 1,202 modules).

NOTE [first job at fork]: a new pool (every epoch's with ``persistent_workers=False``, a kept one's first) is made
without workers, and the stream that uses it forks each worker with its job and first credits in the process's
arguments (``grow(first=...)``: with fork they are inherited, nothing is pickled or sent). A worker starts on its
first batch as soon as it is forked, while the loader's process forks the next one (a fork of a process with torch
loaded takes 3.7-8.4 ms here); before, each waited for its job through its pipe, sent once every worker was forked.
Later jobs of a kept pool come through the pipe as before.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import gc
import itertools
import math
import mmap
import multiprocessing
import os
import secrets
import signal
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import pyloader._C as _C

from ..contract import PlannedDataset
from ..errors import SharedMemoryError
from ..format.owner import owner
from .reap import reap_later, reap_now
from .stage import TransformSpec, _Stopped, as_worker_process, prepare_native_limits, queued_ns, run_batch

# Slots per worker: batches the loop may hold from one worker at once (a worker whose slots
# are all held waits for one; each holds one batch, so /dev/shm bounds them first).
MAX_SLOTS = 1024
_ALIGN = 64
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # (Linux 5.14; Python knows it from 3.12)
_IDLE = -1  # jobs[w] of a worker with nothing to do

# The parent's ends of every pool's worker pipes: a forked child closes its copies (See NOTE [transform worker deaths]).
_PARENT_ENDS: weakref.WeakSet[Any] = weakref.WeakSet()
# Pools whose workers may be running: shut down at interpreter exit.
_LIVE: weakref.WeakSet[WorkerPool] = weakref.WeakSet()
# Modules a worker imported that this process had not (NOTE [warm imports]).
WORKER_IMPORTS: set[str] = set()
MAX_IMPORTS = 4096  # names kept at most
_TRIED: set[str] = set()  # names warm_imports tried (each once)


def note_imports(names: object) -> None:
    """Keeps the module names a worker sent (NOTE [warm imports]): strings not tried before, ``MAX_IMPORTS`` at most."""
    if not isinstance(names, list):
        return
    for name in names:
        if len(WORKER_IMPORTS) + len(_TRIED) >= MAX_IMPORTS:
            return
        if isinstance(name, str) and name not in _TRIED:
            WORKER_IMPORTS.add(name)


def warm_imports() -> int:
    """Imports here the modules earlier workers imported (NOTE [warm imports]); returns how many were new."""
    import importlib

    n = 0
    for name in sorted(WORKER_IMPORTS):
        if name in sys.modules:  # (imported with an earlier one)
            WORKER_IMPORTS.discard(name)
            _TRIED.add(name)
            continue
        try:
            importlib.import_module(name)
            n += 1
        except Exception:  # noqa: BLE001 - a module that will not import here: the workers import it themselves
            pass
        finally:
            WORKER_IMPORTS.discard(name)
            _TRIED.add(name)
    return n


def _close_parent_ends() -> None:
    with contextlib.suppress(Exception):
        for conn in list(_PARENT_ENDS):
            with contextlib.suppress(Exception):
                conn.close()
        _PARENT_ENDS.clear()


os.register_at_fork(after_in_child=_close_parent_ends)


def _shutdown_live() -> None:
    for pool in list(_LIVE):
        with contextlib.suppress(Exception):
            pool.shutdown()
    reap_now(_STOP_GRACE_S)  # See NOTE [late reaping] in reap.py


atexit.register(_shutdown_live)


def shm_dir() -> str:
    """Where slots are made: ``$PYLOADER_SHM_DIR``, else ``/dev/shm``, else the temp dir."""
    d = os.environ.get("PYLOADER_SHM_DIR")
    if d:
        return d
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def slot_prefix(pid: int) -> str:
    """The start of the slot file names of the loader process ``pid`` of this host, boot and pid namespace."""
    return f"pyloader-{owner()}-{pid}-"


class _Leaf:
    """A tensor's place in a batch's structure, sent instead of the tensor."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Leaf, (self.i,))


def flatten(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor (and numeric numpy array) replaced by a ``_Leaf``; the tensors appended to ``leaves``."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return _Leaf(len(leaves) - 1)
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biuf":
        leaves.append(torch.from_numpy(np.ascontiguousarray(obj)))
        return _Leaf(len(leaves) - 1)
    if isinstance(obj, dict):
        return {k: flatten(v, leaves) for k, v in obj.items()}
    if isinstance(obj, list):
        return [flatten(v, leaves) for v in obj]
    if isinstance(obj, tuple):
        items = [flatten(v, leaves) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)  # (a namedtuple keeps its type)
    return obj


def unflatten(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """The inverse of ``flatten``."""
    if isinstance(obj, _Leaf):
        return leaves[obj.i]
    if isinstance(obj, dict):
        return {k: unflatten(v, leaves) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unflatten(v, leaves) for v in obj]
    if isinstance(obj, tuple):
        items = [unflatten(v, leaves) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


# -- the worker process ---------------------------------------------------------------

class _Slot:
    __slots__ = ("fd", "map", "size", "gen", "path", "cold")

    def __init__(self, fd: int, mp: mmap.mmap, size: int, gen: int, path: str) -> None:
        self.fd, self.map, self.size, self.gen, self.path = fd, mp, size, gen, path
        self.cold = True  # its pages are not mapped in this process yet (_Slots.slot_for)

    def warm(self) -> None:
        """Maps all its pages at once before this process first writes a batch there (See NOTE [worker heap] in stage.py)."""
        if self.cold:
            self.cold = False
            with contextlib.suppress(OSError, ValueError):  # (refused before Linux 5.14: the batch faults them in)
                self.map.madvise(_MADV_POPULATE_WRITE)


def shm_error(directory: str, need: int, e: OSError | None) -> SharedMemoryError:
    """The error for a slot of ``need`` bytes that ``directory`` has no room for."""
    try:
        st = os.statvfs(directory)
        free = f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"
    except OSError:
        free = "free space unknown"
    why = f" ({e.strerror})" if e is not None and e.strerror else ""
    return SharedMemoryError(e.errno if e is not None and e.errno else errno.ENOSPC,
        f"{directory}: no room for a transform batch of {need} bytes{why}; {free}. The process executor "
        f"returns batches through shared memory: make {directory} larger (in a container, --shm-size), "
        f"hold fewer batches, use fewer workers or a smaller prefetch, set PYLOADER_SHM_DIR to another "
        f"tmpfs, or use executor='threads' (no shared memory)")


class _Slots:
    """One worker's slots: files in the shm directory the parent maps (NOTE [process executor]).

    ``inherited``: slot -> (generation, mapping) of an earlier pool's slots this worker
    starts with (NOTE [slots across pools]).
    """

    def __init__(self, w: int, prefix: str, directory: str, busy: Any,
                 inherited: dict[int, tuple[int, mmap.mmap]] | None = None) -> None:
        self.w, self.prefix, self.dir, self.busy = w, prefix, directory, busy
        self.slots: list[_Slot | None] = []
        for s, (gen, mp) in sorted((inherited or {}).items()):
            if 0 <= s < MAX_SLOTS:
                self.slots.extend([None] * (s + 1 - len(self.slots)))
                self.slots[s] = _Slot(-1, mp, len(mp), gen, "")
        # The largest batch's bytes so far (the slot a batch goes to); see NOTE [slots across pools] for inherited ones.
        self.hint = min((len(mp) for _, mp in (inherited or {}).values()), default=0)
        self.raw: Any = None  # the native pool of its raw batches (its memory faulted in once), set by the worker

    def _make(self, s: int, size: int, gen: int) -> _Slot:
        path = os.path.join(self.dir, f"{self.prefix}-w{self.w}-s{s}-g{gen}")
        try:
            st = os.statvfs(self.dir)
            if st.f_bavail * st.f_frsize < size:
                raise shm_error(self.dir, size, None)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except SharedMemoryError:
            raise
        except OSError as e:
            raise shm_error(self.dir, size, e) from None
        try:
            os.posix_fallocate(fd, 0, size)
            mp = mmap.mmap(fd, size)
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise shm_error(self.dir, size, e) from None
        return _Slot(fd, mp, size, gen, path)

    def slot_for(self, size: int, stop: Callable[[], bool]) -> tuple[int, _Slot]:
        """A free slot of at least ``size`` bytes (made or grown as needed); waits while all are held."""
        while True:
            base = self.w * MAX_SLOTS
            for s, slot in enumerate(self.slots):
                if self.busy[base + s] == 0:
                    if slot is None or slot.size < size:
                        gen = 0 if slot is None else slot.gen + 1
                        if slot is not None:
                            self._drop(slot)
                        grown = size if slot is None else max(size, slot.size + slot.size // 4)
                        slot = self._make(s, grown, gen)
                        self.slots[s] = slot
                    slot.warm()
                    return s, slot
            if len(self.slots) < MAX_SLOTS:
                s = len(self.slots)
                made = self._make(s, size, 0)
                made.warm()
                self.slots.append(made)
                return s, made
            if stop():
                raise _Stopped
            time.sleep(0.002)

    def _drop(self, slot: _Slot, unlink: bool = True) -> None:
        with contextlib.suppress(Exception):
            slot.map.close()
        if slot.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(slot.fd)
        # A slot is regrown only once free, so the parent has mapped (and removed) it already;
        # an inherited slot has no file (NOTE [slots across pools]).
        if unlink and slot.path:
            with contextlib.suppress(OSError):
                os.unlink(slot.path)

    def close(self, unlink: bool) -> None:
        """Unmaps the slots; ``unlink``: also removes their files (the parent is gone and will not)."""
        for slot in self.slots:
            if slot is not None:
                self._drop(slot, unlink)
        self.slots = []


class _SlotWriter:
    """One batch's tensors in one of the worker's slots (NOTE [collate into the slot]).

    NOTE [collate into the slot]: the default collation (``collate_samples``) writes each
    stacked or padded field straight into a free slot (``alloc``), so a batch is written
    once, where the parent maps it. Collating into new tensors and copying them into the
    slot wrote it twice, and the new tensors' pages were faulted in afresh every batch
    (glibc gives a freed batch back to the kernel): 10% of a worker's time went to system
    calls and faults on a 38 MB image batch. The slot is picked at the first field, sized
    for the largest batch so far (``_Slots.hint``); a field that does not fit, and any
    tensor the collation did not place (a field of numbers, the lengths of a padded one,
    the result of a user's ``collate_fn``), is copied after the placed ones by ``place``.
    Where they do not all fit (the first batch, a larger one), the placed fields are copied
    out and the whole batch is laid out anew in a slot grown to it, as before.
    """

    def __init__(self, slots: _Slots, stop: Callable[[], bool]) -> None:
        self.slots, self.stop = slots, stop
        self.s = -1
        self.slot: _Slot | None = None
        self.end = 0  # the first free byte of the slot
        self.placed: dict[int, tuple[int, int]] = {}  # data_ptr -> (offset, bytes) of each tensor alloc made

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised ``shape``/``dtype`` tensor in the slot, or None where it does not fit."""
        n = math.prod(shape) * dtype.itemsize
        if n == 0:
            return None
        if self.slot is None:
            if self.slots.hint <= 0:
                return None  # the first batch: its size is not known yet
            self.s, self.slot = self.slots.slot_for(self.slots.hint, self.stop)
        if self.end + n > self.slot.size:
            return None
        t = torch.frombuffer(self.slot.map, dtype=torch.uint8, count=n, offset=self.end).view(dtype).reshape(shape)
        self.placed[t.data_ptr()] = (self.end, n)
        self.end += -(-n // _ALIGN) * _ALIGN
        return t

    def place(self, leaves: list[torch.Tensor]) -> tuple[int, _Slot | None, list[tuple[str, tuple[int, ...], int, int]]]:
        """Puts every leaf in the slot (copying those ``alloc`` did not make); (slot index, slot, metas)."""
        if not leaves:
            return -1, None, []
        at: list[int | None] = []
        end = self.end
        for leaf in leaves:
            n = leaf.numel() * leaf.element_size()
            where = self.placed.get(leaf.data_ptr()) if n and leaf.is_contiguous() else None
            if where is not None and where[1] == n:
                at.append(where[0])
            else:
                at.append(None)
                end += -(-n // _ALIGN) * _ALIGN
        if self.slot is None or end > self.slot.size:
            # Not all fit: the placed fields leave the slot, and the batch is laid out from 0
            # in a slot of its size (the slot is not held yet, so slot_for may grow it).
            for k, o in enumerate(at):
                if o is not None:
                    leaves[k] = leaves[k].clone()
            self.placed.clear()
            at = [None] * len(leaves)
            self.end = 0
            end = sum(-(-(x.numel() * x.element_size()) // _ALIGN) * _ALIGN for x in leaves)
            self.slot = None
            self.s, self.slot = self.slots.slot_for(max(end, _ALIGN), self.stop)
        slot = self.slot
        metas = []
        off = self.end
        for leaf, o in zip(leaves, at):
            n = leaf.numel() * leaf.element_size()
            if o is None:
                o, off = off, off + -(-n // _ALIGN) * _ALIGN
                if n:
                    dst = torch.frombuffer(slot.map, dtype=torch.uint8, count=n, offset=o)
                    dst.copy_(leaf.contiguous().reshape(-1).view(torch.uint8))
            metas.append((str(leaf.dtype).removeprefix("torch."), tuple(leaf.shape), o, n))
        self.slots.hint = max(self.slots.hint, end)
        return self.s, slot, metas


@dataclasses.dataclass
class JobPayload:
    """What a worker needs for one epoch: its rows, its tickets (in order), and the epoch's seeds."""

    units: np.ndarray
    records: np.ndarray
    gidx: np.ndarray
    tickets: np.ndarray
    batch_size: int
    seed: int
    epoch: int
    seed_globals: bool
    readers: int


# A worker's first job, given as it is forked: (job number, its payload, the credits it starts with).
_FirstJob = tuple[int, JobPayload, list[int]]


class _ParentGone(BaseException):
    """The parent's end of the pipe is closed: the worker has nobody to work for (not an error)."""


class _Job:
    def __init__(self, jid: int, p: JobPayload, base: TransformSpec) -> None:
        self.jid, self.p = jid, p
        self.spec = dataclasses.replace(base, seed=p.seed, epoch=p.epoch, seed_globals=p.seed_globals)
        self.next = 0  # the index in p.tickets of the next ticket to make
        self.stream: Any = None

    def close(self) -> None:
        if self.stream is not None:
            with contextlib.suppress(Exception):
                self.stream.close()
            self.stream = None


def _worker_main(w: int, ds: PlannedDataset, base: TransformSpec, conn: Any, busy: Any, jobs: Any, prefix: str,
                 directory: str, parent: int, inherited: dict[int, tuple[int, mmap.mmap]] | None = None,
                 first: _FirstJob | None = None) -> None:
    known = len(sys.modules)  # the parent's imports: the first `known` entries (NOTE [warm imports])
    from .stage import _NotedExceptionWrapper as ExceptionWrapper  # the notes reach the parent as notes

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    as_worker_process()  # one thread per library (NOTE [worker threads]), a heap kept (NOTE [worker heap])
    slots = _Slots(w, prefix, directory, busy, inherited)
    slots.raw = _C.SlotPool(num_fields=len(ds.fields))  # its raw batches' pool, kept across its jobs

    def parent_gone() -> bool:
        return os.getppid() != parent

    def send(msg: tuple[Any, ...]) -> None:
        try:
            conn.send(msg)
        except OSError:  # a broken pipe: the parent shut the pool down or died
            raise _ParentGone from None

    job: _Job | None = None
    pending: list[int] = []  # credits given with the first job (See NOTE [first job at fork])
    if first is not None:
        job, pending = _Job(first[0], first[1], base), list(first[2])
    try:
        while True:
            if len(sys.modules) != known:
                new = [m for m in itertools.islice(reversed(sys.modules), max(0, len(sys.modules) - known))
                       if isinstance(m, str) and "__main__" not in m][::-1]
                known = len(sys.modules)
                if new:
                    send(("mods", new[:MAX_IMPORTS]))
            msg: Any
            if pending:
                msg = pending.pop(0)
            else:
                while not conn.poll(1.0):
                    if parent_gone():
                        return
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # the parent closed its end or died
                    return
            if msg is None:
                return
            if isinstance(msg, tuple):  # ("job", jid, payload): a new epoch (See NOTE [transform pool])
                if job is not None:
                    job.close()
                job = _Job(msg[1], msg[2], base)
                continue
            t = int(msg)
            if job is None or jobs[w] != job.jid:
                continue  # a credit of a job that is over
            _make_ticket(w, t, job, ds, slots, jobs, send, parent_gone, ExceptionWrapper)
    except _ParentGone:
        return
    finally:
        if job is not None:
            job.close()
        # The parent may not have mapped the last slots yet: it removes the files (at shutdown).
        slots.close(unlink=parent_gone())


def _make_ticket(w: int, t: int, job: _Job, ds: PlannedDataset, slots: _Slots, jobs: Any,
                 send: Callable[[tuple[Any, ...]], None], parent_gone: Callable[[], bool], wrapper: Any) -> None:
    """Makes ticket ``t`` of ``job`` into a free slot and sends its layout (NOTE [process executor])."""
    p = job.p
    i = job.next
    if i >= len(p.tickets) or int(p.tickets[i]) != t:
        send(("err", job.jid, t, w, wrapper(where=f"in pyloader transform worker {w}: credit for batch {t}, "
                                                  f"which is not its next batch")))
        return
    job.next += 1
    t0 = time.perf_counter_ns()

    def stop() -> bool:
        return jobs[w] != job.jid or parent_gone()

    try:
        if job.stream is None:
            # Each worker streams its own share of a remote dataset through the node cache (sized by
            # this rank's workers), its one thread a batch ahead of the transform (prefetch=1: more
            # only held a batch more of fresh memory, 4 MB of 64 KB records: a pool per epoch +1.5-4%).
            job.stream = ds.batches(p.batch_size, plan=(p.units, p.records), drop_last=False, num_threads=1,
                                    prefetch=1, pool=slots.raw, readers=p.readers)
        raw = next(job.stream)
        sl = slice(i * p.batch_size, (i + 1) * p.batch_size)
        into = _SlotWriter(slots, stop)
        # The time making the batch (not waiting for records), its CPU time and its wait for a
        # CPU tell executor="auto" whether the transform computes (NOTE [executor choice]).
        q0, r0 = queued_ns(), time.perf_counter_ns()
        work = run_batch(job.spec, ds, raw, p.units[sl], p.records[sl], p.gidx[sl], w, stop, into.alloc)
        run_ns, queued = time.perf_counter_ns() - r0, queued_ns() - q0
        del raw
        leaves: list[torch.Tensor] = []
        skeleton = flatten(work.result, leaves)
        work.result = None
        s, slot, metas = into.place(leaves)
        leaves.clear()
        if slot is not None:
            slots.busy[w * MAX_SLOTS + s] = 1
        costs = (work.samples, work.skipped, work.transform_ns, work.decode_ns, time.perf_counter_ns() - t0,
                 work.cpu_ns, queued, run_ns, t0)  # (t0: when it began the batch, NOTE [worker start])
        send(("ok", job.jid, t, w, s, slot.gen if slot is not None else -1, slot.size if slot is not None else 0,
              skeleton, metas, costs))
    except _Stopped:  # the job is over (NOTE [transform pool]): its native stream goes with it
        job.close()
    except StopIteration:
        send(("err", job.jid, t, w, wrapper(where=f"in pyloader transform worker {w}: its native stream ended early")))
    except Exception:  # noqa: BLE001 - sent to the parent with its traceback
        send(("err", job.jid, t, w, wrapper(where=f"in pyloader transform worker {w} (pid {os.getpid()})")))


# -- the parent's side ----------------------------------------------------------------------

def pool_key(ds: PlannedDataset, spec: TransformSpec) -> tuple[Any, ...]:
    """What a pool's workers were started with: an epoch with another key needs another pool."""
    return (id(ds), spec.transform, tuple(sorted((k, id(v)) for k, v in spec.decode.items())), spec.collate)


class WorkerPool:
    """Transform worker processes for one (dataset, transform, decoders, collate) (NOTE [transform pool]).

    ``workers`` start now; ``grow(n)`` starts more, up to ``max_workers``.
    """

    _jids = itertools.count(1)

    def __init__(self, ds: PlannedDataset, spec: TransformSpec, workers: int, *, context: Any = None,
                 max_workers: int | None = None, reserve: SlotReserve | None = None) -> None:
        self.ds = ds
        self.spec = spec
        self.key = pool_key(ds, spec)
        self.max_workers = max(workers, max_workers or workers)
        self.pid = os.getpid()
        self.dir = shm_dir()
        self.prefix = slot_prefix(self.pid) + secrets.token_hex(4)
        self.context = context  # as given (None: fork where the platform has it)
        if context is None:
            methods = multiprocessing.get_all_start_methods()
            context = "fork" if "fork" in methods else multiprocessing.get_start_method()
        self.ctx: Any = multiprocessing.get_context(context) if isinstance(context, str) else context
        self.reserve = reserve if self.ctx.get_start_method() == "fork" else None
        inherited = self.reserve.take(self.max_workers) if self.reserve is not None else None
        self.busy = inherited[0] if inherited else self.ctx.Array("b", self.max_workers * MAX_SLOTS, lock=False)
        self.jobs = self.ctx.Array("q", [_IDLE] * self.max_workers, lock=False)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.ended: set[int] = set()  # workers whose pipe reached its end
        self.exited: set[int] = set()  # workers whose process sentinel fired
        self.retired: set[int] = set()  # workers told to exit once their share of the pool's job was made
        self.maps: dict[tuple[int, int], tuple[int, mmap.mmap]] = inherited[1] if inherited else {}
        self.broken = False  # a worker died: never reused
        self.grace = [_STOP_GRACE_S]  # how long shutdown lets workers finish their batch (0 once one died)
        self.user: Any = None  # the stream using the pool now (a weak reference), if any
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, self.dir, self.prefix,
                                           self.pid, self.grace, self.retired)
        _LIVE.add(self)
        try:
            self.grow(workers)
        except BaseException:
            self.shutdown()
            raise

    @property
    def size(self) -> int:
        """Worker processes started."""
        return len(self.procs)

    @property
    def usable(self) -> bool:
        """Whether a new epoch may use this pool: not shut down or broken, and this process made it."""
        return (not self.broken and self._finalizer.alive and os.getpid() == self.pid
                and all(p.exitcode is None for p in self.procs))  # (a worker killed between epochs)

    def busy_with(self) -> Any:
        """The open stream using the pool, if any."""
        user = self.user() if self.user is not None else None
        return user if user is not None and not getattr(user, "_closed", True) else None

    def grow(self, workers: int, first: dict[int, _FirstJob] | None = None) -> None:
        """Starts workers until ``workers`` run (at most ``max_workers``).

        ``first``: worker ``w`` started now starts on job ``first[w]`` (NOTE [first job at fork]).
        """
        workers = min(workers, self.max_workers)
        if len(self.procs) >= workers:
            return
        # Forked workers share the parent's memory until they write to it; a garbage
        # collection in a worker would write to every object it scans (their gc links and
        # counts) and so copy the parent's heap page by page. Objects alive at the fork are
        # moved out of the collector's reach (gc.freeze) for the children; the parent's
        # collector gets them back right after.
        freeze = self.ctx.get_start_method() == "fork"
        if freeze:
            warm_imports()  # See NOTE [warm imports]
            # numpy.random loads on first use (~80 ms): a worker seeding the global generators
            # (NOTE [sample seeds]) would load it in every worker of every pool; loaded here: shared.
            import numpy.random  # noqa: F401
            prepare_native_limits()  # See NOTE [worker threads]
            gc.freeze()
        try:
            for w in range(len(self.procs), workers):
                # Each pipe is made just before its worker starts (See NOTE [transform worker deaths]).
                mine, theirs = self.ctx.Pipe(duplex=True)
                self.conns.append(mine)
                _PARENT_ENDS.add(mine)
                job = first.get(w) if first is not None else None
                if job is not None:
                    self.jobs[w] = job[0]
                p = self.ctx.Process(target=_worker_main, name=f"pyloader-transform-{w}", daemon=True,
                                     args=(w, self.ds, self.spec, theirs, self.busy, self.jobs, self.prefix,
                                           self.dir, self.pid,
                                           {s: m for (v, s), m in self.maps.items() if v == w} if freeze else None,
                                           job))
                try:
                    p.start()
                except Exception as e:
                    self.conns.pop()
                    self.jobs[w] = _IDLE
                    raise type(e)(f"executor='processes' could not start a worker with the "
                                  f"{self.ctx.get_start_method()!r} start method (a transform must be picklable for "
                                  f"'spawn' and 'forkserver': a module-level function, not a lambda or closure): "
                                  f"{e}") from e
                finally:
                    theirs.close()  # the worker's end lives in the worker only (EOF here when it dies)
                self.procs.append(p)
        finally:
            if freeze:
                gc.unfreeze()

    def new_job(self) -> int:
        """A job number not used before in this process."""
        return next(self._jids)

    def start_job(self, w: int, jid: int, payload: JobPayload) -> None:
        """Gives worker ``w`` job ``jid`` (its credits follow)."""
        self.jobs[w] = jid
        self.conns[w].send(("job", jid, payload))

    def retire(self, w: int) -> None:
        """Tells worker ``w``, which made its last batch of this pool's only job, to exit now (NOTE [transform pool])."""
        if w not in self.retired:
            self.retired.add(w)
            with contextlib.suppress(OSError):
                self.conns[w].send(None)

    def cancel(self, w: int) -> None:
        """Worker ``w`` stops its job after the sample it is on (NOTE [transform pool])."""
        if w < len(self.procs):
            self.jobs[w] = _IDLE

    def release(self, msg: tuple[Any, ...]) -> None:
        """Frees the slot a result filled that nobody will take (a job that is over, a closed stream)."""
        if msg[0] == "ok" and msg[4] >= 0:
            with contextlib.suppress(Exception):
                self.busy[msg[3] * MAX_SLOTS + msg[4]] = 0

    def map(self, w: int, s: int, gen: int, size: int) -> mmap.mmap:
        """Slot ``s`` of worker ``w`` in generation ``gen``, mapped (and its file removed) once."""
        have = self.maps.get((w, s))
        if have is not None and have[0] == gen:
            return have[1]
        path = os.path.join(self.dir, f"{self.prefix}-w{w}-s{s}-g{gen}")
        fd = os.open(path, os.O_RDWR)
        try:
            mp = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)  # both sides keep their mappings; nothing is left behind
        self.maps[(w, s)] = (gen, mp)  # an older generation stays mapped while its tensors live
        return mp

    def shutdown(self) -> None:
        """Stops the workers and removes the slot files. Idempotent; batches already handed out stay valid.

        A pool that ended normally leaves its slots to its ``reserve`` (NOTE [slots across pools]).
        """
        _LIVE.discard(self)
        self._finalizer()
        if (self.reserve is not None and self.maps and not self.broken and os.getpid() == self.pid
                and all(p.exitcode is not None or w in self.retired for w, p in enumerate(self.procs))):
            self.reserve.keep(self.busy, self.maps, self.max_workers)
        self.reserve = None
        self.maps = {}


class SlotReserve:
    """A loader's slots between two pools (NOTE [slots across pools]): the ``busy`` flags and the parent's mappings."""

    __slots__ = ("busy", "maps", "workers")

    def __init__(self) -> None:
        self.busy: Any = None
        self.maps: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}
        self.workers = 0

    def keep(self, busy: Any, maps: dict[tuple[int, int], tuple[int, mmap.mmap]], workers: int) -> None:
        """What a pool that ended normally leaves."""
        self.busy, self.maps, self.workers = busy, maps, workers

    def take(self, workers: int) -> tuple[Any, dict[tuple[int, int], tuple[int, mmap.mmap]]] | None:
        """(busy, maps) for a pool of at most ``workers`` workers, once; None when there is nothing it can use."""
        busy, maps, fits = self.busy, self.maps, 0 < workers <= self.workers
        self.busy, self.maps, self.workers = None, {}, 0
        return (busy, maps) if busy is not None and maps and fits else None


_STOP_GRACE_S = 0.5  # how long a shutdown waits for a worker to finish its batch before it stops it


def _shutdown(procs: list[Any], conns: list[Any], directory: str, prefix: str, parent: int,
              grace: list[float], retired: set[int]) -> None:
    if os.getpid() != parent:  # a forked child's copy: its workers and files are the parent's (NOTE [loader across fork])
        return
    if procs and len(retired) == len(procs):  # every worker made its share and was told to exit
        reap_later(list(procs), _STOP_GRACE_S)  # See NOTE [late reaping] in reap.py
        procs = []
    for c in conns:
        with contextlib.suppress(Exception):
            c.send(None)
    # A worker between batches exits at once; one inside a transform is stopped (at once when a
    # sibling died: the epoch is over): its batch is no longer wanted, its slot files removed below.
    deadline = time.monotonic() + grace[0]
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.terminate()
            p.join(2.0)
        if p.exitcode is None:
            p.kill()
            p.join(2.0)
    for c in conns:
        with contextlib.suppress(Exception):
            c.close()
    with contextlib.suppress(OSError):  # one listing, no pattern (a glob took 2 ms among 350 names)
        for name in (n for n in os.listdir(directory) if n.startswith(prefix + "-")):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))


__all__ = ["SlotReserve", "MAX_SLOTS", "MAX_IMPORTS", "WORKER_IMPORTS", "note_imports", "warm_imports", "shm_dir", "slot_prefix", "flatten", "unflatten", "shm_error", "JobPayload", "pool_key", "WorkerPool"]
