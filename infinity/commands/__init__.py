"""Sub-commands of the ``infinity`` CLI. Each module defines ``add_parser(subparsers)`` and ``run(args) -> int``."""
