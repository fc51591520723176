"""Real torchrun jobs (gloo, CPU): 2 simulated nodes x 2 ranks on this machine.

Each node has its own cache directory and reads the dataset from its own loopback HTTP
server (the same files), so the GETs of each node can be counted apart. A job is killed
(SIGKILL) mid-epoch, three steps after its last checkpoint, with batches prefetched; it
is resumed from the checkpoint at the same world size (2 x 2, then a whole further epoch)
and at another one (2 nodes x 1 rank, with the global batch size kept). The checks:
the samples read before the checkpoint plus those read after the resume are exactly the
epoch (batch for batch against the uninterrupted plan at the same world size); every
rank takes the same number of batches (all_gather in the job); each node downloads
each shard it needs once.
"""

from __future__ import annotations

import collections
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import torch.distributed
from remote_servers import FaultServer
from remote_util import write_ds

import pyloader
from pyloader.read import order as _plan

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "torchrun_worker.py")
N = 302  # not a multiple of 4: the padded tail is exercised
SEED = 7
B = 4  # batch size per rank at world size 4
CKPT_EVERY, HANG_AFTER = 3, 5  # the job is killed after step 5, its checkpoint is at step 3
JOB_TIMEOUT = 60

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()) or sys.platform != "linux",
    reason="needs torch.distributed with gloo, on Linux (prctl, process groups)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    def __init__(self, base: str) -> None:
        self.base = base
        self.out = os.path.join(base, "out")
        self.tmp = os.path.join(base, "tmp")
        os.makedirs(self.out)
        os.makedirs(self.tmp)
        write_ds(os.path.join(base, "srv", "ds"), n=N)
        self.servers = [FaultServer(os.path.join(base, "srv"), max_life=170).start() for _ in range(2)]
        self.caches = [os.path.join(base, f"cache-node{i}") for i in range(2)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.killed_at = float("inf")  # time.monotonic() of the SIGKILL of the first job

    def launch(self, tag: str, nnodes: int, nproc: int, *args: str) -> list[subprocess.Popen[bytes]]:
        port = free_port()
        procs = []
        for node in range(nnodes):
            env = dict(os.environ, PYTHONPATH=REPO, PYLOADER_CACHE_DIR=self.caches[node], TMPDIR=self.tmp,
                       GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                       PYLOADER_FETCH_ATTEMPTS="4", PYLOADER_FETCH_BACKOFF="0.01")
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node}",
                   f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}",
                   "--max-restarts=0", "--monitor-interval=0.1", WORKER,
                   self.servers[node].url + "/ds", self.out, "--tag", tag, "--seed", str(SEED), *args]
            log = open(os.path.join(self.base, f"{tag}-node{node}.log"), "wb")  # noqa: SIM115
            with log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
        self.procs += procs
        return procs

    def logs(self, tag: str) -> str:
        out = []
        for name in sorted(os.listdir(self.base)):
            if name.startswith(tag) and name.endswith(".log"):
                with open(os.path.join(self.base, name), errors="replace") as f:
                    out.append(f"--- {name}\n" + f.read()[-3000:])
        return "\n".join(out)

    def wait(self, procs: list[subprocess.Popen[bytes]], tag: str) -> None:
        deadline = time.monotonic() + JOB_TIMEOUT
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(procs)
                pytest.fail(f"torchrun job {tag!r} did not finish in {JOB_TIMEOUT} s\n{self.logs(tag)}")
        codes = [p.returncode for p in procs]
        assert codes == [0] * len(procs), f"job {tag!r} exit codes {codes}\n{self.logs(tag)}"

    def kill(self, procs: list[subprocess.Popen[bytes]]) -> None:
        """SIGKILL the agents' process groups and every worker (each leads its own session)."""
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        piddir = os.path.join(self.out, "pids")
        for name in os.listdir(piddir) if os.path.isdir(piddir) else []:
            try:
                os.killpg(int(name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in procs:
            p.wait(10)

    def read_log(self, tag: str, rank: int) -> list[dict[str, Any]]:
        with open(os.path.join(self.out, f"log-{tag}-rank{rank}.jsonl")) as f:
            return [json.loads(line) for line in f]

    def read_json(self, name: str) -> Any:
        with open(os.path.join(self.out, name)) as f:
            return json.load(f)

    def shard_index(self) -> dict[str, int]:
        ds = pyloader.ShardDataset(os.path.join(self.base, "srv", "ds"))
        return {"/ds/" + os.path.basename(p): i for i, p in enumerate(ds.shard_paths)}

    def close(self) -> None:
        self.kill(self.procs)
        for s in self.servers:
            s.stop()


def records() -> list[int]:
    return pyloader.ShardDataset(os.path.join(CLUSTER.base, "srv", "ds")).records_per_shard


def planned_batches(epoch: int, rank: int, world: int, batch: int, segments: list[list[int]] = ()) -> list[list[int]]:
    """Labels (= global ids here) of each batch rank ``rank`` reads, from pyloader.read.order alone."""
    counts = records()
    order = _plan.epoch_order(counts, shuffle=True, seed=SEED, epoch=epoch)
    mine = _plan.resume_partition(order, rank=rank, world_size=world, partition="pad", segments=segments)
    return [mine[i:i + batch].tolist() for i in range(0, mine.size, batch)]


def shards_of(ids: list[int]) -> set[int]:
    return set(_plan.locate(np.asarray(ids, np.int64), records())[0].tolist())


CLUSTER: Cluster


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A 2 x 2 job killed mid-epoch 0, after its checkpoint at step 3 and two more steps."""
    global CLUSTER
    base = str(tmp_path_factory.mktemp("torchrun"))
    CLUSTER = c = Cluster(base)
    try:
        procs = c.launch("kill", 2, 2, "--batch-size", str(B), "--ckpt-every", str(CKPT_EVERY),
                         "--hang-after", str(HANG_AFTER), "--step-sleep", "0.01")
        deadline = time.monotonic() + JOB_TIMEOUT
        hung = [os.path.join(c.out, f"hung-kill-rank{r}") for r in range(4)]
        while not all(os.path.exists(h) for h in hung):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                c.kill(procs)
                pytest.fail(f"the job to kill did not reach step {HANG_AFTER}\n{c.logs('kill')}")
            time.sleep(0.05)
        c.kill(procs)  # preempted: SIGKILL, no cleanup, batches prefetched
        c.killed_at = time.monotonic()
        assert not os.path.exists(os.path.join(c.out, "done-kill.json"))
        yield c
    finally:
        c.close()
        shutil.rmtree(base, ignore_errors=True)


def committed(c: Cluster, ckpt_step: int) -> list[list[list[int]]]:
    """Per rank of the killed job, the batches it took up to its checkpoint."""
    return [[e["labels"] for e in c.read_log("kill", r) if e["step"] <= ckpt_step] for r in range(4)]


def check_gets_once(c: Cluster) -> None:
    """One download per shard per node in each job; across the SIGKILL, only the downloads
    cut short by it (at most fetch_jobs per rank: 2 ranks x 2 jobs per node) are made again."""
    for node, srv in enumerate(c.servers):
        gets = srv.shard_gets()
        assert gets, f"node {node} downloaded nothing"
        with srv._mu:
            arrivals = [(t, p) for t, p in srv.get_times if not p.endswith(".json")]
        before = collections.Counter(p for t, p in arrivals if t <= c.killed_at)
        after = collections.Counter(p for t, p in arrivals if t > c.killed_at)
        assert set(before.values()) <= {1}, f"node {node} downloaded a shard twice in the killed job: {before}"
        assert set(after.values()) <= {1}, f"node {node} downloaded a shard twice after the kill: {after}"
        again = set(before) & set(after)
        assert len(again) <= 4, f"node {node} downloaded again shards that were not in flight at the kill: {again}"


@pytest.mark.timeout(120)
def test_killed_job_checkpointed_and_downloaded_each_shard_once_per_node(killed):
    c = killed
    ckpt = c.read_json("ckpt-kill.json")
    assert ckpt["step"] == CKPT_EVERY and ckpt["world_size"] == 4
    assert ckpt["state"]["segments"] == [[4, B, CKPT_EVERY]] and ckpt["state"]["epoch"] == 0
    assert len(json.dumps(ckpt["state"])) < 400  # no per-sample lists
    for r in range(4):  # the job read past its checkpoint before it was killed: lost work
        log = c.read_log("kill", r)
        assert [e["step"] for e in log] == list(range(1, HANG_AFTER + 1))
        assert [e["labels"] for e in log] == planned_batches(0, r, 4, B)[:HANG_AFTER]
    index = c.shard_index()
    for node in range(2):  # ranks 2 * node and 2 * node + 1 run on this node
        need = set().union(*(shards_of(sum(planned_batches(0, r, 4, B), [])) for r in (2 * node, 2 * node + 1)))
        got = {index[p] for p in c.servers[node].shard_gets()}
        assert got == need
    check_gets_once(c)


@pytest.mark.timeout(120)
def test_resume_at_the_same_world_size_is_the_uninterrupted_epoch(killed):
    c = killed
    ckpt = c.read_json("ckpt-kill.json")
    c.wait(c.launch("same", 2, 2, "--batch-size", str(B), "--resume", os.path.join(c.out, "ckpt-kill.json"),
                    "--epochs", "2"), "same")
    before = committed(c, ckpt["step"])
    seen: collections.Counter[int] = collections.Counter()
    for r in range(4):
        log = c.read_log("same", r)
        after = [e["labels"] for e in log if e["epoch"] == 0]
        assert before[r] + after == planned_batches(0, r, 4, B), f"rank {r}: epoch 0 differs"
        for batch in before[r] + after:
            seen.update(batch)
        epoch1 = [e["labels"] for e in log if e["epoch"] == 1]
        assert epoch1 == planned_batches(1, r, 4, B), f"rank {r}: epoch 1 differs"
    # Exactness, the padded tail included: 302 samples over 4 ranks read each sample once
    # and the first 2 of the epoch order once more (ceil(302 / 4) * 4 = 304).
    order = _plan.epoch_order(records(), shuffle=True, seed=SEED, epoch=0)
    assert sorted(seen) == list(range(N))
    assert sorted(k for k, v in seen.items() if v == 2) == sorted(order[:2].tolist())
    assert max(seen.values()) == 2
    done = c.read_json("done-same.json")
    per_rank = math.ceil(math.ceil(N / 4) / B)  # batches per rank in a full epoch
    assert done["epochs"][0]["batches"] == [per_rank - CKPT_EVERY] * 4  # all_gather'ed in the job
    assert done["epochs"][1]["batches"] == [per_rank] * 4
    check_gets_once(c)


@pytest.mark.timeout(120)
def test_resume_at_another_world_size_reads_the_rest_once(killed):
    c = killed
    ckpt = c.read_json("ckpt-kill.json")
    # World size 4 -> 2 (2 nodes x 1 rank), batch 4 -> 8: the global batch stays 16.
    c.wait(c.launch("elastic", 2, 1, "--batch-size", str(2 * B), "--resume",
                    os.path.join(c.out, "ckpt-kill.json")), "elastic")
    before = committed(c, ckpt["step"])
    seen: collections.Counter[int] = collections.Counter()
    for r in range(4):
        for batch in before[r]:
            seen.update(batch)
    counts = []
    for r in range(2):
        after = [e["labels"] for e in c.read_log("elastic", r)]
        assert after == planned_batches(0, r, 2, 2 * B, ckpt["state"]["segments"])
        counts.append(len(after))
        for batch in after:
            seen.update(batch)
    assert sorted(seen) == list(range(N)), "a sample was skipped"
    # 48 samples read before; 254 left over 2 ranks: no padding at all, so nothing repeats.
    assert max(seen.values()) == 1 and sum(seen.values()) == N
    done = c.read_json("done-elastic.json")
    assert done["world_size"] == 2 and done["epochs"][0]["batches"] == counts == [16, 16]
    check_gets_once(c)
