"""Sharded checkpoints in one process: bitwise resume from every tier, the files, atomicity, damage and
mismatch errors, no pickle, and two runs sharing one nvme_path."""

from __future__ import annotations

import copy
import errno
import json
import os
import pickle
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity
import infinity.commands.consolidate
from infinity import checkpoint
from infinity.checkpoint import consolidation
from infinity.checkpoint import safetensors_io
from infinity.checkpoint import CheckpointError
from infinity.checkpoint.save_dir_lock import LOCK_FILE
from helpers import TiedMLP, TinyGPT, engine_config, engine_train, gpt_batches, mlp_batches

pytestmark = pytest.mark.timeout(120)


class WithBuffers(nn.Module):
    """A frozen layer, a persistent buffer that training changes, and a non-persistent one."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(12, 12)
        self.frozen.requires_grad_(False)
        self.fc = nn.Linear(12, 12)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("cache", torch.arange(4.0), persistent=False)

    def forward(self, x, y):
        self.calls += 1
        return F.mse_loss(self.fc(torch.tanh(self.frozen(x))).float(), y)


def _engine(model, tmp_path: Path, *, param="cpu", optimizer="cpu", accum=1, precision="fp32", **extra):
    config = engine_config(param=param, optimizer=optimizer, nvme_path=str(tmp_path), accum=accum, clip=1.0,
                           lr=1e-2, precision=precision, **extra)
    return infinity.initialize(copy.deepcopy(model), config)


def _train(engine, batches, accum: int) -> list[float]:
    losses = []
    it = iter(batches)
    for _ in range(len(batches) // accum):
        for _ in range(accum):
            loss = engine(*next(it))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _draws() -> tuple:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def _assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# --------------------------------------------------------------------------- resume is bitwise


@pytest.mark.parametrize("param,optimizer,accum,precision", [
    ("cpu", "cpu", 2, "fp32"),
    ("nvme", "nvme", 1, "fp32"),
    ("nvme", "cpu", 2, "bf16"),
    ("none", "nvme", 1, "bf16"),
])
def test_resume_continues_bitwise(tmp_path, param, optimizer, accum, precision):
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(8, batch=2)
    save_dir = tmp_path / "ckpt"
    engine = _engine(model, tmp_path, param=param, optimizer=optimizer, accum=accum, precision=precision)
    first = _train(engine, batches[:4], accum)
    engine.lr = 3e-3
    engine.save_checkpoint(save_dir, client_state={"position": 4, "note": [1, "two", None]})
    draws = _draws()
    rest = _train(engine, batches[4:], accum)
    state = engine.full_state_dict()
    engine.close()

    torch.manual_seed(123)  # a fresh run with other RNG states; the checkpoint brings back the saved ones
    resumed = _engine(model, tmp_path, param=param, optimizer=optimizer, accum=accum, precision=precision)
    client = resumed.load_checkpoint(save_dir)
    assert client == {"position": 4, "note": [1, "two", None]}
    assert resumed.global_step == 4 // accum and resumed.lr == 3e-3
    assert _draws() == draws
    assert torch.equal(torch.tensor(_train(resumed, batches[4:], accum)), torch.tensor(rest))
    _assert_state_equal(resumed.full_state_dict(), state)
    resumed.close()
    assert first  # trained before the save


def test_buffers_frozen_parameters_and_tied_weights_resume(tmp_path):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 12, generator=g), torch.randn(4, 12, generator=g)) for _ in range(6)]
    for model, data in ((WithBuffers(), batches), (TiedMLP(), mlp_batches(6, batch=4))):
        save_dir = tmp_path / type(model).__name__
        engine = _engine(model, tmp_path, param="nvme", optimizer="cpu")
        _train(engine, data[:3], 1)
        engine.save_checkpoint(save_dir)
        rest = _train(engine, data[3:], 1)
        state = engine.full_state_dict()
        engine.close()
        resumed = _engine(model, tmp_path, param="nvme", optimizer="cpu")
        resumed.load_checkpoint(save_dir)
        if isinstance(model, WithBuffers):
            assert float(resumed.module.calls) == 3.0  # the buffer as saved, not as built
        assert _train(resumed, data[3:], 1) == rest
        _assert_state_equal(resumed.full_state_dict(), state)
        resumed.close()


def test_fp16_loss_scale_is_restored(tmp_path):
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(6, batch=2)
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=None, accum=1, clip=1.0, lr=1e-2)
    config["fp16"] = {"enabled": True, "initial_scale_power": 40, "loss_scale_window": 2}  # overflows first
    engine = infinity.initialize(copy.deepcopy(model), config)
    _train(engine, batches[:3], 1)
    scaler = engine.loss_scaler.state_dict()
    engine.save_checkpoint(tmp_path / "ckpt")
    rest = _train(engine, batches[3:], 1)
    engine.close()
    resumed = infinity.initialize(copy.deepcopy(model), config)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.loss_scaler.state_dict() == scaler
    assert _train(resumed, batches[3:], 1) == rest
    resumed.close()


# --------------------------------------------------------------------------- the files


def test_files_are_plain_safetensors_and_json(tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = TinyGPT()
    engine = _engine(model, tmp_path, param="nvme", optimizer="nvme")
    _train(engine, gpt_batches(2, batch=2), 1)
    tag = engine.save_checkpoint(tmp_path / "ckpt", client_state={"step": 2})
    engine.close()
    assert tag == "global_step2"
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2\n"
    folder = tmp_path / "ckpt" / tag
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "shard-00000-of-00001.safetensors"]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["world_size"] == 1 and meta["global_step"] == 2 and meta["client_state"] == {"step": 2}
    names = [p["name"] for p in meta["params"]]
    assert "wte.weight" in names and {"wte.weight", "head.weight"} <= {n for p in meta["params"] for n in p["names"]}
    tensors = load_file(folder / "shard-00000-of-00001.safetensors")  # the reference reader accepts our writer
    for name in names:
        for kind in ("param", "master", "exp_avg", "exp_avg_sq"):
            assert tensors[f"{kind}/{name}"].dtype == torch.float32
    assert tensors["rng/torch"].dtype == torch.uint8
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))


def test_save_only_at_a_step_boundary(tmp_path):
    torch.manual_seed(0)
    engine = _engine(TinyGPT(), tmp_path, accum=2)
    x, y = gpt_batches(1, batch=2)[0]
    try:
        engine.backward(engine(x, y))
        with pytest.raises(RuntimeError, match="1 of 2 micro-batches"):
            engine.save_checkpoint(tmp_path / "ckpt")
        engine.step()
        engine.backward(engine(x, y))
        with pytest.raises(RuntimeError, match=r"call engine.step\(\) first"):
            engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    assert not (tmp_path / "ckpt").exists()


def test_bad_client_state_and_tag_are_named_and_leave_nothing(tmp_path):
    torch.manual_seed(0)
    engine = _engine(TinyGPT(), tmp_path)
    try:
        with pytest.raises(ValueError, match=r"client_state\['data'\]\['pos'\] is a Tensor"):
            engine.save_checkpoint(tmp_path / "ckpt", client_state={"data": {"pos": torch.tensor(3)}})
        with pytest.raises(ValueError, match="not usable as a folder name"):
            engine.save_checkpoint(tmp_path / "ckpt", tag="../elsewhere")
    finally:
        engine.close()
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


# --------------------------------------------------------------------------- atomicity


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    torch.manual_seed(0)
    batches = gpt_batches(4, batch=2)
    save_dir = tmp_path / "ckpt"
    engine = _engine(TinyGPT(), tmp_path, param="nvme", optimizer="nvme")
    try:
        _train(engine, batches[:2], 1)
        engine.save_checkpoint(save_dir, tag="good")
        saved = engine.full_state_dict()
        _train(engine, batches[2:], 1)
        written = []
        real = safetensors_io._write_chunk

        def disk_full(file, hasher, data):
            written.append(len(data))
            if len(written) > 20:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(file, hasher, data)

        monkeypatch.setattr(safetensors_io, "_write_chunk", disk_full)
        with pytest.raises(OSError, match=r"No space left on device.*shard-00000-of-00001.safetensors"):
            engine.save_checkpoint(save_dir, tag="bad")
        monkeypatch.setattr(safetensors_io, "_write_chunk", real)
        # no partial folder left (beside the lock file this run holds the folder by)
        assert sorted(p.name for p in save_dir.iterdir()) == [LOCK_FILE, "good", "latest"]
        engine.load_checkpoint(save_dir)
        _assert_state_equal(engine.full_state_dict(), saved)
    finally:
        engine.close()


def test_saving_the_tag_latest_names_replaces_it_safely(tmp_path, monkeypatch):
    torch.manual_seed(0)
    save_dir = tmp_path / "ckpt"
    engine = _engine(TinyGPT(), tmp_path)
    try:
        engine.save_checkpoint(save_dir, tag="t")
        seen = []
        real = checkpoint.publish.write_text_atomic

        def spy(path, text):  # while "t" is replaced, `latest` names an intact copy of the old one
            target = save_dir / text.strip()
            checkpoint.read_meta(target)
            checkpoint.Checkpoint(target).verify()
            seen.append(text.strip())
            real(path, text)

        monkeypatch.setattr(checkpoint.publish, "write_text_atomic", spy)
        _train(engine, gpt_batches(1, batch=2), 1)
        engine.save_checkpoint(save_dir, tag="t")
        assert seen[0].startswith(".old-") and seen[-1] == "t"
        assert sorted(p.name for p in save_dir.iterdir()) == [LOCK_FILE, "latest", "t"]
        assert checkpoint.read_meta(save_dir / "t")["global_step"] == 1
    finally:
        engine.close()


def test_leftovers_of_killed_saves_are_removed(tmp_path):
    torch.manual_seed(0)
    save_dir = tmp_path / "ckpt"
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = finished.pid
    (save_dir / f".tmp-{dead}-00000000abcd-global_step9").mkdir(parents=True)
    (save_dir / f".tmp-{dead}-00000000abcd-global_step9" / "shard-00000-of-00001.safetensors").write_bytes(b"x")
    (save_dir / f".tmp-{os.getppid()}-00000000abcd-other").mkdir()  # a live process's: kept
    engine = _engine(TinyGPT(), tmp_path)
    try:
        engine.save_checkpoint(save_dir)
    finally:
        engine.close()
    assert sorted(p.name for p in save_dir.iterdir()) == [f".tmp-{os.getppid()}-00000000abcd-other",
                                                          "global_step0", "latest"]


# --------------------------------------------------------------------------- damage and mismatch


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of TinyGPT after two steps, and the full state it holds."""
    root = tmp_path_factory.mktemp("saved")
    torch.manual_seed(0)
    model = TinyGPT()
    engine = _engine(model, root, param="nvme", optimizer="nvme")
    _train(engine, gpt_batches(2, batch=2), 1)
    engine.save_checkpoint(root / "ckpt")
    state = engine.full_state_dict()
    engine.close()
    return model, root / "ckpt", state


