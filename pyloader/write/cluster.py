"""``convert(engine="dask")``: convert's tasks on a Dask cluster (``dask.distributed``).

NOTE [dask convert]: the source is cut into tasks by ``plan_tasks``: contiguous ranges
of units (Parquet row groups, Arrow batches, ranges of numpy rows, files, tars) of about
``task_size`` source bytes, a pure function of the source and ``task_size``, never of
the cluster: any number of workers, a re-run, or a task that Dask runs again after
losing its worker, writes the same shards. Task ``k`` encodes its units into shards
``shard-[<token>-]<k:05d>-<n:06d>.pyl``, publishes each (NOTE [atomic publish]; NOTE
[remote publish] for a URL) and returns only their manifest entries (name, records,
bytes, xxh64) with its record and byte counts. The client keeps the results in task
order, so the record order is the source order, and writes the one manifest, last.

A task that fails sets a ``distributed.Event`` that the others look at between chunks
(at most twice a second): they stop and remove their own shards. The client waits for
every task to end before it removes what the run wrote, so no task writes after the
clean-up. A run killed outright (the client, the workers, the machine) leaves shards
and temp files that no manifest lists; convert's next run at that destination removes
them before it starts and, after publishing, removes every shard the new manifest does
not list (``remove_leftovers`` in convert.py). A re-run without ``overwrite`` writes the
same names, so it reproduces a clean run's dataset byte for byte.

Without a scheduler, a ``LocalCluster`` of ``jobs`` worker processes (one thread each,
no dashboard) is started and closed around the run. Given an address, the client
connects to that scheduler; given a ``distributed.Client``, it is used and left open.
On a real cluster every worker must read the source at the same path (a shared
filesystem) and reach the destination (a URL, or a shared folder).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import ConvertError
from ..format.encode import DatasetStore
from .sources import Source

# convert.run_job, passed in (convert imports this module, not the other way round).
RunJob = Callable[..., dict[str, Any]]

_STOP_POLL_S = 0.5


def plan_tasks(unit_bytes: list[int], task_bytes: int) -> list[tuple[int, int]]:
    """Contiguous unit ranges of at least ``task_bytes`` source bytes each (the last may hold less).

    A unit larger than ``task_bytes`` is a task of its own. Depends on nothing else, so
    the same source and ``task_bytes`` give the same tasks (NOTE [dask convert]).
    """
    out: list[tuple[int, int]] = []
    lo, acc = 0, 0
    for u, nb in enumerate(unit_bytes):
        acc += max(int(nb), 1)
        if acc >= task_bytes:
            out.append((lo, u + 1))
            lo, acc = u + 1, 0
    if lo < len(unit_bytes) or not out:
        out.append((lo, len(unit_bytes)))
    return out


def describe_units(source: Source, lo: int, hi: int) -> str:
    """Where units ``lo`` to ``hi`` (exclusive) come from, for messages: files and row groups, or rows."""
    paths = getattr(source, "paths", None)
    if source.kind == "parquet" and isinstance(paths, list):
        (i0, j0), (i1, j1) = source.units[lo], source.units[hi - 1]
        if i0 == i1:
            return f"{paths[i0]}: row groups {j0}-{j1}"
        return f"{paths[i0]} row group {j0} to {paths[i1]} row group {j1}"
    if source.kind == "tar" and isinstance(paths, list):
        return ", ".join(paths[source.units[u]] for u in range(lo, hi))
    row0 = source.unit_row0()
    end = row0[hi - 1] + source.unit_records[hi - 1]
    return f"records {row0[lo]}-{end - 1} of the {source.kind} source"


def _task(run_job: RunJob, k: int, source: Source, store: DatasetStore, compress: list[bool], shard_bytes: int,
          prefix: str, lo: int, hi: int, stop_name: str) -> dict[str, Any]:
    """Runs on a worker: converts units ``lo`` to ``hi`` into shards ``<prefix><n:06d>.pyl``."""
    from distributed import Event

    stop = Event(stop_name)
    last = [time.monotonic()]

    def stopped() -> bool:
        now = time.monotonic()
        if now - last[0] < _STOP_POLL_S:
            return False
        last[0] = now
        return bool(stop.is_set())

    try:
        out = run_job(source, store, compress, shard_bytes, prefix, lo, hi, None, stopped)
    except BaseException:
        with contextlib.suppress(Exception):  # the others stop at their next look
            stop.set()
        raise
    out["task"] = k
    return out


@contextlib.contextmanager
def _client(scheduler: Any, jobs: int) -> Iterator[Any]:
    try:
        import distributed
    except ImportError:
        raise ImportError("engine='dask' needs dask and distributed: pip install 'pyloader[dask]'") from None
    if isinstance(scheduler, distributed.Client):
        yield scheduler
        return
    if scheduler is not None:
        if not isinstance(scheduler, str):
            raise ValueError(f"scheduler must be an address (str) or a distributed.Client, got {type(scheduler).__name__}")
        with distributed.Client(scheduler) as client:
            yield client
        return
    # No dashboard; the scheduler's HTTP endpoints (health, metrics) on a free port, not 8787.
    with distributed.LocalCluster(n_workers=jobs, threads_per_worker=1, processes=True, dashboard_address=None,
                                  scheduler_kwargs={"dashboard_address": ":0"}) as lc, \
            distributed.Client(lc) as client:
        yield client


def run_tasks(run_job: RunJob, source: Source, store: DatasetStore, compress: list[bool], shard_bytes: int,
              token: str, ranges: list[tuple[int, int]], report: Callable[[int, int], None], scheduler: Any,
              jobs: int) -> tuple[list[dict[str, Any]], int]:
    """Runs the tasks ``ranges`` on the cluster (NOTE [dask convert]); (results in task order, workers).

    ``run_job`` is convert's (it converts one task's units); ``report(records, bytes)``
    is called as each task ends.

    Waits for every task to end before raising the first failure; the caller removes
    what the run wrote. A task whose worker died three times (``KilledWorker``) raises
    ConvertError naming its units.
    """
    import distributed

    with _client(scheduler, jobs) as client:
        workers = len(client.scheduler_info().get("workers", {})) or jobs
        run = uuid.uuid4().hex[:12]
        stop_name = f"pyloader-convert-{run}"
        stop = distributed.Event(stop_name, client=client)
        src = client.scatter(source, hash=False)
        futs = [client.submit(_task, run_job, k, src, store, compress, shard_bytes, f"shard-{token}{k:05d}-", lo, hi,
                              stop_name, key=f"pyloader-convert-{run}-{k}", pure=False)
                for k, (lo, hi) in enumerate(ranges)]
        done: list[dict[str, Any] | None] = [None] * len(ranges)
        error: BaseException | None = None
        try:
            for f in distributed.as_completed(futs):
                k = int(str(f.key).rsplit("-", 1)[1])
                try:
                    r = f.result()
                except distributed.KilledWorker as e:
                    err: BaseException = ConvertError(f"task {k} ({describe_units(source, *ranges[k])}) failed: "
                                                      f"its worker died ({e})")
                except Exception as e:  # noqa: BLE001 - re-raised below, the first failure wins
                    err = e
                else:
                    done[k] = r
                    report(r["records"], r["bytes_in"])
                    continue
                if error is None:
                    error = err
                    stop.set()
        except BaseException:
            stop.set()
            raise
        if error is not None:
            raise error
        return [r for r in done if r is not None], workers


__all__ = ["RunJob", "plan_tasks", "describe_units", "run_tasks"]
