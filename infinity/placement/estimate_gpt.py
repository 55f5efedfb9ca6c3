"""The estimate for our GPT (:mod:`infinity.models.gpt`): the activations autograd keeps for a micro-batch of it,
and :func:`~infinity.placement.estimate.estimate` with its exact parameters, largest layer and activations.
"""

from __future__ import annotations

from dataclasses import asdict

from infinity.models.gpt import largest_module_params, param_numels
from infinity.placement.estimate import COMPUTE_BYTES, estimate

__all__ = ["estimate_gpt", "gpt_activation_nbytes"]


def gpt_activation_nbytes(cfg, *, micro_batch: int, seq_len: int | None = None, precision: str = "bf16",
                          activation_checkpointing: bool = False) -> int:
    """What autograd keeps for one micro-batch of ``GPT(cfg)``.

    Per block about 17 activations of ``(batch, seq, d_model)`` (Korthikanti et
    al.'s 34·s·b·h bytes at 2 bytes each; attention by a fused kernel, so no
    ``seq x seq`` term) plus the MLP's ``4 x`` wide ones counted in that 17;
    plus the logits in compute precision and their fp32 copy for the loss.
    With ``activation_checkpointing`` (every block recomputed in backward,
    ``GPT.activation_checkpointing_enable()``) a block keeps only its input, and
    one block's 17 exist at a time, while it is recomputed.
    """
    t = seq_len or cfg.seq_len
    cbytes = COMPUTE_BYTES[precision]
    tokens = micro_batch * t
    block_input = tokens * cfg.d_model * cbytes
    per_block = 17 * block_input
    logits = tokens * cfg.vocab_size * (cbytes + 4 + 4)  # logits, fp32 copy, its softmax grad
    blocks = cfg.n_layer * block_input + per_block if activation_checkpointing else cfg.n_layer * per_block
    return blocks + logits + 2 * block_input


def estimate_gpt(cfg, *, micro_batch: int = 1, seq_len: int | None = None, precision: str = "bf16",
                 activation_checkpointing: bool = False, **kwargs) -> dict:
    """``estimate`` for ``GPT(cfg)``: exact per-parameter padding, largest layer and activations (each block
    recomputed in backward with ``activation_checkpointing``)."""

    result = estimate(
        param_numels=param_numels(cfg),
        largest_layer_params=kwargs.pop("largest_layer_params", None) or largest_module_params(cfg),
        precision=precision,
        activation_nbytes=gpt_activation_nbytes(cfg, micro_batch=micro_batch, seq_len=seq_len, precision=precision,
                                                activation_checkpointing=activation_checkpointing),
        **kwargs,
    )
    result["setting"]["model"] = asdict(cfg)
    result["setting"]["micro_batch"] = micro_batch
    result["setting"]["seq_len"] = seq_len or cfg.seq_len
    result["setting"]["activation_checkpointing"] = activation_checkpointing
    return result
