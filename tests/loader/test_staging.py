"""Staging details of pyloader.loader.transfer: interrupted takes, empty fields, lazy views,
non-strided tensors, and the pinned batch fence's bookkeeping."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import pyloader
from pyloader import _C
from pyloader.loader import transfer as _transfer


class _Map(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1000,), i, dtype=torch.int64)


class _InterruptOnce:
    """A DeviceStage whose first take() is interrupted before the engine consumed the job,
    as a Ctrl-C (or a timeout) arriving while take() waits leaves it."""

    def __init__(self, stage: _transfer.DeviceStage) -> None:
        self._stage = stage
        self.depth = stage.depth
        self.interrupted = False

    def submit_tree(self, batch: Any) -> Any:
        return self._stage.submit_tree(batch)

    def take(self, p: Any) -> Any:
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return self._stage.take(p)

    def consumed(self, p: Any) -> bool:
        return self._stage.consumed(p)

    def close(self) -> None:
        self._stage.close()

    def end_epoch(self) -> bool:
        return self._stage.end_epoch()


def test_an_interrupted_take_loses_no_batch() -> None:
    source = iter(torch.utils.data.DataLoader(_Map(40), batch_size=4))
    stage = _InterruptOnce(_transfer.DeviceStage(torch.device("cpu"), pin=False, depth=2))
    staged = _transfer.Staged(source, stage, stage.submit_tree, go_on_after_error=True)  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt):
        next(staged)
    got = [b[:, 0].tolist() for b in staged]
    assert stage.interrupted
    assert got == [[4 * k + j for j in range(4)] for k in range(10)]


def test_a_failed_submit_takes_its_place_and_iteration_goes_on() -> None:
    stage = _transfer.DeviceStage(torch.device("cpu"), pin=False, depth=2)
    calls = [0]

    def submit(item: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise MemoryError("no room for batch 2")
        return stage.submit_tree(item)

    staged = _transfer.Staged(iter([torch.full((3,), k) for k in range(5)]), stage, submit, go_on_after_error=True)
    assert int(next(staged)[0]) == 0
    assert int(next(staged)[0]) == 1
    with pytest.raises(MemoryError, match="batch 2"):
        next(staged)
    assert [int(b[0]) for b in staged] == [3, 4]


def test_a_batch_whose_variable_field_is_empty_is_copied(write_dataset) -> None:
    fields = {"t": ("int32", (None,)), "y": ("int64", ())}
    path = write_dataset(12, fields, lambda i: {"t": np.arange(i % 3 if i >= 4 else 0, dtype=np.int32), "y": i})
    ds = pyloader.ShardDataset(path)
    plain = list(pyloader.DataLoader(ds, batch_size=4))
    staged = list(pyloader.DataLoader(ds, batch_size=4, device="cpu"))
    assert plain[0]["t"].shape == (4, 0)  # the case under test: a zero-size field
    assert len(plain) == len(staged) == 3
    for a, b in zip(plain, staged, strict=False):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].shape == b[k].shape and torch.equal(a[k], b[k])


def test_lazy_conjugate_and_negative_views_are_materialised() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    x = torch.arange(4.0)
    batch = {"conj": z.conj(), "neg": x._neg_view(), "plain": x.t()}
    assert batch["conj"].is_conj() and batch["neg"].is_neg()
    stage = _transfer.DeviceStage(torch.device("cpu"), pin=False, depth=1)
    out = next(_transfer.Staged(iter([batch]), stage, stage.submit_tree, go_on_after_error=False))
    assert torch.equal(out["conj"].resolve_conj(), torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))
    assert torch.equal(out["neg"].resolve_neg(), -x)
    assert torch.equal(out["plain"], x)


def test_sparse_tensors_pass_through_staging() -> None:
    s = torch.sparse_coo_tensor([[0, 2]], [5.0, 7.0], (4,), check_invariants=True)
    stage = _transfer.DeviceStage(torch.device("cpu"), pin=False, depth=1)
    out = next(_transfer.Staged(iter([{"s": s, "d": torch.ones(3)}]), stage, stage.submit_tree,
                                go_on_after_error=False))
    assert out["s"].layout == torch.sparse_coo
    assert torch.equal(out["s"].to_dense(), torch.tensor([5.0, 0.0, 7.0, 0.0]))
    assert torch.equal(out["d"], torch.ones(3))


class _Event:
    """A GPU event stand-in: completes when the test says so; a new record() is pending again."""

    def __init__(self, log: list[str]) -> None:
        self.done = False
        self.records = 0
        self.log = log

    def record(self) -> None:
        self.records += 1
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append("sync")
        self.done = True


def _fence(limit: int, events: list[_Event], log: list[str]) -> _transfer.PinnedFence:
    def event() -> _Event:
        events.append(_Event(log))
        return events[-1]

    return _transfer.PinnedFence(limit=limit, event=event, cuda_used=lambda: True, device=lambda: 0)


def test_pinned_fence_holds_each_batch_until_the_event_after_it_completed() -> None:
    log: list[str] = []
    events: list[_Event] = []
    fence = _fence(3, events, log)
    fence.hold("b0")
    assert len(fence) == 1 and not events  # nothing recorded before the next batch is taken
    fence.hold("b1")  # the event for b0 is recorded now; not complete: b0 stays held
    assert len(fence) == 2 and len(events) == 1
    events[0].done = True
    fence.hold("b2")  # b0's event completed: b0 goes; b1's event is pending (b0's, recorded again)
    assert len(fence) == 2 and len(events) == 1 and events[0].records == 2
    fence.hold("b3")
    assert len(fence) == 3 and log == []
    fence.hold("b4")  # over the limit: the oldest pending event is waited for
    assert log == ["sync"] and len(fence) == 3
    fence.release()
    assert len(fence) == 0 and log[-1] == "sync"


def test_pinned_fence_reuses_a_small_pool_of_events() -> None:
    # See NOTE [pinned batch fence]: no event per batch; at most one per held batch, reused.
    log: list[str] = []
    events: list[_Event] = []
    fence = _fence(4, events, log)
    for k in range(200):
        fence.hold(k)
        if k % 7 == 0:  # the GPU catches up now and then
            for ev in events:
                ev.done = True
    assert 0 < len(events) <= 4, f"{len(events)} events made for 200 batches"
    assert fence.events_made == len(events) and sum(ev.records for ev in events) == 199


def test_pinned_fence_without_torch_cuda_initialised_records_nothing() -> None:
    # A pin-only loop that never touched a GPU through torch: nothing can read its batches, so
    # the fence neither records events nor initialises torch's CUDA (the default fence here,
    # on whatever torch this is: a CPU build cannot even make a CUDA event).
    was = torch.cuda.is_initialized()
    fence = _transfer.PinnedFence(limit=2)
    if was:
        pytest.skip("torch's CUDA is already initialised in this process")
    for k in range(10):
        fence.hold(k)
        assert len(fence) == 1
    fence.release()
    assert len(fence) == 0 and fence.events_made == 0
    assert not torch.cuda.is_initialized(), "the fence initialised torch's CUDA"


def test_no_fence_without_a_gpu(write_dataset) -> None:
    path = write_dataset(8, {"y": ("int64", ())}, lambda i: {"y": i})
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=4)
    it = iter(loader)
    next(it)
    assert it.fence is None  # type: ignore[attr-defined]
    assert _C.cuda_driver_error() is not None or torch.cuda.is_available()


def test_the_copy_engine_is_kept_across_epochs(write_dataset) -> None:
    # See NOTE [stage across epochs]: one engine (thread, stream, events, context) for every epoch
    # that ends with all its jobs taken, not closed (a host wait for the GPU) at each epoch's end.
    path = write_dataset(40, {"y": ("int64", ())}, lambda i: {"y": i})
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=4, device="cpu", device_prefetch=3)
    stages = []
    for _ in range(3):
        assert [int(x) for b in loader for x in b["y"]] == list(range(40))
        stage = loader._kept_stage
        assert stage is not None and not stage.closed, "the epoch's end closed the copy engine"
        stages.append(stage)
        assert loader.stats()["copy"]["jobs"] == 10, "the copy counters are not the epoch's own"
    assert stages[0] is stages[1] is stages[2], "each epoch made a new copy engine"
    # An epoch abandoned with copies in flight closes it; the next epoch makes a new one.
    it = iter(loader)
    next(it)
    it.close()
    assert stages[0].closed
    assert [int(x) for b in loader for x in b["y"]] == list(range(40))
    assert loader._kept_stage is not stages[0] and not loader._kept_stage.closed
    # Another device_prefetch: a new engine.
    kept = loader._kept_stage
    loader.device_prefetch = 2
    assert len(list(loader)) == 10
    assert loader._kept_stage is not kept and kept.closed
