"""executor="auto" (NOTE [executor choice]), num_workers="auto" (NOTE [transform autotune]) and one
BLAS thread per worker (NOTE [worker threads]), on real threads and worker processes.

Timing decisions use transforms far from the thresholds: a pure-Python loop (no torch or
numpy inside: it holds the GIL all the time) against ``time.sleep`` (it holds it never).

A user's transform on 2 workers starts on forked processes at once where the shared-memory
directory has ``FORK_FIRST_ROOM`` free; the tests of the scaling probe (which runs where it
has less) ask for more room than any machine has (``probe_first``), a real condition of the
loader, not a stand-in for it.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np
import pytest
import torch

import pyloader
from pyloader.transform import auto as auto_mod
from pyloader.transform.auto import EARLY_COMPUTING
from pyloader.transform.pool import shm_dir

FIELDS = {"x": ("float32", (4,)), "label": "int64"}
N = 2000  # long enough for the scaling probe (4 phases of >= 0.1 s) to end in the first epoch
SHORT = 96  # 3 batches of 32: too short for the probe
BATCH = 32


def write(path: str, n: int) -> str:
    with pyloader.ShardWriter(path, FIELDS, shard_bytes=16384) as w:
        for i in range(n):
            w.write({"x": np.full(4, i, np.float32), "label": i})
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    return write(str(tmp_path_factory.mktemp("auto") / "ds"), N)


@pytest.fixture(scope="module")
def short_shards(tmp_path_factory) -> str:
    return write(str(tmp_path_factory.mktemp("auto_short") / "ds"), SHORT)


@pytest.fixture
def probe_first(monkeypatch) -> None:
    """No shared-memory directory has the room to start on processes at once: the scaling probe runs."""
    monkeypatch.setattr(auto_mod, "FORK_FIRST_ROOM", 1 << 62)


@pytest.fixture(params=["fork", "probe"])
def start(request) -> str:
    """How an epoch with its executor open starts: on forked processes at once, or the probe on threads."""
    if request.param == "probe":
        request.getfixturevalue("probe_first")
    return request.param


def _spin() -> int:
    acc = 0
    for k in range(12000):  # ~0.6 ms of pure Python: the GIL is held throughout
        acc += k * k % 7
    return acc


def gil_bound(s: dict[str, Any], ctx: pyloader.SampleContext) -> dict[str, Any]:
    """Holds the GIL; draws only from its context, so both executors give the same batches."""
    return {"label": s["label"], "x": s["x"] * 2, "r": ctx.random.random() + 0 * _spin(), "index": ctx.index}


def sleeping(s: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.001)  # holds no GIL while it waits
    return {"label": s["label"], "x": s["x"]}


_A = np.random.default_rng(0).standard_normal((192, 192)).astype(np.float32)


def part_gil(s: dict[str, Any]) -> dict[str, Any]:
    """Computes throughout, and holds the GIL a sixth of its time (matrix products release it)."""
    y = _A
    for _ in range(4):
        y = (y @ _A) * 0.01
    acc = 0
    for k in range(1000):
        acc += k * k % 7
    return {"label": s["label"], "x": s["x"] + 0 * acc + float(y[0, 0]) * 0}


def blas_threads(s: dict[str, Any]) -> dict[str, Any]:
    from threadpoolctl import threadpool_info

    n = max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")
    return {"label": s["label"], "blas": n}


def loader(path: str, **kw: Any) -> pyloader.DataLoader:
    ds = pyloader.ShardDataset(path, shuffle=True, seed=5)
    kw.setdefault("batch_size", BATCH)
    return pyloader.DataLoader(ds, **kw)


def epoch(ld: pyloader.DataLoader) -> list[dict[str, torch.Tensor]]:
    """One epoch's batches, copied (a process batch's tensors view a slot the worker reuses once dropped)."""
    return [{k: v.clone() for k, v in b.items()} for b in ld]


def until_chosen(ld: pyloader.DataLoader, epochs: int = 3) -> list[int]:
    """The first epoch's labels; more epochs (at most ``epochs``) while the probe has not decided (a loaded machine)."""
    first = [int(i) for b in ld for i in b["label"]]
    for _ in range(epochs - 1):
        if ld.stats()["executor_choice"].get("executor") is not None:
            break
        for _ in ld:
            pass
    return first


def assert_same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


