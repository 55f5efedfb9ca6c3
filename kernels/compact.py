"""Compact optimizer states: their formats, sizes and conversions, in torch ops.

We say *state dtype* for how one parameter's optimizer state is stored:

===========  ==========  ============  ==============  ==========================  =============
state dtype  master      exp_avg       exp_avg_sq      per block of 256 elements   bytes/element
===========  ==========  ============  ==============  ==========================  =============
``fp32``     fp32        fp32          fp32            -                           12
``bf16``     bf16 (SR)   bf16          bf16 (SR)       -                           6
``int8``     bf16 (SR)   uint8 code    uint8 code      2 fp32 scales (8 bytes)     4.03125
===========  ==========  ============  ==============  ==========================  =============

*SR* is stochastic rounding: an fp32 value is rounded to bf16 up or down with
probabilities given by its distance to each, so updates smaller than half a
bf16 ulp still move the value on average. In ``bf16`` the second moment is
rounded that way too, not just the master: with ``beta2 = 0.999`` a step changes
``exp_avg_sq`` by 0.1 %, below half a bf16 ulp (0.2 %), so round-to-nearest
would leave it stuck and it would never decay. The first moment moves by
``1 - beta1`` = 10 % of ``g - m`` per step and is rounded to nearest.

The random bits are a counter-based hash of ``(seed, step, element index)``
(``random_bits``; in ``int8``, whose only stochastic rounding is the master's,
one hash serves two elements: ``random_bits16_shared``), so the C++ kernel and
the torch reference draw the same bits and a resumed run draws the bits an
uninterrupted one would. The index is the
element's position in the tensor given to the step; tensors that are stepped
separately should get different seeds (the engine derives one per sub-group).

``int8`` stores each moment as one byte per element plus one fp32 scale per
block of ``BLOCK_NUMEL`` (256) elements, like 8-bit Adam (bitsandbytes,
torchao). Our codes are small floating-point formats relative to the block's
scale, computed with bit operations instead of a table search:

* ``exp_avg`` (signed): scale = the block's largest ``|m|``; the byte holds the
  sign bit of ``m`` (bit 7) and ``|m| / scale`` as a float with 3 exponent and 4
  mantissa bits (``EXP_AVG_CODE``): relative error at most 1/32 down to 2**-6 of
  the scale, then evenly spaced steps of 2**-10 of the scale.
* ``exp_avg_sq`` (non-negative): stored as its square root, which is what the
  step divides by; scale = the block's largest ``sqrt(v)``; the byte holds
  ``sqrt(v) / scale`` with 2 exponent and 6 mantissa bits (``EXP_AVG_SQ_CODE``):
  relative error in ``sqrt(v)`` at most 1/128 down to 1/4 of the scale, then
  evenly spaced steps of 2**-8 of the scale (``v`` down to 2**-16 of the block's
  largest). A non-zero ``sqrt(v)`` never becomes code 0, so a small ``v`` never
  turns into a division by ``eps`` alone (the 8-bit literature's zero-point
  problem); it is rounded up to 2**-8 of the scale, which shrinks that step.

Why these splits: a moment changes by a small fraction per step (``v`` by
``1 - beta2`` = 0.1 %), less than half a code step, so with nearest rounding an
element's code moves only when its value relative to the block's largest has
drifted by half a step. The error that leaves in ``v`` grows with the code's
step; with 6 mantissa bits on ``sqrt(v)`` it was half that of 4 exponent and 4
mantissa bits, and stochastic rounding of the codes did no better (it trades the
lag for noise). The block's scale itself is exact every step, so a moment that
decays or grows as a whole is tracked exactly.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

STATE_DTYPES = ("fp32", "bf16", "int8")
"""The state dtypes, ``fp32`` first (the default)."""

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
"""The optimizer's states, whatever their dtype: each is held by one tensor of ``state_layout``, plus (``int8``
moments) a tensor of block scales (``state_parts``). Checkpoints file them under these names."""

BLOCK_NUMEL = 256
"""Elements per quantization block of the ``int8`` moments (one fp32 scale each)."""

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One tensor of a parameter's optimizer state: its name, dtype and numel."""

    name: str
    """``master``, ``exp_avg``, ``exp_avg_sq``, ``exp_avg_scale`` or ``exp_avg_sq_scale``."""
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def check_state_dtype(state_dtype: object) -> str:
    """Returns ``state_dtype`` if it is one of ``STATE_DTYPES``, else raises ``ValueError``."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {', '.join(STATE_DTYPES)}, got {state_dtype!r}")
    return state_dtype  # type: ignore[return-value]


def num_blocks(numel: int) -> int:
    """Quantization blocks of ``numel`` elements (the last may be partial)."""
    return -(-numel // BLOCK_NUMEL)


def state_layout(state_dtype: str, numel: int) -> tuple[StateTensor, ...]:
    """The tensors that hold the optimizer state of ``numel`` parameters, in a fixed order.

    The order is the one ``empty_state`` returns and a swap file can lay out.
    """
    check_state_dtype(state_dtype)
    if isinstance(numel, bool) or not isinstance(numel, numbers.Integral) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    numel = int(numel)
    if state_dtype == "fp32":
        f = torch.float32
        return (StateTensor("master", f, numel), StateTensor("exp_avg", f, numel), StateTensor("exp_avg_sq", f, numel))
    if state_dtype == "bf16":
        b = torch.bfloat16
        return (StateTensor("master", b, numel), StateTensor("exp_avg", b, numel), StateTensor("exp_avg_sq", b, numel))
    blocks = num_blocks(numel)
    return (
        StateTensor("master", torch.bfloat16, numel),
        StateTensor("exp_avg", torch.uint8, numel),
        StateTensor("exp_avg_sq", torch.uint8, numel),
        StateTensor("exp_avg_scale", torch.float32, blocks),
        StateTensor("exp_avg_sq_scale", torch.float32, blocks),
    )


def state_nbytes(state_dtype: str, numel: int) -> int:
    """Bytes of the optimizer state (master, moments, scales) of ``numel`` parameters."""
    return sum(t.nbytes for t in state_layout(state_dtype, numel))


def state_bytes_per_element(state_dtype: str) -> float:
    """Bytes per parameter for large tensors: 12 (fp32), 6 (bf16), 4.03125 (int8)."""
    check_state_dtype(state_dtype)
    return {"fp32": 12.0, "bf16": 6.0, "int8": 4.0 + 8.0 / BLOCK_NUMEL}[state_dtype]


def checkpoint_dtype(state_dtype: str, name: str) -> torch.dtype:
    """The dtype a checkpoint stores one state (``master``, ``exp_avg``, ``exp_avg_sq``) in: the narrowest
    that holds each element's value exactly, per element, so that checkpoints still reshard per parameter.
    Master and moments take 12 bytes a parameter with ``fp32`` states, 6 with ``bf16``, 10 with ``int8``.

    ``bf16`` states and every bf16 master are bf16. An ``int8`` moment is its code times its block's scale,
    which needs fp32. The codes themselves cannot be stored instead: a block of 256 elements straddles
    parameters, and a checkpoint keeps one tensor per parameter so that it can be resharded.
    """
    check_state_dtype(state_dtype)
    if name not in STATE_NAMES:
        raise ValueError(f"unknown optimizer state {name!r}; one of {', '.join(STATE_NAMES)}")
    if state_dtype == "bf16" or (state_dtype == "int8" and name == "master"):
        return torch.bfloat16
    return torch.float32


def checkpoint_bytes_per_element(state_dtype: str) -> int:
    """Checkpoint bytes of master and moments per parameter (``checkpoint_dtype``): 12, 6 (bf16) or 10 (int8)."""
    return sum(checkpoint_dtype(state_dtype, name).itemsize for name in STATE_NAMES)


def empty_state(state_dtype: str, numel: int, *, empty=torch.empty) -> dict[str, torch.Tensor]:
    """Uninitialised state tensors by name (``empty(numel, dtype=...)`` allocates each)."""
    return {t.name: empty(t.numel, dtype=t.dtype) for t in state_layout(state_dtype, numel)}


# ---------------------------------------------------------------------------
# Random bits for stochastic rounding


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an int in [0, 2**64), got {type(seed).__name__}")
    if not 0 <= seed <= _MASK64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return int(seed)


def step_keys(seed: int, step: int) -> tuple[int, int]:
    """The two 32-bit keys of one step's random bits (see ``random_bits``)."""
    key = _splitmix64(_splitmix64(seed) ^ (step & _MASK64))
    return key & _MASK32, key >> 32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 tensors holding uint32 values, without overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash ("lowbias32", C. Wellons), on int64 tensors of uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_bits(keys: tuple[int, int], index: torch.Tensor) -> torch.Tensor:
    """32 random bits (int64 tensor) per int64 element index under a step's keys.

    ``h = mix32(((lo32(i) + k0) mod 2**32) ^ mix32(hi32(i) + k1))``: one hash per
    element (the second depends only on the index's high half, so the kernel
    computes it once per block). The master's rounding takes ``h >> 16``, and in
    ``bf16`` the second moment's takes ``h & 0xFFFF``.
    """
    k0, k1 = keys
    high = _mix32(((index >> 32) + k1) & _MASK32)
    return _mix32((((index & _MASK32) + k0) & _MASK32) ^ high)


