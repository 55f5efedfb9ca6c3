"""infinity.hf.Trainer against the stock transformers.Trainer: same script, same arguments, same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from infinity.checkpoint.save_dir_lock import LOCK_FILE  # noqa: E402
from infinity.hf import InfinityTrainerMixin, Trainer  # noqa: E402
from infinity.hf.trainer_config import trainer_config  # noqa: E402

VOCAB = 96
STEPS = 20


def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def dataset(n=40, seed=1):
    """Token rows of 4..12 tokens: batches of them are padded."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, VOCAB, (int(torch.randint(4, 13, (1,), generator=g)),),
                                        generator=g).tolist()} for _ in range(n)]


def collate(rows):
    """Left padding: mask 0 and label -100 on the padding."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, n - len(r["input_ids"]):] = torch.tensor(r["input_ids"])
        mask[i, n - len(r["input_ids"]):] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def training_args(out, **overrides):
    kwargs = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=STEPS,
                  learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.0, max_grad_norm=1.0,
                  logging_steps=1, save_strategy="steps", save_steps=10, save_total_limit=1, report_to=[],
                  use_cpu=True, seed=0, disable_tqdm=True)
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def nvme_config(swap):
    os.makedirs(swap, exist_ok=True)
    return {"device": "cpu",  # compared with the stock Trainer on the CPU, also where there is a GPU
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(swap), "max_in_cpu": 0},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
                                  "stage3_param_persistence_threshold": 0, "sub_group_size": 5000}}


def logged(trainer, key="loss"):
    return [h[key] for h in trainer.state.log_history if key in h and "eval_loss" not in h and "train_loss" not in h]


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The stock Trainer and ours over the same script; ours with parameters and optimizer states on NVMe."""
    tmp = tmp_path_factory.mktemp("trainer")
    data, held_out = dataset(), dataset(8, seed=2)
    stock = transformers.Trainer(model=tiny_llama(), args=training_args(tmp / "stock"), train_dataset=data,
                                 eval_dataset=held_out, data_collator=collate)
    stock.train()
    stock_eval = stock.evaluate()
    stock.save_model(tmp / "stock-model")

    ours = Trainer(model=tiny_llama(), args=training_args(tmp / "ours"), train_dataset=data, eval_dataset=held_out,
                   data_collator=collate, infinity_config=nvme_config(tmp / "swap"))
    tiers = (ours.engine.compute.tier, ours.engine.optimizer.tier)
    ours.train()
    ours_eval = ours.evaluate()
    ours.save_model(tmp / "ours-model")
    yield {"tmp": tmp, "data": data, "stock": stock, "ours": ours, "tiers": tiers, "stock_eval": stock_eval,
           "ours_eval": ours_eval}
    ours.engine.close()


def test_logged_losses_grad_norms_and_lr_equal_the_stock_trainers(runs):
    stock, ours = runs["stock"], runs["ours"]
    assert runs["tiers"] == ("nvme", "nvme")
    assert len(logged(stock)) == STEPS == len(logged(ours))
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(stock)), rtol=1e-5, atol=0)
    # clipping at max_grad_norm=1.0 acted: the norms before it are above 1
    assert max(logged(stock, "grad_norm")) > 1.0
    torch.testing.assert_close(torch.tensor(logged(ours, "grad_norm")), torch.tensor(logged(stock, "grad_norm")),
                               rtol=1e-5, atol=0)
    assert logged(ours, "learning_rate") == logged(stock, "learning_rate")
    assert runs["ours_eval"]["eval_loss"] == pytest.approx(runs["stock_eval"]["eval_loss"], rel=1e-6)


class StepMetrics(transformers.TrainerCallback):
    """Each optimizer step's engine metrics, as the step ends."""

    def __init__(self):
        self.trainer = None
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(self.trainer.engine.step_metrics())