@pytest.mark.timeout(120)
def test_a_gil_bound_transform_moves_to_processes_with_the_same_batches(shards, start: str) -> None:
    auto = loader(shards, transform=gil_bound, num_workers=2)
    first = epoch(auto)
    choice = auto.stats()["executor_choice"]
    assert choice["executor"] == "processes", choice
    if start == "fork":
        # On processes from its first batch; its workers measured that it computes.
        assert choice["computing"] > EARLY_COMPUTING and choice["threads_compared"] == [], choice
        assert "forked worker processes, which computed" in choice["why"], choice
        assert "transform_switched_at" not in auto.stats(), auto.stats()
    else:
        # A transform that computes goes to processes from the first 1-thread phase: the
        # scaling phases are skipped (NOTE [executor choice]).
        assert choice["computing"] > EARLY_COMPUTING and choice["threads_compared"] == [1], choice
        assert "computes" in choice["why"] and auto.stats()["transform_switched_at"] > 0, choice
    assert choice["gil_held"] is None, choice
    second = epoch(auto)
    st = auto.stats()
    assert st["transform_executor"] == "processes" and st["executor_choice"]["executor"] == "processes"
    threads = loader(shards, transform=gil_bound, num_workers=2, executor="threads")
    want = [epoch(threads), epoch(threads)]
    assert_same(first, want[0])
    assert_same(second, want[1])
    assert sorted(int(i) for b in first for i in b["label"]) == list(range(N))
    assert not torch.equal(first[0]["r"], second[0]["r"])  # another epoch, other draws


@pytest.mark.timeout(120)
def test_a_transform_that_computes_and_holds_the_gil_part_of_its_time_moves_to_processes(shards, start: str) -> None:
    ld = loader(shards, transform=part_gil, num_workers=2)
    labels = until_chosen(ld)
    choice = ld.stats()["executor_choice"]
    # Measured here: g 0.14-0.20 (2 threads made 1.67-1.76x the samples of one), computing 98-99%;
    # on threads before the rule for transforms that compute (it took g over 0.5); now decided
    # from the first 1-thread phase, as it computes (or kept on the processes it started on).
    assert choice["executor"] == "processes", choice
    assert choice["computing"] > EARLY_COMPUTING and "comput" in choice["why"], choice
    assert sorted(labels) == list(range(N))


@pytest.mark.timeout(120)
def test_a_transform_that_computes_reads_as_computing_on_a_machine_whose_cpus_are_busy(shards, start: str) -> None:
    # Processes spinning on every CPU: the probe's thread (or a worker process) gets a CPU a
    # fraction of its time. Its CPU time over its working time read as a transform that waits
    # (0.2-0.3 here); the time it waited for a CPU is not working time (NOTE [executor choice]).
    cpus = len(os.sched_getaffinity(0))
    hogs = [subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 60\nwhile time.time() < end: pass"])
            for _ in range(4 * cpus)]
    try:
        ld = loader(shards, transform=gil_bound, num_workers=2)
        it = iter(ld)
        for _ in it:
            if ld.stats()["executor_choice"].get("computing") is not None:
                break
        it.close()
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()
    choice = ld.stats()["executor_choice"]
    assert choice["executor"] == "processes" and choice["computing"] > EARLY_COMPUTING, choice


@pytest.mark.timeout(120)
def test_processes_are_not_chosen_where_shared_memory_has_no_room(shards, start: str) -> None:
    free = os.statvfs(shm_dir())
    huge = free.f_bavail * free.f_frsize + (1 << 30)

    def claims(samples: list[Any]) -> dict[str, torch.Tensor]:
        return {"label": torch.tensor([int(s["label"]) for s in samples]),
                "x": torch.zeros(1, dtype=torch.uint8).expand(huge)}  # a view: it claims, it does not use

    ld = loader(shards, transform=gil_bound, num_workers=2, collate_fn=claims)
    labels = until_chosen(ld)
    choice = ld.stats()["executor_choice"]
    assert choice["executor"] == "threads" and ld.stats()["transform_executor"] == "threads", choice
    if start == "probe":
        # processes, had there been room: for the GIL it holds (over GIL_HIGH), or as one that computes
        assert choice["computing"] > EARLY_COMPUTING, choice
        assert "computes" in choice["why"] or "threads wait for each other" in choice["why"], choice
    else:  # the first batch did not fit: the epoch went on from it on threads
        assert "did not fit" in choice["why"] and ld.stats()["transform_switched_at"] == 0, choice
    assert shm_dir() in choice["why"] and "PYLOADER_SHM_DIR" in choice["why"], choice
    assert sorted(labels) == list(range(N))


