"""Pinned staging and device prefetch: the Python half of the native copy engine.

Python plans each copy (which buffers, which destination tensor from torch's caching
allocator); the engine thread does the byte moving and the ordering (NOTE [copy ordering]
in csrc/core/copy_engine.h). With ``device="cuda"`` the copies run on a dedicated
non-blocking CUDA stream; with ``device="cpu"`` the same engine runs with its CPU copy
backend, which is how CI exercises the ring, the ordering and the shutdown.
"""

from __future__ import annotations

import collections
import collections.abc
import copy
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

import pyloader._C as _C

from ..errors import DeviceError

_warned_pageable = False


def driver_error() -> str | None:
    """None when the CUDA driver loaded and sees a device, else why not."""
    return _C.cuda_driver_error()


def _warn_pageable(reason: str) -> None:
    global _warned_pageable
    if not _warned_pageable:  # one warning per process, as torch's DataLoader does
        _warned_pageable = True
        warnings.warn(f"pyloader: pin_memory needs the CUDA driver ({reason}); batches are staged in "
                      f"pageable memory instead", RuntimeWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside pyloader: warnings point at the user's line."""
    package = os.path.dirname(os.path.abspath(__file__))
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == package:
        level += 1
        frame = frame.f_back  # type: ignore[assignment]
    return level


def resolve_device(device: str | torch.device | int | None) -> torch.device | None:
    """The target device of ``DataLoader(device=...)``: None, ``cpu`` or ``cuda[:N]``."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device: {e}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device={device!r}: pyloader copies batches to 'cuda[:N]' or 'cpu' devices only")
    why = driver_error()
    if why is not None:
        raise DeviceError(f"device={device!r} needs a CUDA GPU: {why}")
    if not torch.cuda.is_available():
        raise DeviceError(f"device={device!r}: this torch build has no CUDA support (torch {torch.__version__})")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise DeviceError(f"device={device!r}: no such GPU (this machine has {torch.cuda.device_count()})")
    return torch.device("cuda", index)


def slot_pool(num_fields: int, *, pinned: bool, device_index: int = 0) -> _C.SlotPool:
    """A pool of batch buffers, page-locked when asked and the driver allows.

    Without the driver the buffers are pageable, with one warning per process.
    """
    if pinned:
        why = driver_error()
        if why is None:
            return _C.SlotPool(num_fields=num_fields, pinned=True, device=device_index)
        _warn_pageable(why)
    return _C.SlotPool(num_fields=num_fields)


class _Pending:
    """One submitted job: its ticket, where its results go, and what must stay alive."""

    __slots__ = ("ticket", "stream", "outputs", "keep", "build", "torch_copies")

    def __init__(self, ticket: int, stream: int, outputs: list[Any], keep: Any, build: Callable[[list[Any]], Any]):
        self.ticket = ticket
        self.stream = stream
        self.outputs = outputs  # destination tensors, or (dtype, shape) for staged results
        self.keep = keep  # sources the engine reads until take()
        self.build = build
        self.torch_copies: Any = None  # the torch stream some leaves (sparse) were copied on, if any


def _flatten(obj: Any, leaves: list[torch.Tensor],
             other_layout: Callable[[torch.Tensor], Any] = lambda t: t,
             custom: Callable[[Any], Any] = lambda obj: obj) -> Callable[[list[Any]], Any]:
    """Collects the CPU tensors of a batch (mappings, sequences, namedtuples) into ``leaves``.

    Returns a function that rebuilds the batch from replacements. Container types are kept
    as torch's ``pin_memory`` keeps them (a copy of a mutable container with its items
    replaced; else the type rebuilt from its items; else a plain one) -- except that a tuple
    stays a tuple. Tensors without one flat buffer (sparse, nested) go through
    ``other_layout``; other objects with a ``pin_memory`` method through ``custom``.
    """
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            return lambda out: obj
        if obj.layout != torch.strided or obj.is_nested:
            moved = other_layout(obj)
            return lambda out: moved
        i = len(leaves)
        leaves.append(obj)
        return lambda out: out[i]
    if isinstance(obj, (str, bytes)):
        return lambda out: obj
    if isinstance(obj, collections.abc.Mapping):
        parts = [(k, _flatten(v, leaves, other_layout, custom)) for k, v in obj.items()]
        return lambda out: _rebuild_mapping(obj, {k: f(out) for k, f in parts})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        fs = [_flatten(v, leaves, other_layout, custom) for v in obj]
        return lambda out: type(obj)(*(f(out) for f in fs))
    if isinstance(obj, tuple):
        fs = [_flatten(v, leaves, other_layout, custom) for v in obj]
        return lambda out: _rebuild_sequence(obj, [f(out) for f in fs])
    if isinstance(obj, collections.abc.Sequence):
        fs = [_flatten(v, leaves, other_layout, custom) for v in obj]
        return lambda out: _rebuild_sequence(obj, [f(out) for f in fs])
    if callable(getattr(obj, "pin_memory", None)):  # a custom batch type (torch calls its pin_memory())
        moved = custom(obj)
        return lambda out: moved
    return lambda out: obj


def _rebuild_mapping(obj: Any, items: dict[Any, Any]) -> Any:
    if type(obj) is dict:
        return items
    try:
        if isinstance(obj, collections.abc.MutableMapping):
            clone = copy.copy(obj)
            clone.update(items)
            return clone
        return type(obj)(items)
    except TypeError:  # cannot be copied or built from its items
        return items


def _rebuild_sequence(obj: Any, items: list[Any]) -> Any:
    if type(obj) in (list, tuple):
        return type(obj)(items)
    try:
        if isinstance(obj, collections.abc.MutableSequence):
            clone = copy.copy(obj)
            for i, v in enumerate(items):
                clone[i] = v
            return clone
        return type(obj)(items)
    except TypeError:
        return items


class DeviceStage:
    """Moves batches through the copy engine, ``depth`` in flight, onto ``device``.

    ``device=None`` with ``pin=True`` stages batches into page-locked memory only (the
    result stays on the CPU). Destination tensors come from torch's allocator on the
    consumer's current stream; the engine orders the copies after it and the consumer's
    stream after the copies (NOTE [copy ordering]).

    NOTE [stage across epochs]: a DataLoader keeps its stage from one epoch to the next.
    Making one per epoch retained the device's primary context, created a stream and
    2 * depth events, and closing it at the epoch's end waited on the host for every copy
    in flight (NOTE [copy engine shutdown]) -- a host stall at every epoch boundary. An
    epoch whose jobs were all taken leaves the ring empty, so the next epoch can submit
    to the same engine at once: ``end_epoch()`` closes the stage only when jobs are still
    in flight (an epoch abandoned part-way; the loader then makes a new one), and the
    loader reuses it when its device, depth and staging pool are unchanged. Its counters
    are reported per epoch (``begin_epoch()``). The engine stops when the loader is dropped.
    """

    def __init__(self, device: torch.device | None, *, pin: bool, depth: int,
                 staging_pool: _C.SlotPool | None = None) -> None:
        self.device = device
        self.depth = depth
        self._cuda = device is not None and device.type == "cuda"
        index = device.index if self._cuda and device is not None else 0
        pool = staging_pool if staging_pool is not None else slot_pool(1, pinned=pin or self._cuda,
                                                                       device_index=index or 0)
        self.pinned = bool(pool.pinned)
        self.staging_pool = pool
        self._engine = _C.CopyEngine(backend="cuda" if self._cuda else "cpu", device=index or 0, depth=depth,
                                     staging=pool)
        self.closed = False
        self.in_epoch = False  # an iterator is using it (begin_epoch() to end_epoch())
        self._pid = os.getpid()
        self._moved_by_torch = False  # set by _other_layout during a submit_tree()
        # NOTE [copy buffers held]: a job's destinations and staged sources, by ticket, from
        # before its submit() until it is taken or the engine closed. A KeyboardInterrupt
        # (Ctrl-C) can be raised in the Python code right after the engine accepted a job --
        # at the first Python call after submit() returned, before the job's _Pending exists
        # -- and the tensors the engine writes into (or stages from) were then freed while
        # its thread still copied: heap corruption ("free(): corrupted unsorted chunks") or
        # a crash. They are entered here, under the ticket the job will get, before the call.
        # A submit() interrupted before acceptance leaves its entry to be replaced by the next
        # submit(), which gets the same ticket.
        self._held: dict[int, Any] = {}
        self._base: dict[str, Any] = {}  # the engine's counters when the current epoch began

    def begin_epoch(self) -> None:
        """Counts from here: a stage kept across epochs (NOTE [stage across epochs]) reports per epoch."""
        self._base = dict(self._engine.counters())
        self.in_epoch = True

    def outstanding(self) -> int:
        """Jobs submitted and not yet taken (none of the parent's, in a forked child)."""
        if os.getpid() != self._pid:
            return 0
        return int(self._engine.submitted) - int(self._engine.taken)

    def end_epoch(self) -> bool:
        """Ends an epoch: True if the stage stays usable for the next one.

        See NOTE [stage across epochs]: an epoch whose jobs were all taken leaves the engine (its
        thread, stream, events and context) running, without waiting for the GPU; one
        abandoned with jobs in flight closes it.
        """
        self.in_epoch = False
        if os.getpid() != self._pid:
            # A forked child: the engine's threads are the parent's, and its lock may have
            # been held by one of them at the fork (NOTE [loader across fork]).
            self.closed = True
            return False
        if not self.closed and self.outstanding():
            self.close()
        return not self.closed

    def _stream(self) -> int:
        return int(torch.cuda.current_stream(self.device).cuda_stream) if self._cuda else 0

    def submit_host(self, host_batch: _C.HostBatch, tensors: dict[str, torch.Tensor]) -> _Pending:
        """A native batch (already in a pinned slot): copied straight to the device."""
        assert self.device is not None
        outs = {k: torch.empty(v.shape, dtype=v.dtype, device=self.device) for k, v in tensors.items()}
        segs = [(v.data_ptr(), outs[k].data_ptr(), v.nbytes) for k, v in tensors.items()]
        stream = self._stream()
        self._held[int(self._engine.submitted)] = outs  # NOTE [copy buffers held]
        ticket = self._engine.submit(segs, stream=stream, source=host_batch)
        return _Pending(ticket, stream, list(outs.values()), None, lambda _res: outs)

    def submit_tree(self, batch: Any) -> _Pending:
        """Queues any batch structure.

        The engine thread packs its CPU tensors into a staging slot, then copies them to the
        device (or returns the pinned copies).
        """
        leaves: list[torch.Tensor] = []
        self._moved_by_torch = False
        build = _flatten(batch, leaves, self._other_layout, self._custom)
        # Lazy conjugate/negative views must be materialised: the engine copies raw bytes.
        srcs = [t.resolve_conj().resolve_neg().contiguous() for t in leaves]
        stream = self._stream()
        if self.device is not None:
            outs: list[Any] = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in srcs]
            segs = [(t.data_ptr(), o.data_ptr(), t.nbytes) for t, o in zip(srcs, outs, strict=True)]
        else:
            outs = [(t.dtype, t.shape) for t in srcs]
            segs = [(t.data_ptr(), 0, t.nbytes) for t in srcs]
        self._held[int(self._engine.submitted)] = (outs, srcs)  # NOTE [copy buffers held]
        ticket = self._engine.submit(segs, stream=stream, stage=True)
        p = _Pending(ticket, stream, outs, srcs, build)
        if self._moved_by_torch:
            p.torch_copies = torch.cuda.current_stream(self.device)
        return p

    def _other_layout(self, t: torch.Tensor) -> torch.Tensor:
        """Sparse, nested and other tensors without one flat buffer: moved by torch (the engine copies flat bytes).

        To a device: pinned by torch, then copied without a host wait on the current stream
        (the stream the batch is submitted on); torch's pinned block is guarded by its own
        event, and take() orders another stream after this one. A layout torch cannot pin
        is copied synchronously, as ``t.to(device)`` does.
        """
        if self._cuda:
            try:
                pinned = t.pin_memory()
            except (RuntimeError, NotImplementedError):
                return t.to(self.device)
            self._moved_by_torch = True
            return pinned.to(self.device, non_blocking=True)
        if self.device is not None:
            return t.to(self.device)
        return t.pin_memory() if self.pinned else t

    def _custom(self, obj: Any) -> Any:
        """An object with its own ``pin_memory()``: called when pinning, as torch's pin_memory does.

        With a ``device`` the object is passed through (torch has no protocol to move it).
        """
        return obj.pin_memory() if self.device is None and self.pinned else obj

    def consumed(self, p: _Pending) -> bool:
        """Whether the engine has consumed ``p``'s ticket (a take() that raised may not have).

        In a forked child the job is lost to this process (the parent's engine refuses to
        run there, and its lock may be held: NOTE [loader across fork]), so it counts as consumed.
        """
        if os.getpid() != self._pid:
            return True
        return bool(self._engine.taken > p.ticket)

    def take(self, p: _Pending) -> Any:
        """Waits for ``p``'s copies and returns its batch rebuilt from the copies.

        The consumer's current stream is ordered after the copies.
        """
        stream = self._stream()
        res = self._engine.take(p.ticket, stream=stream)
        taken = int(self._engine.taken)  # the caller has the results of these (NOTE [copy buffers held])
        for t in [t for t in self._held if t < taken]:
            del self._held[t]
        p.keep = None
        outs = p.outputs
        if self.device is None:  # staged results: views of the (pinned) staging slot
            outs = [torch.from_dlpack(cap).view(dtype).reshape(shape)
                    for cap, (dtype, shape) in zip(res or [], p.outputs, strict=True)]
        elif self._cuda and stream != p.stream:
            # Allocated on another stream than the one that now uses them: keep torch's
            # allocator from reusing the memory before this stream is done with it.
            cur = torch.cuda.current_stream(self.device)
            for t in outs:
                t.record_stream(cur)
            if p.torch_copies is not None:
                # Sparse leaves were copied by torch on the submit stream, which the engine's
                # markers do not cover.
                cur.wait_stream(p.torch_copies)
        return p.build(outs)

    def counters(self) -> dict[str, Any]:
        """The engine's counters: jobs, bytes and where the time went (seconds)."""
        now = self._engine.counters()
        c = {k: v - self._base.get(k, 0) for k, v in now.items()}
        return {"backend": self._engine.backend, "pinned": self.pinned, "depth": self.depth, "jobs": c["jobs"],
                "bytes": c["bytes"], "staged_bytes": c["staged_bytes"], "issue_s": c["issue_ns"] / 1e9,
                "complete_s": c["complete_ns"] / 1e9, "take_wait_s": c["take_wait_ns"] / 1e9,
                "submit_wait_s": c["submit_wait_ns"] / 1e9}

    def close(self) -> None:
        """Stops the engine thread once every copy already issued completed (NOTE [copy engine shutdown])."""
        self.closed = True
        self._engine.close()
        self._held.clear()  # every issued copy completed (NOTE [copy buffers held])


