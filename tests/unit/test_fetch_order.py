"""A parameter's fetch issues its own NVMe read before the prefetches its request starts: compute waits for that
read now, and urgent reads are served in the order they were queued."""

from __future__ import annotations

import pytest
import torch

import infinity
import infinity.params.compute_shards
from helpers import TinyGPT, engine_config, gpt_batches


@pytest.mark.parametrize("distinct", [False, True], ids=["one-memory", "distinct-device"])
def test_the_first_read_of_a_forward_is_its_first_parameter(tmp_path, monkeypatch, distinct):
    monkeypatch.setenv("INFINITY_DISTINCT_DEVICE", "1" if distinct else "0")
    torch.manual_seed(0)
    model = TinyGPT()
    config = engine_config(param="nvme", optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=1e-3)
    engine = infinity.initialize(model, config)
    reads = []
    read = infinity.params.compute_shards.ComputeShards.read

    def logged(self, slot, out):
        reads.append(slot.index)
        return read(self, slot, out)

    monkeypatch.setattr(infinity.params.compute_shards.ComputeShards, "read", logged)
    fetched = []
    try:
        batches = gpt_batches(3, batch=2)
        for x, y in batches[:2]:  # the first pass traces the order; the second prefetches along it
            engine.backward(engine(x, y))
            engine.step()
        assert engine.prefetcher.plan
        fetched = [p.slot.index for p in engine.prefetcher.plan]
        reads.clear()
        engine(*batches[2])
    finally:
        engine.close()
    assert len(reads) > 1
    assert reads[0] == fetched[0], (reads[:5], fetched[:5])
