"""Overlap (prefetching, the step during backward) changes timing, never results."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity
from helpers import TinyGPT, delay_storage, engine_config, engine_steps, engine_train, gpt_batches, reference_train


def assert_same_training(on_losses, on_state, off_losses, off_state) -> None:
    """The overlapped run's losses and final state dict are the other run's, bit for bit."""
    assert on_losses == off_losses
    for key in off_state:
        assert torch.equal(on_state[key], off_state[key]), key


# With the updates behind the forward (the default), the sub-groups the worker has not begun when backward ends
# wait for the next forward: how many it updates during backward then depends on its pace. Without, it takes
# every sub-group that arrives, so counts of speculated and undone updates are the same on every machine.
BEHIND = pytest.mark.parametrize("behind", [True, False], ids=["behind-forward", "during-backward"])


def _train(model, batches, tmp_path, *, overlap: bool, param="nvme", optimizer="nvme", accum=2, steps=4,
           behind=True):
    config = engine_config(param=param, optimizer=optimizer, nvme_path=str(tmp_path), accum=accum, clip=0.0, lr=3e-3,
                           overlap_step_with_backward=overlap, overlap_step_with_forward=behind,
                           stage3_prefetch_bucket_size=50_000_000 if overlap else 0,
                           stage3_max_reuse_distance=1_000_000_000 if overlap else 0)
    return engine_train(model, config, batches, steps=steps, accum=accum)


@BEHIND
@pytest.mark.parametrize("param, optimizer", [("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu"), ("none", "none")])
def test_overlap_on_equals_off_bitwise(tmp_path, param, optimizer, behind):
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(8, batch=4)
    on_losses, on_state, metrics = _train(model, batches, tmp_path, overlap=True, param=param, optimizer=optimizer,
                                          behind=behind)
    assert metrics["sub_groups_during_backward"] >= 1 or behind  # the step really ran during backward
    off_losses, off_state, _ = _train(model, batches, tmp_path, overlap=False, param=param, optimizer=optimizer)
    assert_same_training(on_losses, on_state, off_losses, off_state)


def _speculate_always(monkeypatch):
    """Every overlapped step speculates on every sub-group, even once its norm already says it will clip or
    overflow: every such step is undone (the policy that avoids this is what the other runs use)."""
    from infinity.engine.engine import Engine
    from infinity.optim.speculation import StepCheck

    monkeypatch.setattr(StepCheck, "surely_rejected", lambda self, sq_norm: False)
    original = Engine._step_check
    monkeypatch.setattr(Engine, "_step_check",
                        lambda self: dataclasses.replace(original(self), speculate=True))


def _steps(model, batches, tmp_path, *, overlap, param, optimizer, clip, accum=2, steps=6, **extra):
    config = engine_config(param=param, optimizer=optimizer, nvme_path=str(tmp_path), accum=accum, clip=clip,
                           lr=3e-3, overlap_step_with_backward=overlap, **extra)
    return engine_steps(model, config, batches, steps=steps, accum=accum)


@BEHIND
@pytest.mark.parametrize("policy", ["adaptive", "speculate-always"])
@pytest.mark.parametrize("param, optimizer", [("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu"), ("none", "none")])
def test_overlap_with_clipping_equals_off_bitwise(tmp_path, monkeypatch, param, optimizer, policy, behind):
    """Some steps clip and some do not: the overlapped step commits the ones that do not and undoes and
    redoes the others, and every result equals the step after backward's, bit for bit."""
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(12, batch=4)
    _, _, unclipped, _ = _steps(model, batches, tmp_path, overlap=False, param=param, optimizer=optimizer, clip=0.0)
    clip = sorted(m["grad_norm"] for m in unclipped)[len(unclipped) // 2]  # a threshold between the norms
    if policy == "speculate-always":
        _speculate_always(monkeypatch)
    on_losses, on_state, on_metrics, _ = _steps(model, batches, tmp_path, overlap=True, param=param,
                                                optimizer=optimizer, clip=clip, overlap_step_with_forward=behind)
    off_losses, off_state, off_metrics, _ = _steps(model, batches, tmp_path, overlap=False, param=param,
                                                   optimizer=optimizer, clip=clip)
    outcomes = [m["overlapped_step"] for m in on_metrics]
    assert {"committed", "redone"} <= set(outcomes), outcomes
    assert on_metrics[-1]["rollbacks"] >= 1 or behind  # some step really was undone
    assert [m["grad_norm"] for m in on_metrics] == [m["grad_norm"] for m in off_metrics]
    assert_same_training(on_losses, on_state, off_losses, off_state)


@BEHIND
@pytest.mark.parametrize("policy", ["adaptive", "speculate-always"])
@pytest.mark.parametrize("param, optimizer", [("nvme", "nvme"), ("cpu", "cpu")])
def test_overlap_with_fp16_overflow_equals_off_bitwise(tmp_path, monkeypatch, param, optimizer, policy, behind):
    """fp16 with a loss scale that overflows at first: the overflowing steps are skipped (their speculative
    updates undone, compute shards included) exactly as the step after backward skips them."""
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(12, batch=4)
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 19, "hysteresis": 1}}
    if policy == "speculate-always":
        _speculate_always(monkeypatch)
    runs = {}
    for overlap in (True, False):
        config = engine_config(param=param, optimizer=optimizer, nvme_path=str(tmp_path), accum=2, clip=1.0, lr=3e-3,
                               overlap_step_with_backward=overlap, overlap_step_with_forward=behind)
        config.pop("bf16")
        config.update(fp16)
        runs[overlap] = engine_steps(model, config, batches, steps=6, accum=2)
    (on_losses, on_state, on_metrics, _), (off_losses, off_state, off_metrics, _) = runs[True], runs[False]
    outcomes = [m["overlapped_step"] for m in on_metrics]
    assert "skipped" in outcomes and outcomes[-1] != "skipped", outcomes
    assert [m["skipped"] for m in on_metrics] == [m["skipped"] for m in off_metrics]
    if policy == "speculate-always" and not behind:
        assert on_metrics[-1]["rollbacks"] >= outcomes.count("skipped")
    assert_same_training(on_losses, on_state, off_losses, off_state)