@pytest.mark.timeout(120)
def test_one_worker_stays_on_threads_even_for_a_gil_bound_transform(shards) -> None:
    ld = loader(shards, transform=gil_bound, num_workers=1)
    first = epoch(ld)
    choice = ld.stats()["executor_choice"]
    assert choice["executor"] == "threads" and "one worker" in choice["why"], choice
    assert choice["threads_compared"] == [1, 2] and "gil_held" in choice, choice  # (measured all the same)
    assert ld.stats()["transform_workers"] == 1  # back to the one worker after the probe's 2
    assert sorted(int(i) for b in first for i in b["label"]) == list(range(N))


@pytest.mark.timeout(60)
def test_a_sleeping_transform_goes_to_threads_after_its_first_epoch_on_processes(shards) -> None:
    ld = loader(shards, transform=sleeping, num_workers=2)
    first = epoch(ld)
    st = ld.stats()
    choice = st["executor_choice"]
    assert st["transform_executor"] == "processes" and "transform_switched_at" not in st, st
    assert choice["executor"] == "threads" and choice["computing"] < EARLY_COMPUTING, choice
    assert "waits" in choice["why"] and "threads from the next epoch" in choice["why"], choice
    assert [int(i) for b in first for i in b["label"]] == [int(i) for b in loader(shards, batch_size=BATCH)
                                                             for i in b["label"]]
    second = epoch(ld)  # threads now, with the choice kept
    st = ld.stats()
    assert st["transform_executor"] == "threads" and st["executor_choice"] == choice, st
    assert sorted(int(i) for b in second for i in b["label"]) == list(range(N))


@pytest.mark.timeout(60)
def test_an_epoch_too_short_for_the_workers_check_keeps_processes_pending(short_shards, shards) -> None:
    ld = loader(short_shards, transform=sleeping, num_workers=2)
    it = iter(ld)
    next(it)  # one batch: too little measured
    it.close()
    choice = ld.stats()["executor_choice"]
    assert choice["executor"] == "processes" and choice["computing"] is None, choice
    assert "checked over the first epoch" in choice["why"], choice
    assert len(epoch(ld)) == SHORT // BATCH  # the next epoch starts on processes again
    assert ld.stats()["transform_executor"] == "processes"


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("probe_first")
def test_a_sleeping_transform_stays_on_threads(shards) -> None:
    ld = loader(shards, transform=sleeping, num_workers=2)
    it = iter(ld)
    got = []
    for b in it:  # until the probe decides (~1000 samples; the epoch has 2000)
        got.append(b["label"].clone())
        choice = ld.stats()["executor_choice"]
        if choice.get("executor") is not None:
            break
    it.close()
    assert choice["executor"] == "threads", choice
    assert choice["gil_held"] < 0.5 and choice["scaling"] > 1.5, choice
    assert torch.cat(got).tolist() == [int(b) for b in torch.cat([b["label"] for b in epoch(
        loader(shards, batch_size=BATCH))])][:len(got) * BATCH]
    it = iter(ld)  # the next epoch starts on threads, with the choice kept
    next(it)
    st = ld.stats()
    it.close()
    assert st["transform_executor"] == "threads" and st["executor_choice"] == choice


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("probe_first")
def test_the_probe_compares_no_more_threads_than_cpus(shards) -> None:
    cpus = len(os.sched_getaffinity(0))
    ld = loader(shards, transform=sleeping, num_workers=cpus + 2)  # (one that computes skips the scaling)
    it = iter(ld)
    first = next(it)
    assert ld.stats()["transform_workers"] == 1  # the probe's first phase: one thread from the start
    it.close()
    until_chosen(ld)
    choice = ld.stats()["executor_choice"]
    # Beyond the CPUs even a transform without the GIL stops scaling: the probe would read
    # the CPUs' limit as the GIL's.
    assert choice["threads_compared"] == [1, max(2, cpus)], choice
    assert len(first["label"]) == BATCH


