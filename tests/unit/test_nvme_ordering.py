"""Ordering on the NVMe optimizer path, under late completions: storage requests
that land only when waited on, after a random delay (a buffer reused before its
write was waited for then writes the wrong bytes), and an optimizer worker that
runs late. Every seed must train exactly like plain PyTorch AdamW.

This is the race seen once in eight loaded runs of the two-rank parity test
("mlp params=none optimizer=nvme: losses differ", largest difference 0.0258):
the step's first read went into a staging set whose write-behind from the last
step was still reading it.
"""

from __future__ import annotations

import random
import tempfile
import time

import pytest
import torch

import infinity.optim.overlapped_step
from helpers import TiedMLP, TinyGPT, delay_storage, engine_config, engine_train, gpt_batches, mlp_batches, reference_train

STEPS, ACCUM, LR = 6, 2, 3e-3
SEEDS = range(3)


def _models():
    torch.manual_seed(0)
    # sub_group_size 3000 cuts the MLP into 5 sub-groups, one more than the 4 staging sets
    return {"mlp": (TiedMLP(), mlp_batches(STEPS * ACCUM, batch=4)),
            "gpt": (TinyGPT(), gpt_batches(STEPS * ACCUM, batch=4))}


@pytest.fixture(scope="module")
def models_and_references():
    models = _models()
    refs = {}
    for name, (model, batches) in models.items():
        for clip in (0.0, 1.0):
            refs[name, clip] = reference_train(model, batches, steps=STEPS, accum=ACCUM, clip=clip, lr=LR)
    return models, refs


@pytest.fixture
def late_worker(monkeypatch):
    """The overlapped step's worker starts each sub-group after a random pause."""
    original = infinity.optim.overlapped_step.OverlappedStep._update

    def late(self, group, **kwargs):
        time.sleep(random.uniform(0, 0.003))
        original(self, group, **kwargs)

    monkeypatch.setattr(infinity.optim.overlapped_step.OverlappedStep, "_update", late)


@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_late_storage_and_worker_never_change_results(models_and_references, monkeypatch, late_worker, param, clip):
    models, refs = models_and_references
    delay_storage(monkeypatch)
    for seed in SEEDS:
        random.seed(seed)
        for name, (model, batches) in models.items():
            with tempfile.TemporaryDirectory() as nvme:
                config = engine_config(param=param, optimizer="nvme", nvme_path=nvme, accum=ACCUM, clip=clip, lr=LR)
                losses, state, _ = engine_train(model, config, batches, steps=STEPS, accum=ACCUM)
            ref_losses, ref_state = refs[name, clip]
            where = f"seed {seed} {name} params={param} optimizer=nvme clip={clip}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{where}: losses differ: {m}")
            for key, ref in ref_state.items():
                torch.testing.assert_close(state[key], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {key}: {m}")
