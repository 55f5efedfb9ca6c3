"""``deepspeed.ops`` under the engine: the optimizers a DeepSpeed script makes (:mod:`~infinity.deepspeed.ops.adam`)."""

from infinity.deepspeed.ops import adam

__all__ = ["adam"]
