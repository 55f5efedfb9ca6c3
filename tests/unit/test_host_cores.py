"""The fused CPU Adam's own team of threads, bound off the core that feeds the GPU (``infinity.runtime.host_cores``).

The kernel takes its thread count from the caller and gives the same bits on any count; the threads OpenMP starts
for a bound caller run on the caller's cores; the engine's updating threads bind themselves and call the kernel
with the team the placement chose, while the main thread keeps its cores; the plan is the machine's.
"""

from __future__ import annotations

import os
import re
import threading

import pytest
import torch

import infinity
from helpers import TinyGPT, engine_config, engine_steps, gpt_batches, reference_train, slow_step_tail
from infinity import kernels
from infinity.config.schema import InfinityConfig
from infinity.placement.host_budget import resolve_host_budget
from infinity.runtime.comm import local_rank_and_size
from infinity.runtime.host_cores import HOST_THREADS_KEY, RANK_BOUND_ENV, cores_named, plan_host_cores

CORES = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="binding a team off a core needs two cores")
needs_kernel = pytest.mark.skipif(kernels.backend() != "cpp", reason="the C++ kernel is not built here")

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


# -- the plan -------------------------------------------------------------------------------------------------

def test_a_gpu_machine_leaves_the_first_core_to_the_feeder_and_binds_the_rest():
    plan = plan_host_cores(CUDA, None, usable=frozenset(range(16)))
    assert plan.threads == 15 and plan.cores == frozenset(range(1, 16))
    assert "cores 1-15" in plan.describe() and "feeds the GPU" in plan.describe()


def test_a_cpu_device_takes_torch_s_threads_unbound():
    plan = plan_host_cores(CPU, None, usable=frozenset(range(16)))
    assert plan.threads is None and plan.cores is None
    assert "unbound" in plan.describe()


def test_a_gpu_machine_with_one_core_binds_nothing():
    plan = plan_host_cores(CUDA, None, usable=frozenset({3}))
    assert plan.threads is None and plan.cores is None


def test_host_threads_binds_the_last_cores_of_the_process():
    plan = plan_host_cores(CPU, 4, usable=frozenset({0, 1, 2, 3, 8, 9, 10, 11}))
    assert plan.threads == 4 and plan.cores == frozenset({8, 9, 10, 11})
    assert "cores 8-11" in plan.describe()
    every = plan_host_cores(CUDA, 8, usable=frozenset({0, 1, 2, 3, 8, 9, 10, 11}))
    assert every.threads == 8 and every.cores is None  # all of them: nothing to leave free


def test_ranks_on_one_machine_take_their_own_share_of_its_cores():
    """torchrun's LOCAL_RANK of LOCAL_WORLD_SIZE: contiguous shares, each leaving its first core to its own feeder,
    so no two ranks' teams share a core."""
    cores = frozenset(range(16))
    plans = [plan_host_cores(CUDA, None, usable=cores, local_rank=r, local_world_size=4) for r in range(4)]
    assert [p.cores for p in plans] == [frozenset({1, 2, 3}), frozenset({5, 6, 7}), frozenset({9, 10, 11}),
                                        frozenset({13, 14, 15})]
    assert all(p.threads == 3 for p in plans) and "core 4 left" in plans[1].describe()
    uneven = [plan_host_cores(CUDA, None, usable=frozenset(range(10)), local_rank=r, local_world_size=3)
              for r in range(3)]
    assert [sorted(p.cores) for p in uneven] == [[1, 2, 3], [5, 6], [8, 9]]  # shares of 4, 3, 3
    # a count by hand is bound within the rank's share, even when it takes the whole share
    assert plan_host_cores(CUDA, 4, usable=cores, local_rank=1, local_world_size=4).cores == frozenset({4, 5, 6, 7})
    with pytest.raises(ValueError, match=f"{HOST_THREADS_KEY} is 5, but this rank may run on 4 cores"):
        plan_host_cores(CUDA, 5, usable=cores, local_rank=1, local_world_size=4)


def test_the_environment_names_the_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert plan_host_cores(CUDA, None, usable=frozenset(range(8))).cores == frozenset({5})
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(ValueError, match="LOCAL_RANK=4 and LOCAL_WORLD_SIZE=4 name no rank"):
        plan_host_cores(CUDA, None, usable=frozenset(range(8)))
    with pytest.raises(ValueError, match="local rank 4 of 4"):
        plan_host_cores(CUDA, None, usable=frozenset(range(8)), local_rank=4, local_world_size=4)


