"""Calls of the model itself, not through the engine (``model.generate``, an evaluation's ``model(**batch)``, peft's
``generate``, one layer): each runs as a forward of the engine. Plain transformers and plain peft are the reference."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import infinity  # noqa: E402
from infinity.runtime.comm import Collectives  # noqa: E402
from helpers import engine_config, run_ranks  # noqa: E402
from test_hf_trainer import VOCAB, collate, dataset, tiny_llama  # noqa: E402

LR = 3e-3


def prompts(lengths=(5, 9, 4), seed=4):
    """Left-padded prompts of different lengths (the padding masked), as generate takes a batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, ids.shape[1] - length:] = torch.randint(3, VOCAB, (length,), generator=g)
        mask[row, ids.shape[1] - length:] = 1
    return {"input_ids": ids, "attention_mask": mask}


def greedy(model, batch, **options):
    """Greedy continuations and the scores behind each chosen token."""
    out = model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True, **options)
    return out.sequences, torch.stack(out.scores)


def assert_same_generation(ours, theirs):
    assert torch.equal(ours[0], theirs[0]), f"{ours[0]} != {theirs[0]}"
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)


def config(tmp_path, tier):
    return engine_config(param=tier, optimizer=tier, nvme_path=str(tmp_path), accum=1, clip=0.0, lr=LR,
                         weight_decay=0.0)


def plain_adamw(model):
    """``torch.optim.AdamW`` with the engine config's hyperparameters."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.99), eps=1e-8,
                             weight_decay=0.0)


def train_both(engine, reference, optimizer, steps, first=0):
    """``steps`` optimizer steps of the engine and of the reference's plain AdamW over the same batches (two rows
    each, from row ``2 * first``)."""
    for step_batch in [collate(dataset(40)[i:i + 2]) for i in range(2 * first, 2 * (first + steps), 2)]:
        out = engine(**step_batch)
        engine.backward(out.loss)
        engine.step()
        reference(**step_batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def all_released(model) -> bool:
    return all(p.numel() == 0 for p in model.parameters())


def nothing_held(engine, model) -> bool:
    """After a training step nothing stays gathered: not what a forward without grad kept for the next (within the
    live-parameter budget), nor what an interrupted call left."""
    out = engine(**collate(dataset(2, seed=7)))
    engine.backward(out.loss)
    engine.step()
    return all_released(model)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_generate_and_evaluation_by_the_model_itself_match_the_plain_model_through_training(tmp_path, tier):
    """Between training steps the script evaluates with ``model(**batch)`` and generates with ``model.generate``
    (and ``engine.generate``): each gives the plain model's result, and the training goes on as the plain one."""
    model = tiny_llama()
    reference = copy.deepcopy(model)
    batch, held_out = prompts(), collate(dataset(4, seed=2))
    with infinity.initialize(model, config(tmp_path, tier)) as engine:
        assert all_released(model)  # parameters rest in their tier between passes
        assert_same_generation(greedy(model, batch), greedy(reference, batch))
        assert_same_generation(greedy(engine, batch), greedy(reference, batch))
        optimizer = plain_adamw(reference)
        for step_batch in [collate(dataset(40)[i:i + 2]) for i in range(0, 8, 2)]:
            out = engine(**step_batch)
            engine.backward(out.loss)
            engine.step()
            expected = reference(**step_batch).loss
            expected.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
            with torch.no_grad():
                evaluated, reference_evaluated = model(**held_out), reference(**held_out)
            torch.testing.assert_close(evaluated.logits, reference_evaluated.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(evaluated.loss, reference_evaluated.loss, rtol=1e-5, atol=1e-6)
        assert_same_generation(greedy(model, batch), greedy(reference, batch))
        state = engine.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}")


def nvme_reads(engine) -> int:
    return engine.tiers.snapshot()["nvme"]["bytes_read"]


