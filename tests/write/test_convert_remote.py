"""pyloader.convert straight to object storage: an S3-compatible server (moto) on loopback, and memory://.

NOTE [remote publish] in pyloader/write/store.py: one PUT per shard, the manifest last;
``--verify`` fetches the remote shards back and compares every record with the source.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import pyloader
from pyloader.write import cli as CLI

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "remote"))
from remote_servers import S3Server  # noqa: E402


@pytest.fixture(scope="module")
def s3():
    import boto3

    srv = S3Server(max_life=240).start()
    try:
        boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket="bucket")
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def s3fs_of(s3):
    import s3fs

    return s3fs.S3FileSystem(**s3.storage_options())


def write_corpus(root, files=2, rows=800, row_group=100):
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(3)
    for f in range(files):
        toks = [rng.integers(0, 1000, int(rng.integers(0, 64))).astype(np.int32) for _ in range(rows)]
        pq.write_table(pa.table({"tokens": pa.array(toks, pa.list_(pa.int32())),
                                 "id": pa.array(np.arange(f * rows, (f + 1) * rows, dtype=np.int64))}),
                       os.path.join(root, f"part-{f}.parquet"), row_group_size=row_group)
    return root


def records(ds):
    return [(s["tokens"].numpy().tobytes(), int(s["id"])) for s in ds]


def listing(fs, prefix):
    return sorted(os.path.basename(p) for p in fs.ls(prefix, detail=False, refresh=True))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("jobs", [1, 2])
def test_convert_to_s3_then_read_back(tmp_path, s3, s3fs_of, jobs):
    src = write_corpus(str(tmp_path / "src"))
    local = pyloader.convert(src, str(tmp_path / "local"), shard_size="8K")
    url = f"s3://bucket/single-{jobs}"
    # A shard a killed run left at the URL: gone after this run (NOTE [convert leftovers]).
    s3fs_of.pipe_file(f"bucket/single-{jobs}/shard-00042-000000.pyl", b"stale")
    res = pyloader.convert(src, url, shard_size="8K", jobs=jobs, storage_options=s3.storage_options(), verify=True)
    assert res.path == url and res.records == 1600 and res.verified["records"] == 1600
    ds = pyloader.ShardDataset(url, storage_options=s3.storage_options(), cache_dir=str(tmp_path / "cache"))
    assert records(ds) == records(pyloader.ShardDataset(str(tmp_path / "local")))
    assert listing(s3fs_of, f"bucket/single-{jobs}") == sorted(
        [os.path.basename(n) for n in ds.shard_paths] + ["convert.json", "manifest.json"])
    if jobs == 1:  # the same encoder, the same shards: byte for byte the local dataset
        for n in os.listdir(tmp_path / "local"):
            if n.endswith(".pyl"):
                assert s3fs_of.cat_file(f"bucket/single-1/{n}") == (tmp_path / "local" / n).read_bytes()
    assert local.records == res.records


@pytest.mark.timeout(90)
def test_dask_convert_to_s3_and_cli_verify(tmp_path, s3, s3fs_of):
    distributed = pytest.importorskip("distributed")
    src = write_corpus(str(tmp_path / "src"), files=3)
    url = "s3://bucket/dask"
    opts = s3.storage_options()
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  scheduler_kwargs={"dashboard_address": ":0"}) as lc, \
            distributed.Client(lc) as client:
        res = pyloader.convert(src, url, shard_size="8K", task_size="8K", engine="dask", scheduler=client,
                               storage_options=opts, verify=True)
    assert res.tasks >= 8 and res.records == 2400 and res.verified["records"] == 2400
    ds = pyloader.ShardDataset(url, storage_options=opts, cache_dir=str(tmp_path / "cache"))
    assert [r[1] for r in records(ds)] == list(range(2400))
    assert CLI.main(["convert", src, url, "--verify-only", "--storage-options", json.dumps(opts)]) == 0
    # A shard changed after the manifest was written: --verify-only names it.
    first = sorted(p for p in s3fs_of.ls("bucket/dask", detail=False, refresh=True) if p.endswith(".pyl"))[0]
    data = bytearray(s3fs_of.cat_file(first))
    data[-1] ^= 0xFF
    s3fs_of.pipe_file(first, bytes(data))
    assert CLI.main(["convert", src, url, "--verify-only", "--storage-options", json.dumps(opts)]) == 5


@pytest.mark.timeout(60)
def test_convert_to_memory_url(tmp_path):
    import fsspec

    arrays = {"x": np.arange(3000, dtype=np.int32).reshape(1000, 3), "y": np.arange(1000, dtype=np.int64)}
    url = "memory://convert-test/ds"
    res = pyloader.convert(arrays, url, shard_size="4K", verify=True)
    fs = fsspec.filesystem("memory")
    names = sorted(os.path.basename(p) for p in fs.ls("/convert-test/ds", detail=False))
    assert res.shards > 1 and names[:2] == ["convert.json", "manifest.json"] and len(names) == res.shards + 2
    with pytest.raises(FileExistsError, match="overwrite"):
        pyloader.convert(arrays, url)
    # memory:// lives in this process: worker processes cannot write there.
    with pytest.raises(ValueError, match="memory://"):
        pyloader.convert(arrays, "memory://convert-test/other", jobs=2)
    fs.rm("/convert-test", recursive=True)
