"""Body of one torchrun rank for tests/distributed/test_torchrun.py.

Reads a remote dataset through the node cache (PYLOADER_CACHE_DIR) with a
pyloader.DataLoader and logs every batch it received, one JSON line per step, to
``OUT/log-TAG-rankR.jsonl``. Every ``--ckpt-every`` steps the ranks all_gather their
``state_dict()``s (they must be equal) and rank 0 writes ``OUT/ckpt-TAG.json`` atomically,
as a training job saves a checkpoint. ``--hang-after N``: after step N the rank writes
``OUT/hung-TAG-rankR`` and sleeps, so the test can kill the job mid-epoch. At the end of
each epoch the ranks all_gather their batch counts; rank 0 writes ``OUT/done-TAG.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import threading
import time
from datetime import timedelta

import torch.distributed as dist

import pyloader


def write_json(path: str, obj: object) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("out")
    p.add_argument("--tag", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--resume", default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--hang-after", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    a = p.parse_args()

    # Never outlive the torchrun agent (the test kills it) or the test's time budget.
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    threading.Timer(120, lambda: os._exit(3)).start()
    os.makedirs(os.path.join(a.out, "pids"), exist_ok=True)
    open(os.path.join(a.out, "pids", str(os.getpid())), "w").close()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = pyloader.ShardDataset(a.url, shuffle=True, seed=a.seed, fetch_jobs=2)
    loader = pyloader.DataLoader(ds, batch_size=a.batch_size, num_workers=2, prefetch=4)
    if a.resume:
        with open(a.resume) as f:
            loader.load_state_dict(json.load(f)["state"])
    log = open(os.path.join(a.out, f"log-{a.tag}-rank{rank}.jsonl"), "a")  # noqa: SIM115
    step = 0
    done = []
    for _ in range(a.epochs):
        epoch = loader.state_dict()["epoch"]
        n = 0
        for batch in loader:
            step += 1
            n += 1
            log.write(json.dumps({"epoch": epoch, "step": step, "labels": batch["label"].tolist()}) + "\n")
            log.flush()
            if a.ckpt_every and step % a.ckpt_every == 0:
                state = loader.state_dict()
                states: list[object] = [None] * world
                dist.all_gather_object(states, state)
                if any(s != state for s in states):
                    raise SystemExit(f"rank {rank}: loader states differ across ranks: {states}")
                if rank == 0:
                    write_json(os.path.join(a.out, f"ckpt-{a.tag}.json"),
                               {"state": state, "step": step, "world_size": world})
                dist.barrier()
            if a.hang_after and step >= a.hang_after:
                open(os.path.join(a.out, f"hung-{a.tag}-rank{rank}"), "w").close()
                time.sleep(600)  # "training" until the test kills the job
            time.sleep(a.step_sleep)
        counts: list[object] = [None] * world
        dist.all_gather_object(counts, n)
        done.append({"epoch": epoch, "batches": counts})
    log.close()
    if rank == 0:
        write_json(os.path.join(a.out, f"done-{a.tag}.json"), {"world_size": world, "epochs": done})
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip the watchdog timer thread


if __name__ == "__main__":
    main()
