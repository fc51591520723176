"""pyloader: a data-loading engine for PyTorch with a native hot path.

The torch-facing classes are imported on first use (PEP 562), so processes that only
write or convert data (e.g. ``pyloader convert --jobs N`` workers) start without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    CacheError,
    CacheLimitError,
    CollateError,
    ConvertError,
    DeviceError,
    FetchError,
    FetchNotFoundError,
    FetchPermissionError,
    ImageDecodeError,
    LoaderStateError,
    LoaderTimeoutError,
    ManifestError,
    ManifestNotFoundError,
    NotADatasetError,
    ParquetReadError,
    PyloaderError,
    RemoteChangedError,
    ResumeError,
    SchemaError,
    ShardCorruptError,
    ShardFormatError,
    ShardIOError,
    ShardNotFoundError,
    ShardPermissionError,
    SharedMemoryError,
    ThreadStartError,
    TransformWorkerError,
    VerifyError,
)
from .write.convert import ConvertResult, convert
from .write.verify import verify_dataset as verify_conversion
from .write.writer import ShardWriter

__version__ = "0.1.0"

_LAZY = {
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


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'pyloader' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
    "ParquetReadError",
    "PyloaderError",
    "RemoteChangedError",
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
    "SampleContext",
    "ThreadStartError",
    "TransformWorkerError",
    "VerifyError",
    "convert",
    "merge_states",
    "sample_seed",
    "verify_conversion",
]
