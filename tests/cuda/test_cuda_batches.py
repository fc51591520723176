"""GPU checks of pyloader.DataLoader (run by benchmarks/gpu_check.sh; skipped without CUDA).

Every loader here is compared with a CPU reference read from the same files in the same
order, so a batch that arrives early, late, half-copied or overwritten shows up as a
value mismatch rather than as a crash.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data

import pyloader

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.cuda,
]

# Big enough rows that a copy takes longer than the kernel reading it (a missing wait
# then reads a half-copied batch): 64 KB of float32 per record, 4 MB per batch.
WIDE = 16384
WIDE_FIELDS: dict[str, Any] = {
    "x": ("float32", (WIDE,)),
    "tokens": ("int32", (None,)),
    "label": ("int64", ()),
}


def wide_sample(i: int) -> dict[str, Any]:
    # Exact in float32 (< 2**24): every value names its record and position.
    return {"x": np.arange(WIDE, dtype=np.float32) + np.float32(i * WIDE),
            "tokens": np.arange(i % 13, dtype=np.int32) * 3 + i, "label": i}


def cuda_dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def keep_busy(stream: torch.cuda.Stream | None = None, ms: float = 2.0) -> None:
    """Queues ~ms of GPU work on the current stream (or `stream`), so that whatever is
    queued after it runs late."""
    with torch.cuda.stream(stream):  # None: a no-op
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(int(ms * 2e6))  # ~2 GHz SM clock
        else:  # a long matmul instead
            a = torch.randn(4096, 4096, device=cuda_dev(), dtype=torch.bfloat16)
            for _ in range(max(1, int(ms / 0.2))):
                a = a @ a


def assert_same_batch(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], device: torch.device,
                      where: str) -> None:
    assert sorted(got) == sorted(ref), where
    for k, r in ref.items():
        g = got[k]
        assert g.device == device, f"{where}: {k} on {g.device}, expected {device}"
        assert g.dtype == r.dtype and g.shape == r.shape, f"{where}: {k} {g.dtype}{tuple(g.shape)} vs " \
                                                          f"{r.dtype}{tuple(r.shape)}"
        assert torch.equal(g.cpu(), r.cpu()), f"{where}: {k} differs"


def cpu_reference(path: str, batch_size: int, **ds_kwargs: Any) -> list[dict[str, torch.Tensor]]:
    """The batches of a plain CPU loader (cloned: its slots are reused)."""
    ds = pyloader.ShardDataset(path, **ds_kwargs)
    loader = pyloader.DataLoader(ds, batch_size=batch_size, num_workers=2)
    return [{k: v.clone() for k, v in b.items()} for b in loader]


@pytest.fixture
def wide_dataset(write_dataset: Callable[..., str]) -> str:
    return write_dataset(512, WIDE_FIELDS, wide_sample, shard_bytes=1 << 20)


# -- values and devices ----------------------------------------------------------------------
@pytest.mark.parametrize("shuffle", [False, True])
def test_device_batches_equal_cpu_batches(write_dataset: Callable[..., str], shuffle: bool) -> None:
    path = write_dataset(1000)  # conftest's MIXED_FIELDS: fixed, scalar, variable, bytes, float16
    ref = cpu_reference(path, 64, shuffle=shuffle, seed=3)
    loader = pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=shuffle, seed=3), batch_size=64,
                                 num_workers=2, device="cuda")
    it = iter(loader)
    got = list(it)
    assert len(got) == len(ref) == 16  # 15 full batches and one of 40
    for i, (g, r) in enumerate(zip(got, ref)):
        assert "tokens_lengths" in g and "blob_lengths" in g
        assert_same_batch(g, r, cuda_dev(), f"batch {i}")
    copy = loader.stats()["copy"]  # while `it` is alive: the copy engine's counters
    assert copy["backend"] == "cuda" and copy["jobs"] == 16
    assert copy["bytes"] == sum(v.nbytes for b in got for v in b.values())


def test_device_index_is_respected(write_dataset: Callable[..., str]) -> None:
    path = write_dataset(200)
    idx = torch.cuda.device_count() - 1
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=50, num_workers=2, device=f"cuda:{idx}")
    ref = cpu_reference(path, 50)
    for i, (g, r) in enumerate(zip(loader, ref)):
        assert_same_batch(g, r, torch.device("cuda", idx), f"batch {i}")


# -- stream ordering without explicit synchronisation ------------------------------------------
@pytest.mark.parametrize("side_stream", [False, True], ids=["current-stream", "torch.cuda.stream(s)"])
def test_batches_usable_without_sync(wide_dataset: str, side_stream: bool) -> None:
    """Each batch is read by a kernel queued right after next() (no synchronize), first
    straight away (the copy must have landed), then behind ~2 ms of queued work after
    which the batch is dropped: its memory returns to torch's cache and is handed to a
    later copy, which must wait for that work (NOTE [copy ordering])."""
    ref = cpu_reference(wide_dataset, 64)
    dev = cuda_dev()
    stream = torch.cuda.Stream() if side_stream else None
    early: list[dict[str, torch.Tensor]] = []
    late: list[dict[str, torch.Tensor]] = []
    with torch.cuda.stream(stream):  # None: a no-op
        loader = pyloader.DataLoader(pyloader.ShardDataset(wide_dataset), batch_size=64, num_workers=2,
                                     device="cuda")
        for _epoch in range(2):
            for b in loader:
                early.append({k: v.clone() for k, v in b.items()})  # reads it at once
                keep_busy()
                late.append({k: v.clone() for k, v in b.items()})  # reads it ~2 ms later
                del b
        # What the clones read is only known once the stream ran them.
        torch.cuda.current_stream().synchronize()
    torch.cuda.synchronize()
    assert len(early) == 2 * len(ref)
    for i, (e, la) in enumerate(zip(early, late)):
        r = ref[i % len(ref)]
        assert_same_batch(e, r, dev, f"batch {i}, read at once")
        assert_same_batch(la, r, dev, f"batch {i}, read behind queued work")


def test_busy_side_stream_reductions(wide_dataset: str) -> None:
    """Batches iterated and reduced under a busy side stream; the default stream then
    waits for that stream (the caller's part, as in torch) and reads the results."""
    ref = cpu_reference(wide_dataset, 64)
    s = torch.cuda.Stream()
    out = []
    loader = pyloader.DataLoader(pyloader.ShardDataset(wide_dataset), batch_size=64, num_workers=2, device="cuda")
    with torch.cuda.stream(s):
        it = iter(loader)
        for b in it:
            keep_busy(ms=1.0)
            out.append(b["x"].double().sum())
    torch.cuda.current_stream().wait_stream(s)
    sums = torch.stack(out).cpu()
    expected = torch.stack([r["x"].double().sum() for r in ref])
    assert torch.equal(sums, expected)


# -- pinned host batches --------------------------------------------------------------------
def test_pin_memory_batches_are_pinned(write_dataset: Callable[..., str]) -> None:
    path = write_dataset(500)
    ref = cpu_reference(path, 32)
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=32, num_workers=2, pin_memory=True)
    assert loader._pool.pinned
    n = 0
    for i, (b, r) in enumerate(zip(loader, ref)):
        for k, v in b.items():
            assert v.is_pinned(), f"batch {i} field {k} is not in page-locked memory"
        assert_same_batch(b, r, torch.device("cpu"), f"batch {i}")
        n += 1
    assert n == len(ref)


