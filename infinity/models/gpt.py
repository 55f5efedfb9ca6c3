"""A GPT-style decoder (pre-LN transformer) sized by presets from ~0.4M to ~13B parameters.

The model is written so the engine can build it without memory:

* every module that owns parameters initializes them in its own
  ``reset_parameters()`` (the standard ``nn`` modules already do; the small
  subclasses below carry GPT-2's init: normal(0, 0.02), residual projections
  scaled by ``1/sqrt(2 * n_layer)``, zero biases), so a model built under
  ``torch.device("meta")`` is materialized module by module with
  ``module.to_empty(device=..., recurse=False); module.reset_parameters()``;
* ``GPT.__init__`` touches no tensor data.

With ``tie_embeddings`` the output head is the token embedding used as a
linear map. It is computed by *calling the embedding module a second time*
(``self.wte(h, unembed=True)``), so module hooks see the tied weight used at
the head too: the engine fetches ``wte.weight`` for that call like for any
other module's parameters.

User models: ``load_model_file(path)`` accepts a Python file that defines
``build_model() -> torch.nn.Module`` (its forward must take
``(input_ids, targets)`` and return the mean loss), or a Hugging Face
``transformers`` config JSON (needs ``transformers`` installed; the model keeps
its own forward, see :mod:`infinity.models.transformers_lm`).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from infinity.models.transformers_lm import transformers_lm_from_config_file

__all__ = [
    "GPTConfig",
    "GPT",
    "PRESETS",
    "DEFAULT_PRESET",
    "count_params",
    "param_numels",
    "largest_module_params",
    "gpt_like_largest_layer",
    "get_preset",
    "load_model_file",
]

INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model. Byte-level by default (``vocab_size=256``)."""

    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``d_model``."""
    d_model: int
    """Width of the residual stream."""
    seq_len: int = 256
    """Longest sequence (size of the learned position embedding)."""
    d_ff: int = 0
    """Hidden width of the MLP; 0 means ``4 * d_model``."""
    vocab_size: int = 256
    """Number of token ids; 256 for bytes."""
    tie_embeddings: bool = True
    """Use the token embedding as the output head (no separate head weight)."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches (0 disables it)."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}")
        if self.d_ff < 0:
            raise ValueError(f"GPTConfig.d_ff must be >= 0, got {self.d_ff}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def ff_dim(self) -> int:
        return self.d_ff or 4 * self.d_model


# --------------------------------------------------------------------------- modules


class _Linear(nn.Linear):
    """``nn.Linear`` with GPT-2's init: weight ~ N(0, init_std), bias = 0."""

    def __init__(self, in_features: int, out_features: int, *, init_std: float = INIT_STD, bias: bool = True):
        self.init_std = init_std  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class _Embedding(nn.Embedding):
    """``nn.Embedding`` with weight ~ N(0, 0.02). ``unembed=True`` maps hidden states to logits."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)

    def forward(self, x: torch.Tensor, unembed: bool = False) -> torch.Tensor:  # type: ignore[override]
        if unembed:
            return F.linear(x, self.weight)
        return super().forward(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = _Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = _Linear(cfg.d_model, cfg.d_model, init_std=INIT_STD / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, t, d) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = _Linear(cfg.d_model, cfg.ff_dim)
        self.proj = _Linear(cfg.ff_dim, cfg.d_model, init_std=INIT_STD / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """``forward(input_ids, targets=None)``: mean cross-entropy if ``targets`` is given, else logits.

    :meth:`activation_checkpointing_enable` keeps only the blocks' inputs for backward and recomputes each block
    there (as Hugging Face models' method of that name does), so activations grow with depth by one
    ``(batch, seq, d_model)`` tensor a block instead of ~17."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = _Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = _Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = None if cfg.tie_embeddings else _Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.checkpoint_every = 0
        """Recompute every ``checkpoint_every``-th block in backward (0: none); set by
        :meth:`activation_checkpointing_enable`."""
        self._checkpoint_kwargs: dict = {}  # torch.utils.checkpoint's, with them

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        every_n_layers: int = 1) -> None:
        """Recompute every ``every_n_layers``-th block in backward instead of keeping its activations (in
        training, with gradients on). ``activation_checkpointing_kwargs`` go to ``torch.utils.checkpoint``
        (non-reentrant unless they say otherwise). Names as Hugging Face's, so its Trainer can call it."""
        if not isinstance(every_n_layers, int) or every_n_layers < 1:
            raise ValueError(f"every_n_layers must be a positive integer, got {every_n_layers!r}")
        self._checkpoint_kwargs = {"use_reentrant": False, **(activation_checkpointing_kwargs or {})}
        self.checkpoint_every = every_n_layers

    def activation_checkpointing_disable(self) -> None:
        self.checkpoint_every = 0

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"GPT expects input_ids of shape (batch, seq), got {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len={self.config.seq_len}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        recompute = self.checkpoint_every and self.training and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if recompute and i % self.checkpoint_every == 0:
                x = checkpoint(block, x, **self._checkpoint_kwargs)
            else:
                x = block(x)
        x = self.ln_f(x)
        logits = self.wte(x, unembed=True) if self.head is None else self.head(x)
        if targets is None:
            return logits
        return _mean_cross_entropy(logits, targets)


def _mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in at least fp32, whatever the compute precision."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------- sizes


def param_shapes(cfg: GPTConfig) -> list[tuple[int, ...]]:
    """Each parameter's shape, in ``GPT(cfg).parameters()`` order, without building the model (building one, even
    on the meta device, first imports torch's meta kernels: ~75 MiB of a process's memory)."""
    d, ff = cfg.d_model, cfg.ff_dim
    block = [
        (d,), (d,),  # ln1
        (3 * d, d), (3 * d,),  # attn.qkv
        (d, d), (d,),  # attn.proj
        (d,), (d,),  # ln2
        (ff, d), (ff,),  # mlp.fc
        (d, ff), (d,),  # mlp.proj
    ]
    shapes = [(cfg.vocab_size, d), (cfg.seq_len, d)] + block * cfg.n_layer + [(d,), (d,)]
    if not cfg.tie_embeddings:
        shapes.append((cfg.vocab_size, d))
    return shapes


def param_numels(cfg: GPTConfig) -> list[int]:
    """Each parameter's numel, in ``GPT(cfg).parameters()`` order, without building the model."""
    return [math.prod(shape) for shape in param_shapes(cfg)]


def count_params(cfg: GPTConfig) -> int:
    """Exact parameter count of ``GPT(cfg)``, without building it."""
    return sum(param_numels(cfg))


def largest_module_params(cfg: GPTConfig) -> int:
    """Parameters owned directly by the largest single module (what one fetch brings in at once)."""
    d, ff = cfg.d_model, cfg.ff_dim
    return max(cfg.vocab_size * d, cfg.seq_len * d, d * 3 * d + 3 * d, d * ff + ff, ff * d + d)


def gpt_like_largest_layer(num_params: int) -> int:
    """The largest layer of a GPT with ``num_params`` parameters: its ``d x 4d`` MLP matrix.

    Such a model has about ``12 * n_layer * d**2`` parameters; with the usual
    aspect ratio ``d ~ 128 * n_layer`` that gives ``d = (num_params * 128 / 12) ** (1/3)``.
    """
    d = (num_params * 128 / 12) ** (1 / 3)
    return min(int(num_params), int(4 * d * d + 4 * d))


def _preset(n_layer: int, n_head: int, d_model: int, seq_len: int) -> GPTConfig:
    return GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, seq_len=seq_len)


