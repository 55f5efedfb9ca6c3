"""A ``transformers.Trainer`` script with its own ``--deepspeed ds.json``, run by ``infinity deepspeed`` without a
character changed, trains under the engine as the stock Trainer trains it; a DeepSpeed ``scheduler`` block sets
the learning rates DeepSpeed's scheduler would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from infinity.hf import Trainer  # noqa: E402
from unit.test_hf_trainer import logged, tiny_llama, training_args  # noqa: E402

pytestmark = pytest.mark.device_independent  # processes started and scripts run: the distinct pass leaves it out

VOCAB, ROWS, LENGTH, STEPS = 96, 48, 12, 6

SCRIPT = textwrap.dedent("""
    # a stock Hugging Face script: nothing here knows of infinity
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_pretrained({model!r})
    built_on_meta = next(model.parameters()).is_meta  # as under DeepSpeed's zero.Init: never whole in a process
    g = torch.Generator().manual_seed(1)
    rows = [{{"input_ids": torch.randint(3, {vocab}, ({length},), generator=g).tolist()}} for _ in range({rows})]

    def collate(batch):
        ids = torch.tensor([r["input_ids"] for r in batch])
        return {{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}}

    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
    trainer.train()
    trainer.save_model(args.output_dir + "/final")
    if trainer.is_world_process_zero():
        engine = getattr(trainer, "engine", None)
        with open(args.output_dir + "/run.json", "w") as f:
            json.dump({{"trainer": type(trainer).__module__, "log": trainer.state.log_history,
                       "deepspeed": args.deepspeed, "world": args.world_size, "meta": built_on_meta,
                       "tiers": engine and [engine.compute.tier.value, engine.optimizer.tier.value]}}, f)
""")


def rows():
    """The script's rows: equal lengths, so two ranks' mean losses average to the whole batch's."""
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(3, VOCAB, (LENGTH,), generator=g).tolist()} for _ in range(ROWS)]


def test_an_unchanged_trainer_script_with_its_deepspeed_json_trains_at_two_ranks_as_the_stock_trainer(tmp_path):
    folder = tmp_path / "tiny"
    tiny_llama().save_pretrained(folder)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(model=str(folder), vocab=VOCAB, length=LENGTH, rows=ROWS))
    swap = tmp_path / "swap"
    swap.mkdir()
    ds_config = tmp_path / "ds_config.json"
    ds_config.write_text(json.dumps({  # as Hugging Face's examples write it: "auto" wherever the arguments decide
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
                              "offload_param": {"device": "nvme", "nvme_path": str(swap)},
                              "stage3_param_persistence_threshold": 0, "sub_group_size": 5000,
                              "stage3_gather_16bit_weights_on_model_save": True}}))
    out = tmp_path / "out"
    arguments = ["--output_dir", str(out), "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
                 "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--warmup_steps", "2",
                 "--max_grad_norm", "1.0", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
                 "--seed", "0", "--disable_tqdm", "true"]  # no --use_cpu: as the script is launched on a GPU box
    done = subprocess.run([sys.executable, "-m", "infinity.cli", "deepspeed", "--num_gpus", "2", str(script),
                           "--deepspeed", str(ds_config), *arguments],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # two processes on the CPU, GPU box or not
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["trainer"] == "infinity.hf.trainer" and run["tiers"] == ["nvme", "nvme"] and run["world"] == 2
    assert run["deepspeed"] is None  # kept as the engine's config: accelerate set no DeepSpeed up
    assert run["meta"] is True  # a ZeRO-3 JSON: from_pretrained built on meta, the engine streamed the weights

    # the reference: the stock Trainer in one process over both ranks' batches together
    stock = transformers.Trainer(model=tiny_llama(), train_dataset=rows(), data_collator=collate_rows,
                                 args=training_args(tmp_path / "stock", per_device_train_batch_size=4,
                                                    gradient_accumulation_steps=2, max_steps=STEPS, save_strategy="no",
                                                    learning_rate=3e-3, warmup_steps=2))
    stock.train()
    assert len(from_log(run["log"])) == STEPS == len(logged(stock))
    torch.testing.assert_close(torch.tensor(from_log(run["log"])), torch.tensor(logged(stock)), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(from_log(run["log"], "grad_norm")),
                               torch.tensor(logged(stock, "grad_norm")), rtol=1e-5, atol=0)
    assert from_log(run["log"], "learning_rate") == pytest.approx(logged(stock, "learning_rate"), rel=1e-12)
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    for name, value in stock.model.state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=1e-6, msg=name)


def from_log(history: list[dict], key: str = "loss") -> list:
    """What ``logged`` reads from a Trainer, from its ``log_history`` written out."""
    return [h[key] for h in history if key in h and "eval_loss" not in h and "train_loss" not in h]


def collate_rows(batch):
    ids = torch.tensor([r["input_ids"] for r in batch])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def deepspeed_warmup_decay(step: int, *, peak: float, warmup: int, total: int) -> float:
    """DeepSpeed's WarmupDecayLR with ``warmup_type`` linear and ``warmup_min_lr`` 0, written out: optimizer step
    ``step`` runs with the value at ``last_batch_iteration = step - 1`` (the engine steps the scheduler after the
    optimizer; before the first, the scheduler holds ``warmup_min_lr``)."""
    i = step - 1
    if i < 0:
        return 0.0
    warmup = max(2, warmup)
    if i < warmup:
        return peak * i / warmup
    return peak * max(0.0, (total - i) / (total - warmup))


