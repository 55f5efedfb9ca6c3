"""infinity.kernels.adam_step: numerics against torch.optim, the C++ kernel
against the torch reference (bit for bit), the parameter copy, NaN/inf, and
argument checks. Both backends are tested: "cpp" is adam_step with the kernel
loaded, "torch" is adam_step_reference.
"""

from __future__ import annotations

import functools

import pytest
import torch

import infinity.kernels as kernels
from infinity.kernels import extension, reference
from infinity.kernels.constants import AdamConstants

from helpers import kernel_bodies

pytestmark = pytest.mark.device_independent  # the distinct-device pass leaves it out

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
SIZES = (1, 7, 1_000_003)
LOW_DTYPES = (torch.bfloat16, torch.float16)


@pytest.fixture(params=["cpp", "torch"])
def step_fn(request):
    """adam_step on one backend."""
    if request.param == "cpp":
        request.getfixturevalue("cpp_ready")
        return kernels.adam_step
    return kernels.adam_step_reference


def make_state(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen)
    exp_avg = torch.randn(n, generator=gen).mul_(0.01)
    exp_avg_sq = torch.rand(n, generator=gen).mul_(1e-4)
    return param, exp_avg, exp_avg_sq


def clone_all(*tensors):
    return [None if t is None else t.clone() for t in tensors]


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-6) -> None:
    """Within rtol of the expected value, or of the tensor's scale where it crosses zero."""
    atol = rtol * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------
# Against torch.optim


