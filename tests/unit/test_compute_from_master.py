"""Compute shards read from the bf16 master's swap file (``offload_param.compute_from_master``, issue 13).

With bf16 or int8 states and bf16 compute, both on NVMe, a swapped sub-group's update writes its master alone and
the next forward reads the compute shards from it. The reference is the engine that writes the shards a file of
their own after backward: the same losses and states bit for bit, through speculative updates that are undone,
a checkpoint and its load. Each step writes 2 B an element less, and the shards' own files are given back."""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch

import infinity
import infinity.optim.overlapped_step
from helpers import TinyGPT, delay_storage, engine_config, gpt_batches, optimizer_states, train_batches
from infinity import kernels
from infinity.config.schema import InfinityConfig

LR = 3e-3
STEPS = 4


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT(), gpt_batches(STEPS + 2, batch=2)


def _config(folder, state_dtype: str, *, from_master: bool, overlap: bool, clip: float, behind: bool = True) -> dict:
    """``behind``: the updates backward did not reach run behind the next forward (the default). Off, the worker
    takes every sub-group that arrives during backward, whatever its pace, so speculative updates surely come."""
    folder.mkdir(parents=True, exist_ok=True)
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(folder), accum=1, clip=clip, lr=LR,
                           precision="bf16", sub_group_size=4096, overlap_step_with_backward=overlap,
                           overlap_step_with_forward=behind)
    config["zero_optimization"]["offload_optimizer"]["state_dtype"] = state_dtype
    config["zero_optimization"]["offload_param"]["compute_from_master"] = from_master
    return config


def _run(model, batches, config, *, checkpoint_after: int | None = None, folder=None):
    """Losses, states and full state dict after training on ``batches`` (closing and resuming from a checkpoint
    after ``checkpoint_after`` steps, when given), and the engine's rollbacks."""
    engine = infinity.initialize(copy.deepcopy(model), config)
    rollbacks = 0
    try:
        if checkpoint_after is not None:
            losses = train_batches(engine, batches[:checkpoint_after])
            engine.save_checkpoint(folder / "ckpt")
            rollbacks += engine.optimizer.rollbacks
            engine.close()
            engine = infinity.initialize(copy.deepcopy(model), config)
            engine.load_checkpoint(folder / "ckpt")
            losses += train_batches(engine, batches[checkpoint_after:])
        else:
            losses = train_batches(engine, batches)
        rollbacks += engine.optimizer.rollbacks
        return losses, optimizer_states(engine), engine.full_state_dict(), rollbacks
    finally:
        engine.close()


def _assert_same(got, want) -> None:
    (losses_a, states_a, full_a, _), (losses_b, states_b, full_b, _) = got, want
    assert losses_a == losses_b
    for key in states_b:
        assert torch.equal(states_a[key], states_b[key]), key
    for key in full_b:
        assert torch.equal(full_a[key], full_b[key]), key


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("overlap", [True, False])
def test_shards_read_from_the_master_train_as_shards_of_their_own(gpt, tmp_path, state_dtype, overlap):
    """Clipping at 0.5 clips most steps: the overlapped step's speculative masters (on the other side of their
    keys) are undone and redone, and the shards must be read from the side that stands."""
    model, batches = gpt
    batches = batches[:STEPS]
    want = _run(model, batches, _config(tmp_path / "own", state_dtype, from_master=False, overlap=False, clip=0.5))
    got = _run(model, batches, _config(tmp_path / "master", state_dtype, from_master=True, overlap=overlap, clip=0.5,
                                       behind=False))
    _assert_same(got, want)
    assert got[3] > 0 or not overlap  # speculative updates were undone


