"""TRL's SFTTrainer given the engine by ``InfinityTrainerMixin``: the stock SFTTrainer is the reference.

TRL and ``datasets`` are not among our dependencies: these tests run where they are installed (``pip install trl``)
and are skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
tokenizers = pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
from safetensors.torch import load_file  # noqa: E402

from infinity.hf import InfinityTrainerMixin  # noqa: E402
from test_hf_trainer import VOCAB, logged, nvme_config, tiny_llama  # noqa: E402


class InfinitySFTTrainer(InfinityTrainerMixin, trl.SFTTrainer):
    """What the README tells a TRL user to write."""


def word_tokenizer():
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")


def token_rows(n=40, seed=1):
    """Pre-tokenized rows of 4..12 tokens, as SFTTrainer takes them (an ``input_ids`` column)."""
    g = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_list([
        {"input_ids": torch.randint(3, VOCAB, (int(torch.randint(4, 13, (1,), generator=g)),), generator=g).tolist()}
        for _ in range(n)])


def sft_args(out):
    # fp32: SFTConfig's default bf16 is autocast for the stock run and bf16 compute for the engine's (DeepSpeed's)
    return trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=8, learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=2,
                         weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
                         use_cpu=True, seed=0, disable_tqdm=True, bf16=False)


def lora_config():
    return peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           task_type="CAUSAL_LM")


def test_sft_trainer_by_model_name_trains_as_the_stock_sft_trainer(tmp_path):
    """The model given by its folder's name (SFTTrainer loads it), parameters and states on NVMe."""
    tiny_llama().save_pretrained(tmp_path / "tiny")
    runs = {}
    for name, cls, extra in (("stock", trl.SFTTrainer, {}),
                             ("ours", InfinitySFTTrainer, {"infinity_config": nvme_config(tmp_path / "swap")})):
        trainer = cls(model=str(tmp_path / "tiny"), args=sft_args(tmp_path / name), train_dataset=token_rows(),
                      processing_class=word_tokenizer(), **extra)
        trainer.train()
        runs[name] = trainer
    stock, ours = runs["stock"], runs["ours"]
    assert len(logged(ours)) == 8
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(stock)), rtol=1e-5, atol=0)
    state = ours.engine.full_state_dict()
    for name, value in stock.model.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    ours.engine.close()


def test_sft_trainer_with_a_peft_config_trains_and_saves_the_adapters_as_the_stock_one(tmp_path):
    """SFTTrainer wraps the model in peft inside its __init__: the engine trains that peft model, and save_model
    writes its adapters, as the stock SFTTrainer's does."""
    runs = {}
    for name, cls, extra in (("stock", trl.SFTTrainer, {}),
                             ("ours", InfinitySFTTrainer, {"infinity_config": nvme_config(tmp_path / "swap")})):
        trainer = cls(model=tiny_llama(), args=sft_args(tmp_path / name), train_dataset=token_rows(),
                      processing_class=word_tokenizer(), peft_config=lora_config(), **extra)
        trainer.train()
        trainer.save_model(tmp_path / f"{name}-adapters")
        runs[name] = trainer
    torch.testing.assert_close(torch.tensor(logged(runs["ours"])), torch.tensor(logged(runs["stock"])), rtol=1e-5,
                               atol=0)
    ours = load_file(tmp_path / "ours-adapters" / "adapter_model.safetensors")
    stock = load_file(tmp_path / "stock-adapters" / "adapter_model.safetensors")
    assert set(ours) == set(stock) and any("lora_B" in name for name in stock)
    for name, value in stock.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    for whole in ("model.safetensors", "model.safetensors.index.json"):  # not the whole model (in one file or shards)
        assert not (tmp_path / "ours-adapters" / whole).exists()
    runs["ours"].engine.close()
