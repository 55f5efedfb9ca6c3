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

What DeepSpeed offers that the engine cannot honour (model parallelism's ``mpu``, a client learning-rate
scheduler, an optimizer other than Adam/AdamW) is refused by name, before any work.
"""

from infinity.deepspeed import ops, utils, zero
from infinity.deepspeed.engine import DeepSpeedEngine
from infinity.deepspeed.initialize import add_config_arguments, init_distributed, initialize

__all__ = ["DeepSpeedEngine", "add_config_arguments", "init_distributed", "initialize", "ops", "utils", "zero"]
