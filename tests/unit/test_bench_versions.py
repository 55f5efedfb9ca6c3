"""benchmarks/bench_versions.py: its arguments, its rounds, and each run importing its own tree (no timing here)."""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.device_independent  # which tree each run imports: the distinct pass leaves it out

REPO = Path(__file__).resolve().parents[2]
SPEC = importlib.util.spec_from_file_location("bench_versions", REPO / "benchmarks" / "bench_versions.py")
bench_versions = importlib.util.module_from_spec(SPEC)
sys.modules["bench_versions"] = bench_versions  # its dataclass looks its module up there
SPEC.loader.exec_module(bench_versions)


def _tree_copy(root: Path) -> Path:
    """The engine's three packages copied to ``root``: a tree that is not the installed checkout."""
    for folder in ("infinity", "kernels", "storage"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return root


def test_tree_argument_is_name_and_a_source_tree(tmp_path):
    tree = bench_versions.parse_tree(f"old={_tree_copy(tmp_path)}")
    assert (tree.name, tree.root) == ("old", tmp_path.resolve())
    for bad, says in [("old", "NAME=PATH"), (f"={tmp_path}", "NAME=PATH"), (f"plain={tmp_path}", "NAME must"),
                      (f"a/b={tmp_path}", "NAME must"), (f"new={tmp_path / 'nowhere'}", "no infinity, kernels")]:
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            bench_versions.parse_tree(bad)


def test_arguments(tmp_path):
    root = _tree_copy(tmp_path)
    args = bench_versions.parse_args(["--tree", f"a={root}", "--tree", f"b={root}", "--sub-group-size", "1e8",
                                      "--model", "thin", "--seq", "128", "--offload-param", "none"])
    assert [t.name for t in args.trees] == ["a", "b"]
    assert args.sub_group_size == 100_000_000 and args.offload_param == "none" and args.offload_optimizer == "cpu"
    spec = bench_versions.run_spec("engine", args)
    assert spec["model"] == dict(bench_versions.MODELS["thin"], tie_embeddings=True)
    assert json.loads(json.dumps(spec)) == spec  # travels to the driver as one JSON argument
    with pytest.raises(SystemExit):  # one name twice
        bench_versions.parse_args(["--tree", f"a={root}", "--tree", f"a={root}"])
    with pytest.raises(SystemExit):  # longer than the model's positions
        bench_versions.parse_args(["--tree", f"a={root}", "--model", "thin", "--seq", "1024"])
    with pytest.raises(argparse.ArgumentTypeError):
        bench_versions.parse_size("1.5")


def test_rounds_rotate_every_name_through_every_position():
    names = ["plain", "a", "b"]
    orders = [bench_versions.round_order(names, r) for r in range(3)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert {o[i] for o in orders for i in [0]} == set(names)


def test_ratios_are_taken_within_a_round_and_failed_rounds_left_out():
    def run(s):
        return {"median_step_s": s, "step_s": [s], "setup_s": 1.0, "peak_device_bytes": None,
                "peak_rss_bytes": 1, "losses": [1.0]}

    runs = {"plain": [run(1.0), run(2.0), run(4.0)], "a": [run(3.0), None, run(12.0)]}
    rows = bench_versions.summarize(["plain", "a"], runs)
    assert rows["a"]["ratio_to_plain"] == 3.0  # 3/1 and 12/4, not a median step over a median step (7.5/2)
    assert rows["a"]["step_s"] == 7.5 and rows["a"]["rounds_failed"] == 1
    assert rows["plain"]["ratio_to_plain"] is None


def test_each_run_imports_its_own_tree_and_builds_in_its_own_cache(tmp_path):
    tree = bench_versions.Tree("copy", _tree_copy(tmp_path / "tree").resolve())
    args = bench_versions.parse_args(["--tree", f"copy={tree.root}", "--cache-dir", str(tmp_path / "cache")])
    env = bench_versions.tree_env(tree, args)
    assert env["XDG_CACHE_HOME"] == str(tmp_path / "cache" / "copy")
    env["INFINITY_KERNELS"] = "torch"  # no kernel build in a unit test: where it would go is still reported
    done = subprocess.run([sys.executable, str(bench_versions.DRIVER), "--prepare"], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    facts = bench_versions.result_of(done.stdout)
    assert set(facts["imported_from"]) == {"infinity", "infinity.kernels", "infinity.storage"}
    for name, path in facts["imported_from"].items():
        assert Path(path).is_relative_to(tree.root), (name, path)
    assert Path(facts["kernel_build_dir"]).is_relative_to(tmp_path / "cache" / "copy")


def test_pythonpath_alone_would_mix_trees_where_the_checkout_is_installed(tmp_path):
    """Why the driver maps the names itself: an editable install's finder maps infinity.kernels to its checkout."""
    root = _tree_copy(tmp_path)
    code = "import infinity, infinity.kernels; print(infinity.__file__); print(infinity.kernels.__file__)"
    env = dict(os.environ, PYTHONPATH=str(root), INFINITY_KERNELS="torch")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          check=False, cwd=tmp_path.parent)
    if done.returncode != 0:
        pytest.skip("infinity.kernels does not import from PYTHONPATH alone here (no editable install)")
    package, kernels = (Path(line) for line in done.stdout.split())
    if kernels.is_relative_to(root):
        pytest.skip("no editable install of another checkout here")
    assert package.is_relative_to(root) and not kernels.is_relative_to(root)
