"""benchmarks/sim_scale.py on a tiny job: its JSON holds pyloader's own plans, the manifest
rule, a state_dict measured on a real loader, and a throttling simulation whose real
``HostLimiter`` windows close and whose throughput stays at the store's limit; with shards
large enough for the native transport's ranged GETs, each download counts as that many
requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from pyloader.read import order
from pyloader.remote import transport

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "sim_scale.py")
TINY = ["--nodes", "4", "--ranks", "2", "--shards", "200", "--shard-bytes", "1MB", "--records-per-shard", "10",
        "--window", "64", "--batch-size", "16", "--threads", "1", "--sim-seconds", "6", "--rates", "100,5000",
        "--fetch-jobs", "64"]
S3_GET = 5500


def run_script(out: Any, *args: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, SCRIPT, *args, "--json", str(out)], capture_output=True, text=True,
                       env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "shard GETs per epoch" in p.stdout and "limits" in p.stdout
    data: dict[str, Any] = json.loads(out.read_text())
    return data


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_script(tmp_path_factory.mktemp("sim") / "scale.json", *TINY)


def _big() -> list[str]:
    big = [x if x != "1MB" else "100MB" for x in TINY]
    big[big.index("100,5000")] = "100000"
    big[big.index("--ranks") + 1] = "300"  # readers enough that one download each outruns the limit
    return big


@pytest.fixture(scope="module")
def ranged(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_script(tmp_path_factory.mktemp("sim") / "ranged.json", *_big())


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_script(tmp_path_factory.mktemp("sim") / "kept.json", *_big(), "--keep-ranges")


def test_manifest_once_per_node(result: dict[str, Any]) -> None:
    m = result["manifest"]
    assert m["gets_per_node"]["value"] == 1
    assert m["gets_total"]["value"] == 4
    assert m["gets_per_s_without_node_copy"]["value"] == pytest.approx(8 / 10.0)
    assert m["manifest_bytes"]["value"] > 200 * 50  # 200 entries, each naming a path, its size and checksum


def test_reads_are_pyloader_plans(result: dict[str, Any]) -> None:
    rd = result["reads"]
    world, n = 8, 200 * 10
    assert rd["samples_per_rank"] == -(-n // world)
    rps = np.full(200, 10, np.int64)
    for mode in ("window", "global"):
        first = rd[mode]["nodes"][0]
        node = first["node"]
        union: set[int] = set()
        for k, r in enumerate(range(node * 2, node * 2 + 2)):
            sidx, _ = order.plan(rps, shuffle=True, seed=0, epoch=0, rank=r, world_size=world, shuffle_mode=mode,
                                 window=64)
            assert first["shards_per_rank"][k] == np.unique(sidx).size
            union.update(np.unique(sidx).tolist())
        assert first["node_shards"] == len(union)
        assert rd[mode]["amplification"] >= 1.0
    # A global shuffle spreads a node's samples over many more shards than a window does.
    assert rd["global"]["node_shards"] > rd["window"]["node_shards"]


def test_state_is_small_and_resume_is_measured(result: dict[str, Any]) -> None:
    p = result["plan"]
    assert p["world_size"] == 8
    assert 0 < p["state_bytes"]["value"] < 1024
    assert p["state_bytes_two_segments"]["value"] > p["state_bytes"]["value"]
    assert len(p["state"]["segments"]) == 2
    assert p["resume_window"]["how"].startswith("measured")
    assert p["resume_window"]["samples"] > 0


def test_throttled_store_holds_throughput_at_its_limit(result: dict[str, Any]) -> None:
    s = result["sim"][0]
    assert s["prefixes"] == 1 and s["offered_gets_per_s"] > S3_GET
    assert sum(s["throttled_per_s"]) > 0
    assert s["window_mean"][-1] < 64  # the windows were cut from their ceiling
    assert 0.5 * S3_GET <= s["steady_ok_per_s"] <= 1.05 * S3_GET
    more = result["sim"][1]  # with enough prefixes nothing is throttled once the bucket holds
    assert more["prefixes"] > 1
    assert more["steady_ok_per_s"] > s["steady_ok_per_s"]


def test_limits_name_the_crossed_one(result: dict[str, Any]) -> None:
    crossed = [x["what"] for x in result["limits"] if x["crossed"]]
    assert any(w.startswith("shard GETs/s per prefix at 5000 MB/s") for w in crossed)


def test_ranged_downloads_count_every_get(result: dict[str, Any], ranged: dict[str, Any]) -> None:
    assert result["config"]["parts"] == 1  # 1 MB shards: one whole GET
    parts = len(transport._parts(100 * 10**6))
    assert parts > 1 and ranged["config"]["parts"] == parts
    row = ranged["rates"]["rows"][-1]
    assert row["window_gets_per_s"] == pytest.approx(parts * row["window_downloads_per_s"])
    s = ranged["sim"][0]
    assert s["gets_per_download"] == parts and s["offered_gets_per_s"] > S3_GET
    # Throttled, a reader's transport falls back to one GET per download
    # (See NOTE [transport choice]): the store's limit carries that many downloads again.
    assert s["readers_on_whole_gets_at_end"] > 0.9  # (a reader never throttled keeps its ranges)
    assert 0.5 * S3_GET <= s["steady_ok_per_s"] <= 1.05 * S3_GET


def test_ranges_kept_under_throttling_waste_the_store(kept: dict[str, Any]) -> None:
    s = kept["sim"][0]
    parts = kept["config"]["parts"]
    assert parts > 1 and s["readers_on_whole_gets_at_end"] == 0.0
    # The store answers its limit's worth of GETs, but a download with one throttled part is
    # retried whole: fewer downloads complete than the limit's GETs would carry.
    assert s["steady_wasted_requests_per_s"] > 0
    assert s["steady_ok_per_s"] * parts < S3_GET
