"""benchmarks/gpu_check.sh: every step's command line is one its script accepts, so that a short GPU lease is not
spent on a typo (the script itself needs CUDA; nothing runs here but the scripts' argument parsers)."""

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from infinity.cli import build_parser

pytestmark = pytest.mark.device_independent  # the GPU session's plan and arguments: the distinct pass leaves it out

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
PARSED_SCRIPTS = ("bench_gpu.py", "bench_versions.py", "bench_scale.py", "bench_host_overhead.py")
"""The benchmarks with a ``parse_args(argv)`` of their own."""


def _steps() -> list[tuple[str, str, list[str]]]:
    """(phase, step name, the command after "$py") of every step in the script, continuation lines joined."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    steps, phase = [], None
    for line in text.splitlines():
        if m := re.match(r"^\s{4}([a-z][a-z0-9-]*)\)\s*$", line):
            phase = m.group(1)
        if m := re.match(r'^\s*step (\S+) (\d+) "\$py" (.*)$', line):
            steps.append((phase, m.group(1), shlex.split(m.group(3), comments=True)))
    return steps


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name[:-3], REPO / "benchmarks" / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name[:-3]] = module  # bench_versions' dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_script_is_valid_bash_and_names_its_phases():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    phases = {phase for phase, _, _ in _steps()}
    assert {"step", "step-more", "scale", "tests", "versions", "bench", "quick"} <= phases


@pytest.mark.parametrize("phase,name,argv", [s for s in _steps() if s[2][0] != "-c"], ids=lambda v: str(v)[:40])
def test_every_step_parses(phase, name, argv, tmp_path, monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")  # bench_gpu sets it at import: not left for the suite
    argv = [a.replace("$out", str(tmp_path)) for a in argv]
    if any("$(" in a for a in argv):
        pytest.skip("the trees under .versions/ come from the shell")
    if argv[:2] == ["-m", "infinity.cli"]:
        rest = argv[2:]
        build_parser(rest).parse_args(rest)
        return
    script = Path(argv[0]).name
    if script not in PARSED_SCRIPTS:
        assert (REPO / argv[0]).is_file(), argv[0]
        return
    module = _module(script)
    if script == "bench_versions.py":  # a tree must be a source tree: the working tree stands in for the old one
        argv = [f"f6ac807={REPO}" if a.startswith("f6ac807=") else a for a in argv]
    args = module.parse_args(argv[1:])
    if script == "bench_gpu.py":
        module.parse_cases(args.cases)
        module.parse_cases(args.trace_cases)
        assert all(m.strip() in module.MODELS for m in args.models.split(","))
