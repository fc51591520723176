"""The epoch made ahead is never destroyed on a worker of the epoch before it.

NOTE [hand-over gate] in csrc/core/batch_pipeline.h: the last worker of a pipeline raises
the read-ahead of its successor (BatchPipeline.hand_over) through a gate that does not own
the successor. Here the successor is dropped by Python at the moment the last worker hands
over, hundreds of times with jittered timing; no pipeline may be destroyed on a pipeline's
worker thread. Before the gate, the worker held the successor by a shared_ptr, and the
successor's destructor ran on that (possibly detached) worker in 58 of 300 such rounds.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pytest

import pyloader
from pyloader import _C

FIELDS: dict[str, Any] = {"label": ("int64", ()), "img": ("uint8", (256,))}


@pytest.mark.timeout(120)
def test_a_dropped_successor_is_destroyed_by_its_owner(write_dataset) -> None:
    path = write_dataset(160, FIELDS, lambda i: {"label": i, "img": np.full(256, i % 251, np.uint8)})
    ds = pyloader.ShardDataset(path, rank=0, world_size=1)
    plan0, plan1 = ds.epoch_plan(0, 0, 1, []), ds.epoch_plan(1, 0, 1, [])
    rng = random.Random(0)
    before = _C._pipelines_destroyed_on_workers()
    raised = 0
    for _ in range(300):
        # Only the native pipelines: no Python wrapper holds them.
        pa = ds.batches(8, plan=plan0, num_threads=3, prefetch=2)._pipeline
        pb: Any = ds.batches(8, plan=plan1, num_threads=2, prefetch=2, ahead=1, early=True)._pipeline
        pa.hand_over(pb, 2)
        drop_at = len(pa) - rng.randint(0, 3)
        k = 0
        while pa.next() is not None:
            k += 1
            if k == drop_at:
                if rng.random() < 0.5:
                    time.sleep(rng.random() * 0.0005)
                raised += pb is not None and pb.ahead == 2
                pb = None
        pb = None
        del pa
    assert _C._pipelines_destroyed_on_workers() == before, "a pipeline was destroyed on a worker thread"
    assert raised > 0, "no successor was raised before it was dropped: the hand-over did not run"
