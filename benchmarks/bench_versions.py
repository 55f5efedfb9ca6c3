"""Versions of the engine against each other and against plain PyTorch, the same step in the same run.

Each ``--tree NAME=PATH`` is a source tree of the engine (a root holding ``infinity/``, ``kernels/`` and
``storage/``: the working tree, or an old commit materialized by ``benchmarks/versions.sh``). Every run of a tree,
and every run of plain PyTorch (the model on the device under bf16 autocast with torch.optim.AdamW, fused on CUDA),
is a process of its own (``benchmarks/versions_driver.py``): a fresh CUDA context, its own peak memory, and
imports from that tree alone (the driver maps the package names to the tree ahead of any installed checkout and
says where each came from). Each tree's C++ kernel builds under its own ``XDG_CACHE_HOME``
(``--cache-dir``/NAME), so two trees never load each other's build.

The runs alternate: each round runs plain PyTorch and every tree once, in an order rotated from round to round,
each run taking ``--warmup`` steps and then ``--steps`` timed ones on the same data. A tree's figure is the median
of its rounds' median steps; its ratio is the median over rounds of its step over plain PyTorch's step in the same
round, so a load that moves both moves neither ratio.

    python benchmarks/bench_versions.py --tree ade920c=.versions/ade920c --tree f6ac807=.versions/f6ac807 \\
        --tree head=. --model 1.3b --micro-batch 8 --seq 1024 --offload-optimizer cpu --sub-group-size 1e8
    python benchmarks/bench_versions.py --allow-cpu --model thin --seq 128 --micro-batch 2 --steps 2 \\
        --tree ade920c=.versions/ade920c --tree head=.           # the script itself, without a GPU

Without CUDA (and without --allow-cpu) it says so and exits 0. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DRIVER = Path(__file__).resolve().with_name("versions_driver.py")
RESULT_PREFIX = "RESULT "
REFERENCE = "plain"
"""The name plain PyTorch's runs go under."""

