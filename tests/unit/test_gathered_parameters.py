"""``deepspeed.zero.GatheredParameters`` under the engine: inside the block a parameter is whole; on exit with a
``modifier_rank`` the changes are kept (in the fp32 masters, the compute shards and a frozen parameter's shard), and
training goes on from them as plain PyTorch does from the same change; without one, or when the block fails,
nothing changes."""

from __future__ import annotations

import ast
import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import infinity.deepspeed as deepspeed
from unit.test_deepspeed_door import ADAMW, Regressor, config, data, reference, run

TIERS = {"cpu": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
         "nvme": {"offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "nvme"}}}


def engine_config(tier, tmp_path, **extra):
    zero = copy.deepcopy(TIERS[tier])
    for part in zero.values():
        if part["device"] == "nvme":
            part["nvme_path"] = str(tmp_path)
    return config(**ADAMW, **extra) | {"zero_optimization": {"stage": 3, "sub_group_size": 200, **zero}}


def modify(model):
    """The change a script makes: a row of one matrix set, a frozen vector doubled."""
    model.out.weight.data[0, :4] = 0.25
    model.hidden.bias.data.mul_(2)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_a_change_under_a_modifier_rank_is_kept_and_training_goes_on_as_plain_pytorchs(tier, tmp_path):
    torch.manual_seed(0)
    model = Regressor()
    model.hidden.bias.requires_grad_(False)  # frozen: its compute shard is all it has
    ref = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=trainable, training_data=data(),
                                                config=engine_config(tier, tmp_path))
    ref_optimizer = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    with engine:
        losses, batches = run(engine, loader)
        expected = reference(ref, ref_optimizer, batches, 4)
        with deepspeed.zero.GatheredParameters(model.parameters()):
            whole = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
        for name, value in ref.named_parameters():
            torch.testing.assert_close(whole[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)

        with deepspeed.zero.GatheredParameters([model.out.weight, model.hidden.bias], modifier_rank=0):
            modify(model)
        with torch.no_grad():
            modify(ref)
        state = engine.full_state_dict()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)

        more, batches = run(engine, loader)  # the next epoch, from the changed values
        expected += reference(ref, ref_optimizer, batches, 4)
        torch.testing.assert_close(torch.tensor(losses + more), torch.tensor(expected), rtol=1e-5, atol=0)
        state = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_in_bf16_the_block_sees_bf16_and_what_it_leaves_alone_keeps_its_fp32_master_bitwise(tmp_path):
    torch.manual_seed(1)
    model = Regressor()
    engine, _, loader, _ = deepspeed.initialize(model=model, training_data=data(),
                                                config=engine_config("cpu", tmp_path, bf16={"enabled": True}))
    with engine:
        run(engine, loader)
        before = engine.full_state_dict()
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            seen = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
            model.out.weight.data[0, 0] = 0.3
        after = engine.full_state_dict()
    for name, value in seen.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, before[name].to(torch.bfloat16)), name
    changed = torch.zeros_like(before["out.weight"], dtype=torch.bool)
    changed[0, 0] = True
    assert after["out.weight"][0, 0].item() == torch.tensor(0.3, dtype=torch.bfloat16).item()
    assert torch.equal(after["out.weight"][~changed], before["out.weight"][~changed])
    assert all(torch.equal(after[name], before[name]) for name in before if name != "out.weight")


def test_without_a_modifier_rank_or_when_the_block_fails_nothing_changes(tmp_path):
    model = Regressor()
    plain = torch.nn.Linear(2, 2)  # no engine's: whole already, left as it is
    engine, _, _, _ = deepspeed.initialize(model=model, config=engine_config("nvme", tmp_path))
    with engine:
        before = engine.full_state_dict()
        with deepspeed.zero.GatheredParameters([model.out.weight, plain.weight]):
            model.out.weight.data.zero_()
            plain_seen = plain.weight.data
        with pytest.raises(KeyError, match="in the block"):
            with deepspeed.zero.GatheredParameters(model.out.weight, modifier_rank=0):
                model.out.weight.data.zero_()
                raise KeyError("in the block")
        sharded_again = model.out.weight.numel() == 0  # released: empty between passes, its shard is all there is
        assert sharded_again and plain_seen.data_ptr() == plain.weight.data_ptr()
        after = engine.full_state_dict()
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_what_cannot_be_gathered_is_refused_by_name_and_writes_nothing(tmp_path):
    with deepspeed.zero.Init():
        on_meta = Regressor()
    with pytest.raises(ValueError, match="meta device.*zero.Init"):
        deepspeed.zero.GatheredParameters(on_meta.out.weight)
    model = Regressor()
    engine, _, _, _ = deepspeed.initialize(model=model, config=engine_config("cpu", tmp_path))
    with engine:
        before = engine.full_state_dict()
        with pytest.raises(ValueError, match="modifier_rank=1: a rank of the engine's 1"):
            with deepspeed.zero.GatheredParameters(model.out.weight, modifier_rank=1):
                pass
        with pytest.raises(ValueError, match="left out.weight with another number of elements"):
            with deepspeed.zero.GatheredParameters(model.out.weight, modifier_rank=0):
                model.out.weight.data = torch.zeros(3)
        x, y = data().tensors
        engine.backward(engine(x[:4], y[:4]))
        with pytest.raises(RuntimeError, match="between a forward and its step"):
            deepspeed.zero.GatheredParameters(model.out.weight)
        engine.step()
        assert all(torch.equal(engine.full_state_dict()[n], before[n]) for n in before)  # accumulating, no step yet
    with pytest.raises(RuntimeError, match="closed"):
        deepspeed.zero.GatheredParameters(model.out.weight, modifier_rank=0)


