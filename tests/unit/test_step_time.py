"""The step-time model's arithmetic on hand-made figures (which resource binds when, what overlaps), the machine's
figures and their cache, and the commands that show them (``bench --machine --json``, ``estimate --json``).
Every expected value is worked out by hand here; no timing is asserted."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from infinity import kernels
from infinity.cli import main
from infinity.placement.estimate import estimate
from infinity.placement.step_time import (RESOURCES, StepTraffic, compute_seconds, predict_step, step_flops,
                                          traffic_from_estimate)
from infinity.runtime import machine_figures as mf
from infinity.runtime.machine_figures import MachineFigures, cache_path, load_cached, save

# One block of width 1000 on 1000 tokens of a 1000-token sequence: 6 FLOPs per matmul weight per token
# (12 · 1000² weights) plus the attention's 12 · 1000 · 1000 per token: 84e6 a token, 8.4e10 in all.
FLOPS = 1000 * (6 * 12 * 1000**2 + 12 * 1000 * 1000)
# A block throughput that makes that 3 s exactly.
RATE_TFLOPS = FLOPS / 3.0 / 1e12


def figures(**changes) -> MachineFigures:
    base = MachineFigures(
        host="test", machine="hand-made", device="cuda", matmul_tflops={"bf16": 200.0, "fp32": 50.0},
        block_tflops={"bf16": {"1000": RATE_TFLOPS}}, block_overhead_s={"bf16": 0.0}, block_tokens=1000,
        h2d_GBps=10.0, d2h_GBps=10.0, copy_path="cuda pinned", device_memory_GBps=1000.0,
        cpu_adam_elements_per_s={"fp32": 1e9, "bf16": 2e9, "int8": 4e9}, cpu_threads=16,
        nvme_read_GBps=2.0, nvme_write_GBps=1.0, nvme_path="/nvme", measured_s=1.0, measured_at=0.0,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def traffic(**changes) -> StepTraffic:
    """3 s of compute; 0.2 s of gradients down, 1 s of CPU Adam, 0.2 s of new shards up; 10 sub-groups."""
    base = StepTraffic(layers=1, width=1000, seq_len=1000, tokens=1000, precision="bf16",
                       grad_d2h_nbytes=2e9, cpu_adam_elements=1e9, shards_h2d_nbytes=2e9, sub_groups=10)
    return dataclasses.replace(base, **changes)


def test_the_feeding_thread_binds_a_small_models_step_on_a_gpu():
    """1,000 released tensors at 1 ms each and 4 micro-batches: 4 s of the feeding thread beside 0.75 s of GPU work
    a micro-batch (3 s in all) and 0.04 s of launches: the compute phase is the feed's, and it binds."""
    small = traffic(released_tensors=1000, micro_batches=4, tokens=250, grad_d2h_nbytes=0, cpu_adam_elements=0,
                    shards_h2d_nbytes=0)
    fed = figures(host_feed_s_per_tensor=1e-3, block_overhead_s={"bf16": 0.005})
    p = predict_step(fed, small)
    assert math.isclose(p.resources["feed"], 4.0)
    assert math.isclose(p.predicted_s, 4.0 + 2 * 0.005 * 4)  # the feed beside the blocks' launches
    assert p.bound_by == "feed"
    # without the figure (not measured) the feed counts nothing: the GPU's 3 s and its launches
    unfed = predict_step(figures(block_overhead_s={"bf16": 0.005}), small)
    assert unfed.resources["feed"] == 0.0 and unfed.bound_by == "gpu"
    assert math.isclose(unfed.predicted_s, 3.0 + 0.04)
    # below the GPU's work the feed hides behind it
    hidden = predict_step(figures(host_feed_s_per_tensor=1e-4, block_overhead_s={"bf16": 0.005}), small)
    assert math.isclose(hidden.predicted_s, 3.04) and hidden.bound_by == "gpu"


