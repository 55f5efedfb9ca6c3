"""The placement decided at initialize, and the copy module it chooses."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

from infinity.config.schema import InfinityConfig
from infinity.placement.copies import DONE, Copies
from infinity.placement.placement import DISTINCT_DEVICE_ENV, GradRoute, Memory, Placement, distinct_device_requested

CPU = torch.device("cpu")


def _config(param="none", optimizer="none", accum=1, precision="fp32", **optimizer_extra):
    offload_param = {"device": param, **({"nvme_path": "/tmp"} if param == "nvme" else {})}
    offload_optimizer = {"device": optimizer, **({"nvme_path": "/tmp"} if optimizer == "nvme" else {}),
                         **optimizer_extra}
    return InfinityConfig.from_deepspeed({
        "gradient_accumulation_steps": accum, "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": {"offload_param": offload_param, "offload_optimizer": offload_optimizer}})


@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("optimizer", ["none", "cpu", "nvme"])
def test_one_memory_keeps_everything_in_host_memory_and_reduces_in_place(param, optimizer):
    placement = Placement.decide(_config(param, optimizer, accum=4), CPU, distinct=False)
    for state in (placement.compute_shard, placement.master, placement.moments, placement.grads):
        assert state.memory is Memory.HOST and not state.pinned
    assert placement.grad_route is GradRoute.IN_PLACE
    assert not placement.optimizer_on_device
    assert placement.compute_shard_in_optimizer_memory == (param != "nvme")


@pytest.mark.parametrize("accum, setting, fits, route", [
    (1, "device_if_fits", True, GradRoute.DIRECT_TO_HOST),
    (1, "host", False, GradRoute.DIRECT_TO_HOST),   # nothing accumulates: nothing to place
    (4, "device_if_fits", True, GradRoute.DEVICE_THEN_HOST),
    (4, "device_if_fits", False, GradRoute.HOST_RING),
    (4, "device", False, GradRoute.DEVICE_THEN_HOST),
    (4, "host", True, GradRoute.HOST_RING),
])
def test_distinct_device_routes_gradients_of_an_offloaded_optimizer(accum, setting, fits, route):
    config = _config("none", "cpu", accum=accum, grad_accumulation=setting)
    placement = Placement.decide(config, CPU, distinct=True, grad_accumulator_fits_device=fits)
    assert placement.grad_route is route
    assert placement.grads.memory is Memory.HOST
    assert placement.compute_shard.memory is Memory.DEVICE
    assert not placement.optimizer_on_device
    assert not placement.compute_shard_in_optimizer_memory  # new compute shards cross up


@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_distinct_device_with_optimizer_on_device_runs_it_there(param):
    placement = Placement.decide(_config(param, "none", accum=4), CPU, distinct=True)
    assert placement.optimizer_on_device
    assert placement.grads.memory is Memory.DEVICE and placement.master.memory is Memory.DEVICE
    assert placement.grad_route is GradRoute.IN_PLACE
    assert placement.compute_shard_in_optimizer_memory == (param == "none")
    assert placement.compute_shard.memory is (Memory.DEVICE if param == "none" else Memory.HOST)


def test_gradients_stay_in_compute_precision_only_when_nothing_accumulates():
    assert Placement.decide(_config("none", "cpu", accum=1, precision="bf16"), CPU, distinct=True).grads_lossless
    assert not Placement.decide(_config("none", "cpu", accum=2, precision="bf16"), CPU, distinct=True).grads_lossless


def test_pin_memory_is_honoured_only_where_a_gpu_makes_it_mean_something(caplog):
    config = _config("cpu", "cpu", pin_memory=True)
    with caplog.at_level("WARNING"):
        placement = Placement.decide(config, CPU, distinct=True)
    assert not placement.grads.pinned and not placement.compute_shard.pinned
    assert "pin_memory is true but there is no GPU" in caplog.text
    assert "offload_optimizer.pin_memory" in caplog.text


def test_pin_memory_must_be_a_boolean():
    with pytest.raises(ValueError, match="offload_param.pin_memory must be true or false"):
        InfinityConfig.from_deepspeed({"zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": "yes"}}})
    with pytest.raises(ValueError, match="offload_optimizer.grad_accumulation"):
        _config("none", "cpu", grad_accumulation="gpu")


def test_describe_names_every_state_and_the_route():
    text = Placement.decide(_config("cpu", "nvme", accum=2), CPU, distinct=True).describe()
    for word in ("compute shards host", "master+moments nvme", "gradients host", "accumulate on the device",
                 "fused CPU kernel", DISTINCT_DEVICE_ENV):
        assert word in text, text


def test_device_key_is_checked():
    assert InfinityConfig.from_deepspeed({"device": "cpu"}).device == "cpu"
    # our keys' documented "auto" may be written out (the check for Hugging Face's unfilled "auto" skips them)
    assert InfinityConfig.from_deepspeed({"device": "auto"}).device == "auto"
    assert InfinityConfig.from_deepspeed({"aio": {"backend": "auto"}}).aio.backend == "auto"
    with pytest.raises(ValueError, match='train_micro_batch_size_per_gpu is "auto"'):
        InfinityConfig.from_deepspeed({"train_micro_batch_size_per_gpu": "auto"})
    with pytest.raises(ValueError, match="config key device"):
        InfinityConfig.from_deepspeed({"device": "tpu"})


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), ("", False), ("true", True)])
def test_distinct_device_switch(monkeypatch, value, expected):
    monkeypatch.setenv(DISTINCT_DEVICE_ENV, value)
    assert distinct_device_requested() is expected


def test_distinct_device_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv(DISTINCT_DEVICE_ENV, "yes please")
    with pytest.raises(ValueError, match=DISTINCT_DEVICE_ENV):
        distinct_device_requested()


# -- the copy module ---------------------------------------------------------------

def _copies(distinct: bool, delay_s: float = 0.0) -> Copies:
    return Copies(Placement.decide(_config(), CPU, distinct=distinct), delay_s=delay_s)


def test_one_memory_copies_at_once_and_counts_nothing():
    copies = _copies(distinct=False)
    src, dst = torch.arange(8.0), torch.zeros(8)
    assert copies.to_device(src, dst) is DONE
    assert torch.equal(dst, src)
    assert copies.snapshot() == {"host_to_device_nbytes": 0, "device_to_host_nbytes": 0}
    copies.close()


def test_distinct_copies_are_asynchronous_and_a_wait_makes_them_visible():
    copies = _copies(distinct=True, delay_s=0.05)
    src, dst = torch.arange(1024.0), torch.zeros(1024)
    done = copies.to_device(src, dst)
    # the copy stream is late on purpose: without a wait the destination still holds its old values
    assert not done.query() and torch.count_nonzero(dst) == 0
    copies.compute_waits(done)
    assert torch.equal(dst, src)
    down = torch.zeros(1024)
    copies.host_waits(copies.to_host(dst, down))
    assert torch.equal(down, src)
    assert copies.snapshot() == {"host_to_device_nbytes": 4096, "device_to_host_nbytes": 4096}
    copies.close()


def test_copies_land_in_issue_order_so_the_last_covers_the_earlier():
    copies = _copies(distinct=True, delay_s=0.002)
    dsts = [torch.zeros(64) for _ in range(10)]
    for i, dst in enumerate(dsts):
        copies.to_device(torch.full((64,), float(i + 1)), dst)
    copies.host_waits(copies.last())
    assert all(torch.all(dst == i + 1) for i, dst in enumerate(dsts))
    copies.close()


def test_release_after_runs_once_the_copy_has_landed():
    copies = _copies(distinct=True, delay_s=0.05)
    released = threading.Event()
    done = copies.to_host(torch.ones(16), torch.zeros(16))
    copies.release_after(done, released.set)
    copies.poll()
    assert not released.is_set()
    copies.drain()
    assert released.is_set()
    copies.close()


def test_a_landed_copy_lets_go_of_its_tensors_before_anyone_waits():
    """Nothing may keep a copied tensor alive once the copy has run: not the copy's handle (the reducer keeps
    the last one, ``last()`` too), nor the copy stream's worker. Holding them kept gradients going down alive
    a step longer, 0.14 GB of untracked memory in the RSS test."""
    copies = _copies(distinct=True)
    src, dst = torch.ones(1 << 16), torch.zeros(1 << 16)
    gone = weakref.ref(src)
    done = copies.to_host(src, dst)
    del src
    deadline = time.monotonic() + 5
    while not done.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert done.query() and copies.last() is done  # landed, not waited on, still referenced
    for _ in range(100):  # the worker drops its own references right after setting the event
        if gone() is None:
            break
        time.sleep(0.01)
    assert gone() is None
    assert torch.all(dst == 1)
    copies.close()


def test_a_failed_copy_raises_where_it_is_waited_on():
    copies = _copies(distinct=True)
    done = copies.to_host(torch.ones(16), torch.zeros(8))  # shapes that cannot be copied
    with pytest.raises(RuntimeError):
        copies.host_waits(done)
    copies.close()
