"""With NCCL alone (a user's own ``init_process_group("nccl")``), host tensors cross through a device copy.

No GPU here: the "device" copy is a CPU copy (``_current_cuda_device`` patched), and the collective is a
stand-in that records which tensor it was handed. What is checked is the routing: the collective never
sees the host tensor itself, and its result lands back in it.
"""

from __future__ import annotations

import torch

from infinity.runtime import comm
from infinity.runtime.comm import Collectives


def _nccl_only(monkeypatch) -> Collectives:
    monkeypatch.setattr(comm, "_current_cuda_device", lambda: torch.device("cpu"))
    collectives = Collectives()
    collectives.world_size, collectives.backend, collectives._host_via_device = 2, "nccl", True
    return collectives


def test_a_host_tensor_reaches_nccl_as_a_copy_and_the_result_comes_back(monkeypatch):
    collectives = _nccl_only(monkeypatch)
    host = torch.tensor([1.0, 2.0])
    handed = []

    def doubling_all_reduce(t, op=None, group=None):
        handed.append(t)
        t.mul_(2)

    monkeypatch.setattr(comm.dist, "all_reduce", doubling_all_reduce)
    assert collectives.all_reduce_sum(host) is host
    assert handed[0] is not host and handed[0].data_ptr() != host.data_ptr()
    assert host.tolist() == [2.0, 4.0]


def test_a_host_broadcast_goes_through_a_copy_too(monkeypatch):
    collectives = _nccl_only(monkeypatch)
    host = torch.zeros(3)
    monkeypatch.setattr(comm.dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(comm.dist, "broadcast", lambda t, src, group=None: t.fill_(7.0))
    collectives.group = object()
    collectives.broadcast_from_first(host)
    assert host.tolist() == [7.0, 7.0, 7.0]


def test_with_a_host_backend_the_tensor_is_handed_as_it_is(monkeypatch):
    collectives = _nccl_only(monkeypatch)
    collectives.backend, collectives._host_via_device = "cpu:gloo,cuda:nccl", False
    host = torch.ones(2)
    handed = []
    monkeypatch.setattr(comm.dist, "all_reduce", lambda t, op=None, group=None: handed.append(t))
    collectives.all_reduce_sum(host)
    assert handed == [host] and handed[0] is host


def test_a_host_all_gather_goes_through_copies_of_both_tensors(monkeypatch):
    collectives = _nccl_only(monkeypatch)
    full, shard = torch.zeros(4), torch.tensor([3.0, 4.0])
    handed = []

    def gather(out, inp, group=None):
        handed.append((out, inp))
        out.copy_(torch.cat([inp, inp]))

    monkeypatch.setattr(comm, "_all_gather_single", gather)
    collectives.all_gather_into(full, shard)
    assert handed[0][0] is not full and handed[0][0].data_ptr() != full.data_ptr()
    assert full.tolist() == [3.0, 4.0, 3.0, 4.0]
