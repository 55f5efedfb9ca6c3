"""Faults: kill -9 at random moments (in training, in a save, in a resume), then resume; the NVMe tier or
the checkpoint disk filling up (a file-size limit).

A training run here is a child process forked from a server that has already
imported torch and the engine (multiprocessing's forkserver), so a trial costs
the run, not the interpreter's start. The run is deterministic: fp32, data and
learning-rate jitter drawn from torch's, numpy's and python's global RNGs (so a
resume must restore all three), and every run, killed or not, is compared bit
for bit with one that was never interrupted.

``benchmarks/fault_trials.py`` runs many more trials with the same functions.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import resource
import signal
import time
from pathlib import Path

import pytest
import torch

from helpers import TinyGPT, engine_config

STEPS = 24
EVERY = 2
ACCUM = 2
SLOW_WRITE_S = 0.001  # per write into a checkpoint file in a killed run: a save lasts over 0.1 s
PAUSE_S = 0.005  # after each backward in a killed run: a step lasts over 10 ms


# --------------------------------------------------------------------------- the child processes


def _log(path: str):
    return open(path, "a", buffering=1)


def train_run(workdir: str, log_path: str, steps: int, every: int, slow_write_s: float, pause_s: float,
              result_path: str | None):
    """Train (resuming from ``workdir/ckpt`` if it has a checkpoint), logging each step and save.
    ``slow_write_s`` and ``pause_s`` stretch saves and steps (not their numerics) for the kills to aim."""
    import numpy as np

    import infinity
    from infinity.checkpoint import safetensors_io

    torch.set_num_threads(1)
    log = _log(log_path)
    log.write("begin\n")
    if slow_write_s:
        real = safetensors_io._write_chunk

        def slow(file, hasher, data):
            time.sleep(slow_write_s)
            real(file, hasher, data)
        safetensors_io._write_chunk = slow
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    nvme = Path(workdir) / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(nvme), accum=ACCUM, clip=1.0, lr=1e-2)
    engine = infinity.initialize(TinyGPT(), config)
    save_dir = Path(workdir) / "ckpt"
    start, losses = 0, []
    if (save_dir / "latest").exists():
        client = engine.load_checkpoint(save_dir)
        start, losses = client["step"], client["losses"]
    log.write(f"ready {start}\n")
    for step in range(start, steps):
        engine.lr = 1e-2 * (1 + 0.1 * random.random()) * (1 + 0.1 * float(np.random.rand()))
        for _ in range(ACCUM):
            idx = torch.randint(0, 64, (2, 17))
            loss = engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            time.sleep(pause_s)
        log.write(f"step {step + 1}\n")
        if (step + 1) % every == 0:
            log.write(f"saving {step + 1}\n")
            engine.save_checkpoint(save_dir, tag=f"step{step + 1}", client_state={"step": step + 1, "losses": losses})
            log.write(f"saved {step + 1}\n")
    if result_path:
        from safetensors.torch import save_file
        save_file({k: v.clone() for k, v in engine.full_state_dict().items()}, result_path + ".safetensors")
        Path(result_path).write_text(json.dumps(losses))
    engine.close()
    log.write("done\n")


def full_disk_run(workdir: str, log_path: str):
    """Save, then cap the file size below the checkpoint's shard: a save and then a step must fail clearly."""
    import infinity

    torch.set_num_threads(1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    log = _log(log_path)
    torch.manual_seed(0)
    nvme = Path(workdir) / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    # (no overlapped step: its undo extents, reserved at start, would make the swap file larger than a checkpoint)
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(nvme), accum=1, clip=1.0, lr=1e-2,
                           overlap_step_with_backward=False)
    engine = infinity.initialize(TinyGPT(), config)
    save_dir = Path(workdir) / "ckpt"
    engine.save_checkpoint(save_dir, tag="step0")
    swap_nbytes = max(p.stat().st_size for p in nvme.glob("infinity-swap-*/*"))
    shard_nbytes = max(p.stat().st_size for p in save_dir.glob("step0/shard-*"))
    # Writes past the cap fail (EFBIG), as on a full disk: the next save's shard, and the step's writes of the
    # moments, which rest past it at the swap file's end (reserved at start, with room for them then).
    cap = (shard_nbytes // 4096 - 1) * 4096  # page-aligned, as O_DIRECT writes are
    assert cap < swap_nbytes
    resource.setrlimit(resource.RLIMIT_FSIZE, (cap, resource.RLIM_INFINITY))
    outcome = {"swap_nbytes": swap_nbytes, "cap": cap}
    try:
        engine.save_checkpoint(save_dir, tag="step0-again")
    except OSError as err:
        outcome["save"] = [err.errno, str(err)]
    idx = torch.randint(0, 64, (2, 17))
    try:
        engine.backward(engine(idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
        engine.step()  # the moments are written for the first time, past the cap
    except OSError as err:
        outcome["step"] = [err.errno, str(err)]
    try:
        engine.close()
    except OSError as err:  # the optimizer re-raises the failed write when it closes (reported to its owner)
        outcome["close"] = [err.errno, str(err)]
    log.write(json.dumps(outcome) + "\n")


# --------------------------------------------------------------------------- the parent side


def forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "safetensors.torch", "infinity.engine.engine", "infinity.checkpoint",
                                "infinity.kernels", "helpers", Path(__file__).stem])
    return ctx


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _wait_for(proc, log: Path, line: str, timeout: float = 120.0) -> bool:
    """Until ``line`` is logged (True) or the process ends (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if line in _lines(log):
            return True
        if not proc.is_alive():
            return line in _lines(log)
        time.sleep(0.002)
    raise TimeoutError(f"{line!r} not logged in {log} after {timeout} s")


def _run_to_end(ctx, workdir: Path, log: Path, result: Path, *, steps: int, every: int, slow: float) -> None:
    proc = ctx.Process(target=train_run, args=(str(workdir), str(log), steps, every, slow, 0.0, str(result)))
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0, f"training run failed (exit {proc.exitcode}); see {log}"


def kill_trials(workdir: Path, *, kills: int, seed: int, steps: int = STEPS, every: int = EVERY,
                slow_write_s: float = SLOW_WRITE_S, ctx=None, say=lambda *a: None) -> dict:
    """Train to ``steps`` while killing the run ``kills`` times at random moments, resuming after each;
    compare with an uninterrupted run. Returns what happened; raises AssertionError on any difference."""
    from infinity.checkpoint import Checkpoint, read_latest

    ctx = ctx or forkserver()
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    reference = workdir / "reference.json"
    _run_to_end(ctx, workdir / "uninterrupted", workdir / "uninterrupted.log", reference,
                steps=steps, every=every, slow=0.0)
    run_dir = workdir / "killed"
    save_dir = run_dir / "ckpt"
    saved, saving = 0, 0  # the last save that completed / began, by the logs
    where = {"training": 0, "save": 0, "startup or resume": 0}
    for trial in range(kills):
        log = workdir / f"trial{trial}.log"
        proc = ctx.Process(target=train_run, args=(str(run_dir), str(log), steps, every, slow_write_s, PAUSE_S, None))
        proc.start()
        if not _wait_for(proc, log, "begin"):
            raise AssertionError(f"trial {trial}: the run died before starting (exit {proc.exitcode}); see {log}")
        # Where to kill: a moment the run logs, then a delay. A save lasts at least ~0.1 s (each of its
        # ~100 writes sleeps SLOW_WRITE_S) and a step at least 2 * PAUSE_S, so "saving" + < 0.08 s is
        # inside a save and "step" (of a step that saves nothing) + < PAUSE_S is inside the next step.
        start = int(saved)
        moment = rng.choice(["begin", "step", "step", "saving", "saving", "saved"])
        target = min(steps - 1, start + rng.randint(1, 2 * every))  # a few steps on: kills spread over the run
        if moment == "begin":
            delay = rng.uniform(0.0, 0.5)
        else:
            if moment == "step":
                target -= 1 if target % every == 0 and target - 1 > start else 0
                moment = "step" if target % every else "saving"
                delay = rng.uniform(0.0, PAUSE_S)
            elif moment == "saving":
                target = min(steps - 1 - (steps - 1) % every, target + (-target) % every)
                delay = rng.uniform(0.0, 0.08)
            else:
                target = min(steps - 1 - (steps - 1) % every, target + (-target) % every)
                delay = rng.uniform(0.0, 0.25)
            if target <= start:
                moment, target, delay = "begin", 0, rng.uniform(0.0, 0.5)
            elif not _wait_for(proc, log, f"{moment} {target}"):
                raise AssertionError(f"trial {trial}: the run ended before '{moment} {target}' (exit "
                                     f"{proc.exitcode}); see {log}")
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        lines = _lines(log)
        for line in lines:
            kind, _, value = line.partition(" ")
            if kind == "saved":
                saved = max(saved, int(value))
            elif kind == "saving":
                saving = max(saving, int(value))
        last = lines[-1] if lines else ""
        where["save" if last.startswith("saving") else
              "training" if last.startswith(("ready", "step", "saved")) else "startup or resume"] += 1
        # The newest complete checkpoint is what `latest` names: the last save that returned, or the one
        # in flight if it got past publishing before the kill.
        tag = read_latest(save_dir)
        if saved:
            assert tag is not None, f"trial {trial}: saves completed but no `latest`"
        if tag is not None:
            step = int(tag.removeprefix("step"))
            assert saved <= step <= max(saving, saved), (trial, tag, saved, saving)
            Checkpoint(save_dir / tag).verify()
            saved = step
        say(f"trial {trial}: killed at '{last}' (+{delay:.3f} s); latest {tag}")
    result = workdir / "resumed.json"
    _run_to_end(ctx, run_dir, workdir / "final.log", result, steps=steps, every=every, slow=0.0)
    expected, got = json.loads(reference.read_text()), json.loads(result.read_text())
    assert torch.equal(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)), \
        [(i, a, b) for i, (a, b) in enumerate(zip(got, expected)) if a != b][:5]
    from safetensors.torch import load_file
    want, have = load_file(str(reference) + ".safetensors"), load_file(str(result) + ".safetensors")
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)
    return {"kills": kills, "where": where, "losses": len(got)}


# --------------------------------------------------------------------------- the tests


@pytest.mark.device_independent  # the files' atomicity under kill -9
@pytest.mark.timeout(240)
def test_kill_at_random_moments_then_resume_bitwise(tmp_path):
    outcome = kill_trials(tmp_path, kills=12, seed=8)
    assert outcome["kills"] == 12
    assert outcome["where"]["save"] >= 1 and outcome["where"]["training"] >= 1, outcome


@pytest.mark.timeout(120)
def test_full_disk_is_a_clear_error_and_the_last_checkpoint_stays(tmp_path):
    ctx = forkserver()
    log = tmp_path / "full.log"
    proc = ctx.Process(target=full_disk_run, args=(str(tmp_path), str(log)))
    proc.start()
    proc.join(100)
    assert proc.exitcode == 0, f"see {log}"
    outcome = json.loads(_lines(log)[-1])
    save_errno, save_message = outcome["save"]
    assert save_errno == 27 and "File too large" in save_message and "shard-00000-of-00001.safetensors" in save_message
    step_errno, step_message = outcome["step"]
    assert step_errno == 27 and "File too large" in step_message and "infinity-swap-" in step_message

    import infinity
    from infinity.checkpoint import Checkpoint, read_latest

    save_dir = tmp_path / "ckpt"
    assert read_latest(save_dir) == "step0"
    assert sorted(p.name for p in save_dir.iterdir()) == ["latest", "step0"]  # no partial save left
    Checkpoint(save_dir / "step0").verify()
    torch.manual_seed(0)
    model = TinyGPT()
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=None, accum=1, clip=1.0, lr=1e-2)
    with infinity.initialize(TinyGPT(), config) as engine:
        engine.load_checkpoint(save_dir)
        state = engine.full_state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
