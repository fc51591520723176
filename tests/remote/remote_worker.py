"""Subprocess body for the multi-process tests: ``read URL CACHE_DIR`` prints the labels read."""

import json
import sys

import pyloader

if __name__ == "__main__":
    cmd, url, cache = sys.argv[1:4]
    ds = pyloader.ShardDataset(url, cache_dir=cache, fetch_jobs=2)
    if cmd == "read":
        out = sorted(int(x) for b in ds.batches(32) for x in b["label"])
        print(json.dumps({"n": len(out), "labels_ok": out == list(range(len(out)))}))
