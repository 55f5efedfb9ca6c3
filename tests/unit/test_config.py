"""The DeepSpeed-style config: honoured, not applicable, or rejected by name."""

import json
import logging

import pytest
import torch

import infinity
from infinity.config.schema import InfinityConfig

DEEPSPEED_CONFIG = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 5, "buffer_size": 1e8,
                          "max_in_cpu": 1e9, "pin_memory": True},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4, "pin_memory": True,
                              "pipeline_read": True, "pipeline_write": True, "fast_init": False},
        "sub_group_size": 1e9,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False, "overlap_events": True},
}


def test_a_deepspeed_config_is_accepted_unchanged():
    config = InfinityConfig.from_deepspeed(DEEPSPEED_CONFIG)
    assert config.precision == "bf16"
    assert config.gradient_accumulation_steps == 4 and config.gradient_clipping == 1.0
    assert config.optimizer.lr == 3e-4 and config.optimizer.betas == (0.9, 0.95) and config.optimizer.adamw
    assert config.zero.offload_param.device == "nvme" and config.zero.offload_param.nvme_path == "/local_nvme"
    assert config.zero.offload_param.buffer_size == 100_000_000
    assert config.zero.prefetch_bucket_size == 50_000_000 and config.zero.param_persistence_threshold == 100_000
    assert config.aio.queue_depth == 8 and config.aio.thread_count == 1
    assert {"steps_per_print", "wall_clock_breakdown", "zero_optimization.contiguous_gradients",
            "zero_optimization.offload_optimizer.fast_init"} <= set(config.not_applicable)


def test_intra_op_parallelism_is_the_thread_count():
    assert InfinityConfig.from_deepspeed({"aio": {"intra_op_parallelism": 3}}).aio.thread_count == 3


def test_deepspeed_adam_is_adamw_unless_told_otherwise():
    assert InfinityConfig.from_deepspeed({"optimizer": {"type": "Adam", "params": {}}}).optimizer.adamw
    plain = InfinityConfig.from_deepspeed({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert not plain.optimizer.adamw


@pytest.mark.parametrize("raw, named", [
    ({"zero_optimisation": {"stage": 3}}, "zero_optimisation"),
    ({"zero_optimization": {"stage": 3, "offload_parm": {}}}, "offload_parm"),
    ({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_pth": "/x"}}}, "nvme_pth"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage"),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}}, "offload_param.nvme_path"),
    ({"zero_optimization": {"offload_optimizer": {"device": "disk"}}}, "offload_optimizer.device"),
    ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "amsgrad"),
    ({"optimizer": {"type": "Adam", "params": {"learning_rate": 1}}}, "learning_rate"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled"),
    ({"aio": {"block_size": 1000}}, "aio.block_size"),
    ({"aio": {"use_gds": True}}, "aio.use_gds"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu"),
    ({"zero_optimization": {"sub_group_size": -5}}, "sub_group_size"),
])
def test_bad_keys_and_values_are_rejected_by_name(raw, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        InfinityConfig.from_deepspeed(raw)


def test_config_from_a_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DEEPSPEED_CONFIG))
    assert InfinityConfig.load(str(path)).precision == "bf16"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*not JSON"):
        InfinityConfig.load(str(bad))
    with pytest.raises(OSError, match="missing.json"):
        InfinityConfig.load(str(tmp_path / "missing.json"))


def test_not_applicable_keys_are_logged_once(caplog):
    model = torch.nn.Linear(4, 4)
    with caplog.at_level(logging.INFO, logger="infinity.engine.engine"):
        engine = infinity.initialize(model, {"steps_per_print": 5, "wall_clock_breakdown": True})
        engine.close()
    lines = [r.getMessage() for r in caplog.records if "not applicable" in r.getMessage()]
    assert len(lines) == 1 and "steps_per_print" in lines[0] and "wall_clock_breakdown" in lines[0]


def test_train_batch_size_must_add_up():
    with pytest.raises(ValueError, match="train_batch_size=10"):
        infinity.initialize(torch.nn.Linear(2, 2), {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                                                    "gradient_accumulation_steps": 2})


def test_a_zero_offload_json_of_stage_2_runs_as_stage_3_and_says_so(caplog):
    """DeepSpeed's ZeRO-Offload JSON (stage 2, optimizer states on the CPU) trains exactly as the same JSON at stage 3
    (ZeRO's stages train the same model), and the log says the stage was taken as 3."""
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "contiguous_gradients": True,
               "overlap_comm": True, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}
    raw = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 1.0,
           "zero_optimization": offload}
    losses = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        config = {**raw, "zero_optimization": {**offload, "stage": stage}}
        with caplog.at_level(logging.INFO, logger="infinity.engine.engine"), infinity.initialize(model, config) as engine:
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
            losses[stage] = []
            for _ in range(3):
                loss = engine(x).square().mean()
                engine.backward(loss)
                engine.step()
                losses[stage].append(loss.item())
    assert losses[2] == losses[3]
    assert "zero_optimization.stage=2 (runs as stage 3)" in caplog.text


