"""A script written for ``accelerate launch`` with a DeepSpeed config, run by ``infinity accelerate launch`` without
a character changed, trains under the engine as stock accelerate trains it without DeepSpeed, and resumes from
``accelerator.save_state`` to the same bits."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
safetensors_torch = pytest.importorskip("safetensors.torch")

from unit.test_deepspeed_hf_scripts import SCRIPT as TRAINER_SCRIPT  # noqa: E402
from unit.test_deepspeed_hf_scripts import LENGTH, VOCAB, collate_rows, deepspeed_warmup_decay, from_log  # noqa: E402
from unit.test_deepspeed_hf_scripts import ROWS as TRAINER_ROWS  # noqa: E402
from unit.test_deepspeed_hf_scripts import rows as trainer_rows  # noqa: E402
from unit.test_hf_trainer import logged, tiny_llama, training_args  # noqa: E402

from infinity import cli  # noqa: E402
from infinity.commands import deepspeed as deepspeed_command  # noqa: E402

pytestmark = pytest.mark.device_independent  # processes started and scripts run: the distinct pass leaves it out

LR, ROWS, SAVE_AT = 3e-3, 30, 8  # 15 micro-batches at accumulation 2: the last step has one
SCRIPT = textwrap.dedent("""
    # accelerate's documented loop: nothing here knows of infinity (or of DeepSpeed, but for --dummy)
    import argparse, json, torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

    parser = argparse.ArgumentParser()
    parser.add_argument("model"); parser.add_argument("out")
    parser.add_argument("--save_at", type=int); parser.add_argument("--resume")
    parser.add_argument("--dummy", action="store_true"); parser.add_argument("--lora", action="store_true")
    args = parser.parse_args()
    accelerator = Accelerator()
    set_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    built_on_meta = next(model.parameters()).is_meta
    if args.lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(3, 96, ({rows}, 12), generator=torch.Generator().manual_seed(1))
    rows = [{{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r}} for r in ids]
    loader = DataLoader(rows, batch_size=2, shuffle=False)
    if args.dummy:  # the config's optimizer and scheduler blocks (accelerate offers these where DeepSpeed is)
        from accelerate.utils import DummyOptim, DummyScheduler
        optimizer = DummyOptim(model.parameters(), lr={lr}, weight_decay=0.01)
        scheduler = DummyScheduler(optimizer, total_num_steps=8, warmup_num_steps=2)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr={lr}, weight_decay=0.01)
        scheduler = get_linear_schedule_with_warmup(optimizer, 2, 8)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    start = 0
    if args.resume:
        accelerator.load_state(args.resume)
        start = args.save_at
    losses, rates = [], []
    model.train()
    for step, batch in enumerate(accelerator.skip_first_batches(loader, start), start=start):
        with accelerator.accumulate(model):
            rates.append(float(scheduler.get_last_lr()[0]))  # the rate this micro-batch's step runs with
            out = model(**batch)
            accelerator.backward(out.loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(out.loss.item())
        if step + 1 == args.save_at and not args.resume:
            accelerator.save_state(args.out + "/state")
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(args.out + "/final", is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        with open(args.out + "/run.json", "w") as f:
            plugin = accelerator.state.deepspeed_plugin
            zero = plugin.deepspeed_config.get("zero_optimization", {{}}) if plugin else {{}}
            json.dump({{"losses": losses, "rates": rates, "type": accelerator.distributed_type.value,
                       "engine": type(model).__module__, "meta": built_on_meta,
                       "nvme_paths": [zero.get(part, {{}}).get("nvme_path") for part in
                                      ("offload_param", "offload_optimizer")]}}, f)
""")
YAML = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 1.0
  offload_optimizer_device: nvme
  offload_optimizer_nvme_path: {swap}
  offload_param_device: nvme
  offload_param_nvme_path: {swap}
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
mixed_precision: 'no'
num_machines: 1
num_processes: 1
use_cpu: false
"""


@pytest.fixture
def folder(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "tiny")
    (tmp_path / "train.py").write_text(SCRIPT.format(rows=ROWS, lr=LR))
    (tmp_path / "swap").mkdir()
    return tmp_path


def launch(folder, launch_args: list[str], out: str, *script_args: str) -> dict:
    """``infinity accelerate launch ARGS train.py`` on the CPU (GPU box or not); the script's run.json."""
    done = subprocess.run([sys.executable, "-m", "infinity.cli", "accelerate", "launch", *launch_args,
                           str(folder / "train.py"), str(folder / "tiny"), str(folder / out), *script_args],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                          cwd=folder)  # where a relative path would land
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((folder / out / "run.json").read_text())


def weights(folder, out: str, file: str = "model.safetensors") -> dict:
    return safetensors_torch.load_file(folder / out / "final" / file)


def stock_run(folder, out: str, *script_args: str) -> dict:
    """The script under stock accelerate, no DeepSpeed, at the same accumulation."""
    done = subprocess.run([sys.executable, str(folder / "train.py"), str(folder / "tiny"), str(folder / out),
                           *script_args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2", "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((folder / out / "run.json").read_text())


def test_an_unchanged_accelerate_script_with_a_deepspeed_yaml_trains_as_stock_accelerate_and_resumes_bitwise(folder):
    (folder / "ds.yaml").write_text(YAML.format(swap=folder / "swap"))
    run = launch(folder, ["--config_file", str(folder / "ds.yaml")], "ours", "--save_at", str(SAVE_AT))
    assert run["type"] == "DEEPSPEED" and run["engine"] == "infinity.deepspeed.engine"
    assert run["meta"] is True  # zero3_init_flag: from_pretrained built on meta, the engine streamed the weights
    # the yaml's NVMe paths reach the script (accelerate's launcher alone passes "none": a folder of that name here)
    assert run["nvme_paths"] == [str(folder / "swap")] * 2 and not (folder / "none").exists()
    resumed = launch(folder, ["--config_file", str(folder / "ds.yaml")], "resumed", "--save_at", str(SAVE_AT),
                     "--resume", str(folder / "ours" / "state"))

    stock = stock_run(folder, "stock")
    assert stock["type"] == "NO" and len(run["losses"]) == len(stock["losses"]) == ROWS // 2
    assert run["rates"] == pytest.approx(stock["rates"], rel=1e-12) and max(stock["rates"]) == LR
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(stock["losses"]), rtol=1e-5, atol=0)
    ours, reference = weights(folder, "ours"), weights(folder, "stock")
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6, msg=name)

    # accelerator.load_state: the run goes on with the same rates, losses and weights, to the bit
    assert resumed["rates"] == run["rates"][SAVE_AT:] and resumed["losses"] == run["losses"][SAVE_AT:]
    for name, value in weights(folder, "resumed").items():
        assert torch.equal(value, ours[name]), name


def test_a_lora_run_over_a_base_built_on_meta_trains_its_adapters_as_stock_accelerate(folder):
    """peft draws the adapters from the script's random stream before they follow the base to the meta device; the
    engine starts from those values, so the run is stock accelerate's over the base loaded whole."""
    (folder / "ds.yaml").write_text(YAML.format(swap=folder / "swap"))
    run = launch(folder, ["--config_file", str(folder / "ds.yaml")], "ours", "--lora")
    stock = stock_run(folder, "stock", "--lora")
    assert run["meta"] is True and stock["meta"] is False
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(stock["losses"]), rtol=1e-5, atol=0)
    ours, reference = (weights(folder, out, "adapter_model.safetensors") for out in ("ours", "stock"))
    assert ours.keys() == reference.keys() and any("lora_A" in name for name in ours)
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6, msg=name)


