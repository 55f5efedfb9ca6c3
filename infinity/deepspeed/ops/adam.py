"""``deepspeed.ops.adam``'s ``DeepSpeedCPUAdam`` and ``FusedAdam``, with DeepSpeed's arguments: a script makes one
over its parameter groups and passes it to ``initialize``, which takes its learning rate, betas, eps, weight decay
per group and its ``adamw_mode`` (decoupled decay, or L2 added to the gradient) for the engine's own Adam. Each is
a ``torch.optim.Adam``, so a scheduler can be made over it and it steps as torch's where no engine is used.
``bias_correction=False`` is refused: the engine's Adam always corrects."""

from __future__ import annotations

import torch


def _checked(name: str, bias_correction: bool) -> None:
    if not bias_correction:
        raise ValueError(f"{name}(bias_correction=False) is not supported: the engine's Adam corrects the moments' "
                         "bias, as torch's does")


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's CPU Adam: the engine's fused CPU kernel steps the states wherever they rest on the host."""

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True):
        _checked("DeepSpeedCPUAdam", bias_correction)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adamw_mode)


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's fused GPU Adam: the engine steps the states that rest on the device with the device's fused
    AdamW."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        _checked("FusedAdam", bias_correction)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adam_w_mode)