class Staged:
    """Yields ``source``'s items after the copy engine moved them, ``stage.depth`` ahead.

    An exception from ``source`` is raised (with its own traceback) in its place in the
    order, after the items before it were delivered. With ``go_on_after_error`` the
    iteration then continues, as torch's DataLoader iterator does after a failing batch;
    without it (a native pipeline, which ends at its first error) the iteration ends.
    """

    def __init__(self, source: Iterator[Any], stage: DeviceStage, submit: Callable[[Any], _Pending], *,
                 go_on_after_error: bool) -> None:
        self._source = source
        self._stage = stage
        self._submit = submit
        self._go_on = go_on_after_error
        self._pending: collections.deque[_Pending | Exception] = collections.deque()
        self._done = False
        self._closed = False
        self._unsubmitted: tuple[Any] | None = None  # an item read but not yet accepted by the engine

    def __iter__(self) -> Staged:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        while not self._done and len(self._pending) < self._stage.depth:
            if self._unsubmitted is None:
                try:
                    self._unsubmitted = (next(self._source),)
                except StopIteration:
                    self._done = True
                    break
                except Exception as e:  # noqa: BLE001 - delivered in order below
                    self._pending.append(e)
                    self._done = not self._go_on
                    continue
            p: _Pending | Exception
            try:
                p = self._submit(self._unsubmitted[0])
            except Exception as e:  # noqa: BLE001 - e.g. device out of memory: this item fails, in order
                p = e
            # A KeyboardInterrupt while waiting for room keeps the item for the next call.
            self._unsubmitted = None
            self._pending.append(p)
        if not self._pending:
            self.close()
            raise StopIteration
        head = self._pending[0]
        if isinstance(head, Exception):
            self._pending.popleft()
            raise head
        try:
            out = self._stage.take(head)
        except BaseException:
            # Interrupted or timed out while waiting: the job is still the engine's next
            # one, so it stays queued (its buffers alive) for the next call. A job that
            # failed was consumed.
            if self._stage.consumed(head):
                self._pending.popleft()
            raise
        self._pending.popleft()
        return out

    def close(self) -> None:
        """Stops the engine, then lets go of the jobs' sources and destinations. Idempotent.

        The engine first waits for every copy already issued, so no source is freed while a
        copy still reads it.
        """
        if self._closed:
            return
        self._closed = True
        self._stage.end_epoch()  # See NOTE [stage across epochs]: closes it only with jobs in flight
        self._pending.clear()
        self._unsubmitted = None
        self._source = iter(())

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


