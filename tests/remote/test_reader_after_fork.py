"""A new remote reader in a process whose dataset torch's forked workers read, one of them killed.

The parent's fsspec filesystem (its event loop, its pooled connections) and the native
transport's handles were copied into each worker; a worker that exits, or is killed in the
middle of a download, must leave the parent able to open the same URL again at once: the
new reader's manifest request and downloads wait on no connection a fork broke and no lock
a dead worker held. Bound: the new reader's time in a fresh cache is at most what the first
reader took plus twice the stall timeout (the fixture's 1 s).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from remote_servers import FaultServer
from remote_util import write_ds

import pyloader

STALL_S = 1.0  # conftest's fast_retries: PYLOADER_FETCH_STALL_TIMEOUT
N = 3000


def labels_of(batch: dict) -> list[int]:
    return [int(x) for x in batch["label"]]


def collate(samples: list[dict]) -> dict:
    # Plain ints: no tensor crosses from a worker (torch would pass its storage as a file
    # descriptor, and a worker killed in the middle of that handing over is torch's own race).
    return {"label": [int(s["label"]) for s in samples]}


def read_new(url: str, cache: str) -> tuple[float, list[int]]:
    t = time.monotonic()
    ds = pyloader.ShardDataset(url, cache_dir=cache)
    got = sorted(x for b in pyloader.DataLoader(ds, batch_size=64) for x in labels_of(b))
    return time.monotonic() - t, got


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kill", [False, True], ids=["workers-exit", "a-worker-killed"])
def test_a_new_reader_after_torch_workers_proceeds_at_once(tmp_path, kill):
    import torch

    root = str(tmp_path / "srv")
    write_ds(os.path.join(root, "ds"), n=N)
    with FaultServer(root, max_life=150) as srv:
        url = f"{srv.url}/ds"
        # The process's first reader: what opening and reading the dataset costs here, unforked.
        first, got = read_new(url, str(tmp_path / "c0"))
        assert got == list(range(N))
        srv.bandwidth = 50e3 if kill else 1e12  # slow enough that a worker dies mid-download
        ds = pyloader.ShardDataset(url, cache_dir=str(tmp_path / "c1"))
        loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=2, collate_fn=collate)
        seen: list[int] = []
        it = iter(loader)
        for b in it:
            seen += b["label"]
            if kill:
                os.kill(it._workers[0].pid, signal.SIGKILL)  # noqa: SLF001 - the worker torch started
                break
        if kill:
            with pytest.raises(RuntimeError, match="DataLoader worker"):
                for b in it:
                    seen += b["label"]
            del it
        else:
            assert sorted(seen) == list(range(N))
        srv.bandwidth = 1e12
        for cache in ("c1", "c2"):  # the cache the workers used (a dead one's lock, temps), and a new one
            took, got = read_new(url, str(tmp_path / cache))
            assert got == list(range(N)), cache
            assert took < first + 2 * STALL_S, f"{cache}: the new reader took {took:.1f} s (the first {first:.1f} s)"
