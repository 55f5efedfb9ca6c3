"""The GPU path on a real GPU: the engine against plain PyTorch AdamW on the same
device, over params {none, cpu, nvme} x optimizer {none, cpu, nvme} x gradient
accumulation {1, 4}; host<->device traffic that matches the route; several
ranks on one GPU. Skipped without CUDA (the same paths run on the CPU box under
INFINITY_DISTINCT_DEVICE=1 in tests/unit/test_gpu_path_on_cpu.py)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import infinity
from helpers import TinyGPT, engine_config, engine_steps, gpt_batches, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS, LR, CLIP = 6, 3e-3, 1.0
TIERS = ("none", "cpu", "nvme")
DEVICE = torch.device("cuda") if torch.cuda.is_available() else None


def _reference(model, batches, accum):
    """Plain PyTorch on the GPU: fp32, AdamW, clipping, the same accumulation."""
    model = copy.deepcopy(model).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    losses, it = [], iter(batches)
    for _ in range(STEPS):
        for _ in range(accum):
            idx, targets = (t.to(DEVICE) for t in next(it))
            loss = model(idx, targets)
            (loss / accum).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _engine(model, config, batches, accum):
    def on_the_gpu(engine):
        assert engine.device.type == "cuda" and engine.placement.distinct
    losses, state, metrics, placement = engine_steps(model, config, batches, steps=STEPS, accum=accum,
                                                     setup=on_the_gpu)
    return losses, state, metrics[-1], placement


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT(), {accum: gpt_batches(STEPS * accum, batch=4) for accum in (1, 4)}


@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("param, optimizer", list(itertools.product(TIERS, TIERS)))
def test_parity_with_plain_pytorch_on_the_gpu(gpt, tmp_path, param, optimizer, accum):
    model, batches = gpt
    ref_losses, ref_state = _reference(model, batches[accum], accum)
    config = engine_config(param=param, optimizer=optimizer, nvme_path=str(tmp_path), accum=accum, clip=CLIP, lr=LR,
                           device="auto")
    losses, state, metrics, placement = _engine(model, config, batches[accum], accum)
    where = f"params={param} optimizer={optimizer} accumulation={accum}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{where}: losses differ: {m}")
    for key, ref in ref_state.items():
        torch.testing.assert_close(state[key], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {key}: {m}")
    crossed = metrics["copies"]["host_to_device_nbytes"] + metrics["copies"]["device_to_host_nbytes"]
    assert (crossed == 0) == (param == "none" and optimizer == "none"), (where, metrics["copies"])
    assert placement.optimizer_on_device == (optimizer == "none")


def test_host_buffers_that_cross_are_pinned(tmp_path):
    torch.manual_seed(0)
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=LR,
                           device="auto")
    engine = infinity.initialize(TinyGPT(), config)
    try:
        assert engine.placement.compute_shard.pinned and engine.placement.grads.pinned
        engine.tiers.pinner.wait()  # registration runs on a background thread, off initialize's path
        assert engine.compute._flat.is_pinned() and engine.reducer.slices.is_pinned()
    finally:
        engine.close()


def _two_ranks_on_one_gpu(rank, world_size):
    torch.manual_seed(0)
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=None, accum=1, clip=0.0, lr=LR,
                           device="auto")
    engine = infinity.initialize(TinyGPT(), config)
    try:
        return str(engine.device)
    finally:
        engine.close()


def test_several_ranks_over_gloo_on_one_gpu_compute_on_the_cpu():
    """gloo's all-gather and reduce-scatter take CPU tensors, and NCCL refuses two ranks on one GPU: with
    gloo the engine computes on the CPU (tests/distributed covers their parity); with NCCL and one GPU
    per rank it would compute on the GPU."""
    assert run_ranks(_two_ranks_on_one_gpu, world_size=2) == ["cpu", "cpu"]


@pytest.mark.parametrize("param, optimizer", [("none", "cpu"), ("cpu", "nvme"), ("none", "nvme")])
def test_updates_behind_the_forward_wait_for_their_copies_on_the_gpu(gpt, tmp_path, monkeypatch, param, optimizer):
    """A clipped step's updates finish behind the next forward (infinity.optim.step_tail), slowed down so the forward
    reaches parameters first: the compute stream must wait for each sub-group's copy up; results are the same
    bits as the step made before step() returns."""
    from helpers import slow_step_tail

    model, batches = gpt
    runs = {}
    for behind in (False, True):
        if behind:
            seen = slow_step_tail(monkeypatch)
        config = engine_config(param=param, optimizer=optimizer, nvme_path=str(tmp_path), accum=1, clip=1e-3,
                               lr=LR, device="auto", overlap_step_with_forward=behind)
        runs[behind] = _engine(model, config, batches[1], 1)
    assert seen["tail_updates"] > 0 and seen["waited"] > 0
    assert runs[True][0] == runs[False][0]
    for key, value in runs[False][1].items():
        assert torch.equal(runs[True][1][key], value), key
