"""The engine around a transformers model takes the model's own arguments and returns its own output."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import infinity  # noqa: E402
from test_hf_trainer import VOCAB, tiny_llama  # noqa: E402


def padded_batch():
    """Left-padded rows of different lengths: mask 0 and label -100 on the padding, and on a prompt."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    for row, length in enumerate((12, 7, 4)):
        ids[row, :12 - length] = 0
        mask[row, :12 - length] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :3] = -100  # a prompt without a loss
    return ids, mask, labels


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_forward_with_labels_and_mask_equals_the_models_own(tmp_path, offload):
    model = tiny_llama()
    reference = copy.deepcopy(model)
    ids, mask, labels = padded_batch()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 4096}
    if offload == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    with infinity.initialize(model, {"device": "cpu", "zero_optimization": zero}) as engine:
        with torch.no_grad():
            by_keyword = engine(input_ids=ids, attention_mask=mask, labels=labels)
            by_position = engine(ids, mask, labels=labels)  # attention_mask is the model's second positional
        trained = engine(input_ids=ids, attention_mask=mask, labels=labels)
        engine.backward(trained.loss)
        engine.step()
    assert type(by_keyword) is type(expected)
    for out in (by_keyword, by_position, trained):
        torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(out.logits, expected.logits, rtol=1e-6, atol=1e-6)
    # the mask matters: without it the real tokens attend to the padding
    with torch.no_grad():
        unmasked = reference(input_ids=ids, labels=labels).loss
    assert not torch.allclose(unmasked, expected.loss)


def test_the_byte_gpt_call_is_refused_with_what_to_pass():
    """engine(ids, targets) would take the targets as the attention mask and train on no labels."""
    ids = torch.randint(3, VOCAB, (2, 9))
    with infinity.initialize(tiny_llama(), {"zero_optimization": {"stage": 3}}) as engine:
        with pytest.raises(ValueError, match=r"attention_mask.*engine\(input_ids=ids, attention_mask=mask, labels=ids\)"):
            engine(ids[:, :-1], ids[:, 1:])
        out = engine(ids, labels=ids)  # still usable after the refusal
        assert out.loss.requires_grad and out.logits.shape == (2, 9, VOCAB)
        engine.backward(out.loss)
        engine.step()
