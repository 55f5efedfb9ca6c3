"""``infinity bench --machine``: the machine's figures for the step-time model, measured and cached.

Measures in a few seconds the device's matmul and transformer-block throughput, host⇄device copy bandwidth
(pinned, or the distinct-device mode's copy without a GPU), the fused CPU Adam's throughput for each
optimizer-state dtype, the disk's O_DIRECT bandwidth (in ``--path``, or a temporary folder) and the engine's
host-side work per released tensor (:mod:`infinity.commands.host_feed`), and writes
them where ``infinity estimate``, ``infinity train`` and the benchmarks read them
(:func:`~infinity.runtime.machine_figures.cache_path`).
"""

from __future__ import annotations

import argparse
import json

from infinity.commands.host_feed import measure_host_feed
from infinity.runtime.machine_figures import MachineFigures, cache_path, measure_machine, save

__all__ = ["run_machine", "format_figures"]


def format_figures(figures: MachineFigures) -> str:
    """The figures, one line each."""
    def rate(value, unit="GB/s"):
        return "not measured" if value is None else f"{value:.2f} {unit}"

    blocks = "; ".join(f"{p}: " + ", ".join(f"width {w} {r:.3g}" for w, r in table.items())
                       for p, table in figures.block_tflops.items())
    overhead = ", ".join(f"{p} {s * 1e3:.2f} ms" for p, s in figures.block_overhead_s.items())
    adam = ", ".join(f"{d} {n / 1e9:.2f}" for d, n in figures.cpu_adam_elements_per_s.items())
    return "\n".join([
        f"machine: {figures.machine} (host {figures.host}); the device is the {figures.device.upper()}",
        "matmul: " + ", ".join(f"{p} {t:.3g} TFLOP/s" for p, t in figures.matmul_tflops.items()),
        f"transformer block, forward + backward on {figures.block_tokens} tokens, TFLOP/s: {blocks} "
        f"(plus {overhead} a block)",
        f"host->device {rate(figures.h2d_GBps)}, device->host {rate(figures.d2h_GBps)} ({figures.copy_path}); "
        f"within device memory {rate(figures.device_memory_GBps)}",
        f"fused CPU Adam, billion elements/s on {figures.cpu_threads} threads: {adam}",
        f"disk (O_DIRECT): read {rate(figures.nvme_read_GBps)}, write (overwriting) {rate(figures.nvme_write_GBps)} "
        f"({figures.nvme_path})",
        "engine's host-side work per released tensor: " + ("not measured" if figures.host_feed_s_per_tensor is None
                                                           else f"{figures.host_feed_s_per_tensor * 1e6:.0f} us"),
        f"measured in {figures.measured_s:.1f} s",
    ])  # fmt: skip


def run_machine(args: argparse.Namespace) -> int:
    figures = measure_machine(nvme_dir=args.path, measure_host_feed=measure_host_feed)
    path = save(figures, cache_path(figures.host))
    if args.json:
        print(json.dumps(dict(figures.as_dict(), cache=str(path))))
    else:
        print(format_figures(figures))
        print(f"cached in {path}")
    return 0
