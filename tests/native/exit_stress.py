"""Stress reproducer: gloo ranks running pyloader loaders in turn, then exiting.

The reported failure: 3 gloo ranks on 2 CPUs running four loaders in turn (some iterators
dropped mid-epoch), then ``destroy_process_group()``; rank 0 printed its result and died with
``terminate called without an active exception`` (SIGABRT) in some runs, more on a loaded
machine. This script runs that scenario ``--runs`` times, each time with its world's processes
launched directly (as torchrun would: RANK, WORLD_SIZE, MASTER_ADDR/PORT; ``--torchrun`` uses
torchrun itself), and counts every process's exit status.

    python tests/native/exit_stress.py --runs 30 --hog 2          # a loaded machine
    python tests/native/exit_stress.py --runs 30 --variant pack --exit os_exit

Variants are picked per run (``--variant mixed``: each run draws its loaders' options); exit
modes are ``normal``, ``os_exit`` and ``sleep`` (a sleep after the last batch, then a normal
exit), or ``mixed``.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

RANK_SCRIPT = r"""
import os, random, sys, time
import torch, torch.distributed as dist
import pyloader

path, variant, exit_mode, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
rng = random.Random(seed * 131 + rank)

def tf(s):
    return {"label": s["label"], "img": torch.as_tensor(s["img"]).float() * 0.5}

def options(v):
    kw = {"num_workers": rng.choice([1, 2, 3, "auto"])}
    if v == "pack":
        kw = {"num_workers": rng.choice([1, 2]), "pack": pyloader.PackSpec(seq_len=64, doc_batch=16)}
    elif v == "device":
        kw["device"] = "cpu"
    elif v == "transform":
        kw["transform"] = tf
    return kw

variants = ["native", "pack", "device", "transform"]
total = 0
for k in range(4):
    v = variants[k] if variant == "mixed" else variant
    ds = pyloader.ShardDataset(path, shuffle=True, seed=k)
    loader = pyloader.DataLoader(ds, batch_size=32, **options(v))
    for epoch in range(3):
        it = iter(loader)
        stop = rng.choice([None, None, 1, 3, 7])
        for i, batch in enumerate(it):
            total += 1
            if stop is not None and i >= stop:
                break  # the iterator is dropped mid-epoch (or kept until the next iter)
        if rng.random() < 0.5:
            del it
    t = torch.tensor([total])
    dist.all_reduce(t)
    if rng.random() < 0.5:
        del loader, ds
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank} result {total}", flush=True)
if exit_mode == "sleep":
    time.sleep(0.2)
elif exit_mode == "os_exit":
    sys.stdout.flush()
    os._exit(0)
"""

FIELDS: dict[str, Any] = {"label": ("int64", ()), "img": ("uint8", (1024,)), "tokens": ("int32", (None,))}


def write_dataset(path: str, n: int = 2000) -> None:
    import pyloader

    with pyloader.ShardWriter(path, FIELDS, shard_bytes=256 << 10) as w:
        for i in range(n):
            w.write({"label": i, "img": np.full(1024, i % 251, np.uint8),
                     "tokens": np.arange(i % 90 + 1, dtype=np.int32)})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hog() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def run_world(path: str, nproc: int, variant: str, exit_mode: str, seed: int, torchrun: bool,
              timeout: float) -> list[tuple[int, str]]:
    """One world; each process's (exit status, stderr). Negative status: killed by that signal."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    port = free_port()
    if torchrun:
        fd, name = tempfile.mkstemp(prefix="pyloader_exit_stress_rank_", suffix=".py")
        os.close(fd)
        script = Path(name)
        script.write_text(RANK_SCRIPT)
        cmds = [[sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                 f"--master-port={port}", str(script), path, variant, exit_mode, str(seed)]]
        envs = [env]
    else:
        cmds, envs = [], []
        for r in range(nproc):
            e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            cmds.append([sys.executable, "-c", RANK_SCRIPT, path, variant, exit_mode, str(seed)])
            envs.append(e)
    procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for c, e in zip(cmds, envs)]
    out: list[tuple[int, str]] = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
            out.append((p.returncode, err))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            _, err = p.communicate()
            out.append((999, "hung\n" + err))
    if torchrun:
        script.unlink(missing_ok=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--hog", type=int, default=0, help="CPU-hogging processes run alongside")
    ap.add_argument("--variant", default="mixed", choices=["mixed", "native", "pack", "device", "transform"])
    ap.add_argument("--exit", default="mixed", choices=["mixed", "normal", "os_exit", "sleep"])
    ap.add_argument("--torchrun", action="store_true", help="launch each world with torchrun")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--data", default="", help="an existing dataset written by this script")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    path = args.data or os.path.join(tmp.name, "ds")
    if not os.path.exists(path):
        write_dataset(path)
    hogs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(args.hog)]
    for h in hogs:
        h.start()
    counts: collections.Counter[str] = collections.Counter()
    aborted_runs = 0
    t0 = time.monotonic()
    try:
        for run in range(args.runs):
            exit_mode = random.choice(["normal", "os_exit", "sleep"]) if args.exit == "mixed" else args.exit
            res = run_world(path, args.nproc, args.variant, exit_mode, run, args.torchrun, args.timeout)
            bad = False
            for rank, (rc, err) in enumerate(res):
                aborted = "terminate called" in err or rc in (-signal.SIGABRT, 128 + signal.SIGABRT)
                key = "abort" if aborted else f"rc={rc}" + (" +stderr" if err.strip() else "")
                counts[key] += 1
                if aborted or rc != 0:
                    bad = True
                    if args.verbose:
                        print(f"run {run} proc {rank} exit={exit_mode}: rc={rc}\n{err[-2000:]}", flush=True)
            aborted_runs += bad
            print(f"run {run + 1}/{args.runs} exit={exit_mode} {'BAD' if bad else 'ok'}", flush=True)
    finally:
        for h in hogs:
            h.terminate()
    print(f"{args.runs} runs in {time.monotonic() - t0:.0f} s, {aborted_runs} with a bad exit; "
          f"process exits: {dict(counts)}")
    return 1 if aborted_runs else 0


if __name__ == "__main__":
    sys.exit(main())
