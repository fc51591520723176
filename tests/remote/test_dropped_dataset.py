"""A remote dataset its caller does not keep: ``for b in ShardDataset(url).batches(n)``.

The stream alone holds the dataset; collected mid-epoch, the dataset's finaliser would cancel
the downloads the stream reads ("... cancelled"). Each batch here is followed by a garbage
collection, over a server slow enough that downloads are in flight.
"""

from __future__ import annotations

import gc

import pytest
from remote_util import N_RECORDS

import pyloader


@pytest.mark.timeout(120)
def test_a_stream_keeps_its_dataset(server, cache_dir):
    server.bandwidth = 200e3
    got: list[int] = []
    for b in pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir).batches(32):
        got += [int(x) for x in b["label"]]
        gc.collect()
    assert got == list(range(N_RECORDS))


@pytest.mark.timeout(120)
def test_a_stream_keeps_its_mixture_and_sources(server, cache_dir):
    server.bandwidth = 200e3
    got: list[int] = []
    mix = pyloader.Mixture([pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir)], weights=[1.0])
    it = mix.batches(32)
    del mix
    for b in it:
        got += [int(x) for x in b["label"]]
        gc.collect()
    assert sorted(got) == list(range(N_RECORDS))


@pytest.mark.timeout(120)
def test_a_loader_keeps_its_dataset(server, cache_dir):
    server.bandwidth = 200e3
    got: list[int] = []
    for b in pyloader.DataLoader(pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir), batch_size=32):
        got += [int(x) for x in b["label"]]
        gc.collect()
    assert got == list(range(N_RECORDS))
