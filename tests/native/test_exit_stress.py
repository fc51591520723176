"""Worlds of gloo ranks running loaders in turn, then exiting (tests/native/exit_stress.py).

The reported failure: rank 0 of 3 gloo ranks on 2 CPUs, after four loaders in turn (some
iterators dropped mid-epoch) and ``destroy_process_group()``, printed its result and died with
"terminate called without an active exception". Each world here runs that scenario with all
four kinds of loader (native, packing, a CPU device copy, a transform) and one of the three
ways out (a normal exit, ``os._exit``, a sleep first); every rank must exit with status 0 and
write nothing on stderr. Bounded: worlds start until 20 s have passed (at least 3, at most
6); ``python tests/native/exit_stress.py --runs N --hog K`` runs the long version.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import exit_stress  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux")
torch_dist = pytest.importorskip("torch.distributed")


@pytest.mark.timeout(240)
def test_gloo_worlds_running_loaders_in_turn_exit_cleanly(tmp_path) -> None:
    if not torch_dist.is_available() or not torch_dist.is_gloo_available():
        pytest.skip("torch.distributed without gloo")
    path = str(tmp_path / "ds")
    exit_stress.write_dataset(path)
    bad: list[str] = []
    t0, runs = time.monotonic(), 0
    while runs < 3 or (time.monotonic() - t0 < 20 and runs < 6):
        mode = ("normal", "os_exit", "sleep")[runs % 3]
        for rank, (rc, err) in enumerate(exit_stress.run_world(path, 3, "mixed", mode, runs, False, 90)):
            if rc != 0 or err.strip():
                bad.append(f"world {runs} ({mode}) rank {rank}: rc={rc}\n{err[-3000:]}")
        runs += 1
    assert not bad, f"{len(bad)} ranks of {runs} worlds ended badly; the first:\n{bad[0]}"
