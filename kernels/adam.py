"""The public Adam/AdamW step: checks, then the C++ kernel or the torch reference."""

from __future__ import annotations

import os

import torch

from . import compact, extension, reference, reference_compact
from .constants import AdamConstants

BACKEND_ENV = "INFINITY_KERNELS"
"""Environment variable: "torch" forces the reference, "cpp" requires the kernel,
"auto" (the default) uses the kernel when it can be built."""

_FP32 = (torch.float32,)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def backend() -> str:
    """Which implementation ``adam_step`` uses: "cpp" or "torch".

    The first call that wants the kernel loads it (building it once per machine).
    """
    requested = _requested_backend()
    if requested == "torch":
        return "torch"
    if extension.KERNEL.ops() is not None:
        return "cpp"
    if requested == "cpp":
        raise RuntimeError(
            f"{BACKEND_ENV}=cpp, but the C++ kernel is unavailable: {extension.KERNEL.error}"
        )
    return "torch"


@torch.no_grad()
def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    bias_correction: bool = True,
    param_out: torch.Tensor | None = None,
    num_threads: int | None = None,
    grad_sq_norm: bool = False,
) -> float | None:
    """One Adam (``adamw=False``) or AdamW step, fused into one pass over memory.

    ``param``, ``exp_avg`` and ``exp_avg_sq`` are fp32 and updated in place;
    ``grad`` is fp32, bf16 or fp16 and only read. ``param_out`` (bf16, fp16 or
    fp32), when given, receives the updated parameter rounded to nearest even,
    equal to ``param.to(param_out.dtype)``. All are contiguous CPU tensors of
    one numel, any shapes. ``step`` is the 1-based step count used for bias
    correction. The numerics are those of ``torch.optim.Adam``/``AdamW``
    (fused CPU kernel's operation order, without FMA), identical on both
    backends and for any thread count.

    ``num_threads``: the kernel's team (the calling thread and those OpenMP
    starts for it, which inherit its CPU affinity); None takes
    ``torch.get_num_threads()``. The torch backend ignores it.

    ``grad_sq_norm``: also return ``grad``'s squared L2 norm in fp64, summed
    in the same pass (each block of it just before the step reads it), the
    same bits as ``sq_norm_fp64(grad)``; None where the kernel is not used
    (``backend()`` is "torch", as ``sq_norm_fp64``): the caller sums it.

    Raises ``ValueError`` naming the argument for a wrong dtype, device,
    numel, layout, overlap or hyperparameter.
    """
    constants = AdamConstants.for_step(
        step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        adamw=adamw, bias_correction=bias_correction,
    )  # fmt: skip
    check_tensors(param, grad, exp_avg, exp_avg_sq, param_out)
    threads = check_num_threads(num_threads)
    if backend() != "cpp":
        reference.adam_update(constants, param, grad, exp_avg, exp_avg_sq, param_out)
        return None
    sq_norm = _sq_norm_out(grad_sq_norm)
    extension.adam_update(constants, param, grad, exp_avg, exp_avg_sq, param_out, threads=threads,
                          grad_sq_norm=sq_norm)
    return None if sq_norm is None else float(sq_norm)


@torch.no_grad()
def adam_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool = True,
    bias_correction: bool = True,
    param_out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """``adam_step`` computed with torch ops, whatever the backend (same results, bit for bit); ``num_threads`` is
    checked and ignored (torch ops follow ``torch.set_num_threads``)."""
    constants = AdamConstants.for_step(
        step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        adamw=adamw, bias_correction=bias_correction,
    )  # fmt: skip
    check_tensors(param, grad, exp_avg, exp_avg_sq, param_out)
    check_num_threads(num_threads)
    reference.adam_update(constants, param, grad, exp_avg, exp_avg_sq, param_out)


def check_tensors(
    param: object,
    grad: object,
    exp_avg: object,
    exp_avg_sq: object,
    param_out: object | None,
) -> None:
    """Raises ``ValueError`` naming the first tensor argument the kernel cannot take."""
    numel = _check_tensor("param", param, _FP32, None)
    named = [("param", param)]
    for name, t, allowed in (
        ("grad", grad, _GRAD_DTYPES),
        ("exp_avg", exp_avg, _FP32),
        ("exp_avg_sq", exp_avg_sq, _FP32),
        ("param_out", param_out, _OUT_DTYPES),
    ):
        if t is not None or name != "param_out":
            _check_tensor(name, t, allowed, numel)
            named.append((name, t))
    if numel == 0:
        return
    # The kernel reads and writes each element once; overlapping buffers would
    # read values it has already written. One exception is harmless: an fp32
    # param_out that is param itself receives what param holds.
    spans = [(name, t.data_ptr(), t.data_ptr() + numel * t.element_size()) for name, t in named]
    for i, (a, a_lo, a_hi) in enumerate(spans):
        for b, b_lo, b_hi in spans[i + 1 :]:
            if a_lo < b_hi and b_lo < a_hi and not (a == "param" and b == "param_out" and (a_lo, a_hi) == (b_lo, b_hi)):
                raise ValueError(f"{a} and {b} overlap in memory; each needs its own buffer")


