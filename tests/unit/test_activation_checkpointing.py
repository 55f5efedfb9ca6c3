"""Activation checkpointing under the engine: a block recomputed in backward fetches its parameters again (its
forward hooks run again, inside backward) and releases them after its backward, as in any pass.

Recomputing a block gives the same values (plain PyTorch with and without checkpointing agree bit for bit), so the
reference is the same engine without checkpointing, bit for bit, and plain PyTorch's losses. A block recomputed
with released parameters shows as a wrong value; a parameter left gathered after its backward, as a holder still
counted after the step. (Our GPT's key bias has a gradient that is zero but for rounding, which Adam turns into
full-size steps: its values are compared with plain PyTorch's through the losses, not one by one.)"""

from __future__ import annotations

import copy

import pytest
import torch

import infinity
from helpers import engine_config, engine_steps, gpt_batches, reference_train
from infinity.models.gpt import GPT, GPTConfig
from infinity.placement.estimate_gpt import gpt_activation_nbytes

STEPS, ACCUM = 3, 2


def small_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=3, n_head=2, d_model=32, seq_len=16, vocab_size=64))


def nothing_held(engine, step: int) -> None:
    """After a step every gathered parameter was released by as many holders as fetched it."""
    held = {p.name: p.holders for group in engine.groups.values() for p in group.params if p.holders}
    assert not held, f"step {step}: parameters still held after the step: {held}"


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("tiers", [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme")], ids=lambda t: "-".join(t))
def test_checkpointed_blocks_train_as_without_checkpointing(tmp_path, tiers, reentrant):
    model = small_gpt()
    batches = gpt_batches(STEPS * ACCUM, batch=2)
    reference_losses, _ = reference_train(model, batches, steps=STEPS, accum=ACCUM, clip=1.0, lr=1e-2)
    config = engine_config(param=tiers[0], optimizer=tiers[1], nvme_path=str(tmp_path), accum=ACCUM, clip=1.0,
                           lr=1e-2)
    plain_losses, plain_state, _, _ = engine_steps(model, config, batches, steps=STEPS, accum=ACCUM,
                                                   after_step=nothing_held)
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable({"use_reentrant": reentrant})
    recomputed = []

    def count_recomputes(engine):
        # a block's forward inside backward is a recompute: counted, so the test knows checkpointing ran
        def hook(module, args):
            if torch._C._current_graph_task_id() != -1:
                recomputed.append(module)
        for block in engine.module.blocks:
            block.register_forward_pre_hook(hook)

    losses, state, _, _ = engine_steps(checkpointed, config, batches, steps=STEPS, accum=ACCUM,
                                       setup=count_recomputes, after_step=nothing_held)
    assert len(recomputed) == STEPS * ACCUM * 3  # every block recomputed in every backward
    assert losses == plain_losses
    for name, value in plain_state.items():
        assert torch.equal(state[name], value), name
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-5, atol=1e-6)


def test_every_other_block_and_evaluation_are_not_recomputed():
    model = small_gpt()
    model.activation_checkpointing_enable(every_n_layers=2)
    calls = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: calls.append(torch._C._current_graph_task_id() != -1))
    ids, targets = gpt_batches(1, batch=2)[0]
    model(ids, targets).backward()
    assert calls.count(True) == 2  # blocks 0 and 2 of 3, once more each in backward
    calls.clear()
    model.eval()
    model(ids, targets).backward()
    assert not any(calls)
    with pytest.raises(ValueError, match="every_n_layers"):
        model.activation_checkpointing_enable(every_n_layers=0)


def test_the_estimate_keeps_a_block_input_a_layer_and_one_block_with_checkpointing():
    cfg = GPTConfig(n_layer=24, n_head=16, d_model=1024, seq_len=4096)
    full = gpt_activation_nbytes(cfg, micro_batch=1, precision="bf16")
    kept = gpt_activation_nbytes(cfg, micro_batch=1, precision="bf16", activation_checkpointing=True)
    block_input = 4096 * 1024 * 2
    per_block = 17 * block_input
    # 24 blocks' activations less (23 recomputed ones' and one block's input each)
    assert full - kept == 24 * per_block - (24 * block_input + per_block)
    assert kept < full / 5


def _backward_peak_nbytes(model, tmp_path) -> tuple[int, int]:
    """The gathered parameters' most bytes above those live when backward starts, in one backward with
    parameters on NVMe (nothing fetched ahead or kept for reuse), and one block's parameters' bytes."""
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=1e-2,
                           stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    with infinity.initialize(copy.deepcopy(model), config) as engine:
        gathered = engine.tiers.stats["device"]
        ids, targets = gpt_batches(1, batch=2)[0]
        loss = engine(ids, targets)
        gathered.reset_peak()
        start = gathered.live_nbytes
        engine.backward(loss)
        peak = gathered.peak_nbytes - start
        engine.step()
    block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    return peak, block


def test_a_recomputed_blocks_parameters_are_released_as_its_backward_goes(tmp_path):
    """A recompute gathers the block's modules one by one again; each is released after its backward. Were they
    held to the end of backward, the three blocks' parameters would all be gathered by then."""
    model = small_gpt()
    plain_peak, block = _backward_peak_nbytes(model, tmp_path / "plain")
    model.activation_checkpointing_enable()
    checkpointed_peak, _ = _backward_peak_nbytes(model, tmp_path / "checkpointed")
    assert plain_peak > 0
    assert checkpointed_peak <= plain_peak + block < 3 * block