def test_the_json_configs_optimizer_and_scheduler_blocks_take_accelerates_dummy_optimizer_and_scheduler(folder):
    (folder / "ds.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto",
                                                          "warmup_type": "linear"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                              "stage3_gather_16bit_weights_on_model_save": True}}))
    run = launch(folder, ["--use_deepspeed", "--deepspeed_config_file", str(folder / "ds.json"), "--num_processes",
                          "1"], "ours", "--dummy")
    assert run["engine"] == "infinity.deepspeed.engine" and run["meta"] is True  # a ZeRO-3 JSON: zero.Init by default
    expected = [deepspeed_warmup_decay(i // 2, peak=LR, warmup=2, total=8) for i in range(ROWS // 2)]
    assert run["rates"] == pytest.approx(expected, rel=1e-12, abs=0) and max(expected) == LR
    assert all(loss == loss for loss in run["losses"])


def test_a_trainer_script_launched_with_the_yaml_and_no_deepspeed_argument_trains_under_the_engine_as_stock(folder):
    """``accelerate launch --config_file ds.yaml train.py`` is how Hugging Face's examples run a Trainer under
    DeepSpeed without ``--deepspeed``: the yaml's DeepSpeed part is then the engine's config."""
    (folder / "ds.yaml").write_text(YAML.format(swap=folder / "swap"))
    script = folder / "trainer.py"
    script.write_text(TRAINER_SCRIPT.format(model=str(folder / "tiny"), vocab=VOCAB, length=LENGTH, rows=TRAINER_ROWS))
    out, steps = folder / "out", 6
    arguments = ["--output_dir", str(out), "--max_steps", str(steps), "--per_device_train_batch_size", "2",
                 "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--warmup_steps", "2",
                 "--max_grad_norm", "1.0", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
                 "--use_cpu", "--seed", "0", "--disable_tqdm", "true"]
    done = subprocess.run([sys.executable, "-m", "infinity.cli", "accelerate", "launch", "--config_file",
                           str(folder / "ds.yaml"), str(script), *arguments],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["trainer"] == "infinity.hf.trainer" and run["tiers"] == ["nvme", "nvme"]

    stock = transformers.Trainer(model=tiny_llama(), train_dataset=trainer_rows(), data_collator=collate_rows,
                                 args=training_args(folder / "stock", per_device_train_batch_size=2,
                                                    gradient_accumulation_steps=2, max_steps=steps,
                                                    save_strategy="no", learning_rate=3e-3, warmup_steps=2))
    stock.train()
    assert len(from_log(run["log"])) == steps == len(logged(stock))
    torch.testing.assert_close(torch.tensor(from_log(run["log"])), torch.tensor(logged(stock)), rtol=1e-5, atol=0)
    assert from_log(run["log"], "learning_rate") == pytest.approx(logged(stock, "learning_rate"), rel=1e-12)
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    for name, value in stock.model.state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("launch_args, said", [
    (["--cpu"], "does not use DeepSpeed"),
    (["--multi_gpu", "--num_processes", "2"], "does not use DeepSpeed"),
    (["--use_deepspeed", "--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1"],
     "num_machines 2"),
    (["--use_deepspeed", "--num_processes", "2"], "without a GPU"),
])
def test_a_config_the_engine_does_not_run_is_refused_before_any_process_starts(tmp_path, launch_args, said, capsys,
                                                                               monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('started')\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU's rules, GPU box or not
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    started = []
    monkeypatch.setattr(deepspeed_command, "run", lambda args: started.append(args) or 0)
    code = cli.main(["accelerate", "launch", *launch_args, str(script)])
    assert code == 2 and said in capsys.readouterr().err and not started


def test_a_deepspeed_config_reaches_the_launcher_with_accelerates_variables(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("")
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in [n for n in os.environ if n.startswith("ACCELERATE_")]:
        monkeypatch.delenv(name)
    started = []
    monkeypatch.setattr(deepspeed_command, "run", lambda args: started.append((args, dict(os.environ))) or 0)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what the command sets stays in this test
    code = cli.main(["accelerate", "launch", "--use_deepspeed", "--deepspeed_config_file", str(tmp_path / "ds.json"),
                     "--num_processes", "1", str(script), "--my_arg", "1"])
    (args, environment), = started
    assert code == 0 and args.script == str(script) and args.script_args == ["--my_arg", "1"]
    assert args.no_local_rank and args.num_gpus == 1  # accelerate's launcher passes no --local_rank
    launcher = argparse.ArgumentParser()
    deepspeed_command.add_arguments(launcher)
    defaults = vars(launcher.parse_args([str(script)]))  # every flag `infinity deepspeed` reads, the rest as these
    assert vars(args) == {**defaults, "num_gpus": 1, "no_local_rank": True, "script_args": ["--my_arg", "1"]}
    assert environment["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert environment["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(tmp_path / "ds.json")
