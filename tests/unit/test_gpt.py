"""GPT model: forward against a hand-built reference, exact sizes, meta build + reset_parameters, user models."""

import math

import pytest
import torch
import torch.nn.functional as F

from infinity.commands.train_estimate import model_decays
from infinity.models.gpt import (
    GPT,
    PRESETS,
    GPTConfig,
    count_params,
    get_preset,
    largest_module_params,
    load_model_file,
    param_numels,
    param_shapes,
)

TINY = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=12, vocab_size=256)


def _reference_logits(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """The same network written out op by op, with attention as an explicit masked softmax."""
    cfg = model.config
    b, t = ids.shape
    x = model.wte.weight[ids] + model.wpe.weight[:t]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    hd = cfg.d_model // cfg.n_head
    for blk in model.blocks:
        h = F.layer_norm(x, (cfg.d_model,), blk.ln1.weight, blk.ln1.bias)
        qkv = h @ blk.attn.qkv.weight.T + blk.attn.qkv.bias
        q, k, v = qkv.split(cfg.d_model, dim=-1)
        q, k, v = (z.view(b, t, cfg.n_head, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, cfg.d_model)
        x = x + y @ blk.attn.proj.weight.T + blk.attn.proj.bias
        h = F.layer_norm(x, (cfg.d_model,), blk.ln2.weight, blk.ln2.bias)
        a = h @ blk.mlp.fc.weight.T + blk.mlp.fc.bias
        a = 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))
        x = x + a @ blk.mlp.proj.weight.T + blk.mlp.proj.bias
    x = F.layer_norm(x, (cfg.d_model,), model.ln_f.weight, model.ln_f.bias)
    head = model.wte.weight if cfg.tie_embeddings else model.head.weight
    return x @ head.T


@pytest.mark.parametrize("tie", [True, False])
def test_forward_matches_hand_built_reference(tie):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=12, tie_embeddings=tie)
    model = GPT(cfg).double()
    with torch.no_grad():  # non-trivial LayerNorm affine and biases, so every parameter matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 256, (3, 10))
    targets = torch.randint(0, 256, (3, 10))
    logits = model(ids)
    ref = _reference_logits(model, ids)
    assert logits.shape == (3, 10, 256)
    torch.testing.assert_close(logits, ref, rtol=1e-9, atol=1e-9)
    loss = model(ids, targets)
    torch.testing.assert_close(loss, F.cross_entropy(ref.reshape(-1, 256), targets.reshape(-1)), rtol=1e-9, atol=1e-9)


def test_causal_logits_do_not_see_the_future():
    torch.manual_seed(0)
    model = GPT(TINY)
    ids = torch.randint(0, 256, (1, 8))
    changed = ids.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % 256
    torch.testing.assert_close(model(ids)[:, :5], model(changed)[:, :5])
    assert not torch.allclose(model(ids)[:, 5:], model(changed)[:, 5:])


def test_tied_head_shares_the_embedding():
    model = GPT(TINY)
    assert model.head is None
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and not any(n.startswith("head") for n in names)
    untied = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=12, tie_embeddings=False))
    assert untied.head.weight.shape == (256, 16)


def test_initial_loss_is_near_uniform_over_bytes():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, d_model=64, seq_len=32))
    ids = torch.randint(0, 256, (4, 32))
    targets = torch.randint(0, 256, (4, 32))
    with torch.no_grad():
        loss = model(ids, targets).item()
    assert abs(loss - math.log(256)) < 0.3


@pytest.mark.parametrize("name", list(PRESETS))
def test_count_params_is_exact_without_building(name):
    cfg = PRESETS[name]
    with torch.device("meta"):
        model = GPT(cfg)
    numels = [p.numel() for p in model.parameters()]
    assert numels == param_numels(cfg)
    assert sum(numels) == count_params(cfg)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert largest == largest_module_params(cfg)


