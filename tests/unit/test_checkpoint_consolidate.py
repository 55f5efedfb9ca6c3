"""`infinity consolidate`: one state dict under the original names, loadable by plain PyTorch, streamed."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

import infinity
from infinity.cli import main
from helpers import TinyGPT, engine_config, gpt_batches

# the checkpoint's files, read: the distinct pass leaves it out
pytestmark = [pytest.mark.timeout(120), pytest.mark.device_independent]


class Buffered(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("cache", torch.arange(3.0), persistent=False)

    def forward(self, x, y):
        self.steps += 1
        return F.mse_loss((self.frozen(self.fc(x)) * self.scale).float(), y)


def _save(model, batches, save_dir, tmp_path, **extra) -> dict:
    config = engine_config(param="nvme", optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=1.0, lr=1e-2)
    config.update(extra)
    engine = infinity.initialize(copy.deepcopy(model), config)
    try:
        for batch in batches:
            engine.backward(engine(*batch))
            engine.step()
        engine.save_checkpoint(save_dir)
        return engine.full_state_dict()
    finally:
        engine.close()


def test_consolidated_file_loads_into_the_plain_model(tmp_path, capsys):
    torch.manual_seed(0)
    model = TinyGPT()
    state = _save(model, gpt_batches(2, batch=2), tmp_path / "ckpt", tmp_path)
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    consolidated = load_file(out)
    plain = copy.deepcopy(model)
    plain.load_state_dict(consolidated)  # strict: every key, nothing extra
    assert {"wte.weight", "head.weight"} <= consolidated.keys()  # tied: both names
    assert consolidated.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(consolidated[key], value), key

    assert main(["consolidate", str(tmp_path / "ckpt" / "global_step2"), str(out), "--dtype", "bf16"]) == 0
    halves = load_file(out)
    for key, value in state.items():
        assert halves[key].dtype == torch.bfloat16 and torch.equal(halves[key], value.bfloat16()), key


def test_buffers_frozen_and_tiled_layers_get_their_dense_names(tmp_path):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = Buffered()
    state = _save(model, [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))] * 2,
                  tmp_path / "buffered", tmp_path)
    out = tmp_path / "buffered.safetensors"
    assert main(["consolidate", str(tmp_path / "buffered"), str(out), "--dtype", "bf16"]) == 0
    consolidated = load_file(out)
    plain = Buffered()
    plain.load_state_dict(consolidated)  # strict, and without the non-persistent "cache"
    assert int(plain.steps) == 2 and consolidated["steps"].dtype == torch.int64
    assert torch.equal(consolidated["frozen.weight"], state["frozen.weight"].bfloat16())

    torch.manual_seed(0)
    gpt = TinyGPT()
    tiled_state = _save(gpt, gpt_batches(2, batch=2), tmp_path / "tiled", tmp_path, tiling={"max_tile_numel": 1024})
    assert main(["consolidate", str(tmp_path / "tiled"), str(tmp_path / "tiled.safetensors")]) == 0
    dense = load_file(tmp_path / "tiled.safetensors")
    copy.deepcopy(gpt).load_state_dict(dense)
    assert dense.keys() == tiled_state.keys()
    for key, value in tiled_state.items():
        assert torch.equal(dense[key], value), key


def test_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, capsys):
    torch.manual_seed(0)
    _save(TinyGPT(), gpt_batches(1, batch=2), tmp_path / "ckpt", tmp_path)
    shard = tmp_path / "ckpt" / "global_step1" / "shard-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5000] ^= 1
    shard.write_bytes(bytes(data))
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(shard) in err and "corrupt" in err
    assert not out.exists() and not list(tmp_path.glob(".model.safetensors*"))


def test_a_file_given_as_checkpoint_and_fp16_without_hf_are_named(tmp_path, capsys):
    """A file given as CKPT (or to train --resume) was said not to exist; --dtype fp16 without --hf was refused as
    "dtype must be one of ['bf16', 'fp32']", naming no flag."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert main(["consolidate", str(notes), str(tmp_path / "m.safetensors")]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err
    assert main(["train", "--preset", "tiny", "--resume", str(notes)]) == 2
    assert f"--resume {str(notes)!r} is a file" in capsys.readouterr().err
    torch.manual_seed(0)
    _save(TinyGPT(), gpt_batches(1, batch=2), tmp_path / "ckpt", tmp_path)
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors"), "--dtype", "fp16"]) == 2
    assert "--dtype fp16 needs --hf" in capsys.readouterr().err
    assert notes.read_text() == "mine" and not (tmp_path / "m.safetensors").exists()


def test_hf_of_a_checkpoint_of_a_model_that_is_not_hugging_faces_says_to_write_one_file(tmp_path, capsys):
    """It said "pass --hf-config DIR (the model folder the run started from)": a preset's run has no such folder."""
    torch.manual_seed(0)
    _save(TinyGPT(), gpt_batches(1, batch=2), tmp_path / "ckpt", tmp_path)
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--hf"]) == 2
    err = capsys.readouterr().err
    assert "its model is not a Hugging Face transformers model" in err
    advice = f"`infinity consolidate {tmp_path / 'ckpt'} OUT.safetensors`"
    assert advice in err and not (tmp_path / "out").exists()
    assert main(advice.strip("`").split()[1:-1] + [str(tmp_path / "m.safetensors")]) == 0  # the advice works


_MEASURE = """
import json, sys
from infinity.checkpoint.consolidation import consolidate
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
before = status("VmRSS")
summary = consolidate(sys.argv[1], sys.argv[2])
result = {"growth": status("VmHWM") - before, "largest": summary["largest_tensor_nbytes"], "total": summary["nbytes"]}
print(json.dumps(result))
"""


def test_peak_memory_is_about_the_largest_tensor(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(24)])  # 24 tensors of 1 MiB
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=None, accum=1, clip=0.0, lr=1e-3)
    engine = infinity.initialize(model, config)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors")],
                            capture_output=True, text=True, env=env, timeout=100)
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["total"] > 24 * measured["largest"]
    # about the largest tensor plus the allocator's first-use overhead (a few MiB), not the 24 MiB of the model
    assert measured["growth"] < 3 * measured["largest"] + (4 << 20), measured
