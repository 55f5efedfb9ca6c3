"""The one translation of a DeepSpeed-style JSON config into :class:`~infinity.config.schema.InfinityConfig`.

A user's existing DeepSpeed config works unchanged. Every key is one of:

* honoured: translated into a field of the config's dataclasses;
* not applicable: a DeepSpeed key with no meaning here (logging cadence, knobs
  of mechanisms we do differently); accepted and listed once in the log;
* rejected: a key DeepSpeed itself would not know (a typo) or a value we cannot
  honour; a ``ValueError`` names it.

Nothing is silently ignored. Each table below maps a key to how it is handled: a
field name (honoured), or membership of a ``*_NOT_APPLICABLE`` set. A key in none
of the tables is rejected as unknown.
"""

from __future__ import annotations

import math
from typing import Any

from infinity.config.lr_schedule import scheduler_from_deepspeed
from infinity.config.sections import (AioConfig, LossScaleConfig, OffloadOptimizerConfig, OffloadParamConfig,
                                      OptimizerConfig, TilingConfig, TraceConfig, ZeroConfig)
from infinity.runtime.hardware import resolve_precision

__all__ = ["GATHER_16BIT_KEYS", "asked_precision", "gathers_16bit_on_save", "translate", "without_gather_16bit_keys"]


def translate(raw: dict) -> dict[str, Any]:
    """The fields of the :class:`~infinity.config.schema.InfinityConfig` a DeepSpeed-style dict says (see the
    module's docstring); ``InfinityConfig.from_deepspeed`` builds the config from them."""
    return _DeepSpeedTranslator(raw).translate()


def asked_precision(raw: dict) -> str | None:
    """The compute precision the ``fp16`` and ``bf16`` blocks of ``raw`` ask for, before ``"auto"`` is resolved:
    ``"auto"`` (``bf16.enabled: "auto"``), ``"bf16"``, ``"fp16"``, ``"fp32"`` (a block is there, none enabled), or
    None (neither block: the caller's default applies). Bad values are left to :func:`translate` to name."""
    fp16, bf16 = raw.get("fp16"), raw.get("bf16")
    bf16_enabled = bf16.get("enabled") if isinstance(bf16, dict) else None
    if bf16_enabled == "auto":
        return "auto"
    if bf16_enabled:
        return "bf16"
    if isinstance(fp16, dict) and fp16.get("enabled"):
        return "fp16"
    return "fp32" if ("bf16" in raw or "fp16" in raw) else None


GATHER_16BIT_KEYS = ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                     "stage3_gather_fp16_weights_on_model_save")
"""The ``zero_optimization`` keys (DeepSpeed's names over its releases) that have the model gathered whole when it
is saved: accelerate's ``get_state_dict`` asks them, and the Trainer writes the model's weights into each
``checkpoint-N`` where one is true. The doors honour them, not the engine (:func:`without_gather_16bit_keys`)."""


def gathers_16bit_on_save(raw: dict) -> bool:
    """Whether ``raw``'s ``zero_optimization`` sets one of :data:`GATHER_16BIT_KEYS` true."""
    zero = raw.get("zero_optimization")
    return isinstance(zero, dict) and any(zero.get(key) is True for key in GATHER_16BIT_KEYS)


def without_gather_16bit_keys(raw: dict) -> dict:
    """``raw`` without :data:`GATHER_16BIT_KEYS` (a shallow copy where it had one): a door has honoured them, and
    left in, the engine would log them among the keys that mean nothing here."""
    zero = raw.get("zero_optimization")
    if not isinstance(zero, dict) or not any(key in zero for key in GATHER_16BIT_KEYS):
        return raw
    return dict(raw, zero_optimization={key: value for key, value in zero.items() if key not in GATHER_16BIT_KEYS})


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
LOWER_STAGES = (0, 1, 2)
"""ZeRO stages below 3, taken as 3: the same training, with parameters and gradients partitioned too (a DeepSpeed
JSON for ZeRO-Offload, stage 2 with ``offload_optimizer``, runs unchanged)."""
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
    "overlap_step_with_forward": "overlap_step_with_forward",
    "host_memory_budget": "host_memory_budget",
    "device_memory_budget": "device_memory_budget",
}
# Keys whose only values we can honour are listed with that value.
_ZERO_ONLY_VALUE = {
    "zero_hpz_partition_size": 1, "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False, "mics_shard_size": -1, "mics_hierarchical_params_gather": False,
    "legacy_stage1": False, "cpu_offload": False, "cpu_offload_params": False, "zeropp_loco_param": None,
}
_OFFLOAD_PARAM_KEYS = {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory",
                       "compute_from_master"}
