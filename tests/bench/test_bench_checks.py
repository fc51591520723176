"""`pyloader bench`: errors from its measuring threads, options checked before measuring,
the diagnosis read from measured numbers, the AU search's cap and labels, and warnings
on measurements too short to trust."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import pyloader
from pyloader.bench import au as A
from pyloader.bench import cli as bench_cli
from pyloader.bench import diagnosis as D
from pyloader.bench import measure as B
from pyloader.format.spec import INDEX_DTYPE, unpack_header


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyloader", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _raw_dataset(path: str, n: int) -> str:
    with pyloader.ShardWriter(path, {"x": ("uint8", (1024,)), "label": ("int64", ())}, compression="none",
                              shard_bytes=64 << 10) as w:
        for i in range(n):
            w.write({"x": np.full(1024, i % 256, np.uint8), "label": i})
    return path


# -- a corrupt dataset: one clean error, no thread tracebacks ----------------------------
def _corrupt_lz4_value(tmp_path: Any) -> tuple[str, str]:
    path = str(tmp_path / "lz4")
    B.write_profile_dataset(path, B.PROFILES["image12k"], 300, compression="lz4", shard_bytes=1 << 20)
    victim = pyloader.ShardDataset(path).shard_paths[1]
    with open(victim, "rb") as f:
        data = f.read()
    h = unpack_header(data)
    index = np.frombuffer(data, INDEX_DTYPE, count=h.index_size // INDEX_DTYPE.itemsize, offset=h.index_offset)
    e = index[np.flatnonzero(index["codec"] == 1)[2]]
    with open(victim, "r+b") as f:  # garble the middle of an LZ4 block
        f.seek(h.payload_offset + int(e["offset"]) + 10)
        f.write(b"\xff" * 64)
    return path, victim


@pytest.mark.timeout(300)
def test_corrupt_lz4_value_gives_one_clean_error_naming_the_shard(tmp_path) -> None:
    path, victim = _corrupt_lz4_value(tmp_path)
    res = run_cli(path, "--epochs", "1", "--torch-workers", "0", "--workload", "none")
    assert res.returncode == 1
    assert "Exception in thread" not in res.stderr and "Traceback" not in res.stderr, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("pyloader bench: error:")]
    assert len(errors) == 1, res.stderr
    assert victim in errors[0] and "checksum" in errors[0] and "field 'image'" in errors[0]


def test_parallel_reraises_on_the_calling_thread(capfd) -> None:
    def boom() -> None:
        raise pyloader.ShardFormatError("bad block")

    with pytest.raises(pyloader.ShardFormatError, match="bad block"):
        B.parallel(boom, 3)
    assert "Exception in thread" not in capfd.readouterr().err


# -- options: ranges, combinations, --plot, all before measuring -------------------------
def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pyloader")
    bench_cli.add_bench_parser(p.add_subparsers(dest="cmd"))
    return p.parse_args(["bench", *argv])


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--au-threshold", "1.5", "must be in (0, 1], got 1.5"),
    ("--au-threshold", "0", "must be in (0, 1], got 0"),
    ("--au-threshold", "nan", "must be in (0, 1]"),
    ("--compute-time", "inf", "must be > 0"),
    ("--au-seconds", "-1", "must be > 0"),
    ("--min-seconds", "0", "must be > 0"),
    ("--torch-workers", "-1", "must be >= 0"),
    ("--au-torch-workers", "-2", "must be >= 0"),
    ("--max-accelerators", "0", "must be > 0"),
    ("--batch-size", "2.5", "not an integer"),
    ("--epochs", "x", "not an integer"),
])
def test_numeric_options_are_range_checked(capsys, option: str, value: str, message: str) -> None:
    with pytest.raises(SystemExit) as e:
        _parse(option, value)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {message}" in err


def test_au_threshold_out_of_range_exits_2_from_the_command() -> None:
    res = run_cli("--au-threshold", "1.5", timeout=60)
    assert res.returncode == 2 and "--au-threshold: must be in (0, 1], got 1.5" in res.stderr


@pytest.mark.parametrize(("argv", "message"), [
    (["--workload", "custom", "--compute-time", "0.1"], "--workload custom needs"),
    (["--record-bytes", "100"], "apply to --workload custom only"),
    (["URL", "--records", "100"], "size the generated datasets"),
])
def test_option_combinations_are_checked_before_measuring(tmp_path, capsys, argv: list[str], message: str) -> None:
    url = _raw_dataset(str(tmp_path / "ds"), 10)
    args = _parse(*[url if a == "URL" else a for a in argv], "--quiet")
    assert bench_cli.run_bench(args) == 2
    out = capsys.readouterr()
    assert message in out.err and out.out == ""


@pytest.mark.timeout(60)
def test_plot_without_matplotlib_exits_2_before_measuring(tmp_path) -> None:
    fake = tmp_path / "site"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}
    res = run_cli("--plot", str(tmp_path / "out.png"), env=env, timeout=60)
    assert res.returncode == 2
    assert "--plot needs matplotlib" in res.stderr
    assert "[pyloader bench]" not in res.stderr and res.stdout == ""  # nothing was measured


@pytest.mark.timeout(300)
def test_a_failed_plot_keeps_the_table(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    url = _raw_dataset(str(tmp_path / "ds"), 300)
    target = tmp_path / "taken.png"
    target.mkdir()  # passes the up-front check; writing the PNG over it fails
    res = run_cli(url, "--epochs", "1", "--torch-workers", "0", "--workload", "none", "--quiet",
                  "--min-seconds", "0.05", "--plot", str(target))
    assert res.returncode == 1
    assert "What it drew from each stage" in res.stdout  # the table came first
    assert "the plot was not written" in res.stderr


# -- the diagnosis ------------------------------------------------------------------------
def _stages(*, gbps: float, memcpy: float, decode: float | None = None, lz4_share: float = 0.0,
            busy: float = 0.5, wait: float = 0.3, batches: int = 100, epoch_s: float = 1.0) -> dict[str, Any]:
    """Stage figures as run_stages returns them: one epoch of 1 GB decoded."""
    decoded = 10**9
    lz4_decoded = int(lz4_share * decoded)
    lz4_stored = lz4_decoded // 2
    stored = decoded - lz4_decoded + lz4_stored
    wall = decoded / gbps / 1e9 if epoch_s == 1.0 else epoch_s
    loader = {"samples": 10_000, "bytes": decoded, "epochs": 1, "wall_s": max(wall, 0.6), "epoch_s": wall,
              "cpu_s": 1.0, "samples_per_s": 10_000 / wall, "gbps": decoded / wall / 1e9,
              "batches_per_epoch": batches, "startup_s": 0.1}
    return {
        "remote_fetch": None,
        "storage_read": {"gbps": 50.0, "threads": 8, "cpu_s": 0.1, "wall_s": 0.2},
        "decode": None if decode is None else {"gbps_1_thread": decode / 8, "gbps": decode, "threads": 8,
                                               "cpu_s": 1.0},
        "collate_limit": {"memcpy_gbps": memcpy, "threads": 8, "cpu_s": 0.1},
        "pyloader": {**loader, "threads": 8, "wait_fraction": wait, "workers_busy": busy, "stored_bytes": stored,
                     "decoded_bytes": decoded, "lz4_stored_bytes": lz4_stored, "collate_s": 1.0,
                     "shard_wait_s": 0.0},
        "torch_dataloader": {**loader, "samples_per_s": 1000.0, "num_workers": 2},
        "h2d": None,
    }


def test_a_capacity_below_the_loaders_rate_is_clamped_to_it_and_explained() -> None:
    # The run: the loader at 17.1 GB/s, the copy stage measured at 8.3 GB/s. The
    # loader's own epochs show the copy carries 17.1 GB/s on workers busy 95% of the time, so
    # at least 17.1 / 0.95: no capacity below it, no use above the workers' busy share.
    dg = D.diagnose(_stages(gbps=17.1, memcpy=8.3, busy=0.95), cpus=16)
    row = dg["stages"]["collate"]
    assert row["capacity_gbps"] == pytest.approx(17.1 / 0.95) and row["demand_gbps"] == pytest.approx(17.1)
    assert row["measured_gbps"] == 8.3 and row["clamped"] is True
    assert row["utilization"] == pytest.approx(0.95) and dg["headroom"]["collate"] == pytest.approx(1.05)
    assert dg["bound"] == "collate" and dg["bound_utilization"] == pytest.approx(0.95)
    assert any(n.startswith("collate measured 8.30 GB/s, below the 17.10 GB/s") and "95% used" in n
               for n in dg["notes"])


def test_the_binding_stage_is_the_one_closest_to_its_capacity() -> None:
    # Half the bytes are LZ4: the loader draws 4 GB/s decoded from decode (capacity 4.4) and
    # 4 GB/s raw from the copy (capacity 40); its threads were busy 95% of the time.
    dg = D.diagnose(_stages(gbps=8.0, memcpy=40.0, decode=4.4, lz4_share=0.5, busy=0.95), cpus=16)
    assert dg["stages"]["decode"]["demand_gbps"] == pytest.approx(4.0)
    assert dg["stages"]["collate"]["demand_gbps"] == pytest.approx(4.0)
    assert dg["bound"] == "decode" and dg["bound_utilization"] == pytest.approx(4.0 / 4.4)
    assert dg["notes"][0].startswith("to go faster: add threads")
    assert dg["headroom"]["decode"] == pytest.approx(1.1)


def test_idle_workers_mean_no_cpu_stage_binds() -> None:
    dg = D.diagnose(_stages(gbps=8.0, memcpy=40.0, decode=4.4, lz4_share=0.5, busy=0.4))
    assert dg["bound"] is None
    assert dg["notes"][0].startswith("no stage is near its limit")
    assert any("decode measured apart" in n and "busy only 40%" in n for n in dg["notes"])


def test_the_consumer_wait_line_only_when_true_with_the_number() -> None:
    waited = D.diagnose(_stages(gbps=1.0, memcpy=10.0, wait=0.83))["notes"]
    assert any("the consumer waited for batches 83% of the time" in n for n in waited)
    middle = D.diagnose(_stages(gbps=1.0, memcpy=10.0, wait=0.35))["notes"]
    assert not any("consumer waited" in n for n in middle)


def test_a_first_epoch_slowed_by_new_batch_memory_is_named() -> None:
    st = _stages(gbps=1.0, memcpy=10.0)
    # 8 threads for 0.1 s: 0.8 s of thread time, 0.4 s of it allocating 512 MiB of batch memory.
    st["pyloader"].update(first_epoch_vs_steady=0.25, first_epoch_alloc_s=0.4, first_epoch_alloc_bytes=512 << 20)
    notes = D.diagnose(st)["notes"]
    hit = [n for n in notes if "new batch memory" in n]
    assert len(hit) == 1 and "0.25x the steady state" in hit[0] and "50% of its collating threads' time" in hit[0]
    assert "512 MiB" in hit[0]
    for quiet in ({"first_epoch_vs_steady": 0.7}, {"first_epoch_alloc_s": 0.05}):  # a fast first epoch; little memory
        st2 = _stages(gbps=1.0, memcpy=10.0)
        st2["pyloader"].update({"first_epoch_vs_steady": 0.25, "first_epoch_alloc_s": 0.4,
                                "first_epoch_alloc_bytes": 512 << 20, **quiet})
        assert not any("new batch memory" in n for n in D.diagnose(st2)["notes"]), quiet


def test_a_short_measurement_warns() -> None:
    short = D.diagnose(_stages(gbps=1.0, memcpy=10.0, batches=2, epoch_s=0.009))
    assert len(short["warnings"]) == 1
    assert "too short to trust" in short["warnings"][0] and "2 batches" in short["warnings"][0]
    assert D.diagnose(_stages(gbps=1.0, memcpy=10.0))["warnings"] == []


# -- accelerator utilization --------------------------------------------------------------
def _search(au_of_n, *, cap: int = 1000, budget_s: float = 1e9, trial_s: float = 1.0) -> dict[str, Any]:
    """The AU search over a machine whose AU at n accelerators is ``au_of_n(n)``; each trial takes
    ``trial_s`` on the search's clock."""
    now = [0.0]

    def measure(n: int) -> dict[str, float]:
        now[0] += trial_s
        return {"au": au_of_n(n), "au_min": au_of_n(n), "startup_s": 0.0}

    return A.max_accelerators(measure, threshold=0.9, cap=cap, budget_s=budget_s, progress=lambda m: None,
                              label="t", clock=lambda: now[0])


