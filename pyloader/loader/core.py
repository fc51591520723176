"""``LoaderCore``: what every room of ``pyloader.DataLoader`` reads and calls on the loader.

The DataLoader is built from rooms, one module each (pyloader/README.md): torch's
compatibility surface (``torch_compat``), the host buffers and copy engine (``buffers``),
the native epoch (``native_epoch``), the transform epoch (``transform_epoch``), packing
(``packed_epoch``) and the iterators (``iterators``). Each room is a class the loader
inherits; this base declares, typed, the state they share, and the members one room
calls on another, so that each room can be read (and type-checked) alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..contract import OrderSpec, PipelineStream, Plan, PlannedDataset
from . import autotune as _autotune
from . import iterators as _it
from . import transfer as _transfer
from .options import LoaderOptions
from .packing import PackSpec

if TYPE_CHECKING:
    from .._C import SlotPool
    from ..transform.auto import ExecutorChoice
    from ..transform.pool import WorkerPool
    from ..transform.stage import TransformSpec
    from ..transform.tuning import TransformTune


class LoaderCore:
    """The loader's shared state (set by ``DataLoader.__init__``) and the rooms' cross calls."""

    # The native path uses the dataset contract (PlannedDataset), not torch's Dataset type.
    dataset: Any
    collate_fn: Any
    batch_size: int | None
    drop_last: bool
    timeout: float
    generator: torch.Generator | None
    prefetch_factor: int | None
    pin_memory: bool
    pin_memory_device: str
    device: torch.device | None
    device_prefetch: int
    prefetch: int | None
    transform: Callable[..., Any] | None
    batch_transform: Callable[[Any], Any] | None
    executor: str
    memory_budget: int | None
    pack: PackSpec | None
    shuffle: bool | None

    _options: LoaderOptions
    _native: bool
    _inner: Any  # the generic path's torch DataLoader
    _mp_context: Any
    _next_epoch: int
    _resume: list[list[int]]
    _skip: int  # batches the next iter() skips (NOTE [skipped batches])
    _accelerate_state: Any  # accelerate's GradientState once accelerate prepared the loader
    _torch_run: tuple[int, dict[str, str], int, Any] | None  # NOTE [generic loader state]
    _torch_resume: dict[str, Any] | None
    _torch_epoch: int
    _run: _it.Run | None
    _fingerprint: str | None
    _fingerprint_parts: dict[str, str] | None
    _last_stats: dict[str, Any]
    _active: weakref.ref[Any] | None
    _tuner: _autotune.AutoTune | None
    _choice: ExecutorChoice | None
    _ttune: TransformTune | None
    _tpool: WorkerPool | None
    _ahead: tuple[tuple[Any, ...], PipelineStream] | None
    _batch_pool: SlotPool | None
    _staging_pool: SlotPool | None
    _doc_pool: SlotPool | None
    _kept_stage: _transfer.DeviceStage | None
    _kept_fence: _transfer.PinnedFence | None
    _pack_field: int
    _pack_resume: list[dict[str, Any]]
    _pack_run: tuple[Any, ...] | None

    worker_init_fn: Callable[[int], None] | None
    num_workers: int  # or "auto" (NOTE [autotune])
    persistent_workers: bool
    in_order: bool
    _dataset_kind: Any

    # -- provided by the rooms ----------------------------------------------------------------
    @property
    def _threads(self) -> int:  # native_epoch
        raise NotImplementedError

    @property
    def _auto_workers(self) -> bool:  # native_epoch
        raise NotImplementedError

    @property
    def _prefetch(self) -> int | None:  # native_epoch
        raise NotImplementedError

    @property
    def _seed(self) -> int | None:  # native_epoch
        raise NotImplementedError

    @property
    def _order(self) -> OrderSpec:  # native_epoch
        raise NotImplementedError

    @property
    def _settings(self) -> dict[str, Any]:  # native_epoch
        raise NotImplementedError

    @property
    def _pool(self) -> SlotPool | None:  # buffers
        raise NotImplementedError

    @property
    def _pinned(self) -> bool:  # buffers
        raise NotImplementedError

    @property
    def _pin_index(self) -> int:  # buffers
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:  # dataloader
        """The next ``iter()`` reads ``epoch`` (``DataLoader.set_epoch``)."""
        raise NotImplementedError

    def _check_pack(self, name: str) -> None:  # packed_epoch
        raise NotImplementedError

    def _iter_packed(self, epoch: int, rank: int, world: int) -> _it.LoaderIterator:  # packed_epoch
        raise NotImplementedError

    def _iter_transformed(self, ds: PlannedDataset, epoch: int, world: int, segments: list[list[int]], plan: Plan,
                          spec: TransformSpec, native_bs: int) -> _it.LoaderIterator:  # transform_epoch
        raise NotImplementedError

    def _keep_stats(self, stats: dict[str, Any]) -> None:
        self._last_stats = stats

    def _auto(self) -> _autotune.AutoTune:  # native_epoch
        raise NotImplementedError

    def _new_stage(self, in_slots: bool) -> _transfer.DeviceStage | None:  # buffers
        raise NotImplementedError

    def _fence(self, stage: _transfer.DeviceStage | None) -> _transfer.PinnedFence | None:  # buffers
        raise NotImplementedError

    def _transform_spec(self, epoch: int) -> TransformSpec | None:  # transform_epoch
        raise NotImplementedError

    def _start_run(self, epoch: int, world: int, segments: list[list[int]], consumed: _it.ConsumedCount,
                   length: int) -> None:  # native_epoch
        raise NotImplementedError

    def _loader_iterator(self, gen: Any, length: int | None, src: Any, stage: Any,
                         consumed: _it.ConsumedCount) -> _it.LoaderIterator:  # native_epoch
        raise NotImplementedError


__all__ = ["LoaderCore"]
