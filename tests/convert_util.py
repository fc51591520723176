"""Small generated sources for the convert and ParquetDataset tests (real files, fixed seeds)."""

from __future__ import annotations

import io
import tarfile
from typing import Any

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def mixed_table(n: int, start: int = 0) -> Any:
    """Every column kind that maps to a field; every value encodes its row id."""
    ids = np.arange(start, start + n, dtype=np.int64)
    rng = np.random.default_rng(start)
    return pa.table({
        "id": ids,
        "flag": pa.array(ids % 3 == 0),
        "u8": pa.array((ids % 251).astype(np.uint8)),
        "half": pa.array((ids % 7).astype(np.float16)),
        "vec": pa.array(rng.standard_normal((n, 3)).astype(np.float32).tolist(), pa.list_(pa.float32(), 3)),
        "mat": pa.array([[[int(i), 1], [2, 3]] for i in ids], pa.list_(pa.list_(pa.int16(), 2), 2)),
        "tokens": pa.array([list(range(int(i) % 6)) for i in ids], pa.list_(pa.int32())),
        "pairs": pa.array([[[int(i), -int(i)]] * (int(i) % 3) for i in ids], pa.list_(pa.list_(pa.int64(), 2))),
        "text": pa.array([f"row-{i}-é" for i in ids]),
        "blob": pa.array([bytes([int(i) % 256]) * (int(i) % 4) for i in ids], pa.large_binary()),
        "cat": pa.array([["a", "bb", "ccc"][int(i) % 3] for i in ids]).dictionary_encode(),
        "fixed": pa.array([int(i).to_bytes(4, "little") for i in ids], pa.binary(4)),
    })


def write_parquet(path: Any, table: Any, row_group_size: int = 64) -> str:
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)


def write_tar(path: Any, samples: list[tuple[str, dict[str, bytes]]]) -> str:
    with tarfile.open(str(path), "w") as tf:
        for key, members in samples:
            for ext, data in members.items():
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size = len(data)
                ti.mtime = 0
                tf.addfile(ti, io.BytesIO(data))
    return str(path)


def read_all(path: str) -> list[dict[str, Any]]:
    """Every record of a pyloader dataset, in order, through the native reader."""
    import pyloader

    ds = pyloader.ShardDataset(path, rank=0, world_size=1)
    out = []
    for b in ds.batches(97, shuffle=False):
        n = next(iter(b.values())).shape[0]
        for r in range(n):
            rec = {}
            for f in ds.fields:
                t = b[f.name][r]
                if f.variable:
                    t = t[: int(b[f"{f.name}_lengths"][r])]
                rec[f.name] = bytes(t.numpy()) if f.dtype == "bytes" else t.numpy().copy()
            out.append(rec)
    return out
