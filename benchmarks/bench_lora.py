"""LoRA on an offloaded base: what the optimizer and a checkpoint keep for a frozen base (nothing), measured.

A random Llama (by default hidden 512, 8 layers, vocabulary 8000: ~34M parameters) is trained for a few steps
by ``infinity.hf.Trainer``, each mode in a fresh process, with compute shards and optimizer states on NVMe
(``offload_optimizer.max_in_cpu`` 0, so every state the optimizer keeps is in a swap file):

* ``lora``: ``peft`` LoRA r=8 on ``q_proj``/``v_proj``, the base frozen, the model built whole in host memory
  first (as a Trainer script that calls ``from_pretrained`` does);
* ``lora-streamed``: the same adapters on a base built on the meta device from a saved model folder's config:
  the engine streams the base from the folder into its shards, so the model is never whole in memory;
* ``full``: every parameter trains.

For each it reports the swap files' bytes by kind (compute shards; optimizer states: master + moments),
the trainable elements, the host tier's peak (the engine's accounted host memory), the process's RSS after
training, at its peak once the model is loaded (built and sharded, before training: what streaming the base
saves) and at its peak overall, and the bytes of one checkpoint (the Trainer's: a frozen base is left out).

    .venv/bin/python benchmarks/bench_lora.py              # the three, ~1 minute on 2 cores
    .venv/bin/python benchmarks/bench_lora.py --hidden 1024 --layers 16 --vocab 32000 --modes lora,lora-streamed
    .venv/bin/python benchmarks/bench_lora.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MODES = ("lora", "lora-streamed", "full")


def llama_config(shape: dict):
    import transformers

    return transformers.LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                                    intermediate_size=shape["hidden"] * 11 // 4, num_hidden_layers=shape["layers"],
                                    num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128)


def make_base(folder: str, shape: dict) -> None:
    """The random model saved as a model folder (config.json, model.safetensors), for ``lora-streamed``."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config(shape)).save_pretrained(folder)


def run_one(mode: str, folder: str, steps: int, shape: dict, base: str | None) -> dict:
    import psutil
    import torch
    import transformers

    from infinity.hf import Trainer
    from infinity.runtime.rss import peak_rss_bytes

    torch.manual_seed(0)
    if mode == "lora-streamed":
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(base))
    else:
        model = transformers.LlamaForCausalLM(llama_config(shape))
    total = sum(p.numel() for p in model.parameters())
    if mode.startswith("lora"):
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                           task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, shape["vocab"], (64,), generator=g).tolist()} for _ in range(8 * steps)]

    def collate(rows):
        ids = torch.tensor([r["input_ids"] for r in rows])
        return {"input_ids": ids, "labels": ids}

    swap = os.path.join(folder, "swap")
    os.makedirs(swap, exist_ok=True)
    args = transformers.TrainingArguments(output_dir=os.path.join(folder, "out"), per_device_train_batch_size=4,
                                          max_steps=steps, learning_rate=1e-4, save_strategy="no", report_to=[],
                                          use_cpu=True, disable_tqdm=True, logging_steps=1)
    config = {"device": "cpu", "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0},
        "offload_optimizer": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0}}}
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate, infinity_config=config)
    load_peak = peak_rss_bytes()  # the model built and sharded, not trained
    trainer.train()
    engine = trainer.engine
    checkpoint = os.path.join(folder, "checkpoint")
    trainer._save_optimizer_and_scheduler(checkpoint)  # noqa: SLF001 (what a Trainer checkpoint holds of the engine)
    checkpoint_nbytes = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(checkpoint)
                            for f in files)
    by_kind = {"compute_shards": 0, "optimizer_states": 0}
    for store in engine.tiers._stores.values():  # noqa: SLF001 (a benchmark reads the swap store's extents)
        for key in list(store._extents):  # noqa: SLF001
            kind = "compute_shards" if key.startswith("param.") else "optimizer_states"
            by_kind[kind] += store.nbytes(key)
    host = engine.tiers.stats["host"]
    keys = sorted({key.split(".")[0] for store in engine.tiers._stores.values() for key in store._extents})  # noqa: SLF001
    out = {"mode": mode, "placement": engine.placement.describe(), "swap_keys": keys, "params": total, "trainable": trainable, "nvme_nbytes": by_kind,
           "host_tier_peak_nbytes": host.peak_nbytes, "rss_after_nbytes": psutil.Process().memory_info().rss,
           "load_peak_rss_nbytes": load_peak,
           "peak_rss_nbytes": peak_rss_bytes(),
           "checkpoint_nbytes": checkpoint_nbytes,
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    engine.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--path", default=None, help="folder for the swap files (default: a temporary folder)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--make-base", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown[0]!r}; choose from {', '.join(MODES)}")
    if args.make_base:
        make_base(args.folder, shape)
        return 0
    if args.one:
        print(json.dumps(run_one(args.one, args.folder, args.steps, shape, args.base)))
        return 0
    results = []
    sizes = ["--steps", str(args.steps), "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab",
             str(args.vocab)]
    with tempfile.TemporaryDirectory(dir=args.path) as base:
        if "lora-streamed" in modes:  # made in its own process: the measured ones never hold it
            subprocess.run([sys.executable, __file__, "--make-base", "--folder", base, *sizes], check=True)
        for mode in modes:
            with tempfile.TemporaryDirectory(dir=args.path) as folder:
                done = subprocess.run([sys.executable, __file__, "--one", mode, "--folder", folder, "--base", base,
                                       *sizes], capture_output=True, text=True, check=True)
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(results))
        return 0
    mib = 2**20
    print(f"{'':13} {'params':>11} {'trainable':>11} {'nvme shards':>12} {'nvme optim':>11} {'host peak':>10} "
          f"{'RSS loaded':>10} {'RSS after':>10} {'RSS peak':>9} {'checkpoint':>11}")
    for r in results:
        print(f"{r['mode']:13} {r['params']:>11,} {r['trainable']:>11,} "
              f"{r['nvme_nbytes']['compute_shards'] / mib:>8.1f} MiB {r['nvme_nbytes']['optimizer_states'] / mib:>7.2f} MiB "
              f"{r['host_tier_peak_nbytes'] / mib:>6.1f} MiB {r['load_peak_rss_nbytes'] / mib:>6.0f} MiB "
              f"{r['rss_after_nbytes'] / mib:>6.0f} MiB "
              f"{r['peak_rss_nbytes'] / mib:>5.0f} MiB {r['checkpoint_nbytes'] / mib:>7.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
