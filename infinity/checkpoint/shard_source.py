"""What checkpoints, state dicts and exports see of a training run on this rank: a narrow, typed shard
source and sink.

The engine builds one per use (``Engine.shard_source()``, implemented by
:class:`infinity.engine.shards.EngineShards`); :mod:`infinity.checkpoint`,
:mod:`infinity.checkpoint.state_dict` and :mod:`infinity.weights.export` take a
:class:`ShardSource` and nothing else of the engine. It holds:

* the model: every managed parameter (:class:`ParamShard`), every name the
  module registers one under, the module's buffers (:class:`ModelBuffer`) and
  the tiling plan;
* this rank's shards as *runs* (:class:`ShardRun`): what is read and written in
  one piece, one optimizer state of one sub-group (fp32) or one parameter's
  compute shard. A run lists its entries (:class:`ShardSpan`: key, numel, place
  in the run) and says its dtype, numel and tier; :meth:`ShardSource.read` and
  :meth:`ShardSource.write` move a whole run through a host buffer, so a caller
  streams the rank's state a run at a time and never holds it whole;
* counted host buffers to stream through (they charge the host-memory budget,
  as every host buffer of the run does);
* the run's scalars: the step counters (:class:`RunCounters`, read and set
  explicitly), the optimizer's and the loss scaler's state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from infinity.checkpoint.frozen import FrozenDigest
from infinity.config.schema import InfinityConfig
from infinity.runtime.comm import Collectives
from infinity.tiling.plan import TilingPlan

COMPUTE_SHARD = "param"
"""The ``state`` of a run that holds a compute shard (the optimizer's runs hold one of ``STATE_NAMES``)."""


@dataclass(frozen=True, slots=True)
class ParamShard:
    """One managed parameter and this rank's shard of it."""

    index: int
    """Its place in :attr:`ShardSource.params` (and its number in the engine's layout)."""
    name: str
    shape: tuple[int, ...]
    """The full parameter's shape."""
    numel: int
    shard_numel: int
    """Elements of this rank's shard: ``numel`` divided by the world size, rounded up (the flat is zero-padded)."""
    trainable: bool


@dataclass(frozen=True, slots=True)
class ShardSpan:
    """One parameter's shard inside a run."""

    param: int
    """The parameter's :attr:`ParamShard.index`."""
    key: str
    """``<state>/<parameter name>``: the tensor's name (a checkpoint file holds it under this name)."""
    start: int
    """Its first element in the run."""
    numel: int


@dataclass(frozen=True, slots=True)
class ShardRun:
    """Shards this rank reads and writes in one piece: one optimizer state of one sub-group, or one
    parameter's compute shard."""

    index: int
    """The source's number for it (``read`` and ``write`` take the run)."""
    state: str
    """``param`` (:data:`COMPUTE_SHARD`) or an optimizer state: ``master``, ``exp_avg``, ``exp_avg_sq``."""
    dtype: torch.dtype
    """The dtype ``read`` gives: for optimizer states the narrowest that holds them exactly
    (``compact.checkpoint_dtype``: fp32, or bf16 for bf16 states and masters; ``read`` also gives fp32, and
    ``write`` takes fp32); the compute dtype for compute shards."""
    offset: int
    """Its first element in the rank's flat space (the layout's offset)."""
    numel: int
    """Elements, padding between shards included."""
    tier: str
    """Where it rests: ``device``, ``host`` or ``nvme``."""
    spans: tuple[ShardSpan, ...]


@dataclass(frozen=True, slots=True)
class ModelBuffer:
    """One of the module's buffers under one of its names (in the module's order; a buffer registered by
    two modules comes once under each name)."""

    name: str
    tensor: torch.Tensor
    """The module's own tensor (loading writes into it)."""
    persistent: bool
    """Part of the module's ``state_dict``."""


@dataclass(frozen=True, slots=True)
class RunCounters:
    """How far the run is."""

    global_step: int
    """Optimizer steps taken (skipped fp16 steps included)."""
    micro_step: int
    """Micro-batches back-propagated."""


class ShardSource(Protocol):
    """This rank's side of a run, as checkpoints, state dicts and exports read and restore it."""

    @property
    def comm(self) -> Collectives:
        """The data-parallel ranks: ``rank``, ``world_size`` and the collectives (every rank calls them)."""

    @property
    def config(self) -> InfinityConfig: ...

    @property
    def compute_dtype(self) -> torch.dtype: ...

    @property
    def params(self) -> tuple[ParamShard, ...]:
        """Every managed parameter, in the layout's order (trainable ones first)."""

    @property
    def param_names(self) -> tuple[tuple[str, int], ...]:
        """Every name the module registers a managed parameter under, in the module's order, with the
        parameter's index (tied parameters have several names)."""

    @property
    def state_runs(self) -> tuple[ShardRun, ...]:
        """The optimizer's states: for each sub-group in order, one run per state (``master``, ``exp_avg``,
        ``exp_avg_sq``), covering every trainable parameter."""

    @property
    def compute_runs(self) -> tuple[ShardRun, ...]:
        """Every parameter's compute shard, one run each, in the layout's order."""

    @property
    def tiling_plan(self) -> TilingPlan | None: ...

    @property
    def step_in_progress(self) -> bool:
        """A step has begun (a boundary micro-batch's forward or backward ran) and ``step()`` has not ended it."""

    def buffers(self) -> tuple[ModelBuffer, ...]:
        """The module's buffers (None ones left out), non-persistent ones included."""

    def read(self, run: ShardRun, out_host: torch.Tensor) -> None:
        """Copy the run's values into the host tensor ``out_host`` (``run.numel`` elements of ``run.dtype``, or
        of fp32 for an optimizer state), from whichever tier it rests in; blocking."""

    def write(self, run: ShardRun, values_host: torch.Tensor) -> None:
        """Replace the run's values with the host tensor ``values_host`` (the compute dtype for a compute shard,
        fp32 for an optimizer state); blocking (``values_host`` may be reused when it returns)."""

    def host_view(self, run: ShardRun) -> torch.Tensor | None:
        """The run's values themselves when they rest in host memory in ``run.dtype`` (to be read without a
        copy, not changed), else None."""

    def empty_host(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer charged to the host-memory budget; give it back with :meth:`free_host`."""

    def free_host(self, tensor: torch.Tensor) -> None: ...

    def counters(self) -> RunCounters: ...

    def set_counters(self, counters: RunCounters) -> None: ...

    def optimizer_state(self) -> dict:
        """The optimizer's scalars (its step count and lr) as JSON values; its tensors are the state runs."""

    def load_optimizer_state(self, state: dict) -> None: ...

    def loss_scaler_state(self) -> dict | None:
        """The fp16 loss scaler's state as JSON values; None without one."""

    def load_loss_scaler_state(self, state: dict) -> None:
        """Restore the loss scaler, where there is one (else nothing)."""

    @property
    def frozen(self) -> FrozenDigest:
        """This rank's fingerprint of its frozen parameters' compute shards (:mod:`infinity.checkpoint.frozen`);
        a load that writes them fingerprints them again."""

    def compute_shards_changed(self) -> None:
        """The compute shards were rewritten: full parameters gathered before must be gathered again."""


def require_step_boundary(source: ShardSource, what: str) -> None:
    """Gradients are in neither a checkpoint nor an export, and in none of the tiers at a step boundary:
    ``what`` may run only there."""
    accum = source.config.gradient_accumulation_steps
    micro_step = source.counters().micro_step
    if micro_step % accum != 0:
        raise RuntimeError(f"{what}: {micro_step % accum} of {accum} micro-batches of this step are "
                           f"accumulated; call it after engine.step() completes the step (gradients are not saved)")
    if source.step_in_progress:
        raise RuntimeError(f"{what}: backward() ran but step() did not; call engine.step() first")


def unique_buffers(source: ShardSource) -> list[ModelBuffer]:
    """The module's buffers as its ``named_buffers()`` lists them: each tensor once, under its first name."""
    seen: set[int] = set()
    unique = []
    for buf in source.buffers():
        if id(buf.tensor) not in seen:
            seen.add(id(buf.tensor))
            unique.append(buf)
    return unique