def test_each_training_log_has_the_engines_step_time_and_traffic_over_its_steps(tmp_path):
    """logging_steps=2: each training log's step_s is the mean of its two steps' and its rates their bytes over
    their seconds, as the engine's own metrics of each step give them; the stock run's logs have no such keys."""
    metrics = StepMetrics()
    ours = Trainer(model=tiny_llama(), args=training_args(tmp_path / "ours", max_steps=6, logging_steps=2,
                                                          save_strategy="no"),
                   train_dataset=dataset(), data_collator=collate, infinity_config=nvme_config(tmp_path / "swap"),
                   callbacks=[metrics])
    metrics.trainer = ours
    ours.train()
    ours.engine.close()
    logs = [h for h in ours.state.log_history if "loss" in h]
    assert len(logs) == 3 and len(metrics.steps) == 6
    crossing = ours.engine.placement.distinct
    for log, pair in zip(logs, zip(metrics.steps[0::2], metrics.steps[1::2])):
        seconds = sum(m["step_s"] for m in pair)
        assert log["step_s"] == pytest.approx(seconds / 2, rel=1e-12)
        read = sum(m["tiers"]["nvme"]["bytes_read"] for m in pair)
        assert read > 0  # the parameters rest on NVMe: every forward reads them
        assert log["nvme_read_gb_per_s"] == pytest.approx(read / seconds / 1e9, rel=1e-12)
        written = sum(m["tiers"]["nvme"]["bytes_written"] for m in pair)
        assert log["nvme_write_gb_per_s"] == pytest.approx(written / seconds / 1e9, rel=1e-12)
        assert ("h2d_gb_per_s" in log) == crossing == ("d2h_gb_per_s" in log)
        if crossing:
            up = sum(m["copies"]["host_to_device_nbytes"] for m in pair)
            assert up > 0 and log["h2d_gb_per_s"] == pytest.approx(up / seconds / 1e9, rel=1e-12)
    assert sum(log["nvme_write_gb_per_s"] for log in logs) > 0


def test_saved_model_reloads_in_transformers_with_the_stock_runs_weights(runs):
    tmp = runs["tmp"]
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp / "ours-model")
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp / "stock-model")
    assert type(ours) is transformers.LlamaForCausalLM
    stock_state = stock.state_dict()
    assert set(ours.state_dict()) == set(stock_state)
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, stock_state[name], rtol=0, atol=1e-6, msg=name)


def test_a_saved_model_in_one_shard_is_the_stock_trainers_files_model_safetensors_without_an_index(runs):
    """save_model writes the files the stock Trainer's writes: a model that fits one shard is model.safetensors
    (what a script reading that file, or a tool expecting it, opens), with the stock run's tensors."""
    from safetensors.torch import load_file

    tmp = runs["tmp"]
    ours, stock = (sorted(p.name for p in (tmp / name).iterdir()) for name in ("ours-model", "stock-model"))
    assert ours == stock and "model.safetensors" in ours and "model.safetensors.index.json" not in ours
    mine, theirs = load_file(tmp / "ours-model" / "model.safetensors"), load_file(tmp / "stock-model" / "model.safetensors")
    assert set(mine) == set(theirs)
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=0, atol=1e-6, msg=name)


def test_the_trained_model_generates_as_the_stock_runs(runs):
    """``trainer.model.generate`` after training (the model itself, its parameters resting in their tiers) continues
    the prompts as the stock run's model does."""
    batch = collate(dataset(3, seed=5))
    options = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "max_new_tokens": 6,
               "do_sample": False, "pad_token_id": 0}
    ours, stock = runs["ours"].model.generate(**options), runs["stock"].model.generate(**options)
    assert ours.shape == (3, batch["input_ids"].shape[1] + 6)
    assert torch.equal(ours, stock)


def test_checkpoints_hold_our_shards_and_the_trainers_state_and_rotate(runs):
    out = runs["tmp"] / "ours"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-20"]  # limit 1
    files = set(os.listdir(out / "checkpoint-20"))
    assert {"latest", "global_step20", "trainer_state.json", "scheduler.pt", "rng_state.pth", "config.json"} <= files
    assert not any(f.endswith(".safetensors") for f in files)  # the weights are in the sharded checkpoint
    assert LOCK_FILE not in files  # written once: its save-folder lock is not held while the engine lives on
    generation = [json.loads((runs["tmp"] / run / "checkpoint-20" / "generation_config.json").read_text())
                  for run in ("ours", "stock")]
    assert generation[0] == generation[1]  # what generate() reads from a checkpoint, as the stock Trainer wrote it


