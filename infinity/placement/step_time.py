"""The step-time model: from the machine's measured figures and the bytes a placement moves, the time of one
training step, each resource's busy seconds and the one that binds.

Seven resources, each busy for part of a step (:class:`StepTraffic` says how much it has to do, the machine's
figures, :class:`~infinity.runtime.machine_figures.MachineFigures`, how fast it does it):

* ``gpu``: forward and backward (FLOPs ≈ 6 · matmul parameters · tokens, the attention's products, a
  recomputed forward) at the device's matmul throughput, plus the optimizer when its states rest on the device;
* ``h2d``: host-to-device copies: compute shards fetched from host memory (forward, and backward again for
  those not kept gathered; the forward again for those not kept from the micro-batch before), new compute
  shards after a host step;
* ``d2h``: device-to-host copies: gradient slices going down to a host optimizer;
* ``cpu_adam``: the fused CPU Adam over the states in host memory or on NVMe;
* ``nvme_read`` / ``nvme_write``: compute shards and optimizer states read from and written to NVMe;
* ``feed``: the thread that feeds the device, for the engine's own work on each parameter tensor it fetches and
  releases, every micro-batch (hooks, fetch and release, copy issues, the gradient's hook), at the machine's
  ``host_feed_s_per_tensor`` (none where that figure was not measured). Plain PyTorch's own launches are in the
  block figures' fixed overhead.

What the design overlaps (the critical path), on a machine whose device is a GPU:

1. **forward and backward with fetches**: the prefetcher brings shards up (NVMe read, then a copy up) ahead
   of need, so the compute phase lasts as long as the busiest of compute and the fetches' copies and reads
   (without prefetching, the fetches wait in line: their sum), and at least as long as the feeding thread's
   work: the engine's per tensor beside the launches (a small model's GPU waits for it);
2. **the host step**, sub-group by sub-group: gradients down, states read, the CPU Adam, then states written
   and new compute shards up. The stages run on different resources and overlap across sub-groups, so the
   step lasts as long as its busiest stage plus one sub-group through the others (a pipeline's fill). With
   ``overlap_step_with_backward`` it starts as the boundary micro-batch's backward begins (gradients become
   final all through it) and ends at least one sub-group's chain after backward ends (the last gradients are
   final only then); without, it starts when backward ends. With ``overlap_step_with_forward`` too, the updates
   not begun when backward ends run behind the next forward (which reads each sub-group's new shards as its
   update delivers them), and the next backward waits for the last of them;
3. **behind the next forward**: states written back and new compute shards going up overlap the next step's
   forward (write-behind); only their resource's total bounds the step. Copies run both ways at once (h2d and
   d2h are separate wires); an NVMe disk reads and writes from one budget of time.

The step is the longest of that critical path and every resource's total busy time (a steady run cannot go
faster than its busiest wire).

Without a GPU the device is the CPU: compute, the CPU Adam and the distinct-device mode's copies all run on
the same cores, one after another (the feeding thread's work too), while NVMe transfers overlap them. The step
is then the cores' sum plus the I/O it leaves exposed. Where the updates run beside backward they share the
cores with it rather than hide behind it: their seconds add to the compute's (on a GPU they overlap). The
copies the engine makes within the one memory are the cores' work too (``host_copy_nbytes``, at the machine's
memory copy figure): compute shards a fetch copies out of the optimizer's staging sets, and each micro-batch's
gradient slices copied into the flat slices the optimizer reads; on a GPU those bytes cross (``h2d``, ``d2h``)
instead.

``timed_alone`` (a step timed on its own, as ``bench_overlap.py``'s blocks of one step are) adds what a run
of steps hides: the first fetch before the forward can start, and the last sub-group's write-behind. Both are
the disk's bytes too, so they lengthen the path of the work that waits on them (the cores, on a CPU device),
never the disk's own time.

The bytes (:func:`traffic_from_estimate`): with the optimizer's states on NVMe, an update leaves each
sub-group's new compute shards in its staging set, and the next forward copies the last sets' worth from there
instead of reading them (:mod:`infinity.params.staging`). The disk's write figure is an overwrite, as a steady
step's write-back overwrites the extents its keys already have.
"""

