"""``offload_optimizer.device: auto``: the step-time model chooses how many of the first sub-groups that fit
``device_memory_budget`` rest on the device (the smallest count within 2 % of the best predicted step), the
budget's rule alone without machine figures; and the budget is enforced by the device tier's accounting, named
in the error, before any step. Figures are made by hand here (never this machine's cache); the device's memory
is kept apart from the host's (``INFINITY_DISTINCT_DEVICE=1``)."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

import infinity
from helpers import TinyGPT, assert_matches, engine_config, engine_steps, gpt_batches, reference_train
from infinity.config.schema import InfinityConfig
from infinity.kernels import state_nbytes
from infinity.models.gpt import GPT, GPTConfig
from infinity.placement import engine_split, split_choice
from infinity.placement.estimate import estimate_for_config
from infinity.placement.layout import ShardLayout
from infinity.placement.placement import DISTINCT_DEVICE_ENV, Placement
from infinity.placement.report import format_estimated_split
from infinity.placement.tiers import Tiers
from infinity.runtime.machine_figures import MachineFigures

STEPS, LR, CLIP = 10, 3e-3, 1.0
SUB_GROUP_SIZE = 3000


def figures(**changes) -> MachineFigures:
    base = MachineFigures(
        host="test", machine="hand-made", device="cuda", matmul_tflops={"bf16": 200.0, "fp32": 50.0},
        block_tflops={"bf16": {"64": 100.0}}, block_overhead_s={"bf16": 0.0}, block_tokens=1000,
        h2d_GBps=10.0, d2h_GBps=10.0, copy_path="cuda pinned", device_memory_GBps=1000.0,
        cpu_adam_elements_per_s={"fp32": 1e9, "bf16": 2e9, "int8": 4e9}, cpu_threads=16,
        nvme_read_GBps=2.0, nvme_write_GBps=1.0, nvme_path="/nvme", measured_s=1.0, measured_at=0.0,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


# The host's step shows: compute takes no time, the CPU Adam a second per million elements, the device's
# optimizer is bound by a fast memory. Each sub-group moved to the device takes its host step off the step.
FAST_DEVICE = figures(cpu_adam_elements_per_s={"fp32": 1e6, "bf16": 1e6, "int8": 1e6}, device_memory_GBps=1e4)
# The host's step is hidden: a forward and backward of minutes, the CPU Adam and the copies fast. No sub-group on
# the device makes the step any faster.
HIDDEN_HOST_STEP = figures(block_tflops={"bf16": {"64": 1e-9}}, device_memory_GBps=1.0)


@pytest.fixture(autouse=True)
def distinct_device(monkeypatch):
    monkeypatch.setenv(DISTINCT_DEVICE_ENV, "1")


def use_figures(monkeypatch, machine: MachineFigures | None) -> None:
    monkeypatch.setattr(split_choice, "split_figures", lambda: machine)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = TinyGPT()
    return model, gpt_batches(STEPS, batch=4)


def _groups(model):
    return ShardLayout(list(model.named_parameters()), world_size=1, sub_group_size=SUB_GROUP_SIZE).sub_groups


def _half_budget(model) -> tuple[int, int]:
    """A budget holding the first half of the sub-groups' fp32 states and fp32 gradient slices, and that half."""
    groups = _groups(model)
    half = len(groups) // 2
    return sum(state_nbytes("fp32", g.numel) + g.numel * 4 for g in groups[:half]), half


def _auto_config(model, *, clip: float = 0.0, overlap: bool = True) -> dict:
    budget, _ = _half_budget(model)
    config = engine_config(param="none", optimizer="cpu", nvme_path=None, accum=1, clip=clip, lr=LR,
                           device_memory_budget=budget, overlap_step_with_backward=overlap)
    config["zero_optimization"]["offload_optimizer"] = {"device": "auto"}
    return config


# -- the choice ---------------------------------------------------------------------------------------------------
def test_the_smallest_count_within_two_percent_of_the_best():
    assert split_choice.choose_count([10.0, 9.0, 8.9, 8.85]) == 1     # 9.0 <= 8.85 * 1.02
    assert split_choice.choose_count([10.0, 9.5, 9.0, 8.0]) == 3
    assert split_choice.choose_count([5.0, 5.05, 5.0]) == 0          # nothing faster enough: keep the memory


