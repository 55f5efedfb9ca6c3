"""LoRA through peft on an offloaded base: plain peft training is the reference."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import infinity  # noqa: E402
from infinity.hf import Trainer  # noqa: E402
from test_hf_trainer import collate, dataset, logged, nvme_config, tiny_llama, training_args  # noqa: E402

LR = 3e-3


def lora(model=None):
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(model if model is not None else tiny_llama(), config)


def engine_losses(engine, batches) -> list[float]:
    """The engine's loss of each batch, one optimizer step each."""
    losses = []
    for batch in batches:
        out = engine(**batch)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return losses


def plain_peft_losses(model, batches) -> list[float]:
    """Plain peft's: ``torch.optim.AdamW`` over the trainable parameters, one step a batch."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def trained_adapters(stock, ours, tmp_path) -> tuple[dict, dict]:
    """Both Trainers trained and their adapters saved; the logged losses compared; (ours, the stock's) files."""
    stock.train()
    stock.save_model(tmp_path / "stock-adapter")
    ours.train()
    ours.save_model(tmp_path / "adapter")
    ours.engine.close()
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(stock)), rtol=1e-5, atol=0)
    return (load_file(tmp_path / "adapter" / "adapter_model.safetensors"),
            load_file(tmp_path / "stock-adapter" / "adapter_model.safetensors"))


def test_engine_trains_only_the_adapters_and_matches_plain_peft(tmp_path):
    """The frozen base rests on NVMe with no gradient, master or moments; the adapters train as peft's own."""
    reference, model = lora(), lora()
    model.load_state_dict(reference.state_dict())  # the adapters start equal (lora_A is random)
    batches = [collate(dataset(2, seed=s)) for s in range(6)]
    ref_losses = plain_peft_losses(reference, batches)

    config = nvme_config(tmp_path / "swap")
    config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with infinity.initialize(model, config) as engine:
        assert engine.compute.tier == "nvme"
        trainable = [s for s in engine.layout.slots if s.trainable]
        assert sum(s.numel for s in trainable) == adapters  # the base has no master or moments
        frozen = [s for s in engine.layout.slots if not s.trainable]
        assert frozen and all(".lora_" not in s.name for s in frozen)
        losses = engine_losses(engine, batches)
        state = engine.full_state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
        if "lora_" not in name:
            assert torch.equal(state[name], value), name  # the base did not move


@pytest.mark.parametrize("setting", [{}, {"activation_checkpointing": True}], ids=["kept", "recomputed"])
def test_trainer_with_lora_matches_the_stock_trainer_and_saves_adapters_only(tmp_path, setting):
    """With the activations kept, and recomputed in backward (LoRA's usual companion), as the stock Trainer."""
    data = dataset()
    stock = transformers.Trainer(model=lora(), args=training_args(tmp_path / "stock", save_strategy="no", **setting),
                                 train_dataset=data, data_collator=collate)
    ours = Trainer(model=lora(), args=training_args(tmp_path / "ours", save_strategy="no", **setting),
                   train_dataset=data, data_collator=collate, infinity_config=nvme_config(tmp_path / "swap"))
    files, expected = trained_adapters(stock, ours, tmp_path)
    assert set(files) == set(expected) and all("lora_" in k for k in files)  # adapters only, peft's names
    for name, value in files.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter")
    batch = collate(dataset(4, seed=9))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, stock.model(**batch).logits, rtol=1e-4, atol=1e-5)


def test_trainer_checkpoints_of_a_lora_model_hold_its_adapters_as_the_stock_trainers_do(tmp_path):
    """`checkpoint-N/` holds the adapters the stock Trainer's holds at that step, which PeftModel.from_pretrained
    loads (the engine's own shards, without the base, beside them)."""
    data = dataset()
    stock = transformers.Trainer(model=lora(), args=training_args(tmp_path / "stock", max_steps=4, save_steps=2),
                                 train_dataset=data, data_collator=collate)
    ours = Trainer(model=lora(), args=training_args(tmp_path / "ours", max_steps=4, save_steps=2), train_dataset=data,
                   data_collator=collate, infinity_config=nvme_config(tmp_path / "swap"))
    stock.train()
    ours.train()
    ours.engine.close()
    checkpoint = sorted((tmp_path / "ours").glob("checkpoint-*"))[-1]
    files = load_file(checkpoint / "adapter_model.safetensors")
    expected = load_file(tmp_path / "stock" / checkpoint.name / "adapter_model.safetensors")
    assert set(files) == set(expected) and files
    for name, value in files.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(), checkpoint)
    assert sum(p.numel() for n, p in reloaded.named_parameters() if "lora_" in n) == sum(v.numel() for v in files.values())


