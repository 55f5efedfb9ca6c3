"""What real models have, meta initialization, precision, and the bytes moved by collectives."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity
from helpers import TinyGPT, engine_config, engine_train, gpt_batches, reference_train, run_ranks, rank_slice


class Features(nn.Module):
    """A frozen layer, a layer called twice, a parameter-free module, a buffer, sizes odd for two ranks."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.shared = nn.Linear(8, 8)
        self.act = nn.GELU()
        self.odd = nn.Linear(8, 7)
        self.head = nn.Linear(7, 1)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x, y):
        h = self.act(self.frozen(x))
        h = self.shared(self.act(self.shared(h))) * self.scale
        return F.mse_loss(self.head(self.odd(h)).squeeze(-1).float(), y)


def feature_batches(n, batch=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g), torch.randn(batch, generator=g)) for _ in range(n)]


def _features_run(rank, world_size):
    torch.manual_seed(0)
    model, batches = Features(), feature_batches(12)
    out = {}
    for param in ("cpu", "nvme"):
        with tempfile.TemporaryDirectory() as nvme:
            config = engine_config(param=param, optimizer="cpu", nvme_path=nvme, accum=2, clip=0.5, lr=1e-2)
            out[param] = engine_train(model, config, batches, steps=6, accum=2, rank=rank, world_size=world_size)[:2]
    return out


def _check_features(results):
    torch.manual_seed(0)
    model, batches = Features(), feature_batches(12)
    ref_losses, ref_state = reference_train(model, batches, steps=6, accum=2, clip=0.5, lr=1e-2)
    assert torch.equal(ref_state["frozen.weight"], model.frozen.weight)  # the reference left it alone too
    for param, (losses, state) in results.items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for key, ref in ref_state.items():
            torch.testing.assert_close(state[key], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{param} {key}: {m}")


def test_model_features_world_size_1():
    _check_features(_features_run(0, 1))


def _ws2_run(rank, world_size):
    """Everything that needs two ranks, in one spawn: features, meta init, communication bytes."""
    out = {"features": _features_run(rank, world_size)}
    # a model built on meta is initialized identically on both ranks
    torch.manual_seed(1234 + rank)  # different global seeds: the engine must agree on one
    with torch.device("meta"):
        meta_model = TinyGPT()
    engine = infinity.initialize(meta_model, {"zero_optimization": {"offload_param": {"device": "cpu"}}})
    out["meta_state"] = engine.full_state_dict()
    engine.close()
    out["comm"] = _communication(rank, world_size)
    return out


def _communication(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 16), nn.ReLU(), nn.Linear(16, 5))
    batches = [(torch.randn(4, 16),) for _ in range(2)]
    result = {}
    for precision in ("fp32", "bf16"):
        # nothing kept gathered for reuse: every parameter is gathered for its forward and again for its backward
        config = engine_config(param="cpu", optimizer="cpu", nvme_path=None, accum=1, clip=0.0, lr=1e-3,
                               precision=precision, stage3_max_reuse_distance=0)
        engine = infinity.initialize(copy.deepcopy(model), config)
        for (x,) in batches:
            loss = engine(*rank_slice((x,), rank, world_size)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        padded = sum(s.padded_numel for s in engine.layout.slots)
        result[precision] = (engine.step_metrics()["collectives"], padded, sum(p.numel() for p in model.parameters()))
        engine.close()
    return result


@pytest.mark.timeout(600)
def test_two_ranks():
    results = run_ranks(_ws2_run, world_size=2)
    _check_features(results[0]["features"])
    # meta initialization: both ranks hold the same weights, and they are sane
    a, b = results[0]["meta_state"], results[1]["meta_state"]
    for key in a:
        assert torch.equal(a[key], b[key]), key
        assert torch.isfinite(a[key]).all(), key
    assert a["wte.weight"].std() > 0 and torch.equal(a["wte.weight"], a["head.weight"])
    # ZeRO-3 moves 3 × (N-1)/N × the model's bytes per step: two all-gathers and one reduce-scatter
    for precision, itemsize in (("fp32", 4), ("bf16", 2)):
        collectives, padded_numel, numel = results[0]["comm"][precision]
        n = 2
        assert collectives["all_gather_nbytes"] == 2 * (n - 1) * padded_numel * itemsize // n, precision
        assert collectives["reduce_scatter_nbytes"] == (n - 1) * padded_numel * itemsize // n, precision
        moved = collectives["all_gather_nbytes"] + collectives["reduce_scatter_nbytes"]
        assert abs(moved - 3 * (n - 1) / n * numel * itemsize) <= 0.01 * moved  # padding aside


def test_meta_model_trains_like_the_same_weights_built_eagerly(tmp_path):
    torch.manual_seed(7)
    with torch.device("meta"):
        meta_model = TinyGPT()
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=1e-3)
    engine = infinity.initialize(meta_model, config)
    initial = engine.full_state_dict()
    engine.close()
    eager = TinyGPT()
    eager.load_state_dict(initial)
    batches = gpt_batches(3, batch=2)
    ref_losses, _ = reference_train(eager, batches, steps=3, accum=1, clip=0.0, lr=1e-3)
    losses, _, _ = engine_train(eager, config, batches, steps=3, accum=1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)


