"""``deepspeed.runtime``: the import paths DeepSpeed scripts reach into (:mod:`~infinity.deepspeed.runtime.zero`)."""
