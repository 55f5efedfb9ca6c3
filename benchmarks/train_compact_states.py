"""Kernel-level evidence for compact optimizer states: a tiny GPT trained with
each state dtype through the kernel API directly (no engine), same seed, same
init, same batches; reports the final loss of each against fp32 states.

    .venv/bin/python benchmarks/train_compact_states.py [--steps 300] [--state-dtypes fp32,bf16,int8]

fp32 runs ``adam_step`` (identical to torch's AdamW numerics); bf16 and int8 run
``adam_step_compact``, whose bf16 master is copied into the model's fp32
parameters after each step (``param_out``), so the forward sees exactly what the
states hold. Train loss is the mean of the last 20 steps; eval loss is on 16
held-out batches. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import infinity.kernels as kernels
from infinity.train.data import read_corpus_bytes
from infinity.models.gpt import GPT, GPTConfig

HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def batches(data: torch.Tensor, count: int, batch: int, seq_len: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts.tolist()])
        yield x.long(), y.long()


def train(state_dtype: str, args, train_data, eval_data) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_head=4, d_model=args.d_model, seq_len=args.seq_len)
    model = GPT(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    states = []
    for i, p in enumerate(params):
        flat = p.detach().view(-1)
        zeros = torch.zeros_like(flat)
        state = kernels.compact.from_fp32(state_dtype, flat, zeros, zeros)
        if state_dtype == "fp32":
            state["master"] = flat  # the parameter itself is the master
        else:
            p.data.view(-1).copy_(state["master"])  # the forward sees what the states hold
        states.append(state)
    losses = []
    start = time.perf_counter()
    for step, (x, y) in enumerate(batches(train_data, args.steps, args.batch, args.seq_len, seed=1), start=1):
        loss = model(x, y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(loss.item())
        lr = args.lr * min(1.0, step / 20)  # 20 warm-up steps
        for i, (p, state) in enumerate(zip(params, states)):
            grad = p.grad.view(-1)
            if state_dtype == "fp32":
                kernels.adam_step(state["master"], grad, state["exp_avg"], state["exp_avg_sq"], step=step, lr=lr, **HYPER)
            else:
                kernels.adam_step_compact(
                    state["master"], grad, state["exp_avg"], state["exp_avg_sq"], state_dtype=state_dtype,
                    step=step, lr=lr, seed=1000 + i, param_out=p.data.view(-1),
                    exp_avg_scale=state.get("exp_avg_scale"), exp_avg_sq_scale=state.get("exp_avg_sq_scale"),
                    **HYPER,
                )  # fmt: skip
    seconds = time.perf_counter() - start
    with torch.no_grad():
        eval_losses = [model(x, y).item() for x, y in batches(eval_data, 16, args.batch, args.seq_len, seed=2)]
    state_bytes = sum(kernels.state_nbytes(state_dtype, p.numel()) for p in params)
    return {
        "train_loss": sum(losses[-20:]) / 20, "eval_loss": sum(eval_losses) / len(eval_losses),
        "first_loss": losses[0], "state_bytes": state_bytes, "seconds": round(seconds, 1),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--state-dtypes", default="fp32,bf16,int8")
    args = ap.parse_args()
    raw, description = read_corpus_bytes(max_bytes=4 << 20)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    cut = int(data.numel() * 0.9)
    train_data, eval_data = data[:cut], data[cut:]
    print(f"tiny GPT ({args.layers} layers, d_model {args.d_model}), {args.steps} steps of {args.batch}x{args.seq_len} "
          f"bytes, corpus: {description}, kernels: {kernels.backend()}")  # fmt: skip
    results = {}
    for state_dtype in args.state_dtypes.split(","):
        results[state_dtype] = train(state_dtype, args, train_data, eval_data)
        r = results[state_dtype]
        print(f"{state_dtype:5} train {r['train_loss']:.4f}  eval {r['eval_loss']:.4f}  "
              f"(first {r['first_loss']:.3f}; states {r['state_bytes'] / 1e6:.1f} MB; {r['seconds']} s)")  # fmt: skip
    if "fp32" in results:
        for state_dtype, r in results.items():
            r["train_ratio"] = round(r["train_loss"] / results["fp32"]["train_loss"], 4)
            r["eval_ratio"] = round(r["eval_loss"] / results["fp32"]["eval_loss"], 4)
            print(f"{state_dtype:5} / fp32: train {r['train_ratio']:.4f}, eval {r['eval_ratio']:.4f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
