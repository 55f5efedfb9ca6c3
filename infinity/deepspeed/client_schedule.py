"""The learning-rate schedule a DeepSpeed script sees: its own scheduler driving the engine's one learning rate,
as DeepSpeed's engine drives it (:class:`ClientSchedule`), or a view of the config's ``scheduler`` block
(:class:`ScheduleView`).

A DeepSpeed script often makes its scheduler over its optimizer (``transformers.get_scheduler(...)``,
``torch.optim.lr_scheduler.LambdaLR(...)``) and passes both to ``initialize``; or it passes a callable that makes
the scheduler from the optimizer DeepSpeed hands it. Either way the scheduler moves the ``lr`` of a
``torch.optim`` optimizer's groups; after each applied optimizer step (not one skipped for an fp16 overflow) the
engine steps it and takes the groups' learning rate as its own for the next step. The engine has one learning
rate, so the groups must move together. The scheduler's ``state_dict()`` travels in the engine's checkpoints and
is restored with them.
"""

from __future__ import annotations

import json
import math

import torch

CHECKPOINT_KEY = "deepspeed_lr_scheduler"
"""Where a checkpoint's ``client_state`` holds the scheduler's ``state_dict()`` (taken out again on load)."""


class ClientSchedule:
    """The scheduler and the ``torch.optim`` optimizer whose groups it moves."""

    def __init__(self, scheduler, optimizer: torch.optim.Optimizer):
        if not callable(getattr(scheduler, "step", None)) or not callable(getattr(scheduler, "state_dict", None)):
            raise ValueError(f"initialize(lr_scheduler=...): a {type(scheduler).__name__} has no step() and "
                             "state_dict(); give a torch.optim.lr_scheduler scheduler, or a callable making one from "
                             "the optimizer")
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("initialize(lr_scheduler=...): the scheduler moves another optimizer than the one given "
                             "as optimizer=...; make it over that optimizer")
        self.scheduler = scheduler
        self._optimizer = optimizer
        self.lr()  # the groups move together from the start

    @classmethod
    def made_by(cls, factory, lr: float, weight_decays: list[float]) -> "ClientSchedule":
        """The scheduler ``factory(optimizer)`` makes, over a stand-in optimizer holding the engine's ``lr``: a group
        per group of the engine's optimizer (their ``weight_decays``), as DeepSpeed hands the factory its optimizer
        (a ``LambdaLR`` takes a lambda per group, ``get_last_lr()`` gives a rate per group)."""
        stand_in = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "weight_decay": decay}
                                    for decay in weight_decays], lr=lr)
        return cls(factory(stand_in), stand_in)

    def lr(self) -> float:
        """The groups' one learning rate."""
        rates = {float(group["lr"]) for group in self._optimizer.param_groups}
        if len(rates) != 1 or any(math.isnan(rate) or rate < 0 for rate in rates):
            raise ValueError(f"the lr_scheduler gives the optimizer's groups the learning rates {sorted(rates)}: the "
                             "engine has one learning rate (non-negative), so its groups must move together")
        return rates.pop()

    def step(self) -> float:
        """Move the schedule one optimizer step on; the learning rate of the next step."""
        # torch's schedulers check that their optimizer stepped: the engine's did, in its place
        self._optimizer._opt_called = True
        self.scheduler.step()
        return self.lr()

    def state_dict(self) -> dict:
        state = self.scheduler.state_dict()
        try:
            json.dumps(state)
        except (TypeError, ValueError) as err:
            raise ValueError(f"the lr_scheduler's state_dict() cannot be saved in a checkpoint ({err}): it must hold "
                             "JSON values only") from None
        return state

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
        last = getattr(self.scheduler, "get_last_lr", None)
        if last is not None:  # torch's load_state_dict restores the schedule, not the groups it moved
            for group, lr in zip(self._optimizer.param_groups, last()):
                group["lr"] = lr


class ScheduleView:
    """The learning-rate schedule ``initialize`` returns where the config has a ``scheduler`` block: the engine
    sets each step's lr from it, as DeepSpeed's engine steps its own scheduler; ``step()`` does nothing."""

    def __init__(self, engine):
        self._engine = engine

    def get_last_lr(self) -> list[float]:
        """The engine's one rate, once per group of ``engine.optimizer`` (DeepSpeed's schedulers keep
        ``[group["lr"] for group in optimizer.param_groups]``)."""
        return [self._engine.lr] * len(self._engine.optimizer.param_groups)

    get_lr = get_last_lr

    def step(self, *args, **kwargs) -> None:
        """Nothing to do: ``engine.step()`` moves the schedule."""
