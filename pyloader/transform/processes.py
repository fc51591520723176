"""The process executor: per-sample transforms in worker processes that read the shards themselves.

NOTE [process executor]: for transforms that hold the GIL (pure Python). Worker ``w`` of
``W`` makes the batches whose plan position ``t`` has ``t % W == w``: it reads their
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
parent dies, and remove their slot files on exit; the parent removes any left at
``close()`` and, at start, those whose name proves their parent gone (``owner_gone``:
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
import errno
import gc
import glob
import mmap
import multiprocessing
import os
import re
import secrets
import signal
import tempfile
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait as wait_conns
from typing import Any

import numpy as np
import torch

from ..contract import PlannedDataset
from ..errors import LoaderStateError, LoaderTimeoutError, SharedMemoryError, TransformWorkerError
from ..format.owner import OWNER_PATTERN, owner, owner_gone
from .stage import BatchWork, TransformSpec, TransformStream, run_batch

MAX_SLOTS = 64  # slots per worker: batches the consumer may hold from one worker at once
_ALIGN = 64
_NAME_RE = re.compile(rf"^pyloader-({OWNER_PATTERN})-(\d+)-[0-9a-f]+-w\d+-s\d+-g\d+$")
_LIVENESS_S = 0.1  # the longest the consumer waits without checking that the workers live
_STOP_GRACE_S = 0.5  # how long close() waits for a worker to finish its batch before it stops it
_SHOWN_SAMPLES = 32  # sample indices a TransformWorkerError lists before it abbreviates

# The parent's ends of every open stream's worker pipes: a forked child closes its copies
# (See NOTE [transform worker deaths]).
_PARENT_ENDS: weakref.WeakSet[Any] = weakref.WeakSet()


def _close_parent_ends() -> None:
    with contextlib.suppress(Exception):
        for conn in list(_PARENT_ENDS):
            with contextlib.suppress(Exception):
                conn.close()
        _PARENT_ENDS.clear()


os.register_at_fork(after_in_child=_close_parent_ends)


def shm_dir() -> str:
    """Where slots are made: ``$PYLOADER_SHM_DIR``, else ``/dev/shm``, else the temp dir."""
    d = os.environ.get("PYLOADER_SHM_DIR")
    if d:
        return d
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def slot_prefix(pid: int) -> str:
    """The start of the slot file names of the loader process ``pid`` of this host, boot and pid namespace."""
    return f"pyloader-{owner()}-{pid}-"


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


class _Leaf:
    """A tensor's place in a batch's structure, sent instead of the tensor."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Leaf, (self.i,))


def _flatten(obj: Any, leaves: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return _Leaf(len(leaves) - 1)
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biuf":
        leaves.append(torch.from_numpy(np.ascontiguousarray(obj)))
        return _Leaf(len(leaves) - 1)
    if isinstance(obj, dict):
        return {k: _flatten(v, leaves) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_flatten(v, leaves) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_flatten(v, leaves) for v in obj)
    return obj


def _unflatten(obj: Any, leaves: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Leaf):
        return leaves[obj.i]
    if isinstance(obj, dict):
        return {k: _unflatten(v, leaves) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, leaves) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_unflatten(v, leaves) for v in obj)
    return obj


# -- the worker process ---------------------------------------------------------------

class _Slot:
    __slots__ = ("fd", "map", "size", "gen", "path")

    def __init__(self, fd: int, mp: mmap.mmap, size: int, gen: int, path: str) -> None:
        self.fd, self.map, self.size, self.gen, self.path = fd, mp, size, gen, path


