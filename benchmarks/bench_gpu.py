"""The GPU path against plain PyTorch on the same GPU, in the same run.

Plain PyTorch is the model on the GPU under bf16 autocast with torch's fused
AdamW (no ZeRO, no offload). Ours is the engine in bf16 with parameters and
optimizer in one tier (``none``, ``cpu`` or ``nvme``), with gradient
accumulation 1 and 4. The two train side by side: each round takes one step
of the reference, then one of ours, so the machine's noise hits both alike;
the figure is the median of the per-round ratios of step times.

For ``nvme`` the reference that matters is the disk: the bound is the bytes
one step moves to and from NVMe (from ``step_metrics()``) over the bandwidth
``infinity bench`` measures on the same path, reported as ``io_ratio``.

    python benchmarks/bench_gpu.py                              # 124M and 1.3B, every case
    python benchmarks/bench_gpu.py --models 124m --cases none:4,cpu:1
    python benchmarks/bench_gpu.py --allow-cpu --models tiny    # the script itself, without a GPU
    python benchmarks/bench_gpu.py --allow-cpu --models thin --seq 16 --micro-batch 1 --cases none:1,none:4 \
        --rounds 20                                             # the engine's host-side work a step

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
from infinity.placement.split_choice import apply_optimizer_split  # noqa: E402
from infinity.placement.host_budget import resolve_host_budget  # noqa: E402
from infinity.placement.step_time import gpt_shape, predict_from_estimate  # noqa: E402
from infinity.runtime.host_cores import usable_cores  # noqa: E402
from infinity.runtime.machine_figures import machine_figures  # noqa: E402

MODELS = {
    # GPT-2 small and GPT-3 XL shapes with GPT-2's vocabulary (padded to 50304), tied head
    "124m": GPTConfig(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50304, tie_embeddings=True),
    "1.3b": GPTConfig(n_layer=24, n_head=16, d_model=2048, seq_len=1024, vocab_size=50304, tie_embeddings=True),
    "tiny": GPTConfig(n_layer=2, n_head=4, d_model=128, seq_len=128, vocab_size=256, tie_embeddings=True),
    # 124M's twelve layers (its parameter tensors, modules and hooks) at width 64: next to no compute, so a
    # step's time over plain PyTorch's is the engine's host-side work, what a small model on a GPU waits for
    "thin": GPTConfig(n_layer=12, n_head=2, d_model=64, seq_len=128, vocab_size=256, tie_embeddings=True),
}
DEFAULT_CASES = "none:1,none:4,cpu:1,cpu:4,nvme:1,spill:1"
TIERS = ("none", "cpu", "nvme", "spill", "int8", "half", "unbound")
"""spill: nvme configured, the host-memory budget keeps what fits; int8: cpu with int8 optimizer states; half:
parameters cpu, half the optimizer's sub-groups on the device (DeepSpeed's offload_optimizer.ratio 0.5); unbound:
cpu with the CPU Adam's team on every core, unbound (``host_threads`` = the usable cores), where ``cpu`` leaves the
first core to the thread that feeds the GPU."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="124m,1.3b", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--cases", default=DEFAULT_CASES,
                   help="comma-separated TIER:ACCUMULATION (tier none, cpu, nvme, spill: nvme under the budget, "
                        "int8: cpu with int8 states, half: cpu with half the optimizer on the device, unbound: cpu with "
                        "the CPU Adam on every core)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (each: one step of each)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nvme-path", default=None, help="swap directory for the nvme case (default: a temporary one)")
    p.add_argument("--allow-cpu", action="store_true", help="run without CUDA (device memory kept distinct)")
    p.add_argument("--out", default=None, help="also write the JSON line to this file")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write the engine's Chrome trace of each case in --trace-cases here (MODEL-TIER-ACCUM.json): "
                        "where a step's time goes")
    p.add_argument("--trace-cases", default="cpu:1", help="the cases --trace records (comma-separated TIER:ACCUMULATION)")
    p.add_argument("--profile", action="store_true",
                   help="with --trace: one more step of each traced case under torch.profiler (CPU and CUDA), its "
                        "trace gzipped beside the engine's and its busiest ops printed")
    return p.parse_args(argv)


def parse_cases(text: str) -> list[tuple[str, int]]:
    cases = []
    for item in text.split(","):
        tier, _, accum = item.strip().partition(":")
        if tier not in TIERS or not accum.isdigit() or int(accum) < 1:
            raise SystemExit(f"--cases: {item!r} is not TIER:ACCUMULATION (tier one of {', '.join(TIERS)})")
        cases.append((tier, int(accum)))
    return cases


