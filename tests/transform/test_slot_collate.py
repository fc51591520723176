"""The process executor collates batches straight into its shared-memory slots (NOTE [collate into the slot])."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import numpy as np
import pytest
import torch

import pyloader
from pyloader.transform.pool import MAX_SLOTS, _Slots, _SlotWriter, flatten, unflatten
from pyloader.transform.stage import collate_samples

N = 96


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("slotcollate") / "ds")
    with pyloader.ShardWriter(d, {"x": ("float32", (3,)), "label": "int64"}, shard_bytes=1024) as w:
        for i in range(N):
            w.write({"x": np.full(3, i, np.float32), "label": i})
    return d


def mixed(s: dict[str, Any], ctx: pyloader.SampleContext) -> dict[str, Any]:
    """Every kind of field the default collation places or copies, with lengths that vary by epoch and sample."""
    i = int(s["label"])
    n = 1 + (i * 7 + 3 * ctx.epoch) % 11  # a ragged field: a batch's longest grows and shrinks
    return {
        "image": torch.full((3, 5, 4), float(i)) + s["x"][0],
        "seq": torch.arange(n, dtype=torch.int64) + 100 * i,
        "arr": np.full((2,), i, np.int16),
        "flag": torch.tensor([i % 2 == 0, i % 3 == 0]),
        "pair": (torch.tensor(float(i)), i * 0.5),
        "label": s["label"],
        "name": f"s{i}",
    }


def loader(path: str, **kw: Any) -> pyloader.DataLoader:
    return pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=5), batch_size=8, transform=mixed, **kw)


def assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for j, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{j}]")
    else:
        assert a == b, where


def test_batches_collated_in_the_slots_equal_the_threads_executors(shards) -> None:
    want = loader(shards, num_workers=1, executor="threads")
    got = loader(shards, num_workers=2, executor="processes", persistent_workers=True)
    for epoch in range(4):
        held = []
        for t, (x, y) in enumerate(zip(want, got, strict=True)):
            assert_same(y, x, f"epoch {epoch} batch {t}")
            # The padding of a ragged field is zero, also where the slot held a longer batch before.
            for row, n in zip(y["seq"], y["seq_lengths"]):
                assert not row[int(n):].any()
            if epoch == 1:
                held.append(y)  # every batch of this epoch held at once: new slots, reused the epoch after
        assert t == N // 8 - 1
        del held


def collate_into(slots: _Slots, samples: list[dict[str, Any]]) -> tuple[Any, int, Any, list[Any], list[int]]:
    """One batch collated as a worker does: (the batch read back from its slot, slot index, slot,
    metas, the leaves the collation wrote in place)."""
    into = _SlotWriter(slots, lambda: False)
    leaves: list[torch.Tensor] = []
    skeleton = flatten(collate_samples(samples, into.alloc), leaves)
    base = None if into.slot is None else torch.frombuffer(into.slot.map, dtype=torch.uint8).data_ptr()
    in_slot = [k for k, x in enumerate(leaves) if base is not None and x.data_ptr() - base in
               {o for o, _ in into.placed.values()}]
    s, slot, metas = into.place(leaves)
    del leaves
    got = [torch.frombuffer(slot.map, dtype=torch.uint8, count=n, offset=o).view(getattr(torch, d)).reshape(sh)
           for d, sh, o, n in metas]
    return unflatten(skeleton, got), s, slot, metas, in_slot


def test_a_field_is_written_once_into_the_slot(tmp_path) -> None:
    busy = multiprocessing.Array("b", MAX_SLOTS, lock=False)
    slots = _Slots(0, "pyloader-test-slotcollate", str(tmp_path), busy)

    def batch(t: int, length: int) -> list[dict[str, Any]]:
        return [{"img": torch.full((4, 6), float(t * 10 + i)), "seq": torch.ones(length + i % 2, dtype=torch.int32),
                 "y": i} for i in range(5)]

    def run(samples: list[dict[str, Any]]) -> tuple[Any, int, Any, list[Any], list[int]]:
        return collate_into(slots, samples)

    first = batch(0, 3)
    got, s0, slot0, _, placed = run(first)
    assert placed == []  # the first batch's size is not known yet: laid out after collating, as before
    assert_same(got, collate_samples(first), "first")
    assert slots.hint >= 5 * 4 * 6 * 4
    del got
    second = batch(1, 3)
    got, s1, slot1, metas, placed = run(second)
    assert (s1, slot1.gen) == (s0, slot0.gen)  # the same slot, not grown
    assert placed == [0, 1]  # img and seq collated in place; the numbers and the lengths copied after them
    assert [m[2] for m in metas][:2] == [0, 512]  # (480 bytes, each field 64-byte aligned)
    assert_same(got, collate_samples(second), "second")
    del got
    third = batch(2, 40)  # a longer sequence: the slot is too small, the batch goes to a grown slot
    got, s2, slot2, _, _ = run(third)
    assert slot2.size > slot0.size
    assert_same(got, collate_samples(third), "third")
    del got, slot0, slot1, slot2
    slots.close(unlink=True)
    assert os.listdir(tmp_path) == []


def test_a_new_pools_first_batch_is_collated_into_an_inherited_slot(tmp_path) -> None:
    """A worker of the next epoch's pool starts with the slots of the one before (NOTE [slots
    across pools]), which were made for batches of this size: its first batch is collated
    straight into one of them, not into new tensors copied there after."""
    busy = multiprocessing.Array("b", MAX_SLOTS, lock=False)
    first = _Slots(0, "pyloader-test-inherit", str(tmp_path), busy)
    samples = [{"img": torch.full((4, 6), float(i)), "y": i} for i in range(5)]

    got, s, slot, _, placed = collate_into(first, samples)
    assert placed == []  # a pool's very first batch: its size is not known yet
    del got
    # The next pool's worker: the same slot handed over, its busy flag clear.
    second = _Slots(0, "pyloader-test-inherit", str(tmp_path), busy, {s: (slot.gen, slot.map)})
    assert second.hint == slot.size
    got, s2, slot2, _, placed = collate_into(second, samples)
    assert (s2, slot2.map, slot2.gen) == (s, slot.map, slot.gen)  # the inherited slot, not a new or grown one
    assert placed == [0]  # the image field collated in place
    assert_same(got, collate_samples(samples), "inherited")
    del got, slot, slot2
    second.close(unlink=False)
    first.close(unlink=True)
    assert os.listdir(tmp_path) == []