@torch.no_grad()
def adam_step_compact(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    state_dtype: str,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    seed: int,
    adamw: bool = True,
    bias_correction: bool = True,
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
    param_out: torch.Tensor | None = None,
    num_threads: int | None = None,
    grad_sq_norm: bool = False,
) -> float | None:
    """One Adam/AdamW step on optimizer states in ``state_dtype``'s form, in one pass.

    ``state_dtype`` (forms in ``compact.py``; ``compact.state_layout`` gives the tensors):

    * ``"fp32"``: ``adam_step`` itself; ``seed`` is checked but unused, no scales.
    * ``"bf16"``: ``master``, ``exp_avg``, ``exp_avg_sq`` bf16; master and ``exp_avg_sq``
      stored back with stochastic rounding, ``exp_avg`` rounded to nearest.
    * ``"int8"``: ``master`` bf16 (stochastic rounding); ``exp_avg`` and ``exp_avg_sq``
      uint8 codes; ``exp_avg_scale`` and ``exp_avg_sq_scale`` fp32, one per block of
      ``compact.BLOCK_NUMEL`` elements (``compact.num_blocks(numel)`` of them).

    All are updated in place. The step's arithmetic is ``adam_step``'s in fp32 on the
    widened states; the parameter moves by the step computed from the new moments
    before they are rounded for storage. ``grad`` (fp32, bf16, fp16) is only read.
    ``param_out`` (bf16, fp16, fp32), when given, receives the new master in its dtype
    (``master.to(param_out.dtype)``); it may be ``master`` itself.

    ``seed`` (an int in [0, 2**64)) and ``step`` choose the random bits of stochastic
    rounding, a hash of (seed, step, element index): the same inputs give the same
    bits on both backends and in a resumed run. Give tensors that are stepped
    separately different seeds. ``num_threads`` and ``grad_sq_norm`` as for
    ``adam_step``.

    Raises ``ValueError`` naming the argument for a wrong dtype, device, numel,
    layout, overlap, state dtype, seed or hyperparameter.
    """
    return _compact_step(
        False, master, grad, exp_avg, exp_avg_sq, state_dtype=state_dtype, step=step, lr=lr,
        beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, seed=seed, adamw=adamw,
        bias_correction=bias_correction, exp_avg_scale=exp_avg_scale,
        exp_avg_sq_scale=exp_avg_sq_scale, param_out=param_out, num_threads=num_threads,
        grad_sq_norm=grad_sq_norm,
    )  # fmt: skip


