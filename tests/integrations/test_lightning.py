"""Lightning's ``Trainer`` and Fabric driving a native ``pyloader.DataLoader`` (docs/lightning.md), for real.

Four jobs of lightning_worker.py, each in fresh processes: on one CPU device (plain
``python``) and on two (``torch.distributed.run``, gloo on loopback), first the uninterrupted
runs and the runs that checkpoint after STOP_AT steps of epoch 1 and stop, then the resumed
runs. The checks, per framework and world size: each rank's epoch is, batch for batch, what
the same loader reads outside the framework (so the framework neither rebuilt the loader nor
split a rank's share again), the ranks together read every record of the epoch; the batches
before the checkpoint and after the resume are, batch for batch, the uninterrupted epoch;
pyloader's pipeline made the batches. The packing loader (no length: Lightning takes a
batch ahead, NOTE [batches Lightning holds]) resumes exactly too. And the warnings
Lightning emits about the loaders.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np
import pytest
import torch.distributed
from framework_util import run_job, write_ds
from lightning_worker import BATCH, ROWS, SEQ_LEN, STOP_AT, STOP_EPOCH

import pyloader

N = 301  # records: 2 ranks pad the epoch with one repeat
SCALE = 64  # a document's tokens are doc * SCALE + offset
LENGTHS = np.random.default_rng(0).integers(1, SCALE - 4, N)  # the documents' token counts
LEN_WARNING = "UserWarning: Your `IterableDataset` has `__len__` defined."
NOT_RESUMABLE = "your dataloader is not resumable"

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning"),
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()) or sys.platform != "linux",
        reason="needs torch.distributed with gloo, on Linux"),
]


def write_docs(path: str) -> None:
    """N token documents of LENGTHS tokens (``tokens``: doc * SCALE + offset) and ``idx``."""
    with pyloader.ShardWriter(path, {"tokens": ("int32", (None,)), "idx": ("int64", ())}, shard_bytes=2048) as w:
        for i, n in enumerate(LENGTHS):
            w.write({"tokens": (np.arange(n) + i * SCALE).astype(np.int32), "idx": i})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """Output folders by world size (0: the data), after every job ran."""
    base = str(tmp_path_factory.mktemp("lightning"))
    data = os.path.join(base, "data")
    write_ds(os.path.join(data, "vec"), N)
    write_docs(os.path.join(data, "docs"))
    outs = {0: data, 1: os.path.join(base, "out1"), 2: os.path.join(base, "out2")}
    for d in (outs[1], outs[2]):
        os.makedirs(d)
    tmp = os.path.join(base, "tmp")
    t0 = time.monotonic()
    run_job("lightning_worker.py", 0, [data, outs[1], "trainer-vec-full", "trainer-vec-stop", "trainer-pack-full",
                                       "trainer-pack-stop", "trainer-torch-full"], tmp)
    run_job("lightning_worker.py", 0, [data, outs[1], "trainer-vec-resume", "trainer-vec-epochend",
                                       "trainer-pack-resume"], tmp)
    run_job("lightning_worker.py", 2, [data, outs[2], "trainer-vec-full", "trainer-vec-stop", "fabric-vec-full",
                                       "fabric-vec-stop"], tmp)
    run_job("lightning_worker.py", 2, [data, outs[2], "trainer-vec-resume", "trainer-vec-epochend",
                                       "fabric-vec-resume"], tmp)
    print(f"lightning jobs: {time.monotonic() - t0:.1f} s")
    return outs


def result(runs: dict[int, str], world: int, scenario: str, rank: int) -> dict[str, Any]:
    with open(os.path.join(runs[world], f"{scenario}-rank{rank}.json")) as f:
        return json.load(f)


def epochs(res: dict[str, Any]) -> dict[int, list[list[int]]]:
    return {int(e): batches for e, batches in res["epochs"]}


@functools.cache
def direct(data: str, rank: int, world: int) -> dict[int, list[list[int]]]:
    """Each epoch's batches of the worker's loader on ``rank`` of ``world``, read without a framework."""
    ds = pyloader.ShardDataset(os.path.join(data, "vec"), shuffle=True, seed=3, rank=rank, world_size=world)
    loader = pyloader.DataLoader(ds, batch_size=BATCH, num_workers=2)
    return {e: [b["idx"].tolist() for b in loader] for e in range(2)}


def check_resumed(runs: dict[int, str], world: int, tag: str) -> None:
    """Before the checkpoint + after the resume = the uninterrupted run, batch for batch, on every rank."""
    for rank in range(world):
        full = epochs(result(runs, world, f"{tag}-full", rank))
        stop = epochs(result(runs, world, f"{tag}-stop", rank))
        resumed = result(runs, world, f"{tag}-resume", rank)
        after = epochs(resumed)
        assert len(stop[STOP_EPOCH]) == STOP_AT and sorted(after) == [STOP_EPOCH], (rank, sorted(after))
        assert stop[0] == full[0]
        got, want = stop[STOP_EPOCH] + after[STOP_EPOCH], full[STOP_EPOCH]
        flat_got, flat_want = [x for b in got for x in b], [x for b in want for x in b]
        missed = collections.Counter(flat_want) - collections.Counter(flat_got)
        repeated = collections.Counter(flat_got) - collections.Counter(flat_want)
        assert got == want, (f"{tag} on {world}: rank {rank} resumed {len(got)} batches against {len(want)}; "
                             f"missed {sum(missed.values())}, repeated {sum(repeated.values())}")
        assert resumed["native_batches"] == len(after[STOP_EPOCH]) > 0
        assert not [w for w in resumed["warnings"] if NOT_RESUMABLE in w]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_trainer_epochs_are_the_loaders(runs, world):
    """Every rank's epoch under the Trainer is the loader's own, and the ranks read every record."""
    for epoch in range(2):
        seen: collections.Counter[int] = collections.Counter()
        for rank in range(world):
            res = result(runs, world, "trainer-vec-full", rank)
            assert res["iterated"] == "DataLoader" and res["native_batches"] == math.ceil(math.ceil(N / world) / BATCH)
            mine = epochs(res)[epoch]
            assert mine == direct(runs[0], rank, world)[epoch]
            seen.update(x for b in mine for x in b)
        assert set(seen) == set(range(N)) and sum(seen.values()) == world * math.ceil(N / world)  # pad: fillers


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_trainer_resumes_mid_epoch(runs, world):
    check_resumed(runs, world, "trainer-vec")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_trainer_resumes_at_an_epochs_end(runs, world):
    """From ModelCheckpoint's checkpoint of epoch 0's end the next epoch is the uninterrupted epoch 1.

    Lightning loads no loader state there: the loader takes Lightning's epoch (NOTE [Lightning's epoch]).
    """
    for rank in range(world):
        assert epochs(result(runs, world, "trainer-vec-epochend", rank)) == {
            1: epochs(result(runs, world, "trainer-vec-full", rank))[1]}


@pytest.mark.timeout(300)
def test_fabric_two_processes(runs):
    """Fabric keeps the loader (its wrapper holds it), reads every record, and save/load reach its state."""
    seen: collections.Counter[int] = collections.Counter()
    for rank in range(2):
        res = result(runs, 2, "fabric-vec-full", rank)
        assert res["kept"] and res["iterated"] == "_FabricDataLoader" and res["native_batches"] > 0
        assert epochs(res) == direct(runs[0], rank, 2)
        seen.update(x for b in epochs(res)[0] for x in b)
    assert set(seen) == set(range(N)) and sum(seen.values()) == 2 * math.ceil(N / 2)
    check_resumed(runs, 2, "fabric-vec")


@pytest.mark.timeout(300)
def test_trainer_resumes_a_packing_loader(runs):
    """A loader without a length: every token once per epoch, and the resume is the uninterrupted epoch."""
    every = collections.Counter(i * SCALE + o for i, n in enumerate(LENGTHS) for o in range(n))
    full = result(runs, 1, "trainer-pack-full", 0)
    assert full["native_batches"] > 0
    for epoch, batches in epochs(full).items():
        assert all(len(b) <= ROWS * SEQ_LEN for b in batches)
        assert collections.Counter(t for b in batches for t in b) == every, epoch
    check_resumed(runs, 1, "trainer-pack")


@pytest.mark.timeout(300)
def test_len_warning(runs):
    """Lightning warns that an IterableDataset has ``__len__`` for torch's loader and for ours alike.

    Lightning decides from ``len(loader)`` and ``isinstance(loader.dataset, IterableDataset)``
    alone; both are true of a native loader (and Lightning relies on the second to leave it
    as it is), so pyloader cannot take it back for its loader only (docs/lightning.md).
    """
    assert any(w.startswith(LEN_WARNING) for w in result(runs, 1, "trainer-torch-full", 0)["warnings"])
    assert any(w.startswith(LEN_WARNING) for w in result(runs, 1, "trainer-vec-full", 0)["warnings"])
    for rank in range(2):
        assert not [w for w in result(runs, 2, "fabric-vec-full", rank)["warnings"] if w.startswith(LEN_WARNING)]