from __future__ import annotations

import dataclasses
import logging
import math

__all__ = ["RESOURCES", "StepTraffic", "StepPrediction", "compute_seconds", "format_prediction", "gpt_shape", "model_shape",
           "predict_from_estimate", "predict_step", "step_flops", "traffic_from_estimate"]

logger = logging.getLogger(__name__)

RESOURCES = ("gpu", "h2d", "d2h", "cpu_adam", "nvme_read", "nvme_write", "feed")
"""The resources a step keeps busy, in the order they are reported."""

_COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_DEVICE_ADAM_BYTES = 4 * 3 + 4 + 4 * 3 + 2
"""Bytes the device optimizer moves an element: reads master, gradient (fp32), moments; writes them and the copy."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepTraffic:
    """What one step asks of each resource, per rank: FLOPs, bytes, elements."""

    layers: int
    """Transformer blocks of the model."""
    width: int
    """The model's width (d_model): which of the machine's block throughputs applies."""
    seq_len: int
    """Tokens per sample (the attention's span)."""
    tokens: int
    """Tokens of one micro-batch (micro-batch x sequence)."""
    head_params: int = 0
    """Parameters of the output head's matmul (vocabulary x width)."""
    precision: str = "bf16"
    """The compute precision (``bf16``, ``fp16``, ``fp32``): which throughput applies."""
    recompute: bool = False
    """Activation checkpointing: backward runs the forward again."""
    micro_batches: int = 1
    """Micro-batches a step (gradient accumulation)."""
    fetch_h2d_nbytes: float = 0
    """Compute shards copied up for fetches over the step."""
    fetch_nvme_read_nbytes: float = 0
    """Compute shards read from NVMe for fetches over the step."""
    first_fetch_nbytes: float = 0
    """What the first fetch of a step reads or copies before the forward can begin (its largest layer's shard)."""
    grad_d2h_nbytes: float = 0
    """Gradient slices copied down to a host optimizer over the step."""
    shards_h2d_nbytes: float = 0
    """New compute shards copied up after the host step (parameters resting on the device)."""
    shards_d2h_nbytes: float = 0
    """New compute shards copied down after a device step (parameters resting in host memory or on NVMe)."""
    state_read_nbytes: float = 0
    """Optimizer states read from NVMe."""
    state_write_nbytes: float = 0
    """Optimizer states (and compute shards resting on NVMe) written to NVMe."""
    cpu_adam_elements: float = 0
    """Elements the CPU Adam steps (optimizer states in host memory or on NVMe)."""
    device_adam_elements: float = 0
    """Elements the device optimizer steps (states on the device)."""
    state_dtype: str = "fp32"
    """The optimizer states' form: which CPU Adam throughput applies."""
    sub_groups: int = 1
    """Sub-groups the host step goes through (its pipeline's depth)."""
    prefetch: bool = True
    """Fetches run ahead of need, beside compute."""
    overlap_step_with_backward: bool = True
    """The host step runs during the boundary micro-batch's backward."""
    overlap_step_with_forward: bool = True
    """With ``overlap_step_with_backward``: the updates the host has not begun when backward ends run behind the
    next forward, first those it reads first (:mod:`infinity.optim.step_tail`)."""
    crossings: bool = True
    """Device memory is apart from host memory (a GPU, or the distinct-device mode): copies are real."""
    released_tensors: int = 0
    """Parameter tensors fetched and released every micro-batch (the feeding thread's work is per tensor)."""
    host_copy_nbytes: float = 0
    """Without crossings (the device is the CPU): bytes the cores copy within that one memory a step, each byte
    read and each written counted (as the memory figure counts them): compute shards a fetch copies from the
    optimizer's staging sets, gradient slices copied (or added) into the flat slices the optimizer reads."""


@dataclasses.dataclass(frozen=True, slots=True)
class StepPrediction:
    """The predicted step: its seconds, the resource that binds it, and each resource's busy seconds."""

    predicted_s: float
    bound_by: str
    resources: dict

    def as_dict(self) -> dict:
        return {"predicted_s": self.predicted_s, "bound_by": self.bound_by, "resources": dict(self.resources)}


def _seconds(nbytes: float, GBps: float | None, what: str) -> float:  # noqa: N803 (the unit's spelling)
    if not nbytes:
        return 0.0
    if not GBps:
        raise ValueError(f"the step moves {nbytes:.3g} bytes by {what}, but the machine's figures have no {what} "
                         f"bandwidth (run `infinity bench --machine` where that path can be measured)")
    return nbytes / (GBps * 1e9)


def step_flops(traffic: StepTraffic) -> float:
    """FLOPs of the step's forwards and backwards: 6 per matmul parameter per token (the blocks' linear layers and
    the head; embeddings are look-ups), the attention's two products (12 · layers · sequence · width per token),
    and a second forward with ``recompute``."""
    d = traffic.width
    matmul_params = traffic.layers * 12 * d * d + traffic.head_params
    per_token = 6 * matmul_params + 12 * traffic.layers * traffic.seq_len * d
    if traffic.recompute:
        per_token += per_token // 3
    return float(per_token * traffic.tokens * traffic.micro_batches)


def _block_rate(figures, precision: str, width: int) -> float:
    """FLOP/s of a block's matmuls at ``width`` (beyond its fixed overhead): the machine's block figures,
    interpolated in log(width) and held at the ends; another precision than the one measured scales by the
    matmul throughputs."""
    measured = next(iter(figures.block_tflops))
    table = figures.block_tflops.get(precision) or figures.block_tflops[measured]
    points = sorted((int(w), r) for w, r in table.items())
    scale = 1.0
    if precision not in figures.block_tflops:
        want = figures.matmul_tflops.get(precision) or figures.matmul_tflops.get("fp32")
        scale = want / figures.matmul_tflops[measured]
    if width <= points[0][0]:
        rate = points[0][1]
    elif width >= points[-1][0]:
        rate = points[-1][1]
    else:
        (w0, r0), (w1, r1) = next((a, b) for a, b in zip(points, points[1:]) if a[0] <= width <= b[0])
        f = math.log(width / w0) / math.log(w1 / w0)
        rate = math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))
    return rate * scale * 1e12


