"""What a run changes or finds wrong is said before the work, naming the flag, file or tensor: a Hugging Face
export checked against its config, a corpus cut by --max-bytes, estimate agreeing with train to the byte, a
config file that sets no offload, --resume on a folder with no `latest`, a broken tokenizer, damaged weights,
progress and --version, bf16 asked for on a CPU without bf16 units."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest
import torch

from infinity.cli import build_parser, main
from infinity.commands import train
from infinity.runtime import hardware

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

pytestmark = [pytest.mark.usefixtures("fresh_cwd"), pytest.mark.timeout(300)]  # conftest.py: runs write under ./runs

TINY_RUN = ["--preset", "tiny", "--steps", "1", "--seq-len", "16", "--micro-batch", "1", "--max-bytes", "100000"]


def _plan(*argv):
    argv = ["train", *argv]
    return train.make_plan(build_parser(argv).parse_args(argv))


def _config(tmp_path: Path, body: dict, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(body))
    return str(path)


def _llama(folder: Path, *, hidden: int = 32, vocab: int = 64, tokenizer: bool = False) -> Path:
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    if tokenizer:  # a word-level tokenizer built here, saved the transformers way
        words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocab - 4)]
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                             bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return folder


def _fails(capsys, *argv) -> str:
    capsys.readouterr()  # (what came before: transformers' own progress bars)
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"infinity {argv[0]}: error: ") and len(err.strip().splitlines()) == 1, err
    return err


# --------------------------------------------------------------------------- consolidate --hf against the config


def test_consolidate_hf_checks_every_tensor_against_the_config_before_writing(tmp_path, capsys):
    model_dir = _llama(tmp_path / "llama", vocab=256)  # no tokenizer: trained on bytes
    data = tmp_path / "corpus.txt"
    data.write_text("abc def " * 2000)
    assert main(["train", "--hf-model", str(model_dir), "--data", str(data), "--steps", "1", "--seq-len", "16",
                 "--micro-batch", "1", "--precision", "fp32", "--offload-param", "cpu", "--offload-optimizer", "cpu",
                 "--save-dir", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    # the right config: written, and transformers loads every weight of it
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "ok"), "--hf", "--hf-config", str(model_dir)]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ok")
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert loaded.state_dict().keys() == reference.state_dict().keys()
    # another architecture's config (GPT-2): refused naming tensors, nothing written
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64).save_pretrained(gpt2)
    err = _fails(capsys, "consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--hf", "--hf-config", str(gpt2))
    assert "does not fit" in err and "model.layers.0" in err and "transformer.h.0" in err and "gpt2" in err
    assert not (tmp_path / "out").exists()
    # the same architecture with another width: the shapes named
    wide = tmp_path / "wide"
    transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(wide)
    err = _fails(capsys, "consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--hf", "--hf-config", str(wide))
    assert "shapes differ" in err and "model.embed_tokens.weight: [256, 32] here, [256, 64]" in err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- --max-bytes said


def test_a_corpus_cut_by_max_bytes_is_said_on_the_start_line(tmp_path, capsys):
    corpus = tmp_path / "big.txt"
    corpus.write_text("hello world\n" * 20_000)  # 240,000 bytes
    assert main(["train", *TINY_RUN, "--data", str(corpus), "--offload-param", "cpu",
                 "--offload-optimizer", "cpu"]) == 0
    start = capsys.readouterr().out.splitlines()[0]
    assert "WARNING" in start and "--max-bytes 100,000" in start and "240,000" in start
    folder = tmp_path / "folder"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text("x" * 60_000)
    from infinity.train.data import read_corpus_bytes

    data, said = read_corpus_bytes(folder, max_bytes=100_000)
    assert len(data) == 100_000 and "of its 180,000 bytes by --max-bytes 100,000" in said
    _, said = read_corpus_bytes(folder, max_bytes=180_000)
    assert "WARNING" not in said  # all of it read: nothing to say


# --------------------------------------------------------------------------- estimate == train, to the byte


def _estimate(capsys, *argv) -> dict:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["estimate"]


def _train_tiers(capsys, *argv) -> dict:
    assert main(["train", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tiers"]


def test_estimate_says_the_nvme_bytes_train_reserves(tmp_path, capsys):
    """The NVMe peak of a real run (the engine's tiers: what it reserved, the undo extents of a speculative step
    under clipping included) equals estimate's figure for the same settings; with a DeepSpeed config too. Two
    steps: the first writes only the masters to their first extents (the moments start at zero), the second
    every state."""
    same = ["--preset", "tiny", "--micro-batch", "1", "--seq-len", "16", "--precision", "fp32"]
    ran = _train_tiers(capsys, *same, "--steps", "2", "--max-bytes", "100000")
    said = _estimate(capsys, *same, "--cpu")
    assert said["tiers"]["nvme"]["step_undo"] > 0
    assert said["accounted"]["nvme"] == ran["nvme"]["peak_nbytes"] > 0
    assert said["accounted"]["host"] == ran["host"]["peak_nbytes"]
    cfg = _config(tmp_path, {"gradient_clipping": 0.5, "bf16": {"enabled": False},
                             "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                   "offload_optimizer": {"device": "nvme"}, "sub_group_size": 20000}})
    same = ["--preset", "tiny", "--config", cfg, "--micro-batch", "1", "--seq-len", "16"]
    ran = _train_tiers(capsys, *same, "--steps", "2", "--max-bytes", "100000")
    said = _estimate(capsys, *same, "--cpu")
    assert (said["setting"]["offload_param"], said["setting"]["precision"]) == ("cpu", "fp32")  # the file's
    assert said["accounted"]["nvme"] == ran["nvme"]["peak_nbytes"] > 0


@pytest.mark.parametrize("argv", [
    ["--preset", "tiny"],
    ["--preset", "125m", "--offload-optimizer", "cpu", "--grad-accum", "2"],
])
def test_estimate_with_trains_flags_describes_the_run_train_resolves(capsys, monkeypatch, argv):
    """The same flags, no --cpu: this machine as train finds it (a GPU or not), train's micro-batch (8) and sequence
    (the preset's context, at most 256): estimate's whole figure is train's."""
    import psutil

    memory = psutil.virtual_memory()  # (the default host budget is a share of what is available: held still)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)
    said = _estimate(capsys, *argv)
    plan = _plan(*argv)
    setting = said["setting"]
    assert (setting.pop("micro_batch"), setting.pop("seq_len")) == (plan.micro_batch, plan.seq_len)
    setting.pop("model")  # (estimate's own: the preset's shape)
    assert said == train.estimate_for(plan, train.get_preset(plan.preset))


def test_estimate_predicts_the_step_train_predicts_for_a_hugging_face_folder(tmp_path, capsys, monkeypatch):
    """Without --seq-len, a --hf-model's sequence is its context at most 256, as train takes it (it was 1024)."""
    from infinity.commands.train_step_time import predicted_step
    from infinity.hf.pretrained import build_meta_causal_lm
    from infinity.runtime.machine_figures import cache_path, save
    from test_step_time import figures

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    save(figures(device="cpu"), cache_path())
    model_dir = _llama(tmp_path / "llama")  # (a context of 64)
    argv = ["--hf-model", str(model_dir), "--precision", "fp32", "--offload-optimizer", "cpu"]
    assert main(["estimate", *argv, "--json"]) == 0
    said = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step_time"]
    plan = _plan(*argv)
    model = build_meta_causal_lm(model_dir)
    plan.estimate = train.estimate_for(plan, model)
    prediction, _ = predicted_step(plan, model)
    assert plan.seq_len == 64 and said["predicted_s"] == prediction.predicted_s > 0


def test_estimate_reads_a_hugging_face_folder_as_train_does(tmp_path, capsys):
    model_dir = _llama(tmp_path / "llama")
    plan = _plan("--hf-model", str(model_dir), "--precision", "fp32")
    from infinity.hf.pretrained import build_meta_causal_lm

    planned = train.estimate_for(plan, build_meta_causal_lm(model_dir))
    said = _estimate(capsys, "--hf-model", str(model_dir), "--precision", "fp32", "--cpu")
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert said["setting"]["num_params"] == sum(p.numel() for p in reference.parameters())
    assert said["accounted"]["nvme"] == planned["accounted"]["nvme"] > 0
    (tmp_path / "only-config").mkdir()  # the shapes need no weights
    (tmp_path / "only-config" / "config.json").write_text((model_dir / "config.json").read_text())
    assert _estimate(capsys, "--hf-model", str(tmp_path / "only-config"), "--precision", "fp32",
                     "--cpu")["accounted"] == said["accounted"]


# --------------------------------------------------------------------------- a config that sets no offload


def test_a_config_that_sets_no_offload_keeps_the_commands_defaults_and_says_so(tmp_path):
    plan = _plan("--config", _config(tmp_path, {"train_micro_batch_size_per_gpu": 2}))
    assert (plan.micro_batch, plan.offload_param, plan.offload_optimizer) == (2, "nvme", "nvme")
    assert "--offload-param" in plan.offload_note and "--offload-optimizer" in plan.offload_note
    plan = _plan("--config", _config(tmp_path, {"zero_optimization": {"offload_param": {"device": "cpu"}}}, "one.json"))
    assert (plan.offload_param, plan.offload_optimizer) == ("cpu", "nvme")
    assert "--offload-optimizer" in plan.offload_note and "--offload-param" not in plan.offload_note
    # what the file sets is the file's; what a flag gives is the flag's; then nothing to say
    explicit = _config(tmp_path, {"zero_optimization": {"offload_param": {"device": "none"},
                                                        "offload_optimizer": {"device": "cpu"}}}, "explicit.json")
    plan = _plan("--config", explicit)
    assert (plan.offload_param, plan.offload_optimizer, plan.offload_note) == ("none", "cpu", "")
    plan = _plan("--config", _config(tmp_path, {}), "--offload-param", "cpu", "--offload-optimizer", "cpu")
    assert (plan.offload_param, plan.offload_optimizer, plan.offload_note) == ("cpu", "cpu", "")


# --------------------------------------------------------------------------- --resume with no `latest`


def test_resume_on_a_save_dir_with_no_latest_says_so(no_work, capsys):
    save_dir = no_work / "ckpt"
    (save_dir / "step3").mkdir(parents=True)
    (save_dir / "step3" / "meta.json").write_text("{}")
    err = _fails(capsys, "train", *TINY_RUN, "--save-dir", str(save_dir), "--resume")
    assert "no `latest`" in err and "step3" in err and f"--resume {save_dir / 'step3'}" in err
    assert "resume from them (--resume)" not in err


# --------------------------------------------------------------------------- a broken tokenizer, damaged weights


def test_a_broken_tokenizer_json_is_named(tmp_path, capsys):
    model_dir = _llama(tmp_path / "llama", tokenizer=True)
    (model_dir / "tokenizer.json").write_text("")
    err = _fails(capsys, "train", "--hf-model", str(model_dir), "--steps", "1", "--max-bytes", "100000")
    assert str(model_dir / "tokenizer.json") in err and "not JSON" in err


def test_nan_in_pretrained_weights_is_named_at_load(tmp_path):
    from safetensors.torch import load_file, save_file

    import infinity
    from infinity.weights.pretrained import WeightsError

    model_dir = _llama(tmp_path / "llama")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = {"device": "cpu", "precision": "fp32",
              "zero_optimization": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.* 1 NaN"):
        infinity.from_pretrained(model_dir, config)


@pytest.mark.parametrize("precision, says_fp32", [("fp32", False), ("bf16", True)])
def test_the_nan_advice_says_fp32_only_to_a_run_not_in_fp32(capsys, precision, says_fp32):
    from infinity.commands.train_checkpoints import stop_on_nonfinite

    closed = []
    engine = argparse.Namespace(close=lambda: closed.append(True))
    plan = argparse.Namespace(grad_accum=1, rank=0, precision=precision)
    assert stop_on_nonfinite(argparse.Namespace(save_dir=None), plan, engine, None, [], 4, 0, float("nan")) == 1
    err = capsys.readouterr().err
    assert "Lower --lr" in err and ("--precision fp32" in err) == says_fp32 and closed


# --------------------------------------------------------------------------- progress, --version


def test_version(capsys):
    import infinity

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"infinity {infinity.__version__}"


def test_consolidate_and_from_pretrained_show_progress_when_long(tmp_path, capsys, monkeypatch):
    import infinity
    from infinity.checkpoint import consolidation
    from infinity.engine import materialize

    model_dir = _llama(tmp_path / "llama")
    monkeypatch.setattr(materialize, "PROGRESS_AFTER_S", 0.0)  # "long" from the start
    engine = infinity.from_pretrained(model_dir, {"device": "cpu", "precision": "fp32"})
    try:
        engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    assert "loading weights" in capsys.readouterr().err
    monkeypatch.setattr(consolidation, "PROGRESS_AFTER_S", 0.0)
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors")]) == 0
    assert "consolidating" in capsys.readouterr().err
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--hf", "--hf-config",
                 str(model_dir)]) == 0
    assert "consolidating" in capsys.readouterr().err


