"""The process executor: per-sample transforms in worker processes that read the shards themselves.

NOTE [process executor]: for transforms that hold the GIL (pure Python). The workers are
the processes of a ``WorkerPool``, kept across epochs (NOTE [transform pool] in pool.py);
each epoch is one job. Worker ``w`` of ``W`` makes the batches whose plan position ``t``
has ``t % W == w``: it reads their
records through its own native pipeline (``dataset.batches`` over just those rows, one
thread), so no sample byte is pickled on the way in. It decodes, transforms and collates
each batch (``stage.run_batch``, the code the thread executor runs) and writes the batch's
tensors into a *slot*: a file in ``/dev/shm`` it created with ``posix_fallocate`` (so a
full ``/dev/shm`` is a clear ``SharedMemoryError`` naming it, never a SIGBUS), named
``pyloader-<owner>-<parent pid>-<token>-w<worker>-s<slot>-g<generation>`` (``<owner>``:
``<host>-<boot>-<pidns>`` of the parent, See NOTE [file owners]). It sends only the
layout (dtypes, shapes, offsets) through its pipe; the parent maps the slot, removes the
file (both keep their mappings), and hands the consumer tensors that view the mapping --
zero-copy. A slot is reused only when every tensor of its batch is gone: a finaliser on
each view clears the slot's flag in a shared array, which the worker polls before reusing
it (it makes a new slot when none is free). The parent sends each worker *credits* (the
tickets it may make next) so that at most ``depth`` batches are in flight, and takes
results in plan order. Workers ignore SIGINT (the parent decides), exit when their
parent dies, and remove their slot files on exit; the parent removes any left when it
shuts the pool down and, at start, those whose name proves their parent gone (``owner_gone``:
this boot and pid namespace, pid gone; never a file of another container sharing
``/dev/shm``, nor one in the older ``pyloader-<pid>-...`` form, which names no owner). A worker that dies raises
``TransformWorkerError`` (NOTE [transform worker deaths]); a transform's exception is
re-raised in the parent with its type and the worker's traceback (torch's
``ExceptionWrapper``), and the iteration goes on.

NOTE [transform worker deaths]: a worker killed by the out-of-memory killer or a crash in
native code sends nothing, so the parent watches for it. Each worker's pipe is made just
before its worker starts, and the parent closes the worker's end right after; every
parent end is registered in ``_PARENT_ENDS``, which a fork closes in the child
(``os.register_at_fork``). So a worker holds only its own end of its own pipe -- not its
siblings' ends, nor the parent's (a sibling's copy would keep a dead worker's pipe open, and
the parent would never see its end) -- and any other child forked while a stream is open
(a torch DataLoader worker, a later stream's workers) holds none of them either. The
consumer's ``next()`` waits on the pipes *and* the workers' process sentinels, at most
``_LIVENESS_S`` at a time whatever ``timeout`` is, and before it returns a batch already
here it checks them if it has not in the last ``_LIVENESS_S`` (a check costs ~10 us).
When a worker's sentinel fires (or its pipe ends) the parent reads what it sent before it
died, then, if some of the worker's batches are still missing,
closes the stream and raises ``TransformWorkerError`` naming the worker, its pid, the
signal or exit code, and the batches and samples it held (the credited batches it had
not returned); a worker that ends after its last batch ended normally. A credit sent to
a worker that died (a broken pipe) is reported the same way. So a death is reported at
once to a consumer waiting in ``next()`` (its sentinel wakes the wait; measured 5-15 ms
from SIGKILL), else by the first ``next()`` at least ``_LIVENESS_S`` after it. The other
workers are then stopped at once (SIGTERM), not left ``_STOP_GRACE_S`` to finish a batch
nobody will take.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
import weakref
from multiprocessing.connection import wait as wait_conns
from typing import Any

import numpy as np
import torch

from ..errors import LoaderStateError, LoaderTimeoutError, TransformWorkerError
from ..format.owner import OWNER_PATTERN, owner_gone
from .pool import MAX_SLOTS, JobPayload, WorkerPool, note_imports, shm_dir, slot_prefix, unflatten
from .stage import BatchWork, TransformSpec, TransformStream

_NAME_RE = re.compile(rf"^pyloader-({OWNER_PATTERN})-(\d+)-[0-9a-f]+-w\d+-s\d+-g\d+$")
_LIVENESS_S = 0.1  # the longest the consumer waits without checking that the workers live
_SHOWN_SAMPLES = 32  # sample indices a TransformWorkerError lists before it abbreviates


_CLEAN_EVERY_S = 60.0  # a process looks for dead loaders' slot files at most this often per folder
_cleaned: dict[str, float] = {}  # folder -> when this process last looked


def clean_stale_now_and_then(directory: str) -> None:
    """``clean_stale`` at most every ``_CLEAN_EVERY_S`` per folder: a listing of /dev/shm per epoch cost 1.5 ms."""
    now = time.monotonic()
    if now - _cleaned.get(directory, -_CLEAN_EVERY_S) >= _CLEAN_EVERY_S:
        _cleaned[directory] = now
        clean_stale(directory)


def clean_stale(directory: str) -> int:
    """Removes the slot files whose parent is provably gone (See NOTE [file owners]); returns how many."""
    n = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = _NAME_RE.match(name)
        if m and owner_gone(m.group(1), int(m.group(2))) is True:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
                n += 1
    return n


def _release(busy: Any, index: int, left: list[int]) -> None:
    """A tensor of a slot's batch was freed; the last one frees the slot."""
    left[0] -= 1
    if left[0] == 0:
        with contextlib.suppress(Exception):
            busy[index] = 0


