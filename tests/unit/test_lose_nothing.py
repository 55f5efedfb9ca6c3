"""Nothing a user made is lost, and what would fail is said before the work: a save folder owned by one live run,
model folders replaced only when asked and whole, every output checked before step 1, a dead run's swap folder
reclaimed the moment it died, a second signal that removes a user's --nvme-path store, a missing nvme_path made."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from helpers import TinyGPT, engine_config
from infinity.checkpoint.save_dir_lock import LOCK_FILE, SaveDirInUse
from infinity.cli import main
from infinity.commands import train_checks
from infinity.weights.export import HFTensor, write_hf_folder

pytestmark = pytest.mark.device_independent  # the distinct-device pass leaves it out

TINY = ["--preset", "tiny", "--seq-len", "16", "--micro-batch", "1", "--max-bytes", "100000"]


@pytest.fixture(autouse=True)
def _in_a_fresh_folder(tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def _train_proc(cwd: Path, *argv, tmpdir: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"TMPDIR": str(tmpdir)} if tmpdir else {})}
    return subprocess.Popen([sys.executable, "-m", "infinity.cli", "train", *TINY, *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        if line.startswith("step "):
            return
    raise AssertionError(f"the run ended before its first step: {proc.stderr.read()}")


def _tags(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if (p / "meta.json").is_file())


def _bytes_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# --------------------------------------------------------------------------- 1. one live run per save folder


def test_a_second_run_on_a_save_dir_is_refused_naming_the_first_or_waits_for_it(tmp_path, capsys):
    save_dir = tmp_path / "ck"
    first = _train_proc(tmp_path, "--steps", "100000", "--save-dir", str(save_dir), "--save-every", "1")
    try:
        _wait_for_step(first)
        rc = main(["train", *TINY, "--steps", "2", "--save-dir", str(save_dir), "--overwrite"])
        err = capsys.readouterr().err
        assert rc == 2 and f"pid {first.pid} on host {socket.gethostname()}" in err and "--wait-for-lock" in err
        assert first.poll() is None  # the first run goes on, its checkpoints its own

        # --wait-for-lock: starts when the first ends, and resumes from what it saved
        second = _train_proc(tmp_path, "--steps", "100000", "--save-dir", str(save_dir), "--resume",
                             "--wait-for-lock", "--json")
        try:
            for line in second.stderr:
                if "waiting for it to end" in line:
                    assert f"pid {first.pid}" in line
                    break
            first.send_signal(signal.SIGTERM)
            first.communicate(timeout=120)
            assert first.returncode == 143
            stopped_at = int((save_dir / "latest").read_text().strip()[4:])
            for line in second.stdout:
                if "resumed from" in line:
                    assert f"at step {stopped_at}" in line
                    break
            else:
                raise AssertionError(second.stderr.read())
        finally:
            second.send_signal(signal.SIGTERM)
            second.communicate(timeout=120)
    finally:
        first.kill()
        first.communicate()
    assert second.returncode == 143
    assert not (save_dir / LOCK_FILE).exists()  # released at the end: nothing left behind


_HOLDER = """
import sys, time
from infinity.checkpoint.save_dir_lock import hold_save_dir
hold_save_dir(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def test_the_engine_api_refuses_a_save_folder_held_by_a_live_process_and_not_by_a_dead_one(tmp_path):
    import infinity

    save_dir = tmp_path / "ck"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(save_dir)], stdout=subprocess.PIPE, text=True)
    engine = infinity.initialize(TinyGPT(), engine_config(param="cpu", optimizer="cpu", nvme_path=None, accum=1, clip=1.0, lr=1e-3))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SaveDirInUse, match=f"pid {holder.pid} on host"):
            engine.save_checkpoint(save_dir, tag="a")
        assert _tags(save_dir) == []
        holder.send_signal(signal.SIGKILL)  # died holding it: the kernel dropped the lock
        holder.wait()
        assert engine.save_checkpoint(save_dir, tag="a") == "a" and _tags(save_dir) == ["a"]
        assert (save_dir / LOCK_FILE).read_text().split() == [str(os.getpid()), socket.gethostname()]
    finally:
        engine.close()
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert not (save_dir / LOCK_FILE).exists()  # close() lets go of it