def compute_seconds(figures, traffic: StepTraffic) -> float:
    """Forward and backward of every micro-batch: each block its fixed overhead plus its FLOPs at the block
    throughput of the model's width; the head (and embeddings, the loss) one more block's overhead plus its FLOPs."""
    rate = _block_rate(figures, traffic.precision, traffic.width)
    return step_flops(traffic) / rate + _launch_seconds(figures, traffic)


def _launch_seconds(figures, traffic: StepTraffic) -> float:
    """The blocks' fixed overheads over the step (launches, dispatch, autograd: the feeding thread's own part)."""
    measured = next(iter(figures.block_overhead_s))
    overhead = figures.block_overhead_s.get(traffic.precision, figures.block_overhead_s[measured])
    return (traffic.layers + 1) * overhead * (1 + traffic.recompute / 3) * traffic.micro_batches


def _feed_seconds(figures, traffic: StepTraffic) -> float:
    """The engine's host-side work on the tensors it fetches and releases, over the step's micro-batches."""
    return traffic.released_tensors * traffic.micro_batches * (figures.host_feed_s_per_tensor or 0.0)


def _busy(figures, traffic: StepTraffic) -> dict:
    """Each resource's busy seconds a step, and the parts the critical path needs."""
    # the copies within the device's one memory run on the device (the cores) beside its forward and backward
    compute_s = compute_seconds(figures, traffic) + _seconds(traffic.host_copy_nbytes, figures.device_memory_GBps,
                                                             "copy within device memory")
    if traffic.device_adam_elements and figures.device == "cpu":
        device_adam_s = traffic.device_adam_elements / figures.cpu_adam_elements_per_s["fp32"]
    elif traffic.device_adam_elements:
        # a GPU's fused AdamW is bound by its memory's bandwidth
        device_adam_s = traffic.device_adam_elements * _DEVICE_ADAM_BYTES / (figures.device_memory_GBps * 1e9)
    else:
        device_adam_s = 0.0
    copies = traffic.crossings
    parts = {
        "compute": compute_s,
        "feed": _feed_seconds(figures, traffic),
        "launch": _launch_seconds(figures, traffic),
        "device_adam": device_adam_s,
        "fetch_h2d": _seconds(traffic.fetch_h2d_nbytes, figures.h2d_GBps, "host-to-device copy") if copies else 0.0,
        "fetch_read": _seconds(traffic.fetch_nvme_read_nbytes, figures.nvme_read_GBps, "NVMe read"),
        "grad_d2h": _seconds(traffic.grad_d2h_nbytes, figures.d2h_GBps, "device-to-host copy") if copies else 0.0,
        "shards_h2d": _seconds(traffic.shards_h2d_nbytes, figures.h2d_GBps, "host-to-device copy") if copies else 0.0,
        "shards_d2h": _seconds(traffic.shards_d2h_nbytes, figures.d2h_GBps, "device-to-host copy") if copies else 0.0,
        "state_read": _seconds(traffic.state_read_nbytes, figures.nvme_read_GBps, "NVMe read"),
        "state_write": _seconds(traffic.state_write_nbytes, figures.nvme_write_GBps, "NVMe write"),
        "cpu_adam": traffic.cpu_adam_elements / figures.cpu_adam_elements_per_s[traffic.state_dtype]
        if traffic.cpu_adam_elements else 0.0,
    }
    first = traffic.first_fetch_nbytes
    parts["first_fetch"] = (_seconds(first, figures.nvme_read_GBps, "NVMe read") if traffic.fetch_nvme_read_nbytes
                            and first else 0.0) + (_seconds(first, figures.h2d_GBps, "host-to-device copy")
                                                   if traffic.fetch_h2d_nbytes and first and copies else 0.0)
    resources = {
        "gpu": compute_s + device_adam_s,
        "h2d": parts["fetch_h2d"] + parts["shards_h2d"],
        "d2h": parts["grad_d2h"] + parts["shards_d2h"],
        "cpu_adam": parts["cpu_adam"],
        "nvme_read": parts["fetch_read"] + parts["state_read"],
        "nvme_write": parts["state_write"],
        "feed": parts["feed"],
    }
    return {"resources": resources, "parts": parts}