MODELS = {
    # bench_gpu.py's shapes: GPT-2 small and GPT-3 XL with GPT-2's vocabulary (padded to 50304), tied head
    "124m": {"n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 1024, "vocab_size": 50304},
    "1.3b": {"n_layer": 24, "n_head": 16, "d_model": 2048, "seq_len": 1024, "vocab_size": 50304},
    "tiny": {"n_layer": 2, "n_head": 4, "d_model": 128, "seq_len": 128, "vocab_size": 256},
    # 124M's twelve layers at width 64: next to no compute, so the step is the engine's host-side work
    "thin": {"n_layer": 12, "n_head": 2, "d_model": 64, "seq_len": 128, "vocab_size": 256},
}


@dataclass(frozen=True)
class Tree:
    name: str
    root: Path
    """The source tree's root (holds infinity/, kernels/, storage/)."""


def parse_tree(text: str) -> Tree:
    """``NAME=PATH``; the name is a label in the table and a folder name under --cache-dir."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--tree {text!r}: expected NAME=PATH")
    if name == REFERENCE or not all(c.isalnum() or c in "._-" for c in name):
        raise argparse.ArgumentTypeError(f"--tree {text!r}: NAME must be letters, digits, '.', '_' or '-' "
                                         f"and not {REFERENCE!r}")
    root = Path(path).resolve()
    missing = [d for d in ("infinity", "kernels", "storage") if not (root / d / "__init__.py").is_file()]
    if missing:
        raise argparse.ArgumentTypeError(f"--tree {text!r}: {root} has no {', '.join(missing)} package "
                                         f"(materialize old commits with benchmarks/versions.sh)")
    return Tree(name, root)


def parse_size(text: str) -> int:
    """``1e8``, ``100000000`` or ``100_000_000``: a whole number of elements."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(value)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", dest="trees", type=parse_tree, action="append", required=True,
                   help="NAME=PATH of a source tree of the engine (repeat for each version)")
    p.add_argument("--model", default="1.3b", choices=sorted(MODELS))
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--offload-param", default="cpu", choices=("none", "cpu"),
                   help="where the compute shards rest (cpu: bench_gpu.py's cpu case)")
    p.add_argument("--offload-optimizer", default="cpu", choices=("none", "cpu"))
    p.add_argument("--sub-group-size", type=parse_size, default=100_000_000)
    p.add_argument("--persistence-threshold", type=int, default=100_000,
                   help="stage3_param_persistence_threshold: parameters of at most this many elements are never "
                        "released (0: every tensor fetched and released, as the thin model needs to show the "
                        "engine's work per tensor)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="each round runs plain PyTorch and every tree once")
    p.add_argument("--steps", type=int, default=3, help="timed steps a run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps a run, before the timed ones")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds one run may take")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no round that would end (by the last round's time) past this many seconds from "
                        "the start; the rounds done are reported")
    p.add_argument("--cache-dir", default=None,
                   help="each tree's XDG_CACHE_HOME is CACHE_DIR/NAME (its kernel's build); default "
                        "$XDG_CACHE_HOME/zero-infinity-versions")
    p.add_argument("--allow-cpu", action="store_true", help="run without CUDA (device memory kept distinct)")
    p.add_argument("--out", default=None, help="also write the JSON line to this file")
    args = p.parse_args(argv)
    names = [t.name for t in args.trees]
    if len(set(names)) != len(names):
        p.error(f"--tree names repeat: {names}")
    for key in ("micro_batch", "seq", "grad_accum", "rounds", "steps"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be at least 1")
    if args.seq > MODELS[args.model]["seq_len"]:
        p.error(f"--seq {args.seq} is longer than {args.model}'s {MODELS[args.model]['seq_len']}")
    return args


def cache_dir(args) -> Path:
    if args.cache_dir:
        return Path(args.cache_dir).resolve()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zero-infinity-versions"


def tree_env(tree: Tree, args) -> dict[str, str]:
    """The environment of a run of ``tree``: its imports, its own kernel build, no bytecode written into it."""
    env = dict(os.environ, BENCH_VERSIONS_TREE=str(tree.root), PYTHONPATH=str(tree.root),
               XDG_CACHE_HOME=str(cache_dir(args) / tree.name), PYTHONDONTWRITEBYTECODE="1",
               PYTHONUNBUFFERED="1")
    if args.allow_cpu:
        env["INFINITY_DISTINCT_DEVICE"] = "1"  # the crossings a GPU makes, in trees that have the mode
    return env


def commit_of(tree: Tree) -> str:
    """What the tree is: the COMMIT file versions.sh writes, else git's HEAD (and whether it is modified)."""
    marker = tree.root / "COMMIT"
    if marker.is_file():
        return marker.read_text(encoding="utf-8").strip()
    try:
        head = subprocess.run(["git", "-C", str(tree.root), "log", "-1", "--format=%h %cs %s"],
                              capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree.root), "status", "--porcelain", "--", "infinity", "kernels",
                                "storage"], capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "a working tree (no git history here)"
    return head[:100] + (" + changes in the working tree" if dirty else "")


