"""A DataLoader over a remote dataset, forked while its shards download.

NOTE [loader across fork] in pyloader/loader/dataloader.py: at each of several delays into a
first epoch (every shard still to fetch, a fresh cache each time, a server that answers
slowly), the process forks; the child reads two whole epochs of the same loader (its own
shard set and fetcher: the parent's threads do not exist there) and the parent finishes
its epoch. Neither may hang; both read every label in plan order.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from remote_servers import FaultServer
from remote_util import N_RECORDS

import pyloader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "native"))
from native_util import run_in_forked_child  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


def labels_of(batch: Any) -> list[int]:
    return [int(x) for x in batch["label"]]


@pytest.mark.timeout(240)
def test_fork_while_downloads_are_in_flight(srv_root, tmp_path) -> None:
    with FaultServer(srv_root, latency=0.01, max_life=200) as srv:
        for round_, d in enumerate([0.0, 2.0, 10.0, 40.0]):
            ds = pyloader.ShardDataset(f"{srv.url}/ds", cache_dir=str(tmp_path / f"cache{round_}"), fetch_jobs=4)
            loader = pyloader.DataLoader(ds, batch_size=32, num_workers=2)
            it = iter(loader)
            seen = labels_of(next(it))
            time.sleep(d / 1000)

            def child(step: Callable[[str], None], loader: Any = loader) -> int:
                for epoch in range(2):
                    step(f"epoch {epoch}")
                    got = [x for b in loader for x in labels_of(b)]
                    if got != list(range(N_RECORDS)):
                        step(f"read {len(got)} labels: {got[:20]}...")
                        return 10 + epoch
                step("done")
                return 0

            forked = run_in_forked_child(child, str(tmp_path / f"child{round_}.log"), timeout=60)
            assert forked.code is not None, f"delay {d} ms: the child hung; its steps:\n{forked.log}"
            assert forked.code == 0, f"delay {d} ms: the child failed ({forked.code}); its steps:\n{forked.log}"
            seen += [x for b in it for x in labels_of(b)]
            assert seen == list(range(N_RECORDS)), f"delay {d} ms: the parent's epoch after the fork"
            del it, loader, ds