def test_a_stock_trainers_lora_checkpoint_with_its_optimizer_state_resumes_as_the_stock_trainer_resumes_it(tmp_path):
    """The stock Trainer's checkpoint-2 of a peft model (adapter_model.safetensors, optimizer.pt over the adapters
    alone): ours goes on from it with the adapters, moments and schedule, and steps 3-4 log the losses and end with
    the adapters of the stock Trainer resumed from it."""
    args = dict(max_steps=4, save_steps=2, save_total_limit=None, weight_decay=0.1)
    first = transformers.Trainer(model=lora(), args=training_args(tmp_path / "stock", **args), train_dataset=dataset(),
                                 data_collator=collate)
    first.train()
    checkpoint = tmp_path / "stock" / "checkpoint-2"
    assert {"adapter_model.safetensors", "optimizer.pt"} <= set(os.listdir(checkpoint))
    stock = transformers.Trainer(model=lora(), args=training_args(tmp_path / "stock-resumed", **args),
                                 train_dataset=dataset(), data_collator=collate)
    stock.train(resume_from_checkpoint=str(checkpoint))
    ours = Trainer(model=lora(), args=training_args(tmp_path / "ours", **args, save_strategy="no"),
                   train_dataset=dataset(), data_collator=collate, infinity_config=nvme_config(tmp_path / "swap"))
    ours.train(resume_from_checkpoint=str(checkpoint))
    assert ours.state.global_step == 4 and len(logged(ours)) == 4
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(stock)), rtol=1e-5, atol=0)
    ours.save_model(tmp_path / "ours-adapter")
    ours.engine.close()
    stock.save_model(tmp_path / "stock-adapter")
    files = load_file(tmp_path / "ours-adapter" / "adapter_model.safetensors")
    expected = load_file(tmp_path / "stock-adapter" / "adapter_model.safetensors")
    assert set(files) == set(expected) and files
    for name, value in files.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=name)


def meta_lora(folder, **lora_options):
    """``get_peft_model`` over a model built on the meta device from ``folder``'s config: no weights in memory."""
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    options = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    options.update(lora_options)
    return peft.get_peft_model(base, peft.LoraConfig(**options))


def test_lora_over_a_base_streamed_from_its_folder_trains_as_plain_peft_over_the_loaded_model(tmp_path):
    """The base is read from its files into the shards (never whole in memory); the new adapters start as peft
    starts them (lora_B zero, so the model is its base; lora_A Kaiming-uniform), then train as plain peft's."""
    folder = tmp_path / "base"
    tiny_llama().save_pretrained(folder)
    model = meta_lora(folder)
    torch.manual_seed(3)
    config = nvme_config(tmp_path / "swap")
    config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}
    batches = [collate(dataset(2, seed=s)) for s in range(6)]
    with infinity.initialize(model, config, weights=folder) as engine:
        initial = engine.full_state_dict()
        losses = engine_losses(engine, batches)
        state = engine.full_state_dict()

    reference = lora(transformers.AutoModelForCausalLM.from_pretrained(folder))
    stored = reference.state_dict()
    assert set(initial) == set(stored)
    for name, value in initial.items():
        if "lora_B" in name:
            assert torch.equal(value, torch.zeros_like(value)), name
        elif "lora_A" in name:
            bound = 1 / value.shape[1] ** 0.5  # kaiming_uniform_(a=sqrt(5)) over fan_in
            assert value.abs().max() <= bound and value.std() > bound / 3, name
        else:
            assert torch.equal(value, stored[name]), name  # the base, as transformers loads it
    reference.load_state_dict(initial)  # the same random lora_A
    ref_losses = plain_peft_losses(reference, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_adapters_over_a_streamed_base_are_drawn_from_the_seed(tmp_path):
    """Seeded alike, two runs start from the same adapters; gaussian and False initializations are peft's."""
    folder = tmp_path / "base"
    tiny_llama().save_pretrained(folder)
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
    states = {}
    for run, init in (("a", True), ("b", True), ("gaussian", "gaussian"), ("false", False)):
        model = meta_lora(folder, init_lora_weights=init)
        torch.manual_seed(11)
        with infinity.initialize(model, config, weights=folder) as engine:
            states[run] = {n: v for n, v in engine.full_state_dict().items() if "lora_" in n}
    assert states["a"].keys() == states["b"].keys() and len(states["a"]) == 8
    assert all(torch.equal(states["a"][n], states["b"][n]) for n in states["a"])
    for name, value in states["gaussian"].items():
        if "lora_A" in name:
            assert abs(value.std().item() - 1 / 8) < 0.03, name  # normal with std 1/r
        else:
            assert not value.any(), name
    assert all(value.any() and torch.isfinite(value).all() for value in states["false"].values())  # not zero-init


@pytest.mark.parametrize("options, named", [({"init_lora_weights": "orthogonal"}, "init_lora_weights='orthogonal'"),
                                            ({"use_dora": True}, "use_dora=True"),
                                            ({"trainable_token_indices": [3, 5]}, r"trainable_token_indices=\[3, 5\]")])
def test_an_adapter_initialized_from_the_base_weights_is_refused_before_any_file_is_read(tmp_path, options, named):
    tiny_llama().config.save_pretrained(tmp_path)  # the shapes only: no weights anywhere
    model = meta_lora(tmp_path, **options)
    with pytest.raises(ValueError, match=f"peft adapter 'default': {named}"):
        infinity.initialize(model, {"zero_optimization": {"stage": 3}}, weights=tmp_path / "no-such-folder")


def test_a_saved_copy_of_a_tied_head_over_a_streamed_base_starts_from_the_embeddings_and_trains_as_plain_peft(
        tmp_path):
    """modules_to_save=["lm_head"] on a model with tied embeddings: its files hold the tied tensor under the
    embeddings' name alone, and peft's copy of the head starts from it. Over a streamed base the copy is read from
    there (not refused as 'missing weights: lm_head.weight'), and trains as plain peft's over the loaded model."""
    config = tiny_llama().config
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    folder = tmp_path / "base"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    model = meta_lora(folder, modules_to_save=["lm_head"])
    reference = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", modules_to_save=["lm_head"]))
    head = "base_model.model.lm_head.modules_to_save.default.weight"
    batches = [collate(dataset(2, seed=s)) for s in range(3)]
    engine_config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                     "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
    with infinity.initialize(model, engine_config, weights=folder) as engine:
        initial = engine.full_state_dict()
        assert torch.equal(initial[head], reference.state_dict()[head])
        assert torch.equal(initial[head], initial["base_model.model.model.embed_tokens.weight"])
        reference.load_state_dict(initial)  # the same random lora_A
        losses = engine_losses(engine, batches)
        state = engine.full_state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_peft_losses(reference, batches)), rtol=1e-5,
                               atol=0)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.allclose(state[head], initial[head])  # the copy trained