# --------------------------------------------------------------------------- 2. model folders


def _model_folder(folder: Path, shards: int) -> None:
    """A model folder as a user has it: weights in ``shards`` files with their index, a config, a tokenizer, notes."""
    tensors = [HFTensor(f"w{i}", (64, 64), torch.float32, lambda out, i=i: out.fill_(i)) for i in range(4)]
    write_hf_folder(folder, tensors, config={"model_type": "old"}, max_shard_nbytes=64 * 64 * 4 * 4 // shards)
    (folder / "tokenizer.json").write_text('{"mine": true}')
    (folder / "NOTES.md").write_text("my notes")


def test_a_model_folder_is_replaced_whole_its_other_files_kept_no_stale_shard_left(tmp_path):
    out = tmp_path / "model"
    _model_folder(out, shards=4)
    assert len(list(out.glob("model-*.safetensors"))) == 4
    new = [HFTensor("v", (8,), torch.float32, lambda t: t.fill_(7.0))]
    write_hf_folder(out, new, config={"model_type": "new"})
    assert sorted(p.name for p in out.iterdir()) == ["NOTES.md", "config.json", "model-00001-of-00001.safetensors",
                                                     "model.safetensors.index.json", "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == '{"mine": true}' and (out / "NOTES.md").read_text() == "my notes"
    assert json.loads((out / "config.json").read_text())["model_type"] == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary or old folder beside it


def test_consolidate_hf_into_a_model_folder_needs_overwrite(tmp_path, capsys):
    out = tmp_path / "model"
    _model_folder(out, shards=2)
    before = _bytes_of(out)
    save_dir = tmp_path / "ck"
    assert main(["train", *TINY, "--steps", "1", "--save-dir", str(save_dir)]) == 0
    capsys.readouterr()
    assert main(["consolidate", str(save_dir), str(out), "--hf", "--hf-config", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already holds a model" in err and "--overwrite" in err
    assert _bytes_of(out) == before  # untouched


def test_consolidate_never_writes_over_the_checkpoint_it_reads(tmp_path, capsys):
    """OUT naming a checkpoint's own shard, its meta.json or the save folder's `latest` (the file form), or the
    checkpoint folder itself with --overwrite (--hf, whose shard files looked like a model's), was written: the
    checkpoint was gone. Each is refused before any work, every byte of the save folder kept; and --save-pretrained
    into a checkpoint folder is refused before training."""
    save_dir = tmp_path / "ck"
    assert main(["train", *TINY, "--steps", "1", "--save-dir", str(save_dir)]) == 0
    capsys.readouterr()
    step = save_dir / "step1"
    before = {**_bytes_of(save_dir), **{f"step1/{k}": v for k, v in _bytes_of(step).items()}}
    shard = next(step.glob("shard-*.safetensors"))
    for out in (shard, step / "meta.json", save_dir / "latest"):
        assert main(["consolidate", str(save_dir), str(out)]) == 2
        assert "inside a checkpoint folder" in capsys.readouterr().err
    hf_config = tmp_path / "cfg"
    hf_config.mkdir()
    (hf_config / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert main(["consolidate", str(save_dir), str(step), "--hf", "--overwrite", "--hf-config", str(hf_config)]) == 2
    assert "is a checkpoint folder" in capsys.readouterr().err
    assert main(["train", *TINY, "--steps", "1", "--save-pretrained", str(step), "--overwrite"]) == 2
    captured = capsys.readouterr()
    assert "is a checkpoint folder" in captured.err and "step " not in captured.out
    after = {**_bytes_of(save_dir), **{f"step1/{k}": v for k, v in _bytes_of(step).items()}}
    assert after == before
    assert main(["consolidate", str(save_dir), str(tmp_path / "model.safetensors")]) == 0  # elsewhere: written


def test_save_pretrained_into_the_hf_model_folder_is_refused_before_training(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    model_dir = tmp_path / "llama"
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    (model_dir / "tokenizer.json").write_text("{}")
    before = _bytes_of(model_dir)
    for same in (model_dir, tmp_path / "link-to-llama"):
        if same != model_dir:
            same.symlink_to(model_dir)
        rc = main(["train", "--hf-model", str(model_dir), "--steps", "2", "--max-bytes", "100000", "--seq-len", "16",
                   "--save-pretrained", str(same), "--overwrite"])
        captured = capsys.readouterr()
        assert rc == 2 and "is the --hf-model folder" in captured.err
        assert "step " not in captured.out  # refused before any training
    assert _bytes_of(model_dir) == before

    other = tmp_path / "other"
    _model_folder(other, shards=2)
    rc = main(["train", "--hf-model", str(model_dir), "--steps", "2", "--max-bytes", "100000", "--seq-len", "16",
               "--save-pretrained", str(other)])
    captured = capsys.readouterr()
    assert rc == 2 and "already holds a model" in captured.err and "step " not in captured.out


# --------------------------------------------------------------------------- 7. outputs checked before step 1

_READ_ONLY_RUN = """
import ctypes, json, os, sys
if os.geteuid() == 0:  # root writes anywhere: drop CAP_DAC_OVERRIDE so that mode 0555 holds for it too
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        print("SKIP capget failed"); sys.exit(0)
    data[0].effective &= ~(1 << 1)
    if libc.capset(ctypes.byref(header), data) != 0:
        print("SKIP cannot drop CAP_DAC_OVERRIDE"); sys.exit(0)
from infinity.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("flag", ["--save-dir", "--save-pretrained", "--run-dir", "--trace"])
def test_a_read_only_output_is_refused_before_the_first_step(tmp_path, flag):
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    target = ro / ("trace.json" if flag == "--trace" else "out")
    try:
        out = subprocess.run([sys.executable, "-c", _READ_ONLY_RUN, "train", *TINY, "--steps", "2",
                              "--offload-param", "cpu", "--offload-optimizer", "cpu", flag, str(target)],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
    finally:
        ro.chmod(0o755)
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout)
    assert out.returncode == 2, out.stdout + out.stderr
    assert flag in out.stderr and "not writable" in out.stderr
    assert "step " not in out.stdout  # nothing trained, so nothing lost


def test_a_disk_without_room_for_the_outputs_is_refused_before_work(no_work, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**5, 10**5))
    assert main(["train", "--preset", "10m", "--offload-param", "cpu", "--offload-optimizer", "cpu",
                 "--save-pretrained", str(no_work / "out"), "--save-dtype", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "not enough room" in err and "--save-pretrained" in err and "100,000 bytes" in err
    assert main(["train", "--preset", "10m", "--offload-param", "cpu", "--offload-optimizer", "cpu", "--steps", "10",
                 "--save-dir", str(no_work / "ck"), "--save-every", "2", "--keep-last", "2"]) == 2
    err = capsys.readouterr().err
    assert "not enough room" in err and "3 checkpoint(s)" in err and "--save-dir" in err


# --------------------------------------------------------------------------- 8. a dead run's swap folder

_SWAP_OWNER = """
import sys, time, torch
from infinity.commands.train_signals import Cleanup
from infinity.storage import SwapStore
parent = sys.argv[1]
folder = Cleanup().temporary_folder(parent) if sys.argv[2] == "cli" else parent
store = SwapStore(folder)
store.write("k", torch.ones(1 << 20)).wait()
print(store.directory, flush=True)
time.sleep(600)
"""


def test_a_killed_runs_swap_folder_is_reclaimed_at_once_and_a_live_ones_never(tmp_path):
    owners = {}
    for name in ("cli-dead", "cli-live", "nvme-dead", "nvme-live"):
        parent = tmp_path / name.split("-")[0]
        parent.mkdir(exist_ok=True)
        owners[name] = subprocess.Popen([sys.executable, "-c", _SWAP_OWNER, str(parent), name.split("-")[0]],
                                        stdout=subprocess.PIPE, text=True)
    try:
        stores = {name: Path(proc.stdout.readline().strip()) for name, proc in owners.items()}
        for name in ("cli-dead", "nvme-dead"):
            owners[name].send_signal(signal.SIGKILL)  # kill -9: nothing cleaned up
            owners[name].wait()
            assert stores[name].exists()
        # a restart right away (the folders are seconds old)
        assert train_checks.remove_dead_swap_folders(str(tmp_path / "cli")) == 1
        assert train_checks.remove_dead_swap_folders(str(tmp_path / "nvme")) == 1
        assert not stores["cli-dead"].parent.exists() and not stores["nvme-dead"].exists()
        assert stores["cli-live"].exists() and stores["nvme-live"].exists()  # their owners hold the locks
    finally:
        for proc in owners.values():
            proc.kill()
            proc.wait()
            proc.stdout.close()


# --------------------------------------------------------------------------- 9. a second signal

_SLOW_MODEL = """
import time
import torch
from infinity.models.gpt import GPT, get_preset


class Slow(GPT):
    def forward(self, input_ids, targets=None):
        time.sleep(0.5)  # a step long enough for two signals to arrive within it
        return super().forward(input_ids, targets)


def build_model():
    return Slow(get_preset("tiny"))
"""


@pytest.mark.parametrize("where", ["nvme-path", "temporary"])
def test_a_second_signal_removes_the_swap_store_and_says_which(tmp_path, where):
    model = tmp_path / "slow.py"
    model.write_text(_SLOW_MODEL)
    nvme, tmp = tmp_path / "nvme", tmp_path / "tmp"
    nvme.mkdir()
    tmp.mkdir()
    argv = ["--model", str(model), "--steps", "100000", "--seq-len", "16"]
    if where == "nvme-path":
        argv += ["--nvme-path", str(nvme), "--save-dir", str(tmp_path / "ck")]
    proc = subprocess.Popen([sys.executable, "-m", "infinity.cli", "train", "--micro-batch", "1", "--max-bytes",
                             "100000", *argv], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)})
    try:
        _wait_for_step(proc)
        held = nvme if where == "nvme-path" else tmp
        made = sorted(held.iterdir())
        assert made, "the run keeps its swap store there"
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)  # (two signals: one sent twice may reach it once)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode in (130, 143), err
    assert sorted(nvme.iterdir()) == [] and sorted(tmp.iterdir()) == []  # nothing left behind
    assert not (tmp_path / "ck" / LOCK_FILE).exists()  # and the save folder is free for the next run
    said = err.split("stopping now, ")[1]
    assert all(str(p) in said for p in made), said  # and it says what it removed


_SIGNALS_IN_THE_FINAL_SAVE = """
import os, signal, sys
from infinity.checkpoint import publish
from infinity.cli import main

write_meta, calls = publish.write_meta, []

def signalled(path, body):  # the final save's shard file is written, its meta.json not yet
    calls.append(path)
    if len(calls) == 2:  # (the first is step 1's, whole)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    write_meta(path, body)

publish.write_meta = signalled
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_signal_during_the_final_save_leaves_no_temporary_folder_and_says_what_is_saved(tmp_path):
    script, save_dir, tmp = tmp_path / "signalled.py", tmp_path / "ck", tmp_path / "tmp"
    script.write_text(_SIGNALS_IN_THE_FINAL_SAVE)
    tmp.mkdir()
    done = subprocess.run([sys.executable, str(script), "train", *TINY, "--steps", "2", "--save-every", "1",
                           "--save-dir", str(save_dir)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp)})
    assert done.returncode == 143, done.stderr
    assert sorted(p.name for p in save_dir.iterdir() if p.name.startswith(".tmp-")) == []  # nothing half-written
    assert (save_dir / "latest").read_text().strip() == "step1" and not (save_dir / "step2").exists()
    said = done.stderr.split("stopping now, ")[1]
    assert said.startswith("without a new checkpoint: the checkpoint step2 was being written and is not saved")
    assert f"the latest checkpoint is {save_dir / 'step1'} (resume with --resume)" in said
    assert sorted(tmp.iterdir()) == []  # (and the swap folder is gone)


def test_one_signal_during_the_final_save_finishes_it_and_says_so(tmp_path):
    """It said "stopping at the end of this step" while the run's last checkpoint was being written."""
    script, save_dir, tmp = tmp_path / "signalled.py", tmp_path / "ck", tmp_path / "tmp"
    script.write_text(_SIGNALS_IN_THE_FINAL_SAVE.replace("        os.kill(os.getpid(), signal.SIGINT)\n", ""))
    tmp.mkdir()
    done = subprocess.run([sys.executable, str(script), "train", *TINY, "--steps", "2", "--save-every", "1",
                           "--save-dir", str(save_dir)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp)})
    assert done.returncode == 0, done.stderr  # every step ran, and the checkpoint is whole
    assert "SIGTERM received: finishing the checkpoint step2 being written, then stopping" in done.stderr
    assert (save_dir / "latest").read_text().strip() == "step2" and (save_dir / "step2" / "meta.json").is_file()
    assert sorted(p.name for p in save_dir.iterdir() if p.name.startswith(".tmp-")) == []


_SIGNALS_IN_SAVE_PRETRAINED = """
import os, signal, sys
from infinity.weights import export
from infinity.cli import main

fsync_dir = export.fsync_dir

def signalled(path):  # every file of the model written in its temporary folder, not yet renamed into place
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)
    fsync_dir(path)

export.fsync_dir = signalled
sys.exit(main(sys.argv[1:]))
"""


def test_a_second_signal_during_save_pretrained_leaves_no_temporary_folder_and_says_so(tmp_path):
    script, out, tmp = tmp_path / "signalled.py", tmp_path / "models" / "tuned", tmp_path / "tmp"
    script.write_text(_SIGNALS_IN_SAVE_PRETRAINED)
    out.parent.mkdir()
    tmp.mkdir()
    done = subprocess.run([sys.executable, str(script), "train", *TINY, "--steps", "1", "--offload-param", "cpu",
                           "--offload-optimizer", "cpu", "--save-pretrained", str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp)})
    assert done.returncode == 143, done.stderr
    assert sorted(out.parent.iterdir()) == []  # no `.tuned.tmp-...` folder, no half a model
    said = done.stderr.split("stopping now, ")[1]
    assert said.startswith(f"the --save-pretrained model {out} was being written and is not saved (removed what it "
                           f"had written: .tuned.tmp-"), said


# --------------------------------------------------------------------------- 10. a missing nvme_path


def test_initialize_makes_a_missing_nvme_path_0700(tmp_path):
    import infinity

    nvme = tmp_path / "not" / "yet"
    engine = infinity.initialize(TinyGPT(), engine_config(param="nvme", optimizer="nvme", nvme_path=str(nvme), accum=1, clip=1.0, lr=1e-3))
    try:
        assert nvme.is_dir() and nvme.stat().st_mode & 0o777 == 0o700
        assert [p.name.startswith("infinity-swap-") for p in nvme.iterdir()] == [True]
    finally:
        engine.close()
    assert list(nvme.iterdir()) == []
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="nvme_path .*a-file.* is not a folder"):
        infinity.initialize(TinyGPT(), engine_config(param="nvme", optimizer="nvme", nvme_path=str(blocker), accum=1, clip=1.0,
                                                                lr=1e-3))
