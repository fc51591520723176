"""`pyloader bench`'s CPU time counts every thread and child process, live workers included
(issue 27, item 5; NOTE [CPU of live children] in pyloader/bench/measure.py).

Real worker processes burn a known amount of CPU time and add what they burned (by their own
clock) to a shared counter; the bench's figure must hold it. CPU time, not wall time, so a
loaded machine moves none of these figures much."""

from __future__ import annotations

import multiprocessing
import resource
import time
from typing import Any

import numpy as np
import pytest
import torch

import pyloader
from pyloader.bench import measure as B
from pyloader.bench import stages as R

BURN_S = 0.004  # CPU seconds each sample costs its worker


def burn(seconds: float) -> float:
    """Spins until this process has used ``seconds`` more CPU time; returns what it used."""
    t0 = time.process_time()
    while time.process_time() - t0 < seconds:
        pass
    return time.process_time() - t0


class BurnDataset(torch.utils.data.Dataset):
    """Each sample costs its worker BURN_S of CPU time, added to ``counter`` (shared with the test)."""

    def __init__(self, n: int, counter: Any) -> None:
        self.n, self.counter = n, counter

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        used = burn(BURN_S)
        with self.counter.get_lock():
            self.counter.value += used
        return torch.tensor([i])


def _children_rusage() -> float:
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return c.ru_utime + c.ru_stime


def _persistent_loader(n: int, counter: Any) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(BurnDataset(n, counter), batch_size=10, num_workers=2,
                                       persistent_workers=True, prefetch_factor=2)


@pytest.mark.timeout(300)
def test_live_persistent_torch_workers_are_counted() -> None:
    assert B.cpu_accounting() in ("proc", "psutil")  # this test's machine can read live children
    counter = multiprocessing.Value("d", 0.0)
    loader = _persistent_loader(100, counter)
    for _ in loader:  # the first epoch starts the workers, outside the timed block
        pass
    workers = loader._iterator._workers
    before, exited_before = counter.value, _children_rusage()
    with B.CpuTimer() as t:
        for _ in range(2):
            for _ in loader:
                pass
    burned = counter.value - before  # the workers' CPU time in the block, by their own clock
    assert burned >= 2 * 100 * BURN_S * 0.99
    assert all(w.is_alive() for w in workers)  # persistent: nothing exited, nothing reaped
    assert _children_rusage() - exited_before < 0.05 * burned  # RUSAGE_CHILDREN alone would read ~0
    assert burned * 0.9 <= t.cpu_children <= burned * 1.5 + 0.3, (t.cpu_children, burned)
    assert t.cpu == pytest.approx(t.cpu_self + t.cpu_children)
    del loader


@pytest.mark.timeout(300)
def test_the_bench_figure_of_torch_with_persistent_workers_holds_their_cpu() -> None:
    counter = multiprocessing.Value("d", 0.0)
    r = R._measure_loader(lambda: _persistent_loader(60, counter), rounds=1, batch_size=10, min_seconds=0.01)
    timed = r["epochs"] * 60 * BURN_S  # the least the workers burned in the timed round
    assert r["cpu_s"] >= 0.9 * timed, (r["cpu_s"], timed)
    assert r["cpu_s"] <= counter.value * 1.5 + 0.5  # no more than everything they ever burned, and some


def burn_sample(sample: dict[str, Any]) -> dict[str, Any]:
    burn(BURN_S)
    return sample


@pytest.mark.timeout(300)
def test_pyloader_transform_processes_are_counted(tmp_path) -> None:
    path = str(tmp_path / "ds")
    with pyloader.ShardWriter(path, {"x": ("int64", ())}) as w:
        for i in range(60):
            w.write({"x": np.int64(i)})
    r = R._measure_loader(lambda: pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=10, num_workers=2,
                                                      transform=burn_sample, executor="processes"),
                          rounds=1, batch_size=10, min_seconds=0.01)
    timed = r["epochs"] * 60 * BURN_S
    assert r["cpu_s"] >= 0.9 * timed, (r["cpu_s"], timed)


def _burn_wait_burn(ready: Any, go: Any) -> None:
    burn(0.3)
    ready.set()
    go.wait()
    burn(0.2)


@pytest.mark.timeout(120)
def test_a_child_that_exits_inside_the_block_counts_only_its_time_in_it() -> None:
    """Alive at the start, waited for before the end: RUSAGE_CHILDREN then holds all its 0.5 s,
    of which 0.3 s were spent before the block."""
    ctx = multiprocessing.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_burn_wait_burn, args=(ready, go))
    p.start()
    assert ready.wait(60)
    with B.CpuTimer() as t:
        go.set()
        p.join(60)
    assert p.exitcode == 0
    assert 0.18 <= t.cpu_children <= 0.3, t.cpu_children
