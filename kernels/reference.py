"""The Adam step in plain torch ops: the reference for the C++ kernel.

It computes exactly what ``csrc/adam.cpp`` computes, element for element and
bit for bit: the same fp32 operations in the same order, each rounded once.
Two details make that hold:

* no fused multiply-add: every product and sum is its own torch op, so the
  result does not depend on whether torch's build contracts them;
* ``sqrt`` is taken in float64 and rounded to fp32, because torch's fp32
  ``sqrt`` on CPU is not correctly rounded (it goes through a vector math
  library) while the kernel's ``sqrt`` instruction is; a float64 root of an
  fp32 value, rounded to fp32, is the correctly rounded fp32 root.

The step runs over chunks of at most ``chunk_numel`` elements with
preallocated chunk buffers, so it never allocates temporaries the size of the
whole tensor.
"""

from __future__ import annotations

import torch

from .constants import AdamConstants

# Elements per chunk: the four fp32 chunk buffers and one float64 buffer come
# to 6 MiB, about the size of a core's L2 plus a share of L3.
DEFAULT_CHUNK_NUMEL = 1 << 18


def adam_update(
    constants: AdamConstants,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_out: torch.Tensor | None,
    *,
    chunk_numel: int = DEFAULT_CHUNK_NUMEL,
) -> None:
    """Applies one step in place to checked, contiguous CPU tensors of one numel."""
    c = constants
    numel = param.numel()
    if numel == 0:
        return
    p_flat, m_flat, v_flat = param.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    g_flat = grad.view(-1)
    out_flat = None if param_out is None else param_out.view(-1)

    size = min(numel, chunk_numel)
    f32 = torch.float32
    grad_buf = torch.empty(size, dtype=f32)  # upcast gradient, or gradient + L2 term
    tmp_buf = torch.empty(size, dtype=f32)
    denom_buf = torch.empty(size, dtype=f32)
    root_buf = torch.empty(size, dtype=torch.float64)

    for lo in range(0, numel, chunk_numel):
        hi = min(lo + chunk_numel, numel)
        k = hi - lo
        p, m, v = p_flat[lo:hi], m_flat[lo:hi], v_flat[lo:hi]
        g = g_flat[lo:hi]
        tmp, denom, root = tmp_buf[:k], denom_buf[:k], root_buf[:k]
        if g.dtype != f32:
            grad_buf[:k].copy_(g)  # exact: every bf16/fp16 value is an fp32 value
            g = grad_buf[:k]

        if c.decoupled:
            if c.decay != 1.0:
                p.mul_(c.decay)
        elif c.l2 != 0.0:
            torch.mul(p, c.l2, out=tmp)
            g = torch.add(g, tmp, out=grad_buf[:k])

        # m.lerp_(g, 1 - beta1), in torch's two forms (see AdamConstants).
        torch.sub(g, m, out=tmp)
        tmp.mul_(c.lerp_coeff)
        if c.lerp_base_is_avg:
            m.add_(tmp)
        else:
            torch.add(g, tmp, out=m)

        # v = v * beta2 + ((1 - beta2) * g) * g
        torch.mul(g, c.beta2_complement, out=tmp)
        tmp.mul_(g)
        v.mul_(c.beta2).add_(tmp)

        # denom = sqrt(v) / sqrt(bias_correction2) + eps, with a correctly rounded root
        root.copy_(v)
        root.sqrt_()
        denom.copy_(root)
        denom.div_(c.bias_correction2_sqrt).add_(c.eps)

        # p = p + (-step_size * m) / denom
        torch.mul(m, c.neg_step_size, out=tmp)
        tmp.div_(denom)
        p.add_(tmp)

        if out_flat is not None:
            out_flat[lo:hi].copy_(p)  # round to nearest even
