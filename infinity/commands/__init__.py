"""Sub-commands of the ``infinity`` CLI. Each module defines ``add_arguments(parser)`` and ``run(args) -> int``."""
