"""The squared gradient norm in fp64, chunked through a small buffer (infinity/grad_norm.py)."""

import math

import pytest
import torch

from infinity.grad_norm import HOST_CHUNK_NUMEL, sq_norm_fp64


def _reference(values: torch.Tensor) -> float:
    # math.fsum of exact fp64 squares: an fp32 value's square is exact in fp64, so this is the true sum
    # rounded once.
    return math.fsum(x * x for x in values.double().tolist())


@pytest.mark.parametrize("numel", [1, 1000, HOST_CHUNK_NUMEL, 3 * HOST_CHUNK_NUMEL + 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_exact_sum_of_squares(numel, dtype):
    values = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    assert sq_norm_fp64(values) == pytest.approx(_reference(values), rel=1e-12)


def test_the_same_tensor_gives_the_same_bits():
    values = torch.randn(2 * HOST_CHUNK_NUMEL + 5, generator=torch.Generator().manual_seed(1))
    assert sq_norm_fp64(values) == sq_norm_fp64(values.clone())


def test_finite_exactly_when_every_value_is():
    # Squares above fp32's range stay finite in fp64: the fp16 overflow check must not fire on them.
    big = torch.full((10,), 1e30)
    assert sq_norm_fp64(big) == pytest.approx(10 * 1e60, rel=1e-6)
    for bad in (float("inf"), float("-inf"), float("nan")):
        values = torch.ones(HOST_CHUNK_NUMEL + 3)
        values[HOST_CHUNK_NUMEL + 1] = bad
        assert not math.isfinite(sq_norm_fp64(values))


def test_empty_is_zero():
    assert sq_norm_fp64(torch.empty(0)) == 0.0
