"""``infinity train``: train a GPT-style model on bytes of text with its states offloaded.

With no arguments it trains the ``small`` preset on the Python standard
library's source, parameters and optimizer states on NVMe in a private
temporary directory, in the machine's fast precision (bf16 or fp32: ``--precision
auto``), long enough to see the loss fall from ~5.5 to under 3 (a few minutes on 2 CPU cores). Examples::

    infinity train --preset 125m --steps 1000 --offload-param cpu --offload-optimizer nvme --nvme-path /mnt/nvme
    infinity train --model my_model.py --data corpus/ --config ds_config.json --json
    infinity train --hf-model ./my-llama --data notes.txt --steps 100 --save-pretrained ./my-llama-tuned
    infinity train --hf-model ./my-llama --data notes.txt --lora-rank 16 --save-pretrained ./my-llama-lora
    infinity train --preset tiny --eval-every 20 --sample-every 50 --prompt "def " --run-dir runs/tiny
    torchrun --nproc_per_node 2 -m infinity.cli train --preset 10m

A DeepSpeed-style ``--config`` JSON is read first; flags given explicitly
override it. Every input is checked before any work: the corpus, the preset,
the config, the NVMe path, and that the disk has room for the estimated swap.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time

from infinity.commands import train_checkpoints, train_lora, train_monitor, train_resume
from infinity.commands.hf_model import save_pretrained_with_tokenizer
from infinity.commands.train_checkpoints import engine_has_checkpoints, save, stop_on_nonfinite, stop_on_signal
from infinity.commands.train_checks import default_swap_location  # noqa: F401 (a name tests patch here)
from infinity.commands.train_checks import check_memory, check_nvme_room
from infinity.commands.train_estimate import estimate_for, run_step_shape
from infinity.commands.train_lora import LORA_LR, save_lora_with_tokenizer, trainable_numel, with_lora
from infinity.commands.train_monitor import print_summary
from infinity.commands.train_outputs import (DEFAULT_SAVE_DTYPE, check_output_room, check_outputs_writable,
                                             hold_save_dir_for_run)
from infinity.commands.train_plan import (DEFAULT_LR, DEFAULT_MICRO_BATCH, DEFAULT_STEPS,  # noqa: F401 (the command's)
                                          DEFAULT_SUB_GROUP_SIZE, HF_MODEL_LR, MODEL_FILE_LR, PRESET_LR, Plan,
                                          make_plan, with_swap_folder)
from infinity.commands.train_signals import Cleanup, GracefulStop
from infinity.commands.train_step_time import measured_over_predicted, predicted_step
from infinity.config.lr_schedule import lr_at
from infinity.config.tier_names import OFFLOAD_DEVICES, TIERS
from infinity.config.units import parse_host_memory
from infinity.engine.engine import initialize
from infinity.hf.pretrained import build_meta_causal_lm
from infinity.models.gpt import GPT, count_params, get_preset, load_model_file
from infinity.models.transformers_lm import causal_lm_loss
from infinity.optim.param_groups import decay_matrices_only
from infinity.placement.report import (format_bytes, format_device_budget, format_optimizer_split,
                                      format_split_choice)
from infinity.runtime.comm import process_group_backend
from infinity.runtime.rss import peak_rss_bytes
from infinity.runtime.hardware import PRECISION_CHOICES
from infinity.train.data import ByteCorpus
from infinity.train.evaluation import Validation, carve_held_out
from infinity.train.hf_data import hf_corpus, hf_held_out

logger = logging.getLogger(__name__)

META_BUILD_ABOVE = 10**9
"""Presets with more parameters are built on the meta device and materialized by the engine."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Defaults are None so that a flag given explicitly is told from one left out: those left
    # out take the --config file's value, then the built-in default (shown in the help).
    what = p.add_argument_group("model and data")
    what.add_argument("--preset", metavar="NAME", help="GPT preset (default small); see `infinity estimate --help`")
    what.add_argument("--model", metavar="FILE",
                      help="a Python file defining build_model() -> nn.Module whose forward(input_ids, targets) "
                           "returns the loss, or a Hugging Face transformers config .json")
    what.add_argument("--hf-model", metavar="DIR",
                      help="fine-tune the Hugging Face causal LM in this local folder (config.json + safetensors); "
                           "text is tokenized with its tokenizer when the folder has one")
    what.add_argument("--data", metavar="PATH", help="a text file or folder (default: the Python standard library's source)")
    what.add_argument("--max-bytes", type=int, metavar="N", default=8 * 2**20,
                      help="read at most this many bytes of the corpus (default 8 MiB)")
    run_ = p.add_argument_group("schedule")
    run_.add_argument("--steps", type=int, metavar="N", help=f"optimizer steps (default {DEFAULT_STEPS})")
    run_.add_argument("--micro-batch", type=int, metavar="N", help=f"sequences per micro-batch per rank (default {DEFAULT_MICRO_BATCH})")
    run_.add_argument("--grad-accum", type=int, metavar="N", help="micro-batches per optimizer step (default 1)")
    run_.add_argument("--seq-len", type=int, metavar="N", help="bytes (tokens with --hf-model's tokenizer) per sequence (default: the model's, at most 256)")
    run_.add_argument("--lr", type=float,
                      help=f"peak learning rate (default: the preset's, {DEFAULT_LR} for small; {MODEL_FILE_LR} for --model; "
                           f"{HF_MODEL_LR} for --hf-model, {LORA_LR} with --lora-rank)")
    run_.add_argument("--min-lr", type=float, help="final learning rate of the decay (default lr/10)")
    run_.add_argument("--warmup", type=int, metavar="N", help="linear warmup steps (default 5%% of --steps)")
    run_.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order (default 0)")
    eng = p.add_argument_group("engine")
    eng.add_argument("--config", metavar="FILE", help="DeepSpeed-style JSON config; flags given override it")
    eng.add_argument("--offload-param", choices=OFFLOAD_DEVICES, help="where compute shards rest (default nvme)")
    eng.add_argument("--offload-optimizer", choices=(*OFFLOAD_DEVICES, "auto"),
                     help="where master + moments rest (default nvme); auto: the sub-groups that fit the device-memory "
                          "budget on the device, the rest in host memory (and on NVMe under --nvme-path, when given)")
    eng.add_argument("--optimizer-state-dtype", choices=("fp32", "bf16", "int8"),
                     help="form of master + moments in every tier: fp32 (12 B an element), bf16 (6 B), int8 "
                          "(~4.03 B) (default fp32, or the config's offload_optimizer.state_dtype)")
    eng.add_argument("--nvme-path", metavar="DIR", help="folder for swap files (default: a private temporary folder, removed at exit)")
    eng.add_argument("--host-memory", metavar="SIZE", type=_host_memory,
                     help="host-memory budget of each rank: bytes (8GiB) or a fraction of the available memory "
                          "(0.5, 50%%); default 80%% of what is available. With nvme configured, what fits stays "
                          "in host memory")
    eng.add_argument("--precision", choices=PRECISION_CHOICES,
                     help="compute precision (default auto: bf16 where the device computes it fast, else fp32)")
    eng.add_argument("--buffered-io", action="store_true",
                     help="swap through the page cache where --nvme-path does not take O_DIRECT (tmpfs); config "
                          "aio.buffered_fallback")
    eng.add_argument("--trace", metavar="PATH", help="write a Chrome trace of compute, I/O and collectives")
    eng.add_argument("--activation-checkpointing", action="store_true",
                     help="recompute each block in backward instead of keeping its activations (the model's "
                          "activation_checkpointing_enable(), as Hugging Face's): long sequences take less memory")
    out = p.add_argument_group("checkpoints and output")
    out.add_argument("--save-dir", metavar="DIR", help="save checkpoints here (at the end, and every --save-every steps)")
    out.add_argument("--save-every", type=int, metavar="N", help="steps between checkpoints (needs --save-dir)")
    train_checkpoints.add_arguments(out)
    train_resume.add_arguments(out)
    out.add_argument("--wait-for-lock", action="store_true",
                     help="when another live run holds --save-dir, wait for it to end instead of refusing to start")
    out.add_argument("--save-pretrained", metavar="OUT",
                     help="at the end, write the model in the Hugging Face layout (with --hf-model: and its tokenizer; "
                          "with --lora-rank: the adapters, in peft's layout, or with --merge-lora the merged model)")
    out.add_argument("--save-dtype", choices=("fp32", "bf16", "fp16"),
                     help=f"dtype of --save-pretrained (default {DEFAULT_SAVE_DTYPE})")
    out.add_argument("--json", action="store_true", help="end with one JSON line: losses, tokens_per_s, peak_rss_bytes, ...")
    train_lora.add_arguments(p)
    train_monitor.add_arguments(p)


