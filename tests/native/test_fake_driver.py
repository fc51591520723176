"""The copy engine's backend="cuda" and pinned slot pools against a stand-in ``libcuda.so.1``.

The stand-in (tests/native/fake_cuda/fake_cuda.c, compiled here with the system C compiler)
checks the call protocol on the CPU: contexts per thread, live allocations, asynchronous
streams and events. It is no GPU: the real driver is exercised by tests/cuda on a GPU
machine. Each scenario is a function of tests/native/fake_cuda/children.py, run by
``run_fake`` in a fresh interpreter whose ``LD_LIBRARY_PATH`` points at the stand-in; the
scenario asserts what it can itself and reports the rest, which the test checks. The CPU
backend is tested in-process by test_copy_engine.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from native_util import FIELDS, sample

import pyloader

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux")

ROOT = Path(pyloader.__file__).resolve().parents[1]
NATIVE_DIR = Path(__file__).resolve().parent
FAKE_DIR = NATIVE_DIR / "fake_cuda"
CHILDREN = FAKE_DIR / "children.py"


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory) -> str:
    """The directory holding the stand-in libcuda.so.1 (built once per module)."""
    spec = importlib.util.spec_from_file_location("fake_cuda_build", FAKE_DIR / "build.py")
    assert spec is not None and spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    if builder.compiler() is None:
        pytest.skip("no C compiler to build the stand-in CUDA driver")
    out = tmp_path_factory.mktemp("fake_cuda")
    builder.build(str(out))
    return str(out)


def run_fake(fake_dir: str, scenario: str, *args: str, timeout: float = 90.0, log: str | None = None,
             delay_us: int = 300, devices: int = 1) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Runs ``children.py <scenario> <args>`` in a fresh interpreter that loads the stand-in
    driver; returns the process and the last ``report(...)`` it printed. ``log`` names the
    file where the stand-in logs each driver call with the caller's pid; ``devices``: how
    many devices the stand-in has."""
    env = dict(os.environ)
    env["FAKE_CUDA_DEVICES"] = str(devices)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(NATIVE_DIR), env.get("PYTHONPATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join([fake_dir, env.get("LD_LIBRARY_PATH", "")])
    env["FAKE_CUDA_COPY_DELAY_US"] = str(delay_us)
    if log is not None:
        env["FAKE_CUDA_LOG"] = log
    try:
        res = subprocess.run([sys.executable, "-X", "faulthandler", str(CHILDREN), scenario, *args], env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the stand-in driver scenario {scenario} hung ({timeout} s)\nstdout:\n{e.stdout}\n"
                    f"stderr:\n{e.stderr}")
    text = f"rc={res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.returncode == 0, text
    for bad in ("terminate called", "Segmentation fault", "Fatal Python error", "Aborted"):
        assert bad not in res.stderr, text
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("REPORT ")]
    assert lines, text
    return res, json.loads(lines[-1][len("REPORT "):])


def test_fake_driver_pinned_slot_pool_allocates_and_frees(fake_cuda, write_dataset) -> None:
    path = write_dataset(96, FIELDS, sample)
    _, rep = run_fake(fake_cuda, "pinned_slot_pool", path)
    assert rep["allocs"] >= 2 and rep["frees"] == rep["allocs"]
    # Every allocation and free pushed and popped the context on whichever thread ran it.
    assert rep["pushes"] == rep["pops"] >= rep["allocs"] + rep["frees"]


def test_fake_driver_pinned_dataloader_gives_identical_batches(fake_cuda, write_dataset) -> None:
    path = write_dataset(96, FIELDS, sample)
    _, rep = run_fake(fake_cuda, "pinned_dataloader", path)
    assert rep["allocs"] > 0 and rep["live_before"] > 0


def test_fake_driver_transformed_batches_are_staged_into_pinned_memory(fake_cuda, write_dataset) -> None:
    path = write_dataset(96, FIELDS, sample)
    _, rep = run_fake(fake_cuda, "pinned_transformed", path)
    assert rep["allocs"] > 0


def test_fake_driver_cuda_engine_delivers_exact_bytes(fake_cuda) -> None:
    _, rep = run_fake(fake_cuda, "cuda_engine_exact")
    assert rep["streams"] == 3
    assert rep["copies"] >= 3 * 40 // 2
    # Each engine's two threads (NOTE [copy engine threads]) push once for their whole life
    # and never pop.
    assert rep["pushes"] - rep["pops"] == 2 * 3


def test_fake_driver_copies_are_ordered_with_the_consumer_stream(fake_cuda) -> None:
    _, rep = run_fake(fake_cuda, "cuda_engine_ordering")
    assert rep["after_take"], "after take() and a wait on the consumer's stream the copy had not landed"
    assert rep["after_stream_work"], "the copy ran before the work queued on the consumer's stream"