def test_trainer_with_lora_over_a_base_built_on_meta_streams_it_and_matches_the_stock_trainer(tmp_path):
    """A LoRA script whose base is built under torch.device("meta"): the Trainer streams the base from the folder
    the config came from, and trains as the stock Trainer over the loaded base from the same adapters."""
    folder = tmp_path / "base"
    tiny_llama().save_pretrained(folder)
    data = dataset()
    ours = Trainer(model=meta_lora(folder), args=training_args(tmp_path / "ours", save_strategy="no"),
                   train_dataset=data, data_collator=collate, infinity_config=nvme_config(tmp_path / "swap"))
    initial = ours.engine.full_state_dict()
    stock_model = lora(transformers.AutoModelForCausalLM.from_pretrained(folder))
    stock_model.load_state_dict(initial)
    stock = transformers.Trainer(model=stock_model, args=training_args(tmp_path / "stock", save_strategy="no"),
                                 train_dataset=data, data_collator=collate)
    files, expected = trained_adapters(stock, ours, tmp_path)
    assert set(files) == set(expected)
    for name, value in files.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)


def test_train_cli_with_lora_rank_trains_as_plain_peft_and_saves_what_peft_loads(tmp_path, capsys, monkeypatch):
    """`infinity train --hf-model DIR --lora-rank 4`: the base streamed and frozen, the adapters trained as plain
    peft with torch's AdamW trains them (the run's batches, learning rates, clipping and weight decay), and
    --save-pretrained writes them as peft does, with the tokenizer."""
    from infinity.cli import main
    from infinity.commands import train
    from infinity.models.transformers_lm import causal_lm_loss
    from test_hf_cli import _tiny_llama

    folder, out = tmp_path / "llama", tmp_path / "adapters"
    _tiny_llama(folder, 64, with_tokenizer=True)
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(f"w{(i * 7) % 60}" for i in range(3000)))
    batches, lrs, initial = [], [], {}
    initialize = train.initialize

    def initialize_and_watch(*args, **kwargs):
        engine = initialize(*args, **kwargs)
        initial.update(engine.full_state_dict())
        step = engine.step
        engine.step = lambda: (lrs.append(engine.lr), step())[1]
        return engine

    monkeypatch.setattr(train, "initialize", initialize_and_watch)
    monkeypatch.setattr(train, "causal_lm_loss", lambda e, ids, t: (batches.append(ids.clone()), causal_lm_loss(e, ids, t))[1])
    rc = main(["train", "--hf-model", str(folder), "--data", str(data), "--steps", "6", "--micro-batch", "2",
               "--seq-len", "32", "--precision", "fp32", "--lora-rank", "4", "--lora-target-modules", "q_proj,v_proj",
               "--lr", "3e-3", "--save-pretrained", str(out), "--run-dir", str(tmp_path / "run"), "--json"])
    printed = capsys.readouterr().out
    assert rc == 0
    summary = json.loads(printed.strip().splitlines()[-1])
    assert "LoRA rank 4, alpha 8, dropout 0 on q_proj, v_proj: 896 trainable parameters" in printed
    assert summary["trainable_params"] == 896 and "saved 8 adapter tensors" in printed

    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    reference = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           task_type="CAUSAL_LM"))
    reference.load_state_dict(initial)
    adapters = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(adapters, lr=lrs[0], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # train's defaults
    ref_losses = []
    for ids, lr in zip(batches, lrs):
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(adapters, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)

    files = load_file(out / "adapter_model.safetensors")
    assert len(files) == 8 and all("lora_" in name for name in files)
    reloaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(folder), out)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], value, rtol=0, atol=1e-6, msg=name)
    assert transformers.AutoTokenizer.from_pretrained(out)("w1 w2")["input_ids"] == [5, 6]


