"""A DeepSpeed script's own optimizer and scheduler (``deepspeed.ops.adam``'s, ``transformers.get_scheduler``,
torch's ``LambdaLR``) under ``import infinity.deepspeed as deepspeed``: each step's learning rate and loss are plain
PyTorch's with ``torch.optim.AdamW`` and the same scheduler, and a resumed run goes on with the schedule where it
was."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import get_scheduler

import infinity.deepspeed as deepspeed
from infinity.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from unit.test_deepspeed_door import ADAMW, Regressor, config, data, run

LR = 1e-2


def groups(model):
    return [{"params": [model.hidden.weight, model.out.weight], "weight_decay": 0.1},
            {"params": [model.hidden.bias, model.out.bias], "weight_decay": 0.0}]


def reference(model, optimizer, scheduler, batches, accumulation=4):
    """Plain PyTorch: the losses, and the learning rate each optimizer step used."""
    losses, rates = [], []
    for i, (x, y) in enumerate(batches):
        loss = model(x, y)
        (loss / accumulation).backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    return losses, rates


def run_with_rates(engine, loader):
    losses, rates, batches = [], [], []
    for batch in loader:
        loss = engine(*batch)
        engine.backward(loss)
        if engine.micro_step % 4 == 3:
            rates.append(engine.get_lr()[0])
        engine.step()
        losses.append(loss.item())
        batches.append(batch)
    return losses, rates, batches


@pytest.mark.parametrize("make", [
    lambda g: DeepSpeedCPUAdam(g, lr=LR, betas=(0.9, 0.95)),
    lambda g: FusedAdam(g, lr=LR, betas=(0.9, 0.95)),
], ids=["DeepSpeedCPUAdam", "FusedAdam"])
def test_a_scripts_optimizer_and_transformers_scheduler_train_as_plain_pytorch(make):
    torch.manual_seed(0)
    model = Regressor()
    ref = copy.deepcopy(model)
    optimizer = make(groups(model))
    scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=2, num_training_steps=8)
    engine, _, loader, returned = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                       training_data=data(), config=config())
    with engine:
        assert returned is scheduler is engine.lr_scheduler and engine.get_lr() == [0.0]  # the warmup's first step
        losses, rates, batches = run_with_rates(engine, loader)
        more, more_rates, more_batches = run_with_rates(engine, loader)
    ref_optimizer = torch.optim.AdamW(groups(ref), lr=LR, betas=(0.9, 0.95))
    ref_scheduler = get_scheduler("cosine", optimizer=ref_optimizer, num_warmup_steps=2, num_training_steps=8)
    expected, expected_rates = reference(ref, ref_optimizer, ref_scheduler, batches + more_batches)
    assert rates + more_rates == pytest.approx(expected_rates, rel=1e-12) and expected_rates[1] > expected_rates[-1]
    torch.testing.assert_close(torch.tensor(losses + more), torch.tensor(expected), rtol=1e-5, atol=0)


def test_a_callable_makes_the_scheduler_over_the_configs_optimizer_and_a_resume_goes_on_with_it(tmp_path):
    def factory(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))

    def start():
        torch.manual_seed(1)
        model = Regressor()
        return deepspeed.initialize(model=model, lr_scheduler=factory, training_data=data(), config=config(**ADAMW))

    engine, _, loader, _ = start()
    batches = [tuple(t[i:i + 4] for t in data().tensors) for i in range(0, 64, 4)]
    with engine:
        whole = [_micro_step(engine, b) for b in batches]
        rates = engine.get_lr()
    engine, _, _, scheduler = start()
    with engine:
        first = [_micro_step(engine, b) for b in batches[:8]]
        engine.save_checkpoint(tmp_path, client_state={"mine": 1})
    engine, _, _, fresh = start()
    with engine:
        _, client_state = engine.load_checkpoint(tmp_path)
        assert client_state == {"mine": 1} and engine.get_lr() == pytest.approx([LR / 3])  # two steps made, the third's lr
        rest = [_micro_step(engine, b) for b in batches[8:]]
        assert engine.get_lr() == rates == pytest.approx([LR / 5]) and fresh.get_last_lr() == pytest.approx([LR / 5])
    assert first + rest == whole

    torch.manual_seed(1)
    ref = Regressor()
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    expected, _ = reference(ref, ref_optimizer, factory(ref_optimizer), batches)
    torch.testing.assert_close(torch.tensor(whole), torch.tensor(expected), rtol=1e-5, atol=0)


def test_the_configs_optimizer_shows_the_groups_given_in_their_order_to_the_script_and_to_a_scheduler_callable():
    """accelerate's ``DummyOptim(groups)`` + ``DummyScheduler(lr_scheduler_callable=...)`` pass the groups as
    ``model_parameters`` and the callable as ``lr_scheduler``: DeepSpeed's optimizer keeps one group per group given,
    in order, and hands itself to the callable, so ``param_groups`` and ``get_last_lr()`` read as torch's would over
    the same groups (two here share a decay; the undecayed one comes first)."""
    def my_groups(model):
        return [{"params": [model.hidden.bias, model.out.bias], "weight_decay": 0.0},
                {"params": [model.hidden.weight], "weight_decay": 0.1}, {"params": [model.out.weight]}]

    def factory(optimizer):  # a LambdaLR takes one lambda per group
        return torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda step: 1.0 / (step + 1)] * 3)

    torch.manual_seed(1)
    model = Regressor()
    ref = copy.deepcopy(model)
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, model_parameters=my_groups(model),
                                                                lr_scheduler=factory, training_data=data(),
                                                                config=config(**ADAMW))
    ref_optimizer = torch.optim.AdamW(my_groups(ref), lr=LR, weight_decay=0.01)
    ref_scheduler = factory(ref_optimizer)
    with engine:
        assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.1, 0.01]
        assert [g["weight_decay"] for g in optimizer.param_groups] == [g["weight_decay"]
                                                                       for g in ref_optimizer.param_groups]
        losses, rates, batches = run_with_rates(engine, loader)
        assert scheduler.get_last_lr() == pytest.approx([LR / 5] * 3)
    expected, expected_rates = reference(ref, ref_optimizer, ref_scheduler, batches)
    assert rates == pytest.approx(expected_rates, rel=1e-12)
    assert scheduler.get_last_lr() == pytest.approx(ref_scheduler.get_last_lr(), rel=1e-12)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)


def test_the_configs_scheduler_gives_a_rate_per_group_given_as_deepspeeds_does():
    """accelerate's ``DummyOptim(groups)`` + ``DummyScheduler`` with the config's ``scheduler`` block: DeepSpeed's
    schedulers keep ``[group["lr"] for group in optimizer.param_groups]``, one rate per group given."""
    def my_groups(model):
        return [{"params": [model.hidden.bias, model.out.bias], "weight_decay": 0.0},
                {"params": [model.hidden.weight, model.out.weight], "weight_decay": 0.1}]

    model = Regressor()
    block = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 2,
                                                 "total_num_steps": 8, "warmup_type": "linear"}}
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=model, model_parameters=my_groups(model),
                                                                training_data=data(), config=config(**ADAMW,
                                                                                                    scheduler=block))
    with engine:
        run_with_rates(engine, loader)  # four optimizer steps
        expected = LR * (8 - 3) / (8 - 2)  # WarmupDecayLR at its iteration 3: past the warmup, decaying to 0
        assert scheduler.get_last_lr() == pytest.approx([expected] * 2, rel=1e-12)
        assert scheduler.get_last_lr() == [group["lr"] for group in optimizer.param_groups]


def test_a_scheduler_the_engine_was_not_given_moves_its_rates_through_the_scripts_optimizer():
    """DeepSpeed's engine steps with the groups of the optimizer the script made, so a scheduler over that
    optimizer stepped by the script itself (accelerate's loop does so) sets the rates; a DeepSpeedCPUAdam made over
    an AdamW's groups (accelerate's ``map_pytorch_optim_to_deepspeed``) shares them."""
    torch.manual_seed(0)
    model = Regressor()
    ref = copy.deepcopy(model)
    made = torch.optim.AdamW(groups(model), lr=LR, betas=(0.9, 0.95))
    scheduler = get_scheduler("linear", optimizer=made, num_warmup_steps=2, num_training_steps=8)
    optimizer = DeepSpeedCPUAdam(made.param_groups, lr=LR, adamw_mode=True)  # the groups' dicts themselves
    engine, _, loader, returned = deepspeed.initialize(model=model, optimizer=optimizer, training_data=data(),
                                                       config=config())
    losses, rates, batches = [], [], []
    with engine:
        assert returned is None and engine.get_lr() == [0.0]  # the warmup's first rate, read from the groups
        for i, batch in enumerate(loader):
            loss = engine(*batch)
            engine.backward(loss)
            if i % 4 == 3:
                rates.append(engine.get_lr()[0])
            engine.step()
            if i % 4 == 3:
                scheduler.step()  # the script's own, after the step
            losses.append(loss.item())
            batches.append(batch)
    ref_optimizer = torch.optim.AdamW(groups(ref), lr=LR, betas=(0.9, 0.95))
    ref_scheduler = get_scheduler("linear", optimizer=ref_optimizer, num_warmup_steps=2, num_training_steps=8)
    expected, expected_rates = reference(ref, ref_optimizer, ref_scheduler, batches)
    assert rates == pytest.approx(expected_rates, rel=1e-12) and expected_rates[2] == LR
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)


def _micro_step(engine, batch) -> float:
    loss = engine(*batch)
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_what_a_client_schedule_cannot_do_is_refused_by_name():
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    other = torch.optim.AdamW(Regressor().parameters(), lr=LR)
    schedule_block = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
    cases = [
        (dict(optimizer=optimizer, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(other, lambda s: 1.0)),
         config(), "moves another optimizer"),
        (dict(optimizer=optimizer, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)),
         config(**schedule_block), "both the config's scheduler block and lr_scheduler"),
        (dict(lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)), config(**ADAMW),
         "give the optimizer it moves"),
    ]
    for kwargs, cfg, said in cases:
        with pytest.raises(ValueError, match=said):
            deepspeed.initialize(model=model, config=cfg, **kwargs)
    with pytest.raises(ValueError, match="bias_correction=False"):
        DeepSpeedCPUAdam(model.parameters(), bias_correction=False)
    split = torch.optim.AdamW(groups(model), lr=LR)
    per_group = torch.optim.lr_scheduler.LambdaLR(split, [lambda s: 1.0, lambda s: 0.5])
    with pytest.raises(ValueError, match="has one lr"):
        deepspeed.initialize(model=model, optimizer=split, lr_scheduler=per_group, config=config())
    split = torch.optim.AdamW(groups(model), lr=LR)
    apart_later = torch.optim.lr_scheduler.LambdaLR(split, [lambda s: 1.0, lambda s: 1.0 if s == 0 else 0.5])
    engine, _, loader, _ = deepspeed.initialize(model=model, optimizer=split, lr_scheduler=apart_later,
                                                training_data=data(), config=config(train_batch_size=4))
    with engine, pytest.raises(ValueError, match=r"learning rates \[0.005, 0.01\].*groups must move together"):
        run(engine, loader)


def test_the_configs_csv_monitor_writes_each_steps_loss_and_lr_at_its_samples(tmp_path, caplog):
    torch.manual_seed(2)
    model = Regressor()
    optimizer = DeepSpeedCPUAdam(groups(model), lr=LR)
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=1, num_training_steps=4)
    monitors = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"},
                "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run"}}
    with caplog.at_level("INFO"):
        engine, _, loader, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                    training_data=data(), config=config(**monitors))
    with engine:
        losses, rates, _ = run_with_rates(engine, loader)
    assert "placement" in caplog.text and "not applicable" not in caplog.text  # both blocks are honoured
    written = {}
    for name in ("train_loss", "lr"):
        with open(tmp_path / "run" / f"Train_Samples_{name}.csv") as f:
            header, *rows = [line.strip().split(",") for line in f]
        assert header == ["step", name]
        written[name] = rows
    assert [int(step) for step, _ in written["lr"]] == [16, 32, 48, 64]  # the global samples after each step
    assert [float(v) for _, v in written["lr"]] == pytest.approx(rates)
    means = torch.tensor(losses).reshape(4, 4).mean(dim=1)  # each step's four micro-batches
    assert [float(v) for _, v in written["train_loss"]] == pytest.approx(means.tolist(), rel=1e-6)
    try:
        import tensorboard  # noqa: F401  (not a dependency)
    except ImportError:
        assert "tensorboard package is not installed" in caplog.text