@pytest.mark.timeout(60)
@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_an_explicit_executor_is_not_chosen(short_shards, executor: str) -> None:
    ld = loader(short_shards, transform=gil_bound, num_workers=2, executor=executor)
    assert len(epoch(ld)) == SHORT // BATCH
    st = ld.stats()
    assert "executor_choice" not in st
    assert st["transform_executor"] == executor


_FALLBACK = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {here!r})
    import pyloader
    from test_auto import BATCH, EARLY_COMPUTING, N, gil_bound, loader

    plain = [int(i) for b in loader({shards!r}, batch_size=BATCH) for i in b["label"]]
    for _ in range(3):  # (a probe that misjudged the transform as scaling tries no pool: measured again)
        ld = loader({shards!r}, transform=lambda s, ctx: gil_bound(s, ctx), num_workers=2,
                    multiprocessing_context="spawn")
        labels = [int(i) for b in ld for i in b["label"]]
        choice = ld.stats()["executor_choice"]
        if choice["computing"] > EARLY_COMPUTING:
            break
    print(json.dumps({{"choice": choice, "in_order": labels == plain, "once": sorted(labels) == list(range(N)),
                      "executor": ld.stats()["transform_executor"]}}))
""")


@pytest.mark.timeout(120)
def test_a_transform_spawn_cannot_pickle_falls_back_to_threads(shards) -> None:
    # In a process of its own: the 'spawn' context starts multiprocessing's resource tracker,
    # a child that would outlive the test (and other tests count this process's children).
    script = _FALLBACK.format(here=os.path.dirname(__file__), shards=shards)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100,
                         env={**os.environ, "PYTHONWARNINGS": "error"})
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    choice = got["choice"]
    assert choice["executor"] == "threads" and got["executor"] == "threads", choice
    assert choice["computing"] > EARLY_COMPUTING and "computes" in choice["why"], choice  # it was measured as computing...
    assert "no process pool could start" in choice["why"], choice  # ...but had to stay
    assert "spawn" in choice["why"] and "picklable" in choice["why"], choice
    assert got["in_order"] and got["once"]  # every record once, in plan order


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("probe_first")
def test_an_epoch_too_short_for_the_probe_leaves_the_choice_open(short_shards, shards) -> None:
    # A transform that waits: its choice needs the four phases (one that computes is decided
    # after the first: NOTE [executor choice]).
    ld = loader(short_shards, transform=sleeping, num_workers=2)
    assert len(epoch(ld)) == 3
    choice = ld.stats()["executor_choice"]
    assert choice["executor"] is None and "scaling probe" in choice["why"], choice
    assert ld.stats()["transform_executor"] == "threads"
    # An epoch left after 3 batches leaves it open as well; the next whole epoch decides.
    ld = loader(shards, transform=sleeping, num_workers=2)
    it = iter(ld)
    for _ in range(3):
        next(it)
    it.close()
    assert ld.stats()["executor_choice"].get("executor") is None
    n = sum(len(b["label"]) for b in ld)
    assert n == N
    assert ld.stats()["executor_choice"]["executor"] in ("threads", "processes")  # decided


@pytest.mark.timeout(60)
def test_auto_workers_add_threads_for_a_waiting_transform(shards) -> None:
    ld = loader(shards, transform=sleeping, num_workers="auto", executor="threads")
    cpus = len(os.sched_getaffinity(0))
    it = iter(ld)
    for _ in range(N // BATCH):  # stops once the tuner went past the cores (~2 s); at most 4 s
        next(it)
        if ld.stats()["autotune"]["threads"] > cpus and ld.stats()["transform_workers"] > cpus:
            break
    tune = ld.stats()["autotune"]
    it.close()
    assert tune["executor"] == "threads"
    assert tune["threads"] > cpus, tune
    assert tune["decisions"] and any("try" in d["why"] for d in tune["decisions"]), tune
    assert tune["memory_bytes"] <= tune["memory_budget"]


@pytest.mark.timeout(60)
def test_auto_workers_stay_within_the_memory_budget(shards) -> None:
    # A native batch: 32 x 24 bytes; a transformed one as large: (6n + 5) x 768 bytes for n
    # threads (NOTE [transform autotune]): 3 fit in 20000 bytes, 4 do not.
    budget = 20000
    ld = loader(shards, transform=sleeping, num_workers="auto", executor="threads", memory_budget=budget)
    seen = set()
    it = iter(ld)
    t0 = time.monotonic()
    for b in it:
        seen.add(ld.stats()["transform_workers"])
        del b
        if time.monotonic() - t0 > 3.0:
            break
    tune = ld.stats()["autotune"]
    it.close()
    assert tune["memory_budget"] == budget
    assert tune["raw_batch_bytes"] == BATCH * 24 and tune["transformed_batch_bytes"] == BATCH * 24, tune
    assert max(seen) <= 3 and tune["threads"] <= 3, (seen, tune)
    assert tune["memory_bytes"] <= budget, tune
    assert any("memory budget" in d["why"] or "try 3" in d["why"] for d in tune["decisions"]), tune


def _blas_limits() -> list[tuple[str, int]]:
    from threadpoolctl import threadpool_info

    return sorted((i["filepath"], i["num_threads"]) for i in threadpool_info()) + [("torch", torch.get_num_threads())]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_workers_run_blas_on_one_thread_and_the_limit_is_given_back(short_shards, executor: str) -> None:
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if not any(i["user_api"] == "blas" for i in threadpoolctl.threadpool_info()):
        pytest.skip("no BLAS library loaded")
    gc.collect()  # (an iterator of an earlier test left in a cycle would hold the limit)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's count is process-wide: given back as it was (NOTE [worker threads])
    try:
        before = _blas_limits()
        ld = loader(short_shards, transform=blas_threads, num_workers=2, executor=executor)
        got = [int(n) for b in ld for n in b["blas"]]
        assert got == [1] * SHORT
        assert _blas_limits() == before
        it = iter(ld)  # closed before its end: given back too
        next(it)
        it.close()
        assert _blas_limits() == before
    finally:
        torch.set_num_threads(torch_threads)


_FIRST_SAMPLE = [True]


def cpu_while_asleep(s: dict[str, Any]) -> dict[str, Any]:
    """The CPU ms this process spent during a 0.3 s sleep at its first sample (0 at the others)."""
    ms = 0.0
    if _FIRST_SAMPLE[0]:
        _FIRST_SAMPLE[0] = False
        c0 = time.process_time()
        time.sleep(0.3)
        ms = (time.process_time() - c0) * 1e3
    return {"label": s["label"], "cpu_ms": ms}


@pytest.mark.timeout(60)
def test_a_worker_process_leaves_no_blas_thread_spinning(short_shards) -> None:
    """See NOTE [worker threads]: the limit set in a forked worker restarted OpenBLAS's thread
    server, which spun ~0.1 s of CPU per worker per pool; the worker stops it again."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if not any(i["internal_api"] == "openblas" for i in threadpoolctl.threadpool_info()):
        pytest.skip("no OpenBLAS loaded")
    ld = loader(short_shards, transform=cpu_while_asleep, num_workers=2, executor="processes")
    for _ in range(2):  # a new pool each epoch (persistent_workers=False)
        ms = sorted(float(v) for b in ld for v in b["cpu_ms"] if v > 0)
        assert len(ms) == 2, ms  # each worker's first sample
        assert max(ms) < 40, f"a worker process used {max(ms):.0f} ms of CPU while its transform slept 0.3 s"


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("probe_first")
def test_an_epoch_closed_during_the_probe_says_why_the_choice_is_open(shards) -> None:
    ld = loader(shards, transform=sleeping, num_workers=2)
    it = iter(ld)
    for _ in range(3):  # the probe needs 4 phases of at least 0.1 s
        next(it)
    it.close()
    choice = ld.stats()["executor_choice"]
    assert choice["executor"] is None and "scaling probe" in choice["why"], choice


class _Threads:
    """A thread stream's two members the tuner moves: its count and the call that sets it."""

    def __init__(self, n: int) -> None:
        self.workers = n

    def set_workers(self, n: int) -> None:
        self.workers = n


def test_the_jump_after_the_probe_keeps_a_computing_transform_at_the_cpus() -> None:
    """A thread that computes 98.5% of its working time needs no third thread on 2 CPUs;
    one that computes 5% needs about 20 per CPU (NOTE [transform autotune])."""
    from pyloader.transform.tuning import TransformTune

    for computing, want in [(0.985, 2), (1.0, 2), (0.6, 3), (0.05, 40), (0.001, 64)]:
        stream = _Threads(2)
        TransformTune(cpus=2).jump(stream, computing)
        assert stream.workers == want, (computing, stream.workers)
