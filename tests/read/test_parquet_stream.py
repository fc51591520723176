"""A remote ParquetDataset streams through a cache far smaller than the data (NOTE [pending files]).

Parquet files served by a loopback HTTP server started here; every batch is compared with
the same files read locally, the cache directory's size is sampled while the reader runs,
and resume, corrupt files and a second epoch are checked on the stream.
"""

from __future__ import annotations

import functools
import http.server
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from convert_util import mixed_table, pq

import pyloader
from pyloader.bench.measure import CachePeak
from pyloader.errors import CacheLimitError
from pyloader.read.parquet import ParquetReadError

COLUMNS = ["id", "vec", "tokens", "text"]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYLOADER_FETCH_ATTEMPTS", "2")
    monkeypatch.setenv("PYLOADER_FETCH_BACKOFF", "0.01")
    monkeypatch.setenv("PYLOADER_FETCH_DEADLINE", "20")
    monkeypatch.delenv("PYLOADER_CACHE_DIR", raising=False)


@pytest.fixture
def www(tmp_path) -> Iterator[tuple[str, str]]:
    """(root folder, its URL) of a ThreadingHTTPServer on 127.0.0.1."""
    root = tmp_path / "www"
    root.mkdir()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield str(root), f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)


def _write(folder: str, files: int, rows: int, group: int) -> int:
    """``files`` Parquet files of ``rows`` rows in row groups of ``group``; returns their bytes in all."""
    os.makedirs(folder)
    for k in range(files):
        pq.write_table(mixed_table(rows, start=k * rows).select(COLUMNS), os.path.join(folder, f"part-{k:03d}.parquet"),
                       row_group_size=group)
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "window-shuffle"])
def test_two_epochs_stream_through_an_eighth_of_the_data(www, tmp_path, shuffle):
    root, url = www
    # In order: files of 4 row groups; shuffled, files of one row group each, as the
    # plan orders row groups (a file of several would be held across the epoch).
    files, rows, group = (24, 160, 40) if not shuffle else (64, 40, 40)
    total = _write(os.path.join(root, "data"), files, rows, group)
    limit = total // 8
    kw: dict[str, Any] = dict(columns=COLUMNS, shuffle=shuffle, window=80, seed=3)
    cache = str(tmp_path / "cache")
    ds = pyloader.ParquetDataset(url + "/data/", cache_dir=cache, cache_limit=limit, fetch_jobs=3, **kw)
    local = pyloader.ParquetDataset(os.path.join(root, "data"), **kw)
    with CachePeak(cache) as usage:
        for epoch in range(2):
            it = ds.batches(16, epoch=epoch, num_threads=2, prefetch=2)
            want = list(local.batches(16, epoch=epoch))
            n = 0
            for got, ref in zip(it, want, strict=True):
                _same(got, ref)
                n += int(got["id"].numel())
            assert n == files * rows
            stats = it.stats()
            assert stats["cache_peak_held_bytes"] <= stats["cache_budget_bytes"] == limit
            assert stats["files_unloaded"] > 0  # released files made room for later ones
            assert 0 < stats["cache_working_set_bytes"] <= limit
    assert usage.samples > 10
    assert usage.peak <= limit, (usage.peak, limit)  # published and in-flight bytes together
    assert ds._fetcher.downloaded > files  # the second epoch fetched again what was evicted


