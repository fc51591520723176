"""First epoch vs steady state, and the cost of an epoch boundary, measured side by side.

For 12 KB image-like, 8 KB token and 150 KB raw records (no compression), each run in a
fresh process with the page cache hot (the files are read once before each run), as a
restarted job sees them:

1. time to the first batch (from building the DataLoader), the first epoch's rate and the
   best of three later epochs (the steady state) of ``pyloader.DataLoader(num_workers=2)``,
   for the same records written as shard format version 2 (XXH3-64 checksums, what the
   writer writes) and as version 1 (XXH64: every checksum of the same files recomputed),
   so the first-read verification cost of each is seen on the same bytes;
2. the steady state against the two-thread memcpy bandwidth measured in the same process;
3. epoch boundaries: the gap between the last batch of epoch e and the first of e+1 over
   the median gap between batches inside an epoch, with the next epoch started ahead
   (NOTE [epoch ahead] in pyloader/loader/dataloader.py) and without (as before it);
4. the first epoch once more, as a training script sees it: the loader built, then the
   script builds its model (here: waits until the loader's constructor has prepared its
   batch slots, NOTE [prepared slots] in csrc/core/slot_pool.cpp, and reports how long that
   took), then the first epoch from ``iter()`` -- what is left of the first epoch's extra
   cost once the kernel no longer has to hand the process new pages for its batch buffers
   (shards still mapped afresh, records still verified). Variants 1-3 time the first epoch
   from the constructor, with the preparation running alongside.

Runs are interleaved (round 1 of every variant, then round 2, ...) and medians reported,
because this machine is shared and noisy. Writes JSON and prints a table of ratios.

    python benchmarks/bench_first_epoch.py [--mb 480] [--rounds 5] [--profiles image12k,tokens8k,blob150k]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _to_v1(src: str, dst: str) -> None:
    """Copies the version 2 dataset at ``src`` to ``dst`` as version 1: every checksum XXH64."""
    from pyloader import _C
    from pyloader.format import spec as _format

    shutil.copytree(src, dst)
    mpath = os.path.join(dst, "manifest.json")
    with open(mpath, "rb") as fh:
        body = _format.parse_manifest(fh.read(), mpath, _C.xxh64)
    for s in body["shards"]:
        path = os.path.join(dst, s["path"])
        with open(path, "rb") as fh:
            data = bytearray(fh.read())
        nrec, nfield = struct.unpack_from("<QI", data, 16)
        schema_off, schema_size, index_off, index_size, payload_off = struct.unpack_from("<QQQQQ", data, 32)
        for k in range(nrec * nfield):
            pos = index_off + 32 * k
            off, stored = struct.unpack_from("<QI", data, pos)
            start = payload_off + off
            struct.pack_into("<Q", data, pos + 24, _C.xxh64(memoryview(data)[start:start + stored]))
        struct.pack_into("<I", data, 8, 1)
        struct.pack_into("<Q", data, 88, _C.xxh64(bytes(data[schema_off:schema_off + schema_size])))
        struct.pack_into("<Q", data, 96, _C.xxh64(bytes(data[index_off:index_off + index_size])))
        struct.pack_into("<Q", data, 120, _C.xxh64(bytes(data[:120])))
        with open(path, "wb") as fh:
            fh.write(data)
        s["bytes"], s["xxh64"] = len(data), f"{_C.xxh64(bytes(data)):016x}"
    with open(mpath, "wb") as fh:
        fh.write(_format.dump_manifest(body, _C.xxh64))


def _read_all(path: str) -> None:
    """Puts the dataset's files in the page cache."""
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb", buffering=0) as fh:
            while fh.read(1 << 24):
                pass


def child(path: str, batch: int, shuffle: bool, ahead: bool, epochs: int, settle: bool = False) -> dict[str, Any]:
    """One fresh process: first epoch, steady state, boundaries, memcpy.

    ``settle``: the first epoch is timed from ``iter()``, once the loader built before it
    has prepared its batch slots (as after a script's model building); else from the
    constructor.
    """
    t_import = time.perf_counter()
    import pyloader
    from pyloader.bench import measure as B

    import_s = time.perf_counter() - t_import
    t0 = time.perf_counter()
    loader = pyloader.DataLoader(pyloader.ShardDataset(path, shuffle=shuffle, seed=0), batch_size=batch,
                                 num_workers=2)
    prepare_s = None
    if settle:
        pool = loader._batch_pool
        assert pool is not None
        while pool.preparing and time.perf_counter() - t0 < 30:
            time.sleep(0.001)
        prepare_s = time.perf_counter() - t0
        t0 = time.perf_counter()
    if not ahead:
        loader._reads_ahead = lambda: False  # type: ignore[method-assign]  # the loader as it was before
    first_batch = None
    n = 0
    for b in loader:
        if first_batch is None:
            first_batch = time.perf_counter() - t0
        n += int(b["label"].shape[0])
        del b
    first_s = time.perf_counter() - t0
    rates, inside, boundary = [], [], []
    last = None
    for _ in range(epochs):
        t = time.perf_counter()
        start = True
        for b in loader:
            now = time.perf_counter()
            if last is not None:
                (boundary if start else inside).append(now - last)
            start = False
            del b
            last = time.perf_counter()
        rates.append(n / (time.perf_counter() - t))
    payload = loader.stats()["decoded_bytes"]  # of one epoch (the last)
    steady = max(rates)
    return {"import_s": import_s, "first_batch_s": first_batch, "first_epoch_s": first_s, "records": n,
            "first_rate": n / first_s, "steady_rate": steady, "first_vs_steady": n / first_s / steady,
            "steady_gbps": steady * payload / n / 1e9, "memcpy_2t_gbps": B.memcpy_gbps(2),
            "gap_inside_s": statistics.median(inside), "gap_boundary_s": statistics.median(boundary),
            "boundary_vs_inside": statistics.median(boundary) / statistics.median(inside),
            "started_ahead": loader.stats()["started_ahead"], "slots": loader._pool.created,
            "prepare_s": prepare_s}


