"""Param groups with a weight decay each, against torch.optim.AdamW given the same groups."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import TinyGPT, assert_matches, engine_config, engine_steps, gpt_batches, reference_train
from infinity.placement.layout import ShardLayout

import infinity

STEPS, ACCUM, LR, CLIP, DECAY = 6, 2, 3e-3, 1.0, 0.1
SUB_GROUP_SIZE = 100_000  # one sub-group for the whole model by size: only the decays cut it


def no_decay(name: str) -> bool:
    """Biases and LayerNorms, as the Hugging Face Trainer exempts them."""
    return name.endswith(".bias") or ".ln" in name or name.startswith("ln")


def decay_groups(model: nn.Module) -> list[dict]:
    """The decayed group takes the optimizer's weight_decay (no key); the other none."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not no_decay(n)]},
            {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}]


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT(), gpt_batches(STEPS * ACCUM, batch=4)


@pytest.fixture(scope="module")
def reference(gpt):
    model, batches = gpt
    return reference_train(model, batches, steps=STEPS, accum=ACCUM, clip=CLIP, lr=LR, weight_decay=DECAY,
                           param_groups=decay_groups)


def test_the_reference_tells_grouped_decay_from_uniform_decay(gpt, reference):
    """Decaying every tensor ends elsewhere than the groups do: the parity below can fail."""
    model, batches = gpt
    uniform = reference_train(model, batches, steps=STEPS, accum=ACCUM, clip=CLIP, lr=LR, weight_decay=DECAY)
    for name in ("blocks.0.ln1.weight", "blocks.1.fc.bias"):  # ~lr * decay * steps apart, 100x the tolerance
        assert (uniform[1][name] - reference[1][name]).abs().max() > 1e-4, name


@pytest.mark.parametrize("tier, how", [("none", None), ("cpu", None), ("nvme", None), ("nvme", "overlapped"),
                                       ("cpu", "split")])
def test_two_param_groups_train_like_torch_adamw(gpt, reference, tmp_path, tier, how):
    """Every way a sub-group is stepped: on the device, by the CPU kernel in memory or from NVMe, during backward
    (speculating under clipping), and half the sub-groups on the device beside the others offloaded."""
    model, batches = gpt
    config = engine_config(param=tier, optimizer=tier, nvme_path=str(tmp_path), accum=ACCUM, clip=CLIP, lr=LR,
                           weight_decay=DECAY, sub_group_size=SUB_GROUP_SIZE,
                           overlap_step_with_backward=how == "overlapped")
    if how == "split":
        config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    layouts = []
    result = engine_steps(model, config, batches, steps=STEPS, accum=ACCUM, param_groups=decay_groups,
                          setup=lambda engine: layouts.append(engine.layout))
    assert_matches(result, reference, f"param groups, states in {tier} ({how})")
    if how == "split":
        assert 0 < result[3].device_sub_groups < len(layouts[0].sub_groups)
    (layout,) = layouts
    assert len(layout.sub_groups) > 1  # cut where the decay changes
    for group in layout.sub_groups:
        for slot in group.slots:
            assert slot.weight_decay == group.weight_decay == (0.0 if no_decay(slot.name) else DECAY), slot.name


def test_one_decay_for_all_keeps_the_sub_groups_of_size_alone(gpt):
    model, _ = gpt
    named = list(model.named_parameters())

    def cuts(**kwargs):
        layout = ShardLayout(named, world_size=2, sub_group_size=5000, **kwargs)
        return [(g.start, g.end, [s.index for s in g.slots]) for g in layout.sub_groups]

    by_size = cuts()
    assert len(by_size) > 1
    assert cuts(weight_decay={name: DECAY for name, _ in named}) == by_size
    decay = {name: 0.0 if no_decay(name) else DECAY for name, _ in named}
    grouped = ShardLayout(named, world_size=2, sub_group_size=5000, weight_decay=decay)
    for group in grouped.sub_groups:
        assert len({s.weight_decay for s in group.slots}) == 1


def test_each_decays_parameters_are_laid_out_together(gpt):
    """Biases and norms sit between the matrices in model order: laid out in that order, every one of them would
    end a sub-group. Each decay's parameters come together instead (model order within), so the decays add one cut
    each; the smaller group (the norms and biases, read from the forward's first layer on and final only at the end
    of backward) comes first."""
    model, _ = gpt
    named = list(model.named_parameters())
    decay = {name: 0.0 if no_decay(name) else DECAY for name, _ in named}
    names = [name for name, _ in named]
    layout = ShardLayout(named, world_size=2, sub_group_size=5000, weight_decay=decay)
    assert [s.name for s in layout.slots] == [n for n in names if no_decay(n)] + [n for n in names if not no_decay(n)]
    assert [s.offset for s in layout.slots] == sorted(s.offset for s in layout.slots)
    whole = ShardLayout(named, world_size=2, sub_group_size=10**6, weight_decay=decay)
    assert [g.weight_decay for g in whole.sub_groups] == [0.0, DECAY]  # (though the first parameter, wte, is decayed)


