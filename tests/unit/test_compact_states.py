"""Compact optimizer states in the engine (issue 13): ``offload_optimizer.state_dtype`` bf16 and int8 follow
the kernel's reference step exactly, give the same bits on NVMe as in host memory, move the compact bytes,
convert through checkpoints into any other state dtype, and bad values are refused by name."""

from __future__ import annotations

import copy
import types

import pytest
import torch

import infinity
from helpers import TinyGPT, engine_config, gpt_batches, optimizer_states, train_batches
from infinity import kernels
from infinity.checkpoint.files import shard_file
from infinity.config.schema import InfinityConfig
from infinity.checkpoint.consolidation import consolidate
from infinity.placement.estimate import estimate
from infinity.checkpoint.safetensors_io import SafetensorsReader

LR = 3e-3
STEPS = 4


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT(), gpt_batches(STEPS + 2, batch=2)


def _config(tmp_path, state_dtype: str, *, optimizer: str = "cpu", **zero_extra) -> dict:
    config = engine_config(param="cpu", optimizer=optimizer, nvme_path=str(tmp_path), accum=1, clip=0.0, lr=LR,
                           **zero_extra)
    config["zero_optimization"]["offload_optimizer"]["state_dtype"] = state_dtype
    return config


def _train(engine, batches) -> list[float]:
    return train_batches(engine, batches)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_the_engine_steps_as_the_reference_kernel(gpt, tmp_path, state_dtype):
    """One sub-group: the engine's trajectory is plain PyTorch's forward and backward with the torch reference
    of the compact step on the flat master, bit for bit."""
    model, batches = gpt
    config = _config(tmp_path, state_dtype, sub_group_size=10**6)
    engine = infinity.initialize(copy.deepcopy(model), config)
    try:
        (group,) = engine.layout.sub_groups
        slots = [(s, s.offset - group.start) for s in group.slots]
        got = _train(engine, batches[:STEPS])
        got_states = optimizer_states(engine)
    finally:
        engine.close()

    reference = copy.deepcopy(model)
    params = dict(reference.named_parameters())
    flat = torch.zeros(group.numel)
    for slot, at in slots:
        flat[at:at + slot.shard_numel][:slot.numel] = params[slot.name].detach().reshape(-1)
    state = kernels.compact.from_fp32(state_dtype, flat, torch.zeros_like(flat), torch.zeros_like(flat))
    for key in ("exp_avg", "exp_avg_sq"):
        state[key].zero_()
    for key in ("exp_avg_scale", "exp_avg_sq_scale"):
        if key in state:
            state[key].zero_()
    cfg = config["optimizer"]["params"]
    expected = []
    for step, batch in enumerate(batches[:STEPS], start=1):
        reference.zero_grad(set_to_none=True)
        loss = reference(*batch)
        loss.backward()
        expected.append(loss.item())
        grad = torch.zeros(group.numel)
        for slot, at in slots:
            grad[at:at + slot.numel] = params[slot.name].grad.reshape(-1)
        kernels.adam_step_compact_reference(
            state["master"], grad, state["exp_avg"], state["exp_avg_sq"], state_dtype=state_dtype, step=step, lr=LR,
            beta1=cfg["betas"][0], beta2=cfg["betas"][1], eps=cfg["eps"], weight_decay=cfg["weight_decay"],
            seed=0, exp_avg_scale=state.get("exp_avg_scale"), exp_avg_sq_scale=state.get("exp_avg_sq_scale"))
        with torch.no_grad():  # the new compute shards: the (bf16) master in the compute precision
            for slot, at in slots:
                params[slot.name].copy_(state["master"][at:at + slot.numel].view_as(params[slot.name]))
    fp32 = kernels.compact.to_fp32(state_dtype, state)
    assert got == expected
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(got_states[name, 0], fp32[name]), name