def test_no_grad_forwards_keep_within_the_live_budget_and_a_step_releases_everything(tmp_path):
    """Forwards without grad keep what the next one uses gathered, no more than ``stage3_max_live_parameters`` allows
    (half the model here); the pass that ends a training step releases everything."""
    torch.manual_seed(0)
    model = TinyGPT()
    numel = sum(p.numel() for p in model.parameters())
    config = engine_config(param="nvme", optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=1e-3,
                           stage3_max_live_parameters=numel // 2)
    engine = infinity.initialize(model, config)
    x, y = gpt_batches(1, batch=2)[0]
    device = engine.tiers.stats["device"]
    largest = max(p.full_nbytes for p in engine.params)

    def gathered() -> int:  # blocks kept for the next fetch (infinity.params.gathered_blocks) are not gathered parameters
        return device.live_nbytes - getattr(engine.full_blocks, "kept_nbytes", 0)

    engine.eval()
    kept = []
    with torch.no_grad():
        for _ in range(3):
            engine(x, y)
            kept.append(gathered())
    assert kept[0] == 0 and kept[1] > 0, kept  # the first traces the order; those after it keep
    assert kept[2] == kept[1], kept  # the same each time: blocks kept for reuse are not counted as live parameters
    assert max(kept) <= numel // 2 * 4 + largest, kept  # the budget, fp32, and the one that found it passed
    engine.train()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    assert gathered() == 0
    assert all(p.state.value == "released" for p in engine.params)
    engine.close()


def test_bf16_tracks_fp32_reference():
    """bf16 keeps 8 bits of mantissa: losses agree to about 1% and each Adam step moves a parameter by at
    most about lr, so after S steps parameters agree to S × lr whatever the rounding of the gradients."""
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(10, batch=4)
    steps, lr = 5, 1e-3
    ref_losses, ref_state = reference_train(model, batches, steps=steps, accum=2, clip=1.0, lr=lr)
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=None, accum=2, clip=1.0, lr=lr, precision="bf16")
    losses, state, _ = engine_train(model, config, batches, steps=steps, accum=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)
    for key, ref in ref_state.items():
        assert (state[key] - ref).abs().max() <= steps * lr * 1.01, key


def test_fp16_dynamic_loss_scaling_skips_overflow_and_trains():
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(8, batch=4)
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=None, accum=1, clip=1.0, lr=1e-3)
    config.pop("bf16")
    config["fp16"] = {"enabled": True, "initial_scale_power": 40, "hysteresis": 1}  # overflows at first
    engine = infinity.initialize(copy.deepcopy(model), config)
    skipped, losses = 0, []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        skipped += engine.step_metrics()["skipped"]
        losses.append(loss.item())
    scale = engine.loss_scaler.scale
    engine.close()
    assert skipped >= 1 and scale < 2.0 ** 40
    ref_losses, _ = reference_train(model, batches, steps=8, accum=1, clip=1.0, lr=1e-3)
    # the skipped steps leave the weights alone, so the first loss matches and the run keeps learning
    assert abs(losses[0] - ref_losses[0]) < 1e-2
    assert losses[-1] < losses[0]