def test_au_search_grows_until_au_falls_below_the_threshold() -> None:
    r = _search(lambda n: 0.99 if n <= 37 else 0.5)
    assert r["max_accelerators"] == 37 and r["capped"] is False and r["stopped_by"] is None
    assert r["fails_at"] == 38


def test_au_search_goes_past_32_while_au_holds() -> None:
    # The run: pyloader still held AU 0.91 at 32, the old cap; the maximum is past it.
    r = _search(lambda n: 0.91 if n <= 150 else 0.6)
    assert r["max_accelerators"] == 150 and not r["capped"]
    assert max(t["accelerators"] for t in r["trials"]) == 256
    lo, hi = r["range"]
    assert lo <= 150 <= hi and bench_cli._au_count(r) == f"150 ({lo} to {hi} at 95% confidence, 3 trials per count near it)"


def test_au_search_at_the_cap_says_at_least() -> None:
    r = _search(lambda n: 0.99, cap=20)
    assert r["max_accelerators"] == 20 and r["capped"] is True and r["stopped_by"] == "cap"
    assert [t["accelerators"] for t in r["trials"]][-1] == 20
    assert bench_cli._au_count(r) == "at least 20 (cap)"


def test_au_search_out_of_time_says_at_least() -> None:
    # Trials of 10 s on a 35 s budget: 1, 2, 4 (30 s spent); 8 would end past 35 s.
    r = _search(lambda n: 0.99, budget_s=35, trial_s=10)
    assert [t["accelerators"] for t in r["trials"]] == [1, 2, 4]
    assert r["max_accelerators"] == 4 and r["capped"] and r["stopped_by"] == "time" and r["fails_at"] is None
    assert bench_cli._au_count(r) == "at least 4 (time budget)"
    au = {"cap": 1000, "cap_reason": "ceiling", "pyloader": r, "torch_dataloader": {**r, "capped": False}}
    assert bench_cli._au_stops(au) == ["the search spent its 35 s of trials: raise --au-budget to search further"]
    # Out of time while bisecting: a lower bound below the first count that failed.
    r = _search(lambda n: 0.99 if n <= 40 else 0.5, budget_s=75, trial_s=10)
    assert r["stopped_by"] == "time" and r["fails_at"] is not None and r["max_accelerators"] < r["fails_at"]
    assert bench_cli._au_count(r) == f"at least {r['max_accelerators']}, fewer than {r['fails_at']} (time budget)"