def grads(n: int, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        yield step, torch.randn(n, generator=gen)


@functools.lru_cache(maxsize=None)
def torch_optim_run(adamw: bool, weight_decay: float, n: int) -> tuple[torch.Tensor, ...]:
    """param, exp_avg, exp_avg_sq after 100 steps of torch.optim (shared by both backends)."""
    optim_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    torch_param = torch.nn.Parameter(make_state(n)[0])
    opt = optim_cls(
        [torch_param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
        weight_decay=weight_decay,
    )  # fmt: skip
    for _, grad in grads(n, 100, seed=1):
        torch_param.grad = grad
        opt.step()
    state = opt.state[torch_param]
    return torch_param.detach(), state["exp_avg"], state["exp_avg_sq"]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
def test_100_steps_match_torch_optim(step_fn, adamw, weight_decay, n):
    param, exp_avg, exp_avg_sq = make_state(n)[0], torch.zeros(n), torch.zeros(n)
    for step, grad in grads(n, 100, seed=1):
        step_fn(param, grad, exp_avg, exp_avg_sq, step=step, weight_decay=weight_decay, adamw=adamw, **HYPER)
    for ours, theirs in zip((param, exp_avg, exp_avg_sq), torch_optim_run(adamw, weight_decay, n)):
        assert_close_to(ours, theirs)


@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
def test_100_steps_match_torch_fused(step_fn, adamw):
    """torch's fused CPU kernel: the operation order we follow (it adds FMA)."""
    n = 100_003
    param, _, _ = make_state(n)
    torch_param = torch.nn.Parameter(param.clone())
    optim_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = optim_cls([torch_param], lr=1e-2, weight_decay=0.1, fused=True)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    gen = torch.Generator().manual_seed(2)
    for step in range(1, 101):
        grad = torch.randn(n, generator=gen)
        torch_param.grad = grad.clone()
        opt.step()
        step_fn(param, grad, exp_avg, exp_avg_sq, step=step, lr=1e-2, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.1, adamw=adamw)  # fmt: skip
    assert_close_to(param, torch_param.detach())


def test_small_beta1_takes_torchs_other_lerp_form(step_fn):
    """beta1 <= 0.5 makes torch's lerp weight >= 0.5, where it computes g - (g-m)*(1-w)."""
    n = 1003
    param, _, _ = make_state(n)
    torch_param = torch.nn.Parameter(param.clone())
    opt = torch.optim.Adam([torch_param], lr=1e-2, betas=(0.3, 0.9), eps=1e-6)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 21):
        grad = torch.randn(n, generator=gen)
        torch_param.grad = grad.clone()
        opt.step()
        step_fn(param, grad, exp_avg, exp_avg_sq, step=step, lr=1e-2, beta1=0.3, beta2=0.9,
                eps=1e-6, weight_decay=0.0, adamw=False)  # fmt: skip
    assert_close_to(param, torch_param.detach())
    assert_close_to(exp_avg, opt.state[torch_param]["exp_avg"])


def test_without_bias_correction_is_plain_adam(step_fn):
    n = 1001
    param, exp_avg, exp_avg_sq = make_state(n)
    grad = torch.randn(n)
    expected = clone_all(param, exp_avg, exp_avg_sq)
    lr, b1, b2, eps = 1e-2, 0.9, 0.99, 1e-8
    # By hand, in float64: no bias correction means step_size = lr, denom = sqrt(v) + eps.
    p64, m64, v64, g64 = (t.double() for t in (*expected, grad))
    m64 = b1 * m64 + (1 - b1) * g64
    v64 = b2 * v64 + (1 - b2) * g64 * g64
    p64 = p64 - lr * m64 / (v64.sqrt() + eps)
    step_fn(param, grad, exp_avg, exp_avg_sq, step=7, lr=lr, beta1=b1, beta2=b2, eps=eps,
            weight_decay=0.0, bias_correction=False)  # fmt: skip
    assert_close_to(param, p64.float())
    assert_close_to(exp_avg, m64.float())
    assert_close_to(exp_avg_sq, v64.float())


# ---------------------------------------------------------------------------
# Low-precision gradients and the parameter copy


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", LOW_DTYPES, ids=str)
def test_low_precision_grads_equal_reference_with_upcast_grads(step_fn, grad_dtype, n):
    ours = list(make_state(n))
    ref = clone_all(*ours)
    gen = torch.Generator().manual_seed(4)
    for step in range(1, 4):
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        step_fn(*ours[:1], grad, *ours[1:], step=step, weight_decay=0.1, **HYPER)
        kernels.adam_step_reference(ref[0], grad.float(), ref[1], ref[2], step=step, weight_decay=0.1, **HYPER)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_param_out_equals_param_cast(step_fn, n, out_dtype):
    param, exp_avg, exp_avg_sq = make_state(n)
    param_out = torch.empty(n, dtype=out_dtype)
    for step in range(1, 3):
        grad = torch.randn(n).to(torch.bfloat16)
        step_fn(param, grad, exp_avg, exp_avg_sq, step=step, weight_decay=0.01, param_out=param_out, **HYPER)
        assert torch.equal(param_out, param.to(out_dtype))


@pytest.mark.parametrize("out_dtype", LOW_DTYPES, ids=str)
def test_param_out_rounds_like_torch_on_hard_values(step_fn, out_dtype):
    """Ties, denormals, overflow, signed zeros; lr=0 keeps param exactly as given."""
    finfo = torch.finfo(out_dtype)
    ulp_at_one = 2.0**-7 if out_dtype == torch.bfloat16 else 2.0**-10
    hard = torch.tensor(
        [1 + ulp_at_one / 2, 1 + 3 * ulp_at_one / 2, -(1 + ulp_at_one / 2), 0.0, -0.0,
         finfo.max, finfo.max * (1 + ulp_at_one / 4), finfo.max * (1 + ulp_at_one), 1e-40, -3e-39,
         finfo.tiny / 3, finfo.smallest_normal * 0.75, 65519.0, 65520.0, 3.4e38, float("inf")],
        dtype=torch.float32,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    param = torch.cat([hard, torch.randn(4000, generator=gen) * torch.logspace(-44, 38, 4000).float()])
    n = param.numel()
    param_out = torch.empty(n, dtype=out_dtype)
    expected = param.to(out_dtype)
    step_fn(param, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, beta1=0.9,
            beta2=0.999, eps=1e-8, weight_decay=0.0, param_out=param_out)  # fmt: skip
    assert torch.equal(param_out.view(torch.int16), expected.view(torch.int16))


# ---------------------------------------------------------------------------
# The kernel against the reference, bit for bit, on every body this CPU runs


@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 100, 4099])
def test_every_body_equals_reference_on_small_sizes(cpp_ready, n):
    """Every body x gradient dtype x copy dtype x decay mode, on sizes around vector widths."""
    modes = [(True, 0.1), (False, 0.1), (True, 0.0)]
    for grad_dtype in (torch.float32, *LOW_DTYPES):
        for out_dtype in (None, torch.float32, *LOW_DTYPES):
            for adamw, wd in modes:
                check_against_reference(n, grad_dtype, out_dtype, adamw, wd, steps=2)


