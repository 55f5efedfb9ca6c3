"""LoRA on an offloaded base: what the optimizer and a checkpoint keep for a frozen base (nothing), measured.

A random Llama (by default hidden 512, 8 layers, vocabulary 8000: ~34M parameters) is trained for a few steps
by ``infinity.hf.Trainer``, each mode in a fresh process, with compute shards and optimizer states on NVMe
(``offload_optimizer.max_in_cpu`` 0, so every state the optimizer keeps is in a swap file):

* ``lora``: ``peft`` LoRA r=8 on ``q_proj``/``v_proj``, the base frozen, the model built whole in host memory
  first (as a Trainer script that calls ``from_pretrained`` does);
* ``lora-streamed``: the same adapters on a base built on the meta device from a saved model folder's config:
  the engine streams the base from the folder into its shards, so the model is never whole in memory;
* ``full``: every parameter trains;
* ``lora-in-memory``: ``lora`` with nothing offloaded (the engine's own cost, apart from its tiers');
* ``stock``: the reference, ``lora``'s model and adapters trained by the stock ``transformers.Trainer``, no engine.

Each mode's step time is the median of its optimizer steps after the first (a ``TrainerCallback`` timing them);
with ``--rounds N`` the modes run in turn N times and each mode's step is given ÷ the stock Trainer's of the
same round, the median over rounds (a shared box's speed drifts between runs).

For each it reports the swap files' bytes by kind (compute shards; optimizer states: master + moments),
the trainable elements, the host tier's peak (the engine's accounted host memory), the process's RSS after
training, at its peak once the model is loaded (built and sharded, before training: what streaming the base
saves) and at its peak overall, and the bytes of one checkpoint (the Trainer's: a frozen base is left out).

    .venv/bin/python benchmarks/bench_lora.py              # the three, ~1 minute on 2 cores
    .venv/bin/python benchmarks/bench_lora.py --hidden 1024 --layers 16 --vocab 32000 --modes lora,lora-streamed
    .venv/bin/python benchmarks/bench_lora.py --json
    .venv/bin/python benchmarks/bench_lora.py --modes stock,lora-in-memory,lora --rounds 3 --steps 6   # speed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MODES = ("stock", "lora", "lora-streamed", "full", "lora-in-memory")


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
    if mode.startswith("lora") or mode == "stock":
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
    steps_at = StepClock()
    if mode == "stock":
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate,
                                       callbacks=[steps_at])
        load_peak = peak_rss_bytes()
        trainer.train()
        return {"mode": mode, "params": total, "trainable": trainable, "step_s": steps_at.median_step_s(),
                "load_peak_rss_nbytes": load_peak, "peak_rss_nbytes": peak_rss_bytes(),
                "rss_after_nbytes": psutil.Process().memory_info().rss,
                "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    offloaded = {"offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0},
                 "offload_optimizer": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0}}
    config = {"device": "cpu", "zero_optimization": {"stage": 3, **({} if mode == "lora-in-memory" else offloaded)}}
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate, infinity_config=config,
                      callbacks=[steps_at])
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
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "step_s": steps_at.median_step_s()}
    engine.close()
    return out


def _step_clock():
    import statistics
    import time

    import transformers

    class StepClock(transformers.TrainerCallback):
        """The wall time of each optimizer step (from one step's end to the next's)."""

        def __init__(self):
            self.ends = []

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.ends:
                self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def median_step_s(self) -> float | None:
            """The median step after the first (which loads kernels and caches), or None with fewer than 2."""
            gaps = [b - a for a, b in zip(self.ends, self.ends[1:])][1:]
            return statistics.median(gaps) if gaps else None
    return StepClock


def StepClock():  # noqa: N802 (a class made where transformers is imported: the parent process never needs it)
    return _step_clock()()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--path", default=None, help="folder for the swap files (default: a temporary folder)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--rounds", type=int, default=1, help="run the modes in turn this many times (step ratios: median)")
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
    rounds = []
    sizes = ["--steps", str(args.steps), "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab",
             str(args.vocab)]
    with tempfile.TemporaryDirectory(dir=args.path) as base:
        if "lora-streamed" in modes:  # made in its own process: the measured ones never hold it
            subprocess.run([sys.executable, __file__, "--make-base", "--folder", base, *sizes], check=True)
        for _ in range(args.rounds):  # the modes in turn, each round: the box's drift falls on all of them
            rounds.append({})
            for mode in modes:
                with tempfile.TemporaryDirectory(dir=args.path) as folder:
                    done = subprocess.run([sys.executable, __file__, "--one", mode, "--folder", folder, "--base",
                                           base, *sizes], capture_output=True, text=True, check=True)
                    rounds[-1][mode] = json.loads(done.stdout.strip().splitlines()[-1])
    results = [rounds[-1][mode] | _step_figures(rounds, mode) for mode in modes]
    if args.json:
        print(json.dumps(results))
        return 0
    mib = 2**20

    def mib_of(value, width, digits=1):
        return f"{value / mib:>{width}.{digits}f} MiB" if value is not None else f"{'-':>{width + 4}}"
    print(f"{'':15} {'params':>11} {'trainable':>11} {'nvme shards':>12} {'nvme optim':>11} {'host peak':>10} "
          f"{'RSS loaded':>10} {'RSS after':>10} {'RSS peak':>9} {'checkpoint':>11} {'step':>8} {'÷ stock':>8}")
    for r in results:
        nvme = r.get("nvme_nbytes", {})
        ratio = f"{r['step_vs_stock']:>8.2f}" if r.get("step_vs_stock") is not None else f"{'-':>8}"
        step = f"{r['step_s']:>7.2f}s" if r.get("step_s") is not None else f"{'-':>8}"
        print(f"{r['mode']:15} {r['params']:>11,} {r['trainable']:>11,} "
              f"{mib_of(nvme.get('compute_shards'), 8)} {mib_of(nvme.get('optimizer_states'), 7, 2)} "
              f"{mib_of(r.get('host_tier_peak_nbytes'), 6)} {mib_of(r['load_peak_rss_nbytes'], 6, 0)} "
              f"{mib_of(r['rss_after_nbytes'], 6, 0)} {mib_of(r['peak_rss_nbytes'], 5, 0)} "
              f"{mib_of(r.get('checkpoint_nbytes'), 7)} {step} {ratio}")
    return 0


def _step_figures(rounds: list[dict], mode: str) -> dict:
    """A mode's median step over the rounds, and its median ratio to the stock Trainer's step of the same round."""
    import statistics

    steps = [r[mode]["step_s"] for r in rounds if r[mode].get("step_s") is not None]
    ratios = [r[mode]["step_s"] / r["stock"]["step_s"] for r in rounds
              if "stock" in r and r[mode].get("step_s") and r["stock"].get("step_s")]
    return {"step_s": statistics.median(steps) if steps else None,
            "step_vs_stock": statistics.median(ratios) if ratios else None,
            "step_vs_stock_rounds": ratios}


if __name__ == "__main__":
    sys.exit(main())