def _damaged_copy(saved, tmp_path, damage) -> Path:
    copy_dir = tmp_path / "ckpt"
    shutil.copytree(saved[1], copy_dir)
    damage(copy_dir / "global_step2")
    return copy_dir


def _flip_byte(path: Path, offset_from_end: int = 1000) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


SHARD = "shard-00000-of-00001.safetensors"


@pytest.mark.parametrize("damage,message", [
    (lambda d: _flip_byte(d / SHARD), rf"{SHARD} is corrupt: its sha256 does not match"),
    (lambda d: os.truncate(d / SHARD, (d / SHARD).stat().st_size - 100), rf"{SHARD} has \d+ bytes .*\(truncated\)"),
    (lambda d: (d / SHARD).unlink(), rf"{SHARD} is missing"),
    (lambda d: _flip_byte(d / "meta.json", 200), r"meta.json is damaged"),
    (lambda d: os.truncate(d / "meta.json", 300), r"meta.json is damaged"),
])
def test_damaged_checkpoint_is_refused_naming_the_file(saved, tmp_path, damage, message):
    model, _, _ = saved
    copy_dir = _damaged_copy(saved, tmp_path, damage)
    engine = _engine(model, tmp_path, param="nvme", optimizer="nvme")
    try:
        before = engine.full_state_dict()
        with pytest.raises(CheckpointError, match=message):
            engine.load_checkpoint(copy_dir)
        _assert_state_equal(engine.full_state_dict(), before)  # nothing was loaded
        assert engine.global_step == 0
    finally:
        engine.close()


