"""pyloader.DataLoader over a ParquetDataset: exact and elastic resume, and states refused for other data.

Real Parquet files with several row groups each; ranks are simulated by one loader per
rank stepped in lockstep (as in tests/distributed/test_loader_state.py), read with several
threads and deep prefetch so that states are taken with batches already collated.
"""

from __future__ import annotations

import collections
import io
import json
import os
import shutil
from typing import Any

import pytest
from convert_util import mixed_table, pa, pq, write_parquet
from resume_util import common_state, lockstep

import pyloader

N = 130 + 77 + 41


def _write(d: Any) -> str:
    d.mkdir()
    write_parquet(d / "a.parquet", mixed_table(130), row_group_size=25)
    write_parquet(d / "b.parquet", mixed_table(77, start=130), row_group_size=30)
    (d / "sub").mkdir()
    write_parquet(d / "sub" / "c.parquet", mixed_table(41, start=207), row_group_size=9)
    return str(d)


@pytest.fixture
def pq_dir(tmp_path) -> str:
    return _write(tmp_path / "pq")


def loaders(path: str | list[str], world: int, batch: int, *, columns: tuple[str, ...] = ("id", "tokens"),
            threads: int = 2, prefetch: int = 6, **ds_kw: Any) -> list[pyloader.DataLoader]:
    ds_kw.setdefault("shuffle", True)
    ds_kw.setdefault("seed", 5)
    return [pyloader.DataLoader(pyloader.ParquetDataset(path, columns=list(columns), rank=r, world_size=world,
                                                        **ds_kw),
                                batch_size=batch, num_workers=threads, prefetch=prefetch)
            for r in range(world)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["global", "window"])
@pytest.mark.parametrize("stops", [[1], [4, 3]])
def test_mid_epoch_resume_gives_exactly_the_remaining_batches(pq_dir, mode, stops):
    kw = dict(shuffle_mode=mode, window=40)
    want = lockstep([iter(loader) for loader in loaders(pq_dir, 3, 8, **kw)], None, "id")
    got: list[list[list[int]]] = [[] for _ in range(3)]
    state = None
    for steps in [*stops, None]:
        ls = loaders(pq_dir, 3, 8, threads=3, prefetch=8, **kw)  # a fresh job each time
        if state is not None:
            for loader in ls:
                loader.load_state_dict(state)
        its = [iter(loader) for loader in ls]
        for r, batches in enumerate(lockstep(its, steps, "id")):
            got[r] += batches
        state = common_state(ls)
        del its, ls
    assert got == want
    assert state["epoch"] == 1 and state["segments"] == []
    # The following epoch continues as an uninterrupted loader's would.
    ls = loaders(pq_dir, 3, 8, **kw)
    for loader in ls:
        loader.load_state_dict(state)
    again = loaders(pq_dir, 3, 8, **kw)
    for loader in again:
        loader.set_epoch(1)
    assert lockstep([iter(x) for x in ls], None, "id") == lockstep([iter(x) for x in again], None, "id")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("partition", ["pad", "drop"])
@pytest.mark.parametrize("jobs", [[(4, 3, 5), (3, 4, 4), (2, 6, None)], [(2, 8, 3), (5, 2, None)]])
def test_resume_at_another_world_size_reads_every_remaining_sample_once(pq_dir, partition, jobs):
    seen: collections.Counter[int] = collections.Counter()
    state = None
    worlds = []
    for world, batch, steps in jobs:
        worlds.append(world)
        ls = loaders(pq_dir, world, batch, partition=partition, shuffle_mode="window", window=30)
        if state is not None:
            for loader in ls:
                loader.load_state_dict(state)
        for batches in lockstep([iter(loader) for loader in ls], steps, "id"):
            for b in batches:
                seen.update(b)
        state = common_state(ls)
        assert len(json.dumps(state)) < 500
    assert state["epoch"] == 1 and state["segments"] == []
    repeats = sum(seen.values()) - len(seen)
    if partition == "pad":
        assert sorted(seen) == list(range(N))  # ids are the global row numbers, files in path order
        assert max(seen.values()) <= 2 and repeats <= sum(w - 1 for w in worlds)
    else:
        assert repeats == 0 and N - len(seen) < worlds[-1]


def _stopped_state(path: str, **kw: Any) -> dict[str, Any]:
    (loader,) = loaders(path, 1, 10, **kw)
    it = iter(loader)
    for _ in range(3):
        next(it)
    return common_state([loader])


