"""A transform worker keeps the memory it reuses batch after batch (NOTE [worker heap] in pyloader/transform/stage.py)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest

from pyloader.transform.pool import MAX_SLOTS, _Slots

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and /proc/self/smaps")


def _rss_kib(address: int) -> int:
    """The resident KiB of this process's mapping that starts at ``address`` (its page table, not the file's pages)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        span = line.split(" ", 1)[0]  # "start-end" on a mapping's first line; "Rss:" and the like below it
        if "-" in span and int(span.split("-", 1)[0], 16) == address:
            for rest in lines[i + 1:]:
                if rest.startswith("Rss:"):
                    return int(rest.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


def _address(mp: object) -> int:
    buf = (ctypes.c_char * 1).from_buffer(mp)  # type: ignore[arg-type]
    try:
        return ctypes.addressof(buf)
    finally:
        del buf


def test_a_slot_is_mapped_whole_before_its_first_batch_in_a_new_process(tmp_path) -> None:
    """A slot a new worker inherits (a fork copies no page table entry of a shared mapping) is
    mapped in one call when the worker picks it, not page by page as its batch is written."""
    busy = multiprocessing.Array("b", MAX_SLOTS, lock=False)
    slots = _Slots(0, "pyloader-test-warm", str(tmp_path), busy)
    size = 4 << 20
    s, slot = slots.slot_for(size, lambda: False)
    addr = _address(slot.map)
    assert _rss_kib(addr) == size // 1024  # a new slot: mapped whole by the process that made it
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            child = _Slots(0, "pyloader-test-warm", str(tmp_path), busy, {s: (slot.gen, slot.map)})
            before = _rss_kib(addr)
            _, again = child.slot_for(size, lambda: False)
            after = _rss_kib(addr)
            os.write(w, f"{before} {after} {again.map is slot.map}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    got = os.read(r, 100).decode().split()
    os.close(r)
    assert status == 0 and len(got) == 3, got
    before, after = int(got[0]), int(got[1])
    assert got[2] == "True"  # the inherited slot itself, not a new one
    assert before == 0, f"the child's copy of the mapping held {before} KiB before it picked the slot"
    assert after == size // 1024, f"the inherited slot held {after} of {size // 1024} KiB once picked"
    slots.close(unlink=True)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc 2.33's mallinfo2")
def test_a_worker_keeps_the_memory_its_batches_free(tmp_path) -> None:
    """A 24 MiB buffer freed in a transform worker stays in its heap for the next batch, where
    glibc's defaults would have mapped it afresh and given it back (a page fault per 4 KiB of
    it, every batch). Run in a fresh interpreter so that no earlier free in the test process
    has raised the thresholds the workers inherit."""
    code = textwrap.dedent(f"""
        import ctypes, sys
        import pyloader

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]

        def probe(s):
            libc = ctypes.CDLL(None)
            libc.mallinfo2.restype = Info
            libc.malloc.restype = ctypes.c_void_p
            libc.free.argtypes = [ctypes.c_void_p]
            p = libc.malloc(24 << 20)
            mapped = libc.mallinfo2().hblkhd
            libc.free(p)
            return {{"x": s["x"], "mapped": mapped, "free": libc.mallinfo2().fordblks}}

        with pyloader.ShardWriter({str(tmp_path / "ds")!r}, {{"x": "int64"}}) as w:
            for i in range(8):
                w.write({{"x": i}})
        ds = pyloader.ShardDataset({str(tmp_path / "ds")!r})
        for b in pyloader.DataLoader(ds, batch_size=4, transform=probe, num_workers=2, executor="processes"):
            print(int(b["mapped"].max()), int(b["free"].min()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [[int(v) for v in line.split()] for line in out.stdout.strip().splitlines()]
    assert len(rows) == 2, out.stdout
    for hi_mapped, lo_free in rows:
        assert hi_mapped < 24 << 20, f"a 24 MiB block was mapped on its own ({hi_mapped} bytes in mappings)"
        assert lo_free >= 24 << 20, f"the worker's heap kept {lo_free} free bytes after the block was freed"



def _worker_raw_pool() -> object:
    """The native slot pool of this transform worker's raw batches, from its main loop's frame."""
    f = sys._getframe()
    while f is not None and f.f_code.co_name != "_worker_main":
        f = f.f_back
    assert f is not None, "not called in a transform worker"
    return f.f_locals["slots"].raw


def test_a_kept_worker_reads_later_epochs_into_the_memory_of_its_first(tmp_path) -> None:
    """A kept worker (persistent_workers=True) starts each epoch's native stream on the slot
    pool of its earlier ones: its raw batches of epochs 2 and 3 allocate nothing (a pool per
    epoch mapped and populated its batch buffers afresh each time: 2 MiB here, a page fault per
    4 KiB of it without huge pages)."""
    import numpy as np
    import torch

    import pyloader

    with pyloader.ShardWriter(str(tmp_path / "ds"), {"x": ("float32", (16384,)), "label": "int64"},
                              compression="none") as w:  # 64 KiB records: a raw batch of 32 is 2 MiB
        for i in range(128):
            w.write({"x": np.full(16384, i, np.float32), "label": i})

    def probe(s: dict) -> dict:
        raw = _worker_raw_pool()
        return {"label": s["label"], "pool": torch.tensor(id(raw)),
                "allocs": torch.tensor(raw.memory()["driver_allocs"])}

    ld = pyloader.DataLoader(pyloader.ShardDataset(str(tmp_path / "ds"), shuffle=True, seed=1), batch_size=32,
                             transform=probe, num_workers=1, executor="processes", persistent_workers=True)
    epochs = [list(ld) for _ in range(3)]
    pools = {int(v) for e in epochs for b in e for v in b["pool"]}
    allocs = [max(int(v) for b in e for v in b["allocs"]) for e in epochs]
    assert len(pools) == 1, f"the worker's raw batches came from {len(pools)} pools over 3 epochs"
    assert allocs[0] > 0 and allocs[2] == allocs[0], f"allocations of the worker's raw pool by epoch: {allocs}"
