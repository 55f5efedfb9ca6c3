"""Overlap: step time with parameters and optimizer on NVMe, all overlap on
against all off, against two floors measured in the same run:

* the compute floor: the same model and batch with no offload (everything in
  memory, the same fused optimizer);
* the I/O floor: the bytes one step moves to and from NVMe divided by the
  bandwidth `infinity bench` measures on the same path (read and write apart).

The three engines (no offload, overlapped, sequential) live side by side and
their steps alternate, so the machine's noise hits all alike; figures are
medians. Each engine runs ``--block`` consecutive steps per round (default 1),
timed together with the last one's write-behind (waited for before the next
engine's block, which shares the disk); the step time is the block's over its
steps. Within a block a step's write-behind and the next one's first reads
overlap as in training; the block's first reads and last writes do not, which
a long run would hide.
The last line is JSON with at least step_s, step_no_overlap_s,
compute_floor_s, io_floor_s and predicted_step_s: the step-time model's
prediction of the overlapped step (``infinity.placement.step_time``), from the
machine's cached figures (``infinity bench --machine``; measured here when
there are none) with the disk's bandwidth measured in this run, for a block of
``--block`` steps timed with its fill and drain; ``measured_over_predicted`` is
the median of the per-round ratios. ``predicted_now_s`` predicts each round's
step again from figures measured around it (the block's throughput at the
model's width before and after it, the CPU Adam and the disk before it), so that on a machine
other work shares the step and its figures see the same load;
``measured_over_predicted_now`` is the median of those rounds' ratios.
``measured_busy_s`` holds each resource's busy seconds from the overlapped
engine's timelines (compute, optimizer, reads and writes in flight, the disk
either way), beside ``step_resources``, the model's.

With ``--gradient-clipping C`` the overlapped and sequential engines clip (the
overlapped step speculates and is settled once the norm is known), and a fourth
engine, overlapped without clipping, runs alongside: ``step_unclipped_s`` and
``step_over_unclipped`` compare the two, and ``outcomes`` counts how the
clipped overlapped steps ended (committed, redone, skipped).

    python benchmarks/bench_overlap.py                     # ~300M parameters
    python benchmarks/bench_overlap.py --layers 4 --steps 2  # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

# As the `infinity` CLI does: large blocks 2 MiB-aligned, so NVMe reads land in place (set before torch).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

import infinity  # noqa: E402
from infinity.models.gpt import GPT, GPTConfig, count_params  # noqa: E402
from infinity.placement.estimate_gpt import estimate_gpt  # noqa: E402
from infinity.placement.step_time import gpt_shape, predict_step, traffic_from_estimate  # noqa: E402
from infinity.runtime.machine_figures import machine_figures, measure_block_now, measure_cpu_adam  # noqa: E402
from infinity.storage.bench import check_free_space, measure_nvme  # noqa: E402


AIO = {"block_size": 1 << 20, "queue_depth": 32}
STAGING = {}
"""offload_optimizer keys of every offloaded engine: --buffer-count sets buffer_count (default: the config's)."""
PRECISION = {"name": "bf16"}
"""The compute precision of every engine here: --precision, default auto (the machine's fast one)."""


def engine_config(nvme_path: str | None, *, overlap: bool, sub_group_size: int, clip: float = 0.0,
                  behind_forward: bool = True) -> dict:
    offload = "nvme" if nvme_path else "none"
    param = {"device": offload}
    optimizer = {"device": offload}
    if nvme_path:
        param.update(nvme_path=nvme_path, max_in_cpu=0)
        optimizer.update(nvme_path=nvme_path, max_in_cpu=0)  # measure NVMe, not the host-memory spill
        optimizer.update(STAGING)
    return {
        "aio": dict(AIO),
        "bf16": {"enabled": PRECISION["name"] == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "gradient_clipping": clip,
        "zero_optimization": {
            "stage": 3, "offload_param": param, "offload_optimizer": optimizer, "sub_group_size": sub_group_size,
            "overlap_step_with_backward": overlap,
            "overlap_step_with_forward": behind_forward,
            "stage3_prefetch_bucket_size": 200_000_000 if overlap else 0,
            "stage3_max_reuse_distance": 1_000_000_000 if overlap else 0,
        },
    }


def build(cfg: GPTConfig, config: dict):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    return infinity.initialize(model, config)


def predicted(cfg: GPTConfig, batch: int, sub_group_size: int, block: int, *, figures, overlap: bool = True,
              offloaded: bool = True) -> dict:
    """The step-time model's step for an engine of this run (``engine_config``'s settings): a steady step, plus
    the fill and drain a block of ``block`` steps pays once. ``figures``: the machine's."""
    offload = "nvme" if offloaded else "none"
    est = estimate_gpt(cfg, micro_batch=batch, precision=PRECISION["name"], offload_param=offload,
                       offload_optimizer=offload, max_in_cpu=0, optimizer_max_in_cpu=0, sub_group_size=sub_group_size,
                       gpu=False, prefetch_bucket_size=200_000_000 if overlap else 0,
                       max_reuse_distance=1_000_000_000 if overlap else 0, overlap_step=overlap)
    traffic = traffic_from_estimate(est, shape=gpt_shape(cfg), overlap_step_with_backward=overlap, crossings=False)
    steady = predict_step(figures, traffic)
    alone = predict_step(figures, traffic, timed_alone=True)
    return dict(steady.as_dict(), predicted_s=steady.predicted_s + (alone.predicted_s - steady.predicted_s) / block,
                read_nbytes=traffic.fetch_nvme_read_nbytes + traffic.state_read_nbytes,
                written_nbytes=traffic.state_write_nbytes)


def figures_now(base, cfg: GPTConfig, batch: int, nvme: str):
    """``base`` (the cached figures) with what a step leans on measured again now, between a round's engines: the
    block's throughput at the model's width on its batch (the median of three, not the best; measured again after
    the step by :func:`with_block_after`), the fused CPU Adam
    over fp32 states, and the disk (256 MiB, the write overwriting). On a machine that other work shares, a step
    and the figures it is predicted from then see the same load."""
    precision = PRECISION["name"]
    overhead = base.block_overhead_s.get(precision, next(iter(base.block_overhead_s.values())))
    rate = measure_block_now(cfg.d_model, batch, cfg.seq_len, precision, overhead_s=overhead)
    disk = measure_nvme(nvme, nbytes=256 << 20, block_size=1 << 20, queue_depth=32, rewrite=True)
    adam = dict(base.cpu_adam_elements_per_s, fp32=measure_cpu_adam("fp32", budget_s=0.0))
    return dataclasses.replace(base, block_tflops={precision: {str(cfg.d_model): rate}}, cpu_adam_elements_per_s=adam,
                               nvme_read_GBps=disk.read_GBps, nvme_write_GBps=disk.write_GBps)


def with_block_after(before, cfg: GPTConfig, batch: int):
    """``before`` (:func:`figures_now`'s, measured before a step) with the block's throughput measured again after
    the step and the two averaged over their seconds: the step's load, sampled on both sides of it."""
    precision, width = PRECISION["name"], str(cfg.d_model)
    overhead = before.block_overhead_s.get(precision, next(iter(before.block_overhead_s.values())))
    after = measure_block_now(cfg.d_model, batch, cfg.seq_len, precision, overhead_s=overhead)
    rate = 2 / (1 / before.block_tflops[precision][width] + 1 / after)
    return dataclasses.replace(before, block_tflops={precision: {width: rate}})


def _busy_seconds(metrics: dict) -> dict:
    """A step's measured busy seconds by the model's resources, from its timeline: compute (forward and backward,
    less their waits on I/O), the optimizer's updates, reads and writes each in flight, and the disk busy either
    way. A step's write-behind is counted in the next step's timeline, so a run's median is a steady step's."""
    tl = metrics["timeline"]
    return {"compute": tl["compute_s"], "cpu_adam": tl["optimizer_s"], "nvme_read": tl["nvme_read_s"],
            "nvme_write": tl["nvme_write_s"], "disk": tl["io_s"],
            "staged_nbytes": metrics.get("compute_shards_from_staging_nbytes", 0)}


def one_block(engine, batch, steps: int) -> tuple[float, list[dict]]:
    """``steps`` consecutive steps of one engine; seconds per step and each step's metrics.

    The block's time includes the write-behind of its last step (waited for before the next engine's block,
    which shares the disk). Within the block each step's write-behind finishes behind the next forward and
    the next step's first reads overlap the previous one's tail, as in training; only the block's first
    reads and last writes are exposed, so a block of one step charges a whole pipeline fill and drain to
    every offloaded step."""
    metrics = []
    start = time.perf_counter()
    for _ in range(steps):
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        metrics.append(engine.step_metrics())
    flush = getattr(engine.optimizer, "flush", None)
    if flush is not None:
        flush()
    return (time.perf_counter() - start) / steps, metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="measured rounds (blocks) of each engine")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    parser.add_argument("--block", type=int, default=1,
                        help="consecutive steps of each engine per round, timed together (default 1: each step "
                             "pays a whole pipeline fill and drain, which a long run hides; 2 halves that, and the "
                             "run's time doubles)")
    parser.add_argument("--sub-group-size", type=int, default=20_000_000)
    parser.add_argument("--block-size", type=int, default=1 << 20, help="aio block size in bytes (default 1 MiB)")
    parser.add_argument("--queue-depth", type=int, default=32, help="aio queue depth (default 32)")
    parser.add_argument("--nvme-path", default=None, help="a directory on the NVMe tier (default: a temporary one)")
    parser.add_argument("--gradient-clipping", type=float, default=0.0,
                        help="clip the overlapped and sequential engines' gradients at this norm (default 0: off); "
                             "adds an overlapped engine without clipping to compare with")
    parser.add_argument("--without-tail", action="store_true",
                        help="with --gradient-clipping: add an overlapped, clipped engine whose step makes its updates "
                             "before returning (overlap_step_with_forward false), to measure what finishing them "
                             "behind the next forward gains (use --block 2 or more: a block of one step pays the "
                             "tail in its drain)")
    parser.add_argument("--buffer-count", type=int, default=None,
                        help="offload_optimizer.buffer_count of the offloaded engines: staging sets, each one "
                        "sub-group of states in pinned host memory (more read further ahead; default: the config's)")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="compute precision (default auto: bf16 where the machine computes it fast, else fp32)")
    args = parser.parse_args()
    from infinity.runtime.hardware import machine_description, resolve_precision

    chosen = resolve_precision(args.precision)
    PRECISION["name"] = chosen.precision
    AIO.update(block_size=args.block_size, queue_depth=args.queue_depth)
    if args.buffer_count is not None:
        STAGING["buffer_count"] = args.buffer_count

    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, d_model=args.d_model, seq_len=args.seq_len)
    numel = count_params(cfg)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    print(f"machine: {machine_description()}")
    print(f"model: {numel / 1e6:.0f}M parameters, batch {args.batch} x {args.seq_len} tokens, {chosen.precision}"
          + (f" (auto: {chosen.reason})" if args.precision == "auto" else ""))

    with tempfile.TemporaryDirectory(dir=args.nvme_path, prefix="bench-overlap-") as nvme:
        check_free_space(nvme, 2 * numel * 14 + (1 << 30))
        # the write overwrites written blocks, as the step's write-back overwrites its keys' extents
        bw = [measure_nvme(nvme, nbytes=1 << 30, block_size=1 << 20, queue_depth=32, rewrite=True) for _ in range(3)]
        read_GBps = statistics.median(r.read_GBps for r in bw)
        write_GBps = statistics.median(r.write_GBps for r in bw)
        print(f"nvme bandwidth (infinity bench, 1 GiB, 1 MiB blocks, QD 32): write (overwriting) {write_GBps:.2f} GB/s, "
              f"read {read_GBps:.2f} GB/s")

        clip, size = args.gradient_clipping, args.sub_group_size
        engines = {
            "floor": build(cfg, engine_config(None, overlap=True, sub_group_size=size)),
            "on": build(cfg, engine_config(nvme, overlap=True, sub_group_size=size, clip=clip)),
            "off": build(cfg, engine_config(nvme, overlap=False, sub_group_size=size, clip=clip)),
        }
        if clip > 0:
            engines["unclipped"] = build(cfg, engine_config(nvme, overlap=True, sub_group_size=size))
        if clip > 0 and args.without_tail:
            engines["no tail"] = build(cfg, engine_config(nvme, overlap=True, sub_group_size=size, clip=clip,
                                                          behind_forward=False))
        times = {name: [] for name in engines}
        metrics_on = None
        busy_on: list[dict] = []
        cached = machine_figures()
        round_figures = []
        outcomes: dict[str, int] = {}
        for i in range(args.warmup + args.steps):
            for name, engine in engines.items():  # alternate, so the machine's noise hits all alike
                if name == "on" and i >= args.warmup:  # the figures as the machine is now, just before the step
                    round_figures.append(figures_now(cached, cfg, args.batch, nvme))
                elapsed, block_metrics = one_block(engine, batch, args.block)
                if name == "on" and i >= args.warmup:  # and the block's throughput again just after it
                    round_figures[-1] = with_block_after(round_figures[-1], cfg, args.batch)
                if i >= args.warmup:
                    times[name].append(elapsed)
                    metrics_on = block_metrics[-1] if name == "on" else metrics_on
                    if name == "on":
                        busy_on += [_busy_seconds(m) for m in block_metrics]
                if name == "on":
                    for metrics in block_metrics:
                        outcome = metrics.get("overlapped_step", "none")
                        outcomes[outcome] = outcomes.get(outcome, 0) + 1
            print("  round {}: {}".format(i, ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items() if t))
                  if i >= args.warmup else f"  round {i}: warm-up", flush=True)
        for engine in engines.values():
            engine.close()
        compute_times = times["floor"]

    in_run = dataclasses.replace(cached, nvme_read_GBps=read_GBps, nvme_write_GBps=write_GBps)
    model = predicted(cfg, args.batch, args.sub_group_size, args.block, figures=in_run)
    floor_model = predicted(cfg, args.batch, args.sub_group_size, args.block, figures=in_run, offloaded=False)
    # Each round's step over the model's step from the figures measured around it (the same load)
    per_round = [predicted(cfg, args.batch, args.sub_group_size, args.block, figures=f) for f in round_figures]
    floor_per_round = [predicted(cfg, args.batch, args.sub_group_size, args.block, figures=f, offloaded=False)
                       for f in round_figures]
    nvme_tier = metrics_on["tiers"]["nvme"]
    io_floor = nvme_tier["bytes_read"] / (read_GBps * 1e9) + nvme_tier["bytes_written"] / (write_GBps * 1e9)
    result = {
        "params": numel,
        "step_s": statistics.median(times["on"]),
        "step_no_overlap_s": statistics.median(times["off"]),
        "compute_floor_s": statistics.median(compute_times),
        "io_floor_s": io_floor,
        "bytes_read_per_step": nvme_tier["bytes_read"],
        "bytes_written_per_step": nvme_tier["bytes_written"],
        "read_GBps": read_GBps,
        "write_GBps": write_GBps,
        "timeline": metrics_on["timeline"],
    }
    # Each resource's measured busy seconds (median over the overlapped engine's steps) beside the model's: less
    # sensitive to other work on the machine than the step's wall time, and they say which part of the model errs.
    result["measured_busy_s"] = {key: statistics.median(b[key] for b in busy_on) for key in busy_on[0]}
    result.update(predicted_step_s=model["predicted_s"], step_bound_by=model["bound_by"],
                  step_resources=model["resources"], predicted_floor_s=floor_model["predicted_s"],
                  predicted_bytes_read_per_step=model["read_nbytes"],
                  predicted_bytes_written_per_step=model["written_nbytes"],
                  measured_over_predicted=statistics.median(t / model["predicted_s"] for t in times["on"]),
                  floor_measured_over_predicted=statistics.median(t / floor_model["predicted_s"]
                                                                  for t in times["floor"]))
    result.update(
        predicted_now_s=[round(p["predicted_s"], 4) for p in per_round],
        predicted_now_resources=[p["resources"] for p in per_round],
        measured_over_predicted_now=statistics.median(t / p["predicted_s"] for t, p in zip(times["on"], per_round)),
        floor_measured_over_predicted_now=statistics.median(
            t / p["predicted_s"] for t, p in zip(times["floor"], floor_per_round)),
        figures_now=[{"block_tflops": f.block_tflops[PRECISION["name"]][str(cfg.d_model)],
                      "cpu_adam_fp32": f.cpu_adam_elements_per_s["fp32"], "nvme_read_GBps": f.nvme_read_GBps,
                      "nvme_write_GBps": f.nvme_write_GBps} for f in round_figures])
    # The floor engine ran beside the overlapped one in every round: on a shared machine both slow down alike, so
    # the measured on / floor over the predicted on / floor is the part of the model the load leaves alone.
    result["over_floor_measured_over_predicted"] = statistics.median(
        (on / floor) / (model["predicted_s"] / floor_model["predicted_s"]) for on, floor in zip(times["on"], times["floor"]))
    # Ratios per round (the three engines ran back to back), then their median: the machine's noise
    # moves a round's three steps together, so a ratio is steadier than a ratio of medians.
    result["step_over_floor"] = statistics.median(
        on / max(floor, io_floor) for on, floor in zip(times["on"], times["floor"]))
    result["speedup_over_no_overlap"] = statistics.median(off / on for on, off in zip(times["on"], times["off"]))
    result["step_over_floor_of_medians"] = result["step_s"] / max(result["compute_floor_s"], io_floor)
    if clip > 0:
        result.update(gradient_clipping=clip, step_unclipped_s=statistics.median(times["unclipped"]),
                      step_over_unclipped=statistics.median(on / un for on, un in zip(times["on"], times["unclipped"])),
                      outcomes=outcomes, grad_norm=metrics_on.get("grad_norm"))
    if STAGING:
        result.update(STAGING)
    if "no tail" in times:
        result.update(step_without_tail_s=statistics.median(times["no tail"]),
                      tail_speedup=statistics.median(nt / on for on, nt in zip(times["on"], times["no tail"])),
                      block=args.block)
    print(f"step, overlap on : {result['step_s']:.2f} s  ({result['step_over_floor']:.2f} x max(floors), median of "
          f"per-round ratios; target <= 1.15)")
    print(f"step, overlap off: {result['step_no_overlap_s']:.2f} s  ({result['speedup_over_no_overlap']:.2f} x slower)")
    if clip > 0:
        print(f"step, overlap on, no clipping: {result['step_unclipped_s']:.2f} s  (clipped / unclipped "
              f"{result['step_over_unclipped']:.2f}, target <= 1.1); clipped steps: {outcomes}, last norm "
              f"{result['grad_norm']:.3g}")
    if "no tail" in times:
        print(f"step, clipped, updates before step() returns: {result['step_without_tail_s']:.2f} s  (behind the "
              f"forward is {result['tail_speedup']:.3f} x faster, median of per-round ratios; blocks of {args.block})")
    print(f"step-time model  : {result['predicted_step_s']:.2f} s predicted, bound by {result['step_bound_by']}; "
          f"measured / predicted {result['measured_over_predicted']:.2f} (median of per-round ratios); floor "
          f"predicted {result['predicted_floor_s']:.2f} s, measured / predicted {result['floor_measured_over_predicted']:.2f}; "
          f"(on / floor) measured / predicted {result['over_floor_measured_over_predicted']:.2f}")
    busy, res = result["measured_busy_s"], model["resources"]
    print(f"busy, measured (predicted): compute {busy['compute']:.2f} s ({res['gpu']:.2f}), optimizer "
          f"{busy['cpu_adam']:.2f} s ({res['cpu_adam']:.2f}), disk {busy['disk']:.2f} s "
          f"({res['nvme_read'] + res['nvme_write']:.2f}: reads {res['nvme_read']:.2f}, writes {res['nvme_write']:.2f}); "
          f"{busy['staged_nbytes'] / 1e9:.2f} GB of compute shards from staging")
    print(f"step-time model, figures measured around each round's step: predicted "
          f"{', '.join(f'{p:.2f}' for p in result['predicted_now_s'])} s; measured / predicted "
          f"{result['measured_over_predicted_now']:.2f} (median of per-round ratios); floor "
          f"{result['floor_measured_over_predicted_now']:.2f}")
    print(f"compute floor    : {result['compute_floor_s']:.2f} s")
    print(f"I/O floor        : {result['io_floor_s']:.2f} s  ({nvme_tier['bytes_read'] / 1e9:.2f} GB read, "
          f"{nvme_tier['bytes_written'] / 1e9:.2f} GB written per step)")
    tl = result["timeline"]
    print(f"timeline (overlap on, last step): compute {tl['compute_s']:.2f} s, optimizer {tl['optimizer_s']:.2f} s, "
          f"I/O {tl['io_s']:.2f} s, I/O not hidden {tl['io_exposed_s']:.2f} s")
    result.update(machine=machine_description(), precision=chosen.precision)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