class ProcessTransformStream(TransformStream):
    """Batches of transformed samples made by ``workers`` processes of ``pool``, in plan order (NOTE [process executor]).

    ``units``/``records``/``gidx``: every planned row; batches of ``batch_size`` rows (the
    last one partial unless ``drop_last``). ``owns_pool``: the stream shuts the pool down
    when it ends (``persistent_workers=False``); else the pool outlives it (NOTE [transform
    pool]). Implements the ``BatchStream`` protocol.
    """

    def __init__(self, pool: WorkerPool, spec: TransformSpec, units: np.ndarray, records: np.ndarray, gidx: np.ndarray,
                 batch_size: int, drop_last: bool, *, workers: int, depth: int, owns_pool: bool = False) -> None:
        n = len(units)
        super().__init__("processes", workers, n // batch_size if drop_last else -(-n // batch_size))
        self._pool = pool
        self._owns = owns_pool
        self._workers_n = workers
        self._batch_size = batch_size
        self._gidx = gidx  # the samples of each batch, for a dead worker's report
        self._depth = max(depth, workers)
        self._closed = False
        self._results: dict[int, Any] = {}
        self._sent = 0
        self._delivered = 0
        self._checked = 0.0  # when _pump last looked at the workers
        self.made = [0, 0]  # samples the workers made, and their time making them (not waiting for records), ns
        try:
            self._jid = pool.new_job()
            pool.user = weakref.ref(self)
            n_rows = len(units)
            payloads = []
            for w in range(workers):
                tickets = np.arange(w, self._len, workers, dtype=np.int64)
                rows = (np.concatenate([np.arange(t * batch_size, min((t + 1) * batch_size, n_rows)) for t in tickets])
                        if len(tickets) else np.empty(0, dtype=np.int64))
                payloads.append(JobPayload(
                    np.ascontiguousarray(units[rows]), np.ascontiguousarray(records[rows]),
                    np.ascontiguousarray(gidx[rows]), tickets, batch_size, spec.seed, spec.epoch,
                    spec.seed_globals, readers=workers))
            if pool.size == 0:  # every worker starts on this job as it is forked (NOTE [first job at fork])
                credits = min(self._len, self._depth)
                pool.grow(workers, {w: (self._jid, payloads[w], list(range(w, credits, workers)))
                                    for w in range(workers)})
                self._sent = credits  # the credits _dispatch would send first, given with the job
            else:
                pool.grow(workers)
                for w in range(workers):
                    try:
                        pool.start_job(w, self._jid, payloads[w])
                    except OSError:  # a broken pipe: the worker died since the pool was checked
                        self._worker_ended(w)
                        raise
            clean_stale_now_and_then(pool.dir)
            self._dispatch()
        except BaseException:
            self.close()
            raise

    def _dispatch(self) -> None:
        while self._sent < self._len and self._sent < self._delivered + self._depth:
            w = self._sent % self._workers_n
            try:
                self._pool.conns[w].send(self._sent)
            except OSError:  # a broken pipe: the worker is gone (NOTE [transform worker deaths])
                self._worker_ended(w)  # (reads what it sent first: the pipe's end is still to be read)
                raise
            self._sent += 1

    def _take(self) -> Any:
        if self._closed:
            raise LoaderStateError("iterator is closed")
        k = self._delivered
        if k >= self._len:
            self._end()
        t0 = time.perf_counter_ns()
        deadline = None if not self.timeout else time.monotonic() + self.timeout
        try:
            if k in self._results and time.monotonic() - self._checked >= _LIVENESS_S:
                self._pump(0.0)  # a batch is here, but a worker that died is reported first
            while k not in self._results:
                wait = _LIVENESS_S
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise LoaderTimeoutError.after(self.timeout, f"no transformed batch arrived (batch {k}, "
                                                                     f"transform worker {k % self._workers_n})")
                    wait = min(wait, left)
                self._pump(wait)
        finally:
            self._stats.wait_ns += time.perf_counter_ns() - t0
        msg = self._results.pop(k)
        self._delivered += 1
        self._dispatch()
        if msg[0] == "err":
            msg[4].reraise()
        return self._build(msg)

    def _recv(self, w: int) -> None:
        pool = self._pool
        try:
            msg = pool.conns[w].recv()
        except (EOFError, OSError):  # the worker exited: everything it sent was read
            pool.ended.add(w)
            return
        if msg[0] == "mods":  # modules the worker imported (NOTE [warm imports] in pool.py)
            note_imports(msg[1])
            return
        if msg[1] != self._jid:
            pool.release(msg)  # a result of an earlier epoch's job: nobody takes it
            return
        self._results[msg[2]] = msg
        if self._owns and msg[2] + self._workers_n >= self._len:
            pool.retire(w)  # its last batch of a pool's only job (See NOTE [transform pool])

    def _pump(self, timeout: float) -> None:
        """Reads the results that arrive within ``timeout`` s; reports a worker that died.

        See NOTE [transform worker deaths].
        """
        pool = self._pool
        handles: dict[Any, int] = {}
        for w, conn in enumerate(pool.conns):
            if w not in pool.ended:
                handles[conn] = w
            if w not in pool.exited and w not in pool.retired:
                handles[pool.procs[w].sentinel] = w
        if not handles:
            time.sleep(timeout)
            return
        gone: list[int] = []
        ready = wait_conns(list(handles), timeout=timeout)
        self._checked = time.monotonic()
        for h in ready:
            w = handles[h]
            if isinstance(h, int):  # a process sentinel
                pool.exited.add(w)
                gone.append(w)
                continue
            self._recv(w)
            if w in pool.ended and w not in pool.retired:
                gone.append(w)
        for w in gone:
            self._worker_ended(w)

    def _worker_ended(self, w: int) -> None:
        """Worker ``w``'s process or pipe ended: reads what it sent, raises if batches of its share are missing."""
        pool = self._pool
        pool.broken = True  # never given another job (NOTE [transform pool])
        conn = pool.conns[w]
        while w not in pool.ended:
            try:
                ready = conn.poll(0)  # (True at the pipe's end too: recv then says so)
            except (EOFError, OSError):
                ready = True
            if not ready:
                break
            self._recv(w)
        if w >= self._workers_n:
            return  # a worker this epoch does not use: the next epoch makes a new pool
        missing = [t for t in range(w, self._len, self._workers_n) if t >= self._delivered and t not in self._results]
        if missing:
            raise self._death(w, missing)

    def _death(self, w: int, missing: list[int]) -> TransformWorkerError:
        """Closes the stream and its pool; the error naming worker ``w``, how it ended and the batches it held."""
        p = self._pool.procs[w]
        p.join(1.0)  # its sentinel fires as it exits; its exit status follows at once
        code = p.exitcode
        if code is None:
            how = "closed its pipe"
            fix = "the transform must not close inherited file descriptors (os.closerange)"
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            how = f"was killed by signal {name}"
            if code == -signal.SIGKILL:
                fix = ("SIGKILL is often the out-of-memory killer (see dmesg): use fewer workers, a smaller prefetch "
                       "or a transform that holds less memory")
            elif -code in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT):
                fix = ("a crash in native code the transform calls: run with PYTHONFAULTHANDLER=1 to have the worker "
                       "print its Python stack when it crashes")
            else:
                fix = f"find what sends {name} to the loader's worker processes"
        else:
            how = f"exited with code {code}"
            fix = "the transform, or a library it calls, must not exit the process (os._exit, exit() in C code)"
        held = [t for t in missing if t < self._sent] or missing[:1]
        bs, n = self._batch_size, len(self._gidx)
        samples = [int(i) for t in held for i in self._gidx[t * bs:min((t + 1) * bs, n)]]
        shown = ", ".join(str(i) for i in samples[:_SHOWN_SAMPLES])
        if len(samples) > _SHOWN_SAMPLES:
            shown += f", ... ({len(samples)} samples)"
        batches = ", ".join(str(t) for t in held)
        self._pool.grace[0] = 0.0
        self._owns = True  # a pool with a dead worker goes with the stream
        self.close()
        e = TransformWorkerError(
            f"pyloader transform worker {w} (pid {p.pid}) {how} while it held batch{'es' if len(held) > 1 else ''} "
            f"{batches} (samples {shown}); the epoch cannot be completed. {fix[0].upper()}{fix[1:]}")
        e.worker, e.pid, e.exitcode = w, p.pid, code  # type: ignore[attr-defined]
        e.batches, e.samples = held, samples  # type: ignore[attr-defined]
        return e

    def _build(self, msg: tuple[Any, ...]) -> Any:
        _, _, t, w, s, gen, size, skeleton, metas, costs = msg
        samples, skipped, transform_ns, decode_ns, busy_ns, cpu_ns, queued_ns, run_ns, began_ns = costs
        self._stats.add(BatchWork(None, samples, skipped, transform_ns, decode_ns, cpu_ns, queued_ns), busy_ns)
        if self._owns:  # a pool started for this epoch (NOTE [worker start] in stage.py)
            self._stats.began(w, began_ns)
        self.made[0] += samples + skipped
        self.made[1] += run_ns
        if not metas:
            return skeleton
        mp = self._pool.map(w, s, gen, size)
        left = [len(metas)]
        index = w * MAX_SLOTS + s
        leaves: list[torch.Tensor] = []
        for dtype, shape, off, n in metas:
            a = np.frombuffer(mp, dtype=np.uint8, count=n, offset=off) if n else np.empty(0, np.uint8)
            weakref.finalize(a, _release, self._pool.busy, index, left)
            leaves.append(torch.from_numpy(a).view(getattr(torch, dtype)).reshape(shape))
        return unflatten(skeleton, leaves)

    def close(self) -> None:
        """Ends this epoch's job (the workers stop after the sample they are on). Idempotent.

        Batches already returned stay valid. A pool the stream owns is shut down (its workers
        stopped, its slot files removed); a kept one waits for the next epoch.
        """
        if self._closed:
            return
        self._closed = True
        pool = getattr(self, "_pool", None)
        if pool is not None and os.getpid() == pool.pid:
            for w in range(min(self._workers_n, pool.size)):
                pool.cancel(w)
            for msg in self._results.values():
                pool.release(msg)
            if self._owns:
                pool.shutdown()
        self._results.clear()
        self._finish()

    def stats(self) -> dict[str, Any]:
        """The transform stage's counters (``transform_*``, ``skipped_samples``, the consumer's wait)."""
        s = super().stats()
        s["batches"] = self._stats.batches
        s["records"] = self._stats.samples + self._stats.skipped
        return s


__all__ = ["MAX_SLOTS", "shm_dir", "slot_prefix", "clean_stale", "clean_stale_now_and_then", "ProcessTransformStream"]
