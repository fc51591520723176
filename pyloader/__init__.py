"""pyloader: a data-loading engine for PyTorch with a native hot path.

The torch-facing classes are imported on first use (PEP 562), so processes that only
write or convert data (e.g. ``pyloader convert --jobs N`` workers) start without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._convert import ConvertError, ConvertResult, VerifyError, convert
from ._convert import verify_dataset as verify_conversion
from ._errors import (
    DeviceError,
    LoaderStateError,
    LoaderTimeoutError,
    ManifestError,
    PyloaderError,
    SchemaError,
    ShardCorruptError,
    ShardFormatError,
    ShardIOError,
)
from ._writer import ShardWriter

__version__ = "0.1.0"

_LAZY = {
    "DataLoader": "._loader",
    "ShardDataset": "._dataset",
    "ParquetDataset": "._parquet",
    "ParquetReadError": "._parquet",
    "ResumeError": "._state",
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
    "ConvertError",
    "ConvertResult",
    "DataLoader",
    "LoaderStateError",
    "LoaderTimeoutError",
    "DeviceError",
    "ManifestError",
    "ParquetDataset",
    "ParquetReadError",
    "PyloaderError",
    "ResumeError",
    "SchemaError",
    "ShardCorruptError",
    "ShardDataset",
    "ShardFormatError",
    "ShardIOError",
    "ShardWriter",
    "VerifyError",
    "convert",
    "verify_conversion",
]
