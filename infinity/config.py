"""Configuration: frozen, typed dataclasses, and the one translation from a
DeepSpeed-style JSON config.

A user's existing DeepSpeed config works unchanged. Every key is one of:

* honoured: translated into a field below;
* not applicable: a DeepSpeed key with no meaning here (logging cadence, knobs
  of mechanisms we do differently); accepted and listed once in the log;
* rejected: a key DeepSpeed itself would not know (a typo) or a value we cannot
  honour; a ``ValueError`` names it.

Nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from infinity.lr_schedule import DeepSpeedScheduler, scheduler_from_deepspeed
from infinity.tier_names import OFFLOAD_DEVICES, OffloadDevice

logger = logging.getLogger(__name__)

StateDtype = Literal["fp32", "bf16", "int8"]
STATE_DTYPES = ("fp32", "bf16", "int8")
"""Forms of the optimizer states (``infinity.kernels.compact``): 12, 6 and ~4.03 bytes an element."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AioConfig:
    """How the storage engine talks to NVMe (the top-level ``aio`` block)."""

    block_size: int = 1 << 20
    """Bytes per I/O request; a transfer is split into blocks of this size."""
    queue_depth: int = 32
    """Requests kept in flight per transfer."""
    thread_count: int = 1
    """Threads of the ``threads`` backend (DeepSpeed: ``intra_op_parallelism`` / ``thread_count``)."""
    single_submit: bool = False
    """Submit requests one at a time instead of in batches."""
    overlap_events: bool = True
    """Submit new requests while reaping completions."""
    backend: Literal["auto", "libaio", "threads"] = "auto"
    """``auto`` takes libaio when the system library works, else threads."""
    buffered_fallback: bool = False
    """Where the swap folder does not take O_DIRECT (tmpfs, some network filesystems), use buffered I/O through the
    page cache (said in a warning) instead of refusing. ``infinity train --buffered-io`` sets it."""

    def __post_init__(self):
        _require_positive("aio.block_size", self.block_size)
        if self.block_size % 4096:
            raise ValueError(f"aio.block_size must be a multiple of 4096 bytes, got {self.block_size}")
        _require_positive("aio.queue_depth", self.queue_depth)
        _require_positive("aio.thread_count", self.thread_count)
        _require_choice("aio.backend", self.backend, ("auto", "libaio", "threads"))
        if not isinstance(self.buffered_fallback, bool):
            raise ValueError(f"config key aio.buffered_fallback must be true or false, got {self.buffered_fallback!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadParamConfig:
    """Where compute shards rest (``zero_optimization.offload_param``)."""

    device: OffloadDevice = OffloadDevice.NONE
    """``none``: device memory; ``cpu``: host memory; ``nvme``: files under ``nvme_path``."""
    nvme_path: str | None = None
    """Directory for the swap files; required when ``device`` is ``nvme``."""
    buffer_count: int = 5
    """Host buffers for NVMe reads of parameters; grown (and logged) if too few for the largest module."""
    buffer_size: int = 100_000_000
    """Elements per host buffer; grown (and logged) if smaller than the largest parameter shard."""
    max_in_cpu: int = 1_000_000_000
    """Shard elements that may stay in host memory when ``device`` is ``nvme``."""
    pin_memory: bool | None = None
    """Page-lock the host buffers that cross to the GPU (resting compute shards, NVMe read buffers), so their
    copies are asynchronous. None (the default): pin where there is a GPU. False is honoured (pageable, copies
    synchronous); True without a GPU is said once in the log."""

    def __post_init__(self):
        _require_offload_device("offload_param", self)
        _require_optional_bool("offload_param.pin_memory", self.pin_memory)
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("offload_param.device is 'nvme' but offload_param.nvme_path is not set")
        _require_positive("offload_param.buffer_count", self.buffer_count)
        _require_positive("offload_param.buffer_size", self.buffer_size)
        _require_non_negative("offload_param.max_in_cpu", self.max_in_cpu)


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadOptimizerConfig:
    """Where the fp32 master, the moments and the gradient slices rest (``zero_optimization.offload_optimizer``)."""

    device: OffloadDevice = OffloadDevice.NONE
    """As ``offload_param.device``."""
    nvme_path: str | None = None
    buffer_count: int = 4
    """Host buffers for swapping optimizer state; at least 2 (double buffering)."""
    pin_memory: bool | None = None
    """Page-lock the host buffers that cross to the GPU (gradient slices, new compute shards); as for
    ``offload_param.pin_memory``. Master and moments never cross and are never pinned."""
    grad_accumulation: Literal["device_if_fits", "device", "host"] = "device_if_fits"
    """Where gradient slices accumulate over micro-batches when the optimizer is off the device: ``device``
    (fp32, one copy down per step), ``host`` (each micro-batch's slice copied down and added by a worker off
    the backward hook), ``device_if_fits`` (the default): on the device when the fp32 accumulator takes at
    most a quarter of the device memory free at initialize."""
    max_in_cpu: int | None = None
    """With ``device: nvme``, optimizer-state elements that may rest in host memory (our key, after
    ``offload_param.max_in_cpu``): None (the default) keeps whatever fits the host-memory budget, so NVMe is a
    spill tier; 0 puts every sub-group on NVMe."""
    state_dtype: StateDtype = "fp32"
    """How master and moments are stored, in every tier (memory, NVMe swap files, staging): ``fp32`` (12 bytes an
    element); ``bf16`` (6: master and moments in bf16, master and second moment stochastically rounded);
    ``int8`` (~4.03: bf16 master, moments as 8-bit codes with an fp32 scale per block of 256). The step computes
    in fp32 either way (``infinity.kernels.compact``). Checkpoints hold fp32 states whatever this says, so one
    saved with one state dtype loads into another. DeepSpeed's ``bf16.bf16_optimizer_states: true`` means
    ``bf16``."""
    pipeline_read: bool = True
    """Read sub-group i+1 while sub-group i is updated."""
    pipeline_write: bool = True
    """Write sub-group i-1 while sub-group i is updated."""

    def __post_init__(self):
        _require_offload_device("offload_optimizer", self)
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("offload_optimizer.device is 'nvme' but offload_optimizer.nvme_path is not set")
        if isinstance(self.buffer_count, bool) or not isinstance(self.buffer_count, int) or self.buffer_count < 2:
            raise ValueError(f"config key offload_optimizer.buffer_count must be at least 2 (one buffer is updated while "
                             f"another is read or written), got {self.buffer_count!r}")
        _require_optional_bool("offload_optimizer.pin_memory", self.pin_memory)
        if self.max_in_cpu is not None:
            _require_non_negative("offload_optimizer.max_in_cpu", self.max_in_cpu)
        _require_choice("offload_optimizer.grad_accumulation", self.grad_accumulation,
                        ("device_if_fits", "device", "host"))
        _require_choice("zero_optimization.offload_optimizer.state_dtype", self.state_dtype, STATE_DTYPES)


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """ZeRO stage 3 partitioning and the offload engine (``zero_optimization``)."""

    stage: int = 3
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    sub_group_size: int = 100_000_000
    """Elements the optimizer updates per chunk (and swaps per NVMe transfer). DeepSpeed defaults to
    1e9; we take 1e8, the value its ZeRO-Infinity examples use: with the optimizer on NVMe the host
    stages ``offload_optimizer.buffer_count`` sub-groups of 14 bytes an element."""
    prefetch_bucket_size: int = 50_000_000
    """Elements swapped in ahead of need; 0 turns prefetching off."""
    param_persistence_threshold: int = 100_000
    """Parameters with at most this many elements stay gathered between uses."""
    max_live_parameters: int = 1_000_000_000
    """Gathered elements allowed at once, beyond the module running now."""
    max_reuse_distance: int = 1_000_000_000
    """A parameter used again within this many elements of fetches is kept gathered."""
    overlap_step_with_backward: bool = True
    """Update a shard as soon as its gradient is final, while backward goes on."""
    host_memory_budget: int | float | None = None
    """Host memory this rank's engine may use (our key): bytes, or a fraction of the memory available at start
    (shared by the ranks on the machine). None: 80 % of what is available. Every host allocation charges it;
    staging is sized from it; with NVMe configured, the states that fit stay in host memory."""

    def __post_init__(self):
        if self.stage != 3:
            raise ValueError(
                f"zero_optimization.stage must be 3 (this engine is ZeRO stage 3 with offload), got {self.stage!r}"
            )
        for name in ("sub_group_size", "max_live_parameters"):
            _require_positive(f"zero_optimization.{name}", getattr(self, name))
        for name in ("prefetch_bucket_size", "param_persistence_threshold", "max_reuse_distance"):
            _require_non_negative(f"zero_optimization.{name}", getattr(self, name))
        from infinity.host_budget import parse_host_memory
        object.__setattr__(self, "host_memory_budget", parse_host_memory(self.host_memory_budget))


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """Adam or AdamW (``optimizer``); the step runs on the CPU kernel."""

    type: Literal["Adam", "AdamW"] = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw: bool = True
    """Decoupled weight decay (AdamW). DeepSpeed's ``Adam`` is AdamW unless ``adam_w_mode`` is false."""
    bias_correction: bool = True

    def __post_init__(self):
        _require_choice("optimizer.type", self.type, ("Adam", "AdamW"))
        _require_non_negative("optimizer.params.lr", self.lr)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optimizer.params.betas must be two numbers in [0, 1), got {self.betas!r}")
        _require_positive("optimizer.params.eps", self.eps)
        _require_non_negative("optimizer.params.weight_decay", self.weight_decay)
        for name in ("lr", "eps", "weight_decay"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"config key optimizer.params.{name} must be a finite number, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScaleConfig:
    """fp16 dynamic loss scaling (the ``fp16`` block)."""

    loss_scale: float = 0.0
    """0 for dynamic scaling, else a static scale."""
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class TilingConfig:
    """Memory-centric tiling (our key ``tiling``)."""

    max_tile_numel: int | None = None
    """Linear and Embedding layers whose weight has more elements are split into tiles; None: no tiling."""

    def __post_init__(self):
        if self.max_tile_numel is not None:
            _require_positive("tiling.max_tile_numel", self.max_tile_numel)


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceConfig:
    """A Chrome trace of compute, I/O and collectives (our key ``trace``)."""

    path: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class InfinityConfig:
    """Everything the engine is told. Build it from a DeepSpeed-style dict with :meth:`from_deepspeed`."""

    micro_batch_size: int | None = None
    """``train_micro_batch_size_per_gpu``; informative (the engine does not batch data)."""
    train_batch_size: int | None = None
    """If given, must equal micro batch × accumulation steps × world size."""
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    tiling: TilingConfig = field(default_factory=TilingConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    device: str = "auto"
    """The compute device (our key ``device``): ``auto`` takes the current CUDA device when there is one (and
    the collectives can use it: not gloo with several ranks), else the CPU; or ``cpu``, ``cuda``, ``cuda:N``."""
    scheduler: DeepSpeedScheduler | None = None
    """A DeepSpeed ``scheduler`` block: the engine sets the learning rate of every step from it."""
    not_applicable: tuple[str, ...] = ()
    """DeepSpeed keys that were accepted but mean nothing here (logged once at initialize)."""

    def __post_init__(self):
        _require_positive("gradient_accumulation_steps", self.gradient_accumulation_steps)
        _require_non_negative("gradient_clipping", self.gradient_clipping)
        _require_choice("precision", self.precision, ("fp32", "bf16", "fp16"))
        if self.micro_batch_size is not None:
            _require_positive("train_micro_batch_size_per_gpu", self.micro_batch_size)
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu", "cuda")
                                                    or (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"config key device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    @classmethod
    def load(cls, config: "InfinityConfig | dict | str | os.PathLike | None") -> "InfinityConfig":
        """Accept an InfinityConfig, a DeepSpeed-style dict, or a path to such a JSON file."""
        if config is None:
            return cls()
        if isinstance(config, InfinityConfig):
            return config
        if isinstance(config, (str, os.PathLike)):
            return cls.from_json_file(config)
        if isinstance(config, dict):
            return cls.from_deepspeed(config)
        raise ValueError(f"config must be an InfinityConfig, a dict or a path to JSON, got {type(config).__name__}")

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "InfinityConfig":
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise OSError(f"config file {os.fspath(path)!r} does not exist") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"config file {os.fspath(path)!r} is not JSON: {err}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"config file {os.fspath(path)!r} must hold a JSON object, got {type(raw).__name__}")
        return cls.from_deepspeed(raw)

    @classmethod
    def from_deepspeed(cls, raw: dict) -> "InfinityConfig":
        """Translate a DeepSpeed-style config once, here at the edge."""
        return _DeepSpeedTranslator(raw).translate()

    def replace(self, **changes) -> "InfinityConfig":
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------
# The DeepSpeed translation.
#
# Each table maps a key to how it is handled: a field name (honoured), or
# NOT_APPLICABLE. A key in none of the tables is rejected as unknown.

NOT_APPLICABLE = object()

_TOP_LEVEL_NOT_APPLICABLE = {
    "steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients",
    "gradient_predivide_factor", "sparse_gradients", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "communication_data_type", "activation_checkpointing",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
    "memory_breakdown", "elasticity", "checkpoint", "data_types", "pipeline", "curriculum_learning",
    "data_efficiency", "compression_training", "autotuning", "sparse_attention", "timers", "nebula",
    "eigenvalue", "progressive_layer_drop", "quantize_training", "monitor_config", "disable_allgather",
    "dataloader_drop_last", "weight_quantization", "hybrid_engine", "compile", "amp",
    "seq_parallel_communication_data_type", "graph_harvesting", "use_data_before_expert_parallelism",
}
_ZERO_NOT_APPLICABLE = {
    "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
    "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint",
    "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "round_robin_gradients",
    "stage3_model_persistence_threshold", "model_persistence_threshold", "memory_efficient_linear",
    "pipeline_loading_checkpoint", "override_module_apply", "use_multi_rank_bucket_allreduce",
    "log_trace_cache_warnings", "use_all_reduce_for_fetch_params", "stage3_module_granularity_threshold",
    "module_granularity_threshold", "cpu_offload_use_pin_memory",
}
_ZERO_HONOURED = {
    "stage": "stage",
    "sub_group_size": "sub_group_size",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "max_reuse_distance": "max_reuse_distance",
    "overlap_step_with_backward": "overlap_step_with_backward",
    "host_memory_budget": "host_memory_budget",
}
# Keys whose only values we can honour are listed with that value.
_ZERO_ONLY_VALUE = {
    "zero_hpz_partition_size": 1, "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False, "mics_shard_size": -1, "mics_hierarchical_params_gather": False,
    "legacy_stage1": False, "cpu_offload": False, "cpu_offload_params": False, "zeropp_loco_param": None,
}
_OFFLOAD_PARAM_KEYS = {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"}
_OFFLOAD_OPTIMIZER_KEYS = {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                           "grad_accumulation", "max_in_cpu", "state_dtype"}
_OFFLOAD_OPTIMIZER_NOT_APPLICABLE = {"fast_init"}
_AIO_HONOURED = {
    "block_size": "block_size", "queue_depth": "queue_depth", "intra_op_parallelism": "thread_count",
    "thread_count": "thread_count", "single_submit": "single_submit", "overlap_events": "overlap_events",
    "backend": "backend", "buffered_fallback": "buffered_fallback",
}
_FP16_HONOURED = {
    "loss_scale": "loss_scale", "initial_scale_power": "initial_scale_power",
    "loss_scale_window": "loss_scale_window", "hysteresis": "hysteresis", "min_loss_scale": "min_loss_scale",
}
_FP16_NOT_APPLICABLE = {"auto_cast", "consecutive_hysteresis"}
# bf16_master_weights_and_grads: gradient slices follow the compute precision here (accepted, logged).
# bf16_optimizer_states: true is offload_optimizer.state_dtype "bf16" (see _DeepSpeedTranslator._precision).
_BF16_NOT_APPLICABLE = {"immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads"}
_ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction", "torch_adam", "fused", "amsgrad"}


class _DeepSpeedTranslator:
    """Walks a DeepSpeed-style dict once, recording not-applicable keys and rejecting unknown ones."""

    def __init__(self, raw: dict):
        if not isinstance(raw, dict):
            raise ValueError(f"config must be a JSON object, got {type(raw).__name__}")
        self.raw = raw
        self.not_applicable: list[str] = []
        self.bf16_optimizer_states = False
        """``bf16.bf16_optimizer_states`` was true: the optimizer states default to ``bf16``."""

    def translate(self) -> InfinityConfig:
        raw = dict(self.raw)
        kwargs: dict[str, Any] = {}
        for key in list(raw):
            if key in _TOP_LEVEL_NOT_APPLICABLE:
                self.not_applicable.append(key)
                raw.pop(key)
        _reject_auto(raw, "")  # after the keys that mean nothing here: an "auto" there is harmless
        if "train_micro_batch_size_per_gpu" in raw:
            kwargs["micro_batch_size"] = _int("train_micro_batch_size_per_gpu", raw.pop("train_micro_batch_size_per_gpu"))
        if "train_batch_size" in raw:
            kwargs["train_batch_size"] = _int("train_batch_size", raw.pop("train_batch_size"))
        if "gradient_accumulation_steps" in raw:
            kwargs["gradient_accumulation_steps"] = _int("gradient_accumulation_steps", raw.pop("gradient_accumulation_steps"))
        if "gradient_clipping" in raw:
            kwargs["gradient_clipping"] = _float("gradient_clipping", raw.pop("gradient_clipping"))
        kwargs.update(self._precision(raw.pop("fp16", None), raw.pop("bf16", None), raw.pop("precision", None)))
        if "optimizer" in raw:
            kwargs["optimizer"] = self._optimizer(raw.pop("optimizer"))
        if "zero_optimization" in raw:
            kwargs["zero"] = self._zero(raw.pop("zero_optimization"))
        elif self.bf16_optimizer_states:
            kwargs["zero"] = ZeroConfig(offload_optimizer=OffloadOptimizerConfig(state_dtype="bf16"))
        if "aio" in raw:
            kwargs["aio"] = AioConfig(**self._fields("aio", raw.pop("aio"), _AIO_HONOURED, set(), {"use_gds": False}))
        if "tiling" in raw:
            kwargs["tiling"] = TilingConfig(**self._fields("tiling", raw.pop("tiling"), {"max_tile_numel": "max_tile_numel"}))
        if "device" in raw:
            kwargs["device"] = raw.pop("device")
        if "scheduler" in raw:
            kwargs["scheduler"] = scheduler_from_deepspeed(raw.pop("scheduler"))
        if "trace" in raw:
            kwargs["trace"] = TraceConfig(**self._fields("trace", raw.pop("trace"), {"path": "path"}))
        if raw:
            raise ValueError(f"unknown config key(s): {', '.join(sorted(map(repr, raw)))}")
        kwargs["not_applicable"] = tuple(self.not_applicable)
        return InfinityConfig(**kwargs)

    def _fields(self, where: str, block: Any, honoured: dict, not_applicable: set = frozenset(),
                only_value: dict | None = None) -> dict:
        if not isinstance(block, dict):
            raise ValueError(f"{where} must be a JSON object, got {type(block).__name__}")
        out = {}
        for key, value in block.items():
            if key in honoured:
                out[honoured[key]] = value
            elif key in not_applicable:
                self.not_applicable.append(f"{where}.{key}")
            elif only_value is not None and key in only_value:
                if value != only_value[key]:
                    raise ValueError(f"{where}.{key}={value!r} is not supported (only {only_value[key]!r})")
                self.not_applicable.append(f"{where}.{key}")
            else:
                raise ValueError(f"unknown config key {where}.{key!r}")
        return out

    def _precision(self, fp16: Any, bf16: Any, precision: Any) -> dict:
        fp16_on = self._enabled("fp16", fp16)
        bf16_on = self._enabled("bf16", bf16)
        if fp16_on and bf16_on:
            raise ValueError("fp16.enabled and bf16.enabled are both true; choose one")
        out: dict[str, Any] = {}
        if precision is not None:
            out["precision"] = precision
        if fp16_on:
            out["precision"] = "fp16"
            fields = self._fields("fp16", {k: v for k, v in fp16.items() if k != "enabled"},
                                  _FP16_HONOURED, _FP16_NOT_APPLICABLE, {"fp16_master_weights_and_grads": False})
            out["loss_scale"] = LossScaleConfig(**fields)
        elif isinstance(fp16, dict):
            self.not_applicable.extend(f"fp16.{k}" for k in fp16 if k != "enabled")
        if isinstance(bf16, dict) and "bf16_optimizer_states" in bf16:
            states = bf16["bf16_optimizer_states"]
            if not isinstance(states, bool):
                raise ValueError(f"config key bf16.bf16_optimizer_states must be true or false, got {states!r}")
            self.bf16_optimizer_states = states  # honoured whether or not bf16 computes: states are apart
        if bf16_on:
            out["precision"] = "bf16"
            self._fields("bf16", {k: v for k, v in bf16.items() if k not in ("enabled", "bf16_optimizer_states")},
                         {}, _BF16_NOT_APPLICABLE)
        return out

    @staticmethod
    def _enabled(where: str, block: Any) -> bool:
        if block is None:
            return False
        if not isinstance(block, dict):
            raise ValueError(f"{where} must be a JSON object like {{\"enabled\": true}}, got {block!r}")
        enabled = block.get("enabled", False)
        if where == "bf16" and enabled == "auto":  # bf16 where the device computes it fast (infinity.hardware)
            from infinity.hardware import resolve_precision

            return resolve_precision("auto").precision == "bf16"
        if not isinstance(enabled, bool):
            allowed = "true, false or \"auto\"" if where == "bf16" else "true or false"
            raise ValueError(f"{where}.enabled must be {allowed}, got {enabled!r}")
        return enabled

    def _optimizer(self, block: Any) -> OptimizerConfig:
        if not isinstance(block, dict):
            raise ValueError(f"optimizer must be a JSON object, got {type(block).__name__}")
        unknown = set(block) - {"type", "params"}
        if unknown:
            raise ValueError(f"unknown config key(s) in optimizer: {', '.join(sorted(map(repr, unknown)))}")
        kind = block.get("type", "AdamW")
        normalized = {"adam": "Adam", "adamw": "AdamW"}.get(str(kind).lower())
        if normalized is None:
            raise ValueError(f"optimizer.type {kind!r} is not supported (Adam or AdamW)")
        params = dict(block.get("params", {}))
        unknown = set(params) - _ADAM_PARAMS
        if unknown:
            raise ValueError(f"unknown config key(s) in optimizer.params: {', '.join(sorted(map(repr, unknown)))}")
        if params.pop("amsgrad", False):
            raise ValueError("optimizer.params.amsgrad=true is not supported")
        for key in ("torch_adam", "fused"):
            if key in params:
                params.pop(key)
                self.not_applicable.append(f"optimizer.params.{key}")
        # DeepSpeed's "Adam" is decoupled (AdamW) unless adam_w_mode is false.
        adamw = bool(params.pop("adam_w_mode", True)) if normalized == "Adam" else True
        if normalized == "AdamW" and "adam_w_mode" in block.get("params", {}):
            params.pop("adam_w_mode")
        kwargs: dict[str, Any] = {"type": normalized, "adamw": adamw}
        if "lr" in params:
            kwargs["lr"] = _float("optimizer.params.lr", params.pop("lr"))
        if "betas" in params:
            betas = params.pop("betas")
            if not isinstance(betas, (list, tuple)) or len(betas) != 2:
                raise ValueError(f"optimizer.params.betas must be a list of two numbers, got {betas!r}")
            kwargs["betas"] = (_float("optimizer.params.betas[0]", betas[0]), _float("optimizer.params.betas[1]", betas[1]))
        if "eps" in params:
            kwargs["eps"] = _float("optimizer.params.eps", params.pop("eps"))
        if "weight_decay" in params:
            kwargs["weight_decay"] = _float("optimizer.params.weight_decay", params.pop("weight_decay"))
        if "bias_correction" in params:
            kwargs["bias_correction"] = bool(params.pop("bias_correction"))
        return OptimizerConfig(**kwargs)

    def _zero(self, block: Any) -> ZeroConfig:
        if not isinstance(block, dict):
            raise ValueError(f"zero_optimization must be a JSON object, got {type(block).__name__}")
        block = dict(block)
        kwargs: dict[str, Any] = {}
        if "offload_param" in block:
            kwargs["offload_param"] = self._offload(
                "zero_optimization.offload_param", block.pop("offload_param"), _OFFLOAD_PARAM_KEYS, set(), OffloadParamConfig)
        if "offload_optimizer" in block:
            kwargs["offload_optimizer"] = self._offload(
                "zero_optimization.offload_optimizer", block.pop("offload_optimizer"), _OFFLOAD_OPTIMIZER_KEYS,
                _OFFLOAD_OPTIMIZER_NOT_APPLICABLE, OffloadOptimizerConfig)
        elif self.bf16_optimizer_states:
            kwargs["offload_optimizer"] = OffloadOptimizerConfig(state_dtype="bf16")
        fields = self._fields("zero_optimization", block, _ZERO_HONOURED, _ZERO_NOT_APPLICABLE, _ZERO_ONLY_VALUE)
        for name, value in fields.items():
            if name == "overlap_step_with_backward":
                kwargs[name] = bool(value)
            elif name == "host_memory_budget":
                kwargs[name] = value  # bytes, a fraction or a string with units: parsed by ZeroConfig
            else:
                kwargs[name] = _int(f"zero_optimization.{name}", value)
        return ZeroConfig(**kwargs)

    def _offload(self, where: str, block: Any, keys: set, not_applicable: set, cls):
        if block is None:
            block = {}
        fields = self._fields(where, block, {k: k for k in keys}, not_applicable, {"ratio": 1.0})
        if "device" in fields:
            device = fields["device"]
            fields["device"] = "none" if device in (None, "none") else device
        for name in ("buffer_count", "buffer_size", "max_in_cpu"):
            if name in fields:
                fields[name] = _int(f"{where}.{name}", fields[name])
        if cls is OffloadOptimizerConfig and self.bf16_optimizer_states:
            if fields.get("state_dtype", "bf16") != "bf16":
                raise ValueError(f"bf16.bf16_optimizer_states is true but {where}.state_dtype is "
                                 f"{fields['state_dtype']!r}; give one of them")
            fields["state_dtype"] = "bf16"
        return cls(**fields)


def _reject_auto(block: dict, prefix: str) -> None:
    """Hugging Face's Trainer fills "auto" values before DeepSpeed sees them; we cannot guess them."""
    for key, value in block.items():
        if prefix == "zero_optimization." and key in _ZERO_NOT_APPLICABLE:
            continue  # means nothing here, "auto" or not
        if value == "auto" and f"{prefix}{key}" != "bf16.enabled":  # (that one is ours: infinity.hardware)
            raise ValueError(f"config key {prefix}{key} is \"auto\"; give a number (\"auto\" is filled in by "
                             f"Hugging Face's Trainer, not by DeepSpeed; `infinity train` fills it from its flags)")
        if isinstance(value, dict):
            _reject_auto(value, f"{prefix}{key}.")


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"config key {key} must be an integer, got {value!r}")
    return int(value)


def _float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"config key {key} must be a finite number, got {value!r}")
    return float(value)


def _require_positive(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"config key {key} must be a positive number, got {value!r}")


def _require_non_negative(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"config key {key} must be a non-negative number, got {value!r}")


def _require_optional_bool(key: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"config key {key} must be true or false, got {value!r}")


def _require_offload_device(where: str, block) -> None:
    """``block.device`` is one of OFFLOAD_DEVICES; held as the :class:`OffloadDevice` member (its tier is known)."""
    _require_choice(f"{where}.device", block.device, OFFLOAD_DEVICES)
    object.__setattr__(block, "device", OffloadDevice(block.device))


def _require_choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"config key {key} must be one of {', '.join(map(repr, choices))}, got {value!r}")