def test_a_checkpoints_zero_to_fp32_script_writes_the_stock_runs_weights(runs):
    """As after a DeepSpeed run: ``python checkpoint-20/zero_to_fp32.py checkpoint-20 OUT`` writes the weights."""
    checkpoint, out = runs["tmp"] / "ours" / "checkpoint-20", runs["tmp"] / "from-script"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(checkpoint / "zero_to_fp32.py"), str(checkpoint), str(out),
                           "--safe_serialization"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    stock = transformers.AutoModelForCausalLM.from_pretrained(runs["tmp"] / "stock-model").state_dict()
    with safe_open(str(out / "model.safetensors"), "pt") as written:
        assert set(written.keys()) == set(stock)
        for name in written.keys():
            torch.testing.assert_close(written.get_tensor(name), stock[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("key", ["stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"])
def test_the_gather_16bit_key_puts_the_weights_in_each_checkpoint_as_the_stock_deepspeed_integration(runs, tmp_path,
                                                                                                    key):
    """With the key true, ``from_pretrained("checkpoint-N")`` loads the stock run's weights there, as a stock
    DeepSpeed run's checkpoint holds them; the engine's shards are beside them, and resuming reads those."""
    options = dict(max_steps=2, save_steps=2, save_total_limit=None)
    stock = transformers.Trainer(model=tiny_llama(), args=training_args(tmp_path / "stock", **options),
                                 train_dataset=runs["data"], data_collator=collate)
    stock.train()
    config = nvme_config(tmp_path / "swap")
    config["zero_optimization"][key] = True
    ours = Trainer(model=tiny_llama(), args=training_args(tmp_path / "ours", **options), train_dataset=runs["data"],
                   data_collator=collate, infinity_config=config)
    ours.train()
    ours.engine.close()
    checkpoint = tmp_path / "ours" / "checkpoint-2"
    assert (checkpoint / "latest").is_file() and (checkpoint / "model.safetensors").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "stock" / "checkpoint-2").state_dict()
    assert loaded.keys() == expected.keys()
    for name, value in loaded.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)


def test_resume_from_a_checkpoint_continues_the_run_bitwise(runs):
    tmp = runs["tmp"]
    first = Trainer(model=tiny_llama(), args=training_args(tmp / "resumed"), train_dataset=runs["data"],
                    data_collator=collate, infinity_config=nvme_config(tmp / "swap-a"), callbacks=[StopAt(10)])
    first.train()
    first.engine.close()
    assert (tmp / "resumed" / "checkpoint-10").is_dir()
    again = Trainer(model=tiny_llama(), args=training_args(tmp / "resumed"), train_dataset=runs["data"],
                    data_collator=collate, infinity_config=nvme_config(tmp / "swap-b"))
    again.train(resume_from_checkpoint=True)
    again.engine.close()
    assert logged(first) == logged(runs["ours"])[:10]
    assert len(logged(again)) == STEPS  # the history up to the checkpoint came back with it
    assert logged(again) == logged(runs["ours"])  # steps 11-20 bitwise
    assert logged(again, "grad_norm") == logged(runs["ours"], "grad_norm")


