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
