"""With one rank and every shard in device memory (``offload_param: none``), each shard is its parameter's full
tensor and nothing is ever released: the engine's backward graph is then plain PyTorch's, node for node, with no
release or re-fetch hooks in it. Where shards live elsewhere those hooks are in the graph, and they must be."""

from __future__ import annotations

import collections
import copy

import pytest
import torch

import infinity
from infinity.params.hooks import FetchGroup
from helpers import TinyGPT, engine_config, gpt_batches


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
    extra = nodes - plain
    assert set(extra) == {"_ReleaseAfterBackwardBackward"} and extra["_ReleaseAfterBackwardBackward"] > 0
    assert len(refetched) > 0  # each module that owns parameters is fetched again before its backward
