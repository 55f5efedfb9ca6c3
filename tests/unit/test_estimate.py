"""infinity.placement.estimate: hand-checked numbers, offloading moves bytes down the tiers, the CLI."""

import json
from itertools import product

import pytest
import torch

from infinity.cli import main
from infinity.models.gpt import PRESETS, param_numels
from infinity.placement.estimate import OFFLOAD_CHOICES, TIERS, _largest_sub_group, estimate
from infinity.placement.estimate_gpt import estimate_gpt
from infinity.placement.report import format_bytes, parse_count


def test_a_small_case_by_hand():
    # two parameters on 2 ranks: 4096 elements (shard 2048) and 100 (shard 50, persistent);
    # each shard starts at a multiple of 2048 elements, so the rank's flat space is 2048 + 2048.
    kw = dict(param_numels=[4096, 100], world_size=2, offload_param="nvme", offload_optimizer="cpu",
              precision="bf16", max_in_cpu=0, param_persistence_threshold=1000)
    r = estimate(**kw, prefetch_bucket_size=0, max_reuse_distance=0)  # no prefetcher
    assert r["shard_numel"] == 2048 + 50
    t = r["tiers"]
    # the persistent shard rests in host memory, in a buffer of its own (its aligned 2048 elements)
    assert t["nvme"]["compute_shard"] == 2048 * 2
    assert t["host"]["compute_shard"] == 2048 * 2
    assert t["host"]["master"] == 4096 * 4
    assert t["host"]["moments"] == 4096 * 8
    assert t["host"]["gradients"] == 4096 * 2  # one micro-batch a step in bf16: bf16 gradients
    assert t["device"]["gathered_params"] == (100 + 4096) * 2  # the persistent one + the largest
    assert t["host"]["param_io_buffers"] == 2048 * 2  # the largest shard in flight
    assert t["host"]["optimizer_staging"] == 4096 * 2  # new compute shards on their way to NVMe
    assert r["totals"] == {"device": 8392, "host": 16384 + 32768 + 8192 + 4096 + 8192 + 4096, "nvme": 4096}
    # with the prefetcher (the defaults), everything within max_live_parameters stays gathered,
    # and the reads in flight are bounded by the rank's shards
    r = estimate(**kw)
    assert r["tiers"]["device"]["gathered_params"] == (100 + 4096) * 2
    assert r["tiers"]["host"]["param_io_buffers"] == 4096 * 2
    capped = estimate(param_numels=[4096] * 10, offload_param="nvme", max_in_cpu=0, param_persistence_threshold=0,
                      max_live_parameters=5000)
    assert capped["tiers"]["device"]["gathered_params"] == (4096 + 5000) * 2  # the largest layer + the budget
    # on a CPU-only machine swap-ins land in place: no host buffers
    assert estimate(**kw, gpu=False)["tiers"]["host"]["param_io_buffers"] == 0


def test_seven_billion_on_eight_ranks_by_hand():
    r = estimate(7e9, world_size=8, offload_param="nvme", offload_optimizer="nvme", precision="bf16",
                 max_in_cpu=0, sub_group_size=1e8, gradient_accumulation_steps=4)
    shard = 875_000_000
    assert r["shard_numel"] == shard
    t = r["tiers"]
    assert t["nvme"] == {**t["nvme"], "compute_shard": 2 * shard, "master": 4 * shard, "moments": 8 * shard}
    assert r["totals"]["nvme"] == 14 * shard
    assert t["host"]["gradients"] == 4 * shard  # accumulated over micro-batches: fp32
    # offload_optimizer.buffer_count (default 4) sets of master, moments and compute shard
    assert t["host"]["optimizer_staging"] == 4 * 10**8 * (12 + 2)
    two = estimate(7e9, world_size=8, offload_param="nvme", offload_optimizer="nvme", max_in_cpu=0,
                   sub_group_size=1e8, optimizer_buffer_count=2)
    assert two["tiers"]["host"]["optimizer_staging"] == 2 * 10**8 * (12 + 2)
    assert t["device"]["master"] == t["device"]["moments"] == 0
    # on a GPU, micro-batches accumulate in an fp32 device buffer that crosses to the host once a step
    assert t["device"]["gradients"] == 4 * shard
    assert estimate(7e9, world_size=8, offload_param="nvme", offload_optimizer="nvme", max_in_cpu=0,
                    gradient_accumulation_steps=4, gpu=False)["tiers"]["device"]["gradients"] == 0