def file_bytes(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_run_into_an_output_dir_with_checkpoints_is_refused_before_a_step_unless_asked(runs, tmp_path,
                                                                                                 monkeypatch):
    """The stock Trainer would replace the first run's checkpoint-20 with its own (and rotate the others away)."""
    out = runs["tmp"] / "ours"
    before = file_bytes(out)
    again = Trainer(model=tiny_llama(), args=training_args(out), train_dataset=runs["data"], data_collator=collate,
                    infinity_config={"zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match=rf"output_dir '{out}' holds an earlier run's checkpoints \(checkpoint-20\)"
                                         r".*resume_from_checkpoint=True.*overwrite_output_dir=True"):
        again.train()
    assert again.engine.global_step == 0 and again.state.global_step == 0
    assert file_bytes(out) == before  # nothing written, nothing rotated away
    again.engine.close()
    # Asked to, it writes there as the stock Trainer does: by the keyword, or the variable for a script run unchanged.
    short = dict(max_steps=2, save_steps=2, save_total_limit=None)
    for overwrite, env in ((True, None), (False, "1")):
        target = tmp_path / f"kw{overwrite}"
        target.mkdir()
        (target / "checkpoint-7").mkdir()
        if env is not None:
            monkeypatch.setenv("INFINITY_OVERWRITE_OUTPUT_DIR", env)
        trainer = Trainer(model=tiny_llama(), args=training_args(target, **short), train_dataset=runs["data"],
                          data_collator=collate, infinity_config={"zero_optimization": {"stage": 3}},
                          overwrite_output_dir=overwrite)
        trainer.train()
        trainer.engine.close()
        assert trainer.state.global_step == 2 and (target / "checkpoint-2" / "latest").is_file()
    monkeypatch.delenv("INFINITY_OVERWRITE_OUTPUT_DIR")
    # A run that saves no checkpoints writes over none: it goes ahead.
    quiet = Trainer(model=tiny_llama(), args=training_args(out, max_steps=1, save_strategy="no"),
                    train_dataset=runs["data"], data_collator=collate,
                    infinity_config={"zero_optimization": {"stage": 3}})
    quiet.train()
    quiet.engine.close()
    assert quiet.state.global_step == 1 and file_bytes(out) == before


def test_weight_decay_spares_biases_and_norms_as_the_stock_trainers_does(tmp_path):
    """weight_decay=0.1 on the parameters get_decay_parameter_names names, none on the RMSNorm weights; parameters
    and optimizer states on NVMe, against the stock Trainer (its losses, gradient norms and final parameters)."""
    args = dict(weight_decay=0.1, save_strategy="no")
    data = dataset()
    stock = transformers.Trainer(model=tiny_llama(), args=training_args(tmp_path / "stock", **args),
                                 train_dataset=data, data_collator=collate)
    stock.train()
    ours = Trainer(model=tiny_llama(), args=training_args(tmp_path / "ours", **args), train_dataset=data,
                   data_collator=collate, infinity_config=nvme_config(tmp_path / "swap"))
    assert (ours.engine.compute.tier, ours.engine.optimizer.tier) == ("nvme", "nvme")
    ours.train()
    decays = {slot.name: slot.weight_decay for slot in ours.engine.layout.slots}
    assert decays["model.norm.weight"] == decays["model.layers.0.input_layernorm.weight"] == 0.0
    assert decays["model.layers.0.self_attn.q_proj.weight"] == decays["model.embed_tokens.weight"] == 0.1
    assert all(len({s.weight_decay for s in g.slots}) == 1 for g in ours.engine.layout.sub_groups)
    assert len(logged(stock)) == STEPS == len(logged(ours))
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(stock)), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(logged(ours, "grad_norm")), torch.tensor(logged(stock, "grad_norm")),
                               rtol=1e-5, atol=0)
    state = ours.engine.full_state_dict()
    stock_state = stock.model.state_dict()
    assert set(state) == set(stock_state)
    for name, value in stock_state.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)
    ours.engine.close()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing_trains_as_the_stock_trainers(tmp_path, reentrant):
    """The Trainer's activation_checkpointing, parameters and states on NVMe: the layers are recomputed in
    backward (the engine fetches their parameters again), and the run is the stock Trainer's with the same
    setting."""
    args = dict(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": reentrant},
                save_strategy="no", max_steps=4)
    data = dataset()
    stock = transformers.Trainer(model=tiny_llama(), args=training_args(tmp_path / "stock", **args),
                                 train_dataset=data, data_collator=collate)
    stock.train()
    model = tiny_llama()
    recomputed = []
    for layer in model.model.layers:  # a module's forward inside backward is a recompute (transformers
        # checkpoints a layer's forward, not its hooks: its modules' hooks run again)
        layer.mlp.register_forward_pre_hook(lambda m, a: recomputed.append(torch._C._current_graph_task_id() != -1))
    ours = Trainer(model=model, args=training_args(tmp_path / "ours", **args), train_dataset=data,
                   data_collator=collate, infinity_config=nvme_config(tmp_path / "swap"))
    ours.train()
    assert model.is_activation_checkpointing and recomputed.count(True) == recomputed.count(False) > 0
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(stock)), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(logged(ours, "grad_norm")), torch.tensor(logged(stock, "grad_norm")),
                               rtol=1e-5, atol=0)
    state, stock_state = ours.engine.full_state_dict(), stock.model.state_dict()
    for name, value in stock_state.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)
    ours.engine.close()


class CountingTrainer(InfinityTrainerMixin, transformers.Trainer):
    """A user's own subclass of the stock Trainer, given the engine by the mixin."""

    steps = 0

    def training_step(self, *args, **kwargs):
        type(self).steps += 1
        return super().training_step(*args, **kwargs)


def test_the_mixin_serves_a_subclass_and_evaluate_runs_before_train(tmp_path):
    trainer = CountingTrainer(model=tiny_llama(), args=training_args(tmp_path, max_steps=2, save_strategy="no"),
                              train_dataset=dataset(16), eval_dataset=dataset(4, seed=2), data_collator=collate,
                              infinity_config={"zero_optimization": {"stage": 3}})
    reference = tiny_llama()
    batch = collate(dataset(4, seed=2))
    with torch.no_grad():
        expected = reference(**batch).loss.item()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-6)
    trainer.train()
    assert CountingTrainer.steps == 8 and trainer.state.global_step == 2
    rows = dataset(3, seed=5)
    predicted = trainer.predict(rows)
    model = tiny_llama()
    model.load_state_dict(trainer.engine.full_state_dict())
    with torch.no_grad():
        expected = model(**collate(rows))
    torch.testing.assert_close(torch.as_tensor(predicted.predictions), expected.logits, rtol=1e-5, atol=1e-6)
    assert predicted.metrics["test_loss"] == pytest.approx(expected.loss.item(), rel=1e-6)
    trainer.engine.close()