@torch.no_grad()
def adam_step_compact_reference(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    state_dtype: str,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    seed: int,
    adamw: bool = True,
    bias_correction: bool = True,
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
    param_out: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """``adam_step_compact`` computed with torch ops, whatever the backend (same bits); ``num_threads`` is checked
    and ignored."""
    _compact_step(
        True, master, grad, exp_avg, exp_avg_sq, state_dtype=state_dtype, step=step, lr=lr,
        beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, seed=seed, adamw=adamw,
        bias_correction=bias_correction, exp_avg_scale=exp_avg_scale,
        exp_avg_sq_scale=exp_avg_sq_scale, param_out=param_out, num_threads=num_threads,
    )  # fmt: skip


def _compact_step(
    use_reference: bool,
    master, grad, exp_avg, exp_avg_sq, *, state_dtype, step, lr, beta1, beta2, eps, weight_decay,
    seed, adamw, bias_correction, exp_avg_scale, exp_avg_sq_scale, param_out, num_threads, grad_sq_norm=False,
) -> float | None:  # fmt: skip
    compact.check_state_dtype(state_dtype)
    seed = compact.check_seed(seed)
    constants = AdamConstants.for_step(
        step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        adamw=adamw, bias_correction=bias_correction,
    )  # fmt: skip
    check_compact_tensors(state_dtype, master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_out)
    threads = check_num_threads(num_threads)
    kernel = not use_reference and backend() == "cpp"
    sq_norm = _sq_norm_out(grad_sq_norm) if kernel else None
    if state_dtype == "fp32":
        if kernel:
            extension.adam_update(constants, master, grad, exp_avg, exp_avg_sq, param_out, threads=threads,
                                  grad_sq_norm=sq_norm)
        else:
            reference.adam_update(constants, master, grad, exp_avg, exp_avg_sq, param_out)
        return None if sq_norm is None else float(sq_norm)
    if param_out is not None and param_out.dtype == master.dtype and param_out.data_ptr() == master.data_ptr():
        param_out = None  # it is the master, which the step writes anyway
    keys = compact.step_keys(seed, step)
    states = (master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param_out)
    if kernel:
        extension.adam_update_compact(constants, state_dtype, keys, *states, threads=threads, grad_sq_norm=sq_norm)
    else:
        reference_compact.adam_update_compact(constants, state_dtype, keys, *states)
    return None if sq_norm is None else float(sq_norm)


def _sq_norm_out(wanted: bool) -> torch.Tensor | None:
    """The one-element fp64 tensor the kernel writes the gradient's squared norm to, where it is wanted."""
    return torch.zeros(1, dtype=torch.float64) if wanted else None


def check_num_threads(num_threads: object) -> int:
    """The kernel's team size for ``num_threads`` (0: torch's count), or ``ValueError`` naming it."""
    if num_threads is None:
        return 0
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be None (torch's thread count) or a positive int, got {num_threads!r}")
    return num_threads


def check_compact_tensors(
    state_dtype: str,
    master: object,
    grad: object,
    exp_avg: object,
    exp_avg_sq: object,
    exp_avg_scale: object | None,
    exp_avg_sq_scale: object | None,
    param_out: object | None,
) -> None:
    """Raises ``ValueError`` naming the first tensor argument that does not fit ``state_dtype``."""
    compact.check_state_dtype(state_dtype)
    if state_dtype == "fp32":
        for name, t in (("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale)):
            if t is not None:
                raise ValueError(f"{name} must be None for state_dtype fp32 (it has no scales)")
        check_tensors(master, grad, exp_avg, exp_avg_sq, param_out)
        return
    moment = (torch.bfloat16,) if state_dtype == "bf16" else (torch.uint8,)
    numel = _check_tensor("master", master, (torch.bfloat16,), None, "master")
    named = [("master", master, numel)]
    for name, t, allowed in (
        ("grad", grad, _GRAD_DTYPES),
        ("exp_avg", exp_avg, moment),
        ("exp_avg_sq", exp_avg_sq, moment),
        ("param_out", param_out, _OUT_DTYPES),
    ):
        if t is not None or name != "param_out":
            _check_tensor(name, t, allowed, numel, "master")
            named.append((name, t, numel))
    blocks = compact.num_blocks(numel)
    for name, t in (("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale)):
        if state_dtype == "bf16":
            if t is not None:
                raise ValueError(f"{name} must be None for state_dtype bf16 (it has no scales)")
            continue
        if t is None:
            raise ValueError(f"{name} is required for state_dtype int8 (one fp32 per block of {compact.BLOCK_NUMEL})")
        if isinstance(t, torch.Tensor) and t.numel() != blocks:
            raise ValueError(
                f"{name} has {t.numel()} elements; master's {numel} elements need {blocks} "
                f"(one per block of {compact.BLOCK_NUMEL})"
            )
        _check_tensor(name, t, _FP32, blocks, "master")
        named.append((name, t, blocks))
    if numel == 0:
        return
    spans = [(name, t.data_ptr(), t.data_ptr() + k * t.element_size()) for name, t, k in named]
    for i, (a, a_lo, a_hi) in enumerate(spans):
        for b, b_lo, b_hi in spans[i + 1 :]:
            same_master = a == "master" and b == "param_out" and (a_lo, a_hi) == (b_lo, b_hi) and param_out.dtype == torch.bfloat16
            if a_lo < b_hi and b_lo < a_hi and not same_master:
                raise ValueError(f"{a} and {b} overlap in memory; each needs its own buffer")


def _check_tensor(name: str, t: object, allowed: tuple, numel: int | None, first: str = "param") -> int:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must be {names}, got {str(t.dtype).removeprefix('torch.')}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got {t.layout}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, {first} has {numel}")
    return t.numel()


def _requested_backend() -> str:
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "cpp", "torch"):
        raise ValueError(f"{BACKEND_ENV} must be 'auto', 'cpp' or 'torch', got {value!r}")
    return value
