"""benchmarks/bench_host_overhead.py without a GPU: both cases run, alternate with plain PyTorch, and count every
parameter tensor of the model as managed (no timing is asserted here)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from infinity.models.gpt import GPT

REPO = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("bench_host_overhead", REPO / "benchmarks" / "bench_host_overhead.py")
bench = importlib.util.module_from_spec(SPEC)
sys.modules["bench_host_overhead"] = bench
SPEC.loader.exec_module(bench)


@pytest.fixture(autouse=True)
def _distinct_device_mode_only_in_the_test(monkeypatch):
    """main() sets INFINITY_DISTINCT_DEVICE=1 in the environment without a GPU: restored after each test."""
    monkeypatch.setenv("INFINITY_DISTINCT_DEVICE", os.environ.get("INFINITY_DISTINCT_DEVICE", "0"))


def test_both_cases_run_beside_plain_pytorch_and_manage_every_tensor(tmp_path, capsys):
    out = tmp_path / "row.json"
    argv = ["--layers", "2", "--rounds", "1", "--block", "2", "--warmup", "0", "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    tensors = len(list(GPT(bench.model_config(bench.parse_args(argv))).parameters()))
    assert [row["case"] for row in result["rows"]] == ["none", "cpu"]
    for row in result["rows"]:
        assert row["param_tensors"] == tensors
        assert row["plain_step_s"] > 0 and row["step_s"] > 0
        assert row["over_plain_us_per_param"] == pytest.approx(
            (row["step_s"] - row["plain_step_s"]) * 1e6 / tensors)
    assert "device memory kept distinct" in capsys.readouterr().out
