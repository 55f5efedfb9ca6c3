"""A split optimizer: its first sub-groups rest on the device and are stepped there, the others are offloaded
(``offload_optimizer.device: auto`` within ``device_memory_budget``, or DeepSpeed's ``ratio``). The split is what
the budget or the ratio says; training matches plain PyTorch AdamW with the GPU path's crossings made and late
(``INFINITY_DISTINCT_DEVICE=1``); a device sub-group's gradients never cross and the CPU kernel never sees
device memory."""

from __future__ import annotations

import copy

import pytest
import torch

import infinity
from helpers import TinyGPT, assert_matches, engine_config, engine_steps, gpt_batches, reference_train
from infinity.config.schema import InfinityConfig
from infinity.kernels import state_nbytes
from infinity.placement.layout import ShardLayout
from infinity.placement.optimizer_split import decide_split
from infinity.placement import split_choice
from infinity.placement.placement import DISTINCT_DEVICE_ENV

STEPS, LR, CLIP = 10, 3e-3, 1.0
SUB_GROUP_SIZE = 3000
COPY_DELAY_S = 0.0005  # every copy lands late: values read without a wait would be stale


@pytest.fixture(autouse=True)
def distinct_device(monkeypatch):
    monkeypatch.setenv(DISTINCT_DEVICE_ENV, "1")


@pytest.fixture(autouse=True)
def no_machine_figures(monkeypatch):
    """The budget's rule alone (the longest run that fits), whatever figures this machine has cached: the
    step-time model's choice is tested in test_split_choice.py on figures made by hand."""
    monkeypatch.setattr(split_choice, "split_figures", lambda: None)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = TinyGPT()
    return model, {accum: gpt_batches(STEPS * accum, batch=4) for accum in (1, 2)}


def _layout(model) -> ShardLayout:
    return ShardLayout(list(model.named_parameters()), world_size=1, sub_group_size=SUB_GROUP_SIZE)


def _half_budget(model, grad_itemsize: int = 4) -> tuple[int, int]:
    """A device budget that holds the first half of the sub-groups' fp32 states and gradients, and that half."""
    groups = _layout(model).sub_groups
    half = len(groups) // 2
    return sum(state_nbytes("fp32", g.numel) + g.numel * grad_itemsize for g in groups[:half]), half


def _auto_config(model, *, accum, clip, param="none", nvme_path=None):
    budget, _ = _half_budget(model)
    config = engine_config(param=param, optimizer="cpu", nvme_path=nvme_path, accum=accum, clip=clip, lr=LR,
                           device_memory_budget=budget)
    config["zero_optimization"]["offload_optimizer"] = {"device": "auto"}
    if nvme_path is not None:
        config["zero_optimization"]["offload_optimizer"].update(nvme_path=nvme_path, max_in_cpu=0)
    return config


def _late_copies(engine):
    engine.copies.delay_s = COPY_DELAY_S


# -- the decision ----------------------------------------------------------------------------------------------
def test_auto_keeps_the_first_sub_groups_that_fit_the_budget(gpt):
    model, _ = gpt
    budget, half = _half_budget(model)
    layout = _layout(model)
    assert len(layout.sub_groups) >= 4
    config = InfinityConfig.from_deepspeed({"zero_optimization": {"offload_optimizer": {"device": "auto"},
                                                                  "device_memory_budget": budget}})
    split = decide_split(config, layout, torch.device("cpu"), grad_itemsize=4)
    assert split.device_sub_groups == half and split.partial
    assert split.device_numel == layout.sub_groups[half].start
    one_byte_less = config.with_zero(device_memory_budget=budget - 1)
    assert decide_split(one_byte_less, layout, torch.device("cpu"), grad_itemsize=4).device_sub_groups == half - 1
    everything = config.with_zero(device_memory_budget=1 << 40)
    assert decide_split(everything, layout, torch.device("cpu"), grad_itemsize=4).device_sub_groups == len(layout.sub_groups)


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_ratio_offloads_what_deepspeed_offloads(gpt, ratio):
    """DeepSpeed: sub-group i goes to the CPU when i >= int((1 - ratio) * sub-groups)."""
    model, _ = gpt
    layout = _layout(model)
    n = len(layout.sub_groups)
    config = InfinityConfig.from_deepspeed({"zero_optimization": {"offload_optimizer": {"device": "cpu",
                                                                                        "ratio": ratio}}})
    split = decide_split(config, layout, torch.device("cpu"), grad_itemsize=4)
    assert split.device_sub_groups == int((1 - ratio) * n)


def test_a_ratio_beyond_an_explicit_device_budget_is_refused_by_name(gpt):
    model, _ = gpt
    budget, _ = _half_budget(model)
    config = engine_config(param="none", optimizer="cpu", nvme_path=None, accum=1, clip=0.0, lr=LR,
                           device_memory_budget=budget)
    config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.0
    with pytest.raises(ValueError, match="offload_optimizer.ratio.*device_memory_budget"):
        infinity.initialize(copy.deepcopy(model), config)


