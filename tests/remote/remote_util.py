"""Dataset helpers shared by the remote tests and the cache benchmark."""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np

import pyloader
from pyloader.remote.fs import RetryPolicy

N_RECORDS = 300  # 4 KB shards: about 16 of them
FIELDS = {"image": ("uint8", (3, 8, 8)), "label": ("int64", ()), "tokens": ("int32", (None,))}


def sample(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    return {"image": rng.integers(0, 255, (3, 8, 8), dtype=np.uint8), "label": i,
            "tokens": np.arange(i % 9, dtype=np.int32)}



def write_ds(d: str, n: int = N_RECORDS, offset: int = 0) -> str:
    with pyloader.ShardWriter(d, FIELDS, compression="none", shard_bytes=4096, overwrite=True) as w:
        for i in range(n):
            s = sample(i)
            s["label"] = i + offset
            w.write(s)
    return d


def labels(ds: Any, **kw: Any) -> list[int]:
    return sorted(int(x) for b in ds.batches(32, **kw) for x in b["label"])


def temp_files(cache_dir: str) -> list[str]:
    out = []
    for root, _, files in os.walk(cache_dir):
        out += [os.path.join(root, f) for f in files if f.endswith(".part")]
    return out


def write_one_record_shards(d: str, n: int) -> str:
    """A dataset of ``n`` shards holding one record each (labels 0..n-1)."""
    with pyloader.ShardWriter(d, FIELDS, compression="none", shard_bytes=1, overwrite=True) as w:
        for i in range(n):
            w.write(sample(i))
    return d


def published(cache_dir: str) -> list[str]:
    """Every published shard file under ``cache_dir``."""
    out = []
    for root, _, files in os.walk(cache_dir):
        if os.path.basename(root) == "shards":
            out += [os.path.join(root, f) for f in files]
    return out


def child_env(root: str) -> dict[str, str]:
    """The environment of a child Python that imports this checkout's pyloader."""
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed): connections to it are refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def fetch_policy(monkeypatch: Any, **settings: float) -> RetryPolicy:
    """The retry policy of ``PYLOADER_FETCH_<NAME>`` set from ``settings`` (e.g. stall_timeout=1), for one test."""
    for name, value in settings.items():
        monkeypatch.setenv(f"PYLOADER_FETCH_{name.upper()}", str(value))
    return RetryPolicy.from_env()
