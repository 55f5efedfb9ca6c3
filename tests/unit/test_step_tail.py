"""A step's updates that finish behind the next forward (``infinity.optim.step_tail``) change timing, never results.

Most steps here clip (the threshold is tiny), so every overlapped step waits for the global norm and makes all
its updates after backward: with ``overlap_step_with_forward`` they run on the tail's worker while the next
forward begins; without clipping, the updates a slowed worker had not begun when backward ended do. The tail is slowed down on purpose, so the forward reaches parameters whose sub-group is not
updated yet: a fetch that did not wait for it would gather the old values, and the losses would differ.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

import infinity
from helpers import TinyGPT, engine_config, engine_steps, gpt_batches, slow_step_tail, train_batches


def _train(model, batches, tmp_path, *, param, optimizer, overlap, accum, lrs, clip=1e-3):
    """Steps with a new learning rate set right after each ``step()`` (while its tail may still run): the losses,
    the final full state dict and each step's metrics."""
    config = engine_config(param=param, optimizer=optimizer, nvme_path=str(tmp_path), accum=accum, clip=clip,
                           lr=lrs[0], overlap_step_with_backward=overlap)

    def set_next_lr(engine, step):
        engine.lr = lrs[step + 1]  # the tail updates with the rate its step settled with, not this one

    losses, state, metrics, _ = engine_steps(model, config, batches, steps=len(lrs) - 1, accum=accum,
                                             after_step=set_next_lr)
    return losses, state, metrics


@pytest.mark.parametrize("param, optimizer", [("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu"), ("none", "cpu")])
@pytest.mark.parametrize("accum", [1, 2])
def test_updates_behind_the_forward_equal_the_step_after_backward(tmp_path, monkeypatch, param, optimizer, accum):
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(12, batch=4)
    lrs = [3e-3, 2e-3, 1e-3, 5e-4, 2.5e-4]
    off_losses, off_state, _ = _train(model, batches, tmp_path, param=param, optimizer=optimizer, overlap=False,
                                      accum=accum, lrs=lrs)
    seen = slow_step_tail(monkeypatch)
    on_losses, on_state, on_metrics = _train(model, batches, tmp_path, param=param, optimizer=optimizer,
                                             overlap=True, accum=accum, lrs=lrs)
    assert all(m["overlapped_step"] == "redone" or m["overlapped_step"] == "committed" for m in on_metrics)
    assert all(m["sub_groups_behind_forward"] > 0 for m in on_metrics)  # every step clipped: all updates wait
    assert seen["tail_updates"] == sum(m["sub_groups_behind_forward"] for m in on_metrics)
    assert seen["waited"] > 0  # the forward reached parameters before their sub-group's update: the gate mattered
    assert on_losses == off_losses
    for key in off_state:
        assert torch.equal(on_state[key], off_state[key]), key


@pytest.mark.parametrize("param, optimizer", [("nvme", "nvme"), ("cpu", "cpu"), ("none", "cpu")])
def test_without_clipping_the_updates_backward_did_not_reach_run_behind_the_forward(tmp_path, monkeypatch, param,
                                                                                     optimizer):
    """Nothing clips: the worker updates sub-groups as backward finishes them, but it is slowed here (as a host's
    Adam is behind a GPU's backward), so some are still queued when backward ends. Those are left for the tail,
    which the next forward waits on sub-group by sub-group; the results are bitwise the step after backward's."""
    from infinity.optim.overlapped_step import OverlappedStep

    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(12, batch=4)
    lrs = [3e-3, 2e-3, 1e-3, 5e-4, 2.5e-4]
    off_losses, off_state, _ = _train(model, batches, tmp_path, param=param, optimizer=optimizer, overlap=False,
                                      accum=1, lrs=lrs, clip=0.0)
    seen = slow_step_tail(monkeypatch)
    update = OverlappedStep._update

    def slow_worker(self, group, **kwargs):
        if threading.current_thread().name == "infinity-optimizer":
            time.sleep(0.02)  # behind backward, as the host's Adam is behind a GPU's
        update(self, group, **kwargs)

    monkeypatch.setattr(OverlappedStep, "_update", slow_worker)
    on_losses, on_state, on_metrics = _train(model, batches, tmp_path, param=param, optimizer=optimizer,
                                             overlap=True, accum=1, lrs=lrs, clip=0.0)
    assert all(m["overlapped_step"] == "committed" for m in on_metrics)
    behind = sum(m["sub_groups_behind_forward"] for m in on_metrics)
    assert behind > 0 and seen["tail_updates"] == behind
    assert seen["waited"] > 0  # the forward reached parameters before their sub-group's update
    assert on_losses == off_losses
    for key in off_state:
        assert torch.equal(on_state[key], off_state[key]), key


