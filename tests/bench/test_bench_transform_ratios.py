"""`pyloader bench --transform` reports, for a user's own transform, pyloader / torch, pyloader /
ceiling (processes running the transform alone) and the first epoch against torch's and its own
steady epochs (issue 41, item 3): each in the JSON, each printed once, each the ratio of the
rates printed beside it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pyloader.bench import cli as bench_cli

TRANSFORM = '''
def augment(sample, ctx):
    x = sample["image"]
    if ctx.rng.random() < 0.5:
        x = x.flip(-1)
    return {"image": x.float().mul(2.0), "label": sample["label"]}
'''

SMALL = ["--records", "512", "--batch-size", "32", "--threads", "2", "--epochs", "2", "--min-seconds", "0.2",
         "--torch-workers", "1", "--workload", "none", "--json", "--quiet"]


@pytest.mark.timeout(300)
def test_the_transform_stage_reports_its_ceiling_and_first_epoch(tmp_path, capsys) -> None:
    (tmp_path / "usertr.py").write_text(TRANSFORM)
    res = subprocess.run([sys.executable, "-m", "pyloader", "bench", *SMALL, "--transform", "usertr:augment"],
                         capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    t = r["transform"]
    rate = t["with_transform"]["samples_per_s"]

    c = t["ceiling"]
    assert c["processes"] == 2 and 0 < c["samples"] <= 512 and c["seconds"] == pytest.approx(0.2)
    assert len(c["runs_samples_per_s"]) == 2 and all(x > 0 for x in c["runs_samples_per_s"])
    assert c["samples_per_s"] == max(c["runs_samples_per_s"])
    assert t["of_ceiling"] > 0 and t["of_ceiling"] == pytest.approx(rate / c["samples_per_s"])

    first, torch_first = t["first_epoch_samples_per_s"], t["torch_first_epoch_samples_per_s"]
    assert first > 0 and torch_first > 0
    assert first == t["with_transform"]["first_epoch_samples_per_s"]
    assert torch_first == t["torch_dataloader"]["first_epoch_samples_per_s"]
    assert t["first_epoch_vs_torch"] == pytest.approx(first / torch_first)
    assert t["first_epoch_vs_steady"] == pytest.approx(first / rate)
    assert t["speedup_vs_torch"] == pytest.approx(rate / t["torch_dataloader"]["samples_per_s"])

    # The table prints each ratio once, beside the rates it divides.
    bench_cli._print_bench(r)
    out = capsys.readouterr().out
    assert out.count("pyloader / torch DataLoader with the transform:") == 1
    assert out.count(f"pyloader / ceiling: {t['of_ceiling']:.2f}") == 1
    assert out.count(f"first epoch: pyloader / torch DataLoader {t['first_epoch_vs_torch']:.2f}x, pyloader's first "
                     f"epoch / its steady epochs {t['first_epoch_vs_steady']:.2f}") == 1
    assert f"    ceiling               {c['samples_per_s']:>12,.0f} samples/s (2 processes running it alone" in out
    assert (f"first epoch (from building the loader): pyloader {first:,.0f} samples/s, torch DataLoader "
            f"{torch_first:,.0f} samples/s") in out


@pytest.mark.timeout(120)
def test_the_ceiling_runs_the_transform_alone_and_names_its_error(tmp_path) -> None:
    from pyloader import ShardDataset
    from pyloader.bench import measure as B
    from pyloader.bench import stages as R

    path = str(tmp_path / "ds")
    B.write_profile_dataset(path, B.PROFILES["image12k"], 256, seed=0)

    def boom(sample):
        raise ValueError("no such crop")

    c = R.transform_ceiling(ShardDataset(path, transform=lambda s: s), batch_size=32, processes=2, rounds=1,
                            seconds=0.1)
    assert c["samples"] == 256 and c["samples_per_s"] > 0
    with pytest.raises(RuntimeError, match="ValueError: no such crop"):
        R.transform_ceiling(ShardDataset(path, transform=boom), batch_size=32, processes=2, rounds=1, seconds=0.1)


def _thread_setup(i: int) -> int:
    """Raises unless this process runs torch and BLAS on one thread with no OpenBLAS server spinning."""
    import time

    import torch
    from threadpoolctl import threadpool_info

    if torch.get_num_threads() != 1:
        raise AssertionError(f"torch runs {torch.get_num_threads()} threads")
    blas = [d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas"]
    if any(n != 1 for n in blas):
        raise AssertionError(f"BLAS runs {blas} threads")
    if i < 2:  # each process's first call: its CPU while it sleeps is only a spinning thread's
        c0 = time.process_time()
        time.sleep(0.3)
        ms = (time.process_time() - c0) * 1e3
        if ms > 40:
            raise AssertionError(f"the process used {ms:.0f} ms of CPU while asleep for 0.3 s")
    return 1


@pytest.mark.timeout(120)
def test_the_ceilings_processes_run_as_a_transform_worker_does() -> None:
    """The ceiling's processes set the threads a transform worker sets (NOTE [worker threads]):
    threadpoolctl's limit alone restarted OpenBLAS's thread server in a forked process, whose
    spinning took CPU from the transform and held the ceiling down."""
    pytest.importorskip("threadpoolctl")
    import numpy as np

    np.ones((64, 64)) @ np.ones((64, 64))  # OpenBLAS started in this process, as a training script's would be
    from pyloader.bench import measure

    assert measure.forked_rate(_thread_setup, 2, 0.5) > 0