def _shm_error(directory: str, need: int, e: OSError | None) -> SharedMemoryError:
    try:
        st = os.statvfs(directory)
        free = f"{st.f_bavail * st.f_frsize} bytes free of {st.f_blocks * st.f_frsize}"
    except OSError:
        free = "free space unknown"
    why = f" ({e.strerror})" if e is not None and e.strerror else ""
    return SharedMemoryError(
        e.errno if e is not None and e.errno else errno.ENOSPC,
        f"{directory}: no room for a transform batch of {need} bytes{why}; {free}. The process executor "
        f"returns batches through shared memory: make {directory} larger (in a container, --shm-size), "
        f"hold fewer batches, use fewer workers or a smaller prefetch, set PYLOADER_SHM_DIR to another "
        f"tmpfs, or use executor='threads' (no shared memory)")


class _Worker:
    def __init__(self, w: int, prefix: str, directory: str, busy: Any) -> None:
        self.w, self.prefix, self.dir, self.busy = w, prefix, directory, busy
        self.slots: list[_Slot | None] = []

    def _make(self, s: int, size: int, gen: int) -> _Slot:
        path = os.path.join(self.dir, f"{self.prefix}-w{self.w}-s{s}-g{gen}")
        try:
            st = os.statvfs(self.dir)
            if st.f_bavail * st.f_frsize < size:
                raise _shm_error(self.dir, size, None)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except SharedMemoryError:
            raise
        except OSError as e:
            raise _shm_error(self.dir, size, e) from None
        try:
            os.posix_fallocate(fd, 0, size)
            mp = mmap.mmap(fd, size)
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise _shm_error(self.dir, size, e) from None
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
                    return s, slot
            if len(self.slots) < MAX_SLOTS:
                s = len(self.slots)
                self.slots.append(self._make(s, size, 0))
                return s, self.slots[s]  # type: ignore[return-value]
            if stop():
                raise SystemExit(0)
            time.sleep(0.002)

    def _drop(self, slot: _Slot, unlink: bool = True) -> None:
        with contextlib.suppress(Exception):
            slot.map.close()
        with contextlib.suppress(OSError):
            os.close(slot.fd)
        if unlink:  # a slot is regrown only once free, so the parent has mapped (and removed) it already
            with contextlib.suppress(OSError):
                os.unlink(slot.path)

    def close(self, unlink: bool) -> None:
        """Unmaps the slots; ``unlink``: also removes their files (the parent is gone and will not)."""
        for slot in self.slots:
            if slot is not None:
                self._drop(slot, unlink)
        self.slots = []


class _ParentGone(BaseException):
    """The parent's end of the pipe is closed: the worker has nobody to work for (not an error)."""


