"""accelerate with a native pyloader.DataLoader: kept by ``prepare``, every sample once, exact resume.

Real accelerate (CPU, gloo) under torchrun with 2 processes, and alone. Each scenario's
worker (accelerate_worker.py) writes the record indices every rank received per epoch;
the checks count them: the union over ranks is the dataset, each sample once plus the
documented pad (partition="pad": at most world_size - 1 repeats at the epoch's end), the
batches came from pyloader's pipeline (stats), and a configuration pyloader cannot serve
raises FrameworkPathError at ``prepare`` instead of losing data. The per-sample path (a torch
DataLoader over a ShardDataset handed to accelerate) raises on 2 processes and warns on one.
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch.distributed
from framework_util import results, run_job, write_ds

accelerate = pytest.importorskip("accelerate")

N = 301
pytestmark = [
    pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available())
                       or sys.platform != "linux", reason="needs torch.distributed with gloo, on Linux"),
    pytest.mark.timeout(400),
]


def check_epoch(per_rank: list[list[int]], world: int) -> None:
    counts = collections.Counter(i for seen in per_rank for i in seen)
    assert set(counts) == set(range(N)), f"missed {sorted(set(range(N)) - set(counts))[:10]}"
    repeated = sum(c - 1 for c in counts.values())
    assert repeated == (-N) % world  # the pad: ceil(N / world) * world - N
    assert len({len(s) for s in per_rank}) == 1  # every rank takes the same number of samples


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("accelerate")
    data = write_ds(str(base / "ds"), N)
    out = str(base / "out")
    os.makedirs(out)
    run_job("accelerate_worker.py", 2, [data, out, "default", "nodispatch", "uneven", "split", "torch", "stop", "gather"],
            str(base / "tmp"))
    run_job("accelerate_worker.py", 2, [data, out, "resume"], str(base / "tmp"))
    return out


@pytest.mark.parametrize("scenario", ["default", "nodispatch", "uneven"])
def test_two_processes_every_sample_once_from_the_native_pipeline(two_process_runs, scenario):
    ranks = results(two_process_runs, scenario, 2)
    for r in ranks:
        assert "error" not in r, r["error"]
        assert r["kept"] and r["class"] == "pyloader.loader.dataloader.DataLoader"
        assert r["native_batches"] == r["length"] == 10  # ceil(151 / 16) batches per rank, from the pipeline
        assert r["warnings"] == []
    for e in range(2):
        check_epoch([r["epochs"][e][1] for r in ranks], 2)
    # the epochs differ (set_epoch reached the loader) and the ranks' shares are disjoint but for the pad
    assert ranks[0]["epochs"][0][1] != ranks[0]["epochs"][1][1]
    # accelerator.accumulate (4 steps) synced at the last batch of each epoch: GradientState saw the loader's end
    for r in ranks:
        assert all([e, 9] in r["syncs"] for e in (0, 1))
        assert all(step in (3, 7, 9) for _, step in r["syncs"])


def test_split_batches_raises_at_prepare_with_the_fix(two_process_runs):
    for r in results(two_process_runs, "split", 2):
        assert "split_batches=True" in r["error"] and "batch_size=8" in r["error"]
        assert "epochs" not in r  # nothing was read


def test_torch_loader_over_a_shard_dataset_raises_instead_of_losing_data(two_process_runs):
    for r in results(two_process_runs, "torch", 2):
        assert r["kept"] is False and r["class"].startswith("accelerate.data_loader.")
        assert "would never be seen" in r["error"] and "pyloader.DataLoader" in r["error"]
        assert "epochs" not in r


def test_save_state_and_load_state_resume_mid_epoch_exactly(two_process_runs):
    full = results(two_process_runs, "default", 2)
    stop = results(two_process_runs, "stop", 2)
    resumed = results(two_process_runs, "resume", 2)
    for f, s, r in zip(full, stop, resumed):
        assert s["epochs"][0] == f["epochs"][0]
        assert len(s["epochs"][1][1]) == 5 * 16  # STOP_AT batches
        assert r["epochs"][0][0] == 1  # the loaded state names epoch 1; set_epoch(1) kept its position
        # batch for batch the interrupted epoch: before the checkpoint, then after the resume
        assert s["epochs"][1][1] + r["epochs"][0][1] == f["epochs"][1][1]


def test_one_process(tmp_path):
    data = write_ds(str(tmp_path / "ds"), N)
    out = str(tmp_path / "out")
    os.makedirs(out)
    run_job("accelerate_worker.py", 0, [data, out, "default", "torch"], str(tmp_path / "tmp"))
    (native,) = results(out, "default", 1)
    assert native["kept"] and native["native_batches"] == 19 and native["warnings"] == []
    for e in range(2):
        check_epoch([native["epochs"][e][1]], 1)
    (per_sample,) = results(out, "torch", 1)
    # one process: nothing lost, but the native pipeline does not run, and it says so once
    assert "error" not in per_sample
    for e in range(2):
        check_epoch([per_sample["epochs"][e][1]], 1)
    assert len(per_sample["warnings"]) == 1 and "native pipeline does not run" in per_sample["warnings"][0]


def test_one_import_swap_over_a_torch_dataset(tmp_path):
    """``torch.utils.data.DataLoader = pyloader.DataLoader`` before accelerate is imported, over a TensorDataset.

    accelerate shards the sampler as it does torch's loader (its even_batches pad repeats
    samples to fill whole batches); its DataLoaderAdapter asks the loader for state_dict(),
    which the generic path answers (NOTE [generic loader state]).
    """
    data = write_ds(str(tmp_path / "ds"), N)
    out = str(tmp_path / "out")
    os.makedirs(out)
    run_job("accelerate_worker.py", 2, [data, out, "swap", "--patch"], str(tmp_path / "tmp"))
    ranks = results(out, "swap", 2)
    for r in ranks:
        assert "error" not in r, r["error"]
        assert r["base"] == "DataLoader" and r["class"] == "accelerate.data_loader.DataLoaderShard"
        assert r["state"]["loader"] == "torch" and r["state"]["epoch"] == 2
    for e in range(2):
        counts = collections.Counter(i for r in ranks for i in r["epochs"][e][1])
        assert set(counts) == set(range(N))
        assert sum(counts.values()) == 2 * 10 * 16  # whole batches of 16 on each rank


def test_gather_for_metrics_leaves_out_the_pad(two_process_runs):
    """accelerate keeps the first ``remainder`` rows of the last gathered batch; the loader names them."""
    for r in results(two_process_runs, "gather", 2):
        assert "error" not in r, r["error"]
        assert sorted(r["gathered"]) == list(range(N))  # N is odd: one sample is the pad, and it is left out
