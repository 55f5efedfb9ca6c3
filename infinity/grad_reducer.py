"""Gradient reduction: a parameter's full gradient, once autograd has finished
accumulating it, is reduce-scattered (mean over ranks) and this rank's slice is
added to the fp32 gradient buffer in the optimizer's tier, across
micro-batches. The full gradient is freed at once.
"""

from __future__ import annotations

import logging

import torch

from infinity.comm import Collectives
from infinity.layout import ShardLayout

logger = logging.getLogger(__name__)


class GradReducer:
    def __init__(self, layout: ShardLayout, grads: torch.Tensor, comm: Collectives,
                 slot_of_param: dict[int, int]):
        self.layout = layout
        self.grads = grads            # fp32, the trainable flat space
        self._comm = comm
        self._slot_of_param = slot_of_param
        self.received: set[int] = set()  # slots with a gradient this micro-batch
        self.accumulating = False     # False: the next gradient overwrites; True: adds
        self.on_slot_final = None     # callback(slot) when a slot's gradient is final for the step

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: reduce this parameter's gradient and free it."""
        slot = self.layout.slots[self._slot_of_param[id(param)]]
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        flat = grad.reshape(-1)
        if slot.padded_numel != slot.numel:
            padded = flat.new_zeros(slot.padded_numel)
            padded[:slot.numel].copy_(flat)
            flat = padded
        if self._comm.world_size == 1:
            shard = flat
        else:
            shard = flat.new_empty(slot.shard_numel)
            self._comm.reduce_scatter_mean(shard, flat)
        target = self.grads[slot.offset:slot.end]
        if self.accumulating or slot.index in self.received:
            target.add_(shard.to(target.device))
        else:
            target.copy_(shard)
        self.received.add(slot.index)
        if self.on_slot_final is not None:
            self.on_slot_final(slot)

    def end_micro_batch(self, *, boundary: bool) -> None:
        """Gradients of slots that got none this micro-batch are zero (on a fresh accumulation)."""
        if not self.accumulating:
            for slot in self.layout.slots:
                if slot.trainable and slot.index not in self.received:
                    self.grads[slot.offset:slot.end].zero_()
        self.received.clear()
        self.accumulating = not boundary

    def zero(self) -> None:
        self.received.clear()
        self.accumulating = False
