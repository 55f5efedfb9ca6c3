"""The squared gradient norm in fp64 (infinity/grads/norm.py): the C++ kernel where it is built, else chunked
through a small buffer in torch ops; both against the exact sum."""

import math

import pytest
import torch

from infinity import kernels
from infinity.grads.norm import HOST_CHUNK_NUMEL, sq_norm_fp64


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """Each test once through the C++ kernel (skipped where it is not built) and once through torch ops."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "sq_norm_fp64", lambda values, num_threads=None: None)
    elif kernels.backend() != "cpp":
        pytest.skip("the C++ kernel is not built here")
    return request.param


def _reference(values: torch.Tensor) -> float:
    # math.fsum of exact fp64 squares: an fp32 value's square is exact in fp64, so this is the true sum
    # rounded once.
    return math.fsum(x * x for x in values.double().tolist())


@pytest.mark.parametrize("numel", [1, 1000, HOST_CHUNK_NUMEL, 3 * HOST_CHUNK_NUMEL + 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_exact_sum_of_squares(path, numel, dtype):
    values = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    assert sq_norm_fp64(values) == pytest.approx(_reference(values), rel=1e-12)


def test_the_same_tensor_gives_the_same_bits(path):
    values = torch.randn(2 * HOST_CHUNK_NUMEL + 5, generator=torch.Generator().manual_seed(1))
    assert sq_norm_fp64(values) == sq_norm_fp64(values.clone())


def test_finite_exactly_when_every_value_is(path):
    # Squares above fp32's range stay finite in fp64: the fp16 overflow check must not fire on them.
    big = torch.full((10,), 1e30)
    assert sq_norm_fp64(big) == pytest.approx(10 * 1e60, rel=1e-6)
    for bad in (float("inf"), float("-inf"), float("nan")):
        values = torch.ones(HOST_CHUNK_NUMEL + 3)
        values[HOST_CHUNK_NUMEL + 1] = bad
        assert not math.isfinite(sq_norm_fp64(values))


def test_empty_is_zero(path):
    assert sq_norm_fp64(torch.empty(0)) == 0.0


def test_the_kernel_gives_the_same_bits_on_any_number_of_threads():
    if kernels.backend() != "cpp":
        pytest.skip("the C++ kernel is not built here")
    values = torch.randn(40 * (1 << 16) + 9, generator=torch.Generator().manual_seed(2)).bfloat16()
    threads = torch.get_num_threads()
    try:
        results = set()
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.add(kernels.sq_norm_fp64(values))
    finally:
        torch.set_num_threads(threads)
    assert len(results) == 1


def test_the_kernel_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="contiguous float32/bfloat16/float16 CPU tensor, got torch.float64"):
        kernels.sq_norm_fp64(torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="not contiguous"):
        kernels.sq_norm_fp64(torch.ones(4, 4).t())
