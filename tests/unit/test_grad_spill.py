"""Gradient slices on NVMe: where the host-memory budget cannot hold them, the last sub-groups' slices rest on NVMe
between backward and the step, and training is what plain PyTorch's is."""

from __future__ import annotations

import copy

import pytest
import torch

import infinity
from helpers import TinyGPT, assert_matches, engine_config, gpt_batches, reference_train, train_batches
from infinity.placement.placement import GradRoute, distinct_device_requested

STEPS, LR = 3, 3e-3
# holds the working set and some of the 13 MiB of fp32 slices, not all (in the distinct-device mode the gathered
# parameters are device memory: less host memory for the same split)
SPILLING_BUDGET = (38 if distinct_device_requested() else 42) << 20
SUB_GROUP = 262144          # the largest shard: the same sub-groups under every budget


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT(vocab=256, d=256, n_layer=4, n_head=4, seq=16)


def _config(tmp_path, *, accum, clip, overlap, budget=SPILLING_BUDGET, precision="fp32", grad_accumulation=None):
    config = engine_config(param="cpu", optimizer="nvme", nvme_path=str(tmp_path), accum=accum, clip=clip, lr=LR,
                           precision=precision, overlap_step_with_backward=overlap, sub_group_size=SUB_GROUP,
                           host_memory_budget=budget)
    if grad_accumulation is not None:
        config["zero_optimization"]["offload_optimizer"]["grad_accumulation"] = grad_accumulation
    return config


def _run(model, batches, config):
    engine = infinity.initialize(copy.deepcopy(model), config)
    try:
        losses = train_batches(engine, batches)
        slices = engine.reducer.slices
        state = engine.full_state_dict()
        engine.optimizer.flush()  # the last writes behind the step have landed: the run's bytes are all counted
        return losses, state, engine.tiers.snapshot(), engine, (slices.numel(), slices.dtype)
    finally:
        engine.close()


def _spilled_payload(engine, dtype: torch.dtype) -> int:
    """Bytes of the slices that rest on NVMe (each slot's shard, as written)."""
    first = engine.placement.nvme_grads_from
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(s.shard_numel * itemsize for g in engine.layout.sub_groups[first:] for s in g.slots)


@pytest.mark.parametrize("accum, overlap, grad_accumulation", [(1, False, None), (1, True, None), (2, False, None),
                                                                (2, True, None), (2, True, "host")])
def test_spilled_slices_train_as_plain_pytorch(gpt, tmp_path, accum, overlap, grad_accumulation):
    """Clipping on (every step clips here: the overlapped step's speculative updates are undone and redone from the
    slices read back), accumulation adding to the sums on NVMe; every gradient route (distinct-device mode too)."""
    batches = list(gpt_batches(STEPS * accum, batch=2, vocab=256))
    losses, state, _, engine, (slices_numel, _) = _run(gpt, batches, _config(tmp_path, accum=accum, clip=1.0, overlap=overlap,
                                                                 grad_accumulation=grad_accumulation))
    first = engine.placement.nvme_grads_from
    assert first is not None and first < len(engine.layout.sub_groups)
    if grad_accumulation is None:  # (the host ring's reserve leaves no room for any in the distinct-device mode)
        assert first > 0  # some slices in memory, the rest on NVMe
    assert slices_numel == engine.layout.sub_groups[first].start
    assert engine.tiers.host_memory.peak_nbytes <= SPILLING_BUDGET
    reference = reference_train(gpt, batches, steps=STEPS, accum=accum, clip=1.0, lr=LR)
    assert_matches((losses, state), reference, f"accumulation {accum}, overlap {overlap}")


@pytest.mark.parametrize("accum", [1, 2])
def test_the_disk_moves_the_slices_once_a_micro_batch_and_the_step_reads_them_once(gpt, tmp_path, accum):
    """Against the same run with every slice in memory: the same bits, and on NVMe exactly the spilled slices'
    bytes more a step, written every micro-batch and read back by every micro-batch after the first and by the
    step (once a step where the device accumulates them)."""
    batches = list(gpt_batches(STEPS * accum, batch=2, vocab=256))
    spilled = _run(gpt, batches, _config(tmp_path / "a", accum=accum, clip=0.0, overlap=False))
    in_memory = _run(gpt, batches, _config(tmp_path / "b", accum=accum, clip=0.0, overlap=False, budget=1 << 30))
    assert in_memory[3].placement.nvme_grads_from is None
    assert spilled[0] == in_memory[0]
    for key, value in in_memory[1].items():
        assert torch.equal(spilled[1][key], value), key
    payload = _spilled_payload(spilled[3], spilled[4][1])
    nvme, nvme_ref = spilled[2]["nvme"], in_memory[2]["nvme"]
    # accumulated on the device (the distinct-device mode), a slice goes down and is written once a step
    writes = 1 if spilled[3].placement.grad_route is GradRoute.DEVICE_THEN_HOST else accum
    assert nvme["bytes_written"] - nvme_ref["bytes_written"] == STEPS * writes * payload
    assert nvme["bytes_read"] - nvme_ref["bytes_read"] == STEPS * writes * payload


def test_bf16_slices_spilled_are_the_slices_kept(gpt, tmp_path):
    """bf16 compute, one micro-batch: the slices go to NVMe in bf16 as they are and come back bit for bit."""
    batches = list(gpt_batches(STEPS, batch=2, vocab=256))
    spilled = _run(gpt, batches, _config(tmp_path / "a", accum=1, clip=0.0, overlap=True, precision="bf16",
                                         budget=20 << 20))
    in_memory = _run(gpt, batches, _config(tmp_path / "b", accum=1, clip=0.0, overlap=True, precision="bf16",
                                           budget=1 << 30))
    assert spilled[3].placement.nvme_grads_from is not None and spilled[4][1] == torch.bfloat16
    assert spilled[0] == in_memory[0]
    for key, value in in_memory[1].items():
        assert torch.equal(spilled[1][key], value), key