def test_the_engine_rests_and_steps_each_sub_group_where_the_split_says(gpt):
    model, batches = gpt
    _, half = _half_budget(model)
    engine = infinity.initialize(copy.deepcopy(model), _auto_config(model, accum=1, clip=0.0))
    try:
        groups = engine.layout.sub_groups
        assert engine.placement.device_sub_groups == half
        assert [engine.optimizer.state_tier(g) for g in groups] == ["device"] * half + ["host"] * (len(groups) - half)
        # the device sub-groups' gradient slices are on the device; only the others' are in host memory
        assert engine.reducer.device_slices.numel() == groups[half].start
        assert engine.reducer.slices.numel() == engine.layout.trainable_numel - groups[half].start
        loss = engine(*batches[1][0])
        engine.backward(loss)
        engine.step()
        states = engine.step_metrics()["optimizer_states"]
        assert states["device"]["sub_groups"] == half and states["host"]["sub_groups"] == len(groups) - half
        assert states["device"]["nbytes"] == sum(state_nbytes("fp32", g.numel) for g in groups[:half])
        assert states["nvme"] == {"sub_groups": 0, "nbytes": 0}
        assert "optimizer split" in engine.placement.describe()
    finally:
        engine.close()


# -- training ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("clip", [0.0, CLIP])
def test_half_on_the_device_trains_like_plain_pytorch(gpt, accum, clip):
    model, batches = gpt
    reference = reference_train(model, batches[accum], steps=STEPS, accum=accum, clip=clip, lr=LR)
    result = engine_steps(model, _auto_config(model, accum=accum, clip=clip), batches[accum], steps=STEPS,
                          accum=accum, setup=_late_copies)
    assert result[3].split
    assert_matches(result, reference, f"auto, half the sub-groups on the device, accumulation {accum}, clip {clip}")


def test_parameters_in_host_memory_and_states_spilled_to_nvme_train_like_plain_pytorch(gpt, tmp_path):
    """Device sub-groups' new compute shards come down; the offloaded ones rest on NVMe (max_in_cpu 0)."""
    model, batches = gpt
    reference = reference_train(model, batches[2], steps=STEPS, accum=2, clip=CLIP, lr=LR)
    config = _auto_config(model, accum=2, clip=CLIP, param="cpu", nvme_path=str(tmp_path))
    result = engine_steps(model, config, batches[2], steps=STEPS, accum=2, setup=_late_copies)
    states = result[2][-1]["optimizer_states"]
    assert states["device"]["sub_groups"] > 0 and states["nvme"]["sub_groups"] > 0 and states["host"]["sub_groups"] == 0
    assert_matches(result, reference, "auto with params in host memory, the rest on NVMe")