def test_a_rank_the_launcher_bound_to_its_share_takes_all_of_it(monkeypatch):
    """``infinity deepspeed --bind_cores_to_rank`` gives each rank its share as its affinity: sharing that again
    would leave it half its cores."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    own_share = frozenset({4, 5, 6, 7})
    assert plan_host_cores(CUDA, None, usable=own_share).cores == frozenset({7})  # half of a half
    monkeypatch.setenv(RANK_BOUND_ENV, "1")
    assert plan_host_cores(CUDA, None, usable=own_share).cores == frozenset({5, 6, 7})


def test_core_lists_read_as_numactl_writes_them():
    assert cores_named("0,2-4,3,7") == [0, 2, 3, 4, 7]
    for bad in ("1-x", "", "5-2", "-1"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            cores_named(bad)


@pytest.mark.parametrize("env, expected", [
    ({}, (0, 1)),
    ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}, (3, 8)),
    ({"LOCAL_RANK": " 1 ", "LOCAL_WORLD_SIZE": "2"}, (1, 2)),
    ({"LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE='two' is not a whole number"),
    ({"LOCAL_RANK": "1.0", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK='1.0' is not a whole number"),
    ({"LOCAL_RANK": "-1", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=-1 and LOCAL_WORLD_SIZE=2 name no rank"),
    ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_RANK=0 and LOCAL_WORLD_SIZE=0 name no rank"),
])
def test_torchruns_local_ranks_are_read_in_one_place_and_garbage_is_named(monkeypatch, env, expected):
    """The host budget's share, the CPU Adam's cores, the GPU a rank takes and the run's plan all read them here."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if isinstance(expected, tuple):
        assert local_rank_and_size() == expected
        assert resolve_host_budget(0.5, available_nbytes=8 << 30) == (4 << 30) // expected[1]
    else:
        with pytest.raises(ValueError, match=re.escape(expected)):
            local_rank_and_size()
        with pytest.raises(ValueError, match=re.escape(expected)):
            resolve_host_budget(0.5, available_nbytes=8 << 30)


def test_more_host_threads_than_cores_is_refused_by_key():
    with pytest.raises(ValueError, match=f"{HOST_THREADS_KEY} is 17, but this rank may run on 16 cores"):
        plan_host_cores(CUDA, 17, usable=frozenset(range(16)))


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "4"])
def test_a_bad_host_threads_is_refused_by_key(value):
    with pytest.raises(ValueError, match="offload_optimizer.host_threads"):
        InfinityConfig.load({"zero_optimization": {"offload_optimizer": {"device": "cpu", "host_threads": value}}})


def test_host_threads_reads_from_a_deepspeed_json():
    config = InfinityConfig.load({"zero_optimization": {"offload_optimizer": {"device": "cpu",
                                                                                   "host_threads": 2.0}}})
    assert config.zero.offload_optimizer.host_threads == 2


def test_too_many_host_threads_is_refused_at_initialize_before_any_work(tmp_path):
    config = engine_config(param="none", optimizer="cpu", nvme_path=None, accum=1, clip=0.0, lr=1e-3)
    config["zero_optimization"]["offload_optimizer"]["host_threads"] = len(CORES) + 1
    model = TinyGPT()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=HOST_THREADS_KEY):
        infinity.initialize(model, config)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- the kernel -----------------------------------------------------------------------------------------------

def _adam_case(state_dtype: str, numel: int = (1 << 20) + 77):
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=gen).to(torch.bfloat16)
    state = kernels.empty_state(state_dtype, numel)
    for name, t in state.items():
        if name == "master":
            t.copy_(torch.randn(numel, generator=gen).to(t.dtype))
        else:
            t.zero_()
    return grad, state


def _run_steps(state_dtype: str, num_threads, steps: int = 3):
    grad, state = _adam_case(state_dtype)
    out = torch.empty(grad.numel(), dtype=torch.bfloat16)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, param_out=out, num_threads=num_threads)
    for step in range(1, steps + 1):
        if state_dtype == "fp32":
            kernels.adam_step(state["master"], grad, state["exp_avg"], state["exp_avg_sq"], step=step, **hyper)
        else:
            kernels.adam_step_compact(state["master"], grad, state["exp_avg"], state["exp_avg_sq"],
                                      state_dtype=state_dtype, step=step, seed=7,
                                      exp_avg_scale=state.get("exp_avg_scale"),
                                      exp_avg_sq_scale=state.get("exp_avg_sq_scale"), **hyper)
    return {**state, "param_out": out}


