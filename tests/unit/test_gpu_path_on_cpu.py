"""The GPU path without a GPU: with INFINITY_DISTINCT_DEVICE=1 device memory is a
distinct set of buffers, every crossing runs on the copy worker — late on purpose
here, so a missing wait shows up as a wrong value — and the engine still trains
exactly like plain PyTorch AdamW, over every tier combination, with and without
gradient accumulation, by every gradient route. Crossing bytes are what a GPU
run would move."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity
from helpers import TinyGPT, assert_matches, engine_config, engine_steps, gpt_batches, reference_train
from infinity.placement.placement import DISTINCT_DEVICE_ENV, GradRoute

STEPS, LR, CLIP = 6, 3e-3, 1.0
TIERS = ("none", "cpu", "nvme")
COPY_DELAY_S = 0.0005  # every copy lands late: values read without a wait would be stale


@pytest.fixture(autouse=True)
def distinct_device(monkeypatch):
    monkeypatch.setenv(DISTINCT_DEVICE_ENV, "1")


def _train(model, config, batches, *, accum, delay_s=COPY_DELAY_S):
    def late_copies(engine):
        engine.copies.delay_s = delay_s
    return engine_steps(model, config, batches, steps=STEPS, accum=accum, setup=late_copies)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = TinyGPT()
    return model, {accum: gpt_batches(STEPS * accum, batch=4) for accum in (1, 4)}


@pytest.mark.parametrize("accum", [1, 4])
def test_every_tier_combination_trains_like_plain_pytorch(gpt, tmp_path, accum):
    model, batches = gpt
    reference = reference_train(model, batches[accum], steps=STEPS, accum=accum, clip=CLIP, lr=LR)
    for param, optimizer in itertools.product(TIERS, TIERS):
        config = engine_config(param=param, optimizer=optimizer, nvme_path=str(tmp_path), accum=accum, clip=CLIP,
                               lr=LR)
        result = _train(model, config, batches[accum], accum=accum)
        assert_matches(result, reference, f"params={param} optimizer={optimizer} accumulation={accum}")


@pytest.mark.parametrize("route", ["device", "host"])
@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_both_accumulation_routes_train_like_plain_pytorch(gpt, tmp_path, route, optimizer):
    model, batches = gpt
    reference = reference_train(model, batches[4], steps=STEPS, accum=4, clip=CLIP, lr=LR)
    config = engine_config(param="cpu", optimizer=optimizer, nvme_path=str(tmp_path), accum=4, clip=CLIP, lr=LR)
    config["zero_optimization"]["offload_optimizer"]["grad_accumulation"] = route
    result = _train(model, config, batches[4], accum=4)
    expected = GradRoute.DEVICE_THEN_HOST if route == "device" else GradRoute.HOST_RING
    assert result[3].grad_route is expected
    assert_matches(result, reference, f"route={route} optimizer={optimizer}")


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_a_part_kept_between_micro_batches_trains_like_plain_pytorch(gpt, tmp_path, param):
    """A reuse distance of a third of the model: some parameters stay gathered from one micro-batch to the next,
    the rest are fetched again, with every copy late; the step's update must reach the kept ones."""
    model, batches = gpt
    reference = reference_train(model, batches[4], steps=STEPS, accum=4, clip=CLIP, lr=LR)
    numel = sum(p.numel() for p in model.parameters())
    config = engine_config(param=param, optimizer="cpu", nvme_path=str(tmp_path), accum=4, clip=CLIP, lr=LR,
                           max_reuse_distance=numel // 3)
    result = _train(model, config, batches[4], accum=4)
    assert_matches(result, reference, f"params={param}, a third kept")
    # a mixed state: fewer crossings than four steps of one micro-batch (nothing kept between them), more than
    # one forward's (everything kept)
    one = engine_config(param=param, optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=CLIP, lr=LR,
                        max_reuse_distance=numel // 3)
    up = result[2][-1]["copies"]["host_to_device_nbytes"]
    up_alone = _train(model, one, batches[1], accum=1)[2][-1]["copies"]["host_to_device_nbytes"]
    assert numel * 4 < up < 4 * up_alone


def test_overlapped_step_without_clipping_matches_the_step_after_backward(gpt, tmp_path):
    """The optimizer's worker updates sub-groups while backward runs; each waits for its own slices' crossing."""
    model, batches = gpt
    results = {}
    for overlap in (True, False):
        # the worker takes every sub-group that arrives, whatever its pace (none is left behind the next forward)
        config = engine_config(param="none", optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=LR,
                               overlap_step_with_backward=overlap, overlap_step_with_forward=False)
        results[overlap] = _train(model, config, batches[1], accum=1)
    assert any(m["sub_groups_during_backward"] for m in results[True][2])
    assert results[True][0] == results[False][0]
    for key, value in results[True][1].items():
        assert torch.equal(value, results[False][1][key]), key


class _MLP(nn.Module):
    """Four Linears, no tying, no buffers: each parameter is fetched once in forward and once in backward."""

    def __init__(self, d=64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(4))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, y)


def _mlp_batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)) for _ in range(n)]


class _FrozenEmbedding(nn.Module):
    """A frozen embedding under a trainable head, as LoRA leaves a base model's: the embedding's input needs no
    gradient and its weight gets none, so nothing releases it before its pass ends."""

    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d).requires_grad_(False)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets):
        return F.cross_entropy(self.head(self.embedding(idx)), targets)