def test_compact_states_stay_close_to_fp32_adamw(gpt, tmp_path):
    """Against fp32 states (torch's AdamW numerics): a few steps move the losses by a fraction of a percent."""
    model, batches = gpt
    losses = {}
    for state_dtype in ("fp32", "bf16", "int8"):
        engine = infinity.initialize(copy.deepcopy(model), _config(tmp_path, state_dtype))
        try:
            losses[state_dtype] = _train(engine, batches[:STEPS])
        finally:
            engine.close()
    for state_dtype in ("bf16", "int8"):
        assert losses[state_dtype][0] == losses["fp32"][0]
        for a, b in zip(losses[state_dtype], losses["fp32"]):
            assert abs(a / b - 1) < 5e-3, (state_dtype, losses)


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("overlap", [True, False])
def test_nvme_and_host_memory_give_the_same_bits(gpt, tmp_path, state_dtype, overlap):
    model, batches = gpt
    results = []
    for optimizer in ("cpu", "nvme"):
        (tmp_path / optimizer).mkdir()
        # sub-groups of whole shards above the largest one: the same layout on both tiers
        config = _config(tmp_path / optimizer, state_dtype, optimizer=optimizer, sub_group_size=4096,
                         overlap_step_with_backward=overlap)
        engine = infinity.initialize(copy.deepcopy(model), config)
        try:
            assert optimizer == "cpu" or engine.optimizer.swapped_groups == list(engine.layout.sub_groups)
            results.append((_train(engine, batches[:STEPS]), optimizer_states(engine), engine.full_state_dict()))
        finally:
            engine.close()
    (losses_a, states_a, full_a), (losses_b, states_b, full_b) = results
    assert losses_a == losses_b
    for key in states_a:
        assert torch.equal(states_a[key], states_b[key]), key
    for key in full_a:
        assert torch.equal(full_a[key], full_b[key]), key


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_nvme_bytes_per_step_are_the_compact_bytes(gpt, tmp_path, state_dtype):
    """Each step reads every sub-group's states once (and writes them back): 12, 6 or ~4.03 bytes an element."""
    model, batches = gpt
    # every update inside its own step, so that a step's counters hold its bytes (behind the next forward, the
    # updates backward did not reach read and write during the next step)
    engine = infinity.initialize(copy.deepcopy(model), _config(tmp_path, state_dtype, optimizer="nvme",
                                                               overlap_step_with_forward=False))
    try:
        expected = sum(kernels.state_nbytes(state_dtype, g.numel) for g in engine.layout.sub_groups)
        read = written = 0
        for i, batch in enumerate(batches[:STEPS]):
            engine.backward(engine(*batch))
            engine.step()
            nvme = engine.step_metrics()["tiers"]["nvme"]
            if i:  # the first step reads only the masters (moments start at zero)
                assert nvme["bytes_read"] == expected
            read += nvme["bytes_read"]
            written += nvme["bytes_written"]
        engine.optimizer.flush()
        written += engine.tiers.snapshot()["nvme"]["bytes_written"] - engine._last_counters["tiers"]["nvme"]["bytes_written"]
    finally:
        engine.close()
    masters = sum(kernels.state_layout(state_dtype, g.numel)[0].nbytes for g in engine.layout.sub_groups)
    assert read == masters + (STEPS - 1) * expected
    assert written == STEPS * expected  # every step's states (the initial masters went before the first window)
    assert expected / sum(12 * g.numel for g in engine.layout.sub_groups) == pytest.approx(
        kernels.state_bytes_per_element(state_dtype) / 12, rel=1e-3)


