"""Every figure `pyloader bench` prints agrees with the others of the same run (issue 40, items 3,
4, 5, 7 and 8; NOTE [a diagnosis true to its figures] in pyloader/bench/diagnosis.py).

The verdicts are drawn from the situations the issue met (decode "100% used" beside "no stage
is near its limit", a transform stage read from an epoch of 8 batches, "reading limits" while
reading alone ran 5x faster, "builds rows most of the time" at 43%, greedy advised at four
times the padding), then one real run's JSON is read and its identities checked."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from pyloader.bench import au as A
from pyloader.bench import cli as bench_cli
from pyloader.bench import diagnosis as D


def stages(*, gbps: float, decode: float, busy: float, wait: float = 0.9, threads: int = 2) -> dict[str, Any]:
    """One epoch of 1 GB decoded, all of it LZ4 (stored at half), delivered at ``gbps``."""
    decoded, wall = 10**9, 1.0 / gbps
    loader = {"samples": 10_000, "bytes": decoded, "epochs": 3, "wall_s": 3 * wall, "epoch_s": wall, "cpu_s": 1.0,
              "samples_per_s": 10_000 / wall, "gbps": gbps, "batches_per_epoch": 80, "startup_s": 0.1}
    return {"remote_fetch": None, "storage_read": {"gbps": 10.0, "threads": threads, "cpu_s": 0.1, "wall_s": 0.2},
            "decode": {"gbps_1_thread": decode / threads, "gbps": decode, "threads": threads, "cpu_s": 1.0},
            "collate_limit": {"memcpy_gbps": 8.0, "threads": threads, "cpu_s": 0.1},
            "pyloader": {**loader, "threads": threads, "wait_fraction": wait, "workers_busy": busy,
                         "stored_bytes": decoded // 2, "decoded_bytes": decoded, "lz4_stored_bytes": decoded // 2,
                         "collate_s": 1.0, "shard_wait_s": 0.0},
            "torch_dataloader": {**loader, "samples_per_s": 3000.0, "num_workers": 2}, "h2d": None}


def check_diagnosis(st: dict[str, Any], dg: dict[str, Any]) -> None:
    """The table and the verdict agree: worker stages used no more than the workers were busy; no
    bound exactly when every row is below BOUND_AT."""
    busy = st["pyloader"]["workers_busy"]
    rows = dg["stages"]
    for name in ("decode", "collate"):
        if name in rows and busy:
            assert rows[name]["utilization"] <= min(busy, 1.0) + 1e-9, (name, rows[name], busy)
    top = max(r["utilization"] for r in rows.values())
    assert (dg["bound"] is None) == (top < D.BOUND_AT), (dg["bound"], rows)
    if dg["bound"] is None:
        assert dg["notes"][0].startswith("no stage is near its limit")
        assert f"at {100 * top:.0f}% of its capacity" in dg["notes"][0]
    else:
        assert dg["bound_utilization"] == pytest.approx(rows[dg["bound"]]["utilization"])
        assert dg["bound_utilization"] >= D.BOUND_AT


def test_decode_measured_below_the_loaders_rate_is_not_100_percent_used_beside_no_bound(capsys) -> None:
    # The default run: decode measured apart at 1.01 GB/s, the loader drew 1.03 GB/s from it
    # on workers busy 70% of the time. The old table read "decode ... 100%" above "no stage is near
    # its limit"; the workers' own epochs show decode carries at least 1.03 / 0.70.
    st = stages(gbps=1.03, decode=1.01, busy=0.70)
    dg = D.diagnose(st, cpus=2)
    check_diagnosis(st, dg)
    row = dg["stages"]["decode"]
    assert row["clamped"] and row["measured_gbps"] == 1.01
    assert row["utilization"] == pytest.approx(0.70) and row["capacity_gbps"] == pytest.approx(1.03 / 0.70)
    assert dg["bound"] is None
    bench_cli._print_bench({"stages": st, "diagnosis": dg, "dataset": {"records": 10_000, "shards": 4, "bytes": 10**9}})
    out = capsys.readouterr().out
    decode_line = next(line for line in out.splitlines() if line.strip().startswith("decode "))
    assert re.search(r"GB/s\s+70%", decode_line), decode_line
    assert "bound by: no measured stage" in out and "no stage is near its limit (the busiest" in out
    # Busy workers: the same decode figures bind, at the workers' share.
    st = stages(gbps=1.03, decode=1.01, busy=0.96)
    dg = D.diagnose(st, cpus=2)
    check_diagnosis(st, dg)
    assert dg["bound"] == "decode" and dg["bound_utilization"] == pytest.approx(0.96)


def hint(*, wait: float, busy: float, with_rate: float = 1000.0, without_rate: float = 5000.0,
         shard_wait_s: float = 5e-05, batches: int = 40, workers: int = 2, cpus: int = 2) -> str:
    return D.transform_hint(wait_fraction=wait, workers_busy=busy, workers=workers, cpus=cpus, executor="threads",
                            with_rate=with_rate, without_rate=without_rate, shard_wait_s=shard_wait_s, wall_s=2.0,
                            batches=batches)


def test_the_transform_verdict_follows_from_its_figures() -> None:
    # The issue: the consumer waited 98% and the verdict said it rarely waits.
    assert not hint(wait=0.98, busy=0.0).startswith("enough")
    assert hint(wait=0.02, busy=0.3).startswith("enough: the consumer waited only 2% of the time")
    # The issue: "reading, not the transform, limits (see shard_wait_s)" with shard_wait_s 5e-05 s
    # while reading alone ran 5x faster than with the transform.
    idle = hint(wait=0.95, busy=0.43, batches=8)
    assert "reading limits" not in idle and "shard_wait_s" not in idle
    assert idle.startswith("neither the transform nor reading binds") and "5.0x this rate" in idle
    assert "only 8 batches measured" in idle
    # Reading alone hardly faster: reading limits, with the figure that shows it.
    reading = hint(wait=0.95, busy=0.43, without_rate=1100.0)
    assert reading.startswith("reading limits, not the transform") and "1.10x" in reading
    assert "opening shards" not in reading  # 5e-05 s of 2 s: not named
    assert "opening shards" in hint(wait=0.95, busy=0.43, without_rate=1100.0, shard_wait_s=0.5)
    # Busy workers: the transform binds, more workers only below the CPU count.
    assert hint(wait=0.9, busy=0.9, workers=2, cpus=4).startswith("more workers would help")
    assert hint(wait=0.9, busy=0.9).startswith("the transform binds")


def test_the_transform_figures_are_summed_over_the_timed_epochs_without_a_swap() -> None:
    from pyloader.bench import stages as R

    def epoch(executor: str, busy: float, wait: float, samples: int = 2000) -> dict[str, Any]:
        return {"transform_executor": executor, "transformed_samples": samples, "skipped_samples": 0,
                "transform_s": 0.0, "decode_s": samples * 700e-6, "transform_busy_fraction": busy,
                "wait_fraction": wait, "transform_per_sample_us": 0.0, "executor_choice": None}

    # The stage: an epoch of 8 batches in which executor="auto" moved to processes; the
    # new part had barely run, so that epoch's busy share (0%) and cost per sample (0 us) were its
    # alone, beside the whole epoch's wait (98%). That epoch is left out; the others are summed.
    st = R._transform_figures([(epoch("threads", 0.7, 0.9), 0.0), (epoch("processes", 0.0, 0.98), 1.5),
                               (epoch("processes", 0.9, 0.95), 1.0), (epoch("processes", 0.96, 0.99), 1.0)], 256)
    assert st["measured"] == {"epochs": 2, "left_out": 1, "batches": 16, "samples": 4000, "wall_s": 2.0}
    assert st["workers_busy"] == pytest.approx(0.93) and st["wait_fraction"] == pytest.approx(0.97)
    assert st["per_sample_us"] == pytest.approx(700.0) and st["executor"] == "processes"


def test_the_pack_verdict_follows_from_its_shares_and_prices_greedy() -> None:
    def verdict(busy: float, starved: float, *, greedy: float | None = None, mode: str = "first_fit") -> str:
        return D.pack_verdict(busy=busy, starved=starved, wait_fraction=0.8, mode=mode, padding=0.013,
                              greedy_padding=greedy, threads=2, cpus=2)

    # The issue: "building rows 43% of the time" beside "its thread builds rows most of the time".
    v = verdict(0.43, 0.2)
    assert not v.startswith("packer") and "most of the time" in v and "built rows 43%" in v and "greedy" not in v
    # Building rows most of the time: greedy is advised with the padding it costs, measured.
    v = verdict(0.62, 0.1, greedy=0.195)
    assert v.startswith("packer: the packer thread built rows 62%")
    assert "greedy padded 19.5% of row tokens on these documents against 1.3% here" in v
    assert "padding" not in verdict(0.62, 0.1, greedy=0.013).split("greedy")[0]
    assert verdict(0.2, 0.7).startswith("documents: ")
    assert "greedy is already" in verdict(0.7, 0.1, mode="greedy")
    assert D.pack_verdict(busy=0.9, starved=0.0, wait_fraction=0.3, mode="first_fit", padding=0.01,
                          greedy_padding=None, threads=2, cpus=2).startswith("consumer: it waited only 30%")


def search(noise: float, seed: int, repeats: int = 3) -> dict[str, Any]:
    """The AU search over a machine whose AU falls as 142.5 / n past 100 accelerators (0.9 is
    crossed at 158.3), each trial off by up to ``noise`` (uniform), as the load of the moment moves it."""
    rng = np.random.default_rng(seed)

    def measure(n: int) -> dict[str, float]:
        base = min(1.0, 142.5 / n) if n > 100 else 1.0
        return {"au": min(1.0, base * (1 + rng.uniform(-noise, noise)))}

    return A.max_accelerators(measure, threshold=0.9, cap=1024, budget_s=1e9, progress=lambda m: None, label="t",
                              repeats=repeats)


def test_the_au_maximum_carries_its_range_and_runs_agree_within_it() -> None:
    # The issue: single trials moved the maximum from run to run (162, 149, 169, 158), each
    # printed as one exact count. Twenty runs over a machine whose trials scatter by 6%:
    runs = [search(0.06, seed) for seed in range(20)]
    for r in runs:
        lo, hi = r["range"]
        assert lo <= r["max_accelerators"] <= hi and not r["capped"]
        assert r["fails_at"] is None or r["fails_at"] > r["max_accelerators"]
        # The counts around the boundary were measured again, each AU the median of its trials.
        near = [t for t in r["trials"] if abs(t["accelerators"] - r["max_accelerators"]) <= 0.12 * r["max_accelerators"]]
        assert sum(len(t["au_trials"]) == 3 for t in near) >= 5, near
        for t in r["trials"]:
            assert t["au"] == pytest.approx(float(np.median(t["au_trials"])))
        assert bench_cli._au_count(r).startswith(f"{r['max_accelerators']} ({lo} to {hi} ")
    # The true crossing lies inside nearly every run's range, and every two runs' ranges overlap.
    assert sum(r["range"][0] <= 158 <= r["range"][1] for r in runs) >= 18
    assert all(max(a["range"][0], b["range"][0]) <= min(a["range"][1], b["range"][1]) for a in runs for b in runs)
    # The maximum moves less from run to run than one trial per count let it.
    single = [search(0.06, seed, repeats=1)["max_accelerators"] for seed in range(20)]
    assert np.std([r["max_accelerators"] for r in runs]) < np.std(single)
    # Without noise the runs agree exactly.
    exact = {tuple(search(0.0, seed)["range"]) + (search(0.0, seed)["max_accelerators"],) for seed in range(3)}
    assert len(exact) == 1


def test_one_trial_that_dips_does_not_end_the_search() -> None:
    # The runs on a loaded 2-core machine: AU about 95% up to 64 accelerators, but now and then
    # one trial dips 15% (0.76 at 65 beside 0.90 and 0.97); one such dip at 4 ended the doubling
    # there ("4" in one run, "32" and "18" in others).
    dips = {4: [0.78], 16: [0.80]}

    def measure(n: int) -> dict[str, float]:
        au = dips[n].pop() if dips.get(n) else (0.95 if n <= 64 else 0.95 * 64 / n)
        return {"au": au}

    r = A.max_accelerators(measure, threshold=0.9, cap=1024, budget_s=1e9, progress=lambda m: None, label="t")
    # AU crosses 0.9 at 0.95 * 64 / 0.9 = 67.6 accelerators.
    assert r["max_accelerators"] == 67 and r["range"][0] <= 67 < 68 <= r["range"][1], r["range"]
    four = next(t for t in r["trials"] if t["accelerators"] == 4)
    assert four["au_trials"] == [0.78, 0.95, 0.95] and four["au"] == 0.95


# -- one real run --------------------------------------------------------------------------
SMALL = ["--records", "1024", "--batch-size", "32", "--threads", "2", "--epochs", "1", "--min-seconds", "0.2",
         "--torch-workers", "0", "--pack", "512", "--pack-rows", "4",
         "--workload", "custom", "--record-bytes", "2048", "--au-batch-size", "8", "--compute-time", "0.004",
         "--au-records", "256", "--au-seconds", "0.1", "--au-budget", "8", "--json", "--quiet"]

TRANSFORM = '''
def augment(sample):
    x = sample["image"]
    return {"image": x.flip(-1), "label": sample["label"]}
'''


@pytest.mark.timeout(400)
def test_a_runs_figures_agree_with_each_other(tmp_path, capsys) -> None:
    (tmp_path / "usertr.py").write_text(TRANSFORM)
    res = subprocess.run([sys.executable, "-m", "pyloader", "bench", *SMALL, "--transform", "usertr:augment"],
                         capture_output=True, text=True, timeout=380, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    check_diagnosis(r["stages"], r["diagnosis"])

    t = r["transform"]
    m = t["measured"]
    # Measured over enough batches, in the epochs the rate was timed in.
    # (an epoch in which executor="auto" swapped executors is left out: its busy share is half known)
    assert (m["batches"] >= D.MIN_BATCHES or m["left_out"] == 1) and m["samples"] > 0 and m["wall_s"] > 0
    assert t["per_sample_us"] > 0 and 0 < t["workers_busy"] <= 1.0 and 0 <= t["wait_fraction"] <= 1.0
    # No faster than the transform's own cost allows on its workers (each sample took per_sample_us).
    assert t["with_transform"]["samples_per_s"] <= 1.2 * t["limit_samples_per_s"]
    h = t["hint"]
    assert h.startswith("enough") == (t["wait_fraction"] < D.RARELY_WAITS), (h, t["wait_fraction"])
    if h.startswith(("more workers", "the transform binds")):
        assert t["workers_busy"] >= D.BUSY_AT
    if "reading limits" in h:
        assert t["without_transform"]["samples_per_s"] <= D.READING_AT * t["with_transform"]["samples_per_s"]

    p = r["packing"]
    v = p["bound"]
    if v.startswith("packer"):
        assert p["packer_busy"] > 0.5
    if v.startswith("documents"):
        assert p["packer_waiting"] > 0.5
    if "pads more" in v:
        assert f"{100 * p['greedy_padding_fraction']:.1f}%" in v and f"{100 * p['padding_fraction']:.1f}%" in v
    assert f"built rows {100 * p['packer_busy']:.0f}%" in v or v.startswith("consumer")

    au = r["accelerator_utilization"]
    # No memory cap on the count: the accelerators share one loader, whose read-ahead memory bounds.
    assert au["shared_loader"] is True and au["cap_reason"] == "ceiling"
    for key in ("pyloader", "torch_dataloader"):
        s = au[key]
        lo, hi = s["range"]
        assert lo <= s["max_accelerators"] <= hi
        assert not s["capped"] or s["stopped_by"] == "time"
        for t in s["trials"]:
            assert t["au"] == pytest.approx(float(np.median(t["au_trials"])))
            assert t["prefetch"] >= min(t["accelerators"], au["memory_batches"]) or key == "torch_dataloader"

    bench_cli._print_bench(r)
    out = capsys.readouterr().out
    assert out.count("pyloader / torch DataLoader with the transform:") == 1
    assert out.count("pyloader / torch DataLoader:") == 1
    line = next(x for x in out.splitlines() if "max accelerators at AU" in x)
    for key in ("pyloader", "torch_dataloader"):
        s = au[key]
        if not s["capped"] and s["range"][0] < s["range"][1]:
            assert f"{s['max_accelerators']} ({s['range'][0]} to {s['range'][1]} " in line, line
