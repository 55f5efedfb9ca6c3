"""With several ranks, a parameter kept gathered skips its next all-gather, so every rank must keep the same ones:
ranks whose memory budgets have different room (each reads its budget from its own free memory), or whose reads
ahead differ (a read buffer not free yet), still join every all-gather together and train as ranks that are
alike. Before the ranks agreed, a rank with less room released what the other kept, and both waited for ever."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from helpers import TinyGPT, engine_config, gpt_batches, run_ranks, train_batches

pytestmark = pytest.mark.timeout(240)  # a rank that keeps alone waits in an all-gather for ever: fail instead

STEPS, ACCUM = 3, 2


def _run(rank: int, world_size: int, model, batches) -> tuple[list[float], dict, int]:
    """Losses, full state dict and this rank's all-gathered bytes, with the parameters on NVMe (so fetches are read
    ahead) and every parameter's next use, within the step, near enough to keep it gathered."""
    import copy

    import infinity

    with tempfile.TemporaryDirectory() as nvme:
        config = engine_config(param="nvme", optimizer="cpu", nvme_path=nvme, accum=ACCUM, clip=1.0, lr=3e-3,
                               stage3_max_reuse_distance=10**9, stage3_max_live_parameters=10**9)
        engine = infinity.initialize(copy.deepcopy(model), config)
        try:
            losses = train_batches(engine, batches[:STEPS * ACCUM], rank=rank, world_size=world_size)
            return losses, engine.full_state_dict(), engine.comm.nbytes["all_gather"]
        finally:
            engine.close()


def _alike_then_unlike(rank: int, world_size: int, unlike: str):
    from infinity.storage.stats import TierStats

    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(STEPS * ACCUM, batch=4)
    alike = _run(rank, world_size, model, batches)
    if rank == 1 and unlike == "room":
        room = TierStats.room_nbytes
        TierStats.room_nbytes = lambda self: 0 if self.name == "device" else room(self)
    if rank == 1 and unlike == "reads ahead":
        # reads ahead in flight that rank 0 has not issued (a read buffer was free here sooner): more bytes live
        live = TierStats.live_nbytes.fget
        TierStats.live_nbytes = property(lambda self: live(self) + (10**12 if self.name == "device" else 0))
    return alike, _run(rank, world_size, model, batches)


@pytest.mark.parametrize("unlike", ["room", "reads ahead"])
def test_ranks_keep_the_same_parameters_gathered(unlike):
    if unlike == "room" and os.environ.get("INFINITY_DISTINCT_DEVICE") == "1":
        pytest.skip("device memory apart from host memory has no budget (a GPU's), so no room to differ")
    (alike0, unlike0), (alike1, unlike1) = run_ranks(_alike_then_unlike, unlike)
    for alike, unlike_run in ((alike0, unlike0), (alike1, unlike1)):
        assert unlike_run[0] == alike[0]
        for key, value in alike[1].items():
            assert torch.equal(unlike_run[1][key], value), key
    assert unlike0[2] == unlike1[2]  # the same all-gathers on both ranks
    if unlike == "room":
        # rank 1's budget has no room, so neither rank keeps a parameter across micro-batches: more is gathered
        assert unlike0[2] > alike0[2]