def test_on_a_cpu_device_the_feed_adds_to_the_cores():
    cpu = figures(device="cpu", host_feed_s_per_tensor=1e-3)
    plain = predict_step(figures(device="cpu"), traffic(released_tensors=100, crossings=False))
    fed = predict_step(cpu, traffic(released_tensors=100, crossings=False))
    assert math.isclose(fed.predicted_s - plain.predicted_s, 0.1)


def test_flops_and_compute_seconds_by_hand():
    assert step_flops(traffic()) == FLOPS
    assert step_flops(traffic(micro_batches=4)) == 4 * FLOPS
    assert step_flops(traffic(head_params=500_000)) == FLOPS + 6 * 500_000 * 1000
    assert math.isclose(compute_seconds(figures(), traffic()), 3.0)
    # a fixed overhead per block and one more for the head: (1 + 1) x 0.01 s
    assert math.isclose(compute_seconds(figures(block_overhead_s={"bf16": 0.01}), traffic()), 3.02)
    # the throughput between two measured widths, interpolated in log(width): 64 -> 1, 1024 -> 16 gives 4 at 256
    table = figures(block_tflops={"bf16": {"64": 1.0, "1024": 16.0}})
    flops_256 = step_flops(traffic(width=256))
    assert math.isclose(compute_seconds(table, traffic(width=256)), flops_256 / 4e12)
    # below the narrowest and above the widest, held at the ends
    assert math.isclose(compute_seconds(table, traffic(width=32)), step_flops(traffic(width=32)) / 1e12)
    # fp32, not measured as a block: the bf16 block throughput scaled by the matmuls' (50 / 200)
    assert math.isclose(compute_seconds(figures(), traffic(precision="fp32")), 12.0)


def test_host_step_hidden_behind_backward_gpu_binds():
    # compute phase 3 s; the host step a pipeline of 0.2 s (gradients down) and 1 s (Adam) over 10 sub-groups:
    # 1 + 0.2 / 10 = 1.02 s, begun with the boundary backward (2 s before the end): done by 1 + 1.02 = 2.02 s,
    # but the last sub-group's gradients are final at 3 s and take (0.2 + 1) / 10 = 0.12 s more: 3.12 s.
    p = predict_step(figures(), traffic())
    assert math.isclose(p.predicted_s, 3.12)
    assert p.bound_by == "gpu"
    assert p.resources == {"gpu": 3.0, "h2d": 0.2, "d2h": 0.2, "cpu_adam": 1.0, "nvme_read": 0.0, "nvme_write": 0.0,
                           "feed": 0.0}


def test_without_overlap_the_host_step_follows_backward():
    p = predict_step(figures(), traffic(overlap_step_with_backward=False))
    assert math.isclose(p.predicted_s, 3.0 + 1.02)


def test_a_slow_cpu_adam_binds():
    # 5 s of Adam: the pipeline is 5 + 0.2 / 10 = 5.02 s. It begins once backward (2 s) has finished the first of
    # ten sub-groups (0.2 s in) and goes on behind the next forward (1 s), whose last sub-group's layers run 0.1 s
    # after the last update; the next backward starts then: 0.2 + 5.02 + 0.1 = 5.32 s a step
    p = predict_step(figures(), traffic(cpu_adam_elements=5e9))
    assert math.isclose(p.predicted_s, 5.32)
    assert p.bound_by == "cpu_adam"
    # every update before step() returns: from the boundary backward's start at 1 s, 6.02 s
    p = predict_step(figures(), traffic(cpu_adam_elements=5e9, overlap_step_with_forward=False))
    assert math.isclose(p.predicted_s, 6.02)


def test_accumulation_leaves_less_backward_to_hide_behind():
    # four micro-batches of 0.75 s each: the boundary backward is 0.5 s and a forward 0.25 s, so the 5.02 s host
    # step begins 0.05 s into that backward; the next step's first forward ends 0.025 s after the last update, and
    # its first backward, two more micro-batches and the boundary forward (2.25 s) follow: 7.345 s a step
    fast = figures(block_tflops={"bf16": {"1000": RATE_TFLOPS * 4}})
    p = predict_step(fast, traffic(cpu_adam_elements=5e9, micro_batches=4))
    assert math.isclose(p.predicted_s, 2.25 + 0.05 + 5.02 + 0.025)
    # every update before step() returns: 3.0 - 0.5 + 5.02 s
    p = predict_step(fast, traffic(cpu_adam_elements=5e9, micro_batches=4, overlap_step_with_forward=False))
    assert math.isclose(p.predicted_s, 3.0 - 0.5 + 5.02)


