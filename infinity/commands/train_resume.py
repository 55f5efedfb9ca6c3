"""The run a checkpoint of ``infinity train`` belongs to: the settings that decide its training (the schedule, the
batch, the data and its order), saved with each checkpoint and compared with a ``--resume``'s flags before any work.

A resumed run that differs in one of them is not the run it continues: its learning rate would jump at the resumed
step, or its data would change under it. Each difference is refused by name, with its saved and given values.
Flags that do not change the results (logging, outputs, offload tiers, ``--run-dir``) stay free.

Extending a run (a larger ``--steps``) changes the curve of a schedule that decays to ``--steps`` (cosine, linear,
wsd, a config's scheduler): the steps already run followed the shorter curve, the rest follow the longer one from
where it stands at the resumed step, so the learning rate jumps there. That is done only when ``--extend-steps``
asks for it; a ``--warmup`` left out then keeps the saved run's (its default is a share of ``--steps``). A constant
schedule does not depend on ``--steps``: extending it needs no flag.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from infinity.checkpoint import CheckpointError
from infinity.checkpoint.files import read_meta
from infinity.checkpoint.publish import resolve_checkpoint
from infinity.commands.train_checkpoints import checkpoint_dir_and_tag

__all__ = ["RUN_KEY", "SETTINGS", "add_arguments", "check_resume", "run_settings", "saved_settings"]

RUN_KEY = "run"
"""The key of the run's settings in a checkpoint's ``client_state``."""

SETTINGS = {
    "lora": "--lora-rank", "steps": "--steps", "warmup": "--warmup", "lr": "--lr", "min_lr": "--min-lr",
    "lr_schedule": "--lr-schedule",
    "decay_fraction": "--decay-fraction", "micro_batch": "--micro-batch", "grad_accum": "--grad-accum",
    "seq_len": "--seq-len", "seed": "--seed", "data": "--data", "max_bytes": "--max-bytes",
    "held_out": "--eval-every/--val-data/--val-fraction",
    "optimizer": "--config's optimizer", "gradient_clipping": "--config's gradient_clipping",
}
"""The settings that decide the training, each with the flag that sets it (a --config key may set it too)."""


def add_arguments(group) -> None:
    group.add_argument("--extend-steps", action="store_true",
                       help="with --resume: accept a larger --steps than the checkpoint's run, though a schedule that "
                            "decays to --steps then follows a longer curve from the resumed step on (its learning "
                            "rate jumps there)")


def run_settings(args: argparse.Namespace, plan) -> dict:
    """The settings of ``plan`` that decide its training, as JSON values (``SETTINGS``' keys)."""
    monitor = plan.monitor
    held_out = None
    if monitor.eval_every:  # (the training corpus is what is not held out)
        held_out = ({"val_data": str(Path(monitor.val_data).resolve())} if monitor.val_data else
                    {"val_fraction": monitor.val_fraction})
    lora = plan.lora
    return {
        "lora": None if lora is None else {"rank": lora.rank, "alpha": float(lora.alpha),
                                           "dropout": float(lora.dropout)},
        "steps": plan.steps, "warmup": plan.warmup, "lr": plan.lr, "min_lr": plan.min_lr,
        "lr_schedule": monitor.lr_schedule,
        "decay_fraction": monitor.decay_fraction if monitor.lr_schedule == "wsd" else None,
        "micro_batch": plan.micro_batch, "grad_accum": plan.grad_accum, "seq_len": plan.seq_len, "seed": args.seed,
        "data": str(Path(args.data).resolve()) if args.data else None, "max_bytes": args.max_bytes,
        "held_out": held_out,
        "optimizer": _optimizer_said(plan.config.optimizer), "gradient_clipping": plan.config.gradient_clipping,
    }


def _optimizer_said(optimizer) -> str:
    """The optimizer's settings but its learning rate (--lr's), in one comparable line."""
    betas = ", ".join(f"{b:g}" for b in optimizer.betas)
    return (f"{optimizer.type} (betas {betas}, eps {optimizer.eps:g}, weight decay {optimizer.weight_decay:g}"
            + ("" if optimizer.bias_correction else ", no bias correction") + ")")


def saved_settings(resume: str) -> dict | None:
    """The settings saved with the checkpoint ``resume`` names (``DIR`` or ``DIR/TAG``): only ``lora`` where it was
    saved by an earlier version; None where its ``meta.json`` cannot be read (the load says why, with the tags
    beside it)."""
    try:
        meta = read_meta(resolve_checkpoint(*checkpoint_dir_and_tag(resume)))  # the checkpoint the load reads
    except (OSError, ValueError, CheckpointError):
        return None
    client_state = meta.get("client_state") or {}
    settings = client_state.get(RUN_KEY)
    settings = dict(settings) if isinstance(settings, dict) else {}
    # Whether it trained LoRA adapters, and which: peft's record (saved by earlier versions too), else none.
    peft_config = client_state.get("peft_config")
    settings["lora"] = None if not isinstance(peft_config, dict) else {
        "rank": peft_config.get("r"), "alpha": float(peft_config.get("lora_alpha") or 0),
        "dropout": float(peft_config.get("lora_dropout") or 0)}
    return settings


def _said(key: str, value) -> str:
    if value is None:
        return {"data": "the default corpus", "held_out": "none held out",
                "lora": "no LoRA adapters (the whole model trained)"}.get(key, "none")
    if key == "lora":
        return f"LoRA adapters of rank {value['rank']}, alpha {value['alpha']:g}, dropout {value['dropout']:g}"
    if key == "held_out":
        return f"--val-data {value['val_data']}" if "val_data" in value else f"--val-fraction {value['val_fraction']}"
    return str(value)


def steps_depend_on_total(lr_schedule: str) -> bool:
    """Whether the learning rate of a step depends on ``--steps`` (all but the constant schedule)."""
    return lr_schedule != "constant"


def check_resume(saved: dict, given: dict, *, resume: str, extend_steps: bool) -> None:
    """``ValueError`` naming each setting of ``given`` that differs from the checkpoint's ``saved``, with both values;
    a larger ``steps`` passes with ``extend_steps`` (or a constant schedule). Settings the checkpoint does not hold
    (saved by an earlier version) are not compared."""
    if extend_steps and isinstance(saved.get("steps"), int) and given["steps"] <= saved["steps"]:
        raise ValueError(f"--extend-steps has no effect here: --steps {given['steps']} does not extend the "
                         f"checkpoint's run of {saved['steps']} steps; give a larger --steps, or leave it out")
    differences = []
    for key, flag in SETTINGS.items():
        if key not in saved or saved[key] == given[key]:
            continue
        if key == "steps" and isinstance(saved[key], int) and given[key] > saved[key]:
            if extend_steps or not steps_depend_on_total(given["lr_schedule"]):
                continue
            differences.append(f"{flag} {given[key]} extends the run of {saved[key]} steps: its {given['lr_schedule']} "
                               f"schedule would then follow a longer curve from the resumed step on, so the learning "
                               f"rate would jump there; give --extend-steps to accept that")
            continue
        said = f"{flag}: the checkpoint's run has {_said(key, saved[key])}, given {_said(key, given[key])}"
        if key == "lora":
            lora = saved[key]
            said += (" (leave out --lora-rank)" if lora is None else
                     f" (give --lora-rank {lora['rank']} --lora-alpha {lora['alpha']:g} --lora-dropout "
                     f"{lora['dropout']:g})")
        differences.append(said)
    if differences:
        raise ValueError(f"--resume {resume}: the flags differ from the run that saved the checkpoint, and each "
                         f"difference changes its training: {'; '.join(differences)}. Give the checkpoint's values "
                         f"(or start a new run without --resume)")
