"""The squared gradient norm in fp64 (infinity/grads/norm.py): the C++ kernel where it is built, else chunked
through a small buffer in torch ops; both against the exact sum."""

import math

import copy

import pytest
import torch

import infinity
from helpers import TinyGPT, engine_config, gpt_batches, kernel_bodies, train_batches
from infinity import kernels
from infinity.grads import reducer
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


# ---------------------------------------------------------------------------
# The norm summed by the Adam kernels in their own pass (csrc/sq_norm.h)

_SIZES = [1, 17, 1 << 16, (1 << 16) + 1, 3 * (1 << 16) + 5]


def _states(state_dtype: str, n: int) -> dict:
    master = torch.randn(n, generator=torch.Generator().manual_seed(n))
    if state_dtype == "fp32":
        return {"master": master, "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
    return kernels.compact.from_fp32(state_dtype, master, torch.zeros(n), torch.zeros(n))


def _step(isa: str, state_dtype: str, states: dict, grad, out, threads: int, sq_norm) -> None:
    from infinity.kernels import extension
    from infinity.kernels.constants import AdamConstants

    constants = AdamConstants.for_step(step=3, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                       adamw=True, bias_correction=True)
    if state_dtype == "fp32":
        extension.adam_update(constants, states["master"], grad, states["exp_avg"], states["exp_avg_sq"], out,
                              isa=isa, threads=threads, grad_sq_norm=sq_norm)
        return
    extension.adam_update_compact(constants, state_dtype, (5, 6), states["master"], grad, states["exp_avg"],
                                  states["exp_avg_sq"], states.get("exp_avg_scale"), states.get("exp_avg_sq_scale"),
                                  out, isa=isa, threads=threads, grad_sq_norm=sq_norm)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_the_adam_kernels_sum_the_norms_bits_in_their_own_pass(cpp_ready, state_dtype):
    """Every body, gradient dtype, size around the norm's blocks and team size: the norm an update sums as it
    reads the gradients is sq_norm_fp64's to the bit, and the update is the one made without it."""
    for isa in kernel_bodies():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for n in _SIZES:
                grad = (torch.randn(n, generator=torch.Generator().manual_seed(n + 1)) * 3).to(dtype)
                expected = kernels.sq_norm_fp64(grad, num_threads=1)
                for threads in (1, 3):
                    plain, summed = _states(state_dtype, n), _states(state_dtype, n)
                    out_plain, out_summed = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
                    sq_norm = torch.full((1,), -1.0, dtype=torch.float64)
                    _step(isa, state_dtype, plain, grad, out_plain, threads, None)
                    _step(isa, state_dtype, summed, grad, out_summed, threads, sq_norm)
                    where = f"isa={isa} grad={dtype} n={n} threads={threads}"
                    assert float(sq_norm) == expected, where
                    assert torch.equal(out_plain, out_summed), where
                    for name in plain:
                        assert torch.equal(plain[name], summed[name]), f"{name}: {where}"


def test_the_public_steps_return_the_norm_only_when_asked(cpp_ready):
    n = (1 << 16) + 3
    grad = torch.randn(n, generator=torch.Generator().manual_seed(3))
    grad[n - 1] = float("inf")
    states = _states("fp32", n)
    hyper = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    assert kernels.adam_step(states["master"], grad, states["exp_avg"], states["exp_avg_sq"], **hyper) is None
    assert kernels.adam_step(states["master"], grad, states["exp_avg"], states["exp_avg_sq"], grad_sq_norm=True,
                             **hyper) == math.inf
    finite = grad[:-1].contiguous()
    compact = _states("int8", n - 1)
    got = kernels.adam_step_compact(compact["master"], finite, compact["exp_avg"], compact["exp_avg_sq"],
                                    state_dtype="int8", seed=1, exp_avg_scale=compact["exp_avg_scale"],
                                    exp_avg_sq_scale=compact["exp_avg_sq_scale"], grad_sq_norm=True, **hyper)
    assert got == kernels.sq_norm_fp64(finite)


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_the_overlapped_step_takes_its_norms_in_the_updates(cpp_ready, tmp_path, monkeypatch, optimizer, clip):
    """The sub-groups updated during backward have their norms summed by the kernel that updates them: no pass
    of their own over the gradients, and the same global norms, losses and weights as the step after backward.
    Clipping at 0.05 clips every step: speculation stops once the norms seen say so, and is undone."""
    passes = []

    def counted(values, **kwargs):
        passes.append(values.numel())
        return sq_norm_fp64(values, **kwargs)

    monkeypatch.setattr(reducer, "sq_norm_fp64", counted)  # the reducer's own pass over a sub-group
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(4, batch=2)
    runs = {}
    for overlap in (True, False):
        folder = tmp_path / str(overlap)
        folder.mkdir()
        config = engine_config(param="cpu", optimizer=optimizer, nvme_path=str(folder), accum=1, clip=clip, lr=3e-3,
                               sub_group_size=4096, overlap_step_with_backward=overlap,
                               overlap_step_with_forward=False)
        engine = infinity.initialize(copy.deepcopy(model), config)
        try:
            passes.clear()
            norms, during_backward = [], []
            for batch in batches:
                losses = train_batches(engine, [batch])
                norms.append((losses[0], engine.get_global_grad_norm()))
                during_backward.append(engine.step_metrics().get("sub_groups_during_backward", 0))
            weights = {name: value.clone() for name, value in engine.full_state_dict().items()}
            groups = len(engine.layout.sub_groups)
            runs[overlap] = (norms, weights, list(passes), during_backward, engine.optimizer.rollbacks)
        finally:
            engine.close()
    norms, weights, passes_overlapped, during_backward, rollbacks = runs[True]
    assert norms == runs[False][0]
    for name, value in weights.items():
        assert torch.equal(value, runs[False][1][name]), name
    assert len(runs[False][2]) == len(batches) * groups  # the step after backward: a pass per sub-group
    if clip == 0.0:
        assert during_backward == [groups] * len(batches)  # all updated during backward ...
        assert passes_overlapped == []                     # ... each norm taken in its update
    else:
        assert rollbacks > 0
        # the first step speculates until the norms it took in its updates say it clips; the others do not
        # speculate (their updates follow a clipped step): they take every norm in a pass of its own
        assert 0 < len(passes_overlapped) < len(batches) * groups