def test_fake_driver_close_waits_for_copies_in_flight(fake_cuda, write_dataset) -> None:
    path = write_dataset(32, FIELDS, sample)
    _, rep = run_fake(fake_cuda, "close_in_flight", path)
    assert rep["issued"] == 3 and rep["in_flight"] > 0, f"the scenario did not have copies in flight at close: {rep}"
    assert rep["pending"] == 0, f"close() returned with {rep['pending']} operations still queued on the copy stream"
    assert all(rep["landed"]), f"issued jobs whose copies had not landed when close() returned: {rep}"
    assert rep["clean1"]
    assert rep["held_while_copying"] == 1, "a HostBatch's pinned slot returned to its pool while its copy was queued"
    assert rep["returned"], "the HostBatch's slot did not return after its copy completed"
    assert rep["ok2"], "the copy from a HostBatch's pinned slot delivered wrong bytes"
    assert rep["ok3"], "close() returned before the copy from a HostBatch's pinned slot landed"


def test_fake_driver_a_failed_copy_raises_device_error_at_take(fake_cuda) -> None:
    _, rep = run_fake(fake_cuda, "copy_error")
    assert "cuMemcpyHtoDAsync" in rep["message"] and "CUDA_ERROR_OUT_OF_MEMORY" in rep["message"], rep["message"]
    assert rep["free_ok"], "the staging slot of the failed job was lost"


def test_fake_driver_forked_child_never_calls_the_driver(fake_cuda, write_dataset, tmp_path) -> None:
    path = write_dataset(96, FIELDS, sample)
    log = str(tmp_path / "driver_calls.log")
    _, rep = run_fake(fake_cuda, "fork_after_pinned", path, str(tmp_path / "child.log"), log=log)
    assert rep["rc"] == 0, f"the forked child exited with {rep['rc']}; its steps:\n{rep['child_log']}"
    assert rep["live_at_fork"] > 0
    calls = Path(log).read_text().splitlines() if os.path.exists(log) else []
    child_calls = [c for c in calls if c.split()[0] == str(rep["child"])]
    assert not [c for c in child_calls if c.endswith("cuMemFreeHost")], \
        f"the child freed the parent's pinned memory: {child_calls}"
    assert not child_calls, f"the forked child called the CUDA driver: {child_calls}"


def test_fake_driver_pinned_pool_growing_in_a_forked_child_fails_without_a_driver_call(fake_cuda, write_dataset,
                                                                                       tmp_path) -> None:
    path = write_dataset(96, FIELDS, sample)
    log = str(tmp_path / "driver_calls.log")
    _, rep = run_fake(fake_cuda, "pinned_pool_grows_in_forked_child", path, str(tmp_path / "child.log"), log=log)
    calls = Path(log).read_text().splitlines() if os.path.exists(log) else []
    child_calls = [c for c in calls if c.split()[0] == str(rep["child"])]
    assert not child_calls, f"the forked child called the CUDA driver: {child_calls}"
    assert rep["rc"] == 0, f"the child's pinned allocation did not fail naming the fork (exit {rep['rc']}):\n" \
                           f"{rep['child_log']}"


def test_fake_driver_building_a_pin_memory_loader_calls_no_driver_until_iter(fake_cuda, write_dataset) -> None:
    path = write_dataset(96, FIELDS, sample)
    _, rep = run_fake(fake_cuda, "pinned_loader_is_lazy", path)
    assert rep["calls_before"] == 0, f"the driver was called before the loaders were built: {rep}"
    assert rep["calls_built"] == 0, f"building pin_memory DataLoaders called the CUDA driver: {rep}"
    assert rep["calls_first_iter"] > 0 and rep["allocs_first_iter"] > 0, \
        f"the first iteration did not pin through the driver: {rep}"
    assert rep["allocs_after"] > rep["allocs_first_iter"], "the other loaders' staging pools were not pinned"


def test_fake_driver_engine_thread_that_cannot_start_raises_at_construction(fake_cuda) -> None:
    _, rep = run_fake(fake_cuda, "engine_thread_start_fails")
    assert not rep["constructed"], f"CopyEngine was built although its thread could not start; later: {rep}"
    assert "copy engine thread could not start" in rep["message"] and "cuCtxPushCurrent" in rep["message"] \
        and "CUDA_ERROR_UNKNOWN" in rep["message"], rep["message"]
    assert rep["threads_left"] == 0, f"{rep['threads_left']} threads left behind by the failed construction"
    assert rep["no_ctx_calls"] == 0, f"driver calls without a context: {rep['no_ctx_functions']}"
    assert rep["streams_live"] == 0 and rep["events_live"] == 0, "the failed engine leaked its stream or events"
    assert not rep["errors"] and rep["allocs_live"] == 0 and rep["retained"] == 0, rep


def test_fake_driver_cuda_engine_requires_a_stream(fake_cuda) -> None:
    _, rep = run_fake(fake_cuda, "cuda_engine_needs_a_stream")
    assert len(rep["messages"]) == 2, f"submit() or take() accepted a missing stream= with backend='cuda': {rep}"
    assert all("stream= is required" in m for m in rep["messages"]), rep["messages"]


