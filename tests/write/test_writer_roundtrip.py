"""Every dtype x shape x compression x content, written with pyloader.ShardWriter and read back bit for bit.

Readers: ``ShardDataset.batches()`` (the native batched iterator: variable fields padded with
zeros plus ``<name>_lengths``) and per-sample ``ShardDataset.__iter__``. Also float specials
(NaN payloads, -0.0, infinities, subnormals), bfloat16 conversions, empty rows and zero-sized
dimensions, and which dtypes a schema accepts. Shared checks: tests/roundtrip_util.py.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np
import pytest
import torch
from roundtrip_util import check_batches, check_samples, expected_bits, field_dtypes, tensor_bits, write

import pyloader

INT_DTYPES = ["uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"]
FLOAT_DTYPES = ["float16", "float32", "float64"]
ALL_DTYPES = ["bool", *INT_DTYPES, *FLOAT_DTYPES, "bfloat16"]  # bytes is tested on its own
SHAPES: dict[str, tuple] = {"scalar": (), "vec": (3,), "cube": (2, 3, 4), "var": (None,), "var3": (None, 3)}
BITS_DTYPE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def shard_codecs(ds: pyloader.ShardDataset) -> set[int]:
    """Codecs used by the index entries of every shard (0 raw, 1 LZ4), parsed from the files.

    (Fields stored as columns, in version 3 shards, have no entries: their values are raw.)
    """
    out: set[int] = set()
    for p in ds.shard_paths:
        with open(p, "rb") as fh:
            data = fh.read()
        index_off, index_size = struct.unpack_from("<QQ", data, 48)
        for k in range(index_size // 32):
            out.add(data[index_off + 32 * k + 20])
    return out


def content(dtype: str, shape: tuple[int, ...], rng: np.random.Generator, compressible: bool) -> np.ndarray:
    """Random content over the dtype's whole range (random bits for floats: NaNs, infs,
    subnormals included), or highly repetitive content that LZ4 shrinks."""
    if dtype == "bool":
        return np.zeros(shape, bool) if compressible else rng.integers(0, 2, shape).astype(bool)
    if compressible:
        n = int(np.prod(shape))
        base = (np.arange(n) // 5 % 3).reshape(shape)
        return base.astype(np.uint16) if dtype == "bfloat16" else base.astype(dtype)
    if dtype in INT_DTYPES:
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    size = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    bits = rng.integers(0, np.iinfo(BITS_DTYPE[size]).max, shape, dtype=BITS_DTYPE[size], endpoint=True)
    return bits if dtype == "bfloat16" else bits.view(dtype)


# --- every dtype x shape x compression x content --------------------------------------------


def matrix_samples(dtype: str, compressible: bool, n: int = 37) -> list[dict[str, Any]]:
    rng = np.random.default_rng(ALL_DTYPES.index(dtype) * 2 + compressible)
    out = []
    for i in range(n):
        s = {}
        for key, shape in SHAPES.items():
            if key == "var":
                shape = (i % 7 * (5 if compressible else 1),)  # includes empty rows
            elif key == "var3":
                # 1 + ...: an empty (0, 3) row cannot be written (test_empty_rows_multidim).
                shape = (1 + i % 5 * (4 if compressible else 1), 3)
            s[key] = content(dtype, shape, rng, compressible)
        if dtype == "bfloat16" and i % 3 == 1:
            # bfloat16 also accepts torch bfloat16 tensors (bits kept exactly).
            s = {k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) for k, v in s.items()}
        out.append(s)
    return out


@pytest.mark.parametrize("compression", ["lz4", "none"])
@pytest.mark.parametrize("compressible", [True, False], ids=["repetitive", "random"])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_roundtrip_every_dtype_and_shape(tmp_path, dtype, compressible, compression):
    samples = matrix_samples(dtype, compressible)
    fields = {k: (dtype, shape) for k, shape in SHAPES.items()}
    d = write(str(tmp_path / "ds"), fields, samples, compression=compression, shard_bytes=300)
    ds = pyloader.ShardDataset(d)
    assert len(ds.shard_paths) >= 2
    assert [(f.name, f.dtype, f.shape) for f in ds.fields] == [(k, dtype, s) for k, s in SHAPES.items()]
    codecs = shard_codecs(ds)
    if compression == "none":
        assert codecs == {0}
    elif compressible:
        assert 1 in codecs
    for bs, nt in ((1, 1), (8, 3), (37, 2), (64, 1)):
        check_batches(ds, samples, bs, num_threads=nt)
    check_samples(list(ds), samples, field_dtypes(ds))


@pytest.mark.parametrize("compression", ["lz4", "none"])
@pytest.mark.parametrize("compressible", [True, False], ids=["repetitive", "random"])
def test_roundtrip_bytes(tmp_path, compressible, compression):
    rng = np.random.default_rng(5)
    samples = []
    for i in range(41):
        n = (i * 37) % 300 if i % 6 else 0
        raw = (b"abcab" * n)[:n] if compressible else rng.bytes(n)
        samples.append({"b": [bytes, bytearray, memoryview, lambda x: np.frombuffer(x, np.uint8)][i % 4](raw),
                        "id": i})
    d = write(str(tmp_path / "ds"), {"b": ("bytes", ()), "id": ("int32", ())}, samples,
              compression=compression, shard_bytes=1500)
    ds = pyloader.ShardDataset(d)
    assert ds.fields[0].shape == (None,)
    if compressible and compression == "lz4":
        assert 1 in shard_codecs(ds)
    for bs in (1, 6, 41):
        check_batches(ds, samples, bs)
    check_samples(list(ds), samples, field_dtypes(ds))


FLOAT_SPECIALS = {
    "float16": [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7D55, 0xFDFF, 0x0001, 0x03FF, 0x7BFF,
                0xFBFF],
    "bfloat16": [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7FA5, 0xFFFF, 0x0001, 0x007F, 0x7F7F,
                 0xFF7F],
    "float32": [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                0x7FA5A5A5, 0xFFFFFFFF, 0x00000001, 0x007FFFFF, 0x7F7FFFFF, 0xFF7FFFFF],
    "float64": [0, 1 << 63, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000, 0xFFF8000000000000,
                0x7FF0000000000001, 0x7FF5A5A5A5A5A5A5, 0xFFFFFFFFFFFFFFFF, 1, 0x000FFFFFFFFFFFFF,
                0x7FEFFFFFFFFFFFFF, 0xFFEFFFFFFFFFFFFF],
}


@pytest.mark.parametrize("compression", ["lz4", "none"])
@pytest.mark.parametrize("dtype", list(FLOAT_SPECIALS))
def test_nan_inf_signed_zero_subnormal_preserved_bitwise(tmp_path, dtype, compression):
    """Signalling NaNs, NaN payloads, -0.0, +-inf, subnormals and extremes keep every bit."""
    size = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    bits = np.array(FLOAT_SPECIALS[dtype], dtype=BITS_DTYPE[size])
    vals = bits if dtype == "bfloat16" else bits.view(dtype)
    k = len(vals)
    samples = [{"x": vals[i % k], "row": np.roll(vals, i), "var": np.tile(vals, 1 + i % 3)[: 3 + i]} for i in range(k)]
    if dtype == "bfloat16":  # as torch bfloat16 tensors too
        samples += [{kk: torch.from_numpy(np.asarray(v).view(np.int16)).view(torch.bfloat16) for kk, v in s.items()}
                    for s in samples]
    fields = {"x": (dtype, ()), "row": (dtype, (k,)), "var": (dtype, (None,))}
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), fields, samples, compression=compression))
    check_batches(ds, samples, 4)
    check_samples(list(ds), samples, field_dtypes(ds))
    # And explicitly: the NaNs read back are still NaNs with their payloads.
    got = next(iter(ds.batches(len(samples))))["row"]
    assert tensor_bits(got)[0].tobytes() == np.asarray(expected_bits(dtype, samples[0]["row"])).tobytes()


def test_bfloat16_from_float32_arrays_and_tensors(tmp_path):
    """float32 data stored in a bfloat16 field is rounded exactly as torch rounds it."""
    rng = np.random.default_rng(3)
    f32 = rng.standard_normal((20, 4)).astype(np.float32) * 1e3
    f32[0] = [np.inf, -np.inf, 0.0, -0.0]
    f32[1] = [3.4e38, 1e-40, 1.00390625, 1.01171875]  # overflow-to-inf edge, subnormal, ties
    samples = []
    for i in range(20):
        src = [f32[i], torch.from_numpy(f32[i]), f32[i].astype(np.float64),
               torch.from_numpy(f32[i]).to(torch.bfloat16)][i % 4]
        samples.append({"x": src, "v": f32[i][: i % 4], "s": torch.from_numpy(f32[i][:1]).to(torch.bfloat16)[0]})
    fields = {"x": ("bfloat16", (4,)), "v": (torch.bfloat16, (None,)), "s": ("bfloat16", ())}
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), fields, samples))
    batch = next(iter(ds.batches(20)))
    assert batch["x"].dtype == torch.bfloat16
    want = torch.from_numpy(f32).to(torch.bfloat16)
    assert torch.equal(batch["x"].view(torch.int16), want.view(torch.int16))
    assert torch.equal(batch["s"].view(torch.int16), want[:, 0].contiguous().view(torch.int16))
    check_batches(ds, samples, 7)
    check_samples(list(ds), samples, field_dtypes(ds))


@pytest.mark.parametrize("value", [1.5, np.float32(1.5), np.array(1.5), np.float64(1.5), 3])
def test_bfloat16_scalar_field_from_a_number(tmp_path, value):
    # Regression: the bfloat16 branch of ShardWriter._to_array once converted with
    # np.ascontiguousarray, which turns a 0-d array into shape (1,), so a Python float or
    # numpy scalar written to a scalar bfloat16 field failed with "expected shape (), got (1,)".
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), {"s": ("bfloat16", ())}, [{"s": value}]))
    got = next(iter(ds.batches(1)))["s"]
    assert got.dtype == torch.bfloat16 and got.tolist() == [float(value)]


def test_empty_rows_and_all_empty_batch(tmp_path):
    """Length-0 rows anywhere, and whole batches in which every row is empty."""
    def sample(i: int) -> dict[str, Any]:
        n = 0 if i < 8 or i % 3 == 0 else i % 7
        return {"t": np.arange(n, dtype=np.int64) - 3, "b": b"z" * n, "h": np.ones(n, np.float16), "id": i}
    samples = [sample(i) for i in range(30)]
    fields = {"t": ("int64", (None,)), "b": ("bytes", ()), "h": ("float16", (None,)), "id": ("int64", ())}
    for compression in ("lz4", "none"):
        ds = pyloader.ShardDataset(write(str(tmp_path / compression), fields, samples, compression=compression))
        it = ds.batches(4, num_threads=1)
        for _ in range(2):  # records 0..7: both batches entirely empty
            b = next(it)
            assert tuple(b["t"].shape) == (4, 0) and tuple(b["b"].shape) == (4, 0) and tuple(b["h"].shape) == (4, 0)
            assert b["t_lengths"].tolist() == [0, 0, 0, 0] and b["b_lengths"].tolist() == [0, 0, 0, 0]
        for bs in (1, 4, 5, 30):
            check_batches(ds, samples, bs)
        check_samples(list(ds), samples, field_dtypes(ds), key="id")


@pytest.mark.parametrize("dtype", ["uint8", "int32", "float32", "bfloat16"])
def test_empty_rows_multidim(tmp_path, dtype):
    # BUG (pyloader/write/writer.py, ShardWriter.write: `memoryview(np.ascontiguousarray(arr)).cast("B")`):
    # an empty row of a variable field with trailing dims, e.g. shape (0, 3) for a
    # (None, 3) field, makes write() raise TypeError("memoryview: cannot cast view with
    # zeros in shape or strides"). Empty rows must be writable for every variable field.
    samples = [{"m": np.zeros((i % 3, 3), np.float32 if dtype == "bfloat16" else dtype)} for i in range(9)]
    samples[4]["m"] = samples[4]["m"][:0]
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), {"m": (dtype, (None, 3))}, samples))
    b = next(iter(ds.batches(3)))
    assert tuple(b["m"].shape) == (3, 2, 3) and b["m_lengths"].tolist() == [0, 1, 2]
    check_batches(ds, samples, 3)
    empty_row = np.zeros((0, 3), np.float32 if dtype == "bfloat16" else dtype)
    all_empty = pyloader.ShardDataset(write(str(tmp_path / "e"), {"m": (dtype, (None, 3))}, [{"m": empty_row}] * 5))
    b = next(iter(all_empty.batches(5)))
    assert tuple(b["m"].shape) == (5, 0, 3) and b["m_lengths"].tolist() == [0] * 5


def test_fixed_field_with_zero_sized_dim(tmp_path):
    # BUG (same line as test_empty_rows_multidim): a fixed field whose shape has a 0 dim,
    # e.g. (2, 0), is accepted by the schema but every write() raises TypeError.
    samples = [{"z": np.zeros((2, 0), np.int16), "id": i} for i in range(3)]
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), {"z": ("int16", (2, 0)), "id": ("int16", ())}, samples))
    b = next(iter(ds.batches(3)))
    assert tuple(b["z"].shape) == (3, 2, 0) and b["id"].tolist() == [0, 1, 2]


def test_schema_accepts_numpy_and_torch_dtypes(tmp_path):
    fields = {
        "a": (np.dtype("int16"), (3,)), "b": (np.float32, ()), "c": (np.dtype(np.uint64), (None,)),
        "d": (torch.bfloat16, (2,)), "e": (torch.int64, (None, 2)), "f": (torch.bool, ()),
        "g": (torch.float16, (1,)), "h": (bytes, ()), "i": "uint32", "j": (np.bool_, (2,)),
    }
    want = {"a": "int16", "b": "float32", "c": "uint64", "d": "bfloat16", "e": "int64", "f": "bool",
            "g": "float16", "h": "bytes", "i": "uint32", "j": "bool"}
    samples = [{"a": np.arange(3, dtype=np.int16) * i, "b": np.float32(i / 3), "c": np.arange(i, dtype=np.uint64) << 60,
                "d": torch.tensor([i, -i], dtype=torch.bfloat16), "e": torch.arange(2 * (1 + i % 3)).reshape(-1, 2),
                "f": bool(i % 2), "g": torch.tensor([i / 7], dtype=torch.float16), "h": bytes(i), "i": 2**32 - 1 - i,
                "j": np.array([i % 2, 1 - i % 2], bool)} for i in range(6)]
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), fields, samples))
    assert field_dtypes(ds) == want
    with open(os.path.join(str(tmp_path / "ds"), "manifest.json")) as fh:
        manifest = json.load(fh)["manifest"]
    assert {f["name"]: f["dtype"] for f in manifest["fields"]} == want
    check_batches(ds, samples, 4)
    check_samples(list(ds), samples, want)


@pytest.mark.parametrize("bad", [torch.complex64, np.complex128, np.dtype("U3"), object, "float8", "int128", str])
def test_schema_rejects_unsupported_dtypes(tmp_path, bad):
    with pytest.raises(pyloader.SchemaError):
        pyloader.ShardWriter(str(tmp_path / "ds"), {"x": (bad, (2,))})
    assert not os.path.exists(os.path.join(str(tmp_path / "ds"), "manifest.json"))