def test_ratio_trains_like_plain_pytorch(gpt):
    model, batches = gpt
    reference = reference_train(model, batches[1], steps=STEPS, accum=1, clip=CLIP, lr=LR)
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=None, accum=1, clip=CLIP, lr=LR)
    config["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5
    result = engine_steps(model, config, batches[1], steps=STEPS, accum=1, setup=_late_copies)
    assert result[3].device_sub_groups == int(0.5 * len(_layout(model).sub_groups))
    assert_matches(result, reference, "ratio 0.5")


def test_each_kernel_sees_only_its_own_memory_and_device_gradients_never_cross(gpt):
    """The CPU kernel is handed host memory only, the device's Adam device memory only; the gradients that
    cross down are the offloaded sub-groups' alone."""
    model, batches = gpt
    engine = infinity.initialize(copy.deepcopy(model), _auto_config(model, accum=1, clip=0.0))

    def span(t):
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()

    device = [span(t) for t in (*engine.optimizer.device_states.tensors.values(), engine.reducer.device_slices,
                                engine.compute._flat)]
    handed = {"host": [], "device": []}
    host_kernel, device_kernel = engine.optimizer._adam, engine.optimizer._device_adam

    def recorded(which, kernel):
        def step(*tensors, **kwargs):
            handed[which].extend(span(t) for t in tensors)
            return kernel(*tensors, **kwargs)
        return step

    engine.optimizer._adam = recorded("host", host_kernel)
    engine.optimizer._device_adam = recorded("device", device_kernel)
    try:
        loss = engine(*batches[1][0])
        engine.backward(loss)
        engine.step()
        crossed_down = engine.step_metrics()["copies"]["device_to_host_nbytes"]
        offloaded_slots = [s for s in engine.layout.slots if s.trainable and s.offset >= engine.placement.device_numel]
    finally:
        engine.close()

    def on_device(lo):
        return any(d_lo <= lo < d_hi for d_lo, d_hi in device)

    assert handed["host"] and handed["device"]
    assert not any(on_device(lo) for lo, _ in handed["host"]), "device memory handed to the CPU kernel"
    assert all(on_device(lo) for lo, _ in handed["device"]), "host memory handed to the device's Adam"
    assert crossed_down == sum(s.shard_numel * 4 for s in offloaded_slots)  # fp32 gradients, once each


# -- the estimate and the step-time model -------------------------------------------------------------------------
def test_the_estimate_moves_the_device_sub_groups_states_and_gradients_to_the_device():
    from infinity.placement.estimate import estimate_for_config
    from infinity.placement.step_time import traffic_from_estimate

    numels = [4096] * 8
    base = {"zero_optimization": {"sub_group_size": 4096, "offload_param": {"device": "none"},
                                  "offload_optimizer": {"device": "cpu"}}}
    split_raw = copy.deepcopy(base)
    split_raw["zero_optimization"]["offload_optimizer"]["ratio"] = 0.75
    whole = estimate_for_config(InfinityConfig.from_deepspeed(base), param_numels=numels, gpu=True)
    split = estimate_for_config(InfinityConfig.from_deepspeed(split_raw), param_numels=numels, gpu=True)
    assert "optimizer_split" not in whole
    assert split["optimizer_split"]["device_sub_groups"] == int(0.25 * 8) == 2
    device_states = state_nbytes("fp32", 2 * 4096)
    assert split["optimizer_split"]["nbytes"] == {"device": device_states, "host": 3 * device_states, "nvme": 0}
    def states(est):
        return [est["tiers"][t]["master"] + est["tiers"][t]["moments"] for t in ("device", "host", "nvme")]
    assert sum(states(split)) == sum(states(whole))  # bytes moved, none made or lost
    assert split["tiers"]["host"]["gradients"] == 3 * whole["tiers"]["host"]["gradients"] // 4
    traffic = traffic_from_estimate(split, micro_batch=1, seq_len=16, shape={"layers": 1, "width": 64, "seq_len": 16})
    assert traffic.device_adam_elements == 2 * 4096 and traffic.cpu_adam_elements == 6 * 4096
    assert traffic.grad_d2h_nbytes == traffic_from_estimate(whole, micro_batch=1, seq_len=16, shape={
        "layers": 1, "width": 64, "seq_len": 16}).grad_d2h_nbytes * 3 / 4


def test_a_checkpoint_of_a_split_optimizer_loads_its_device_and_host_states(gpt, tmp_path):
    """The device sub-groups' states are read and written across the copy worker like the host ones from disk;
    loaded into a run with every sub-group offloaded, they are the same values."""
    from helpers import optimizer_states

    model, batches = gpt
    engine = infinity.initialize(copy.deepcopy(model), _auto_config(model, accum=1, clip=CLIP))
    try:
        _late_copies(engine)
        for batch in batches[1][:3]:
            engine.backward(engine(*batch))
            engine.step()
        saved = optimizer_states(engine)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    finally:
        engine.close()
    offloaded = engine_config(param="none", optimizer="cpu", nvme_path=None, accum=1, clip=CLIP, lr=LR)
    for config in (_auto_config(model, accum=1, clip=CLIP), offloaded):
        engine = infinity.initialize(copy.deepcopy(model), config)
        try:
            engine.load_checkpoint(str(tmp_path / "ckpt"))
            loaded = optimizer_states(engine)
        finally:
            engine.close()
        assert loaded.keys() == saved.keys()
        for key, values in saved.items():
            assert torch.equal(loaded[key], values), key


def test_where_the_device_is_the_host_the_split_trains_like_plain_pytorch(gpt, monkeypatch):
    """Without the test mode the device's memory is the host's: the split is the same (device bytes are
    accounted apart), nothing crosses, and training is the same."""
    monkeypatch.setenv(DISTINCT_DEVICE_ENV, "0")
    model, batches = gpt
    reference = reference_train(model, batches[2], steps=STEPS, accum=2, clip=CLIP, lr=LR)
    result = engine_steps(model, _auto_config(model, accum=2, clip=CLIP), batches[2], steps=STEPS, accum=2)
    assert result[3].split and not result[3].distinct
    assert result[2][-1]["copies"] == {"host_to_device_nbytes": 0, "device_to_host_nbytes": 0}
    assert_matches(result, reference, "auto where the device is the host")


def test_the_command_line_takes_auto_and_says_the_split(tmp_path, capsys, monkeypatch):
    """`--offload-optimizer auto` with a config's device budget that holds one sub-group: the start lines say the
    split, and the run trains (the device's memory is kept apart from the host's here)."""
    import json

    from infinity.cli import main

    monkeypatch.chdir(tmp_path)
    # without machine figures the longest run of first sub-groups that fits the budget rests on the device: this
    # one holds the first (the biases and norm weights, laid out first) and not the second (200,000 elements)
    monkeypatch.setattr(split_choice, "split_figures", lambda: None)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {
        "stage": 3, "sub_group_size": 200_000, "device_memory_budget": 1 << 20}}))
    assert main(["train", "--preset", "tiny", "--steps", "2", "--micro-batch", "1", "--seq-len", "16",
                 "--max-bytes", "200000", "--config", "ds.json", "--offload-param", "cpu",
                 "--offload-optimizer", "auto"]) == 0
    out = capsys.readouterr().out
    assert "optimizer split: sub-groups 0-0" in out
    # (4 sub-groups of at most 200,000 elements: the biases and norm weights, then the decayed tensors in 3)
    assert "optimizer states: device 1 sub-group" in out and "host 3 sub-groups" in out