def run_child(path: str, args: argparse.Namespace, *, ahead: bool, epochs: int, settle: bool = False) -> dict[str, Any]:
    _read_all(path)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    extra = ["--settle", "1"] if settle else []
    out = subprocess.run([sys.executable, __file__, "--child", path, "--batch", str(args.batch),
                          "--shuffle", str(int(args.shuffle)), "--ahead", str(int(ahead)), "--epochs", str(epochs),
                          *extra], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=480, help="dataset size per profile (MB)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=4, help="epochs after the first, per run")
    ap.add_argument("--shuffle", type=int, default=1)
    ap.add_argument("--profiles", default="image12k,tokens8k,blob150k")
    ap.add_argument("--out", default="bench_results/first_epoch.json")
    ap.add_argument("--child")
    ap.add_argument("--ahead", type=int, default=1)
    ap.add_argument("--settle", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.batch, bool(args.shuffle), bool(args.ahead), args.epochs,
                               bool(args.settle))))
        return 0

    from pyloader.bench import measure as B

    unknown = [n for n in args.profiles.split(",") if n not in B.PROFILES]
    if unknown:
        ap.error(f"--profiles: unknown profile(s) {', '.join(map(repr, unknown))}; choose from "
                 f"{', '.join(sorted(B.PROFILES))}")
    results: dict[str, Any] = {"config": vars(args), "environment": B.environment(), "profiles": {}}
    with tempfile.TemporaryDirectory(prefix="pyloader-first-epoch-") as tmp:
        variants: list[tuple[str, str, str, bool, bool]] = []
        for name in args.profiles.split(","):
            p = B.PROFILES[name]
            v2 = os.path.join(tmp, f"{name}-v2")
            B.write_profile_dataset(v2, p, int(args.mb * 1e6 / p.record_bytes), compression="none", version=2)
            v1 = os.path.join(tmp, f"{name}-v1")
            _to_v1(v2, v1)
            variants += [(name, "v2", v2, True, False), (name, "v1", v1, True, False),
                         (name, "v2-no-ahead", v2, False, False), (name, "v2-built-ahead", v2, True, True)]
        os.sync()  # the datasets just written go to disk now, not as writeback during the runs
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            for name, tag, path, ahead, settle in variants:
                res = run_child(path, args, ahead=ahead, epochs=args.epochs, settle=settle)
                runs.setdefault((name, tag), []).append(res)
                print(f"[round {r + 1}/{args.rounds}] {name} {tag}: first/steady {res['first_vs_steady']:.2f}, "
                      f"first batch {1e3 * res['first_batch_s']:.1f} ms, boundary/inside "
                      f"{res['boundary_vs_inside']:.2f}", file=sys.stderr, flush=True)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    rows = []
    for name in args.profiles.split(","):
        out: dict[str, Any] = {}
        for tag in ("v2", "v1", "v2-no-ahead", "v2-built-ahead"):
            rs = runs[(name, tag)]
            out[tag] = {"runs": rs, **{k: med([x[k] for x in rs]) for k in (
                "first_batch_s", "first_rate", "steady_rate", "first_vs_steady", "steady_gbps", "memcpy_2t_gbps",
                "gap_inside_s", "gap_boundary_s", "boundary_vs_inside")}}
            out[tag]["steady_vs_memcpy_2t"] = med([x["steady_gbps"] / x["memcpy_2t_gbps"] for x in rs])
        results["profiles"][name] = out
        v2, v1, off, built = out["v2"], out["v1"], out["v2-no-ahead"], out["v2-built-ahead"]
        built["prepare_s"] = med([x["prepare_s"] for x in built["runs"]])
        rows.append((name, v1["first_vs_steady"], v2["first_vs_steady"], v2["first_rate"] / v1["first_rate"],
                     1e3 * v1["first_batch_s"], 1e3 * v2["first_batch_s"], v2["steady_vs_memcpy_2t"],
                     off["boundary_vs_inside"], v2["boundary_vs_inside"], built["first_vs_steady"],
                     1e3 * built["first_batch_s"], 1e3 * built["prepare_s"]))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"medians of {args.rounds} interleaved rounds, {args.mb:.0f} MB per dataset, batch {args.batch}, "
          f"{'shuffled' if args.shuffle else 'in order'}, 2 native threads, page cache hot, fresh process per run")
    print(f"{'profile':<10}{'first/steady v1':>16}{'v2':>7}{'v2/v1 first':>13}{'1st batch v1 ms':>17}{'v2 ms':>7}"
          f"{'steady/memcpy2t':>17}{'boundary gap: before':>22}{'ahead':>7}"
          f"{'built ahead: first/steady':>27}{'1st batch ms':>14}{'prepared in ms':>16}")
    for r in rows:
        print(f"{r[0]:<10}{r[1]:>16.2f}{r[2]:>7.2f}{r[3]:>12.2f}x{r[4]:>17.1f}{r[5]:>7.1f}{r[6]:>17.2f}"
              f"{r[7]:>21.1f}x{r[8]:>6.1f}x{r[9]:>27.2f}{r[10]:>14.1f}{r[11]:>16.1f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
