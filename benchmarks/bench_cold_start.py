"""Cold start of a remote dataset of many shards: the open path, per process, against a
loopback HTTP server (benchmarks/throttled_http.py), all measured in one run:

1. for 1k, 10k and 100k shards, each step in a fresh process (imports done, not timed):
   fetching ``manifest.json`` (fsspec's HTTP import included) and parsing it; building
   ``ShardDataset(url, cache_dir=...)`` on a cold node (it fetches the manifest) and on a
   node whose cache holds a fresh copy (See NOTE [manifest once per node]: what every rank
   but the first sees); then ``ds.batches(256)`` (plan, shard set, fetch schedule), and
   the peak RSS growth over it all;
2. 8 processes opening the largest dataset at once with one cache dir: the GETs of
   ``manifest.json`` the server sees, against the same 8 with ``PYLOADER_MANIFEST_TTL=0``
   (every process fetches: the baseline), and the slowest process's construction time.

What is timed: construction and ``batches()`` only. The shards are real and readable --
hard links to one shard of one record, so 100k of them take seconds to make -- and the
server holds every shard request for ``--shard-delay`` seconds so that no download runs
while ``batches()`` is timed (it starts the downloads in the background). The manifest
lists each shard by its own path, as a written dataset does: its size and parse cost are
those of a real 100k-shard manifest.

Writes bench_results/cold_start.json. Usage: python benchmarks/bench_cold_start.py [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MANIFEST = "manifest.json"
_LINKS_PER_FILE = 50_000  # below ext4's 65,000 links per inode


class CountingServer:
    """``ThrottledServer`` that counts GETs per path and holds shard requests for ``shard_delay`` s."""

    def __init__(self, root: str, shard_delay: float) -> None:
        from throttled_http import ThrottledServer

        counts: collections.Counter[str] = collections.Counter()
        mu = threading.Lock()

        class Server(ThrottledServer):
            def _serve(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
                path = h.path.split("?", 1)[0]
                if not head:
                    with mu:
                        counts[path] += 1
                if not path.endswith("/" + MANIFEST):
                    time.sleep(shard_delay)  # parked: no download competes with what is timed
                super()._serve(h, head=head)

        self.srv = Server(root, bandwidth=1e12, latency=0.0, max_life=1800)
        self.counts, self._mu = counts, mu

    def gets(self, path: str) -> int:
        with self._mu:
            return self.counts[path]


def write_dataset(root: str, n: int) -> int:
    """A dataset of ``n`` one-record shards at ``root`` (hard links to one shard); returns the manifest size."""
    import numpy as np

    import pyloader
    from pyloader import _C
    from pyloader.format.spec import dump_manifest, parse_manifest

    tpl = os.path.join(os.path.dirname(root), "template")
    if not os.path.exists(os.path.join(tpl, MANIFEST)):
        with pyloader.ShardWriter(tpl, {"x": ("uint8", (16,)), "label": ("int64", ())}, compression="none") as w:
            w.write({"x": np.zeros(16, np.uint8), "label": 0})
    with open(os.path.join(tpl, MANIFEST), "rb") as f:
        body = parse_manifest(f.read(), tpl, _C.xxh64)
    one = body["shards"][0]
    os.makedirs(root, exist_ok=True)
    shards = []
    for i in range(n):
        src = os.path.join(tpl, f"{one['path']}.{i // _LINKS_PER_FILE}")
        if not os.path.exists(src):
            shutil.copyfile(os.path.join(tpl, one["path"]), src)
        name = f"shard-{i:06d}.pyl"
        try:
            os.link(src, os.path.join(root, name))
        except OSError:
            shutil.copyfile(src, os.path.join(root, name))  # no hard links here
        shards.append({"path": name, "records": 1, "bytes": one["bytes"], "xxh64": one["xxh64"]})
    body.update(shards=shards, records=n)
    data = dump_manifest(body, _C.xxh64)
    with open(os.path.join(root, MANIFEST), "wb") as f:
        f.write(data)
    return len(data)


# -- the measuring child ---------------------------------------------------------------
def child(mode: str, url: str, cache: str, out: str, go: str | None, profile: bool) -> None:
    """One fresh process: ``stages`` (fetch, parse) or ``open`` (construct, batches)."""
    t0 = time.perf_counter()
    import torch  # noqa: F401 - imported by ShardDataset anyway; not part of what is timed

    import pyloader
    from pyloader import _C
    from pyloader.format.spec import parse_manifest
    from pyloader.remote import fs

    res: dict[str, Any] = {"import_s": time.perf_counter() - t0}
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if mode == "stages":
        t = time.perf_counter()
        import aiohttp  # noqa: F401
        import fsspec.implementations.http  # noqa: F401

        res["http_import_s"] = time.perf_counter() - t
        t = time.perf_counter()
        data = fs.read_object(url + "/" + MANIFEST, None, fs.RetryPolicy.from_env())
        res["fetch_s"] = time.perf_counter() - t
        t = time.perf_counter()
        parse_manifest(data, url, _C.xxh64)
        res["parse_s"] = time.perf_counter() - t
    else:
        if go is not None:
            open(f"{go}.ready-{os.getpid()}", "w").close()
            while not os.path.exists(go):
                time.sleep(0.002)
        prof = None
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t = time.perf_counter()
        ds = pyloader.ShardDataset(url, cache_dir=cache)
        res["construct_s"] = time.perf_counter() - t
        t = time.perf_counter()
        it = ds.batches(256)
        res["batches_s"] = time.perf_counter() - t
        if prof is not None:
            import pstats

            prof.disable()
            st = pstats.Stats(prof)
            rows = sorted(st.stats.items(), key=lambda kv: -kv[1][3])
            res["profile_cumulative"] = [
                {"function": f"{os.path.relpath(k[0], ROOT) if k[0].startswith(ROOT) else k[0]}:{k[1]}({k[2]})",
                 "calls": v[1], "cum_s": round(v[3], 4), "own_s": round(v[2], 4)} for k, v in rows[:40]]
        del it
    res["peak_rss_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    with open(out, "w") as f:
        json.dump(res, f)
    sys.stdout.flush()
    os._exit(0)  # the fetcher's downloads are parked at the server: do not wait for them at exit


def run_child(mode: str, url: str, cache: str, tmp: str, *, env: dict[str, str] | None = None,
              profile: bool = False) -> dict[str, Any]:
    out = os.path.join(tmp, f"child-{time.monotonic_ns()}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, url, cache, out]
    if profile:
        cmd.append("--profile")
    subprocess.run(cmd, check=True, env=env, timeout=600)
    with open(out) as f:
        return dict(json.load(f))


def together(n_procs: int, url: str, cache: str, tmp: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """``n_procs`` fresh processes that build the dataset at the same moment (after their imports)."""
    go = os.path.join(tmp, f"go-{time.monotonic_ns()}")
    outs = [os.path.join(tmp, f"proc-{go[-8:]}-{i}.json") for i in range(n_procs)]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "open", url, cache, out,
                               "--go", go], env=env) for out in outs]
    try:
        deadline = time.monotonic() + 300
        while sum(1 for f in os.listdir(tmp) if f.startswith(os.path.basename(go) + ".ready-")) < n_procs:
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError("the processes did not start")
            time.sleep(0.01)
        open(go, "w").close()
        for p in procs:
            if p.wait(timeout=300) != 0:
                raise RuntimeError(f"a process failed ({p.returncode})")
    finally:
        for p in procs:
            p.kill()
    results = []
    for out in outs:
        with open(out) as f:
            results.append(dict(json.load(f)))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1k and 10k shards only (CI smoke run)")
    ap.add_argument("--procs", type=int, default=8, help="processes opening the dataset at once")
    ap.add_argument("--shard-delay", type=float, default=60.0, help="seconds the server holds each shard request")
    ap.add_argument("--profile", action="store_true",
                    help="one more open of the largest dataset under cProfile (top functions in the JSON)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "cold_start.json"))
    args = ap.parse_args()
    sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    cfg = {"shards": sizes, "records_per_shard": 1, "procs": args.procs, "batch_size": 256,
           "shard_delay_s": args.shard_delay, "manifest_ttl_s": "default (PYLOADER_MANIFEST_TTL unset)"}
    env = {k: v for k, v in os.environ.items() if k != "PYLOADER_MANIFEST_TTL"}
    tmp = tempfile.mkdtemp(prefix="pyloader-bench-cold-")
    rows: list[dict[str, Any]] = []
    try:
        srv_root = os.path.join(tmp, "srv")
        t = time.perf_counter()
        manifest_bytes = {n: write_dataset(os.path.join(srv_root, f"ds{n}"), n) for n in sizes}
        print(f"wrote {', '.join(f'{n:,}' for n in sizes)}-shard datasets in {time.perf_counter() - t:.1f} s")
        server = CountingServer(srv_root, args.shard_delay)
        with server.srv as srv:
            for n in sizes:
                url = f"{srv.url}/ds{n}"
                stages = run_child("stages", url, os.path.join(tmp, "unused"), tmp, env=env)
                cache = os.path.join(tmp, f"cache{n}")
                cold = run_child("open", url, cache, tmp, env=env)
                copy = run_child("open", url, cache, tmp, env=env)
                rows.append({"shards": n, "manifest_bytes": manifest_bytes[n], "stages": stages, "cold_node": cold,
                             "node_copy": copy})
                if args.profile and n == sizes[-1]:  # a separate run: the profiler slows what it measures
                    rows[-1]["node_copy_profiled"] = run_child("open", url, cache, tmp, env=env, profile=True)
            n = sizes[-1]
            url = f"{srv.url}/ds{n}"
            path = f"/ds{n}/{MANIFEST}"
            runs = {}
            for label, ttl in (("node_copy", None), ("baseline_ttl0", "0")):
                before = server.gets(path)
                penv = dict(env) if ttl is None else dict(env, PYLOADER_MANIFEST_TTL=ttl)
                res = together(args.procs, url, os.path.join(tmp, f"together-{label}"), tmp, penv)
                runs[label] = {"manifest_gets": server.gets(path) - before,
                               "construct_s": [r["construct_s"] for r in res],
                               "peak_rss_growth_mib": [r["peak_rss_growth_mib"] for r in res]}
        result = {
            "config": cfg,
            "environment": {"python": platform.python_version(), "machine": platform.machine(),
                            "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]},
            "what_is_timed": "construction and batches() creation in fresh processes; imports excluded; "
                             "shard downloads parked at the server; shards are hard links to one 1-record shard",
            "per_size": rows,
            "together": {"shards": n, "procs": args.procs, **runs},
        }
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"{'shards':>8} {'manifest':>9} {'fetch':>7} {'parse':>7} {'open cold':>10} {'open copy':>10} "
              f"{'batches':>8} {'open+batches':>13} {'peak RSS +':>10}")
        for r in rows:
            s, c, k = r["stages"], r["cold_node"], r["node_copy"]
            print(f"{r['shards']:>8,} {r['manifest_bytes'] / 1e6:>7.2f}MB {s['fetch_s']:>6.3f}s {s['parse_s']:>6.3f}s "
                  f"{c['construct_s']:>9.3f}s {k['construct_s']:>9.3f}s {k['batches_s']:>7.3f}s "
                  f"{k['construct_s'] + k['batches_s']:>12.3f}s {k['peak_rss_growth_mib']:>7.0f}MiB")
        print(f"(fetch excludes fsspec's HTTP import: {rows[-1]['stages']['http_import_s']:.3f} s once per process; "
              "'open cold' includes it and the fetch; 'open copy' reads the node's fresh copy)")
        for label, r in runs.items():
            print(f"{args.procs} processes, {n:,} shards, {label}: {r['manifest_gets']} GET(s) of {MANIFEST}; "
                  f"construction {statistics.median(r['construct_s']):.3f} s median, "
                  f"{max(r['construct_s']):.3f} s slowest")
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        a = sys.argv[2:]
        go = a[a.index("--go") + 1] if "--go" in a else None
        child(a[0], a[1], a[2], a[3], go, "--profile" in a)
    sys.exit(main())