def mean_predicted_token(prediction):
    """A ``compute_metrics`` over argmax predictions (``preprocess_logits_for_metrics``): their mean id where the
    label is a token."""
    predicted, labels = prediction
    return {"mean_predicted_token": float(predicted[:, :-1][labels[:, 1:] != -100].mean())}


@pytest.mark.parametrize("save_only_model", [False, True], ids=["checkpoints", "model-only"])
def test_evaluation_during_training_and_the_best_model_at_the_end_are_the_stock_trainers(tmp_path, save_only_model):
    """eval_strategy steps with compute_metrics, checkpoints every 5 steps and load_best_model_at_end: at lr 3e-2
    the held-out loss is lowest at step 5, so both runs end holding checkpoint-5's weights (with save_only_model,
    checkpoint-5 holds the model alone, and its weights are loaded as the stock Trainer loads them)."""
    args = dict(max_steps=20, eval_strategy="steps", eval_steps=5, save_steps=5, save_total_limit=2,
                load_best_model_at_end=True, learning_rate=3e-2, save_only_model=save_only_model)
    runs = {}
    for name, cls, extra in (("stock", transformers.Trainer, {}),
                             ("ours", Trainer, {"infinity_config": nvme_config(tmp_path / "swap")})):
        trainer = cls(model=tiny_llama(), args=training_args(tmp_path / name, **args), train_dataset=dataset(),
                      eval_dataset=dataset(8, seed=2), data_collator=collate, compute_metrics=mean_predicted_token,
                      preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1), **extra)
        trainer.train()
        runs[name] = trainer
    stock, ours = runs["stock"], runs["ours"]
    evaluations = {name: [(h["step"], h["eval_loss"], h["eval_mean_predicted_token"])
                          for h in trainer.state.log_history if "eval_loss" in h] for name, trainer in runs.items()}
    assert [e[0] for e in evaluations["ours"]] == [5, 10, 15, 20] == [e[0] for e in evaluations["stock"]]
    torch.testing.assert_close(torch.tensor(evaluations["ours"]), torch.tensor(evaluations["stock"]), rtol=1e-5, atol=0)
    assert stock.state.best_model_checkpoint.endswith("checkpoint-5")
    assert os.path.basename(ours.state.best_model_checkpoint) == "checkpoint-5"
    best_loss = evaluations["stock"][0][1]
    assert min(e[1] for e in evaluations["stock"][1:]) > best_loss  # the last step is not the best
    assert ours.evaluate()["eval_loss"] == pytest.approx(best_loss, rel=1e-5)
    state = ours.engine.full_state_dict()
    for name, value in stock.model.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    ours.engine.close()


def test_an_epoch_that_ends_inside_an_accumulation_ends_with_a_short_step_as_the_stock_trainers(tmp_path):
    """10 rows, 2 a micro-batch, 4 micro-batches a step: each epoch is a step of 4 micro-batches and one of 1,
    whose loss the Trainer scales by its own count; parameters and states on NVMe, against the stock Trainer."""
    args = dict(max_steps=-1, num_train_epochs=3, save_strategy="no")
    stock = transformers.Trainer(model=tiny_llama(), args=training_args(tmp_path / "stock", **args),
                                 train_dataset=dataset(10), data_collator=collate)
    stock.train()
    ours = Trainer(model=tiny_llama(), args=training_args(tmp_path / "ours", **args), train_dataset=dataset(10),
                   data_collator=collate, infinity_config=nvme_config(tmp_path / "swap"))
    ours.train()
    assert len(logged(stock)) == 6 == len(logged(ours))  # two steps an epoch, three epochs
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(stock)), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(logged(ours, "grad_norm")), torch.tensor(logged(stock, "grad_norm")),
                               rtol=1e-5, atol=0)
    assert ours.engine.global_step == 6 and ours.engine.is_gradient_accumulation_boundary()
    ours.engine.close()


