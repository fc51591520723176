"""The native codecs against independent references: the LZ4 block decoder against the lz4
package (valid, boundary-sized, malformed, mutated and arbitrary blocks, inside guard bytes
and guard pages), XXH64 against a pure-Python implementation of the xxHash spec, and
XXH3-64 (every long-input loop this CPU runs, and the fused copy) against the reference
implementation's own binding, the xxhash package.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import lz4.block
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import pyloader
from pyloader import _C

# --- the native LZ4 decoder against the lz4 package -----------------------------------------------


def make_data(kind: str, size: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.bytes(size)
    if kind == "zeros":
        return bytes(size)
    if kind == "period":  # short periods exercise overlapping matches (offsets 1..15)
        period = rng.bytes(int(rng.integers(1, 20)))
        return (period * (size // max(len(period), 1) + 1))[:size]
    if kind == "runs":  # random chunks and repeats of earlier chunks, at all distances
        out = bytearray()
        while len(out) < size:
            if out and rng.random() < 0.6:
                start = int(rng.integers(0, len(out)))
                out += out[start:start + int(rng.integers(4, 300))]
            else:
                out += rng.bytes(int(rng.integers(1, 64)))
        return bytes(out[:size])
    if kind == "lowentropy":
        return rng.integers(0, 3, size, dtype=np.uint8).tobytes()
    if kind == "numeric":  # like real tensors: slowly varying int32
        return np.cumsum(rng.integers(-2, 3, size // 4 + 1)).astype(np.int32).tobytes()[:size]
    raise AssertionError(kind)


KINDS = ["random", "zeros", "period", "runs", "lowentropy", "numeric"]
sizes = st.one_of(st.integers(0, 40), st.integers(0, 2000), st.integers(0, 300_000))
modes = st.sampled_from([("default", {}), ("fast", {"acceleration": 8}), ("high_compression", {"compression": 4}),
                         ("high_compression", {"compression": 12})])
LZ4_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def compress(data: bytes, mode: tuple[str, dict[str, Any]]) -> bytes:
    return lz4.block.compress(data, store_size=False, mode=mode[0], **mode[1])


def decode_guarded(block: bytes, size: int) -> bytes:
    """lz4_decode_into a window inside a larger buffer: bytes around it must stay untouched."""
    guard = 64
    buf = bytearray(b"\xa5" * (size + 2 * guard))
    view = memoryview(buf)[guard:guard + size]
    try:
        _C.lz4_decode_into(block, view)
    finally:
        view.release()
        assert buf[:guard] == b"\xa5" * guard and buf[guard + size:] == b"\xa5" * guard, "write outside dst"
    return bytes(buf[guard:guard + size])


def test_lz4_hand_made_malformed_blocks():
    bad = [
        (b"", 0), (b"", 5),                     # no token at all
        (b"\x10", 1),                            # one literal promised, none present
        (b"\xf0", 15), (b"\xf0\xff", 300),       # length continuation runs off the end
        (b"\x10a\x00\x00", 5),                   # offset 0
        (b"\x10a\x02\x00", 5),                   # offset before the start of output
        (b"\x00\x01\x00", 4),                    # match with nothing written yet
        (b"\x10a\x01\x00", 5),                   # ends with a match (no last literals)
        (b"\x10a\x01", 5),                       # truncated offset
        (b"\x1fa\x01\x00", 100),                 # match length continuation missing
        (b"\x1fa\x01\x00\xff\xff\xff\xff", 2000),  # match length continues past the input
        (b"\x50abcde", 3),                       # literals overflow the output
        (b"\x30abc", 5),                         # input ends before the output is full
        (b"\x1fa\x01\x00\xff\x00\x00", 10),      # match far longer than the output
    ]
    for block, size in bad:
        with pytest.raises(pyloader.ShardFormatError, match="LZ4 block is malformed"):
            _C.lz4_decode_block(block, size)
    good = [(b"\x00", b""), (b"\x30abc", b"abc"), (b"\x1fa\x01\x00\x00\x00", b"a" * 20),
            (b"\x23ab\x02\x00\x00", b"ab" * 4 + b"a")]
    for block, want in good:
        assert _C.lz4_decode_block(block, len(want)) == want


_GUARD_CHILD = r"""
import ctypes, mmap, sys
import numpy as np, lz4.block
from pyloader import _C, ShardFormatError
PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

