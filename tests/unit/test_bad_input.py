"""Inputs that went wrong (issue 17): each is refused with one line naming the key, path or flag, before any work;
and the precision ``auto`` takes on this machine."""

import json
import subprocess
import sys
import tempfile

import pytest

from infinity.runtime import hardware
from infinity.cli import build_parser, main
from infinity.commands import train
from infinity.config.schema import InfinityConfig


pytestmark = pytest.mark.usefixtures("fresh_cwd")  # conftest.py: runs write under ./runs


def _fails(capsys, *argv, command="train") -> str:
    extra = ["--max-bytes", "200000"] if command == "train" and "--max-bytes" not in argv else []
    assert main([command, *extra, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"infinity {command}: error: ") and len(err.strip().splitlines()) == 1, err
    return err


def _config(tmp_path, body: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(body))
    return str(path)


# --------------------------------------------------------------------------- precision auto


def test_auto_takes_fp32_on_a_cpu_without_bf16_units(monkeypatch):
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: "model name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma\n")
    hardware.cpu_flags.cache_clear(), hardware.fast_precision.cache_clear()
    try:
        chosen = hardware.fast_precision("cpu")
        assert chosen.precision == "fp32" and "avx2" in chosen.reason
        monkeypatch.setattr(hardware, "_cpuinfo", lambda: "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n")
        hardware.cpu_flags.cache_clear(), hardware.fast_precision.cache_clear()
        assert hardware.fast_precision("cpu") == hardware.FastPrecision("bf16", "CPU has amx_bf16")
        monkeypatch.setattr(hardware, "_cpuinfo", lambda: "")  # no flags to read: the probe decides
        monkeypatch.setattr(hardware, "_probe_cpu_bf16", lambda: False)
        hardware.cpu_flags.cache_clear(), hardware.fast_precision.cache_clear()
        assert hardware.fast_precision("cpu").precision == "fp32"
    finally:
        hardware.cpu_flags.cache_clear(), hardware.fast_precision.cache_clear()


def test_precision_auto_is_the_default_and_said_and_a_flag_forces(tmp_path):
    fast = hardware.resolve_precision("auto")
    plan = train.make_plan(build_parser(["train"]).parse_args(["train"]))
    assert plan.precision == fast.precision and plan.precision_said == f"{fast.precision} (auto: {fast.reason})"
    for forced in ("bf16", "fp32"):
        plan = train.make_plan(build_parser(["train"]).parse_args(["train", "--precision", forced]))
        assert plan.precision == forced and plan.config.precision == forced
    cfg = _config(tmp_path, {"bf16": {"enabled": "auto"}})
    plan = train.make_plan(build_parser(["train"]).parse_args(["train", "--config", cfg]))
    assert plan.precision == fast.precision and plan.config.precision == fast.precision
    assert InfinityConfig.from_deepspeed({"bf16": {"enabled": "auto"}}).precision == fast.precision


# --------------------------------------------------------------------------- section 3


@pytest.mark.parametrize("body, message", [
    ({"gradient_accumulation_steps": "8"}, "gradient_accumulation_steps must be an integer, got '8'"),
    ({"train_micro_batch_size_per_gpu": "2"}, "train_micro_batch_size_per_gpu"),
    ({"train_batch_size": "16"}, "train_batch_size"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}}, "optimizer.params.lr must be a number"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": float("inf")}}}, "optimizer.params.eps"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "buffer_count": 1}}},
     "offload_optimizer.buffer_count must be at least 2"),
])
def test_config_values_that_went_wrong(no_work, capsys, tmp_path, body, message):
    assert message in _fails(capsys, "--config", _config(tmp_path, body))


def test_auto_in_a_deepspeed_config_is_filled_from_the_run(tmp_path):
    """Hugging Face's Trainer's "auto": the run's own value, not a TypeError (what cannot be filled is named by
    infinity.config.auto)."""
    cfg = _config(tmp_path, {"gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto",
                             "bf16": {"enabled": "auto"}})
    plan = train.make_plan(build_parser(["train"]).parse_args(["train", "--config", cfg, "--micro-batch", "4"]))
    assert (plan.grad_accum, plan.micro_batch) == (1, 4)
    assert plan.precision == hardware.resolve_precision("auto").precision


def test_auto_bucket_sizes_are_filled_from_a_presets_width(tmp_path, capsys):
    """The ZeRO bucket keys of Hugging Face's DeepSpeed configs are "auto"; `infinity train --preset` and
    `infinity estimate --preset` fill them from the preset's d_model by the Trainer's formulas, as they do for
    --hf-model (they were refused, the message saying `infinity train` fills them)."""
    cfg = _config(tmp_path, {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                   "stage3_prefetch_bucket_size": "auto",
                                                   "stage3_param_persistence_threshold": "auto"}})
    hidden = 128  # preset tiny's d_model (infinity/models/gpt.py PRESETS)
    plan = train.make_plan(build_parser(["train"]).parse_args(["train", "--preset", "tiny", "--config", cfg]))
    assert plan.config.zero.prefetch_bucket_size == int(0.9 * hidden * hidden)
    assert plan.config.zero.param_persistence_threshold == 10 * hidden
    assert main(["estimate", "--preset", "tiny", "--config", cfg, "--json"]) == 0
    setting = json.loads(capsys.readouterr().out)["estimate"]["setting"]
    assert setting["prefetch_bucket_size"] == int(0.9 * hidden * hidden)
    assert setting["param_persistence_threshold"] == 10 * hidden


