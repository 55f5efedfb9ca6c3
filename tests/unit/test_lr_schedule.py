"""Learning-rate schedules against their formulas, step by step; DeepSpeed blocks through config and engine."""

import math

import pytest
import torch

import infinity
from infinity.config.schema import InfinityConfig
from infinity.config.lr_schedule import DeepSpeedScheduler, lr_at, scheduler_from_deepspeed

PEAK, MIN, WARMUP, TOTAL = 1e-3, 1e-4, 4, 20


def _ours(schedule, **kw):
    return [lr_at(s, peak_lr=PEAK, warmup_steps=WARMUP, total_steps=TOTAL, min_lr=MIN, schedule=schedule, **kw)
            for s in range(TOTAL)]


def test_warmup_is_the_same_linear_ramp_for_every_schedule():
    for schedule in ("cosine", "linear", "constant", "wsd"):
        assert _ours(schedule)[:WARMUP] == pytest.approx([PEAK * (s + 1) / WARMUP for s in range(WARMUP)])


def test_cosine_linear_constant_follow_their_formulas():
    after = range(WARMUP, TOTAL)
    progress = [(s - WARMUP + 1) / (TOTAL - WARMUP) for s in after]
    assert _ours("cosine")[WARMUP:] == pytest.approx([MIN + (PEAK - MIN) * (1 + math.cos(math.pi * p)) / 2 for p in progress])
    assert _ours("linear")[WARMUP:] == pytest.approx([PEAK + (MIN - PEAK) * p for p in progress])
    assert _ours("constant")[WARMUP:] == pytest.approx([PEAK] * len(after))
    assert _ours("cosine")[-1] == pytest.approx(MIN) and _ours("linear")[-1] == pytest.approx(MIN)


def test_wsd_holds_the_peak_then_decays_linearly_over_its_last_fraction():
    lrs = _ours("wsd", decay_fraction=0.25)  # 16 steps after warmup: 12 stable, 4 of decay
    assert lrs[WARMUP:16] == pytest.approx([PEAK] * 12)
    assert lrs[16:] == pytest.approx([PEAK + (MIN - PEAK) * k / 4 for k in (1, 2, 3, 4)])


def test_bad_schedule_arguments_are_named():
    with pytest.raises(ValueError, match="'cosin'"):
        lr_at(0, peak_lr=1, warmup_steps=1, total_steps=2, schedule="cosin")
    with pytest.raises(ValueError, match="decay_fraction"):
        lr_at(0, peak_lr=1, warmup_steps=1, total_steps=2, schedule="wsd", decay_fraction=0)


# --------------------------------------------------------------------------- DeepSpeed's


def _ds_reference(kind, it, lr, p):
    """DeepSpeed's get_lr() at last_batch_iteration=it, written out from its documented formulas."""
    n = max(2, p.get("warmup_num_steps", 1000))
    log = p.get("warmup_type", "log") == "log"
    if kind == "WarmupCosineLR":
        if it < 0:
            return 0.0
        if it < n:
            g = math.log(it + 1) / math.log(n) if log else it / n
            w = p.get("warmup_min_ratio", 0.0)
            return lr * (w + (1 - w) * g)
        c = p.get("cos_min_ratio", 1e-4)
        return lr * max(0.0, c + (1 - c) * (1 + math.cos(math.pi * (it - n + 1) / (p["total_num_steps"] - n))) / 2)
    lo, hi = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", lr)
    if it < 0:
        return lo
    if it < n:
        g = math.log(it + 1) / math.log(n) if log else it / n
    elif kind == "WarmupLR":
        g = 1.0
    else:
        g = max(0.0, (p["total_num_steps"] - it) / max(1.0, p["total_num_steps"] - n))
    return lo + (hi - lo) * g


@pytest.mark.parametrize("kind, params", [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3, "warmup_num_steps": 5}),
    ("WarmupLR", {"warmup_num_steps": 6, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4, "total_num_steps": 20}),
    ("WarmupDecayLR", {"warmup_num_steps": 3, "total_num_steps": 12, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}),
    ("WarmupCosineLR", {"total_num_steps": 15, "warmup_num_steps": 3, "warmup_type": "linear"}),
])
def test_deepspeed_schedulers_match_their_formulas_one_step_late(kind, params):
    sched = scheduler_from_deepspeed({"type": kind, "params": params})
    lr = 3e-3
    steps = params.get("total_num_steps", 12)
    # DeepSpeed steps its scheduler after each optimizer step: optimizer step k runs at iteration k - 1.
    assert [sched.lr_at(k, lr) for k in range(steps)] == pytest.approx(
        [_ds_reference(kind, k - 1, lr, params) for k in range(steps)], abs=1e-15)


@pytest.mark.parametrize("block, named", [
    ({"type": "OneCycle", "params": {}}, "OneCycle"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4}}, "scheduler.type 'OneCycle' is not supported"),
    ({"type": "WarmupLR", "params": {"warmup_steps": 3}}, "warmup_steps"),
    ({"type": "WarmupDecayLR", "params": {}}, "total_num_steps"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_min_lr": 0}}, "warmup_min_lr"),
    ({"type": "WarmupLR", "params": {"warmup_type": "exp"}}, "warmup_type"),
    ({"params": {}}, "scheduler.type"),
])
def test_bad_scheduler_blocks_are_refused_by_name(block, named):
    with pytest.raises(ValueError, match=named):
        InfinityConfig.from_deepspeed({"scheduler": block})


def test_the_engine_runs_each_step_at_the_scheduled_lr():
    block = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3, "total_num_steps": 6, "warmup_max_lr": 0.01,
                                                 "warmup_type": "linear"}}
    # (clipping that never clips: the step then runs after backward and takes the norm)
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 0.5}}, "scheduler": block, "gradient_clipping": 1e9}
    assert "scheduler" not in InfinityConfig.from_deepspeed(config).not_applicable
    sched = DeepSpeedScheduler(type="WarmupDecayLR", **block["params"])
    torch.manual_seed(0)
    with infinity.initialize(torch.nn.Linear(4, 2), config) as engine:
        seen = []
        for _ in range(6):
            seen.append(engine.lr)
            loss = engine(torch.randn(3, 4)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            assert engine.get_global_grad_norm() > 0
    assert seen == pytest.approx([sched.lr_at(k, 0.5) for k in range(6)])
    assert seen[0] == 0.0 and seen[4] == pytest.approx(0.01)