def guarded(n_pages):
    # [PROT_NONE page][n_pages usable][PROT_NONE page]: touching either guard faults.
    mm = mmap.mmap(-1, (n_pages + 2) * PAGE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    for p in (0, n_pages + 1):
        assert libc.mprotect(addr + p * PAGE, PAGE, 0) == 0
    return mm, memoryview(mm)

src_mm, src_mv = guarded(20)
dst_mm, dst_mv = guarded(20)
lo, hi = PAGE, 21 * PAGE
rng = np.random.default_rng(int(sys.argv[1]))
n_ok = n_err = 0
for it in range(int(sys.argv[2])):
    size = int(rng.choice([rng.integers(0, 64), rng.integers(0, 4096), rng.integers(0, 60000)]))
    kind = int(rng.integers(0, 3))
    data = rng.bytes(size) if kind == 0 else (rng.bytes(int(rng.integers(1, 16))) * (size + 1))[:size] if kind == 1 \
        else rng.integers(0, 3, size, dtype=np.uint8).tobytes()
    block = bytearray(lz4.block.compress(data, store_size=False))
    if it % 4:
        for _ in range(int(rng.integers(1, 6))):
            r = int(rng.integers(0, 4))
            if r == 0 and block: block[int(rng.integers(0, len(block)))] ^= 1 << int(rng.integers(0, 8))
            elif r == 1 and block: block[int(rng.integers(0, len(block)))] = int(rng.choice([0, 255, 0xF0, 0x0F]))
            elif r == 2: del block[int(rng.integers(0, len(block) + 1)):]
            else: block += rng.bytes(int(rng.integers(1, 20)))
    want = max(0, size + int(rng.choice([0, 0, 0, -1, 1, 40])))
    if len(block) > 20 * PAGE or want > 20 * PAGE:
        continue
    # src flush against the upper guard, or the lower one; dst likewise.
    s0 = hi - len(block) if it % 2 else lo
    d0 = hi - want if (it // 2) % 2 else lo
    src_mv[s0:s0 + len(block)] = bytes(block)
    try:
        _C.lz4_decode_into(src_mv[s0:s0 + len(block)], dst_mv[d0:d0 + want])
        n_ok += 1
        if it % 4 == 0:
            assert bytes(dst_mv[d0:d0 + want]) == data, "valid block decoded wrongly"
    except ShardFormatError:
        n_err += 1
print(n_ok, n_err)
"""


@pytest.mark.timeout(120)
def test_lz4_decoder_stays_inside_guard_pages_in_subprocess(tmp_path):
    """Blocks flush against PROT_NONE pages on both sides of src and dst: one byte read or
    written outside [src, src+n) or [dst, dst+size) kills the child with SIGSEGV."""
    script = tmp_path / "guard_child.py"
    script.write_text(_GUARD_CHILD)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, str(script), "12345", "3000"], env=env, capture_output=True, text=True,
                       timeout=110, check=False)
    assert p.returncode == 0, f"guard-page child exited {p.returncode}:\n{p.stderr[-3000:]}"
    n_ok, n_err = map(int, p.stdout.split())
    assert n_ok > 500 and n_err > 500


@LZ4_SETTINGS
@given(kind=st.sampled_from(KINDS), size=sizes, seed=st.integers(0, 2**32 - 1), mode=modes)
def test_lz4_decode_matches_reference(kind, size, seed, mode):
    data = make_data(kind, size, seed)
    block = compress(data, mode)
    assert _C.lz4_decode_block(block, len(data)) == data
    assert decode_guarded(block, len(data)) == data
    # The block must expand to exactly the requested size: one more or one less is an error.
    with pytest.raises(pyloader.ShardFormatError, match="LZ4"):
        _C.lz4_decode_block(block, len(data) + 1)
    if data:
        with pytest.raises(pyloader.ShardFormatError, match="LZ4"):
            _C.lz4_decode_block(block, len(data) - 1)


@pytest.mark.parametrize("size", [0, 1, 4, 5, 12, 13, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 4096, 65535,
                                  65536, 65537, 300_000])
@pytest.mark.parametrize("kind", KINDS)
def test_lz4_decode_boundary_sizes(kind, size):
    data = make_data(kind, size, size)
    for mode in (("default", {}), ("high_compression", {"compression": 9})):
        block = compress(data, mode)
        assert _C.lz4_decode_block(block, size) == data
        assert decode_guarded(block, size) == data


def mutate(block: bytes, rng: np.random.Generator) -> bytes:
    b = bytearray(block)
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(0, 5))
        if op == 0 and b:  # flip bits
            for _ in range(int(rng.integers(1, 4))):
                b[int(rng.integers(0, len(b)))] ^= 1 << int(rng.integers(0, 8))
        elif op == 1 and b:  # set a byte to an extreme value (length nibbles of 15, 255 runs)
            b[int(rng.integers(0, len(b)))] = int(rng.choice([0x00, 0xFF, 0xF0, 0x0F, 0x10, 0x01]))
        elif op == 2:  # truncate
            del b[int(rng.integers(0, len(b) + 1)):]
        elif op == 3:  # extend
            b += rng.bytes(int(rng.integers(1, 40)))
        elif op == 4 and b:  # splice a chunk elsewhere
            i, j = sorted(int(x) for x in rng.integers(0, len(b) + 1, 2))
            k = int(rng.integers(0, len(b) + 1))
            b[k:k] = b[i:j]
    return bytes(b)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), size=st.one_of(st.integers(0, 300), st.integers(0, 20_000)),
       seed=st.integers(0, 2**32 - 1), mode=modes, size_delta=st.sampled_from([0, 0, 0, -1, 1, 17, -17]))
def test_lz4_mutated_blocks_decode_exactly_or_raise(kind, size, seed, mode, size_delta):
    data = make_data(kind, size, seed)
    block = mutate(compress(data, mode), np.random.default_rng(seed))
    want = len(data) + size_delta
    assume(want >= 0)
    try:
        out = _C.lz4_decode_block(block, want)
    except pyloader.ShardFormatError as e:
        assert "LZ4 block is malformed" in str(e)
    else:
        assert isinstance(out, bytes) and len(out) == want
    try:
        out2 = decode_guarded(block, want)
    except pyloader.ShardFormatError:
        pass
    else:
        assert len(out2) == want


@settings(max_examples=300, deadline=None)
@given(block=st.binary(max_size=200), size=st.integers(0, 5000))
def test_lz4_arbitrary_bytes_decode_exactly_or_raise(block, size):
    try:
        out = decode_guarded(block, size)
    except pyloader.ShardFormatError:
        return
    assert len(out) == size


# --- XXH64 against an independent pure-Python implementation of the spec ---------------------------

_M64 = (1 << 64) - 1
_P1, _P2, _P3, _P4, _P5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                           0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M64


def _round(acc: int, lane: int) -> int:
    return (_rotl((acc + lane * _P2) & _M64, 31) * _P1) & _M64


def ref_xxh64(data: bytes, seed: int = 0) -> int:
    """XXH64 straight from the xxHash specification (doc/xxhash_spec.md)."""
    n, i = len(data), 0
    if n >= 32:
        v = [(seed + _P1 + _P2) & _M64, (seed + _P2) & _M64, seed & _M64, (seed - _P1) & _M64]
        while i + 32 <= n:
            for k in range(4):
                v[k] = _round(v[k], int.from_bytes(data[i + 8 * k:i + 8 * k + 8], "little"))
            i += 32
        acc = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _M64
        for k in range(4):
            acc = (((acc ^ _round(0, v[k])) * _P1) + _P4) & _M64
    else:
        acc = (seed + _P5) & _M64
    acc = (acc + n) & _M64
    while i + 8 <= n:
        acc ^= _round(0, int.from_bytes(data[i:i + 8], "little"))
        acc = (_rotl(acc, 27) * _P1 + _P4) & _M64
        i += 8
    if i + 4 <= n:
        acc ^= (int.from_bytes(data[i:i + 4], "little") * _P1) & _M64
        acc = (_rotl(acc, 23) * _P2 + _P3) & _M64
        i += 4
    while i < n:
        acc ^= (data[i] * _P5) & _M64
        acc = (_rotl(acc, 11) * _P1) & _M64
        i += 1
    acc ^= acc >> 33
    acc = (acc * _P2) & _M64
    acc ^= acc >> 29
    acc = (acc * _P3) & _M64
    return acc ^ (acc >> 32)


def test_xxh64_known_vectors():
    # Published reference values (xxHash's own test vectors and the spec's examples).
    known = {b"": 0xEF46DB3751D8E999, b"a": 0xD24EC4F1A98C6E5B, b"abc": 0x44BC2CF5AD770999}
    for data, want in known.items():
        assert ref_xxh64(data) == want  # the reference implementation is right...
        assert _C.xxh64(data) == want   # ...and so is the native one
    assert _C.xxh64(b"", seed=0) == 0xEF46DB3751D8E999
    # Every code path: < 4, 4..7, 8..31, exactly 32, stripes plus tails, with big seeds.
    for n in list(range(70)) + [100, 127, 128, 129, 1000, 4096 + 7]:
        data = bytes((i * 131 + n) % 256 for i in range(n))
        for seed in (0, 1, 0x9E3779B185EBCA87, _M64):
            assert _C.xxh64(data, seed=seed) == ref_xxh64(data, seed), (n, seed)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), seed=st.integers(0, _M64))
def test_xxh64_matches_reference(data, seed):
    assert _C.xxh64(data, seed=seed) == ref_xxh64(data, seed)


def _xxh64_impls() -> list[str]:
    """The stripe loops this build and CPU run ("auto" is one of them)."""
    out = []
    for impl in ("scalar", "avx512"):
        try:
            _C.xxh64(b"", impl=impl)
        except ValueError:
            continue
        out.append(impl)
    return out


XXH64_IMPLS = _xxh64_impls()


def test_xxh64_impls_cover_the_machine():
    assert "scalar" in XXH64_IMPLS
    if sys.platform.startswith("linux") and os.uname().machine == "x86_64":
        with open("/proc/cpuinfo") as fh:
            flags = set(fh.read().split())
        assert ("avx512" in XXH64_IMPLS) == ({"avx512f", "avx512vl", "avx512dq"} <= flags)
    with pytest.raises(ValueError, match="impl must be"):
        _C.xxh64(b"x", impl="avx2")


@pytest.mark.parametrize("impl", XXH64_IMPLS + ["auto"])
def test_xxh64_every_loop_matches_reference(impl):
    # The reference over stripes plus every tail, big seeds; then large unaligned inputs
    # against the scalar loop (the reference is too slow for megabytes).
    for n in list(range(0, 130)) + [1000, 4096 + 7]:
        data = bytes((i * 131 + n) % 256 for i in range(n))
        for seed in (0, 0x9E3779B185EBCA87, _M64):
            assert _C.xxh64(data, seed=seed, impl=impl) == ref_xxh64(data, seed), (impl, n, seed)
    big = memoryview(np.random.default_rng(5).bytes((1 << 20) + 64))
    for start, n in ((0, 1 << 20), (1, (1 << 20) - 3), (7, 65536 + 33), (3, 32 * 1000)):
        view = big[start:start + n]
        assert _C.xxh64(view, seed=5, impl=impl) == _C.xxh64(view, seed=5, impl="scalar") == \
            xxhash.xxh64_intdigest(view, seed=5), (impl, start, n)


# --- XXH3-64 against the reference implementation (the xxhash package) ---------------------


def _xxh3_impls() -> list[str]:
    """The long-input loops this build and CPU run ("auto" is one of them)."""
    out = []
    for impl in ("scalar", "sse2", "avx2"):
        try:
            _C.xxh3_64(b"", impl=impl)
        except ValueError:
            continue
        out.append(impl)
    return out


XXH3_IMPLS = _xxh3_impls()
# Every length class (0, 1-3, 4-8, 9-16, 17-128, 129-240, long), one and two 1024-byte
# blocks exactly and around them, and partial last stripes of every size.
XXH3_DATA = np.random.default_rng(3).bytes((1 << 20) + 64)


def test_xxh3_impls_cover_the_machine():
    assert "scalar" in XXH3_IMPLS
    if sys.platform.startswith("linux") and os.uname().machine == "x86_64":
        assert "sse2" in XXH3_IMPLS
        with open("/proc/cpuinfo") as fh:
            has_avx2 = " avx2" in fh.read()
        assert ("avx2" in XXH3_IMPLS) == has_avx2
    with pytest.raises(ValueError, match="impl must be"):
        _C.xxh3_64(b"x", impl="avx512")


def test_xxh3_known_vectors():
    assert _C.xxh3_64(b"") == 0x2D06800538D394C2  # XXH3_64bits of the empty input
    assert xxhash.xxh3_64_intdigest(b"") == 0x2D06800538D394C2


@pytest.mark.parametrize("impl", XXH3_IMPLS + ["auto"])
def test_xxh3_every_length_matches_reference(impl):
    for n in range(2101):
        data = XXH3_DATA[n:2 * n]  # a different slice of random bytes per length
        assert _C.xxh3_64(data, impl=impl) == xxhash.xxh3_64_intdigest(data), (impl, n)


@pytest.mark.parametrize("impl", XXH3_IMPLS + ["auto"])
def test_xxh3_large_and_unaligned_inputs(impl):
    buf = np.frombuffer(XXH3_DATA, np.uint8)
    for n in (241, 1024, 1025, 4096 + 63, 12 << 10, 64 << 10, (64 << 10) + 1, 150 << 10, 1 << 20, (1 << 20) + 3):
        for start in (0, 1, 3, 7, 8, 31, 33):
            if start + n > len(buf):
                continue
            view = buf[start:start + n]  # a numpy view: the address is start bytes past the allocation
            want = xxhash.xxh3_64_intdigest(view.tobytes())
            assert _C.xxh3_64(view, impl=impl) == want, (impl, n, start)


@pytest.mark.parametrize("impl", XXH3_IMPLS + ["auto"])
def test_xxh3_copy_copies_and_hashes(impl):
    guard = 64
    for n in [*range(0, 300), 511, 512, 1023, 1024, 1025, 2047, 2048, 2049, 5000, 64 << 10, (1 << 20) + 3]:
        for src_start, dst_start in ((0, 0), (1, 3), (7, 0), (0, 5)):
            src = XXH3_DATA[src_start:src_start + n]
            buf = bytearray(b"\xa5" * (n + dst_start + guard))
            view = memoryview(buf)[dst_start:dst_start + n]
            got = _C.xxh3_64_copy(view, src, impl=impl)
            view.release()
            assert got == xxhash.xxh3_64_intdigest(src), (impl, n, src_start, dst_start)
            assert buf[dst_start:dst_start + n] == src, (impl, n, src_start, dst_start)
            assert buf[:dst_start] == b"\xa5" * dst_start and buf[dst_start + n:] == b"\xa5" * guard, "write outside dst"
    with pytest.raises(ValueError, match="same size"):
        _C.xxh3_64_copy(bytearray(3), b"abcd")
    with pytest.raises((BufferError, TypeError)):
        _C.xxh3_64_copy(b"read", b"only")  # dst must be writable


@pytest.mark.parametrize("impl", XXH3_IMPLS + ["auto"])
def test_xxh3_copy_streamed_into_aligned_destinations(impl):
    """From 4 KB into a 16-byte aligned destination the copy uses non-temporal stores (NOTE
    [streaming copy]); the input's last stripe, unaligned when the length is not a multiple
    of 16, is stored plainly. Every alignment and tail: the same bytes and checksum, nothing
    written outside the destination."""
    guard = 64
    raw = np.empty((1 << 20) + 4096 + 2 * guard, np.uint8)
    base = (-raw.ctypes.data) % 64  # raw[base:] starts 64-byte aligned
    for n in (4095, 4096, 4097, 4096 + 63, 12 << 10, 150000 + 8, 153600, (1 << 20) + 3):
        src = XXH3_DATA[:n]
        want = xxhash.xxh3_64_intdigest(src)
        for shift in (0, 16, 48, 8, 1):  # streamed at 0/16/48 (16-byte aligned), plain at 8 and 1
            raw[:] = 0xA5
            start = base + shift
            dst = raw[start:start + n]
            assert dst.ctypes.data % 16 == shift % 16
            assert _C.xxh3_64_copy(dst, src, impl=impl) == want, (impl, n, shift)
            assert dst.tobytes() == src, (impl, n, shift)
            assert (raw[:start] == 0xA5).all() and (raw[start + n:] == 0xA5).all(), ("write outside dst", impl, n)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=3000))
def test_xxh3_matches_reference(data):
    assert _C.xxh3_64(data) == xxhash.xxh3_64_intdigest(data)


def test_xxh64_buffer_types():
    data = bytes(range(256)) * 3
    want = ref_xxh64(data)
    arr = np.frombuffer(data, np.uint8)
    for buf in (data, bytearray(data), memoryview(data), arr, arr.view(np.int32), torch.from_numpy(arr.copy()).numpy()):
        assert _C.xxh64(buf) == want
    with pytest.raises((BufferError, ValueError, TypeError)):
        _C.xxh64(arr[::2])  # not contiguous
    with pytest.raises(TypeError):
        _C.xxh64("text")  # type: ignore[arg-type]
