"""benchmarks/bench_gpu.py without a GPU: its cases' configs, rows without plain PyTorch, a split case predicted with
the engine's own split, and a case that cannot run leaving the next one to run (no timing here)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from infinity.config.schema import InfinityConfig
from infinity.config.tier_names import OffloadDevice
from infinity.models.gpt import count_params

REPO = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("bench_gpu", REPO / "benchmarks" / "bench_gpu.py")
bench_gpu = importlib.util.module_from_spec(SPEC)
sys.modules["bench_gpu"] = bench_gpu
_thp = os.environ.get("THP_MEM_ALLOC_ENABLE")
SPEC.loader.exec_module(bench_gpu)  # sets THP_MEM_ALLOC_ENABLE for its own process: not for the suite's
if _thp is None:
    os.environ.pop("THP_MEM_ALLOC_ENABLE", None)

@pytest.fixture(autouse=True)
def _hand_made_machine_figures(monkeypatch):
    """The rows' predictions from figures made here: what is asserted of them is bytes and work, never seconds, and
    measuring this machine (what ``bench_gpu.py`` does where none are cached) would take half a minute."""
    from test_step_time import figures
    monkeypatch.setattr(bench_gpu, "machine_figures", lambda: figures(device="cpu", copy_path="host copy"))


@pytest.fixture(autouse=True)
def _distinct_device_mode_only_in_the_test(monkeypatch):
    """main() with --allow-cpu sets INFINITY_DISTINCT_DEVICE=1 in the environment: restored after each test."""
    monkeypatch.setenv("INFINITY_DISTINCT_DEVICE", os.environ.get("INFINITY_DISTINCT_DEVICE", "0"))


TINY = ["--allow-cpu", "--models", "tiny", "--seq", "32", "--micro-batch", "1", "--rounds", "1", "--warmup", "0"]


def test_auto_case_is_cpu_parameters_and_the_optimizer_split_by_the_device_budget(tmp_path):
    args = bench_gpu.parse_args(["--host-memory", "110GiB", "--sub-group-size", "5e7"])
    raw = bench_gpu.engine_config("auto", 1, str(tmp_path), bench_gpu.zero_overrides(args))
    config = InfinityConfig.from_deepspeed(raw)
    assert config.zero.offload_param.device is OffloadDevice.CPU
    assert config.zero.offload_optimizer.device is OffloadDevice.AUTO
    assert config.zero.sub_group_size == 50_000_000 and config.zero.host_memory_budget == 110 << 30
    # every other case takes the same overrides, and none without them
    for tier in bench_gpu.TIERS:
        zero = bench_gpu.engine_config(tier, 1, str(tmp_path), bench_gpu.zero_overrides(args))["zero_optimization"]
        assert zero["host_memory_budget"] == "110GiB" and zero["sub_group_size"] == 50_000_000, tier
        plain = bench_gpu.engine_config(tier, 1, str(tmp_path))["zero_optimization"]
        assert "host_memory_budget" not in plain and "sub_group_size" not in plain, tier


def test_keep_case_is_the_cpu_case_with_every_parameter_kept_gathered_until_the_step(tmp_path):
    keep = InfinityConfig.from_deepspeed(bench_gpu.engine_config("keep", 4, str(tmp_path)))
    cpu = InfinityConfig.from_deepspeed(bench_gpu.engine_config("cpu", 4, str(tmp_path)))
    assert keep.zero.max_live_parameters == keep.zero.max_reuse_distance == bench_gpu.KEEP_ALL
    assert keep.zero.offload_param == cpu.zero.offload_param
    assert keep.zero.offload_optimizer == cpu.zero.offload_optimizer
    # predicted with fetches once a step: less to copy up than the cpu case's, which at 1.3B keeps what the default
    # reuse distance covers (at 124M it covers the whole model already)
    args = bench_gpu.parse_args(["--seq", "64"])
    cfg = bench_gpu.MODELS["1.3b"]
    raw = {tier: bench_gpu.engine_config(tier, 4, str(tmp_path)) for tier in ("keep", "cpu")}
    kept = bench_gpu.predicted(cfg, "keep", 4, args, raw["keep"])["step_resources"]["h2d"]
    refetched = bench_gpu.predicted(cfg, "cpu", 4, args, raw["cpu"])["step_resources"]["h2d"]
    assert 0 < kept < refetched


def test_plain_pytorch_rows_only_where_its_training_state_fits():
    cfg = bench_gpu.MODELS["6.7b"]
    assert 6.6e9 < count_params(cfg) < 6.7e9
    # 16 B a parameter: 107 GB, more than an 80 GB card holds, so the reference is left out on a GPU
    assert count_params(cfg) * bench_gpu.PLAIN_TRAINING_BYTES_PER_PARAM > 80e9
    import torch
    assert bench_gpu.reference_fits(cfg, torch.device("cpu"))  # the CPU's memory is the host's: always tried


def test_model_tflops_are_six_flops_a_parameter_a_token():
    cfg = bench_gpu.MODELS["tiny"]
    assert bench_gpu.model_tflops(cfg, 1000, 2.0) == pytest.approx(6 * count_params(cfg) * 1000 / 2.0 / 1e12)


def test_split_rows_without_a_reference_carry_tokens_a_second_and_the_engines_split(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = bench_gpu.main(TINY + ["--cases", "cpu:1,half:1", "--sub-group-size", "5e4", "--no-reference",
                                "--out", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())
    cpu, half = summary["rows"]
    for row in (cpu, half):
        assert row["reference_step_s"] is None and row["ratio"] is None and "ratio_over_predicted_ratio" not in row
        assert row["tokens_per_s"] == pytest.approx(32 / row["step_s"])
        assert row["tflops"] == pytest.approx(bench_gpu.model_tflops(bench_gpu.MODELS["tiny"], 32, row["step_s"]))
    split = half["optimizer_split"]
    assert 0 < split["device_sub_groups"] < split["sub_groups"] and "optimizer_split" not in cpu
    assert summary["half_vs_cpu"]["tiny"] == pytest.approx(half["step_s"] / cpu["step_s"])
    # predicted with the sub-groups the engine put on the device: less CPU Adam work than every sub-group offloaded
    assert half["step_resources"]["cpu_adam"] < cpu["step_resources"]["cpu_adam"]
    assert "optimizer: 7 of 14 sub-groups on the device" in capsys.readouterr().out


def test_a_case_that_cannot_run_is_a_row_of_its_own_and_the_next_case_runs(tmp_path, capsys):
    out = tmp_path / "rows.json"
    # 8 MiB of host memory: the cpu case needs ~11 MiB (refused at initialize, naming the key); none needs ~4
    rc = bench_gpu.main(TINY + ["--cases", "cpu:1,none:1", "--host-memory", "8MiB", "--out", str(out)])
    assert rc == 1
    failed, ran = json.loads(out.read_text())["rows"]
    assert failed["tier"] == "cpu" and "zero_optimization.host_memory_budget" in failed["error"]
    assert ran["tier"] == "none" and "error" not in ran and ran["ratio"] > 0
    assert "cpu   1 failed: ValueError" in capsys.readouterr().out


def test_a_block_runs_its_steps_back_to_back_and_ends_once_their_updates_are_done(monkeypatch):
    """The updates a step leaves behind the next forward are in its block's time: the contender's finish() (the
    engine's finish_step) ends the block, once, after its last step (plain PyTorch's has nothing to wait for)."""
    import torch
    clock, calls = [0.0], []

    class Contender:
        def step(self, batches):
            calls.append(("step", batches))
            clock[0] += 1.0
            return float(batches)

        def finish(self):
            calls.append(("finish", None))
            clock[0] += 0.5  # the last step's tail

    monkeypatch.setattr(bench_gpu.time, "perf_counter", lambda: clock[0])
    per_step, loss = bench_gpu.timed_block(torch.device("cpu"), Contender(), [1, 2, 3])
    assert calls == [("step", 1), ("step", 2), ("step", 3), ("finish", None)]
    assert per_step == pytest.approx(3.5 / 3) and loss == 3.0
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--block", "0"])
