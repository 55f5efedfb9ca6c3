"""The GPU path against plain PyTorch on the same GPU, in the same run.

Plain PyTorch is the model on the GPU under bf16 autocast with torch's fused
AdamW (no ZeRO, no offload). Ours is the engine in bf16 with parameters and
optimizer in one tier (``none``, ``cpu`` or ``nvme``), with gradient
accumulation 1 and 4. The two train side by side: each round takes a block of
steps of the reference (``--block``, 3), then the same of ours, so the
machine's noise hits both alike; the figure is the median of the per-round
ratios of step times. A block is timed until every update its steps made is
done: the updates a step leaves to run behind the next forward overlap the next
step's forward within the block, and the last step's are waited for, so none
runs (uncounted) in the reference's time.

For ``nvme`` the reference that matters is the disk: the bound is the bytes
one step moves to and from NVMe (from ``step_metrics()``) over the bandwidth
``infinity bench`` measures on the same path, reported as ``io_ratio``.

    python benchmarks/bench_gpu.py                              # 124M and 1.3B, every case
    python benchmarks/bench_gpu.py --models 124m --cases none:4,cpu:1
    python benchmarks/bench_gpu.py --allow-cpu --models tiny    # the script itself, without a GPU
    python benchmarks/bench_gpu.py --allow-cpu --models thin --seq 16 --micro-batch 1 --cases none:1,none:4 \
        --rounds 20                                             # the engine's host-side work a step
    python benchmarks/bench_gpu.py --models 6.7b --cases cpu:1,auto:1 --activation-checkpointing \
        --host-memory 110GiB                                    # a model whose states do not fit the GPU

A model whose plain PyTorch training state (16 B a parameter) is more than the
GPU's memory has no plain PyTorch rows; its rows compare tiers by tokens a
second and TFLOP/s (model FLOPs, 6 a parameter a token), which every row has.
A case that cannot run (out of device memory, or refused by a budget) prints
why and the next case runs; the script then exits 1.

Every row also has the step-time model's prediction of our step
(``predicted_s``, ``bound_by``, each resource's busy seconds in
``step_resources``, ``measured_over_predicted``), its prediction of plain
PyTorch's step (``reference_predicted_s``) and ``ratio_over_predicted_ratio``:
the measured ratio over the predicted one, which a shared machine's load
leaves alone. The figures are the machine's cached ones (``infinity bench
--machine``; measured here when there are none).

Without CUDA (and without --allow-cpu) it says so and exits 0. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the CLI: large host blocks 2 MiB-aligned

import torch  # noqa: E402

import infinity  # noqa: E402
from infinity.models.gpt import GPT, GPTConfig, count_params  # noqa: E402
from infinity.config.schema import InfinityConfig  # noqa: E402
from infinity.placement.estimate_gpt import estimate_gpt  # noqa: E402
from infinity.placement.estimate_split import move_to_device  # noqa: E402
from infinity.placement.host_budget import resolve_host_budget  # noqa: E402
from infinity.placement.split_choice import step_shape_of  # noqa: E402
from infinity.placement.step_time import gpt_shape, predict_from_estimate  # noqa: E402
from infinity.runtime.host_cores import usable_cores  # noqa: E402
from infinity.runtime.machine_figures import machine_figures  # noqa: E402

MODELS = {
    # GPT-2 small and GPT-3 XL shapes with GPT-2's vocabulary (padded to 50304), tied head
    "124m": GPTConfig(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50304, tie_embeddings=True),
    "1.3b": GPTConfig(n_layer=24, n_head=16, d_model=2048, seq_len=1024, vocab_size=50304, tie_embeddings=True),
    # GPT-3 6.7B's shape: its fp32 weights, gradients and AdamW moments (16 B a parameter, 107 GB) fit no 80 GB card,
    # so it has no plain PyTorch row; its rows compare tiers (``auto`` against ``cpu``) by tokens a second
    "6.7b": GPTConfig(n_layer=32, n_head=32, d_model=4096, seq_len=1024, vocab_size=50304, tie_embeddings=True),
    "tiny": GPTConfig(n_layer=2, n_head=4, d_model=128, seq_len=128, vocab_size=256, tie_embeddings=True),
    # 124M's twelve layers (its parameter tensors, modules and hooks) at width 64: next to no compute, so a
    # step's time over plain PyTorch's is the engine's host-side work, what a small model on a GPU waits for
    "thin": GPTConfig(n_layer=12, n_head=2, d_model=64, seq_len=128, vocab_size=256, tie_embeddings=True),
}
DEFAULT_CASES = "none:1,none:4,cpu:1,cpu:4,nvme:1,spill:1"
TIERS = ("none", "cpu", "nvme", "spill", "int8", "half", "auto", "unbound", "keep")
"""spill: nvme configured, the host-memory budget keeps what fits; int8: cpu with int8 optimizer states; half:
parameters cpu, half the optimizer's sub-groups on the device (DeepSpeed's offload_optimizer.ratio 0.5); auto:
parameters cpu, the optimizer's sub-groups on the device as far as the device-memory budget holds them and the
step-time model finds them worth it (``offload_optimizer.device: auto``, the default budget), the rest on the CPU;
unbound: cpu with the CPU Adam's team on every core, unbound (``host_threads`` = the usable cores), where ``cpu``
leaves the first core to the thread that feeds the GPU; keep: cpu with every parameter kept gathered once fetched
until the step's update (``stage3_max_live_parameters`` and ``stage3_max_reuse_distance`` past the model's size, within
the device's room): each crosses up once a step instead of twice a micro-batch."""
KEEP_ALL = 10 ** 12
"""The keep case's live-parameter budget and reuse distance, in elements: more than any model here."""
PLAIN_TRAINING_BYTES_PER_PARAM = 16
"""Plain PyTorch's training state a parameter: fp32 weight, fp32 gradient, AdamW's two fp32 moments."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="124m,1.3b", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--cases", default=DEFAULT_CASES,
                   help="comma-separated TIER:ACCUMULATION (tier none, cpu, nvme, spill: nvme under the budget, "
                        "int8: cpu with int8 states, half: cpu with half the optimizer on the device, unbound: cpu with "
                        "the CPU Adam on every core, keep: cpu with parameters kept gathered until the step)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (each: --block steps of each)")
    p.add_argument("--block", type=int, default=3,
                   help="consecutive steps of each contender a round, timed together until every update they made "
                        "is done: the updates a step leaves behind the next forward are in its block's time (the "
                        "last step's land before the block ends), and a step is the block's time over its steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nvme-path", default=None, help="swap directory for the nvme case (default: a temporary one)")
    p.add_argument("--allow-cpu", action="store_true", help="run without CUDA (device memory kept distinct)")
    p.add_argument("--out", default=None, help="also write the JSON line to this file")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write the engine's Chrome trace of each case in --trace-cases here (MODEL-TIER-ACCUM.json): "
                        "where a step's time goes")
    p.add_argument("--trace-cases", default="cpu:1", help="the cases --trace records (comma-separated TIER:ACCUMULATION)")
    p.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="the engine's host-memory budget (zero_optimization.host_memory_budget: 110GiB, 0.9; default: "
                        "the engine's, 80%% of the memory available)")
    p.add_argument("--sub-group-size", type=float, default=None,
                   help="optimizer elements stepped at once (zero_optimization.sub_group_size; default: the engine's, 1e8)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="every block recomputed in backward, in ours and in plain PyTorch (a large model's activations "
                        "then leave room on the device for the optimizer's states)")
    p.add_argument("--no-reference", action="store_true",
                   help="no plain PyTorch rows (without it they are left out only where plain PyTorch's training state, "
                        f"{PLAIN_TRAINING_BYTES_PER_PARAM} B a parameter, is more than the GPU's memory)")
    p.add_argument("--profile", action="store_true",
                   help="with --trace: one more step of each traced case under torch.profiler (CPU and CUDA), its "
                        "trace gzipped beside the engine's and its busiest ops printed")
    args = p.parse_args(argv)
    if args.block < 1:
        p.error(f"--block must be 1 or more, got {args.block}")
    return args


def parse_cases(text: str) -> list[tuple[str, int]]:
    cases = []
    for item in text.split(","):
        tier, _, accum = item.strip().partition(":")
        if tier not in TIERS or not accum.isdigit() or int(accum) < 1:
            raise SystemExit(f"--cases: {item!r} is not TIER:ACCUMULATION (tier one of {', '.join(TIERS)})")
        cases.append((tier, int(accum)))
    return cases


def zero_overrides(args) -> dict:
    """``zero_optimization`` keys every case of this run sets from the command line."""
    overrides = {}
    if args.host_memory is not None:
        overrides["host_memory_budget"] = args.host_memory
    if args.sub_group_size is not None:
        overrides["sub_group_size"] = int(args.sub_group_size)
    return overrides


def engine_config(tier: str, accum: int, nvme_path: str, overrides: dict | None = None) -> dict:
    """Our config for a case; ``overrides``: :func:`zero_overrides`."""
    if tier == "spill":  # nvme as configured by a user who does not know what fits: the engine decides
        return _without_max_in_cpu(engine_config("nvme", accum, nvme_path, overrides))
    if tier in ("int8", "half", "unbound"):  # the cpu case with compact states, a device-first split, or unbound
        config = engine_config("cpu", accum, nvme_path, overrides)
        change = {"int8": {"state_dtype": "int8"}, "half": {"ratio": 0.5},
                  "unbound": {"host_threads": len(usable_cores())}}[tier]
        config["zero_optimization"]["offload_optimizer"].update(change)
        return config
    if tier == "keep":  # the cpu case with every parameter kept gathered from its first fetch to the step's update
        config = engine_config("cpu", accum, nvme_path, overrides)
        config["zero_optimization"].update(stage3_max_live_parameters=KEEP_ALL, stage3_max_reuse_distance=KEEP_ALL)
        return config
    if tier == "auto":  # parameters cpu, as in half; the optimizer split by the device budget and the step-time model
        config = engine_config("cpu", accum, nvme_path, overrides)
        config["zero_optimization"]["offload_optimizer"]["device"] = "auto"
        return config
    offload = {"device": tier}
    param = dict(offload, **({"nvme_path": nvme_path, "max_in_cpu": 0} if tier == "nvme" else {}))
    # "nvme" means NVMe here: nothing kept in host memory within the budget
    optimizer = dict(offload, **({"nvme_path": nvme_path, "max_in_cpu": 0} if tier == "nvme" else {}))
    zero = {"stage": 3, "offload_param": param, "offload_optimizer": optimizer,
            "stage3_param_persistence_threshold": 100_000}
    zero.update(overrides or {})
    return {
        "gradient_accumulation_steps": accum,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": zero,
    }


def _without_max_in_cpu(config: dict) -> dict:
    zero = config["zero_optimization"]
    for key in ("offload_param", "offload_optimizer"):
        zero[key].pop("max_in_cpu", None)
    return config


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a step's time includes the GPU work it queued


class Reference:
    """Plain PyTorch on the device: bf16 autocast, fused AdamW, the same accumulation."""

    def __init__(self, cfg: GPTConfig, device: torch.device, recompute: bool = False):
        torch.manual_seed(0)
        self.model = GPT(cfg).to(device)
        if recompute:
            self.model.activation_checkpointing_enable()
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1, fused=fused)
        self.device = device

    def step(self, batches) -> float:
        for idx, targets in batches:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = self.model(idx, targets)
            (loss / len(batches)).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def finish(self) -> None:
        """Nothing of plain PyTorch's step outlives it (the device's queued work is synchronized by the caller)."""

    def close(self) -> None:
        del self.model, self.opt


class Ours:
    def __init__(self, cfg: GPTConfig, config: dict, *, micro_batch: int, seq: int, trace_path: str | None = None,
                 recompute: bool = False):
        with infinity.Init():
            model = GPT(cfg)
        if recompute:  # before initialize: a split optimizer's choice hears that backward recomputes
            model.activation_checkpointing_enable()
        if trace_path is not None:
            config["trace"] = {"path": trace_path}
        # the step the split's count is chosen for: this run's micro-batch and sequence
        shape = step_shape_of(model, micro_batch=micro_batch, seq_len=seq)
        start = time.perf_counter()
        self.engine = infinity.initialize(model, config, step_shape=shape)
        self.initialize_s = time.perf_counter() - start  # pinning must stay off this path

    def pinning(self) -> dict:
        """What the background pinner registered, and how long it took (off ``initialize``'s path)."""
        pinner = self.engine.tiers.pinner
        if pinner is None:
            return {}
        return {"pinned_nbytes": pinner.pinned_nbytes, "pinning_s": pinner.seconds,
                "pinning_pending_nbytes": pinner.pending_nbytes}

    def step(self, batches) -> float:
        for idx, targets in batches:
            loss = self.engine(idx, targets)
            self.engine.backward(loss)
            self.engine.step()
        return float(loss.detach())

    def finish(self) -> None:
        """Wait for the updates the last step left behind the next forward: a timed block ends with them done, so
        none runs in the reference's time (the host's work would then go uncounted, and slow the reference)."""
        self.engine.finish_step()

    def nvme_bytes(self) -> int:
        """Bytes read from and written to NVMe since initialize (a step's own metrics count the updates behind
        the next forward in the next step)."""
        nvme = self.engine.tiers.snapshot()["nvme"]
        return nvme["bytes_read"] + nvme["bytes_written"]

    def close(self) -> None:
        self.engine.close()
        del self.engine


def batches_for(cfg: GPTConfig, args, accum: int, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    seq = min(args.seq, cfg.seq_len)
    out = []
    for _ in range(accum):
        idx = torch.randint(0, cfg.vocab_size, (args.micro_batch, seq + 1), generator=g)
        out.append((idx[:, :-1].to(device), idx[:, 1:].to(device)))
    return out


def timed(device, fn, *a) -> tuple[float, float]:
    synchronize(device)
    start = time.perf_counter()
    loss = fn(*a)
    synchronize(device)
    return time.perf_counter() - start, loss


def timed_block(device, contender, steps: list) -> tuple[float, float]:
    """Seconds a step over ``steps`` (each a step's micro-batches) run back to back, and the last loss: from a
    synchronized start until the device's work and (for ours) every update the steps made are done."""
    synchronize(device)
    start = time.perf_counter()
    for batches in steps:
        loss = contender.step(batches)
    contender.finish()
    synchronize(device)
    return (time.perf_counter() - start) / len(steps), loss


def predicted(cfg: GPTConfig, tier: str, accum: int, args, config: dict, split: dict | None = None) -> dict:
    """The step-time model's step for the case's ``config`` (:func:`engine_config`) on this machine (crossings
    always: a GPU, or the distinct-device mode). ``split``: the engine's own optimizer split
    (``step_metrics()["optimizer_split"]``), so a split case is predicted with the sub-groups the engine put on the
    device."""
    offload = {"spill": "nvme", "int8": "cpu", "half": "cpu", "auto": "cpu", "unbound": "cpu",
               "keep": "cpu"}.get(tier, tier)
    parsed = InfinityConfig.from_deepspeed(config)
    zero = parsed.zero  # the case's own fetch settings (keep's live budget, say)
    seq = min(args.seq, cfg.seq_len)
    recompute = args.activation_checkpointing
    est = estimate_gpt(cfg, micro_batch=args.micro_batch, seq_len=seq, precision="bf16", offload_param=offload,
                       offload_optimizer=offload, gradient_accumulation_steps=accum, gpu=True,
                       state_dtype="int8" if tier == "int8" else "fp32",
                       param_persistence_threshold=zero.param_persistence_threshold,
                       max_live_parameters=zero.max_live_parameters, max_reuse_distance=zero.max_reuse_distance,
                       activation_checkpointing=recompute,
                       **({"sub_group_size": args.sub_group_size} if args.sub_group_size else {}),
                       max_in_cpu=0 if tier == "nvme" else 1_000_000_000,
                       optimizer_max_in_cpu=0 if tier == "nvme" else None,
                       host_memory_budget=resolve_host_budget(args.host_memory) if tier == "spill" else None,
                       overlap_step=True)
    if split and split.get("device_sub_groups"):  # its first sub-groups' states and gradients on the device
        move_to_device(est, parsed, split["device_sub_groups"], split["device_numel"])
    prediction = predict_from_estimate(machine_figures(), est, micro_batch=args.micro_batch, seq_len=seq,
                                       shape=gpt_shape(cfg))
    # plain PyTorch: the same model with nothing offloaded and nothing crossing (a load gauge: on a shared
    # machine both run slower alike, so ours / plain over the predicted ratio is what the model must explain)
    plain = estimate_gpt(cfg, micro_batch=args.micro_batch, seq_len=seq, precision="bf16",
                         gradient_accumulation_steps=accum, gpu=False, activation_checkpointing=recompute)
    reference = predict_from_estimate(machine_figures(), plain, micro_batch=args.micro_batch, seq_len=seq,
                                      shape=gpt_shape(cfg))
    return {"predicted_s": prediction.predicted_s, "bound_by": prediction.bound_by,
            "step_resources": prediction.resources, "reference_predicted_s": reference.predicted_s}


def reference_fits(cfg: GPTConfig, device: torch.device) -> bool:
    """Plain PyTorch's training state of ``cfg`` (:data:`PLAIN_TRAINING_BYTES_PER_PARAM`) fits the device's memory
    (always, where the device is the CPU)."""
    if device.type != "cuda":
        return True
    return count_params(cfg) * PLAIN_TRAINING_BYTES_PER_PARAM < torch.cuda.get_device_properties(device).total_memory


def model_tflops(cfg: GPTConfig, tokens: int, step_s: float) -> float:
    """Model FLOP/s of a step, in TFLOP/s: 6 a parameter a token (forward and backward; a recomputed forward is
    not counted, as in MFU)."""
    return 6 * count_params(cfg) * tokens / step_s / 1e12


def run_case(cfg, name, tier, accum, args, device, nvme_path, disk, with_reference: bool = True) -> dict:
    """One case: ours alternating with plain PyTorch round by round (ours alone without ``with_reference``)."""
    recompute = args.activation_checkpointing
    reference = Reference(cfg, device, recompute) if with_reference else None
    traced = args.trace is not None and (tier, accum) in parse_cases(args.trace_cases)
    trace_path = os.path.join(args.trace, f"{name}-{tier}-{accum}.json") if traced else None
    config = engine_config(tier, accum, nvme_path, zero_overrides(args))
    seq = min(args.seq, cfg.seq_len)
    ours = None
    ratios, ref_times, our_times, nvme_bytes = [], [], [], []
    try:
        ours = Ours(cfg, config, micro_batch=args.micro_batch, seq=seq, trace_path=trace_path,
                    recompute=recompute)
        for round_ in range(args.warmup + args.rounds):
            steps = [batches_for(cfg, args, accum, device, seed=round_ * args.block + i) for i in range(args.block)]
            ref_s = timed_block(device, reference, steps)[0] if reference is not None else None
            moved = ours.nvme_bytes()
            our_s, loss = timed_block(device, ours, steps)
            if round_ < args.warmup:
                continue
            if ref_s is not None:
                ratios.append(our_s / ref_s)
                ref_times.append(ref_s)
            our_times.append(our_s)
            nvme_bytes.append((ours.nvme_bytes() - moved) / args.block)
        if traced and args.profile:
            profile_step(ours, batches_for(cfg, args, accum, device, seed=10_000), device,
                         os.path.join(args.trace, f"{name}-{tier}-{accum}.profile.json.gz"))
        metrics = ours.engine.step_metrics()
        placement = ours.engine.placement.describe()
        setup = {"initialize_s": ours.initialize_s, **ours.pinning()}
    finally:
        for contender in (ours, reference):
            if contender is not None:
                contender.close()
        # Nothing of this case may hold device memory into the next one (the engine's parameters and its
        # prefetcher refer to each other: only the collector frees them).
        del ours, reference
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    tokens = accum * args.micro_batch * seq
    step_s = statistics.median(our_times)
    row = {"model": name, "params": count_params(cfg), "tier": tier, "accumulation": accum,
           "reference_step_s": statistics.median(ref_times) if ref_times else None, "step_s": step_s,
           "ratio": statistics.median(ratios) if ratios else None, "loss": loss,
           "tokens_per_s": tokens / step_s, "tflops": model_tflops(cfg, tokens, step_s),
           "activation_checkpointing": recompute, "copies": metrics.get("copies", {}),
           "hooks_s": metrics.get("hooks_s"),  # the last step's seconds in the engine's hooks (the feeding thread)
           "placement": placement, **setup,
           **({"optimizer_split": metrics["optimizer_split"]} if "optimizer_split" in metrics else {}),
           **predicted(cfg, tier, accum, args, config, metrics.get("optimizer_split")),
           **({"trace": trace_path} if trace_path else {})}
    row["measured_over_predicted"] = row["step_s"] / row["predicted_s"]
    if row["ratio"] is not None:
        row["ratio_over_predicted_ratio"] = row["ratio"] / (row["predicted_s"] / row["reference_predicted_s"])
    if tier in ("nvme", "spill") and disk:
        moved = statistics.median(nvme_bytes)
        io_floor_s = moved / disk["bytes_per_s"]
        row.update(nvme_bytes_per_step=moved, io_floor_s=io_floor_s)
        if moved:  # spill may keep every state in host memory: no disk bound then
            row["io_ratio"] = row["step_s"] / io_floor_s
    return row


def failed_row(name: str, cfg: GPTConfig, tier: str, accum: int, err: BaseException) -> dict:
    """A case that could not run (out of device memory, say, or refused by the engine's budgets): what stopped it,
    so the cases after it still run."""
    return {"model": name, "params": count_params(cfg), "tier": tier, "accumulation": accum,
            "error": f"{type(err).__name__}: {err}".splitlines()[0][:500]}


def profile_step(ours: "Ours", batches, device: torch.device, path: str) -> None:
    """One step of ``ours`` under torch.profiler: the Chrome trace to ``path`` (gzipped: a 1.3B step's is tens of
    MB raw) and the ops that took the most time, printed."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        timed(device, ours.step, batches)
    prof.export_chrome_trace(path)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"profile of one step ({path}), by {sort}:", flush=True)
    print(prof.key_averages().table(sort_by=sort, row_limit=25), flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)


def measure_disk(path: str) -> dict | None:
    from infinity.storage.bench import measure_nvme
    try:
        results = [measure_nvme(path, nbytes=1 << 30, block_size=1 << 20, queue_depth=32) for _ in range(3)]
    except OSError as err:  # the nvme case still runs; only its disk bound is missing
        print(f"could not measure the disk at {path}: {err}", file=sys.stderr)
        return None
    read = statistics.median(r.nbytes / r.read_s for r in results)
    write = statistics.median(r.nbytes / r.write_s for r in results)
    # a step reads and writes about the same bytes: the harmonic mean is the rate of moving them
    return {"read_bytes_per_s": read, "write_bytes_per_s": write, "bytes_per_s": 2 / (1 / read + 1 / write)}


def machine(device: torch.device) -> str:
    from infinity.runtime.hardware import machine_description

    return machine_description()


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("bench_gpu: CUDA is not available here; nothing to measure (use --allow-cpu to run the script "
              "on the CPU with device memory kept distinct)")
        return 0
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        os.environ["INFINITY_DISTINCT_DEVICE"] = "1"
        device = torch.device("cpu")
    cases = parse_cases(args.cases)
    names = [n.strip() for n in args.models.split(",")]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    if args.trace is not None:
        os.makedirs(args.trace, exist_ok=True)  # the traces' folder, made before the first case
    rows = []
    with contextlib.ExitStack() as stack:
        nvme_path = args.nvme_path or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-gpu-"))
        disk = measure_disk(nvme_path) if any(t == "nvme" for t, _ in cases) else None
        print(f"machine: {machine(device)}; micro-batch {args.micro_batch} x seq {args.seq}, bf16, "
              f"{args.rounds} rounds of {args.block} steps after {args.warmup} warm-up"
              + (", every block recomputed in backward" if args.activation_checkpointing else ""))
        print(f"{'model':>6} {'tier':>7} {'acc':>3} {'plain s':>9} {'ours s':>9} {'ratio':>7} {'predicted s':>11} "
              f"{'/pred':>6} {'ratio/pred':>10} {'bound by':>10} {'TFLOP/s':>8}  host<->device MB/step")
        for name in names:
            cfg = MODELS[name]
            with_reference = not args.no_reference and reference_fits(cfg, device)
            if not with_reference and not args.no_reference:
                print(f"{name}: no plain PyTorch rows: its training state ({PLAIN_TRAINING_BYTES_PER_PARAM} B a "
                      f"parameter, {count_params(cfg) * PLAIN_TRAINING_BYTES_PER_PARAM / 1e9:.0f} GB) is more than "
                      f"the GPU's memory")
            for tier, accum in cases:
                try:
                    row = run_case(cfg, name, tier, accum, args, device, nvme_path, disk, with_reference)
                except (RuntimeError, ValueError, OSError, MemoryError) as err:  # CUDA's out of memory is a RuntimeError
                    # one case that does not fit must not cost the cases after it (a GPU lease is short); run_case
                    # has freed what it held
                    row = failed_row(name, cfg, tier, accum, err)
                    rows.append(row)
                    print(f"{name:>6} {tier:>7} {accum:>3} failed: {row['error']}", flush=True)
                    continue
                rows.append(row)
                print_row(row)
    summary = {"machine": machine(device), "disk": disk, "rows": rows}
    for name in names:
        by_tier = {r["tier"]: r for r in rows if r["model"] == name and r["accumulation"] == 1 and "error" not in r}
        for key, tier, over, says in [
                # nvme configured with a budget that holds the states, against cpu
                ("spill_vs_cpu", "spill", "cpu", "nvme configured, states within the host budget: {:.2f}x the cpu "
                                                 "step"),
                # the target: half the states on the device, <= 0.6x the cpu step
                ("half_vs_cpu", "half", "cpu", "half the optimizer on the device: {:.2f}x the cpu step"),
                ("auto_vs_cpu_step", "auto", "cpu", "the optimizer split by the device budget (auto): {:.2f}x the cpu "
                                                    "step"),
                # the CPU Adam bound off the feeder's core, against every core
                ("bound_vs_unbound", "cpu", "unbound", "the CPU Adam bound off the first core: {:.2f}x the step with "
                                                       "it on every core")]:
            if tier in by_tier and over in by_tier:
                ratio = by_tier[tier]["step_s"] / by_tier[over]["step_s"]
                summary.setdefault(key, {})[name] = ratio
                print(f"{name}: " + says.format(ratio))
        for accum in sorted({r["accumulation"] for r in rows if r["model"] == name}):
            # parameters kept gathered until the step against fetched twice a micro-batch, at each accumulation
            pair = {r["tier"]: r for r in rows if r["model"] == name and r["accumulation"] == accum
                    and r["tier"] in ("keep", "cpu") and "error" not in r}
            if len(pair) == 2:
                ratio = pair["keep"]["step_s"] / pair["cpu"]["step_s"]
                summary.setdefault("keep_vs_cpu", {})[f"{name}:{accum}"] = ratio
                print(f"{name}, accumulation {accum}: parameters kept gathered until the step: {ratio:.2f}x the cpu "
                      f"step")
        if "auto" in by_tier and "cpu" in by_tier:  # the target for a model whose states do not fit: >= 1.5x
            speedup = by_tier["auto"]["tokens_per_s"] / by_tier["cpu"]["tokens_per_s"]
            summary.setdefault("auto_vs_cpu_tokens_per_s", {})[name] = speedup
            print(f"{name}: auto {by_tier['auto']['tokens_per_s']:,.0f} tokens/s "
                  f"({by_tier['auto']['tflops']:.1f} TFLOP/s) against cpu {by_tier['cpu']['tokens_per_s']:,.0f}: "
                  f"{speedup:.2f}x")
    line = json.dumps(summary)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line)
    return 1 if any("error" in r for r in rows) else 0


def print_row(row: dict) -> None:
    moved = sum(row["copies"].values()) / 1e6
    extra = f"   io {row['io_ratio']:.2f}x disk bound" if "io_ratio" in row else ""
    extra += f"   initialize {row['initialize_s']:.1f} s"
    if row.get("pinned_nbytes"):
        extra += f" (then {row['pinned_nbytes'] / 1e9:.1f} GB pinned in {row['pinning_s']:.1f} s behind it)"
    split = row.get("optimizer_split")
    if split and split.get("device_sub_groups"):
        extra += f"   optimizer: {split['device_sub_groups']} of {split['sub_groups']} sub-groups on the device"

    def figure(key: str, fmt: str, width: int) -> str:  # "-" where there is no plain PyTorch row
        return format(row[key], fmt) if row.get(key) is not None else "-".rjust(width)

    print(f"{row['model']:>6} {row['tier']:>7} {row['accumulation']:>3} {figure('reference_step_s', '9.3f', 9)} "
          f"{row['step_s']:9.3f} {figure('ratio', '6.2f', 6)}{'x' if row['ratio'] else ' '} "
          f"{row['predicted_s']:11.3f} {row['measured_over_predicted']:5.2f}x "
          f"{figure('ratio_over_predicted_ratio', '9.2f', 9)}{'x' if row['ratio'] else ' '} "
          f"{row['bound_by']:>10} {row['tflops']:8.1f}  {moved:10.1f}{extra}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
