"""GPU checks (run by benchmarks/gpu_check.sh on a GPU machine; skipped elsewhere)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pyloader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_batches_reach_the_gpu_intact(tmp_path) -> None:
    path = str(tmp_path / "ds")
    with pyloader.ShardWriter(path, {"x": ("float32", (64,)), "t": ("int32", (None,))}) as w:
        for i in range(1000):
            w.write({"x": np.full(64, i, np.float32), "t": np.arange(i % 7, dtype=np.int32)})
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=128, num_workers=2)
    seen = 0
    stream = torch.cuda.Stream()
    for batch in loader:
        with torch.cuda.stream(stream):
            gpu = {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}
        torch.cuda.current_stream().wait_stream(stream)
        for k, v in batch.items():
            assert torch.equal(gpu[k].cpu(), v)
        seen += int(batch["x"].shape[0])
    assert seen == 1000
