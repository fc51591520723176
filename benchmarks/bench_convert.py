"""Conversion throughput and ParquetDataset epoch throughput, baselines measured in the same run.

    python benchmarks/bench_convert.py [--rows 40000] [--jobs 2] [--out bench_results/convert.json]

Generates one Parquet file (image-like uint8 [3, 32, 32], int64 label, variable int32
tokens), then measures, in this process and on this machine:

convert:  pyarrow reading the whole file into numpy (the floor any converter pays),
          pyloader.convert with --jobs 1 and --jobs N (compression none and auto),
          pyloader.ShardWriter fed the same rows one by one, and LitData's BinaryWriter
          (LitData-style) when ``litdata`` imports here; MosaicML's MDSWriter when
          ``streaming`` imports. MB/s = decoded value bytes / wall seconds.
read:     one epoch of ParquetDataset.batches (unshuffled and window-shuffled) vs
          pyarrow ``iter_batches`` + numpy + ``torch.from_numpy`` over the same file,
          same columns and batch size.
Writes JSON with the config, the environment and every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pyloader


def make_table(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    # Image-like: smooth gradients plus noise, so LZ4 saves a little (as on real pixels).
    base = (np.arange(3 * 32 * 32) % 64).astype(np.uint8)
    img = (base[None, :] + rng.integers(0, 16, (rows, 3 * 32 * 32), dtype=np.uint8)).astype(np.uint8)
    lens = rng.integers(0, 64, rows)
    offs = np.zeros(rows + 1, np.int32)
    np.cumsum(lens, out=offs[1:])
    tok = pa.ListArray.from_arrays(pa.array(offs), pa.array(rng.integers(0, 50000, int(offs[-1]), dtype=np.int32)))
    image = pa.FixedSizeListArray.from_arrays(pa.array(img.reshape(-1)), 3 * 32 * 32)
    return pa.table({"image": image, "label": pa.array(np.arange(rows, dtype=np.int64)), "tokens": tok})


def timed(fn: Any, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=40000)
    ap.add_argument("--row-group", type=int, default=4096)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--out", default="bench_results/convert.json")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="pyloader-bench-convert-")
    res: dict[str, Any] = {"config": vars(args), "environment": {
        "python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
        "numpy": np.__version__, "pyarrow": pa.__version__, "torch": torch.__version__}}
    try:
        table = make_table(args.rows)
        src = os.path.join(tmp, "data.parquet")
        pq.write_table(table, src, row_group_size=args.row_group, compression="snappy")
        img = table.column("image").combine_chunks().flatten().to_numpy().reshape(args.rows, 3, 32, 32)
        tok_arr = table.column("tokens").combine_chunks()
        value_bytes = img.nbytes + 8 * args.rows + 4 * len(tok_arr.values)
        res["data"] = {"rows": args.rows, "value_mb": value_bytes / 1e6, "parquet_mb": os.path.getsize(src) / 1e6}
        print(f"data: {args.rows} rows, {value_bytes / 1e6:.1f} MB of values, "
              f"{os.path.getsize(src) / 1e6:.1f} MB Parquet (snappy)")

        conv: dict[str, float] = {}

        def pyarrow_read() -> None:
            t = pq.read_table(src)
            for c in t.columns:
                c = c.combine_chunks()
                while hasattr(c, "flatten") and not isinstance(c, pa.lib.StringArray):
                    c = c.flatten() if pa.types.is_fixed_size_list(c.type) else c.values
                c.to_numpy()

        conv["pyarrow read_table -> numpy (floor)"] = timed(pyarrow_read, 3)
        for jobs in sorted({1, args.jobs}):
            for comp in ("none", "auto"):
                dst = os.path.join(tmp, f"pyl-{jobs}-{comp}")
                conv[f"pyloader convert jobs={jobs} compression={comp}"] = timed(
                    lambda d=dst, j=jobs, c=comp: pyloader.convert(src, d, jobs=j, compression=c, overwrite=True))
        res["verify_s"] = timed(lambda: pyloader.verify_conversion(src, os.path.join(tmp, "pyl-1-none")))

        labels, toks = table.column("label").to_numpy(), tok_arr.to_pylist()
        n_sw = min(args.rows, 10000)  # per-record writers: a subset, scaled to MB/s

        def shardwriter() -> None:
            with pyloader.ShardWriter(os.path.join(tmp, "sw"), {"image": ("uint8", (3, 32, 32)), "label": "int64",
                                                                "tokens": ("int32", (None,))},
                                      compression="none", overwrite=True) as w:
                for i in range(n_sw):
                    w.write({"image": img[i], "label": labels[i], "tokens": np.asarray(toks[i], np.int32)})

        scale = args.rows / n_sw
        conv["pyloader.ShardWriter per record (same rows)"] = timed(shardwriter) * scale
        try:
            from litdata.streaming.writer import BinaryWriter

            def litdata() -> None:
                d = os.path.join(tmp, f"lit-{time.perf_counter_ns()}")
                w = BinaryWriter(d, chunk_bytes="64MB")
                for i in range(n_sw):
                    w.add_item(i, {"image": img[i], "label": int(labels[i]), "tokens": np.asarray(toks[i], np.int32)})
                w.done()

            conv["litdata BinaryWriter per record (same rows)"] = timed(litdata) * scale
        except Exception as e:  # noqa: BLE001 - an optional baseline
            res["litdata_error"] = f"{type(e).__name__}: {e}"[:200]
        try:
            from streaming import MDSWriter

            def mds() -> None:
                with MDSWriter(out=os.path.join(tmp, f"mds-{time.perf_counter_ns()}"),
                               columns={"image": "ndarray:uint8:3,32,32", "label": "int64", "tokens": "ndarray:int32"}) as w:
                    for i in range(n_sw):
                        w.write({"image": img[i], "label": int(labels[i]), "tokens": np.asarray(toks[i], np.int32)})

            conv["mosaicml MDSWriter per record (same rows)"] = timed(mds) * scale
        except Exception as e:  # noqa: BLE001 - an optional baseline
            res["mosaicml_error"] = f"{type(e).__name__}: {e}"[:200]

        base = conv["pyarrow read_table -> numpy (floor)"]
        res["convert"] = {k: {"seconds": v, "mb_per_s": value_bytes / v / 1e6, "x_vs_pyarrow_read": base / v}
                          for k, v in conv.items()}
        print("\nconversion (MB/s of values; ratio = pyarrow read time / this time)")
        for k, v in res["convert"].items():
            print(f"  {k:55s} {v['mb_per_s']:8.1f} MB/s  {v['x_vs_pyarrow_read']:5.2f}x")
        print(f"  verify pass (jobs=1 output): {value_bytes / res['verify_s'] / 1e6:.1f} MB/s")

        read: dict[str, float] = {}
        cols = ["image", "label", "tokens"]

        def pyarrow_epoch() -> None:
            f = pq.ParquetFile(src)
            for b in f.iter_batches(batch_size=args.batch_size, columns=cols):
                torch.from_numpy(b.column(0).flatten().to_numpy().reshape(-1, 3, 32, 32))
                torch.from_numpy(b.column(1).to_numpy())
                t = b.column(2)
                torch.from_numpy(t.values.to_numpy())

        def pyl_epoch(shuffle: bool, threads: int) -> None:
            ds = pyloader.ParquetDataset(src, columns=cols, shuffle=shuffle, window=4 * args.row_group,
                                         rank=0, world_size=1)
            for _ in ds.batches(args.batch_size, num_threads=threads):
                pass

        read["pyarrow iter_batches -> torch (unpadded tokens)"] = timed(pyarrow_epoch, 3)
        for threads in (1, 2):
            read[f"ParquetDataset unshuffled, threads={threads}"] = timed(lambda t=threads: pyl_epoch(False, t), 3)
        read["ParquetDataset window shuffle, threads=2"] = timed(lambda: pyl_epoch(True, 2), 3)
        rbase = read["pyarrow iter_batches -> torch (unpadded tokens)"]
        res["read"] = {k: {"seconds": v, "mb_per_s": value_bytes / v / 1e6, "x_vs_pyarrow_iter_batches": rbase / v}
                       for k, v in read.items()}
        print(f"\nepoch read, batch {args.batch_size} (MB/s of values; ratio = pyarrow iter_batches time / this time)")
        for k, v in res["read"].items():
            print(f"  {k:55s} {v['mb_per_s']:8.1f} MB/s  {v['x_vs_pyarrow_iter_batches']:5.2f}x")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)
        print(f"\nwrote {args.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
