"""What ``infinity train`` shows and records about a run: flags, progress line, metrics log, validation,
samples and the summary. The training loop itself stays in ``train.py``; it calls :class:`RunMonitor`.

The flags of this module (``--run-dir``, ``--eval-every``, ``--lr-schedule``, ``--sample-every``, ...) are
checked by :func:`monitor_plan` with the rest of the plan, before any work.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from infinity.config.lr_schedule import DEFAULT_DECAY_FRACTION, SCHEDULES
from infinity.config.monitors import MonitorConfig, monitor_from_deepspeed, tensorboard_available
from infinity.config.tier_names import TIERS
from infinity.placement.report import format_bytes
from infinity.train.evaluation import DEFAULT_VAL_FRACTION, Validation, sample_text
from infinity.train.metrics_log import METRICS_FILE, MetricsLog, read_metrics

logger = logging.getLogger(__name__)

DEFAULT_EVAL_BATCHES = 8
DEFAULT_SAMPLE_TOKENS = 64
DEFAULT_PROMPT = "\n"
RUNS_FOLDER = "runs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sched = p.add_argument_group("learning-rate schedule")
    sched.add_argument("--lr-schedule", choices=SCHEDULES,
                       help="after --warmup: cosine (default), linear, constant, or wsd (warmup-stable-decay); "
                            "replaces a --config scheduler block (WarmupLR, WarmupDecayLR, WarmupCosineLR)")
    sched.add_argument("--decay-fraction", type=float, metavar="F",
                       help=f"wsd: share of the steps after warmup spent decaying (default {DEFAULT_DECAY_FRACTION})")
    watch = p.add_argument_group("watching the run")
    watch.add_argument("--run-dir", metavar="DIR",
                       help=f"folder of metrics.csv (default {RUNS_FOLDER}/<date-time>); `infinity plot DIR` draws it")
    watch.add_argument("--tensorboard", metavar="DIR", help="also write TensorBoard events here (needs `tensorboard`)")
    watch.add_argument("--eval-every", type=int, metavar="N", help="validation loss every N steps (and at the end)")
    watch.add_argument("--eval-batches", type=int, metavar="M",
                       help=f"micro-batches per validation (default {DEFAULT_EVAL_BATCHES})")
    watch.add_argument("--val-data", metavar="PATH", help="held-out text file or folder (default: the corpus' last "
                                                          f"--val-fraction, {DEFAULT_VAL_FRACTION:g})")
    watch.add_argument("--val-fraction", type=float, metavar="F",
                       help=f"share of the corpus held out for validation when no --val-data (default {DEFAULT_VAL_FRACTION})")
    watch.add_argument("--sample-every", type=int, metavar="N", help="print a sample of the model every N steps")
    watch.add_argument("--prompt", metavar="TEXT", help="what samples continue (default a newline)")
    watch.add_argument("--sample-tokens", type=int, metavar="N", help=f"bytes (tokens with --hf-model's tokenizer) per sample (default {DEFAULT_SAMPLE_TOKENS})")
    watch.add_argument("--temperature", type=float, metavar="T", help="sampling temperature; 0 (default) is greedy")


@dataclass(frozen=True)
class MonitorPlan:
    """The checked settings of the learning-rate schedule, the metrics log, validation and samples."""

    lr_schedule: str
    """One of SCHEDULES, or ``deepspeed`` when the config's scheduler block sets the learning rate."""
    decay_fraction: float
    """wsd's share of the post-warmup steps spent decaying."""
    run_dir: Path
    """Folder of metrics.csv (made at the start of training)."""
    tensorboard_dir: Path | None
    """Where TensorBoard events go; None: none asked for."""
    eval_every: int | None
    """Steps between validations; None: no validation."""
    eval_batches: int
    """Micro-batches per validation."""
    val_data: str | None
    """A held-out corpus; None: carve --val-fraction off the training corpus."""
    val_fraction: float
    """Share of the corpus held out when there is no val_data."""
    sample_every: int | None
    """Steps between samples; None: no samples."""
    prompt: str
    """Text the samples continue."""
    sample_tokens: int
    """Bytes per sample."""
    temperature: float
    """0: greedy; else softmax sampling at this temperature."""


