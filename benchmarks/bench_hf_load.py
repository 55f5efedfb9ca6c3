"""Peak host memory of ``infinity.from_pretrained`` on a ~1B-parameter random Llama saved locally.

The model folder is written first (config.json + sharded bf16 safetensors,
one random tensor at a time, never the model in memory); then a fresh process
builds the engine with parameters and optimizer states on NVMe and reports
how much its peak RSS grew during the load, against the largest tensor and the
engine's own host buffers the load touches: one sub-group of fp32 masters
being assembled, the optimizer's staging buffer it is copied into, and one
shard in compute precision on its way to NVMe (``sub_group_size`` 2e7).

    .venv/bin/python benchmarks/bench_hf_load.py                # ~1.1B (TinyLlama's shape)
    .venv/bin/python benchmarks/bench_hf_load.py --layers 2     # a quick run
    .venv/bin/python benchmarks/bench_hf_load.py --launched     # a script's own loop under `infinity deepspeed`:
                                                                #   ZeRO-3 (built on meta) against stage 2 (whole)

Everything goes under a fresh temporary folder (``--path`` to pick the
filesystem), removed at the end. Needs ~20 GB free: 2.2 GB of weights, 2.2 GB
of compute shards and 13 GB of fp32 master + moments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


SUB_GROUP_SIZE = 20_000_000


def llama_config(layers: int):
    import transformers
    return transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                                    num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                                    tie_word_embeddings=False)


def write_random_model(folder: Path, layers: int) -> dict:
    """config.json and bf16 safetensors shards of ~2 GB, each tensor generated and written alone."""
    import transformers

    from infinity.weights.export import HFTensor, write_hf_folder

    config = llama_config(layers)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    tensors = [HFTensor(name, tuple(p.shape), torch.bfloat16,
                        lambda out: out.normal_(0.0, 0.02) if out.dim() > 1 else out.fill_(1.0))
               for name, p in model.named_parameters()]
    summary = write_hf_folder(folder, tensors, config=json.loads(config.to_json_string()),
                              max_shard_nbytes=2 * 10**9)
    summary["params"] = sum(math.prod(t.shape) for t in tensors)
    return summary


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(folder: str, nvme: str) -> dict:
    """In a fresh process: RSS before and peak during ``from_pretrained`` (params + optimizer on NVMe, bf16)."""
    import infinity
    import infinity.engine.engine as engine_module
    from infinity.hf.pretrained import build_meta_causal_lm
    from infinity.runtime.rss import peak_rss_bytes
    from infinity.weights.pretrained import PretrainedWeights

    build_meta_causal_lm(folder)  # imports and the meta model's own costs are not the load's
    with PretrainedWeights.open(folder) as weights:
        largest = max((weights.info(n) for n in weights.names), key=lambda i: math.prod(i[1]))
    largest_numel = math.prod(largest[1])
    config = {"bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "sub_group_size": SUB_GROUP_SIZE,
                                    "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0},
                                    # NVMe for real: by default what fits the host-memory budget stays in
                                    # host memory (NVMe is a spill tier), which is not what this measures
                                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}}}
    # The streaming phase alone: the engine's own buffers (gradient slices, zeroed at construction) are
    # allocated before it; its RSS is taken as it starts (instrumentation of this benchmark only).
    phase = {}
    original = engine_module.write_initial_shards

    def timed(*a, **k):
        phase["rss_before"] = _rss_bytes()
        phase["peak_before"] = peak_rss_bytes()
        original(*a, **k)
        phase["peak_after"] = peak_rss_bytes()

    engine_module.write_initial_shards = timed
    before = _rss_bytes()
    peak_before = peak_rss_bytes()
    started = time.perf_counter()
    engine = infinity.from_pretrained(folder, config)
    seconds = time.perf_counter() - started
    peak = peak_rss_bytes()
    engine_module.write_initial_shards = original
    grads_nbytes = engine.optimizer.grads.numel() * engine.optimizer.grads.element_size()
    accounted = engine.tiers.stats["host"].peak_nbytes  # allocated staging sets, mostly never touched by a load
    # What the load touches besides the tensor itself: one sub-group of fp32 masters assembled, its staging
    # buffer (the optimizer's), and one shard in compute precision on its way to NVMe.
    buffers = (2 * engine.layout.largest_sub_group_numel * 4
               + engine.layout.largest_shard_numel * torch.empty((), dtype=engine.dtype).element_size())
    engine.close()
    growth = peak - max(before, 0)
    load_growth = phase["peak_after"] - phase["rss_before"]
    bound = 1.3 * largest_numel * 4 + buffers
    return {"params": sum(s.numel for s in engine.layout.slots), "load_s": round(seconds, 1),
            "rss_before_bytes": before, "peak_rss_before_bytes": peak_before, "peak_rss_bytes": peak,
            "peak_rss_growth_bytes": growth,
            "largest_tensor_numel": largest_numel, "largest_tensor_file_nbytes": largest_numel * largest[0].itemsize,
            "largest_tensor_fp32_nbytes": largest_numel * 4, "engine_host_buffers_nbytes": buffers,
            "engine_host_tier_peak_nbytes": accounted, "sub_group_size": SUB_GROUP_SIZE,
            "grad_slices_nbytes": grads_nbytes, "load_phase_rss_before_bytes": phase["rss_before"],
            "load_phase_peak_rss_growth_bytes": load_growth,
            "bound_bytes": int(bound), "within_bound": load_growth <= bound and growth <= bound + grads_nbytes}


def measure_launched(folder: str, nvme: str, stage: int) -> dict:
    """Run by ``infinity deepspeed`` as a Hugging Face script with its own loop would be: ``HfDeepSpeedConfig``, then
    ``from_pretrained``, then ``deepspeed.initialize``. At stage 3 the launcher builds the model on the meta device
    and the engine streams it; at stage 2 the model is loaded whole first, as DeepSpeed loads it there."""
    import deepspeed  # the launcher's alias: infinity.deepspeed
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    from infinity.runtime.rss import peak_rss_bytes

    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
              "zero_optimization": {"stage": stage, "sub_group_size": SUB_GROUP_SIZE,
                                    "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}}}
    dschf = HfDeepSpeedConfig(config)  # kept alive while the model loads, as transformers' docs keep it
    assert dschf.is_zero3() == (stage == 3)
    before = _rss_bytes()
    started = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    built_on_meta = next(model.parameters()).is_meta
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    seconds = time.perf_counter() - started
    peak = peak_rss_bytes()
    grads_nbytes = engine.optimizer.grads.numel() * engine.optimizer.grads.element_size()
    engine.close()
    return {"stage": stage, "built_on_meta": built_on_meta, "load_s": round(seconds, 1), "rss_before_bytes": before,
            "peak_rss_growth_bytes": peak - before, "grad_slices_nbytes": grads_nbytes}


def launched(root: Path) -> int:
    """The same script under ``infinity deepspeed`` at stage 3 (meta, streamed) and stage 2 (loaded whole), twice
    each, alternating; the peak RSS growth of each and their ratio."""
    runs = []
    for stage in (3, 2, 3, 2):
        (root / "swap").mkdir(exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "infinity.cli", "deepspeed", "--no_local_rank", __file__,
                               "--measure-launched", str(root / "model"), str(root / "swap"), str(stage)],
                              capture_output=True, text=True)
        shutil.rmtree(root / "swap", ignore_errors=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-5000:])
            return proc.returncode
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    mib = 2**20
    growth = {stage: [r["peak_rss_growth_bytes"] for r in runs if r["stage"] == stage] for stage in (3, 2)}
    for r in runs:
        print(f"  stage {r['stage']} ({'built on meta, streamed' if r['built_on_meta'] else 'loaded whole'}): "
              f"from_pretrained + initialize in {r['load_s']} s, peak RSS grew {r['peak_rss_growth_bytes'] / mib:,.0f}"
              f" MiB (gradient slices {r['grad_slices_nbytes'] / mib:,.0f} MiB of it)")
    ratio = max(growth[3]) / min(growth[2])
    print(f"  streamed / whole peak RSS growth: {ratio:.2f} (the worse streamed run over the better whole one)")
    print(json.dumps({"runs": runs, "streamed_over_whole": round(ratio, 3)}))
    return 0 if all(r["built_on_meta"] == (r["stage"] == 3) for r in runs) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=22, help="decoder layers (22: ~1.1B parameters)")
    ap.add_argument("--path", default=None, help="filesystem for the model and swap files (default: system temp)")
    ap.add_argument("--launched", action="store_true",
                    help="a Hugging Face script's own loop under `infinity deepspeed` (HfDeepSpeedConfig, "
                         "from_pretrained, deepspeed.initialize): stage 3, built on meta and streamed, against "
                         "stage 2, loaded whole")
    ap.add_argument("--measure", nargs=2, metavar=("FOLDER", "NVME"), help=argparse.SUPPRESS)
    ap.add_argument("--measure-launched", nargs=3, metavar=("FOLDER", "NVME", "STAGE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return 0
    if args.measure_launched:
        folder, nvme, stage = args.measure_launched
        print(json.dumps(measure_launched(folder, nvme, int(stage))))
        return 0
    root = Path(tempfile.mkdtemp(prefix="bench-hf-load-", dir=args.path))
    try:
        need = 20 * 10**9 * args.layers / 22
        free = shutil.disk_usage(root).free
        if free < need:
            raise SystemExit(f"{root}: {free / 1e9:.1f} GB free, the benchmark needs ~{need / 1e9:.1f} GB")
        started = time.perf_counter()
        written = write_random_model(root / "model", args.layers)
        print(f"wrote a random Llama of {written['params'] / 1e9:.2f}B parameters: {written['files']} file(s), "
              f"{written['nbytes'] / 1e9:.2f} GB bf16, in {time.perf_counter() - started:.0f} s", flush=True)
        if args.launched:
            return launched(root)
        (root / "swap").mkdir()
        proc = subprocess.run([sys.executable, __file__, "--measure", str(root / "model"), str(root / "swap")],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        mib = 2**20
        r = result
        print(f"from_pretrained in {r['load_s']} s; largest tensor {r['largest_tensor_file_nbytes'] / mib:,.0f} MiB bf16 "
              f"({r['largest_tensor_fp32_nbytes'] / mib:,.0f} MiB as fp32 master); load buffers (sub-group of masters "
              f"+ its staging + one compute shard) {r['engine_host_buffers_nbytes'] / mib:,.0f} MiB; "
              f"bound 1.3 x tensor + buffers = {r['bound_bytes'] / mib:,.0f} MiB")
        print(f"  streaming phase: peak RSS grew {r['load_phase_peak_rss_growth_bytes'] / mib:,.0f} MiB")
        print(f"  whole from_pretrained: peak RSS grew {r['peak_rss_growth_bytes'] / mib:,.0f} MiB, of which the "
              f"engine's gradient slices (host, zeroed at construction) {r['grad_slices_nbytes'] / mib:,.0f} MiB")
        print(f"  {'within' if r['within_bound'] else 'OVER'} the bound")
        print(json.dumps(result))
        return 0 if result["within_bound"] else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
