"""``infinity deepspeed SCRIPT``: a DeepSpeed script, not changed by a character (``import deepspeed``,
``deepspeed.ops.adam``, ``deepspeed.accelerator``, ``deepspeed.comm``, ``--local_rank`` from the launcher), trains at
two processes as plain PyTorch over both ranks' batches together; a module the door does not offer fails naming
it; a launch that cannot work is refused before any process starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from infinity.cli import main
from unit.test_deepspeed_door import Regressor, data, reference

pytestmark = pytest.mark.device_independent  # processes started and scripts run: the distinct pass leaves it out

SCRIPT = textwrap.dedent("""
    import argparse, json, sys
    import torch
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.accelerator import get_accelerator
    from deepspeed import comm as dist
    sys.path.insert(0, {tests!r})
    from unit.test_deepspeed_door import Regressor, data

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    device = torch.device(get_accelerator().device_name(args.local_rank))
    try:
        import deepspeed.moe
        missing = None
    except ImportError as err:
        missing = str(err)
    torch.manual_seed(0)
    model = Regressor()
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer, training_data=data())
    losses, batches = [], []
    for x, y in loader:
        loss = engine(x.to(device), y.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        batches.append((x.tolist(), y.tolist()))
    state = {{name: value.tolist() for name, value in engine.full_state_dict().items()}}
    with open(f"{{args.out}}/rank{{dist.get_rank()}}.json", "w") as f:
        json.dump({{"losses": losses, "batches": batches, "state": state, "local_rank": args.local_rank,
                   "world": dist.get_world_size(), "missing": missing, "torch_rank": torch.distributed.get_rank()}}, f)
""")


def test_an_unchanged_deepspeed_script_trains_at_two_processes_as_plain_pytorch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(__import__("pathlib").Path(__file__).parents[1])))
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                     "gradient_clipping": 1.0,
                                     "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    done = subprocess.run([sys.executable, "-m", "infinity.cli", "deepspeed", "--num_gpus", "2", str(script),
                           "--deepspeed", "--deepspeed_config", str(ds_config), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # two processes on the CPU, GPU box or not
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["local_rank"], r["torch_rank"], r["world"]) for r in ranks] == [(0, 0, 2), (1, 1, 2)]
    assert "deepspeed.moe" in ranks[0]["missing"] and "does not offer it" in ranks[0]["missing"]

    torch.manual_seed(0)
    ref = Regressor()
    halves = [[(torch.tensor(x), torch.tensor(y)) for x, y in r["batches"]] for r in ranks]
    together = [tuple(torch.cat(parts) for parts in zip(a, b)) for a, b in zip(*halves)]
    expected = reference(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0),
                         together, 2)
    losses = torch.tensor(ranks[0]["losses"]) / 2 + torch.tensor(ranks[1]["losses"]) / 2
    torch.testing.assert_close(losses, torch.tensor(expected), rtol=1e-5, atol=1e-7)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(torch.tensor(ranks[0]["state"][name]), value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_launch_that_cannot_work_is_refused_before_any_process_starts(tmp_path, capsys):
    assert main(["deepspeed", str(tmp_path / "nowhere.py")]) == 2
    assert "nowhere.py: no such script" in capsys.readouterr().err
    (tmp_path / "train.py").write_text("")
    assert main(["deepspeed", "--num_nodes", "2", str(tmp_path / "train.py")]) == 2
    assert "--num_nodes 2" in capsys.readouterr().err


RANK_REPORT = textwrap.dedent("""
    import json, os, sys
    import torch
    import deepspeed  # answered by the engine
    print(json.dumps({"rank": int(os.environ["LOCAL_RANK"]), "cores": sorted(os.sched_getaffinity(0)),
                      "threads": torch.get_num_threads(), "argv": sys.argv[1:]}))
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a core for each of two processes")
def test_deepspeeds_launcher_flags_for_one_machine_mean_what_they_mean_there(tmp_path):
    """A one-host hostfile gives the processes, each bound to its own share of the cores with as many threads,
    each one's output in its own file; the multi-machine launchers' flags have nothing to do."""
    (tmp_path / "report.py").write_text(RANK_REPORT)
    (tmp_path / "hostfile").write_text("# this machine\nlocalhost slots=2\n")
    done = subprocess.run([sys.executable, "-m", "infinity.cli", "deepspeed", "--hostfile", str(tmp_path / "hostfile"),
                           "--bind_cores_to_rank", "--enable_each_rank_log", str(tmp_path / "logs"), "--launcher",
                           "pdsh", "--no_ssh_check", str(tmp_path / "report.py"), "--x", "1"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    logs = sorted((tmp_path / "logs").rglob("stdout.log"))
    assert len(logs) == 2 and '"rank"' not in done.stdout  # each rank's output in its file, not the terminal
    ranks = sorted((json.loads(log.read_text().strip().splitlines()[-1]) for log in logs), key=lambda r: r["rank"])
    usable = sorted(os.sched_getaffinity(0))
    half = len(usable) // 2
    assert [r["cores"] for r in ranks] == [usable[:len(usable) - half], usable[len(usable) - half:]]
    assert [r["threads"] for r in ranks] == [len(r["cores"]) for r in ranks]
    assert [r["argv"] for r in ranks] == [["--x", "1", "--local_rank=0"], ["--x", "1", "--local_rank=1"]]


@pytest.mark.parametrize("flags, named", [
    (["--force_multi"], "--force_multi: not offered"),
    (["--autotuning", "run"], "--autotuning: not offered"),
    (["--hostfile", "HOSTS"], "names 2 hosts (worker-0, worker-1)"),
    (["--bind_cores_to_rank", "--bind_core_list", "0-9999"], "may not run on core(s) [")])
def test_deepspeed_launcher_flags_that_cannot_work_here_are_refused_by_name(tmp_path, capsys, flags, named):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "HOSTS").write_text("worker-0 slots=8\nworker-1 slots=8\n")
    flags = [str(tmp_path / "HOSTS") if flag == "HOSTS" else flag for flag in flags]
    assert main(["deepspeed", *flags, str(tmp_path / "train.py")]) == 2
    assert named in capsys.readouterr().err


def test_include_and_exclude_pick_gpus_as_deepspeeds_launcher_does():
    from infinity.commands.deepspeed import _chosen_gpus

    assert _chosen_gpus(None, None, 4) is None
    assert _chosen_gpus("localhost:1,3", None, 4) == [1, 3] and _chosen_gpus("localhost", None, 2) == [0, 1]
    assert _chosen_gpus(None, "localhost:0", 3) == [1, 2]
    for include, said in [("localhost:5", "no GPU \\[5\\]"), ("worker-1:0", "one machine only"),
                          ("localhost:a", "integers")]:
        with pytest.raises(ValueError, match=said):
            _chosen_gpus(include, None, 4)
