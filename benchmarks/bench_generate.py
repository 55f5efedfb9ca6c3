"""Generation and evaluation with offloaded parameters against the plain model, in the same run.

A random Llama (by default hidden 512, 8 layers, vocabulary 8000: ~34M parameters) generates ``--new-tokens``
tokens greedily from a batch of prompts, and evaluates ``--eval-batches`` batches (``model(**batch)`` under
``torch.no_grad()``): the plain model, and the same model under the engine with its parameters on a tier
(``--tiers``: ``cpu``, ``nvme``). Each engine runs twice: as it is (a forward without grad keeps what the next uses
gathered, within ``stage3_max_live_parameters``), and with ``stage3_max_reuse_distance`` 0, which keeps nothing, so
that every forward fetches the whole model again. Each round runs every contender in turn (a shared box's speed
drifts); a row gives each contender's median time ÷ the plain model's in the same round, the median over rounds,
and the NVMe bytes read per generated token (the model's compute shards are read once a forward where nothing is
kept). The tokens each engine generates are checked against the plain model's.

    .venv/bin/python benchmarks/bench_generate.py                      # ~1 minute on 2 cores
    .venv/bin/python benchmarks/bench_generate.py --tiers nvme --rounds 5 --json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import infinity  # noqa: E402
from infinity.runtime.hardware import machine_description  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--tiers", default="cpu,nvme", help="parameter tiers, comma-separated (cpu, nvme)")
    parser.add_argument("--batch", type=int, default=4, help="prompts a generate and rows an evaluation batch")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nvme-path", default=None, help="folder for the swap files (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="one JSON line at the end")
    args = parser.parse_args(argv)
    for tier in args.tiers.split(","):
        if tier not in ("cpu", "nvme"):
            parser.error(f"--tiers: {tier!r} is not cpu or nvme")
    if min(args.rounds, args.new_tokens, args.eval_batches, args.batch, args.prompt_len) < 1:
        parser.error("--rounds, --new-tokens, --eval-batches, --batch and --prompt-len must be at least 1")
    return args


def llama(args):
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                                      num_attention_heads=8, num_key_value_heads=8,
                                      max_position_embeddings=args.prompt_len + args.new_tokens, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def engine_config(tier: str, swap: str, keep: bool) -> dict:
    offload = {"device": tier}
    if tier == "nvme":
        offload.update(nvme_path=swap, max_in_cpu=0)  # really read from the disk, not cached in host memory
    zero = {"stage": 3, "offload_param": offload, "offload_optimizer": {"device": "cpu"},
            "stage3_param_persistence_threshold": 0}
    if not keep:
        zero["stage3_max_reuse_distance"] = 0
    return {"device": "cpu", "train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}


def nvme_bytes_read(engine) -> int:
    return engine.tiers.snapshot()["nvme"]["bytes_read"]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main(argv=None) -> int:
    args = parse_args(argv)
    model = llama(args)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=g)
    eval_batches = [torch.randint(3, args.vocab, (args.batch, args.prompt_len + args.new_tokens), generator=g)
                    for _ in range(args.eval_batches)]
    options = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": False,
               "pad_token_id": 0}

    def generate(m):
        with torch.no_grad():
            return m.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), **options)

    def evaluate(m):
        with torch.no_grad():
            return [m(input_ids=b, labels=b).loss.item() for b in eval_batches]

    swap_root = tempfile.TemporaryDirectory(dir=args.nvme_path)
    engines = {}
    for tier in args.tiers.split(","):
        for keep in (True, False):
            name = f"{tier}" + ("" if keep else " reuse 0")
            swap = Path(swap_root.name) / name.replace(" ", "-")
            swap.mkdir()
            engines[name] = infinity.initialize(copy.deepcopy(model), engine_config(tier, str(swap), keep))
    times = {name: {"generate": [], "evaluate": []} for name in ["plain", *engines]}
    reads_per_token = {name: [] for name in engines}
    expected_tokens = generate(model)
    for _ in range(args.rounds):
        for kind, run in (("generate", generate), ("evaluate", evaluate)):
            seconds, _ = timed(lambda: run(model))
            times["plain"][kind].append(seconds)
            for name, engine in engines.items():
                before = nvme_bytes_read(engine)
                seconds, out = timed(lambda: run(engine.module))
                times[name][kind].append(seconds)
                if kind == "generate":
                    if not torch.equal(out, expected_tokens):
                        raise SystemExit(f"{name}: generated tokens differ from the plain model's")
                    reads_per_token[name].append((nvme_bytes_read(engine) - before) / args.new_tokens)
    for engine in engines.values():
        engine.close()
    swap_root.cleanup()

    params = sum(p.numel() for p in model.parameters())
    rows = []
    for name in engines:
        row = {"case": name, "params": params}
        for kind in ("generate", "evaluate"):
            ratios = [ours / plain for ours, plain in zip(times[name][kind], times["plain"][kind])]
            row[f"{kind}_s"] = statistics.median(times[name][kind])
            row[f"{kind}_plain_s"] = statistics.median(times["plain"][kind])
            row[f"{kind}_ratio"] = statistics.median(ratios)
        row["nvme_bytes_read_per_token"] = statistics.median(reads_per_token[name])
        rows.append(row)
    print(f"{machine_description()}; {params / 1e6:.1f}M parameters; {args.batch} prompts of {args.prompt_len} "
          f"tokens, {args.new_tokens} new; {args.eval_batches} evaluation batches; {args.rounds} rounds")
    print(f"{'case':<14} {'generate s':>10} {'ours/plain':>10} {'evaluate s':>10} {'ours/plain':>10} "
          f"{'NVMe read/token':>16}")
    for row in rows:
        print(f"{row['case']:<14} {row['generate_s']:>10.3f} {row['generate_ratio']:>9.2f}x "
              f"{row['evaluate_s']:>10.3f} {row['evaluate_ratio']:>9.2f}x "
              f"{row['nvme_bytes_read_per_token'] / 2**20:>12.1f} MiB")
    if args.json:
        print(json.dumps({"machine": machine_description(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
