"""The checkpoint code sees a run only through a ShardSource: a source over plain tensors (no engine) saves
and loads through it (that the checkpoint wing imports none of the engine's parts: test_wings.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from infinity.checkpoint import load_checkpoint, save_checkpoint
from infinity.checkpoint.frozen import METADATA_KEY, FrozenDigest
from infinity.checkpoint.consolidation import consolidate
from infinity.checkpoint.safetensors_io import CheckpointError
from infinity.runtime.comm import Collectives
from infinity.config.schema import InfinityConfig
from infinity.checkpoint.shard_source import ModelBuffer, ParamShard, RunCounters, ShardRun, ShardSpan

pytestmark = pytest.mark.timeout(60)

class MemorySource:
    """One rank of one: parameters ``a`` (3x4, also named ``tied_a``) and ``b`` (5) trainable in one sub-group
    of 24 elements (``b`` starts at 16: the gap is padding), ``c`` (2x2) frozen; every value in a plain tensor."""

    STATES = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.comm = Collectives()
        self.config = InfinityConfig()
        self.compute_dtype = torch.float32
        self.tiling_plan = None
        self.step_in_progress = False
        self.params = (ParamShard(0, "a", (3, 4), 12, 12, True), ParamShard(1, "b", (5,), 5, 5, True),
                       ParamShard(2, "c", (2, 2), 4, 4, False))
        self.param_names = (("a", 0), ("tied_a", 0), ("b", 1), ("c", 2))
        self.state_runs = tuple(
            ShardRun(i, state, torch.float32, 0, 24, "host",
                     (ShardSpan(0, f"{state}/a", 0, 12), ShardSpan(1, f"{state}/b", 16, 5)))
            for i, state in enumerate(self.STATES))
        self.compute_runs = tuple(ShardRun(3 + p.index, "param", torch.float32, 0, p.numel, "nvme",
                                           (ShardSpan(p.index, f"param/{p.name}", 0, p.numel),))
                                  for p in self.params)
        self.states = {state: torch.randn(24, generator=g) for state in self.STATES}
        self.compute = {p.index: torch.randn(p.numel, generator=g) for p in self.params}
        self.buffer = torch.randn(3, generator=g)
        self.run_counters = RunCounters(global_step=seed + 7, micro_step=seed + 7)
        self.optimizer = {"step": seed + 7, "lr": 0.5 + seed}
        self.changed = False
        self.frozen = FrozenDigest()
        self.frozen.add(2, self.compute[2])  # as the engine fingerprints its frozen shards when it writes them

    def buffers(self):
        return (ModelBuffer("running", self.buffer, True),)

    def read(self, run, out_host):
        out_host.copy_(self.compute[run.spans[0].param] if run.state == "param" else self.states[run.state])

    def write(self, run, values_host):
        target = self.compute[run.spans[0].param] if run.state == "param" else self.states[run.state]
        target.copy_(values_host)

    def host_view(self, run):
        return None

    def empty_host(self, numel, dtype):
        return torch.empty(numel, dtype=dtype)

    def free_host(self, tensor):
        pass

    def counters(self):
        return self.run_counters

    def set_counters(self, counters):
        self.run_counters = counters

    def optimizer_state(self):
        return dict(self.optimizer)

    def load_optimizer_state(self, state):
        self.optimizer = dict(state)

    def loss_scaler_state(self):
        return None

    def load_loss_scaler_state(self, state):
        raise AssertionError("no loss scaler was saved")

    def compute_shards_changed(self):
        self.changed = True


def test_a_source_without_an_engine_saves_and_loads_every_shard(tmp_path):
    saved, restored = MemorySource(0), MemorySource(1)
    tag = save_checkpoint(saved, tmp_path, client_state={"note": "x"})
    assert tag == "global_step7"
    with safe_open(str(tmp_path / tag / "shard-00000-of-00001.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert torch.equal(f.get_tensor("exp_avg/b"), saved.states["exp_avg"][16:21])
    rng = {"rng/torch", "rng/cuda"} if torch.cuda.is_available() else {"rng/torch"}
    assert keys == {f"{s}/{p}" for s in MemorySource.STATES for p in "ab"} | {"param/a", "param/b", "param/c",
                                                                             "buffer/running"} | rng
    meta = json.loads((tmp_path / tag / "meta.json").read_text())
    assert [p["names"] for p in meta["params"]] == [["a", "tied_a"], ["b"], ["c"]]
    assert meta["sub_groups"] == [[0, 24, [0, 1]]]

    assert load_checkpoint(restored, tmp_path) == {"note": "x"}
    for state in MemorySource.STATES:
        assert torch.equal(restored.states[state][:12], saved.states[state][:12])
        assert torch.equal(restored.states[state][16:21], saved.states[state][16:21])
        assert not restored.states[state][12:16].any() and not restored.states[state][21:].any()  # padding
    for index, values in saved.compute.items():
        assert torch.equal(restored.compute[index], values)
    assert torch.equal(restored.buffer, saved.buffer)
    assert restored.run_counters == saved.run_counters and restored.optimizer == saved.optimizer
    assert restored.changed




def test_a_checkpoint_without_the_frozen_parameters_loads_only_beside_the_same_ones(tmp_path):
    """exclude_frozen_parameters: the frozen ``c`` is not in the file, its fingerprint is; a run holding the same
    ``c`` gets everything else back and keeps its ``c``; a run holding another ``c`` is refused before any change."""
    saved = MemorySource(0)
    tag = save_checkpoint(saved, tmp_path, exclude_frozen_parameters=True)
    with safe_open(str(tmp_path / tag / "shard-00000-of-00001.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata()[METADATA_KEY] == saved.frozen.hexdigest()
    assert "param/c" not in keys and {"param/a", "param/b"} <= keys
    assert json.loads((tmp_path / tag / "meta.json").read_text())["frozen_excluded"] is True

    same = MemorySource(1)
    same.compute[2].copy_(saved.compute[2])
    same.frozen = FrozenDigest()
    same.frozen.add(2, same.compute[2])
    load_checkpoint(same, tmp_path)
    for index, values in saved.compute.items():
        assert torch.equal(same.compute[index], values)
    for state in MemorySource.STATES:
        assert torch.equal(same.states[state][:12], saved.states[state][:12])
        assert torch.equal(same.states[state][16:21], saved.states[state][16:21])

    other = MemorySource(2)  # its own c
    before = {state: v.clone() for state, v in other.states.items()}
    with pytest.raises(CheckpointError, match="saved without its frozen parameters .* not the ones it was saved beside"):
        load_checkpoint(other, tmp_path)
    assert all(torch.equal(other.states[s], before[s]) for s in MemorySource.STATES) and not other.changed
    with pytest.raises(CheckpointError, match="saved without its frozen parameters .* not a whole model"):
        consolidate(tmp_path, tmp_path / "whole.safetensors")
    assert not (tmp_path / "whole.safetensors").exists()


def test_loading_the_frozen_parameters_fingerprints_them_again(tmp_path):
    """A checkpoint that holds the frozen values replaces them and their fingerprint, so a later checkpoint without
    them loads beside them."""
    saved = MemorySource(0)
    save_checkpoint(saved, tmp_path / "whole")
    run = MemorySource(3)
    assert run.frozen.hexdigest() != saved.frozen.hexdigest()
    load_checkpoint(run, tmp_path / "whole")
    assert run.frozen.hexdigest() == saved.frozen.hexdigest()
    save_checkpoint(saved, tmp_path / "lean", exclude_frozen_parameters=True)
    load_checkpoint(run, tmp_path / "lean")
