"""``infinity.hf.Trainer`` at two gloo ranks on the CPU against the stock ``transformers.Trainer`` run as DDP at the
same two ranks, in the same processes: a peft LoRA model with ``modules_to_save`` (a trainable copy of the head)."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")

from helpers import run_ranks  # noqa: E402
from infinity.hf import Trainer  # noqa: E402
from unit.test_hf_trainer import collate, dataset, logged, nvme_config, tiny_llama, training_args  # noqa: E402

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.device_independent]  # compared on the CPU: the distinct-device pass leaves it out

ADAPTERS = "adapter_model.safetensors"


def lora_llama():
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    return peft.get_peft_model(tiny_llama(), config)


def _both_trainers(rank, world_size, out, options, runs=("stock", "ours")):
    """The stock Trainer's run, then ours, of the same script at these two ranks; rank 0's logs and evaluation.
    ``resumed``: ours again, from the stock run's checkpoint-2 (its adapters and torch's optimizer state)."""
    # as torchrun starts a rank: accelerate takes the process group the test's ranks already joined
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    done = {}
    for name in runs:
        args = training_args(os.path.join(out, name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=3, save_steps=1, save_total_limit=None, **options)
        script = dict(model=lora_llama(), args=args, train_dataset=dataset(24), eval_dataset=dataset(6, seed=2),
                      data_collator=collate)
        trainer = (transformers.Trainer(**script) if name == "stock"
                   else Trainer(**script, infinity_config=nvme_config(os.path.join(out, f"swap{rank}"))))
        assert trainer.args.world_size == 2
        trainer.train(resume_from_checkpoint=os.path.join(out, "stock", "checkpoint-2") if name == "resumed" else None)
        trainer.save_model(os.path.join(out, name, "final"))
        done[name] = {"loss": logged(trainer), "eval": trainer.evaluate()["eval_loss"],
                      "best": trainer.state.best_model_checkpoint}
        if name != "stock":
            trainer.engine.close()
    return done


def saved_adapters(folder):
    return transformers.modeling_utils.load_state_dict(os.path.join(folder, ADAPTERS))


def assert_same_adapters(ours, stock):
    ours, stock = saved_adapters(ours), saved_adapters(stock)
    assert "base_model.model.lm_head.weight" in stock  # the head's trainable copy, as peft names it in the file
    assert set(ours) == set(stock)
    for name, value in stock.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6, msg=name)


def test_two_ranks_save_the_adapters_and_the_heads_copy_in_each_checkpoint_as_the_stock_trainers_ddp(tmp_path):
    """peft's save asks the head's trainable copy for its state_dict() (for its keys): at two ranks the Trainer's
    checkpoints and save_model wrote nothing and stopped the run there. A run resumed from the stock run's
    checkpoint-2 (its adapters, the head's copy and AdamW's moments) goes on as the stock run went on."""
    run, _ = run_ranks(_both_trainers, str(tmp_path), {}, ("stock", "ours", "resumed"))
    assert len(run["ours"]["loss"]) == 3
    torch.testing.assert_close(torch.tensor(run["ours"]["loss"]), torch.tensor(run["stock"]["loss"]), rtol=1e-5,
                               atol=0)
    for folder in ("checkpoint-1", "checkpoint-3", "final"):
        assert_same_adapters(tmp_path / "ours" / folder, tmp_path / "stock" / folder)
    assert len(run["resumed"]["loss"]) == 3  # the stock run's first two logs, from its trainer_state.json
    assert run["resumed"]["loss"][2] == pytest.approx(run["stock"]["loss"][2], rel=1e-5)
    assert_same_adapters(tmp_path / "resumed" / "final", tmp_path / "stock" / "final")

    # one process resuming our two ranks' checkpoint (its shards beside each rank's slice of the base) is refused
    # by name before any work, with the ways that work, where the engine's loader said to save it otherwise
    out = tmp_path / "one"
    one = Trainer(model=lora_llama(), args=training_args(out, max_steps=3), train_dataset=dataset(24),
                  data_collator=collate, infinity_config=nvme_config(tmp_path / "swap-one"))
    try:
        with pytest.raises(ValueError, match=r"resume_from_checkpoint: .*checkpoint-2.* saved by 2 process\(es\).*"
                                             r"this run has 1\. Launch it with 2 \(torchrun --nproc_per_node 2\)"):
            one.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-2"))
    finally:
        one.engine.close()
    assert not any(out.iterdir()) and one.state.global_step == 0  # the folder as the constructor left it: empty


def test_two_ranks_load_the_best_adapters_of_a_model_only_run_at_the_end_as_the_stock_trainers_ddp(tmp_path):
    """peft's loader asks the whole model for its state_dict() (for its keys): at two ranks loading the adapters
    of a save_only_model checkpoint (the best at the end; a stock checkpoint resumed) stopped the run there."""
    # the highest eval loss is the best: an early checkpoint, so what is loaded at the end is not the last step's
    options = dict(eval_strategy="steps", eval_steps=1, save_only_model=True, load_best_model_at_end=True,
                   metric_for_best_model="eval_loss", greater_is_better=True)
    run, _ = run_ranks(_both_trainers, str(tmp_path), options)
    assert run["ours"]["best"] == str(tmp_path / "ours" / "checkpoint-1")
    assert run["stock"]["best"] == str(tmp_path / "stock" / "checkpoint-1")
    assert run["ours"]["eval"] == pytest.approx(run["stock"]["eval"], rel=1e-6)
    assert_same_adapters(tmp_path / "ours" / "final", tmp_path / "stock" / "checkpoint-1")
    assert_same_adapters(tmp_path / "ours" / "final", tmp_path / "stock" / "final")