def test_the_safe_get_and_set_helpers_read_and_write_what_torch_adamw_holds(tmp_path):
    from infinity.deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state,
                                          safe_set_full_fp32_param, safe_set_full_optimizer_state)

    torch.manual_seed(2)
    model = Regressor()
    model.hidden.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=trainable, training_data=data(),
                                                config=engine_config("nvme", tmp_path))
    ref_optimizer = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    with engine:
        assert torch.equal(safe_get_full_optimizer_state(model.out.weight, "exp_avg").cpu(), torch.zeros(1, 16))
        with pytest.raises(ValueError, match="no optimizer step has run"):
            safe_set_full_optimizer_state(model.out.weight, torch.ones(1, 16), "exp_avg")
        losses, batches = run(engine, loader)
        expected = reference(ref, ref_optimizer, batches, 4)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            if not q.requires_grad:
                assert safe_get_full_fp32_param(p) is None, name
                continue
            torch.testing.assert_close(safe_get_full_fp32_param(p).cpu(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(safe_get_full_optimizer_state(p, key).cpu(), ref_optimizer.state[q][key],
                                           rtol=1e-5, atol=1e-9, msg=f"{name} {key}")

        new_weight = torch.linspace(-1, 1, 16).reshape(1, 16)
        safe_set_full_fp32_param(model.out.weight, new_weight)
        safe_set_full_optimizer_state(model.hidden.weight, torch.full((16, 8), 0.01), "exp_avg")
        with torch.no_grad():
            ref.out.weight.copy_(new_weight)
            ref_optimizer.state[ref.hidden.weight]["exp_avg"].fill_(0.01)
        more, batches = run(engine, loader)
        expected += reference(ref, ref_optimizer, batches, 4)
        torch.testing.assert_close(torch.tensor(losses + more), torch.tensor(expected), rtol=1e-5, atol=0)
        state = engine.full_state_dict()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)

        with pytest.raises(ValueError, match="not trained by an engine"):
            safe_set_full_fp32_param(model.hidden.bias, torch.zeros(16))
        with pytest.raises(ValueError, match="optim_state_key='momentum'"):
            safe_get_full_optimizer_state(model.out.weight, "momentum")
        with pytest.raises(ValueError, match="out.weight: 3 values given"):
            safe_set_full_fp32_param(model.out.weight, torch.zeros(3))


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_moments_and_step_written_whole_go_on_as_the_torch_adamw_that_took_them(tier, tmp_path):
    """torch's AdamW trains 4 steps; a fresh engine given its weights (masters), moments and step count by
    ``whole_params()`` before its first step (NVMe: swapped sub-groups with nothing on disk yet) takes the next 4 as
    that AdamW does. All the trainable parameters' moments or none: one left out is named, nothing written."""
    torch.manual_seed(3)
    model = Regressor()
    ref = copy.deepcopy(model)
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    batches = [(x, y) for x, y in torch.utils.data.DataLoader(data(), batch_size=4)]
    reference(ref, ref_optimizer, batches, 4)  # 16 micro-batches: 4 steps
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=data(), config=engine_config(tier, tmp_path))
    with engine:
        whole = engine.whole_params()
        moments = {key: {p: ref_optimizer.state[q][key] for p, q in zip(model.parameters(), ref.parameters())}
                   for key in ("exp_avg", "exp_avg_sq")}
        partial = {key: {p: v for p, v in values.items() if p is not model.out.bias} for key, values in moments.items()}
        with pytest.raises(ValueError, match=r"exp_avg: no value for out\.bias: every trainable parameter's moments"):
            whole.write_moments(partial, step=4)
        assert engine.shard_source().optimizer_state()["step"] == 0
        assert torch.equal(whole.read(model.hidden.weight, "exp_avg").cpu(), torch.zeros(16, 8))
        for p, q in zip(model.parameters(), ref.parameters()):
            whole.write(p, q.detach())
        whole.write_moments(moments, step=int(ref_optimizer.state[ref.out.weight]["step"]))
        losses, batches = run(engine, loader)
        expected = reference(ref, ref_optimizer, batches, 4)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
        state = engine.full_state_dict()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_scripts_zero3_save_that_tests_ds_id_and_ds_status_gets_the_whole_model(tmp_path):
    """The save function DeepSpeed scripts carry: gather a parameter where it has ``ds_id`` and is not available."""
    from infinity.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    def to_fetch(params):
        return [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]

    torch.manual_seed(3)
    model = Regressor()
    engine, _, loader, _ = deepspeed.initialize(model=model, training_data=data(),
                                                config=engine_config("nvme", tmp_path))
    with engine:
        run(engine, loader)
        saved = {}
        for name, param in model.named_parameters():
            assert param.numel() == 0  # released between passes: empty, as DeepSpeed's partitioned parameters
            with deepspeed.zero.GatheredParameters(to_fetch([param]), enabled=True):
                assert param.ds_status == ZeroParamStatus.AVAILABLE
                assert (param.ds_numel, tuple(param.ds_shape)) == (param.numel(), tuple(param.shape))
                saved[name] = param.data.cpu().clone()
            assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE and param.numel() == 0
        expected = engine.full_state_dict()
    assert saved.keys() == expected.keys() and all(torch.equal(saved[n], v) for n, v in expected.items())