def scheduler_config(swap, **params):
    config = {"device": "cpu",
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
                                    "sub_group_size": 5000},
              "scheduler": {"type": "WarmupDecayLR",
                            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                                       "total_num_steps": "auto", "warmup_type": "linear", **params}}}
    os.makedirs(swap, exist_ok=True)
    return config


def test_a_deepspeed_scheduler_block_sets_deepspeeds_learning_rates_and_the_run_is_the_stock_trainers_at_them(
        tmp_path):
    steps, warmup, peak = 10, 3, 3e-3
    expected = [deepspeed_warmup_decay(k, peak=peak, warmup=warmup, total=steps) for k in range(steps)]
    args = dict(max_steps=steps, warmup_steps=warmup, learning_rate=peak, save_strategy="no", weight_decay=0.0)
    data = rows()
    ours = Trainer(model=tiny_llama(), args=training_args(tmp_path / "ours", **args), train_dataset=data,
                   data_collator=collate_rows, infinity_config=scheduler_config(tmp_path / "swap"))
    ours.train()
    ours.engine.close()
    assert logged(ours, "learning_rate") == pytest.approx(expected, rel=1e-12, abs=0)  # each step's own rate

    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: deepspeed_warmup_decay(k, peak=peak, warmup=warmup, total=steps) / peak)
    stock = transformers.Trainer(model=model, args=training_args(tmp_path / "stock", **args), train_dataset=data,
                                 data_collator=collate_rows, optimizers=(optimizer, schedule))
    stock.train()
    assert logged(stock, "learning_rate") == pytest.approx(expected, rel=1e-12, abs=0)
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(stock)), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(logged(ours, "grad_norm")), torch.tensor(logged(stock, "grad_norm")),
                               rtol=1e-5, atol=0)


def test_a_scheduler_value_that_disagrees_with_the_arguments_is_refused_naming_it_before_any_step(tmp_path):
    trainer = Trainer(model=tiny_llama(), args=training_args(tmp_path / "out", max_steps=4, save_strategy="no"),
                      train_dataset=rows(), data_collator=collate_rows,
                      infinity_config=scheduler_config(tmp_path / "swap", total_num_steps=999))
    with pytest.raises(ValueError, match=r"scheduler\.params\.total_num_steps=999 but TrainingArguments say 4"):
        trainer.train()
    assert trainer.engine.global_step == 0
    trainer.engine.close()


@pytest.mark.parametrize("first", ["transformers", "infinity.hf"])
def test_the_patches_hold_whichever_trainer_the_script_imports_first(tmp_path, first):
    """A script may import ``infinity.hf.Trainer`` itself (which derives from transformers' while it loads), or
    only transformers'; either way ``transformers.Trainer``, ``transformers.trainer.Trainer`` and a subclass made
    after are the engine's, and a dict ``deepspeed`` becomes the arguments' ``infinity_config``."""
    probe = textwrap.dedent(f"""
        import json, sys
        from infinity.deepspeed import hf_scripts
        hf_scripts.install()
        if {first!r} == "infinity.hf":
            from infinity.hf import Trainer as ours
        import transformers
        from transformers import Trainer, TrainingArguments
        from transformers.trainer_seq2seq import Seq2SeqTrainer
        from infinity.hf import Trainer as ours
        args = TrainingArguments(output_dir={str(tmp_path)!r}, deepspeed={{"zero_optimization": {{"stage": 3}}}},
                                 use_cpu=True, report_to=[])
        print(json.dumps([Trainer is ours, transformers.Trainer is ours, transformers.trainer.Trainer is ours,
                          issubclass(Seq2SeqTrainer, ours), args.deepspeed, args.infinity_config,
                          getattr(args, "hf_deepspeed_config", None) is None]))
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, True, True, True, None,
                                                               {"zero_optimization": {"stage": 3}}, True]


LOOP_SCRIPT = textwrap.dedent("""
    # transformers' non-Trainer DeepSpeed integration, as its docs write it: nothing here knows of infinity
    import json, sys
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    ds_config = json.load(open({config!r}))
    dschf = HfDeepSpeedConfig(ds_config)  # keep this object alive
    model = AutoModelForCausalLM.from_pretrained({model!r})
    built_on_meta = next(model.parameters()).is_meta
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config_params=ds_config)
    losses = []
    for ids in torch.load({batches!r}):
        loss = engine(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = {{name: value.tolist() for name, value in engine.full_state_dict().items()}}
    json.dump({{"losses": losses, "stage": dschf.config["zero_optimization"]["stage"],
               "zero3_in_from_pretrained": is_deepspeed_zero3_enabled(), "meta": built_on_meta, "state": state}},
              open({out!r}, "w"))
""")


def test_a_script_with_its_own_loop_and_hf_deepspeed_config_trains_as_plain_pytorch(tmp_path):
    folder = tmp_path / "tiny"
    tiny_llama().save_pretrained(folder)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(3, VOCAB, (2, LENGTH), generator=g) for _ in range(4)]
    torch.save(batches, tmp_path / "batches.pt")
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}))
    script = tmp_path / "loop.py"
    out = tmp_path / "run.json"
    script.write_text(LOOP_SCRIPT.format(config=str(config), model=str(folder), batches=str(tmp_path / "batches.pt"),
                                         out=str(out)))
    done = subprocess.run([sys.executable, "-m", "infinity.cli", "deepspeed", str(script)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["stage"] == 3 and run["zero3_in_from_pretrained"] is False and run["meta"] is True

    model = tiny_llama()  # the weights the folder holds
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    expected = []
    for ids in batches:
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(torch.tensor(run["state"][name]), value, rtol=0, atol=1e-6, msg=name)
