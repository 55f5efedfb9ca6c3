"""The Adam/AdamW step where the states are in device memory.

On the CPU that is our fused kernel (:func:`adam_step`). On a GPU it is
torch's fused AdamW (one kernel launch over the whole flat range), or, where
torch's fused op cannot express the update (no bias correction), the same
arithmetic in plain torch ops. The hyperparameters mean what they mean for
:func:`adam_step`: decoupled weight decay with ``adamw``, L2 otherwise, and
``step`` the 1-based count used for bias correction.
"""

from __future__ import annotations

import math

import torch

from .adam import adam_step


@torch.no_grad()
def adam_step_on_device(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                        step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                        adamw: bool = True, bias_correction: bool = True,
                        param_out: torch.Tensor | None = None) -> None:
    """One step over flat fp32 ``param``/``exp_avg``/``exp_avg_sq`` on their device; ``param_out`` receives
    the updated parameter in its own dtype."""
    hyper = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
                 bias_correction=bias_correction)
    if param.device.type == "cpu":
        adam_step(param, grad, exp_avg, exp_avg_sq, param_out=param_out, **hyper)
        return
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    if bias_correction and _fused_available():
        adam_step_fused(param, grad, exp_avg, exp_avg_sq, **hyper)
    else:
        adam_step_torch_ops(param, grad, exp_avg, exp_avg_sq, **hyper)
    if param_out is not None:
        param_out.copy_(param)


def adam_step_fused(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, adamw,
                    bias_correction=True) -> None:
    """torch's fused Adam/AdamW kernel (it always corrects bias)."""
    if not bias_correction:
        raise ValueError("torch's fused Adam always corrects bias; use adam_step_torch_ops")
    fused = torch._fused_adamw_ if adamw else torch._fused_adam_
    steps = [torch.tensor(float(step), dtype=torch.float32, device=param.device)]
    fused([param], [grad], [exp_avg], [exp_avg_sq], [], steps, lr=lr, beta1=beta1, beta2=beta2,
          weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def adam_step_torch_ops(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay, adamw,
                        bias_correction=True) -> None:
    """The same update in plain torch ops, on any device."""
    if adamw:
        param.mul_(1.0 - lr * weight_decay)
    elif weight_decay:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    correction1 = 1.0 - beta1 ** step if bias_correction else 1.0
    correction2 = 1.0 - beta2 ** step if bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / math.sqrt(correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / correction1)


def _fused_available() -> bool:
    return hasattr(torch, "_fused_adamw_") and hasattr(torch, "_fused_adam_")