def test_a_checkpoint_moves_between_state_dtypes(gpt, tmp_path):
    """Saved with bf16 states: loads into fp32 (exactly the bf16 values), into int8 (their int8 form) and into
    bf16 (resuming bit for bit); each goes on training."""
    model, batches = gpt
    layout = dict(sub_group_size=4096)  # the same sub-groups in memory and on NVMe (int8 blocks line up)
    src = infinity.initialize(copy.deepcopy(model), _config(tmp_path, "bf16", **layout))
    try:
        _train(src, batches[:2])
        src.save_checkpoint(tmp_path / "ckpt")
        saved = optimizer_states(src)
        uninterrupted = _train(src, batches[2:STEPS])
    finally:
        src.close()
    for state_dtype in ("fp32", "int8", "bf16"):
        (tmp_path / state_dtype).mkdir()
        dst = infinity.initialize(copy.deepcopy(model),
                                  _config(tmp_path / state_dtype, state_dtype, optimizer="nvme", **layout))
        try:
            dst.load_checkpoint(tmp_path / "ckpt")
            loaded = optimizer_states(dst)
            for key, values in saved.items():
                name = key[0]
                want = kernels.compact.state_to_fp32(
                    state_dtype, name, kernels.compact.state_from_fp32(state_dtype, name, values))
                assert torch.equal(loaded[key], want), (state_dtype, key)
            resumed = _train(dst, batches[2:STEPS])
        finally:
            dst.close()
        assert all(map(torch.isfinite, map(torch.tensor, resumed)))
        if state_dtype == "bf16":
            assert resumed == uninterrupted


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_a_checkpoint_keeps_each_state_in_the_narrowest_exact_dtype(gpt, tmp_path, state_dtype):
    """Master and moments are saved as they rest where that is exact (bf16 states, bf16 masters), else in fp32
    (int8 moments: code times scale): a bf16-state checkpoint holds half the state bytes of an fp32 one. The
    file's values are the engine's states, and its consolidation is the engine's full state dict."""
    model, batches = gpt
    engine = infinity.initialize(copy.deepcopy(model), _config(tmp_path, state_dtype, optimizer="nvme"))
    try:
        _train(engine, batches[:2])
        tag = engine.save_checkpoint(tmp_path / "ckpt")
        states, full = optimizer_states(engine), engine.full_state_dict()
    finally:
        engine.close()
    itemsizes = {"fp32": (4, 4, 4), "bf16": (2, 2, 2), "int8": (2, 4, 4)}[state_dtype]
    reader = SafetensorsReader(tmp_path / "ckpt" / tag / shard_file(0, 1))
    try:
        for group in engine.layout.sub_groups:
            for name, itemsize in zip(("master", "exp_avg", "exp_avg_sq"), itemsizes):
                for slot in group.slots:
                    dtype, shape = reader.info(f"{name}/{slot.name}")
                    assert (torch.empty((), dtype=dtype).element_size(), shape) == (itemsize, (slot.shard_numel,))
                    start = slot.offset - group.start
                    want = states[name, group.index][start:start + slot.shard_numel]
                    assert torch.equal(reader.read(f"{name}/{slot.name}").float(), want), (name, slot.name)
    finally:
        reader.close()
    summary = consolidate(tmp_path / "ckpt", tmp_path / "model.safetensors")
    consolidated = SafetensorsReader(summary["path"])
    try:
        for name, value in full.items():
            assert torch.equal(consolidated.read(name), value), name
    finally:
        consolidated.close()


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_estimate_gives_the_checkpoint_size(gpt, tmp_path, state_dtype):
    """``estimate``'s checkpoint_nbytes is the rank file's size, less its header, RNG state and buffers."""
    model, batches = gpt
    engine = infinity.initialize(copy.deepcopy(model), _config(tmp_path, state_dtype))
    try:
        _train(engine, batches[:1])
        tag = engine.save_checkpoint(tmp_path / "ckpt")
        precision = {torch.float32: "fp32", torch.bfloat16: "bf16"}[engine.compute.dtype]
    finally:
        engine.close()
    planned = estimate(param_numels=[p.numel() for p in model.parameters()], precision=precision,
                       state_dtype=state_dtype)["checkpoint_nbytes"]
    file_nbytes = (tmp_path / "ckpt" / tag / shard_file(0, 1)).stat().st_size
    buffers_nbytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert 0 <= file_nbytes - planned <= buffers_nbytes + (64 << 10), (file_nbytes, planned)


def test_an_int8_checkpoint_round_trips_exactly(gpt, tmp_path):
    """int8 states saved as fp32 and loaded into int8 at the same layout are the same codes and scales."""
    model, batches = gpt
    src = infinity.initialize(copy.deepcopy(model), _config(tmp_path, "int8"))
    dst = infinity.initialize(copy.deepcopy(model), _config(tmp_path, "int8"))
    try:
        _train(src, batches[:2])
        src.save_checkpoint(tmp_path / "ckpt")
        dst.load_checkpoint(tmp_path / "ckpt")
        for name, tensor in src.optimizer._states.items():
            assert torch.equal(tensor, dst.optimizer._states[name]), name
        assert _train(src, batches[2:STEPS]) == _train(dst, batches[2:STEPS])
    finally:
        src.close()
        dst.close()