@pytest.mark.parametrize("machine, expect", [(FAST_DEVICE, "all that fit"), (HIDDEN_HOST_STEP, "none")])
def test_the_engine_keeps_on_the_device_what_the_model_says(gpt, monkeypatch, machine, expect):
    model, batches = gpt
    _, half = _half_budget(model)
    use_figures(monkeypatch, machine)
    engine = infinity.initialize(copy.deepcopy(model), _auto_config(model, overlap=expect == "none"))
    try:
        engine.backward(engine(*batches[0]))
        engine.step()
        split = engine.step_metrics()["optimizer_split"]
    finally:
        engine.close()
    assert split["chosen_by"] == "step-time model" and split["fitting_sub_groups"] == half
    if expect == "all that fit":
        assert split["device_sub_groups"] == half
        assert split["predicted_step_s"] < 0.9 * split["all_offloaded_step_s"]
    else:
        assert split["device_sub_groups"] == 0
        assert split["predicted_step_s"] == split["all_offloaded_step_s"]


def test_a_faster_device_optimizer_keeps_more_on_the_device():
    """The same run with the device's optimizer made slower and slower (the host's step shows: no overlap): from
    every sub-group that fits to none, never rising."""
    numels = [4096] * 8
    raw = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "sub_group_size": 4096, "offload_param": {"device": "none"}, "offload_optimizer": {"device": "auto"},
        "device_memory_budget": 1 << 30, "overlap_step_with_backward": False}}
    config = InfinityConfig.from_deepspeed(raw)
    shape = split_choice.StepShape(layers=1, width=64, seq_len=16, head_params=0)
    counts = []
    for memory_GBps in (1e4, 1e-3, 1e-4, 1e-6):  # noqa: N806
        machine = figures(cpu_adam_elements_per_s={"fp32": 1e6, "bf16": 1e6, "int8": 1e6},
                          device_memory_GBps=memory_GBps)
        with pytest.MonkeyPatch.context() as patch:
            use_figures(patch, machine)
            est = estimate_for_config(config, param_numels=numels, gpu=True, step_shape=shape)
        counts.append(est["optimizer_split"]["device_sub_groups"])
    assert counts[0] == 8 and counts[-1] == 0 and counts == sorted(counts, reverse=True), counts


def test_without_figures_the_longest_run_that_fits_and_one_line_says_so(gpt, monkeypatch, caplog):
    model, _ = gpt
    _, half = _half_budget(model)
    use_figures(monkeypatch, None)
    with caplog.at_level(logging.INFO, logger=split_choice.__name__):
        engine = infinity.initialize(copy.deepcopy(model), _auto_config(model))
    try:
        split = engine.step_metrics()["optimizer_split"]
        assert engine.placement.device_sub_groups == half == split["device_sub_groups"]
        assert split["chosen_by"] == "zero_optimization.device_memory_budget"
    finally:
        engine.close()
    said = [r.getMessage() for r in caplog.records if r.name == split_choice.__name__]
    assert len(said) == 1 and "no machine figures" in said[0] and "infinity bench --machine" in said[0]


def test_the_estimate_shows_the_chosen_count_against_all_offloaded(monkeypatch):
    use_figures(monkeypatch, FAST_DEVICE)
    raw = {"zero_optimization": {"sub_group_size": 4096, "offload_param": {"device": "none"},
                                 "offload_optimizer": {"device": "auto"},
                                 "device_memory_budget": 3 * (state_nbytes("fp32", 4096) + 4096 * 4)}}
    est = estimate_for_config(InfinityConfig.from_deepspeed(raw), param_numels=[4096] * 8, gpu=True)
    split = est["optimizer_split"]
    assert split["fitting_sub_groups"] == 3 == split["device_sub_groups"]
    assert split["chosen_by"] == "step-time model"
    assert split["predicted_step_s"] < split["all_offloaded_step_s"]
    line = format_estimated_split(est)
    assert "3 of 8 sub-groups on the device" in line and "every sub-group offloaded" in line


def test_a_split_chosen_by_the_model_trains_like_plain_pytorch(gpt, monkeypatch):
    model, batches = gpt
    use_figures(monkeypatch, FAST_DEVICE)
    reference = reference_train(model, batches, steps=STEPS, accum=1, clip=CLIP, lr=LR)
    result = engine_steps(model, _auto_config(model, clip=CLIP), batches, steps=STEPS, accum=1)
    assert result[3].split and result[2][-1]["optimizer_split"]["chosen_by"] == "step-time model"
    assert_matches(result, reference, "auto, the count chosen by the step-time model")


