"""Configuration: frozen, typed dataclasses, a docstring under every field and validation in ``__post_init__``.

A DeepSpeed-style JSON config is translated into them once, at the edge (:meth:`InfinityConfig.from_deepspeed`,
tables in :mod:`infinity.config.deepspeed`). Changes after that are typed: :meth:`InfinityConfig.replace` and the
``with_*`` methods return a copy that is validated as at construction (``infinity train`` applies its flags so).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Literal

from infinity.config.deepspeed import translate
from infinity.config.lr_schedule import DeepSpeedScheduler
from infinity.config.sections import (AioConfig, LossScaleConfig, OptimizerConfig, TilingConfig, TraceConfig,
                                      ZeroConfig, _require_choice, _require_non_negative, _require_positive)
from infinity.runtime.hardware import CPU_MATMUL_CHOICES


@dataclass(frozen=True, kw_only=True, slots=True)
class InfinityConfig:
    """Everything the engine is told. Build it from a DeepSpeed-style dict with :meth:`from_deepspeed`."""

    micro_batch_size: int | None = None
    """``train_micro_batch_size_per_gpu``; informative (the engine does not batch data)."""
    train_batch_size: int | None = None
    """If given, must equal micro batch × accumulation steps × world size."""
    gradient_accumulation_steps: int = 1
    accumulation_from_batch: bool = False
    """``gradient_accumulation_steps`` was not given but ``train_batch_size`` and the micro batch were: it is their
    quotient over the world size, as DeepSpeed derives it, set at initialize (:meth:`for_world_size`)."""
    gradient_clipping: float = 0.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    cpu_matmul_precision: Literal["auto", "fp32", "native"] = "auto"
    """How a bf16 or fp16 run computes its matmuls when the compute device is the CPU (our key
    ``cpu_matmul_precision``): ``fp32`` from fp32 copies of the operands, the product rounded back (torch's own
    half-precision matmul on a CPU without units for it is a scalar fallback, 20-70x slower); ``native`` as torch
    runs them; ``auto`` in fp32 where the CPU has no units for the precision (:mod:`infinity.runtime.cpu_matmul`)."""
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
        _require_choice("cpu_matmul_precision", self.cpu_matmul_precision, CPU_MATMUL_CHOICES)
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
        raw = read_config_json(path)
        return cls.from_deepspeed(raw)

    @classmethod
    def from_deepspeed(cls, raw: dict) -> "InfinityConfig":
        """Translate a DeepSpeed-style config once, here at the edge."""

        return cls(**translate(raw))

    def for_world_size(self, world_size: int) -> "InfinityConfig":
        """The config of a run of ``world_size`` ranks: as DeepSpeed does, the one of ``train_batch_size``, the
        micro batch and ``gradient_accumulation_steps`` left out is the quotient of the other two (over the world
        size); ``train_batch_size`` given with both must equal micro batch × accumulation steps × ``world_size``."""
        config = self
        if self.accumulation_from_batch:
            accumulation = accumulation_steps_from(self.train_batch_size, self.micro_batch_size, world_size)
            if accumulation is None:
                raise ValueError(f"train_batch_size={self.train_batch_size} is not a multiple of "
                                 f"train_micro_batch_size_per_gpu × world size = {self.micro_batch_size} × {world_size}: "
                                 f"no whole gradient_accumulation_steps gives it")
            config = self.replace(gradient_accumulation_steps=accumulation, accumulation_from_batch=False)
        elif self.train_batch_size is not None and self.micro_batch_size is None:
            per_micro = self.gradient_accumulation_steps * world_size
            if self.train_batch_size % per_micro:
                raise ValueError(f"train_batch_size={self.train_batch_size} is not a multiple of "
                                 f"gradient_accumulation_steps × world size = {self.gradient_accumulation_steps} × "
                                 f"{world_size}: no whole train_micro_batch_size_per_gpu gives it")
            config = self.replace(micro_batch_size=self.train_batch_size // per_micro)
        c = config
        if c.train_batch_size is not None and c.micro_batch_size is not None:
            expected = c.micro_batch_size * c.gradient_accumulation_steps * world_size
            if expected != c.train_batch_size:
                raise ValueError(
                    f"train_batch_size={c.train_batch_size} but train_micro_batch_size_per_gpu × "
                    f"gradient_accumulation_steps × world size = {c.micro_batch_size} × "
                    f"{c.gradient_accumulation_steps} × {world_size} = {expected}")
        return config

    # -- typed changes: each returns a copy, validated as at construction -------------------------
    def replace(self, **changes) -> "InfinityConfig":
        """A copy with top-level fields changed (``precision="bf16"``, ``trace=TraceConfig(...)``)."""
        return dataclasses.replace(self, **changes)

    def with_optimizer(self, **changes) -> "InfinityConfig":
        """A copy with fields of ``optimizer`` changed (``lr``, ``betas``, ...)."""
        return self.replace(optimizer=dataclasses.replace(self.optimizer, **changes))

    def with_zero(self, **changes) -> "InfinityConfig":
        """A copy with fields of ``zero`` (``zero_optimization``) changed."""
        return self.replace(zero=dataclasses.replace(self.zero, **changes))

    def with_offload(self, which: Literal["param", "optimizer"], **changes) -> "InfinityConfig":
        """A copy with fields of ``zero.offload_param`` or ``zero.offload_optimizer`` changed; give ``device`` and
        ``nvme_path`` together when both change (each state is validated whole)."""
        if which not in ("param", "optimizer"):
            raise ValueError(f"with_offload: which must be 'param' or 'optimizer', got {which!r}")
        key = f"offload_{which}"
        return self.with_zero(**{key: dataclasses.replace(getattr(self.zero, key), **changes)})

    def with_aio(self, **changes) -> "InfinityConfig":
        """A copy with fields of ``aio`` changed."""
        return self.replace(aio=dataclasses.replace(self.aio, **changes))


def accumulation_steps_from(train_batch_size: int, micro_batch_size: int, world_size: int) -> int | None:
    """DeepSpeed's gradient accumulation steps where only the batch sizes are given: ``train_batch_size`` ÷ (micro
    batch × ``world_size``), or None where that is not a whole number."""
    per_step = micro_batch_size * world_size
    return train_batch_size // per_step if train_batch_size % per_step == 0 else None


def read_config_json(path: str | os.PathLike, what: str = "config file") -> dict:
    """The JSON object in ``path``; a missing file, a folder, or anything but a JSON object is an error naming
    ``what`` and the path."""
    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {name!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {name!r} is a folder, not a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{what} {name!r} is not JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{what} {name!r} must hold a JSON object, got {type(raw).__name__}")
    return raw
