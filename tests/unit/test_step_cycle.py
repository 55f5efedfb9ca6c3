"""The step cycle: its phases follow forward/backward/step, and misuse is refused naming the phase."""

import logging

import pytest
import torch

import infinity


def _loss(engine):
    return engine(torch.randn(2, 3)).sum()


def test_phases_of_one_accumulated_step(caplog):
    engine = infinity.initialize(torch.nn.Linear(3, 1), {"gradient_accumulation_steps": 2})
    try:
        with caplog.at_level(logging.DEBUG, logger="infinity.optim.step_cycle"):
            engine.backward(_loss(engine))
            assert engine.cycle.phase.name == "MICRO_BATCH" and engine.backward_pending
            engine.step()
            assert engine.cycle.phase.name == "ACCUMULATING" and not engine.backward_pending
            engine.backward(_loss(engine))
            assert engine.cycle.phase.name == "BOUNDARY_BACKWARD" and engine.step_in_progress
            engine.step()
        assert engine.cycle.phase.name == "IDLE" and engine.global_step == 1 and engine.micro_step == 2
        moves = [r.getMessage().split(": ", 1)[1] for r in caplog.records
                 if r.name == "infinity.optim.step_cycle" and " -> " in r.getMessage()]
        assert moves == ["IDLE -> MICRO_BATCH", "MICRO_BATCH -> ACCUMULATING", "ACCUMULATING -> BOUNDARY_BACKWARD",
                         "BOUNDARY_BACKWARD -> STEPPING", "STEPPING -> IDLE"]
    finally:
        engine.close()


def test_second_backward_of_the_step_s_last_micro_batch_is_refused():
    """It would overwrite that micro-batch's gradients (or, overlapped, mix them with updates already made)."""
    reference = torch.nn.Linear(3, 1)
    engine = infinity.initialize(reference, {})
    try:
        engine.backward(_loss(engine))
        with pytest.raises(RuntimeError, match="'boundary backward'.*call engine.step"):
            engine.backward(_loss(engine))
        assert engine.micro_step == 1
        engine.step()  # the refused backward changed nothing: training goes on
        engine.backward(_loss(engine))
        engine.step()
        assert engine.global_step == 2
    finally:
        engine.close()


def test_step_twice_names_the_phase():
    engine = infinity.initialize(torch.nn.Linear(3, 1), {})
    try:
        engine.backward(_loss(engine))
        engine.step()
        with pytest.raises(RuntimeError, match=r"step\(\) called before backward\(\).*'idle'"):
            engine.step()
    finally:
        engine.close()