def _crossings(param, optimizer, accum, tmp_path, route=None, reuse=0, frozen_embedding=False):
    torch.manual_seed(0)
    config = engine_config(param=param, optimizer=optimizer, nvme_path=str(tmp_path), accum=accum, clip=0.0, lr=LR,
                           max_reuse_distance=reuse, stage3_prefetch_bucket_size=0)
    if route is not None:
        config["zero_optimization"]["offload_optimizer"]["grad_accumulation"] = route
    # every update inside its own step, so that a step's counters hold its crossings (behind the next forward,
    # the updates backward did not reach cross during the next step)
    config["zero_optimization"]["overlap_step_with_forward"] = False
    model = _FrozenEmbedding() if frozen_embedding else _MLP()
    g = torch.Generator().manual_seed(2)
    batches = ([(torch.randint(0, 64, (8,), generator=g), torch.randint(0, 64, (8,), generator=g))
                for _ in range(STEPS * accum)] if frozen_embedding else _mlp_batches(STEPS * accum))
    _, _, metrics, _ = _train(model, config, batches, accum=accum, delay_s=0.0)
    shard_nbytes = sum(p.numel() * 4 for p in model.parameters())  # fp32, one rank: the shard is the parameter
    return metrics[-1]["copies"], shard_nbytes


def test_nothing_crosses_when_everything_is_on_the_device(tmp_path):
    copies, _ = _crossings("none", "none", 4, tmp_path)
    assert copies == {"host_to_device_nbytes": 0, "device_to_host_nbytes": 0}


def test_zero_offload_moves_gradients_down_and_new_parameters_up_once_a_step(tmp_path):
    copies, shard_nbytes = _crossings("none", "cpu", 1, tmp_path)
    assert copies["device_to_host_nbytes"] == shard_nbytes  # each gradient slice, once
    # new compute shards go up per sub-group (shards padded to the 4 KiB I/O alignment inside a sub-group)
    assert shard_nbytes <= copies["host_to_device_nbytes"] < shard_nbytes + 4 * 2048 * 4


def test_device_accumulation_crosses_once_per_step_however_many_micro_batches(tmp_path):
    on_device, shard_nbytes = _crossings("none", "cpu", 4, tmp_path, route="device")
    through_host, _ = _crossings("none", "cpu", 4, tmp_path, route="host")
    assert on_device["device_to_host_nbytes"] == shard_nbytes        # fp32 accumulator, once a step
    assert through_host["device_to_host_nbytes"] == 4 * shard_nbytes  # every micro-batch's slice


def test_host_resident_parameters_cross_up_at_every_fetch(tmp_path):
    copies, shard_nbytes = _crossings("cpu", "cpu", 1, tmp_path)
    assert copies["host_to_device_nbytes"] == 2 * shard_nbytes  # forward and backward fetch each parameter
    assert copies["device_to_host_nbytes"] == shard_nbytes       # gradients; new shards are written in place


def test_parameters_stay_gathered_across_the_micro_batches_of_a_step(tmp_path):
    """No update comes between the micro-batches of a step: with a reuse distance that spans a pass and the next,
    each parameter crosses up once a step (the first forward's fetch) instead of twice a micro-batch."""
    refetched, shard_nbytes = _crossings("cpu", "cpu", 4, tmp_path / "refetched")
    numel = sum(p.numel() for p in _MLP().parameters())
    kept, _ = _crossings("cpu", "cpu", 4, tmp_path / "kept", reuse=4 * numel)
    assert refetched["host_to_device_nbytes"] == 4 * 2 * shard_nbytes
    assert kept["host_to_device_nbytes"] == shard_nbytes
    assert kept["device_to_host_nbytes"] == refetched["device_to_host_nbytes"] == shard_nbytes  # fp32 accumulator
    # a frozen first module is held to the pass's end (nothing in backward releases it): kept for the next
    # micro-batch's forward too, which uses it first
    kept, shard_nbytes = _crossings("cpu", "cpu", 4, tmp_path / "frozen", reuse=10 ** 9, frozen_embedding=True)
    assert kept["host_to_device_nbytes"] == shard_nbytes


def test_the_cpu_kernel_is_never_handed_device_memory(gpt, tmp_path, monkeypatch):
    """The failure the H100 showed: with states on the host, every tensor the fused CPU kernel sees is host memory."""
    model, batches = gpt
    config = engine_config(param="none", optimizer="cpu", nvme_path=str(tmp_path), accum=4, clip=CLIP, lr=LR)
    engine = infinity.initialize(copy.deepcopy(model), config)
    device_ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                     for t in (engine.compute._flat, engine.reducer._device_acc)]
    seen = []
    kernel = engine.optimizer._adam

    def checked(*tensors, **kwargs):
        for t in (*tensors, kwargs["param_out"]):
            seen.append(t)
            assert not any(lo <= t.data_ptr() < hi for lo, hi in device_ranges), "device memory handed to the CPU kernel"
        return kernel(*tensors, **kwargs)

    engine.optimizer._adam = checked
    try:
        it = iter(batches[4])
        for _ in range(2 * 4):
            engine.backward(engine(*next(it)))
            engine.step()
    finally:
        engine.close()
    assert seen
