"""Hugging Face Trainer over a pyloader dataset: the native loader, every sample once, exact mid-epoch resume.

Real transformers (CPU, gloo) under torchrun with 2 processes. The worker's model records
the ``idx`` field of every batch it trains on (trainer_worker.py). With
``pyloader.integrations.transformers.Trainer``: the loader is pyloader's (stats count its
batches), each epoch's union over ranks is the dataset plus the documented pad, and a job
stopped after a mid-epoch checkpoint and resumed in fresh processes trains, batch for batch,
on exactly what the uninterrupted job trained on. With ``transformers.Trainer`` itself (the
per-sample path through accelerate) 2 processes raise FrameworkPathError instead of losing
half the data, and one process trains on everything with one SlowPathWarning.
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch.distributed
from framework_util import results, run_job, write_ds

transformers = pytest.importorskip("transformers")

N = 301
B = 8
pytestmark = [
    pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available())
                       or sys.platform != "linux", reason="needs torch.distributed with gloo, on Linux"),
    pytest.mark.timeout(400),
]


def check_epoch(per_rank: list[list[int]], world: int) -> None:
    counts = collections.Counter(i for seen in per_rank for i in seen)
    assert set(counts) == set(range(N)), f"missed {sorted(set(range(N)) - set(counts))[:10]}"
    assert sum(c - 1 for c in counts.values()) == (-N) % world


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("trainer")
    data = write_ds(str(base / "ds"), N)
    out = str(base / "out")
    tmp = str(base / "tmp")
    os.makedirs(out)
    run_job("trainer_worker.py", 2, [data, out, "--tag", "full", "--accum", "2"], tmp)
    run_job("trainer_worker.py", 2, [data, out, "--tag", "stop", "--accum", "2", "--max-steps", "4",
                                     "--save-steps", "4"], tmp)
    run_job("trainer_worker.py", 2, [data, out, "--tag", "resume", "--accum", "2", "--resume",
                                     os.path.join(out, "ckpt", "checkpoint-4")], tmp)
    return out


def test_pyloader_trainer_reads_every_sample_once_on_native_threads(runs):
    full = results(runs, "full", 2)
    for r in full:
        assert "error" not in r, r["error"]
        assert r["class"] == "pyloader.loader.dataloader.DataLoader"
        assert r["native_batches"] == 19  # ceil(151 / 8) batches per rank, from the pipeline
        assert r["warnings"] == []
        assert r["global_step"] == 20  # 2 epochs x ceil(19 / 2) optimizer steps
        assert [len(e) for e in r["epochs"]] == [151, 151]
    for e in range(2):
        check_epoch([r["epochs"][e] for r in full], 2)
    assert full[0]["epochs"][0] != full[0]["epochs"][1]  # Trainer's set_epoch reached the loader


def test_pyloader_trainer_resumes_mid_epoch_exactly(runs):
    full, stop, resumed = (results(runs, t, 2) for t in ("full", "stop", "resume"))
    for f, s, r in zip(full, stop, resumed):
        assert "error" not in r, r["error"]
        assert len(s["epochs"]) == 1 and len(s["epochs"][0]) == 4 * 2 * B  # 4 steps of 2 accumulated batches
        assert r["global_step"] == 20 and r["class"] == "pyloader.loader.dataloader.DataLoader"
        # Trainer marks an epoch's start only for the epochs it begins: the resumed epoch, then the next
        assert len(r["epochs"]) == 2
        assert s["epochs"][0] + r["epochs"][0] == f["epochs"][0]  # no sample repeated or skipped, same order
        assert r["epochs"][1] == f["epochs"][1]


def test_plain_trainer_over_a_shard_dataset_raises_on_two_processes(tmp_path):
    data = write_ds(str(tmp_path / "ds"), N)
    out = str(tmp_path / "out")
    os.makedirs(out)
    run_job("trainer_worker.py", 2, [data, out, "--tag", "plain", "--plain", "--epochs", "1"], str(tmp_path / "tmp"))
    for r in results(out, "plain", 2):
        assert "would never be seen" in r["error"]
        assert "pyloader.integrations.transformers.Trainer" in r["error"]
        assert r["epochs"] in ([], [[]])  # not one sample trained on
    run_job("trainer_worker.py", 0, [data, out, "--tag", "plain1", "--plain", "--epochs", "1"], str(tmp_path / "tmp"))
    (one,) = results(out, "plain1", 1)
    assert "error" not in one
    check_epoch(one["epochs"], 1)  # one process: nothing lost
    assert len(one["warnings"]) == 1 and "pyloader.integrations.transformers.Trainer" in one["warnings"][0]