def result_of(stdout: str) -> dict | None:
    """The driver's last ``RESULT {json}`` line, or None when it printed none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return None


def run_driver(tree: Tree, argv: list[str], args, timeout: float) -> tuple[dict | None, str]:
    """One process of the driver; (its result or None, why it failed)."""
    try:
        done = subprocess.run([sys.executable, str(DRIVER), *argv], env=tree_env(tree, args), capture_output=True,
                              text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, f"no result within {timeout:.0f} s"
    result = result_of(done.stdout)
    if done.returncode != 0 or result is None:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
        return None, f"exit {done.returncode}:\n{tail}"
    return result, ""


def prepare_all(trees: list[Tree], args) -> dict[str, dict]:
    """Every tree imported and its kernel built (or loaded), in parallel, before any timing."""
    procs = {t.name: subprocess.Popen([sys.executable, str(DRIVER), "--prepare"], env=tree_env(t, args),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for t in trees}
    prepared = {}
    for tree in trees:
        proc = procs[tree.name]
        try:
            out, _ = proc.communicate(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        result = result_of(out or "")
        if proc.returncode != 0 or result is None:
            tail = "\n".join((out or "").strip().splitlines()[-12:])
            raise SystemExit(f"bench_versions: tree {tree.name} ({tree.root}) did not import or build:\n{tail}")
        own_cache = cache_dir(args) / tree.name
        if result["kernel_backend"] == "cpp" and not Path(result["kernel_build_dir"]).is_relative_to(own_cache):
            raise SystemExit(f"bench_versions: tree {tree.name}'s kernel was built in {result['kernel_build_dir']}, "
                             f"not under its own {own_cache}")
        prepared[tree.name] = result
    return prepared


def run_spec(mode: str, args) -> dict:
    model = dict(MODELS[args.model], tie_embeddings=True)
    return {"mode": mode, "model": model, "micro_batch": args.micro_batch, "seq": args.seq,
            "grad_accum": args.grad_accum, "offload_param": args.offload_param,
            "offload_optimizer": args.offload_optimizer, "sub_group_size": args.sub_group_size,
            "persistence_threshold": args.persistence_threshold, "steps": args.steps, "warmup": args.warmup,
            "allow_cpu": args.allow_cpu}


def round_order(names: list[str], round_: int) -> list[str]:
    """Every name once, rotated by the round: each takes each position as often as the rounds allow."""
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


def summarize(names: list[str], runs: dict[str, list[dict | None]]) -> dict[str, dict]:
    """Per name: the median of its rounds' median steps and the median of its per-round ratios to plain PyTorch."""
    rows = {}
    for name in names:
        done = [r for r in runs[name] if r is not None]
        ratios = [r["median_step_s"] / ref["median_step_s"]
                  for r, ref in zip(runs[name], runs[REFERENCE]) if r is not None and ref is not None]
        rows[name] = {
            "rounds_done": len(done), "rounds_failed": len(runs[name]) - len(done),
            "step_s": statistics.median(r["median_step_s"] for r in done) if done else None,
            "ratio_to_plain": statistics.median(ratios) if ratios and name != REFERENCE else None,
            "steps_s": [s for r in done for s in r["step_s"]],
            "setup_s": statistics.median(r["setup_s"] for r in done) if done else None,
            "peak_device_bytes": max((r["peak_device_bytes"] or 0 for r in done), default=None),
            "peak_rss_bytes": max((r["peak_rss_bytes"] for r in done), default=None),
            "losses_last_run": done[-1]["losses"] if done else None,
            "copies_last_run": done[-1].get("copies", {}) if done else None,
        }
    return rows


