"""bf16 on a CPU: a GPT's training step with its matmuls in fp32 (``cpu_matmul_precision: "auto"`` on a CPU
without bf16 units) against torch's own bf16 kernels and against fp32, in the same run.

Cases, each one training step (forward, backward, the engine's step) of the same model, nothing offloaded:

* ``engine-bf16``: the engine in bf16 with the default ``cpu_matmul_precision`` (``auto``);
* ``engine-bf16-native``: the engine in bf16 with ``cpu_matmul_precision: "native"`` (torch's kernels);
* ``torch-bf16``: plain PyTorch, the model in bf16, ``torch.optim.AdamW`` (the reference a user would write);
* ``engine-fp32`` and ``torch-fp32``: the same in fp32.

The cases alternate, round after round, so the machine's noise hits all alike; each keeps its median. The last
line is JSON with each case's median step and the ratios ``engine_bf16_vs_torch_bf16``,
``engine_bf16_vs_torch_fp32`` and ``engine_bf16_native_vs_torch_bf16``.

    python benchmarks/bench_cpu_matmul.py                      # 4 layers, width 512, 4 x 256 tokens
    python benchmarks/bench_cpu_matmul.py --layers 2 --rounds 2  # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import infinity  # noqa: E402
from infinity.models.gpt import GPT, GPTConfig, count_params  # noqa: E402
from infinity.runtime.cpu_matmul import matmuls_in_fp32  # noqa: E402
from infinity.runtime.hardware import machine_description  # noqa: E402

CASES = ("engine-bf16", "engine-bf16-native", "torch-bf16", "engine-fp32", "torch-fp32")
LR = 1e-4


def _model(cfg: GPTConfig, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg).to(dtype)


class EngineCase:
    """One step of the engine in ``precision`` with ``cpu_matmul_precision`` ``matmul``."""

    def __init__(self, cfg: GPTConfig, precision: str, matmul: str):
        config = {"device": "cpu", "precision": precision, "cpu_matmul_precision": matmul,
                  "optimizer": {"type": "AdamW", "params": {"lr": LR}},
                  "zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
                                        "offload_optimizer": {"device": "none"}}}
        self.engine = infinity.initialize(_model(cfg, torch.float32), config)

    def step(self, x, y) -> float:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def close(self):
        self.engine.close()


class TorchCase:
    """One step of plain PyTorch: the model in ``dtype``, ``torch.optim.AdamW``."""

    def __init__(self, cfg: GPTConfig, dtype: torch.dtype):
        self.model = _model(cfg, dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def step(self, x, y) -> float:
        loss = self.model(x, y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def close(self):
        pass


def build(case: str, cfg: GPTConfig):
    if case == "engine-bf16":
        return EngineCase(cfg, "bf16", "auto")
    if case == "engine-bf16-native":
        return EngineCase(cfg, "bf16", "native")
    if case == "engine-fp32":
        return EngineCase(cfg, "fp32", "auto")
    return TorchCase(cfg, torch.bfloat16 if case == "torch-bf16" else torch.float32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="steps timed per case, alternating (after a warm-up)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; cases: {', '.join(CASES)}")

    cfg = GPTConfig(n_layer=args.layers, n_head=max(1, args.width // 64), d_model=args.width, seq_len=args.seq)
    print(f"machine: {machine_description()}; {torch.get_num_threads()} threads")
    print(f"model: {count_params(cfg) / 1e6:.1f}M parameters, {args.layers} layers, width {args.width}, "
          f"{args.batch} x {args.seq} tokens; bf16 matmuls through fp32 by default here: "
          f"{matmuls_in_fp32('auto', 'bf16', 'cpu')}")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    runs = {case: build(case, cfg) for case in cases}
    times: dict[str, list[float]] = {case: [] for case in cases}
    losses: dict[str, list[float]] = {case: [] for case in cases}
    try:
        for case, run in runs.items():
            losses[case].append(run.step(x, y))  # warm-up: first calls pick kernels and allocate
        for r in range(args.rounds):
            for case, run in runs.items():
                t0 = time.perf_counter()
                losses[case].append(run.step(x, y))
                times[case].append(time.perf_counter() - t0)
            print(f"round {r + 1}: " + ", ".join(f"{c} {times[c][-1]:.3f} s" for c in cases), flush=True)
    finally:
        for run in runs.values():
            run.close()

    median = {case: statistics.median(t) for case, t in times.items()}
    print(f"\n{'case':<20} {'step s':>9} {'first loss':>11} {'last loss':>10}")
    for case in cases:
        print(f"{case:<20} {median[case]:>9.3f} {losses[case][0]:>11.4f} {losses[case][-1]:>10.4f}")

    def ratio(a, b):
        return round(median[a] / median[b], 3) if a in median and b in median else None

    result = {
        "machine": machine_description(), "num_params": count_params(cfg), "layers": args.layers, "width": args.width,
        "tokens": args.batch * args.seq, "rounds": args.rounds, "step_s": {c: round(s, 4) for c, s in median.items()},
        "losses": {c: [round(v, 4) for v in l] for c, l in losses.items()},
        "engine_bf16_vs_torch_bf16": ratio("engine-bf16", "torch-bf16"),
        "engine_bf16_vs_torch_fp32": ratio("engine-bf16", "torch-fp32"),
        "engine_bf16_native_vs_torch_bf16": ratio("engine-bf16-native", "torch-bf16"),
        "engine_fp32_vs_torch_fp32": ratio("engine-fp32", "torch-fp32"),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
