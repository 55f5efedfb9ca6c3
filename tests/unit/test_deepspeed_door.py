"""A DeepSpeed script with ``import infinity.deepspeed as deepspeed``: the four things ``initialize`` returns, the
loop ``engine(batch); engine.backward(loss); engine.step()`` against plain PyTorch with ``torch.optim``, DeepSpeed's
checkpoint returns, and what cannot be honoured refused by name before any work."""

from __future__ import annotations

import argparse
import copy
import logging

import pytest
import torch
from torch.utils.data import TensorDataset

import infinity.deepspeed as deepspeed

LR = 1e-2


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.out(torch.tanh(self.hidden(x))), y)


def data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def config(**extra):
    return {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}} | extra


ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}


def reference(model, optimizer, batches, accumulation, clip=1.0) -> list[float]:
    """Plain PyTorch: ``optimizer`` over ``model``, the losses of ``batches`` averaged over each accumulation."""
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = model(x, y)
        (loss / accumulation).backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return losses


def run(engine, loader) -> tuple[list[float], list]:
    losses, batches = [], []
    for batch in loader:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        batches.append(batch)
    return losses, batches


def assert_same_model(engine, model):
    state = engine.full_state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_deepspeed_loop_trains_as_plain_pytorch_and_its_loader_covers_the_data_once():
    torch.manual_seed(0)
    model = Regressor()
    ref = copy.deepcopy(model)
    engine, optimizer, loader, schedule = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                               training_data=data(), config=config(**ADAMW))
    with engine:
        # DeepSpeed's arithmetic: 16 = 4 per micro-batch x 4 accumulation steps x 1 rank
        assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                engine.gradient_accumulation_steps()) == (16, 4, 4)
        assert schedule is None and optimizer.param_groups[0]["lr"] == LR
        losses, batches = run(engine, loader)
        assert engine.global_steps == 4 and engine.was_step_applied()
        assert (engine.zero_optimization_stage(), engine.dp_world_size, engine.global_samples) == (3, 1, 64)
        timer = engine.tput_timer
        assert (timer.global_step_count, timer.micro_step_count) == (4, 16) and timer.avg_samples_per_sec() > 0
        timer.update_epoch_count()  # what a DeepSpeed script calls at an epoch's end
        seen = torch.cat([x for x, _ in batches])
        assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, data().tensors[0].tolist()))
        expected = reference(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01), batches, 4)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
        assert_same_model(engine, ref)


@pytest.mark.parametrize("make", [
    lambda groups: torch.optim.AdamW(groups, lr=LR, betas=(0.8, 0.95), eps=1e-6),
    lambda groups: torch.optim.Adam(groups, lr=LR),  # its weight decay is L2, added to the gradient
], ids=["AdamW", "Adam"])
def test_a_client_adam_is_the_engines_optimizer_with_its_groups_decay(make):
    torch.manual_seed(1)
    model = Regressor()
    ref = copy.deepcopy(model)

    def groups(m):  # each named, as scripts label their groups (torch.optim keeps the key)
        return [{"params": [m.hidden.weight, m.out.weight], "weight_decay": 0.1, "name": "decay"},
                {"params": [m.hidden.bias, m.out.bias], "weight_decay": 0.0, "name": "no_decay"}]
    engine, optimizer, loader, _ = deepspeed.initialize(model=model, optimizer=make(groups(model)),
                                                        training_data=data(), config=config())
    with engine:
        assert sorted(g["weight_decay"] for g in optimizer.param_groups) == [0.0, 0.1]
        losses, batches = run(engine, loader)
    expected = reference(ref, make(groups(ref)), batches, 4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)


def test_checkpoints_return_as_deepspeeds_and_resume_bitwise(tmp_path):
    torch.manual_seed(2)
    model = Regressor()
    batches = [tuple(t[i:i + 4] for t in data().tensors) for i in range(0, 64, 4)]
    cfg = config(**ADAMW)

    def engine_of(m):
        return deepspeed.initialize(model=m, config=cfg)[0]

    with engine_of(copy.deepcopy(model)) as engine:
        assert engine.load_checkpoint(tmp_path / "nothing-yet") == (None, None)  # a script then starts afresh
        straight = [engine.backward(loss := engine(*b)) or engine.step() or loss.item() for b in batches]
    with engine_of(copy.deepcopy(model)) as engine:
        for b in batches[:8]:
            engine.backward(engine(*b))
            engine.step()
        assert engine.save_checkpoint(tmp_path / "ckpt", client_state={"epoch": 3}) is True
    with engine_of(copy.deepcopy(model)) as engine:
        path, client_state = engine.load_checkpoint(tmp_path / "ckpt")
        assert path == str(tmp_path / "ckpt" / "global_step2") and client_state["epoch"] == 3
        resumed = [engine.backward(loss := engine(*b)) or engine.step() or loss.item() for b in batches[8:]]
    assert resumed == straight[8:]


