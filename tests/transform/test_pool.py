"""The process executor's worker pool across epochs (NOTE [transform pool]), with real worker processes."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from worker_util import alive, assert_nothing_left, slot_files, wait_gone

import pyloader

FIELDS = {"x": ("float32", (4,)), "label": "int64"}
N = 160
BATCH = 8


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("pool") / "ds")
    with pyloader.ShardWriter(d, FIELDS, shard_bytes=2048) as w:
        for i in range(N):
            w.write({"x": np.full(4, i, np.float32), "label": i})
    return d


def with_pid(s: dict[str, Any], ctx: pyloader.SampleContext) -> dict[str, Any]:
    """The sample, who made it, and a draw that changes with the epoch (a stale result would show)."""
    time.sleep(0.001)
    return {"label": s["label"], "x": s["x"] * 2, "pid": os.getpid(), "r": ctx.random.random()}


def loader(path: str, **kw: Any) -> pyloader.DataLoader:
    ds = pyloader.ShardDataset(path, shuffle=True, seed=11)
    kw.setdefault("batch_size", BATCH)
    kw.setdefault("num_workers", 2)
    kw.setdefault("executor", "processes")
    return pyloader.DataLoader(ds, transform=with_pid, **kw)


def take(batches: Any) -> tuple[list[int], list[float], set[int]]:
    """(labels, draws, worker pids) of batches, checking each value; drops every batch as it goes."""
    labels: list[int] = []
    draws: list[float] = []
    pids: set[int] = set()
    for b in batches:
        assert torch.equal(b["x"], b["label"].to(torch.float32)[:, None].expand(-1, 4) * 2)
        labels += b["label"].tolist()
        draws += b["r"].tolist()
        pids |= set(b["pid"].tolist())
    return labels, draws, pids


def reference(path: str, epochs: int) -> list[tuple[list[int], list[float]]]:
    """What each epoch must yield: the same loader on threads (NOTE [sample seeds])."""
    ld = loader(path, executor="threads", persistent_workers=False)
    out = []
    for _ in range(epochs):
        labels, draws, _ = take(ld)
        out.append((labels, draws))
    return out


@pytest.mark.timeout(120)
def test_persistent_workers_serve_every_epoch_and_go_with_the_loader(shards) -> None:
    want = reference(shards, 3)
    ld = loader(shards, persistent_workers=True)
    seen = []
    for e in range(3):
        labels, draws, pids = take(ld)
        assert (labels, draws) == want[e], e
        seen.append(pids)
    assert len(seen[0]) == 2 and seen[0] == seen[1] == seen[2]
    assert all(os.getppid() != p and alive(p) for p in seen[0])
    del ld
    assert_nothing_left(seen[0])


@pytest.mark.timeout(120)
def test_without_persistent_workers_each_epoch_has_its_own(shards) -> None:
    ld = loader(shards, persistent_workers=False)
    first = take(ld)[2]
    assert not wait_gone(first)  # the epoch's stream shut its pool down
    second = take(ld)[2]
    assert len(first) == len(second) == 2 and not first & second
    assert not wait_gone(second)
    assert not slot_files()


@pytest.mark.timeout(120)
def test_each_epochs_pool_takes_the_last_ones_slots_and_spares_a_batch_still_held(shards) -> None:
    # See NOTE [slots across pools]: with persistent_workers=False every epoch has new workers;
    # they write into the slots the last epoch's workers made (no new shared memory), except
    # one whose batch the loop still holds.
    want = reference(shards, 3)
    ld = loader(shards, persistent_workers=False)
    labels, draws, pids = take(ld)
    assert (labels, draws) == want[0]
    reserve = ld._slot_reserve
    first = {k: id(m) for k, (_, m) in reserve.maps.items()}
    assert len(first) >= 2, first  # (slots of both workers)
    it = iter(ld)
    held = next(it)  # a batch of epoch 1 kept across the rest of it and all of epoch 2
    copy = {k: v.clone() for k, v in held.items()}
    rest = take(it)
    assert (take([held])[0] + rest[0], take([held])[1] + rest[1]) == want[1]
    later = take(ld)
    assert later[:2] == want[2] and not later[2] & rest[2] and not rest[2] & pids  # new workers each epoch
    for k in copy:
        assert torch.equal(held[k], copy[k]), k  # its slot was not written while it was held
    again = {k: id(m) for k, (_, m) in ld._slot_reserve.maps.items()}
    # Every mapping of epoch 1 still serves (a new slot file at the same place would replace it).
    assert {k: v for k, v in again.items() if k in first} == first, (first, again)
    assert not slot_files()


@pytest.mark.timeout(120)
def test_an_epoch_left_early_leaks_nothing_into_the_next(shards) -> None:
    want = reference(shards, 3)
    ld = loader(shards, persistent_workers=True)
    head = []
    for b in ld:  # the iterator is dropped at the break: its job ends with results in flight
        head.append(b)
        if len(head) == 2:
            break
    del b
    assert take(head)[:2] == (want[0][0][:2 * BATCH], want[0][1][:2 * BATCH])
    del head
    pids = set()
    for e in (1, 2):  # epochs 1 and 2: the first was left (break) with results in flight
        labels, draws, p = take(ld)
        assert labels == want[e][0] and draws == want[e][1], e
        assert sorted(labels) == list(range(N))
        pids |= p
    assert len(pids) == 2  # one pool all along
    del ld
    assert_nothing_left(pids)


@pytest.mark.timeout(120)
def test_a_persistent_worker_killed_between_epochs(shards) -> None:
    want = reference(shards, 3)
    ld = loader(shards, persistent_workers=True)
    labels, draws, pids = take(ld)
    assert (labels, draws) == want[0]
    victim = max(pids)
    os.kill(victim, signal.SIGKILL)
    assert not wait_gone({victim})
    time.sleep(0.5)  # (as a loop that evaluates between epochs would: the death is long over)
    # Either the next epoch reports the death (TransformWorkerError naming the worker)...
    try:
        labels, draws, p = take(ld)
    except pyloader.TransformWorkerError as e:
        assert e.pid == victim  # type: ignore[attr-defined]
    else:  # ...or it runs on a new pool, complete.
        assert (labels, draws) == want[1] and not p & pids
    # Then the epoch after that completes on new workers.
    labels, draws, p = take(ld)
    assert (labels, draws) == want[2]
    assert len(p) == 2 and not p & pids


@pytest.mark.timeout(120)
def test_two_live_iterators_of_one_persistent_loader(shards) -> None:
    ld = loader(shards, persistent_workers=True)
    it1 = iter(ld)
    b = next(it1)
    got1 = [b["label"].clone()]
    pids1 = set(b["pid"].tolist())
    del b
    it2 = iter(ld)  # the kept pool is it1's: it2 runs on a pool of its own
    got2 = []
    pids2 = set()
    for b1, b2 in zip(it1, it2):
        got1.append(b1["label"].clone())
        got2.append(b2["label"].clone())
        pids1 |= set(b1["pid"].tolist())
        pids2 |= set(b2["pid"].tolist())
    for b in it2:  # (it2 has one batch more: it1 gave one before the zip)
        got2.append(b["label"].clone())
        pids2 |= set(b["pid"].tolist())
    del b1, b2
    assert sorted(torch.cat(got1).tolist()) == list(range(N))
    assert sorted(torch.cat(got2).tolist()) == list(range(N))
    assert torch.cat(got1).tolist() != torch.cat(got2).tolist()  # epochs 0 and 1: two orders
    assert len(pids1) == len(pids2) == 2 and not pids1 & pids2
    assert take(ld)[2] == pids1  # the kept pool serves the next epoch
    del it1, it2, ld
    assert_nothing_left(pids1 | pids2)


@pytest.mark.timeout(120)
def test_a_forked_child_makes_its_own_pool(shards) -> None:
    want = reference(shards, 3)
    ld = loader(shards, persistent_workers=True)
    labels, draws, parent_pids = take(ld)
    assert (labels, draws) == want[0]
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (fork of a process with threads, Python >= 3.12)
        pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        code = 1
        try:
            signal.alarm(60)
            os.close(r)
            got, got_draws, kids = take(ld)
            ok = got == want[1][0] and got_draws == want[1][1] and len(kids) == 2 and not kids & parent_pids
            os.write(w, " ".join(str(k) for k in sorted(kids)).encode())
            del ld
            gc.collect()  # its own pool goes with its loader
            code = 0 if ok and not slot_files() else 3
        except BaseException:  # noqa: BLE001 - reported by the exit status
            code = 2
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + 90
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not finish within 90 s")
    child_pids = [int(k) for k in os.read(r, 4096).split()]
    os.close(r)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(child_pids) == 2 and not set(child_pids) & parent_pids
    # The parent's pool was not touched by the child: it serves the next epoch.
    labels, draws, pids = take(ld)
    assert (labels, draws) == want[1]  # (the child read its own epoch 1; the parent's is its own)
    assert pids == parent_pids
    del ld
    assert_nothing_left(parent_pids | set(child_pids))


@pytest.mark.timeout(60)
def test_a_consumer_may_hold_every_batch_of_an_epoch(tmp_path) -> None:
    d = str(tmp_path / "ds")
    with pyloader.ShardWriter(d, FIELDS, shard_bytes=2048) as w:
        for i in range(70):
            w.write({"x": np.full(4, i, np.float32), "label": i})
    ds = pyloader.ShardDataset(d)
    ld = pyloader.DataLoader(ds, batch_size=1, num_workers=1, executor="processes", timeout=3,
                             transform=lambda s: {"label": s["label"]})
    held = list(ld)  # 70 batches of the one worker, all alive at once
    assert [int(b["label"]) for b in held] == list(range(70))


_IMPORTER = '''
import os, sys
sys.path.insert(0, {here!r})
import pyloader

def transform(s):
    import warm_probe_mod  # imported on first use, as a transform's libraries often are
    return {{"label": s["label"], "importers": warm_probe_mod.count()}}

if __name__ == "__main__":
    ds = pyloader.ShardDataset({path!r}, shuffle=True, seed=3)
    ld = pyloader.DataLoader(ds, batch_size=8, num_workers=2, transform=transform)  # executor="auto"
    seen = []
    for epoch in range(3):
        seen.append(sum(int(b["label"].shape[0]) for b in ld))
        seen.append(ld.stats()["transform_executor"])
    print(seen, "warm_probe_mod" in sys.modules)
'''


@pytest.mark.timeout(120)
def test_the_next_epochs_workers_start_with_the_modules_earlier_workers_imported(shards, tmp_path) -> None:
    # See NOTE [warm imports]: a module the transform imports is imported once by each worker of
    # the first epoch, then once by the loader's process before it forks the next pool; the
    # workers of epochs 2 and 3 (persistent_workers=False: new processes) find it imported.
    log = tmp_path / "imports.log"
    (tmp_path / "warm_probe_mod.py").write_text(
        "import os\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        "def count():\n"
        f"    return len(open({str(log)!r}).read().split())\n")
    script = tmp_path / "run.py"
    script.write_text(_IMPORTER.format(here=str(tmp_path), path=shards))
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("True"), run.stdout
    assert f"[{N}, 'processes', {N}, 'processes', {N}, 'processes']" in run.stdout, run.stdout
    pids = log.read_text().split()
    # 2 workers of epoch 1 and the loader's process: 3 imports, not 2 more per epoch.
    assert len(pids) == 3 and len(set(pids)) == 3, pids


# A hook run before every fork of this test process (os.register_at_fork cannot be undone):
# while _FORKS has a "marker", the second fork waits (at most 10 s) for the file the first
# forked worker's transform makes on its first sample, and says whether it came.
_FORKS: dict[str, Any] = {}


def _before_fork() -> None:
    marker = _FORKS.get("marker")
    if marker is None:
        return
    _FORKS["forks"] += 1
    if _FORKS["forks"] == 2:
        deadline = time.monotonic() + 10.0
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.005)
        _FORKS["first_sample_before_second_fork"] = os.path.exists(marker)


os.register_at_fork(before=_before_fork)


class MarkFirstSample:
    """A transform that makes the file ``path`` on the first sample of any worker."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, s: dict[str, Any]) -> dict[str, Any]:
        if not os.path.exists(self.path):
            with open(self.path, "w"):
                pass
        return {"label": s["label"], "pid": os.getpid()}