def test_the_disk_binds_reads_and_writes_share_it():
    # 8 GB read at 2 GB/s (4 s) and 8 GB written at 1 GB/s (8 s): one disk, 12 s, more of it writing
    p = predict_step(figures(), traffic(state_read_nbytes=8e9, state_write_nbytes=8e9))
    assert math.isclose(p.predicted_s, 12.0)
    assert p.bound_by == "nvme_write"
    assert p.resources["nvme_read"] == 4.0 and p.resources["nvme_write"] == 8.0


def test_fetches_overlap_compute_when_prefetched_else_wait_in_line():
    # 40 GB of compute shards up at 10 GB/s: 4 s, longer than the 3 s of compute
    prefetched = predict_step(figures(), traffic(fetch_h2d_nbytes=40e9, grad_d2h_nbytes=0, shards_h2d_nbytes=0,
                                                 cpu_adam_elements=0))
    assert math.isclose(prefetched.predicted_s, 4.0)
    assert prefetched.bound_by == "h2d"
    waiting = predict_step(figures(), traffic(fetch_h2d_nbytes=40e9, grad_d2h_nbytes=0, shards_h2d_nbytes=0,
                                              cpu_adam_elements=0, prefetch=False))
    assert math.isclose(waiting.predicted_s, 7.0)


def test_copies_both_ways_at_once():
    # 30 GB of compute shards up (3 s, beside the 3 s of compute) and 30 GB of gradients down (3 s, from the first
    # sub-group's end of backward, 0.2 s into it, and on behind the next forward, whose last sub-group's layers
    # take 0.1 s after): separate wires, so the step is 3.3 s, where one wire for both would need 6 s of copies
    p = predict_step(figures(), traffic(fetch_h2d_nbytes=30e9, grad_d2h_nbytes=30e9, shards_h2d_nbytes=0,
                                        cpu_adam_elements=0))
    assert p.resources["h2d"] == 3.0 and p.resources["d2h"] == 3.0
    assert math.isclose(p.predicted_s, 3.3)
    # every update before step() returns: the gradients down from the boundary backward's start, 1 + 3 = 4 s
    p = predict_step(figures(), traffic(fetch_h2d_nbytes=30e9, grad_d2h_nbytes=30e9, shards_h2d_nbytes=0,
                                        cpu_adam_elements=0, overlap_step_with_forward=False))
    assert math.isclose(p.predicted_s, 4.0)


def test_on_a_cpu_device_the_cores_do_everything_in_turn():
    # compute 3 s, Adam 1 s, the copies 0.2 + 0.2 s: all on the same cores, 4.4 s; the disk's 1.5 s overlaps them
    cpu = figures(device="cpu")
    p = predict_step(cpu, traffic(state_read_nbytes=1e9, state_write_nbytes=1e9))
    assert math.isclose(p.predicted_s, 4.4)
    assert p.bound_by == "gpu"
    # without crossings (one memory) the copies cost nothing
    assert math.isclose(predict_step(cpu, traffic(crossings=False)).predicted_s, 4.0)
    # a disk slower than the cores binds
    slow = predict_step(cpu, traffic(state_read_nbytes=4e9, state_write_nbytes=4e9, crossings=False))
    assert math.isclose(slow.predicted_s, 2.0 + 4.0)
    assert slow.bound_by == "nvme_write"


