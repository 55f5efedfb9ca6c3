"""peft's ``merge_and_unload()``, ``merge_adapter()`` and ``unmerge_adapter()`` on a partitioned model merge the trained
adapters as plain peft does, never a silent merge of empty tensors (at two ranks they are refused:
test_model_state_dict). Plain peft over the same training is the reference."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import infinity  # noqa: E402
from test_hf_trainer import collate, dataset, tiny_llama  # noqa: E402
from test_model_calls import all_released, config, plain_adamw, train_both  # noqa: E402
from test_model_state_dict import assert_state_close, lora_model  # noqa: E402


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_merge_and_unload_after_training_gives_plain_peft_merged_model(tmp_path, tier):
    """The merged model's state dict, its logits and what its ``save_pretrained`` writes equal plain peft's
    ``merge_and_unload()`` after the same training; the merge leaves nothing gathered."""
    model = lora_model()
    reference = copy.deepcopy(model)
    held_out = collate(dataset(4, seed=2))
    with infinity.initialize(model, config(tmp_path / "swap", tier)) as engine:
        train_both(engine, reference, plain_adamw(reference), steps=3)
        merged = model.merge_and_unload()
        expected = reference.merge_and_unload()
        assert type(merged) is type(expected)
        assert all_released(merged)
        assert_state_close(merged.state_dict(), expected.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(merged(**held_out).logits, expected(**held_out).logits, rtol=1e-4, atol=1e-5)
        merged.save_pretrained(tmp_path / "merged")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert_state_close(loaded.state_dict(), expected.state_dict())
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(expected.state_dict()[name], tiny_llama().state_dict()[name], atol=1e-4)  # merged


def test_merge_adapter_then_unmerge_computes_and_trains_on_as_plain_peft(tmp_path):
    """``merge_adapter()`` (peft's evaluation speed-up) then ``unmerge_adapter()``: merged, the model computes as
    plain peft's merged one; unmerged, the training goes on as plain peft's."""
    model = lora_model()
    reference = copy.deepcopy(model)
    held_out = collate(dataset(4, seed=2))
    with infinity.initialize(model, config(tmp_path / "swap", "nvme")) as engine:
        optimizer = plain_adamw(reference)
        train_both(engine, reference, optimizer, steps=2)
        model.merge_adapter()
        reference.merge_adapter()
        with torch.no_grad():
            torch.testing.assert_close(model(**held_out).logits, reference(**held_out).logits, rtol=1e-4, atol=1e-5)
        model.unmerge_adapter()
        reference.unmerge_adapter()
        train_both(engine, reference, optimizer, steps=2, first=2)
        assert_state_close(engine.full_state_dict(), reference.state_dict())
