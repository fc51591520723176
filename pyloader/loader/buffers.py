"""``HostBuffers``: the DataLoader's host buffers (batch and staging slot pools), copy engine and pinned fence."""

from __future__ import annotations

from typing import Any

import torch

import pyloader._C as _C

from ..contract import PipelineDataset, check_stream_args
from . import transfer as _transfer
from .core import LoaderCore


class HostBuffers(LoaderCore):
    """Slot pools made on first use and kept across epochs; the copy engine of each epoch (NOTE [stage across epochs])."""

    @property
    def _pool(self) -> _C.SlotPool | None:
        """The native path's batch buffers (None on the generic path), made on first use.

        Collation writes straight into them: pinned when asked (NOTE [slot reuse]).

        NOTE [lazy pinned pools]: a pinned pool retains a GPU's primary context and allocates
        through the CUDA driver, so it is made at the first ``iter()`` (as is the staging pool,
        ``_staging()``), never in the constructor: building a loader initialises no CUDA (as
        torch's does not), so a program may build it and then fork, and the pinning context
        is the device current at the first ``iter()`` -- after ``torch.cuda.set_device(local_rank)``
        -- not the one current at construction. Both pools are then kept across epochs.
        """
        if not self._native:
            return None
        if self._batch_pool is None:
            fields = 4 if self.pack is not None else len(self.dataset.fields)  # packed batches: 4 outputs
            self._batch_pool = _transfer.slot_pool(fields, pinned=self._pinned,
                                                   device_index=self._pin_index if self._pinned else 0)
        return self._batch_pool

    def _slots_to_prepare(self) -> tuple[Any, int, list[int]] | None:
        """(pool, count, field bytes) of the first epoch's slots, made by a native thread (NOTE [prepared slots]).

        The constructor passes them to ``pool.prepare``; the pool is made now.

        As many as a plain ``for batch in loader:`` loop holds at once (``prefetch`` + 3: the
        read-ahead, the batch the loop body holds, the previous one still bound to the loop
        variable while the next is asked for, and the next epoch's first batch made ahead,
        NOTE [epoch ahead]; the size such a loop's pool reached within its first epochs, 7
        slots at ``prefetch`` 4, where ``prefetch`` + 1 made the loop populate the missing
        slots inside measured epochs: 9,728 page faults for one slot of 256 records of
        150 KB), each with its fixed-shape fields' buffers populated: the memory an epoch
        would otherwise wait for the kernel to hand over, made while the training script
        builds its model. Pageable pools of the
        plain native path only: a pinned pool is made at the first ``iter()`` (NOTE [lazy
        pinned pools]), the transform and packing paths collate into pools of their own, and
        ``num_workers="auto"`` sizes memory against its budget (NOTE [autotune]).
        """
        ds = self.dataset
        if (self._pinned or self.pack is not None or self.batch_size is None or self._auto_workers
                or not isinstance(ds, PipelineDataset) or self._transform_spec(0) is not None):
            return None
        pool = self._pool
        assert pool is not None
        sizes = [0 if f.variable else self.batch_size * f.row_bytes for f in ds.fields]
        _, _, depth = check_stream_args(self.batch_size, self._threads, self._prefetch)  # the pipeline's ring
        return pool, depth + 3, sizes

    @property
    def _pin_index(self) -> int:
        """The GPU whose context pins memory (the memory is portable to every GPU).

        Asked only when pinning: as torch pins, in the current device's context, so that each
        rank of a job (after torch.cuda.set_device(local_rank)) touches only its own GPU.
        """
        named = self._options.pin_named
        if named is not None:
            return named
        return torch.cuda.current_device() if torch.cuda.is_available() else 0

    @property
    def _pinned(self) -> bool:
        """Whether host buffers should be page-locked: asked for, or needed by a GPU copy."""
        return self.pin_memory or (self.device is not None and self.device.type == "cuda")

    def _new_stage(self, in_slots: bool) -> _transfer.DeviceStage | None:
        """The copy engine for this epoch's batches, or None when they need none.

        None: no device, and either no pinning asked, batches already in pinned slots
        (``in_slots``), or no pinned memory to stage into (no driver: warned once; a pageable
        copy would only cost time). No timeout on the engine: ``timeout`` bounds waiting for
        data (as torch's bounds waiting for workers), not waiting for the GPU to finish the
        loop's own work.
        """
        if self.device is None and (not self.pin_memory or in_slots or not self._staging().pinned):
            return None
        # See NOTE [stage across epochs]: the last epoch's engine, if it ended with every job taken
        # and nothing it was made for changed.
        kept, self._kept_stage = self._kept_stage, None
        if (kept is not None and not kept.closed and not kept.in_epoch and kept.device == self.device
                and kept.depth == self.device_prefetch and kept.staging_pool is self._staging()
                and kept.outstanding() == 0):
            stage = kept
        else:
            # One still in an epoch belongs to a live iterator (NOTE [iterators of one
            # loader] in dataloader.py): it is left to that iterator, which ends it.
            if kept is not None and not kept.in_epoch:
                kept.close()
            stage = _transfer.DeviceStage(self.device, pin=self.pin_memory, depth=self.device_prefetch,
                                          staging_pool=self._staging())
        stage.begin_epoch()
        self._kept_stage = stage
        return stage

    def _fence(self, stage: _transfer.DeviceStage | None) -> _transfer.PinnedFence | None:
        """A fence for batches the loop receives in pyloader's pinned memory (NOTE [pinned batch fence]).

        The loop could queue GPU copies from them. None when it receives none: a ``device``
        is set, CUDA is unavailable, or the buffers are pageable.
        """
        if self.device is not None or not torch.cuda.is_available():
            return None
        pool = self._pool
        pinned = stage.pinned if stage is not None else pool is not None and pool.pinned
        if not pinned:
            return None
        # Kept across epochs: the batches it holds carry over, so an epoch's end waits for nothing.
        if self._kept_fence is None:
            self._kept_fence = _transfer.PinnedFence()
        return self._kept_fence

    def _staging(self) -> _C.SlotPool:
        """The engine's staging buffers, made on first use (NOTE [lazy pinned pools]) and kept across epochs."""
        if self._staging_pool is None:
            self._staging_pool = _transfer.slot_pool(1, pinned=self._pinned,
                                                     device_index=self._pin_index if self._pinned else 0)
        return self._staging_pool

    def host_memory(self, *, pinned_only: bool = False) -> dict[str, Any]:
        """The host memory of this loader's batch and staging buffers (NOTE [pinned cache]).

        ``bytes``: held from the allocator (``live_bytes`` in slots + ``cached_bytes`` kept for
        reuse, at most ``cache_limit`` per pool); ``allocs``: buffers handed out, ``reused`` of
        them from the cache; ``driver_allocs`` / ``driver_frees``: the calls that reached the
        system or, when pinned, the CUDA driver (each of which synchronises the device);
        ``driver_alloc_bytes`` / ``driver_alloc_s``: the bytes of those allocations and the
        thread time they took -- the kernel handing out and zeroing new pages, or the driver
        pinning them: in a first epoch of large records, most of what it costs beyond the
        steady state (``pyloader bench`` reports it).
        """
        keys = ("bytes", "live_bytes", "cached_bytes", "cache_limit", "allocs", "reused", "driver_allocs",
                "driver_frees", "driver_alloc_bytes", "driver_alloc_s")
        out: dict[str, Any] = dict.fromkeys(keys, 0)
        pools = [p for p in (self._batch_pool, self._staging_pool) if p is not None]
        for pool in pools:
            if pinned_only and not pool.pinned:
                continue
            m = pool.memory()
            for k in keys:
                out[k] += m[k]
        return out


__all__ = ["HostBuffers"]
