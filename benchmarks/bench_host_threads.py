"""The fused CPU Adam beside a thread that feeds the GPU: its team unbound on every core, or bound off the first.

On a GPU the main thread launches kernels and issues copies, a stream of small host operations whose latency the
GPU waits on. The engine's updating threads run the CPU Adam beside it. This benchmark reproduces that pair on
any machine: the "feeder" (the main thread, never bound, as the engine leaves it) times a loop of small torch ops,
while a worker thread steps a large optimizer state over and over. Per round, alternating:

  alone      the feeder with nothing beside it
  unbound    the worker's kernel on torch's thread count, unbound (the engine before binding)
  bound      the worker bound as the engine binds it on a GPU machine: every core but the first, a team that size
             (``infinity.runtime.host_cores.plan_host_cores``)

It reports the feeder's mean (its throughput) and 99th-percentile iteration (its stalls) against ``alone`` (1.0 is an undisturbed feeder) and
the kernel's throughput in each, as medians over rounds of per-round ratios. The machine is shared: read ratios.

    .venv/bin/python benchmarks/bench_host_threads.py [--numel 50000000] [--rounds 7] [--seconds 1.5]

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

import infinity.kernels as kernels
from infinity.runtime.hardware import machine_description
from infinity.runtime.host_cores import HostCores, plan_host_cores, usable_cores

HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


class AdamWorker:
    """A thread stepping one fp32 state with bf16 gradients and a bf16 parameter copy until told to stop."""

    def __init__(self, numel: int, host_cores: HostCores | None):
        self.grad = torch.randn(numel).to(torch.bfloat16)
        self.master, self.exp_avg, self.exp_avg_sq = torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
        self.param_out = torch.empty(numel, dtype=torch.bfloat16)
        self.host_cores = host_cores
        self.elements = 0
        self.seconds = 0.0
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-adam", daemon=True)

    def __enter__(self):
        self._thread.start()
        self._started.wait()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        threads = None
        if self.host_cores is not None:
            self.host_cores.bind_this_thread()
            threads = self.host_cores.threads
        step = 0
        self._started.set()
        start = time.perf_counter()
        while not self._stop.is_set():
            step += 1
            kernels.adam_step(self.master, self.grad, self.exp_avg, self.exp_avg_sq, step=step,
                              param_out=self.param_out, num_threads=threads, **HYPER)
            self.elements += self.master.numel()
        self.seconds = time.perf_counter() - start

    @property
    def elements_per_s(self) -> float:
        return self.elements / self.seconds if self.seconds else 0.0


def feed(seconds: float) -> list[float]:
    """The feeder: iterations of a few small torch ops (a launch's worth of host work each), their seconds."""
    a, b, out = torch.randn(256), torch.randn(256), torch.empty(256)
    times = []
    end = time.perf_counter() + seconds
    while (now := time.perf_counter()) < end:
        for _ in range(20):
            torch.add(a, b, out=out)
            torch.mul(out, 0.5, out=out)
        times.append(time.perf_counter() - now)
    return times


def one_case(case: str, args, bound: HostCores) -> dict:
    if case == "alone":
        times = feed(args.seconds)
        return {**_feed_figures(times), "adam": 0.0}
    with AdamWorker(args.numel, bound if case == "bound" else None) as worker:
        time.sleep(0.1)  # the team is up and running before the feeder starts timing
        times = feed(args.seconds)
    return {**_feed_figures(times), "adam": worker.elements_per_s}


def _feed_figures(times: list[float]) -> dict:
    """The feeder's mean (its throughput), median and 99th-percentile iteration (its stalls)."""
    return {"feed_mean_s": statistics.fmean(times), "feed_median_s": statistics.median(times),
            "feed_p99_s": sorted(times)[min(len(times) - 1, int(0.99 * len(times)))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=50_000_000, help="elements of the state the worker steps")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.5, help="the feeder's time per case and round")
    args = parser.parse_args()
    if kernels.backend() != "cpp":
        raise SystemExit("the C++ kernel is not built here: nothing to measure")
    cores = usable_cores()
    bound = plan_host_cores(torch.device("cuda"), None, usable=cores)  # as the engine binds it on a GPU machine
    if bound.cores is None:
        raise SystemExit(f"{len(cores)} core(s): nothing to bind off the feeder's core")
    print(f"machine: {machine_description()}")
    print(f"worker: {args.numel:,} fp32 elements a step; unbound: torch's {torch.get_num_threads()} threads; "
          f"bound: {bound.describe()}")
    cases = ["alone", "unbound", "bound"]
    rounds = []
    for r in range(args.rounds):
        order = cases[r % 3:] + cases[:r % 3]
        result = {case: one_case(case, args, bound) for case in order}
        rounds.append(result)
        alone = result["alone"]
        print(f"  round {r}: feeder mean x{result['unbound']['feed_mean_s'] / alone['feed_mean_s']:.2f} "
              f"unbound, x{result['bound']['feed_mean_s'] / alone['feed_mean_s']:.2f} bound; p99 "
              f"x{result['unbound']['feed_p99_s'] / alone['feed_p99_s']:.2f} / "
              f"x{result['bound']['feed_p99_s'] / alone['feed_p99_s']:.2f}; Adam "
              f"{result['unbound']['adam'] / 1e9:.2f} / {result['bound']['adam'] / 1e9:.2f} G elements/s")

    def ratio(case: str, key: str, over: str = "alone") -> float:
        return statistics.median(r[case][key] / r[over][key] for r in rounds)

    summary = {
        "machine": machine_description(), "numel": args.numel, "rounds": args.rounds, "bound": bound.describe(),
        "unbound_threads": torch.get_num_threads(),
        "feed_mean_unbound_over_alone": ratio("unbound", "feed_mean_s"),
        "feed_mean_bound_over_alone": ratio("bound", "feed_mean_s"),
        "feed_median_unbound_over_alone": ratio("unbound", "feed_median_s"),
        "feed_median_bound_over_alone": ratio("bound", "feed_median_s"),
        "feed_p99_unbound_over_alone": ratio("unbound", "feed_p99_s"),
        "feed_p99_bound_over_alone": ratio("bound", "feed_p99_s"),
        "adam_bound_over_unbound": ratio("bound", "adam", over="unbound"),
        "adam_unbound_elements_per_s": statistics.median(r["unbound"]["adam"] for r in rounds),
        "adam_bound_elements_per_s": statistics.median(r["bound"]["adam"] for r in rounds),
    }  # fmt: skip
    print(f"feeder (mean iteration) against alone: unbound x{summary['feed_mean_unbound_over_alone']:.2f}, "
          f"bound x{summary['feed_mean_bound_over_alone']:.2f}; p99: "
          f"x{summary['feed_p99_unbound_over_alone']:.2f} / x{summary['feed_p99_bound_over_alone']:.2f}; "
          f"the kernel bound runs at {summary['adam_bound_over_unbound']:.2f} x its unbound throughput")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
