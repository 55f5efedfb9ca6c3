"""With one rank and every shard in device memory (``offload_param: none``), each shard is its parameter's full
tensor and nothing is ever released: the engine's backward graph is then plain PyTorch's, node for node, with no
release or re-fetch hooks in it. Where shards live elsewhere those hooks are in the graph, and they must be: a
module of its own forward gets a release node on its inputs, while a ``torch.nn`` layer whose parameters all train
is released by its parameters' gradient hooks, so its part of the graph stays plain PyTorch's."""

from __future__ import annotations

import collections
import copy
import time

import pytest
import torch

import infinity
from infinity.params.hooks import FetchGroup
from infinity.params.sharded_param import ShardedParam
from helpers import TinyGPT, assert_matches, engine_config, engine_steps, gpt_batches, reference_train


def backward_nodes(loss: torch.Tensor) -> collections.Counter:
    """The loss's autograd graph: how many nodes of each type."""
    seen, todo, kinds = set(), [loss.grad_fn], collections.Counter()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kinds[type(node).__name__] += 1
        todo.extend(next_node for next_node, _ in node.next_functions)
    return kinds


def _engine_loss_graph(model, batch, tmp_path, monkeypatch, param: str):
    """The engine's loss graph, its parameters, and how many modules its backward fetched again."""
    config = engine_config(param=param, optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=1e-3)
    engine = infinity.initialize(copy.deepcopy(model), config)
    refetched = []
    fetch_for_backward = FetchGroup.fetch_for_backward
    monkeypatch.setattr(FetchGroup, "fetch_for_backward",
                        lambda group: (refetched.append(group.name), fetch_for_backward(group))[1])
    try:
        loss = engine(*batch)
        nodes = backward_nodes(loss)
        engine.backward(loss)
        engine.step()
        return nodes, engine.params, refetched
    finally:
        engine.close()


def test_resident_parameters_leave_plain_pytorchs_backward_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINITY_DISTINCT_DEVICE", "0")
    torch.manual_seed(0)
    model, batch = TinyGPT(), gpt_batches(1, batch=2)[0]
    plain = backward_nodes(copy.deepcopy(model)(*batch))
    nodes, params, refetched = _engine_loss_graph(model, batch, tmp_path, monkeypatch, "none")
    assert all(p.aliased for p in params)
    assert nodes == plain
    assert refetched == []


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_released_parameters_are_fetched_again_through_the_graph(tmp_path, monkeypatch, param):
    monkeypatch.setenv("INFINITY_DISTINCT_DEVICE", "0")
    torch.manual_seed(0)
    model, batch = TinyGPT(), gpt_batches(1, batch=2)[0]
    plain = backward_nodes(copy.deepcopy(model)(*batch))
    nodes, params, refetched = _engine_loss_graph(model, batch, tmp_path, monkeypatch, param)
    assert not any(p.aliased for p in params)
    # TinyGPT's parametrized modules are torch.nn layers, released on their gradients, but for its head, tied to the
    # embedding (whose input, like the root's, needs no gradient): one release node, the head's
    assert nodes - plain == collections.Counter({"_ReleaseAfterBackwardBackward": 1})
    assert not nodes.keys() - plain.keys() - {"_ReleaseAfterBackwardBackward"}
    assert len(refetched) > 0  # each module that owns parameters is fetched again before its backward


