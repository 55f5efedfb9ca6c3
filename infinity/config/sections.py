"""The config's sections: frozen, typed dataclasses, a docstring under every field and validation in
``__post_init__``. :class:`~infinity.config.schema.InfinityConfig` holds one of each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from infinity.config.tier_names import OFFLOAD_DEVICES, OPTIMIZER_OFFLOAD_DEVICES, OffloadDevice, Tier
from infinity.config.units import parse_host_memory

DEFAULT_DEVICE_FRACTION = 0.6
"""Without ``device_memory_budget``, split optimizers take this share of the device memory free after the model's
working set: the rest is for activations and the allocator's slack, unknown at ``initialize``."""

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
    compute_from_master: bool = True
    """With ``device`` nvme, a bf16 master on NVMe (``offload_optimizer.state_dtype`` bf16 or int8) and bf16
    compute, read the compute shards of the swapped sub-groups from the master's swap file instead of writing a
    copy of their own each step (the same bits, 2 B an element less written). False keeps the copy."""

    def __post_init__(self):
        _require_offload_device("offload_param", self)
        _require_optional_bool("offload_param.pin_memory", self.pin_memory)
        if not isinstance(self.compute_from_master, bool):
            raise ValueError(f"config key offload_param.compute_from_master must be true or false, "
                             f"got {self.compute_from_master!r}")
        _require_nvme_path("offload_param", self)
        _require_positive("offload_param.buffer_count", self.buffer_count)
        _require_positive("offload_param.buffer_size", self.buffer_size)
        _require_non_negative("offload_param.max_in_cpu", self.max_in_cpu)


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadOptimizerConfig:
    """Where the fp32 master, the moments and the gradient slices rest (``zero_optimization.offload_optimizer``)."""

    device: OffloadDevice = OffloadDevice.NONE
    """As ``offload_param.device``, or ``auto`` (our value): of the first sub-groups whose states fit
    ``zero_optimization.device_memory_budget``, as many as the step-time model finds worth it (the smallest count
    within 2 % of the best predicted step; all of them without cached machine figures) rest on the device and are
    stepped there, the rest in host memory, and with ``nvme_path`` set what the host-memory budget cannot hold on
    NVMe."""
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
    ratio: float = 1.0
    """DeepSpeed's key: the fraction of the optimizer's sub-groups that is offloaded (stepped by the CPU kernel)
    when ``device`` is ``cpu`` or ``nvme``; the first ``int((1 - ratio) * sub-groups)`` sub-groups rest on the
    device and are stepped there, as DeepSpeed splits them. 1 (the default) offloads all of them."""
    host_threads: int | None = None
    """The fused CPU Adam's threads (our key): None sizes them from the machine (on a GPU every core this process may
    use but the first, which is left to the thread that feeds the GPU, the kernel's threads bound to the others; on
    a CPU device every core, unbound); fewer than the usable cores are bound to the last of them
    (:mod:`infinity.runtime.host_cores`)."""

    def __post_init__(self):
        _require_offload_device("offload_optimizer", self, OPTIMIZER_OFFLOAD_DEVICES)
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"config key zero_optimization.offload_optimizer.ratio must be a number in [0, 1] (the "
                             f"fraction of the optimizer offloaded), got {self.ratio!r}")
        object.__setattr__(self, "ratio", float(self.ratio))
        if self.ratio < 1.0 and self.device not in ("cpu", "nvme"):
            raise ValueError(
                f"config key zero_optimization.offload_optimizer.ratio is {self.ratio} but offload_optimizer.device "
                f"is {self.device.value!r}: a ratio splits an offloaded optimizer ('cpu' or 'nvme'); 'auto' picks the "
                f"split from zero_optimization.device_memory_budget instead")
        _require_nvme_path("offload_optimizer", self)
        if isinstance(self.buffer_count, bool) or not isinstance(self.buffer_count, int) or self.buffer_count < 2:
            raise ValueError(f"config key offload_optimizer.buffer_count must be at least 2 (one buffer is updated while "
                             f"another is read or written), got {self.buffer_count!r}")
        _require_optional_bool("offload_optimizer.pin_memory", self.pin_memory)
        if self.max_in_cpu is not None:
            _require_non_negative("offload_optimizer.max_in_cpu", self.max_in_cpu)
        _require_choice("offload_optimizer.grad_accumulation", self.grad_accumulation,
                        ("device_if_fits", "device", "host"))
        _require_choice("zero_optimization.offload_optimizer.state_dtype", self.state_dtype, STATE_DTYPES)
        threads = self.host_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"config key zero_optimization.offload_optimizer.host_threads must be a positive integer "
                             f"(threads of the fused CPU Adam) or null (from the machine), got {self.host_threads!r}")

    @property
    def offloaded_tier(self) -> Tier:
        """Where the offloaded sub-groups rest: ``host`` or ``nvme`` (``auto``: NVMe when ``nvme_path`` is set,
        the sub-groups that fit the host budget staying in host memory); ``device`` when nothing is offloaded."""
        if self.device is OffloadDevice.AUTO:
            return Tier.NVME if self.nvme_path else Tier.HOST
        return self.device.tier

    @property
    def splits(self) -> bool:
        """Some sub-groups may rest on the device while others are offloaded (``auto``, or a ratio below 1)."""
        return self.device is OffloadDevice.AUTO or self.ratio < 1.0


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
    overlap_step_with_forward: bool = True
    """With ``overlap_step_with_backward``: the updates an overlapped step makes after the global norm is known
    (all of them when the step clips, or follows one that did) run on a worker thread while the next forward
    begins; a parameter's fetch waits only for its own sub-group (our key)."""
    host_memory_budget: int | float | None = None
    """Host memory this rank's engine may use (our key): bytes, or a fraction of the memory available at start
    (shared by the ranks on the machine). None: 80 % of what is available. Every host allocation charges it;
    staging is sized from it; with NVMe configured, the states that fit stay in host memory."""
    device_memory_budget: int | float | None = None
    """Device memory the optimizer states of ``offload_optimizer.device: auto`` may take (our key): bytes, or a
    fraction of the device memory free after the model's working set (compute shards on the device, gathered
    parameters, scratch). None: :data:`DEFAULT_DEVICE_FRACTION` of it, leaving the rest to activations and the
    allocator, which are not known at ``initialize``. With a ``ratio`` below 1 the device's share must fit it.
    Enforced: the device tier counts the optimizer's states and gradient slices on the device apart and refuses
    an allocation past the budget (gathered parameters, prefetching and scratch are outside it)."""

    def __post_init__(self):
        if self.stage != 3:
            raise ValueError(
                f"zero_optimization.stage must be 0, 1, 2 or 3 (this engine is ZeRO stage 3 with offload; a lower "
                f"stage runs as 3), got {self.stage!r}"
            )
        for name in ("sub_group_size", "max_live_parameters"):
            _require_positive(f"zero_optimization.{name}", getattr(self, name))
        for name in ("prefetch_bucket_size", "param_persistence_threshold", "max_reuse_distance"):
            _require_non_negative(f"zero_optimization.{name}", getattr(self, name))
        object.__setattr__(self, "host_memory_budget", parse_host_memory(self.host_memory_budget))
        # any byte count: a budget below one sub-group's states keeps every sub-group offloaded
        object.__setattr__(self, "device_memory_budget", parse_host_memory(
            self.device_memory_budget, key="zero_optimization.device_memory_budget", min_nbytes=2))


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


