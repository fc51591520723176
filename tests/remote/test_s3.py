"""Remote datasets on an S3-compatible server (moto, on loopback) through s3fs."""

from __future__ import annotations

import os

import pytest
from remote_servers import S3Server
from remote_util import N_RECORDS, labels

import pyloader
from pyloader.remote.bad_copies import verify_entry
from pyloader.remote.cli import EXIT_OK, main

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")


@pytest.fixture
def s3(srv_root):
    import boto3
    import s3fs

    srv = S3Server(max_life=120).start()
    try:
        boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket="bucket")
        fs = s3fs.S3FileSystem(**srv.storage_options())
        src = os.path.join(srv_root, "ds")
        for name in sorted(os.listdir(src)):
            fs.put_file(os.path.join(src, name), f"bucket/ds/{name}")
        yield srv
    finally:
        srv.stop()


@pytest.mark.timeout(90)
def test_s3_dataset_reads_through_the_cache(s3, cache_dir):
    ds = pyloader.ShardDataset("s3://bucket/ds", cache_dir=cache_dir, storage_options=s3.storage_options(),
                               shuffle=True)
    assert labels(ds) == list(range(N_RECORDS))
    d = ds._remote
    assert all(d.is_published(i) for i in range(len(ds.shard_paths)))
    assert all(verify_entry(d, e) is None for e in d.entries())


@pytest.mark.timeout(90)
def test_s3_missing_object_fails_at_once(s3, cache_dir):
    import s3fs

    fs = s3fs.S3FileSystem(**s3.storage_options())
    fs.rm("bucket/ds/shard-000002.pyl")
    ds = pyloader.ShardDataset("s3://bucket/ds", cache_dir=cache_dir, storage_options=s3.storage_options())
    with pytest.raises(pyloader.ShardIOError, match=r"s3://bucket/ds/shard-000002.pyl.*permanent"):
        labels(ds)


@pytest.mark.timeout(90)
def test_s3_cli_warm(s3, cache_dir, capsys):
    import json

    opts = s3.storage_options()
    code = main(["cache", "warm", "s3://bucket/ds", "--cache-dir", cache_dir, "--json",
                 "--storage-options", json.dumps(opts)])
    r = json.loads(capsys.readouterr().out)
    assert code == EXIT_OK and r["downloaded"] == 16 and r["failed"] == []