def _pipeline(stage_totals: list[float], depth: int) -> float:
    """Seconds for ``depth`` equal items through stages whose totals over all items are ``stage_totals``: the
    busiest stage's total, plus one item through every other stage (the fill and drain)."""
    stages = [s for s in stage_totals if s > 0]
    if not stages:
        return 0.0
    depth = max(1, depth)
    busiest = max(stages)
    return busiest + (sum(stages) - busiest) / depth


def _chain(stage_totals: list[float], depth: int) -> float:
    """One item (a sub-group) through every stage, one after another."""
    return sum(stage_totals) / max(1, depth)


def predict_step(figures, traffic: StepTraffic, *, timed_alone: bool = False) -> StepPrediction:
    """The step's predicted seconds, its binding resource and every resource's busy seconds (see the module's
    docstring for what overlaps). ``figures``: :class:`~infinity.runtime.machine_figures.MachineFigures`."""
    busy = _busy(figures, traffic)
    resources, p = busy["resources"], busy["parts"]
    depth = traffic.sub_groups
    # Stages of the host step before step() returns (gradients down, states read, the update), and behind it
    # (states written back, new compute shards crossing), which overlap the next forward.
    blocking = [p["grad_d2h"], p["state_read"], p["cpu_adam"]]
    behind = [p["state_write"], p["shards_h2d"], p["shards_d2h"]]
    drain = _chain(behind, depth) if timed_alone else 0.0
    fill = p["first_fetch"] if timed_alone else 0.0
    disk_s = resources["nvme_read"] + resources["nvme_write"]  # one disk: reads and writes share its time

    if figures.device == "cpu":
        # One set of cores computes, steps and copies; NVMe transfers overlap them (read ahead of the forward and
        # of the step, written behind). Overlapped, the step is the cores' work or the disk's, whichever is
        # longer; not overlapped, the step's reads and writes after backward are pipelined with the updates only.
        copies_s = resources["h2d"] + resources["d2h"]
        cores = resources["gpu"] + resources["cpu_adam"] + copies_s + resources["feed"]
        # Timed alone, the cores wait for the first fetch before the forward, and the last sub-group's write-back
        # follows their last update; the disk's own time already holds those bytes, so they add to the cores'
        # path, not to the disk's.
        if traffic.overlap_step_with_backward:
            path = max(fill + cores + drain, disk_s)
        else:
            fetches = [p["compute"] + p["device_adam"] + p["fetch_h2d"] + p["feed"], p["fetch_read"]]
            fetch_phase = max(fetches) if traffic.prefetch else sum(fetches)
            path = fill + fetch_phase + drain + _pipeline(
                [p["state_read"], p["cpu_adam"] + p["grad_d2h"], p["state_write"]], depth)
        critical = {"cores": cores, "disk": disk_s}
    else:
        fetches = [p["compute"], p["fetch_h2d"], p["fetch_read"]]
        compute_phase = max(fetches) if traffic.prefetch else sum(fetches)
        # the GPU runs what the feeding thread has issued: the engine's work per tensor beside the launches
        compute_phase = max(compute_phase, p["launch"] + p["feed"])
        host_step = _pipeline(blocking, depth)
        last_group = _chain(blocking, depth)
        if traffic.overlap_step_with_backward and host_step:
            # the boundary micro-batch's backward: two thirds of its forward and backward
            boundary_backward = compute_phase * (2 / 3) / max(1, traffic.micro_batches)
            if traffic.overlap_step_with_forward:
                # The host's updates begin once backward has finished the first sub-group and go on behind the
                # next forward, which waits for each sub-group's update as it reaches its layers: the next
                # backward begins one sub-group's forward after the last update (it waits for all of them).
                forward = boundary_backward / 2
                host_end = (boundary_backward + forward) / depth + host_step
                step_end = compute_phase + max(last_group, host_end - boundary_backward - forward)
            else:
                step_end = max(compute_phase + last_group, compute_phase - boundary_backward + host_step)
        else:
            step_end = compute_phase + host_step
        path = step_end + p["device_adam"] + fill + drain
        critical = {"compute_phase": compute_phase, "host_step": host_step}

    predicted = max(path, disk_s, *resources.values())
    bound_by = _binding(figures, resources, critical, predicted, disk_s)
    logger.debug("step-time model: %.3f s, bound by %s; resources %s; critical %s", predicted, bound_by,
                 resources, critical)
    return StepPrediction(predicted_s=predicted, bound_by=bound_by,
                          resources={k: round(v, 6) for k, v in resources.items()})


