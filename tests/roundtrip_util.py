"""Bit-exact checks shared by the round-trip tests (tests/write, tests/read).

A dataset is written with ``pyloader.ShardWriter`` (``write``) and read back through the
native batched iterator (``check_batches``: values, ``<name>_lengths`` and zero padding) or
per sample (``check_samples``); every value is compared by its stored bytes, so NaN payloads,
-0.0 and infinities compare exactly. ``id_samples``/``ID_FIELDS`` are the small mixed schema
of the batches() and DataLoader tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import pyloader

TORCH_DTYPE = {"bool": torch.bool, "uint8": torch.uint8, "uint16": torch.uint16, "uint32": torch.uint32,
               "uint64": torch.uint64, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
               "int64": torch.int64, "float16": torch.float16, "float32": torch.float32,
               "float64": torch.float64, "bfloat16": torch.bfloat16, "bytes": torch.uint8}


def write(path: str, fields: dict[str, Any], samples: list[dict[str, Any]], **kwargs: Any) -> str:
    with pyloader.ShardWriter(path, fields, **kwargs) as w:
        for s in samples:
            w.write(s)
    return path


def expected_bits(dtype: str, value: Any) -> np.ndarray:
    """The exact stored representation of a written value, as a numpy array."""
    if dtype == "bytes":
        return np.frombuffer(bytes(value), np.uint8)
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            return value.contiguous().view(torch.int16).numpy().view(np.uint16)
        value = value.numpy()
    if dtype == "bfloat16":
        arr = np.asarray(value)
        if arr.dtype == np.uint16:
            return arr
        as_bf16 = torch.from_numpy(np.asarray(arr, np.float32)).to(torch.bfloat16)
        return as_bf16.view(torch.int16).numpy().view(np.uint16)
    return np.asarray(value).astype({"bool": "?"}.get(dtype, dtype))


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Same shape and the same bytes (so NaN payloads, -0.0 and inf compare exactly)."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype.itemsize == want.dtype.itemsize, f"{what}: dtype {got.dtype} vs {want.dtype}"
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), f"{what}: values differ"


def field_dtypes(ds: pyloader.ShardDataset) -> dict[str, str]:
    return {f.name: f.dtype for f in ds.fields}


def check_batches(ds: pyloader.ShardDataset, samples: list[dict[str, Any]], batch_size: int, *,
                  num_threads: int = 2, drop_last: bool = False) -> int:
    """Reads one epoch with batches() and checks every value, length and padding byte."""
    dtypes = field_dtypes(ds)
    var = {f.name for f in ds.fields if f.variable}
    n = 0
    for b, batch in enumerate(ds.batches(batch_size, num_threads=num_threads, drop_last=drop_last)):
        rows = batch[ds.fields[0].name].shape[0]
        assert rows == min(batch_size, len(samples) - n), f"batch {b} has {rows} rows"
        assert set(batch) == set(dtypes) | {f"{v}_lengths" for v in var}
        for name, dt in dtypes.items():
            t = batch[name]
            assert t.dtype == TORCH_DTYPE[dt], f"{name}: {t.dtype}"
            full = tensor_bits(t)
            if name in var:
                lengths = batch[f"{name}_lengths"]
                assert lengths.dtype == torch.int64 and tuple(lengths.shape) == (rows,)
                want_max = max((len(expected_bits(dt, samples[n + i][name])) for i in range(rows)), default=0)
                assert full.shape[1] == want_max, f"{name}: padded to {full.shape[1]}, max length {want_max}"
            for i in range(rows):
                want = expected_bits(dt, samples[n + i][name])
                row = full[i]
                if name in var:
                    ln = int(lengths[i])
                    assert ln == len(want), f"batch {b} row {i} {name}: length {ln} != {len(want)}"
                    pad = row[ln:]
                    assert not np.ascontiguousarray(pad).view(np.uint8).any(), \
                        f"batch {b} row {i} {name}: padding not zero"
                    row = row[:ln]
                assert_same(row, want, f"batch {b} row {i} (record {n + i}) field {name}")
        n += rows
    expect = len(samples) - len(samples) % batch_size if drop_last else len(samples)
    assert n == expect
    return n


def check_samples(got: list[dict[str, Any]], samples: list[dict[str, Any]], dtypes: dict[str, str],
                  key: str | None = None) -> None:
    """Per-sample results (any order when ``key`` names a unique int field) equal the written ones."""
    assert len(got) == len(samples)
    if key is not None:
        got = sorted(got, key=lambda s: int(s[key]))
    for i, (g, s) in enumerate(zip(got, samples, strict=True)):
        assert set(g) == set(dtypes), g.keys()
        for name, dt in dtypes.items():
            if dt == "bytes":
                assert isinstance(g[name], bytes) and g[name] == bytes(s[name]), f"sample {i} {name}"
            else:
                assert g[name].dtype == TORCH_DTYPE[dt]
                assert_same(tensor_bits(g[name]), expected_bits(dt, s[name]), f"sample {i} field {name}")



def id_samples(n: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(n)
    return [{"id": i, "v": rng.integers(-99, 99, i % 9, dtype=np.int16),
             "img": rng.integers(0, 255, (2, 3), dtype=np.uint8),
             "b": bytes([i % 256]) * (i % 4)} for i in range(n)]


ID_FIELDS = {"id": ("int64", ()), "v": ("int16", (None,)), "img": ("uint8", (2, 3)), "b": ("bytes", ())}
