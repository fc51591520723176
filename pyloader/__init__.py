"""pyloader: a data-loading engine for PyTorch with a native hot path.

Everything but the exception classes is imported on first use (PEP 562, the ``_LAZY``
table), so ``import pyloader`` loads only ``pyloader.errors``: processes that only write or
convert data (e.g. ``pyloader convert --jobs N`` workers) start without importing torch,
and a stage is loaded only when something asks for it. The package's own modules import
what they need from where it lives, never from here (tests/test_layout.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CacheError,
    CacheLimitError,
    CollateError,
    ConvertError,
    DeviceError,
    FetchError,
    FetchNotFoundError,
    FetchPermissionError,
    FrameworkPathError,
    ImageDecodeError,
    LoaderStateError,
    LoaderTimeoutError,
    ManifestError,
    ManifestNotFoundError,
    NotADatasetError,
    ParquetReadError,
    PlanMemoryError,
    PyloaderError,
    RemoteChangedError,
    RemoteCorruptError,
    ResumeError,
    SchemaError,
    ShardCorruptError,
    ShardFormatError,
    ShardIOError,
    ShardNotFoundError,
    ShardPermissionError,
    SharedMemoryError,
    SlowPathWarning,
    ThreadStartError,
    TransformWorkerError,
    VerifyError,
)

if TYPE_CHECKING:  # the names _LAZY imports on first use, for type checkers
    from ._version import __version__ as __version__
    from .contract import PlannedDataset
    from .loader.dataloader import DataLoader
    from .loader.packing import PackSpec, merge_states
    from .read.mixture import Mixture
    from .read.parquet import ParquetDataset
    from .read.shards import ShardDataset
    from .transform.context import SampleContext, sample_seed
    from .transform.image import ImageDecode
    from .write.convert import ConvertResult, convert
    from .write.verify import verify_dataset as verify_conversion
    from .write.writer import ShardWriter

# name -> "module" (relative to this package) or "module:attribute" where the names differ.
_LAZY = {
    "__version__": "._version",
    "ShardWriter": ".write.writer",
    "convert": ".write.convert",
    "ConvertResult": ".write.convert",
    "verify_conversion": ".write.verify:verify_dataset",
    "PlannedDataset": ".contract",
    "DataLoader": ".loader.dataloader",
    "ShardDataset": ".read.shards",
    "Mixture": ".read.mixture",
    "PackSpec": ".loader.packing",
    "merge_states": ".loader.packing",
    "ParquetDataset": ".read.parquet",
    "SampleContext": ".transform.context",
    "sample_seed": ".transform.context",
    "ImageDecode": ".transform.image",
}


# Subpackages and the native module, imported on first attribute access too, so that
# ``pyloader.write`` or ``pyloader._C`` works after a bare ``import pyloader`` as it did when
# this module imported them eagerly.
_SUBMODULES = frozenset({"_C", "bench", "format", "integrations", "loader", "read", "remote", "transform", "write"})


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    spec = _LAZY.get(name)
    if spec is None:
        raise AttributeError(f"module 'pyloader' has no attribute {name!r}")
    mod, _, attr = spec.partition(":")
    value = getattr(importlib.import_module(mod, __name__), attr or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


__all__ = [
    "CacheError",
    "CacheLimitError",
    "CollateError",
    "ConvertError",
    "ConvertResult",
    "DataLoader",
    "DeviceError",
    "FetchError",
    "FetchNotFoundError",
    "FetchPermissionError",
    "FrameworkPathError",
    "ImageDecodeError",
    "ImageDecode",
    "LoaderStateError",
    "LoaderTimeoutError",
    "ManifestError",
    "ManifestNotFoundError",
    "Mixture",
    "NotADatasetError",
    "PackSpec",
    "ParquetDataset",
    "PlannedDataset",
    "ParquetReadError",
    "PlanMemoryError",
    "PyloaderError",
    "RemoteChangedError",
    "RemoteCorruptError",
    "ResumeError",
    "SchemaError",
    "ShardCorruptError",
    "ShardDataset",
    "ShardFormatError",
    "ShardIOError",
    "ShardNotFoundError",
    "ShardPermissionError",
    "ShardWriter",
    "SharedMemoryError",
    "SlowPathWarning",
    "SampleContext",
    "ThreadStartError",
    "TransformWorkerError",
    "VerifyError",
    "convert",
    "merge_states",
    "sample_seed",
    "verify_conversion",
]
