"""Kill -9 trials, many more than the test suite runs: a training run (TinyGPT, fp32, parameters and
optimizer on NVMe, a checkpoint every 2 steps) is killed at random moments — in a step, in a save, in
its start or resume — and resumed each time; at the end its losses and weights must equal an
uninterrupted run's bit for bit, and after every kill `latest` must name the newest complete checkpoint.

    python benchmarks/fault_trials.py                  # 50 kills in rounds of 10, in a temporary folder
    python benchmarks/fault_trials.py --kills 200 --per-round 20 --seed 3 --dir /mnt/nvme/trials

Prints one line per kill, one per round, and a final JSON line with the pass count.
The trial machinery is the test suite's (tests/unit/test_checkpoint_faults.py).

Three trials of `infinity train` itself, each ending with nothing lost and nothing left behind
(``--trials``; ``--kills 0`` runs only these)::

    python benchmarks/fault_trials.py --kills 0 --trials shared-save-dir,tight-restart,double-signal

* ``shared-save-dir``: a second run started on a run's --save-dir is refused, naming the first; a third with
  --wait-for-lock --resume --extend-steps waits, then continues from the first's last checkpoint; every checkpoint
  of the first is intact, byte for byte, at the end.
* ``tight-restart``: a run on a small disk (a loop-mounted ext4 image when run as root, else a disk whose free
  room is reported as that small) is killed with kill -9 and restarted within a second: the restart reclaims the
  dead run's swap folder and trains; the disk is empty after it.
* ``double-signal``: SIGTERM then SIGINT in one step of a run with --nvme-path and --save-dir: it exits at once,
  its swap files are gone from --nvme-path and the temporary folder, `latest` names a whole checkpoint, no lock
  or temporary file is left in the save folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "unit")]

import test_checkpoint_faults as faults  # noqa: E402  (after the path above)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=50, help="kills in all (default 50)")
    p.add_argument("--per-round", type=int, default=10, help="kills per training run to the end (default 10)")
    p.add_argument("--steps", type=int, default=faults.STEPS, help=f"steps per run (default {faults.STEPS})")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments (default 0)")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed after)")
    p.add_argument("-q", "--quiet", action="store_true", help="no line per kill")
    p.add_argument("--trials", default="", metavar="NAMES",
                   help=f"also these trials of `infinity train`, comma-separated: {', '.join(TRIALS)} (or all)")
    args = p.parse_args()
    if args.kills < 0 or args.per_round < 1:
        p.error("--kills must be at least 0 and --per-round at least 1")
    names = list(TRIALS) if args.trials == "all" else [n for n in args.trials.split(",") if n]
    unknown = [n for n in names if n not in TRIALS]
    if unknown:
        p.error(f"unknown trial(s) {', '.join(unknown)}; choose from {', '.join(TRIALS)}")
    trials_failed = run_cli_trials(names, Path(args.dir) if args.dir else None)
    if args.kills == 0:
        return 1 if trials_failed else 0

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fault-trials-"))
    ctx = faults.forkserver()
    say = (lambda *a: None) if args.quiet else (lambda line: print("  " + line, flush=True))
    passed, failed, where = 0, 0, {}
    started = time.perf_counter()
    rounds = (args.kills + args.per_round - 1) // args.per_round
    try:
        for r in range(rounds):
            kills = min(args.per_round, args.kills - r * args.per_round)
            workdir = root / f"round{r}"
            t0 = time.perf_counter()
            try:
                outcome = faults.kill_trials(workdir, kills=kills, seed=args.seed * 1000 + r, steps=args.steps,
                                             ctx=ctx, say=say)
            except AssertionError as err:
                failed += kills
                print(f"round {r}: FAILED ({kills} kills): {err}", flush=True)
                continue
            passed += kills
            for k, v in outcome["where"].items():
                where[k] = where.get(k, 0) + v
            print(f"round {r}: {kills} kills, resumed bitwise ({outcome['where']}) in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            shutil.rmtree(workdir, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"kills": args.kills, "passed": passed, "failed": failed, "killed_in": where,
                      "seconds": round(time.perf_counter() - started, 1)}))
    return 0 if failed == 0 and not trials_failed else 1


# --------------------------------------------------------------------------- trials of `infinity train`

TINY = ["--preset", "tiny", "--seq-len", "16", "--micro-batch", "1", "--max-bytes", "100000"]
SLOW_MODEL = """
import time
from infinity.models.gpt import GPT, get_preset