def _worker_main(w: int, workers: int, ds: PlannedDataset, units: np.ndarray, records: np.ndarray, gidx: np.ndarray,
                 tickets: list[int],
                 batch_size: int, spec: TransformSpec, conn: Any, busy: Any, prefix: str,
                 directory: str, parent: int) -> None:
    from torch._utils import ExceptionWrapper

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    torch.set_num_threads(1)
    worker = _Worker(w, prefix, directory, busy)

    def parent_gone() -> bool:
        return os.getppid() != parent

    def send(msg: tuple[Any, ...]) -> None:
        try:
            conn.send(msg)
        except OSError:  # a broken pipe: the parent closed the stream or died
            raise _ParentGone from None

    stream = None
    try:
        # Each worker streams its own share of a remote dataset through the node cache: the
        # reader sizes its share of the cache limit by this rank's workers.
        stream = ds.batches(batch_size, plan=(units, records), drop_last=False, num_threads=1, prefetch=2,
                            readers=workers)
        pos = 0
        for t in tickets:
            while not conn.poll(1.0):  # a credit for ticket t
                if parent_gone():
                    return
            try:
                credit = conn.recv()
            except (EOFError, OSError):  # no sibling holds the parent's end: it closed or died
                return
            if credit is None:
                return
            t0 = time.perf_counter_ns()
            try:
                raw = next(stream)
                sl = slice(pos, pos + batch_size)
                pos += batch_size  # (before the transform, which may raise: the next batch starts there)
                work = run_batch(spec, ds, raw, units[sl], records[sl], gidx[sl], w)
                del raw
                leaves: list[torch.Tensor] = []
                skeleton = _flatten(work.result, leaves)
                metas = []
                off = 0
                for leaf in leaves:
                    n = leaf.numel() * leaf.element_size()
                    metas.append((str(leaf.dtype).removeprefix("torch."), tuple(leaf.shape), off, n))
                    off += -(-n // _ALIGN) * _ALIGN
                s, slot, gen = -1, None, -1
                if leaves:
                    s, slot = worker.slot_for(max(off, _ALIGN), parent_gone)
                    gen = slot.gen
                    for leaf, (_, _, o, n) in zip(leaves, metas):
                        if n:
                            dst = torch.frombuffer(slot.map, dtype=torch.uint8, count=n, offset=o)
                            dst.copy_(leaf.contiguous().reshape(-1).view(torch.uint8))
                    busy[w * MAX_SLOTS + s] = 1
                costs = (work.samples, work.skipped, work.transform_ns, work.decode_ns, time.perf_counter_ns() - t0)
                send(("ok", t, w, s, gen, slot.size if slot is not None else 0, skeleton, metas, costs))
            except StopIteration:
                send(("err", t, w, ExceptionWrapper(where=f"in pyloader transform worker {w}: its "
                                                            "native stream ended early")))
                return
            except Exception:  # noqa: BLE001 - sent to the parent with its traceback
                send(("err", t, w, ExceptionWrapper(where=f"in pyloader transform worker {w} (pid "
                                                            f"{os.getpid()})")))
    except _ParentGone:
        return
    finally:
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()
        # The parent may not have mapped the last slots yet: it removes the files (at close()).
        worker.close(unlink=parent_gone())


# -- the parent -----------------------------------------------------------------------

def _release(busy: Any, index: int, left: list[int]) -> None:
    """A tensor of a slot's batch was freed; the last one frees the slot."""
    left[0] -= 1
    if left[0] == 0:
        with contextlib.suppress(Exception):
            busy[index] = 0


class ProcessTransformStream(TransformStream):
    """Batches of transformed samples made by ``workers`` processes, in plan order (NOTE [process executor]).

    ``units``/``records``/``gidx``: every planned row; batches of ``batch_size`` rows (the
    last one partial unless ``drop_last``). Implements the ``BatchStream`` protocol.
    """

    def __init__(self, ds: PlannedDataset, spec: TransformSpec, units: np.ndarray, records: np.ndarray, gidx: np.ndarray,
                 batch_size: int, drop_last: bool, *, workers: int, depth: int, context: Any = None) -> None:
        n = len(units)
        super().__init__("processes", workers, n // batch_size if drop_last else -(-n // batch_size))
        self._workers_n = workers
        self._batch_size = batch_size
        self._gidx = gidx  # the samples of each batch, for a dead worker's report
        self._depth = max(depth, workers)
        self._closed = False
        self._results: dict[int, Any] = {}
        self._sent = 0
        self._delivered = 0
        self._maps: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}
        self._dir = shm_dir()
        clean_stale(self._dir)
        self._prefix = slot_prefix(os.getpid()) + secrets.token_hex(4)
        if context is None:
            methods = multiprocessing.get_all_start_methods()
            context = "fork" if "fork" in methods else multiprocessing.get_start_method()
        ctx: Any = multiprocessing.get_context(context) if isinstance(context, str) else context
        self._busy = ctx.Array("b", workers * MAX_SLOTS, lock=False)
        # One pipe per worker: credits go down, results come up, each written synchronously by
        # the sender (a Queue's feeder thread would wait for the GIL, milliseconds per batch).
        # Each is made just before its worker starts (See NOTE [transform worker deaths]).
        self._conns: list[Any] = []
        self._ended: set[int] = set()  # workers whose pipe reached its end
        self._exited: set[int] = set()  # workers whose process sentinel fired
        self._checked = 0.0  # when _pump last looked at the workers
        self._grace = [_STOP_GRACE_S]  # how long close() lets workers finish their batch (0 once one died)
        self._procs: list[Any] = []
        # Forked workers share the parent's memory until they write to it; a garbage
        # collection in a worker would write to every object it scans (their gc links and
        # counts) and so copy the parent's heap page by page. Objects alive at the fork are
        # moved out of the collector's reach (gc.freeze) for the children; the parent's
        # collector gets them back right after.
        freeze = ctx.get_start_method() == "fork"
        if freeze:
            gc.freeze()
        try:
            for w in range(workers):
                tickets = list(range(w, self._len, workers))
                rows = np.concatenate([np.arange(t * batch_size, min((t + 1) * batch_size, n)) for t in tickets]) \
                    if tickets else np.empty(0, dtype=np.int64)
                mine, theirs = ctx.Pipe(duplex=True)
                self._conns.append(mine)
                _PARENT_ENDS.add(mine)
                p = ctx.Process(target=_worker_main, name=f"pyloader-transform-{w}", daemon=True,
                                args=(w, workers, ds, np.ascontiguousarray(units[rows]), np.ascontiguousarray(records[rows]),
                                      np.ascontiguousarray(gidx[rows]), tickets, batch_size, spec, theirs,
                                      self._busy, self._prefix, self._dir, os.getpid()))
                try:
                    p.start()
                except Exception as e:
                    raise type(e)(f"executor='processes' could not start a worker with the {ctx.get_start_method()!r} "
                                  f"start method (a transform must be picklable for 'spawn' and 'forkserver': "
                                  f"a module-level function, not a lambda or closure): {e}") from e
                finally:
                    theirs.close()  # the worker's end lives in the worker only (EOF here when it dies)
                self._procs.append(p)
        except BaseException:
            self.close()
            raise
        finally:
            if freeze:
                gc.unfreeze()
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns, self._dir, self._prefix,
                                           os.getpid(), self._grace)
        self._dispatch()

    def _dispatch(self) -> None:
        while self._sent < self._len and self._sent < self._delivered + self._depth:
            w = self._sent % self._workers_n
            try:
                self._conns[w].send(self._sent)
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
                        raise LoaderTimeoutError(f"no transformed batch within timeout={self.timeout} s (batch {k}, "
                                                 f"transform worker {k % self._workers_n})")
                    wait = min(wait, left)
                self._pump(wait)
        finally:
            self._stats.wait_ns += time.perf_counter_ns() - t0
        msg = self._results.pop(k)
        self._delivered += 1
        self._dispatch()
        if msg[0] == "err":
            msg[3].reraise()
        return self._build(msg)

    def _recv(self, w: int) -> None:
        try:
            msg = self._conns[w].recv()
        except (EOFError, OSError):  # the worker exited: everything it sent was read
            self._ended.add(w)
            return
        self._results[msg[1]] = msg

    def _pump(self, timeout: float) -> None:
        """Reads the results that arrive within ``timeout`` s; reports a worker that died.

        See NOTE [transform worker deaths].
        """
        handles: dict[Any, int] = {}
        for w, conn in enumerate(self._conns):
            if w not in self._ended:
                handles[conn] = w
            if w not in self._exited:
                handles[self._procs[w].sentinel] = w
        if not handles:
            time.sleep(timeout)
            return
        gone: list[int] = []
        ready = wait_conns(list(handles), timeout=timeout)
        self._checked = time.monotonic()
        for h in ready:
            w = handles[h]
            if isinstance(h, int):  # a process sentinel
                self._exited.add(w)
                gone.append(w)
                continue
            self._recv(w)
            if w in self._ended:
                gone.append(w)
        for w in gone:
            self._worker_ended(w)

    def _worker_ended(self, w: int) -> None:
        """Worker ``w``'s process or pipe ended: reads what it sent, raises if batches of its share are missing."""
        conn = self._conns[w]
        while w not in self._ended:
            try:
                ready = conn.poll(0)  # (True at the pipe's end too: recv then says so)
            except (EOFError, OSError):
                ready = True
            if not ready:
                break
            self._recv(w)
        missing = [t for t in range(w, self._len, self._workers_n) if t >= self._delivered and t not in self._results]
        if missing:
            raise self._death(w, missing)

    def _death(self, w: int, missing: list[int]) -> TransformWorkerError:
        """Closes the stream; the error naming worker ``w``, how it ended and the batches it held."""
        p = self._procs[w]
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
        self._grace[0] = 0.0
        self.close()
        e = TransformWorkerError(
            f"pyloader transform worker {w} (pid {p.pid}) {how} while it held batch{'es' if len(held) > 1 else ''} "
            f"{batches} (samples {shown}); the epoch cannot be completed. {fix[0].upper()}{fix[1:]}")
        e.worker, e.pid, e.exitcode = w, p.pid, code  # type: ignore[attr-defined]
        e.batches, e.samples = held, samples  # type: ignore[attr-defined]
        return e

    def _build(self, msg: tuple[Any, ...]) -> Any:
        _, t, w, s, gen, size, skeleton, metas, costs = msg
        samples, skipped, transform_ns, decode_ns, busy_ns = costs
        self._stats.add(BatchWork(None, samples, skipped, transform_ns, decode_ns), busy_ns)
        if not metas:
            return skeleton
        mp = self._map(w, s, gen, size)
        left = [len(metas)]
        index = w * MAX_SLOTS + s
        leaves: list[torch.Tensor] = []
        for dtype, shape, off, n in metas:
            a = np.frombuffer(mp, dtype=np.uint8, count=n, offset=off) if n else np.empty(0, np.uint8)
            weakref.finalize(a, _release, self._busy, index, left)
            leaves.append(torch.from_numpy(a).view(getattr(torch, dtype)).reshape(shape))
        return _unflatten(skeleton, leaves)

    def _map(self, w: int, s: int, gen: int, size: int) -> mmap.mmap:
        have = self._maps.get((w, s))
        if have is not None and have[0] == gen:
            return have[1]
        path = os.path.join(self._dir, f"{self._prefix}-w{w}-s{s}-g{gen}")
        fd = os.open(path, os.O_RDWR)
        try:
            mp = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)  # both sides keep their mappings; nothing is left behind
        self._maps[(w, s)] = (gen, mp)  # an older generation stays mapped while its tensors live
        return mp

    def close(self) -> None:
        """Stops the workers, removes the slot files. Idempotent. Batches already returned stay valid."""
        if self._closed:
            return
        self._closed = True
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()
        else:
            _shutdown(self._procs, self._conns, self._dir, self._prefix, os.getpid(), self._grace)
        self._results.clear()
        self._maps.clear()
        self._finish()

    def stats(self) -> dict[str, Any]:
        """The transform stage's counters (``transform_*``, ``skipped_samples``, the consumer's wait)."""
        s = super().stats()
        s["batches"] = self._stats.batches
        s["records"] = self._stats.samples + self._stats.skipped
        return s


def _shutdown(procs: list[Any], conns: list[Any], directory: str, prefix: str, parent: int,
              grace: list[float]) -> None:
    if os.getpid() != parent:
        # A forked child's copy of the stream: its workers and files are the parent's (see
        # NOTE [loader across fork]).
        return
    for c in conns:
        with contextlib.suppress(Exception):
            c.send(None)
    # A worker between batches exits at once; one inside a transform is stopped (at once
    # when a sibling died: the epoch is over): its batch is no longer wanted, and the slot
    # files are removed below.
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
    for path in glob.glob(os.path.join(directory, glob.escape(prefix) + "-*")):
        with contextlib.suppress(OSError):
            os.unlink(path)


__all__ = ["MAX_SLOTS", "shm_dir", "slot_prefix", "clean_stale", "ProcessTransformStream"]
