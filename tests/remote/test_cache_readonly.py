"""A cache that cannot be written: the commands and the constructor say so, naming it and the fix (issue 40).

Item 11: ``cache clear`` / ``cache evict`` on a read-only cache reported every shard "in
use" while ``cache stats`` said none was. Item 12: a ``cache_dir`` that cannot be created
passed the constructor and failed at the first batch, naming an internal subfolder.
The read-only filesystem is a read-only bind mount (as root), else a folder without write
permission; the dataset is served by a loopback server.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
from collections.abc import Iterator

import pytest
from remote_util import labels

import pyloader
from pyloader.errors import EXIT_CACHE, EXIT_OK, CacheError
from pyloader.remote.cli import main

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def read_only(path: str) -> Iterator[str]:
    """``path`` made read-only for this process: "filesystem" (a read-only bind mount, as root) or "permissions"."""
    if os.geteuid() == 0:
        subprocess.run(["mount", "--bind", path, path], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", path, path], check=True)
        undo, how = ["umount", "-l", path], "filesystem"
    else:
        subprocess.run(["chmod", "-R", "a-w", path], check=True)
        undo, how = ["chmod", "-R", "u+w", path], "permissions"
    try:
        yield how
    finally:
        gc.collect()
        subprocess.run(undo, check=True)


@pytest.mark.parametrize("command", [["clear"], ["evict", "--to", "0"]])
def test_clear_and_evict_on_a_read_only_cache_name_it_not_shards_in_use(server, tmp_path, capsys, command):
    cache = str(tmp_path / "rocache")
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache)
    labels(ds)
    del ds
    gc.collect()
    with read_only(cache) as how:
        assert main(["cache", "stats", "--cache-dir", cache, "--json"]) == EXIT_OK
        capsys.readouterr()
        code = main(["cache", *command, "--cache-dir", cache])
        err = capsys.readouterr().err
    assert code == EXIT_CACHE, err
    assert "in use" not in err and cache in err, err
    assert ("read-only filesystem" if how == "filesystem" else "not writable by this user") in err, err
    assert err.startswith(f"pyloader cache {command[0]}: error: "), err


def test_a_cache_dir_that_cannot_be_created_fails_at_construction(server, tmp_path):
    parent = str(tmp_path / "ro")
    os.makedirs(parent)
    cache = os.path.join(parent, "cache")
    with read_only(parent):
        with pytest.raises(CacheError) as ei:
            pyloader.ShardDataset(server.url + "/ds", cache_dir=cache)
    msg = str(ei.value)
    assert f"cannot create {cache} " in msg and "cache_dir=" in msg and "PYLOADER_CACHE_DIR" in msg, msg
    assert "/v1" not in msg and "shard" not in msg, msg
    assert server.shard_gets() == {}  # nothing was downloaded, nor tried