def test_each_loaders_stop_is_named_once() -> None:
    py = _search(lambda n: 0.99, cap=64)
    py["cap_reason"] = "ceiling"
    tc = _search(lambda n: 0.99, cap=8)
    tc["cap_reason"] = "max_accelerators"
    au = {"cap": 64, "cap_reason": "ceiling", "pyloader": py, "torch_dataloader": tc}
    assert bench_cli._au_stops(au) == [
        "the search stopped at 64, its ceiling without --max-accelerators",
        "the search stopped at 8, the cap: raise --max-accelerators to search further"]
    both = {**au, "torch_dataloader": {**py}}
    assert len(bench_cli._au_stops(both)) == 1


@pytest.mark.timeout(300)
def test_au_on_a_users_dataset_is_labelled_with_its_record_size(tmp_path) -> None:
    url = _raw_dataset(str(tmp_path / "ds"), 300)
    argv = [url, "--epochs", "1", "--torch-workers", "0", "--min-seconds", "0.05", "--workload", "resnet50",
            "--au-seconds", "0.2", "--max-accelerators", "2", "--quiet"]
    res = run_cli(*argv, "--json")
    assert res.returncode == 0, res.stderr
    w = json.loads(res.stdout)["accelerator_utilization"]["workload"]
    assert w["record_bytes"] == 1024 + 8 and w["records"] == 300 and w["records_from"] == "dataset"
    assert w["batch_size"] == 64  # the preset's batch and compute, on the dataset's own records
    res = run_cli(*argv)
    assert res.returncode == 0, res.stderr
    assert "accelerator utilization, this dataset: 300 records of 1.0 KB" in res.stdout
    assert "114.7 KB" not in res.stdout


@pytest.mark.timeout(120)
def test_a_timed_round_spans_at_least_min_seconds(tmp_path) -> None:
    """A round stops on the CPU timer's own clock, so its wall time is never below --min-seconds
    (and the diagnosis never calls a round the user sized right too short)."""
    from pyloader.bench import stages

    with pyloader.ShardWriter(str(tmp_path / "ds"), {"x": ("uint8", (64,))}, shard_bytes=1 << 16) as w:
        for i in range(64):
            w.write({"x": np.full(64, i % 256, np.uint8)})
    ds = pyloader.ShardDataset(str(tmp_path / "ds"))
    for _ in range(3):
        r = stages._measure_loader(lambda: pyloader.DataLoader(ds, batch_size=16), rounds=2, batch_size=16,
                                   min_seconds=0.05)
        assert r["wall_s"] >= 0.05 and r["epochs"] > 1
