"""Shared by the framework tests: a small dataset whose records name themselves, and torchrun jobs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import numpy as np
import torch.distributed

import pyloader

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
JOB_TIMEOUT = 180


def write_ds(path: str, n: int) -> str:
    """``n`` records: ``x`` (8 float32, all equal to the index) and ``idx``, in shards of 4 KiB."""
    with pyloader.ShardWriter(path, fields={"x": ("float32", (8,)), "idx": ("int64", ())}, shard_bytes=4096) as w:
        for i in range(n):
            w.write({"x": np.full(8, i, np.float32), "idx": i})
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_env(tmp: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=REPO, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                TMPDIR=tmp, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", ACCELERATE_DISABLE_RICH="1")


def run_job(worker: str, nproc: int, args: list[str], tmp: str) -> subprocess.CompletedProcess[str]:
    """``worker`` under torchrun with ``nproc`` processes (gloo, loopback), or alone when ``nproc`` is 0."""
    os.makedirs(tmp, exist_ok=True)
    script = os.path.join(HERE, worker)
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--max-restarts=0",
               "--monitor-interval=0.1", script, *args]
    else:
        cmd = [sys.executable, script, *args]
    proc = subprocess.run(cmd, env=job_env(tmp), capture_output=True, text=True, timeout=JOB_TIMEOUT,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{worker} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def end_job() -> None:
    """Ends a torchrun worker whose results are written: a barrier, the group destroyed, then ``os._exit(0)``.

    Not the interpreter's own exit: there the DDP model's reducer drops the last reference to
    gloo's process group, whose destructor joins gloo's worker threads while holding the GIL,
    and a worker thread still releasing the tensors of the job's last collective (Trainer's
    closing all_gather) waits for the GIL: both wait for ever (seen under load: the main
    thread in ``std::thread::join`` from ``~ProcessGroupGloo``, a gloo thread in
    ``gil_scoped_acquire`` from ``~AsyncAllgatherWork``). Nor can that teardown abort the
    process ("terminate called without an active exception", pytorch#190489).
    """
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def results(out: str, tag: str, ranks: int) -> list[dict[str, Any]]:
    """Each rank's JSON result of ``tag``."""
    found = []
    for r in range(ranks):
        with open(os.path.join(out, f"{tag}-rank{r}.json")) as f:
            found.append(json.load(f))
    return found