class WideMLP(nn.Module):
    def __init__(self, d=16, wide=512):
        super().__init__()
        self.up = nn.Linear(d, wide)
        self.norm = nn.LayerNorm(wide)
        self.down = nn.Linear(wide, d)

    def forward(self, x, y):
        return F.mse_loss(self.down(F.gelu(self.norm(self.up(x)))).float(), y)


def test_the_tiles_of_a_tiled_parameter_take_its_decay(tmp_path):
    torch.manual_seed(0)
    model = WideMLP()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(4)]
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=None, accum=1, clip=CLIP, lr=1e-2,
                           weight_decay=DECAY, sub_group_size=SUB_GROUP_SIZE)
    config["tiling"] = {"max_tile_numel": 2048}
    layouts = []
    result = engine_steps(model, config, batches, steps=4, accum=1, param_groups=decay_groups,
                          setup=lambda engine: layouts.append(engine.layout))
    reference = reference_train(model, batches, steps=4, accum=1, clip=CLIP, lr=1e-2, weight_decay=DECAY,
                                param_groups=decay_groups)
    # a tiled matmul sums in another order than the whole one: states within the tiling tests' own tolerance
    # (test_tiling_engine.py), which a tile without its decay (DECAY x lr x 4 steps of a ~0.02 weight) exceeds
    losses, state = result[:2]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), rtol=1e-5, atol=1e-6)
    for key, value in reference[1].items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
    tiles = [s for s in layouts[0].slots if ".tiles." in s.name]
    assert tiles and {s.weight_decay for s in tiles if s.name.endswith("weight")} == {DECAY}


def _named(model, *names):
    params = dict(model.named_parameters())
    return [params[n] for n in names]


def test_groups_with_labels_train_like_torch_adamw_with_the_same_groups(gpt, reference, tmp_path):
    """A group's ``name`` (and torch's ``param_names``) names the group; torch.optim keeps such keys, and so do we."""
    model, batches = gpt

    def labelled(model):
        named = list(model.named_parameters())
        groups = decay_groups(model)
        groups[0].update(name="decay", param_names=[n for n, _ in named if not no_decay(n)])
        groups[1]["name"] = "no_decay"
        return groups

    config = engine_config(param="cpu", optimizer="cpu", nvme_path=str(tmp_path), accum=ACCUM, clip=CLIP, lr=LR,
                           weight_decay=DECAY, sub_group_size=SUB_GROUP_SIZE)
    result = engine_steps(model, config, batches, steps=STEPS, accum=ACCUM, param_groups=labelled)
    assert_matches(result, reference, "param groups with labels")


@pytest.mark.parametrize("groups, message", [
    (lambda m: [{"params": list(m.parameters()), "lr": 1e-4}], r"param_groups\[0\]\['lr'\] is 0.0001 but .*lr"),
    (lambda m: [{"params": list(m.parameters()), "betas": (0.9, 0.95)}], r"param_groups\[0\]\['betas'\]"),
    (lambda m: [{"params": _named(m, "0.weight")}, {"params": _named(m, "0.bias", "1.weight", "1.bias"),
                                                    "momentum": 0.9}], r"param_groups\[1\] has key 'momentum'"),
    (lambda m: [{"params": _named(m, "0.weight", "0.bias")}], r"parameter '1.weight' \(and 1 more\) is trainable"),
    (lambda m: [{"params": list(m.parameters())}, {"params": _named(m, "0.bias")}],
     r"'0.bias' is in param_groups\[0\] and in param_groups\[1\]"),
    (lambda m: [{"params": list(m.parameters()) + [torch.zeros(3)]}], r"param_groups\[0\]\['params'\] holds a tensor"),
    (lambda m: [{"params": list(m.parameters()), "weight_decay": -1.0}], r"weight_decay'\] must be a finite"),
    (lambda m: {"params": list(m.parameters())}, "param_groups must be a list of dicts"),
    (lambda m: [list(m.parameters())], r"param_groups\[0\] must be a dict"),
    (lambda m: [{"params": list(m.parameters()), "name": "all", "weight_deacy": 0.0}],
     r"param_groups\[0\] has key 'weight_deacy'"),  # a label is kept, a misspelt setting is not
])
def test_what_cannot_be_honoured_is_refused_by_name_before_any_work(tmp_path, groups, message):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(tmp_path), accum=1, clip=0, lr=LR)
    with pytest.raises(ValueError, match=message):
        infinity.initialize(model, config, param_groups=groups(model))
    assert os.listdir(tmp_path) == []  # no swap folder made


def test_a_groups_lr_betas_and_eps_equal_to_the_configs_are_accepted():
    model = nn.Linear(4, 1)
    config = {"optimizer": {"params": {"lr": LR, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": DECAY}}}
    groups = [{"params": [model.weight], "lr": LR, "betas": (0.9, 0.99), "eps": 1e-8},
              {"params": [model.bias], "weight_decay": 0.0}]
    with infinity.initialize(model, config, param_groups=groups) as engine:
        assert [g.weight_decay for g in engine.layout.sub_groups] == [0.0, DECAY]  # the smaller group first
