"""Checkpoints at world size 2: bitwise resume, resharding 2 -> 1 and 1 -> 2, and failures that every
rank reports (a damaged file of one rank, a save that fails on one rank) instead of a deadlock."""

from __future__ import annotations

import copy
import errno
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import infinity
from infinity.checkpoint.save_dir_lock import LOCK_FILE
from helpers import TinyGPT, engine_config, gpt_batches, run_ranks, train_batches

pytestmark = pytest.mark.timeout(180)

ACCUM = 2


def _setup(nvme: str):
    Path(nvme).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(8, batch=4)
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=nvme, accum=ACCUM, clip=1.0, lr=1e-2)
    return model, batches, config


def _train(engine, batches, rank: int, world_size: int) -> list[float]:
    return train_batches(engine, batches, rank=rank, world_size=world_size)


def _moments(engine) -> dict[str, torch.Tensor]:
    """This rank's exp_avg shards by parameter name, read back from the optimizer's tier."""
    out = {}
    for group in engine.layout.sub_groups:
        values = torch.empty(group.numel)
        engine.optimizer.read_state("exp_avg", group, values)
        for s in group.slots:
            out[s.name] = values[s.offset - group.start:s.offset - group.start + s.shard_numel].clone()
    return out


def _saved_moments(folder: Path, world_size: int) -> dict[str, torch.Tensor]:
    """Every parameter's whole padded exp_avg, from the shard files read by the reference safetensors reader."""
    from safetensors.torch import load_file
    files = [load_file(folder / f"shard-{r:05d}-of-{world_size:05d}.safetensors") for r in range(world_size)]
    names = [k.removeprefix("exp_avg/") for k in files[0] if k.startswith("exp_avg/")]
    return {n: torch.cat([f[f"exp_avg/{n}"] for f in files]) for n in names}


def _two_ranks(rank, world_size, save_dir):
    from infinity.checkpoint import safetensors_io
    from infinity.checkpoint import CheckpointError

    save_dir = Path(save_dir)
    model, batches, config = _setup(str(save_dir.parent / "nvme"))
    out = {}
    engine = infinity.initialize(copy.deepcopy(model), config)
    _train(engine, batches[:4], rank, world_size)
    engine.save_checkpoint(save_dir, tag="half", client_state={"at": 4})
    out["state_at_save"] = engine.full_state_dict()
    out["rest"] = _train(engine, batches[4:], rank, world_size)
    out["final"] = engine.full_state_dict()
    engine.close()

    resumed = infinity.initialize(copy.deepcopy(model), config)
    out["client"] = resumed.load_checkpoint(save_dir)
    out["rest_resumed"] = _train(resumed, batches[4:], rank, world_size)
    out["final_resumed"] = resumed.full_state_dict()

    # One rank's file damaged: both ranks refuse, naming it.
    damaged = save_dir.parent / "damaged"
    if rank == 0:
        shutil.copytree(save_dir, damaged)
        shard = damaged / "half" / "shard-00001-of-00002.safetensors"
        data = bytearray(shard.read_bytes())
        data[-3000] ^= 1
        shard.write_bytes(bytes(data))
    dist.barrier()
    try:
        resumed.load_checkpoint(damaged)
    except CheckpointError as err:
        out["damaged_error"] = str(err)

    # One rank's save fails (its disk is full): both ranks raise, the previous checkpoint stays latest.
    if rank == 1:
        def full(file, hasher, data):
            raise OSError(errno.ENOSPC, "No space left on device")
        safetensors_io._write_chunk = full
    try:
        resumed.save_checkpoint(save_dir, tag="broken")
    except OSError as err:
        out["save_error"] = str(err)
    resumed.close()
    return out


def _load_at_two(rank, world_size, save_dir, batches_from: int):
    model, batches, config = _setup(str(Path(save_dir).parent / "nvme2"))
    engine = infinity.initialize(copy.deepcopy(model), config)
    engine.load_checkpoint(save_dir)
    out = {"state": engine.full_state_dict(), "moments": _moments(engine)}
    out["rest"] = _train(engine, batches[batches_from:], rank, world_size)
    out["final"] = engine.full_state_dict()
    engine.close()
    return out


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_resume_at_two_ranks_is_bitwise_and_reshards_to_one(tmp_path):
    save_dir = tmp_path / "ckpt"
    ranks = run_ranks(_two_ranks, str(save_dir))
    for r in ranks:
        assert r["client"] == {"at": 4}
        assert torch.equal(torch.tensor(r["rest_resumed"]), torch.tensor(r["rest"]))
        _assert_equal(r["final_resumed"], r["final"])
        assert "shard-00001-of-00002.safetensors is corrupt" in r["damaged_error"]
    assert "No space left on device" in ranks[1]["save_error"]
    assert "rank(s) [1] could not write" in ranks[0]["save_error"]
    assert (save_dir / "latest").read_text() == "half\n"
    # nothing but the checkpoints (a rank process ends without atexit, so its save-folder lock file may stay)
    assert sorted(p.name for p in save_dir.iterdir() if p.name != LOCK_FILE) == ["half", "latest"]

    # 2 -> 1: the same values, the moments concatenated, and training goes on as at two ranks.
    model, batches, config = _setup(str(tmp_path / "nvme1"))
    with infinity.initialize(copy.deepcopy(model), config) as engine:
        engine.load_checkpoint(save_dir)
        _assert_equal(engine.full_state_dict(), ranks[0]["state_at_save"])
        saved = _saved_moments(save_dir / "half", 2)
        for name, shard in _moments(engine).items():
            numel = dict(engine.module.named_parameters())[name].numel()
            assert torch.equal(shard[:numel], saved[name][:numel]), name
        rest = _train(engine, batches[4:], 0, 1)
        final = engine.full_state_dict()
    torch.testing.assert_close(torch.tensor(rest), torch.tensor(ranks[0]["rest"]), rtol=1e-5, atol=1e-6)
    _assert_close(final, ranks[0]["final"])


def test_one_rank_checkpoint_reshards_to_two(tmp_path):
    model, batches, config = _setup(str(tmp_path / "nvme"))
    with infinity.initialize(copy.deepcopy(model), config) as engine:
        _train(engine, batches[:4], 0, 1)
        engine.save_checkpoint(tmp_path / "ckpt")
        state = engine.full_state_dict()
        rest = _train(engine, batches[4:], 0, 1)
        final = engine.full_state_dict()
    saved = _saved_moments(tmp_path / "ckpt" / "global_step2", 1)
    ranks = run_ranks(_load_at_two, str(tmp_path / "ckpt"), 4)
    for rank, r in enumerate(ranks):
        _assert_equal(r["state"], state)
        for name, shard in r["moments"].items():
            numel = dict(model.named_parameters())[name].numel()
            start = rank * shard.numel()
            expected = torch.zeros(shard.numel())
            part = saved[name][start:min(start + shard.numel(), numel)]
            expected[:part.numel()] = part
            assert torch.equal(shard, expected), name
        torch.testing.assert_close(torch.tensor(r["rest"]), torch.tensor(rest), rtol=1e-5, atol=1e-6)
        _assert_close(r["final"], final)
