"""The engine: wiring of config, layout, tiers, hooks, reducer and optimizer
behind ``infinity.initialize``. It owns every other object's lifetime.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time

import torch

from infinity.checkpoint.frozen import FrozenDigest
from infinity.checkpoint.save_dir_lock import release_save_dir
from infinity.config.schema import InfinityConfig
from infinity.engine.adapter_init import check_adapter_init
from infinity.engine.adapter_merge import AdapterMergeHooks
from infinity.engine.adapter_save import AdapterSaveHook
from infinity.engine.casting import cast_buffers, cast_floating
from infinity.engine.gathered import register
from infinity.engine.materialize import Initializer, ParamInit, replace_meta_parameters, write_initial_shards
from infinity.engine.model_calls import ModelCallHooks
from infinity.engine.model_state import StateDictHooks
from infinity.engine.passes import Passes
from infinity.engine.state_verbs import StateVerbs
from infinity.engine.step_metrics import StepMeter, optimizer_split_metrics, optimizer_states_by_tier
from infinity.engine.trainable_set import TrainableSet
from infinity.grads.loss_scaler import LossScaler
from infinity.grads.reducer import GradReducer
from infinity.grads.spill import GradSpill
from infinity.models.transformers_lm import is_transformers_model, refuse_targets_as_mask
from infinity.optim.offload_optimizer import OffloadOptimizer
from infinity.optim.param_groups import decay_of_tiles, weight_decay_by_name
from infinity.optim.speculation import StepCheck
from infinity.optim.states import OptimizerParts
from infinity.optim.step_cycle import StepCycle
from infinity.params.compute_shards import ComputeShards
from infinity.params.fetch_parts import prefetcher_for, read_pool_for
from infinity.params.gathered_blocks import full_blocks_for
from infinity.params.hooks import FetchGroup, ModuleHooks, fetch_groups, fetch_on_use
from infinity.params.sharded_param import FetchPath, ShardedParam
from infinity.placement.copies import Copies
from infinity.placement.host_budget import HostMemoryPlan
from infinity.placement.layout import ShardLayout
from infinity.placement.engine_split import engine_split
from infinity.placement.placement import (Placement, compute_device, device_memory_is_distinct,
                                          grad_accumulator_fits_device)
from infinity.placement.split_choice import StepShape
from infinity.placement.tiers import Tiers
from infinity.runtime.allocator import give_back_freed_heap, keep_large_blocks_mapped
from infinity.runtime.comm import Collectives, rank_in
from infinity.runtime.cpu_matmul import run_matmul_mode
from infinity.runtime.trace import Timeline
from infinity.tiling import tile_model
from infinity.weights.adapters import is_peft_model
from infinity.weights.pretrained import open_for_model

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def initialize(model: torch.nn.Module, config: "InfinityConfig | dict | str | None" = None, *,
               process_group=None, weights=None, param_init: ParamInit | None = None,
               step_shape: StepShape | None = None, param_groups=None) -> "Engine":
    """Partition ``model`` across the data-parallel ranks and offload its states as ``config`` says.

    ``weights``: a Hugging Face model folder (or ``.safetensors`` file) whose tensors are streamed
    straight into this rank's shards instead of initializing (a ``peft`` model: its base's; its new LoRA
    adapters are initialized as ``peft`` does, see :mod:`infinity.engine.adapter_init`). ``param_init(module)``: initializes
    each module of a model built on the meta device (see :mod:`infinity.engine.materialize`).
    ``step_shape``: the run's model shape and micro-batch, for the step-time model that chooses how many
    sub-groups ``offload_optimizer.device: auto`` keeps on the device (default: the model's own).
    ``param_groups``: ``[{"params": [...], "weight_decay": 0.0}, ...]`` as ``torch.optim`` takes them, for a
    weight decay per group (see :mod:`infinity.optim.param_groups`); without them, the config's
    ``weight_decay`` applies to every trainable parameter.
    """
    return Engine(model, InfinityConfig.load(config), process_group=process_group, weights=weights,
                  param_init=param_init, step_shape=step_shape, param_groups=param_groups)


class Engine(StateVerbs):
    """A model under ZeRO-3 with offload: ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``; saving
    and loading are :class:`~infinity.engine.state_verbs.StateVerbs`'."""

    def __init__(self, model: torch.nn.Module, config: InfinityConfig, *, process_group=None, weights=None,
                 param_init: ParamInit | None = None, step_shape: StepShape | None = None, param_groups=None):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        # by name: a meta parameter is replaced by a new one below
        weight_decay = None if param_groups is None else weight_decay_by_name(model, param_groups, config.optimizer)
        # The timeline first: the collectives record their spans on it from the first one (and a trace path that
        # cannot be written is refused before anything is opened).
        self.timeline = Timeline(config.trace.path, rank=rank_in(process_group))
        self._initializer = Initializer(model, param_init)
        self._weights = None
        if weights is not None:
            check_adapter_init(model)  # a peft model's new adapters over a streamed base: before a file is opened
            self._weights = open_for_model(weights, model, tiled=config.tiling.max_tile_numel is not None)
        self.config = config
        keep_large_blocks_mapped()
        self.comm = Collectives(process_group, timeline=self.timeline)
        self.device = compute_device(config.device, self.comm)
        self.dtype = DTYPES[config.precision]
        self._matmul_mode = run_matmul_mode(config.cpu_matmul_precision, config.precision, self.device, logger=logger)
        config = self.config = config.for_world_size(self.comm.world_size)  # DeepSpeed's batch-size arithmetic
        if config.not_applicable:
            logger.info("config keys accepted but not applicable here: %s", ", ".join(config.not_applicable))
        if config.tiling.max_tile_numel is not None:
            self.tiling_plan = tile_model(model, config.tiling.max_tile_numel)
        else:
            self.tiling_plan = None
        self.module = model
        self._transformers_forward = is_transformers_model(model)  # refuses the byte GPT's (ids, targets) call
        meta_data = replace_meta_parameters(model)
        named = list(model.named_parameters())
        if not named:
            raise ValueError(f"model {type(model).__name__} has no parameters to train or partition")
        zero = config.zero
        self.host_budget = HostMemoryPlan(zero, self.dtype)
        sub_group_size = self.host_budget.sub_group_size(named, self.comm.world_size)
        if weight_decay is not None:
            weight_decay = decay_of_tiles(weight_decay, [name for name, _ in named], self.tiling_plan)
        self.layout = ShardLayout(named, world_size=self.comm.world_size, sub_group_size=sub_group_size,
                                  weight_decay=weight_decay)
        distinct = device_memory_is_distinct(self.device)
        self.optimizer_split = engine_split(config, self.layout, self.device, distinct=distinct, model=model,
                                            step_shape=step_shape)
        """Which sub-groups rest on the device, how that was chosen, and the device budget enforced for them."""
        self.placement = Placement.decide(
            config, self.device, distinct=distinct,
            grad_accumulator_fits_device=grad_accumulator_fits_device(self.device, self.layout.trainable_numel),
            split=self.optimizer_split)
        # refuses a budget below the minimum working set; puts gradient slices it cannot hold on NVMe
        self.placement = self.host_budget.settle(self.layout, self.placement)
        logger.info("%s", self.placement.describe())
        self.copies = Copies(self.placement)
        self.tiers = Tiers(config.aio, self.placement, self.timeline, host_budget_nbytes=self.host_budget.budget_nbytes,
                           device_optimizer_budget_nbytes=self.optimizer_split.budget_nbytes)
        self._closed = False
        self._save_dirs: set[str] = set()
        self.frozen = FrozenDigest()
        """This rank's fingerprint of its frozen compute shards: a checkpoint may then leave them out."""
        try:
            self._build(model, named, meta_data)
        except BaseException as failed:
            if self._weights is not None:
                self._weights.close()
            try:
                Engine.close(self)  # what _build made so far, its workers too (the exit's closing finds it closed)
            except Exception as err:
                failed.add_note(f"closing the engine it left half built failed too: {err!r}")
            raise

    # -- construction ------------------------------------------------------
    def _build(self, model: torch.nn.Module, named: list, meta_data: dict[int, torch.Tensor]) -> None:
        config, zero, layout, placement = self.config, self.config.zero, self.layout, self.placement
        self._read_pool = read_pool_for(self.placement, self.config.zero.offload_param, self.layout, self.dtype,
                                        self.tiers)
        budget = self.host_budget
        reserve = budget.reserve_nbytes(self._read_pool.budget_nbytes if self._read_pool is not None else 0)
        persistent = layout.persistent_slots(zero.param_persistence_threshold)
        self.compute = ComputeShards(layout, self.dtype, placement.compute_shard, self.tiers, self.copies,
                                     nvme_path=zero.offload_param.nvme_path,
                                     max_in_cpu=budget.param_cache_numel(self.tiers.host_memory.room_nbytes(), reserve),
                                     persistent=persistent)
        by_name = {name: p for name, p in named}
        spill = None
        if placement.nvme_grads_from is not None:
            spill = GradSpill(self.tiers.swap_store(zero.offload_optimizer.nvme_path), layout, placement, self.tiers,
                              self.copies, grad_dtype=self.dtype if placement.grads_lossless else torch.float32)
        self.reducer = GradReducer(layout, placement, self.tiers, self.copies, self.comm,
                                   {id(by_name[s.name]): s.index for s in layout.slots}, compute_dtype=self.dtype,
                                   spill=spill)
        # Exact with clipping and fp16 too: those steps speculate and are settled once the norm is known.
        self.overlap_step = zero.overlap_step_with_backward
        parts = OptimizerParts(layout, placement, self.tiers, self.compute, self.reducer, self.copies,
                               timeline=self.timeline, rank=self.comm.rank)
        self.optimizer = OffloadOptimizer(parts, config.optimizer, zero, staging_sets=budget.staging_sets,
                                          reserve_nbytes=reserve,
                                          step_undo=self.overlap_step and self._step_may_be_undone())
        # The user's values (or meta tensors), before each .data becomes a view of a full tensor.
        original_data = {id(p): meta_data.get(id(p), p.data) for _, p in named}
        self.full_blocks = full_blocks_for(placement, self.tiers.stats["device"])
        self.prefetcher = prefetcher_for(self.config.zero, self.compute, self.copies, self.layout, self.dtype,
                                         self.tiers.stats["device"], reserve, self.comm, self.full_blocks)
        self.params: list[ShardedParam] = []
        self._by_param: dict[int, ShardedParam] = {}
        path = FetchPath(self.compute, self.comm, self.tiers, self.copies, self._read_pool, self.full_blocks,
                         prefetcher=self.prefetcher)
        for slot in layout.slots:
            sharded = ShardedParam(by_name[slot.name], slot, path, persistent=slot.index in persistent)
            self.params.append(sharded)
        write_initial_shards(model, self.params, original_data, initializer=self._initializer, weights=self._weights,
                             comm=self.comm, compute=self.compute, optimizer=self.optimizer, frozen=self.frozen)
        for sharded in self.params:
            self._by_param[id(sharded.param)] = sharded
        register(self, self.params)  # a parameter leads to its engine (zero.GatheredParameters)
        if self._weights is not None:
            self._weights.load_buffers(model)
            self._weights.close()
        self._initializer.materialize_buffers()
        cast_buffers(model, self.device, self.dtype)
        self.groups = fetch_groups(model, self._by_param)
        self.root_group = self.groups.get(model) or FetchGroup("", [])
        trainable = [by_name[s.name] for s in layout.slots if s.trainable]
        self.hooks = ModuleHooks(model, self.groups, self.reducer.on_grad_ready, trainable)
        self.loss_scaler = LossScaler(config.loss_scale) if config.precision == "fp16" else None
        self.cycle = StepCycle(config, reducer=self.reducer, optimizer=self.optimizer, comm=self.comm,
                               loss_scaler=self.loss_scaler, params=self.params)
        self.passes = Passes(self.params, self.prefetcher, self.hooks, self.cycle)
        self._forward_contexts: contextlib.ExitStack | None = None  # while a forward of the whole model runs
        self._forward_start = 0.0  # when it began (perf_counter), for the step's compute seconds
        self.model_calls = ModelCallHooks(self, model)  # model.generate(...), model(...): forwards of the engine
        self.model_state = StateDictHooks(self, self.groups)  # model.state_dict(): whole values, never empty ones
        AdapterMergeHooks(self, model, self._by_param)  # peft's merge_and_unload(): with each layer whole
        if is_peft_model(model):
            AdapterSaveHook(self, model, self._by_param)  # peft's save_pretrained(): reads only what it writes
        self._trainable_set = TrainableSet(model, self._by_param)  # what each training forward may train
        self.meter = StepMeter(self.tiers, self.comm, self.copies, self.timeline, self.compute.staged,
                               optimizer_states_by_tier(self.optimizer), self.hooks.clock)
        if config.zero.offload_optimizer.splits:
            self.meter.metrics["optimizer_split"] = optimizer_split_metrics(self.optimizer_split, self.tiers)
        self._apply_lr_schedule()

    def _step_may_be_undone(self) -> bool:
        """Clipping or fp16 loss scaling can reject a step's speculative updates."""
        return self.config.gradient_clipping > 0 or self.config.precision == "fp16"

    # -- training ----------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """The model's own forward: its arguments (keyword or positional) and what it returns."""
        args, kwargs = self._open_forward(args, kwargs)
        try:
            output = self.module(*args, **kwargs)
        except BaseException:
            self._close_forward(failed=True)
            raise
        self._close_forward(failed=False)
        return output

    def generate(self, *args, **kwargs):
        """The model's own ``generate`` (a transformers model's, or peft's), each of its forwards one of the engine's.
        With several ranks every rank runs as many forwards as the longest (``synced_gpus``, as transformers asks
        under ZeRO-3): each forward gathers parameters from all of them."""
        self._ensure_open()
        if self.comm.world_size > 1:
            kwargs.setdefault("synced_gpus", True)
        return self.module.generate(*args, **kwargs)

    @property
    def forward_running(self) -> bool:
        """A forward of the whole model is running (the engine's, or a call of the model itself:
        :mod:`infinity.engine.model_calls`)."""
        return self._forward_contexts is not None

    def _open_forward(self, args, kwargs):
        """Begin a forward of the whole model: its pass, the step's updates behind it, the fetch-on-use and matmul
        modes. Returns the arguments on the compute device in the compute precision."""
        self._ensure_open()
        if self._transformers_forward:
            refuse_targets_as_mask(args)
        if torch.is_grad_enabled():
            self._trainable_set.refuse_changes()  # before the pass: nothing to undo
        args, kwargs = cast_floating((args, kwargs), self.dtype, self.device)
        self._forward_start = time.perf_counter()
        self.passes.begin()
        contexts = contextlib.ExitStack()
        try:
            if torch.is_grad_enabled() and self.cycle.next_is_boundary:
                self._begin_overlapped_step()  # from the forward on, so optimizer states can be read ahead
            contexts.enter_context(fetch_on_use(self._by_param, self.hooks, self.root_group,
                                                updates_behind=self.optimizer.tail is not None))
            contexts.enter_context(self._matmul_mode())
            contexts.enter_context(self.timeline.span("compute", "forward"))
        except BaseException:
            contexts.close()
            self.passes.end(completed=False)
            raise
        self._forward_contexts = contexts
        return args, kwargs

    def _close_forward(self, *, failed: bool) -> None:
        """End the forward :meth:`_open_forward` began; its pass ends too where no backward follows (it raised, or
        it ran without grad)."""
        contexts, self._forward_contexts = self._forward_contexts, None
        contexts.close()
        if failed or not torch.is_grad_enabled():
            self.passes.end(completed=not failed)
        if not failed:
            self.meter.add_compute(time.perf_counter() - self._forward_start)

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        """Back-propagate ``loss`` divided by ``gradient_accumulation_steps`` (``scale_wrt_gas=False``: as it is,
        for a loss already normalized over the whole accumulated batch, as DeepSpeed's engine takes it)."""
        self._ensure_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("backward() takes the scalar loss returned by the model's forward")
        if not loss.requires_grad:
            raise ValueError("the loss does not require grad: was the forward run under torch.no_grad() or eval?")
        scale = 1.0 / self.config.gradient_accumulation_steps if scale_wrt_gas else 1.0
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.scale
        start = time.perf_counter()
        if self.cycle.next_is_boundary:
            self._begin_overlapped_step()
        self.passes.begin_backward()
        begun = completed = False
        try:
            self.cycle.begin_backward()  # refuses (changing nothing) a second backward of the step's last micro-batch
            begun = True
            with self._matmul_mode(), self.timeline.span("compute", "backward"):
                (loss.float() * scale).backward()
            completed = True
        except BaseException as err:
            if begun:
                self.cycle.abort_backward(err)
            raise
        finally:
            self.passes.end(completed=completed)
        self.meter.add_compute(time.perf_counter() - start)
        self.cycle.end_backward()

    def _begin_overlapped_step(self) -> None:
        """With ``overlap_step_with_backward``, the coming step runs during its last backward."""
        if self.overlap_step:
            self.cycle.begin_overlapped_step(self._step_check())

    def _step_check(self) -> StepCheck:
        """What the coming step's speculative updates assume: nothing clips and nothing overflows. A step that
        follows one which clipped or overflowed likely does too, and waits for the norm instead."""
        unscale = 1.0 / self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        return StepCheck(grad_coef=unscale, max_norm=self.config.gradient_clipping,
                         speculate=not self.cycle.last_step_rejected)

    def _cancel_unused_overlap(self) -> None:
        self.cycle.cancel_unused_overlap()

    @property
    def step_in_progress(self) -> bool:
        """True from the forward of a boundary micro-batch (or its backward) until ``step()``."""
        return self.cycle.in_progress

    @property
    def backward_pending(self) -> bool:
        """True between ``backward()`` and its ``step()`` (no checkpoint may be taken then)."""
        return self.cycle.backward_pending

    @property
    def micro_step(self) -> int:
        return self.cycle.micro_step

    @micro_step.setter
    def micro_step(self, value: int) -> None:  # a checkpoint restores it
        self.cycle.micro_step = value

    @property
    def global_step(self) -> int:
        return self.cycle.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:  # a checkpoint restores it
        self.cycle.global_step = value

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.cycle.at_boundary

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's name: with ``True``, the coming micro-batch (call it before its forward) ends the step
        although fewer than ``gradient_accumulation_steps`` ran (an epoch's last, short accumulation); ``False``
        leaves the count to decide. Its loss is scaled as the caller scales it (``backward(scale_wrt_gas=...)``)."""
        self.cycle.force_boundary(is_boundary)

    def step(self) -> None:
        """Apply the optimizer at accumulation boundaries; a no-op between them."""
        self._ensure_open()
        skipped = self.cycle.step(self.meter.metrics)
        if skipped is None:
            return
        self.meter.close_step(step=self.global_step, skipped=skipped, lr=self.lr,
                              loss_scale=self.loss_scaler.scale if self.loss_scaler else None)
        self._apply_lr_schedule()
        if self.device.type == "cpu":  # the step's freed activations, kept by glibc in pieces: back to the system
            give_back_freed_heap()

    def finish_step(self) -> None:
        """Wait until the last step's updates are all made. With ``overlap_step_with_forward`` those a step makes
        after the norm is known finish behind the next forward, which waits for each parameter's own; everything
        else of ours waits for them too. Call this before reading parameters outside the engine's forward."""
        self._ensure_open()
        self.cycle.land_tail()

    def _apply_lr_schedule(self) -> None:
        """With a DeepSpeed ``scheduler`` block, the learning rate of the next step (set before its forward)."""
        if self.config.scheduler is not None:
            self.optimizer.lr = self.config.scheduler.lr_at(self.global_step, self.config.optimizer.lr)

    # -- what users read and set ---------------------------------------------
    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        if not isinstance(value, (int, float)) or value < 0 or math.isnan(value):
            raise ValueError(f"lr must be a non-negative number, got {value!r}")
        if self.cycle.updates_started and float(value) != self.optimizer.lr:
            raise RuntimeError(
                f"engine.lr was set after backward() of the step's last micro-batch, but with "
                f"overlap_step_with_backward the update already ran during backward with lr={self.optimizer.lr:g}; "
                f"set the learning rate before that micro-batch's forward (or turn overlap_step_with_backward off)")
        self.optimizer.lr = float(value)

    def set_lr(self, value: float) -> None:
        self.lr = value

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping, unscaled) of the last optimizer step, as DeepSpeed's
        engine names it; None before the first step and after a skipped fp16 step (an overlapped step takes
        it too, from the sub-groups' norms as backward finished them)."""
        return self.cycle.global_grad_norm

    def step_metrics(self) -> dict:
        """Bytes, seconds and peaks of the last optimizer step (since the step before it)."""
        return dict(self.meter.metrics)

    @property
    def _last_counters(self) -> dict:
        """The counters at the last step's end (tests read the writes that finished after it)."""
        return self.meter.last_counters

    # -- teardown ----------------------------------------------------------------
    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")

    def close(self) -> None:
        """Remove swap files and free every tier. Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors = []
        built = self.__dict__  # a constructor that failed part-way made only the first parts (see __init__)

        def verb_of(part: str, verb: str):
            return getattr(built[part], verb) if part in built else None

        for close_part in (verb_of("model_calls", "remove"), verb_of("model_state", "remove"),
                           verb_of("hooks", "remove"), verb_of("cycle", "abandon_overlap"),
                           verb_of("optimizer", "drop_tail"), self.copies.close, self._write_timeline,
                           verb_of("optimizer", "close"), verb_of("reducer", "close"), verb_of("compute", "close"),
                           verb_of("full_blocks", "close"), self.tiers.close, self.frozen.close):
            if close_part is None:
                continue  # never built
            try:
                close_part()
            except Exception as err:  # every part is closed (swap files removed) whatever failed before it
                errors.append(err)
        for save_dir in self._save_dirs:
            release_save_dir(save_dir)  # another run may save there from now on
        if errors:
            raise errors[0]

    def _write_timeline(self) -> None:
        path = self.timeline.write()
        if path:
            logger.info("timeline written to %s (open it in Perfetto or chrome://tracing)", path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the stores clean up after themselves
            pass