def test_presets_span_ten_million_to_billions():
    sizes = {name: count_params(cfg) for name, cfg in PRESETS.items()}
    assert sizes["10m"] == pytest.approx(10e6, rel=0.15)
    assert sizes["125m"] == pytest.approx(125e6, rel=0.1)
    assert sizes["1.3b"] == pytest.approx(1.3e9, rel=0.1)
    assert sizes["6.7b"] == pytest.approx(6.7e9, rel=0.1)
    assert list(sizes.values()) == sorted(sizes.values())


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="unknown preset 'huge'.*tiny.*small.*6.7b"):
        get_preset("huge")


def test_meta_build_then_reset_parameters_module_by_module():
    """The engine's path: build on meta, then per module to_empty(recurse=False) + reset_parameters()."""
    cfg = GPTConfig(n_layer=3, n_head=2, d_model=32, seq_len=16)
    with torch.device("meta"):
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    torch.manual_seed(0)
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
            module.reset_parameters()
    for name, p in model.named_parameters():
        assert not p.is_meta and torch.isfinite(p).all(), name
    assert [p.numel() for p in model.parameters()] == param_numels(cfg)
    # GPT-2's init: embeddings and matrices N(0, 0.02), residual projections scaled down, biases 0, LN = (1, 0)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * 3), rel=0.1)
    assert torch.all(model.blocks[0].attn.qkv.bias == 0)
    assert torch.all(model.ln_f.weight == 1) and torch.all(model.ln_f.bias == 0)
    ids = torch.randint(0, 256, (2, 16))
    assert torch.isfinite(model(ids, ids))


def test_bf16_forward_and_backward():
    torch.manual_seed(0)
    model = GPT(TINY).to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 12))
    loss = model(ids, ids)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_sequence_longer_than_the_model_is_refused():
    with pytest.raises(ValueError, match="longer than the model's seq_len=12"):
        GPT(TINY)(torch.zeros(1, 13, dtype=torch.long))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="d_model=10 is not divisible by n_head=3"):
        GPTConfig(n_layer=1, n_head=3, d_model=10)
    with pytest.raises(ValueError, match="n_layer must be positive"):
        GPTConfig(n_layer=0, n_head=1, d_model=8)


def test_load_model_file_builds_the_users_model(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text(
        "from infinity.models.gpt import GPT, GPTConfig\n"
        "def build_model():\n"
        "    return GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8))\n"
    )
    model = load_model_file(f)
    assert isinstance(model, GPT) and model.config.n_layer == 1


def test_load_model_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_model_file(tmp_path / "nope.py")
    bad = tmp_path / "nobuild.py"
    bad.write_text("x = 1\n")
    with pytest.raises(ValueError, match="nobuild.py.*build_model"):
        load_model_file(bad)
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def build_model():\n    return 3\n")
    with pytest.raises(ValueError, match="returned int"):
        load_model_file(wrong)
    other = tmp_path / "model.yaml"
    other.write_text("a: 1\n")
    with pytest.raises(ValueError, match="model.yaml"):
        load_model_file(other)


def test_hugging_face_config_needs_valid_json_and_transformers(tmp_path):
    notjson = tmp_path / "config.json"
    notjson.write_text("{not json")
    with pytest.raises(ValueError, match="config.json.*not valid JSON"):
        load_model_file(notjson)
    good = tmp_path / "hf.json"
    good.write_text('{"model_type": "gpt2", "vocab_size": 256, "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 32}')
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="transformers"):
            load_model_file(good)
    else:
        model = load_model_file(good)
        ids = torch.randint(0, 256, (1, 8))
        assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize("tie", [True, False])
def test_shapes_and_decays_from_the_config_are_the_built_models(tie):
    """``param_shapes`` and ``infinity train``'s decays read off a config, without building a model, are those of
    ``GPT(cfg)``: its parameters' shapes in order, and the weight decay on those of 2 or more dimensions."""
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=64, tie_embeddings=tie)
    model = GPT(cfg)
    assert param_shapes(cfg) == [tuple(p.shape) for p in model.parameters()]
    assert model_decays(cfg, 0.1) == model_decays(model, 0.1)
    assert set(model_decays(cfg, 0.1)) == {0.1, 0.0}
