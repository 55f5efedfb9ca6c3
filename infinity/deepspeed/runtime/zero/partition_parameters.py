"""``deepspeed.runtime.zero.partition_parameters``: ``GatheredParameters``, ``Init`` and ``ZeroParamStatus`` at the
path scripts import them from (:mod:`infinity.deepspeed.zero`)."""

from infinity.deepspeed.zero import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]
