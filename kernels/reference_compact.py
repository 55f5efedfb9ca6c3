"""The Adam step on compact states (``bf16``, ``int8``) in torch ops: the reference
for ``csrc/adam_compact.cpp``, equal to it bit for bit.

Per element, the states are widened to fp32 (``compact.py`` defines the forms),
then the fp32 step of ``reference.py`` runs in the same order (but for its last
line, where ``sqrt(bias_correction2)`` moves into the two constants so that one
division is left), then the results are stored back:

    p, m, v  = widen(master), widen(exp_avg), widen(exp_avg_sq)    (int8: v = (code * scale)**2)
    p  = p * decay  |  g = g + p * l2
    m  = base + coeff * (g - m)
    v  = v * beta2 + ((1 - beta2) * g) * g
    r  = sqrt(v)                                                 (correctly rounded)
    p  = p + ((-step_size * sqrt(bc2)) * m) / (r + eps * sqrt(bc2))   (one division; reference.py has two)
    bf16: h = random_bits(keys, index)
          master = SR_bf16(p, h >> 16), exp_avg = RNE_bf16(m), exp_avg_sq = SR_bf16(v, h & 0xFFFF)
    int8: master = SR_bf16(p, random_bits16_shared(keys, index))
          each block's scales from the new m and r, then codes of m and r
    param_out = master in its dtype

so the parameter moves by the step computed from the unrounded new moments;
only what is stored is rounded. Chunks are whole blocks, so the scales are
those of the whole tensor.
"""

from __future__ import annotations

import torch

from . import compact
from .constants import AdamConstants

# Elements per chunk (a multiple of the block size).
DEFAULT_CHUNK_NUMEL = 1 << 16


def adam_update_compact(
    constants: AdamConstants,
    state_dtype: str,
    keys: tuple[int, int],
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_scale: torch.Tensor | None,
    exp_avg_sq_scale: torch.Tensor | None,
    param_out: torch.Tensor | None,
    *,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
) -> None:
    """Applies one step in place to checked tensors (``state_dtype`` "bf16" or "int8")."""
    c = constants
    numel = master.numel()
    if numel == 0:
        return
    if chunk_numel % compact.BLOCK_NUMEL:
        raise ValueError(f"chunk_numel must be a multiple of {compact.BLOCK_NUMEL}, got {chunk_numel}")
    int8 = state_dtype == "int8"
    p_flat, g_flat = master.view(-1), grad.view(-1)
    m_flat, v_flat = exp_avg.view(-1), exp_avg_sq.view(-1)
    out_flat = None if param_out is None else param_out.view(-1)
    f32 = torch.float32
    # Python floats (doubles), rounded to fp32 where they meet a tensor, as the kernel rounds its products
    neg_step_root = c.neg_step_size * c.bias_correction2_sqrt
    eps_root = c.eps * c.bias_correction2_sqrt
    for lo in range(0, numel, chunk_numel):
        hi = min(lo + chunk_numel, numel)
        blo, bhi = lo // compact.BLOCK_NUMEL, compact.num_blocks(hi)
        g = g_flat[lo:hi].to(f32)
        p = p_flat[lo:hi].to(f32)
        if int8:
            m = compact.dequantize_exp_avg(m_flat[lo:hi], exp_avg_scale[blo:bhi])
            v = compact.dequantize_exp_avg_sq(v_flat[lo:hi], exp_avg_sq_scale[blo:bhi])
        else:
            m, v = m_flat[lo:hi].to(f32), v_flat[lo:hi].to(f32)

        if c.decoupled:
            if c.decay != 1.0:
                p = p * c.decay
        elif c.l2 != 0.0:
            g = g + p * c.l2
        if c.lerp_base_is_avg:
            m = m + (g - m) * c.lerp_coeff
        else:
            m = g + (g - m) * c.lerp_coeff
        v = v * c.beta2 + (g * c.beta2_complement) * g
        root = compact.sqrt_rn(v)
        p = p + (m * neg_step_root) / (root + eps_root)

        index = torch.arange(lo, hi, dtype=torch.int64)
        if int8:
            new_master = compact.bf16_stochastic_round(p, compact.random_bits16_shared(keys, index))
        else:
            h = compact.random_bits(keys, index)
            new_master = compact.bf16_stochastic_round(p, h >> 16)
        p_flat[lo:hi].copy_(new_master)
        if out_flat is not None:
            out_flat[lo:hi].copy_(new_master)
        if int8:
            m_scale, r_scale = compact.block_scales(m), compact.block_scales(root)
            m_flat[lo:hi].copy_(compact.quantize_exp_avg(m, m_scale))
            v_flat[lo:hi].copy_(compact.quantize_exp_avg_sq(root, r_scale))
            exp_avg_scale[blo:bhi].copy_(m_scale)
            exp_avg_sq_scale[blo:bhi].copy_(r_scale)
        else:
            m_flat[lo:hi].copy_(m)  # round to nearest even
            v_flat[lo:hi].copy_(compact.bf16_stochastic_round(v, h & 0xFFFF))
