"""The plan of an ``infinity train`` run: every flag and the ``--config`` file checked and decided before any work.

The engine's config is built in one direction: the file is read into an :class:`~infinity.config.schema.InfinityConfig`
(translated once, by :mod:`infinity.config.deepspeed`), then the flags are applied on top of it with typed changes
(``replace``, ``with_offload``, ...), each validated as the config's own constructor validates it. Before the file
is read, what it leaves to the run is completed in it (:func:`complete_file`): Hugging Face's ``"auto"`` values, a
swap folder still to be made, and the blocks a flag replaces (``--lr-schedule``, ``--precision``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from infinity.commands import train_checkpoints, train_monitor
from infinity.commands.hf_model import read_hf_model_config, read_model_config_file
from infinity.commands.train_checkpoints import SavePolicy
from infinity.commands.train_checks import (TEMPORARY_SWAP_PATH, SwapLocation, check_direct_io, check_model_file,
                                            check_output_folder, check_writable, config_number, default_swap_location,
                                            finite_positive, nvme_offloads)
from infinity.commands.train_lora import LORA_LR, LoraPlan, lora_plan
from infinity.commands.train_monitor import MonitorPlan
from infinity.commands.train_resume import check_resume, run_settings, saved_settings
from infinity.config.auto import fill_auto
from infinity.config.deepspeed import asked_precision
from infinity.config.schema import InfinityConfig, accumulation_steps_from, read_config_json
from infinity.config.sections import TraceConfig
from infinity.config.tier_names import OffloadDevice
from infinity.models.gpt import DEFAULT_PRESET, get_preset
from infinity.runtime.comm import local_rank_and_size
from infinity.runtime.cpu_matmul import matmuls_in_fp32
from infinity.runtime.hardware import default_device, resolve_precision, slow_precision_warning

__all__ = ["DEFAULT_LR", "DEFAULT_MICRO_BATCH", "DEFAULT_STEPS", "DEFAULT_SUB_GROUP_SIZE", "HF_MODEL_LR",
           "MAX_DEFAULT_SEQ_LEN",
           "MODEL_FILE_LR", "PRESET_LR", "Plan", "complete_file", "engine_config", "kept_offload_note", "make_plan",
           "with_swap_folder"]

DEFAULT_STEPS = 200
DEFAULT_MICRO_BATCH = 8
MAX_DEFAULT_SEQ_LEN = 256
"""Without --seq-len, a sequence is the model's context, at most this long."""
DEFAULT_LR = 2e-3
"""Peak learning rate of the default preset; other presets have theirs in PRESET_LR."""
PRESET_LR = {
    "tiny": 3e-3, "small": DEFAULT_LR, "10m": 1e-3, "50m": 8e-4,
    # GPT-3's (Brown et al. 2020, table 2.1) from 125m up
    "125m": 6e-4, "350m": 3e-4, "760m": 2.5e-4, "1.3b": 2e-4, "2.7b": 1.6e-4, "6.7b": 1.2e-4, "13b": 1e-4,
    "20b": 9e-5, "30b": 8e-5,  # between GPT-3's 13B (1e-4) and 175B (6e-5)
}
MODEL_FILE_LR = 3e-4
HF_MODEL_LR = 5e-5
"""Fine-tuning a pretrained model (--hf-model): Hugging Face's Trainer default."""
DEFAULT_SUB_GROUP_SIZE = 10**8
"""Sub-groups of 1e8 elements: the NVMe optimizer's staging stays at buffer_count x 1e8 x 14 bytes whatever the
model, and sub-groups pipeline (as the engine's own default, 1e8)."""
ADAMW_DEFAULTS = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
"""The optimizer's settings when the config file names no optimizer. The weight decay (this one or the file's)
falls on the tensors of 2 or more dimensions only (``decay_matrices_only``)."""
DEFAULT_GRADIENT_CLIPPING = 1.0
"""When the config file gives no ``gradient_clipping``."""
OFFLOADS = ("param", "optimizer")
"""The two offloaded states, as :meth:`InfinityConfig.with_offload` names them."""