def test_a_tag_given_as_a_step_number_names_the_checkpoint_as_deepspeeds_str_tag_does(tmp_path):
    """DeepSpeed's save_checkpoint and load_checkpoint take ``str(tag)``: scripts pass their step count."""
    torch.manual_seed(2)
    model = Regressor()
    batches = [tuple(t[i:i + 4] for t in data().tensors) for i in range(0, 32, 4)]
    cfg = config(**ADAMW)
    with deepspeed.initialize(model=copy.deepcopy(model), config=cfg)[0] as engine:
        for b in batches[:4]:
            engine.backward(engine(*b))
            engine.step()
        engine.save_checkpoint(tmp_path, tag=engine.global_steps)
        straight = [engine.backward(loss := engine(*b)) or engine.step() or loss.item() for b in batches[4:]]
    assert (tmp_path / "latest").read_text().strip() == "1" and (tmp_path / "1").is_dir()
    with deepspeed.initialize(model=copy.deepcopy(model), config=cfg)[0] as engine:
        path, _ = engine.load_checkpoint(tmp_path, tag=1)
        resumed = [engine.backward(loss := engine(*b)) or engine.step() or loss.item() for b in batches[4:]]
    assert path == str(tmp_path / "1") and resumed == straight


def test_the_lr_a_script_sets_on_the_groups_is_the_engines_and_a_scheduler_block_is_returned():
    model = Regressor()
    schedule_cfg = config(**ADAMW, scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                                             "warmup_max_lr": LR,
                                                                             "warmup_num_steps": 4,
                                                                             "warmup_type": "linear"}})
    engine, optimizer, loader, schedule = deepspeed.initialize(model=model, training_data=data(), config=schedule_cfg)
    with engine:
        run(engine, loader)
        assert schedule.get_last_lr() == [engine.lr] and 0.0 < engine.lr < LR  # warming up (test_lr_schedule: how)
    decayed = [{"params": [model.hidden.weight], "weight_decay": 0.1},
               {"params": [model.hidden.bias, model.out.weight, model.out.bias], "weight_decay": 0.0}]
    engine, optimizer, _, _ = deepspeed.initialize(model=Regressor(), config=config(**ADAMW))
    with engine:
        for group in optimizer.param_groups:
            group["lr"] = 3e-3
        assert engine.get_lr() == [3e-3] and optimizer.param_groups[0]["lr"] == 3e-3
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=decayed, config=config(**ADAMW))
    with engine:
        optimizer.param_groups[0]["lr"] = 1e-3
        with pytest.raises(ValueError, match="one learning rate"):
            optimizer.param_groups[1]["lr"] = 2e-3
        with pytest.raises(ValueError, match="'weight_decay'.*cannot be set"):
            optimizer.param_groups[0]["weight_decay"] = 0.5


def test_zero_init_builds_on_meta_and_initialize_gives_the_values_eager_construction_gives():
    torch.manual_seed(5)
    eager = Regressor()
    torch.manual_seed(5)
    with deepspeed.zero.Init(config_dict_or_path=config(**ADAMW)):
        model = Regressor()
    assert all(p.is_meta for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(**ADAMW))
    with engine:
        state = engine.full_state_dict()
    for name, value in eager.state_dict().items():  # the modules' reset_parameters replayed in order
        assert torch.equal(state[name], value), name


def test_save_16bit_model_writes_the_state_dict_in_the_compute_precision(tmp_path):
    model = Regressor()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(**ADAMW, bf16={"enabled": True}))
    with engine:
        assert engine.bfloat16_enabled() and not engine.fp16_enabled()
        assert engine.save_16bit_model(tmp_path, "model.bin") is True
        expected = {name: value.to(torch.bfloat16) for name, value in engine.full_state_dict().items()}
    written = torch.load(tmp_path / "model.bin")
    assert written.keys() == expected.keys() and all(torch.equal(written[n], v) for n, v in expected.items())


