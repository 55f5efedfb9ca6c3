"""infinity.kernels: fused CPU optimizer kernels, with a torch fallback.

The optimizer step of an offloaded run goes over every parameter of the rank
on the CPU, and it is bound by memory bandwidth; ``adam_step`` does it in one
pass: fp32 master and moments in place, fp32/bf16/fp16 gradients, and the
low-precision parameter copy written in the same pass.

    adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
              weight_decay, adamw=True, bias_correction=True, param_out=None,
              grad_sq_norm=False)      -> grad's squared norm, summed in the same pass, when asked
    adam_step_reference(...)   same signature; always the torch implementation
    backend()                  "cpp" or "torch": what adam_step uses
    adam_step_on_device(...)   same signature, states in device memory: adam_step
                               on the CPU, torch's fused AdamW on a GPU

    adam_step_compact(master, grad, exp_avg, exp_avg_sq, *, state_dtype, step, lr, ...,
                      seed, exp_avg_scale=None, exp_avg_sq_scale=None, param_out=None)
                               the step on "fp32", "bf16" or "int8" states (compact.py)
    adam_step_compact_reference(...)   same signature; always torch
    sq_norm_fp64(values)       the sum of squares in fp64, one pass (None where the kernel is not used)
    state_layout(state_dtype, numel), state_nbytes(...), state_bytes_per_element(...),
    empty_state(...)           the tensors, bytes and buffers of each state dtype
    compact.from_fp32 / to_fp32 / convert   conversions (checkpoints, consolidation)

The C++ kernel (``csrc/adam.cpp``) is built on first use and cached per machine
(``extension.py``). ``reference.py`` is the same computation in torch ops,
used when no compiler is found or when ``INFINITY_KERNELS=torch``; the two
agree bit for bit. This package imports only torch and the standard library.
"""

from . import compact
from .adam import BACKEND_ENV, adam_step, adam_step_compact, adam_step_compact_reference, adam_step_reference, backend
from .compact import BLOCK_NUMEL, STATE_DTYPES, empty_state, state_bytes_per_element, state_layout, state_nbytes
from .device_adam import adam_step_on_device
from .norm import sq_norm_fp64

__all__ = [
    "BACKEND_ENV", "BLOCK_NUMEL", "STATE_DTYPES", "adam_step", "adam_step_compact", "adam_step_compact_reference",
    "adam_step_on_device", "adam_step_reference", "backend", "compact", "empty_state", "state_bytes_per_element",
    "sq_norm_fp64", "state_layout", "state_nbytes",
]  # fmt: skip