def engine_config(tier: str, accum: int, nvme_path: str) -> dict:
    if tier == "spill":  # nvme as configured by a user who does not know what fits: the engine decides
        return _without_max_in_cpu(engine_config("nvme", accum, nvme_path))
    if tier in ("int8", "half", "unbound"):  # the cpu case with compact states, a device-first split, or unbound
        config = engine_config("cpu", accum, nvme_path)
        change = {"int8": {"state_dtype": "int8"}, "half": {"ratio": 0.5},
                  "unbound": {"host_threads": len(usable_cores())}}[tier]
        config["zero_optimization"]["offload_optimizer"].update(change)
        return config
    offload = {"device": tier}
    param = dict(offload, **({"nvme_path": nvme_path, "max_in_cpu": 0} if tier == "nvme" else {}))
    # "nvme" means NVMe here: nothing kept in host memory within the budget
    optimizer = dict(offload, **({"nvme_path": nvme_path, "max_in_cpu": 0} if tier == "nvme" else {}))
    return {
        "gradient_accumulation_steps": accum,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "offload_param": param, "offload_optimizer": optimizer,
                              "stage3_param_persistence_threshold": 100_000},
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

    def __init__(self, cfg: GPTConfig, device: torch.device):
        torch.manual_seed(0)
        self.model = GPT(cfg).to(device)
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

    def close(self) -> None:
        del self.model, self.opt


class Ours:
    def __init__(self, cfg: GPTConfig, tier: str, accum: int, nvme_path: str, trace_path: str | None = None):
        with infinity.Init():
            model = GPT(cfg)
        config = engine_config(tier, accum, nvme_path)
        if trace_path is not None:
            config["trace"] = {"path": trace_path}
        start = time.perf_counter()
        self.engine = infinity.initialize(model, config)
        self.initialize_s = time.perf_counter() - start  # issue 12: pinning must stay off this path

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


def predicted(cfg: GPTConfig, tier: str, accum: int, args) -> dict:
    """The step-time model's step for ``engine_config(tier, accum)`` on this machine (crossings always: a GPU, or
    the distinct-device mode)."""
    offload = {"spill": "nvme", "int8": "cpu", "half": "cpu", "unbound": "cpu"}.get(tier, tier)
    seq = min(args.seq, cfg.seq_len)
    est = estimate_gpt(cfg, micro_batch=args.micro_batch, seq_len=seq, precision="bf16", offload_param=offload,
                       offload_optimizer=offload, gradient_accumulation_steps=accum, gpu=True,
                       state_dtype="int8" if tier == "int8" else "fp32",
                       param_persistence_threshold=100_000,
                       max_in_cpu=0 if tier == "nvme" else 1_000_000_000,
                       optimizer_max_in_cpu=0 if tier == "nvme" else None,
                       host_memory_budget=resolve_host_budget(None) if tier == "spill" else None, overlap_step=True)
    if tier == "half":  # its first sub-groups' states and gradients on the device, as the engine splits them
        est = apply_optimizer_split(est, InfinityConfig.from_deepspeed(engine_config(tier, accum, args.nvme_path)))
    prediction = predict_from_estimate(machine_figures(), est, micro_batch=args.micro_batch, seq_len=seq,
                                       shape=gpt_shape(cfg))
    # plain PyTorch: the same model with nothing offloaded and nothing crossing (a load gauge: on a shared
    # machine both run slower alike, so ours / plain over the predicted ratio is what the model must explain)
    plain = estimate_gpt(cfg, micro_batch=args.micro_batch, seq_len=seq, precision="bf16",
                         gradient_accumulation_steps=accum, gpu=False)
    reference = predict_from_estimate(machine_figures(), plain, micro_batch=args.micro_batch, seq_len=seq,
                                      shape=gpt_shape(cfg))
    return {"predicted_s": prediction.predicted_s, "bound_by": prediction.bound_by,
            "step_resources": prediction.resources, "reference_predicted_s": reference.predicted_s}