class Slow(GPT):
    def forward(self, input_ids, targets=None):
        time.sleep(0.5)  # a step long enough for two signals to arrive within it
        return super().forward(input_ids, targets)


def build_model():
    return Slow(get_preset("tiny"))
"""
SMALL_DISK = """
import os, shutil, sys
from collections import namedtuple
limit, root = int(os.environ["TRIAL_DISK_BYTES"]), os.environ["TRIAL_DISK"]
real = shutil.disk_usage
usage = namedtuple("usage", "total used free")


def small(path):
    if not os.path.realpath(path).startswith(os.path.realpath(root)):
        return real(path)
    used = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    return usage(limit, used, max(0, limit - used))


shutil.disk_usage = small
from infinity.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cli(cwd: Path, *argv: str, tmpdir: Path, runner: list[str] | None = None, env: dict | None = None):
    return subprocess.Popen([*(runner or [sys.executable, "-m", "infinity.cli"]), "train", *argv], cwd=cwd,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmpdir), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _until_step(proc) -> bool:
    for line in proc.stdout:
        if line.startswith("step "):
            return True
    return False


def _digests(save_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(save_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(save_dir.rglob("*")) if p.is_file() and not p.name.startswith(".")
            and p.name != "latest"}


def _left_behind(*folders: Path) -> list[str]:
    return [str(p) for f in folders if f.exists() for p in f.iterdir() if p.name != "lost+found"]  # (ext4's own)


def _save_dir_leftovers(save_dir: Path) -> list[str]:
    return [p.name for p in save_dir.iterdir() if p.name.startswith(".")] if save_dir.exists() else []


def _whole(save_dir: Path) -> bool:
    from infinity.checkpoint import Checkpoint, resolve_checkpoint

    ckpt = Checkpoint(resolve_checkpoint(save_dir))
    try:
        ckpt.verify()
        return True
    finally:
        ckpt.close()


def trial_shared_save_dir(work: Path) -> tuple[bool, str]:
    tmp, save_dir = work / "tmp", work / "ck"
    tmp.mkdir(parents=True)
    first = _cli(work, *TINY, "--steps", "40", "--save-dir", str(save_dir), "--save-every", "2", tmpdir=tmp)
    try:
        if not _until_step(first):
            return False, f"the first run did not start: {first.stderr.read()[-300:]}"
        second = _cli(work, *TINY, "--steps", "10", "--save-dir", str(save_dir), "--overwrite", tmpdir=tmp)
        _, err2 = second.communicate(timeout=600)
        refused = second.returncode == 2 and f"pid {first.pid}" in err2
        third = _cli(work, *TINY, "--steps", "60", "--save-dir", str(save_dir), "--save-every", "2", "--resume",
                     "--extend-steps", "--wait-for-lock", tmpdir=tmp)
        first.communicate(timeout=600)
        firsts = _digests(save_dir)
        out3, err3 = third.communicate(timeout=600)
    finally:
        for proc in (first,):
            proc.kill()
    tags = sorted((p.name for p in save_dir.iterdir() if (p / "meta.json").is_file()), key=lambda t: int(t[4:]))
    kept = {k: v for k, v in _digests(save_dir).items() if k in firsts} == firsts
    waited = "waiting for it to end" in err3 and "resumed from" in out3 and "at step 40" in out3
    left = _left_behind(tmp) + _save_dir_leftovers(save_dir)
    ok = (refused and first.returncode == 0 and third.returncode == 0 and waited and kept
          and tags == [f"step{i}" for i in range(2, 61, 2)] and _whole(save_dir) and not left)
    return ok, (f"second run {'refused naming the first' if refused else f'NOT refused (rc {second.returncode})'}; "
                f"third {'waited and resumed at step 40' if waited else 'did not wait/resume'} (rc {third.returncode}); "
                f"first run's {len(firsts)} files {'intact' if kept else 'CHANGED'}; tags {tags[0]}..{tags[-1]} "
                f"({len(tags)}); left behind: {left or 'nothing'}")


def _small_disk(work: Path, nbytes: int):
    """A folder on a disk of about ``nbytes`` free: a loop-mounted ext4 image (root), else None."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        return None
    image, mnt = work / "disk.img", work / "disk"
    mnt.mkdir()
    size = nbytes + 6 * 2**20  # ext4's own blocks
    for _ in range(3):
        with open(image, "wb") as f:
            f.truncate(size)
        if subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True).returncode != 0:
            return None
        if subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True).returncode != 0:
            return None
        free = shutil.disk_usage(mnt).free
        if abs(free - nbytes) < nbytes // 20:
            return mnt
        subprocess.run(["umount", str(mnt)], capture_output=True)
        size += nbytes - free
    return None


def trial_tight_restart(work: Path) -> tuple[bool, str]:
    from infinity.cli import build_parser
    from infinity.commands import train
    from infinity.models.gpt import get_preset

    tmp = work / "tmp"
    tmp.mkdir(parents=True)
    argv = [*TINY, "--steps", "100000"]
    plan = train.make_plan(build_parser(["train"]).parse_args(["train", *argv]))
    need = train.estimate_for(plan, get_preset("tiny"))["totals"]["nvme"]
    disk_bytes = need * 3 // 2  # room for one run's swap, not for two
    mnt = _small_disk(work, disk_bytes)
    how = "loop-mounted ext4"
    runner, env = None, None
    if mnt is None:
        mnt, how = work / "disk", "a folder reported as a small disk"
        mnt.mkdir()
        runner, env = [sys.executable, "-c", SMALL_DISK], {"TRIAL_DISK": str(mnt), "TRIAL_DISK_BYTES": str(disk_bytes)}
    try:
        first = _cli(work, *argv, "--nvme-path", str(mnt), tmpdir=tmp, runner=runner, env=env)
        try:
            started = _until_step(first)
            first.send_signal(signal.SIGKILL)
            first.wait()
            killed_at = time.perf_counter()
            left_by_kill = _left_behind(mnt)
            second = _cli(work, *TINY, "--steps", "3", "--nvme-path", str(mnt), tmpdir=tmp, runner=runner, env=env)
            restart_s = time.perf_counter() - killed_at
            out, err = second.communicate(timeout=600)
        finally:
            first.kill()
        left = _left_behind(mnt, tmp)
    finally:
        if how == "loop-mounted ext4":
            subprocess.run(["umount", str(mnt)], capture_output=True)
    ok = started and bool(left_by_kill) and second.returncode == 0 and not left
    said = err.strip().splitlines()[-1][:200] if second.returncode else "trained 3 steps"
    return ok, (f"{how}, {disk_bytes / 2**20:.1f} MiB for a run needing {need / 2**20:.1f} MiB of swap; the kill -9 "
                f"left {len(left_by_kill)} swap folder(s); restart {restart_s:.2f} s after it: rc {second.returncode} "
                f"({said}); left behind: {left or 'nothing'}")


def trial_double_signal(work: Path) -> tuple[bool, str]:
    tmp, nvme, save_dir = work / "tmp", work / "nvme", work / "ck"
    for folder in (tmp, nvme):
        folder.mkdir(parents=True)
    model = work / "slow.py"
    model.write_text(SLOW_MODEL)
    proc = _cli(work, "--model", str(model), "--seq-len", "16", "--micro-batch", "1", "--max-bytes", "100000",
                "--steps", "100000", "--nvme-path", str(nvme), "--save-dir", str(save_dir), "--save-every", "1",
                tmpdir=tmp)
    try:
        started = _until_step(proc)
        while started and not (save_dir / "latest").exists():
            time.sleep(0.1)
        held = _left_behind(nvme)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    said = err.split("stopping now, ")[-1].strip() if "stopping now" in err else err[-200:]
    left = _left_behind(nvme, tmp) + _save_dir_leftovers(save_dir)
    named = all(p in said for p in held)
    ok = started and proc.returncode in (130, 143) and not left and named and bool(held) and _whole(save_dir)
    return ok, (f"rc {proc.returncode}; said: {said!r}; the store{' was' if named else ' was NOT'} named; latest "
                f"{(save_dir / 'latest').read_text().strip()} whole; left behind: {left or 'nothing'}")


TRIALS = {"shared-save-dir": trial_shared_save_dir, "tight-restart": trial_tight_restart,
          "double-signal": trial_double_signal}


def run_cli_trials(names: list[str], root: Path | None) -> int:
    """Run the named trials, one line each; how many failed."""
    failed = 0
    for name in names:
        work = Path(tempfile.mkdtemp(prefix=f"trial-{name}-", dir=root))
        t0 = time.perf_counter()
        try:
            ok, detail = TRIALS[name](work)
        except Exception as err:  # a trial that breaks is a failed trial, said
            ok, detail = False, f"{type(err).__name__}: {err}"
        failed += not ok
        print(f"{name}: {'PASS' if ok else 'FAIL'} ({time.perf_counter() - t0:.1f} s): {detail}", flush=True)
        shutil.rmtree(work, ignore_errors=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
