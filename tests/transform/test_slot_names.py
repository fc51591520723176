"""The process executor's slot files name their owner; cleanup removes only files it can prove dead.

See NOTE [file owners]: ``/dev/shm`` is shared by containers run with ``--ipc=host``, each
with its own pid namespace, so a pid that is gone here says nothing about a file another
namespace made. Files are planted under names of another namespace, another host, an
earlier boot, the older pid-only form, a live process and a dead one of this namespace.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

import pyloader
from pyloader.format.owner import owner, owner_gone
from pyloader.transform.processes import clean_stale, slot_prefix

FIELDS = {"x": ("float32", (4,)), "label": "int64"}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("slots") / "ds")
    with pyloader.ShardWriter(d, FIELDS, shard_bytes=2048) as w:
        for i in range(64):
            w.write({"x": np.full(4, i, np.float32), "label": i})
    return d


def dead_pid() -> int:
    """The pid of a process of this namespace that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not os.path.exists(f"/proc/{p.pid}")
    return p.pid


def test_the_owner_is_this_host_boot_and_pid_namespace() -> None:
    host, boot, ns = owner().split("-")
    assert ns == str(os.stat("/proc/self/ns/pid").st_ino)
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert boot == f.read().strip().replace("-", "")[:16]
    assert re.fullmatch(r"[A-Za-z0-9_]{1,32}", host)
    assert slot_prefix(123) == f"pyloader-{owner()}-123-"


def test_owner_gone_says_yes_only_when_it_can_prove_it() -> None:
    host, boot, ns = owner().split("-")
    gone = dead_pid()
    assert owner_gone(owner(), gone) is True
    assert owner_gone(owner(), os.getpid()) is False
    assert owner_gone(f"{host}-{boot}-{int(ns) + 1}", gone) is None  # another container's namespace
    assert owner_gone(f"otherhost-{'1' * 16}-{ns}", gone) is None  # another host
    assert owner_gone(f"{host}-{'0' * 15}1-{ns}", gone) is True  # an earlier boot of this host
    assert owner_gone(f"{host}-0-{ns}", gone) is None  # a boot id nobody could read
    assert owner_gone("not an owner", gone) is None


def plant(directory: str) -> dict[str, bool]:
    """Slot-like files, each with whether cleanup may remove it."""
    host, boot, ns = owner().split("-")
    gone = dead_pid()
    tail = "-0123abcd-w0-s0-g0"
    files = {
        f"pyloader-{owner()}-{gone}{tail}": True,  # this namespace, its loader gone
        f"pyloader-{host}-{'0' * 15}1-{ns}-{gone}{tail}": True,  # an earlier boot of this host
        f"pyloader-{owner()}-{os.getpid()}{tail}": False,  # this namespace, alive
        f"pyloader-{host}-{boot}-{int(ns) + 1}-{gone}{tail}": False,  # another pid namespace: its pid
        f"pyloader-otherhost-{'1' * 16}-{ns}-{gone}{tail}": False,  # another host sharing the directory
        f"pyloader-{gone}{tail}": False,  # the older pid-only form: no owner to prove anything by
        "pyloader-notes.txt": False,
    }
    for name in files:
        with open(os.path.join(directory, name), "wb") as f:
            f.write(b"x")
    return files


def test_clean_stale_removes_only_files_of_provably_gone_loaders(tmp_path) -> None:
    files = plant(str(tmp_path))
    assert clean_stale(str(tmp_path)) == sum(files.values())
    assert sorted(os.listdir(tmp_path)) == sorted(n for n, removable in files.items() if not removable)


@pytest.mark.timeout(60)
def test_a_process_executor_names_its_slots_by_owner_and_cleans_only_dead_ones(shards, tmp_path,
                                                                                monkeypatch) -> None:
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("PYLOADER_SHM_DIR", str(d))
    files = plant(str(d))

    def tr(s: dict[str, Any]) -> dict[str, Any]:
        return {"x": s["x"] + 1}

    ds = pyloader.ShardDataset(shards)
    it = iter(pyloader.DataLoader(ds, batch_size=4, transform=tr, num_workers=2, executor="processes"))
    kept = sorted(n for n, removable in files.items() if not removable)
    mine = re.compile(rf"^{re.escape(slot_prefix(os.getpid()))}[0-9a-f]+-w[01]-s\d+-g\d+$")
    # The workers make the batches they have credits for; the slots the loop has not taken stay.
    deadline = time.monotonic() + 30
    while not set(os.listdir(d)) - set(kept) and time.monotonic() < deadline:
        time.sleep(0.01)
    new = sorted(set(os.listdir(d)) - set(kept))
    assert new and all(mine.match(n) for n in new), new
    assert len(list(it)) == 16
    del it
    assert sorted(os.listdir(d)) == kept  # the dead ones at start, its own at the end