@pytest.mark.parametrize("tier", ["nvme", "cpu"])
def test_generates_forwards_keep_the_model_gathered_from_one_to_the_next(tmp_path, monkeypatch, tier):
    """One forward without grad gathers the model once (on NVMe: reads it once); generate's eight forwards after it
    gather it once more in all, not eight times (each keeps what the next uses, within the live-parameter budget),
    and give the plain model's tokens. With a budget of a fifth of the model most of it is gathered at every forward.
    ``cpu`` on a machine without a GPU starts nothing ahead, yet each gather is a copy, which keeping saves."""
    gathers = []
    all_gather_into = Collectives.all_gather_into
    monkeypatch.setattr(Collectives, "all_gather_into",
                        lambda self, full, shard: gathers.append(full.numel()) or all_gather_into(self, full, shard))
    model = tiny_llama()
    reference = copy.deepcopy(model)
    batch = prompts()
    numel = sum(p.numel() for p in model.parameters())
    again = {}
    for budget in (None, numel // 5):
        options = {} if budget is None else {"stage3_max_live_parameters": budget}
        swap = tmp_path / f"swap-{budget}"
        with infinity.initialize(copy.deepcopy(model),
                                 engine_config(param=tier, optimizer="cpu", nvme_path=str(swap), accum=1,
                                               clip=0.0, lr=LR, **options)) as engine:
            gathers.clear()
            start = nvme_reads(engine)
            with torch.no_grad():
                engine(**batch)  # its order becomes the plan of forwards without grad
            one, one_read = sum(gathers), nvme_reads(engine) - start
            assert one >= numel
            assert_same_generation(greedy(engine, batch), greedy(reference, batch))
            again[budget] = (sum(gathers) - one) / one
            if tier == "nvme":
                assert (nvme_reads(engine) - start - one_read) / one_read == pytest.approx(again[budget], abs=0.05)
    assert again[None] <= 1.0, again
    assert again[numel // 5] >= 4.0, again


def test_what_forwards_kept_gathered_is_never_older_than_the_shards(tmp_path):
    """After forwards without grad (which keep the model gathered), a weight written through gathered_parameters and a
    checkpoint loaded are what the next forward computes with, as the plain model does."""
    model = tiny_llama()
    reference = copy.deepcopy(model)
    held_out = collate(dataset(4, seed=2))
    with infinity.initialize(model, config(tmp_path / "swap", "nvme")) as engine:
        train_both(engine, reference, plain_adamw(reference), steps=1)
        engine.save_checkpoint(tmp_path / "ckpt", tag="one")
        saved = copy.deepcopy(reference)
        with torch.no_grad():
            for _ in range(2):
                engine(**held_out)  # the second keeps the model gathered for a next
            weight = model.model.layers[0].mlp.up_proj.weight
            with engine.gathered_parameters([weight], modifier_rank=0):
                weight.data.mul_(-1)
            reference.model.layers[0].mlp.up_proj.weight.mul_(-1)
            torch.testing.assert_close(engine(**held_out).logits, reference(**held_out).logits, rtol=1e-5, atol=1e-5)
            engine(**held_out)
            engine.load_checkpoint(tmp_path / "ckpt", tag="one")
            torch.testing.assert_close(engine(**held_out).logits, saved(**held_out).logits, rtol=1e-5, atol=1e-5)


def test_a_peft_models_generate_runs_through_the_engine_as_plain_peft(tmp_path):
    """peft's generate calls the base model inside its wrappers, not the root: the base's call is the engine's
    forward too, with the adapters trained."""
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(tiny_llama(), lora)
    reference = copy.deepcopy(model)
    batch = prompts()
    with infinity.initialize(model, config(tmp_path, "nvme")) as engine:
        train_both(engine, reference, plain_adamw(reference), steps=3)
        trained = greedy(reference, batch)
        with reference.disable_adapter():
            assert not torch.equal(trained[0], greedy(reference, batch)[0])  # the adapters matter
        assert_same_generation(greedy(model, batch), trained)
        assert_same_generation(greedy(engine, batch), trained)
        assert nothing_held(engine, model)


def test_the_models_own_call_with_gradients_is_a_training_forward(tmp_path):
    """``loss = model(**batch).loss`` then ``engine.backward(loss)``: a script that calls the model it gave the
    engine trains as with ``engine(**batch)``."""
    model = tiny_llama()
    reference = copy.deepcopy(model)
    optimizer = plain_adamw(reference)
    with infinity.initialize(model, config(tmp_path, "nvme")) as engine:
        for step_batch in [collate(dataset(40)[i:i + 2]) for i in range(0, 8, 2)]:
            loss = model(**step_batch).loss
            engine.backward(loss)
            engine.step()
            expected = reference(**step_batch).loss
            expected.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        state = engine.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_a_layer_called_alone_is_whole_for_its_call_and_released_after(tmp_path):
    model = tiny_llama()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    with infinity.initialize(model, config(tmp_path, "nvme")):
        with torch.no_grad():
            out = model.model.layers[1].mlp(x)
        torch.testing.assert_close(out, reference.model.layers[1].mlp(x), rtol=1e-6, atol=1e-6)
        assert all_released(model)


class InterruptOnce:
    """A forward hook that raises KeyboardInterrupt the first time its layer runs (a user's Ctrl-C mid-generate:
    torch skips the model's closing hooks on it)."""

    def __init__(self):
        self.fired = False

    def __call__(self, module, args, output):
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt


def test_an_interrupted_or_failed_call_leaves_the_engine_usable(tmp_path):
    model = tiny_llama()
    reference = copy.deepcopy(model)
    optimizer = plain_adamw(reference)
    batch, step_batch = prompts(), collate(dataset(2))
    with infinity.initialize(model, config(tmp_path, "nvme")) as engine:
        handle = model.model.layers[1].register_forward_hook(InterruptOnce())
        with pytest.raises(KeyboardInterrupt):
            greedy(model, batch)
        handle.remove()
        with pytest.raises(IndexError):
            model(input_ids=torch.tensor([[VOCAB + 5]]))  # no such token
        assert not engine.forward_running
        assert_same_generation(greedy(model, batch), greedy(reference, batch))
        out = engine(**step_batch)
        engine.backward(out.loss)
        engine.step()
        reference(**step_batch).loss.backward()
        optimizer.step()
        assert_same_generation(greedy(model, batch), greedy(reference, batch))
        assert nothing_held(engine, model)


def _generate_on_rank(rank, world_size, swap, max_new_tokens):
    """Each rank its own prompts and its own length: a rank that is done keeps gathering with the others."""
    model = tiny_llama()
    reference = copy.deepcopy(model)
    batch = prompts((4 + rank, 6), seed=10 + rank)
    options = {"max_new_tokens": max_new_tokens[rank], "do_sample": False, "pad_token_id": 0}
    with infinity.initialize(model, config(f"{swap}/rank{rank}", "nvme")) as engine:
        ours = engine.generate(**batch, **options)  # synced_gpus: with two ranks, as transformers asks under ZeRO-3
        own = model.generate(**batch, **options)  # a script's own call, without synced_gpus
    return ours, own, reference.generate(**batch, **options)


def test_generate_at_two_ranks_with_different_lengths_matches_each_ranks_plain_model(tmp_path):
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
    results = run_ranks(_generate_on_rank, str(tmp_path), (3, 9))
    for rank, (ours, own, theirs) in enumerate(results):
        assert ours.shape[1] == theirs.shape[1] == prompts((4 + rank, 6))["input_ids"].shape[1] + (3, 9)[rank]
        assert torch.equal(ours, theirs), f"rank {rank}"
        assert torch.equal(own, theirs), f"rank {rank}: model.generate"
