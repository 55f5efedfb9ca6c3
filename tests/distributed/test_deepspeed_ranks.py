"""A DeepSpeed script at two ranks (``import infinity.deepspeed as deepspeed``): the loader gives each rank a disjoint
half of the data, and the run equals plain PyTorch over both ranks' micro-batches together."""

from __future__ import annotations

import copy

import torch

from helpers import run_ranks
from unit.test_deepspeed_door import ADAMW, Regressor, config, data, reference, run


def _rank_run(rank: int, world_size: int):
    import infinity.deepspeed as deepspeed

    torch.manual_seed(0)
    model = Regressor()
    engine, _, loader, _ = deepspeed.initialize(model=model, training_data=data(), config=config(**ADAMW))
    with engine:
        assert (engine.global_rank, engine.gradient_accumulation_steps()) == (rank, 2)  # 16 = 4 x 2 x 2 ranks
        losses, batches = run(engine, loader)
        return losses, batches, engine.full_state_dict(), engine.global_steps


def test_two_ranks_share_the_data_and_train_as_one_process_over_both_halves():
    (losses0, batches0, state, steps), (losses1, batches1, state1, _) = run_ranks(_rank_run, world_size=2)
    assert steps == 4 and all(torch.equal(state[n], state1[n]) for n in state)
    rows = [tuple(r) for b in batches0 + batches1 for r in b[0].tolist()]
    assert sorted(rows) == sorted(map(tuple, data().tensors[0].tolist()))  # disjoint halves, all of it

    torch.manual_seed(0)
    ref = copy.deepcopy(Regressor())
    together = [tuple(torch.cat(parts) for parts in zip(a, b)) for a, b in zip(batches0, batches1)]
    expected = reference(ref, torch.optim.AdamW(ref.parameters(), lr=ADAMW["optimizer"]["params"]["lr"],
                                                weight_decay=0.01), together, 2)
    # each rank's loss is its half's mean; both halves are the same size
    torch.testing.assert_close(torch.tensor(losses0) / 2 + torch.tensor(losses1) / 2, torch.tensor(expected),
                               rtol=1e-5, atol=1e-7)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _rank_gathers(rank: int, world_size: int):
    import infinity.deepspeed as deepspeed

    torch.manual_seed(0)
    model = Regressor()
    engine, _, loader, _ = deepspeed.initialize(model=model, training_data=data(), config=config(**ADAMW))
    with engine:
        first, batches = run(engine, loader)
        with deepspeed.zero.GatheredParameters(model.parameters()):
            whole = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
        with deepspeed.zero.GatheredParameters([model.hidden.weight, model.out.bias], modifier_rank=1):
            model.hidden.weight.data[rank] = float(rank + 1)  # rank 1's change is the one kept
            model.out.bias.data.fill_(-rank)
        second, more = run(engine, loader)
        return first + second, batches + more, whole, engine.full_state_dict()


def test_two_ranks_gather_whole_parameters_and_keep_the_modifier_ranks_change():
    (losses0, batches0, whole0, state), (losses1, batches1, whole1, _) = run_ranks(_rank_gathers, world_size=2)
    torch.manual_seed(0)
    ref = copy.deepcopy(Regressor())
    optimizer = torch.optim.AdamW(ref.parameters(), lr=ADAMW["optimizer"]["params"]["lr"], weight_decay=0.01)
    together = [tuple(torch.cat(parts) for parts in zip(a, b)) for a, b in zip(batches0, batches1)]
    epoch = len(together) // 2  # each rank ran its loader twice
    expected = reference(ref, optimizer, together[:epoch], 2)
    for name, value in ref.named_parameters():  # both ranks see the same whole values
        assert torch.equal(whole0[name], whole1[name]), name
        torch.testing.assert_close(whole0[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        ref.hidden.weight[1] = 2.0
        ref.out.bias.fill_(-1.0)
    expected += reference(ref, optimizer, together[epoch:], 2)
    torch.testing.assert_close(torch.tensor(losses0) / 2 + torch.tensor(losses1) / 2, torch.tensor(expected),
                               rtol=1e-5, atol=1e-7)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