def test_updates_beside_backward_share_a_cpu_devices_cores_and_hide_behind_a_gpus_backward():
    # 3 s of compute, 1 s of CPU Adam, nothing crossing: on a GPU the updates run beside backward on other
    # hardware (the step is the compute's 3 s plus the last sub-group's 0.1 s after backward ends); on a CPU
    # device they take the same cores as backward, so their seconds add: 4 s
    t = traffic(grad_d2h_nbytes=0, shards_h2d_nbytes=0, crossings=False)
    assert math.isclose(predict_step(figures(), t).predicted_s, 3.1)
    cpu = predict_step(figures(device="cpu"), t)
    assert math.isclose(cpu.predicted_s, 4.0) and cpu.bound_by == "gpu"


def test_copies_within_a_cpu_devices_memory_are_the_cores_work():
    # 20 GB copied within host memory (staged shards and gradient slices, read plus written) at 10 GB/s: 2 s on
    # the cores, after the 3 s of compute and the 1 s of Adam
    cpu = figures(device="cpu", device_memory_GBps=10.0)
    t = traffic(grad_d2h_nbytes=0, shards_h2d_nbytes=0, crossings=False, host_copy_nbytes=20e9)
    p = predict_step(cpu, t)
    assert math.isclose(p.resources["gpu"], 5.0) and math.isclose(p.predicted_s, 6.0)
    # from an estimate: one memory (gpu=False), 4 micro-batches; the gradient slices accumulate in fp32 (4 B an
    # element), copied into by the first micro-batch (read, written: 8 B) and added to by the other three (read
    # twice, written: 12 B each): 44 B an element; states in host memory leave no staging sets to copy shards from
    n = 10_000_000
    est = estimate(num_params=n, offload_param="cpu", offload_optimizer="cpu", gpu=False, gradient_accumulation_steps=4)
    assert est["tiers"]["host"]["gradients"] == 4 * n
    assert traffic_from_estimate(est).host_copy_nbytes == 44 * n
    # where the device is apart from host memory those bytes cross instead: nothing is copied within one memory
    assert traffic_from_estimate(estimate(num_params=n, offload_param="cpu", offload_optimizer="cpu",
                                          gpu=True)).host_copy_nbytes == 0


def test_a_step_timed_alone_pays_the_first_fetch_and_the_last_write():
    # the first fetch: 0.2 GB read at 2 GB/s = 0.1 s; the last sub-group's write: 1 GB / 10 at 1 GB/s = 0.1 s
    cpu = figures(device="cpu")
    t = traffic(crossings=False, state_read_nbytes=1e9, state_write_nbytes=1e9, fetch_nvme_read_nbytes=2e9,
                first_fetch_nbytes=2e8)
    steady, alone = predict_step(cpu, t), predict_step(cpu, t, timed_alone=True)
    assert math.isclose(steady.predicted_s, 4.0)
    assert math.isclose(alone.predicted_s, 4.0 + 0.1 + 0.1)


def test_a_disk_bound_step_timed_alone_pays_no_fill_or_drain_beyond_the_disks_own_time():
    # cores 3 + 1 = 4 s; the disk: 2 GB of shards (1 s) and 4 GB of states (2 s) read, 4 GB written (4 s): 7 s.
    # Alone, the cores wait 0.1 s for the first fetch and the last sub-group's 0.4 s write follows them (4.5 s),
    # but those bytes are in the disk's 7 s already: the step stays 7 s
    cpu = figures(device="cpu")
    t = traffic(crossings=False, state_read_nbytes=4e9, state_write_nbytes=4e9, fetch_nvme_read_nbytes=2e9,
                first_fetch_nbytes=2e8)
    assert math.isclose(predict_step(cpu, t).predicted_s, 7.0)
    alone = predict_step(cpu, t, timed_alone=True)
    assert math.isclose(alone.predicted_s, 7.0) and alone.bound_by == "nvme_write"


def test_the_device_optimizer_runs_on_the_device():
    # 1e9 elements, 30 bytes each (reads 4 + 4 + 8, writes 12 + 2) at 1000 GB/s: 0.03 s on the GPU after backward
    p = predict_step(figures(), traffic(grad_d2h_nbytes=0, shards_h2d_nbytes=0, cpu_adam_elements=0,
                                        device_adam_elements=1e9))
    assert math.isclose(p.predicted_s, 3.03)
    # on a CPU device, at the CPU Adam's fp32 rate: 1 s
    assert math.isclose(predict_step(figures(device="cpu"), traffic(
        grad_d2h_nbytes=0, shards_h2d_nbytes=0, cpu_adam_elements=0, device_adam_elements=1e9)).predicted_s, 4.0)