def _binding(figures, resources: dict, critical: dict, predicted: float, disk_s: float) -> str:
    """The resource whose work the predicted step is made of: the disk's busier direction when the disk's time is
    the step; else the busiest resource (on a CPU device, the busiest of the work its cores do)."""
    if disk_s > 0 and math.isclose(predicted, disk_s, rel_tol=1e-9) and disk_s >= max(
            critical.get("cores", 0.0), critical.get("compute_phase", 0.0)):
        return "nvme_read" if resources["nvme_read"] >= resources["nvme_write"] else "nvme_write"
    candidates = ("gpu", "cpu_adam", "h2d", "d2h", "feed") if figures.device == "cpu" else RESOURCES
    return max(candidates, key=lambda r: resources[r])


# --------------------------------------------------------------------------- traffic from an estimate


def gpt_shape(cfg) -> dict:
    """:func:`model_shape`'s keys for a ``GPTConfig``."""
    return {"layers": cfg.n_layer, "width": cfg.d_model, "seq_len": cfg.seq_len,
            "head_params": cfg.vocab_size * cfg.d_model}


def model_shape(est: dict) -> dict:
    """``layers``, ``width``, ``seq_len``, ``head_params`` of the estimate's model: its GPT config when it has one,
    else a GPT of its parameter count (width ≈ (N · 128 / 12)^(1/3), 12 · width² a block, a 50k vocabulary)."""
    s = est["setting"]
    cfg = s.get("model")
    if cfg:
        return {"layers": cfg["n_layer"], "width": cfg["d_model"], "seq_len": s.get("seq_len") or cfg["seq_len"],
                "head_params": cfg["vocab_size"] * cfg["d_model"]}
    n = s["num_params"]
    width = max(64, int(round((n * 128 / 12) ** (1 / 3) / 64)) * 64)
    layers = max(1, round(n / (12 * width * width)))
    return {"layers": layers, "width": width, "seq_len": s.get("seq_len") or 1024,
            "head_params": min(50304 * width, max(0, n - layers * 12 * width * width))}


