"""``model.state_dict()`` of a partitioned model: whole values (one rank) or a refusal naming the collective forms
(several ranks), never a state dict of empty tensors. Plain transformers and plain peft are the reference."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors import torch as safetensors_torch  # noqa: E402

import infinity  # noqa: E402
from infinity.engine.gathered import WholeParams  # noqa: E402
from helpers import engine_config, run_ranks, slow_step_tail  # noqa: E402
from test_hf_trainer import collate, dataset, tiny_llama  # noqa: E402
from test_model_calls import LR, all_released, config, plain_adamw, train_both  # noqa: E402


def assert_state_close(state, expected, atol=5e-5):
    assert set(state) == set(expected)
    for name, value in expected.items():
        assert state[name].shape == value.shape, name
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def test_the_models_own_state_dict_and_save_pretrained_hold_the_trained_weights(tmp_path):
    model = tiny_llama()
    reference = copy.deepcopy(model)
    with infinity.initialize(model, config(tmp_path / "swap", "nvme")) as engine:
        optimizer = plain_adamw(reference)
        train_both(engine, reference, optimizer, steps=3)
        assert all_released(model)
        assert_state_close(model.state_dict(), reference.state_dict())
        kept = model.state_dict(keep_vars=True)  # the parameters themselves, as they are between passes
        assert all(kept[name] is param for name, param in model.named_parameters())
        model.save_pretrained(tmp_path / "saved")
        torch.save(model.state_dict(), tmp_path / "state.pt")
        assert all_released(model)  # nothing stays gathered
        train_both(engine, reference, optimizer, steps=1, first=3)  # and the training goes on as the plain one
        assert_state_close(engine.full_state_dict(), reference.state_dict())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    saved = torch.load(tmp_path / "state.pt")
    assert_state_close(loaded.state_dict(), saved)
    assert not torch.equal(saved["model.layers.0.mlp.up_proj.weight"], reference.state_dict()[
        "model.layers.0.mlp.up_proj.weight"])  # saved before the last step


@pytest.mark.parametrize("options", [{}, {"modules_to_save": ["lm_head"], "bias": "all"}], ids=["lora", "and-more"])
def test_a_peft_models_save_pretrained_writes_its_trained_adapters_reading_only_them(tmp_path, monkeypatch, options):
    """peft's own save_pretrained writes what plain peft's does after the same training, and of the partitioned
    parameters reads whole only those it writes (not the frozen base)."""
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           task_type="CAUSAL_LM", **options)
    model = peft.get_peft_model(tiny_llama(), lora)
    reference = copy.deepcopy(model)
    read = []
    with infinity.initialize(model, config(tmp_path / "swap", "nvme")) as engine:
        train_both(engine, reference, plain_adamw(reference), steps=3)
        whole_read = WholeParams.read
        names = {id(param): name for name, param in model.named_parameters()}
        monkeypatch.setattr(WholeParams, "read", lambda self, param, *a: read.append(names[id(param)])
                            or whole_read(self, param, *a))
        model.save_pretrained(tmp_path / "ours")
    reference.save_pretrained(tmp_path / "plain")
    ours = safetensors_torch.load_file(tmp_path / "ours" / "adapter_model.safetensors")
    plain = safetensors_torch.load_file(tmp_path / "plain" / "adapter_model.safetensors")
    assert any(key.endswith("lora_B.weight") for key in plain)
    assert all(value.abs().sum() > 0 for key, value in plain.items() if "lora_B" in key)  # trained
    assert_state_close(ours, plain)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert read and set(read) <= trainable, sorted(set(read) - trainable)


def lora_model():
    lora = peft.LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           task_type="CAUSAL_LM")  # scaling 4: a merge that forgets it shows
    return peft.get_peft_model(tiny_llama(), lora)


def _refusals_on_rank(rank, world_size, swap):
    torch.manual_seed(0)  # every rank's adapters alike
    model = lora_model()
    said = {}
    with infinity.initialize(model, config(f"{swap}/rank{rank}", "nvme")) as engine:
        for what, call in (("state_dict", model.state_dict), ("merge", model.merge_and_unload)):
            try:
                call()
            except RuntimeError as err:
                said[what] = str(err)
        full = engine.full_state_dict()  # the collective form works on every rank
    return said, {name: tuple(value.shape) for name, value in full.items()}


def test_at_two_ranks_the_models_state_dict_and_a_peft_merge_are_refused_naming_the_collective_forms(tmp_path):
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
    expected = {name: tuple(value.shape) for name, value in lora_model().state_dict().items()}
    for said, shapes in run_ranks(_refusals_on_rank, str(tmp_path)):
        assert "partitioned over 2 ranks" in said["state_dict"] and "engine.full_state_dict()" in said["state_dict"]
        assert "partitioned over 2 ranks" in said["merge"] and "save_merged" in said["merge"]
        assert shapes == expected


def test_a_tied_head_is_read_once_and_both_entries_are_one_tensor_as_in_a_plain_state_dict(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    expected = copy.deepcopy(model).state_dict()
    # what torch gives a tied head: both entries over one storage
    assert expected["lm_head.weight"].data_ptr() == expected["model.embed_tokens.weight"].data_ptr()
    with infinity.initialize(model, config(tmp_path, "nvme")):
        state = model.state_dict()
        assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
        assert_state_close(state, expected)
        model.save_pretrained(tmp_path / "saved")
    assert_state_close(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict(), expected)


def test_a_state_dict_taken_right_after_step_holds_the_updates_that_finish_behind_the_forward(tmp_path, monkeypatch):
    """With every parameter held whole between passes (on the device, one rank) and a step
    that clips (so all its updates are made behind the next forward, slowed here), ``model.state_dict()`` and the
    script's own ``model.save_pretrained`` right after ``engine.step()`` hold that step's updates, as plain
    PyTorch's model does after ``optimizer.step()``. (Found by ``trainer.model.state_dict()`` after
    ``Trainer.train()`` on a tiny tied Llama, one step behind the stock Trainer's.)"""
    seen = slow_step_tail(monkeypatch)
    model = tiny_llama()
    reference = copy.deepcopy(model)
    settings = engine_config(param="none", optimizer="none", nvme_path=None, accum=1, clip=0.01, lr=LR,
                             weight_decay=0.0)
    optimizer = plain_adamw(reference)
    with infinity.initialize(model, settings) as engine:
        for first in range(2):
            batch = collate(dataset(40)[2 * first:2 * first + 2])
            engine.backward(engine(**batch).loss)
            engine.step()
            reference(**batch).loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
            optimizer.step()
            optimizer.zero_grad()
            assert not all_released(model)  # held whole: the state dict reads the parameters themselves
            assert_state_close(model.state_dict(), reference.state_dict())
        model.save_pretrained(tmp_path / "saved")
    assert seen["tail_updates"] > 0  # the updates were behind the forward when the state dict was taken
    assert_state_close(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict(),
                       reference.state_dict())
