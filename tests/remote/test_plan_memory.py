"""A manifest cannot make a reader allocate more than the machine holds (NOTE [plan memory]).

A few hundred bytes of manifest claiming 2^36 records, served by a real loopback server:
the first plan raises PlanMemoryError naming the dataset and the numbers, before any shard
is fetched, whether the dataset is read by pyloader's loader or by torch's.
"""

from __future__ import annotations

import json
import os

import pytest
import torch.utils.data

import pyloader
import pyloader._C as _C
from pyloader.format.spec import dump_manifest


@pytest.mark.timeout(60)
def test_a_manifest_claiming_2_36_records_is_refused_before_a_fetch(srv_root, server, cache_dir):
    ds_dir = os.path.join(srv_root, "ds")
    with open(os.path.join(ds_dir, "manifest.json")) as f:
        body = json.load(f)["manifest"]
    first = dict(body["shards"][0], records=1 << 36, bytes=1 << 39)
    body = dict(body, shards=[first], records=1 << 36)
    with open(os.path.join(ds_dir, "manifest.json"), "wb") as f:
        f.write(dump_manifest(body, _C.xxh64))
    assert os.path.getsize(os.path.join(ds_dir, "manifest.json")) < 1000
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir, rank=0, world_size=1)
    assert ds.num_records == 1 << 36
    with pytest.raises(pyloader.PlanMemoryError, match=r"68719476736 records.*GiB per rank") as ei:
        next(iter(pyloader.DataLoader(ds, batch_size=4)))
    assert isinstance(ei.value, MemoryError) and server.url in str(ei.value)
    with pytest.raises(pyloader.PlanMemoryError):
        next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert server.shard_gets() == {}  # nothing but the manifest was asked for
