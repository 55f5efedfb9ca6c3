"""from_pretrained and save_pretrained over two gloo ranks: each rank reads its slices, rank 0 writes."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _two_ranks(rank, world_size, model_dir, out_dir):
    import infinity

    engine = infinity.from_pretrained(model_dir, {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
                              "stage3_param_persistence_threshold": 0, "sub_group_size": 4096}})
    try:
        loaded = engine.full_state_dict()
        shard_numels = {s.slot.name: s.slot.shard_numel for s in engine.params}
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            ids = torch.randint(0, 80, (2, 16), generator=g)[rank:rank + 1]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        engine.save_pretrained(out_dir, max_shard_nbytes=40_000)
        trained = engine.full_state_dict()
    finally:
        engine.close()
    return {"loaded": loaded, "trained": trained, "shard_numels": shard_numels}


def test_two_ranks_load_their_slices_and_save_one_folder(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model", max_shard_size="30KB")
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()

    ranks = run_ranks(_two_ranks, str(tmp_path / "model"), str(tmp_path / "out"))
    name = "model.embed_tokens.weight"
    assert ranks[0]["shard_numels"][name] == 80 * 32 // 2  # each rank holds half
    for r in ranks:
        for key, value in expected.items():
            assert torch.equal(r["loaded"][key], value), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for key, value in reloaded.items():
        assert torch.equal(value, ranks[0]["trained"][key]), key
        assert not torch.equal(value, expected[key]) or "norm" in key  # trained


def _lora_model(model_dir):
    import peft

    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     task_type="CAUSAL_LM"))


def _two_ranks_lora(rank, world_size, model_dir, ckpt_dir):
    import infinity

    torch.manual_seed(100 + rank)  # the ranks' own generators differ: the adapters must not
    engine = infinity.initialize(_lora_model(model_dir), {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}},
        weights=model_dir)
    try:
        initial = engine.full_state_dict()
        ids = torch.randint(0, 80, (1, 16), generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.save_checkpoint(ckpt_dir, exclude_frozen_parameters=True)
    finally:
        engine.close()
    return {name: value for name, value in initial.items() if "lora_" in name}


def test_two_ranks_stream_a_lora_base_draw_the_same_adapters_and_save_without_the_base(tmp_path):
    """Over two ranks a peft model's base streams from its folder and every rank starts from the same adapters
    (lora_B zero); their checkpoint without the base loads at two ranks only, so one rank is refused by name."""
    pytest.importorskip("peft")
    import infinity
    from infinity.checkpoint.safetensors_io import CheckpointError

    cfg = transformers.LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    ranks = run_ranks(_two_ranks_lora, str(tmp_path / "model"), str(tmp_path / "ckpt"))
    assert len(ranks[0]) == 8 and ranks[0].keys() == ranks[1].keys()
    for name, value in ranks[0].items():
        assert torch.equal(value, ranks[1][name]), name
        assert ("lora_B" in name) == (not value.any()), name

    with infinity.initialize(_lora_model(tmp_path / "model"), {"zero_optimization": {"stage": 3}},
                             weights=tmp_path / "model") as engine:
        with pytest.raises(CheckpointError, match=r"saved without its frozen parameters .* by 2 rank\(s\)"):
            engine.load_checkpoint(tmp_path / "ckpt")
