"""A download whose bytes cannot be written locally is the cache's failure, not the server's.

A file-size limit (``RLIMIT_FSIZE``, SIGXFSZ ignored: writes fail with EFBIG) in a child
process, on a filesystem without ``posix_fallocate`` (stood in for by making it answer
EOPNOTSUPP, as some network filesystems do), so the failure comes from the download's
own writes. Both transports: the reader's error says the cache could not be written and
names it (the cache's ``CacheError``, as a reader of a shard that failed to arrive gets
it: a ``ShardIOError``), not a download failure; the request is sent once (a write
failure is not retried) and no temp file is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from remote_util import child_env, temp_files

import pyloader._C as _C

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = """
import errno, json, os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
def no_fallocate(fd, offset, length):
    raise OSError(errno.EOPNOTSUPP, "Operation not supported")
os.posix_fallocate = no_fallocate
import pyloader
url, cache = sys.argv[1:3]
ds = pyloader.ShardDataset(url, cache_dir=cache)
resource.setrlimit(resource.RLIMIT_FSIZE, (1500, 1500))
try:
    for _ in ds.batches(16):
        pass
    print(json.dumps({"error": None}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "cache_error": isinstance(e, pyloader.CacheError),
                      "fetch_error": isinstance(e, pyloader.FetchError), "message": str(e)}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["native", "fsspec"])
def test_a_write_that_fails_locally_is_a_cache_error(srv_root, server, cache_dir, transport):
    if transport == "native" and not _C.http_available()[0]:
        pytest.skip("no libcurl.so.4 here")
    env = dict(child_env(ROOT), PYLOADER_TRANSPORT=transport)
    r = subprocess.run([sys.executable, "-c", _CHILD, server.url + "/ds", cache_dir], capture_output=True,
                       text=True, env=env, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"] == "ShardIOError" and not out["fetch_error"], out
    assert f"cannot write to cache {cache_dir}: File too large" in out["message"], out
    assert "attempt" not in out["message"] and "permanent" not in out["message"], out
    shards = server.shard_gets()
    assert shards and max(shards.values()) == 1  # not retried
    assert temp_files(cache_dir) == []
