"""A shard whose cache name takes all of a file name's 255 bytes can be fetched (NOTE [cache paths]).

Its download lock (``<name>.lock``) would be 260 bytes: ENAMETOOLONG on every run. Real
files on a loopback server, under Hive-style folders whose quoted form is long.
"""

from __future__ import annotations

import json
import os

import pytest
from remote_util import N_RECORDS, labels

import pyloader
import pyloader._C as _C
from pyloader.format.spec import dump_manifest
from pyloader.remote.cache import shard_cache_name
from pyloader.remote.names import lock_file_name


def long_path(target: int) -> str:
    """A shard path whose cache name (quoted, a dot, 16 hex digits) is ``target`` bytes."""
    stem = "year=2024/month=01/day=01/region=eu-west/source=crawl/"
    name = "part-" + "x" * 400
    for cut in range(len(name), 0, -1):
        path = stem + name[:cut] + ".pyl"
        if len(shard_cache_name(path, "0" * 16)) == target:
            return path
    raise AssertionError(target)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", [251, 255])
def test_a_255_byte_cache_name_is_fetched(srv_root, server, cache_dir, target):
    ds_dir = os.path.join(srv_root, "ds")
    with open(os.path.join(ds_dir, "manifest.json")) as f:
        framed = json.load(f)
    body = framed["manifest"]
    first = body["shards"][0]
    path = long_path(target)
    os.makedirs(os.path.join(ds_dir, os.path.dirname(path)), exist_ok=True)
    os.rename(os.path.join(ds_dir, first["path"]), os.path.join(ds_dir, path))
    first["path"] = path
    with open(os.path.join(ds_dir, "manifest.json"), "wb") as f:
        f.write(dump_manifest(body, _C.xxh64))
    name = shard_cache_name(path, first["xxh64"])
    assert len(name) == target and len(lock_file_name(name)) <= 255
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir)
    assert labels(ds) == list(range(N_RECORDS))
    assert any(name in files for _, _, files in os.walk(cache_dir))  # published under its full name