class _MapDataset(torch.utils.data.Dataset):
    """An ordinary map-style dataset: nested structures, ints, strings."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        x = torch.arange(256, dtype=torch.float32) + i
        return {"x": x, "label": i, "name": f"s{i}",
                "pair": (torch.full((3, 4), i, dtype=torch.int16), torch.tensor([i, -i], dtype=torch.int64))}


def test_generic_pin_memory_batches_are_pinned() -> None:
    ds = _MapDataset(200)
    ref = list(torch.utils.data.DataLoader(ds, batch_size=32))
    loader = pyloader.DataLoader(ds, batch_size=32, pin_memory=True)
    got = list(loader)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        for t in (g["x"], g["label"], g["pair"][0], g["pair"][1]):
            assert t.device.type == "cpu" and t.is_pinned()
        assert g["name"] == r["name"]
        assert torch.equal(g["x"], r["x"]) and torch.equal(g["label"], r["label"])
        assert torch.equal(g["pair"][0], r["pair"][0]) and torch.equal(g["pair"][1], r["pair"][1])


# -- generic path onto the GPU ------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_generic_device_equals_torch_moved(num_workers: int) -> None:
    ds = _MapDataset(300)
    dev = cuda_dev()
    ref = [_to(b, dev) for b in torch.utils.data.DataLoader(ds, batch_size=32, num_workers=num_workers)]
    loader = pyloader.DataLoader(ds, batch_size=32, num_workers=num_workers, device="cuda")
    got = list(loader)
    assert len(got) == len(ref) == len(loader) == 10
    for i, (g, r) in enumerate(zip(got, ref)):
        assert type(g) is dict and sorted(g) == sorted(r), f"batch {i}"
        assert g["name"] == r["name"]
        assert isinstance(g["pair"], type(r["pair"]))
        for a, b in ((g["x"], r["x"]), (g["label"], r["label"]), (g["pair"][0], r["pair"][0]),
                     (g["pair"][1], r["pair"][1])):
            assert a.device == dev and a.dtype == b.dtype and torch.equal(a, b), f"batch {i}"


def _to(obj: Any, dev: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, dict):
        return {k: _to(v, dev) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, dev) for v in obj)
    return obj


# -- lifetime and steady state ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["device", "pin_memory"])
def test_kept_batch_stays_valid(write_dataset: Callable[..., str], mode: str) -> None:
    path = write_dataset(1000)
    ref = cpu_reference(path, 16)
    assert len(ref) >= 51
    kw: dict[str, Any] = {"device": "cuda"} if mode == "device" else {"pin_memory": True}
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=16, num_workers=2, **kw)
    it = iter(loader)
    kept = next(it)
    for _ in range(50):
        b = next(it)
        for v in b.values():
            v.sum()  # used and dropped, as a training step would
    torch.cuda.synchronize()
    expected_dev = cuda_dev() if mode == "device" else torch.device("cpu")
    assert_same_batch(kept, ref[0], expected_dev, "the kept first batch after 50 more")
    it.close()
    assert_same_batch(kept, ref[0], expected_dev, "the kept first batch after close()")


def _wait_until(check: Callable[[], str | None], where: str, timeout_s: float = 10.0) -> None:
    """Polls check() (None: the condition holds, else what is wrong) until it holds; fails
    after timeout_s with what was last wrong (a slot that never returns)."""
    deadline = time.monotonic() + timeout_s
    while (wrong := check()) is not None:
        if time.monotonic() > deadline:
            pytest.fail(f"{where}, still after {timeout_s:.0f} s: {wrong}")
        time.sleep(0.0005)


def _all_slots_free(pool: Any) -> str | None:
    return None if pool.free == pool.created else f"{pool.created - pool.free} of {pool.created} slots in use"


def _early_batches(loader: pyloader.DataLoader) -> int:
    """Batches of the next epoch collated ahead (NOTE [epoch ahead]): they hold slots too."""
    ahead = loader._ahead
    return 0 if ahead is None else int(ahead[1].counters()["batches"])


def _slots_settled(loader: pyloader.DataLoader, delivered: int) -> str | None:
    """None once every slot in use holds a batch collated and not yet delivered (this
    epoch's, or the next one's collated ahead): the delivered (and dropped) batches' slots
    are back, and no collation is half-way."""
    # Counters first: in_use can then only be over, never under.
    waiting = loader.stats()["batches"] - delivered + _early_batches(loader)
    in_use = loader._pool.created - loader._pool.free
    if in_use == waiting:
        return None
    return f"{in_use} slots in use, {waiting} batches collated and not delivered (the next epoch's included)"


def _only_early_slots(loader: pyloader.DataLoader) -> str | None:
    early = _early_batches(loader)
    in_use = loader._pool.created - loader._pool.free
    return None if in_use == early else f"{in_use} slots in use after the epoch, {early} batches collated ahead"


@pytest.mark.parametrize("pin_memory", [False, True])
def test_no_new_pinned_slots_after_warmup(wide_dataset: str, pin_memory: bool) -> None:
    """Slots return to the pool once their copies completed and the batch was dropped:
    over four epochs the pool allocates nothing (NOTE [slot reuse]).

    No timing is assumed. The copy engine returns a slot on its own thread, and whether a
    worker takes a slot before or after the one it could reuse came back is a race, so the
    pool is first grown past the loader's window (prefetch + device_prefetch, with room to
    spare), and after each batch the test waits, bounded, until the dropped batch's slot
    is back (_slots_settled). A slot that never returns fails that wait.
    """
    prefetch = 2
    loader = pyloader.DataLoader(pyloader.ShardDataset(wide_dataset), batch_size=32, num_workers=2,
                                 device="cuda", pin_memory=pin_memory, prefetch=prefetch)
    pool = loader._pool
    assert pool.pinned

    # Warm-up: hold more batches at once than the loader ever has in flight, then let go.
    window = prefetch + loader.device_prefetch
    src = loader.dataset.batches(32, num_threads=2, pool=pool)
    held = [src.next_host() for _ in range(window + 2)]
    src.close()
    del held, src
    _wait_until(lambda: _all_slots_free(pool), "after the warm-up")
    warm = pool.created
    assert warm >= window + 2

    created = []
    for epoch in range(1, 5):
        delivered = 0
        for b in loader:
            b["x"].sum()
            torch.cuda.synchronize()  # this batch's copy (and every copy issued ahead) completed
            del b
            delivered += 1
            _wait_until(functools.partial(_slots_settled, loader, delivered), f"epoch {epoch}, batch {delivered}")
        # Every copy completed and every batch was dropped: only the next epoch's batches,
        # collated ahead, hold slots.
        _wait_until(functools.partial(_only_early_slots, loader), f"after epoch {epoch}")
        created.append(pool.created)
    assert created == [warm] * 4, f"slots created by the warm-up ({warm}), after epochs 1..4: {created}"


# -- no warnings -------------------------------------------------------------------------------
def test_no_warning_emitted(wide_dataset: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kw in ({"device": "cuda"}, {"pin_memory": True}, {"device": "cuda", "pin_memory": True}):
            loader = pyloader.DataLoader(pyloader.ShardDataset(wide_dataset), batch_size=64, num_workers=2, **kw)
            for b in loader:
                b["x"].sum()
        loader = pyloader.DataLoader(_MapDataset(64), batch_size=16, device="cuda", pin_memory=True)
        for b in loader:
            b["x"].sum()
        torch.cuda.synchronize()
    assert not caught, [f"{w.category.__name__}: {w.message}" for w in caught]


@pytest.mark.parametrize("native", [True, False], ids=["shard-dataset", "map-dataset"])
def test_loop_own_non_blocking_copies_read_the_right_batch(wide_dataset: str, native: bool) -> None:
    """See NOTE [pinned batch fence]: with pin_memory=True (no device=) the loop queues its own
    non_blocking copies behind busy GPU work and drops each batch at once; the copies must
    still read the batch they were queued from, not the next batch collated into a reused
    slot."""
    dev = cuda_dev()
    if native:
        ds: Any = pyloader.ShardDataset(wide_dataset)
        ref = [b["x"] for b in cpu_reference(wide_dataset, 32)]
    else:
        class Wide(torch.utils.data.Dataset):
            def __len__(self) -> int:
                return 256

            def __getitem__(self, i: int) -> torch.Tensor:
                return torch.from_numpy(wide_sample(i)["x"])
        ds = Wide()
        ref = list(torch.utils.data.DataLoader(ds, batch_size=32))
    loader = pyloader.DataLoader(ds, batch_size=32, pin_memory=True, num_workers=2)
    out = []
    for batch in loader:
        x = batch["x"] if native else batch
        assert x.is_pinned()
        keep_busy(ms=3.0)  # the copy below waits behind this work on the current stream
        out.append(x.to(dev, non_blocking=True))
        del batch, x  # the loop lets go of the pinned batch before the copy ran
    torch.cuda.synchronize()
    assert len(out) == len(ref)
    for got, want in zip(out, ref):
        assert torch.equal(got.cpu(), want)