@pytest.mark.parametrize("overrides, named", [
    ({"optim": "sgd"}, "optim='sgd'"),
    ({"torch_compile": True}, "torch_compile"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size"),
])
def test_what_cannot_be_honoured_is_refused_by_name(tmp_path, overrides, named):
    with pytest.raises(ValueError, match=f"cannot honour: .*{named}"):
        Trainer(model=tiny_llama(), args=training_args(tmp_path, **overrides), train_dataset=dataset(8),
                data_collator=collate)
    model = tiny_llama()
    with pytest.raises(ValueError, match="optimizers="):
        Trainer(model=model, args=training_args(tmp_path), train_dataset=dataset(8), data_collator=collate,
                optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))


HF_DS_CONFIG = {  # the shape of the configs in Hugging Face's DeepSpeed docs
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
}


def test_auto_values_are_filled_from_the_arguments_and_disagreements_named(tmp_path, tmp_path_factory):
    args = training_args(tmp_path, learning_rate=2e-4, adam_beta2=0.95, weight_decay=0.1, bf16=True,
                         gradient_accumulation_steps=2, max_grad_norm=0.5)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_DS_CONFIG))
    cfg = trainer_config(str(path), args, world_size=1, hidden_size=32)
    assert (cfg.micro_batch_size, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (2, 2, 4)
    assert cfg.gradient_clipping == 0.5 and cfg.precision == "bf16" and cfg.scheduler is None
    assert (cfg.optimizer.lr, cfg.optimizer.betas, cfg.optimizer.weight_decay) == (2e-4, (0.9, 0.95), 0.1)
    assert cfg.zero.prefetch_bucket_size == int(0.9 * 32 * 32) and cfg.zero.param_persistence_threshold == 320
    absent = trainer_config({"zero_optimization": {"stage": 3}}, args, world_size=1, hidden_size=32)
    assert absent.optimizer.lr == 2e-4 and absent.gradient_accumulation_steps == 2 and absent.precision == "bf16"
    wrong = dict(HF_DS_CONFIG, gradient_accumulation_steps=8, optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=8 but .* 2; optimizer\.params\.lr=0\.001"):
        trainer_config(wrong, args, world_size=1, hidden_size=32)


def test_a_deepspeed_json_in_the_arguments_is_refused_naming_infinity_config(tmp_path):
    """Without DeepSpeed installed transformers itself refuses TrainingArguments(deepspeed=...); with it, the
    arguments would set up DeepSpeed's engine beside ours, so the JSON is asked for as infinity_config=."""
    from infinity.hf.trainer import refusals

    args = training_args(tmp_path)
    args.deepspeed = "ds_config.json"  # what TrainingArguments(deepspeed=...) keeps where DeepSpeed is installed
    (reason,) = refusals(args, model_init=None, optimizers=(None, None), optimizer_cls_and_kwargs=None)
    assert reason.startswith("TrainingArguments(deepspeed=...)") and "infinity_config=" in reason


def test_a_model_built_on_meta_streams_its_weights_from_its_folder(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "llama")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "llama")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    trainer = Trainer(model=model, args=training_args(tmp_path / "out", save_strategy="no"),
                      eval_dataset=dataset(4, seed=2), data_collator=collate,
                      infinity_config={"zero_optimization": {"stage": 3}})
    state = trainer.engine.full_state_dict()
    for name, value in tiny_llama().state_dict().items():
        assert torch.equal(state[name], value), name
    batch = collate(dataset(4, seed=2))
    with torch.no_grad():
        expected = tiny_llama()(**batch).loss.item()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-6)
    trainer.engine.close()
    with torch.device("meta"):
        orphan = transformers.LlamaForCausalLM(tiny_llama().config)
    with pytest.raises(ValueError, match="meta device and its name_or_path"):
        Trainer(model=orphan, args=training_args(tmp_path / "out2"), data_collator=collate)


def test_positional_arguments_are_taken_as_the_stock_trainer_takes_them(tmp_path):
    args = training_args(tmp_path, save_strategy="no", max_steps=1)
    trainer = Trainer(tiny_llama(), args, collate, dataset(8), infinity_config={"zero_optimization": {"stage": 3}})
    assert trainer.args is args and trainer.train_dataset is not None and trainer.data_collator is collate
    trainer.train()
    assert trainer.engine.global_step == 1
    trainer.engine.close()


