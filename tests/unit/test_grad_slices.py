"""The optimizer's gradient slices are not cleared between steps: each step's first backward overwrites every
slot it reaches and zeroes the others. A parameter that got a gradient in one step and none (or only in a later
micro-batch) in the next must see exactly that step's gradient, not a leftover of the last step's."""

import pytest
import torch

import infinity


class _TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.always = torch.nn.Linear(4, 4)
        self.sometimes = torch.nn.Linear(4, 4)

    def forward(self, x, use_sometimes: bool):
        y = self.always(x)
        if use_sometimes:
            y = self.sometimes(y)
        return y.pow(2).mean()


def _slice(engine, name: str) -> torch.Tensor:
    slot = next(s for s in engine.layout.slots if s.name == name)
    (slices,) = engine.reducer.wait_all()  # one flat tensor: no split optimizer here
    return slices[slot.offset:slot.offset + slot.numel].clone()


def _micro_batch(engine, x, use: bool) -> None:
    engine.backward(engine(x, use))


@pytest.mark.parametrize("accum", [1, 2])
def test_a_parameter_gets_only_this_step_s_gradient(accum):
    torch.manual_seed(0)
    config = {"gradient_accumulation_steps": accum, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "overlap_step_with_backward": False}}
    engine = infinity.initialize(_TwoBranches(), config)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    try:
        for _ in range(accum):  # step 1: both branches in every micro-batch
            _micro_batch(engine, x, True)
            engine.step()
        assert engine.global_step == 1
        values = engine.full_state_dict()
        # step 2: the branch runs in its last micro-batch only (with one micro-batch: not at all)
        for micro in range(accum):
            _micro_batch(engine, x, accum > 1 and micro == accum - 1)
            if micro < accum - 1:
                engine.step()
        got = _slice(engine, "sometimes.weight")
        engine.step()
    finally:
        engine.close()
    plain = _TwoBranches()
    plain.load_state_dict(values)
    if accum > 1:
        (plain(x, True) / accum).backward()  # the engine scales each micro-batch's loss by 1 / accumulation
        want = plain.sometimes.weight.grad.reshape(-1)
    else:
        want = torch.zeros(plain.sometimes.weight.numel())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)
