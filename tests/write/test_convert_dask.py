"""pyloader.convert(engine="dask") on a real Dask LocalCluster of worker processes.

NOTE [dask convert] in pyloader/write/cluster.py: tasks cut from the source, shards written
by the workers, one manifest merged by the client; a killed run is repaired by the next.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import pyloader
from pyloader.format.spec import MANIFEST_NAME
from pyloader.write import cli as CLI
from pyloader.write.cluster import plan_tasks

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
distributed = pytest.importorskip("distributed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def client():
    """Two worker processes of one thread each, no dashboard: the cluster a laptop has."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                  scheduler_kwargs={"dashboard_address": ":0"}) as lc, distributed.Client(lc) as c:
        yield c


def write_corpus(root, files=3, rows=1200, row_group=150, seed=0):
    """Parquet files of several row groups: a token-list column, scalars and a string."""
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    rid = 0
    for f in range(files):
        toks = [rng.integers(0, 50_000, int(rng.integers(0, 120))).astype(np.int32) for _ in range(rows)]
        table = pa.table({"tokens": pa.array(toks, pa.list_(pa.int32())),
                          "id": pa.array(np.arange(rid, rid + rows, dtype=np.int64)),
                          "score": pa.array(rng.random(rows).astype(np.float32)),
                          "lang": pa.array([["en", "de", "fr"][i % 3] for i in range(rows)])})
        pq.write_table(table, os.path.join(root, f"part-{f}.parquet"), row_group_size=row_group)
        rid += rows
    return root


def records(path, **kw):
    """Every record of the dataset at ``path`` in stored order, as tuples of bytes."""
    ds = pyloader.ShardDataset(path, **kw)
    return [tuple(bytes(np.asarray(v).tobytes()) for v in s.values()) for s in ds]


def manifest(path):
    with open(os.path.join(path, MANIFEST_NAME), "rb") as fh:
        return fh.read()


def files_of(path):
    out = {}
    for n in sorted(os.listdir(path)):
        with open(os.path.join(path, n), "rb") as fh:
            out[n] = fh.read()
    return out


def shard_names(path):
    return {s["path"] for s in _body(path)["shards"]}


def _body(path):
    from pyloader import _C
    from pyloader.format.spec import parse_manifest

    return parse_manifest(manifest(path), path, _C.xxh64)


@pytest.mark.timeout(60)
def test_dask_parquet_holds_the_jobs1_records_in_source_order(tmp_path, client):
    src = write_corpus(str(tmp_path / "src"))
    one = pyloader.convert(src, str(tmp_path / "one"), shard_size="32K")
    res = pyloader.convert(src, str(tmp_path / "dask"), shard_size="32K", task_size="64K", engine="dask",
                           scheduler=client, verify=True)
    assert res.engine == "dask" and res.jobs == 2 and res.verified["records"] == 3600
    assert res.tasks >= 4 * res.jobs  # many more tasks than workers
    assert res.records == one.records == 3600 and res.fields == one.fields
    got = records(str(tmp_path / "dask"))
    assert got == records(str(tmp_path / "one"))
    ids = [np.frombuffer(r[1], np.int64)[0] for r in got]
    assert ids == list(range(3600))  # the source order, across files and row groups
    # Shard names come from the task (shard-<task>-<n>.pyl): every task's shards, in order.
    names = [s["path"] for s in _body(str(tmp_path / "dask"))["shards"]]
    assert names == sorted(names) and names[0] == "shard-00000-000000.pyl"
    assert {n.split("-")[1] for n in names} == {f"{k:05d}" for k in range(res.tasks)}
    # The tasks depend on the source and task_size only: another cluster (here one worker,
    # started by convert) writes the same bytes.
    again = pyloader.convert(src, str(tmp_path / "again"), shard_size="32K", task_size="64K", engine="dask",
                             jobs=1)
    assert again.jobs == 1 and files_of(str(tmp_path / "again")).keys() == files_of(str(tmp_path / "dask")).keys()
    a, b = files_of(str(tmp_path / "again")), files_of(str(tmp_path / "dask"))
    assert all(a[n] == b[n] for n in a if n != "convert.json")
    # One task covering the whole source is the jobs=1 conversion, byte for byte.
    whole = pyloader.convert(src, str(tmp_path / "whole"), shard_size="32K", task_size="1G", engine="dask",
                             scheduler=client)
    assert whole.tasks == 1
    a, b = files_of(str(tmp_path / "whole")), files_of(str(tmp_path / "one"))
    assert a.keys() == b.keys() and all(a[n] == b[n] for n in a if n != "convert.json")


@pytest.mark.timeout(60)
def test_dask_numpy_arrays_and_npy_files(tmp_path, client):
    # A numpy unit is about 16 MB of rows: 40 MB make three tasks.
    n = 10_000
    rng = np.random.default_rng(1)
    arrays = {"x": rng.integers(0, 255, (n, 4, 1024), dtype=np.uint8), "y": np.arange(n, dtype=np.int64),
              "name": np.array([f"n{i}" for i in range(n)])}
    np.save(tmp_path / "x.npy", arrays["x"])
    for src, tag in ((arrays, "dict"), ({"x": str(tmp_path / "x.npy"), "y": arrays["y"]}, "npy")):
        pyloader.convert(src, str(tmp_path / f"one-{tag}"), shard_size="4M", compression="none")
        res = pyloader.convert(src, str(tmp_path / f"dask-{tag}"), shard_size="4M", compression="none",
                               task_size="1", engine="dask", scheduler=client, verify=True)
        assert res.tasks == 3 and res.records == n
        assert {name.split("-")[1] for name in shard_names(str(tmp_path / f"dask-{tag}"))} == {"00000", "00001", "00002"}
        assert records(str(tmp_path / f"dask-{tag}")) == records(str(tmp_path / f"one-{tag}"))