def test_a_model_file_with_a_syntax_error_names_its_line(no_work, capsys, tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("def build_model():\n    return (\n")
    err = _fails(capsys, "--model", str(f))
    assert "broken.py" in err and "syntax error at line" in err


def test_a_model_config_json_bounds_seq_len_by_its_positions(no_work, capsys, tmp_path):
    """--model CONFIG.json of a model with learned positions (GPT-2's n_positions 64): the default --seq-len was 256
    and the first forward raised IndexError; its context is the bound, as --hf-model's, and a longer --seq-len is
    refused naming the file, before any work."""
    transformers = pytest.importorskip("transformers")
    f = tmp_path / "gpt2.json"
    transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=4, bos_token_id=0,
                            eos_token_id=0).to_json_file(f)
    plan = train.make_plan(build_parser(["train"]).parse_args(["train", "--model", str(f)]))
    assert plan.seq_len == 64
    err = _fails(capsys, "--model", str(f), "--seq-len", "65")
    assert "--seq-len 65" in err and "gpt2.json" in err and "(64)" in err


def test_trace_into_a_missing_folder_is_refused_before_work(no_work, capsys, tmp_path):
    err = _fails(capsys, "--trace", str(tmp_path / "nowhere" / "t.json"))
    assert "--trace" in err and "nowhere" in err


@pytest.mark.parametrize("argv, message", [
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--max-bytes", "-1"], "--max-bytes must be positive"),
])
def test_flags_that_went_wrong(no_work, capsys, argv, message):
    assert message in _fails(capsys, *argv)


def test_nvme_path_with_a_config_that_offloads_nothing(no_work, capsys, tmp_path):
    none = {"zero_optimization": {"offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}}}
    err = _fails(capsys, "--config", _config(tmp_path, none), "--nvme-path", str(tmp_path / "swap"))
    assert "--nvme-path" in err and "nothing goes to NVMe" in err and "as --config sets" in err


def test_a_binary_corpus_file_is_refused(no_work, capsys, tmp_path):
    corpus = tmp_path / "weights.bin"
    corpus.write_bytes(bytes(range(256)) * 100)
    err = _fails(capsys, "--preset", "tiny", "--data", str(corpus), "--offload-param", "cpu", "--offload-optimizer", "cpu")
    assert "weights.bin" in err and "not text" in err


def test_estimate_of_an_absurd_count_is_refused(capsys):
    assert "--params" in _fails(capsys, "--params", "1e30", command="estimate")


def test_verbose_after_the_command_is_accepted():
    assert build_parser(["train", "-v"]).parse_args(["train", "-v"]).verbose == 1
    assert build_parser(["-v", "train"]).parse_args(["-v", "train"]).verbose == 1
    assert build_parser(["train"]).parse_args(["train"]).verbose == 0


@pytest.mark.device_independent  # what the log says
def test_not_applicable_keys_are_said_at_the_default_level(tmp_path):
    """Said once on stdout, without -v (a subprocess: the real log level and output)."""
    cfg = _config(tmp_path, {"tensorboard": {"enabled": False}, "zero_optimization": {"overlap_comm": True}})
    run = subprocess.run([sys.executable, "-m", "infinity.cli", "train", "--config", cfg, "--preset", "tiny",
                          "--steps", "1", "--seq-len", "16", "--micro-batch", "1", "--max-bytes", "100000"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if "not used here" in line]
    assert len(lines) == 1 and "tensorboard" in lines[0] and "zero_optimization.overlap_comm" in lines[0]



# --------------------------------------------------------------------------- swap location


def test_a_tmpfs_tmp_falls_back_to_a_disk_that_takes_o_direct(monkeypatch, tmp_path):
    from infinity.commands import train_checks

    disk = tmp_path / "disk"
    real = train_checks.direct_io_problem
    monkeypatch.setattr(train_checks, "direct_io_problem",
                        lambda p: "it is on tmpfs" if str(p) == tempfile.gettempdir() else real(p))
    monkeypatch.setattr(train_checks, "_fallback_parents", lambda: [str(disk)])
    monkeypatch.setattr(train, "default_swap_location", train_checks.default_swap_location)
    plan = train.make_plan(build_parser(["train"]).parse_args(["train"]))
    assert plan.swap.parent == str(disk) and not plan.swap.buffered and "tmpfs" in plan.swap.note
    assert not plan.config.aio.buffered_fallback
    # nowhere takes O_DIRECT: buffered I/O, said, and the engine is told
    monkeypatch.setattr(train_checks, "direct_io_problem", lambda p: "it is on tmpfs")
    plan = train.make_plan(build_parser(["train"]).parse_args(["train"]))
    assert plan.swap.buffered and plan.swap.note.startswith("WARNING") and plan.config.aio.buffered_fallback


def test_a_tmpfs_nvme_path_names_the_flag_and_the_flag_is_honoured(no_work, capsys, monkeypatch):
    from infinity.commands import train_checks
    from infinity.config.sections import AioConfig

    monkeypatch.setattr(train_checks, "direct_io_problem", lambda p: "it is on tmpfs")
    err = _fails(capsys, "--nvme-path", str(no_work / "swap"))
    assert "does not take direct I/O" in err and "--buffered-io" in err and "aio.buffered_fallback" in err
    plan = train.make_plan(build_parser(["train"]).parse_args(["train", "--nvme-path", str(no_work / "swap"),
                                                                "--buffered-io"]))
    assert plan.config.aio == AioConfig(buffered_fallback=True)
    assert "--buffered-io" in capsys.readouterr().err  # said
    assert InfinityConfig.from_deepspeed({"aio": {"buffered_fallback": True}}).aio == AioConfig(buffered_fallback=True)