@pytest.mark.timeout(60)
def test_a_modified_file_is_refused_naming_what_differs(pq_dir):
    state = _stopped_state(pq_dir)
    assert state["segments"] == [[1, 10, 3]]
    assert set(state["dataset_parts"]) == {"paths", "row_groups", "footers", "columns"}
    target = os.path.join(pq_dir, "b.parquet")
    st = os.stat(target)
    # Same rows, same row groups, same size, mtime put back: one value changed (the last
    # row group's largest id). A listing's (size, mtime) cannot see it; the footer's
    # statistics do.
    table = mixed_table(77, start=130)
    ids = table.column("id").to_pylist()
    ids[76] = 1000
    buf = io.BytesIO()
    pq.write_table(table.set_column(0, "id", pa.array(ids, pa.int64())), buf, row_group_size=30)
    with open(target, "wb") as f:
        f.write(buf.getvalue())
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(target).st_size, os.stat(target).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    (loader,) = loaders(pq_dir, 1, 10)
    with pytest.raises(pyloader.ResumeError, match=r"another dataset .*\(differing in: footers\)"):
        loader.load_state_dict(state)
    with pytest.raises(ValueError, match="another dataset"):  # ResumeError is a ValueError
        loader.load_state_dict(state)


@pytest.mark.timeout(60)
def test_other_row_groups_files_or_columns_are_refused_naming_each(pq_dir, tmp_path):
    state = _stopped_state(pq_dir)
    # The same rows in other row groups.
    regrouped = _write(tmp_path / "regrouped")
    write_parquet(os.path.join(regrouped, "a.parquet"), mixed_table(130), row_group_size=26)
    (loader,) = loaders(regrouped, 1, 10)
    with pytest.raises(pyloader.ResumeError, match=r"differing in: row_groups, footers\)"):
        loader.load_state_dict(state)
    # A file renamed (the same bytes).
    renamed = _write(tmp_path / "renamed")
    os.rename(os.path.join(renamed, "b.parquet"), os.path.join(renamed, "b2.parquet"))
    (loader,) = loaders(renamed, 1, 10)
    with pytest.raises(pyloader.ResumeError, match=r"differing in: paths\)"):
        loader.load_state_dict(state)
    # A file missing: fewer records, and the listing differs.
    os.remove(os.path.join(renamed, "b2.parquet"))
    (loader,) = loaders(renamed, 1, 10)
    with pytest.raises(pyloader.ResumeError, match=r"\d+ records.*differing in: paths, row_groups, footers\)"):
        loader.load_state_dict(state)
    # Other columns of the same files.
    (loader,) = loaders(pq_dir, 1, 10, columns=("id", "text"))
    with pytest.raises(pyloader.ResumeError, match=r"differing in: columns\)"):
        loader.load_state_dict(state)


@pytest.mark.timeout(60)
def test_the_same_files_elsewhere_resume(pq_dir, tmp_path):
    """The fingerprint names the data, not where it lies: a copy (new mtimes), a list of its files, a cache."""
    state = _stopped_state(pq_dir)
    (full,) = lockstep([iter(loaders(pq_dir, 1, 10)[0])], None, "id")
    assert sorted(x for b in full for x in b) == list(range(N))
    copy = str(tmp_path / "copy")
    shutil.copytree(pq_dir, copy)  # new mtimes
    for src in (copy, [os.path.join(copy, "a.parquet"), os.path.join(copy, "b.parquet"),
                       os.path.join(copy, "sub", "c.parquet")]):
        (loader,) = loaders(src, 1, 10)
        if isinstance(src, list):  # files named alone are named by their base names
            with pytest.raises(pyloader.ResumeError, match=r"differing in: paths\)"):
                loader.load_state_dict(state)
            continue
        loader.load_state_dict(state)
        (got,) = lockstep([iter(loader)], None, "id")
        assert got == full[3:]

    fsspec = pytest.importorskip("fsspec")
    mem = fsspec.filesystem("memory")
    for rel in ("a.parquet", "b.parquet", "sub/c.parquet"):
        with open(os.path.join(pq_dir, rel), "rb") as f:
            mem.pipe(f"/pyl-resume/data/{rel}", f.read())
    try:
        for _ in range(2):  # footers read from the store, then from the node cache
            (loader,) = loaders("memory://pyl-resume/data", 1, 10, cache_dir=str(tmp_path / "cache"))
            loader.load_state_dict(state)
            (got,) = lockstep([iter(loader)], None, "id")
            assert got == full[3:]
    finally:
        mem.rm("/pyl-resume", recursive=True)


@pytest.mark.timeout(60)
def test_a_window_state_without_the_file_first_order_is_refused(pq_dir):
    """A window shuffle of a ParquetDataset orders files first (NOTE [window size]): a state
    saved by a window order of row groups alone (a state without ``window_units``, as an
    older pyloader wrote it) names another order, and is refused rather than resumed
    into other samples."""
    state = _stopped_state(pq_dir, shuffle_mode="window", window=40)
    assert state["window_units"] == "files"
    (loader,) = loaders(pq_dir, 1, 10, shuffle_mode="window", window=40)
    loader.load_state_dict(dict(state))  # its own state resumes
    old = {k: v for k, v in state.items() if k != "window_units"}
    (loader,) = loaders(pq_dir, 1, 10, shuffle_mode="window", window=40)
    with pytest.raises(pyloader.ResumeError, match="window_units='units' but this loader uses window_units='files'"):
        loader.load_state_dict(old)
    (loader,) = loaders(pq_dir, 1, 10, shuffle_mode="global")  # a global shuffle does not depend on it
    loader.load_state_dict({**old, "shuffle_mode": "global"})
