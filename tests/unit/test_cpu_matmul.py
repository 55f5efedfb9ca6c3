"""Half-precision matmuls on a CPU without units for them: computed from fp32 copies, rounded once, and chosen
where the CPU lacks the units (infinity.runtime.cpu_matmul)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import infinity
from infinity.runtime import hardware
from infinity.runtime.cpu_matmul import HalfMatmulsInFp32, matmuls_in_fp32

DTYPES = (torch.bfloat16, torch.float16)


def _ops(dtype):
    """(name, the op, its fp64 reference) for each matmul the mode takes, on operands made in ``dtype``."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    a, b, c = r(24, 40), r(40, 16), r(24, 16)
    ba, bb, bc = r(3, 24, 40), r(3, 40, 16), r(3, 24, 16)
    v, w = r(40), r(24)
    d = torch.float64
    return [
        ("mm", lambda: a @ b, lambda: a.to(d) @ b.to(d)),
        ("addmm", lambda: torch.addmm(c, a, b, beta=0.5, alpha=2.0), lambda: 0.5 * c.to(d) + 2.0 * (a.to(d) @ b.to(d))),
        ("bmm", lambda: torch.bmm(ba, bb), lambda: torch.bmm(ba.to(d), bb.to(d))),
        ("baddbmm", lambda: torch.baddbmm(bc, ba, bb), lambda: bc.to(d) + torch.bmm(ba.to(d), bb.to(d))),
        ("mv", lambda: a @ v, lambda: a.to(d) @ v.to(d)),
        ("addmv", lambda: torch.addmv(w, a, v), lambda: w.to(d) + a.to(d) @ v.to(d)),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_matmul_is_the_exact_product_rounded_once(dtype):
    for name, op, exact in _ops(dtype):
        native = op()
        with HalfMatmulsInFp32():
            ours = op()
        assert ours.dtype == native.dtype == dtype and ours.shape == native.shape, name
        # within one rounding of the exact product, and the fp32 sums' own error (40 terms of magnitude < 25,
        # each off by < 2^-24 of itself: < 1e-4, far below a half's step but for a product near zero)
        reference = exact()
        step = reference.abs() * torch.finfo(dtype).eps + 1e-4
        assert ((ours.to(torch.float64) - reference).abs() <= step).all(), name
        # and torch's own kernel's value within a couple of steps of the largest (it may round a partial result)
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(ours, native, rtol=2 * eps, atol=2 * eps * native.abs().max().item(), msg=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_flash_attentions_backward_is_as_close_to_fp64_as_torchs_own(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, 64, 32, generator=g) for _ in range(4))

    def grads(precision, mode=None):
        leaves = [t.to(precision).requires_grad_() for t in (q, k, v)]
        with mode() if mode else contextlib.nullcontext():
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
            out.backward(grad.to(precision))
        assert all(t.grad.dtype == precision for t in leaves)
        return torch.cat([t.grad.double().flatten() for t in leaves])

    exact = grads(torch.float64)
    native, ours = grads(dtype), grads(dtype, HalfMatmulsInFp32)
    assert not torch.equal(native, ours)  # the mode took the backward
    error_native = (native - exact).norm() / exact.norm()
    error_ours = (ours - exact).norm() / exact.norm()
    assert error_ours <= 1.2 * error_native, (error_ours, error_native)


def test_a_models_gradients_are_as_close_to_fp32_as_torchs_own_half_kernels():
    from helpers import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=64, n_layer=2, n_head=4, seq=32)
    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))

    def grads(m, mode=None):
        m.zero_grad()
        if mode is None:
            m(x, y).backward()
        else:
            with mode():
                m(x, y).backward()
        return torch.cat([p.grad.float().flatten() for p in m.parameters()])

    exact = grads(model)
    half = TinyGPT(vocab=64, d=64, n_layer=2, n_head=4, seq=32)
    half.load_state_dict(model.state_dict())
    half = half.bfloat16()
    native, ours = grads(half), grads(half, HalfMatmulsInFp32)
    assert not torch.equal(native, ours)  # the mode did take the matmuls (the sums differ in order)
    error_native = (native - exact).norm() / exact.norm()
    error_ours = (ours - exact).norm() / exact.norm()
    assert error_ours <= 1.2 * error_native, (error_ours, error_native)


def test_the_backward_is_taken_too_and_other_ops_and_devices_pass_through():
    taken = []

    class Spy(HalfMatmulsInFp32):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("mm", "addmm"):
                taken.append((func.overloadpacket.__name__, args[-1].dtype))
            return super().__torch_dispatch__(func, types, args, kwargs)

    layer = torch.nn.Linear(8, 4).bfloat16()
    x = torch.randn(3, 8).bfloat16().requires_grad_()
    with Spy():
        layer(x).float().sum().backward()
    assert ("addmm", torch.bfloat16) in taken  # forward
    assert sum(1 for name, _ in taken if name == "mm") == 2  # backward: the input's and the weight's gradients
    with HalfMatmulsInFp32():
        mixed = torch.ones(2, 2, dtype=torch.float32) @ torch.ones(2, 2, dtype=torch.float32)
        added = torch.ones(2, dtype=torch.bfloat16) + 1
    assert mixed.dtype == torch.float32 and added.dtype == torch.bfloat16


