"""``pyloader cache``: warm (idempotent, resumable, per node), ls, stats, verify, evict, clear."""

from __future__ import annotations

import json
import os

import pytest
from remote_util import N_RECORDS, labels

import pyloader
from pyloader.read import order as _plan
from pyloader.remote.cli import EXIT_CACHE, EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, main
from pyloader.remote.fetch import first_touch_order


def run(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["cache", *argv])
    out = capsys.readouterr().out
    return code, (json.loads(out) if "--json" in argv else {"text": out})


@pytest.mark.timeout(60)
def test_warm_is_idempotent_and_resumable(server, cache_dir, capsys):
    url = server.url + "/ds"
    code, r = run(capsys, "warm", url, "--cache-dir", cache_dir, "--jobs", "3", "--json")
    assert code == EXIT_OK and r["selected_shards"] == 16 and r["downloaded"] == 16 and r["failed"] == []
    code, r = run(capsys, "warm", url, "--cache-dir", cache_dir, "--json")
    assert code == EXIT_OK and r["downloaded"] == 0 and r["cached_before"] == 16
    assert set(server.shard_gets().values()) == {1}
    # Resumable: evict some, warm fetches only those.
    code, r = run(capsys, "evict", "--cache-dir", cache_dir, "--to", "40K", "--json")
    assert code == EXIT_OK and r["evicted"] > 0 and r["bytes_left"] <= 40 * 1024
    n = r["evicted"]
    code, r = run(capsys, "warm", url, "--cache-dir", cache_dir, "--json")
    assert code == EXIT_OK and r["downloaded"] == n
    # A reader of the warm cache downloads nothing.
    before = sum(server.shard_gets().values())
    assert labels(pyloader.ShardDataset(url, cache_dir=cache_dir)) == list(range(N_RECORDS))
    assert sum(server.shard_gets().values()) == before


@pytest.mark.timeout(60)
def test_warm_per_node_selects_what_its_ranks_read(server, cache_dir, capsys):
    url = server.url + "/ds"
    code, r = run(capsys, "warm", url, "--cache-dir", cache_dir, "--nodes", "2", "--node-rank", "1",
                  "--ranks-per-node", "2", "--epoch", "3", "--seed", "5", "--shuffle", "--shuffle-mode", "window",
                  "--window", "40", "--json")
    assert code == EXIT_OK
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir, shuffle=True, seed=5, shuffle_mode="window", window=40)
    want = set()
    for rank in (2, 3):
        sidx, _ = _plan.plan(ds.records_per_shard, shuffle=True, seed=5, epoch=3, rank=rank, world_size=4,
                             worker=0, num_workers=1, shuffle_mode="window", window=40, partition="pad")
        want |= set(first_touch_order(sidx))
    assert 0 < len(want) < 16 and r["selected_shards"] == len(want) == r["downloaded"]
    got = {p.rsplit("/", 1)[1] for p in server.shard_gets()}
    assert got == {ds.manifest["shards"][i]["path"] for i in want}


@pytest.mark.timeout(60)
def test_ls_stats_verify_evict_clear(server, cache_dir, capsys):
    url = server.url + "/ds"
    assert run(capsys, "warm", url, "--cache-dir", cache_dir)[0] == EXIT_OK
    code, r = run(capsys, "ls", "--cache-dir", cache_dir, "--json")
    assert code == EXIT_OK and len(r["datasets"]) == 1
    row = r["datasets"][0]
    assert row["url"] == url and row["shards_cached"] == row["shards_total"] == 16
    code, r = run(capsys, "stats", "--cache-dir", cache_dir, "--json")
    assert code == EXIT_OK and r["shards"] == 16 and r["pinned_shards"] == 0 and r["temp_files"] == 0
    # Corrupt one cached file in place: verify finds it, removes it, says so in its exit code.
    shards_dir = os.path.join(cache_dir, "v1", row["key"], "shards")
    victim = os.path.join(shards_dir, sorted(os.listdir(shards_dir))[4])
    with open(victim, "r+b") as f:
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 1]))
    code, r = run(capsys, "verify", "--cache-dir", cache_dir, "--json")
    assert code == EXIT_PARTIAL and r["checked"] == 16 and len(r["bad"]) == 1 and r["bad"][0]["file"] == victim
    assert not os.path.exists(victim)
    assert run(capsys, "verify", "--cache-dir", cache_dir, "--json")[0] == EXIT_OK
    # A live reader pins its shards: evict and clear keep them and say so.
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir)
    assert labels(ds) == list(range(N_RECORDS))
    code, r = run(capsys, "evict", "--cache-dir", cache_dir, "--json")
    assert code == EXIT_PARTIAL and r["evicted"] == 0 and r["in_use_skipped"] == 16
    code, r = run(capsys, "clear", "--cache-dir", cache_dir, "--json")
    assert code == EXIT_PARTIAL and r["in_use_kept"] == 16
    assert labels(ds) == list(range(N_RECORDS))  # still readable
    ds._fetcher.close()  # drop the pins
    code, r = run(capsys, "clear", "--cache-dir", cache_dir, "--json")
    assert code == EXIT_OK and r["in_use_kept"] == 0
    assert os.listdir(os.path.join(cache_dir, "v1")) == ["space.lock"]


@pytest.mark.timeout(60)
def test_exit_codes_for_bad_input_and_small_limits(server, cache_dir, capsys):
    assert main(["cache", "warm", server.url + "/missing", "--cache-dir", cache_dir]) == EXIT_USAGE
    assert "missing/manifest.json" in capsys.readouterr().err
    assert main(["cache", "warm", "/local/path", "--cache-dir", cache_dir]) == EXIT_USAGE
    assert main(["cache", "warm", server.url + "/ds", "--cache-dir", cache_dir, "--limit", "10K"]) == EXIT_CACHE
    assert "--limit" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ei:
        main(["cache", "warm", server.url + "/ds", "--jobs", "0"])
    assert ei.value.code == 2


@pytest.mark.timeout(60)
def test_warm_reports_failed_shards(server, cache_dir, capsys):
    from remote_servers import Fault

    server.inject("ds/shard-000007.pyl", Fault("status", status=404, times=None))
    code, r = run(capsys, "warm", server.url + "/ds", "--cache-dir", cache_dir, "--json")
    assert code == EXIT_PARTIAL and r["downloaded"] == 15
    assert len(r["failed"]) == 1 and r["failed"][0]["url"].endswith("ds/shard-000007.pyl")


@pytest.mark.timeout(60)
def test_progress_bar(server, cache_dir, capsys):
    assert main(["cache", "warm", server.url + "/ds", "--cache-dir", cache_dir, "--progress"]) == EXIT_OK
    err = capsys.readouterr().err
    assert "16/16 shards" in err and "/s" in err and "ETA" in err
