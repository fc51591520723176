"""Shared fixtures: small real datasets written with pyloader.ShardWriter."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import pyloader

# The default cache root (``$XDG_CACHE_HOME/pyloader`` when PYLOADER_CACHE_DIR is not set:
# the records of verified local shards, a node cache without cache_dir) is a folder of this
# test process (each of -n auto's has its own), for its tests and every process they start,
# never the user's ~/.cache/pyloader.
_CACHE_HOME = tempfile.mkdtemp(prefix="pyloader-test-cache-home-")
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME
atexit.register(shutil.rmtree, _CACHE_HOME, True)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many test processes ``-n auto`` (pyproject.toml's addopts) starts: one per CPU, at most 4.

    Many tests start processes and threads of their own (loaders' workers, servers, two ranks
    under torchrun), so more test processes than CPUs would only slow each other down.
    """
    return max(1, min(4, len(os.sched_getaffinity(0))))


# A schema with every kind of field: fixed, scalar, variable, bytes, bfloat16.
MIXED_FIELDS: dict[str, Any] = {
    "image": ("uint8", (3, 8, 8)),
    "label": ("int64", ()),
    "tokens": ("int32", (None,)),
    "blob": ("bytes", ()),
    "half": ("float16", (2,)),
}


def mixed_sample(i: int) -> dict[str, Any]:
    """Deterministic sample i: every field encodes i so a reader can check it."""
    rng = np.random.default_rng(i)
    return {
        "image": np.full((3, 8, 8), i % 251, np.uint8) + rng.integers(0, 4, (3, 8, 8), dtype=np.uint8),
        "label": i,
        "tokens": np.arange(i, i + (i % 9), dtype=np.int32),
        "blob": bytes([i % 256]) * (i % 5),
        "half": np.array([i, -i], np.float16),
    }


@pytest.fixture
def write_dataset(tmp_path) -> Callable[..., str]:
    """write_dataset(n, fields=MIXED_FIELDS, sample=mixed_sample, **writer_kwargs) -> dataset dir."""
    counter = [0]

    def _write(n: int, fields: dict[str, Any] | None = None, sample: Callable[[int], dict] | None = None,
               **kwargs: Any) -> str:
        counter[0] += 1
        d = os.path.join(tmp_path, f"ds{counter[0]}")
        kwargs.setdefault("shard_bytes", 4096)
        with pyloader.ShardWriter(d, fields or MIXED_FIELDS, **kwargs) as w:
            for i in range(n):
                w.write((sample or mixed_sample)(i))
        return d

    return _write