@pytest.mark.timeout(180)
def test_a_shuffled_epoch_of_files_of_many_row_groups_streams_through_an_eighth(www, tmp_path):
    root, url = www
    # 32 files of 8 row groups: a window shuffles files, then the row groups within each
    # (NOTE [window size]), so a file is held only while a window overlaps it.
    files, rows, group = 32, 320, 40
    total = _write(os.path.join(root, "data"), files, rows, group)
    limit = total // 8
    kw: dict[str, Any] = dict(columns=COLUMNS, shuffle=True, window=40, seed=5)
    cache = str(tmp_path / "cache")
    ds = pyloader.ParquetDataset(url + "/data/", cache_dir=cache, cache_limit=limit, fetch_jobs=3, **kw)
    local = pyloader.ParquetDataset(os.path.join(root, "data"), **kw)
    orders = []
    with CachePeak(cache) as usage:
        for epoch in range(2):
            it = ds.batches(16, epoch=epoch, num_threads=2, prefetch=2)
            got = []
            for b, ref in zip(it, local.batches(16, epoch=epoch), strict=True):
                _same(b, ref)
                got += b["id"].tolist()
            assert sorted(got) == list(range(files * rows))  # every row once
            orders.append(got)
            stats = it.stats()
            assert stats["cache_peak_held_bytes"] <= stats["cache_budget_bytes"] == limit
            assert 0 < stats["cache_working_set_bytes"] <= limit
            assert stats["files_unloaded"] > 0
    assert usage.samples > 10
    assert usage.peak <= limit, (usage.peak, limit)
    assert orders[0] != orders[1]
    # Shuffled: neither files in path order nor row groups in file order.
    first = [i // rows for i in orders[0]]
    assert sorted(set(first[: rows // 2])) != [0] and orders[0][:group] != list(range(group))


@pytest.mark.timeout(180)
def test_a_cache_that_holds_two_files_of_sixteen_streams_a_shuffled_epoch_without_read_ahead(www, tmp_path):
    # See NOTE [tight cache]: 16 files of 8 row groups through 1/8 of them (two files' worth):
    # at each file boundary the read-ahead would hold two neighbours at once, more than the
    # limit when they are larger than the mean; the reader waits for the release instead.
    root, url = www
    files, rows, group = 16, 320, 40
    total = _write(os.path.join(root, "data"), files, rows, group)
    limit = total // 8
    kw: dict[str, Any] = dict(columns=COLUMNS, shuffle=True, window=40, seed=9)
    cache = str(tmp_path / "cache")
    ds = pyloader.ParquetDataset(url + "/data/", cache_dir=cache, cache_limit=limit, fetch_jobs=3, **kw)
    local = pyloader.ParquetDataset(os.path.join(root, "data"), **kw)
    with CachePeak(cache) as usage:
        it = ds.batches(16, epoch=0, num_threads=2, prefetch=2)
        assert ds._fetcher.strict  # the read-ahead does not fit: this is the tight case
        got = []
        for b, ref in zip(it, local.batches(16, epoch=0), strict=True):
            _same(b, ref)
            got += b["id"].tolist()
        stats = it.stats()
    assert sorted(got) == list(range(files * rows))  # every row once
    assert stats["cache_peak_held_bytes"] <= stats["cache_budget_bytes"] == limit, stats
    assert usage.peak <= limit, (usage.peak, limit)  # published and in-flight bytes together
    assert stats["files_unloaded"] >= files - 2, stats


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["window", "global"])
def test_a_working_set_above_the_cache_limit_is_refused_up_front(www, tmp_path, mode):
    root, url = www
    total = _write(os.path.join(root, "data"), 24, 160, 40)
    # A window of 800 rows spans 6 files; a global shuffle holds every file across the epoch.
    fix = "a smaller window (now 800 rows" if mode == "window" else "shuffle_mode='window'"
    with pytest.raises(CacheLimitError, match=fix.replace("(", r"\(")) as e:
        ds = pyloader.ParquetDataset(url + "/data/", columns=COLUMNS, shuffle=True, shuffle_mode=mode, window=800,
                                     cache_dir=str(tmp_path / "c"), cache_limit=total // 8)
        ds.batches(16)
    assert url in str(e.value) and "cache_limit >=" in str(e.value)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stop", [3, 17, 150])
@pytest.mark.parametrize("shape", ["in-order", "window-shuffle", "shuffled-row-groups"])
def test_resume_mid_epoch_while_streaming_gives_exactly_the_rest(www, tmp_path, stop, shape):
    root, url = www
    shuffle = shape != "in-order"
    # Shuffled files of one row group each, or of 8 (shuffled within each file, NOTE [window size]).
    files, rows, group = {"in-order": (24, 160, 40), "window-shuffle": (64, 60, 60),
                          "shuffled-row-groups": (32, 480, 60)}[shape]
    total = _write(os.path.join(root, "data"), files, rows, group)
    kw: dict[str, Any] = dict(columns=["id", "tokens"], shuffle=shuffle, window=60, seed=1,
                              cache_limit=total // 8, fetch_jobs=2)

    def loader(cache: str) -> pyloader.DataLoader:
        ds = pyloader.ParquetDataset(url + "/data/", cache_dir=cache, **kw)
        return pyloader.DataLoader(ds, batch_size=8, num_workers=2, prefetch=4)

    want = [b["id"].tolist() for b in loader(str(tmp_path / "c0"))]
    first = loader(str(tmp_path / "c1"))
    it = iter(first)
    got = [next(it)["id"].tolist() for _ in range(stop)]
    state = first.state_dict()
    del it, first
    again = loader(str(tmp_path / "c2"))  # a fresh node: nothing cached
    again.load_state_dict(state)
    got += [b["id"].tolist() for b in again]
    assert got == want
    assert sorted(i for b in got for i in b) == list(range(files * rows))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_remote_file_raises_naming_its_url(www, tmp_path, damage):
    root, url = www
    total = _write(os.path.join(root, "data"), 24, 160, 40)
    ds = pyloader.ParquetDataset(url + "/data/", columns=COLUMNS, cache_dir=str(tmp_path / "c"),
                                 cache_limit=total // 8)
    victim = os.path.join(root, "data", "part-009.parquet")  # damaged on the server after the footers were read
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        if damage == "garbage":
            f.write(np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes())
        else:
            f.truncate(size // 2)
    seen: list[int] = []
    with pytest.raises(ParquetReadError) as e:
        for b in ds.batches(16):
            seen.extend(b["id"].tolist())
    assert f"{url}/data/part-009.parquet" in str(e.value)
    # ... and the one action that fixes it.
    fix = "replace it with a valid Parquet file" if damage == "garbage" else "changed since; open the ParquetDataset again"
    assert fix in str(e.value), str(e.value)
    assert seen == list(range(len(seen))) and len(seen) <= 9 * 160  # the files before it were read whole, in order


@pytest.mark.timeout(120)
def test_an_iterator_closed_early_releases_its_files(www, tmp_path):
    root, url = www
    total = _write(os.path.join(root, "data"), 24, 160, 40)
    ds = pyloader.ParquetDataset(url + "/data/", columns=["id"], cache_dir=str(tmp_path / "c"),
                                 cache_limit=total // 8)
    it = ds.batches(16, prefetch=4)
    for _ in range(5):
        next(it)
    it.close()
    ds._fetcher.wait(30)
    deadline = time.monotonic() + 10
    while ds._pending.counts()["idle"] != ds._pending.counts()["ready"] and time.monotonic() < deadline:
        time.sleep(0.01)
    counts = ds._pending.counts()
    assert counts["ready"] and counts["idle"] == counts["ready"]  # nothing it planned is held for it
    # A later epoch still reads everything.
    assert [int(x) for b in ds.batches(16, epoch=1) for x in b["id"]] == list(range(24 * 160))


@pytest.mark.timeout(180)
def test_torch_dataloader_workers_stream_each_through_their_share(www, tmp_path):
    root, url = www
    total = _write(os.path.join(root, "data"), 24, 160, 40)
    cache = str(tmp_path / "c")
    limit = total // 3  # each of the two workers streams through a sixth of the data
    ds = pyloader.ParquetDataset(url + "/data/", columns=["id"], cache_dir=cache, cache_limit=limit)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    with CachePeak(cache) as usage:
        got = sorted(int(s["id"]) for s in loader)
    assert got == list(range(24 * 160))
    assert usage.peak <= limit, (usage.peak, limit)
