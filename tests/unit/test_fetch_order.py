"""A parameter's fetch issues its own NVMe read before the prefetches its request starts: compute waits for that
read now, and urgent reads are served in the order they were queued."""

from __future__ import annotations

import copy

import pytest
import torch

import infinity
import infinity.params.compute_shards
from helpers import TinyGPT, engine_config, gpt_batches, reference_train


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


def test_evaluation_between_training_steps_leaves_the_training_plan(tmp_path):
    """A forward without grad follows a plan of its own: training and evaluation taking turns change no plan (each
    training pass after an evaluation follows the training plan to its end), and training is plain AdamW's."""
    torch.manual_seed(0)
    model = TinyGPT()
    batches = gpt_batches(6, batch=2)
    held_out = gpt_batches(1, batch=2, seed=9)[0]
    config = engine_config(param="nvme", optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=1e-3)
    engine = infinity.initialize(copy.deepcopy(model), config)
    losses = []
    try:
        for i, (x, y) in enumerate(batches):
            if i >= 3:  # the training plan is learned (pass 1) and followed (pass 2); evaluate before each of the rest
                with torch.no_grad():
                    engine(*held_out)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        order_changes = engine.prefetcher.order_changes
        training_plan = list(engine.prefetcher.plan)
    finally:
        engine.close()
    ref_losses, _ = reference_train(model, batches, steps=len(batches), accum=1, clip=0.0, lr=1e-3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert order_changes == 0
    assert len(set(training_plan)) == len(engine.params) and len(training_plan) > len(engine.params)  # and backward


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "training"])
def test_a_pass_that_raises_midway_leaves_its_plan_and_keeps_nothing(tmp_path, grad):
    """An interrupted pass (Ctrl-C in generate) fetched only a prefix of the model: its trace is no plan, so the
    next whole pass follows the old one without an order change, and it computes plain PyTorch's loss."""
    torch.manual_seed(0)
    model = TinyGPT()
    x, y = gpt_batches(1, batch=2)[0]
    # lr 0: the training steps leave the model as plain PyTorch's
    config = engine_config(param="nvme", optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=0.0)
    engine = infinity.initialize(copy.deepcopy(model), config)

    def interrupt(module, args):
        raise KeyboardInterrupt

    try:
        with torch.set_grad_enabled(grad):
            for _ in range(2):  # the plan is learned, then followed
                loss = engine(x, y)
                if grad:
                    engine.backward(loss)
                    engine.step()
            plan = list(engine.prefetcher.plan)
            hook = engine.module.blocks[1].register_forward_pre_hook(interrupt)
            with pytest.raises(KeyboardInterrupt):
                engine(x, y)
            hook.remove()
            kept = sum(p.state is not infinity.params.sharded_param.ParamState.RELEASED for p in engine.params
                       if not p.persistent)
            loss = engine(x, y)
        order_changes = engine.prefetcher.order_changes
        same_plan = list(engine.prefetcher.plan) == plan
    finally:
        engine.close()
    with torch.no_grad():
        expected = model(x, y)
    assert kept == 0
    assert order_changes == 0 and same_plan
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