def test_estimate_with_lora_rank_counts_what_the_run_holds(tmp_path, capsys, monkeypatch):
    """`infinity estimate --hf-model DIR --lora-rank R` lays the frozen base out as train does: its tiers are the
    run's peaks, to the byte (with device memory apart, an upper bound on the host's)."""
    from infinity.cli import main
    from infinity.placement.placement import distinct_device_requested
    from test_hf_cli import _tiny_llama

    folder = tmp_path / "llama"
    _tiny_llama(folder, 64, with_tokenizer=True)
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(f"w{(i * 7) % 60}" for i in range(3000)))
    setting = ["--lora-rank", "4", "--offload-param", "nvme", "--offload-optimizer", "nvme", "--precision", "fp32",
               "--micro-batch", "2", "--nvme-path", str(tmp_path)]
    # as train counts it: device memory apart from host memory where a GPU is, or INFINITY_DISTINCT_DEVICE=1 says
    device = [] if torch.cuda.is_available() or distinct_device_requested() else ["--cpu"]
    assert main(["estimate", "--hf-model", str(folder), "--json", *device, *setting]) == 0
    estimate = json.loads(capsys.readouterr().out)["estimate"]
    assert estimate["setting"]["trainable_params"] == 896
    assert main(["train", "--hf-model", str(folder), "--data", str(data), "--steps", "2", "--seq-len", "32",
                 "--run-dir", str(tmp_path / "run"), "--json", *setting]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["estimate"] == estimate["accounted"]
    peaks = {tier: summary["tiers"][tier]["peak_nbytes"] for tier in ("host", "nvme")}
    planned = {tier: estimate["accounted"][tier] for tier in ("host", "nvme")}
    if device:  # one memory: nothing crosses, and the estimate is the run's peaks to the byte
        assert peaks == planned
    else:  # device memory apart: the estimate bounds the host's (it counts the buffers a crossing may take)
        assert peaks["nvme"] == planned["nvme"] and peaks["host"] <= planned["host"]


@pytest.mark.parametrize("argv, said", [
    (["--lora-alpha", "8"], "--lora-alpha needs --lora-rank"),
    (["--lora-rank", "0"], "--lora-rank must be positive"),
    (["--lora-rank", "4", "--lora-dropout", "1"], r"--lora-dropout must be in \[0, 1\)"),
    (["--lora-rank", "4", "--lora-target-modules", "nope"], "--lora-target-modules: Target modules {'nope'} not found"),
    (["--lora-rank", "4", "--merge-lora"], "--merge-lora needs --save-pretrained"),
    (["--merge-lora", "--save-pretrained", "out"], "--merge-lora needs --lora-rank"),
])
@pytest.mark.device_independent  # refused before any engine
def test_bad_lora_flags_are_refused_naming_the_flag(tmp_path, capsys, argv, said):
    from infinity.cli import main
    from test_hf_cli import _tiny_llama

    _tiny_llama(tmp_path / "llama", 64, with_tokenizer=True)
    assert main(["train", "--hf-model", str(tmp_path / "llama"), "--steps", "1", "--run-dir", str(tmp_path / "run"),
                 *argv]) == 2
    assert re.search(said, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_resume_of_a_lora_run_names_the_lora_flags_it_needs(tmp_path, capsys, monkeypatch):
    """--resume of a --lora-rank run without the flag (or with another rank) is refused before any work, naming
    --lora-rank with the checkpoint's rank, alpha and dropout."""
    from infinity.cli import main
    from infinity.commands import train
    from test_hf_cli import _tiny_llama

    _tiny_llama(tmp_path / "llama", 64, with_tokenizer=True)
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(f"w{(i * 7) % 60}" for i in range(3000)))
    argv = ["train", "--hf-model", str(tmp_path / "llama"), "--data", str(data), "--steps", "2", "--micro-batch", "2",
            "--seq-len", "32", "--precision", "fp32", "--lr", "1e-3", "--run-dir", str(tmp_path / "run"), "--overwrite"]
    assert main([*argv, "--lora-rank", "4", "--save-dir", str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    monkeypatch.setattr(train, "_build_model", lambda *a, **k: pytest.fail("work started before the refusal"))
    for lora, given in (([], "given no LoRA adapters"), (["--lora-rank", "8"], "given LoRA adapters of rank 8")):
        assert main([*argv, *lora, "--resume", str(tmp_path / "ck")]) == 2
        err = capsys.readouterr().err
        assert f"--lora-rank: the checkpoint's run has LoRA adapters of rank 4, alpha 8, dropout 0, {given}" in err
        assert "(give --lora-rank 4 --lora-alpha 8 --lora-dropout 0)" in err and "--lr" not in err


def test_lora_checkpoints_leave_the_base_out_and_resume_bitwise_only_beside_the_same_base(tmp_path, capsys):
    """`--lora-rank --save-dir`: a checkpoint holds the adapters and their states, not the frozen base; --resume
    rebuilds the base from --hf-model and continues the run bit for bit; another base is refused by name."""
    from infinity.cli import main
    from test_hf_cli import _tiny_llama

    folder, other = tmp_path / "llama", tmp_path / "llama-other"
    _tiny_llama(folder, 64, with_tokenizer=True)
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(f"w{(i * 7) % 60}" for i in range(3000)))

    def run(*argv, base=folder):
        code = main(["train", "--hf-model", str(base), "--data", str(data), "--steps", "4", "--micro-batch", "2",
                     "--seq-len", "32", "--precision", "fp32", "--lora-rank", "4", "--lr", "3e-3",
                     "--run-dir", str(tmp_path / "run"), "--overwrite", "--json", *argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, out, _ = run("--save-dir", str(tmp_path / "ckpt"), "--save-every", "2")
    assert code == 0
    straight = json.loads(out.strip().splitlines()[-1])["losses"]
    with safe_open(str(tmp_path / "ckpt" / "step2" / "shard-00000-of-00001.safetensors"), "pt") as f:
        saved = {key.split("/", 1)[1] for key in f.keys() if key.startswith("param/")}
    assert saved and all("lora_" in name for name in saved)  # no base tensor

    code, out, _ = run("--resume", str(tmp_path / "ckpt" / "step2"), "--save-dir", str(tmp_path / "ckpt2"))
    assert code == 0
    assert json.loads(out.strip().splitlines()[-1])["losses"] == straight

    shutil.copytree(folder, other)
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run("--resume", str(tmp_path / "ckpt" / "step2"), "--save-dir", str(tmp_path / "ckpt3"), base=other)
    assert code != 0 and "saved without its frozen parameters" in err and "not the ones it was saved beside" in err


def test_consolidate_hf_of_a_lora_checkpoint_writes_the_adapters_peft_wrote_at_that_step(tmp_path, capsys):
    """`infinity consolidate CKPT OUT --hf` of a `--lora-rank` run's checkpoint (no base in it): the adapters as the
    run's own `--save-pretrained` (peft's save_pretrained) wrote them at the same step, tensor for tensor; a single
    file of the whole model is refused, naming --hf."""
    from infinity.cli import main
    from test_hf_cli import _tiny_llama

    folder = tmp_path / "llama"
    _tiny_llama(folder, 64, with_tokenizer=True)
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(f"w{(i * 7) % 60}" for i in range(3000)))
    assert main(["train", "--hf-model", str(folder), "--data", str(data), "--steps", "4", "--micro-batch", "2",
                 "--seq-len", "32", "--precision", "fp32", "--lora-rank", "4", "--lora-target-modules", "all-linear",
                 "--run-dir", str(tmp_path / "run"), "--save-dir", str(tmp_path / "ckpt"), "--save-every", "4",
                 "--save-pretrained", str(tmp_path / "saved")]) == 0
    capsys.readouterr()

    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "whole.safetensors")]) == 2
    assert "infinity consolidate --hf" in capsys.readouterr().err
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "adapters"), "--hf"]) == 0
    assert "adapter tensors" in capsys.readouterr().out

    expected, written = load_file(tmp_path / "saved" / "adapter_model.safetensors"), \
        load_file(tmp_path / "adapters" / "adapter_model.safetensors")
    assert written.keys() == expected.keys() and len(expected) == 2 * 7 * 2  # A and B, 7 linears, 2 layers
    for name, value in expected.items():
        assert torch.equal(written[name], value), name

    def config(path):
        record = json.loads((path / "adapter_config.json").read_text())
        return record | {"target_modules": sorted(record["target_modules"])}  # a set: peft writes it in any order
    assert config(tmp_path / "adapters") == config(tmp_path / "saved")