@pytest.mark.parametrize("clip", [0.5, 0.0], ids=["clipped", "unclipped"])
def test_late_storage_and_worker_never_change_what_is_read(gpt, tmp_path, monkeypatch, clip):
    """Requests that complete only when waited on, after a random delay, and an overlapped step's worker that
    starts each update late: a read of a shard that went ahead of its master's write, or of the wrong side,
    shows as other bits."""
    model, batches = gpt
    batches = batches[:STEPS]
    want = _run(model, batches, _config(tmp_path / "own", "bf16", from_master=False, overlap=False, clip=clip))
    delay_storage(monkeypatch)
    update = infinity.optim.overlapped_step.OverlappedStep._update

    def late(self, group, **kwargs):
        time.sleep(random.uniform(0, 0.003))
        update(self, group, **kwargs)

    monkeypatch.setattr(infinity.optim.overlapped_step.OverlappedStep, "_update", late)
    for seed in range(3):
        random.seed(seed)
        got = _run(model, batches, _config(tmp_path / f"master{seed}", "bf16", from_master=True, overlap=True,
                                           clip=clip))
        _assert_same(got, want)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_a_checkpoint_and_its_load_keep_the_same_bits(gpt, tmp_path, state_dtype):
    """Saved while the shards are read from the master, loaded (the load writes them files of their own again),
    trained on: as the engine that never shared, uninterrupted."""
    model, batches = gpt
    batches = batches[:STEPS]
    want = _run(model, batches, _config(tmp_path / "own", state_dtype, from_master=False, overlap=True, clip=1.0))
    got = _run(model, batches, _config(tmp_path / "master", state_dtype, from_master=True, overlap=True, clip=1.0),
               checkpoint_after=2, folder=tmp_path)
    _assert_same(got, want)


def _nvme_bytes_and_keys(model, batches, config) -> tuple[list[int], int, list[str], object]:
    """NVMe bytes read in each step, bytes written by all of them (their write-behind flushed), the keys the
    compute shards' store still holds after one more forward (it reads every shard), and the layout."""
    engine = infinity.initialize(copy.deepcopy(model), config)
    try:
        engine.optimizer.flush()
        written_before = engine.tiers.snapshot()["nvme"]["bytes_written"]
        reads = []
        for batch in batches:
            engine.backward(engine(*batch))
            engine.step()
            reads.append(engine.step_metrics()["tiers"]["nvme"]["bytes_read"])
        engine.optimizer.flush()
        written = engine.tiers.snapshot()["nvme"]["bytes_written"] - written_before
        engine(*batches[0])
        keys = [k for k in engine.compute._store.keys() if k.startswith("param.")]
        return reads, written, keys, engine.layout
    finally:
        engine.close()


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_each_step_writes_the_states_alone(gpt, tmp_path, state_dtype):
    """Without clipping (nothing speculative): the same bytes read, and every compute shard's 2 B an element less
    written a step; once read from the master, a shard's own file is deleted."""
    model, batches = gpt
    batches = batches[:STEPS]
    own_reads, own_written, own_keys, layout = _nvme_bytes_and_keys(
        model, batches, _config(tmp_path / "own", state_dtype, from_master=False, overlap=False, clip=0.0))
    reads, written, keys, _ = _nvme_bytes_and_keys(
        model, batches, _config(tmp_path / "master", state_dtype, from_master=True, overlap=False, clip=0.0))
    states_nbytes = sum(kernels.state_nbytes(state_dtype, group.numel) for group in layout.sub_groups)
    shard_nbytes = sum(slot.shard_numel * 2 for slot in layout.slots if slot.trainable)
    assert reads == own_reads
    assert own_written == STEPS * (states_nbytes + shard_nbytes)
    assert written == STEPS * states_nbytes
    assert len(own_keys) == len(layout.slots)
    assert keys == [f"param.{slot.index}" for slot in layout.slots if not slot.trainable]


def test_the_key_is_checked_and_fp32_states_keep_the_copies(gpt, tmp_path):
    with pytest.raises(ValueError, match="offload_param.compute_from_master must be true or false"):
        InfinityConfig.load(_config(tmp_path / "bad", "bf16", from_master="yes", overlap=True, clip=0.0))
    model, batches = gpt
    engine = infinity.initialize(copy.deepcopy(model),
                                 _config(tmp_path / "fp32", "fp32", from_master=True, overlap=True, clip=0.0))
    try:  # an fp32 master is not the bf16 shards: each keeps its file
        train_batches(engine, batches[:2])
        assert not engine.optimizer.delivery.master_groups
        assert len([k for k in engine.compute._store.keys() if k.startswith("param.")]) == len(engine.layout.slots)
    finally:
        engine.close()