def test_plan_tasks_is_contiguous_and_ignores_the_cluster():
    r = plan_tasks([10, 10, 10, 10, 100, 10], 25)
    assert r == [(0, 3), (3, 5), (5, 6)]
    assert plan_tasks([5], 1 << 30) == [(0, 1)]
    assert plan_tasks([1] * 10, 1) == [(k, k + 1) for k in range(10)]


_KILLED_RUN = """
import sys

import pyloader

if __name__ == "__main__":
    pyloader.convert(sys.argv[1], sys.argv[2], shard_size="32K", task_size="64K", engine="dask", jobs=2)
"""


def _group(pgid: int) -> dict[int, str]:
    """The processes of process group ``pgid``: pid -> command line."""
    out = {}
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
            with open(f"/proc/{d}/cmdline", "rb") as fh:
                out[int(d)] = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
    return out


def _kill_all_but_trackers(pgid: int) -> list[int]:
    """SIGKILLs group ``pgid`` but its multiprocessing resource trackers; returns theirs.

    A tracker left alive sees its clients' pipe close and unlinks the named semaphores they
    registered (the cluster's queues and locks); killed with them, those stay in /dev/shm.
    """
    trackers = []
    for pid, cmd in _group(pgid).items():
        if "resource_tracker" in cmd:
            trackers.append(pid)
            continue
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return trackers


@pytest.mark.timeout(90)
def test_a_killed_run_then_a_rerun_equals_a_clean_run(tmp_path, client):
    src = write_corpus(str(tmp_path / "src"), files=4, rows=4000, row_group=250)
    clean = str(tmp_path / "clean")
    pyloader.convert(src, clean, shard_size="32K", task_size="64K", engine="dask", scheduler=client)
    dst = str(tmp_path / "dst")
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(_KILLED_RUN))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # Its own session: the SIGKILL takes the client and the cluster's workers at once, as a lost machine would.
    proc = subprocess.Popen([sys.executable, str(script), src, dst], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.isdir(dst) and sum(n.endswith(".pyl") for n in os.listdir(dst)) >= 3:
                break
            time.sleep(0.005)
        assert proc.poll() is None, f"the convert ended before it was killed: {proc.stderr.read()!r}"
        trackers = _kill_all_but_trackers(proc.pid)
    finally:
        if proc.poll() is None:
            trackers = _kill_all_but_trackers(proc.pid)
        proc.wait()
        proc.stderr.close()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{t}") for t in trackers) and time.monotonic() < deadline:
        time.sleep(0.02)  # each tracker unlinks what its dead clients registered, then exits
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything still in the group
    time.sleep(0.5)  # the killed workers' last writes are over
    left = os.listdir(dst)
    assert MANIFEST_NAME not in left and left  # killed midway: shards, no dataset
    # What a task killed inside a write leaves: a temp file with part of a shard.
    with open(os.path.join(dst, f"shard-00003-000000.pyl.{proc.pid}.0123abcd.part"), "wb") as fh:
        fh.write(b"PYL-half")
    # And a shard of a task the killed run finished under a name this run will not write.
    with open(os.path.join(dst, "shard-09999-000000.pyl"), "wb") as fh:
        fh.write(b"stale")

    pyloader.convert(src, dst, shard_size="32K", task_size="64K", engine="dask", scheduler=client, verify=True)
    a, b = files_of(dst), files_of(clean)
    assert manifest(dst) == manifest(clean)
    assert sorted(a) == sorted(b) == sorted(shard_names(clean) | {MANIFEST_NAME, "convert.json"})
    assert all(a[n] == b[n] for n in a)


@pytest.mark.timeout(60)
def test_a_failing_task_names_the_file_and_writes_no_manifest(tmp_path, client):
    src = write_corpus(str(tmp_path / "src"), files=3, rows=1200, row_group=150)
    bad = os.path.join(src, "part-1.parquet")
    col = pq.ParquetFile(bad).metadata.row_group(3).column(0)
    off = col.dictionary_page_offset or col.data_page_offset
    with open(bad, "rb") as fh:
        data = bytearray(fh.read())
    data[off:off + 40] = bytes(b ^ 0xFF for b in data[off:off + 40])  # a page header of row group 3
    with open(bad, "wb") as fh:
        fh.write(data)
    dst = str(tmp_path / "out")
    with pytest.raises(pyloader.ConvertError, match=r"part-1\.parquet: row group 3: cannot be read"):
        pyloader.convert(src, dst, shard_size="16K", task_size="32K", engine="dask", scheduler=client)
    assert not os.path.exists(dst)  # neither a manifest nor the shards of the tasks that succeeded, nor the folder


@pytest.mark.timeout(60)
def test_cli_engine_dask(tmp_path, capsys):
    src = write_corpus(str(tmp_path / "src"), files=2, rows=600, row_group=100)
    dst = str(tmp_path / "out")
    assert CLI.main(["convert", src, dst, "--engine", "dask", "--jobs", "2", "--shard-size", "16K",
                     "--task-size", "32K", "--verify", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "dask" and out["jobs"] == 2 and out["records"] == 1200 and out["verified"]
    assert CLI.main(["convert", src, dst, "--verify-only"]) == 0
    assert CLI.main(["convert", src, str(tmp_path / "x"), "--scheduler", "tcp://127.0.0.1:1"]) == 2
    assert "--engine dask" in capsys.readouterr().err
    assert CLI.main(["convert", src, str(tmp_path / "x"), "--engine", "dask", "--scheduler", "tcp://127.0.0.1:1",
                     "--jobs", "2"]) == 2
    with pytest.raises(ValueError, match="engine must be one of"):
        pyloader.convert(src, str(tmp_path / "y"), engine="ray")