def _host_memory(text: str):
    try:
        return parse_host_memory(text, key="--host-memory")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# --------------------------------------------------------------------------- running


def run(args: argparse.Namespace) -> int:
    plan = make_plan(args)
    check_outputs_writable(args, plan)
    cleanup = Cleanup()
    try:
        lock = hold_save_dir_for_run(args, plan.rank)  # this run owns --save-dir until it ends
        if lock is not None:
            cleanup.locks.append(lock)  # released last, also by a second signal's exit
            if lock.waited:  # the run it waited for may have saved there: --resume and --overwrite see that now
                plan = make_plan(args)
        corpus, validation = _corpora(args, plan)
        if (args.save_dir or args.resume) and not engine_has_checkpoints():
            raise ValueError("--save-dir/--resume: this build of the engine cannot save or load checkpoints yet")
        if plan.preset is not None:  # a preset's size is known without building it
            plan.estimate = estimate_for(plan, get_preset(plan.preset))
            check_nvme_room(plan)
            check_output_room(args, plan, count_params(get_preset(plan.preset)), warn=_warn)
            check_memory(plan)
        # SIGTERM/SIGINT: checkpoint at the step's end, swap folder removed
        with GracefulStop(cleanup, save_dir=args.save_dir) as stop:
            if plan.nvme_is_temporary:
                plan.nvme_path = cleanup.temporary_folder(plan.swap.parent)
            plan.config = with_swap_folder(plan.config, plan.nvme_path)
            return _train(args, plan, corpus, validation, cleanup, stop)
    finally:
        cleanup.run()