@needs_kernel
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_the_kernel_gives_the_same_bits_on_any_team(state_dtype):
    reference = {}
    grad, state = _adam_case(state_dtype)
    out = torch.empty(grad.numel(), dtype=torch.bfloat16)
    for step in range(1, 4):
        kernels.adam_step_compact_reference(state["master"], grad, state["exp_avg"], state["exp_avg_sq"],
                                            state_dtype=state_dtype, step=step, seed=7, lr=1e-3, beta1=0.9,
                                            beta2=0.999, eps=1e-8, weight_decay=0.01, param_out=out,
                                            exp_avg_scale=state.get("exp_avg_scale"),
                                            exp_avg_sq_scale=state.get("exp_avg_sq_scale"))
    reference = {**state, "param_out": out}
    for num_threads in (None, 1, 2, 3):  # 3 on two cores: more threads than cores still adds up
        result = _run_steps(state_dtype, num_threads)
        for name, expected in reference.items():
            assert torch.equal(result[name], expected), (num_threads, name)


@needs_kernel
def test_the_norm_gives_the_same_bits_on_any_team():
    values = torch.randn((1 << 22) + 5, generator=torch.Generator().manual_seed(1))
    expected = kernels.sq_norm_fp64(values)
    assert expected == pytest.approx(float(values.double().pow(2).sum()), rel=1e-12)
    for num_threads in (1, 2, 3):
        assert kernels.sq_norm_fp64(values, num_threads=num_threads) == expected


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_a_bad_num_threads_is_refused_by_name(value):
    grad, state = _adam_case("fp32", numel=64)
    with pytest.raises(ValueError, match="num_threads"):
        kernels.adam_step(state["master"], grad, state["exp_avg"], state["exp_avg_sq"], step=1, lr=1e-3, beta1=0.9,
                          beta2=0.999, eps=1e-8, weight_decay=0.0, num_threads=value)
    with pytest.raises(ValueError, match="num_threads"):
        kernels.sq_norm_fp64(grad.float(), num_threads=value)


def _thread_cores() -> dict[int, str]:
    """This process's threads: their id and the cores each may run on (``Cpus_allowed_list``)."""
    cores = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                cores[int(tid)] = next(line.split(":", 1)[1].strip() for line in f
                                       if line.startswith("Cpus_allowed_list"))
        except (OSError, StopIteration):
            pass  # a thread that ended meanwhile
    return cores


@needs_kernel
@needs_two_cores
def test_the_team_a_bound_thread_starts_runs_on_its_cores():
    """The guarantee the engine's binding rests on: OpenMP's threads for a bound caller inherit its cores, and
    the main thread keeps its own."""
    main_cores = os.sched_getaffinity(0)
    last = CORES[-1]
    seen: dict = {}

    def bound_update():
        os.sched_setaffinity(0, {last})
        before = set(_thread_cores())
        _run_steps("fp32", num_threads=2, steps=1)  # a team of two: one thread started for this one
        seen["team"] = {tid: cores for tid, cores in _thread_cores().items() if tid not in before}
        seen["self"] = os.sched_getaffinity(0)

    worker = threading.Thread(target=bound_update)
    worker.start()
    worker.join()
    assert seen["self"] == {last}
    assert seen["team"], "the kernel started no thread for a team of two"
    assert set(seen["team"].values()) == {str(last)}
    assert os.sched_getaffinity(0) == main_cores


# -- the engine -----------------------------------------------------------------------------------------------

def _record_kernel_calls(monkeypatch, kernel: str = "adam_step") -> list:
    """Each call of ``kernels.<kernel>``: its thread, that thread's cores and the team it asked for."""
    calls = []
    original = getattr(kernels, kernel)

    def recording(*args, **kwargs):
        calls.append((threading.current_thread().name, frozenset(os.sched_getaffinity(0)), kwargs.get("num_threads")))
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, kernel, recording)
    return calls