def test_the_merged_model_is_what_peft_merge_and_unload_writes(tmp_path):
    """save_merged: the base with the trained adapters merged, under the base's names, as plain peft's
    merge_and_unload gives it from the same adapters; transformers loads it without peft."""
    from infinity.hf.merge import save_merged

    folder = tmp_path / "base"
    tiny_llama().save_pretrained(folder)
    config = nvme_config(tmp_path / "swap")
    config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}
    model = meta_lora(folder, lora_alpha=32)  # scaling 4: a merge that forgets it shows
    torch.manual_seed(5)
    with infinity.initialize(model, config, weights=folder) as engine:
        for s in range(3):
            out = engine(**collate(dataset(2, seed=s)))
            engine.backward(out.loss)
            engine.step()
        state = engine.full_state_dict()
        summary = save_merged(engine, model, tmp_path / "merged", dtype="fp32")
    assert summary["merged_layers"] == 4
    reference = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder),
                                    peft.LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                                    task_type="CAUSAL_LM"))
    reference.load_state_dict(state)
    expected = reference.merge_and_unload().state_dict()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    got = merged.state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)
    base = load_file(folder / "model.safetensors")
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(got["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"])


def test_a_merged_model_whose_saved_copy_was_tied_keeps_the_original_under_the_other_name_as_peft_does(tmp_path):
    """modules_to_save=["embed_tokens"] with tied embeddings: the head stays tied to the untrained original, so
    peft's merge_and_unload unties them (the trained copy as the embeddings, the original as lm_head.weight,
    tie_word_embeddings false). save_merged wrote the copy alone and kept the tie: the loaded model's head was the
    trained copy."""
    from infinity.hf.merge import save_merged
    from test_model_calls import config, plain_adamw, train_both
    tied = tiny_llama().config
    tied.tie_word_embeddings = True
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(tied), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj"], task_type="CAUSAL_LM", modules_to_save=["embed_tokens"]))
    reference = copy.deepcopy(model)
    with infinity.initialize(model, config(tmp_path / "swap", "cpu")) as engine:
        train_both(engine, reference, plain_adamw(reference), steps=2)
        save_merged(engine, model, tmp_path / "merged")
    reference.merge_and_unload().save_pretrained(tmp_path / "expected")
    merged, expected = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name)
                        for name in ("merged", "expected"))
    assert merged.config.tie_word_embeddings is False is expected.config.tie_word_embeddings
    assert not torch.equal(expected.lm_head.weight, expected.model.embed_tokens.weight)  # the copy trained
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    batch = collate(dataset(4, seed=9))
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, expected(**batch).logits, rtol=1e-5, atol=1e-5)

