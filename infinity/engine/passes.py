"""Passes: one micro-batch's forward and backward (or a forward alone without grad), and what lies between them.

At a pass's start every parameter's ``.data`` becomes the view of its full tensor that fetches fill, and the
prefetcher learns whether an update may come before the next pass: only after a backward that is its step's last.
At its end everything gathered is released but what the prefetcher keeps for the next pass (no update comes in
between: the first layers the next forward needs, :mod:`infinity.params.prefetcher`; after a forward without grad,
as much of the model as the live-parameter budget and the memory's room allow), and user code runs until the next
one, seeing a released parameter's ``.data`` empty. A step's update marks what was kept stale, which frees it, so
the pass that ends a step keeps nothing; so does writing the shards outside a pass (a checkpoint loaded, a
gathered block modified).
"""

from __future__ import annotations

import torch

from infinity.optim.step_cycle import StepCycle
from infinity.params.hooks import ModuleHooks
from infinity.params.prefetcher import Prefetcher
from infinity.params.sharded_param import ParamState, ShardedParam


class Passes:
    """Whether a pass is running, and what one pass keeps gathered for the next."""

    def __init__(self, params: list[ShardedParam], prefetcher: Prefetcher | None, hooks: ModuleHooks,
                 cycle: StepCycle):
        self._params = params
        self._prefetcher = prefetcher
        self._hooks = hooks
        self._cycle = cycle
        self.running = False
        self._kept: list[ShardedParam] = []  # gathered at the last pass's end for this one (its step goes on)
        self.leave()

    def begin(self) -> None:
        """A forward begins a pass, unless one is running (a second forward before its backward)."""
        if self.running:
            return
        self.running = True
        for sharded in self._params:
            sharded.enter_pass()
        if self._prefetcher is not None:
            training = torch.is_grad_enabled()  # a backward follows
            # A forward alone changes no shard, so what the next pass uses early may stay gathered for it, as between
            # the micro-batches of one step (an evaluation's batches, generate's tokens).
            self._prefetcher.begin_pass(self._kept, training=training,
                                        step_goes_on=not (training and self._cycle.next_is_boundary))
        self._kept = []

    def begin_backward(self) -> None:
        """The pass's backward begins: whether its step goes on after it, as known now (a boundary may have been
        forced since the forward)."""
        if self._prefetcher is not None and self.running:
            self._prefetcher.begin_backward(step_goes_on=not self._cycle.next_is_boundary)

    def end(self, *, completed: bool = True) -> None:
        """The backward is over (or the forward, without grad, or either raised: not ``completed``): release all but
        what the prefetcher keeps for the next pass (nothing after a pass that raised)."""
        running = self.running and self._prefetcher is not None
        self._kept = self._prefetcher.end_pass(completed=completed) if running else []
        self.release_all(keep=self._kept)
        self.running = False
        self.leave()

    def leave(self) -> None:
        """User code runs until the next pass: a released parameter's ``.data`` is empty meanwhile."""
        for sharded in self._params:
            sharded.leave_pass()

    def release_all(self, keep: list[ShardedParam] = ()) -> None:
        """Free every gathered parameter but ``keep``'s, whoever holds it."""
        kept = {id(sharded) for sharded in keep}
        for sharded in self._params:
            if sharded.state is not ParamState.RELEASED and id(sharded) not in kept:
                sharded.force_release()
        self._hooks.running.clear()
