"""``infinity estimate``: bytes per rank in each tier (device, host, nvme) for a model and an offload setting.

    infinity estimate --params 7B --world-size 8 --offload-param nvme --offload-optimizer nvme
    infinity estimate --preset 1.3b --micro-batch 4 --json
    infinity estimate --hf-model ./my-llama --config ds_config.json --cpu
    infinity estimate --params 7B --trainable-params 4M --offload-param nvme --offload-optimizer cpu   # LoRA
    infinity estimate --hf-model ./my-llama --lora-rank 16 --offload-param nvme --offload-optimizer cpu  # exactly
    infinity estimate --max-params --offload-param nvme --offload-optimizer nvme --optimizer-state-dtype int8 --cpu \\
        --host-memory 7GiB --nvme-path /mnt/nvme --seq-len 16

The settings are read as ``infinity train`` reads them: the ``--config`` file (DeepSpeed-style JSON) first, then the
flags given, then the train command's defaults (both offloads on NVMe, gradient clipping 1.0, ...). The engine's
config is built by the same code as train's, and the figures come from the same function, so the NVMe bytes said
here are the bytes ``infinity train`` reserves for the same settings, the extents kept to undo a speculative step
included. Prints the setting broken down by kind of state, then every offload alternative (none/cpu/nvme for
parameters x optimizer) for comparison.
Then the step-time model's predicted step on this machine and the resource that binds it (from the
figures `infinity bench --machine` cached; ``--json`` has them under ``step_time``).
With ``--max-params``: the largest GPT of our presets' shape that this machine's host memory (``--host-memory``,
default 80%% of what is available) and disk (the free room under ``--nvme-path``) hold in that setting, and the
bytes a parameter takes in each tier.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import asdict

from infinity.commands import train_lora
from infinity.commands.hf_model import read_hf_model_config
from infinity.commands.train_checks import config_number
from infinity.commands.train_estimate import device_memory_apart, model_decays, model_numels, model_trainable
from infinity.commands.train_lora import lora_plan, with_lora
from infinity.commands.train_plan import (DEFAULT_LR, DEFAULT_MICRO_BATCH, DEFAULT_STEPS, MAX_DEFAULT_SEQ_LEN,
                                          complete_file, engine_config, kept_offload_note)
from infinity.config.schema import InfinityConfig, read_config_json
from infinity.config.tier_names import OFFLOAD_DEVICES
from infinity.config.units import parse_host_memory
from infinity.hf.pretrained import build_meta_causal_lm
from infinity.models.gpt import get_preset
from infinity.placement.estimate import estimate_for_config, estimate_settings
from infinity.placement.estimate_gpt import gpt_activation_nbytes
from infinity.placement.max_model import max_gpt
from infinity.placement.report import format_estimated_split, format_max_gpt, format_table, parse_count
from infinity.placement.split_choice import step_shape_of
from infinity.placement.step_time import format_prediction, predict_from_estimate
from infinity.runtime.machine_figures import cache_path, load_cached

MAX_PARAMS = 10**15
"""A quadrillion parameters: above that a count is a typo, not a model."""


def _count(text: str) -> int:
    try:
        return parse_count(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _host_memory(text: str):
    try:
        return parse_host_memory(text, key="--host-memory")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Defaults are None so that a flag given is told from one left out: those left out take the --config file's
    # value, then the train command's default (shown in the help).
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=_count, metavar="N", help="parameter count: 7B, 350M, 1.3e9, ...")
    model.add_argument("--preset", metavar="NAME", help="one of our GPT presets (exact layout and activations)")
    model.add_argument("--hf-model", metavar="DIR",
                       help="a local Hugging Face model folder: the shapes from its config.json (no weights needed; "
                            "needs transformers)")
    model.add_argument("--max-params", action="store_true",
                       help="the largest GPT of our presets' shape that fits --host-memory and the disk under "
                            "--nvme-path in this setting, with its bytes per parameter in each tier")
    p.add_argument("--config", metavar="FILE",
                   help="DeepSpeed-style JSON config, read as `infinity train --config` reads it; flags given override it")
    p.add_argument("--world-size", type=int, default=1, metavar="N", help="number of ranks (default 1)")
    p.add_argument("--offload-param", choices=OFFLOAD_DEVICES,
                   help="where compute shards rest (default: the config's, else nvme as in `infinity train`)")
    p.add_argument("--offload-optimizer", choices=(*OFFLOAD_DEVICES, "auto"),
                   help="where master + moments rest (default: the config's, else nvme as in `infinity train`); auto: "
                        "the sub-groups that fit the device-memory budget on the device, the rest offloaded")
    p.add_argument("--precision", choices=("auto", "bf16", "fp16", "fp32"),
                   help="compute precision (default: the config's, else auto as in `infinity train`: bf16 where this "
                        "machine computes it fast, else fp32)")
    p.add_argument("--optimizer-state-dtype", choices=("fp32", "bf16", "int8"),
                   help="form of master + moments: fp32 (12 B an element), bf16 (6 B), int8 (~4.03 B) (default fp32)")
    p.add_argument("--micro-batch", type=int, metavar="N",
                   help=f"micro-batch per rank (default: the config's, else {DEFAULT_MICRO_BATCH} as in "
                        f"`infinity train`)")
    p.add_argument("--grad-accum", type=int, metavar="N",
                   help="micro-batches per step; more than 1 keeps gradients in fp32 (default 1)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help=f"tokens per sample (with --preset or --hf-model; default: the model's context, at most "
                        f"{MAX_DEFAULT_SEQ_LEN}, as in `infinity train`)")
    p.add_argument("--largest-layer", type=_count, default=None, metavar="N",
                   help="parameters of the largest layer (default: from the model, or a GPT of that size)")
    p.add_argument("--max-live-parameters", type=_count, metavar="N",
                   help="gathered parameter budget on the device (default 1e9)")
    p.add_argument("--prefetch-bucket-size", type=_count, metavar="N",
                   help="parameters swapped in ahead of need with --offload-param nvme (default 5e7)")
    p.add_argument("--max-reuse-distance", type=_count, metavar="N",
                   help="parameters used again within this many stay gathered (default 1e9)")
    p.add_argument("--param-persistence-threshold", type=_count, metavar="N",
                   help="parameters this small stay gathered (default 1e5)")
    p.add_argument("--max-in-cpu", type=_count, metavar="N",
                   help="shard elements kept in host memory with --offload-param nvme (default 0, as "
                        "`infinity train` sets it; the engine's config default is 1e9)")
    p.add_argument("--sub-group-size", type=_count, metavar="N",
                   help="optimizer elements stepped at once (default 1e8, the engine's)")
    p.add_argument("--optimizer-buffer-count", type=int, metavar="N",
                   help="host staging sets with the optimizer on NVMe (offload_optimizer.buffer_count, default 4)")
    p.add_argument("--buffer-count", type=int, metavar="N", help="host buffers for NVMe params (default 5)")
    p.add_argument("--buffer-size", type=_count, metavar="N",
                   help="elements per host buffer for NVMe params (default 1e8)")
    device = p.add_mutually_exclusive_group()
    device.add_argument("--cpu", action="store_true",
                        help="the ranks compute on the CPU (no GPU): NVMe reads need no host buffers (default: as "
                             "`infinity train` on this machine: on a GPU where CUDA is available)")
    device.add_argument("--gpu", action="store_true",
                        help="the ranks compute on a GPU, its memory apart from the host's (to plan for another "
                             "machine)")
    p.add_argument("--host-memory", metavar="SIZE", type=_host_memory, default=None,
                   help="host-memory budget per rank (8GiB, or a fraction of the available memory: 0.5, 50%%): "
                        "NVMe becomes a spill tier under it, as in the engine (default: as `infinity train`, 80%% of "
                        "the memory this machine has available; give bytes to plan for another machine)")
    add_trainable_argument(p)
    train_lora.add_arguments(p, training=False)
    p.add_argument("--nvme-path", metavar="DIR", default=None,
                   help="with --max-params: the disk whose free room NVMe states may take (default: the temporary "
                        "folder's)")
    p.add_argument("--device-memory", metavar="SIZE", default=None,
                   help="with --max-params: device memory per rank (default: no bound on it)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="the GPT recomputes each block in backward: a block keeps only its input (with --preset "
                        "or --max-params)")


def add_trainable_argument(p: argparse.ArgumentParser) -> None:
    """``--trainable-params N``: a frozen base (LoRA adapters on it, say) has no gradient, master or moments."""
    p.add_argument("--trainable-params", type=_count, default=None, metavar="N",
                   help="parameters that train, e.g. LoRA adapters on a frozen base: only they get a gradient, "
                        "a master and moments (default: all)")


def trainable_params(args: argparse.Namespace, num_params: int) -> int | None:
    """``--trainable-params``, checked against the model's size."""
    n = args.trainable_params
    if n is not None and not 0 <= n <= num_params:
        raise ValueError(f"--trainable-params {n:,} must be between 0 and the model's {num_params:,} parameters")
    return n