GROW_FIELDS: dict[str, Any] = {"tokens": ("int32", (None,)), "label": ("int64", ())}


def grow_sample(i: int) -> dict[str, Any]:
    # Lengths rise through the (unshuffled) epoch: every batch's buffers must be larger.
    return {"tokens": np.arange(16 * (i + 1), dtype=np.int32) + i, "label": i}


def test_fake_driver_pinned_cache_no_driver_calls_after_the_first_epoch(fake_cuda, write_dataset) -> None:
    # See NOTE [pinned cache]: growth by size classes, released blocks cached, none freed mid-training.
    path = write_dataset(96, GROW_FIELDS, grow_sample, shard_bytes=1 << 16)
    _, rep = run_fake(fake_cuda, "pinned_cache_across_epochs", path)
    epochs = rep["per_epoch"]
    first, *later = epochs
    assert all(e["frees"] == 0 for e in epochs), \
        f"a growing pinned buffer was freed through the driver mid-training (a device sync): {epochs}"
    # Lengths grow 12x over the epoch: doubling classes regrow the slot that meets them first
    # O(log 12) times, each other slot once (to the pool's largest), not every batch: with the
    # old 1/8 headroom this was one cuMemFreeHost + cuMemHostAlloc pair per slot every batch or two.
    assert 0 < first["allocs"] <= rep["slots"] * 3 + 2 * 5, f"{first['allocs']} pinned allocations for " \
                                                            f"{rep['slots']} slots: {epochs}"
    # Later epochs: only a slot that did not meet the longest batches yet grows, once, to the
    # pool's largest size (a new slot is made at that size).
    assert sum(e["allocs"] for e in later) <= rep["slots"], \
        f"pinned allocations after the first epoch (each synchronises the device): {epochs}"
    mem = rep["pinned"]
    assert mem["driver_frees"] == 0 and 0 < mem["cached_bytes"] <= mem["cache_limit"], mem


def test_fake_driver_pinned_memory_is_not_mapped_in_a_forked_child(fake_cuda, tmp_path) -> None:
    _, rep = run_fake(fake_cuda, "pinned_memory_is_not_inherited", str(tmp_path / "child.log"))
    assert rep["rc"] == -11, f"a forked child read the parent's pinned memory (exit {rep['rc']}): {rep['child_log']}"


def test_fake_driver_copy_stream_does_not_wait_for_a_busy_legacy_stream(fake_cuda) -> None:
    # The stand-in counts every implicit wait on the legacy stream: exactly one, the blocking
    # stream's copy, in every run. The timing shows the same where the machine lets it: a
    # loaded one can delay the engine's copy past the legacy stream's 800 ms, so up to three runs.
    reps = []
    for _ in range(3):
        _, rep = run_fake(fake_cuda, "legacy_stream_busy")
        reps.append(rep)
        assert rep["landed"], "the copy had not landed after take() and a sync of the consumer's stream"
        assert rep["blocking_s"] >= 0.25, f"the stand-in did not order a blocking stream after the legacy one: {rep}"
        assert rep["legacy_waits"] == 1, f"a job on a non-blocking stream waited for the legacy default stream: {rep}"
        if rep["engine_s"] < 0.4 and rep["legacy_left"] > 0:
            return
    raise AssertionError(f"the engine's copy landed only after the busy legacy stream's work, 3 times: {reps}")


def test_fake_driver_stream_of_another_context_is_rejected(fake_cuda) -> None:
    _, rep = run_fake(fake_cuda, "foreign_context_stream", devices=2)
    assert "cuEventRecord" in rep["message"] and "CUDA_ERROR_INVALID_HANDLE" in rep["message"], rep["message"]
    assert rep["foreign"] >= 1 and rep["ok"], rep
    assert rep["allocs_live"] == 0 and rep["retained"] == 0 and rep["no_ctx_calls"] == 0, rep


def test_fake_driver_staging_overlaps_the_copies_of_the_job_before(fake_cuda) -> None:
    # See NOTE [copy engine threads]: the engine thread never waits for the GPU, so the staging of
    # job t+1 runs while job t's copies do. Measured side by side in one process: with the
    # staging (S) and the copies (C) of each job about equal, overlapped N jobs take about
    # N * max(S, C), half the serial N * (S + C); a waiting engine thread took the whole sum
    # (1.0-1.2 of it, every run). A loaded machine can stretch one run past 0.8 (0.805 seen in
    # a CI run): up to three runs, as for the legacy stream above.
    reps = []
    for _ in range(3):
        _, rep = run_fake(fake_cuda, "staging_overlaps_copies")
        reps.append(rep)
        if rep["ratio"] < 0.8:
            return
    raise AssertionError("staging and copies did not overlap in 3 runs (both / (staging + copying alone)): "
                         + ", ".join(f"{r['ratio']:.2f}" for r in reps) + f"; {reps}")