class Scale(torch.nn.Module):
    """A module of its own forward: it keeps the release node on its inputs."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.weight


class DetachedLinear(torch.nn.Linear):
    """A subclass whose forward saves its weight for backward without a gradient edge, beside a use with one: a
    release once the weight's gradient is ready would free the bytes the detached use's backward still reads."""

    def forward(self, x):
        # made first, so its backward runs last: after the weight's gradient is ready
        detached = torch.nn.functional.linear(x, self.weight.detach())
        return detached * torch.nn.functional.linear(x, self.weight, self.bias)


class Mixed(torch.nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.first = torch.nn.Linear(d, d)
        self.scale = Scale(d)
        self.detached = DetachedLinear(d, d)
        self.last = torch.nn.Linear(d, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.last(self.detached(self.scale(self.first(x)))).squeeze(-1), y)


def test_only_layers_of_their_own_forward_keep_the_release_node(tmp_path, monkeypatch):
    """The release node goes where the forward is the module's own (Scale, the overriding subclass), not on the
    torch.nn layers; and the engine trains the mix exactly as plain PyTorch AdamW does, every copy late."""
    monkeypatch.setenv("INFINITY_DISTINCT_DEVICE", "1")
    torch.manual_seed(0)
    model = Mixed()
    batches = [(torch.randn(4, 8), torch.randn(4)) for _ in range(4)]
    plain = backward_nodes(copy.deepcopy(model)(*batches[0]))
    nodes, _, refetched = _engine_loss_graph(model, batches[0], tmp_path, monkeypatch, "cpu")
    assert nodes - plain == collections.Counter({"_ReleaseAfterBackwardBackward": 2})  # scale, detached
    assert {"first", "last", "scale", "detached"} <= set(refetched)

    reference = reference_train(model, batches, steps=4, accum=1, clip=0.0, lr=1e-2)
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=1e-2)

    def late_copies(engine):
        engine.copies.delay_s = 0.0005  # a parameter read after its release would read late or freed bytes
    result = engine_steps(model, config, batches, steps=4, accum=1, setup=late_copies)
    assert_matches(result, reference, "torch.nn layers released on gradients beside wrapped modules")


def test_a_layer_released_on_its_gradients_is_released_inside_backward(tmp_path, monkeypatch):
    """Released on gradients means released as its backward ends, not held until the end of backward."""
    monkeypatch.setenv("INFINITY_DISTINCT_DEVICE", "1")
    torch.manual_seed(0)
    model = Mixed()
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=1e-2)
    engine = infinity.initialize(copy.deepcopy(model), config)
    try:
        last = next(p for p in engine.params if p.name == "last.weight")
        states_when_first_fetched = []
        first_group = engine.groups[engine.module.first]
        fetch_for_backward = first_group.fetch_for_backward

        def spy():
            states_when_first_fetched.append(last.state.name)  # `first`'s backward comes after `last`'s
            fetch_for_backward()
        first_group.fetch_for_backward = spy
        loss = engine(torch.randn(4, 8), torch.randn(4))
        engine.backward(loss)
        engine.step()
    finally:
        engine.close()
    assert states_when_first_fetched == ["RELEASED"]


def test_step_metrics_count_the_seconds_the_hooks_ran(tmp_path, monkeypatch):
    """``hooks_s``: each step's seconds in the engine's hooks. Every fetch made slower by 2 ms shows there in full
    (at least 2 ms a fetch of that step), and the figure is the step's own (taken afresh at each step)."""
    monkeypatch.setenv("INFINITY_DISTINCT_DEVICE", "1")
    torch.manual_seed(0)
    model, batches = Mixed(), [(torch.randn(4, 8), torch.randn(4)) for _ in range(3)]
    config = engine_config(param="cpu", optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=1e-2)
    engine = infinity.initialize(copy.deepcopy(model), config)
    fetches = []
    fetch = ShardedParam.fetch

    def slow_fetch(sharded):
        time.sleep(0.002)
        fetches.append(sharded.name)
        fetch(sharded)
    monkeypatch.setattr(ShardedParam, "fetch", slow_fetch)
    try:
        per_step = []
        for x, y in batches:
            fetches.clear()
            engine.backward(engine(x, y))
            engine.step()
            metrics = engine.step_metrics()
            per_step.append((metrics["hooks_s"], len(fetches), metrics["step_s"]))
    finally:
        engine.close()
    for hooks_s, count, step_s in per_step:
        assert count >= 8  # the four layers' weights and biases, in forward and again in backward
        assert 0.002 * count <= hooks_s < step_s


@pytest.mark.parametrize("behind", [False, True], ids=["no-updates-behind", "updates-behind"])
def test_resident_modules_are_fetched_only_while_updates_run_behind_the_forward(tmp_path, monkeypatch, behind):
    """Nothing resident is ever released: with no update behind the forward (``overlap_step_with_forward`` off) its
    hooks fetch nothing; with the step's updates behind it, each module is fetched, which waits for its
    parameters' update. Training equals plain PyTorch either way (every copy late)."""
    monkeypatch.setenv("INFINITY_DISTINCT_DEVICE", "1")
    torch.manual_seed(0)
    model, batches = TinyGPT(), gpt_batches(4, batch=2)
    reference = reference_train(model, batches, steps=4, accum=1, clip=0.0, lr=1e-3)
    config = engine_config(param="none", optimizer="cpu", nvme_path=str(tmp_path), accum=1, clip=0.0, lr=1e-3,
                           overlap_step_with_forward=behind)
    fetches = []
    fetch = ShardedParam.fetch

    def counted(sharded):
        fetches.append(sharded.name)
        fetch(sharded)
    monkeypatch.setattr(ShardedParam, "fetch", counted)

    def late_copies(engine):
        assert all(p.aliased for p in engine.params)
        engine.copies.delay_s = 0.0005
    result = engine_steps(model, config, batches, steps=4, accum=1, setup=late_copies)
    assert_matches(result, reference, f"resident parameters, updates behind the forward: {behind}")
    assert bool(fetches) is behind
