"""``infinity train --hf-model DIR --lora-rank R``: LoRA adapters trained on a frozen base streamed from its folder.

The model is built on the meta device, wrapped by ``peft``'s own ``get_peft_model`` (so the adapters, their names
and their files are ``peft``'s), and its base read from ``DIR`` into the shards by the engine: the base is never
whole in memory, and it has no gradient, master or moments in any tier. ``--save-pretrained OUT`` writes the
adapters as ``peft`` writes them (``adapter_config.json``, ``adapter_model.safetensors``; ``PeftModel.from_pretrained(base,
OUT)`` loads them), or with ``--merge-lora`` the base with them merged in (:mod:`infinity.hf.merge`), with the folder's
tokenizer.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from infinity.commands.hf_model import copy_tokenizer_files
from infinity.hf.merge import save_merged
from infinity.hf.peft_models import require_peft, wrap_with_peft
from infinity.placement.report import format_bytes

LORA_LR = 2e-4
"""The default peak learning rate with --lora-rank: adapters learn at LoRA's usual rates (peft's examples use 1e-4
to 3e-4), where full fine-tuning takes the Trainer's 5e-5."""
ALL_LINEAR = "all-linear"
"""``peft``'s name for every linear layer but the output head."""


@dataclass(frozen=True)
class LoraPlan:
    """The adapters a run trains, as ``peft.LoraConfig`` takes them."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...] | str | None
    """Module names, ``"all-linear"``, or None for ``peft``'s default for the model's type."""
    merge: bool = False
    """--merge-lora: --save-pretrained writes the merged model, not the adapters."""

    def describe(self, model: torch.nn.Module | None = None) -> str:
        """The adapters in words; with the ``peft`` model, on the modules ``peft`` chose."""
        targets = getattr(getattr(model, "peft_config", {}).get("default"), "target_modules", None)
        if targets is None:
            targets = self.target_modules
        said = ("peft's default modules" if targets is None else targets if isinstance(targets, str) else
                ", ".join(sorted(targets)))
        return f"LoRA rank {self.rank}, alpha {self.alpha:g}, dropout {self.dropout:g} on {said}"


def add_arguments(p: argparse.ArgumentParser, *, training: bool = True) -> None:
    """The LoRA flags (``training``: and what ``--save-pretrained`` writes of them)."""
    lora = p.add_argument_group("LoRA (with --hf-model; needs peft)")
    lora.add_argument("--lora-rank", type=int, metavar="R",
                      help="train LoRA adapters of rank R on the frozen base instead of every weight (peft's "
                           "LoraConfig r); the base gets no gradient, master or moments")
    lora.add_argument("--lora-alpha", type=float, metavar="A", help="the adapters' scaling alpha/R (default 2 x R)")
    lora.add_argument("--lora-dropout", type=float, metavar="P", help="dropout on the adapters' input (default 0)")
    lora.add_argument("--lora-target-modules", metavar="NAMES",
                      help=f"comma-separated module names (q_proj,v_proj) or {ALL_LINEAR} (default: peft's for the "
                           f"model's type)")
    if training:
        lora.add_argument("--merge-lora", action="store_true",
                          help="--save-pretrained writes the base with the adapters merged into its weights (a plain "
                               "Hugging Face model, as peft's merge_and_unload) instead of the adapters")


def lora_plan(args: argparse.Namespace, hf_model: str | None) -> LoraPlan | None:
    """The flags checked before any work: None without --lora-rank."""
    rank = getattr(args, "lora_rank", None)
    others = [flag for flag, value in (("--lora-alpha", getattr(args, "lora_alpha", None)),
                                       ("--lora-dropout", getattr(args, "lora_dropout", None)),
                                       ("--lora-target-modules", getattr(args, "lora_target_modules", None)))
              if value is not None]
    if getattr(args, "merge_lora", False):
        others.append("--merge-lora")
        if not getattr(args, "save_pretrained", None):
            raise ValueError("--merge-lora needs --save-pretrained (the folder the merged model is written to)")
    if rank is None:
        if others:
            raise ValueError(f"{others[0]} needs --lora-rank")
        return None
    if hf_model is None:
        raise ValueError("--lora-rank needs --hf-model (the adapters go on a Hugging Face model's layers)")
    if rank <= 0:
        raise ValueError(f"--lora-rank must be positive, got {rank}")
    alpha = 2.0 * rank if args.lora_alpha is None else args.lora_alpha
    if not alpha > 0:
        raise ValueError(f"--lora-alpha must be positive, got {alpha}")
    dropout = 0.0 if args.lora_dropout is None else args.lora_dropout
    if not 0 <= dropout < 1:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {dropout}")
    targets = args.lora_target_modules
    if targets is not None:
        names = tuple(name.strip() for name in targets.split(",") if name.strip())
        if not names:
            raise ValueError(f"--lora-target-modules {targets!r} names no module")
        targets = ALL_LINEAR if names == (ALL_LINEAR,) else names
    require_peft("--lora-rank")
    return LoraPlan(rank=rank, alpha=alpha, dropout=dropout, target_modules=targets,
                    merge=bool(getattr(args, "merge_lora", False)))


def with_lora(model: torch.nn.Module, plan: LoraPlan) -> torch.nn.Module:
    """``model`` (on the meta device) wrapped by ``peft.get_peft_model`` with the plan's adapters."""
    peft = require_peft("--lora-rank")
    config = peft.LoraConfig(r=plan.rank, lora_alpha=plan.alpha, lora_dropout=plan.dropout, task_type="CAUSAL_LM",
                             target_modules=list(plan.target_modules) if isinstance(plan.target_modules, tuple)
                             else plan.target_modules)
    try:
        return wrap_with_peft(model, config, needed_for="--lora-rank")
    except ValueError as err:  # e.g. target modules not found, or no default for this model type
        raise ValueError(f"--lora-target-modules: {err}") from None


def trainable_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def save_lora_with_tokenizer(engine, model: torch.nn.Module, plan: LoraPlan, out_dir: str, *, dtype: str,
                             source: str | None) -> str:
    """The adapters as ``peft`` writes them, or (``plan.merge``) the base with them merged in the Hugging Face
    layout; and the source folder's tokenizer files. Returns the line to print."""
    if plan.merge:
        summary = save_merged(engine, model, out_dir, dtype=dtype)
        said = (f"saved the base with {summary['merged_layers']} LoRA layer(s) merged: {summary.get('tensors', 0)} "
                f"tensors ({format_bytes(summary.get('nbytes', 0))} {dtype}) to {out_dir} in the Hugging Face layout")
    else:
        written = engine.save_pretrained(out_dir, dtype=dtype)  # collective; rank 0 writes
        count, nbytes = written["tensors"], written["nbytes"]
        said = (f"saved {count} adapter tensors ({format_bytes(nbytes)} {dtype}) to {out_dir} in peft's layout "
                f"(adapter_config.json, adapter_model.safetensors)")
    if engine.rank != 0:
        return ""
    copied = copy_tokenizer_files(source, out_dir)
    return said + (f", with {', '.join(copied)}" if copied else "")