@pytest.fixture
def cpu_flags(monkeypatch):
    """Fakes the CPU's /proc/cpuinfo flags: ``cpu_flags("avx2")``."""
    caches = (hardware.cpu_flags, hardware.fast_precision, hardware.cpu_name)

    def fake(flags: str):
        monkeypatch.setattr(hardware, "_cpuinfo", lambda: f"model name\t: Fake CPU\nflags\t\t: fpu sse {flags}\n")
        for cache in caches:
            cache.cache_clear()

    yield fake
    for cache in caches:
        cache.cache_clear()


def test_auto_takes_fp32_only_where_the_cpu_lacks_units_for_the_precision(cpu_flags):
    cpu_flags("avx avx2 fma")
    assert matmuls_in_fp32("auto", "bf16", "cpu") and matmuls_in_fp32("auto", "fp16", "cpu")
    assert not matmuls_in_fp32("auto", "fp32", "cpu") and not matmuls_in_fp32("native", "bf16", "cpu")
    assert not matmuls_in_fp32("auto", "bf16", "cuda") and not matmuls_in_fp32("fp32", "bf16", "cuda")
    cpu_flags("avx2 avx512f avx512_bf16")
    assert not matmuls_in_fp32("auto", "bf16", "cpu") and matmuls_in_fp32("auto", "fp16", "cpu")
    assert matmuls_in_fp32("fp32", "bf16", "cpu")
    cpu_flags("avx2 avx512f avx512_bf16 amx_bf16 amx_fp16")
    assert not matmuls_in_fp32("auto", "fp16", "cpu")
    with pytest.raises(ValueError, match="cpu_matmul_precision"):
        matmuls_in_fp32("fast", "bf16", "cpu")


class _SeesTheMode(torch.nn.Module):
    """A linear layer that records the dispatch mode its forward, and its input's gradient in backward, run under
    (a half matmul's value alone cannot tell the kernels apart: both sum in fp32 and round once)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.seen: dict[str, type | None] = {}

    def forward(self, x):
        self.seen["forward"] = type(_get_current_dispatch_mode())
        x = x.detach().requires_grad_()
        x.register_hook(lambda g: self.seen.__setitem__("backward", type(_get_current_dispatch_mode())))
        return self.linear(x).float().sum()


def _modes_seen(choice: str) -> dict:
    model = _SeesTheMode()
    engine = infinity.initialize(model, {"device": "cpu", "bf16": {"enabled": True}, "cpu_matmul_precision": choice})
    try:
        engine.backward(engine(torch.randn(3, 8)))
        engine.step()
        return model.seen
    finally:
        engine.close()


def test_the_engine_computes_a_bf16_models_forward_and_backward_as_the_config_says(cpu_flags):
    taken = {"forward": HalfMatmulsInFp32, "backward": HalfMatmulsInFp32}
    native = {"forward": type(None), "backward": type(None)}
    assert _modes_seen("fp32") == taken
    assert _modes_seen("native") == native
    cpu_flags("avx avx2 fma")
    assert _modes_seen("auto") == taken
    cpu_flags("avx2 avx512f avx512_bf16")
    assert _modes_seen("auto") == native


def test_a_bad_choice_is_named_before_any_work():
    with pytest.raises(ValueError, match="cpu_matmul_precision"):
        infinity.initialize(torch.nn.Linear(4, 4), {"device": "cpu", "cpu_matmul_precision": "fast"})


def test_the_benchmark_runs_its_cases_side_by_side_and_bf16_trains_as_fp32_does(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cpu_matmul.py"
    spec = importlib.util.spec_from_file_location("bench_cpu_matmul", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--layers", "1", "--width", "64", "--batch", "2", "--seq", "32", "--rounds", "2",
                       "--cases", "engine-bf16,engine-fp32,torch-fp32"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["step_s"]) == {"engine-bf16", "engine-fp32", "torch-fp32"}
    assert result["engine_bf16_vs_torch_fp32"] > 0 and result["engine_bf16_vs_torch_bf16"] is None
    # a warm-up step and two timed ones, each from the same batch: the loss falls, in bf16 as in fp32
    bf16, fp32 = result["losses"]["engine-bf16"], result["losses"]["torch-fp32"]
    assert len(bf16) == 3 and bf16[-1] < bf16[0]
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=1e-2, atol=0)
    with pytest.raises(SystemExit):
        bench.main(["--cases", "engine-bf16,fast"])
