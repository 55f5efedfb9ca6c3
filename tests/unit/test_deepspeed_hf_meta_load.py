"""``from_pretrained`` under a ZeRO-3 config (as ``infinity deepspeed`` patches it): the model built on the meta device
and marked with its folder, its weights streamed by ``deepspeed.initialize`` to the values ``from_pretrained`` loads
whole; whatever it cannot honour loads the model whole, saying so."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import infinity.deepspeed as deepspeed  # noqa: E402
from infinity.deepspeed import hf_meta_load  # noqa: E402
from infinity.weights.pretrained import streamed_from  # noqa: E402
from unit.test_hf_trainer import tiny_llama  # noqa: E402

STOCK = transformers.PreTrainedModel.__dict__["from_pretrained"].__func__
from_pretrained = hf_meta_load.streaming_from_pretrained(STOCK)  # the patch, applied by hand: nothing global


@pytest.fixture
def zero3():
    reader = hf_meta_load.config_reader()({"zero_optimization": {"stage": 3}})  # kept alive, as a script keeps it
    assert hf_meta_load.zero3_load()
    yield reader
    hf_meta_load.register(hf_meta_load.config_reader()({}))  # no ZeRO-3 config for the tests after


def test_a_model_loaded_under_zero3_is_built_on_meta_and_initialize_streams_from_pretrained_values(tmp_path, zero3):
    tiny_llama().save_pretrained(tmp_path / "tiny")
    whole = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "tiny")
    model = from_pretrained(transformers.LlamaForCausalLM, str(tmp_path / "tiny"), use_cache=False)
    assert all(p.is_meta for p in model.parameters()) and not model.training
    assert streamed_from(model) == str(tmp_path / "tiny") and model.config.use_cache is False
    engine, _, _, _ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    with engine:
        state = engine.full_state_dict()
    for name, value in whole.state_dict().items():
        assert torch.equal(state[name], value), name


def test_what_the_meta_build_cannot_honour_loads_the_model_whole_saying_why(tmp_path, zero3, caplog):
    tiny_llama().save_pretrained(tmp_path / "bin")  # then as pytorch_model.bin alone: nothing to stream
    (tmp_path / "bin" / "model.safetensors").unlink()
    torch.save(tiny_llama().state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    tiny_llama().save_pretrained(tmp_path / "tiny")
    with caplog.at_level(logging.WARNING, logger=hf_meta_load.__name__):
        from_bin = from_pretrained(transformers.LlamaForCausalLM, str(tmp_path / "bin"))
        mapped = from_pretrained(transformers.LlamaForCausalLM, str(tmp_path / "tiny"), output_loading_info=True)
    assert not any(p.is_meta for p in from_bin.parameters()) and streamed_from(from_bin) is None
    assert isinstance(mapped, tuple) and not any(p.is_meta for p in mapped[0].parameters())
    said = caplog.text
    assert "holds no model.safetensors" in said and "output_loading_info=" in said


def test_without_a_live_zero3_config_from_pretrained_loads_whole(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "tiny")
    stage2 = hf_meta_load.config_reader()({"zero_optimization": {"stage": 2}})
    assert not hf_meta_load.zero3_load() and stage2.config["zero_optimization"]["stage"] == 2
    model = from_pretrained(transformers.LlamaForCausalLM, str(tmp_path / "tiny"))
    assert not any(p.is_meta for p in model.parameters()) and streamed_from(model) is None
    hf_meta_load.config_reader()({"zero_optimization": {"stage": 3}})  # not kept: gone at once, as under DeepSpeed
    assert not hf_meta_load.zero3_load()
    again = from_pretrained(transformers.LlamaForCausalLM, str(tmp_path / "tiny"))
    assert not any(p.is_meta for p in again.parameters())


def test_a_folder_whose_tensors_transformers_renames_while_loading_loads_the_model_whole_saying_why(tmp_path, zero3,
                                                                                                   caplog):
    """transformers 5 renames a Mixtral's ``block_sparse_moe`` and fuses its experts while loading: streaming by
    the model's own names would find none, so the model loads whole, as ``from_pretrained`` loads it."""
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                                        num_experts_per_tok=1, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "moe")
    whole = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "moe")
    with caplog.at_level(logging.WARNING, logger=hf_meta_load.__name__):
        model = from_pretrained(transformers.MixtralForCausalLM, str(tmp_path / "moe"))
    assert not any(p.is_meta for p in model.parameters()) and streamed_from(model) is None
    assert "loads the model whole: missing weights: parameter 'model.layers.0.mlp." in caplog.text  # renamed there
    state = model.state_dict()
    for name, value in whole.state_dict().items():
        assert torch.equal(state[name], value), name