def _staged_shard_nbytes(est: dict, cbytes: int) -> float:
    """Compute-shard bytes a step's first forward copies from the optimizer's staging sets instead of reading
    them from NVMe (:mod:`infinity.params.staging`): with its states on NVMe, an update leaves each sub-group's
    new shards in its staging set, and the next forward finds there the last sets' worth, the first sub-groups
    (backward's order updates them last); those the host keeps anyway (``max_in_cpu``) are no reads either way."""
    sets = est["setting"].get("optimizer_staging_sets", 0)
    if not sets:
        return 0.0
    numels = est.get("sub_group_numels") or []
    in_sets = sum(numels[:sets]) * cbytes
    host_kept = est["tiers"]["host"]["compute_shard"]
    return float(min(est["tiers"]["nvme"]["compute_shard"], max(0, in_sets - host_kept)))


def traffic_from_estimate(est: dict, *, micro_batch: int | None = None, seq_len: int | None = None,
                          overlap_step_with_backward: bool = True, overlap_step_with_forward: bool = True,
                          recompute: bool | None = None, crossings: bool | None = None,
                          shape: dict | None = None) -> StepTraffic:
    """What one step asks of each resource, from an :func:`~infinity.placement.estimate.estimate` (its setting,
    its model's shape, the bytes it puts in each tier). ``micro_batch`` and ``seq_len`` default to the estimate's
    (1 and the model's sequence without them); ``crossings`` to the estimate's ``gpu``; ``recompute`` to its
    ``activation_checkpointing``; ``shape`` to :func:`model_shape`'s."""
    s = est["setting"]
    tiers = est["tiers"]
    cbytes = _COMPUTE_BYTES[s["precision"]]
    crossings = s["gpu"] if crossings is None else crossings
    accum = int(s["gradient_accumulation_steps"])
    shard = est["shard_numel"]
    offload_param, offload_optimizer = s["offload_param"], s["offload_optimizer"]
    prefetch = s["prefetch_bucket_size"] > 0 or s["max_reuse_distance"] > 0

    # A micro-batch fetches every shard for its forward, and again for its backward those not kept gathered
    # in between: the forward's last max_reuse_distance / 2 elements stay (within max_live_parameters). Between
    # two micro-batches of one step the backward's last max_reuse_distance / 2 (the forward's first) stay too.
    kept = min(s["max_reuse_distance"] // 2, s["max_live_parameters"]) if prefetch else 0
    kept_share = min(1.0, kept / s["num_params"]) if s["num_params"] else 0.0
    fetches = accum * (2.0 - kept_share) - (accum - 1) * kept_share
    nvme_shard = tiers["nvme"]["compute_shard"]
    host_shard = tiers["host"]["compute_shard"]
    split = est.get("optimizer_split")  # a split optimizer: its first sub-groups are stepped on the device
    staged = _staged_shard_nbytes(est, cbytes) if offload_param == "nvme" and not split else 0.0
    fetch_read = max(0.0, nvme_shard * fetches - staged) if offload_param == "nvme" else 0.0
    fetch_h2d = (host_shard + nvme_shard) * fetches if crossings and offload_param != "none" else 0.0
    largest_shard = math.ceil(s["largest_layer_params"] / s["world_size"]) * cbytes if offload_param != "none" else 0
    if staged:
        largest_shard = 0  # the forward's first layers are in a staging set: it starts without a read

    state_nvme = tiers["nvme"]["master"] + tiers["nvme"]["moments"]
    # gradient slices resting on NVMe: written every micro-batch, read back by each after the first and by the
    # step; counted with the states' (the disk's time is one budget; the writes run beside backward)
    grads_nvme = tiers["nvme"]["gradients"] * accum
    # compute shards resting on NVMe are written back after the step, unless they are read from a bf16 master
    shards_written = nvme_shard if offload_param == "nvme" and s["state_dtype"] == "fp32" else 0
    host_optimizer = offload_optimizer != "none"
    device_elements = min(shard, split["device_numel"]) if split and host_optimizer else 0
    host_share = (shard - device_elements) / shard if shard else 1.0
    grad_d2h = shards_h2d = shards_d2h = 0.0
    if crossings and host_optimizer:
        # with accumulation, the fp32 device accumulator goes down once a step; else (one micro-batch, or the
        # host ring) every micro-batch's slices go down in compute precision
        fp32_accumulator = accum > 1 and tiers["device"]["gradients"] > 0
        grad_d2h = (shard * 4 if fp32_accumulator else shard * cbytes * accum) * host_share  # device ones stay
        if offload_param == "none":
            shards_h2d = shard * cbytes * host_share  # the new compute shards go up to where they rest
        else:
            shards_d2h = device_elements * cbytes  # a device-stepped sub-group's new compute shards go down
    elif crossings and offload_param != "none":
        shards_d2h = shard * cbytes  # a device step's new compute shards go down to their tier
    host_copy = 0.0
    if not crossings:
        # one memory: the staged shards are copied into the gathered parameters (read, written), and each
        # micro-batch's gradient slices into the flat slices (read and written, and the slices read again to add)
        grads_in_memory = tiers["device"]["gradients"] + tiers["host"]["gradients"]
        host_copy = 2 * staged + grads_in_memory * (2 + 3 * (accum - 1))
    groups = max(1, math.ceil(shard / max(1, est.get("largest_sub_group_numel") or shard)))
    shape = dict(shape or model_shape(est))
    if seq_len is not None:
        shape["seq_len"] = seq_len
    tokens = (micro_batch or s.get("micro_batch") or 1) * shape["seq_len"]
    return StepTraffic(
        **shape, tokens=tokens, precision=s["precision"], micro_batches=accum,
        recompute=bool(s.get("activation_checkpointing")) if recompute is None else recompute,
        fetch_h2d_nbytes=fetch_h2d, fetch_nvme_read_nbytes=fetch_read, first_fetch_nbytes=largest_shard,
        grad_d2h_nbytes=grad_d2h, shards_h2d_nbytes=shards_h2d, shards_d2h_nbytes=shards_d2h,
        state_read_nbytes=state_nvme + grads_nvme, state_write_nbytes=state_nvme + shards_written + grads_nvme,
        cpu_adam_elements=shard - device_elements if host_optimizer else 0,
        device_adam_elements=device_elements if host_optimizer else shard,
        state_dtype=s["state_dtype"], sub_groups=groups, prefetch=prefetch,
        overlap_step_with_backward=overlap_step_with_backward, overlap_step_with_forward=overlap_step_with_forward,
        crossings=bool(crossings), host_copy_nbytes=host_copy, released_tensors=s.get("released_tensors") or 0,
    )  # fmt: skip


def format_prediction(prediction: StepPrediction) -> str:
    """``predicted step 1.23 s, bound by cpu_adam (gpu 0.41 s, h2d 0.20 s, ...)``."""
    busy = ", ".join(f"{name} {prediction.resources[name]:.3g} s" for name in RESOURCES if prediction.resources[name])
    return f"predicted step {prediction.predicted_s:.3g} s, bound by {prediction.bound_by}" + (f" ({busy})" if busy else "")


def predict_from_estimate(figures, est: dict, *, timed_alone: bool = False, **traffic) -> StepPrediction:
    """:func:`predict_step` for an :func:`~infinity.placement.estimate.estimate` (``traffic``:
    :func:`traffic_from_estimate`'s keywords)."""
    return predict_step(figures, traffic_from_estimate(est, **traffic), timed_alone=timed_alone)
