"""Scripts that end with an epoch in progress, on every path of the DataLoader.

A training script that stops after N steps (``for _, batch in zip(range(N), it)``) leaves its
iterator alive until the interpreter exits. Each path -- transform threads, transform
processes, native threads, packing, a CPU device copy, pinned slots (through the stand-in
CUDA driver of tests/native/fake_cuda) -- is run as such a script several times: it must
exit with status 0 and print nothing on stderr (NOTE [transform threads at exit] in
pyloader/transform/threads.py: before it, the threads path aborted in 5 of 6 runs).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pyloader

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux")

ROOT = Path(pyloader.__file__).resolve().parents[1]
FAKE_DIR = Path(__file__).resolve().parent / "fake_cuda"
IMG = 4096
FIELDS: dict[str, Any] = {"label": ("int64", ()), "img": ("uint8", (IMG,)), "tokens": ("int32", (None,))}


def sample(i: int) -> dict[str, Any]:
    return {"label": i, "img": np.full(IMG, i % 251, np.uint8), "tokens": np.arange(i % 50 + 1, dtype=np.int32)}


# The transform keeps its worker inside torch ops most of the time, where the exit used to
# catch it.
SCRIPT = r"""
import sys, torch, pyloader
kind, path = sys.argv[1], sys.argv[2]
ds = pyloader.ShardDataset(path, rank=0, world_size=1)

def tf(s):
    x = torch.as_tensor(s["img"]).float()
    for _ in range(20):
        x = torch.nn.functional.avg_pool1d(x.view(1, 1, -1), 3, 1, 1).view(-1) * 1.0001
    return {"label": s["label"], "img": x}

kw = {
    "threads": dict(transform=tf, num_workers=2),
    "processes": dict(transform=tf, num_workers=2, executor="processes"),
    "native": dict(num_workers=3),
    "packing": dict(num_workers=2, pack=pyloader.PackSpec(seq_len=64, doc_batch=16)),
    "device": dict(num_workers=3, device="cpu"),
    "pinned": dict(num_workers=3, pin_memory=True),
}[kind]
loader = pyloader.DataLoader(ds, batch_size=64, **kw)
it = iter(loader)
for _, batch in zip(range(3), it):
    pass
print("stopping mid-epoch", flush=True)
"""

RUNS = {"threads": 6, "processes": 3, "native": 3, "packing": 3, "device": 3, "pinned": 3}


def run_script(kind: str, path: str, env: dict[str, str]) -> list[str]:
    """Runs the script RUNS[kind] times, two at a time; the failures, described."""
    bad: list[str] = []
    runs = RUNS[kind]
    for first in range(0, runs, 2):
        procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, kind, path], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
                 for _ in range(min(2, runs - first))]
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                bad.append(f"hung at exit\nstdout:\n{out}\nstderr:\n{err}")
                continue
            if proc.returncode != 0 or err or "stopping mid-epoch" not in out:
                bad.append(f"rc={proc.returncode}\nstdout:\n{out}\nstderr:\n{err}")
    return bad


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("exit") / "ds")
    with pyloader.ShardWriter(d, FIELDS, shard_bytes=1 << 20) as w:
        for i in range(1200):
            w.write(sample(i))
    return d


def script_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["threads", "processes", "native", "packing", "device"])
def test_script_ending_mid_epoch_exits_cleanly(dataset, kind: str) -> None:
    bad = run_script(kind, dataset, script_env())
    assert not bad, f"{kind}: {len(bad)} of {RUNS[kind]} runs ended badly; the first:\n{bad[0]}"


@pytest.mark.timeout(180)
def test_script_ending_mid_epoch_with_pinned_slots_exits_cleanly(dataset, tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("fake_cuda_build", FAKE_DIR / "build.py")
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    if builder.compiler() is None:
        pytest.skip("no C compiler to build the stand-in CUDA driver")
    fake = builder.build(str(tmp_path))
    env = script_env(FAKE_CUDA_DEVICES="1",
                     LD_LIBRARY_PATH=os.pathsep.join([os.path.dirname(fake), os.environ.get("LD_LIBRARY_PATH", "")]))
    bad = run_script("pinned", dataset, env)
    assert not bad, f"pinned: {len(bad)} of {RUNS['pinned']} runs ended badly; the first:\n{bad[0]}"


# A Ctrl-C is delivered at the first Python call after the engine accepted a copy, before the
# job's _Pending exists: here, on every third submit, that call raises KeyboardInterrupt.
CTRL_C_AFTER_SUBMIT = r"""
import sys, torch, pyloader
from pyloader.loader import transfer
path, kind = sys.argv[1], sys.argv[2]
ds = pyloader.ShardDataset(path, rank=0, world_size=1)
original = transfer._Pending.__init__
calls = [0]

def interrupted(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] % 3 == 0:
        raise KeyboardInterrupt
    original(self, *args, **kwargs)

transfer._Pending.__init__ = interrupted
kw = {"transform": lambda s: s} if kind == "staged" else {}
loader = pyloader.DataLoader(ds, batch_size=256, num_workers=2, device="cpu", **kw)
interrupts = 0
for _ in range(40):
    it = iter(loader)
    try:
        for batch in it:
            assert bool((batch["img"][:, 0] == (batch["label"] % 251).to(torch.uint8)).all())
    except KeyboardInterrupt:
        interrupts += 1
    del it
assert interrupts > 0
print("interrupted", interrupts, flush=True)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["host", "staged"])
def test_ctrl_c_right_after_a_copy_was_accepted(dataset, kind: str) -> None:
    """NOTE [copy buffers held] in pyloader/loader/transfer.py: the copy's destinations (and
    staged sources) stay alive until the engine closed; before, the engine wrote into freed
    tensors and the process crashed (SIGSEGV, or glibc's "free(): corrupted unsorted chunks")."""
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", CTRL_C_AFTER_SUBMIT, dataset, kind], env=script_env(),
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and not res.stderr and "interrupted" in res.stdout, \
            f"rc={res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