@pytest.mark.parametrize("given, micro, accumulation", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, 8),
    ({"train_batch_size": 12, "gradient_accumulation_steps": 3}, 4, 3),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 5}, 2, 5),
])
def test_the_batch_size_left_out_is_derived_as_deepspeed_derives_it(given, micro, accumulation):
    """Any two of train_batch_size, the micro batch and the accumulation steps give the third (world size 1), and
    the engine steps at every derived boundary."""
    model = torch.nn.Linear(2, 1)
    with infinity.initialize(model, given) as engine:
        assert (engine.config.micro_batch_size, engine.config.gradient_accumulation_steps) == (micro, accumulation)
        for _ in range(accumulation):
            assert engine.global_step == 0
            engine.backward(engine(torch.ones(micro, 2)).sum())
            engine.step()
        assert engine.global_step == 1
    with pytest.raises(ValueError, match="train_batch_size=10 is not a multiple"):
        infinity.initialize(torch.nn.Linear(2, 2), {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})


# -- a split optimizer: DeepSpeed's offload_optimizer.ratio, our device "auto" and device_memory_budget -------------
@pytest.mark.parametrize("block, device, ratio", [
    ({"device": "cpu", "ratio": 0.3}, "cpu", 0.3),
    ({"device": "cpu", "ratio": 1}, "cpu", 1.0),
    ({"device": "cpu", "ratio": 0}, "cpu", 0.0),
    ({"device": "nvme", "nvme_path": "/x", "ratio": 0.5}, "nvme", 0.5),
    ({"device": "auto"}, "auto", 1.0),
    ({"device": "auto", "nvme_path": "/x"}, "auto", 1.0),
    ({"device": "cpu"}, "cpu", 1.0),
])
def test_ratio_and_auto_are_honoured(block, device, ratio):
    zero = InfinityConfig.from_deepspeed({"zero_optimization": {"offload_optimizer": block}}).zero
    assert zero.offload_optimizer.device == device and zero.offload_optimizer.ratio == ratio
    assert zero.offload_optimizer.splits == (device == "auto" or ratio < 1)


def test_the_offloaded_tier_of_each_device():
    def tier(block):
        return InfinityConfig.from_deepspeed({"zero_optimization": {"offload_optimizer": block}}).zero.offload_optimizer.offloaded_tier
    assert tier({"device": "auto"}) == "host"
    assert tier({"device": "auto", "nvme_path": "/x"}) == "nvme"
    assert tier({"device": "cpu", "ratio": 0.5}) == "host"
    assert tier({"device": "nvme", "nvme_path": "/x"}) == "nvme"
    assert tier({"device": "none"}) == "device"


@pytest.mark.parametrize("value, parsed", [("20GiB", 20 << 30), (0.5, 0.5), ("40%", 0.4), (None, None), (3 << 30, 3 << 30)])
def test_device_memory_budget_is_bytes_or_a_fraction(value, parsed):
    zero = InfinityConfig.from_deepspeed({"zero_optimization": {"device_memory_budget": value}}).zero
    assert zero.device_memory_budget == parsed


@pytest.mark.parametrize("raw, named", [
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 1.5}}}, "offload_optimizer.ratio"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": -0.1}}}, "offload_optimizer.ratio"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": "half"}}}, "offload_optimizer.ratio"),
    ({"zero_optimization": {"offload_optimizer": {"device": "none", "ratio": 0.5}}}, "offload_optimizer.ratio"),
    ({"zero_optimization": {"offload_optimizer": {"device": "auto", "ratio": 0.5}}}, "offload_optimizer.ratio"),
    ({"zero_optimization": {"offload_param": {"device": "auto"}}}, "offload_param.device"),
    ({"zero_optimization": {"offload_param": {"device": "cpu", "ratio": 0.5}}}, "offload_param.ratio"),
    ({"zero_optimization": {"device_memory_budget": "lots"}}, "device_memory_budget"),
    ({"zero_optimization": {"device_memory_budget": 0}}, "device_memory_budget"),
    ({"zero_optimization": {"device_memory_budget": "auto"}}, "device_memory_budget"),
])
def test_bad_split_keys_are_rejected_by_name(raw, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        InfinityConfig.from_deepspeed(raw)


@pytest.mark.parametrize("part", ["offload_param", "offload_optimizer"])
def test_accelerates_none_nvme_path_is_no_path(part, tmp_path):
    """accelerate's DeepSpeed plugin fills an NVMe path it was not given with "none": with device nvme that is refused
    by name before any work (no folder "none" is made); where nothing swaps to NVMe it is no path."""
    with pytest.raises(ValueError, match=rf"{part}\.nvme_path is 'none'"):
        InfinityConfig.from_deepspeed({"zero_optimization": {part: {"device": "nvme", "nvme_path": "none"}}})
    zero = InfinityConfig.from_deepspeed({"zero_optimization": {part: {"device": "cpu", "nvme_path": "none"}}}).zero
    assert getattr(zero, part).nvme_path is None
    auto = {"device": "auto", "nvme_path": "none"}
    zero = InfinityConfig.from_deepspeed({"zero_optimization": {"offload_optimizer": auto}}).zero
    assert zero.offload_optimizer.nvme_path is None and zero.offload_optimizer.offloaded_tier.value == "host"