@pytest.mark.parametrize("gather", [True, False])
def test_the_gather_16bit_key_is_what_get_state_dict_asks_and_is_not_logged_as_meaning_nothing(caplog, gather):
    """DeepSpeed's stage3_gather_16bit_weights_on_model_save is what accelerate's get_state_dict and save_model ask
    (zero_gather_16bit_weights_on_model_save) before gathering the model, so the engine's log does not list it
    among the keys that mean nothing here; a key that means nothing (overlap_comm) still is."""
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True,
            "stage3_gather_16bit_weights_on_model_save": gather}
    with caplog.at_level(logging.INFO, logger="infinity"):
        engine, _, _, _ = deepspeed.initialize(model=Regressor(), config=config(**ADAMW, zero_optimization=zero))
    with engine:
        assert engine.zero_gather_16bit_weights_on_model_save() is gather
    notes = [r.getMessage() for r in caplog.records if "not applicable" in r.getMessage()]
    assert notes == ["config keys accepted but not applicable here: zero_optimization.overlap_comm"]


@pytest.mark.parametrize("kwargs, said", [
    (dict(mpu=object()), "mpu"),
    (dict(lr_scheduler=object()), "lr_scheduler"),
    (dict(optimizer=torch.optim.SGD, config=config()), "optimizer=SGD"),
    (dict(model_parameters="the hidden layer"), "leaves out 2 parameter"),
    (dict(config=config(**ADAMW), args=argparse.Namespace(deepspeed_config="ds.json")), "both as args"),
    (dict(config=None), "no DeepSpeed config"),
    (dict(config=config(train_micro_batch_size_per_gpu=3)), "is not a multiple"),
    (dict(client_adam=True), "both the config's optimizer block"),
], ids=["mpu", "lr_scheduler", "sgd", "subset", "two-configs", "no-config", "batch", "two-optimizers"])
def test_what_cannot_be_honoured_is_refused_by_name(kwargs, said, monkeypatch):
    from infinity.deepspeed import engine as door

    model = Regressor()
    monkeypatch.setattr(door.Engine, "__init__", lambda *a, **k: pytest.fail("the model was sharded"))
    if kwargs.pop("client_adam", False):
        kwargs = dict(optimizer=torch.optim.AdamW(model.parameters()), config=config(**ADAMW))
    if kwargs.get("model_parameters") == "the hidden layer":
        kwargs["model_parameters"] = model.hidden.parameters()
    kwargs.setdefault("config", config(**ADAMW))
    if said == "is not a multiple":
        monkeypatch.undo()  # the batch arithmetic needs the world size: refused as the engine starts
    with pytest.raises(ValueError, match=said):
        deepspeed.initialize(model=model, **kwargs)


def test_engine_arguments_it_cannot_honour_are_refused_by_name(tmp_path):
    engine, _, _, _ = deepspeed.initialize(model=Regressor(), config=config(**ADAMW))
    with engine:
        x, y = data().tensors
        with pytest.raises(ValueError, match="retain_graph=True"):
            engine.backward(engine(x[:4], y[:4]), retain_graph=True)
        with pytest.raises(ValueError, match="load_module_strict=False"):
            engine.load_checkpoint(tmp_path, tag="global_step0", load_module_strict=False)
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"]).deepspeed_config == "ds.json"


def test_get_accelerator_names_the_device_the_engine_computes_on():
    accelerator = deepspeed.get_accelerator()
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    assert accelerator is deepspeed.accelerator.get_accelerator()
    assert (accelerator.device_name(), accelerator.communication_backend_name()) == (
        kind, "nccl" if kind == "cuda" else "gloo")
    assert torch.device(accelerator.device_name(0)).type == kind
    assert accelerator.on_accelerator(torch.zeros(1, device=kind)) and accelerator.device_count() >= 1


class Checkpointed(Regressor):
    def forward(self, x, y):
        hidden = deepspeed.checkpointing.checkpoint(lambda t: torch.tanh(self.hidden(t)), x)
        return torch.nn.functional.mse_loss(self.out(hidden), y)