# Byte-level (vocab 256), so the names count the transformer blocks; the
# embeddings are small. The exact count is ``count_params(PRESETS[name])``.
PRESETS: dict[str, GPTConfig] = {
    "tiny": _preset(2, 4, 128, 128),  # ~0.44M, for tests
    "small": _preset(4, 4, 256, 256),  # ~3.3M, the default of `infinity train`
    "10m": _preset(6, 6, 384, 256),
    "50m": _preset(16, 8, 512, 512),
    "125m": _preset(18, 12, 768, 1024),
    "350m": _preset(28, 16, 1024, 1024),
    "760m": _preset(27, 16, 1536, 1024),
    "1.3b": _preset(26, 16, 2048, 2048),
    "2.7b": _preset(34, 32, 2560, 2048),
    "6.7b": _preset(33, 32, 4096, 2048),
    "13b": _preset(42, 40, 5120, 2048),
    "20b": _preset(45, 48, 6144, 2048),  # GPT-NeoX-20B's width, one block more for 20.4B with a byte vocabulary
    "30b": _preset(48, 56, 7168, 2048),  # GPT-3's widths continued (head size 128)
}

DEFAULT_PRESET = "small"


def get_preset(name: str) -> GPTConfig:
    """The preset's config; ``ValueError`` listing the presets if ``name`` is unknown."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}") from None


# --------------------------------------------------------------------------- user models


def load_model_file(path: str | Path) -> nn.Module:
    """Build a user's model from ``path``.

    * ``*.py``: a Python file that defines ``build_model() -> torch.nn.Module``.
      The module's ``forward(input_ids, targets)`` must return the mean loss
      (a scalar tensor); ``input_ids`` and ``targets`` are int64 ``(batch, seq)``
      byte ids (0..255).
    * ``*.json``: a Hugging Face ``transformers`` model config; the model is
      ``AutoModelForCausalLM.from_config(config)``, with its own forward
      (``input_ids=..., labels=...``). Needs ``transformers``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file {str(path)!r} does not exist")
    if path.suffix == ".py":
        spec = importlib.util.spec_from_file_location(f"infinity_user_model_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import model file {str(path)!r}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        build = getattr(module, "build_model", None)
        if not callable(build):
            raise ValueError(f"model file {str(path)!r} does not define build_model() -> torch.nn.Module")
        model = build()
        if not isinstance(model, nn.Module):
            raise ValueError(f"build_model() in {str(path)!r} returned {type(model).__name__}, not a torch.nn.Module")
        return model
    if path.suffix == ".json":
        return transformers_lm_from_config_file(path)
    raise ValueError(f"model file {str(path)!r}: expected a .py file defining build_model() or a transformers config .json")
