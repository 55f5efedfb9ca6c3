"""Persistent parameters' compute shards rest in host memory while the others are on NVMe.

A parameter of at most ``param_persistence_threshold`` elements keeps its full tensor in device memory from one
use to the next; with ``offload_param`` on NVMe its shard rests in host memory too, so a step's new values never
cross the disk as a small read. The reference is the same engine with the threshold at 0 (every shard on NVMe):
the same losses, states and full state dict bit for bit, with fp32 states (the shards have files of their own)
and with bf16/int8 states whose master is read as the compute shards (the update copies the persistent ones out
of it), through speculative updates that are undone and redone (clipping at 0.5 clips most steps)."""

from __future__ import annotations

import copy

import pytest
import torch

import infinity
from helpers import TinyGPT, engine_config, gpt_batches, optimizer_states, train_batches
from infinity.params.compute_shards import ComputeShards
from infinity.placement.estimate import estimate
from infinity.placement.layout import ALIGN_NUMEL

STEPS = 4
THRESHOLD = 200
"""Norms and biases of TinyGPT persist (32-128 elements); its matrices and embeddings (512+) do not."""


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT(), gpt_batches(STEPS, batch=2)


def _config(folder, state_dtype: str, *, threshold: int, overlap: bool = True, clip: float = 0.5,
            behind: bool = True) -> dict:
    """``behind`` off: the worker takes every sub-group that arrives during backward, whatever its pace."""
    folder.mkdir(parents=True, exist_ok=True)
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(folder), accum=1, clip=clip, lr=3e-3,
                           precision="bf16", sub_group_size=4096, overlap_step_with_backward=overlap,
                           overlap_step_with_forward=behind, stage3_param_persistence_threshold=threshold)
    config["zero_optimization"]["offload_optimizer"]["state_dtype"] = state_dtype
    return config


def _run(model, batches, config) -> tuple[list[float], dict, dict, int]:
    engine = infinity.initialize(copy.deepcopy(model), config)
    try:
        losses = train_batches(engine, batches)
        states = optimizer_states(engine)
        return losses, states, engine.full_state_dict(), engine.optimizer.rollbacks
    finally:
        engine.close()


@pytest.mark.parametrize("state_dtype,overlap", [("fp32", True), ("int8", True), ("bf16", False)])
def test_persistent_shards_in_host_memory_train_as_on_nvme(gpt, tmp_path, state_dtype, overlap):
    model, batches = gpt
    # on NVMe with the updates behind the forward; in host memory with every update during backward speculative,
    # on every machine (none left behind the forward), so that undone ones surely restore persistent shards
    want = _run(model, batches, _config(tmp_path / "nvme", state_dtype, threshold=0, overlap=overlap))
    got = _run(model, batches, _config(tmp_path / "host", state_dtype, threshold=THRESHOLD, overlap=overlap,
                                       behind=False))
    assert got[0] == want[0]
    for key in want[1]:
        assert torch.equal(got[1][key], want[1][key]), key
    for key in want[2]:
        assert torch.equal(got[2][key], want[2][key]), key
    assert got[3] > 0 or not overlap  # speculative updates were undone: their persistent shards restored


def test_persistent_shards_never_cross_the_disk(gpt, tmp_path, monkeypatch):
    """No NVMe read of a persistent shard, from a file of its own or from the master; no file of its own; and the
    host bytes they take are those ``estimate`` gives."""
    model, batches = gpt
    read_slots = []
    read = ComputeShards.read

    def recording(self, slot, out):
        read_slots.append(slot.index)
        return read(self, slot, out)

    monkeypatch.setattr(ComputeShards, "read", recording)
    for state_dtype in ("fp32", "int8"):
        read_slots.clear()
        config = _config(tmp_path / state_dtype, state_dtype, threshold=THRESHOLD)
        engine = infinity.initialize(copy.deepcopy(model), config)
        try:
            train_batches(engine, batches)
            engine.optimizer.flush()
            persistent = engine.layout.persistent_slots(THRESHOLD)
            assert persistent and len(persistent) < len(engine.layout.slots)
            assert read_slots and not persistent & set(read_slots)
            own_files = {k for k in engine.compute._store.keys() if k.startswith("param.")}
            assert not own_files & {f"param.{i}" for i in persistent}
            for slot in engine.layout.slots:
                assert (engine.compute.resident(slot) is not None) == (slot.index in persistent), slot.name
            host = engine.compute.nbytes_resident()
            assert host == sum(-(-slot.shard_numel // ALIGN_NUMEL) * ALIGN_NUMEL * 2
                               for slot in engine.layout.slots if slot.index in persistent)
            planned = estimate(param_numels=[p.numel() for p in model.parameters()], offload_param="nvme",
                               offload_optimizer="nvme", precision="bf16", max_in_cpu=0, state_dtype=state_dtype,
                               param_persistence_threshold=THRESHOLD)
            assert planned["tiers"]["host"]["compute_shard"] == host
        finally:
            engine.close()


def test_restoring_the_compute_shards_copies_the_persistent_ones_from_the_master(gpt, tmp_path):
    """After an undone update that is not redone (an fp16 overflow's skip), ``restore_compute`` gives every
    compute shard its master's value again; for a sub-group whose master holds the shards, the persistent ones
    are copied from it (the others are read from it)."""
    model, batches = gpt
    engine = infinity.initialize(copy.deepcopy(model), _config(tmp_path, "int8", threshold=THRESHOLD, clip=0.0))
    try:
        train_batches(engine, batches[:2])
        engine.optimizer.flush()
        persistent = engine.layout.persistent_slots(THRESHOLD)
        mixed = [group for group in engine.layout.sub_groups if group.index in engine.optimizer.delivery.master_groups
                 and any(slot.index in persistent for slot in group.slots)]
        assert mixed  # sub-groups of persistent shards alone write them as any resident shards
        for group in mixed:
            slots = [slot for slot in group.slots if slot.index in persistent]
            for slot in slots:
                engine.compute.resident(slot).fill_(7.0)  # what a speculative update left
            engine.optimizer.restore_compute(group)
            master = torch.empty(group.numel)
            engine.optimizer.read_state("master", group, master)
            for slot in slots:
                start = slot.offset - group.start
                want = master[start:start + slot.shard_numel].to(torch.bfloat16)
                assert torch.equal(engine.compute.resident(slot), want), slot.name
    finally:
        engine.close()
