"""Compute shards read from the staging set that still holds them after their update, not from NVMe.

The reference is the same engine with every read going to the disk (``StagedShards.copy`` finds nothing):
the same losses, optimizer states and full state dict bit for bit, with fp32 states (the shards' own files are
written from the set's compute buffer) and with bf16/int8 states whose master is read as the compute shards,
through updates during backward, speculative ones that commit (a threshold nothing reaches) or are undone and
redone behind the next forward (clipping at 0.5), and the step after backward. More sub-groups than staging sets,
so sets are reused while they hold shards."""

from __future__ import annotations

import copy

import pytest
import torch

import infinity
from helpers import TinyGPT, engine_config, gpt_batches, optimizer_states, train_batches
from infinity.params.staging import StagedShards

STEPS = 5


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT(), gpt_batches(STEPS, batch=2)


def _config(folder, state_dtype: str, *, clip: float, overlap: bool) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(folder), accum=1, clip=clip, lr=3e-3,
                           precision="bf16", sub_group_size=4096, overlap_step_with_backward=overlap)
    config["zero_optimization"]["offload_optimizer"].update(state_dtype=state_dtype, buffer_count=3)
    return config


def _run(model, batches, config) -> tuple[list[float], dict, dict, int, int]:
    engine = infinity.initialize(copy.deepcopy(model), config)
    try:
        assert len(engine.layout.sub_groups) > 3  # sets are reused within a step
        losses, from_staging = [], 0
        for batch in batches:
            losses += train_batches(engine, [batch])
            from_staging += engine.step_metrics()["compute_shards_from_staging_nbytes"]
        # the whole run's reads, the last step's updates behind the forward included (a step's metrics count the
        # reads of the updates behind its forward, which the load on the machine decides)
        engine.finish_step()
        nvme_read = engine.tiers.snapshot()["nvme"]["bytes_read"]
        states = optimizer_states(engine)
        return losses, states, engine.full_state_dict(), from_staging, nvme_read
    finally:
        engine.close()


@pytest.mark.parametrize("state_dtype,clip,overlap", [
    ("fp32", 0.0, True), ("int8", 0.0, True),   # updates during backward
    ("int8", 1e6, True),                         # speculative updates that commit
    ("int8", 0.5, True), ("bf16", 0.5, True),   # undone, redone behind the next forward
    ("fp32", 0.5, False), ("bf16", 0.0, False),  # the step after backward
])
def test_shards_from_staging_train_as_from_nvme(gpt, tmp_path, monkeypatch, state_dtype, clip, overlap):
    model, batches = gpt
    with monkeypatch.context() as m:
        m.setattr(StagedShards, "copy", lambda self, *args: False)
        ref_losses, ref_states, ref_full, none, ref_read = _run(model, batches, _config(tmp_path / "disk", state_dtype,
                                                                                       clip=clip, overlap=overlap))
    assert none == 0
    losses, states, full, from_staging, nvme_read = _run(model, batches, _config(tmp_path / "staged", state_dtype,
                                                                                 clip=clip, overlap=overlap))
    assert from_staging > 0
    assert nvme_read < ref_read
    assert losses == ref_losses
    for key, value in ref_states.items():
        assert torch.equal(states[key], value), key
    for name, value in ref_full.items():
        assert torch.equal(full[name], value), name


def test_what_is_readable_and_when():
    staged, told = StagedShards(), []
    staged.on_read = told.append
    values = torch.arange(10.0)
    owner, other = object(), object()
    out = torch.empty(3)
    assert not staged.copy(0, 7, 2, out)  # nothing kept
    staged.keep(0, values, owner, [7, 8])
    assert staged.holds_unread(owner) and not staged.holds_unread(other)
    assert staged.copy(0, 7, 2, out) and out.tolist() == [2.0, 3.0, 4.0]
    assert told == [] and staged.holds_unread(owner)
    assert staged.copy(0, 8, 5, out) and out.tolist() == [5.0, 6.0, 7.0]
    assert told == [owner] and not staged.holds_unread(owner)  # both read: the set is free for reads ahead
    assert staged.hits == 2 and staged.hit_nbytes == 24

    # a speculative update is readable once published; undone, the values before it stay readable
    staged.keep(0, values + 100, other, [7], speculative=True)
    assert staged.copy(0, 7, 0, out) and out[0] == 0.0
    staged.discard_held([0])
    staged.publish([0])
    assert staged.copy(0, 7, 0, out) and out[0] == 0.0
    staged.keep(0, values + 100, other, [7], speculative=True)
    staged.publish([0])
    assert staged.copy(0, 7, 0, out) and out[0] == 100.0

    staged.release(other)  # the set is about to be overwritten
    assert not staged.copy(0, 7, 0, out)
    staged.keep(1, values, owner, [1])
    staged.forget(1)  # written some other way
    assert not staged.copy(1, 1, 0, out)


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_a_checkpoint_loaded_into_the_engine_is_what_the_next_forward_reads(gpt, tmp_path, state_dtype):
    """Steps 3-4 after loading step 2's checkpoint into the same engine, whose sets still hold step 4's shards,
    are steps 3-4 again, bit for bit."""
    model, batches = gpt
    engine = infinity.initialize(copy.deepcopy(model), _config(tmp_path / "swap", state_dtype, clip=0.0,
                                                               overlap=True))
    try:
        train_batches(engine, batches[:2])
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        first = train_batches(engine, batches[2:4])
        state = engine.full_state_dict()
        assert engine.compute.staged.hits > 0
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        again = train_batches(engine, batches[2:4])
        assert again == first
        for name, value in engine.full_state_dict().items():
            assert torch.equal(value, state[name]), name
    finally:
        engine.close()