def test_a_disk_without_room_for_two_sides_waits_for_the_norm(tmp_path, monkeypatch, caplog):
    """Undoing a swapped sub-group needs its states twice on NVMe. Where the disk cannot hold that, nothing
    goes to a second side: swapped sub-groups wait for the norm (even when the policy says speculate), and the
    results are still those of the step after backward, bit for bit."""
    import shutil
    from collections import namedtuple

    from infinity.storage import SwapStore

    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(12, batch=4)
    _, _, unclipped, _ = _steps(model, batches, tmp_path, overlap=False, param="nvme", optimizer="nvme", clip=0.0)
    clip = sorted(m["grad_norm"] for m in unclipped)[len(unclipped) // 2]
    off_losses, off_state, _, _ = _steps(model, batches, tmp_path, overlap=False, param="nvme", optimizer="nvme",
                                         clip=clip)
    _speculate_always(monkeypatch)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, (1 << 30) - 4096, 4096))
    second_side = []
    for method in ("reserve", "write"):
        original = getattr(SwapStore, method)

        def recording(self, key, *args, _original=original, **kwargs):
            if key.endswith(".b"):
                second_side.append(key)
            return _original(self, key, *args, **kwargs)
        monkeypatch.setattr(SwapStore, method, recording)
    with caplog.at_level("WARNING", logger="infinity.optim.on_nvme"):
        on_losses, on_state, on_metrics, _ = _steps(model, batches, tmp_path, overlap=True, param="nvme",
                                                    optimizer="nvme", clip=clip)
    assert "swapped sub-groups wait for the global norm" in caplog.text
    assert second_side == []
    assert on_metrics[-1]["rollbacks"] == 0  # nothing was speculated, so nothing was undone
    assert_same_training(on_losses, on_state, off_losses, off_state)


def test_a_forward_without_backward_leaves_no_step_behind(tmp_path):
    """A boundary forward begins the overlapped step; when its loss is not back-propagated (non-finite, say),
    a checkpoint still saves the last step's state, and training goes on exactly as if it had not run."""
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(4, batch=4)
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(tmp_path), accum=1, clip=1.0, lr=3e-3)
    ref_losses, ref_state, _ = engine_train(model, config, batches, steps=4, accum=1)
    engine = infinity.initialize(copy.deepcopy(model), config)
    losses = []
    try:
        for i, (x, y) in enumerate(batches):
            if i == 2:
                engine(x, y)  # a forward whose loss is dropped
                engine.save_checkpoint(tmp_path / "ck")
                assert engine.optimizer.step_count == 2
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        state = engine.full_state_dict()
    finally:
        engine.close()
    assert losses == ref_losses
    for key in ref_state:
        assert torch.equal(state[key], ref_state[key]), key


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