@dataclass
class Plan:
    """Everything decided and checked before any work."""

    config: InfinityConfig
    """The engine's config: the file, the flags on top. Until the run starts, a swap folder still to be made is
    ``TEMPORARY_SWAP_PATH`` (see :func:`with_swap_folder`)."""
    steps: int
    micro_batch: int
    grad_accum: int
    seq_len: int
    lr: float
    min_lr: float
    warmup: int
    precision: str
    offload_param: str
    offload_optimizer: str
    nvme_path: str | None
    nvme_is_temporary: bool
    preset: str | None
    model_file: str | None
    rank: int
    world_size: int
    local_world_size: int
    monitor: MonitorPlan | None = None
    estimate: dict | None = None
    hf_model: str | None = None
    hf_vocab_size: int | None = None
    precision_said: str = ""
    """The precision as the start line says it: ``fp32 (auto: CPU without bf16 units (avx2))``."""
    precision_warning: str = ""
    """Said on the start line when the precision is emulated here (bf16 on a CPU without bf16 units)."""
    offload_note: str = ""
    """Said on the start line when --config sets no offload and the command's default (nvme) is kept."""
    save: SavePolicy | None = None
    """--save-dir, --keep-last and the checkpoint to resume from."""
    swap: SwapLocation | None = None
    """Where the temporary swap folder goes (no --nvme-path): the temporary directory or a disk that takes O_DIRECT."""
    activation_checkpointing: bool = False
    """--activation-checkpointing: the model recomputes its blocks in backward instead of keeping their activations."""
    lora: LoraPlan | None = None
    """--lora-rank: LoRA adapters trained on the frozen --hf-model base."""
    run_settings: dict | None = None
    """The settings that decide the training (:func:`~infinity.commands.train_resume.run_settings`): saved with each
    checkpoint, compared with a --resume's."""

    @property
    def not_applicable(self) -> tuple[str, ...]:
        """DeepSpeed keys of --config accepted but with no meaning here: said once in the start lines."""
        return self.config.not_applicable

    @property
    def state_dtype(self) -> str:
        """The optimizer states' form (``zero_optimization.offload_optimizer.state_dtype``)."""
        return self.config.zero.offload_optimizer.state_dtype


def with_swap_folder(config: InfinityConfig, folder: str) -> InfinityConfig:
    """``config`` with the swap folder made for this run where it says ``TEMPORARY_SWAP_PATH``."""
    for which in OFFLOADS:
        if getattr(config.zero, f"offload_{which}").nvme_path == TEMPORARY_SWAP_PATH:
            config = config.with_offload(which, nvme_path=folder)
    return config