def _require_positive(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"config key {key} must be a positive number, got {value!r}")


def _require_non_negative(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"config key {key} must be a non-negative number, got {value!r}")


def _require_optional_bool(key: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"config key {key} must be true or false, got {value!r}")


def _require_offload_device(where: str, block, choices=OFFLOAD_DEVICES) -> None:
    """``block.device`` is one of ``choices``; held as the :class:`OffloadDevice` member."""
    _require_choice(f"{where}.device", block.device, choices)
    object.__setattr__(block, "device", OffloadDevice(block.device))


UNSET_NVME_PATH = "none"
"""The NVMe path accelerate's DeepSpeed plugin fills in where it was given none (its launcher does not pass a config
file's paths on): never a folder to swap into."""


def _require_nvme_path(where: str, block) -> None:
    """An NVMe path where ``block.device`` swaps to NVMe; accelerate's ``"none"`` is no path (dropped elsewhere)."""
    if block.nvme_path == UNSET_NVME_PATH:
        if block.device == "nvme":
            raise ValueError(f"{where}.device is 'nvme' but {where}.nvme_path is 'none' (what accelerate's DeepSpeed "
                             f"plugin fills in where it was given no path): set {where}.nvme_path to the folder for "
                             f"the swap files ({where}_nvme_path in an accelerate config)")
        object.__setattr__(block, "nvme_path", None)
    if block.device == "nvme" and not block.nvme_path:
        raise ValueError(f"{where}.device is 'nvme' but {where}.nvme_path is not set")


def _require_choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"config key {key} must be one of {', '.join(map(repr, choices))}, got {value!r}")
