"""The engine's :class:`~infinity.checkpoint.shard_source.ShardSource`: its layout's shards as runs, read and written
through the optimizer (states) and the compute shards, its module's names and buffers, its counters.

This is the one place outside the engine that knows which of the engine's parts holds what; checkpoints,
state dicts and exports see only the :class:`ShardSource` it implements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from infinity.checkpoint.frozen import FrozenDigest
from infinity.checkpoint.shard_source import COMPUTE_SHARD, ModelBuffer, ParamShard, RunCounters, ShardRun, ShardSpan
from infinity.config.schema import InfinityConfig
from infinity.grads.loss_scaler import LossScaler
from infinity.kernels.compact import STATE_NAMES, checkpoint_dtype
from infinity.optim.offload_optimizer import OffloadOptimizer
from infinity.params.compute_shards import ComputeShards
from infinity.params.sharded_param import ShardedParam
from infinity.placement.layout import ParamSlot, ShardLayout, SubGroup
from infinity.placement.placement import Memory
from infinity.placement.tiers import Tiers
from infinity.runtime.comm import Collectives
from infinity.tiling.plan import TilingPlan


class RunProgress(Protocol):
    """What a save reads, and a load restores, of the run itself (the engine)."""

    global_step: int
    micro_step: int

    @property
    def step_in_progress(self) -> bool:
        """Between a step's first micro-batch and its ``step()``: no checkpoint can be taken."""


@dataclass(frozen=True, slots=True)
class ShardOwners:
    """The engine's parts that hold shards and scalars, as :class:`EngineShards` reads them."""

    module: torch.nn.Module
    params: list[ShardedParam]
    layout: ShardLayout
    compute: ComputeShards
    optimizer: OffloadOptimizer
    tiers: Tiers
    comm: Collectives
    config: InfinityConfig
    tiling_plan: TilingPlan | None
    loss_scaler: LossScaler | None
    frozen: FrozenDigest


class EngineShards:
    """One engine's shards, counters and scalars; made by ``Engine.shard_source()`` for one save, load or
    export (the runs' tiers are those of that moment)."""

    def __init__(self, owners: ShardOwners, run: RunProgress):
        self._owners = owners
        self._run = run
        self._optimizer = owners.optimizer
        self._compute = owners.compute
        self._tiers = owners.tiers
        self.comm = owners.comm
        self.config = owners.config
        self.compute_dtype = owners.compute.dtype
        self.tiling_plan = owners.tiling_plan
        layout = owners.layout
        self.params = tuple(ParamShard(s.index, s.name, tuple(s.shape), s.numel, s.shard_numel, s.trainable)
                            for s in layout.slots)
        index_of = {id(sharded.param): sharded.slot.index for sharded in owners.params}
        self.param_names = tuple((name, index_of[id(param)])
                                 for name, param in owners.module.named_parameters(remove_duplicate=False)
                                 if id(param) in index_of)
        runs: list[ShardRun] = []
        self._targets: list[SubGroup | ParamSlot] = []  # run index -> what holds it
        for group in layout.sub_groups:
            tier = self._state_tier(group)
            for state in STATE_NAMES:
                spans = tuple(ShardSpan(s.index, f"{state}/{s.name}", s.offset - group.start, s.shard_numel)
                              for s in group.slots)
                dtype = checkpoint_dtype(self._optimizer.state_dtype, state)  # as it rests, where that is exact
                runs.append(ShardRun(len(runs), state, dtype, group.start, group.numel, tier, spans))
                self._targets.append(group)
        self.state_runs = tuple(runs)
        for slot in layout.slots:
            span = ShardSpan(slot.index, f"{COMPUTE_SHARD}/{slot.name}", 0, slot.shard_numel)
            runs.append(ShardRun(len(runs), COMPUTE_SHARD, self.compute_dtype, slot.offset, slot.shard_numel,
                                 self._compute_tier(slot), (span,)))
            self._targets.append(slot)
        self.compute_runs = tuple(runs[len(self.state_runs):])

    def _state_tier(self, group: SubGroup) -> str:
        return self._optimizer.state_tier(group)

    def _compute_tier(self, slot: ParamSlot) -> str:
        if self._compute.resident(slot) is None:
            return "nvme"
        return "device" if self._compute.memory is Memory.DEVICE else "host"

    # -- the model ------------------------------------------------------------------
    @property
    def step_in_progress(self) -> bool:
        return self._run.step_in_progress

    def buffers(self) -> tuple[ModelBuffer, ...]:
        found = []
        for module_name, module in self._owners.module.named_modules():
            for local, buf in module._buffers.items():  # every name, as the module's state_dict() has them
                if buf is None:
                    continue
                name = f"{module_name}.{local}" if module_name else local
                found.append(ModelBuffer(name, buf, local not in module._non_persistent_buffers_set))
        return tuple(found)

    # -- shards ---------------------------------------------------------------------
    def read(self, run: ShardRun, out_host: torch.Tensor) -> None:
        target = self._targets[run.index]
        if run.state == COMPUTE_SHARD:
            self._compute.read_to_host(target, out_host)
        else:
            self._optimizer.read_state(run.state, target, out_host)

    def write(self, run: ShardRun, values_host: torch.Tensor) -> None:
        target = self._targets[run.index]
        if run.state == COMPUTE_SHARD:
            handle = self._compute.write(target, values_host)
            if handle is not None:
                handle.wait()  # the caller reuses values_host for the next shard
        else:
            self._optimizer.write_state(run.state, target, values_host)

    def host_view(self, run: ShardRun) -> torch.Tensor | None:
        if run.state != COMPUTE_SHARD or run.tier != "host":
            return None
        return self._compute.resident(self._targets[run.index])

    def empty_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._tiers.empty("host", numel, dtype, owner="state streaming")

    def free_host(self, tensor: torch.Tensor) -> None:
        self._tiers.free("host", tensor)

    # -- scalars --------------------------------------------------------------------
    def counters(self) -> RunCounters:
        return RunCounters(global_step=self._run.global_step, micro_step=self._run.micro_step)

    def set_counters(self, counters: RunCounters) -> None:
        self._run.global_step = counters.global_step
        self._run.micro_step = counters.micro_step

    def optimizer_state(self) -> dict:
        return self._optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        self._optimizer.load_state_dict(state)

    def loss_scaler_state(self) -> dict | None:
        scaler = self._owners.loss_scaler
        return scaler.state_dict() if scaler is not None else None

    def load_loss_scaler_state(self, state: dict) -> None:
        if self._owners.loss_scaler is not None:
            self._owners.loss_scaler.load_state_dict(state)

    @property
    def frozen(self) -> FrozenDigest:
        return self._owners.frozen

    def compute_shards_changed(self) -> None:
        self._compute.staged.clear()  # what the staging sets hold predates the loaded shards
        for sharded in self._owners.params:
            sharded.mark_stale()