def test_the_host_budget_counts_the_compact_bytes(gpt, tmp_path):
    """NVMe as a spill tier: under one budget, int8 states keep more sub-groups in host memory than fp32 ones."""
    model, _ = gpt
    kept = {}
    for state_dtype in ("fp32", "int8"):
        config = _config(tmp_path, state_dtype, optimizer="nvme", sub_group_size=4096)
        del config["zero_optimization"]["offload_optimizer"]["max_in_cpu"]
        config["zero_optimization"]["host_memory_budget"] = 1 << 20  # fp32 states do not all fit, int8 ones do
        engine = infinity.initialize(copy.deepcopy(model), config)
        try:
            kept[state_dtype] = engine.optimizer.resident_numel
            staging = engine.optimizer.staging_sets[0].states
            assert sum(t.numel() * t.element_size() for t in staging.values()) == kernels.state_nbytes(
                state_dtype, engine.layout.largest_sub_group_numel)
        finally:
            engine.close()
    assert 0 < kept["fp32"] < kept["int8"]


def test_estimate_knows_the_compact_sizes():
    numels = [4096] * 10
    sizes = {d: estimate(param_numels=numels, offload_optimizer="nvme", state_dtype=d)["tiers"]
             for d in ("fp32", "bf16", "int8")}
    assert sizes["fp32"]["nvme"]["master"] == 4 * 40960 and sizes["fp32"]["nvme"]["moments"] == 8 * 40960
    assert sizes["bf16"]["nvme"]["master"] == 2 * 40960 and sizes["bf16"]["nvme"]["moments"] == 4 * 40960
    assert sizes["int8"]["nvme"]["master"] == 2 * 40960
    assert sizes["int8"]["nvme"]["moments"] == 2 * 40960 + 8 * 40960 // 256
    assert sizes["int8"]["host"]["optimizer_staging"] < sizes["bf16"]["host"]["optimizer_staging"] < \
        sizes["fp32"]["host"]["optimizer_staging"]
    with pytest.raises(ValueError, match="state_dtype"):
        estimate(param_numels=numels, state_dtype="fp8")