# --------------------------------------------------------------------------- bf16 on a CPU without bf16 units


@pytest.fixture
def avx2_cpu(monkeypatch):
    """This box has bf16 units (AMX): a CPU without them, faked through /proc/cpuinfo's text."""
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: "model name\t: AMD EPYC 7B12\nflags\t\t: fpu sse avx avx2 fma\n")
    caches = (hardware.cpu_flags, hardware.fast_precision, hardware.cpu_name)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def test_bf16_on_a_cpu_without_bf16_units_takes_its_matmuls_in_fp32_or_is_warned_naming_the_cpu(avx2_cpu, tmp_path,
                                                                                                  caplog):
    import infinity

    # by default (cpu_matmul_precision "auto") the matmuls run in fp32 there: said on the start line, no warning
    plan = _plan("--config", _config(tmp_path, {"bf16": {"enabled": True}}))
    assert plan.precision == "bf16" and plan.precision_said == "bf16, matmuls in fp32" and plan.precision_warning == ""
    # in torch's own kernels ("native") it is emulated: warned, naming the CPU and the settings that help
    native = {"bf16": {"enabled": True}, "cpu_matmul_precision": "native"}
    plan = _plan("--config", _config(tmp_path, native, "native.json"))
    assert plan.precision == "bf16"  # asked for: kept, and said
    assert "AMD EPYC 7B12" in plan.precision_warning and 'bf16.enabled: "auto"' in plan.precision_warning
    assert 'cpu_matmul_precision at "auto"' in plan.precision_warning
    assert "--precision auto" in _plan("--config", _config(tmp_path, {"cpu_matmul_precision": "native"}, "n.json"),
                                       "--precision", "bf16").precision_warning
    assert _plan("--config", _config(tmp_path, {"bf16": {"enabled": "auto"}}, "auto.json")).precision_warning == ""
    with caplog.at_level(logging.INFO, logger="infinity.engine.engine"):
        infinity.initialize(torch.nn.Linear(4, 4), {"device": "cpu", "bf16": {"enabled": True}}).close()
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r for r in caplog.records if "matmuls on the CPU are computed in fp32" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infinity.engine.engine"):
        engine = infinity.initialize(torch.nn.Linear(4, 4), {"device": "cpu", **native})
        engine.close()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "AMD EPYC 7B12" in r.getMessage()]
    assert len(warned) == 1 and 'bf16.enabled: "auto"' in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infinity.engine.engine"):
        infinity.initialize(torch.nn.Linear(4, 4), {"device": "cpu", "precision": "fp32"}).close()
    assert not [r for r in caplog.records if "bf16 units" in r.getMessage()]