def _positive(name: str, value: int | float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def _dist_env() -> tuple[int, int, int]:
    """(rank, world size, ranks on this machine) from torchrun's environment; (0, 1, 1) without it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        return int(os.environ["RANK"]), world, local_rank_and_size(default_size=world)[1]
    return 0, 1, 1


def _block(raw: dict, key: str, where: str | None = None) -> dict:
    """``raw[key]`` when it is a JSON object, ``{}`` when absent; else a ``ValueError`` naming ``where``."""
    block = raw.get(key, {})
    if not isinstance(block, dict):
        raise ValueError(f"config key {where or key} must be a JSON object, got {block!r}")
    return block


def make_plan(args: argparse.Namespace) -> Plan:
    """Read the config file, apply the flags on top of it and check every input, before any work."""
    raw = read_config_json(args.config) if args.config else {}
    _block(raw, "zero_optimization")
    offload_note = kept_offload_note(args, raw)
    opt_params = _block(_block(raw, "optimizer"), "params", "optimizer.params")

    def pick(flag, from_config, default):
        return flag if flag is not None else (from_config if from_config is not None else default)

    # The run's numbers first: a Hugging Face "auto" in the file is filled from them.
    hf_model = getattr(args, "hf_model", None)
    micro_batch = pick(args.micro_batch, config_number(raw, "train_micro_batch_size_per_gpu",
                                                       "train_micro_batch_size_per_gpu"), DEFAULT_MICRO_BATCH)
    config_accum = config_number(raw, "gradient_accumulation_steps", "gradient_accumulation_steps")
    train_batch = config_number(raw, "train_batch_size", "train_batch_size")
    rank, world_size, local_world_size = _dist_env()
    if args.grad_accum is None and config_accum is None and train_batch is not None and micro_batch > 0:
        # DeepSpeed's arithmetic, as initialize does it (not a whole number: refused below, naming the three)
        config_accum = accumulation_steps_from(train_batch, micro_batch, world_size)
    grad_accum = pick(args.grad_accum, config_accum, 1)
    if sum(x is not None for x in (args.preset, args.model, hf_model)) > 1:
        raise ValueError("give --preset or --model or --hf-model, only one")
    preset = None if (args.model or hf_model) else (args.preset or _default_preset())
    hf_vocab_size = hidden_size = None
    if hf_model is not None:
        hf_config = read_hf_model_config(hf_model)
        model_seq, hf_vocab_size = hf_config["max_position_embeddings"], hf_config["vocab_size"]
        hidden_size = hf_config.get("hidden_size")
    elif preset is not None:
        preset_shape = get_preset(preset)  # unknown preset: error listing the presets
        model_seq, hidden_size = preset_shape.seq_len, preset_shape.d_model  # (d_model: the "auto" bucket sizes)
        preset = preset.lower()
    else:
        check_model_file(args.model)
        model_seq = None
        if args.model.endswith(".json"):  # a transformers config: its context and width bound the run, as --hf-model's
            model_config = read_model_config_file(args.model)
            model_seq, hidden_size = model_config["max_position_embeddings"], model_config["hidden_size"]
    lora = lora_plan(args, hf_model)
    default_lr = (LORA_LR if lora else HF_MODEL_LR) if hf_model else (
        PRESET_LR.get(preset, MODEL_FILE_LR) if preset else MODEL_FILE_LR)
    lr = pick(args.lr, config_number(opt_params, "lr", "optimizer.params.lr", integer=False), default_lr)
    steps = pick(args.steps, None, DEFAULT_STEPS)
    for name, value in (("--steps", steps), ("--micro-batch", micro_batch), ("--grad-accum", grad_accum),
                        ("--max-bytes", args.max_bytes)):
        _positive(name, value)
    finite_positive("--lr" if args.lr is not None else "optimizer.params.lr", lr)
    save_policy = train_checkpoints.save_policy(args, raw)  # (takes checkpoint.keep_last out of raw)
    if getattr(args, "extend_steps", False) and save_policy.resume is None:
        raise ValueError("--extend-steps needs --resume (of a checkpoint to extend)")
    saved = saved_settings(save_policy.resume) if save_policy.resume else None

    def saved_default(key: str, at_most):
        """Resuming, a derived default is the saved run's (--warmup's is a share of --steps, which --extend-steps
        changes); one above its bound now follows a difference that check_resume names: not used."""
        value = saved.get(key) if saved else None
        return value if isinstance(value, (int, float)) and value <= at_most else None

    min_lr = pick(args.min_lr, saved_default("min_lr", lr), lr / 10)
    if not 0 <= min_lr <= lr:
        raise ValueError(f"--min-lr must be in [0, lr={lr}], got {min_lr}")
    warmup = pick(args.warmup, saved_default("warmup", steps), max(1, steps // 20))
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    if warmup > steps:  # (the learning rate would never reach --lr, nor decay)
        raise ValueError(f"--warmup {warmup} is more than --steps {steps}: the warmup would not end before the run "
                         f"does; give a --warmup of at most {steps}")

    if args.trace:
        check_output_folder("--trace", args.trace)
    raw = complete_file(raw, args, micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size,
                         steps=steps, warmup=warmup, lr=lr, min_lr=min_lr, hidden_size=hidden_size)
    monitor = train_monitor.monitor_plan(args, raw, steps=steps)  # (--lr-schedule takes the scheduler block out)
    seq_len = pick(args.seq_len, None, min(model_seq or MAX_DEFAULT_SEQ_LEN, MAX_DEFAULT_SEQ_LEN))
    _positive("--seq-len", seq_len)
    if model_seq is not None and seq_len > model_seq:
        what = f"preset {preset!r}" if preset else f"the model in {hf_model or args.model}"
        raise ValueError(f"--seq-len {seq_len} is longer than {what} allows ({model_seq})")
    _check_flags_that_need_others(args)
    if args.save_every is not None:
        _positive("--save-every", args.save_every)
    if train_batch is not None and train_batch != micro_batch * grad_accum * world_size:
        raise ValueError(f"config key train_batch_size={raw['train_batch_size']!r} but micro-batch x grad-accum x ranks = "
                         f"{micro_batch} x {grad_accum} x {world_size} = {micro_batch * grad_accum * world_size}")

    config, precision, precision_said, precision_warning = engine_config(raw, args, micro_batch=micro_batch,
                                                                        grad_accum=grad_accum, lr=lr)

    nvme_blocks = nvme_offloads(config)
    nvme_paths = list(dict.fromkeys(b.nvme_path for b in nvme_blocks if b.nvme_path != TEMPORARY_SWAP_PATH))
    offload_param, offload_optimizer = config.zero.offload_param.device, config.zero.offload_optimizer.device
    if getattr(args, "buffered_io", False) and not nvme_blocks:
        raise ValueError(f"--buffered-io needs a tier on NVMe: nothing goes there (params -> {offload_param}, "
                         f"optimizer -> {offload_optimizer}); give --offload-param and/or --offload-optimizer nvme, "
                         f"or leave out --buffered-io")
    if args.min_lr is not None and monitor.lr_schedule == "constant":
        raise ValueError("--min-lr has no effect with --lr-schedule constant (it holds --lr after the warmup): give "
                         "another --lr-schedule (cosine, linear, wsd), or leave out --min-lr")
    if args.nvme_path and not nvme_blocks:
        raise ValueError(f"--nvme-path {args.nvme_path!r} is given but nothing goes to NVMe (params -> "
                         f"{offload_param}, optimizer -> {offload_optimizer}"
                         + (", as --config sets" if args.config else "")
                         + "): add --offload-param nvme and/or --offload-optimizer nvme (or auto), or leave out --nvme-path")
    for path in nvme_paths:
        check_writable(path)
        check_direct_io(path, config.aio.buffered_fallback)
    nvme_is_temporary = any(b.nvme_path == TEMPORARY_SWAP_PATH for b in nvme_blocks)
    swap = default_swap_location() if nvme_is_temporary else None
    if swap is not None and swap.buffered:
        config = config.with_aio(buffered_fallback=True)
    plan = Plan(config=config, steps=steps, micro_batch=micro_batch, grad_accum=grad_accum, seq_len=seq_len, lr=lr,
                min_lr=min_lr, warmup=warmup, precision=precision, offload_param=offload_param.value,
                offload_optimizer=offload_optimizer.value, nvme_path=nvme_paths[0] if nvme_paths else None,
                nvme_is_temporary=nvme_is_temporary, preset=preset, model_file=args.model, rank=rank,
                world_size=world_size, local_world_size=local_world_size, monitor=monitor,
                precision_said=precision_said, precision_warning=precision_warning,
                offload_note=offload_note, save=save_policy, hf_model=hf_model, hf_vocab_size=hf_vocab_size,
                swap=swap, activation_checkpointing=args.activation_checkpointing, lora=lora)
    plan.run_settings = run_settings(args, plan)
    if saved:
        check_resume(saved, plan.run_settings, resume=save_policy.resume,
                     extend_steps=getattr(args, "extend_steps", False))
    return plan


NEEDED = (
    ("save_every", "--save-every", "save_dir", "--save-dir"),
    ("wait_for_lock", "--wait-for-lock", "save_dir", "--save-dir (the folder whose lock it waits for)"),
    ("save_dtype", "--save-dtype", "save_pretrained", "--save-pretrained (the model it is the dtype of)"),
)
"""(flag, as said, the flag it acts with, as said): flags that do nothing without another one."""


def _check_flags_that_need_others(args: argparse.Namespace) -> None:
    """A flag that acts only with another is refused without it, naming both, rather than silently ignored."""
    for name, flag, needed, said in NEEDED:
        if getattr(args, name, None) not in (None, False) and not getattr(args, needed, None):
            raise ValueError(f"{flag} needs {said}")
    if getattr(args, "overwrite", False) and not any(getattr(args, name, None)
                                                     for name in ("save_dir", "save_pretrained", "run_dir")):
        raise ValueError("--overwrite needs --save-dir, --save-pretrained or --run-dir (a folder it lets this run "
                         "write over); a run without them writes into a new runs/ folder")


def engine_config(raw: dict, args: argparse.Namespace, *, micro_batch: int, grad_accum: int,
                  lr: float) -> tuple[InfinityConfig, str, str, str]:
    """The engine's config from the completed file (:func:`complete_file`) with the flags on top: (config,
    precision, how the start line says it, a warning when the precision is emulated here). ``args`` holds the
    engine's flags (precision, offload_param, offload_optimizer, nvme_path, optimizer_state_dtype, host_memory,
    config, trace, buffered_io). Touches no file: ``infinity estimate`` builds the same config from it."""
    # The file, read once (unknown keys and bad values named here); then the flags on top.
    config = InfinityConfig.from_deepspeed(raw)
    config, precision, precision_said, precision_warning = _apply_precision(config, args, asked_precision(raw))
    config = _apply_schedule(config, raw, micro_batch=micro_batch, grad_accum=grad_accum, lr=lr)
    config = _apply_offload(config, args, raw)
    if getattr(args, "trace", None):
        config = config.replace(trace=TraceConfig(path=args.trace))
    if getattr(args, "buffered_io", False):
        config = config.with_aio(buffered_fallback=True)
    return config, precision, precision_said, precision_warning


def complete_file(raw: dict, args: argparse.Namespace, *, micro_batch: int, grad_accum: int, world_size: int,
                   steps: int, warmup: int, lr: float, min_lr: float, hidden_size: int | None) -> dict:
    """A copy of the config file with what it leaves to the run filled in, so that it reads as a valid config:

    * Hugging Face's ``"auto"`` values, from the run's own (as its Trainer does; ``fp16.enabled: "auto"`` is off:
      fp16 is never the fast precision, bf16's ``"auto"`` is :mod:`infinity.runtime.hardware`'s);
    * an offload block on NVMe without ``nvme_path`` gets ``TEMPORARY_SWAP_PATH``: the run makes that folder;
    * ``--precision`` replaces the ``fp16`` block (its loss scaling means nothing in the precision asked for).
    """

    raw = fill_auto(raw, {
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size, "fp16.enabled": False,
        "gradient_clipping": DEFAULT_GRADIENT_CLIPPING,
        "optimizer.params.betas": list(ADAMW_DEFAULTS["betas"]), "optimizer.params.eps": ADAMW_DEFAULTS["eps"],
        "optimizer.params.weight_decay": ADAMW_DEFAULTS["weight_decay"],
    }, steps=steps, warmup=warmup, lr=lr, min_lr=min_lr, hidden_size=hidden_size)
    if args.precision is not None:
        raw.pop("fp16", None)
    zero = raw.get("zero_optimization")
    for which in OFFLOADS:
        block = zero.get(f"offload_{which}") if isinstance(zero, dict) else None
        if isinstance(block, dict) and block.get("device") == "nvme" and not block.get("nvme_path"):
            zero[f"offload_{which}"] = {**block, "nvme_path": TEMPORARY_SWAP_PATH}
    return raw


def _apply_precision(config: InfinityConfig, args: argparse.Namespace,
                     asked: str | None) -> tuple[InfinityConfig, str, str, str]:
    """--precision, else the file's, else ``auto``: (config, precision, how the start line says it, a warning when
    the precision is emulated on the device: bf16 on a CPU without bf16 units). ``auto`` is resolved for the
    config's device (bf16 where it computes it fast)."""
    requested = args.precision or asked or "auto"
    chosen = resolve_precision(requested, config.device) if requested != "fp16" else None
    precision = chosen.precision if chosen else "fp16"
    said = f"{precision} (auto: {chosen.reason})" if requested == "auto" else precision
    device = config.device if config.device not in (None, "auto") else default_device()
    fix = "--precision auto" if args.precision is not None else 'bf16.enabled: "auto" in --config (or --precision auto)'
    slow = None
    if matmuls_in_fp32(config.cpu_matmul_precision, precision, device):
        said += ", matmuls in fp32"  # not emulated: infinity.runtime.cpu_matmul
    else:
        slow = slow_precision_warning(precision, device, how_to_fix=fix)
    if args.precision is not None or asked in (None, "auto"):
        config = config.replace(precision=precision)
    return config, precision, said, f"WARNING: {slow}" if slow else ""