def _warn(text: str) -> None:
    print(f"infinity train: {text}", file=sys.stderr, flush=True)


def _corpora(args: argparse.Namespace, plan: Plan):
    """The training corpus, and the validation batches when --eval-every asks for them."""

    monitor = plan.monitor
    if plan.hf_model is not None:
        ids = dict(vocab_size=plan.hf_vocab_size, seq_len=plan.seq_len, micro_batch=plan.micro_batch, seed=args.seed,
                   rank=plan.rank, world_size=plan.world_size, max_bytes=args.max_bytes)
        if not monitor.eval_every:
            return hf_corpus(plan.hf_model, args.data, **ids), None
        corpus, held_out = hf_held_out(plan.hf_model, args.data, val_path=monitor.val_data,
                                       val_fraction=monitor.val_fraction, **ids)
        validation = Validation(held_out, batches=monitor.eval_batches, seq_len=plan.seq_len,
                                micro_batch=plan.micro_batch, seed=args.seed, rank=plan.rank, world_size=plan.world_size)
        validation.description = held_out.description
        return corpus, validation
    if not monitor.eval_every:
        corpus = ByteCorpus(args.data, seq_len=plan.seq_len, micro_batch=plan.micro_batch, seed=args.seed,
                            rank=plan.rank, world_size=plan.world_size, max_bytes=args.max_bytes)
        return corpus, None

    held = carve_held_out(args.data, max_bytes=args.max_bytes, seq_len=plan.seq_len, val_path=monitor.val_data,
                          val_fraction=monitor.val_fraction)
    corpus = ByteCorpus(data=held.train, seq_len=plan.seq_len, micro_batch=plan.micro_batch, seed=args.seed,
                        rank=plan.rank, world_size=plan.world_size)
    corpus.description = held.train_description
    validation = Validation(held.val, batches=monitor.eval_batches, seq_len=plan.seq_len, micro_batch=plan.micro_batch,
                            seed=args.seed, rank=plan.rank, world_size=plan.world_size)
    validation.description = held.val_description
    return corpus, validation


