"""pyloader on many nodes, on paper and in simulation: what a job of ``--nodes`` x ``--ranks``
readers over ``--shards`` shards of ``--shard-bytes`` asks of the store, the node and the planner.

Every number is either *computed* from pyloader's own code and documented behaviour, or
*measured* here; the JSON says which (``"how"``). Sections:

1. manifest: GETs per node and in all, their rate if every node starts within
   ``--start-spread`` seconds (NOTE [manifest once per node] in pyloader/remote/manifest.py);
   the manifest's size (a real one, made with ``dump_manifest``) and, measured in a fresh
   process, ``ShardDataset`` construction over it (parse, checks) and its memory;
2. shard GETs: for a few sampled nodes, the real plan of each of their ranks
   (``pyloader.read.order.plan`` at world size nodes x ranks): shards each rank reads, shards
   the node downloads (the union: the node cache downloads a shard once per node), bytes,
   against the node's share (shards / nodes); window mode for sampled nodes, global
   shuffle for one node (or, past ``--max-plan-records``, the expected count);
3. request rate per bucket prefix at ``--node-mb-s`` sample bytes consumed per node,
   against S3's 5,500 GET/HEAD per second per partitioned prefix; and a discrete-event
   simulation that drives the real ``HostLimiter`` (pyloader/remote/throttle.py) and the real
   ``RetryPolicy.throttle_pause`` (fs.py) of every rank's process against a server that
   answers SlowDown above the prefix limit: window, GETs/s achieved, throttles. A download
   is as many GETs as the transport makes of it (``--transport native``, the default where
   libcurl loads: parallel ranged GETs for a shard of 64 MiB or more; ``fsspec``: one);
4. planning time and state size per rank, measured: ``plan`` of one rank (window and
   global), ``resume_plan`` after a stop (its time and peak memory, in a fresh process),
   ``DataLoader.state_dict()`` of a ``ShardDataset`` over a manifest of ``--shards`` entries;
5. the cache working set per rank and node (``pyloader.remote.fetch.working_set`` with
   ``--batch-size`` and ``--threads``), and what ``cache_limit`` the share check asks for;
6. the limits each number is compared with, and which it crosses.

The simulation's clock is virtual: the limiter module's ``time`` is replaced by the
simulation's clock while it runs (and restored); nothing sleeps. A job waiting for a
paused host is not counted as waiting by the limiter (the real one is), so the simulated
window widens a little more slowly than the real one.

Usage: python benchmarks/sim_scale.py [--nodes 1024 --ranks 8 --shards 100000 --shard-bytes 100MB]
       [--json PATH]. The default run takes under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

S3_GET_PER_PREFIX = 5500  # GET/HEAD requests per second per partitioned prefix (S3's published figure)
S3_PUT_PER_PREFIX = 3500  # PUT/COPY/POST/DELETE per second per partitioned prefix


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _size(text: str) -> int:
    """``100MB`` / ``100M`` / ``1e8`` -> bytes (decimal units: 1 MB = 10**6 bytes)."""
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def _fmt_bytes(n: float) -> str:
    for unit, k in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.0f} B"


def _status_kb(key: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process in KiB; the peak from getrusage where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _rss_kb() -> int:
    return _status_kb("VmRSS")


def _peak_kb() -> int:
    return _status_kb("VmHWM")


# -- measured in a fresh process (peak memory is per process) -------------------------------------
def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement in this (fresh) process; ``spec["what"]`` says which."""
    from pyloader.read import order

    what = spec["what"]
    if what == "open":
        from pyloader.loader.dataloader import DataLoader
        from pyloader.read.shards import ShardDataset

        base = _rss_kb()  # after the imports (torch's among them)
        t0 = time.perf_counter()
        ds = ShardDataset(spec["dir"], shuffle=True, shuffle_mode="window", window=spec["window"],
                                   rank=spec["rank"], world_size=spec["world"])
        t_open = time.perf_counter() - t0
        rss = _peak_kb() - base
        t0 = time.perf_counter()
        ds.plan()
        t_plan = time.perf_counter() - t0
        loader = DataLoader(ds, batch_size=spec["batch"], num_workers=spec["threads"])
        state = loader.state_dict()
        fresh = len(json.dumps(state))
        # A state after a stop at this world size and a resume at half of it: two segments.
        w, b, n = spec["world"], spec["batch"], ds.num_records
        s1 = min(3, _ceil_div(_ceil_div(n, w), b))
        left = order.unread_count(n, segments=[[w, b, s1]])
        s2 = min(2, _ceil_div(_ceil_div(left, max(1, w // 2)), b)) if left else 0
        state["segments"] = [[w, b, s1], [max(1, w // 2), b, s2]]
        loader.load_state_dict(state)
        resumed = len(json.dumps(loader.state_dict()))
        return {"open_s": t_open, "open_rss_bytes": rss * 1024, "dataset_plan_s": t_plan,
                "state_bytes": fresh, "state_bytes_two_segments": resumed, "state": loader.state_dict()}
    rps = [int(spec["records"])] * int(spec["shards"])  # a list, as ShardDataset passes its records per shard
    kw: dict[str, Any] = dict(shuffle=True, seed=0, epoch=0, rank=spec["rank"], world_size=spec["world"],
              shuffle_mode=spec["mode"], window=spec["window"])
    base = _rss_kb()
    t0 = time.perf_counter()
    if what == "plan":
        sidx, _ = order.plan(rps, **kw)
    else:  # resume: a stop after ``steps`` batches, resumed at the same world size
        sidx, _ = order.resume_plan(rps, segments=[[spec["world"], spec["batch"], spec["steps"]]], **kw)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "peak_rss_bytes": (_peak_kb() - base) * 1024, "samples": int(sidx.size)}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                       capture_output=True, text=True, env=env, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"measurement {spec['what']} failed:\n{p.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


# -- 1. manifest --------------------------------------------------------------------------------
def make_manifest_dataset(d: str, shards: int, records: int, shard_bytes: int) -> int:
    """A local dataset folder whose manifest lists ``shards`` entries as a written one does.

    The shard files are empty: nothing measured here reads one, but opening a local dataset
    lists their folder and refuses one that is missing. Returns the manifest's size in bytes.
    """
    import pyloader._C as _C
    from pyloader.format.spec import MANIFEST_NAME, dump_manifest

    body = {"format": "pyloader-shards", "version": 1,
            "fields": [{"name": "x", "dtype": "uint8", "shape": [None]}, {"name": "label", "dtype": "int64",
                                                                         "shape": []}],
            "records": shards * records,
            "shards": [{"path": f"shard-{i:06d}.pyl", "records": records, "bytes": shard_bytes,
                        "xxh64": f"{(i * 0x9E3779B97F4A7C15) % (1 << 64):016x}"} for i in range(shards)]}
    data = dump_manifest(body, _C.xxh64)
    with open(os.path.join(d, MANIFEST_NAME), "wb") as f:
        f.write(data)
    for entry in body["shards"]:
        open(os.path.join(d, entry["path"]), "wb").close()
    return len(data)


def manifest_section(a: argparse.Namespace, mbytes: int, opened: dict[str, Any]) -> dict[str, Any]:
    per_node = 1  # one GET per node per TTL, whatever its ranks (See NOTE [manifest once per node])
    total = per_node * a.nodes
    return {
        "gets_per_node": {"value": per_node, "how": "computed: NOTE [manifest once per node] (one GET per node "
                          "while the node copy is fresh; tests/remote/test_manifest_once.py)"},
        "gets_total": {"value": total, "how": "computed"},
        "gets_per_s_at_start": {"value": total / a.start_spread,
                                "how": f"computed: nodes / --start-spread ({a.start_spread:g} s), one key"},
        "gets_per_s_without_node_copy": {"value": a.nodes * a.ranks / a.start_spread,
                                         "how": "computed: PYLOADER_MANIFEST_TTL=0, every rank fetches"},
        "manifest_bytes": {"value": mbytes, "how": "measured: dump_manifest of the entries"},
        "bytes_total_at_start": {"value": mbytes * total, "how": "computed"},
        "open_s_per_rank": {"value": opened["open_s"], "how": "measured: ShardDataset(...) over the manifest, "
                            "local, fresh process (parse, checks)"},
        "open_rss_bytes_per_rank": {"value": opened["open_rss_bytes"], "how": "measured: peak RSS growth"},
        "open_rss_bytes_per_node": {"value": opened["open_rss_bytes"] * a.ranks, "how": "computed: x ranks"},
    }


def writes_section(a: argparse.Namespace) -> dict[str, Any]:
    """PUTs that writing the dataset to S3 makes: one ``pipe_file`` per shard, then the manifest."""
    chunk = 50 * 2**20  # s3fs: one put_object below 2 x its 50 MiB chunk, a multipart upload above
    per_shard = 1 if a.shard_bytes < 2 * chunk else 2 + -(-a.shard_bytes // chunk)
    puts = a.shards * per_shard + 1
    rate = a.writers * per_shard / (a.rtt + a.shard_bytes / (a.conn_mb_s * 1e6))
    return {"how": "computed: pyloader.write.store puts each shard with fsspec pipe_file (s3fs: put_object, or "
                   "create + parts + complete)", "requests_per_shard": per_shard, "puts_total": puts,
            "writers": a.writers, "puts_per_s": rate, "limit": S3_PUT_PER_PREFIX}


# -- 2. shard GETs ------------------------------------------------------------------------------
def sampled_nodes(nodes: int, k: int) -> list[int]:
    picks = sorted({int(round(i * (nodes - 1) / max(1, k - 1))) for i in range(k)}) if k > 1 else [0]
    return picks[:k]


def expected_distinct(shards: int, records: int, samples: int) -> float:
    """Expected shards touched by ``samples`` ids drawn without replacement from ``shards`` x ``records``."""
    n = shards * records
    k = min(samples, n)
    # P(a shard untouched) = C(n - r, k) / C(n, k) ~= (1 - k / n) ** r for r << n
    return float(shards * (1.0 - (1.0 - k / n) ** records))


def node_reads(a: argparse.Namespace, mode: str, node: int, sizes: np.ndarray, horizon: int) -> dict[str, Any]:
    """The real plans of one node's ranks: shards per rank, the node's union, working sets, plan time."""
    from pyloader.read import order
    from pyloader.remote.fetch import working_set

    rps = [a.records_per_shard] * a.shards  # a list, as ShardDataset passes its records per shard
    world = a.nodes * a.ranks
    union: list[np.ndarray] = []
    per_rank, ws_bytes, ws_shards, plan_s = [], [], [], []
    samples = 0
    for r in range(node * a.ranks, (node + 1) * a.ranks):
        t0 = time.perf_counter()
        sidx, _ = order.plan(rps, shuffle=True, seed=a.seed, epoch=0, rank=r, world_size=world,
                             shuffle_mode=mode, window=a.window)
        plan_s.append(time.perf_counter() - t0)
        samples = int(sidx.size)
        u = np.unique(sidx)
        union.append(u)
        per_rank.append(int(u.size))
        b, c = working_set(sidx, sizes, horizon)
        ws_bytes.append(b)
        ws_shards.append(c)
    node_shards = int(np.unique(np.concatenate(union)).size)
    return {"node": node, "samples_per_rank": samples, "shards_per_rank": per_rank, "node_shards": node_shards,
            "working_set_bytes": ws_bytes, "working_set_shards": ws_shards, "plan_s": plan_s}


def reads_section(a: argparse.Namespace, horizon: int) -> dict[str, Any]:
    sizes = np.full(a.shards, a.shard_bytes, np.int64)
    share = a.shards / a.nodes
    n = a.shards * a.records_per_shard
    world = a.nodes * a.ranks
    out: dict[str, Any] = {"share_shards_per_node": share, "share_bytes_per_node": share * a.shard_bytes,
                           "samples_per_rank": -(-n // world)}
    for mode in ("window", "global"):
        k = a.sample_nodes if mode == "window" else 1
        if mode == "global" and n > a.max_plan_records:
            per_node = expected_distinct(a.shards, a.records_per_shard, a.ranks * -(-n // world))
            per_rank = expected_distinct(a.shards, a.records_per_shard, -(-n // world))
            out[mode] = {"how": f"computed: expected distinct shards ({n} records > --max-plan-records)",
                         "node_shards": per_node, "shards_per_rank": per_rank,
                         "node_bytes": per_node * a.shard_bytes, "amplification": per_node / share}
            continue
        rows = [node_reads(a, mode, node, sizes, horizon) for node in sampled_nodes(a.nodes, k)]
        node_shards = float(np.mean([r["node_shards"] for r in rows]))
        out[mode] = {
            "how": f"computed: pyloader.read.order.plan of every rank of nodes "
                   f"{[r['node'] for r in rows]} at world size {world}",
            "nodes": rows, "node_shards": node_shards, "node_shards_max": max(r["node_shards"] for r in rows),
            "shards_per_rank": float(np.mean([x for r in rows for x in r["shards_per_rank"]])),
            "node_bytes": node_shards * a.shard_bytes, "amplification": node_shards / share,
            "expected_node_shards_if_random": expected_distinct(a.shards, a.records_per_shard,
                                                                a.ranks * -(-n // world)),
            "working_set_bytes_per_rank": max(x for r in rows for x in r["working_set_bytes"]),
            "working_set_shards_per_rank": max(x for r in rows for x in r["working_set_shards"]),
            "plan_s_per_rank": float(np.median([x for r in rows for x in r["plan_s"]])),
        }
    return out


# -- 3. request rate and the AIMD window ------------------------------------------------------------
def rate_section(a: argparse.Namespace, reads: dict[str, Any]) -> dict[str, Any]:
    share_bytes = reads["share_bytes_per_node"]
    rows = []
    for mbs in a.rates:
        rate = mbs * 1e6
        epoch_s = share_bytes / rate
        row: dict[str, Any] = {"node_mb_s": mbs, "epoch_s": epoch_s}
        for mode in ("window", "global"):
            downloads = a.nodes * reads[mode]["node_shards"] / epoch_s
            gets = downloads * a.parts
            row[f"{mode}_downloads_per_s"] = downloads
            row[f"{mode}_gets_per_s"] = gets
            row[f"{mode}_gets_per_s_per_prefix"] = gets / a.prefixes
            row[f"{mode}_prefixes_needed"] = math.ceil(gets / S3_GET_PER_PREFIX)
            row[f"{mode}_node_download_mb_s"] = reads[mode]["node_shards"] * a.shard_bytes / epoch_s / 1e6
        rows.append(row)
    top = S3_GET_PER_PREFIX * a.prefixes * share_bytes / (a.nodes * reads["window"]["node_shards"] * a.parts) / 1e6
    return {"how": f"computed: nodes x shards each node downloads per epoch / epoch seconds, x {a.parts} GET "
                   f"requests per download ({a.transport} transport)", "rows": rows,
            "window_max_node_mb_s_for_prefixes": top}


class _Clock:
    """The simulation's clock, standing in for the ``time`` module of the limiter."""

    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t


class _Client:
    """One reader process: its ``HostLimiter`` for the bucket, ``jobs`` download threads, shards to fetch."""

    def __init__(self, lim: Any, jobs: int, rate: float, phase: float) -> None:
        self.lim = lim
        self.jobs = jobs
        self.rate = rate
        self.phase = phase
        self.queue: list[int] = []  # prefixes of the shards waiting to be fetched
        self.pause_until = 0.0
        self.wake_at = -1.0
        self.slots: dict[int, Any] = {}
        self.parts = 1  # GETs per download: the transport's ranged parts, until a throttle (NOTE [transport choice])


def simulate(a: argparse.Namespace, clients: int, offered: float, prefixes: int, seconds: float) -> dict[str, Any]:
    """Drives one real ``HostLimiter`` per reader process against a throttling store (see the module docstring).

    ``offered``: shard downloads per second all readers need; ``clients`` readers share it.
    A download is ``a.parts`` GET requests at once (the native transport's ranged parts,
    or one whole GET), holding one place in its reader's window. The store admits
    ``S3_GET_PER_PREFIX`` requests per second per prefix (a token bucket holding one second
    of them) and answers the rest ``SlowDown`` after ``--rtt``; an admitted request takes
    ``--rtt`` plus its part at ``--conn-mb-s``. A download with a throttled part is a
    throttled attempt once its parts have ended, and is tried again whole; from then on the
    reader's transport makes one GET per download (See NOTE [transport choice]), unless
    ``--keep-ranges`` (the behaviour before that rule).
    """
    from pyloader.remote import throttle
    from pyloader.remote.fs import RetryPolicy

    scale = max(1, math.ceil(clients / a.sim_max_clients))
    n = max(1, clients // scale)
    limit = S3_GET_PER_PREFIX / scale  # per prefix, for n = clients / scale readers
    policy = RetryPolicy()
    rng = random.Random(a.seed)
    random.seed(a.seed)  # RetryPolicy's jitter
    clock = _Clock()
    real_time = throttle.time
    throttle.time = clock  # type: ignore[assignment]
    try:
        lims = [throttle.HostLimiter(ceiling=64, name=f"s3://bucket#{i}") for i in range(n)]
        for lim in lims:
            lim.report_first_s = float("inf")  # no throttling reports from 1000s of simulated processes
        per = offered / scale / n
        cs = [_Client(lim, a.fetch_jobs, per, rng.random() / per if per > 0 else 0.0) for lim in lims]
        for c in cs:
            c.parts = a.parts
        tokens = [limit] * prefixes
        last_fill = [0.0] * prefixes
        cancel = threading.Event()
        cancel.set()  # slot() then grants at once or raises: a try-acquire
        ev: list[tuple[float, int, int, int, int]] = []  # (time, seq, kind, client, a job's token)
        seq = 0
        ARRIVE, DONE_OK, DONE_THROTTLED, WAKE = 0, 1, 2, 3

        def push(t: float, kind: int, c: int, tok: int = 0) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(ev, (t, seq, kind, c, tok))

        for i, c in enumerate(cs):
            if c.rate > 0:
                push(c.phase, ARRIVE, i)
        bins = int(math.ceil(seconds))
        ok = [0] * bins
        thr = [0] * bins
        window_mean = [0.0] * bins
        floor_share = [0.0] * bins
        next_sample = 0
        tokseq = 0
        def duration(parts: int) -> float:
            return a.rtt + _ceil_div(a.shard_bytes, parts) / (a.conn_mb_s * 1e6)

        dur_ok = duration(a.parts)
        req = [0] * bins  # requests the store answered, admitted or not
        wasted = [0] * bins  # admitted requests of attempts that were throttled

        def admit(p: int, t: float) -> bool:
            tokens[p] = min(limit, tokens[p] + (t - last_fill[p]) * limit)
            last_fill[p] = t
            if tokens[p] >= 1.0:
                tokens[p] -= 1.0
                return True
            return False

        def start(i: int, t: float) -> None:
            nonlocal tokseq
            c = cs[i]
            while c.queue and c.lim.in_flight < c.jobs:
                cm = c.lim.slot(cancel)
                try:
                    granted = cm.__enter__()
                except throttle._Cancelled:
                    if c.pause_until > t and c.wake_at < c.pause_until:
                        c.wake_at = c.pause_until
                        push(c.pause_until, WAKE, i)
                    return
                p = c.queue.pop(0)
                tokseq += 1
                c.slots[tokseq] = (cm, granted, p)
                admitted = sum(admit(p, t) for _ in range(c.parts))
                b = min(int(t), bins - 1)
                req[b] += c.parts
                if admitted == c.parts:
                    push(t + duration(c.parts), DONE_OK, i, tokseq)
                else:
                    wasted[b] += admitted
                    push(t + (duration(c.parts) if admitted else a.rtt), DONE_THROTTLED, i, tokseq)

        while ev:
            t, _, kind, i, tok = heapq.heappop(ev)
            if t >= seconds:
                break
            clock.t = t
            while next_sample <= t and next_sample < bins:
                window_mean[next_sample] = sum(c.lim.window for c in cs) / n
                floor_share[next_sample] = sum(c.lim.window == 1 for c in cs) / n
                next_sample += 1
            c = cs[i]
            if kind == ARRIVE:
                c.queue.append(rng.randrange(prefixes))
                push(t + 1.0 / c.rate, ARRIVE, i)
            elif kind in (DONE_OK, DONE_THROTTLED):
                cm, granted, p = c.slots.pop(tok)
                if kind == DONE_OK:
                    ok[int(t)] += 1
                    c.lim.ok()
                else:
                    thr[int(t)] += 1
                    # As fs.with_retries does: the pause from the policy, then the limiter's cut.
                    pause = policy.throttle_pause(c.lim.streak + 1, None)
                    c.lim.throttled(granted, pause, "S3 SlowDown")
                    c.pause_until = max(c.pause_until, t + pause)
                    c.queue.insert(0, p)  # the same shard is asked again
                    if not a.keep_ranges:
                        c.parts = 1  # NativeTransport.ranges = False: whole GETs from now on
                cm.__exit__(None, None, None)
            start(i, t)
        backlog = sum(len(c.queue) for c in cs) + sum(len(c.slots) for c in cs)
        whole = sum(c.parts == 1 for c in cs) / n
    finally:
        throttle.time = real_time
    half = bins // 2
    steady_ok = sum(ok[half:]) / max(1, bins - half) * scale
    steady_thr = sum(thr[half:]) / max(1, bins - half) * scale
    steady_req = sum(req[half:]) / max(1, bins - half) * scale
    steady_wasted = sum(wasted[half:]) / max(1, bins - half) * scale
    return {
        "how": f"simulated: {n} real HostLimiter objects{' (1/' + str(scale) + ' of the readers, limit scaled alike)' if scale > 1 else ''}, virtual clock",
        "readers": clients, "simulated_readers": n, "scale": scale, "prefixes": prefixes,
        "limit_gets_per_s": S3_GET_PER_PREFIX * prefixes, "gets_per_download": a.parts,
        "offered_downloads_per_s": offered, "offered_gets_per_s": offered * a.parts, "seconds": seconds,
        "success_s": dur_ok, "ok_per_s": [x * scale for x in ok], "throttled_per_s": [x * scale for x in thr],
        "requests_per_s": [x * scale for x in req], "steady_requests_per_s": steady_req,
        "steady_wasted_requests_per_s": steady_wasted,
        "window_mean": window_mean, "window_at_1": floor_share,
        "steady_ok_per_s": steady_ok, "steady_throttled_per_s": steady_thr,
        "steady_fraction_of_offered": steady_ok / offered if offered else 0.0,
        "backlog_shards_at_end": backlog * scale,
        "readers_on_whole_gets_at_end": whole,
        "floor_gets_per_s": clients * a.parts / dur_ok if a.keep_ranges else clients / duration(1),
        "readers_capacity_gets_per_s": clients * a.fetch_jobs * a.parts / dur_ok,
    }


# -- 4./5. planning, state, working set ---------------------------------------------------------------
def plan_section(a: argparse.Namespace, opened: dict[str, Any]) -> dict[str, Any]:
    world = a.nodes * a.ranks
    rank = world // 2 + 1
    n = a.shards * a.records_per_shard
    out: dict[str, Any] = {"rank": rank, "world_size": world}
    for mode in ("window", "global"):
        if mode == "global" and n > a.max_plan_records:
            out["plan_global"] = {"how": f"not measured: {n} records > --max-plan-records"}
            continue
        m = measure({"what": "plan", "shards": a.shards, "records": a.records_per_shard, "rank": rank,
                     "world": world, "mode": mode, "window": a.window})
        out[f"plan_{mode}"] = {"how": "measured: pyloader.read.order.plan, fresh process", **m}
    # resume_plan computes only the rank's positions, as plan does (NOTE [resume runs]): run at
    # every size, like the window plans
    steps = _ceil_div(_ceil_div(a.shards * a.records_per_shard, world), a.batch_size) // 2  # a stop half way
    m = measure({"what": "resume", "shards": a.shards, "records": a.records_per_shard, "rank": rank,
                 "world": world, "mode": "window", "window": a.window, "batch": a.batch_size, "steps": steps})
    how = f"measured: pyloader.read.order.resume_plan after {steps} of each rank's batches, fresh process"
    out["resume_window"] = {"how": how, **m,
                            "peak_rss_bytes_per_node": m["peak_rss_bytes"] * a.ranks}
    out["dataset_plan_s"] = {"value": opened["dataset_plan_s"], "how": "measured: ShardDataset.plan() of rank "
                             f"{rank} (window mode), after construction"}
    out["state_bytes"] = {"value": opened["state_bytes"], "how": "measured: len(json.dumps(DataLoader.state_dict()))"}
    out["state_bytes_two_segments"] = {"value": opened["state_bytes_two_segments"],
                                       "how": "measured: the same after load_state_dict of a state with two "
                                              "segments (a stop, a resume at half the world size)"}
    out["state"] = opened["state"]
    return out


def cache_section(a: argparse.Namespace, reads: dict[str, Any], horizon: int) -> dict[str, Any]:
    w = reads["window"]
    per_rank = w["working_set_bytes_per_rank"]
    return {"how": f"computed: pyloader.remote.fetch.working_set of the plans above, horizon {horizon} samples "
                   f"((2 x threads + threads) x batch_size, threads={a.threads}, batch_size={a.batch_size})",
            "per_rank_bytes": per_rank, "per_rank_shards": w["working_set_shards_per_rank"],
            "cache_limit_asked_per_node": per_rank * a.ranks,
            "node_epoch_download_bytes": w["node_bytes"],
            "global_needs_whole_plan_bytes": reads["global"]["node_bytes"]}


# -- 6. limits -------------------------------------------------------------------------------------
def limits(a: argparse.Namespace, r: dict[str, Any]) -> list[dict[str, Any]]:
    rate = r["rates"]["rows"][-1]
    node_ram = a.node_ram_gb * 1e9
    rows = [
        ("manifest GETs/s at start, one key", r["manifest"]["gets_per_s_at_start"]["value"], S3_GET_PER_PREFIX),
        (f"PUTs/s writing the dataset with {a.writers} writers", r["writes"]["puts_per_s"], S3_PUT_PER_PREFIX),
        ("manifest parse memory per node (bytes)", r["manifest"]["open_rss_bytes_per_node"]["value"], node_ram / 10),
        (f"shard GETs/s per prefix at {rate['node_mb_s']:g} MB/s per node (window)",
         rate["window_gets_per_s_per_prefix"], S3_GET_PER_PREFIX),
        ("GETs/s with every reader at window 1 (AIMD floor)", r["sim"][0]["floor_gets_per_s"],
         S3_GET_PER_PREFIX * a.prefixes),
        ("resume_plan peak memory per node (bytes)", r["plan"]["resume_window"]["peak_rss_bytes_per_node"],
         node_ram / 10),
        ("resume_plan seconds per rank", r["plan"]["resume_window"]["seconds"], 60.0),
        ("cache_limit the share check asks per node (bytes)", r["cache"]["cache_limit_asked_per_node"],
         a.node_cache_gb * 1e9),
        ("global shuffle: bytes each node downloads per epoch", r["reads"]["global"]["node_bytes"],
         a.node_cache_gb * 1e9),
    ]
    return [{"what": w, "value": v, "limit": lim, "crossed": bool(v > lim)} for w, v, lim in rows]


# -- report ----------------------------------------------------------------------------------------
def _table(rows: list[tuple[str, str, str]]) -> str:
    w0 = max(len(x[0]) for x in rows)
    w1 = max(len(x[1]) for x in rows)
    return "\n".join(f"  {x[0]:<{w0}}  {x[1]:>{w1}}  {x[2]}" for x in rows)


def report(a: argparse.Namespace, r: dict[str, Any]) -> str:
    m, rd, p, c = r["manifest"], r["reads"], r["plan"], r["cache"]
    w, g = rd["window"], rd["global"]
    lines = [f"pyloader at {a.nodes} nodes x {a.ranks} ranks, {a.shards} shards of {_fmt_bytes(a.shard_bytes)} "
             f"({_fmt_bytes(a.shards * a.shard_bytes)}), {a.records_per_shard} records per shard, window {a.window}",
             "", "manifest"]
    lines.append(_table([
        ("GETs per node / in all", f"{m['gets_per_node']['value']} / {m['gets_total']['value']}", "computed"),
        (f"GETs/s at start (within {a.start_spread:g} s)", f"{m['gets_per_s_at_start']['value']:.0f}",
         f"computed (TTL=0, every rank: {m['gets_per_s_without_node_copy']['value']:.0f})"),
        ("manifest size / all nodes", f"{_fmt_bytes(m['manifest_bytes']['value'])} / "
         f"{_fmt_bytes(m['bytes_total_at_start']['value'])}", "measured / computed"),
        ("ShardDataset open per rank", f"{m['open_s_per_rank']['value']:.2f} s, "
         f"{_fmt_bytes(m['open_rss_bytes_per_rank']['value'])}", "measured"),
    ]))
    wr = r["writes"]
    lines.append(_table([("writing the dataset: PUTs / at once", f"{wr['puts_total']} / {wr['puts_per_s']:.0f} "
                          f"per s", f"computed ({wr['requests_per_shard']} per shard, {wr['writers']} writers; "
                          f"S3: {S3_PUT_PER_PREFIX} PUT/s per prefix)")]))
    lines += ["", f"shard GETs per epoch (share: {rd['share_shards_per_node']:.1f} shards = "
              f"{_fmt_bytes(rd['share_bytes_per_node'])} per node; {rd['samples_per_rank']} samples per rank)"]
    rows = []
    for name, x in (("window", w), ("global", g)):
        how = "computed (plans)" if "order.plan" in x["how"] else "computed (expected)"
        rows.append((f"{name}: shards per rank / per node", f"{x['shards_per_rank']:.1f} / {x['node_shards']:.1f}",
                     how))
        rows.append((f"{name}: bytes per node, x share", f"{_fmt_bytes(x['node_bytes'])}, "
                     f"{x['amplification']:.2f}x", how))
    lines.append(_table(rows))
    lines += ["", f"request rate (all shards under {a.prefixes} prefix(es); {a.parts} GET request(s) per download, "
              f"{a.transport} transport; S3: {S3_GET_PER_PREFIX} GET/s per prefix)"]
    rows = []
    for row in r["rates"]["rows"]:
        rows.append((f"{row['node_mb_s']:g} MB/s per node: epoch {row['epoch_s']:.0f} s",
                     f"{row['window_gets_per_s_per_prefix']:.0f} GET/s/prefix",
                     f"window (needs {row['window_prefixes_needed']} prefixes); global "
                     f"{row['global_gets_per_s_per_prefix']:.0f}"))
    lines.append(_table(rows))
    for s in r["sim"]:
        lines += ["", f"AIMD simulation: {s['readers']} readers, {s['prefixes']} prefix(es) "
                  f"(limit {s['limit_gets_per_s']} GET/s), readers need {s['offered_downloads_per_s']:.0f} "
                  f"downloads/s of {s['gets_per_download']} GET(s) each, {s['how']}"]
        step = max(1, len(s["ok_per_s"]) // 8)
        rows = [(f"t={t:>3d} s", f"{s['ok_per_s'][t]:.0f} ok/s",
                 f"{s['throttled_per_s'][t]:.0f} throttled/s, {s['requests_per_s'][t]:.0f} GET/s at the store, "
                 f"window mean {s['window_mean'][t]:.2f}, "
                 f"{100 * s['window_at_1'][t]:.0f}% at 1") for t in range(0, len(s["ok_per_s"]), step)]
        rows.append(("steady (2nd half)", f"{s['steady_ok_per_s']:.0f} ok/s",
                     f"{100 * s['steady_fraction_of_offered']:.0f}% of offered, "
                     f"{s['steady_throttled_per_s']:.0f} throttled/s, {s['steady_requests_per_s']:.0f} GET/s at the "
                     f"store ({s['steady_wasted_requests_per_s']:.0f} of them admitted for throttled downloads), "
                     f"backlog {s['backlog_shards_at_end']:.0f} shards"))
        rows.append(("readers at window 1 / all jobs", f"{s['floor_gets_per_s']:.0f} GET/s",
                     f"/ {s['readers_capacity_gets_per_s']:.0f} GET/s (downloads of {s['success_s']:.2f} s); "
                     f"{100 * s['readers_on_whole_gets_at_end']:.0f}% of the readers on whole GETs at the end"))
        lines.append(_table(rows))
    lines += ["", f"planning and state (rank {p['rank']} of {p['world_size']})"]
    rows = [("plan, window", f"{p['plan_window']['seconds'] * 1e3:.0f} ms",
             f"measured, {_fmt_bytes(p['plan_window']['peak_rss_bytes'])} peak")]
    if "seconds" in p["plan_global"]:
        rows.append(("plan, global", f"{p['plan_global']['seconds'] * 1e3:.0f} ms",
                     f"measured, {_fmt_bytes(p['plan_global']['peak_rss_bytes'])} peak"))
    rows.append(("ShardDataset.plan(), window", f"{p['dataset_plan_s']['value'] * 1e3:.0f} ms",
                 "measured, over the manifest above"))
    res = p["resume_window"]
    rows.append(("resume_plan, window", f"{res['seconds']:.1f} s",
                 f"{res['how'].split(':')[0]}, {_fmt_bytes(res['peak_rss_bytes'])} peak per rank, "
                 f"{_fmt_bytes(res['peak_rss_bytes_per_node'])} per node"))
    rows.append(("state_dict() size", f"{p['state_bytes']['value']} B",
                 f"measured; {p['state_bytes_two_segments']['value']} B with two segments"))
    lines.append(_table(rows))
    lines += ["", "cache working set (window mode)"]
    lines.append(_table([
        ("per rank", f"{_fmt_bytes(c['per_rank_bytes'])}", f"computed: working_set ({c['per_rank_shards']} shards)"),
        ("cache_limit the share check asks per node", f"{_fmt_bytes(c['cache_limit_asked_per_node'])}",
         "computed: per rank x ranks"),
        ("node downloads per epoch", f"{_fmt_bytes(c['node_epoch_download_bytes'])}", "computed (plans)"),
    ]))
    lines += ["", f"limits (node RAM {a.node_ram_gb:g} GB: a tenth of it; node cache {a.node_cache_gb:g} GB)"]
    lines.append(_table([(x["what"], f"{x['value']:.3g}", f"limit {x['limit']:.3g}"
                          + ("  CROSSED" if x["crossed"] else "")) for x in r["limits"]]))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=8, help="ranks (reader processes) per node")
    ap.add_argument("--shards", type=int, default=100_000)
    ap.add_argument("--shard-bytes", type=_size, default=_size("100MB"), help="e.g. 100MB (decimal units)")
    ap.add_argument("--records-per-shard", type=int, default=1000)
    ap.add_argument("--window", type=int, default=65536, help="shuffle window in samples (the default of ShardDataset)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=4, help="DataLoader num_workers (native threads) per rank")
    ap.add_argument("--fetch-jobs", type=int, default=None,
                    help="downloads at once per reader (default: fetch_jobs='auto' for these shards)")
    ap.add_argument("--transport", choices=("native", "fsspec"), default="native",
                    help="native: ranged GETs per large shard (the default where libcurl loads); fsspec: one GET")
    ap.add_argument("--sample-nodes", type=int, default=4, help="nodes whose ranks' plans are computed (window mode)")
    ap.add_argument("--start-spread", type=float, default=10.0, help="seconds within which every node starts")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[100.0, 250.0, 1000.0],
                    help="sample MB/s consumed per node, comma-separated; the last one is simulated")
    ap.add_argument("--keep-ranges", action="store_true",
                    help="simulate ranged GETs kept after a throttle (the native transport before it fell back)")
    ap.add_argument("--prefixes", type=int, default=1, help="bucket prefixes the shards are spread over")
    ap.add_argument("--conn-mb-s", type=float, default=100.0, help="MB/s of one GET")
    ap.add_argument("--rtt", type=float, default=0.02, help="seconds to a response (a SlowDown, a GET's start)")
    ap.add_argument("--sim-seconds", type=float, default=30.0)
    ap.add_argument("--sim-max-clients", type=int, default=1024,
                    help="simulate at most this many readers (more: a fraction of them, limit scaled alike)")
    ap.add_argument("--max-plan-records", type=int, default=100_000_000,
                    help="above this many records, global plans and resume plans are computed, not run")
    ap.add_argument("--writers", type=int, default=256, help="shards written at once when the dataset is made")
    ap.add_argument("--node-ram-gb", type=float, default=1000.0)
    ap.add_argument("--node-cache-gb", type=float, default=7000.0, help="node-local disk for the cache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for name in ("nodes", "ranks", "shards", "shard_bytes", "records_per_shard", "window", "batch_size", "threads",
                 "sample_nodes", "prefixes", "sim_max_clients", "writers"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    a.sample_nodes = min(a.sample_nodes, a.nodes)
    if a.fetch_jobs is not None and a.fetch_jobs < 1:
        ap.error("--fetch-jobs must be >= 1")
    return a


def resolve(a: argparse.Namespace) -> None:
    """``fetch_jobs="auto"`` and the GETs per download, from pyloader's own rules."""
    from pyloader.remote import transport
    from pyloader.remote.fetch import auto_fetch_jobs

    if a.fetch_jobs is None:
        a.fetch_jobs = auto_fetch_jobs([a.shard_bytes])  # See NOTE [fetch jobs]
    # See NOTE [transport choice]: large objects as parallel ranged GETs, one attempt for all.
    a.parts = max(1, len(transport._parts(a.shard_bytes))) if a.transport == "native" else 1


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.child:
        print(json.dumps(_child(json.loads(a.child))))
        return {}
    resolve(a)
    t_start = time.perf_counter()
    horizon = (2 * a.threads + a.threads) * a.batch_size  # (prefetch + threads) x batch, prefetch = 2 x threads
    world = a.nodes * a.ranks
    d = tempfile.mkdtemp(prefix="sim_scale-")
    try:
        mbytes = make_manifest_dataset(d, a.shards, a.records_per_shard, a.shard_bytes)
        opened = measure({"what": "open", "dir": d, "window": a.window, "rank": world // 2 + 1, "world": world,
                          "batch": a.batch_size, "threads": a.threads})
    finally:
        shutil.rmtree(d, ignore_errors=True)
    r: dict[str, Any] = {"config": {k: v for k, v in vars(a).items() if k not in ("child", "json")},
                         "env": {"python": platform.python_version(), "machine": platform.machine(),
                                 "cpus": os.cpu_count(), "numpy": np.__version__}}
    r["manifest"] = manifest_section(a, mbytes, opened)
    r["writes"] = writes_section(a)
    r["reads"] = reads_section(a, horizon)
    r["rates"] = rate_section(a, r["reads"])
    offered = r["rates"]["rows"][-1]["window_downloads_per_s"]
    r["sim"] = [simulate(a, world, offered, a.prefixes, a.sim_seconds)]
    need = r["rates"]["rows"][-1]["window_prefixes_needed"]
    more = max(need + 1, math.ceil(r["sim"][0]["floor_gets_per_s"] / S3_GET_PER_PREFIX) + 1)
    if more > a.prefixes and sum(r["sim"][0]["throttled_per_s"]):
        r["sim"].append(simulate(a, world, offered, more, a.sim_seconds))
    r["plan"] = plan_section(a, opened)
    r["cache"] = cache_section(a, r["reads"], horizon)
    r["limits"] = limits(a, r)
    r["seconds"] = time.perf_counter() - t_start
    print(report(a, r))
    print(f"\n({r['seconds']:.0f} s)")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return r


if __name__ == "__main__":
    main()
