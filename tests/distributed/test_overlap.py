"""Overlap (prefetching, the step during backward) changes timing, never results."""

from __future__ import annotations

import copy
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity
from helpers import TinyGPT, delay_storage, engine_config, engine_train, gpt_batches, reference_train


def _train(model, batches, tmp_path, *, overlap: bool, param="nvme", optimizer="nvme", accum=2, steps=4):
    config = engine_config(param=param, optimizer=optimizer, nvme_path=str(tmp_path), accum=accum, clip=0.0, lr=3e-3,
                           overlap_step_with_backward=overlap,
                           stage3_prefetch_bucket_size=50_000_000 if overlap else 0,
                           stage3_max_reuse_distance=1_000_000_000 if overlap else 0)
    return engine_train(model, config, batches, steps=steps, accum=accum)


@pytest.mark.parametrize("param, optimizer", [("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu"), ("none", "none")])
def test_overlap_on_equals_off_bitwise(tmp_path, param, optimizer):
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(8, batch=4)
    on_losses, on_state, metrics = _train(model, batches, tmp_path, overlap=True, param=param, optimizer=optimizer)
    assert metrics["sub_groups_during_backward"] >= 1  # the step really ran during backward
    off_losses, off_state, _ = _train(model, batches, tmp_path, overlap=False, param=param, optimizer=optimizer)
    assert on_losses == off_losses
    for key in off_state:
        assert torch.equal(on_state[key], off_state[key]), key


def test_overlap_is_refused_with_clipping(caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="infinity.engine"):
        engine = infinity.initialize(torch.nn.Linear(2, 2), {"gradient_clipping": 1.0})
    assert not engine.overlap_step and "gradient clipping" in caplog.text
    engine.close()


class Branchy(nn.Module):
    """The order of the layers depends on the data: the fetch order changes from step to step.

    (Every layer runs each step: torch's AdamW skips a parameter that got no gradient, while the
    engine, like DeepSpeed, updates it with a zero gradient.)"""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        h = self.b(torch.tanh(self.a(h))) if x[0, 0] > 0 else self.a(torch.tanh(self.b(h)))
        return F.mse_loss(self.out(torch.tanh(h)).squeeze(-1).float(), y)


def test_changing_fetch_order_trains_correctly(tmp_path):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, generator=g)) for _ in range(12)]
    model = Branchy()
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=1e-2)
    engine = infinity.initialize(copy.deepcopy(model), config)
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    changes, prefetched = engine.prefetcher.order_changes, engine.prefetcher.prefetched
    engine.close()
    ref_losses, _ = reference_train(model, batches, steps=12, accum=1, clip=0.0, lr=1e-2, weight_decay=0.01)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert changes >= 2 and prefetched > 0


def test_delayed_completions_give_the_same_results(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(6, batch=4)
    real_losses, real_state, _ = _train(model, batches, tmp_path, overlap=True, steps=3)
    delay_storage(monkeypatch)
    slow_losses, slow_state, _ = _train(model, batches, tmp_path, overlap=True, steps=3)
    assert slow_losses == real_losses
    for key in real_state:
        assert torch.equal(slow_state[key], real_state[key]), key


def test_trace_has_a_track_per_activity_and_steps_summarize(tmp_path):
    import json
    torch.manual_seed(0)
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=1e-3)
    config["trace"] = {"path": str(tmp_path / "trace.json")}
    engine = infinity.initialize(TinyGPT(), config)
    for x, y in gpt_batches(2, batch=2):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    summary = engine.step_metrics()["timeline"]
    engine.close()
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "nvme read", "nvme write", "optimizer"} <= names
    tids = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert len(tids) >= 4
    assert summary["compute_s"] > 0 and summary["io_s"] > 0
    assert 0 <= summary["io_exposed_s"] <= summary["io_s"]


def test_lr_set_after_the_overlapped_update_is_an_error(tmp_path):
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=None, accum=1, clip=0.0, lr=1e-3)
    engine = infinity.initialize(TinyGPT(), config)
    x, y = gpt_batches(1, batch=2)[0]
    engine.lr = 2e-3                      # before the forward: fine
    loss = engine(x, y)
    engine.backward(loss)
    with pytest.raises(RuntimeError, match="set the learning rate before"):
        engine.lr = 5e-3
    engine.step()
    engine.lr = 5e-3                      # after step(): fine again
    engine.close()