@pytest.fixture(scope="module")
def stock_checkpoint(tmp_path_factory):
    """The stock Trainer's run of 6 steps (5 to an epoch) with checkpoint-2 (the model, torch's optimizer.pt, the
    scheduler, trainer_state, rng_state), and the stock Trainer resumed from it to step 6: the reference."""
    tmp = tmp_path_factory.mktemp("stock-resume")
    args = dict(max_steps=6, save_steps=2, save_total_limit=None, weight_decay=0.1)
    first = transformers.Trainer(model=tiny_llama(), args=training_args(tmp / "stock", **args),
                                 train_dataset=dataset(), data_collator=collate)
    first.train()
    checkpoint = tmp / "stock" / "checkpoint-2"
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth"} <= \
        set(os.listdir(checkpoint)) and "latest" not in os.listdir(checkpoint)
    resumed = transformers.Trainer(model=tiny_llama(), args=training_args(tmp / "stock-resumed", **args),
                                   train_dataset=dataset(), data_collator=collate)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    return {"tmp": tmp, "args": args, "checkpoint": checkpoint, "resumed": resumed}


def test_a_stock_trainers_checkpoint_with_its_optimizer_state_resumes_as_the_stock_trainer_resumes_it(
        stock_checkpoint):
    """Ours, from the stock Trainer's checkpoint-2 (by path, and as output_dir's last): the weights, AdamW moments
    and step, schedule, step and data position come back, and steps 3-6 (across an epoch) log the losses and end
    with the weights the stock Trainer's resumed run does; optimizer states swapped to NVMe, to be written before
    the first step there."""
    tmp, args, checkpoint, stock = (stock_checkpoint[k] for k in ("tmp", "args", "checkpoint", "resumed"))
    before = file_bytes(tmp / "stock")
    (tmp / "last").mkdir()
    copied_checkpoint(checkpoint, tmp / "last" / checkpoint.name)  # output_dir's last checkpoint
    for out, resume in ((tmp / "ours", str(checkpoint)), (tmp / "last", True)):
        ours = Trainer(model=tiny_llama(), args=training_args(out, **args, save_strategy="no"),
                       train_dataset=dataset(), data_collator=collate, infinity_config=nvme_config(tmp / "swap"))
        ours.train(resume_from_checkpoint=resume)
        assert ours.state.global_step == 6 and ours.engine.global_step == 6
        assert len(logged(ours)) == 6  # the history up to the checkpoint came back with it
        torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(stock)), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(logged(ours, "learning_rate")),
                                   torch.tensor(logged(stock, "learning_rate")), rtol=1e-6, atol=0)
        state = ours.engine.full_state_dict()
        for name, value in stock.model.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-5, msg=name)
        ours.engine.close()
    assert file_bytes(tmp / "stock") == before


def copied_checkpoint(checkpoint, to, change_optimizer=None):
    """A copy of ``checkpoint`` whose optimizer.pt ``change_optimizer`` edits in place."""
    to.mkdir()  # a new folder: nothing of a run's is written over
    for f in checkpoint.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    if change_optimizer is not None:
        state = torch.load(to / "optimizer.pt", weights_only=True)
        change_optimizer(state)
        torch.save(state, to / "optimizer.pt")
    return to


def wider_exp_avg(state):
    state["state"][0]["exp_avg"] = torch.zeros(VOCAB + 1, 32)


def other_beta2(state):
    for group in state["param_groups"]:
        group["betas"] = (0.9, 0.95)


