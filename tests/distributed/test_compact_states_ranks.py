"""Compact optimizer states at world size 2: int8 states on NVMe resume bit for bit (each rank's
stochastic rounding draws its own bits, the same after a resume), and the checkpoint reshards to one
rank with bf16 states, converting."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import infinity
from helpers import TinyGPT, engine_config, gpt_batches, run_ranks, train_batches

pytestmark = pytest.mark.timeout(180)


def _setup(nvme: str, state_dtype: str):
    Path(nvme).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(6, batch=4)
    config = engine_config(param="cpu", optimizer="nvme", nvme_path=nvme, accum=1, clip=0.0, lr=3e-3,
                           sub_group_size=4096)
    config["zero_optimization"]["offload_optimizer"]["state_dtype"] = state_dtype
    return model, batches, config


def _train(engine, batches, rank: int, world_size: int) -> list[float]:
    return train_batches(engine, batches, rank=rank, world_size=world_size)


def _two_ranks(rank, world_size, save_dir):
    save_dir = Path(save_dir)
    model, batches, config = _setup(str(save_dir.parent / "nvme"), "int8")
    out = {}
    engine = infinity.initialize(copy.deepcopy(model), config)
    _train(engine, batches[:3], rank, world_size)
    engine.save_checkpoint(save_dir, tag="half")
    out["state_at_save"] = engine.full_state_dict()
    out["rest"] = _train(engine, batches[3:], rank, world_size)
    out["final"] = engine.full_state_dict()
    engine.close()
    resumed = infinity.initialize(copy.deepcopy(model), config)
    resumed.load_checkpoint(save_dir)
    out["rest_resumed"] = _train(resumed, batches[3:], rank, world_size)
    out["final_resumed"] = resumed.full_state_dict()
    resumed.close()
    return out


def test_int8_states_resume_bitwise_at_two_ranks_and_reshard_to_one_in_bf16(tmp_path):
    save_dir = tmp_path / "ckpt"
    ranks = run_ranks(_two_ranks, str(save_dir))
    for r in ranks:
        assert r["rest_resumed"] == r["rest"]
        for key in r["final"]:
            assert torch.equal(r["final_resumed"][key], r["final"][key]), key

    model, batches, config = _setup(str(tmp_path / "nvme1"), "bf16")
    engine = infinity.initialize(copy.deepcopy(model), config)
    try:
        engine.load_checkpoint(save_dir)
        for key, value in engine.full_state_dict().items():  # masters: the int8 run's bf16 masters, exactly
            assert torch.equal(value, ranks[0]["state_at_save"][key]), key
        rest = _train(engine, batches[3:], 0, 1)
    finally:
        engine.close()
    assert all(abs(a / b - 1) < 0.02 for a, b in zip(rest, ranks[0]["rest"])), (rest, ranks[0]["rest"])


def _shards_from_the_master(rank, world_size, nvme):
    """At two ranks, each reads its compute shards from its own master's file: as with files of their own."""
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(4, batch=4)
    out = {}
    for from_master in (False, True):
        folder = Path(nvme) / f"{from_master}-{rank}"
        folder.mkdir(parents=True)
        config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(folder), accum=1, clip=0.5, lr=3e-3,
                               precision="bf16", sub_group_size=4096)
        config["zero_optimization"]["offload_optimizer"]["state_dtype"] = "int8"
        config["zero_optimization"]["offload_param"]["compute_from_master"] = from_master
        engine = infinity.initialize(copy.deepcopy(model), config)
        try:
            out[from_master] = (_train(engine, batches, rank, world_size), engine.full_state_dict(),
                                len(engine.optimizer.delivery.master_groups))
        finally:
            engine.close()
    return out


def test_compute_shards_read_from_the_master_at_two_ranks(tmp_path):
    for r in run_ranks(_shards_from_the_master, str(tmp_path)):
        (losses, state, _), (got_losses, got_state, shared) = r[False], r[True]
        assert shared > 0
        assert got_losses == losses
        for key in state:
            assert torch.equal(got_state[key], state[key]), key
