"""`infinity estimate --trainable-params`: a frozen base has no gradient, master or moments."""

from __future__ import annotations

import json


from infinity.cli import main
from infinity.placement.estimate import estimate


def test_only_the_trainable_parameters_carry_optimizer_state():
    full = estimate(7 * 10**9, offload_param="nvme", offload_optimizer="cpu", gpu=False)
    lora = estimate(7 * 10**9, offload_param="nvme", offload_optimizer="cpu", gpu=False, trainable_params=4 * 10**6)
    assert lora["tiers"]["nvme"]["compute_shard"] == full["tiers"]["nvme"]["compute_shard"]  # the base rests as before
    assert lora["tiers"]["host"]["master"] == 4 * 10**6 * 4 and lora["tiers"]["host"]["moments"] == 4 * 10**6 * 8
    assert lora["tiers"]["host"]["gradients"] == 4 * 10**6 * 2  # bf16, one micro-batch a step
    assert full["tiers"]["host"]["master"] == 7 * 10**9 * 4
    two = estimate(7 * 10**9, world_size=2, offload_param="nvme", offload_optimizer="cpu", gpu=False,
                   trainable_params=4 * 10**6)
    assert two["tiers"]["host"]["master"] == 2 * 10**6 * 4  # each rank holds its half


def test_the_cli_option_and_its_bounds(capsys):
    assert main(["estimate", "--params", "1B", "--trainable-params", "2M", "--offload-optimizer", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["estimate"]["setting"]["trainable_params"] == 2 * 10**6
    assert out["estimate"]["tiers"]["host"]["master"] == 8 * 10**6
    assert main(["estimate", "--params", "1B", "--trainable-params", "2B"]) != 0
    assert "--trainable-params 2,000,000,000 must be between 0 and the model's 1,000,000,000" in capsys.readouterr().err