TOUCH = textwrap.dedent("""
    import sys, tempfile
    import torch
    sys.path.insert(0, {tests!r})
    import infinity
    from unit.test_deepspeed_door import Regressor, data
    from unit.test_gathered_parameters import engine_config
    model = Regressor()
    engine = infinity.initialize(model, engine_config("nvme", tempfile.mkdtemp()))
    x, y = data().tensors
    seen = []
    for _ in range(4):
        seen.append(tuple(model.out.weight.shape))  # between passes: what a script's logging would touch
        model.out.weight.sum().item()
        loss = engine(x[:4], y[:4]); engine.backward(loss); engine.step()
    engine.close()  # the test is of the reads above; an engine left open at exit is another matter
    print(seen, loss.item())
""")


def test_a_released_parameter_touched_between_passes_is_empty_not_a_crash():
    """A script that reads a parameter outside the forward (logging its norm, printing it) read freed bytes
    and the process died of SIGSEGV; it now finds an empty tensor, as DeepSpeed's partitioned parameters are."""
    done = subprocess.run([sys.executable, "-c", TOUCH.format(tests=str(Path(__file__).parents[1]))],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = ast.literal_eval(done.stdout.split("]")[0] + "]")
    # empty while released; whole where the prefetcher has fetched it for the next forward already
    assert seen[0] == (0,) and set(seen) <= {(0,), (1, 16)}


LEFT_OPEN = textwrap.dedent("""
    import atexit, os, sys, tempfile
    seen = {{}}
    # registered before infinity is imported, so it runs after infinity's own handler (atexit is last-in first-out)
    atexit.register(lambda: print("closed", seen["engine"]._closed, "left", os.listdir(seen["nvme"])))
    sys.path.insert(0, {tests!r})
    import infinity
    from unit.test_deepspeed_door import Regressor, data
    from unit.test_gathered_parameters import engine_config
    seen["nvme"] = tempfile.mkdtemp()
    model = Regressor()
    engine = infinity.initialize(model, engine_config("nvme", seen["nvme"]))
    x, y = data().tensors
    for _ in range(2):
        loss = engine(x[:4], y[:4]); engine.backward(loss); engine.step()
    seen["engine"] = engine  # never closed
""")


def test_an_engine_left_open_is_closed_before_the_interpreter_finalizes():
    """A script that never closes its engine: the engine's daemon workers stopped inside a native kernel while the
    interpreter tore down aborted the process now and then; it is closed at exit (swap files removed) first."""
    done = subprocess.run([sys.executable, "-c", LEFT_OPEN.format(tests=str(Path(__file__).parents[1]))],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "closed True left []"