def _apply_schedule(config: InfinityConfig, raw: dict, *, micro_batch: int, grad_accum: int,
                    lr: float) -> InfinityConfig:
    """The batch, the learning rate, and the train command's defaults where the file gives none: AdamW's
    ``ADAMW_DEFAULTS`` without an optimizer block, ``DEFAULT_GRADIENT_CLIPPING``, ``DEFAULT_SUB_GROUP_SIZE``."""
    config = config.replace(micro_batch_size=micro_batch, gradient_accumulation_steps=grad_accum)
    if "gradient_clipping" not in raw:
        config = config.replace(gradient_clipping=DEFAULT_GRADIENT_CLIPPING)
    if raw.get("optimizer"):
        config = config.with_optimizer(lr=lr)
    else:
        config = config.with_optimizer(type="AdamW", adamw=True, lr=lr, **ADAMW_DEFAULTS)
    if "sub_group_size" not in raw.get("zero_optimization", {}):
        config = config.with_zero(sub_group_size=DEFAULT_SUB_GROUP_SIZE)
    return config


def _apply_offload(config: InfinityConfig, args: argparse.Namespace, raw: dict) -> InfinityConfig:
    """--offload-param/--offload-optimizer, --nvme-path, --optimizer-state-dtype and --host-memory.

    Without a flag, an offload the config file sets is the file's; one it does not set keeps the command's
    default, NVMe (the `make train` job), and the start line says so (``Plan.offload_note``): a file holding only
    a batch size does not move the states into memory. `--offload-* nvme` means the disk: nothing kept in host memory unless the file says
    otherwise (``max_in_cpu``); with --host-memory, NVMe is a spill tier under that budget: the engine keeps in
    host memory what fits."""
    zero_raw = raw.get("zero_optimization", {})
    for which in OFFLOADS:
        block = getattr(config.zero, f"offload_{which}")
        flag = getattr(args, f"offload_{which}")
        file_sets = isinstance(zero_raw, dict) and f"offload_{which}" in zero_raw
        device = OffloadDevice(flag if flag is not None else (block.device if file_sets else OffloadDevice.NVME))
        changes: dict = {"device": device}
        if device == OffloadDevice.AUTO and args.nvme_path:  # auto spills to NVMe only where a path is given
            changes["nvme_path"] = args.nvme_path
        if device == OffloadDevice.NVME:
            changes["nvme_path"] = args.nvme_path or block.nvme_path or TEMPORARY_SWAP_PATH
            file_block = zero_raw.get(f"offload_{which}")
            if args.host_memory is None and not (isinstance(file_block, dict) and "max_in_cpu" in file_block):
                changes["max_in_cpu"] = 0
        elif block.nvme_path == TEMPORARY_SWAP_PATH:  # (the file's NVMe block, moved off NVMe by a flag)
            changes["nvme_path"] = None
        if which == "optimizer" and device not in (OffloadDevice.CPU, OffloadDevice.NVME) and block.ratio < 1.0:
            changes["ratio"] = 1.0  # the file's split was of its own offload; a flag moved the optimizer elsewhere
        if which == "optimizer" and getattr(args, "optimizer_state_dtype", None) is not None:
            changes["state_dtype"] = args.optimizer_state_dtype
        config = config.with_offload(which, **changes)
    if args.host_memory is not None:
        config = config.with_zero(host_memory_budget=args.host_memory)
    return config


def kept_offload_note(args: argparse.Namespace, raw: dict) -> str:
    """The start line's note when --config is given but sets an offload that no flag gives: the command's default
    (nvme) is kept, said with the flag that changes it; ``""`` otherwise."""
    if not args.config:
        return ""
    zero = raw.get("zero_optimization")
    kept = [which for which in OFFLOADS if getattr(args, f"offload_{which}") is None
            and not (isinstance(zero, dict) and f"offload_{which}" in zero)]
    if not kept:
        return ""
    flags = " and ".join(f"--offload-{which}" for which in kept)
    keys = " or ".join(f"zero_optimization.offload_{which}" for which in kept)
    return (f"note: {args.config} sets no {keys}: on nvme, this command's default ({flags} choose"
            f"{'s' if len(kept) == 1 else ''} otherwise)")


def _default_preset() -> str:
    return DEFAULT_PRESET
