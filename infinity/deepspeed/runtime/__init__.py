"""``deepspeed.runtime``: the import paths DeepSpeed scripts and libraries reach into (:mod:`~.zero`,
:mod:`~.lr_schedules`), loaded with the package as DeepSpeed's are: accelerate reads
``deepspeed.runtime.lr_schedules`` without importing it."""

from infinity.deepspeed.runtime import lr_schedules, utils, zero

__all__ = ["lr_schedules", "utils", "zero"]