def test_save_merged_of_several_adapters_with_saved_copies_writes_the_active_ones_copy_as_peft(tmp_path):
    """Two adapters, each with its own modules_to_save copy of lm_head: peft's merge_and_unload keeps the active
    adapter's copy. save_merged refused the folder ('lm_head.weight' listed twice)."""
    from infinity.hf.merge import save_merged
    from test_model_calls import config, plain_adamw, train_both
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM",
                                                             modules_to_save=["lm_head"]))
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["v_proj"], task_type="CAUSAL_LM",
                                                modules_to_save=["lm_head"]))
    model.set_adapter("second")
    reference = copy.deepcopy(model)
    with infinity.initialize(model, config(tmp_path / "swap", "cpu")) as engine:
        train_both(engine, reference, plain_adamw(reference), steps=2)
        save_merged(engine, model, tmp_path / "merged")
    expected = reference.merge_and_unload().state_dict()
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(expected["lm_head.weight"], tiny_llama().lm_head.weight)  # the active copy trained

def test_save_merged_of_trainable_tokens_is_refused_by_name_before_anything_is_written(tmp_path):
    """trainable_token_indices trains rows of the embeddings, which peft's merge writes over them: save_merged wrote
    the delta and the base under peft's names (token_adapter...), which transformers does not load (it drew new
    embeddings). Refused, naming the option, with nothing written."""
    from infinity.hf.merge import save_merged
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=8, target_modules=["q_proj"], task_type="CAUSAL_LM",
                                                             trainable_token_indices=[3, 5]))
    with infinity.initialize(model, {"zero_optimization": {"stage": 3}}) as engine:
        with pytest.raises(ValueError, match=r"'base_model\.model\.model\.embed_tokens\.token_adapter' holds "
                                             r"peft's trainable_token_indices.*save the adapters instead"):
            save_merged(engine, model, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()

def test_train_cli_with_merge_lora_writes_a_plain_model_with_the_adapters_merged(tmp_path, capsys):
    """--merge-lora: --save-pretrained writes the base's tensors under its names, the wrapped layers changed by the
    adapters and no other, loadable by transformers alone, with the tokenizer."""
    from infinity.cli import main
    from test_hf_cli import _tiny_llama

    folder, out = tmp_path / "llama", tmp_path / "merged"
    _tiny_llama(folder, 64, with_tokenizer=True)
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(f"w{(i * 7) % 60}" for i in range(3000)))
    assert main(["train", "--hf-model", str(folder), "--data", str(data), "--steps", "3", "--micro-batch", "2",
                 "--seq-len", "32", "--precision", "fp32", "--lora-rank", "4", "--lr", "3e-3", "--merge-lora",
                 "--save-pretrained", str(out), "--save-dtype", "bf16", "--run-dir", str(tmp_path / "run")]) == 0
    assert "saved the base with 4 LoRA layer(s) merged" in capsys.readouterr().out
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert set(merged) == set(base) and all(v.dtype == torch.bfloat16 for v in merged.values())
    changed = {name for name, value in base.items() if not torch.equal(merged[name], value.to(torch.bfloat16))}
    assert changed == {f"model.layers.{i}.self_attn.{m}_proj.weight" for i in range(2) for m in "qv"}
    assert transformers.AutoTokenizer.from_pretrained(out)("w1 w2")["input_ids"] == [5, 6]


