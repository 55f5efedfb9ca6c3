"""Soak: a long run with parameters and optimizer on NVMe and periodic checkpoints; after warm-up, host
RSS, open file descriptors and the swap folder's size must stop growing.

    python benchmarks/soak.py                          # 300 steps, a small GPT, swap in a temporary folder
    python benchmarks/soak.py --steps 1000 --nvme-path /mnt/nvme --every 50 --save-every 100

Prints a line every ``--every`` steps (RSS, fds, swap bytes, checkpoint time) and a final JSON line with
the samples, the growth of each after warm-up, and the verdict ("flat" or "growing").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

RSS_SLACK_NBYTES = 4 << 20  # allocator noise a flat run may still show after warm-up


def _swap_nbytes(nvme: Path) -> tuple[int, int]:
    """Apparent and allocated bytes of every file under the swap folder."""
    apparent = allocated = 0
    for root, _, files in os.walk(nvme):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return apparent, allocated


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=50, help="steps before the baseline is taken (default 50)")
    p.add_argument("--every", type=int, default=25, help="steps between samples (default 25)")
    p.add_argument("--save-every", type=int, default=50, help="steps between checkpoints; 0: none (default 50)")
    p.add_argument("--nvme-path", default=None, help="folder for the swap files (default: a temporary one)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()

    import infinity
    from infinity.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    nvme = Path(args.nvme_path) if args.nvme_path else work / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    save_dir = work / "ckpt"
    cfg = GPTConfig(n_layer=args.layers, n_head=4, d_model=args.d_model, seq_len=64)
    model = GPT(cfg)
    numel = sum(p.numel() for p in model.parameters())
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "sub_group_size": max(numel // 4, 4096),
                              "stage3_param_persistence_threshold": 0,
                              "offload_param": {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0},
                              "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "max_in_cpu": 0}},
    }
    proc = psutil.Process()
    engine = infinity.initialize(model, config)
    samples = []
    g = torch.Generator().manual_seed(1)
    print(f"soak: {numel:,} parameters, params and optimizer on nvme ({nvme}), {args.steps} steps, "
          f"checkpoint every {args.save_every}", flush=True)
    started = time.perf_counter()
    save_s = 0.0
    try:
        for step in range(1, args.steps + 1):
            idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=g)
            loss = engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
            engine.backward(loss)
            engine.step()
            if args.save_every and step % args.save_every == 0:
                t0 = time.perf_counter()
                engine.save_checkpoint(save_dir, tag=f"step{step}", client_state={"step": step})
                save_s = time.perf_counter() - t0
                for old in save_dir.glob("step*"):  # keep the newest only: the disk is not what we watch
                    if old.name != f"step{step}":
                        shutil.rmtree(old)
            if step % args.every == 0 or step == 1:
                apparent, allocated = _swap_nbytes(nvme)
                sample = {"step": step, "rss": proc.memory_info().rss, "fds": proc.num_fds(),
                          "swap_nbytes": apparent, "swap_allocated_nbytes": allocated, "loss": round(loss.item(), 4)}
                samples.append(sample)
                print(f"step {step:>5}  loss {sample['loss']:.4f}  rss {sample['rss'] / 2**20:8.1f} MiB  "
                      f"fds {sample['fds']:>4}  swap {apparent / 2**20:7.2f} MiB ({allocated / 2**20:.2f} allocated)"
                      f"  last save {save_s:.2f} s", flush=True)
        engine.close()
        after_close = {"fds": proc.num_fds(), "swap_nbytes": _swap_nbytes(nvme)[0]}
    finally:
        engine.close()
        shutil.rmtree(work, ignore_errors=True)

    base = next(s for s in samples if s["step"] >= args.warmup)
    later = [s for s in samples if s["step"] > base["step"]]
    growth = {key: max(s[key] for s in later) - base[key] if later else 0
              for key in ("rss", "fds", "swap_nbytes", "swap_allocated_nbytes")}
    flat = growth["rss"] <= RSS_SLACK_NBYTES and growth["fds"] <= 0 and growth["swap_nbytes"] <= 0
    print(json.dumps({"steps": args.steps, "parameters": numel, "warmup": args.warmup, "baseline_step": base["step"],
                      "growth_after_warmup": growth, "rss_slack_nbytes": RSS_SLACK_NBYTES,
                      "after_close": after_close, "seconds": round(time.perf_counter() - started, 1),
                      "verdict": "flat" if flat else "growing", "samples": samples}))
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
