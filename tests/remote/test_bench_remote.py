"""`pyloader bench URL` on a remote dataset: the fetch stage goes through the node cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_bench_remote_url_fetches_each_shard_once(server, cache_dir) -> None:
    url = server.url + "/ds"
    cmd = [sys.executable, "-m", "pyloader", "bench", url, "--cache-dir", cache_dir, "--epochs", "1",
           "--torch-workers", "0", "--workload", "none", "--json", "--quiet"]
    env = {**os.environ}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    fetch = r["stages"]["remote_fetch"]
    n = r["dataset"]["shards"]
    assert fetch["shards_downloaded"] == n and fetch["shards_cached"] == 0
    assert fetch["bytes"] == r["dataset"]["bytes"]
    assert fetch["transport"] == "native" and fetch["jobs"] >= 4 and fetch["cpu_s_per_gb"] > 0
    shard_gets = {k: v for k, v in server.gets.items() if k.endswith(".pyl")}
    assert len(shard_gets) == n and all(v == 1 for v in shard_gets.values()), shard_gets
    # A second run finds everything in the cache and downloads nothing.
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr
    fetch = json.loads(res.stdout)["stages"]["remote_fetch"]
    assert fetch["shards_downloaded"] == 0 and fetch["shards_cached"] == n
    assert all(v == 1 for k, v in server.gets.items() if k.endswith(".pyl"))