def run_case(cfg, name, tier, accum, args, device, nvme_path, disk) -> dict:
    reference = Reference(cfg, device)
    traced = args.trace is not None and (tier, accum) in parse_cases(args.trace_cases)
    trace_path = os.path.join(args.trace, f"{name}-{tier}-{accum}.json") if traced else None
    ours = Ours(cfg, tier, accum, nvme_path, trace_path)
    ratios, ref_times, our_times, nvme_bytes = [], [], [], []
    try:
        for round_ in range(args.warmup + args.rounds):
            batches = batches_for(cfg, args, accum, device, seed=round_)
            ref_s, _ = timed(device, reference.step, batches)
            our_s, loss = timed(device, ours.step, batches)
            if round_ < args.warmup:
                continue
            ratios.append(our_s / ref_s)
            ref_times.append(ref_s)
            our_times.append(our_s)
            tiers = ours.engine.step_metrics()["tiers"]
            nvme_bytes.append(tiers["nvme"]["bytes_read"] + tiers["nvme"]["bytes_written"])
        if traced and args.profile:
            profile_step(ours, batches_for(cfg, args, accum, device, seed=10_000), device,
                         os.path.join(args.trace, f"{name}-{tier}-{accum}.profile.json.gz"))
        metrics = ours.engine.step_metrics()
        placement = ours.engine.placement.describe()
        setup = {"initialize_s": ours.initialize_s, **ours.pinning()}
    finally:
        ours.close()
        reference.close()
        # Nothing of this case may hold device memory into the next one (the engine's parameters and its
        # prefetcher refer to each other: only the collector frees them).
        del ours, reference
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row = {"model": name, "params": count_params(cfg), "tier": tier, "accumulation": accum,
           "reference_step_s": statistics.median(ref_times), "step_s": statistics.median(our_times),
           "ratio": statistics.median(ratios), "loss": loss, "copies": metrics.get("copies", {}),
           "placement": placement, **setup, **predicted(cfg, tier, accum, args),
           **({"trace": trace_path} if trace_path else {})}
    row["measured_over_predicted"] = row["step_s"] / row["predicted_s"]
    row["ratio_over_predicted_ratio"] = row["ratio"] / (row["predicted_s"] / row["reference_predicted_s"])
    if tier in ("nvme", "spill") and disk:
        moved = statistics.median(nvme_bytes)
        io_floor_s = moved / disk["bytes_per_s"]
        row.update(nvme_bytes_per_step=moved, io_floor_s=io_floor_s)
        if moved:  # spill may keep every state in host memory: no disk bound then
            row["io_ratio"] = row["step_s"] / io_floor_s
    return row


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
    rows = []
    with contextlib.ExitStack() as stack:
        nvme_path = args.nvme_path or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-gpu-"))
        disk = measure_disk(nvme_path) if any(t == "nvme" for t, _ in cases) else None
        print(f"machine: {machine(device)}; micro-batch {args.micro_batch} x seq {args.seq}, bf16, "
              f"{args.rounds} rounds after {args.warmup} warm-up")
        print(f"{'model':>6} {'tier':>7} {'acc':>3} {'plain s':>9} {'ours s':>9} {'ratio':>7} {'predicted s':>11} "
              f"{'/pred':>6} {'ratio/pred':>10} {'bound by':>10}  host<->device MB/step")
        for name in names:
            for tier, accum in cases:
                row = run_case(MODELS[name], name, tier, accum, args, device, nvme_path, disk)
                rows.append(row)
                moved = sum(row["copies"].values()) / 1e6
                extra = f"   io {row['io_ratio']:.2f}x disk bound" if "io_ratio" in row else ""
                extra += f"   initialize {row['initialize_s']:.1f} s"
                if row.get("pinned_nbytes"):
                    extra += f" (then {row['pinned_nbytes'] / 1e9:.1f} GB pinned in {row['pinning_s']:.1f} s behind it)"
                print(f"{name:>6} {tier:>7} {accum:>3} {row['reference_step_s']:9.3f} {row['step_s']:9.3f} "
                      f"{row['ratio']:6.2f}x {row['predicted_s']:11.3f} {row['measured_over_predicted']:5.2f}x "
                      f"{row['ratio_over_predicted_ratio']:9.2f}x "
                      f"{row['bound_by']:>10}  {moved:10.1f}{extra}", flush=True)
    summary = {"machine": machine(device), "disk": disk, "rows": rows}
    for name in names:  # issue 12: nvme configured with a budget that holds the states, against cpu
        by_tier = {r["tier"]: r for r in rows if r["model"] == name and r["accumulation"] == 1}
        if "spill" in by_tier and "cpu" in by_tier:
            ratio = by_tier["spill"]["step_s"] / by_tier["cpu"]["step_s"]
            summary.setdefault("spill_vs_cpu", {})[name] = ratio
            print(f"{name}: nvme configured, states within the host budget: {ratio:.2f}x the cpu step")
        if "half" in by_tier and "cpu" in by_tier:  # the target: half the states on the device, <= 0.6x the cpu step
            ratio = by_tier["half"]["step_s"] / by_tier["cpu"]["step_s"]
            summary.setdefault("half_vs_cpu", {})[name] = ratio
            print(f"{name}: half the optimizer on the device: {ratio:.2f}x the cpu step")
        if "unbound" in by_tier and "cpu" in by_tier:  # the CPU Adam bound off the feeder's core, against every core
            ratio = by_tier["cpu"]["step_s"] / by_tier["unbound"]["step_s"]
            summary.setdefault("bound_vs_unbound", {})[name] = ratio
            print(f"{name}: the CPU Adam bound off the first core: {ratio:.2f}x the step with it on every core")
    line = json.dumps(summary)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