def test_a_missing_figure_is_named():
    with pytest.raises(ValueError, match="NVMe read"):
        predict_step(figures(nvme_read_GBps=None), traffic(state_read_nbytes=1e9))


# --------------------------------------------------------------------------- bytes from an estimate


def test_traffic_follows_the_estimates_bytes():
    n = 10_000_000
    # ZeRO-Offload (optimizer on the CPU, parameters on the device): gradients down once in bf16, new compute
    # shards up once, the CPU Adam over every element, nothing fetched
    t = traffic_from_estimate(estimate(num_params=n, offload_optimizer="cpu", gpu=True))
    assert (t.grad_d2h_nbytes, t.shards_h2d_nbytes, t.fetch_h2d_nbytes, t.cpu_adam_elements) == (2 * n, 2 * n, 0, n)
    # accumulation over 4 micro-batches: the fp32 device accumulator goes down once a step
    t = traffic_from_estimate(estimate(num_params=n, offload_optimizer="cpu", gradient_accumulation_steps=4))
    assert t.grad_d2h_nbytes == 4 * n and t.micro_batches == 4
    # parameters in host memory: up at every fetch; kept gathered for backward within max_reuse_distance / 2
    kept = estimate(num_params=n, offload_param="cpu", offload_optimizer="cpu")
    assert traffic_from_estimate(kept).fetch_h2d_nbytes == kept["tiers"]["host"]["compute_shard"] == 2 * n
    # and fetched again for backward without reuse (the README: "2 B up, twice")
    again = estimate(num_params=n, offload_param="cpu", offload_optimizer="cpu", max_reuse_distance=0,
                     prefetch_bucket_size=0)
    assert traffic_from_estimate(again).fetch_h2d_nbytes == 4 * n
    # over 4 micro-batches of a step: a reuse distance of a quarter of the model keeps the forward's last eighth
    # for backward and the backward's last eighth (the forward's first) for the next micro-batch's forward
    eighth = estimate(num_params=n, offload_param="cpu", offload_optimizer="cpu", gradient_accumulation_steps=4,
                      max_reuse_distance=n // 4)
    assert traffic_from_estimate(eighth).fetch_h2d_nbytes == 2 * n * (4 * (2 - 1 / 8) - 3 / 8)
    # one that spans a pass and the next: every shard up once a step, whatever the micro-batches
    whole = estimate(num_params=n, offload_param="cpu", offload_optimizer="cpu", gradient_accumulation_steps=4,
                     max_reuse_distance=2 * n, max_live_parameters=n)
    assert traffic_from_estimate(whole).fetch_h2d_nbytes == 2 * n
    # everything on NVMe, fp32 states: 12 B an element read and written, plus the compute shard written back;
    # the one sub-group's new shards wait in a staging set, so the next forward reads none from NVMe
    nvme = estimate(num_params=n, offload_param="nvme", offload_optimizer="nvme", max_in_cpu=0, gpu=False)
    t = traffic_from_estimate(nvme)
    assert t.state_read_nbytes == 12 * n and t.state_write_nbytes == 14 * n and t.fetch_nvme_read_nbytes == 0
    assert t.first_fetch_nbytes == 0 and not t.crossings
    # bf16 states: the compute shards come from the master, nothing written for them
    t = traffic_from_estimate(estimate(num_params=n, offload_param="nvme", offload_optimizer="nvme", max_in_cpu=0,
                                       state_dtype="bf16"))
    assert t.state_read_nbytes == t.state_write_nbytes == 6 * n


def test_the_forward_reads_from_staging_what_the_last_updates_left_there():
    n = 10_000_000
    nvme = dict(num_params=n, offload_param="nvme", offload_optimizer="nvme", gpu=False, sub_group_size=n // 8)
    # 8 sub-groups, 4 staging sets: the first 4 sub-groups' shards (n / 2 elements, n bytes) come from memory,
    # the other n bytes from NVMe, and the first layer is in memory: no read before the forward
    t = traffic_from_estimate(estimate(**nvme, max_in_cpu=0))
    assert (t.fetch_nvme_read_nbytes, t.first_fetch_nbytes, t.sub_groups) == (n, 0, 8)
    # fetched again for backward (no reuse): that second pass reads every shard from NVMe
    again = estimate(**nvme, max_in_cpu=0, max_reuse_distance=0, prefetch_bucket_size=0)
    assert traffic_from_estimate(again).fetch_nvme_read_nbytes == 4 * n - n
    # the host keeps the first 3 sub-groups' shards (max_in_cpu): of the staged 4, only the 4th was on NVMe
    kept = traffic_from_estimate(estimate(**nvme, max_in_cpu=3 * n // 8))
    assert kept.fetch_nvme_read_nbytes == 2 * (5 * n // 8) - 2 * (n // 8)
    # two staging sets (optimizer_buffer_count): two sub-groups' shards from memory
    two = traffic_from_estimate(estimate(**nvme, max_in_cpu=0, optimizer_buffer_count=2))
    assert two.fetch_nvme_read_nbytes == 2 * n - 2 * 2 * (n // 8)
    # the states in host memory: no staging sets, every shard read
    host_states = dict(nvme, offload_optimizer="cpu")
    assert traffic_from_estimate(estimate(**host_states, max_in_cpu=0)).fetch_nvme_read_nbytes == 2 * n


def test_a_cpu_only_step_from_its_estimate_each_resource_by_hand():
    # 3e8 elements on NVMe, fp32 states, 8 sub-groups on 4 staging sets, one block of width 1000 on 1000 tokens
    n = 300_000_000
    est = estimate(num_params=n, offload_param="nvme", offload_optimizer="nvme", max_in_cpu=0, gpu=False,
                   sub_group_size=n // 8)
    shape = {"layers": 1, "width": 1000, "seq_len": 1000, "head_params": 0}
    t = traffic_from_estimate(est, micro_batch=1, shape=shape)
    cpu = figures(device="cpu")
    p = predict_step(cpu, t)
    # compute 3 s, and the copies within the one memory on the same cores: the staged half of the shards (0.3 GB)
    # read and written, the bf16 gradient slices (0.6 GB) read and written, 1.8 GB at 1000 GB/s = 0.0018 s;
    # Adam 3e8 / 1e9 = 0.3 s; reads: 12 B states (3.6 GB) and half the 2 B shards (0.3 GB) at 2 GB/s = 1.95 s;
    # writes: 14 B (4.2 GB) at 1 GB/s = 4.2 s; nothing crosses
    assert t.host_copy_nbytes == 2 * 0.3e9 + 2 * 0.6e9
    assert p.resources == {"gpu": 3.0018, "h2d": 0.0, "d2h": 0.0, "cpu_adam": 0.3, "nvme_read": 1.95, "nvme_write": 4.2,
                           "feed": 0.0}
    # the cores' 3.3018 s hide behind the disk's 1.95 + 4.2 s (reads and writes share it)
    assert math.isclose(p.predicted_s, 6.15) and p.bound_by == "nvme_write"
    # timed alone: no first read (staged), the last sub-group's 0.525 s write after the cores' 3.3 s: the disk binds
    assert math.isclose(predict_step(cpu, t, timed_alone=True).predicted_s, 6.15)
    # a faster disk: the cores bind, and alone they pay the last write-back after their last update
    fast = figures(device="cpu", nvme_read_GBps=20.0, nvme_write_GBps=10.0)
    assert math.isclose(predict_step(fast, t).predicted_s, 3.3018)
    assert math.isclose(predict_step(fast, t, timed_alone=True).predicted_s, 3.3018 + 4.2e9 / 8 / 10e9)


# --------------------------------------------------------------------------- the figures' cache and the commands


def test_cache_round_trip_and_what_is_not_trusted(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_path("box") == tmp_path / "zero-infinity" / "machine-box.json"
    assert load_cached() is None
    written = save(figures(host="box"), cache_path("box"))
    assert load_cached(written) == figures(host="box")
    data = json.loads(written.read_text())
    written.write_text(json.dumps(dict(data, format=mf.FORMAT + 1)))
    assert load_cached(written) is None  # another format is measured again
    written.write_text('{"host": ')
    assert load_cached(written) is None  # half a file is never trusted


def test_the_cpu_adam_figure_is_taken_beyond_the_cache_within_the_memory(monkeypatch):
    """An H100 box's Xeon held a 16 Mi-element measurement in its L3 and gave 3.1x what its steps' updates got: the
    figure streams from memory as a model's sub-groups do, four caches' worth in the smallest form (8 B an element)
    and at least 64 Mi elements, and never more than a sixteenth of the available memory holds at 16 B."""
    free = {"available": 1 << 40}
    monkeypatch.setattr(mf, "last_level_cache_bytes", lambda: 320 << 20)
    monkeypatch.setattr("psutil.virtual_memory", lambda: type("Memory", (), free)())
    assert mf.adam_measure_numel() == 4 * (320 << 20) // 8  # 160 Mi elements
    monkeypatch.setattr(mf, "last_level_cache_bytes", lambda: 32 << 20)
    assert mf.adam_measure_numel() == 1 << 26  # the floor: 64 Mi
    free["available"] = 4 << 30
    assert mf.adam_measure_numel() == (4 << 30) // 256  # 16 Mi: what 256 MiB holds at 16 B an element


def test_the_cpu_adam_figure_is_of_the_update_that_sums_the_norm(monkeypatch):
    """The overlapped step's updates sum each sub-group's squared gradient norm in their own pass (the worker's
    time on the trace): the figure is of that update, over bf16 gradients."""
    if kernels.backend() != "cpp":
        pytest.skip("the C++ kernel is not built here: the norm is summed in torch ops")
    seen = []
    for name in ("adam_step", "adam_step_compact"):
        real = getattr(kernels, name)

        def counted(master, grad, *args, _real=real, **kw):
            seen.append((grad.numel(), grad.dtype, kw.get("grad_sq_norm")))
            return _real(master, grad, *args, **kw)

        monkeypatch.setattr(mf.kernels, name, counted)
    for state_dtype in ("fp32", "int8"):
        seen.clear()
        assert mf.measure_cpu_adam(state_dtype, numel=1 << 12, budget_s=0.0) > 0
        assert len(seen) >= 4, state_dtype  # the warm-up and at least three timed calls
        assert all(s == (1 << 12, mf.torch.bfloat16, True) for s in seen), state_dtype


DOCUMENTED_KEYS = {
    "host", "machine", "device", "matmul_tflops", "block_tflops", "block_overhead_s", "block_tokens", "h2d_GBps",
    "d2h_GBps", "copy_path", "device_memory_GBps", "cpu_adam_elements_per_s", "cpu_threads", "nvme_read_GBps",
    "nvme_write_GBps", "nvme_path", "host_feed_s_per_tensor", "measured_s", "measured_at", "format",
}


def test_a_block_is_measured_with_the_flops_counted_by_hand():
    # width 64, 16 tokens of a 16-token sequence: 16 x (6 x 12 x 64² + 12 x 16 x 64) = 4,915,200
    assert mf.block_flops(64, 16, 16) == 4_915_200
    block = mf._block(64, mf._DTYPES["fp32"], mf.torch.device("cpu"))
    assert sum(p.numel() for p in block.parameters() if p.dim() == 2) == 12 * 64 * 64  # the FLOPs' weights
    assert mf.measure_block_now(64, 1, 16, "fp32", overhead_s=0.0, tries=1) > 0


def test_a_width_s_figure_is_the_median_of_its_turns_and_the_overhead_its_best(monkeypatch):
    """What a step of many blocks runs at is the block's typical time, not its best moment; a burst of other work
    in one turn (the 50 s one) moves neither."""
    clock = [0.0]
    turns = {64: [0.02, 0.01, 0.03, 0.02, 50.0, 0.02], 256: [0.2] * 6, 1024: [2.0, 1.0, 3.0, 2.0, 50.0, 2.0]}
    overheads = iter([0.002, 0.001, 0.003] * 10)

    def scripted(width, batch, seq, precision, device):
        took = iter([0.5] + turns[width]) if batch > 1 else iter([0.5] + [next(overheads) for _ in range(30)])

        def run():  # the first call is the warm-up
            clock[0] += next(took)
        return run

    monkeypatch.setattr(mf, "_block_run", scripted)
    monkeypatch.setattr(mf.time, "perf_counter", lambda: clock[0])
    rates, overhead, tokens = mf.measure_blocks(mf.torch.device("cpu"), "fp32")
    assert overhead == pytest.approx(0.001) and tokens == 4 * 256
    for width, median in ((64, 0.02), (256, 0.2), (1024, 2.0)):
        expected = mf.block_flops(width, tokens, 256) / (median - 0.001) / 1e12
        assert rates[str(width)] == pytest.approx(expected, rel=1e-3), width


@pytest.mark.device_independent  # the machine's figures
def test_bench_machine_json_emits_the_figures_and_caches_them(tmp_path, monkeypatch, capsys):
    kernels.backend()  # the CPU Adam's kernel, built (or loaded) from the usual cache before the cache moves
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # the transformer blocks are the slow part of the measurement (seconds on a shared box): measured above
    monkeypatch.setattr(mf, "measure_blocks", lambda device, precision: ({"64": 0.1, "1024": 1.0}, 0.001, 1024))
    disk = tmp_path / "disk"
    disk.mkdir()
    assert main(["bench", "--machine", "--json", "--path", str(disk)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == DOCUMENTED_KEYS | {"cache"}
    assert set(out["cpu_adam_elements_per_s"]) == {"fp32", "bf16", "int8"}
    assert all(v > 0 for v in out["cpu_adam_elements_per_s"].values())
    assert set(out["matmul_tflops"]) == {"bf16", "fp32"} and out["device"] in ("cpu", "cuda")
    assert out["host_feed_s_per_tensor"] >= 0  # the command measures it (a cache measured for lack of one does not)
    cached = load_cached()
    assert cached is not None and cached.as_dict() == {k: v for k, v in out.items() if k != "cache"}
    assert out["cache"] == str(cache_path(out["host"]))
    assert list(disk.iterdir()) == []  # the disk's benchmark file is gone


def test_estimate_json_has_the_step_time(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["estimate", "--preset", "tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_time"] is None and "bench --machine" in out["step_time_note"]

    save(figures(device="cpu"), cache_path())
    argv = ["estimate", "--preset", "tiny", "--offload-optimizer", "nvme", "--offload-param", "nvme", "--cpu"]
    assert main([*argv, "--json"]) == 0
    step = json.loads(capsys.readouterr().out)["step_time"]
    assert set(step) == {"predicted_s", "bound_by", "resources"}
    assert set(step["resources"]) == set(RESOURCES) and step["bound_by"] in RESOURCES
    assert step["predicted_s"] >= max(step["resources"].values()) > 0
    assert main(argv) == 0
    assert f"predicted step {step['predicted_s']:.3g} s, bound by {step['bound_by']}" in capsys.readouterr().out


def test_activation_checkpointing_adds_a_forward_to_the_compute(tmp_path, monkeypatch, capsys):
    """A recomputed block runs its forward again in backward: 4 forwards' FLOPs where there were 3."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    save(figures(device="cpu"), cache_path())
    argv = ["estimate", "--preset", "small", "--offload-optimizer", "cpu", "--offload-param", "cpu", "--cpu", "--json"]
    compute = []
    for flag in ([], ["--activation-checkpointing"]):
        assert main([*argv, *flag]) == 0
        compute.append(json.loads(capsys.readouterr().out)["step_time"]["resources"]["gpu"])
    assert compute[1] == pytest.approx(compute[0] * 4 / 3, rel=0.02)