def test_fp32_without_offload_on_one_rank_is_twenty_bytes_a_parameter():
    # compute copy 4 + master 4 + moments 8 + gradient 4; on one rank the full tensors are the shards
    r = estimate(param_numels=[2048] * 3, precision="fp32")
    assert r["totals"] == {"device": 20 * 3 * 2048, "host": 0, "nvme": 0}


@pytest.mark.parametrize("world_size", [1, 4])
def test_offloading_moves_bytes_from_the_device_down(world_size):
    numels = param_numels(PRESETS["10m"])
    # no parameter kept gathered for reuse: on a GPU the prefetcher would keep host-resident ones too
    est = {(p, o): estimate(param_numels=numels, world_size=world_size, offload_param=p, offload_optimizer=o,
                            max_in_cpu=0, max_reuse_distance=0, prefetch_bucket_size=0)
           for p, o in product(OFFLOAD_CHOICES, OFFLOAD_CHOICES)}
    for p in OFFLOAD_CHOICES:  # the optimizer: none -> cpu -> nvme
        none, cpu, nvme = (est[p, o]["totals"] for o in OFFLOAD_CHOICES)
        assert cpu["device"] < none["device"] and cpu["host"] > none["host"]
        assert nvme["device"] == cpu["device"] and nvme["nvme"] > cpu["nvme"]
    for o in OFFLOAD_CHOICES:  # the parameters: none -> cpu -> nvme
        none, cpu, nvme = (est[p, o]["totals"] for p in OFFLOAD_CHOICES)
        # an optimizer on the device sends new compute shards down through one sub-group of device scratch
        scratch = est["cpu", o]["tiers"]["device"]["optimizer_staging"]
        assert scratch == (est["cpu", o]["largest_sub_group_numel"] * 2 if o == "none" else 0)
        assert cpu["device"] - scratch <= none["device"]
        assert nvme["nvme"] > cpu["nvme"]
    # the resting states are the same bytes wherever they rest
    kinds = ("compute_shard", "master", "moments")
    for r in est.values():
        assert sum(r["tiers"][t][k] for t in TIERS for k in kinds) == sum(
            est["none", "none"]["tiers"][t][k] for t in TIERS for k in kinds)


def test_more_ranks_fewer_bytes_per_rank():
    one, eight = (estimate(1.3e9, world_size=w, offload_param="cpu", offload_optimizer="cpu")["totals"]["host"]
                  for w in (1, 8))
    assert eight == pytest.approx(one / 8, rel=0.01)


