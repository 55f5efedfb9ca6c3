"""Parity: the engine at world size 1 and 2, every combination of parameter and
optimizer tiers, against the same model trained by plain PyTorch AdamW in one
process (gradient accumulation 2, clipping 1.0, 10 steps)."""

from __future__ import annotations

import itertools
import tempfile

import pytest
import torch

from helpers import (TiedMLP, TinyGPT, engine_config, engine_train, gpt_batches, mlp_batches, reference_train,
                     run_ranks)

STEPS, ACCUM, CLIP, LR = 10, 2, 1.0, 3e-3
STEPS_AT_TWO_RANKS = 5
"""Two gloo ranks on a 2-core box spend their time in some 10,000 small collectives: half the steps, every tier."""
TIERS = ("none", "cpu", "nvme")
COMBOS = list(itertools.product(TIERS, TIERS))


def _models():
    torch.manual_seed(0)
    return {
        "gpt": (TinyGPT(), gpt_batches(STEPS * ACCUM, batch=4)),
        "mlp": (TiedMLP(), mlp_batches(STEPS * ACCUM, batch=4)),
    }


def _run_all(rank: int, world_size: int, precision: str = "fp32", steps: int = STEPS):
    results = {}
    for name, (model, batches) in _models().items():
        for param, optimizer in COMBOS:
            with tempfile.TemporaryDirectory() as nvme:
                config = engine_config(param=param, optimizer=optimizer, nvme_path=nvme, accum=ACCUM, clip=CLIP,
                                       lr=LR, precision=precision)
                losses, state, _ = engine_train(model, config, batches, steps=steps, accum=ACCUM, rank=rank,
                                                world_size=world_size)
            results[(name, param, optimizer)] = (losses, state)
    return results


def _references(steps: int) -> dict:
    return {name: reference_train(model, batches, steps=steps, accum=ACCUM, clip=CLIP, lr=LR)
            for name, (model, batches) in _models().items()}


@pytest.fixture(scope="module")
def references():
    return _references(STEPS)


def _check(results, references, rtol, atol):
    for (name, param, optimizer), (losses, state) in results.items():
        ref_losses, ref_state = references[name]
        where = f"{name} params={param} optimizer={optimizer}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{where}: losses differ: {m}")
        assert state.keys() == ref_state.keys(), where
        for key, ref in ref_state.items():
            torch.testing.assert_close(state[key], ref, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{where}: {key} differs: {m}")


def test_world_size_1_fp32(references):
    _check(_run_all(0, 1), references, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(600)
def test_world_size_2_fp32():
    results = run_ranks(_run_all, "fp32", STEPS_AT_TWO_RANKS, world_size=2)
    _check(results[0], _references(STEPS_AT_TWO_RANKS), rtol=1e-5, atol=1e-6)
    # both ranks report the same gathered parameters
    for key, (_, state) in results[0].items():
        for name, tensor in state.items():
            assert torch.equal(tensor, results[1][key][1][name]), (key, name)
