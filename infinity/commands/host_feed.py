"""The engine's host-side work per parameter tensor: what the thread that feeds the device spends on each tensor the
engine fetches and releases, each micro-batch (the module hooks, the fetch and release, the prefetcher, each copy's
issue, the gradient's hook), beyond what plain PyTorch spends on the same model.

Measured on a GPT with a real model's tensors and modules but next to no compute (124M's twelve layers at width 64,
fp32, a few tokens), the engine with its parameters and optimizer offloaded to the CPU against plain PyTorch
(``torch.optim.AdamW``), each step's difference over the engine's tensors. ``infinity bench --machine`` caches the
figure for the step-time model (:mod:`infinity.placement.step_time`: the ``feed`` resource);
``benchmarks/bench_host_overhead.py`` reports it beside plain PyTorch, round by round.
"""

from __future__ import annotations

import statistics
import time

import torch

import infinity
from infinity.models.gpt import GPT, GPTConfig

__all__ = ["EngineSteps", "PlainSteps", "engine_config", "measure_host_feed", "thin_gpt", "timed_block"]

CASES = {
    "none": {"offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}},
    "cpu": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
}
"""``none``: nothing released (one rank: each shard is its full tensor); ``cpu``: every tensor fetched and released."""


def thin_gpt(layers: int = 12, width: int = 64, seq: int = 16) -> GPTConfig:
    """124M's tensors and modules (at ``layers`` 12) at next to no compute."""
    return GPTConfig(n_layer=layers, n_head=2, d_model=width, seq_len=seq, vocab_size=256, tie_embeddings=True)


def engine_config(case: str, device: torch.device) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **CASES[case]}  # every tensor managed
    return {"device": device.type, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
            "zero_optimization": zero}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a block's time includes the GPU work it queued


class PlainSteps:
    """Plain PyTorch: the model on the device, ``torch.optim.AdamW`` (fused on a GPU)."""

    def __init__(self, cfg: GPTConfig, device: torch.device):
        torch.manual_seed(0)
        self.model = GPT(cfg).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1,
                                     fused=device.type == "cuda")

    def step(self, idx, targets) -> None:
        self.model(idx, targets).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class EngineSteps:
    """The engine on the same model, with ``case``'s placement."""

    def __init__(self, cfg: GPTConfig, case: str, device: torch.device):
        torch.manual_seed(0)
        self.engine = infinity.initialize(GPT(cfg), engine_config(case, device))

    @property
    def tensors(self) -> int:
        return len(self.engine.params)

    def step(self, idx, targets) -> None:
        self.engine.backward(self.engine(idx, targets))
        self.engine.step()

    def finish(self) -> None:
        self.engine.finish_step()  # updates behind the next forward are the block's work

    def close(self) -> None:
        self.engine.close()


def timed_block(device: torch.device, contender, batches) -> float:
    """Seconds a step over ``batches`` run back to back, until the device's work and every update are done."""
    _synchronize(device)
    start = time.perf_counter()
    for idx, targets in batches:
        contender.step(idx, targets)
    contender.finish()
    _synchronize(device)
    return (time.perf_counter() - start) / len(batches)


def batches_for(cfg: GPTConfig, device: torch.device, count: int, *, micro_batch: int = 1,
                generator: torch.Generator | None = None) -> list:
    batches = []
    for _ in range(count):
        idx = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=generator)
        batches.append((idx[:, :-1].to(device), idx[:, 1:].to(device)))
    return batches


def measure_host_feed(device: torch.device, *, rounds: int = 5, block: int = 5) -> float:
    """Seconds a step of the feeding thread per tensor the engine fetches and releases, beyond plain PyTorch's (the
    median over rounds alternating the two; at least 0)."""
    cfg = thin_gpt()
    plain, ours = PlainSteps(cfg, device), EngineSteps(cfg, "cpu", device)
    generator = torch.Generator().manual_seed(0)
    per_tensor = []
    try:
        for round_ in range(rounds + 1):  # the first round warms both up
            batches = batches_for(cfg, device, block, generator=generator)
            plain_s, ours_s = timed_block(device, plain, batches), timed_block(device, ours, batches)
            if round_:
                per_tensor.append((ours_s - plain_s) / ours.tensors)
    finally:
        ours.close()
        plain.close()
    return max(0.0, statistics.median(per_tensor))