def test_a_step_that_finishes_before_returning_is_the_same(tmp_path):
    """``overlap_step_with_forward: false``: nothing runs behind the forward, and the results are the same."""
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(6, batch=4)
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(tmp_path), accum=1, clip=1e-3, lr=3e-3,
                           overlap_step_with_forward=False)
    runs = {}
    for behind in (False, True):
        config["zero_optimization"]["overlap_step_with_forward"] = behind
        engine = infinity.initialize(copy.deepcopy(model), config)
        try:
            losses, tails = [], []
            for x, y in batches:
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                tails.append(engine.optimizer.tail is not None)
            runs[behind] = losses, tails, engine.full_state_dict()
        finally:
            engine.close()
    assert not any(runs[False][1]) and any(runs[True][1])
    assert runs[False][0] == runs[True][0]
    for key, value in runs[False][2].items():
        assert torch.equal(value, runs[True][2][key]), key


def test_a_failed_update_behind_the_forward_is_raised_and_a_checkpoint_goes_on(tmp_path, monkeypatch):
    """An update of the tail that fails (a disk error, say) is raised to the forward that needs its sub-group;
    every later use of the step's results says to load a checkpoint, and once one is loaded training goes on
    exactly as from that checkpoint in an engine that never failed."""
    from infinity.optim.overlapped_step import OverlappedStep

    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(4, batch=4)
    (tmp_path / "swap").mkdir()
    config = engine_config(param="nvme", optimizer="nvme", nvme_path=str(tmp_path / "swap"), accum=1, clip=1e-3,
                           lr=3e-3)
    update = OverlappedStep._update

    def failing_update(self, group, **kwargs):
        if threading.current_thread().name == "infinity-step-tail":
            raise OSError(5, "Input/output error (injected)")
        update(self, group, **kwargs)

    with infinity.initialize(copy.deepcopy(model), config) as engine:
        train_batches(engine, batches[:1])
        engine.save_checkpoint(tmp_path / "ckpt", tag="one")
        expected = train_batches(engine, batches[1:3])
    with infinity.initialize(copy.deepcopy(model), config) as engine:
        train_batches(engine, batches[:1])
        x, y = batches[1]
        engine.backward(engine(x, y))
        with monkeypatch.context() as patch:
            patch.setattr(OverlappedStep, "_update", failing_update)
            engine.step()
            with pytest.raises(OSError, match="injected"):
                engine(x, y)
        with pytest.raises(RuntimeError, match="load a checkpoint"):
            engine(x, y)
        engine.load_checkpoint(tmp_path / "ckpt", tag="one")
        assert train_batches(engine, batches[1:3]) == expected
    assert not any(p.is_file() for p in (tmp_path / "swap").rglob("*.swap"))


def test_finish_step_makes_resident_parameters_current(tmp_path, monkeypatch):
    """Parameters that stay resident (one rank, offload_param none) can be read outside the forward: after
    ``engine.finish_step()`` they are those of the step made before ``step()`` returns, even with a slow tail."""
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(3, batch=4)
    seen = slow_step_tail(monkeypatch)
    values = {}
    for behind in (False, True):
        config = engine_config(param="none", optimizer="cpu", nvme_path=None, accum=1, clip=1e-3, lr=3e-3,
                               overlap_step_with_forward=behind)
        with infinity.initialize(copy.deepcopy(model), config) as engine:
            for x, y in batches:
                engine.backward(engine(x, y))
                engine.step()
            engine.finish_step()
            values[behind] = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    assert seen["tail_updates"] > 0
    for name, value in values[False].items():
        assert torch.equal(values[True][name], value), name


class _ReadsAChildsWeightFirst(torch.nn.Module):
    """The root reads a child's weight before (and without) running that child: no hook of the child's fetches it."""

    def __init__(self, vocab: int = 64, d: int = 32, seq: int = 16):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)       # its forward never runs; the root slices its weight
        self.body = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx, targets):
        x = self.pos.weight[: idx.shape[1]] + self.tok(idx)
        logits = self.head(torch.tanh(self.body(x)))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


@pytest.mark.parametrize("param", ["none", "cpu"])
def test_a_weight_read_outside_its_module_waits_for_the_tail(tmp_path, monkeypatch, param):
    """A parameter the forward reads before its own module runs (or that module never runs) still waits for the
    last step's update of its sub-group: resident ones too, which are never released."""
    torch.manual_seed(0)
    model, batches = _ReadsAChildsWeightFirst(), gpt_batches(5, batch=4)
    runs = {}
    for behind in (False, True):
        if behind:
            seen = slow_step_tail(monkeypatch)
        config = engine_config(param=param, optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=1e-3, lr=3e-3,
                               overlap_step_with_forward=behind)
        with infinity.initialize(copy.deepcopy(model), config) as engine:
            runs[behind] = train_batches(engine, batches), engine.full_state_dict()
    assert seen["tail_updates"] > 0
    assert runs[True][0] == runs[False][0]
    for key, value in runs[False][1].items():
        assert torch.equal(value, runs[True][1][key]), key