def test_the_key_and_its_deepspeed_spelling():
    def state_dtype(raw):
        return InfinityConfig.from_deepspeed(raw).zero.offload_optimizer.state_dtype

    assert state_dtype({}) == "fp32"
    assert state_dtype({"zero_optimization": {"offload_optimizer": {"device": "cpu", "state_dtype": "int8"}}}) == "int8"
    assert state_dtype({"bf16": {"enabled": True, "bf16_optimizer_states": True}}) == "bf16"
    assert state_dtype({"bf16": {"enabled": True, "bf16_optimizer_states": True},
                        "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}) == "bf16"
    assert state_dtype({"bf16": {"enabled": True, "bf16_optimizer_states": False}}) == "fp32"


@pytest.mark.parametrize("raw, message", [
    ({"zero_optimization": {"offload_optimizer": {"state_dtype": "fp8"}}},
     "zero_optimization.offload_optimizer.state_dtype must be one of 'fp32', 'bf16', 'int8', got 'fp8'"),
    ({"zero_optimization": {"offload_optimizer": {"state_dtype": 8}}}, "offload_optimizer.state_dtype"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": "yes"}}, "bf16.bf16_optimizer_states must be true or false"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True},
      "zero_optimization": {"offload_optimizer": {"state_dtype": "int8"}}}, "give one of them"),
])
def test_bad_values_are_refused_by_name(raw, message):
    with pytest.raises(ValueError, match=message):
        InfinityConfig.from_deepspeed(raw)


def test_compact_states_on_a_gpu_are_refused_naming_the_key():
    """torch's fused AdamW keeps fp32 states: with the optimizer on a CUDA device, a compact form is refused."""
    from infinity.config.sections import OffloadOptimizerConfig, ZeroConfig
    from infinity.optim.offload_optimizer import OffloadOptimizer
    from infinity.optim.states import OptimizerParts

    placement = types.SimpleNamespace(master=types.SimpleNamespace(tier="device"), optimizer_on_device=True,
                                      device=torch.device("cuda", 0), compute_shard_in_optimizer_memory=True,
                                      grads=types.SimpleNamespace(pinned=False))
    with pytest.raises(ValueError, match="offload_optimizer.state_dtype is 'int8'.*'cpu' or 'nvme'"):
        parts = OptimizerParts(types.SimpleNamespace(sub_groups=()), placement, None, None, None, None)
        OffloadOptimizer(parts, InfinityConfig().optimizer,
                         ZeroConfig(offload_optimizer=OffloadOptimizerConfig(state_dtype="int8")))


def test_train_says_the_state_dtype_and_refuses_a_bad_one(fresh_cwd, capsys):
    from infinity.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--preset", "tiny", "--optimizer-state-dtype", "fp8"])
    assert "--optimizer-state-dtype" in capsys.readouterr().err
    assert main(["train", "--preset", "tiny", "--steps", "2", "--micro-batch", "1", "--seq-len", "16", "--max-bytes", "200000",
                 "--offload-param", "cpu", "--offload-optimizer", "cpu", "--optimizer-state-dtype", "int8",
                 "--json"]) == 0
    out = capsys.readouterr().out
    assert "optimizer states int8" in out
    assert '"optimizer_state_dtype": "int8"' in out


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_conversions_a_chunk_at_a_time_equal_the_whole(monkeypatch, state_dtype):
    """read_state/write_state convert a sub-group in chunks of whole blocks (bounded temporaries): the same bits."""
    compact = kernels.compact
    monkeypatch.setattr(compact, "CONVERT_CHUNK_NUMEL", 2 * compact.BLOCK_NUMEL)
    g = torch.Generator().manual_seed(0)
    n = 5 * compact.BLOCK_NUMEL + 17
    values = {"master": torch.randn(n, generator=g), "exp_avg": torch.randn(n, generator=g) * 1e-3,
              "exp_avg_sq": torch.rand(n, generator=g) ** 4 * 1e-6}
    for name, x in values.items():
        whole = compact.state_from_fp32(state_dtype, name, x)
        parts = {key: torch.empty_like(t) for key, t in whole.items()}
        compact.state_from_fp32_into(state_dtype, name, x, parts)
        for key in whole:
            assert torch.equal(parts[key], whole[key]), (name, key)
        out = torch.empty(n)
        compact.state_to_fp32_into(state_dtype, name, parts, out)
        assert torch.equal(out, compact.state_to_fp32(state_dtype, name, whole)), name


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_an_overlapped_step_under_clipping_equals_the_step_after_backward(gpt, tmp_path, state_dtype, optimizer):
    """With clipping the overlapped step speculates and undoes (in-memory undo copy, or the other side of the
    swap keys, scales included): the compact states come out as a step taken after backward."""
    model, batches = gpt
    results = []
    for overlap in (True, False):
        folder = tmp_path / str(overlap)
        folder.mkdir()
        # every sub-group backward reaches is updated speculatively, whatever the worker's pace (none is left
        # behind the next forward)
        config = _config(folder, state_dtype, optimizer=optimizer, sub_group_size=4096,
                         overlap_step_with_backward=overlap, overlap_step_with_forward=False)
        config["gradient_clipping"] = 0.5  # small: most steps are clipped, so speculative updates are redone
        engine = infinity.initialize(copy.deepcopy(model), config)
        try:
            results.append((_train(engine, batches[:STEPS]), optimizer_states(engine)))
            assert engine.optimizer.rollbacks > 0 or not overlap  # speculative updates were undone and redone
        finally:
            engine.close()
    (losses_a, states_a), (losses_b, states_b) = results
    assert losses_a == losses_b
    for key in states_a:
        assert torch.equal(states_a[key], states_b[key]), key
