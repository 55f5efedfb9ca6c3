"""Tiling at initialize: an oversized Linear is fetched one tile at a time."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity
from helpers import engine_config, reference_train


class WideMLP(nn.Module):
    def __init__(self, d=16, wide=512):
        super().__init__()
        self.up = nn.Linear(d, wide)        # 8192 weights: 4 × the live budget below
        self.down = nn.Linear(wide, d)      # 8192 weights
        self.head = nn.Linear(d, 1)

    def forward(self, x, y):
        return F.mse_loss(self.head(F.gelu(self.down(F.gelu(self.up(x))))).squeeze(-1).float(), y)


def _batches(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, generator=g)) for _ in range(n)]


def test_oversized_linear_trains_within_budget_plus_one_tile(tmp_path):
    torch.manual_seed(0)
    model, batches = WideMLP(), _batches(6)
    budget = 2048
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(tmp_path), accum=1, clip=1.0, lr=1e-2,
                           stage3_max_live_parameters=budget)
    config["tiling"] = {"max_tile_numel": budget}
    engine = infinity.initialize(copy.deepcopy(model), config)
    assert isinstance(engine.module.up, infinity.TiledLinear) and isinstance(engine.module.down, infinity.TiledLinear)
    # the tiles' sizes from the engine's layout: between passes a released parameter is empty (numel 0)
    numel_of = {id(sharded.param): sharded.slot.numel for sharded in engine.params}
    largest_tile = max(sum(numel_of[id(p)] for p in m.parameters(recurse=False))
                       for m in engine.module.modules() if isinstance(getattr(m, "weight", None), nn.Parameter))
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    peak = engine.tiers.stats["device"].peak_nbytes
    state = engine.full_state_dict()
    engine.close()
    assert peak <= (budget + largest_tile) * 4, (peak, budget, largest_tile)
    assert peak < model.up.weight.numel() * 4   # the dense layer was never gathered whole
    ref_losses, ref_state = reference_train(model, batches, steps=6, accum=1, clip=1.0, lr=1e-2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert state.keys() == ref_state.keys()     # original names and shapes
    for key, ref in ref_state.items():
        torch.testing.assert_close(state[key], ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
