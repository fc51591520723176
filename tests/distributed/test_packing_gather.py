"""A packing loader's state_dict() under torch.distributed (gloo, 2 processes on loopback).

See NOTE [packing resume]: each rank's packer stands at its own place, so the state of one rank
says nothing about the other's; under an initialised process group state_dict() gathers
every rank's packing entry, and that one state (rank 0's, as a job saves it) resumes the
epoch at another world size with every token delivered once.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import pyloader

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()) or sys.platform != "linux",
    reason="needs torch.distributed with gloo, on Linux")

SEQ = 256
STEPS = 3


def doc(i: int) -> np.ndarray:
    n = (i * 7919) % 700  # 0..699 tokens, some longer than SEQ
    return (np.arange(n, dtype=np.int64) + i * 4096).astype(np.int32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tokens_of(batch: dict[str, torch.Tensor]) -> list[int]:
    t = batch["tokens"].flatten()
    return t[batch["document_ids"].flatten() >= 0].tolist()


# Each rank is its own interpreter (not multiprocessing from the test process, whose
# resource tracker would outlive the test as a child of pytest).
WORKER = """
import json, os, sys
import torch.distributed as dist
import pyloader
rank, port, path, out, seq, steps = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
try:
    ds = pyloader.ShardDataset(path, shuffle=True, seed=5)  # rank and world size from the process group
    dl = pyloader.DataLoader(ds, batch_size=2, num_workers=1,
                             pack=pyloader.PackSpec(seq_len=seq, mode="first_fit", lookahead=8))
    seen = []
    for step, b in enumerate(dl):
        t = b["tokens"].flatten()
        seen += t[b["document_ids"].flatten() >= 0].tolist()
        if step + 1 == steps:
            break
    state = dl.state_dict()  # a collective: both ranks call it
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"state": state, "seen": seen}, f)
finally:
    dist.destroy_process_group()
"""


def test_state_dict_gathers_every_rank_and_resumes_at_another_world_size(tmp_path: Any) -> None:
    path = str(tmp_path / "ds")
    with pyloader.ShardWriter(path, {"tokens": ("int32", (None,))}, shard_bytes=1 << 14) as w:
        for i in range(200):
            w.write({"tokens": doc(i)})
    out = str(tmp_path)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), port, path, out, str(SEQ), str(STEPS)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], logs
    got = []
    for r in range(2):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            got.append(json.load(f))
    s0, s1 = got[0]["state"], got[1]["state"]
    assert s0 == s1  # every rank holds the gathered state
    ranks = s0["packing"]["phases"][-1]["ranks"]
    assert sorted(ranks) == ["0", "1"] and ranks["0"] != ranks["1"]

    # Resume on one rank: the rest of the epoch, each token once with what the two ranks read.
    dl = pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=True, seed=5, rank=0, world_size=1), batch_size=2,
                             pack=pyloader.PackSpec(seq_len=SEQ, mode="first_fit", lookahead=8))
    dl.load_state_dict(s0)
    rest: list[int] = []
    for b in dl:
        rest += tokens_of(b)
    before = got[0]["seen"] + got[1]["seen"]
    assert len(before) > 0 and len(rest) > 0
    want = collections.Counter(t for i in range(200) for t in doc(i).tolist())
    assert collections.Counter(before + rest) == want