def print_run(round_: int, name: str, result: dict | None, why: str) -> None:
    if result is None:
        print(f"round {round_ + 1}  {name:>12}  FAILED: {why}", flush=True)
        return
    device_gib = (result["peak_device_bytes"] or 0) / 2**30
    steps = " ".join(f"{s:.3f}" for s in result["step_s"])
    print(f"round {round_ + 1}  {name:>12}  median step {result['median_step_s']:.3f} s  [{steps}]  "
          f"setup {result['setup_s']:.1f} s  peak device {device_gib:.2f} GiB  "
          f"peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB  loss {result['losses'][-1]:.4f}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    trees = args.trees
    started = time.perf_counter()
    prepared = prepare_all(trees, args)
    first = prepared[trees[0].name]
    if not first["cuda"] and not args.allow_cpu:
        print("bench_versions: CUDA is not available here; nothing to measure (use --allow-cpu to run the script "
              "on the CPU with device memory kept distinct)")
        return 0
    commits = {t.name: commit_of(t) for t in trees}
    print(f"device: {first['device_name']}; torch {first['torch']}; model {args.model}, micro-batch "
          f"{args.micro_batch} x seq {args.seq}, bf16, offload_param {args.offload_param}, offload_optimizer "
          f"{args.offload_optimizer}, sub_group_size {args.sub_group_size:.0e}, accumulation {args.grad_accum}; "
          f"{args.rounds} rounds of {args.steps} steps after {args.warmup} warm-up")
    for tree in trees:
        facts = prepared[tree.name]
        print(f"tree {tree.name}: {commits[tree.name]}\n  imports {facts['imported_from']['infinity']}"
              f"\n  kernel {facts['kernel_backend']} from {facts['kernel_build_dir']} "
              f"(loaded in {facts['kernel_load_s']:.1f} s)", flush=True)
        if facts["kernel_backend"] != "cpp":
            print(f"  WARNING: tree {tree.name} steps with the torch reference, not its C++ kernel", flush=True)
    names = [REFERENCE] + [t.name for t in trees]
    by_name = {t.name: t for t in trees}
    # plain PyTorch imports its GPT from the last tree (the model's compute is the same in every tree)
    reference_tree = trees[-1]
    runs: dict[str, list[dict | None]] = {name: [] for name in names}
    round_s = 0.0
    for round_ in range(args.rounds):
        elapsed = time.perf_counter() - started
        if args.budget_s is not None and round_ > 0 and elapsed + round_s > args.budget_s:
            print(f"stopping after {round_} rounds: another ({round_s:.0f} s) would end past --budget-s "
                  f"{args.budget_s:.0f}", flush=True)
            break
        round_start = time.perf_counter()
        for name in round_order(names, round_):
            mode = "reference" if name == REFERENCE else "engine"
            tree = reference_tree if name == REFERENCE else by_name[name]
            result, why = run_driver(tree, ["--run", json.dumps(run_spec(mode, args))], args, args.run_timeout)
            runs[name].append(result)
            print_run(round_, name, result, why)
        round_s = time.perf_counter() - round_start
    rows = summarize(names, runs)
    print(f"\n{'tree':>12} {'median step s':>14} {'x plain':>8} {'setup s':>8} {'peak device GiB':>16} "
          f"{'peak RSS GiB':>13}  rounds")
    for name in names:
        row = rows[name]
        step = f"{row['step_s']:14.3f}" if row["step_s"] is not None else f"{'-':>14}"
        ratio = f"{row['ratio_to_plain']:7.2f}x" if row["ratio_to_plain"] is not None else f"{'-':>8}"
        setup = f"{row['setup_s']:8.1f}" if row["setup_s"] is not None else f"{'-':>8}"
        device_gib = (row["peak_device_bytes"] or 0) / 2**30
        rss_gib = (row["peak_rss_bytes"] or 0) / 2**30
        print(f"{name:>12} {step} {ratio} {setup} {device_gib:16.2f} {rss_gib:13.2f}  "
              f"{row['rounds_done']}/{len(runs[REFERENCE])}")
    summary = {"device": first["device_name"], "torch": first["torch"], "model": args.model,
               "micro_batch": args.micro_batch, "seq": args.seq, "offload_param": args.offload_param,
               "offload_optimizer": args.offload_optimizer, "sub_group_size": args.sub_group_size,
               "persistence_threshold": args.persistence_threshold, "grad_accum": args.grad_accum,
               "rounds": len(runs[REFERENCE]), "steps": args.steps,
               "warmup": args.warmup,
               "trees": {t.name: {"root": str(t.root), "commit": commits[t.name],
                                  "kernel_backend": prepared[t.name]["kernel_backend"]} for t in trees},
               "rows": rows, "wall_s": time.perf_counter() - started}
    line = json.dumps(summary)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line)
    return 0 if all(rows[n]["rounds_failed"] == 0 for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