def _build_model(plan: Plan, seed: int):
    import torch

    torch.manual_seed(seed)
    if plan.hf_model is not None:
        return build_meta_causal_lm(plan.hf_model)
    if plan.model_file is not None:
        return load_model_file(plan.model_file)

    cfg = get_preset(plan.preset)
    if count_params(cfg) > META_BUILD_ABOVE:
        with torch.device("meta"):
            return GPT(cfg)
    return GPT(cfg)


def _with_activation_checkpointing(model):
    """``model`` recomputing its blocks in backward: its own ``activation_checkpointing_enable()`` (ours and
    Hugging Face's), or ``gradient_checkpointing_enable()`` (Hugging Face's older name)."""
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        enable = getattr(model, name, None)
        if callable(enable):
            enable()
            return model
    raise ValueError(f"--activation-checkpointing: the model ({type(model).__name__}) has no "
                     f"activation_checkpointing_enable() or gradient_checkpointing_enable() to call; give it one "
                     f"(wrapping its blocks in torch.utils.checkpoint.checkpoint), or leave out the flag")


def _init_distributed(plan: Plan, cleanup: Cleanup) -> None:
    if plan.world_size == 1:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend=process_group_backend())
        cleanup.callbacks.append(dist.destroy_process_group)


def _train(args: argparse.Namespace, plan: Plan, corpus, validation, cleanup: Cleanup, stop: GracefulStop) -> int:
    from tqdm import tqdm

    is_main = plan.rank == 0
    say = (lambda *a, **k: print(*a, **k, flush=True)) if is_main else (lambda *a, **k: None)

    model = _build_model(plan, args.seed)
    if plan.lora is not None:
        model = with_lora(model, plan.lora)
    if plan.activation_checkpointing:
        _with_activation_checkpointing(model)
    num_params = sum(p.numel() for p in model.parameters())
    trainable = trainable_numel(model)
    # what --save-pretrained writes: the adapters, or the merged base (without the adapters), or the whole model
    saved_params = (num_params - trainable if plan.lora.merge else trainable) if plan.lora is not None else num_params
    if plan.estimate is None:  # a user's model: its size is known once built
        plan.estimate = estimate_for(plan, model)
        check_nvme_room(plan)
        check_output_room(args, plan, saved_params, warn=_warn if is_main else None)
        check_memory(plan)
    # transformers' own rule (the Trainer's get_decay_parameter_names) would need the optional package here, and
    # it has changed between its versions; on the usual architectures it names the same tensors as this one
    param_groups = decay_matrices_only(model, plan.config.optimizer.weight_decay)

    what = (f"preset {plan.preset}" if plan.preset else
            f"Hugging Face model {plan.hf_model}" if plan.hf_model else f"model {plan.model_file}")
    say(f"infinity train: {what}, {num_params:,} parameters; {corpus.description}")
    if plan.lora is not None:
        say(f"  {plan.lora.describe(model)}: {trainable:,} trainable parameters ({100 * trainable / num_params:.2f}%), "
            f"the base frozen")
    if validation is not None:
        say(f"  validation: {plan.monitor.eval_batches} micro-batch(es) of {validation.description}, "
            f"every {plan.monitor.eval_every} steps")
    say(f"  {plan.steps} steps x {plan.world_size} rank(s) x {plan.grad_accum} micro-batch(es) x {plan.micro_batch} x "
        f"{plan.seq_len} {getattr(corpus, 'unit', 'bytes')}; {plan.precision_said or plan.precision}; "
        f"params -> {plan.offload_param}, optimizer -> {plan.offload_optimizer}"
        + (f" ({plan.nvme_path})" if plan.nvme_path else "") + f"; optimizer states {plan.state_dtype}; "
        + _decay_said(param_groups))
    if plan.precision_warning:
        say(f"  {plan.precision_warning}")
    if plan.offload_note:
        say(f"  {plan.offload_note}")
    if plan.swap is not None and plan.swap.note:
        say(f"  {plan.swap.note}")
        if plan.swap.buffered and is_main:
            print(f"infinity train: {plan.swap.note}", file=sys.stderr, flush=True)
    if plan.not_applicable:
        say(f"  config keys accepted but not used here: {', '.join(plan.not_applicable)}")
    accounted, activations = plan.estimate["accounted"], plan.estimate["tiers"]["device"]["activations"]
    say("  estimate per rank: " + ", ".join(f"{t} {format_bytes(accounted[t])}" for t in TIERS)
        + (f"; plus activations {format_bytes(activations)}" if activations else ""))
    prediction, prediction_line = predicted_step(plan, model)
    say(f"  {prediction_line}")

    _init_distributed(plan, cleanup)
    engine = initialize(model, plan.config, weights=plan.hf_model, step_shape=run_step_shape(plan, model),
                        param_groups=param_groups)
    cleanup.callbacks.append(engine.close)
    say(f"  {engine.placement.describe()}")
    metrics = engine.step_metrics()
    if engine.placement.split:
        say(f"  {format_optimizer_split(metrics['optimizer_states'])}")
    if "optimizer_split" in metrics:
        split = metrics["optimizer_split"]
        say(f"  optimizer split: {split['device_sub_groups']} of {split['sub_groups']} sub-groups on the device, "
            f"{format_split_choice(split)}; {format_device_budget(split)}")

    start_step = 0
    losses: list[float] = []
    resume = plan.save.resume
    if resume:
        client = train_checkpoints.load(engine, resume)
        start_step = int(client.get("step", 0))
        losses = list(client.get("losses", []))
        if "corpus" in client:
            corpus.load_state_dict(client["corpus"])
        say(f"  resumed from {resume} at step {start_step}")
    elif args.resume is not None:
        say(f"  --resume: {args.save_dir} holds no checkpoint yet; starting at step 0")

    tokens_per_step = plan.world_size * plan.grad_accum * plan.micro_batch * plan.seq_len
    monitor = train_monitor.RunMonitor(plan.monitor, total_steps=plan.steps, tokens_per_step=tokens_per_step,
                                       seq_len=plan.seq_len, validation=validation, is_main=is_main,
                                       resume_after=start_step if resume else None, say=say,
                                       codec=getattr(corpus, "codec", None))
    cleanup.callbacks.append(monitor.close)
    report_every = max(1, plan.steps // 10)
    bar = tqdm(total=plan.steps, initial=start_step, disable=not is_main, file=sys.stderr, unit="step",
               dynamic_ncols=True, leave=False)
    if is_main:  # samples print above the progress bar
        monitor.say = lambda text: bar.write(text, file=sys.stdout)
    train_s, step_seconds = 0.0, []
    for step in range(start_step, plan.steps):
        t0 = time.perf_counter()
        if plan.monitor.lr_schedule != "deepspeed":  # (else the engine sets it from the config's scheduler block)
            engine.lr = lr_at(step, peak_lr=plan.lr, warmup_steps=plan.warmup, total_steps=plan.steps,
                              min_lr=plan.min_lr, schedule=plan.monitor.lr_schedule,
                              decay_fraction=plan.monitor.decay_fraction)
        step_loss = 0.0
        for micro in range(plan.grad_accum):
            input_ids, targets = corpus.next_batch()
            loss = causal_lm_loss(engine, input_ids, targets)
            # Every rank learns of a non-finite loss on any rank before backward, so all stop together.
            micro_loss = _mean_over_ranks(float(loss.detach()), plan.world_size)
            if not math.isfinite(micro_loss):
                del loss
                bar.close()
                monitor.log_nonfinite(step + 1, micro_loss)
                return stop_on_nonfinite(args, plan, engine, corpus, losses, step, micro, micro_loss)
            engine.backward(loss)
            engine.step()
            step_loss += micro_loss / plan.grad_accum
        grad_norm = engine.get_global_grad_norm()
        if grad_norm is not None and not math.isfinite(grad_norm):  # (the same on every rank: it is all-reduced)
            bar.close()
            monitor.log_nonfinite(step + 1, step_loss)
            return stop_on_nonfinite(args, plan, engine, corpus, losses, step, 0, grad_norm, applied=True)
        dt = time.perf_counter() - t0
        train_s += dt
        step_seconds.append(dt)
        losses.append(step_loss)
        progress = monitor.after_step(engine, step + 1, step_loss, dt)
        bar.set_postfix_str(progress, refresh=False)
        bar.update(1)
        if is_main and ((step + 1) % report_every == 0 or step == start_step):
            bar.write(f"step {step + 1:>5}/{plan.steps}  lr {engine.step_metrics().get('lr', engine.lr):.2e}  {progress}",
                      file=sys.stdout)
        if args.save_dir and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < plan.steps:
            save(engine, args.save_dir, step + 1, corpus, losses, plan.save.keep_last,
                 run=plan.run_settings, stop=stop)
        if stop.requested(plan.world_size) and step + 1 < plan.steps:
            bar.close()
            return stop_on_signal(args, plan, engine, monitor, corpus, losses, step + 1, stop)
    bar.close()
    if args.save_dir:
        save(engine, args.save_dir, plan.steps, corpus, losses, plan.save.keep_last, run=plan.run_settings,
             stop=stop)
    save_dtype = args.save_dtype or DEFAULT_SAVE_DTYPE
    if getattr(args, "save_pretrained", None) and plan.lora is not None:
        with stop.writing_model(args.save_pretrained):
            say(save_lora_with_tokenizer(engine, model, plan.lora, args.save_pretrained, dtype=save_dtype,
                                         source=plan.hf_model))
    elif getattr(args, "save_pretrained", None):
        with stop.writing_model(args.save_pretrained):
            say(save_pretrained_with_tokenizer(engine, args.save_pretrained, dtype=save_dtype, source=plan.hf_model))
    engine.close()
    monitor.close()

    steps_run = plan.steps - start_step
    tokens_per_s = steps_run * tokens_per_step / train_s if train_s > 0 else 0.0
    summary = {
        "preset": plan.preset,
        "model": plan.model_file or plan.hf_model,
        "num_params": num_params,
        "trainable_params": trainable,
        "lora": plan.lora.describe(model) if plan.lora is not None else None,
        "steps": plan.steps,
        "world_size": plan.world_size,
        "tokens_per_step": tokens_per_step,
        "losses": losses,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "val_losses": monitor.val_losses,
        "val_loss": monitor.val_losses[-1][1] if monitor.val_losses else None,
        "tokens_per_s": tokens_per_s,
        "train_s": train_s,
        "step_s": step_seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "tiers": monitor.totals,
        "copies": monitor.copies,
        "step_outcomes": monitor.step_outcomes,
        "estimate": plan.estimate["accounted"],
        "precision": plan.precision,
        "offload_param": plan.offload_param,
        "offload_optimizer": plan.offload_optimizer,
        "optimizer_state_dtype": plan.state_dtype,
        "lr_schedule": plan.monitor.lr_schedule,
        "metrics_file": str(monitor.log.path) if monitor.log else None,
    }
    step_time, step_time_line = measured_over_predicted(prediction, step_seconds)
    summary.update(step_time)
    if is_main:
        print_summary(summary)
        if step_time_line:
            print(f"  {step_time_line}")
        if args.json:
            print(json.dumps(summary), flush=True)
    return 0


def _decay_said(param_groups: list[dict]) -> str:
    """``decay_matrices_only``'s groups in a clause of the start line."""
    decayed, kept = param_groups
    decay = decayed["weight_decay"]
    if not decay:
        return "no weight decay"
    return f"weight decay {decay:g} on {len(decayed['params'])} tensors (2-D and up), none on {len(kept['params'])}"


def _mean_over_ranks(value: float, world_size: int) -> float:
    if world_size == 1:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / world_size