def test_missing_checkpoint_is_named(tmp_path, saved):
    engine = _engine(saved[0], tmp_path)
    try:
        with pytest.raises(FileNotFoundError, match="no 'latest' file"):
            engine.load_checkpoint(tmp_path)
        with pytest.raises(FileNotFoundError, match="checkpoint 'nope' not found"):
            engine.load_checkpoint(saved[1], tag="nope")
    finally:
        engine.close()


def test_checkpoint_of_another_model_names_the_first_mismatched_tensor(saved, tmp_path):
    for other, message in ((TinyGPT(d=48), r"parameter 'wpe' has shape \[16, 32\] in the checkpoint and "
                                           r"\[16, 48\] in this model"),
                           (TinyGPT(n_layer=3), r"parameter 'blocks.2.ln1.weight' .* is in this model but not in "
                                                r"the checkpoint"),
                           (TinyGPT(n_layer=1), r"parameter 'blocks.1.ln1.weight' .* is in the checkpoint but not "
                                                r"in this model")):
        engine = _engine(other, tmp_path)
        try:
            with pytest.raises(CheckpointError, match=r"saved from another model: " + message):
                engine.load_checkpoint(saved[1])
        finally:
            engine.close()


def test_loading_never_unpickles(saved, tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a checkpoint was unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    engine = _engine(saved[0], tmp_path)
    try:
        engine.load_checkpoint(saved[1])
        _assert_state_equal(engine.full_state_dict(), saved[2])
    finally:
        engine.close()
    source = "".join(Path(m.__file__).read_text()
                     for m in (checkpoint, safetensors_io, consolidation, infinity.commands.consolidate))
    for code in ("import pickle", "pickle.", "torch.load(", "np.load(", "numpy.load(", "allow_pickle", "weights_only"):
        assert code not in source, code


# --------------------------------------------------------------------------- one nvme_path, two runs


def test_two_runs_on_one_nvme_path_keep_their_own_files(tmp_path):
    torch.manual_seed(0)
    gpt, mlp = TinyGPT(), TiedMLP()
    gpt_data, mlp_data = gpt_batches(6, batch=2), mlp_batches(6, batch=4)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cfg = dict(param="nvme", optimizer="nvme", nvme_path=str(nvme), accum=1, clip=1.0, lr=1e-2)
    ref_gpt = engine_train(gpt, engine_config(**cfg), gpt_data, steps=6, accum=1)[0]
    ref_mlp = engine_train(mlp, engine_config(**cfg), mlp_data, steps=6, accum=1)[0]
    assert not any(nvme.iterdir())

    a = infinity.initialize(copy.deepcopy(gpt), engine_config(**cfg))
    b = infinity.initialize(copy.deepcopy(mlp), engine_config(**cfg))
    dirs = sorted(nvme.iterdir())
    assert len(dirs) == 2 and all(d.name.startswith("infinity-swap-") for d in dirs)
    losses_a, losses_b = [], []
    for i in range(4):  # interleaved, as two concurrent runs would be
        losses_a += _train(a, gpt_data[i:i + 1], 1)
        losses_b += _train(b, mlp_data[i:i + 1], 1)
    a_dir = [d for d in dirs if d.exists() and any(d.iterdir())]
    a.close()
    left = sorted(nvme.iterdir())
    assert len(left) == 1 and left[0] in a_dir  # a removed only its own folder
    losses_b += _train(b, mlp_data[4:], 1)
    b.close()
    assert not any(nvme.iterdir())
    assert losses_a == ref_gpt[:4]
    assert losses_b == ref_mlp


def test_load_into_other_tiers_precision_sub_groups_and_trainability(tmp_path, saved):
    """Shards are stored per parameter, so the loading run may differ in all of these."""
    model, save_dir, state = saved
    engine = _engine(model, tmp_path, param="cpu", optimizer="cpu", precision="bf16", sub_group_size=100_000)
    try:
        engine.load_checkpoint(save_dir)
        _assert_state_equal(engine.full_state_dict(), state)  # fp32 masters as saved
        x, y = gpt_batches(1, batch=2)[0]
        engine.backward(engine(x, y))  # compute shards recast to bf16 from the masters: it trains
        engine.step()
    finally:
        engine.close()

    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 12, generator=g), torch.randn(4, 12, generator=g)) for _ in range(2)]
    frozen_then = WithBuffers()
    engine = _engine(frozen_then, tmp_path)
    _train(engine, data, 1)
    engine.save_checkpoint(tmp_path / "frozen")
    before = engine.full_state_dict()
    engine.close()
    trainable_now = copy.deepcopy(frozen_then)
    trainable_now.frozen.requires_grad_(True)
    engine = _engine(trainable_now, tmp_path)
    try:
        engine.load_checkpoint(tmp_path / "frozen")
        _assert_state_equal(engine.full_state_dict(), before)  # its master comes from its compute shard
    finally:
        engine.close()
