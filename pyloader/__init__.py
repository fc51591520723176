"""pyloader: a data-loading engine for PyTorch with a native hot path."""

from ._dataset import ShardDataset
from ._errors import (
    LoaderStateError,
    LoaderTimeoutError,
    ManifestError,
    PyloaderError,
    SchemaError,
    ShardCorruptError,
    ShardFormatError,
    ShardIOError,
)
from ._loader import DataLoader
from ._writer import ShardWriter

__version__ = "0.1.0"

__all__ = [
    "DataLoader",
    "ShardDataset",
    "ShardWriter",
    "PyloaderError",
    "ShardFormatError",
    "ShardCorruptError",
    "SchemaError",
    "ManifestError",
    "ShardIOError",
    "LoaderStateError",
    "LoaderTimeoutError",
]
