"""A local dataset whose shard files are gone or cut short: found when it is opened, each message with its fix.

Issue 40 item 14: a missing shard was found only when the epoch reached it (after 832 of
2,000 samples), and a truncated shard's message named no fix. The constructor now lists
the folder of the shard files the manifest names (one listing, no per-file call) and fails
on one that is gone; a shard cut short, or gone after the dataset was opened, is named with
its fix when the reader opens it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import pyloader

N = 2000


@pytest.fixture
def dataset(tmp_path) -> str:
    d = str(tmp_path / "ds")
    with pyloader.ShardWriter(d, {"x": ("uint8", (64,)), "label": ("int64", ())}, shard_bytes=16 << 10,
                              compression=None) as w:
        for i in range(N):
            w.write({"x": np.full(64, i % 251, np.uint8), "label": i})
    return d


def test_a_missing_shard_is_found_when_the_dataset_is_opened(dataset):
    paths = pyloader.ShardDataset(dataset).shard_paths
    assert len(paths) >= 4
    victim = paths[len(paths) // 2]
    os.unlink(victim)
    with pytest.raises(pyloader.ShardNotFoundError) as ei:
        pyloader.ShardDataset(dataset)
    e = ei.value
    assert e.shard == victim and victim in str(e) and os.path.join(dataset, "manifest.json") in str(e), str(e)
    assert "its file is gone" in str(e) and "copy the dataset folder again whole, or write it again" in str(e)


def test_a_truncated_shard_names_the_fix(dataset):
    victim = pyloader.ShardDataset(dataset).shard_paths[1]
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(pyloader.ShardFormatError) as ei:
        for _ in pyloader.ShardDataset(dataset).batches(64):
            pass
    msg = str(ei.value)
    assert ei.value.shard == victim and f"file is {size // 2} bytes but the manifest says {size}" in msg, msg
    assert f"replace {os.path.basename(victim)!r} with a good copy, or write the dataset again" in msg, msg


def test_a_shard_truncated_after_opening_names_the_fix_when_read(dataset):
    ds = pyloader.ShardDataset(dataset)
    victim = ds.shard_paths[1]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    with pytest.raises(pyloader.ShardFormatError) as ei:
        for _ in ds.batches(64):
            pass
    msg = str(ei.value)
    assert victim in msg and "truncated" in msg and "with a good copy, or write the dataset again" in msg, msg


def test_fetch_jobs_resolves_on_first_use_and_takes_a_new_value(dataset) -> None:
    """``fetch_jobs`` is resolved when first read (a local dataset loads no fetcher for it), and
    can still be set afterwards, checked as the constructor's argument is."""
    ds = pyloader.ShardDataset(dataset, fetch_jobs=5)
    assert ds.fetch_jobs == 5
    ds.fetch_jobs = 3
    assert ds.fetch_jobs == 3
    ds.fetch_jobs = "auto"
    assert isinstance(ds.fetch_jobs, int) and ds.fetch_jobs >= 1
    with pytest.raises(ValueError, match="fetch_jobs must be 'auto' or a positive int, got 0"):
        ds.fetch_jobs = 0
    assert ds.fetch_jobs >= 1  # unchanged by the refused value
