"""One step's scalar constants, computed once in float64 for both backends.

Both backends round these doubles to fp32 at use, as torch's Adam does, so
they agree with each other bit for bit and with torch's operation order.
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdamConstants:
    """The constants of one Adam/AdamW step (see ``for_step``)."""

    decoupled: bool
    """AdamW: weight decay scales the parameter; else Adam's L2 term joins the gradient."""
    decay: float
    """AdamW's factor ``1 - lr * weight_decay``; 1.0 when not used."""
    l2: float
    """Adam's ``weight_decay``, added as ``grad + param * l2``; 0.0 when not used."""
    lerp_weight: float
    """``1 - beta1``, the weight of ``exp_avg.lerp_(grad, 1 - beta1)``."""
    beta2: float
    beta2_complement: float
    """``1 - beta2``."""
    bias_correction2_sqrt: float
    """``sqrt(1 - beta2**step)``, or 1.0 without bias correction."""
    neg_step_size: float
    """``-lr / (1 - beta1**step)``, or ``-lr`` without bias correction."""
    eps: float

    @property
    def lerp_base_is_avg(self) -> bool:
        """torch's lerp: ``m + w*(g-m)`` when ``|w| < 0.5``, else ``g + (w-1)*(g-m)``.

        Decided on the fp32 weight, as torch's kernel decides it.
        """
        return abs(_to_fp32(self.lerp_weight)) < 0.5

    @property
    def lerp_coeff(self) -> float:
        """The fp32 coefficient of ``(g - m)`` in the lerp (see ``lerp_base_is_avg``)."""
        w = _to_fp32(self.lerp_weight)
        return w if self.lerp_base_is_avg else _to_fp32(w - 1.0)

    @classmethod
    def for_step(
        cls,
        *,
        step: int,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        adamw: bool,
        bias_correction: bool,
    ) -> AdamConstants:
        """Checks the hyperparameters (``ValueError`` naming the bad one) and derives the constants."""
        if type(step) is not int and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
            raise ValueError(f"step must be an int (the 1-based step count), got {type(step).__name__}")
        if step < 1:
            raise ValueError(f"step must be >= 1 (it counts steps from 1), got {step}")
        lr = _real("lr", lr)
        beta1, beta2 = _real("beta1", beta1), _real("beta2", beta2)
        eps, weight_decay = _real("eps", eps), _real("weight_decay", weight_decay)
        # The same ranges as torch.optim.Adam; `not 0 <= x` also rejects NaN.
        if not 0.0 <= lr:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= beta1 < 1.0:
            raise ValueError(f"beta1 must be in [0, 1), got {beta1}")
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
        if not 0.0 <= eps:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        for name, flag in (("adamw", adamw), ("bias_correction", bias_correction)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {type(flag).__name__}")

        if bias_correction:
            # As torch: float64 pow and sqrt of the step as a float.
            bias_correction1 = 1.0 - beta1 ** float(step)
            bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** float(step))
        else:
            bias_correction1 = 1.0
            bias_correction2_sqrt = 1.0
        use_decay = weight_decay != 0.0
        return cls(
            decoupled=adamw,
            decay=1.0 - lr * weight_decay if adamw and use_decay else 1.0,
            l2=weight_decay if not adamw and use_decay else 0.0,
            lerp_weight=1.0 - beta1,
            beta2=beta2,
            beta2_complement=1.0 - beta2,
            bias_correction2_sqrt=bias_correction2_sqrt,
            neg_step_size=-(lr / bias_correction1),
            eps=eps,
        )


def _real(name: str, value: object) -> float:
    if type(value) is float:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _to_fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]
