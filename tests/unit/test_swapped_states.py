"""SwappedStates: the staging sets and the two sides of the swap keys of the optimizer states on NVMe, against
the bytes the swap store holds."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
import torch

from infinity.config.schema import InfinityConfig
from infinity.placement.layout import SubGroup
from infinity.placement.placement import Placement
from infinity.optim.on_nvme import SwappedStates, group_states
from infinity.placement.tiers import Tiers

LARGEST = 1000


@pytest.fixture
def tiers(tmp_path):
    config = InfinityConfig.from_deepspeed({"zero_optimization": {
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}})
    tiers = Tiers(config.aio, Placement.decide(config, torch.device("cpu"), distinct=False))
    yield tiers
    tiers.close()


def _swapped(tiers, tmp_path, state_dtype="fp32", sets=2):
    return SwappedStates(tiers.swap_store(str(tmp_path)), tiers, state_dtype, largest_numel=LARGEST, set_count=sets,
                         compute_dtype=torch.bfloat16, compute_pinned=False)


def _fill(swapped, group, staging, seed):
    g = torch.Generator().manual_seed(seed)
    for tensor in group_states(swapped.state_dtype, group, staging.states).values():
        if tensor.dtype == torch.uint8:
            tensor.copy_(torch.randint(0, 256, tensor.shape, generator=g, dtype=torch.uint8))
        else:
            tensor.copy_(torch.randn(tensor.shape, generator=g).to(tensor.dtype))
    return {name: t.clone() for name, t in group_states(swapped.state_dtype, group, staging.states).items()}


def _write(swapped, group, staging, *, other_side):
    swapped.write(group, staging, other_side=other_side, urgent_master=False)
    staging.wait_writes()


def _read(swapped, group, staging, step=2):
    for handle in swapped.read(group, staging, step=step):
        handle.wait()
    return {name: t.clone() for name, t in group_states(swapped.state_dtype, group, staging.states).items()}


def test_sets_are_counted_in_the_host_tier_and_given_back(tiers, tmp_path):
    swapped = _swapped(tiers, tmp_path, sets=3)
    # master, exp_avg, exp_avg_sq in fp32 and a bf16 compute buffer, per set
    assert tiers.stats["host"].live_nbytes == 3 * LARGEST * (12 + 2)
    swapped.close()
    assert tiers.stats["host"].live_nbytes == 0 and swapped.sets == []


def test_a_speculative_write_leaves_the_states_in_use_until_published(tiers, tmp_path):
    swapped = _swapped(tiers, tmp_path)
    group = SubGroup(index=3, start=0, end=600, slots=())
    a, b = swapped.sets
    assert swapped.key("exp_avg", group) == "exp_avg.3"
    assert swapped.key("exp_avg", group, other_side=True) == "exp_avg.3.b"
    old = _fill(swapped, group, a, seed=0)
    _write(swapped, group, a, other_side=False)
    new = _fill(swapped, group, a, seed=1)
    _write(swapped, group, a, other_side=True)  # a step that may still be undone
    for name, values in _read(swapped, group, b).items():
        assert torch.equal(values, old[name]), name
    swapped.publish_other_side([group.index])  # the step stands
    assert swapped.key("exp_avg", group) == "exp_avg.3.b"
    assert swapped.key("exp_avg", group, other_side=True) == "exp_avg.3"
    for name, values in _read(swapped, group, b).items():
        assert torch.equal(values, new[name]), name
    # the next speculative update writes the first side again: the published states stay
    _fill(swapped, group, a, seed=2)
    _write(swapped, group, a, other_side=True)
    for name, values in _read(swapped, group, b).items():
        assert torch.equal(values, new[name]), name
    swapped.close()


def test_the_first_step_reads_the_master_alone_and_zeroes_the_moments(tiers, tmp_path):
    swapped = _swapped(tiers, tmp_path, state_dtype="int8")
    group = SubGroup(index=0, start=0, end=LARGEST, slots=())
    a, b = swapped.sets
    master = _fill(swapped, group, a, seed=0)["master"]
    swapped._store.write(swapped.key("master", group), a.states["master"][:group.numel]).wait()
    _fill(swapped, group, b, seed=1)  # stale values a first step must not see
    states = _read(swapped, group, b, step=1)
    assert torch.equal(states["master"], master)
    for name in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        assert not states[name].any(), name
    assert sorted(swapped._store.keys()) == ["master.0"]  # nothing else was read or written
    swapped.close()


def test_the_other_sides_are_reserved_only_where_the_disk_holds_both(tiers, tmp_path, monkeypatch, caplog):
    swapped = _swapped(tiers, tmp_path)
    groups = [SubGroup(index=i, start=i * 500, end=(i + 1) * 500, slots=()) for i in range(2)]
    usage = namedtuple("usage", "total used free")
    one_side = 2 * 500 * 12
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 0, int(2.1 * one_side)))
    with caplog.at_level("WARNING", logger="infinity.optim.on_nvme"):
        assert not swapped.reserve_other_sides(groups)
    assert "wait for the global norm" in caplog.text
    assert swapped._store.keys() == []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 0, int(2.3 * one_side)))
    assert swapped.reserve_other_sides(groups)
    assert sorted(swapped._store.keys()) == sorted(f"{name}.{i}.b" for i in range(2)
                                                   for name in ("master", "exp_avg", "exp_avg_sq"))
    assert all(swapped._store.nbytes(key) == 500 * 4 for key in swapped._store.keys())
    swapped.close()


def _no_room_after(monkeypatch, allowed_nbytes):
    """The filesystem has ``allowed_nbytes`` of room for the swap file: preallocations past it fail with ENOSPC."""
    import errno
    import os

    real = os.posix_fallocate

    def fallocate(fd, offset, length):
        if offset + length > allowed_nbytes:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)


def test_a_disk_that_fills_while_the_other_sides_are_reserved_falls_back(tiers, tmp_path, monkeypatch, caplog):
    swapped = _swapped(tiers, tmp_path)
    groups = [SubGroup(index=i, start=i * 500, end=(i + 1) * 500, slots=()) for i in range(2)]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 0, 1 << 30))  # room, said free space
    _no_room_after(monkeypatch, 3 * 4096)  # but the disk fills up after three extents
    with caplog.at_level("WARNING", logger="infinity.optim.on_nvme"):
        assert not swapped.reserve_other_sides(groups)
    assert "filled up" in caplog.text
    assert swapped._store.keys() == []  # the sides it had reserved are given back
    assert swapped._store.stats.live_nbytes == 0
    swapped.close()


def test_the_states_in_use_are_reserved_before_any_step_and_a_full_disk_says_so(tiers, tmp_path, monkeypatch):
    swapped = _swapped(tiers, tmp_path)
    groups = [SubGroup(index=i, start=i * 500, end=(i + 1) * 500, slots=()) for i in range(2)]
    swapped.reserve_states(groups)
    assert sorted(swapped._store.keys()) == sorted(f"{name}.{i}" for i in range(2)
                                                   for name in ("master", "exp_avg", "exp_avg_sq"))
    a, b = swapped.sets
    written = _fill(swapped, groups[1], a, seed=0)
    _write(swapped, groups[1], a, other_side=False)  # the first write lands in the reserved extents
    for name, values in _read(swapped, groups[1], b).items():
        assert torch.equal(values, written[name]), name
    swapped.close()

    (tmp_path / "full").mkdir()
    full = _swapped(tiers, tmp_path / "full")
    _no_room_after(monkeypatch, 0)
    with pytest.raises(OSError, match="no room to reserve .* for swap key 'master.0'"):
        full.reserve_states(groups)
    assert full._store.keys() == []
    full.close()
