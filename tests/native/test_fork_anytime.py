"""A DataLoader forked at any moment: the child reads its own epochs, the parent goes on.

NOTE [loader across fork] in pyloader/loader/dataloader.py and NOTE [slot pools across fork]
in csrc/core/slot_pool.cpp. Each test forks at many points (a loop over delays) while
something runs in the parent -- the constructor's slot preparation, native pipelines with the
epoch made ahead, a transform epoch on threads or processes, a copy engine -- and the child
reads two whole epochs of the same loader and checks every label; it must neither hang
(each child is killed after a timeout) nor deadlock. Before the fix, a child forked while the
slots were being prepared waited forever for the slot in the making.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from native_util import run_in_forked_child

import pyloader

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")

BIG = 150_000
BIG_FIELDS: dict[str, Any] = {"label": ("int64", ()), "payload": ("uint8", (BIG,))}
FIELDS: dict[str, Any] = {"label": ("int64", ()), "img": ("uint8", (256,))}
DELAYS_MS = [0.0, 0.3, 1.0, 2.0, 4.0, 8.0, 16.0]


def open_ds(path: str) -> pyloader.ShardDataset:
    return pyloader.ShardDataset(path, rank=0, world_size=1)


def labels_of(batch: Any) -> list[int]:
    return [int(x) for x in batch["label"]]


def add_one(sample: dict[str, Any]) -> dict[str, Any]:
    return {"label": sample["label"], "img": torch.as_tensor(sample["img"]).float() + 1}


def child_reads_epochs(loader: pyloader.DataLoader, n: int, inherited: Any = None) -> Callable[[Callable[[str], None]], int]:
    def run(step: Callable[[str], None]) -> int:
        if inherited is not None:
            step("the parent's iterator refuses to run here")
            try:
                next(inherited)
                return 2
            except pyloader.LoaderStateError:
                pass
        for epoch in range(2):
            step(f"epoch {epoch}")
            got = [x for b in loader for x in labels_of(b)]
            if got != list(range(n)):
                step(f"epoch {epoch} read {len(got)} labels: {got[:20]}...")
                return 10 + epoch
        step("done")
        return 0

    return run


def fork_and_check(tmp_path: Any, name: str, run: Callable[[Callable[[str], None]], int]) -> None:
    log = str(tmp_path / f"{name}.log")
    child = run_in_forked_child(run, log, timeout=30)
    assert child.code is not None, f"{name}: the forked child hung (killed after 30 s); its steps:\n{child.log}"
    assert child.code == 0, f"{name}: the child failed with exit code {child.code}; its steps:\n{child.log}"


@pytest.mark.timeout(240)
def test_fork_while_the_loader_prepares_its_slots(write_dataset, tmp_path) -> None:
    n = 48
    path = write_dataset(n, BIG_FIELDS, lambda i: {"label": i, "payload": np.zeros(BIG, np.uint8)},
                         shard_bytes=4 << 20)
    ds = open_ds(path)
    forked_preparing = 0
    for d in DELAYS_MS:
        loader = pyloader.DataLoader(ds, batch_size=16, num_workers=4, prefetch=16)  # 17 slots of 2.4 MB
        time.sleep(d / 1000)
        assert loader._batch_pool is not None
        forked_preparing += loader._batch_pool.preparing
        fork_and_check(tmp_path, f"prepare-{d}", child_reads_epochs(loader, n))
        assert [x for b in loader for x in labels_of(b)] == list(range(n)), "the parent's epoch after the fork"
        del loader
        gc.collect()
    assert forked_preparing >= 2, "no fork fell while the slots were being prepared: the test tests nothing"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["native", "auto", "device", "threads", "processes"])
def test_fork_while_an_epoch_runs(write_dataset, tmp_path, kind: str) -> None:
    """Mid-epoch, at many points: near the start, and near the end where the next epoch's
    pipeline is made ahead (NOTE [epoch ahead]) and handed over."""
    n, bs = 96, 8
    path = write_dataset(n, FIELDS, lambda i: {"label": i, "img": np.full(256, i % 251, np.uint8)})
    kw: dict[str, Any] = {"num_workers": 2, "prefetch": 4}
    kw.update({
        "native": {},
        "auto": {"num_workers": "auto", "prefetch": None},
        "device": {"device": "cpu"},
        "threads": {"transform": add_one},
        "processes": {"transform": add_one, "executor": "processes"},
    }[kind])
    loader = pyloader.DataLoader(open_ds(path), batch_size=bs, **kw)
    points = [(k, d) for k in (1, n // bs - 2) for d in DELAYS_MS[::2]]
    if kind == "processes":
        points = points[::2]  # each fork of the parent is slow with worker processes alive
    for k, d in points:
        it = iter(loader)
        seen = [x for _, b in zip(range(k), it) for x in labels_of(b)]
        time.sleep(d / 1000)
        fork_and_check(tmp_path, f"{kind}-{k}-{d}", child_reads_epochs(loader, n, inherited=it))
        seen += [x for b in it for x in labels_of(b)]
        assert seen == list(range(n)), f"{kind}: the parent's epoch after a fork at batch {k}"


@pytest.mark.timeout(120)
def test_a_slot_pool_is_whole_in_a_child_forked_while_it_prepares(tmp_path) -> None:
    """The native pool itself (NOTE [slot pools across fork]): a child forked while prepare()
    runs has no slot in the making and no thread to join; its pipelines use the pool."""
    from pyloader import _C

    forked_preparing = 0
    for d in DELAYS_MS:
        pool = _C.SlotPool(num_fields=1)
        pool.prepare(count=32, field_bytes=[4 << 20])  # 128 MiB: ~50 ms to prepare here
        time.sleep(d / 1000)
        forked_preparing += pool.preparing

        def child(step: Callable[[str], None], pool: Any = pool) -> int:
            step("forked")
            if pool.preparing:
                return 3
            pool.prepare(count=2, field_bytes=[4096])  # a thread of the child's own, joined below
            deadline = time.monotonic() + 10
            while pool.preparing and time.monotonic() < deadline:
                time.sleep(0.002)
            if pool.preparing or pool.created < 2:
                return 4
            step("drop the pool")
            del pool  # (no gc.collect() here: in a child of a long test session it copies the whole heap)
            return 0

        fork_and_check(tmp_path, f"pool-{d}", child)
        del pool
        gc.collect()
    assert forked_preparing >= 1, "no fork fell while the slots were being prepared: the test tests nothing"
