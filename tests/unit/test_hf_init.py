"""A model built on the meta device starts from the values its constructor gives on a real device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import infinity
from infinity.models.gpt import GPT, GPTConfig

try:
    import transformers
except ImportError:  # the transformers cases are skipped; our GPT's still run
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="needs the [hf] extra (transformers)")


def engine_state(model, **kwargs) -> dict:
    with infinity.initialize(model, {"zero_optimization": {"stage": 3, "sub_group_size": 4096}}, **kwargs) as engine:
        return engine.full_state_dict()


def assert_module_by_module(real: nn.Module, state: dict, prefix: str = "") -> None:
    for module_name, module in real.named_modules():
        for local, value in module.named_parameters(recurse=False):
            name = f"{module_name}.{local}" if module_name else local
            assert torch.equal(state[prefix + name], value.detach()), f"{name} ({type(module).__name__})"


def test_gpt_meta_equals_real_device():
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=64)
    torch.manual_seed(5)
    real = GPT(cfg)
    after_real = torch.rand(4)
    torch.manual_seed(5)
    with infinity.Init():
        meta = GPT(cfg)
    state = engine_state(meta)
    assert_module_by_module(real, state)
    assert real.wte.weight.std().item() == pytest.approx(0.02, rel=0.2)  # GPT-2's init, not nn.Embedding's std 1
    assert torch.equal(torch.rand(4), after_real)  # the generator is left where the real constructor leaves it


@needs_transformers
def test_llama_meta_equals_real_device():
    """transformers' _init_weights (nested post_init of LlamaModel, then the head) and the rotary buffers."""
    cfg = transformers.LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(7)
    real = transformers.LlamaForCausalLM(cfg)
    torch.manual_seed(7)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(cfg)
    with infinity.initialize(meta, {}) as engine:
        state = engine.full_state_dict()
        inv_freq = engine.module.model.rotary_emb.inv_freq.cpu()  # buffers live on the compute device
    assert_module_by_module(real, state)
    assert real.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.2)
    torch.testing.assert_close(inv_freq, real.model.rotary_emb.inv_freq, rtol=0, atol=0)


class _WithInitWeights(nn.Module):
    """Both conventions present: _init_weights wins over reset_parameters."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.LayerNorm(4)
        self._init_weights_all()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 0.5)
            nn.init.zeros_(module.bias)

    def _init_weights_all(self):  # what transformers' post_init does
        for m in reversed(list(self.modules())):
            if any(True for _ in m.parameters(recurse=False)):
                self._init_weights(m)


def test_order_param_init_then_init_weights_then_reset_parameters():
    real = _WithInitWeights()
    with torch.device("meta"):
        meta = _WithInitWeights()
    state = engine_state(meta)
    assert torch.equal(state["a.weight"], torch.full((4, 4), 0.5)) and torch.equal(state["a.weight"], real.a.weight)
    assert torch.equal(state["b.weight"], torch.ones(4))  # reset_parameters() where _init_weights does nothing

    calls = []

    def param_init(module):
        calls.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 3.0)

    with torch.device("meta"):
        meta = _WithInitWeights()
    state = engine_state(meta, param_init=param_init)
    assert calls == ["Linear", "LayerNorm"]
    assert all(torch.equal(v, torch.full_like(v, 3.0)) for v in state.values())


def test_uninitialized_parameter_is_named():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

        def _init_weights(self, module):
            pass

    with torch.device("meta"):
        meta = Bare()
    with pytest.raises(ValueError, match="parameter 'w' was not initialized"):
        engine_state(meta)
    with pytest.raises(ValueError, match="param_init must be a callable"):
        engine_state(nn.Linear(2, 2), param_init=3)


@needs_transformers
def test_a_real_model_is_not_reinitialized_and_draws_nothing():
    cfg = transformers.LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(2)
    real = transformers.LlamaForCausalLM(cfg)
    expected = {k: v.clone() for k, v in real.state_dict().items()}
    after = torch.get_rng_state()
    state = engine_state(real)
    assert torch.equal(torch.get_rng_state(), after)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name


class Rotary(nn.Module):
    """Buffers computed in the constructor (a frequency table, a mask, positions) and a tied head, with no
    ``reset_parameters`` of its own: under ``torch.device("meta")`` its buffers would have no values."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)
        self.register_buffer("pos", torch.arange(5))

    def forward(self, ids):
        return self.head(self.proj(self.embed(ids)) * self.inv_freq.repeat(2)).sum() + self.mask.sum()


@pytest.mark.parametrize("context", ["infinity.Init", "deepspeed.zero.Init"])
def test_buffers_the_constructor_computes_are_real_and_parameters_replayed(context):
    import infinity.deepspeed as deepspeed

    torch.manual_seed(3)
    real = Rotary()
    torch.manual_seed(3)
    with (infinity.Init() if context == "infinity.Init" else deepspeed.zero.Init()):
        built = Rotary()
    assert all(p.is_meta for p in built.parameters()) and built.head.weight is built.embed.weight
    assert all(not b.is_meta for b in built.buffers())
    with infinity.initialize(built, {"zero_optimization": {"stage": 3, "sub_group_size": 4096}}) as engine:
        state = engine.full_state_dict()
        ids = torch.randint(0, 16, (2, 4))
        assert torch.equal(engine(ids), real(ids))
    assert_module_by_module(real, state)
    for name, value in real.named_buffers():
        assert torch.equal(dict(built.named_buffers())[name], value), name
