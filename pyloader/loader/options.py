"""``LoaderOptions``: the settings of a ``pyloader.DataLoader``, checked once, in one place.

NOTE [loader options]: the constructor's arguments become one frozen ``LoaderOptions``,
whose ``__post_init__`` holds every rule that does not depend on the dataset (the
dataset-dependent ones are the rooms': ``native_epoch``, ``torch_compat``, ``packed_epoch``),
each by its setting's one rule (NOTE [one rule per setting] in ``pyloader.contract``).
torch lets code assign some of those attributes after construction (``num_workers``,
``timeout``...): such an assignment is checked by the same rules, as it builds the next
options object with ``replace`` (``TorchCompat.__setattr__``); the loader's public attributes
always hold the values of its current options.

torch's own arguments come first, in torch's order (``num_workers``, ``timeout``,
``prefetch_factor``, ``persistent_workers``, then the rest), with torch's messages, and
accept what torch accepts (``shuffle``: any truth value). The checks torch makes with the
dataset and the samplers (``sampler`` with ``shuffle``, an ``IterableDataset`` with
``shuffle``...) are torch's own on the generic path, given the arguments as the caller wrote
them (``TorchCompat._init_torch``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..contract import (
    DEFAULTS,
    check_callable,
    check_choice,
    check_count,
    check_int,
    check_seconds,
    check_size,
)
from ..transform.stage import EXECUTORS
from . import transfer as _transfer
from .packing import PackSpec


def pin_device_index(pin_memory_device: str) -> int | None:
    """The GPU named by ``pin_memory_device`` (None: not named). Validates the string."""
    if not isinstance(pin_memory_device, str):
        raise ValueError(f"pin_memory_device must be a str, got {pin_memory_device!r}")
    if not pin_memory_device:
        return None
    try:
        dev = torch.device(pin_memory_device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type != "cuda":
        raise ValueError(f"pin_memory_device={pin_memory_device!r}: pyloader pins memory for 'cuda[:N]' only")
    return dev.index


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """Every constructor argument of ``pyloader.DataLoader`` but the dataset, sampler and multiprocessing context.

    Checked when built (NOTE [loader options]); raises ``ValueError`` naming the setting.
    """

    batch_size: int | None = 1
    shuffle: bool | None = None
    num_workers: int | str = 0
    collate_fn: Callable[[Any], Any] | None = None
    pin_memory: bool = False
    drop_last: bool = False
    timeout: float = 0
    worker_init_fn: Callable[[int], None] | None = None
    generator: torch.Generator | None = None
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pin_memory_device: str = ""
    in_order: bool = True
    device: torch.device | None = None
    device_prefetch: int = DEFAULTS["device_prefetch"]
    prefetch: int | None = None
    transform: Callable[..., Any] | None = None
    executor: str = "auto"
    batch_transform: Callable[[Any], Any] | None = None
    memory_budget: int | str | None = None  # bytes, or a size string such as "8G" (parse_size)
    pack: PackSpec | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        if self.num_workers != "auto":  # See NOTE [autotune]: "auto" is checked with the dataset
            put(self, "num_workers", check_count("num_workers", self.num_workers))
        workers = 1 if self.num_workers == "auto" else self.num_workers
        put(self, "timeout", check_seconds("timeout", self.timeout))
        if workers == 0 and self.prefetch_factor is not None:
            raise ValueError("prefetch_factor option could only be specified in multiprocessing."
                             "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None.")
        put(self, "prefetch_factor", check_int("prefetch_factor", self.prefetch_factor))
        if self.persistent_workers and workers == 0:
            raise ValueError("persistent_workers option needs num_workers > 0")
        # torch's rule: any truth value (its ``bool(shuffle)``); None is "unspecified" (on the
        # native path: the dataset's own setting). torch's checks of shuffle with a sampler or
        # an IterableDataset see the value as given, on the generic path.
        put(self, "shuffle", None if self.shuffle is None else bool(self.shuffle))
        bs = self.batch_size
        put(self, "batch_size", None if bs is None else check_count("batch_size", bs))
        put(self, "drop_last", bool(self.drop_last))
        put(self, "pin_memory", bool(self.pin_memory))
        put(self, "device_prefetch", check_count("device_prefetch", self.device_prefetch))
        pin_device_index(self.pin_memory_device)
        put(self, "device", _transfer.resolve_device(self.device))
        put(self, "prefetch", check_int("prefetch", self.prefetch))
        put(self, "memory_budget", check_size("memory_budget", self.memory_budget))
        if self.memory_budget is not None and self.num_workers != "auto":
            raise ValueError("memory_budget= bounds what num_workers='auto' may use; give num_workers='auto'")
        if self.pack is not None and not isinstance(self.pack, PackSpec):
            raise ValueError(f"pack must be a pyloader.PackSpec, got {self.pack!r}")
        check_callable("transform", self.transform)
        check_callable("batch_transform", self.batch_transform)
        check_callable("collate_fn", self.collate_fn)
        check_callable("worker_init_fn", self.worker_init_fn)
        check_choice("executor", self.executor, EXECUTORS)
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(self.generator).__name__}")

    def replace(self, **changes: Any) -> LoaderOptions:
        """These options with ``changes``, checked by the same rules."""
        return dataclasses.replace(self, **changes)

    @property
    def pin_named(self) -> int | None:
        """The GPU that pins host memory when one is named (``device="cuda:N"`` or ``pin_memory_device``)."""
        if self.device is not None and self.device.type == "cuda":
            return self.device.index
        return pin_device_index(self.pin_memory_device)

    @property
    def pinned(self) -> bool:
        """Whether host buffers should be page-locked: asked for, or needed by a GPU copy."""
        return self.pin_memory or (self.device is not None and self.device.type == "cuda")


OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(LoaderOptions))

__all__ = ["OPTION_NAMES", "LoaderOptions", "pin_device_index"]