@needs_two_cores
@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_the_engine_binds_its_updating_threads_and_matches_plain_adamw(tmp_path, monkeypatch, optimizer):
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(4, batch=4)
    config = engine_config(param="cpu", optimizer=optimizer, nvme_path=str(tmp_path), accum=1, clip=0.0, lr=3e-3)
    config["zero_optimization"]["offload_optimizer"]["host_threads"] = 1
    calls = _record_kernel_calls(monkeypatch)
    norms = _record_kernel_calls(monkeypatch, "sq_norm_fp64")
    main_cores = os.sched_getaffinity(0)
    losses, state, _, placement = engine_steps(model, config, batches, steps=4, accum=1)
    assert placement.host_cores.cores == frozenset({CORES[-1]}) and placement.host_cores.threads == 1
    assert calls and all(cores == {CORES[-1]} and threads == 1 for _, cores, threads in calls), calls
    # the overlapped step's worker, and the tail that makes behind the next forward the updates it had not begun
    assert {name for name, _, _ in calls} <= {"infinity-optimizer", "infinity-step-tail"}
    # the worker takes each sub-group's gradient norm as it becomes final: in its update's pass (the calls above),
    # or in a pass of its own, with the same team
    worker_norms = [(cores, threads) for name, cores, threads in norms if name == "infinity-optimizer"]
    assert all(cores == {CORES[-1]} and threads == 1 for cores, threads in worker_norms)
    assert os.sched_getaffinity(0) == main_cores
    expected = reference_train(model, batches, steps=4, accum=1, clip=0.0, lr=3e-3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[0]), rtol=1e-5, atol=1e-6)
    for key, value in expected[1].items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)


@needs_two_cores
def test_the_step_tail_binds_its_thread_too(tmp_path, monkeypatch):
    """Every step clips, so its updates run behind the next forward on the tail's thread, bound like the rest."""
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(4, batch=4)
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(tmp_path), accum=1, clip=1e-3, lr=3e-3)
    config["zero_optimization"]["offload_optimizer"]["host_threads"] = 1
    slow_step_tail(monkeypatch)
    calls = _record_kernel_calls(monkeypatch)
    unbound, _, _, _ = engine_steps(model, {**config, "zero_optimization": {
        **config["zero_optimization"], "offload_optimizer": {**config["zero_optimization"]["offload_optimizer"],
                                                             "host_threads": None}}}, batches, steps=4, accum=1)
    calls.clear()
    losses, _, metrics, _ = engine_steps(model, config, batches, steps=4, accum=1)
    assert sum(m["sub_groups_behind_forward"] for m in metrics) > 0
    tail_calls = [(cores, threads) for name, cores, threads in calls if name == "infinity-step-tail"]
    assert tail_calls and all(cores == {CORES[-1]} and threads == 1 for cores, threads in tail_calls)
    assert losses == unbound  # the same bits, bound or not


@needs_two_cores
def test_the_gradient_spill_worker_takes_its_norms_bound_with_the_team(tmp_path, monkeypatch):
    """Gradient slices the host budget cannot hold rest on NVMe; the worker that writes them takes their norms on
    the CPU Adam's cores with its team, as the optimizer's worker does, and the result is the same bits."""
    from infinity.placement.placement import distinct_device_requested

    torch.manual_seed(0)
    model = TinyGPT(vocab=256, d=256, n_layer=4, n_head=4, seq=16)
    batches = list(gpt_batches(3, batch=2, vocab=256))
    budget = (38 if distinct_device_requested() else 42) << 20  # some of the 13 MiB of fp32 slices, not all

    def config(host_threads):
        raw = engine_config(param="cpu", optimizer="nvme", nvme_path=str(tmp_path), accum=1, clip=1.0, lr=3e-3,
                            sub_group_size=262144, host_memory_budget=budget)
        raw["zero_optimization"]["offload_optimizer"]["host_threads"] = host_threads
        return raw

    unbound, _, _, _ = engine_steps(model, config(None), batches, steps=3, accum=1)
    norms = _record_kernel_calls(monkeypatch, "sq_norm_fp64")
    losses, _, _, placement = engine_steps(model, config(1), batches, steps=3, accum=1)
    assert placement.nvme_grads_from is not None
    spill_norms = [(cores, threads) for name, cores, threads in norms if name == "infinity-grad-spill"]
    assert spill_norms and all(cores == {CORES[-1]} and threads == 1 for cores, threads in spill_norms), spill_norms
    assert losses == unbound
