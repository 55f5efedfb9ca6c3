"""DeepSpeed's door: a DeepSpeed training script runs under the engine with one line changed,
``import infinity.deepspeed as deepspeed`` in place of ``import deepspeed``::

    model_engine, optimizer, train_loader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset, config="ds_config.json")
    for batch in train_loader:
        loss = model_engine(batch)
        model_engine.backward(loss)
        model_engine.step()
    model_engine.save_checkpoint(save_dir)
    load_path, client_state = model_engine.load_checkpoint(save_dir)   # (None, None) where nothing was saved

Beside ``initialize``: ``zero.Init`` and ``zero.GatheredParameters``, ``utils``' ``safe_get/set_full_*`` and
``utils.zero_to_fp32``, ``ops.adam``'s ``DeepSpeedCPUAdam`` and ``FusedAdam``, ``get_accelerator()``, ``comm`` and
``checkpointing``. ``infinity deepspeed script.py`` runs a script unchanged, its ``import deepspeed`` answered by
this package (:mod:`~infinity.deepspeed.alias`). What DeepSpeed
offers that the engine cannot honour (model parallelism's ``mpu``, an optimizer other than Adam/AdamW) is refused by
name, before any work.
"""

from infinity.deepspeed import accelerator, checkpointing, comm, ops, runtime, utils, zero
from infinity.deepspeed.accelerator import get_accelerator
from infinity.deepspeed.alias import DOOR_VERSION as __version__  # what importlib.metadata answers under the alias
from infinity.deepspeed.engine import DeepSpeedEngine
from infinity.deepspeed.initialize import add_config_arguments, init_distributed, initialize

__all__ = ["DeepSpeedEngine", "__version__", "accelerator", "add_config_arguments", "checkpointing", "comm",
           "get_accelerator", "init_distributed", "initialize", "ops", "runtime", "utils", "zero"]
