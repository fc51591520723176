"""`pyloader bench`'s cold-read stage: the dataset's pages are dropped without root, the
sequential read and an epoch in order and one shuffled are measured from a cold page cache,
and the table shows each epoch's ratio to the sequential read and to what the machine allows it."""

from __future__ import annotations

import os

import pytest

import pyloader
from pyloader.bench import cli as bench_cli
from pyloader.bench import measure as B
from pyloader.bench import stages as R


@pytest.fixture
def dataset(tmp_path) -> str:
    p = B.PROFILES["image12k"]
    path = str(tmp_path / "ds")
    B.write_profile_dataset(path, p, 600, compression="none", seed=0)
    return path


def _files(path: str) -> list[str]:
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".pyl"))


def test_drop_pages_evicts_the_files_from_the_page_cache(dataset) -> None:
    files = _files(dataset)
    B.read_gbps(files, 1)
    assert B.resident_fraction(files) > 0.9
    B.drop_pages(files)
    assert B.resident_fraction(files) < 0.1


def test_the_cold_stage_reads_one_epoch_from_a_cold_cache_against_the_sequential_read(dataset) -> None:
    ds = pyloader.ShardDataset(dataset)
    lines: list[str] = []
    got = R.cold_read_stage(ds, batch_size=64, threads=2, progress=lines.append)
    assert got is not None and "cold read" in lines[0]
    assert got["samples"] == ds.num_records
    assert got["bytes"] == sum(ds.shard_bytes)
    assert 0 < got["stored_bytes"] <= got["bytes"]
    assert got["resident"] < 0.1  # every read started from a cold page cache
    assert got["gbps"] > 0 and got["seq_gbps"] > 0
    # It reads through a dataset of its own: the bench's maps nothing (a mapped page cannot be dropped).
    assert ds._shards is None


def test_the_cold_stage_reports_an_in_order_and_a_shuffled_epoch_against_the_best_sequential_read(dataset) -> None:
    """The issue's ratio, both ways: each cold epoch over the faster of two cold sequential reads
    of the same files in the same run; the stage's own ratio is the lower of the two."""
    ds = pyloader.ShardDataset(dataset)
    got = R.cold_read_stage(ds, batch_size=64, threads=2, progress=lambda s: None)
    assert got is not None
    assert len(got["seq_gbps_runs"]) == 2 and got["seq_gbps"] == max(got["seq_gbps_runs"])
    for key in ("in_order", "shuffled"):
        e = got[key]
        assert e["samples"] == ds.num_records
        assert 0 < e["stored_bytes"] <= got["bytes"]
        assert e["gbps"] == pytest.approx(e["stored_bytes"] / e["wall_s"] / 1e9)
        assert e["of_seq"] == pytest.approx(e["gbps"] / got["seq_gbps"])
        assert 0 < e["first_batch_s"] <= e["wall_s"]
        assert e["cpu_s"] > 0
        assert e["warm_gbps"] > 0 and e["of_limit"] == pytest.approx(e["gbps"] / e["limit_gbps"])
    # The limits: in order reading and batching overlap; shuffled they follow each other.
    assert got["in_order"]["limit_gbps"] == min(got["seq_gbps"], got["in_order"]["warm_gbps"])
    seq, warm = got["seq_gbps"], got["shuffled"]["warm_gbps"]
    assert got["shuffled"]["limit_gbps"] == pytest.approx(seq * warm / (seq + warm))
    assert got["in_order"]["stored_bytes"] == got["shuffled"]["stored_bytes"]  # the same records, once each
    assert got["of_seq"] == min(got["in_order"]["of_seq"], got["shuffled"]["of_seq"])
    assert got["gbps"] == got["shuffled"]["gbps"] and got["samples"] == got["shuffled"]["samples"]


def test_run_stages_reports_the_cold_stage_and_the_table_shows_it(dataset, capsys) -> None:
    ds = pyloader.ShardDataset(dataset)
    stages = R.run_stages(ds, batch_size=64, threads=2, epochs=1, torch_workers=0, progress=lambda s: None,
                          min_seconds=0.05)
    cold = stages["cold_read"]
    assert cold["samples"] == ds.num_records and cold["resident"] < 0.1
    from pyloader.bench import diagnosis

    result = {"stages": stages, "diagnosis": diagnosis.diagnose(stages),
              "dataset": {"records": ds.num_records, "shards": len(ds.shard_paths), "bytes": sum(ds.shard_bytes)}}
    bench_cli._print_bench(result)
    out = capsys.readouterr().out
    assert "cold sequential read (1 thr, best of 2)" in out
    for key, label in (("in_order", "in order"), ("shuffled", "shuffled")):
        assert f"cold epoch {label}, pyloader (2 thr)" in out
        assert f"= {cold[key]['of_seq']:.2f}x seq, {cold[key]['of_limit']:.2f}x limit" in out
    assert "(cold limit: " in out