def test_a_new_pools_workers_start_on_their_batches_as_they_are_forked(shards, tmp_path) -> None:
    # See NOTE [first job at fork]: the first worker makes its first sample while the loader's
    # process forks the second, with nothing sent to it: before, it waited for its job to
    # come through its pipe after every worker was forked.
    marker = str(tmp_path / "first-sample")
    ld = pyloader.DataLoader(pyloader.ShardDataset(shards, shuffle=True, seed=11), batch_size=BATCH, num_workers=2,
                             executor="processes", transform=MarkFirstSample(marker))
    for epoch in range(2):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(marker)
        _FORKS.update(marker=marker, forks=0, first_sample_before_second_fork=None)
        try:
            labels: list[int] = []
            pids: set[int] = set()
            for b in ld:
                labels += b["label"].tolist()
                pids |= set(b["pid"].tolist())
        finally:
            _FORKS.pop("marker")
        assert _FORKS["forks"] == 2, f"epoch {epoch}: {_FORKS['forks']} forks for a pool of 2 workers"
        assert _FORKS["first_sample_before_second_fork"] is True, (
            f"epoch {epoch}: the first worker had made no sample 10 s after it was forked, when the second was")
        assert sorted(labels) == list(range(N)) and len(pids) == 2, (epoch, len(labels), pids)
