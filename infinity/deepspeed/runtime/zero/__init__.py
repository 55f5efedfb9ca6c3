"""``deepspeed.runtime.zero``: ZeRO stage 3's names at the path scripts import them from
(:mod:`infinity.deepspeed.zero`)."""

from infinity.deepspeed.runtime.zero.partition_parameters import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]
