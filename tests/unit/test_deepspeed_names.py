"""Names DeepSpeed scripts import beside ``initialize``: ``deepspeed.utils``' ``logger`` and ``log_dist``,
``deepspeed.runtime.utils.see_memory_usage``, ``deepspeed.zero.register_external_parameter`` and
``deepspeed.comm.new_group``, each doing what DeepSpeed's does."""

from __future__ import annotations

import copy
import io
import logging

import psutil
import pytest
import torch
import torch.distributed as dist

import infinity.deepspeed as deepspeed
from infinity.deepspeed.runtime.utils import see_memory_usage
from infinity.deepspeed.utils import log_dist, logger

LR = 1e-2


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def printed(capsys) -> list[str]:
    """The messages the DeepSpeed logger printed, without its ``[time] [LEVEL] [file:line:function]`` prefix."""
    return [line.split("] ", 3)[-1] for line in capsys.readouterr().out.splitlines()]


def test_log_dist_prints_on_the_ranks_named_as_deepspeeds_does(capsys, one_rank_group):
    assert logger.name == "DeepSpeed"
    for ranks in ([0], [-1], [1], None, [1, 0]):
        log_dist(f"ranks={ranks}", ranks=ranks)
    assert printed(capsys) == ["[Rank 0] ranks=[0]", "[Rank 0] ranks=[-1]", "[Rank 0] ranks=[1, 0]"]


def test_log_dist_without_a_process_group_prints_as_rank_minus_one(capsys):
    log_dist("alone", ranks=[3], level=logging.WARNING)
    out = capsys.readouterr().out
    assert "[WARNING]" in out and out.rstrip().endswith("[Rank -1] alone")


def test_the_loggers_lines_are_printed_once_with_no_logging_set_up_or_with_the_scripts(capsys):
    """DeepSpeed's logger prints its INFO lines to stdout itself and keeps them from the root logger: a script's
    progress shows without logging set up, and once where the script sets up its own."""
    logger.info("step 1")
    scripts = io.StringIO()
    logging.getLogger().addHandler(handler := logging.StreamHandler(scripts))
    try:
        logger.info("step 2")
    finally:
        logging.getLogger().removeHandler(handler)
    assert printed(capsys) == ["step 1", "step 2"] and scripts.getvalue() == ""


def test_see_memory_usage_prints_the_hosts_memory_in_use_only_when_forced(capsys):
    see_memory_usage("not forced")
    assert printed(capsys) == []
    see_memory_usage("after the model", force=True)
    lines = printed(capsys)
    assert lines[0] == "after the model"
    host = psutil.virtual_memory()
    used_gb = float(lines[-1].split("used = ")[1].split(" GB")[0])
    assert lines[-1].startswith("CPU Virtual Memory:")
    assert abs(used_gb - (host.total - host.available) / 1024 ** 3) < 1.0  # both read now, the same counter


def test_new_group_is_a_process_group_the_collectives_take(one_rank_group):
    group = deepspeed.comm.new_group(ranks=[0])
    value = torch.tensor([2.0])
    deepspeed.comm.all_reduce(value, group=group)
    assert dist.get_world_size(group) == 1 and value.item() == 2.0


class SharedWeight(torch.nn.Module):
    """``first.weight`` is used again in the parent's forward, outside its module: DeepSpeed's example of
    ``register_external_parameter``."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 1)
        deepspeed.zero.register_external_parameter(self, self.first.weight)

    def forward(self, x, y):
        h = torch.tanh(self.first(x))
        h = h @ self.first.weight.t()  # the external use
        return torch.nn.functional.mse_loss(self.second(h), y)


def test_a_registered_external_parameter_trains_as_plain_pytorch_with_parameters_released():
    torch.manual_seed(0)
    model = SharedWeight()
    ref = copy.deepcopy(model)
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": LR,
                                                                                         "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(1)
    with engine:
        for _ in range(4):
            x = torch.randn(4, 8, generator=g)
            y = x.sum(dim=1, keepdim=True).sin()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            ref_loss = ref(x, y)
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
            assert model.first.weight.numel() == 0  # released between passes: the external use fetched it
        state = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_register_external_parameter_refuses_what_is_not_a_parameter_by_argument():
    with pytest.raises(ValueError, match=r"parameter=\.\.\.\) must be a torch.nn.Parameter"):
        deepspeed.zero.register_external_parameter(torch.nn.Linear(2, 2), torch.zeros(2))
    with pytest.raises(ValueError, match=r"module=\.\.\.\) must be a torch.nn.Module"):
        deepspeed.zero.register_external_parameter("first", torch.nn.Parameter(torch.zeros(2)))