_OFFLOAD_OPTIMIZER_KEYS = {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
                           "grad_accumulation", "max_in_cpu", "state_dtype", "ratio", "host_threads"}
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

    def translate(self) -> dict[str, Any]:
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
        elif "train_batch_size" in kwargs and "micro_batch_size" in kwargs:
            kwargs["accumulation_from_batch"] = True  # DeepSpeed's: the third of the three from the other two
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
        if "cpu_matmul_precision" in raw:
            kwargs["cpu_matmul_precision"] = raw.pop("cpu_matmul_precision")
        if "scheduler" in raw:
            kwargs["scheduler"] = scheduler_from_deepspeed(raw.pop("scheduler"))
        if "trace" in raw:
            kwargs["trace"] = TraceConfig(**self._fields("trace", raw.pop("trace"), {"path": "path"}))
        if raw:
            raise ValueError(f"unknown config key(s): {', '.join(sorted(map(repr, raw)))}")
        kwargs["not_applicable"] = tuple(self.not_applicable)
        return kwargs

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
        if where == "bf16" and enabled == "auto":  # bf16 where the device computes it fast (infinity.runtime.hardware)
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
        stage = block.get("stage", 3)
        if type(stage) is int and stage in LOWER_STAGES:  # (True == 1, and is not a stage)
            # ZeRO's stages train the same model: a lower one only keeps more of the state whole on each rank
            self.not_applicable.append(f"zero_optimization.stage={stage} (runs as stage 3)")
            block.pop("stage")
        fields = self._fields("zero_optimization", block, _ZERO_HONOURED, _ZERO_NOT_APPLICABLE, _ZERO_ONLY_VALUE)
        for name, value in fields.items():
            if name in ("overlap_step_with_backward", "overlap_step_with_forward"):
                kwargs[name] = bool(value)
            elif name in ("host_memory_budget", "device_memory_budget"):
                kwargs[name] = value  # bytes, a fraction or a string with units: parsed by ZeroConfig
            else:
                kwargs[name] = _int(f"zero_optimization.{name}", value)
        return ZeroConfig(**kwargs)

    def _offload(self, where: str, block: Any, keys: set, not_applicable: set, cls):
        if block is None:
            block = {}
        # DeepSpeed's offload_optimizer.ratio is honoured (a split optimizer); offload_param takes only 1.0
        only_value = {} if cls is OffloadOptimizerConfig else {"ratio": 1.0}
        fields = self._fields(where, block, {k: k for k in keys}, not_applicable, only_value)
        if "device" in fields:
            device = fields["device"]
            fields["device"] = "none" if device in (None, "none") else device
        for name in ("buffer_count", "buffer_size", "max_in_cpu", "host_threads"):
            if name in fields and fields[name] is not None:
                fields[name] = _int(f"{where}.{name}", fields[name])
        if cls is OffloadOptimizerConfig and self.bf16_optimizer_states:
            if fields.get("state_dtype", "bf16") != "bf16":
                raise ValueError(f"bf16.bf16_optimizer_states is true but {where}.state_dtype is "
                                 f"{fields['state_dtype']!r}; give one of them")
            fields["state_dtype"] = "bf16"
        return cls(**fields)


_OUR_AUTO_KEYS = frozenset({"bf16.enabled", "device", "cpu_matmul_precision", "aio.backend",
                            "zero_optimization.offload_optimizer.device"})
"""Keys whose "auto" we resolve ourselves (infinity.runtime.hardware, placement.compute_device,
infinity.runtime.cpu_matmul, the storage backend, the optimizer's split per sub-group)."""


def _reject_auto(block: dict, prefix: str) -> None:
    """Hugging Face's Trainer fills "auto" values before DeepSpeed sees them; we cannot guess them."""
    for key, value in block.items():
        if prefix == "zero_optimization." and key in _ZERO_NOT_APPLICABLE:
            continue  # means nothing here, "auto" or not
        if value == "auto" and f"{prefix}{key}" not in _OUR_AUTO_KEYS:
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
