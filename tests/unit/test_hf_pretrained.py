"""from_pretrained / save_pretrained against transformers' own loading and plain PyTorch fine-tuning."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import infinity  # noqa: E402
from infinity.weights.pretrained import WeightsError  # noqa: E402
from infinity.checkpoint.safetensors_io import CheckpointError  # noqa: E402

VOCAB = 96
LR = 3e-3


def tiny_llama_config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_gpt2_config():
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                   bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random Llama saved by transformers, in several shards with an index."""
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(1)
    transformers.GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(path)
    return path


def config(tmp_path, *, offload="nvme"):
    (tmp_path / "swap").mkdir(exist_ok=True)
    block = lambda: {"device": offload, **({"nvme_path": str(tmp_path / "swap")} if offload == "nvme" else {})}  # noqa: E731
    param = block()
    if offload == "nvme":
        param["max_in_cpu"] = 0
    # on the CPU also where there is a GPU: compared with transformers' model trained on the CPU at 1e-5
    return {"device": "cpu",
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "offload_param": param, "offload_optimizer": block(),
                                  "stage3_param_persistence_threshold": 0, "sub_group_size": 5000}}


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randint(0, VOCAB, (2, 17), generator=g)


def plain_adamw(model, steps):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    losses = []
    for ids in batches(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("distinct_device", [False, True], ids=["cpu", "distinct-device"])
def test_round_trip_llama_on_nvme(llama_dir, tmp_path, monkeypatch, distinct_device):
    """With distinct_device, host and device memory are kept apart as on a GPU (the crossings run)."""
    from infinity.placement.placement import DISTINCT_DEVICE_ENV
    monkeypatch.setenv(DISTINCT_DEVICE_ENV, "1" if distinct_device else "0")
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    ref_losses, ref_model = plain_adamw(reference, 20)

    with infinity.from_pretrained(llama_dir, config(tmp_path)) as engine:
        assert engine.compute.tier == "nvme" and engine.optimizer.tier == "nvme"
        losses = []
        for ids in batches(20):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out = tmp_path / "tuned"
        summary = engine.save_pretrained(out, max_shard_nbytes=30_000)
        state = engine.full_state_dict()

    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert summary["files"] > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(reference.state_dict())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(reloaded) is transformers.LlamaForCausalLM
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, state[name]), name
        torch.testing.assert_close(value, ref_model.state_dict()[name], rtol=1e-5, atol=1e-6)


def test_loaded_values_equal_transformers_loading(llama_dir, tmp_path):
    expected = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).state_dict()
    with infinity.from_pretrained(llama_dir, config(tmp_path, offload="cpu")) as engine:
        state = engine.full_state_dict()
        ids = next(batches(1))
        device = engine.device  # the reference computes where the engine does, so the kernels are the same
        with torch.no_grad():
            logits = engine(input_ids=ids).logits
    assert set(state) == set(expected)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).to(device)(input_ids=ids.to(device)).logits
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-6)


def test_tied_gpt2_stays_tied_and_saves_loadable(gpt2_dir, tmp_path):
    expected = transformers.AutoModelForCausalLM.from_pretrained(gpt2_dir)
    with infinity.from_pretrained(gpt2_dir, config(tmp_path, offload="cpu")) as engine:
        inner = engine.module
        assert inner.lm_head.weight is inner.transformer.wte.weight
        assert len(engine.params) == len(list(expected.parameters()))
        for ids in batches(3):
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        engine.save_pretrained(tmp_path / "out", dtype="bf16")
        state = engine.full_state_dict()
    files = load_file(tmp_path / "out" / "model-00001-of-00001.safetensors")
    assert "lm_head.weight" not in files and all(v.dtype == torch.bfloat16 for v in files.values())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, state[name].to(torch.bfloat16).float()), name


def test_initialize_with_weights_and_bf16_file(gpt2_dir, tmp_path):
    """A model the user built (on meta) takes weights= ; a bf16 file is cast to the fp32 masters."""
    src = load_file(gpt2_dir / "model.safetensors")
    folder = tmp_path / "bf16"
    folder.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in src.items()}, folder / "model.safetensors", {"format": "pt"})
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    with infinity.initialize(model, config(tmp_path, offload="cpu"), weights=folder) as engine:
        state = engine.full_state_dict()
    for name, value in src.items():
        assert torch.equal(state[name], value.to(torch.bfloat16).float()), name


# -- bad input: errors that name the tensor or file ------------------------------------------------

def _one_file_copy(gpt2_dir, tmp_path, edit):
    tensors = load_file(gpt2_dir / "model.safetensors")
    edit(tensors)
    folder = tmp_path / "edited"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", {"format": "pt"})
    (folder / "config.json").write_text((gpt2_dir / "config.json").read_text())
    return folder


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("transformer.h.1.mlp.c_fc.weight"), r"missing weights: parameter 'transformer\.h\.1\.mlp\.c_fc\.weight'"),
    (lambda t: t.update({"transformer.h.9.extra": torch.zeros(3)}), r"unexpected weights .*'transformer\.h\.9\.extra'"),
    (lambda t: t.update({"transformer.ln_f.bias": torch.zeros(31)}), r"shape mismatch: tensor 'transformer\.ln_f\.bias'.*\[31\].*\[32\]"),
    (lambda t: t.update({"transformer.ln_f.bias": torch.zeros(32, dtype=torch.int32)}), r"dtype mismatch: tensor 'transformer\.ln_f\.bias'"),
])
def test_weights_that_do_not_fit_are_named(gpt2_dir, tmp_path, edit, message):
    folder = _one_file_copy(gpt2_dir, tmp_path, edit)
    with pytest.raises(WeightsError, match=message):
        infinity.from_pretrained(folder, config(tmp_path, offload="nvme"))
    assert os.listdir(tmp_path / "swap") == []  # refused before any state was written


def test_missing_and_corrupt_files_are_named(llama_dir, tmp_path):
    import shutil
    folder = tmp_path / "copy"
    shutil.copytree(llama_dir, folder)
    shards = sorted(folder.glob("model-*.safetensors"))
    with open(shards[0], "r+b") as f:  # truncated
        f.truncate(os.path.getsize(shards[0]) - 10)
    with pytest.raises(CheckpointError, match=f"{shards[0].name}.*truncated"):
        infinity.from_pretrained(folder, config(tmp_path, offload="cpu"))
    shards[0].unlink()
    with pytest.raises(FileNotFoundError, match=shards[0].name):
        infinity.from_pretrained(folder, config(tmp_path, offload="cpu"))
    for f in folder.glob("model*"):
        f.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin found"):
        infinity.from_pretrained(folder, config(tmp_path, offload="cpu"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        infinity.from_pretrained(tmp_path, config(tmp_path, offload="cpu"))