def another_model():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("model, change, named", [
    (another_model, None, r"model\.layers\.0\.mlp\.gate_proj\.weight is \(48, 32\) in '.*', the model's is "
                          r"\(64, 32\): it is not this model's checkpoint"),
    (tiny_llama, wider_exp_avg, r"model\.embed_tokens\.weight is \(97, 32\) in '.*optimizer\.pt' \(exp_avg\), "
                                r"the model's is \(96, 32\)"),
    (tiny_llama, other_beta2, r"saved with betas=\(0\.9, 0\.95\), these arguments give \(0\.9, 0\.999\)"),
    (tiny_llama, "scaler", r"its fp16 GradScaler's state \(scaler\.pt\) cannot be resumed exactly"),
], ids=["another-model", "moment-shape", "betas", "grad-scaler"])
def test_a_stock_checkpoint_that_cannot_go_on_exactly_is_refused_naming_why_before_any_work(
        stock_checkpoint, tmp_path, model, change, named):
    """Another model's checkpoint, a moment of another shape (named by the parameter torch's index maps to),
    AdamW's settings other than the arguments', an fp16 GradScaler's state: each named before a step, with nothing
    loaded or written."""
    checkpoint = copied_checkpoint(stock_checkpoint["checkpoint"], tmp_path / "checkpoint-2",
                                   None if change == "scaler" else change)
    if change == "scaler":
        torch.save({"scale": 65536.0}, checkpoint / "scaler.pt")
    before = file_bytes(tmp_path)
    ours = Trainer(model=model(), args=training_args(tmp_path / "ours", **stock_checkpoint["args"]),
                   train_dataset=dataset(), data_collator=collate, infinity_config={"zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match=named):
        ours.train(resume_from_checkpoint=str(checkpoint))
    assert ours.engine.global_step == 0 and ours.state.global_step == 0
    ours.engine.close()
    assert file_bytes(tmp_path) == before


def test_a_model_only_checkpoint_resumes_as_the_stock_trainer_resumes_it(tmp_path):
    """save_only_model=True: checkpoint-2 holds model.safetensors and no optimizer state (the stock Trainer's and
    ours alike). Resumed from it, the stock Trainer takes its weights, its step and its data position with a fresh
    optimizer and schedule; ours, from the stock's folder or its own, continues with the same losses and weights."""
    args = dict(max_steps=4, save_steps=2, save_total_limit=None, save_only_model=True)
    first = transformers.Trainer(model=tiny_llama(), args=training_args(tmp_path / "stock", **args),
                                 train_dataset=dataset(), data_collator=collate)
    first.train()
    checkpoint = tmp_path / "stock" / "checkpoint-2"
    assert {"model.safetensors", "trainer_state.json"} <= set(os.listdir(checkpoint))
    assert not {"optimizer.pt", "latest"} & set(os.listdir(checkpoint))
    stock = transformers.Trainer(model=tiny_llama(), args=training_args(tmp_path / "stock-resumed", **args),
                                 train_dataset=dataset(), data_collator=collate)
    stock.train(resume_from_checkpoint=str(checkpoint))
    assert logged(stock)[3] != logged(first)[3]  # a fresh optimizer from step 3: not the run that went on
    ours_first = Trainer(model=tiny_llama(), args=training_args(tmp_path / "ours", **args), train_dataset=dataset(),
                         data_collator=collate, infinity_config={"zero_optimization": {"stage": 3}})
    ours_first.train()
    ours_first.engine.close()
    assert not {"optimizer.pt", "latest"} & set(os.listdir(tmp_path / "ours" / "checkpoint-2"))
    # from the stock's with parameters on NVMe: released between passes, their .data is empty, not their shape
    for source, config in ((checkpoint, nvme_config(tmp_path / "swap")),
                           (tmp_path / "ours" / "checkpoint-2", {"zero_optimization": {"stage": 3}})):
        ours = Trainer(model=tiny_llama(), args=training_args(tmp_path / f"resumed-{source.parent.name}", **args),
                       train_dataset=dataset(), data_collator=collate, infinity_config=config)
        ours.train(resume_from_checkpoint=str(source))
        assert ours.state.global_step == 4 and len(logged(ours)) == 4
        torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(stock)), rtol=1e-5, atol=0)
        state = ours.engine.full_state_dict()
        for name, value in stock.model.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=name)
        ours.engine.close()


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32], ids=["bf16-model", "fp32-model"])
def test_save_model_writes_the_models_own_dtype_as_the_stock_trainers(tmp_path, model_dtype):
    """bf16=True, a model loaded in bf16 or in fp32: save_model writes each in the model's own dtype (and names it in
    config.json), as the stock Trainer's does, not in the engine's fp32 masters' (twice a bf16 model's size)."""
    from safetensors.torch import load_file

    args = dict(max_steps=2, save_strategy="no", bf16=True)
    saved = {}
    for name, cls, extra in (("stock", transformers.Trainer, {}),
                             ("ours", Trainer, {"infinity_config": {"zero_optimization": {"stage": 3}}})):
        trainer = cls(model=tiny_llama().to(model_dtype), args=training_args(tmp_path / name, **args),
                      train_dataset=dataset(), data_collator=collate, **extra)
        trainer.train()
        trainer.save_model(tmp_path / f"{name}-model")
        config = json.loads((tmp_path / f"{name}-model" / "config.json").read_text())
        saved[name] = (load_file(tmp_path / f"{name}-model" / "model.safetensors"), config["dtype"])
        if name == "ours":
            trainer.engine.close()
    (ours, ours_dtype), (stock, stock_dtype) = saved["ours"], saved["stock"]
    assert ours_dtype == stock_dtype == str(model_dtype).removeprefix("torch.")
    assert set(ours) == set(stock) and {v.dtype for v in ours.values()} == {model_dtype}
    for name, value in stock.items():  # bf16 arithmetic in both runs, autocast in the stock one: bf16's tolerance
        torch.testing.assert_close(ours[name].float(), value.float(), rtol=0, atol=2e-2, msg=name)