# -- the budget, enforced -----------------------------------------------------------------------------------------
def test_the_device_tier_refuses_the_optimizer_past_its_budget():
    config = InfinityConfig.from_deepspeed({})
    tiers = Tiers(config.aio, Placement.decide(config, torch.device("cpu"), distinct=True),
                  device_optimizer_budget_nbytes=1000)
    try:
        states = tiers.empty("device", 200, torch.float32, owner="optimizer states", optimizer_share=True)  # 800 bytes
        gathered = tiers.empty("device", 1000, torch.float32, owner="gathered parameters")  # not the optimizer's
        with pytest.raises(ValueError, match=r"zero_optimization\.device_memory_budget") as refused:
            tiers.empty("device", 100, torch.float32, owner="optimizer states", optimizer_share=True)
        assert "800 bytes" in str(refused.value) and "400 more bytes" in str(refused.value)
        assert tiers.device_optimizer.live_nbytes == 800 and tiers.stats["device"].live_nbytes == 4800
        tiers.free("device", states, optimizer_share=True)
        tiers.free("device", gathered)
        assert tiers.stats["device"].live_nbytes == 0
    finally:
        tiers.close()


def test_a_split_past_the_budget_fails_at_initialize_naming_the_key(gpt, monkeypatch):
    """One sub-group more than the budget holds (as a wrong split would take): refused while the states are
    allocated, before any step."""
    model, _ = gpt
    use_figures(monkeypatch, None)
    decide = engine_split.decide_split

    def one_more(*args, **kwargs):
        split = decide(*args, **kwargs)
        more = split.device_sub_groups + 1
        groups = _groups(model)
        return dataclasses.replace(split, device_sub_groups=more, device_numel=groups[more].start)

    monkeypatch.setattr(engine_split, "decide_split", one_more)
    budget, _ = _half_budget(model)
    with pytest.raises(ValueError, match=r"zero_optimization\.device_memory_budget is %d bytes" % budget) as refused:
        infinity.initialize(copy.deepcopy(model), _auto_config(model))
    assert "in use" in str(refused.value) and "were asked" in str(refused.value)


def test_step_metrics_show_the_budget_and_what_the_share_holds(gpt, monkeypatch):
    model, batches = gpt
    budget, half = _half_budget(model)
    use_figures(monkeypatch, None)
    engine = infinity.initialize(copy.deepcopy(model), _auto_config(model, clip=CLIP))
    try:
        engine.backward(engine(*batches[0]))
        engine.step()
        split = engine.step_metrics()["optimizer_split"]
        groups = engine.layout.sub_groups
    finally:
        engine.close()
    states_and_slices = sum(state_nbytes("fp32", g.numel) + g.numel * 4 for g in groups[:half])
    assert split["budget_nbytes"] == budget
    assert split["device_share_nbytes"] == states_and_slices == split["device_share_peak_nbytes"] <= budget


# -- a model that recomputes its blocks -----------------------------------------------------------------------------
def test_the_split_hears_that_the_model_recomputes(monkeypatch):
    """Blocks recomputed in backward (activation checkpointing) cost one more forward a step: the split's step-time
    model counts it, read off the built model (our GPT's flag) at ``initialize``, as the estimate counts it from its
    shape."""
    use_figures(monkeypatch, figures(block_tflops={"bf16": {"64": 1e-4}}))  # compute shows in the step
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=32)
    steps = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        if recompute:
            model.activation_checkpointing_enable()
        assert split_choice.step_shape_of(model).recompute is recompute
        engine = infinity.initialize(model, _auto_config(model))
        try:
            steps[recompute] = engine.step_metrics()["optimizer_split"]["all_offloaded_step_s"]
        finally:
            engine.close()
    assert steps[True] > 1.2 * steps[False], steps
    config = InfinityConfig.from_deepspeed(_auto_config(GPT(cfg)))
    numels = [p.numel() for p in GPT(cfg).parameters()]
    estimated = {recompute: estimate_for_config(
        config, param_numels=numels, gpu=True,
        step_shape=split_choice.step_shape_of(cfg, micro_batch=2, recompute=recompute))["optimizer_split"]
        for recompute in (False, True)}
    assert estimated[True]["all_offloaded_step_s"] > 1.2 * estimated[False]["all_offloaded_step_s"]


def test_a_transformers_model_says_it_recomputes():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    assert split_choice.step_shape_of(model).recompute is False
    model.activation_checkpointing_enable()
    assert split_choice.step_shape_of(model).recompute is True
    assert split_choice.step_shape_of(model, recompute=False).recompute is False  # the caller's word wins
