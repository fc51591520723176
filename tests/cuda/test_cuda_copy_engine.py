"""The native copy engine on a GPU: NOTE [copy ordering] (csrc/core/copy_engine.h) against a
consumer stream that is busy, or idle, when a job is submitted and taken. Skipped without CUDA.

A copy that ignored the marker recorded at submit would land before the queued work that
last wrote its destination, and that work would overwrite it (the checks see 255s, a value
the sources never hold); a take() that did not order the stream would let the kernel after
it read a half-copied destination.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from pyloader import _C

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.cuda,
]

N = 64 << 20  # bytes per copy: ~1-3 ms over PCIe


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def engine(depth: int = 2) -> object:
    idx = torch.cuda.current_device()
    return _C.CopyEngine(backend="cuda", device=idx, depth=depth,
                         staging=_C.SlotPool(num_fields=1, pinned=True, device=idx))


def pattern(n: int, seed: int, pinned: bool) -> torch.Tensor:
    """n bytes in 0..250 (never 255), shifted by seed."""
    t = torch.from_numpy(np.resize((np.arange(251, dtype=np.uint8) + seed) % 251, n))
    return t.pin_memory() if pinned else t.clone()


def long_matmul() -> torch.Tensor:
    """Tens of ms of bf16 matmuls queued on the current stream."""
    g = torch.Generator(device=dev()).manual_seed(0)
    a = torch.randn(8192, 8192, device=dev(), dtype=torch.bfloat16, generator=g) / 90
    y = a
    for _ in range(30):
        y = y @ a
    return y


@pytest.mark.parametrize("stage", [False, True], ids=["pinned-source", "staged-pageable-source"])
@pytest.mark.parametrize("side_stream", [False, True], ids=["current-stream", "side-stream"])
def test_copy_waits_for_busy_consumer_stream(stage: bool, side_stream: bool) -> None:
    s = torch.cuda.Stream() if side_stream else None
    eng = engine()
    src_same, src_fresh = pattern(N, 1, not stage), pattern(N, 2, not stage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.cuda.stream(s):
            cur = torch.cuda.current_stream()
            handle = int(cur.cuda_stream)
            # The same tensor: written by work still queued behind the matmuls.
            same = torch.empty(N, dtype=torch.uint8, device=dev())
            long_matmul()
            same.fill_(255)
            t = eng.submit([(src_same.data_ptr(), same.data_ptr(), N)], stream=handle, stage=stage)
            eng.take(t, stream=handle)
            got_same = same.clone()
            # A fresh tensor from torch's cache: the block of one that queued work still
            # writes (freed now, reusable at once on this stream).
            old = torch.empty(N, dtype=torch.uint8, device=dev())
            long_matmul()
            old.fill_(255)
            old_ptr = old.data_ptr()
            del old
            fresh = torch.empty(N, dtype=torch.uint8, device=dev())
            t = eng.submit([(src_fresh.data_ptr(), fresh.data_ptr(), N)], stream=handle, stage=stage)
            eng.take(t, stream=handle)
            got_fresh = fresh.clone()
            reused = fresh.data_ptr() == old_ptr
        torch.cuda.synchronize()
    assert torch.equal(got_same.cpu(), src_same), "copy landed before the queued work on its destination"
    assert torch.equal(got_fresh.cpu(), src_fresh), \
        f"copy into a fresh tensor landed before queued work on its memory (block reused: {reused})"
    c = eng.counters()
    assert c["jobs"] == 2 and c["bytes"] == 2 * N
    assert c["staged_bytes"] == (2 * N if stage else 0)
    eng.close()
    assert not caught, [str(w.message) for w in caught]


@pytest.mark.parametrize("stage", [False, True], ids=["pinned-source", "staged-pageable-source"])
def test_take_orders_an_idle_stream_after_the_copies(stage: bool) -> None:
    """Nothing queued: the kernel right after take() must still see the whole copy."""
    eng = engine()
    srcs = [pattern(4 * N, k, not stage) for k in range(3)]
    handle = int(torch.cuda.current_stream().cuda_stream)
    outs = []
    for src in srcs:
        dst = torch.empty(src.numel(), dtype=torch.uint8, device=dev())
        t = eng.submit([(src.data_ptr(), dst.data_ptr(), src.numel())], stream=handle, stage=stage)
        eng.take(t, stream=handle)
        outs.append(dst.sum(dtype=torch.int64))  # reads all of it at once
    got = torch.stack(outs).cpu()
    expected = torch.stack([s.sum(dtype=torch.int64) for s in srcs])
    assert torch.equal(got, expected)
    eng.close()


def test_ring_of_jobs_in_flight_behind_busy_stream() -> None:
    """depth jobs outstanding, each destination last written by queued work; taken in order."""
    depth = 3
    eng = engine(depth)
    handle = int(torch.cuda.current_stream().cuda_stream)
    n = 8 << 20
    srcs = [pattern(n, k, True) for k in range(10)]
    dsts = [torch.empty(n, dtype=torch.uint8, device=dev()) for _ in srcs]
    tickets: list[int] = []
    for k, (src, dst) in enumerate(zip(srcs, dsts)):
        if len(tickets) == depth:
            eng.take(tickets.pop(0), stream=handle)
        if k % 3 == 0:
            long_matmul()
        dst.fill_(255)
        tickets.append(eng.submit([(src.data_ptr(), dst.data_ptr(), n)], stream=handle))
    while tickets:
        eng.take(tickets.pop(0), stream=handle)
    got = [d.clone() for d in dsts]
    torch.cuda.synchronize()
    for k, (g, s) in enumerate(zip(got, srcs)):
        assert torch.equal(g.cpu(), s), f"job {k}"
    assert eng.counters()["jobs"] == len(srcs)
    eng.close()