def test_estimate_gives_a_lora_checkpoint_size_with_and_without_the_base(tmp_path):
    """checkpoint_nbytes (states of the adapters only, compute shards of all) and checkpoint_frozen_nbytes (the base's
    compute shards) are the rank file's sizes with and without exclude_frozen_parameters, less header and RNG."""
    from infinity.checkpoint.files import shard_file
    from infinity.placement.estimate import estimate

    folder = tmp_path / "base"
    tiny_llama().save_pretrained(folder)
    model = meta_lora(folder)
    numels = [p.numel() for p in model.parameters()]
    trains = [p.requires_grad for p in model.parameters()]
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
              "precision": "fp32"}
    with infinity.initialize(model, config, weights=folder) as engine:
        sizes = {}
        for exclude in (False, True):
            tag = engine.save_checkpoint(tmp_path / f"ckpt-{exclude}", exclude_frozen_parameters=exclude)
            sizes[exclude] = (tmp_path / f"ckpt-{exclude}" / tag / shard_file(0, 1)).stat().st_size
    planned = estimate(param_numels=numels, param_trainable=trains, precision="fp32")
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert 0 <= sizes[False] - planned["checkpoint_nbytes"] <= buffers + (64 << 10), (sizes, planned)
    lean = planned["checkpoint_nbytes"] - planned["checkpoint_frozen_nbytes"]
    assert 0 <= sizes[True] - lean <= buffers + (64 << 10), (sizes, lean)
    assert abs(sizes[False] - sizes[True] - planned["checkpoint_frozen_nbytes"]) < 8 << 10  # (the headers differ)


def test_engine_save_pretrained_of_a_peft_model_writes_its_adapters_as_peft_does(tmp_path):
    """infinity.from_pretrained(folder, config, lora=LoraConfig(...)) streams the base under the adapters;
    engine.save_pretrained then writes what peft_model.save_pretrained writes (not the peft-named base), which
    PeftModel.from_pretrained loads onto the base."""
    folder = tmp_path / "base"
    tiny_llama().save_pretrained(folder)
    lora_config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    with infinity.from_pretrained(folder, nvme_config(tmp_path / "swap"), lora=lora_config) as engine:
        out = engine(**collate(dataset(2)))
        engine.backward(out.loss)
        engine.step()
        state = engine.full_state_dict()
        summary = engine.save_pretrained(tmp_path / "adapter")
    assert summary["adapters"] and summary["tensors"] == 8
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    reloaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(folder),
                                              tmp_path / "adapter")
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)


def test_peft_counts_the_trainable_parameters_of_a_partitioned_model_as_before(tmp_path):
    """Between passes a released parameter's numel() is 0; peft's counts (print_trainable_parameters) read
    ``ds_numel`` then, as under DeepSpeed."""
    model = lora()
    before = model.get_nb_trainable_parameters()
    with infinity.initialize(model, nvme_config(tmp_path / "swap")):
        assert all(p.numel() == 0 for p in model.parameters())
        assert model.get_nb_trainable_parameters() == before
    assert before[0] > 0