def test_deepspeed_checkpointing_recomputes_under_the_engine_and_trains_as_without_it():
    deepspeed.checkpointing.configure(None, partition_activations=False)
    assert deepspeed.checkpointing.is_configured()
    torch.manual_seed(6)
    model = Checkpointed()
    ref = Regressor()
    ref.load_state_dict(model.state_dict())
    engine, _, loader, _ = deepspeed.initialize(model=model, training_data=data(), config=config(**ADAMW))
    with engine:
        losses, batches = run(engine, loader)
        expected = reference(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01), batches, 4)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
        assert_same_model(engine, ref)
    with pytest.raises(ValueError, match="mpu_"):
        deepspeed.checkpointing.configure(object())


def test_what_the_engine_lacks_the_model_answers_as_deepspeeds_engine_forwards_it():
    model = Regressor()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(**ADAMW))
    with engine:
        assert engine.hidden is model.hidden and engine.train_batch_size() == 16  # the engine's own first
        # named after what the script asked, as DeepSpeed's engine names itself (not the model it forwards to)
        with pytest.raises(AttributeError, match="'DeepSpeedEngine' object has no attribute 'nowhere'"):
            engine.nowhere


def test_a_model_property_that_fails_inside_raises_through_the_engine_what_the_model_raises():
    class Broken(Regressor):
        @property
        def width(self):
            return self.hidden.nowhere_inside

    with pytest.raises(AttributeError) as plain:
        Broken().width
    engine, _, _, _ = deepspeed.initialize(model=Broken(), config=config(**ADAMW))
    with engine:
        with pytest.raises(AttributeError) as through:
            engine.width
    assert str(through.value) == str(plain.value)


def test_the_door_answers_deepspeed_version_as_importlib_metadata_does_under_the_alias():
    from packaging.version import Version

    from infinity.deepspeed import alias

    assert deepspeed.__version__ == alias._DoorDistribution().version  # what version("deepspeed") answers
    assert Version(deepspeed.__version__) >= Version("0.14")  # scripts compare it so


def test_a_module_only_load_starts_a_fresh_optimizer_from_the_saved_weights_as_plain_pytorch_does(tmp_path):
    torch.manual_seed(7)
    engine, _, loader, _ = deepspeed.initialize(model=Regressor(), training_data=data(), config=config(**ADAMW))
    with engine:
        run(engine, loader)
        engine.save_checkpoint(tmp_path)
        saved = engine.full_state_dict()
    runs = {}
    for how in ("load_module_only", "load_optimizer_states"):
        torch.manual_seed(8)  # other initial values, which the load replaces
        engine, _, loader, _ = deepspeed.initialize(model=Regressor(), training_data=data(), config=config(**ADAMW))
        with engine:
            engine.load_checkpoint(tmp_path, **{how: how == "load_module_only"})
            assert engine.global_steps == (0 if how == "load_module_only" else 4)
            assert all(torch.equal(value, saved[name]) for name, value in engine.full_state_dict().items())
            assert not deepspeed.utils.safe_get_full_optimizer_state(engine.module.out.weight, "exp_avg").any()
            runs[how] = run(engine, loader)
    for how, (losses, batches) in runs.items():  # the second restores the saved RNG: its batches come in another order
        ref = Regressor()
        ref.load_state_dict(saved)
        expected = reference(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01), batches, 4)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0, msg=how)



def test_without_an_optimizer_forwards_run_and_training_is_refused_naming_what_to_give():
    """DeepSpeed's ``initialize`` without an optimizer block or ``optimizer=``: an engine whose forwards work and
    whose ``backward`` and ``step`` refuse (its ZeRO-3 returns no optimizer to step); never a default AdamW."""
    torch.manual_seed(4)
    model = Regressor()
    ref = copy.deepcopy(model)
    x, y = data(8).tensors
    engine, optimizer, _, schedule = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                          config=config())
    with engine:
        assert optimizer is None and schedule is None
        loss = engine(x, y)
        torch.testing.assert_close(loss, ref(x, y), rtol=1e-6, atol=0)
        for call in (lambda: engine.backward(loss), engine.step):
            with pytest.raises(RuntimeError, match=r'"optimizer" block .*optimizer=\.\.\.'):
                call()
        with torch.no_grad():
            engine.eval()
            torch.testing.assert_close(engine(x, y), ref(x, y), rtol=1e-6, atol=0)
        assert engine.global_steps == 0
        assert_same_model(engine, ref)  # nothing trained


