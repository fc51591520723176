"""Dataset helpers shared by the remote tests and the cache benchmark."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import numpy as np

import pyloader

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


def _sizes_in(d: str) -> dict[str, int]:
    out = {}
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return out
    for n in names:
        try:
            out[n] = os.stat(os.path.join(d, n)).st_size
        except FileNotFoundError:
            pass
    return out


def cache_bytes(cache_dir: str) -> int:
    """Bytes of every published shard and temp file in the cache (what the limit caps).

    A consistent sample: ``shards/`` is listed before and after ``tmp/`` and the sample is
    taken again if a download was published in between (it would be counted twice).
    """
    root = os.path.join(cache_dir, "v1")
    keys = [k for k in os.listdir(root) if os.path.isdir(os.path.join(root, k))] if os.path.isdir(root) else []
    total = 0
    for k in keys:
        for _ in range(100):
            before = _sizes_in(os.path.join(root, k, "shards"))
            temps = _sizes_in(os.path.join(root, k, "tmp"))
            after = _sizes_in(os.path.join(root, k, "shards"))
            if before.keys() == after.keys():
                total += sum(after.values()) + sum(temps.values())
                break
    return total


class UsageSampler:
    """Samples the cache directory's size every few milliseconds while a test reads."""

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir, self.peak, self.samples = cache_dir, 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, cache_bytes(self.cache_dir))
            self.samples += 1
            time.sleep(0.003)

    def __enter__(self) -> UsageSampler:
        self._t.start()
        return self

    def __exit__(self, *a: object) -> None:
        self._stop.set()
        self._t.join()