def test_the_best_adapters_of_a_model_only_run_are_loaded_at_the_end_as_the_stock_trainer_loads_them(tmp_path):
    """save_only_model=True with load_best_model_at_end, a LoRA model with modules_to_save: each checkpoint holds
    the adapters alone (adapter_model.safetensors), and both runs end holding the best one's (checkpoint-10, not the
    last step's): peft's own loader fills our trainable parameters, as the stock Trainer's does."""
    args = dict(max_steps=20, eval_strategy="steps", eval_steps=5, save_steps=5, save_total_limit=2,
                load_best_model_at_end=True, learning_rate=1e-1, save_only_model=True)
    runs = {}
    for name, cls, extra in (("stock", transformers.Trainer, {}),
                             ("ours", Trainer, {"infinity_config": {"zero_optimization": {"stage": 3}}})):
        model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM",
            modules_to_save=["lm_head"]))
        trainer = cls(model=model, args=training_args(tmp_path / name, **args), train_dataset=dataset(),
                      eval_dataset=dataset(8, seed=2), data_collator=collate, **extra)
        trainer.train()
        runs[name] = trainer
    stock, ours = runs["stock"], runs["ours"]
    assert "adapter_model.safetensors" in os.listdir(ours.state.best_model_checkpoint)
    assert os.path.basename(ours.state.best_model_checkpoint) == "checkpoint-10" == \
        os.path.basename(stock.state.best_model_checkpoint)
    evaluations = [h["eval_loss"] for h in stock.state.log_history if "eval_loss" in h]
    assert evaluations[-1] > evaluations[1]  # the last step is not the best
    assert ours.evaluate()["eval_loss"] == pytest.approx(stock.evaluate()["eval_loss"], rel=1e-5)
    state = ours.engine.full_state_dict()
    for name, value in stock.model.state_dict().items():  # lr 1e-1 amplifies float differences: 1e-4
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-4, msg=name)
    ours.engine.close()


def two_adapters():
    """peft's "default" adapter and a "second", active: it alone is trainable."""
    model = lora()
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj"], lora_dropout=0.0,
                                                task_type="CAUSAL_LM"))
    model.set_adapter("second")
    return model

def test_of_several_adapters_the_active_one_trains_and_a_change_of_adapters_after_initialize_is_refused(tmp_path):
    """Two adapters, the second active (set_adapter before initialize): it alone trains, as plain peft's. After
    initialize, peft's set_adapter (which flips requires_grad) and add_adapter (parameters never partitioned) would
    train another set than the script asks, silently: the next training forward is refused naming the parameter,
    before any work, and a forward without grad under disable_adapter() (which clears requires_grad) still runs."""
    from test_model_calls import config, plain_adamw, train_both
    model = two_adapters()
    reference = copy.deepcopy(model)
    batch = collate(dataset(2, seed=5))
    with infinity.initialize(model, config(tmp_path / "swap", "cpu")) as engine:
        train_both(engine, reference, plain_adamw(reference), steps=2)
        state = engine.full_state_dict()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert all(torch.equal(state[n], v) for n, v in lora().state_dict().items() if ".default." in n)  # unmoved
        with torch.no_grad(), model.disable_adapter(), reference.disable_adapter():
            torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, rtol=1e-5, atol=1e-6)
        model.set_adapter("default")
        with pytest.raises(ValueError, match=r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\."
                                             r"default\.weight' was frozen at infinity.initialize.*set_adapter"):
            engine(**batch)
        model.set_adapter("second")
        model.add_adapter("third", peft.LoraConfig(r=2, target_modules=["o_proj"], task_type="CAUSAL_LM"))
        with pytest.raises(ValueError, match=r"'base_model\.model\.model\.layers\.0\.self_attn\.o_proj\.lora_A\.third"
                                             r"\.weight' was added .* after infinity.initialize.*add_adapter"):
            engine(**batch)
        assert engine.global_step == 2 and not engine.backward_pending
        assert all(torch.equal(v, state[n]) for n, v in engine.full_state_dict().items() if n in state)


def test_engine_save_pretrained_of_several_adapters_writes_each_as_peft_does(tmp_path):
    """peft's save_pretrained writes every adapter (the second in its own folder), the frozen ones too:
    engine.save_pretrained (and so the Trainer's save_model) wrote the frozen "default" with the active one's
    tensors. Each file equals plain peft's after the same training."""
    from test_model_calls import config, plain_adamw, train_both
    model = two_adapters()
    with torch.no_grad():  # "default" as if trained before: its lora_B not zero
        for name, param in model.named_parameters():
            if ".lora_B.default." in name:
                param.normal_()
    reference = copy.deepcopy(model)
    with infinity.initialize(model, config(tmp_path / "swap", "cpu")) as engine:
        train_both(engine, reference, plain_adamw(reference), steps=1)
        summary = engine.save_pretrained(tmp_path / "ours")
    reference.save_pretrained(tmp_path / "plain")
    assert summary["tensors"] == 12  # q, v of "default" and k of "second": A and B in each of 2 layers
    for file in ("adapter_model.safetensors", "second/adapter_model.safetensors"):
        ours, plain = load_file(tmp_path / "ours" / file), load_file(tmp_path / "plain" / file)
        assert set(ours) == set(plain), file
        for name, value in plain.items():
            torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=f"{file}: {name}")