class PinnedFence:
    """Keeps delivered pinned batches alive until the GPU has read them.

    NOTE [pinned batch fence]: a batch in pinned memory handed to the training loop may be
    the source of a copy the loop queues itself (``batch["x"].cuda(non_blocking=True)``).
    torch guards its own pinned blocks with an event recorded at such a copy; memory it did
    not allocate gets no such guard, so once the loop drops the batch its slot could be
    refilled by the next collation while the copy still waits in the stream. The loader
    therefore holds each delivered batch until an event, recorded on the loop's current
    stream when the next batch is taken (after every copy queued from this one on that
    stream), has completed; at most ``limit`` batches are held (then the host waits for the
    oldest: the loop runs at most ``limit`` batches ahead of its own copies). Copies queued
    on another stream must be synchronised by the caller.

    - A loop that never initialised torch's CUDA (``torch.cuda.is_initialized()``) cannot
      have queued a copy through torch: nothing is recorded and earlier batches go at once,
      so a pin-only loop that never touches a GPU does not initialise torch's CUDA (which a
      later ``fork`` would inherit broken) -- and the fence costs nothing there.
    - Events come from a small pool per device (one per held batch at most) and are
      recorded again once their record completed: no event is created per batch.
    - They are made with ``blocking=True``: waiting for one sleeps instead of spinning a core.
    - Nothing is synchronised at an epoch's end: the fence is kept across epochs
      (NOTE [stage across epochs]); ``release()`` is the explicit wait.
    """

    def __init__(self, limit: int = 4, event: Callable[[], Any] | None = None,
                 cuda_used: Callable[[], bool] | None = None, device: Callable[[], int] | None = None) -> None:
        self._limit = limit
        self._new_event = event if event is not None else _cuda_event
        self._cuda_used = cuda_used if cuda_used is not None else torch.cuda.is_initialized
        self._device = device if device is not None else torch.cuda.current_device
        self._held: collections.deque[list[Any]] = collections.deque()  # [(device, event) or None, batch]
        self._free: dict[int, list[Any]] = {}  # per device: events whose record completed
        self.events_made = 0

    def _record(self) -> tuple[int, Any]:
        """An event recorded now on the current stream, reused from the pool when one is free."""
        dev = self._device()
        free = self._free.get(dev)
        if free:
            ev = free.pop()
        else:
            ev = self._new_event()
            self.events_made += 1
        ev.record()
        return dev, ev

    def _let_go_oldest(self) -> None:
        mark, _ = self._held.popleft()
        if mark is not None:
            self._free.setdefault(mark[0], []).append(mark[1])

    def hold(self, batch: Any) -> None:
        """Holds ``batch`` until an event recorded at the next ``hold()`` completed (NOTE [pinned batch fence]).

        Lets go of earlier batches whose event completed; with ``limit`` batches held, waits
        for the oldest.
        """
        if not self._cuda_used():
            # No CUDA use through torch yet (it is never undone): no copy can read them.
            self._held.clear()
            self._held.append([None, batch])
            return
        # Earlier batches whose event completed go first: their events can be recorded again.
        while self._held and self._held[0][0] is not None and self._held[0][0][1].query():
            self._let_go_oldest()
        if self._held:
            self._held[-1][0] = self._record()  # after every copy queued from the previous batch
        while len(self._held) >= self._limit:
            self._held[0][0][1].synchronize()
            self._let_go_oldest()
        self._held.append([None, batch])

    def release(self) -> None:
        """Waits for the copies queued so far, then lets every held batch go."""
        if self._held and self._cuda_used():
            dev, ev = self._record()
            ev.synchronize()
            self._free.setdefault(dev, []).append(ev)
        while self._held:
            self._let_go_oldest()

    def __len__(self) -> int:
        return len(self._held)


def _cuda_event() -> Any:
    # blocking: a synchronize() sleeps until the event completes rather than spinning.
    return torch.cuda.Event(blocking=True)


__all__ = ["driver_error", "resolve_device", "slot_pool", "DeviceStage", "Staged", "PinnedFence"]
