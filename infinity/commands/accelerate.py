"""``infinity accelerate launch``: a script written for ``accelerate launch`` with a DeepSpeed config, run unchanged
under the engine::

    infinity accelerate launch --config_file ds_zero3.yaml train.py --my_arg 1   # the yaml `accelerate config` wrote
    infinity accelerate launch --use_deepspeed --deepspeed_config_file ds.json --num_processes 2 train.py

The arguments and the config file are accelerate's own, read by accelerate's own code (its ``launch`` parser and
its checks), so they mean what they mean under ``accelerate launch``: the same ``ACCELERATE_*`` variables reach
the script, whose ``Accelerator()`` then takes its DeepSpeed branch. Each process is started as ``infinity
deepspeed`` starts it (:mod:`infinity.deepspeed.run_script`), where ``import deepspeed`` is the engine's door: the
``Accelerator`` hands the model, the optimizer and the scheduler to the engine through ``deepspeed.initialize``.
A config for anything but DeepSpeed, several machines, or several processes without a GPU (accelerate runs DeepSpeed
on the CPU as one process) is refused before any process starts.
"""

from __future__ import annotations

import argparse
import importlib
import os

import torch

from infinity.commands import deepspeed as deepspeed_command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["launch"], help="accelerate's `launch`, with its arguments")
    p.add_argument("launch_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="what `accelerate launch` takes: its options, then the script and the script's arguments")


def run(args: argparse.Namespace) -> int:
    try:
        launch = importlib.import_module("accelerate.commands.launch")
        accelerate_launch = importlib.import_module("accelerate.utils.launch")
    except ImportError as err:
        raise ValueError(f"infinity accelerate needs accelerate (pip install 'zero-infinity[hf]'): {err}") from None
    parsed = launch.launch_command_parser().parse_args(args.launch_args)
    parsed, defaults, precision_from_config = launch._validate_launch_command(parsed)
    if not parsed.use_deepspeed or parsed.cpu:
        raise ValueError("the accelerate config (or flags) does not use DeepSpeed: `infinity accelerate launch` runs "
                         "DeepSpeed configs under the engine (distributed_type: DEEPSPEED, or --use_deepspeed); run "
                         "others with `accelerate launch`. A script making its own DeepSpeedPlugin: `infinity "
                         "deepspeed --no_local_rank SCRIPT`")
    if parsed.num_machines > 1:
        raise ValueError(f"num_machines {parsed.num_machines}: `infinity accelerate launch` starts the processes of "
                         "one machine")
    if parsed.num_processes and parsed.num_processes > 1 and not torch.cuda.is_available():
        raise ValueError(f"num_processes {parsed.num_processes} without a GPU: accelerate runs a DeepSpeed config on "
                         "the CPU as one process (each would train on the whole data); use num_processes 1")
    # the config's DeepSpeed fields, named to the script as accelerate's launcher names them (launch_command)
    fields = list(defaults.deepspeed_config.keys()) if defaults else []
    if precision_from_config:
        fields.append("mixed_precision")
    parsed.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, environment = accelerate_launch.prepare_deepspeed_cmd_env(parsed)
    os.environ.update(environment)  # the processes inherit the ACCELERATE_* variables
    # accelerate's launcher passes the offload devices on but not their NVMe paths, so its plugin fills them with
    # "none", and the swap files would go to a folder of that name in the working directory: the paths the config
    # file (or the flags) gave are passed on too
    for part in ("optimizer", "param"):
        path = getattr(parsed, f"offload_{part}_nvme_path", None)
        if path not in (None, "none"):
            os.environ.setdefault(f"ACCELERATE_DEEPSPEED_OFFLOAD_{part.upper()}_NVME_PATH", str(path))
    # started as `infinity deepspeed --num_gpus N --no_local_rank [--module] SCRIPT ARGS` would start it: its own
    # parser gives every other flag its default
    launcher = argparse.ArgumentParser(add_help=False)
    deepspeed_command.add_arguments(launcher)
    flags = ["--no_local_rank", *(["--module"] if parsed.module else [])]
    if parsed.num_processes:
        flags += ["--num_gpus", str(int(parsed.num_processes))]
    launched = launcher.parse_args([*flags, parsed.training_script])
    launched.script_args = list(parsed.training_script_args)  # as given, whatever they look like to the launcher
    return deepspeed_command.run(launched)
