"""The ``infinity`` command line: ``infinity train | bench | estimate | consolidate | plot | deepspeed | accelerate``.

Each sub-command lives in ``infinity/commands/<name>.py`` and is imported only
when chosen, so ``infinity bench`` does not pay for building the engine.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from infinity import __version__

# name -> one-line help. The module infinity.commands.<name> provides
# add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "train": "train a GPT-style model with its states offloaded",
    "bench": "measure the bandwidth of the offload tiers and suggest an `aio` config",
    "estimate": "bytes per rank in each tier for a model and an offload setting",
    "consolidate": "write one state dict from a sharded checkpoint",
    "plot": "draw a training run's metrics (loss, tokens/s, tier bandwidth) into one PNG",
    "deepspeed": "run a DeepSpeed training script unchanged under the engine, as DeepSpeed's launcher does",
    "accelerate": "`infinity accelerate launch`: an accelerate script with a DeepSpeed config, unchanged, under the "
                  "engine",
}


def _load(name: str):
    return importlib.import_module(f"infinity.commands.{name}")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infinity", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v for INFO logs, -vv for DEBUG")
    parser.add_argument("--version", action="version", version=f"infinity {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # -v after the command as well as before it (SUPPRESS: left out here, the value before the command stays).
        p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help="-v for INFO logs, -vv for DEBUG")
        if name == chosen:  # only the chosen command's module is imported
            _load(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Before torch allocates anything: blocks of 2 MiB or more come 2 MiB-aligned (and huge-page backed),
    # so full parameters can be read from NVMe with O_DIRECT in place, without a bounce copy.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(_load(args.command).run(args) or 0)
    except (ValueError, OSError) as err:  # bad input: one clear line, no traceback
        print(f"infinity {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"infinity {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
