"""`pyloader bench` end to end: the CLI in a subprocess on tiny data, its JSON schema
(docs/bench.md), its plot, and its errors on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import pyloader

# A run small enough for the test suite: a 400-record generated dataset and a tiny
# custom accelerator workload.
TINY = ["--records", "400", "--epochs", "1", "--batch-size", "64", "--threads", "2", "--torch-workers", "0",
        "--workload", "custom", "--record-bytes", "2048", "--au-batch-size", "8", "--compute-time", "0.002",
        "--au-records", "64", "--max-accelerators", "2", "--au-seconds", "0.05"]


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyloader", "bench", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(300)
def test_bench_json_schema_on_the_generated_dataset() -> None:
    res = run_cli(*TINY, "--json", "--quiet")
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    assert r["schema_version"] == 2
    assert r["dataset"]["generated"] is True and r["dataset"]["records"] == 400
    st = r["stages"]
    for key in ("storage_read", "decode", "collate_limit", "pyloader", "torch_dataloader"):
        assert key in st, key
    assert st["remote_fetch"] is None and st["h2d"] is None  # local data, no GPU here
    assert st["storage_read"]["gbps"] > 0
    assert st["decode"]["gbps"] > 0  # the generated dataset is LZ4-compressed
    # Both loaders saw exactly the dataset, once per epoch.
    assert st["pyloader"]["samples"] == 400
    assert st["torch_dataloader"]["samples"] == 400
    assert st["pyloader"]["bytes"] == st["torch_dataloader"]["bytes"] > 400 * 12288
    assert 0.0 <= st["pyloader"]["wait_fraction"] <= 1.0
    # The first epoch is timed apart: its first batch comes before its end, and its rate is
    # the epoch's samples over its time.
    for key in ("pyloader", "torch_dataloader"):
        s = st[key]
        assert 0.0 < s["first_batch_s"] < s["startup_s"], key
        assert s["first_epoch_samples_per_s"] == pytest.approx(400 / s["startup_s"]), key
        assert s["first_epoch_vs_steady"] == pytest.approx(s["first_epoch_samples_per_s"] / s["samples_per_s"]), key
    # And once more after a 1 s pause, from iter(): its rate over the steady one.
    p = st["pyloader"]
    assert p["pause_s"] == 1.0 and 0.0 < p["paused_first_batch_s"] < p["paused_first_epoch_s"]
    assert p["paused_first_epoch_vs_steady"] == pytest.approx(400 / p["paused_first_epoch_s"] / p["samples_per_s"])
    # The same loader's next epoch after the same pause: the pause's own cost, the first epoch's reference.
    assert 0.0 < p["paused_warm_epoch_s"]
    assert p["paused_warm_epoch_vs_steady"] == pytest.approx(400 / p["paused_warm_epoch_s"] / p["samples_per_s"])
    assert p["paused_first_vs_warm"] == pytest.approx(p["paused_warm_epoch_s"] / p["paused_first_epoch_s"])
    assert "paused_first_epoch_s" not in st["torch_dataloader"]
    # pyloader's new batch memory in the first epoch: at least one batch's bytes, and its cost.
    assert st["pyloader"]["first_epoch_alloc_bytes"] >= 400 * 12288 / st["pyloader"]["batches_per_epoch"]
    assert st["pyloader"]["first_epoch_alloc_s"] > 0
    assert "first_epoch_alloc_bytes" not in st["torch_dataloader"]
    dg = r["diagnosis"]
    assert dg["bound"] in ("storage", "decode", "collate", "network", "workers", None)
    assert dg["loader_gbps"] == pytest.approx(st["pyloader"]["gbps"])
    for row in dg["stages"].values():
        assert row["utilization"] == pytest.approx(row["demand_gbps"] / row["capacity_gbps"])
    assert dg["notes"] and all(isinstance(n, str) for n in dg["notes"])
    assert dg["speedup_vs_torch"] == pytest.approx(
        st["pyloader"]["samples_per_s"] / st["torch_dataloader"]["samples_per_s"])
    au = r["accelerator_utilization"]
    assert au["workload"]["name"] == "custom" and au["workload"]["batch_size"] == 8
    for key in ("pyloader", "torch_dataloader"):
        trials = au[key]["trials"]
        assert trials and all(0.0 < t["au"] <= 1.05 for t in trials)
        assert 0 <= au[key]["max_accelerators"] <= 2
        assert au[key]["capped"] == (au[key]["max_accelerators"] == 2)
        ns = [t["accelerators"] for t in trials]
        assert ns == sorted(set(ns))


@pytest.mark.timeout(300)
def test_bench_table_and_plot(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    res = run_cli(*TINY, "--plot", str(png))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "pyloader / torch DataLoader:" in out and "bound by:" in out and "What it drew" in out
    assert "first epoch:" in out and "after a 1 s pause:" in out and "new batch memory:" in out and "ms thread time" in out
    assert "warm loader, same pause:" in out
    assert "max accelerators at AU >= 90%" in out
    assert "[pyloader bench] stage 4/5" in res.stderr  # live progress went to stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def _write(path: str, n: int) -> str:
    with pyloader.ShardWriter(path, {"x": ("uint8", (1024,)), "label": ("int64", ())}, compression="none",
                              shard_bytes=64 << 10) as w:
        for i in range(n):
            w.write({"x": np.full(1024, i % 256, np.uint8), "label": i})
    return path


@pytest.mark.timeout(300)
def test_bench_on_a_user_dataset(tmp_path) -> None:
    path = _write(str(tmp_path / "ds"), 300)
    res = run_cli(path, "--epochs", "1", "--torch-workers", "0", "--workload", "none", "--json", "--quiet")
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    assert r["dataset"]["generated"] is False and r["dataset"]["records"] == 300
    assert r["stages"]["decode"] is None  # nothing in it is compressed
    assert r["stages"]["pyloader"]["samples"] == 300
    assert "accelerator_utilization" not in r


@pytest.mark.timeout(120)
def test_bench_bad_url_exits_2(tmp_path) -> None:
    missing = str(tmp_path / "nowhere")
    res = run_cli(missing, "--quiet")
    assert res.returncode == 2
    assert "nowhere" in res.stderr and "manifest" in res.stderr


@pytest.mark.timeout(120)
def test_bench_empty_dataset_exits_2(tmp_path) -> None:
    path = str(tmp_path / "empty")
    with pyloader.ShardWriter(path, {"x": ("uint8", (4,))}):
        pass
    res = run_cli(path, "--quiet")
    assert res.returncode == 2
    assert "no records" in res.stderr


@pytest.mark.timeout(300)
def test_bench_corrupt_dataset_exits_1_naming_the_shard(tmp_path) -> None:
    path = _write(str(tmp_path / "bad"), 300)
    ds = pyloader.ShardDataset(path)
    victim = ds.shard_paths[1]
    with open(victim, "r+b") as f:  # flip a payload byte near the end of the shard
        f.seek(os.path.getsize(victim) - 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    res = run_cli(path, "--epochs", "1", "--torch-workers", "0", "--workload", "none", "--quiet")
    assert res.returncode == 1
    assert victim in res.stderr and "checksum" in res.stderr


def test_bench_rejects_bad_arguments() -> None:
    res = run_cli("--records", "0")
    assert res.returncode == 2 and "must be > 0" in res.stderr
    res = run_cli("--workload", "custom", "--records", "50")  # checked before anything is measured
    assert res.returncode == 2 and "--workload custom needs" in res.stderr and "[pyloader bench]" not in res.stderr


def _write_images(path: str, n: int) -> str:
    import io

    from PIL import Image

    with pyloader.ShardWriter(path, {"image": "jpeg", "label": "int64"}) as w:
        for i in range(n):
            buf = io.BytesIO()
            Image.fromarray(np.full((24 + i % 3, 32, 3), i % 250, np.uint8)).save(buf, "JPEG")
            w.write({"image": buf.getvalue(), "label": i})
    return path


@pytest.mark.timeout(300)
def test_bench_measures_a_users_transform(tmp_path) -> None:
    path = _write_images(str(tmp_path / "imgs"), 200)
    (tmp_path / "usertr.py").write_text(
        "def shrink(sample, ctx):\n"
        "    return {'x': sample['image'].float().mean((0, 1)), 'label': sample['label']}\n")
    res = subprocess.run([sys.executable, "-m", "pyloader", "bench", path, "--transform", "usertr:shrink",
                          "--image-size", "16", "--epochs", "1", "--torch-workers", "0", "--workload", "none",
                          "--min-seconds", "0.05", "--json", "--quiet"], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    t = json.loads(res.stdout)["transform"]
    assert t["function"] == "usertr:shrink" and t["executor_asked"] == "auto"  # the default: NOTE [executor choice]
    assert t["executor"] in ("threads", "processes") and t["executor_choice"]["why"]
    assert t["executor_choice"]["executor"] in (None, t["executor"])  # None: the epoch ended before the probe did
    assert t["with_transform"]["samples"] == 200 and t["torch_dataloader"]["samples"] == 200
    assert t["per_sample_us"] > 0 and 0 < t["share_of_sample_time"] <= 1 and t["hint"]
    # The table says the same.
    res = subprocess.run([sys.executable, "-m", "pyloader", "bench", path, "--transform", "usertr:shrink",
                          "--image-size", "16", "--epochs", "1", "--torch-workers", "0", "--workload", "none",
                          "--min-seconds", "0.05", "--quiet", "--executor", "processes"], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "transform stage: usertr:shrink on 2 process workers" in res.stdout
    assert "per sample:" in res.stdout and "pyloader / torch DataLoader with the transform" in res.stdout


def test_bench_rejects_a_transform_it_cannot_import(tmp_path) -> None:
    res = run_cli("--transform", "no_such_module_xyz:fn", "--quiet")
    assert res.returncode == 2 and "cannot import 'no_such_module_xyz'" in res.stderr
    res = run_cli("--transform", "json", "--quiet")
    assert res.returncode == 2 and "MODULE:FUNCTION" in res.stderr
    res = run_cli("--transform", "json:no_such_fn", "--quiet")
    assert res.returncode == 2 and "no function 'no_such_fn'" in res.stderr


@pytest.mark.timeout(300)
def test_bench_with_auto_threads_reports_what_the_tuner_chose() -> None:
    res = run_cli(*TINY, "--threads", "auto", "--json", "--quiet")
    assert res.returncode == 0, res.stderr
    py = json.loads(res.stdout)["stages"]["pyloader"]
    a = py["autotune"]
    assert set(a) >= {"threads", "prefetch", "max_threads", "memory_budget", "slot_bytes", "memory_bytes",
                      "decisions"}
    assert 1 <= a["threads"] <= a["max_threads"] and py["threads"] == a["threads"]
    assert 0 < a["memory_bytes"] <= a["memory_budget"]
    assert a["slot_bytes"] >= 64 * 12288  # the largest batch seen (64 records of 12 KB)
    bad = run_cli(*TINY, "--threads", "two")
    assert bad.returncode == 2 and "--threads: a positive number of threads or 'auto' (the loader tunes them), got 'two'" in bad.stderr


@pytest.mark.timeout(300)
def test_bench_packing_stage_on_a_token_dataset(tmp_path) -> None:
    """--pack: the packing stage over the dataset's token field, its padding counted from the
    documents written (greedy rows of 64 tokens: every document here is 40 tokens, one per row)."""
    path = str(tmp_path / "docs")
    with pyloader.ShardWriter(path, {"tokens": ("int32", (None,)), "id": ("int64", ())}) as w:
        for i in range(500):
            w.write({"tokens": np.full(40, i, np.int32), "id": i})
    res = run_cli(path, "--epochs", "1", "--torch-workers", "0", "--workload", "none", "--json", "--quiet",
                  "--pack", "64", "--pack-mode", "greedy", "--pack-rows", "4", "--min-seconds", "0.05")
    assert res.returncode == 0, res.stderr
    p = json.loads(res.stdout)["packing"]
    assert p["field"] == "tokens" and p["seq_len"] == 64 and p["mode"] == "greedy" and p["lookahead"] == 1
    assert p["padding_fraction"] == pytest.approx(24 / 64)
    assert p["split_documents"] == 0 and p["truncated_tokens"] == 0 and p["generated"] is False
    assert p["tokens_per_s"] > 0 and p["unpacked_tokens_per_s"] > 0
    assert p["packed_vs_unpacked"] == pytest.approx(p["tokens_per_s"] / p["unpacked_tokens_per_s"])
    assert p["bound"].split(":")[0] in ("consumer", "documents", "packer", "no part most of the time")
    # The table names the stage.
    table = run_cli(path, "--epochs", "1", "--torch-workers", "0", "--workload", "none", "--quiet", "--pack", "64",
                    "--min-seconds", "0.05")
    assert table.returncode == 0, table.stderr
    assert "packing stage: 'tokens' into rows of 64 tokens (first_fit, lookahead 64" in table.stdout


@pytest.mark.timeout(120)
def test_bench_pack_without_a_token_field_fails_before_measuring(tmp_path) -> None:
    path = _write(str(tmp_path / "ds"), 50)
    res = run_cli(path, "--workload", "none", "--quiet", "--pack", "64")
    assert res.returncode == 2  # See NOTE [exit codes]: a setting this dataset cannot take is a usage error
    assert "token field" in res.stderr


@pytest.mark.timeout(300)
def test_bench_au_search_without_a_cap_ends_by_the_threshold_or_its_budget() -> None:
    """No --max-accelerators: the search is not held at a round number; it ends where AU fell below
    the threshold or, within --au-budget, says its count is a lower bound."""
    i = TINY.index("--max-accelerators")
    argv = TINY[:i] + TINY[i + 2 :]
    res = run_cli(*argv, "--au-budget", "1.5", "--json", "--quiet")
    assert res.returncode == 0, res.stderr
    au = json.loads(res.stdout)["accelerator_utilization"]
    # One loader shared by a trial's accelerators: memory bounds its read-ahead, not the count.
    assert au["cap_reason"] == "ceiling" and au["cap"] > 32 and au["shared_loader"] is True
    assert au["torch_dataloader"]["cap"] == au["pyloader"]["cap"] == au["cap"]
    assert au["torch_dataloader"]["cap_reason"] == "ceiling"
    for key in ("pyloader", "torch_dataloader"):
        r = au[key]
        assert r["budget_s"] == 1.5 and r["stopped_by"] in (None, "time"), r
        below = [t["accelerators"] for t in r["trials"] if t["au"] < r["threshold"]]
        if r["stopped_by"] is None:  # a measured maximum, within its range; a count above it failed
            lo, hi = r["range"]
            assert not r["capped"] and lo <= r["max_accelerators"] <= hi
            assert r["fails_at"] is None or (r["fails_at"] > r["max_accelerators"] and r["fails_at"] in below)
        else:  # out of time: a lower bound
            assert r["capped"] and (r["fails_at"] is None or r["max_accelerators"] < r["fails_at"])
        # No trial started once the budget was spent: all of them took at most the budget and one more.
        spent = [t["trial_s"] for t in r["trials"]]
        assert sum(spent) <= 1.5 + max(spent) + 0.1, spent


@pytest.mark.timeout(120)
def test_bench_names_a_missing_shard_before_measuring(tmp_path) -> None:
    path = _write(str(tmp_path / "ds"), 300)
    victim = pyloader.ShardDataset(path).shard_paths[1]
    os.remove(victim)
    res = run_cli(path, "--workload", "none", "--quiet", "--epochs", "1", "--torch-workers", "0")
    assert res.returncode == 1, res.stderr
    assert "[Errno" not in res.stderr and victim in res.stderr, res.stderr
    assert "copy the dataset folder again whole" in res.stderr and "manifest.json" in res.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("option,value,words", [
    ("--threads", "lots", "a positive number of threads or 'auto'"),
    ("--record-bytes", "12Q", "a positive size in bytes, e.g. 12288, 12K or 1.5M, got '12Q'"),
])
def test_bench_option_errors_say_what_is_taken(option: str, value: str, words: str) -> None:
    res = run_cli(option, value)
    assert res.returncode == 2 and f"argument {option}: {words}" in res.stderr, res.stderr


@pytest.mark.timeout(300)
def test_bench_takes_record_bytes_as_a_size() -> None:
    res = run_cli("--records", "64", "--workload", "custom", "--record-bytes", "2K", "--au-batch-size", "8",
                  "--compute-time", "0.001", "--au-records", "64",
                  "--json", "--quiet", "--epochs", "1", "--torch-workers", "0", "--min-seconds", "0.05",
                  "--max-accelerators", "2", "--au-seconds", "0.05")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["config"]["record_bytes"] == 2048