@pytest.mark.parametrize("grad_dtype", [torch.float32, *LOW_DTYPES], ids=str)
def test_every_body_equals_reference_threaded_and_streamed(cpp_ready, grad_dtype):
    """Two threads, chunked; a copy big enough for non-temporal stores, and unaligned."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_against_reference(2_100_003, grad_dtype, torch.bfloat16, True, 0.1, steps=1)
        check_against_reference(1_000_003, grad_dtype, torch.float32, False, 0.1, steps=1, out_offset=1)
    finally:
        torch.set_num_threads(threads)


def check_against_reference(n, grad_dtype, out_dtype, adamw, wd, steps, out_offset=0):
    """Runs the reference once and every kernel body on copies of the same state."""
    state = make_state(n, seed=n)
    step_grads = [(step, g.to(grad_dtype)) for step, g in grads(n, steps, seed=n + 1)]

    def run(update):
        p, m, v = clone_all(*state)
        # out_offset > 0: a view that starts mid-line, so the kernel must peel
        out = None if out_dtype is None else torch.empty(n + out_offset, dtype=out_dtype)[out_offset:]
        for step, grad in step_grads:
            c = AdamConstants.for_step(step=step, weight_decay=wd, adamw=adamw, bias_correction=True, **HYPER)
            update(c, p, grad, m, v, out)
        return p, m, v, out

    expected = run(reference.adam_update)
    for isa in kernel_bodies():
        actual = run(functools.partial(extension.adam_update, isa=isa))
        where = f"isa={isa} n={n} grad={grad_dtype} out={out_dtype} adamw={adamw} wd={wd}"
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "param_out"), actual, expected):
            assert (a is None and b is None) or torch.equal(a, b), f"{name} differs from the reference: {where}"


def test_results_do_not_depend_on_thread_count(cpp_ready):
    n = 1_000_003
    runs = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            param, exp_avg, exp_avg_sq = make_state(n)
            out = torch.empty(n, dtype=torch.bfloat16)
            kernels.adam_step(param, torch.ones(n), exp_avg, exp_avg_sq, step=3, weight_decay=0.1,
                              param_out=out, **HYPER)  # fmt: skip
            runs.append((param, exp_avg, exp_avg_sq, out))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_reference_chunking_does_not_change_results():
    n = 10_007
    a = list(make_state(n))
    b = clone_all(*a)
    grad = torch.randn(n).to(torch.float16)
    outs = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    c = AdamConstants.for_step(step=2, weight_decay=0.1, adamw=False, bias_correction=True, **HYPER)
    reference.adam_update(c, a[0], grad, a[1], a[2], outs[0])
    reference.adam_update(c, b[0], grad, b[1], b[2], outs[1], chunk_numel=1000)
    for x, y in zip([*a, outs[0]], [*b, outs[1]]):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------
# NaN and inf in gradients


@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
def test_nan_and_inf_in_grads_behave_as_in_torch(step_fn, adamw):
    n = 1000
    param, _, _ = make_state(n)
    torch_param = torch.nn.Parameter(param.clone())
    optim_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = optim_cls([torch_param], lr=1e-2, weight_decay=0.1)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(6)
    for step in range(1, 4):
        grad = torch.randn(n, generator=gen)
        grad[step * 10 : step * 10 + 3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        torch_param.grad = grad.clone()
        opt.step()
        step_fn(param, grad, exp_avg, exp_avg_sq, step=step, lr=1e-2, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=0.1, adamw=adamw, param_out=out)  # fmt: skip
    state = opt.state[torch_param]
    for ours, theirs in ((param, torch_param.detach()), (exp_avg, state["exp_avg"]), (exp_avg_sq, state["exp_avg_sq"])):
        assert ours.isnan().any()
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(ours.isinf(), theirs.isinf())
        finite = theirs.isfinite()
        assert_close_to(ours[finite], theirs[finite])
    assert torch.equal(out.isnan(), param.isnan())


# ---------------------------------------------------------------------------
# Shapes, parameters that require grad, empty tensors


def test_any_shapes_of_equal_numel(step_fn):
    param = torch.randn(3, 5, 7)
    grad = torch.randn(105).to(torch.bfloat16)
    exp_avg, exp_avg_sq = torch.zeros(5, 21), torch.zeros(105, 1)
    out = torch.empty(7, 15, dtype=torch.bfloat16)
    flat = [param.flatten().clone(), torch.zeros(105), torch.zeros(105)]
    step_fn(param, grad, exp_avg, exp_avg_sq, step=1, weight_decay=0.0, param_out=out, **HYPER)
    kernels.adam_step_reference(flat[0], grad, flat[1], flat[2], step=1, weight_decay=0.0, **HYPER)
    assert torch.equal(param.flatten(), flat[0]) and torch.equal(out.flatten(), flat[0].bfloat16())
    assert torch.equal(exp_avg.flatten(), flat[1]) and torch.equal(exp_avg_sq.flatten(), flat[2])


def test_parameters_that_require_grad(step_fn):
    param = torch.nn.Parameter(torch.randn(100))
    before = param.detach().clone()
    step_fn(param, torch.randn(100), torch.zeros(100), torch.zeros(100), step=1, weight_decay=0.0, **HYPER)
    assert not torch.equal(param.detach(), before)


def test_empty_tensors(step_fn):
    e = torch.empty(0)
    step_fn(e, e.clone(), e.clone(), e.clone(), step=1, weight_decay=0.1, param_out=torch.empty(0, dtype=torch.bfloat16), **HYPER)


# ---------------------------------------------------------------------------
# Bad arguments


def valid_args(n=8):
    return dict(
        param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n),
        step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
    )  # fmt: skip


BAD_TENSORS = [
    ("param", torch.zeros(8, dtype=torch.bfloat16), "float32"),
    ("grad", torch.zeros(8, dtype=torch.float64), "float32 or bfloat16 or float16"),
    ("exp_avg", torch.zeros(8, dtype=torch.float16), "float32"),
    ("exp_avg_sq", torch.zeros(8, dtype=torch.int32), "float32"),
    ("param_out", torch.zeros(8, dtype=torch.int8), "bfloat16 or float16 or float32"),
    ("grad", torch.zeros(9), "9 elements"),
    ("exp_avg_sq", torch.zeros(4, 2), None),  # same numel, other shape: fine
    ("param_out", torch.zeros(7, dtype=torch.bfloat16), "7 elements"),
    ("exp_avg", torch.zeros(8, 2)[:, 0], "contiguous"),
    ("param", torch.zeros(2, 4).t(), "contiguous"),
    ("grad", torch.zeros(8, device="meta"), "CPU"),
    ("exp_avg", [0.0] * 8, "torch.Tensor"),
    ("grad", torch.zeros(8).to_sparse(), None),  # message checked below: layout
]


@pytest.mark.parametrize("name, value, message", BAD_TENSORS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_TENSORS)])
@pytest.mark.parametrize("fn", [kernels.adam_step, kernels.adam_step_reference], ids=["adam_step", "reference"])
def test_bad_tensors_raise_value_error_naming_the_argument(fn, name, value, message):
    args = valid_args()
    args[name] = value
    if message is None and value.layout == torch.strided:
        fn(**args)  # accepted
        return
    with pytest.raises(ValueError, match=name) as info:
        fn(**args)
    if message is not None:
        assert message in str(info.value)


@pytest.mark.parametrize("fn", [kernels.adam_step, kernels.adam_step_reference], ids=["adam_step", "reference"])
def test_overlapping_buffers_are_rejected(fn):
    args = valid_args()
    buf = torch.zeros(12)
    args["exp_avg"], args["exp_avg_sq"] = buf[:8], buf[4:]
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq overlap"):
        fn(**args)
    args = valid_args()
    buf = torch.zeros(9)
    args["param"] = buf[1:]
    with pytest.raises(ValueError, match="param and param_out overlap"):
        fn(**args, param_out=buf[:8])


@pytest.mark.parametrize("fn", [kernels.adam_step, kernels.adam_step_reference], ids=["adam_step", "reference"])
def test_param_out_may_be_param_itself(fn):
    param, grad = torch.randn(8), torch.randn(8)
    expected = param.clone()
    kernels.adam_step_reference(expected, grad, torch.zeros(8), torch.zeros(8), step=1, weight_decay=0.1, **HYPER)
    fn(param, grad, torch.zeros(8), torch.zeros(8), step=1, weight_decay=0.1, param_out=param, **HYPER)
    assert torch.equal(param, expected)


BAD_SCALARS = [
    ("step", 0), ("step", 1.0), ("step", True), ("step", -3),
    ("lr", -1e-3), ("lr", float("nan")), ("lr", "0.1"),
    ("beta1", 1.0), ("beta1", -0.1), ("beta2", 1.5),
    ("eps", -1e-8), ("weight_decay", -0.1),
    ("adamw", 1), ("bias_correction", None),
]  # fmt: skip


@pytest.mark.parametrize("name, value", BAD_SCALARS)
@pytest.mark.parametrize("fn", [kernels.adam_step, kernels.adam_step_reference], ids=["adam_step", "reference"])
def test_bad_hyperparameters_raise_value_error_naming_them(fn, name, value):
    args = valid_args()
    args[name] = value
    with pytest.raises(ValueError, match=f"^{name} "):
        fn(**args)
    assert torch.equal(args["param"], torch.zeros(8)), "nothing may change on bad input"
