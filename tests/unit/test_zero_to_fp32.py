"""``deepspeed.utils.zero_to_fp32`` over the engine's checkpoints: the state dict it gives, the plain model it
loads and the files it writes hold the values the run had when it saved (its ``full_state_dict()``), under every
name the plain model's ``state_dict()`` has; a LoRA-style checkpoint without its frozen parameters gives the
trained ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import infinity.deepspeed as deepspeed
from infinity.checkpoint.publish import TMP_PREFIX
from infinity.checkpoint.recovery_script import RECOVERY_SCRIPT_NAME
from infinity.deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                                   get_fp32_state_dict_from_zero_checkpoint,
                                                   load_state_dict_from_zero_checkpoint)
from unit.test_deepspeed_door import ADAMW, config

pytestmark = pytest.mark.device_independent  # files read without an engine: the distinct pass leaves it out


class Tied(torch.nn.Module):
    """An embedding tied to its head, a frozen projection and a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.tensor([0.5]))

    def forward(self, ids):
        logits = self.head(torch.tanh(self.frozen(self.embed(ids))) * self.scale)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def trained(tmp_path, *, exclude_frozen=False):
    """A run of two steps saved under tmp_path/ckpt; its full_state_dict() at the save."""
    torch.manual_seed(0)
    model = Tied()
    ids = torch.randint(0, 32, (16, 6))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                           if p.requires_grad],
                                           config=config(**ADAMW, train_batch_size=4))
    with engine:
        for step in range(2):
            engine.backward(engine(ids[4 * step:4 * step + 4]))
            engine.step()
        engine.save_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=exclude_frozen)
        return engine.full_state_dict()


def test_the_state_dict_and_the_plain_model_hold_the_values_of_the_save(tmp_path):
    expected = trained(tmp_path)
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert state.keys() == Tied().state_dict().keys()  # the tied head's name too, and the buffer
    assert all(torch.equal(state[name], expected[name]) for name in expected)
    model = load_state_dict_from_zero_checkpoint(Tied(), tmp_path / "ckpt")
    assert all(torch.equal(value, expected[name]) for name, value in model.state_dict().items())
    assert model.head.weight is model.embed.weight


@pytest.mark.parametrize("safe", [False, True], ids=["bin", "safetensors"])
def test_converted_files_hold_the_values_and_a_folders_other_files_are_kept(tmp_path, safe):
    expected = trained(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out, safe_serialization=safe)
    name = "model.safetensors" if safe else "pytorch_model.bin"
    assert sorted(p.name for p in out.iterdir()) == sorted([name, "notes.txt"])
    assert (out / "notes.txt").read_text() == "mine"
    written = _read(out / name)
    assert written.keys() == expected.keys() and all(torch.equal(written[n], v) for n, v in expected.items())

    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out, max_shard_size="1KB", safe_serialization=safe)
    index = json.loads((out / ("model.safetensors.index.json" if safe else "pytorch_model.bin.index.json")).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (out / name).exists() and (out / "notes.txt").exists()
    written = {}
    for file in files:
        written.update(_read(out / file))
    assert written.keys() == expected.keys() and all(torch.equal(written[n], v) for n, v in expected.items())


@pytest.mark.parametrize("file", ["model.pt", "model.safetensors"])
def test_an_output_file_is_one_state_dict(tmp_path, file):
    expected = trained(tmp_path)
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / file)
    written = _read(tmp_path / file)
    assert written.keys() == expected.keys() and all(torch.equal(written[n], v) for n, v in expected.items())
    assert [p.name for p in tmp_path.iterdir() if TMP_PREFIX in p.name] == []  # no temporary left


def test_a_checkpoint_without_its_frozen_parameters_gives_the_trained_ones(tmp_path):
    expected = trained(tmp_path, exclude_frozen=True)
    with pytest.raises(Exception, match="saved without its frozen parameters"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=True)
    assert sorted(state) == ["embed.weight", "head.weight", "scale"]
    assert all(torch.equal(value, expected[name]) for name, value in state.items())
    with pytest.raises(ValueError, match="max_shard_size: cannot read 'big'"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "out", max_shard_size="big")
    assert not (tmp_path / "out").exists()


def _run_script(script: Path, *args) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` as a user runs it: a fresh interpreter, from the save folder, this checkout importable."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=script.parent, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_save_folders_zero_to_fp32_script_writes_the_weights_as_deepspeeds_does(tmp_path):
    expected = trained(tmp_path)
    script = tmp_path / "ckpt" / RECOVERY_SCRIPT_NAME
    assert script.is_file()  # beside the tags and `latest`, where DeepSpeed writes its own
    done = _run_script(script, ".", tmp_path / "out", "--safe_serialization", "--max_shard_size", "1KB")
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    written = {}
    for file in sorted(set(index["weight_map"].values())):
        written.update(_read(tmp_path / "out" / file))
    assert written.keys() == expected.keys() and all(torch.equal(written[n], v) for n, v in expected.items())

    done = _run_script(script, ".", tmp_path / "pytorch_model.bin")  # DeepSpeed's older output_file
    assert done.returncode == 0, done.stderr
    written = _read(tmp_path / "pytorch_model.bin")
    assert written.keys() == expected.keys() and all(torch.equal(written[n], v) for n, v in expected.items())

    done = _run_script(script, tmp_path / "nowhere", tmp_path / "out2")
    assert done.returncode == 2 and "zero_to_fp32.py: error:" in done.stderr and "nowhere" in done.stderr
    assert not (tmp_path / "out2").exists()


def test_the_script_names_its_flag_for_a_checkpoint_without_its_frozen_parameters(tmp_path):
    expected = trained(tmp_path, exclude_frozen=True)
    script = tmp_path / "ckpt" / RECOVERY_SCRIPT_NAME
    done = _run_script(script, ".", tmp_path / "out")
    assert done.returncode == 2 and "saved without its frozen parameters" in done.stderr
    assert "zero_to_fp32.py --exclude_frozen_parameters" in done.stderr and not (tmp_path / "out").exists()
    done = _run_script(script, ".", tmp_path / "out.safetensors", "--exclude_frozen_parameters")
    assert done.returncode == 0, done.stderr
    written = _read(tmp_path / "out.safetensors")
    assert sorted(written) == ["embed.weight", "head.weight", "scale"]
    assert all(torch.equal(value, expected[name]) for name, value in written.items())


def test_a_zero_to_fp32_script_not_ours_is_kept(tmp_path, caplog):
    theirs = "# DeepSpeed's own recovery script\nprint('theirs')\n"
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / RECOVERY_SCRIPT_NAME).write_text(theirs)
    trained(tmp_path)
    assert (tmp_path / "ckpt" / RECOVERY_SCRIPT_NAME).read_text() == theirs
    assert any("is not zero-infinity's" in r.getMessage() for r in caplog.records)


def _read(path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        with safe_open(str(path), "pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    return torch.load(path)


def test_save_16bit_model_writes_tied_names_to_safetensors_each_as_its_own(tmp_path):
    model = Tied()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                           if p.requires_grad],
                                           config=config(**ADAMW))
    with engine:
        engine.save_16bit_model(tmp_path, "model.safetensors")  # fp32: the head and the embedding share one tensor
        expected = engine.full_state_dict()
    written = _read(tmp_path / "model.safetensors")
    assert written.keys() == expected.keys() and all(torch.equal(written[n], v) for n, v in expected.items())