def monitor_plan(args: argparse.Namespace, ds: dict, *, steps: int) -> MonitorPlan:
    """Check this module's flags (and the config's scheduler and tensorboard blocks); ``ds`` is edited in place:
    ``--lr-schedule`` removes its scheduler block; a scheduler block without ``total_num_steps`` gets ``steps``."""
    for flag in ("eval_every", "eval_batches", "sample_every", "sample_tokens"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    for flag, needs in (("eval_batches", "eval_every"), ("val_data", "eval_every"), ("val_fraction", "eval_every"),
                        ("prompt", "sample_every"), ("sample_tokens", "sample_every"), ("temperature", "sample_every")):
        if getattr(args, flag) is not None and getattr(args, needs) is None:
            raise ValueError(f"--{flag.replace('_', '-')} needs --{needs.replace('_', '-')}")
    if args.val_data is not None and args.val_fraction is not None:
        raise ValueError("give --val-data or --val-fraction, not both")
    if args.val_data is not None and not Path(args.val_data).exists():
        raise FileNotFoundError(f"--val-data path {args.val_data!r} does not exist")
    val_fraction = DEFAULT_VAL_FRACTION if args.val_fraction is None else args.val_fraction
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    temperature = 0.0 if args.temperature is None else args.temperature
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    decay_fraction = DEFAULT_DECAY_FRACTION if args.decay_fraction is None else args.decay_fraction
    if not 0.0 < decay_fraction <= 1.0:
        raise ValueError(f"--decay-fraction must be in (0, 1], got {decay_fraction}")
    if args.decay_fraction is not None and args.lr_schedule != "wsd":
        raise ValueError("--decay-fraction needs --lr-schedule wsd")

    lr_schedule = args.lr_schedule or "cosine"
    if "scheduler" in ds:
        if args.lr_schedule is not None:
            logger.info("--lr-schedule %s replaces the config's scheduler block", args.lr_schedule)
            del ds["scheduler"]
        else:
            if args.warmup is not None or args.min_lr is not None:
                raise ValueError("--warmup/--min-lr shape --lr-schedule, but the --config scheduler block sets the "
                                 "learning rate; give --lr-schedule to replace the block, or drop the flags")
            block = ds["scheduler"]
            if isinstance(block, dict) and block.get("type") in ("WarmupDecayLR", "WarmupCosineLR"):
                params = block.setdefault("params", {})
                if isinstance(params, dict):
                    params.setdefault("total_num_steps", steps)
            lr_schedule = "deepspeed"

    tensorboard_dir = Path(args.tensorboard) if args.tensorboard else None
    if tensorboard_dir is None and "tensorboard" in ds:
        tb: MonitorConfig = monitor_from_deepspeed(ds["tensorboard"], "tensorboard")
        if tb.enabled:
            tensorboard_dir = Path(tb.output_path or RUNS_FOLDER) / tb.job_name
    for flag, path in (("--run-dir", args.run_dir), ("--tensorboard", tensorboard_dir)):
        if path is not None and Path(path).exists() and not Path(path).is_dir():
            raise NotADirectoryError(f"{flag} {str(path)!r} is a file, not a folder")
    run_dir = Path(args.run_dir) if args.run_dir else _new_run_dir()
    _check_run_dir_reuse(run_dir, resumes=getattr(args, "resume", None) is not None,
                         overwrite=getattr(args, "overwrite", False))
    return MonitorPlan(
        lr_schedule=lr_schedule, decay_fraction=decay_fraction, run_dir=run_dir, tensorboard_dir=tensorboard_dir,
        eval_every=args.eval_every, eval_batches=args.eval_batches or DEFAULT_EVAL_BATCHES, val_data=args.val_data,
        val_fraction=val_fraction, sample_every=args.sample_every,
        prompt=DEFAULT_PROMPT if args.prompt is None else args.prompt,
        sample_tokens=args.sample_tokens or DEFAULT_SAMPLE_TOKENS, temperature=temperature)


def _check_run_dir_reuse(run_dir: Path, *, resumes: bool, overwrite: bool) -> None:
    """A fresh run (no --resume) starts metrics.csv anew: one that holds an earlier run's steps is replaced only
    with --overwrite, before any work. (A resumed run keeps its rows up to the step it resumes from.)"""
    metrics = run_dir / METRICS_FILE
    if resumes or overwrite or not metrics.is_file():
        return
    try:
        steps = len(read_metrics(metrics))
    except (OSError, ValueError):
        steps = None  # not a metrics file of ours: it is the user's, kept all the same
    if steps == 0:
        return
    held = "rows that are not a run's metrics" if steps is None else f"an earlier run's {steps} step(s)"
    raise FileExistsError(f"--run-dir {str(run_dir)!r}: {str(metrics)!r} holds {held}, which this run would replace: "
                          f"choose another --run-dir (or leave it out: runs/<date-time>), --resume that run, or "
                          f"give --overwrite to replace them")


def _new_run_dir() -> Path:
    base = Path(RUNS_FOLDER) / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


class RunMonitor:
    """Per step: the metrics row, validation and samples when due, the progress line; at the end, the summary."""

    def __init__(self, plan: MonitorPlan, *, total_steps: int, tokens_per_step: int, seq_len: int,
                 validation: Validation | None, is_main: bool, resume_after: int | None, say, codec=None):
        """``codec``: text to ids and back for samples (None: bytes; a ``TokenizerCodec`` for ``--hf-model``)."""
        self.plan = plan
        self.codec = codec
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.seq_len = seq_len
        self.validation = validation
        self.is_main = is_main
        self.say = say
        self.totals = {t: {"peak_nbytes": 0, "bytes_read": 0, "bytes_written": 0} for t in TIERS}
        self.copies = {"host_to_device_nbytes": 0, "device_to_host_nbytes": 0}  # what a GPU run moves over PCIe
        self.step_outcomes: dict[str, int] = {}  # how steps ended: overlapped (committed/redone/skipped) or after backward
        self.val_losses: list[tuple[int, float]] = []
        self.log = None
        if is_main:
            tb_dir = plan.tensorboard_dir
            if tb_dir is not None and not tensorboard_available():
                say(f"  tensorboard is not installed (pip install tensorboard): no events in {tb_dir}; "
                    f"metrics.csv has every step")
                tb_dir = None
            self.log = MetricsLog(plan.run_dir, tensorboard_dir=tb_dir, resume_after=resume_after)
            say(f"  metrics: {self.log.path}" + (f"; TensorBoard events: {tb_dir}" if tb_dir else "")
                + f"; lr schedule {plan.lr_schedule}")

    def after_step(self, engine, step: int, loss: float, step_s: float) -> str:
        """Record optimizer step ``step`` (1-based) and return its progress text; validates and samples when due."""
        metrics = engine.step_metrics()
        tiers = metrics.get("tiers", {})
        for t in TIERS:
            m = tiers.get(t, {})
            self.totals[t]["peak_nbytes"] = max(self.totals[t]["peak_nbytes"], int(m.get("peak_nbytes", 0)))
            self.totals[t]["bytes_read"] += int(m.get("bytes_read", 0))
            self.totals[t]["bytes_written"] += int(m.get("bytes_written", 0))
        for direction, nbytes in metrics.get("copies", {}).items():
            self.copies[direction] += int(nbytes)
        outcome = metrics.get("overlapped_step", "after backward")
        self.step_outcomes[outcome] = self.step_outcomes.get(outcome, 0) + 1
        val_loss = None
        if self.validation is not None and (step % self.plan.eval_every == 0 or step == self.total_steps):
            val_loss = self.validation.loss(engine)
            self.val_losses.append((step, val_loss))
        tokens_per_s = self.tokens_per_step / step_s if step_s > 0 else 0.0
        row = {"step": step, "loss": loss, "val_loss": val_loss, "lr": metrics.get("lr", engine.lr),
               "grad_norm": engine.get_global_grad_norm(), "tokens_per_s": tokens_per_s,
               "step_s": metrics.get("step_s") or step_s,
               "exposed_io_s": (metrics.get("timeline") or {}).get("io_exposed_s"),
               "fetch_wait_s": metrics.get("fetch_wait_s")}
        for t in TIERS:
            m = tiers.get(t, {})
            row.update({f"{t}_bytes_read": m.get("bytes_read"), f"{t}_bytes_written": m.get("bytes_written"),
                        f"{t}_peak_nbytes": m.get("peak_nbytes")})
        if self.log is not None:
            self.log.log(row)
        if self.plan.sample_every and (step % self.plan.sample_every == 0 or step == self.total_steps):
            text = sample_text(engine, self.plan.prompt, max_new_tokens=self.plan.sample_tokens, seq_len=self.seq_len,
                               temperature=self.plan.temperature, seed=step, codec=self.codec)
            self.say(f"sample at step {step}: {self.plan.prompt + text!r}")
        return progress_text(loss, tokens_per_s, tiers, metrics.get("step_s") or step_s,
                             val_loss=self.val_losses[-1][1] if self.val_losses else None,
                             grad_norm=engine.get_global_grad_norm())

    def log_nonfinite(self, step: int, loss: float) -> None:
        if self.log is not None:
            self.log.log({"step": step, "loss": loss})

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def progress_text(loss: float, tokens_per_s: float, tiers: dict, step_s: float, *, val_loss: float | None = None,
                  grad_norm: float | None = None) -> str:
    parts = [f"loss {loss:.3f}"]
    if val_loss is not None:
        parts.append(f"val {val_loss:.3f}")
    if grad_norm is not None:
        parts.append(f"|g| {grad_norm:.2f}")
    parts.append(f"{tokens_per_s:,.0f} tok/s" if tokens_per_s >= 10 else f"{tokens_per_s:.2g} tok/s")
    for t in TIERS:
        m = tiers.get(t)
        if m and (m.get("bytes_read") or m.get("bytes_written")) and step_s > 0:
            parts.append(f"{t} r/w {m['bytes_read'] / step_s / 1e9:.2f}/{m['bytes_written'] / step_s / 1e9:.2f} GB/s")
    return ", ".join(parts)


_OUTCOME_TEXT = {
    "committed": "overlapped with backward",
    "redone": "clipped (updated once the global norm was known)",
    "skipped": "skipped (fp16 overflow)",
    "after backward": "after backward",
}


def print_summary(s: dict) -> None:
    val = f", validation loss {s['val_loss']:.3f}" if s.get("val_loss") is not None else ""
    print(f"done: {s['steps']} steps, loss {s['first_loss']:.3f} -> {s['last_loss']:.3f}{val}, "
          f"{s['tokens_per_s']:,.{0 if s['tokens_per_s'] >= 10 else 2}f} tokens/s, {s['train_s']:.0f} s, "
          f"peak RSS {format_bytes(s['peak_rss_bytes'])}")
    print(f"  {'tier':<7} {'peak':>10} {'estimate':>10} {'read':>10} {'written':>10}")
    for t in TIERS:
        m = s["tiers"][t]
        print(f"  {t:<7} {format_bytes(m['peak_nbytes']):>10} {format_bytes(s['estimate'][t]):>10} "
              f"{format_bytes(m['bytes_read']):>10} {format_bytes(m['bytes_written']):>10}")
    if s.get("step_outcomes"):
        print("  steps: " + ", ".join(f"{n} {_OUTCOME_TEXT.get(k, k)}" for k, n in s["step_outcomes"].items()))
    if s.get("metrics_file"):
        print(f"  metrics: {s['metrics_file']} (draw them: infinity plot {Path(s['metrics_file']).parent})")
