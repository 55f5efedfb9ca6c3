"""The ``zero_to_fp32.py`` beside a save folder's checkpoints, where DeepSpeed writes its own.

A DeepSpeed user (and the Hugging Face docs) turns a ZeRO checkpoint into plain weights with
``python checkpoint-N/zero_to_fp32.py checkpoint-N OUTPUT``. The DeepSpeed door and the Trainer write ours there
too: a few lines that call :func:`infinity.deepspeed.utils.zero_to_fp32.main` (DeepSpeed's arguments), so the
habit works on our checkpoints. ``infinity consolidate`` does the same.

A ``zero_to_fp32.py`` we did not write (DeepSpeed's, the user's own) is left as it is, with a warning: it is the
user's file, and DeepSpeed's cannot read our checkpoints.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

RECOVERY_SCRIPT_NAME = "zero_to_fp32.py"
RECOVERY_SCRIPT_MARK = "# written by zero-infinity beside its checkpoints"
"""The script's second line: a file that starts with it is ours, and is brought up to date."""

RECOVERY_SCRIPT = f'''#!/usr/bin/env python
{RECOVERY_SCRIPT_MARK}
"""The trained model's fp32 weights from this save folder, without an engine, as DeepSpeed's zero_to_fp32.py:

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization] [--max_shard_size 5GB] [-t TAG]
                           [--exclude_frozen_parameters]

OUTPUT_DIR gets transformers' weight files; an output ending in .bin, .pt, .pth or .safetensors is one file.
The checkpoints here were written by zero-infinity, which this needs installed (`infinity consolidate` is the same).
"""
import sys

try:
    from infinity.deepspeed.utils.zero_to_fp32 import main
except ImportError as error:
    sys.exit(f"zero_to_fp32.py: the checkpoints here were written by zero-infinity, which is not importable "
             f"({{error}}): install it (pip install zero-infinity) or run `infinity consolidate` where it is")

if __name__ == "__main__":
    sys.exit(main(prog="zero_to_fp32.py"))
'''


def write_recovery_script(save_dir) -> Path | None:
    """Write (or bring up to date) ``save_dir/zero_to_fp32.py``; returns its path, or None where a script we did
    not write is there (kept, with a warning). Written whole or not at all (a temporary file renamed over)."""
    path = Path(save_dir) / RECOVERY_SCRIPT_NAME
    if path.exists():
        try:
            current = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            current = None
        if current == RECOVERY_SCRIPT:
            return path
        if current is None or current.splitlines()[1:2] != [RECOVERY_SCRIPT_MARK]:
            logger.warning("%s is not zero-infinity's: it is left as it is, and cannot read these checkpoints; "
                           "`infinity consolidate %s OUTPUT` writes their weights", path, save_dir)
            return None
    temporary = path.with_name(f".{RECOVERY_SCRIPT_NAME}.tmp-{os.getpid()}")
    try:
        temporary.write_text(RECOVERY_SCRIPT, encoding="utf-8")
        temporary.chmod(0o755)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path