def test_sub_groups_are_cut_as_the_engine_cuts_them():
    from infinity.placement.layout import ShardLayout

    torch.manual_seed(0)
    for world_size, sub_group_size in [(1, 5000), (3, 7000), (2, 10**9)]:
        numels = torch.randint(1, 6000, (12,)).tolist()
        params = [(f"p{i}", torch.nn.Parameter(torch.empty(n, device="meta"))) for i, n in enumerate(numels)]
        layout = ShardLayout(params, world_size=world_size, sub_group_size=sub_group_size)
        shards = [-(-n // world_size) for n in numels]
        assert _largest_sub_group(shards, sub_group_size) == layout.largest_sub_group_numel


def test_sub_groups_follow_the_engines_decay_groups():
    """With a weight decay per parameter (infinity train's groups) the layout lays each decay's parameters together
    and cuts where the decay changes: the estimate's sub-groups are the layout's, in its order."""
    from infinity.placement.layout import ShardLayout

    torch.manual_seed(0)
    for world_size, sub_group_size in [(1, 5000), (3, 7000), (2, 10**9)]:
        numels = torch.randint(1, 6000, (12,)).tolist()
        decays = [0.1 if i % 3 else 0.0 for i in range(12)]
        params = [(f"p{i}", torch.nn.Parameter(torch.empty(n, device="meta"))) for i, n in enumerate(numels)]
        layout = ShardLayout(params, world_size=world_size, sub_group_size=sub_group_size,
                             weight_decay={f"p{i}": d for i, d in enumerate(decays)})
        est = estimate(param_numels=numels, param_decays=decays, world_size=world_size,
                       sub_group_size=sub_group_size)
        assert est["sub_group_numels"] == [g.numel for g in layout.sub_groups]
        assert len({g.weight_decay for g in layout.sub_groups}) == 2


def test_gpt_estimate_adds_activations_outside_the_engines_accounting():
    r = estimate_gpt(PRESETS["small"], micro_batch=4, offload_param="nvme", offload_optimizer="nvme")
    assert r["tiers"]["device"]["activations"] > 0
    assert r["accounted"]["device"] == r["totals"]["device"] - r["tiers"]["device"]["activations"]
    assert r["setting"]["num_params"] == sum(param_numels(PRESETS["small"]))


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="offload_param must be one of none, cpu, nvme; got 'disk'"):
        estimate(10, offload_param="disk")
    with pytest.raises(ValueError, match="world_size"):
        estimate(10, world_size=0)
    with pytest.raises(ValueError, match="num_params or param_numels"):
        estimate()


def test_parse_count_and_format_bytes():
    assert parse_count("7B") == 7_000_000_000
    assert parse_count("350M") == 350_000_000
    assert parse_count("1.3e9") == 1_300_000_000
    assert parse_count("125k") == 125_000
    assert parse_count("2.7b") == 2_700_000_000
    with pytest.raises(ValueError, match="7 billion"):
        parse_count("7 billion")
    assert format_bytes(0) == "0"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3 GiB"


def test_cli_prints_the_requested_setting_and_the_alternatives(capsys):
    assert main(["estimate", "--params", "7B", "--world-size", "8", "--offload-param", "nvme",
                 "--offload-optimizer", "nvme"]) == 0
    out = capsys.readouterr().out
    assert "7,000,000,000 parameters, world size 8" in out
    assert "* nvme / nvme" in out
    assert sum(line.strip().startswith(("none /", "cpu /", "nvme /", "* ")) for line in out.splitlines()) == 9
    for kind in ("compute shard", "master", "moments", "optimizer staging"):
        assert kind in out


def test_cli_json_for_a_preset(capsys):
    assert main(["estimate", "--preset", "125m", "--world-size", "2", "--offload-optimizer", "cpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["estimate"]["setting"]["offload_optimizer"] == "cpu"
    assert doc["estimate"]["tiers"]["host"]["master"] > 0
    assert len(doc["alternatives"]) == 9


def test_cli_errors(capsys):
    assert main(["estimate", "--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "lots"])
    assert "cannot read a parameter count from 'lots'" in capsys.readouterr().err


def test_parameters_reused_within_max_reuse_distance_stay_gathered():
    # 100 layers of 1000: a parameter's reuse distance is twice the elements after it in the forward, so
    # with max_reuse_distance 20000 the last 10000 elements stay gathered, plus the layer being used
    kw = dict(param_numels=[1000] * 100, offload_param="nvme", max_in_cpu=0, param_persistence_threshold=0,
              prefetch_bucket_size=0, precision="bf16")
    assert estimate(**kw, max_reuse_distance=20_000)["tiers"]["device"]["gathered_params"] == (1000 + 10_000) * 2
    assert estimate(**kw, max_reuse_distance=0)["tiers"]["device"]["gathered_params"] == 1000 * 2
    # parameters that rest in host memory: with one memory they are gathered on demand only (no prefetcher);
    # with a GPU they cross up at every fetch, so the prefetcher keeps them as it keeps NVMe ones
    assert estimate(**{**kw, "offload_param": "cpu"}, max_reuse_distance=20_000, gpu=False)["tiers"]["device"][
        "gathered_params"] == 1000 * 2
    assert estimate(**{**kw, "offload_param": "cpu"}, max_reuse_distance=20_000, gpu=True)["tiers"]["device"][
        "gathered_params"] == (1000 + 10_000) * 2


# --------------------------------------------------------------------------- the largest GPT that fits


def _engine_at(cfg, budget, nvme_path, optimizer="nvme"):
    """``infinity.initialize`` of ``GPT(cfg)`` with params on NVMe and the optimizer in ``optimizer``'s tier under
    ``budget``, bf16 on the CPU."""
    import infinity
    from helpers import engine_config
    from infinity.models.gpt import GPT

    config = engine_config(param="nvme", optimizer=optimizer, nvme_path=str(nvme_path), accum=1, clip=1.0, lr=1e-4,
                           precision="bf16", sub_group_size=10**8, host_memory_budget=budget)
    torch.manual_seed(0)
    return infinity.initialize(GPT(cfg), config)


def _train_one_step(engine, budget):
    try:
        ids = torch.randint(0, 256, (2, 17))
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss)
        assert engine.tiers.host_memory.peak_nbytes <= budget
    finally:
        engine.close()


def test_max_gpt_is_the_deepest_the_engine_takes_under_the_budget(tmp_path):
    """The engine itself is the reference: it trains the model max_gpt names and refuses one block more (states in
    host memory, so each block's bytes count against the budget)."""
    from dataclasses import replace

    from infinity.models.gpt import GPTConfig, count_params
    from infinity.placement.max_model import host_floor_nbytes, max_gpt

    template = PRESETS["10m"]
    setting = dict(offload_param="nvme", offload_optimizer="cpu", precision="bf16", gpu=False,
                   param_persistence_threshold=0, sub_group_size=10**8)
    floor = estimate_gpt(replace(template, n_layer=7), micro_batch=2, seq_len=16, max_in_cpu=0,
                         optimizer_max_in_cpu=0, host_memory_budget=64 << 20, **setting)
    budget = host_floor_nbytes(floor) + (1 << 20)  # seven blocks and a little: not eight
    found = max_gpt(host_memory_nbytes=budget, nvme_nbytes=1 << 40, templates=("10m",), micro_batch=2, seq_len=16,
                    **setting)
    cfg = GPTConfig(**found["config"])
    assert (cfg.n_layer, found["template"], found["bound"]) == (7, "10m", "host memory")
    assert found["num_params"] == count_params(cfg)
    bpp = found["bytes_per_param"]
    assert bpp["host"]["gradients"] == pytest.approx(2, rel=0.02)  # bf16 slices (flat space aligned), accumulation 1
    assert bpp["host"]["master"] + bpp["host"]["moments"] == pytest.approx(12, rel=0.01)

    _train_one_step(_engine_at(cfg, budget, tmp_path, optimizer="cpu"), budget)
    with pytest.raises(ValueError, match="needs at least"):
        _engine_at(replace(cfg, n_layer=8), budget, tmp_path, optimizer="cpu")


def test_with_states_on_nvme_the_gradient_slices_the_budget_cannot_hold_go_there_too(tmp_path):
    """Parameters and optimizer on NVMe under a budget that holds the gradient slices of 7 blocks only: the engine
    puts the slices of the last sub-groups on NVMe instead of refusing, and max_gpt counts it so (deeper than 7)."""
    from dataclasses import replace

    from infinity.models.gpt import GPTConfig
    from infinity.placement.max_model import host_floor_nbytes, max_gpt

    setting = dict(offload_param="nvme", offload_optimizer="nvme", precision="bf16", gpu=False,
                   param_persistence_threshold=0, sub_group_size=10**8)
    seven = estimate_gpt(replace(PRESETS["10m"], n_layer=7), micro_batch=2, seq_len=16, max_in_cpu=0,
                         optimizer_max_in_cpu=0, host_memory_budget=64 << 20, **setting)
    assert seven["tiers"]["nvme"]["gradients"] == 0  # 64 MiB holds them
    budget = host_floor_nbytes(seven) + (1 << 20)
    found = max_gpt(host_memory_nbytes=budget, nvme_nbytes=1 << 40, templates=("10m",), micro_batch=2, seq_len=16,
                    **setting)
    cfg = GPTConfig(**found["config"])
    assert cfg.n_layer > 7 and found["host_floor_nbytes"] <= budget
    assert found["bytes_per_param"]["nvme"]["gradients"] > 0.5  # the last sub-groups' bf16 slices
    engine = _engine_at(cfg, budget, tmp_path)
    assert engine.placement.nvme_grads_from is not None
    _train_one_step(engine, budget)


def test_max_gpt_is_bounded_by_the_disk_and_says_so():
    from dataclasses import replace

    from infinity.models.gpt import GPTConfig, count_params
    from infinity.placement.max_model import max_gpt

    setting = dict(offload_param="nvme", offload_optimizer="nvme", precision="bf16", gpu=False, seq_len=16)
    disk = 10 * 10**9
    found = max_gpt(host_memory_nbytes=16 << 30, nvme_nbytes=disk, **setting)
    assert found["bound"] == "disk" and found["nvme_nbytes"] <= disk
    deeper = replace(GPTConfig(**found["config"]), n_layer=found["config"]["n_layer"] + 1)
    planned = estimate_gpt(deeper, host_memory_budget=16 << 30, **setting)
    assert planned["totals"]["nvme"] - planned["tiers"]["nvme"]["step_undo"] > disk
    compact = max_gpt(host_memory_nbytes=16 << 30, nvme_nbytes=disk, state_dtype="int8", **setting)
    assert compact["num_params"] > 1.5 * found["num_params"]  # ~6 B a parameter on disk instead of 14
    nothing = max_gpt(host_memory_nbytes=1 << 20, nvme_nbytes=1 << 40, **setting)
    assert nothing["config"] is None and nothing["num_params"] == 0
    assert count_params(PRESETS["20b"]) >= 20e9


def test_cli_max_params(capsys, tmp_path):
    from infinity.cli import main

    rc = main(["estimate", "--max-params", "--offload-param", "nvme", "--offload-optimizer", "nvme", "--cpu",
               "--host-memory", "2GiB", "--nvme-path", str(tmp_path), "--seq-len", "16", "--json"])
    found = json.loads(capsys.readouterr().out)
    assert rc == 0 and found["host_memory_nbytes"] == 2 << 30 and found["host_floor_nbytes"] <= 2 << 30
    # what the budget cannot hold of the bf16 gradient slices (2 B a parameter) rests on NVMe between steps
    assert found["bytes_per_param"]["nvme"]["gradients"] > 1.5 > 0.5 > found["bytes_per_param"]["host"]["gradients"]
    rc = main(["estimate", "--max-params", "--cpu", "--host-memory", "2GiB", "--nvme-path", str(tmp_path / "no")])
    assert rc == 2 or "not a folder" in capsys.readouterr().err


def test_max_gpt_cuts_sub_groups_where_infinity_train_s_decay_groups_cut_them(tmp_path):
    """With ``decays`` (infinity train's groups: decay on 2-D tensors and up), the estimate of the model max_gpt names
    has the engine's own sub-groups for those param groups; without, one decay for all, it has fewer."""
    import infinity
    from helpers import engine_config
    from infinity.commands.train_estimate import model_decays
    from infinity.models.gpt import GPT, GPTConfig
    from infinity.optim.param_groups import decay_matrices_only
    from infinity.placement.max_model import max_gpt

    setting = dict(offload_param="cpu", offload_optimizer="cpu", precision="fp32", gpu=False,
                   param_persistence_threshold=0, sub_group_size=10**6)
    found = max_gpt(host_memory_nbytes=16 << 30, nvme_nbytes=1 << 40, templates=("10m",), micro_batch=2, seq_len=16,
                    decays=lambda cfg: model_decays(cfg, 0.1), **setting)
    alike = max_gpt(host_memory_nbytes=16 << 30, nvme_nbytes=1 << 40, templates=("10m",), micro_batch=2, seq_len=16,
                    **setting)
    cfg = GPTConfig(**found["config"])
    assert alike["config"] == found["config"]
    model = GPT(cfg)
    engine = infinity.initialize(model, engine_config(param="cpu", optimizer="cpu", nvme_path=str(tmp_path), accum=1,
                                                      clip=1.0, lr=1e-4, sub_group_size=10**6),
                                 param_groups=decay_matrices_only(model, 0.1))
    try:
        engine_numels = [g.numel for g in engine.layout.sub_groups]
    finally:
        engine.close()
    assert found["estimate"]["sub_group_numels"] == engine_numels
    assert alike["estimate"]["sub_group_numels"] != engine_numels