ZERO_FLAGS = {"max_live_parameters": "max_live_parameters", "prefetch_bucket_size": "prefetch_bucket_size",
              "max_reuse_distance": "max_reuse_distance", "param_persistence_threshold": "param_persistence_threshold",
              "sub_group_size": "sub_group_size"}
"""Flags (as argparse names them) -> ``zero_optimization`` fields, applied on top of the config when given."""
OFFLOAD_FLAGS = {"max_in_cpu": ("param", "max_in_cpu"), "buffer_count": ("param", "buffer_count"),
                 "buffer_size": ("param", "buffer_size"), "optimizer_buffer_count": ("optimizer", "buffer_count")}
"""Flags -> (offload block, field), applied on top of the config when given."""


def _engine_config(args: argparse.Namespace, raw: dict, offload: tuple[str | None, str | None]) -> tuple[InfinityConfig, str]:
    """The config ``infinity train`` would build from ``raw`` and these flags (``offload``: the two offload flags),
    with the estimate's engine flags on top: (config, the precision as said)."""
    micro_batch = _pick(args.micro_batch, config_number(raw, "train_micro_batch_size_per_gpu",
                                                        "train_micro_batch_size_per_gpu"), DEFAULT_MICRO_BATCH)
    grad_accum = _pick(args.grad_accum, config_number(raw, "gradient_accumulation_steps",
                                                      "gradient_accumulation_steps"), 1)
    optimizer = raw.get("optimizer") if isinstance(raw.get("optimizer"), dict) else {}
    params = optimizer.get("params") if isinstance(optimizer.get("params"), dict) else {}
    lr = config_number(params, "lr", "optimizer.params.lr", integer=False) or DEFAULT_LR  # (no bytes depend on it)
    engine_args = argparse.Namespace(config=args.config, precision=args.precision, offload_param=offload[0],
                                     offload_optimizer=offload[1], nvme_path=None, host_memory=args.host_memory,
                                     optimizer_state_dtype=args.optimizer_state_dtype)
    completed = complete_file(raw, engine_args, micro_batch=micro_batch, grad_accum=grad_accum,
                              world_size=args.world_size, steps=DEFAULT_STEPS, warmup=max(1, DEFAULT_STEPS // 20),
                              lr=lr, min_lr=lr / 10, hidden_size=args.hidden_size)
    config, _, said, _ = engine_config(completed, engine_args, micro_batch=micro_batch, grad_accum=grad_accum, lr=lr)
    zero = {field: getattr(args, flag) for flag, field in ZERO_FLAGS.items() if getattr(args, flag) is not None}
    if zero:
        config = config.with_zero(**zero)
    for flag, (which, field) in OFFLOAD_FLAGS.items():
        if getattr(args, flag) is not None:
            config = config.with_offload(which, **{field: getattr(args, flag)})
    return config, said


def _gpu(args: argparse.Namespace) -> bool:
    """Whether the ranks compute on a GPU with its own memory: --gpu, --cpu, else as `infinity train` finds this
    machine (CUDA available, or INFINITY_DISTINCT_DEVICE=1)."""
    if args.gpu or args.cpu:
        return args.gpu
    return device_memory_apart()


def _pick(flag, from_config, default):
    return flag if flag is not None else (from_config if from_config is not None else default)


def _model(args: argparse.Namespace, weight_decay: float) -> tuple[dict, object]:
    """(what the estimate takes of the model: param_numels or num_params, largest layer, each parameter's weight
    decay as train gives it (not with --trainable-params: train trains every parameter); the GPTConfig of a preset
    for its activations, else None)."""
    if args.preset is not None:
        cfg = get_preset(args.preset)
        if args.seq_len is not None and not 0 < args.seq_len <= cfg.seq_len:
            raise ValueError(f"--seq-len must be in 1..{cfg.seq_len} for preset {args.preset!r}, got {args.seq_len}")
        return _of_model(args, cfg, weight_decay), cfg
    if args.hf_model is not None:
        model = build_meta_causal_lm(args.hf_model)  # on the meta device: shapes, no memory, no weights read
        if args.lora is not None:  # the adapters train; the base is frozen (exact, as train lays it out)
            model = args.lora_model = with_lora(model, args.lora)
        return _of_model(args, model, weight_decay), None
    return {"num_params": args.params, "largest_layer_params": args.largest_layer}, None


def _of_model(args: argparse.Namespace, model, weight_decay: float) -> dict:
    numels, largest = model_numels(model)
    decays = model_decays(model, weight_decay) if args.trainable_params is None else None
    trains = model_trainable(model) if args.trainable_params is None else None
    return {"param_numels": numels, "largest_layer_params": args.largest_layer or largest, "param_decays": decays,
            "param_trainable": trains}


def _default_seq_len(args: argparse.Namespace, gpt_cfg) -> int | None:
    """Train's sequence without --seq-len: the model's context (a preset's, or --hf-model's), at most
    ``MAX_DEFAULT_SEQ_LEN``; None for a bare --params count."""
    if gpt_cfg is not None:
        context = gpt_cfg.seq_len
    elif args.hf_model is not None:
        context = read_hf_model_config(args.hf_model, weights=False)["max_position_embeddings"]
    else:
        return None
    return min(context, MAX_DEFAULT_SEQ_LEN)


def _hidden_size(args: argparse.Namespace) -> int | None:
    """The model's hidden size (for the config's ``"auto"`` bucket sizes, as train fills them)."""
    if args.preset is not None:
        return get_preset(args.preset).d_model
    if args.hf_model is None:
        return None
    return read_hf_model_config(args.hf_model, weights=False)["hidden_size"]


def run(args: argparse.Namespace) -> int:
    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    if args.params is not None and args.params < 1:
        raise ValueError(f"--params must be at least 1, got {args.params}")
    if args.params is not None and args.params > MAX_PARAMS:
        raise ValueError(f"--params {args.params:.3g} is more than this estimate is made for (at most {MAX_PARAMS:.0e}, "
                         f"a quadrillion); did you mean a smaller count such as 7B or 1.3e12?")
    for flag in ("grad_accum", "micro_batch"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    raw = read_config_json(args.config) if args.config else {}
    args.hidden_size = _hidden_size(args)
    args.lora = lora_plan(args, args.hf_model)
    if args.lora is not None and args.trainable_params is not None:
        raise ValueError("give --lora-rank or --trainable-params, not both (--lora-rank counts the adapters itself)")
    if args.max_params:
        config, _ = _engine_config(args, raw, (args.offload_param, args.offload_optimizer))
        return _run_max_params(args, estimate_settings(config, world_size=args.world_size, gpu=_gpu(args)),
                               micro_batch=config.micro_batch_size or 1, weight_decay=config.optimizer.weight_decay)
    config, precision_said = _engine_config(args, raw, (args.offload_param, args.offload_optimizer))
    model, gpt_cfg = _model(args, config.optimizer.weight_decay)
    total = sum(model["param_numels"]) if model.get("param_numels") is not None else model["num_params"]
    trainable = trainable_params(args, total)
    micro_batch = config.micro_batch_size or 1
    seq_len = args.seq_len or _default_seq_len(args, gpt_cfg)
    shape = step_shape_of(gpt_cfg, micro_batch=micro_batch, seq_len=seq_len,
                          recompute=args.activation_checkpointing) if gpt_cfg is not None else None

    def figures(config: InfinityConfig) -> dict:
        activations = 0 if gpt_cfg is None else gpt_activation_nbytes(
            gpt_cfg, micro_batch=micro_batch, seq_len=seq_len, precision=config.precision,
            activation_checkpointing=args.activation_checkpointing)
        result = estimate_for_config(config, **model, world_size=args.world_size, gpu=_gpu(args),
                                     activation_nbytes=activations, trainable_params=trainable, step_shape=shape)
        if gpt_cfg is not None:
            result["setting"].update(model=asdict(gpt_cfg), micro_batch=micro_batch, seq_len=seq_len,
                                     activation_checkpointing=args.activation_checkpointing)
        return result

    chosen = figures(config)
    alts = [figures(_engine_config(args, raw, (op, oo))[0]) for op in OFFLOAD_DEVICES for oo in OFFLOAD_DEVICES]
    note = kept_offload_note(argparse.Namespace(config=args.config, offload_param=args.offload_param,
                                            offload_optimizer=args.offload_optimizer), raw)
    step_time, step_note = predicted_step(chosen, micro_batch=micro_batch, seq_len=seq_len)
    if args.json:
        print(json.dumps({"estimate": chosen, "alternatives": alts, "step_time": step_time,
                          **({"step_time_note": step_note} if step_note else {})}))
        return 0
    if args.preset is not None:
        print(f"preset {args.preset}: {chosen['setting']['model']}")
    elif args.hf_model is not None:
        print(f"Hugging Face model {args.hf_model}" + (f"; {args.lora.describe(args.lora_model)}" if args.lora is not None else ""))
    print(f"as `infinity train` would run it{f' with --config {args.config}' if args.config else ''}: {precision_said}; "
          f"gradient clipping {config.gradient_clipping:g}"
          + ("; the extents that undo a speculative step are counted" if chosen["tiers"]["nvme"]["step_undo"] else ""))
    if note:
        print(note)
    print(format_table(chosen, alts))
    split_line = format_estimated_split(chosen)
    if split_line:
        print(split_line)
    print()
    print(step_note)
    return 0


def predicted_step(est: dict, *, micro_batch: int, seq_len: int | None) -> tuple[dict | None, str]:
    """The step-time model's prediction for the estimate on this machine (``{"predicted_s", "bound_by",
    "resources"}``, or None without cached figures) and a line saying it, or how to get it."""
    figures = load_cached()
    if figures is None:
        return None, (f"predicted step: no figures of this machine at {cache_path()}; "
                      f"`infinity bench --machine` measures them")
    s = est["setting"]
    where = f"{figures.machine}" + ("" if s["gpu"] == (figures.device == "cuda") else
                                     f" (its {figures.device.upper()} as the device)")
    try:
        prediction = predict_from_estimate(figures, est, micro_batch=micro_batch, seq_len=seq_len)
    except ValueError as err:  # a path the figures lack (no disk measured, say)
        return None, f"predicted step: {err}"
    tokens = f"micro-batch {micro_batch} x {seq_len or s.get('seq_len') or 1024} tokens"
    return prediction.as_dict(), f"{format_prediction(prediction)}; {tokens}, on {where}"


def _run_max_params(args: argparse.Namespace, settings: dict, *, micro_batch: int, weight_decay: float) -> int:
    """``--max-params``: the free disk under ``--nvme-path``, then the largest GPT that fits it and the host budget
    ``settings`` (:func:`~infinity.placement.estimate.estimate_settings`) resolved, each depth's sub-groups cut by
    ``weight_decay``'s groups as ``infinity train`` cuts them."""
    settings = dict(settings)
    host = settings.pop("host_memory_budget")
    nvme_path = args.nvme_path or tempfile.gettempdir()
    if not os.path.isdir(nvme_path):
        raise OSError(f"--nvme-path {nvme_path!r} is not a folder")
    disk = shutil.disk_usage(nvme_path).free
    device = parse_host_memory(args.device_memory, key="--device-memory") if args.device_memory else None
    if isinstance(device, float):
        raise ValueError(f"--device-memory must be a size (80GiB), not a fraction: {args.device_memory!r}")
    found = max_gpt(host_memory_nbytes=host, nvme_nbytes=disk, device_memory_nbytes=device,
                    micro_batch=micro_batch, seq_len=args.seq_len,
                    activation_checkpointing=args.activation_checkpointing,
                    decays=lambda cfg: model_decays(cfg, weight_decay), **settings)
    if args.json:
        print(json.dumps(dict(found, host_memory_nbytes=host, disk_free_nbytes=disk, nvme_path=nvme_path)))
    else:
        print(format_max_gpt(found, host_memory_nbytes=host, nvme_nbytes=disk))
    return 0 if found["config"] is not None else 1
