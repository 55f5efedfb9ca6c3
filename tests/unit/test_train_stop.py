"""`infinity train` loses nothing (issue 17, section 4): signals end a run with a checkpoint and the conventional exit
code, a --save-dir of another run is not written over, retention keeps the newest, --resume without a value, dead
runs' swap folders go before the disk-room check."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from infinity.cli import main
from infinity.commands import train, train_checks

pytestmark = [pytest.mark.skipif(not train.engine_has_checkpoints(), reason="the engine has no checkpoints yet"),
              pytest.mark.device_independent]  # the distinct-device pass leaves it out

TINY = ["--preset", "tiny", "--seq-len", "16", "--micro-batch", "1", "--max-bytes", "100000"]


@pytest.fixture(autouse=True)
def _in_a_fresh_folder(tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["train", *TINY, *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _tags(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if (p / "meta.json").is_file())


# --------------------------------------------------------------------------- signals


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_a_checkpoint_removes_the_swap_folder_and_exits_128_plus(tmp_path, sig, code):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    save_dir = tmp_path / "ck"
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "infinity.cli", "train", *TINY, "--steps", "100000",
                             "--save-dir", str(save_dir)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # the first step's report line
            if line.startswith("step "):
                break
        assert list(tmp.glob("infinity-train-*")), "the run keeps its swap folder in TMPDIR"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert f"stopped by {signal.Signals(sig).name}" in err
    latest = (save_dir / "latest").read_text().strip()
    assert latest.startswith("step") and int(latest[4:]) >= 1 and latest in _tags(save_dir)
    assert list(tmp.iterdir()) == []  # the swap folder is gone


# --------------------------------------------------------------------------- save folders


def test_a_save_dir_of_another_run_is_refused_unless_overwrite(capsys, tmp_path):
    save_dir = tmp_path / "ck"
    rc, _, err = _run(capsys, "--steps", "4", "--save-dir", str(save_dir))
    assert rc == 0 and _tags(save_dir) == ["step4"]
    before = (save_dir / "step4" / "meta.json").read_bytes()

    rc, _, err = _run(capsys, "--steps", "2", "--save-dir", str(save_dir), "--preset", "small")
    assert rc == 2 and "--save-dir" in err and "step4" in err and "--overwrite" in err
    assert (save_dir / "step4" / "meta.json").read_bytes() == before and (save_dir / "latest").read_text() == "step4\n"

    rc, _, err = _run(capsys, "--steps", "2", "--save-dir", str(save_dir), "--overwrite")
    assert rc == 0 and "moved back from step4 to step2" in err  # said, not silent
    assert _tags(save_dir) == ["step2", "step4"]


def test_keep_last_keeps_the_newest(capsys, tmp_path):
    save_dir = tmp_path / "ck"
    rc, _, _ = _run(capsys, "--steps", "6", "--save-dir", str(save_dir), "--save-every", "1", "--keep-last", "2")
    assert rc == 0 and _tags(save_dir) == ["step5", "step6"]
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"checkpoint": {"keep_last": 1},
                               "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}))
    rc, out, _ = _run(capsys, "--steps", "3", "--save-dir", str(tmp_path / "ck2"), "--save-every", "1", "--config",
                      str(cfg))
    assert rc == 0 and _tags(tmp_path / "ck2") == ["step3"] and "not used here" not in out


def test_resume_without_a_value_takes_the_save_dirs_latest(capsys, tmp_path):
    save_dir = tmp_path / "ck"
    rc, out, _ = _run(capsys, "--steps", "2", "--save-dir", str(save_dir), "--resume")
    assert rc == 0 and "holds no checkpoint yet" in out  # a fresh start, said
    rc, out, _ = _run(capsys, "--steps", "4", "--save-dir", str(save_dir), "--resume", "--extend-steps")
    assert rc == 0 and f"resumed from {save_dir} at step 2" in out and _tags(save_dir) == ["step2", "step4"]


def test_resume_without_a_value_needs_a_save_dir(capsys):
    rc, _, err = _run(capsys, "--resume")
    assert rc == 2 and "--save-dir" in err


def test_a_damaged_checkpoint_is_named_with_the_tags_that_exist(capsys, tmp_path):
    save_dir = tmp_path / "ck"
    assert _run(capsys, "--steps", "2", "--save-dir", str(save_dir), "--save-every", "1")[0] == 0
    shard = next((save_dir / "step2").glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[-9] ^= 0xFF  # one flipped byte of the last tensor
    shard.write_bytes(bytes(data))
    rc, _, err = _run(capsys, "--steps", "3", "--resume", str(save_dir), "--extend-steps")
    assert rc == 2 and "checkpoints in" in err and "step1, step2" in err and "(latest: step2)" in err


# --------------------------------------------------------------------------- dead runs' swap folders


def test_dead_runs_swap_folders_are_removed_before_the_disk_room_check(monkeypatch, tmp_path):
    from infinity.storage.swap_store import STALE_AFTER_S

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f"{train_checks.TEMPORARY_PREFIX}{int(dead.stdout)}-abc" / "infinity-swap-x"
    left.mkdir(parents=True)
    (left / "swap").write_bytes(b"\0" * 4096)
    old = time.time() - 2 * STALE_AFTER_S
    for p in (left, left.parent):
        os.utime(p, (old, old))
    live = tmp_path / f"{train_checks.TEMPORARY_PREFIX}{os.getpid()}-def"
    live.mkdir()
    os.utime(live, (old, old))
    seen = []
    monkeypatch.setattr(train_checks, "check_disk_room", lambda path, n: seen.append(left.parent.exists()))
    from infinity.cli import build_parser

    plan = train.make_plan(build_parser(["train"]).parse_args(["train", *TINY]))
    from infinity.models.gpt import get_preset

    plan.estimate = train.estimate_for(plan, get_preset("tiny"))
    train_checks.check_nvme_room(plan)
    assert seen == [False]  # the dead run's folder went first
    assert live.is_dir()  # a live process's folder stays
