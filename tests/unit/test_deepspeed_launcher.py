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


def test_include_and_exclude_pick_gpus_as_deepspeeds_launcher_does():
    from infinity.commands.deepspeed import _chosen_gpus

    assert _chosen_gpus(None, None, 4) is None
    assert _chosen_gpus("localhost:1,3", None, 4) == [1, 3] and _chosen_gpus("localhost", None, 2) == [0, 1]
    assert _chosen_gpus(None, "localhost:0", 3) == [1, 2]
    for include, said in [("localhost:5", "no GPU \\[5\\]"), ("worker-1:0", "one machine only"),
                          ("localhost:a", "integers")]:
        with pytest.raises(ValueError, match=said):
            _chosen_gpus(include, None, 4)
