"""The diagnosis never contradicts its own figures (issue 27, item 6; NOTE [a diagnosis true to
its figures] in pyloader/bench/diagnosis.py).

Each test builds the measured figures of a situation (storage-bound, decode-bound,
consumer-bound, already at the CPU count, a local or a remote dataset) as ``run_stages``
returns them and reads the verdict, the advice and the printed table."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from pyloader.bench import cli as bench_cli
from pyloader.bench import diagnosis as D


def situation(*, gbps: float, storage: float = 50.0, decode: float | None = None, memcpy: float = 40.0,
              lz4_share: float = 0.0, busy: float = 0.5, wait: float = 0.6, threads: int = 4,
              network: float | None = None, batches: int = 100) -> dict[str, Any]:
    """Stage figures of one epoch of 1 GB decoded delivered at ``gbps``; ``lz4_share`` of it LZ4
    (stored at half its size), the rest raw; ``network`` set: a remote dataset."""
    decoded = 10**9
    lz4_decoded = int(lz4_share * decoded)
    lz4_stored = lz4_decoded // 2
    stored = decoded - lz4_decoded + lz4_stored
    wall = decoded / gbps / 1e9
    loader = {"samples": 10_000, "bytes": decoded, "epochs": 3, "wall_s": 3 * wall, "epoch_s": wall, "cpu_s": 1.0,
              "samples_per_s": 10_000 / wall, "gbps": gbps, "batches_per_epoch": batches, "startup_s": 0.1}
    return {
        "remote_fetch": None if network is None else {"gbps": network, "bytes": stored, "shards_downloaded": 4,
                                                      "shards_cached": 0, "wall_s": 1.0, "cpu_s": 0.1},
        "storage_read": {"gbps": storage, "threads": threads, "cpu_s": 0.1, "wall_s": 0.2},
        "decode": None if decode is None else {"gbps_1_thread": decode / threads, "gbps": decode,
                                               "threads": threads, "cpu_s": 1.0},
        "collate_limit": {"memcpy_gbps": memcpy, "threads": threads, "cpu_s": 0.1},
        "pyloader": {**loader, "threads": threads, "wait_fraction": wait, "workers_busy": busy,
                     "stored_bytes": stored, "decoded_bytes": decoded, "lz4_stored_bytes": lz4_stored,
                     "collate_s": 1.0, "shard_wait_s": 0.0},
        "torch_dataloader": {**loader, "samples_per_s": 1000.0, "num_workers": 2},
        "h2d": None,
    }


def printed(st: dict[str, Any], dg: dict[str, Any], capsys: Any) -> str:
    bench_cli._print_bench({"stages": st, "diagnosis": dg,
                            "dataset": {"records": 10_000, "shards": 4, "bytes": 10**9}})
    return capsys.readouterr().out


def used_column(out: str) -> list[int]:
    """The 'used' percentages of the printed stage table."""
    return [int(m) for m in re.findall(r"GB/s\s+\d+\.\d\d GB/s\s+(\d+)%", out)]


def assert_true_to_its_figures(st: dict[str, Any], dg: dict[str, Any], cpus: int) -> None:
    for name, row in dg["stages"].items():
        assert row["utilization"] <= 1.0 + 1e-9, (name, row)
        assert row["capacity_gbps"] >= row["demand_gbps"] * (1 - 1e-9), (name, row)
        assert dg["headroom"][name] >= 1.0, (name, dg["headroom"])
        assert row["utilization"] == pytest.approx(row["demand_gbps"] / row["capacity_gbps"])
        assert row["demand_gbps"] > 0
    text = " ".join(dg["notes"])
    assert all(int(pct) <= 100 for pct in re.findall(r"(\d+)%", text)), text
    if st["pyloader"]["threads"] >= cpus:
        assert "add threads" not in text, text
    if st["remote_fetch"] is None:
        assert "cache warm" not in text, text
    if st["pyloader"]["lz4_stored_bytes"] == st["pyloader"]["stored_bytes"]:
        assert "compression='lz4'" not in text, text
    assert dg["cpus"] == cpus
    # The work the loader's threads do is never used more than they were busy, and the verdict
    # agrees with the table: no bound exactly when every row is below BOUND_AT.
    busy = st["pyloader"].get("workers_busy")
    for name in ("decode", "collate"):
        if busy and name in dg["stages"]:
            assert dg["stages"][name]["utilization"] <= min(busy, 1.0) + 1e-9, (name, dg["stages"][name], busy)
    top = max(row["utilization"] for row in dg["stages"].values())
    assert (dg["bound"] is None) == (top < D.BOUND_AT), (dg["bound"], top)
    if dg["bound"] is not None:
        assert dg["bound_utilization"] == pytest.approx(dg["stages"][dg["bound"]]["utilization"])
        assert dg["bound_utilization"] >= D.BOUND_AT


# -- storage-bound ---------------------------------------------------------------------------
def test_storage_bound_local_dataset_gets_local_advice(capsys) -> None:
    st = situation(gbps=0.9, storage=1.0)
    dg = D.diagnose(st, cpus=8)
    assert dg["bound"] == "storage" and dg["bound_utilization"] == pytest.approx(0.9)
    head = dg["notes"][0]
    assert head.startswith("to go faster: move the dataset to faster storage")
    assert "compression='lz4'" in head and "cache warm" not in head  # it refuses local paths
    assert "`pyloader convert --compression lz4`" in head  # the command's option, beside the Python argument
    assert_true_to_its_figures(st, dg, 8)
    assert "bound by: storage, at 90% of its capacity (0.90 of 1.00 GB/s)" in printed(st, dg, capsys)


def test_storage_bound_remote_dataset_is_told_to_warm_the_cache() -> None:
    st = situation(gbps=0.9, storage=1.0, network=5.0)
    dg = D.diagnose(st, cpus=8)
    assert dg["bound"] == "storage" and "pyloader cache warm URL" in dg["notes"][0]
    assert "network" in dg["stages"]
    assert_true_to_its_figures(st, dg, 8)


def test_network_bound_compressed_dataset_is_not_told_to_compress() -> None:
    st = situation(gbps=1.0, network=0.55, lz4_share=1.0, decode=20.0, busy=0.3)
    dg = D.diagnose(st, cpus=8)
    assert dg["bound"] == "network"
    assert "pyloader cache warm URL" in dg["notes"][0] and "compression" not in dg["notes"][0]
    assert_true_to_its_figures(st, dg, 8)


# -- decode-bound, below and at the CPU count ---------------------------------------------------
def test_decode_bound_below_the_cpu_count_adds_threads() -> None:
    st = situation(gbps=2.0, decode=2.2, lz4_share=1.0, busy=0.95, threads=4)
    dg = D.diagnose(st, cpus=8)
    assert dg["bound"] == "decode"
    assert dg["notes"][0].startswith("to go faster: add threads (--threads / num_workers; 4 of 8 CPUs used)")
    assert_true_to_its_figures(st, dg, 8)


def test_decode_bound_at_the_cpu_count_does_not_add_threads(capsys) -> None:
    # The run: 2 threads on 2 CPUs, decode measured apart below what the loader drew
    # (0.69 against 0.89 GB/s: "at 129% of its capacity").
    st = situation(gbps=0.89, decode=0.69, lz4_share=1.0, busy=0.97, threads=2)
    dg = D.diagnose(st, cpus=2)
    assert dg["bound"] == "decode"
    row = dg["stages"]["decode"]
    # The loader's workers decoded 0.89 GB/s busy 97% of the time: its capacity is at least 0.89 / 0.97.
    assert row["clamped"] and row["measured_gbps"] == 0.69 and row["utilization"] == pytest.approx(0.97)
    assert dg["headroom"]["decode"] >= 1.0  # never below 1: the loader carried this rate
    head = dg["notes"][0]
    assert "add threads" not in head
    assert "already runs 2 threads on the 2 CPUs this process may use" in head
    assert "compression='none'" in head and "more CPUs" in head
    assert "`pyloader convert --compression none`" in head
    assert any(n.startswith("decode measured 0.69 GB/s, below the 0.89 GB/s") for n in dg["notes"])
    assert_true_to_its_figures(st, dg, 2)
    out = printed(st, dg, capsys)
    assert "129%" not in out and max(used_column(out)) <= 100
    assert all(int(pct) <= 100 for pct in re.findall(r"(\d+)%", out)), out
    assert "bound by: decode, at 97% of its capacity (0.89 of 0.92 GB/s)" in out
    assert "measured 0.69 GB/s, below what the loader's own epochs show, raised to that" in out


def test_workers_bound_at_the_cpu_count_does_not_add_threads() -> None:
    st = situation(gbps=3.0, busy=0.93, threads=8)
    dg = D.diagnose(st, cpus=8)
    assert dg["bound"] == "workers"
    assert "add threads" not in dg["notes"][0] and "already runs 8 threads on the 8 CPUs" in dg["notes"][0]
    assert "compression='none'" not in dg["notes"][0]  # nothing in this dataset is compressed
    assert_true_to_its_figures(st, dg, 8)
    below = D.diagnose(st, cpus=16)
    assert below["notes"][0].startswith("to go faster: add threads (--threads / num_workers; 8 of 16 CPUs used)")


def test_collate_bound_at_the_cpu_count_names_the_only_remedy() -> None:
    st = situation(gbps=9.0, memcpy=10.0, busy=0.9, threads=4)
    dg = D.diagnose(st, cpus=4)
    assert dg["bound"] == "collate"
    assert "add threads" not in dg["notes"][0] and "fewer bytes per sample" in dg["notes"][0]


# -- consumer-bound ----------------------------------------------------------------------------
def test_consumer_bound_nothing_binds_and_the_loop_set_the_pace() -> None:
    st = situation(gbps=1.0, wait=0.05, busy=0.2)
    dg = D.diagnose(st, cpus=8)
    assert dg["bound"] is None
    assert dg["notes"][0].startswith("no stage is near its limit")
    assert any("only 5% of the time: the loop itself set the pace" in n for n in dg["notes"])
    assert not any(n.startswith("to go faster") for n in dg["notes"])
    assert_true_to_its_figures(st, dg, 8)


# -- figures that need their explanation -------------------------------------------------------
def test_a_stage_that_carried_no_bytes_has_no_row_but_a_reason(capsys) -> None:
    # All values LZ4 but the labels: the copy stage carries ~0 of the bytes ("drawn 0.00 GB/s 0%").
    st = situation(gbps=1.0, decode=5.0, lz4_share=0.999, busy=0.4)
    dg = D.diagnose(st, cpus=8)
    assert "collate" not in dg["stages"]
    assert any(n.startswith("collate has no row: only 0.1% of the bytes are uncompressed values") for n in
               dg["notes"])
    out = printed(st, dg, capsys)
    assert not re.search(r"collate\s+\d", out) and " 0.00 GB/s" not in out


def test_new_batch_memory_and_cpu_seconds_are_explained_in_the_table(capsys) -> None:
    st = situation(gbps=1.0)
    st["pyloader"].update(first_batch_s=0.01, first_epoch_vs_steady=0.5, first_epoch_alloc_bytes=20 << 20,
                          first_epoch_alloc_s=0.013)
    out = printed(st, D.diagnose(st, cpus=8), capsys)
    assert "of it new batch memory: 20 MiB" in out and "13 ms thread time" in out
    assert "new batch memory: the batch buffers' pages the kernel populated" in out
    assert "CPU s: the CPU time of every thread and child process" in out


def test_a_short_round_asks_for_more_seconds_not_more_rounds() -> None:
    st = situation(gbps=1.0)
    st["pyloader"]["wall_s"] = 0.2
    (w,) = D.diagnose(st, cpus=8)["warnings"]
    assert "pyloader 0.20 s" in w and "raise --min-seconds to 0.5" in w and "--epochs" not in w


def test_the_transform_stage_asks_for_more_workers_only_below_the_cpu_count() -> None:
    def hint(workers: int, cpus: int, executor: str = "threads", wait: float = 0.9) -> str:
        return D.transform_hint(wait_fraction=wait, workers_busy=0.97, workers=workers, cpus=cpus, executor=executor,
                                with_rate=1000.0, without_rate=50_000.0, shard_wait_s=0.0, wall_s=1.0, batches=40)

    assert hint(2, 8).startswith("more workers would help: the consumer waits 90% of the time and the 2 transform "
                                 "worker(s) are busy 97% of it (2 of the 8 CPUs")
    at_cpus = hint(2, 2)
    assert "more workers would help" not in at_cpus
    assert at_cpus.startswith("the transform binds: the consumer waits 90% of the time and the 2 transform worker(s) "
                              "are busy 97% of it, and the 2 workers already match the 2 CPUs")
    assert "executor='processes'" in at_cpus
    # On processes already, the hint does not send the user there.
    on_processes = hint(2, 2, "processes")
    assert on_processes.startswith("the transform binds") and "executor='processes'" not in on_processes
    assert hint(4, 2, wait=0.01).startswith("enough: the consumer waited only 1% of the time")


def test_no_situation_contradicts_itself() -> None:
    """Many situations drawn at random: capacities at or above the loader's rate, use at most
    100%, advice the machine and the dataset can take."""
    rng = np.random.default_rng(27)
    for _ in range(400):
        threads, cpus = int(rng.integers(1, 17)), int(rng.integers(1, 17))
        remote = bool(rng.random() < 0.5)
        lz4 = float(rng.choice([0.0, 0.5, 1.0]))
        gbps = float(rng.uniform(0.1, 10))
        st = situation(gbps=gbps, storage=float(rng.uniform(0.05, 20)), memcpy=float(rng.uniform(0.05, 20)),
                       decode=float(rng.uniform(0.05, 20)) if lz4 else None, lz4_share=lz4,
                       busy=float(rng.uniform(0.01, 1.2)), wait=float(rng.uniform(0, 1)), threads=threads,
                       network=float(rng.uniform(0.05, 20)) if remote else None)
        dg = D.diagnose(st, cpus=cpus)
        assert_true_to_its_figures(st, dg, cpus)
        if dg["bound"] is not None:
            assert dg["notes"][0].startswith("to go faster: ")
