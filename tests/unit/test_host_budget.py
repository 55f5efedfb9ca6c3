"""One host-memory budget: parsed, enforced, staging sized from it, NVMe as a spill tier under it, and a
clear refusal when the minimum working set does not fit."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import infinity
from helpers import TinyGPT, engine_config, gpt_batches, train_batches
from infinity.placement.host_budget import MAX_STAGED_SUB_GROUP_NUMEL, resolve_host_budget, staged_sub_group_numel
from infinity.config.units import parse_host_memory

STEPS, ACCUM, LR = 4, 1, 3e-3


@pytest.mark.parametrize("value, expected", [("8GiB", 8 << 30), ("1.5 GB", 1_500_000_000), (0.5, 0.5), ("60%", 0.6),
                                             ("0.25", 0.25), (3 << 30, 3 << 30), (None, None)])
def test_a_budget_is_bytes_or_a_fraction(value, expected):
    assert parse_host_memory(value) == expected


@pytest.mark.parametrize("value", ["lots", 0, -2, "150%", True, 100, "1e400"])
def test_a_bad_budget_names_the_key(value):
    with pytest.raises(ValueError, match="host_memory_budget"):
        parse_host_memory(value)


def test_fractions_are_of_the_available_memory_shared_by_local_ranks():
    assert resolve_host_budget(0.5, available_nbytes=16 << 30, local_ranks=2) == 4 << 30
    assert resolve_host_budget(None, available_nbytes=10 << 30, local_ranks=1) == int((10 << 30) * 0.8)
    assert resolve_host_budget(5 << 30, available_nbytes=1, local_ranks=8) == 5 << 30  # bytes are per rank


def test_staging_is_sized_from_the_budget_whatever_sub_group_size_says():
    kw = dict(largest_shard_numel=1000, sets=4, bytes_per_numel=14)
    assert staged_sub_group_numel(10**9, budget_nbytes=1 << 40, **kw) == MAX_STAGED_SUB_GROUP_NUMEL
    assert staged_sub_group_numel(10**9, budget_nbytes=224 * 10**6, **kw) == 10**6  # a quarter of the budget
    assert staged_sub_group_numel(10**9, budget_nbytes=1, **kw) == 1000  # never below the largest shard
    assert staged_sub_group_numel(500, budget_nbytes=1 << 40, **kw) == 1000


def _config(tmp_path, budget=None, *, optimizer_in_cpu=None, sub_group_size=3000, clip=1.0, overlap=True):
    config = engine_config(param="cpu", optimizer="nvme", nvme_path=str(tmp_path), accum=ACCUM, clip=clip, lr=LR,
                           overlap_step_with_backward=overlap)
    zero = config["zero_optimization"]
    zero["sub_group_size"] = sub_group_size
    if optimizer_in_cpu is None:
        zero["offload_optimizer"].pop("max_in_cpu")  # the budget decides
    else:
        zero["offload_optimizer"]["max_in_cpu"] = optimizer_in_cpu
    if budget is not None:
        zero["host_memory_budget"] = budget
    return config


def _run(model, batches, config):
    engine = infinity.initialize(copy.deepcopy(model), config)
    try:
        losses = train_batches(engine, batches)
        return losses, engine.full_state_dict(), engine.step_metrics(), engine.optimizer.resident_numel, engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT(), gpt_batches(STEPS, batch=4)


def test_states_that_fit_stay_in_host_memory_and_train_exactly_as_on_nvme(gpt, tmp_path):
    model, batches = gpt
    on_nvme = _run(model, batches, _config(tmp_path, optimizer_in_cpu=0))
    in_host = _run(model, batches, _config(tmp_path))  # the default budget holds this model's states
    trainable = sum(g.numel for g in on_nvme[4].layout.sub_groups)
    assert on_nvme[3] == 0 and in_host[3] == trainable
    assert on_nvme[2]["tiers"]["nvme"]["bytes_read"] > 0
    assert in_host[2]["tiers"]["nvme"]["bytes_read"] == in_host[2]["tiers"]["nvme"]["bytes_written"] == 0
    assert in_host[0] == on_nvme[0]
    for key, value in on_nvme[1].items():
        assert torch.equal(in_host[1][key], value), key


@pytest.mark.parametrize("overlap, kept_first", [(False, "first"), (True, "last")])
def test_a_partial_spill_keeps_what_the_step_reads_first(gpt, tmp_path, overlap, kept_first):
    """A budget that holds some sub-groups: those stay, the rest spills; bytes moved fall with what stays."""
    model, batches = gpt
    full = _run(model, batches, _config(tmp_path, optimizer_in_cpu=0, overlap=overlap))
    groups = full[4].layout.sub_groups
    half = sum(g.numel for g in groups) // 2
    partial = _run(model, batches, _config(tmp_path, optimizer_in_cpu=half, overlap=overlap))
    optimizer = partial[4].optimizer
    kept = [g.index for g in groups if optimizer.in_memory(g)]
    assert 0 < partial[3] <= half and kept
    # overlapped, the step runs during backward, which finishes the last sub-groups first
    assert (kept[0] == 0) if kept_first == "first" else (kept[-1] == groups[-1].index)
    assert partial[2]["tiers"]["nvme"]["bytes_read"] < full[2]["tiers"]["nvme"]["bytes_read"]
    assert partial[0] == full[0]
    for key, value in full[1].items():
        assert torch.equal(partial[1][key], value), key


def test_host_memory_never_passes_the_budget(gpt, tmp_path):
    model, batches = gpt
    budget = 5 << 18  # 1.25 MiB: the working set and about half of the states
    losses, _, metrics, resident, engine = _run(model, batches, _config(tmp_path, budget))
    assert engine.tiers.host_memory.peak_nbytes <= budget
    assert 0 < resident < sum(g.numel for g in engine.layout.sub_groups)  # some kept, the rest spilled


def test_a_huge_sub_group_size_stages_no_more_than_a_small_one(tmp_path):
    """A DeepSpeed config's sub_group_size of 1e9 must not grow host memory over 1e8's (the issue's 10%)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, d=256, n_layer=4, n_head=4, seq=16)
    batches = gpt_batches(2, batch=2, vocab=256)
    peaks = {}
    for size in (10**9, 10**8):
        config = _config(tmp_path, 48 << 20, optimizer_in_cpu=0, sub_group_size=size)
        *_, engine = _run(model, batches, config)
        peaks[size] = engine.tiers.host_memory.peak_nbytes
    assert peaks[10**9] <= 1.1 * peaks[10**8]


def test_a_budget_below_the_working_set_is_refused_before_any_work(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, d=256, n_layer=4, n_head=4, seq=16)  # 3M parameters: 12 MiB of fp32 gradients
    with pytest.raises(ValueError) as err:
        infinity.initialize(model, _config(tmp_path, 1 << 20))
    message = str(err.value)
    assert "host_memory_budget is 1 MiB" in message and "needs at least" in message
    assert "gradient slices" in message and "--host-memory" in message
    assert os.listdir(tmp_path) == []  # nothing written to the swap folder


def test_checkpoints_move_between_a_spilled_and_an_all_nvme_engine(gpt, tmp_path):
    model, batches = gpt
    half = 6000
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    src = infinity.initialize(copy.deepcopy(model), _config(tmp_path / "a", optimizer_in_cpu=half))
    dst = infinity.initialize(copy.deepcopy(model), _config(tmp_path / "b", optimizer_in_cpu=0))
    try:
        for batch in batches:
            src.backward(src(*batch))
            src.step()
        src.save_checkpoint(tmp_path / "ckpt")
        dst.load_checkpoint(tmp_path / "ckpt")
        for name in ("master", "exp_avg", "exp_avg_sq"):
            for group in src.layout.sub_groups:
                a, b = torch.empty(group.numel), torch.empty(group.numel)
                src.optimizer.read_state(name, group, a)
                dst.optimizer.read_state(name, group, b)
                assert torch.equal(a, b), (name, group.index)
    finally:
        src.close()
        dst.close()
