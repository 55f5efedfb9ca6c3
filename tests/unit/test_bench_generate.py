"""benchmarks/bench_generate.py on a small Llama: its rows, the tokens checked against the plain model's, and what a
forward without grad keeping the model gathered saves in NVMe reads (no timing here)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("bench_generate", REPO / "benchmarks" / "bench_generate.py")
bench_generate = importlib.util.module_from_spec(SPEC)
sys.modules["bench_generate"] = bench_generate
SPEC.loader.exec_module(bench_generate)

SMALL = ["--hidden", "64", "--layers", "2", "--vocab", "100", "--batch", "2", "--prompt-len", "4", "--new-tokens", "6",
         "--eval-batches", "1"]


def test_rows_and_the_reads_a_kept_model_saves(tmp_path, capsys):
    rc = bench_generate.main(SMALL + ["--tiers", "nvme", "--rounds", "2", "--nvme-path", str(tmp_path), "--json"])
    assert rc == 0
    rows = {row["case"]: row for row in json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]}
    kept, refetched = rows["nvme"], rows["nvme reuse 0"]
    for row in (kept, refetched):
        assert row["generate_ratio"] > 0 and row["evaluate_ratio"] > 0
    # without keeps each of the 6 forwards reads the model; kept, the second round's generate reads nothing
    assert refetched["nvme_bytes_read_per_token"] > 0
    assert kept["nvme_bytes_read_per_token"] < refetched["nvme_bytes_read_per_token"] / 2
    assert list(tmp_path.iterdir()) == []  # the swap files are gone


def test_bad_flags_are_refused_naming_them(capsys):
    with pytest.raises(SystemExit):
        bench_generate.parse_args(["--tiers", "gpu"])
    assert "--tiers: 'gpu'" in capsys.readouterr().err
