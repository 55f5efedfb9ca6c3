"""LoRA through peft on an offloaded base: plain peft training is the reference."""

from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402

import infinity  # noqa: E402
from infinity.hf import Trainer  # noqa: E402
from test_hf_trainer import collate, dataset, logged, nvme_config, tiny_llama, training_args  # noqa: E402

LR = 3e-3


def lora(model=None):
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(model if model is not None else tiny_llama(), config)


def test_engine_trains_only_the_adapters_and_matches_plain_peft(tmp_path):
    """The frozen base rests on NVMe with no gradient, master or moments; the adapters train as peft's own."""
    reference, model = lora(), lora()
    model.load_state_dict(reference.state_dict())  # the adapters start equal (lora_A is random)
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    batches = [collate(dataset(2, seed=s)) for s in range(6)]
    ref_losses = []
    for batch in batches:
        loss = reference(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())

    config = nvme_config(tmp_path / "swap")
    config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with infinity.initialize(model, config) as engine:
        assert engine.compute.tier == "nvme"
        trainable = [s for s in engine.layout.slots if s.trainable]
        assert sum(s.numel for s in trainable) == adapters  # the base has no master or moments
        frozen = [s for s in engine.layout.slots if not s.trainable]
        assert frozen and all(".lora_" not in s.name for s in frozen)
        losses = []
        for batch in batches:
            out = engine(**batch)
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.item())
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
    stock.train()
    stock.save_model(tmp_path / "stock-adapter")
    ours = Trainer(model=lora(), args=training_args(tmp_path / "ours", save_strategy="no", **setting),
                   train_dataset=data, data_collator=collate, infinity_config=nvme_config(tmp_path / "swap"))
    ours.train()
    ours.save_model(tmp_path / "adapter")
    ours.engine.close()
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(stock)), rtol=1e-5, atol=0)

    files = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    expected = load_file(tmp_path / "stock-adapter" / "adapter_model.safetensors")
    assert set(files) == set(expected) and all("lora_" in k for k in files)  # adapters only, peft's names
    for name, value in files.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter")
    batch = collate(dataset(4, seed=9))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, stock.model(**batch).logits, rtol=1e-4, atol=1e-5)
