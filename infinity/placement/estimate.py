"""Bytes per rank in each tier for a model size and an offload setting.

Like DeepSpeed's ``estimate_zero3_model_states_mem_needs_*``, but covering the
host buffers and NVMe too. It follows the engine's layout (``infinity.placement.layout``,
``compute_shards``, ``offload_optimizer``, ``sharded_param``):

* every parameter is flattened and padded to a multiple of ``world_size``;
  a rank keeps ``ceil(numel / world_size)`` elements of it (its *shard*),
  and each shard starts at a multiple of ``ALIGN_NUMEL`` elements;
* the **compute shard** (2 bytes/element in bf16/fp16, 4 in fp32) rests in the
  ``offload_param`` tier (none -> device, cpu -> host, nvme -> nvme; with nvme
  the first ``max_in_cpu`` elements stay in host memory, and so do the
  persistent parameters' shards, packed);
* the **master** and the Adam **moments** ``exp_avg`` + ``exp_avg_sq`` rest in
  the ``offload_optimizer`` tier, in the form ``state_dtype`` says: fp32 (4 B
  + 8 B), bf16 (2 B + 4 B) or int8 (a bf16 master, 2 B, + one byte a moment
  and an fp32 scale per block of 256: ~2.03 B);
* the **gradient** shard rests in host memory when the optimizer is offloaded
  (cpu or nvme), on the device otherwise; in compute precision with one
  micro-batch per step (bf16/fp32), in fp32 when it accumulates over several
  or when fp16 gradients are unscaled;
* **gathered** full parameters (compute bytes, padded) live on the device:
  the persistent ones (at most ``param_persistence_threshold`` elements each)
  always, plus the largest layer being used; with params on NVMe the
  prefetcher also keeps up to ``max(prefetch_bucket_size, max_reuse_distance / 2)``
  elements gathered (ahead of need, or until their reuse in the backward: the
  last ``max_reuse_distance / 2`` elements of the forward; between two
  micro-batches of one step, its first), within
  ``max_live_parameters``. With one rank and the compute shard on the device,
  the shard *is* the full tensor: nothing is gathered;
* with a GPU (``gpu``: device memory apart from host memory) the compute
  shards in host memory cross up at every fetch, so the prefetcher keeps them
  gathered as it does NVMe ones; the optimizer's gradients accumulate over
  micro-batches in an fp32 **device** buffer (the engine's default where it
  fits) and are fp32 for an optimizer on the device (torch's fused AdamW);
  new compute shards that cross between memories go through one sub-group of
  **scratch** in the optimizer's memory (and a host one for NVMe);
* with params on NVMe and a GPU, host **I/O buffers** (compute bytes) stage the
  reads: the largest shard plus ``prefetch_bucket_size`` elements in flight,
  within the pool's budget of ``buffer_count x buffer_size`` elements (on a
  CPU-only machine shards land in place: no buffers);
* with the optimizer on NVMe, host **staging** holds ``offload_optimizer.buffer_count``
  sets (at least two; one without pipelining) of one sub-group's master, both
  moments (12 B in fp32) and new compute shard; with the compute shard on NVMe but the optimizer in memory, one
  sub-group of compute bytes of scratch;
* **activations** (device, only when the model's shape is known): what
  autograd keeps for one micro-batch (with activation checkpointing, the
  blocks' inputs and one block's). The engine's tier accounting does not see
  them: ``accounted`` leaves them out.

"device" is reported as its own tier even where there is no accelerator (it
is then CPU memory too). All numbers are bytes per rank. The plan within a
host-memory budget is :mod:`infinity.placement.estimate_budget`'s; the estimate
of our GPT (its activations among them) is :mod:`infinity.placement.estimate_gpt`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import product

from infinity.config.schema import InfinityConfig
from infinity.config.tier_names import OFFLOAD_DEVICES as OFFLOAD_CHOICES, TIER_OF_OFFLOAD, TIERS
from infinity.kernels.compact import checkpoint_bytes_per_element
from infinity.models.gpt import gpt_like_largest_layer
from infinity.placement.estimate_budget import add_step_undo, plan_within_budget
from infinity.placement.estimate_grad_spill import plan_grad_spill, sub_group_numel, sub_group_shards
from infinity.placement.host_budget import (gathered_nbytes, kept_free_nbytes, resolve_host_budget,
                                            staged_sub_group_numel, state_bytes_per_numel, state_nbytes,
                                            working_set)
from infinity.placement.layout import ALIGN_NUMEL, decay_order, packed_offsets
from infinity.placement.split_choice import StepShape, apply_optimizer_split

__all__ = [
    "TIERS",
    "OFFLOAD_CHOICES",
    "COMPUTE_BYTES",
    "estimate",
    "estimate_for_config",
    "estimate_settings",
    "alternatives",
]

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
KINDS = (
    "compute_shard",
    "gathered_params",
    "gradients",
    "master",
    "moments",
    "param_io_buffers",
    "optimizer_staging",
    "step_undo",
    "activations",
)


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def estimate(
    num_params: int | None = None,
    *,
    world_size: int = 1,
    offload_param: str = "none",
    offload_optimizer: str = "none",
    precision: str = "bf16",
    param_numels: Sequence[int] | None = None,
    largest_layer_params: int | None = None,
    max_live_parameters: float = 1e9,
    prefetch_bucket_size: float = 5e7,
    max_reuse_distance: float = 1e9,
    param_persistence_threshold: float = 1e5,
    sub_group_size: float = 1e8,
    buffer_count: int = 5,
    buffer_size: float = 1e8,
    max_in_cpu: float = 1e9,
    pipeline: bool = True,
    optimizer_buffer_count: int = 4,
    gradient_accumulation_steps: int = 1,
    gpu: bool = True,
    activation_nbytes: int = 0,
    host_memory_budget: int | None = None,
    optimizer_max_in_cpu: int | None = None,
    overlap_step: bool = False,
    step_undo: bool = False,
    state_dtype: str = "fp32",
    trainable_params: int | None = None,
    param_decays: Sequence[float | None] | None = None,
    param_trainable: Sequence[bool] | None = None,
) -> dict:
    """Bytes per rank in each tier, by kind of state.

    Give either ``num_params`` or ``param_numels`` (each parameter's numel, in
    the model's order: padding, alignment, persistence and sub-groups exact).
    With only ``num_params`` the model is taken as one tensor per
    ``largest_layer_params`` and nothing persists. ``largest_layer_params``
    defaults to the largest of ``param_numels``, or to the MLP matrix of a GPT
    of that size (:func:`~infinity.models.gpt.gpt_like_largest_layer`). Returns ``{"setting": {...},
    "shard_numel": int, "tiers": {tier: {kind: bytes}}, "totals": {tier: bytes},
    "accounted": {tier: bytes}}`` (``accounted``: without activations).

    With ``host_memory_budget`` (bytes) the engine's plan within it is followed: NVMe staging capped by the
    budget, compute shards and then optimizer sub-groups configured for NVMe kept in host memory while they
    fit (``optimizer_max_in_cpu`` elements at most), the step's first reads first (``overlap_step``: the last
    sub-groups). Without it, ``nvme`` means NVMe. ``state_dtype``: the optimizer states' form (fp32, bf16,
    int8; ``zero_optimization.offload_optimizer.state_dtype``).

    ``trainable_params``: how many of the parameters train (e.g. LoRA adapters on a frozen base; default
    all): only they have a gradient, a master and moments, and only they are staged for the optimizer.

    ``param_decays``: each parameter's weight decay where param groups give them their own (``infinity train``'s
    groups), in ``param_numels``' order: the layout lays each decay's parameters together and cuts a sub-group
    where the decay changes (:func:`~infinity.placement.layout.decay_order`), and so does the estimate.

    ``param_trainable``: whether each parameter trains, in ``param_numels``' order: the frozen ones (a LoRA
    base) are laid out after every trainable one, as the layout lays them, and the trainable part of the flat
    space and its sub-groups are then exact (``trainable_params`` is their count).

    ``step_undo``: the step overlaps backward and may be undone (clipping or fp16): swapped optimizer states
    take a second extent on NVMe, and in-memory ones an undo copy where the budget leaves room for it.
    """
    _check_choice("offload_param", offload_param, OFFLOAD_CHOICES)
    _check_choice("offload_optimizer", offload_optimizer, OFFLOAD_CHOICES)
    _check_choice("precision", precision, tuple(COMPUTE_BYTES))
    _check_choice("state_dtype", state_dtype, ("fp32", "bf16", "int8"))
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    sub_group_size, max_in_cpu = int(sub_group_size), int(max_in_cpu)
    sets = max(2, int(optimizer_buffer_count)) if pipeline else 1
    exact_part = None  # (trainable elements, their sub-groups, the largest) when param_trainable marks frozen ones
    if param_numels is not None:
        numels = [int(n) for n in param_numels]
        decays = None
        for name, given in (("param_decays", param_decays), ("param_trainable", param_trainable)):
            if given is not None and len(given) != len(numels):
                raise ValueError(f"{name} has {len(given)} entries for {len(numels)} param_numels")
        trains = [True] * len(numels) if param_trainable is None else [bool(t) for t in param_trainable]
        trained = sum(trains)
        if param_decays is not None or trained < len(numels):
            # the trainable parameters first (each decay's together), the frozen ones after, as the layout lays them
            kept = [i for i, t in enumerate(trains) if t]
            of_kept = [None] * len(kept) if param_decays is None else [param_decays[i] for i in kept]
            order = [kept[j] for j in decay_order(of_kept, [numels[i] for i in kept])]
            order += [i for i, t in enumerate(trains) if not t]
            if param_decays is not None:
                decays = [param_decays[i] for i in order[:trained]]
            numels = [numels[i] for i in order]
        num_params = sum(numels)
        shards = [math.ceil(n / world_size) for n in numels]
        if host_memory_budget is not None and offload_optimizer == "nvme":
            sub_group_size = staged_sub_group_numel(sub_group_size, largest_shard_numel=max(shards, default=0),
                                                    budget_nbytes=host_memory_budget, sets=sets,
                                                    bytes_per_numel=state_bytes_per_numel(state_dtype) + COMPUTE_BYTES[precision])
        shard_numel = sum(shards)
        flat_numel = sum(_round_up(n, ALIGN_NUMEL) for n in shards)  # the rank's aligned flat space
        largest = max(numels, default=0)
        persistent_numel = sum(s * world_size for n, s in zip(numels, shards) if n <= param_persistence_threshold)
        # fetched and released every pass: with one rank and the shards on the device each is its full tensor
        released = (0 if world_size == 1 and offload_param == "none"
                    else sum(1 for n in numels if n > param_persistence_threshold))
        shard_groups = sub_group_shards(shards[:trained], sub_group_size, decays)
        sub_groups = [sub_group_numel(group) for group in shard_groups]
        largest_sub_group = max(sub_groups, default=0)
        if trained < len(numels):  # exact: the trainable part of the flat space, and its sub-groups
            trainable_params, exact_part = sum(numels[:trained]), (sum(sub_groups), sub_groups, largest_sub_group)
        host_cached, cached_count = _prefix_within(shards, max_in_cpu)
        # persistent shards past the cache rest in host memory too, packed (infinity.params.compute_shards)
        persistent_left = [s for i, (n, s) in enumerate(zip(numels, shards))
                           if i >= cached_count and n <= param_persistence_threshold]
        persistent_host = packed_offsets(persistent_left)[1]
        persistent_off_nvme = sum(_round_up(s, ALIGN_NUMEL) for s in persistent_left)
        persistent_all = packed_offsets([s for n, s in zip(numels, shards) if n <= param_persistence_threshold])[1]
    elif num_params is not None:
        num_params = int(num_params)
        shard_numel = flat_numel = math.ceil(num_params / world_size)
        largest = gpt_like_largest_layer(num_params)
        persistent_numel = 0
        released = None  # tensors unknown: the step-time model counts no host-side work for them
        largest_sub_group = min(sub_group_size, flat_numel)
        sub_groups = [largest_sub_group] * (flat_numel // largest_sub_group) + (
            [flat_numel % largest_sub_group] if largest_sub_group and flat_numel % largest_sub_group else [])
        host_cached = min(max_in_cpu, flat_numel)
        persistent_host = persistent_off_nvme = persistent_all = 0
        shard_groups = None
    else:
        raise ValueError("give num_params or param_numels")
    if num_params <= 0:
        raise ValueError(f"the model must have parameters, got {num_params}")
    if largest_layer_params is not None:
        largest = int(largest_layer_params)

    if exact_part is not None:
        trained_shard = sum(shards[:trained])  # (the trainable parameters come first)
    else:
        trained_shard = shard_numel if trainable_params is None else min(shard_numel,
                                                                          math.ceil(trainable_params / world_size))
    if exact_part is not None:
        train_numel, sub_groups, largest_sub_group = exact_part
    else:
        train_numel, sub_groups, largest_sub_group = _trainable_part(trainable_params, num_params, world_size,
                                                                     flat_numel, sub_groups, largest_sub_group)
    cbytes = COMPUTE_BYTES[precision]
    tiers: dict[str, dict[str, int]] = {t: dict.fromkeys(KINDS, 0) for t in TIERS}
    param_tier = TIER_OF_OFFLOAD[offload_param]
    optim_tier = TIER_OF_OFFLOAD[offload_optimizer]
    optim_memory = "host" if offload_optimizer != "none" else "device"

    if offload_param == "nvme":
        tiers["host"]["compute_shard"] += (host_cached + persistent_host) * cbytes
        tiers["nvme"]["compute_shard"] += (flat_numel - host_cached - persistent_off_nvme) * cbytes
    else:
        tiers[param_tier]["compute_shard"] += flat_numel * cbytes
    master_bytes = 4 if state_dtype == "fp32" else 2
    tiers[optim_tier]["master"] += train_numel * master_bytes
    tiers[optim_tier]["moments"] += state_nbytes(state_dtype, train_numel) - train_numel * master_bytes
    # gradients stay in compute precision when nothing accumulates in them (one micro-batch a step, no fp16
    # unscaling); else fp32
    lossless = gradient_accumulation_steps == 1 and precision != "fp16" and not (gpu and offload_optimizer == "none")
    gbytes = cbytes if lossless else 4
    tiers[optim_memory]["gradients"] += train_numel * gbytes
    if gpu and offload_optimizer != "none" and gradient_accumulation_steps > 1:
        tiers["device"]["gradients"] += train_numel * 4  # the fp32 accumulator; one copy down per step
    swapped_in = offload_param == "nvme" and host_cached < flat_numel  # fetches start with an NVMe read
    crosses_up = swapped_in or (gpu and offload_param != "none")       # fetches start with a read or a copy
    prefetching = crosses_up and (prefetch_bucket_size > 0 or max_reuse_distance > 0)
    if not (world_size == 1 and offload_param == "none"):
        padded_largest = math.ceil(largest / world_size) * world_size
        rest = max(0, num_params - persistent_numel)
        # The prefetcher keeps parameters gathered ahead of need and for reuse, within max_live_parameters.
        # A parameter's reuse distance is twice the elements used after it in the forward (the rest of
        # the forward, then the backward back to it): the last max_reuse_distance / 2 elements stay.
        kept = max(int(prefetch_bucket_size), int(max_reuse_distance) // 2)
        ahead = min(kept, int(max_live_parameters)) if prefetching else 0
        fetched = min(rest, padded_largest + ahead)
        tiers["device"]["gathered_params"] += (persistent_numel + fetched) * cbytes
    if swapped_in and gpu:
        # reads in flight: the largest shard plus the prefetched ones, within the pool's budget
        per_buffer = max(int(buffer_size), math.ceil(largest / world_size))
        ahead = min(int(prefetch_bucket_size), int(max_live_parameters)) if prefetching else 0
        in_flight = math.ceil((largest + ahead) / world_size)
        tiers["host"]["param_io_buffers"] += min(buffer_count * per_buffer, in_flight, flat_numel) * cbytes
    if offload_optimizer == "nvme":
        tiers["host"]["optimizer_staging"] += sets * (state_nbytes(state_dtype, largest_sub_group) + largest_sub_group * cbytes)
    elif offload_param == "nvme" and host_cached < flat_numel:
        tiers["host"]["optimizer_staging"] += largest_sub_group * cbytes
    elif gpu and offload_param == "none" and offload_optimizer == "cpu":
        tiers["host"]["optimizer_staging"] += largest_sub_group * cbytes  # new compute shards, pinned, on their way up
    if gpu and offload_optimizer == "none" and offload_param != "none":
        tiers["device"]["optimizer_staging"] += largest_sub_group * cbytes  # new compute shards on their way down
    tiers["device"]["activations"] += int(activation_nbytes)
    keepable = len(sub_groups)
    largest_shard = math.ceil(largest / world_size)
    # the engine's minimum working set and the reserve it keeps free beside it (infinity.placement.host_budget):
    # slices, shards, two staging sets, the gathered parameters where the device is the host (none where each
    # shard is its full tensor), streaming buffers; kept free: the gathered parameters, streaming, a scratch sub-group
    min_shards = {"cpu": flat_numel, "nvme": persistent_all, "none": 0 if gpu else flat_numel}[offload_param]
    gathered = 0 if gpu or (world_size == 1 and offload_param == "none") else gathered_nbytes(
        persistent_numel, largest_shard * world_size, cbytes)
    floor = working_set((("gradient slices", train_numel * gbytes), ("compute shards", min_shards * cbytes)),
                        staging_sets=2, largest_sub_group_numel=largest_sub_group, largest_shard_numel=largest_shard,
                        state_dtype=state_dtype, itemsize=cbytes, gathered=gathered)
    reserve = kept_free_nbytes(floor, scratch_nbytes=largest_sub_group * cbytes)
    if host_memory_budget is not None and offload_optimizer == "nvme":
        minimum = floor.nbytes + reserve
        groups = (shard_groups if shard_groups is not None and (trainable_params is None or exact_part is not None)
                  else [[n] for n in sub_groups])
        spill = plan_grad_spill(minimum, host_memory_budget, groups=groups, grad_itemsize=gbytes,
                                accumulates=not lossless, staging_sets=sets)
        if spill.first_group is not None:
            tiers["host"]["gradients"] -= spill.host_nbytes
            tiers["nvme"]["gradients"] += spill.nvme_nbytes
            tiers["host"]["optimizer_staging"] += spill.staging_nbytes
            keepable = spill.first_group  # sub-groups whose states the budget may keep in host memory
    if host_memory_budget is not None:
        plan_within_budget(tiers, host_memory_budget, gpu=gpu, reserve=reserve, cbytes=cbytes, sub_groups=sub_groups,
                            offload_param=offload_param, offload_optimizer=offload_optimizer,
                            optimizer_max_in_cpu=optimizer_max_in_cpu, overlap_step=overlap_step,
                            state_dtype=state_dtype, keepable=keepable)

    if step_undo:
        add_step_undo(tiers, host_memory_budget, gpu=gpu, reserve=reserve, optim_memory=optim_memory)

    totals = {t: sum(kinds.values()) for t, kinds in tiers.items()}
    accounted = dict(totals, device=totals["device"] - tiers["device"]["activations"])
    return {
        "setting": {
            "num_params": num_params,
            "world_size": world_size,
            "offload_param": offload_param,
            "offload_optimizer": offload_optimizer,
            "precision": precision,
            "largest_layer_params": largest,
            "max_live_parameters": int(max_live_parameters),
            "prefetch_bucket_size": int(prefetch_bucket_size),
            "max_reuse_distance": int(max_reuse_distance),
            "param_persistence_threshold": int(param_persistence_threshold),
            "sub_group_size": sub_group_size,
            "buffer_count": buffer_count,
            "optimizer_staging_sets": sets if offload_optimizer == "nvme" else 0,
            "buffer_size": int(buffer_size),
            "max_in_cpu": max_in_cpu,
            "pipeline": pipeline,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "gpu": gpu,
            "host_memory_budget": host_memory_budget,
            "state_dtype": state_dtype,
            "trainable_params": num_params if trainable_params is None else int(trainable_params),
            "released_tensors": released,
        },
        "shard_numel": shard_numel,
        "largest_sub_group_numel": largest_sub_group,
        "gathered_nbytes": gathered,
        "sub_group_numels": list(sub_groups),
        "tiers": tiers,
        "totals": totals,
        "accounted": accounted,
        # What save_checkpoint writes per rank: master and moments (each in the narrowest exact dtype) for the
        # trainable elements of the rank's shards, and the compute shard of every one; the frozen ones' compute
        # shards apart (exclude_frozen_parameters leaves them out).
        "checkpoint_nbytes": trained_shard * checkpoint_bytes_per_element(state_dtype) + shard_numel * cbytes,
        "checkpoint_frozen_nbytes": (shard_numel - trained_shard) * cbytes,
    }


def estimate_settings(config: InfinityConfig, *, world_size: int = 1, gpu: bool) -> dict:
    """:func:`estimate`'s keywords for the engine's ``config`` (all but the model's size): every setting the
    engine reserves by is read from it, so the figures are what ``initialize`` will reserve. A split optimizer
    (``offload_optimizer.device: auto`` or a ``ratio``) is set as offloaded here; :func:`estimate_for_config`
    then moves its device sub-groups to the device.

    The host-memory budget is resolved as the engine resolves it (:func:`resolve_host_budget`: a fraction of the
    memory available now unless the config gives bytes); the undo extents of a speculative step are counted when
    the step overlaps the backward and may be undone (gradient clipping or fp16 loss scaling), as
    :mod:`infinity.optim.overlapped_step` reserves them. ``gpu``: device memory apart from host memory."""
    config = config.for_world_size(world_size)  # DeepSpeed's batch-size arithmetic, as initialize does it
    zero = config.zero
    offload = zero.offload_optimizer
    return dict(
        world_size=world_size,
        offload_param=zero.offload_param.device.value,
        offload_optimizer={"device": "none", "host": "cpu", "nvme": "nvme"}[offload.offloaded_tier],
        precision=config.precision,
        max_live_parameters=zero.max_live_parameters,
        prefetch_bucket_size=zero.prefetch_bucket_size,
        max_reuse_distance=zero.max_reuse_distance,
        param_persistence_threshold=zero.param_persistence_threshold,
        sub_group_size=zero.sub_group_size,
        buffer_count=zero.offload_param.buffer_count,
        buffer_size=zero.offload_param.buffer_size,
        max_in_cpu=zero.offload_param.max_in_cpu,
        pipeline=offload.pipeline_read or offload.pipeline_write,
        optimizer_buffer_count=offload.buffer_count,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        gpu=gpu,
        host_memory_budget=resolve_host_budget(zero.host_memory_budget),
        optimizer_max_in_cpu=offload.max_in_cpu,
        overlap_step=zero.overlap_step_with_backward,
        step_undo=zero.overlap_step_with_backward and (config.gradient_clipping > 0 or config.precision == "fp16"),
        state_dtype=offload.state_dtype,
    )


def estimate_for_config(config: InfinityConfig, *, param_numels: Sequence[int] | None = None,
                        num_params: int | None = None, largest_layer_params: int | None = None, world_size: int = 1,
                        gpu: bool, activation_nbytes: int = 0, trainable_params: int | None = None,
                        step_shape: StepShape | None = None,
                        param_decays: Sequence[float | None] | None = None,
                        param_trainable: Sequence[bool] | None = None) -> dict:
    """:func:`estimate` for the engine's ``config`` (:func:`estimate_settings`; a split optimizer's device
    sub-groups then moved to the device, ``auto``'s count chosen by the step-time model for ``step_shape``):
    ``infinity train``, ``infinity estimate`` and the engine's ``initialize`` all come here."""
    est = estimate(num_params, param_numels=param_numels, largest_layer_params=largest_layer_params,
                   activation_nbytes=activation_nbytes, trainable_params=trainable_params, param_decays=param_decays,
                   param_trainable=param_trainable, **estimate_settings(config, world_size=world_size, gpu=gpu))
    return apply_optimizer_split(est, config, shape=step_shape) if config.zero.offload_optimizer.splits else est


def _trainable_part(trainable_params: int | None, num_params: int, world_size: int, flat_numel: int,
                    sub_groups: list[int], largest_sub_group: int) -> tuple[int, list[int], int]:
    """The rank's trainable elements and the optimizer's sub-groups over them: all of them by default; with
    ``trainable_params`` (a frozen base) only as many as train, the sub-groups cut down to cover them."""
    if trainable_params is None:
        return flat_numel, sub_groups, largest_sub_group
    if not 0 <= trainable_params <= num_params:
        raise ValueError(f"trainable_params must be in 0..{num_params} (the model's parameters), got {trainable_params}")
    train_numel = min(flat_numel, math.ceil(trainable_params / world_size))
    cut, left = [], train_numel
    for numel in sub_groups:
        if left <= 0:
            break
        cut.append(min(numel, left))
        left -= cut[-1]
    return train_numel, cut, max(cut, default=0)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _sub_group_numels(shards: Sequence[int], sub_group_size: int) -> list[int]:
    """Runs of whole aligned shards of at most ``sub_group_size`` elements (one shard alone may exceed it)."""
    return [sub_group_numel(group) for group in sub_group_shards(shards, sub_group_size)]


def _largest_sub_group(shards: Sequence[int], sub_group_size: int) -> int:
    """Largest run of whole aligned shards of at most ``sub_group_size`` elements (one shard alone may exceed it)."""
    return max(_sub_group_numels(shards, sub_group_size), default=0)


def _prefix_within(shards: Sequence[int], limit: int) -> tuple[int, int]:
    """Aligned elements of the leading shards whose shards total at most ``limit`` (``offload_param.max_in_cpu``),
    and how many shards they are."""
    total, offset, count = 0, 0, 0
    for n in shards:
        if total + n > limit:
            break
        total += n
        offset = _round_up(offset, ALIGN_NUMEL) + n
        count += 1
    return offset, count


def alternatives(estimate_fn, **kwargs) -> list[dict]:
    """``estimate_fn(**kwargs)`` for every (offload_param, offload_optimizer) pair."""
    out = []
    for op, oo in product(OFFLOAD_CHOICES, OFFLOAD_CHOICES):
        out.append(estimate_fn(**{**kwargs, "offload_param": op, "offload_optimizer": oo}))
    return out