def test_engine_optimizer_is_the_returned_one_and_an_lr_set_in_its_groups_trains_as_torch_adamw_does():
    """DeepSpeed's ``initialize`` returns ``engine.optimizer``; scripts set ``engine.optimizer.param_groups[i]["lr"]``
    by hand and log ``cur_scale``/``loss_scale`` (1.0 without fp16, ``2**initial_scale_power`` with it)."""
    torch.manual_seed(5)
    model = Regressor()
    ref = copy.deepcopy(model)
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    batches = [tuple(t[i:i + 4] for t in data().tensors) for i in range(0, 64, 4)]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=config(**ADAMW))
    with engine:
        assert optimizer is engine.optimizer
        assert engine.optimizer.cur_scale == engine.optimizer.loss_scale == 1.0
        for i, batch in enumerate(batches):
            if i == 8:  # after two steps: a quarter of the rate, through engine.optimizer
                for group in engine.optimizer.param_groups:
                    group["lr"] = LR / 4
            engine.backward(engine(*batch))
            engine.step()
        assert engine.optimizer.param_groups[0]["lr"] == LR / 4
        reference(ref, ref_optimizer, batches[:8], 4)
        for group in ref_optimizer.param_groups:
            group["lr"] = LR / 4
        reference(ref, ref_optimizer, batches[8:], 4)
        assert_same_model(engine, ref)
    fp16 = config(**ADAMW, fp16={"enabled": True, "initial_scale_power": 8})
    engine, _, _, _ = deepspeed.initialize(model=Regressor(), config=fp16)
    with engine:
        assert engine.optimizer.cur_scale == engine.optimizer.loss_scale == 2.0 ** 8


def test_the_optimizers_overflow_is_a_skipped_step_as_accelerate_reads_it():
    """accelerate's DeepSpeed wrapper reads ``optimizer.overflow`` for ``step_was_skipped`` (and a script's
    ``accelerator.optimizer_step_was_skipped``); without it every skipped fp16 step read as applied."""
    batch = tuple(t[:4] for t in data().tensors)
    for precision, expected in (({"fp16": {"enabled": True, "initial_scale_power": 32}}, True), ({}, False)):
        engine, optimizer, _, _ = deepspeed.initialize(model=Regressor(), config=config(**ADAMW, **precision))
        with engine:
            for _ in range(engine.gradient_accumulation_steps()):  # to the step
                engine.backward(engine(*batch))
                engine.step()
            assert engine.global_steps == 1 and engine.was_step_applied() is not expected  # 2**32 x the loss: inf
            assert hasattr(optimizer, "overflow") and optimizer.overflow is expected  # as accelerate reads it


def test_client_state_is_anything_torch_save_stores_and_comes_back_as_it_was_given(tmp_path):
    """DeepSpeed keeps ``client_state`` in its checkpoint with ``torch.save``: tensors, tuples, numpy values and
    nested dicts come back as they were; what cannot be stored is named before a file is written; a checkpoint
    written before (its client_state plain JSON) still loads."""
    numpy = pytest.importorskip("numpy")
    from infinity.engine.engine import Engine

    given = {"t": torch.arange(6, dtype=torch.float64).reshape(2, 3), "pair": (3, "a"),
             "nested": {"step": numpy.int64(7), "lrs": [1e-3, (0.9, 0.95)], 4: {"deep": torch.ones(2)}}}
    engine, _, _, _ = deepspeed.initialize(model=Regressor(), config=config(**ADAMW))
    with engine:
        with pytest.raises(ValueError, match=r"client_state\['nested'\]\['bad'\]"):
            engine.save_checkpoint(tmp_path / "refused", client_state={"nested": {"ok": 1, "bad": lambda: 0}})
        assert not (tmp_path / "refused").exists()
        engine.save_checkpoint(tmp_path / "ckpt", client_state=given)
        Engine.save_checkpoint(engine, tmp_path / "before", client_state={"epoch": 3, "seen": [1, 2]})  # as before
        _, loaded = engine.load_checkpoint(tmp_path / "ckpt")
        _, before = engine.load_checkpoint(tmp_path / "before")
    assert set(loaded) == set(given) and torch.equal(loaded["t"], given["t"]) and loaded["t"].dtype == torch.float64
    assert type(loaded["pair"]) is tuple and loaded["pair"] == (3, "a")
    nested = loaded["nested"]
    assert type(nested["step"]) is numpy.int64 and nested["step"] == 7 and nested["lrs"] == [1e-3, (0.9, 0.95)]
    assert torch.equal(nested[4]["deep"], torch.ones(2))
    assert before == {"epoch": 3, "seen": [1, 2]}