def random_bits16_shared(keys: tuple[int, int], index: torch.Tensor) -> torch.Tensor:
    """16 random bits (int64 tensor) per int64 element index, one ``random_bits`` hash per two elements.

    In each group of 16 elements, elements ``i`` and ``i + 8`` share hash number
    ``(i >> 4) * 8 + (i & 7)``: the first takes its high half, the second its low
    half. The ``int8`` form's master rounding uses these (it needs 16 bits per
    element); the pairing is the one the kernel's 8-lane vectors take without
    shuffles.
    """
    h = random_bits(keys, ((index >> 4) << 3) | (index & 7))
    return torch.where((index & 8) != 0, h & 0xFFFF, h >> 16)


def _bits32(x: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor's bit patterns as int64 values in [0, 2**32)."""
    return x.view(torch.int32).to(torch.int64) & _MASK32


def _from_bits32(u: torch.Tensor) -> torch.Tensor:
    """fp32 values from int64 tensors of bit patterns in [0, 2**32)."""
    return torch.where(u >= 1 << 31, u - (1 << 32), u).to(torch.int32).view(torch.float32)


def _bf16_from_bits(h: torch.Tensor) -> torch.Tensor:
    """bf16 values from int64 tensors of bit patterns in [0, 2**16)."""
    return torch.where(h >= 1 << 15, h - (1 << 16), h).to(torch.int16).view(torch.bfloat16)


def bf16_stochastic_round(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to bf16 by adding 16 random bits ``r16`` below the cut and truncating.

    Infinities stay infinite and NaN becomes 0xFFFF, as in the kernel's nearest rounding.
    """
    u = _bits32(x)
    rounded = ((u + r16) >> 16) & 0xFFFF
    special = (u & 0x7F800000) == 0x7F800000
    special_bits = torch.where(x.isnan(), 0xFFFF, u >> 16)
    return _bf16_from_bits(torch.where(special, special_bits, rounded))


# ---------------------------------------------------------------------------
# The int8 moment codes


def _round_half_even(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)  # torch.round rounds halves to even


# The two codes: (exponent bits, mantissa bits).
EXP_AVG_CODE = (3, 4)
"""``exp_avg``: sign bit + 3 exponent + 4 mantissa bits of ``|m| / scale``."""
EXP_AVG_SQ_CODE = (2, 6)
"""``exp_avg_sq``: 2 exponent + 6 mantissa bits of ``sqrt(v) / scale``."""


def _code_consts(exp_bits: int, mantissa_bits: int) -> tuple[int, int]:
    """(fp32 exponent field of the code's exponent 0, the smallest normal exponent)."""
    min_exp = -(2**exp_bits - 2)
    return 127 - (2**exp_bits - 1), min_exp


def encode_unit(y: torch.Tensor, exp_bits: int, mantissa_bits: int) -> torch.Tensor:
    """Codes (int64) of ``y`` in [0, 1] as a small unsigned float, rounded to nearest even.

    Code ``(e << mb) | f`` (``mb`` = mantissa_bits) means ``2**(e - 2**exp_bits + 1) *
    (1 + f / 2**mb)`` for e >= 1 and ``f * 2**(min_exp - mb)`` for e = 0, where
    ``min_exp = 2 - 2**exp_bits``; 1.0 (code ``(2**exp_bits - 1) << mb``) is the
    largest code used.
    """
    field, min_exp = _code_consts(exp_bits, mantissa_bits)
    drop = 23 - mantissa_bits
    u = _bits32(y)
    r = u + ((1 << (drop - 1)) - 1) + ((u >> drop) & 1)
    normal = (r >> drop) - (field << mantissa_bits)
    subnormal = _round_half_even(y * 2.0 ** (mantissa_bits - min_exp)).to(torch.int64)
    return torch.where(y < 2.0**min_exp, subnormal, normal)


def decode_unit(code: torch.Tensor, exp_bits: int, mantissa_bits: int) -> torch.Tensor:
    """fp32 values of ``encode_unit``'s codes (int64)."""
    field, min_exp = _code_consts(exp_bits, mantissa_bits)
    normal = _from_bits32((code + (field << mantissa_bits)) << (23 - mantissa_bits))
    subnormal = code.to(torch.float32) * 2.0 ** (min_exp - mantissa_bits)
    return torch.where(code < 1 << mantissa_bits, subnormal, normal)


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """The largest ``|x|`` of each block of ``BLOCK_NUMEL`` (NaN skipped; 0 for an all-zero block)."""
    n = x.numel()
    a = x.abs().nan_to_num(nan=0.0, posinf=math.inf, neginf=math.inf)
    pad = num_blocks(n) * BLOCK_NUMEL - n
    if pad:
        a = torch.cat([a, a.new_zeros(pad)])
    return a.view(-1, BLOCK_NUMEL).amax(dim=1)


def _unit(x_abs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``min(|x| * (1 / scale), 1)`` per element (1 for NaN), the inverse 0 for a scale of 0 or inf."""
    finite = (scales > 0) & (scales < math.inf)
    inv = torch.where(finite, 1.0 / torch.where(finite, scales, 1.0), 0.0)
    y = x_abs * inv.repeat_interleave(BLOCK_NUMEL)[: x_abs.numel()]
    return torch.where(y < 1.0, y, 1.0)


def quantize_exp_avg(m: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Codes (uint8) of fp32 ``m`` under its block scales (``block_scales(m)``), nearest even."""
    mag = encode_unit(_unit(m.abs(), scales), *EXP_AVG_CODE)
    sign = (_bits32(m) >> 24) & 128  # the sign bit: -0.0 keeps it
    return (sign | mag).to(torch.uint8)


def dequantize_exp_avg(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.int64)
    mag = decode_unit(c & 127, *EXP_AVG_CODE)
    mag = torch.where(c >= 128, -mag, mag)
    return mag * scales.repeat_interleave(BLOCK_NUMEL)[: c.numel()]


def quantize_exp_avg_sq(root: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Codes (uint8) of ``root = sqrt(v)`` under its block scales (``block_scales(root)``).

    Nearest even; a positive root that would get code 0 gets code 1.
    """
    code = encode_unit(_unit(root, scales), *EXP_AVG_SQ_CODE)
    code = torch.where((code == 0) & (root > 0), 1, code)
    return code.to(torch.uint8)


def dequantize_exp_avg_sq(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``exp_avg_sq`` (fp32) from its codes: the root decoded and scaled, then squared."""
    root = decode_unit(codes.to(torch.int64), *EXP_AVG_SQ_CODE) * scales.repeat_interleave(BLOCK_NUMEL)[: codes.numel()]
    return root * root


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (torch's fp32 sqrt on CPU is not; see reference.py)."""
    return v.double().sqrt().float()


# ---------------------------------------------------------------------------
# Conversions between fp32 states and compact ones (checkpoints, consolidation)


@torch.no_grad()
def from_fp32(state_dtype: str, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 master and moments in ``state_dtype``'s form (new tensors, by name as ``state_layout``).

    Rounded to nearest (no random bits): a conversion, not a step. ``exp_avg_sq``
    must be >= 0.
    """
    check_state_dtype(state_dtype)
    flat = []
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be a float32 torch.Tensor")
        if t.numel() != master.numel():
            raise ValueError(f"{name} has {t.numel()} elements, master has {master.numel()}")
        flat.append(t.detach().reshape(-1).cpu())
    p, m, v = flat
    if state_dtype == "fp32":
        return {"master": p.clone(), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    if state_dtype == "bf16":
        return {"master": p.bfloat16(), "exp_avg": m.bfloat16(), "exp_avg_sq": v.bfloat16()}
    root = sqrt_rn(v)
    m_scale, v_scale = block_scales(m), block_scales(root)
    return {
        "master": p.bfloat16(),
        "exp_avg": quantize_exp_avg(m, m_scale),
        "exp_avg_sq": quantize_exp_avg_sq(root, v_scale),
        "exp_avg_scale": m_scale,
        "exp_avg_sq_scale": v_scale,
    }


@torch.no_grad()
def to_fp32(state_dtype: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 ``master``, ``exp_avg``, ``exp_avg_sq`` (new flat tensors) from a state in ``state_dtype``'s form."""
    check_state_dtype(state_dtype)
    numel = state["master"].numel() if "master" in state else None
    for spec in state_layout(state_dtype, numel or 0):
        t = state.get(spec.name)
        if not isinstance(t, torch.Tensor) or t.dtype != spec.dtype or t.numel() != spec.numel:
            raise ValueError(
                f"state[{spec.name!r}] must be a {str(spec.dtype).removeprefix('torch.')} tensor of "
                f"{spec.numel} elements for state_dtype {state_dtype}"
            )
    p, m, v = (state[k].reshape(-1).cpu() for k in ("master", "exp_avg", "exp_avg_sq"))
    if state_dtype != "int8":
        return {"master": p.float(), "exp_avg": m.float(), "exp_avg_sq": v.float()}
    return {
        "master": p.float(),
        "exp_avg": dequantize_exp_avg(m, state["exp_avg_scale"].cpu()),
        "exp_avg_sq": dequantize_exp_avg_sq(v, state["exp_avg_sq_scale"].cpu()),
    }


def state_parts(state_dtype: str, name: str) -> tuple[str, ...]:
    """The tensors (``state_layout`` names) that hold one state (``master``, ``exp_avg``, ``exp_avg_sq``)."""
    check_state_dtype(state_dtype)
    if name not in STATE_NAMES:
        raise ValueError(f"unknown optimizer state {name!r}; one of {', '.join(STATE_NAMES)}")
    return (name, f"{name}_scale") if state_dtype == "int8" and name != "master" else (name,)


@torch.no_grad()
def state_from_fp32(state_dtype: str, name: str, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """One fp32 state in ``state_dtype``'s form, by part (``state_parts``), as :func:`from_fp32` makes it:
    rounded to nearest, each int8 moment with the block scales of its own values. New tensors."""
    parts = state_parts(state_dtype, name)
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 torch.Tensor")
    flat = values.detach().reshape(-1).cpu()
    if state_dtype == "fp32":
        return {name: flat.clone()}
    if state_dtype == "bf16" or name == "master":
        return {name: flat.bfloat16()}
    if name == "exp_avg":
        scales = block_scales(flat)
        return {parts[0]: quantize_exp_avg(flat, scales), parts[1]: scales}
    root = sqrt_rn(flat)
    scales = block_scales(root)
    return {parts[0]: quantize_exp_avg_sq(root, scales), parts[1]: scales}


@torch.no_grad()
def state_to_fp32(state_dtype: str, name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """One state in fp32 (a new flat tensor) from its parts in ``state_dtype``'s form (``state_parts``)."""
    names = state_parts(state_dtype, name)
    value = parts[names[0]].reshape(-1).cpu()
    if state_dtype != "int8" or name == "master":
        return value.float()
    scales = parts[names[1]].cpu()
    return dequantize_exp_avg(value, scales) if name == "exp_avg" else dequantize_exp_avg_sq(value, scales)


CONVERT_CHUNK_NUMEL = 1 << 20
"""Elements converted at a time by the ``_into`` conversions (whole blocks), which bounds their temporaries."""


@torch.no_grad()
def state_to_fp32_into(state_dtype: str, name: str, parts: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """:func:`state_to_fp32` into ``out`` (flat fp32), a chunk of :data:`CONVERT_CHUNK_NUMEL` at a time."""
    names = state_parts(state_dtype, name)
    for lo in range(0, out.numel(), CONVERT_CHUNK_NUMEL):
        hi = min(lo + CONVERT_CHUNK_NUMEL, out.numel())
        chunk = {names[0]: parts[names[0]][lo:hi]}
        if len(names) > 1:
            chunk[names[1]] = parts[names[1]][lo // BLOCK_NUMEL:num_blocks(hi)]
        out[lo:hi].copy_(state_to_fp32(state_dtype, name, chunk))


@torch.no_grad()
def state_from_fp32_into(state_dtype: str, name: str, values: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
    """:func:`state_from_fp32` into ``parts`` (the tensors ``state_parts`` names, sized by ``state_layout``), a
    chunk of :data:`CONVERT_CHUNK_NUMEL` at a time (whole blocks: the same scales as the whole)."""
    names = state_parts(state_dtype, name)
    for lo in range(0, values.numel(), CONVERT_CHUNK_NUMEL):
        hi = min(lo + CONVERT_CHUNK_NUMEL, values.numel())
        chunk = state_from_fp32(state_dtype, name, values[lo:hi])
        parts[names[0]][lo:hi].copy_(chunk[names[0]])
        if len(names) > 1:
            parts[names[1]][lo // BLOCK_NUMEL:num_blocks(hi)].copy_(chunk[names[1]])


def convert(state: dict[str, torch.Tensor], from_dtype: str, to_dtype: str) -> dict[str, torch.Tensor]:
    """A state in ``from_dtype``'s form converted to ``to_dtype``'s (through fp32)."""
    fp32 = to_fp32(from_dtype, state)
    return from_fp32(to_dtype, fp32["master"], fp32["exp_avg"], fp32["exp_avg_sq"])


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
