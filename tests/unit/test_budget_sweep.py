"""A host-memory budget is enforced, not advisory: over budgets from below the minimum working set to well above it,
each run is either refused at ``initialize`` with a ``ValueError`` naming ``zero_optimization.host_memory_budget``
(before any step, nothing on disk) or trains as plain PyTorch does within the budget; never a ``MemoryError``
mid-run. The planner hands resting states (compute shards and optimizer sub-groups kept in host memory) only what
the run's gathered parameters, prefetches and buffers leave, so the failures of a budget are not left to chance."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import infinity
from helpers import TinyGPT, assert_matches, engine_config, gpt_batches, reference_train, train_batches

STEPS, LR, CLIP = 2, 3e-3, 1.0
BUDGETS_KIB = [int(1024 * 1.25 ** i) for i in range(11)]  # 1 MiB (the least a budget may be) .. ~9.3 MiB
"""From below this model's minimum working set (the smallest persistence and precision) to well above its
largest one."""


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=96, n_layer=2, n_head=2, seq=16)  # a root parameter and a tied head: fetch chains
    return model, gpt_batches(STEPS, batch=4)


def _config(tmp_path, budget_nbytes: int, *, precision: str, persistence: int) -> dict:
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(tmp_path), accum=1, clip=CLIP, lr=LR,
                           precision=precision, host_memory_budget=budget_nbytes, sub_group_size=10**8)
    zero = config["zero_optimization"]
    zero["stage3_param_persistence_threshold"] = persistence
    zero["offload_param"].pop("max_in_cpu")      # the budget decides what stays in host memory
    zero["offload_optimizer"].pop("max_in_cpu")
    return config


def _train(model, batches, config):
    """The losses and final state of 2 steps, or the ValueError that refused the budget at initialize."""
    try:
        engine = infinity.initialize(copy.deepcopy(model), config)
    except ValueError as refused:
        return refused
    try:
        losses = train_batches(engine, batches)
        state = engine.full_state_dict()
        peak = engine.tiers.host_memory.peak_nbytes
    finally:
        engine.close()
    return losses, state, peak


# persistence 100000: every parameter stays gathered from its first use (the failure that made this test); 0: each
# module's parameters are fetched on demand, prefetched and kept for reuse within the budget
@pytest.mark.parametrize("persistence", [100_000, 0])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_budget_is_refused_up_front_or_trains_exactly_within_it(gpt, tmp_path, precision, persistence):
    model, batches = gpt
    if precision == "fp32":
        reference = reference_train(model, batches, steps=STEPS, accum=1, clip=CLIP, lr=LR)
    else:  # bf16 has no plain-PyTorch twin at 1e-5: the same engine with room to spare is the reference
        ample = _train(model, batches, _config(tmp_path / "ample", 1 << 30, precision=precision,
                                               persistence=persistence))
        reference = ample[:2]
    refused, trained = [], []
    for kib in BUDGETS_KIB:
        budget = kib << 10
        swap = tmp_path / f"{kib}"
        swap.mkdir()
        result = _train(model, batches, _config(swap, budget, precision=precision, persistence=persistence))
        if isinstance(result, ValueError):
            message = str(result)
            assert "zero_optimization.host_memory_budget" in message, message
            assert os.listdir(swap) == [], f"{kib} KiB: refused, but the swap folder was written"
            refused.append(kib)
            continue
        losses, state, peak = result
        assert peak <= budget, f"{kib} KiB: host memory peaked at {peak} bytes"
        if precision == "fp32":
            assert_matches((losses, state), reference, f"{kib} KiB")
        else:
            assert losses == reference[0], f"{kib} KiB"
            for key, value in reference[1].items():
                assert torch.equal(state[key], value), f"{kib} KiB: {key}"
        trained.append(kib)
    # the sweep crosses the minimum: the smallest budgets are refused, every one above the first accepted trains
    assert refused and trained and max(refused) < min(trained), (refused, trained)
