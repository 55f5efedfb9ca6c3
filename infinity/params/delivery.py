"""New compute shards, from the optimizer's kernel to their tier.

The kernel writes a sub-group's new low-precision compute shards in the same
pass as the update. Where they go first, and how they get home:

* into their flat buffer itself, when it rests in the memory the optimizer
  runs in (nothing more to do);
* else into a scratch buffer (the staging set's, or one of this object's in
  host or device memory), which crosses through :class:`~infinity.placement.copies.Copies`
  to the other memory, or is written to NVMe (coming down to host scratch
  first when the optimizer runs on the device).

A scratch buffer is overwritten only once the copy reading it has landed.
"""

from __future__ import annotations

import torch

from infinity.params.compute_shards import ComputeShards
from infinity.placement.copies import Copies, CopyDone
from infinity.placement.layout import ShardLayout, SubGroup
from infinity.placement.placement import Placement
from infinity.placement.tiers import Tiers
from infinity.storage import IOHandle


class ComputeDelivery:
    """Where the kernel writes a sub-group's new compute shards, and their way to the shards' tier."""

    def __init__(self, layout: ShardLayout, placement: Placement, tiers: Tiers, compute: ComputeShards,
                 copies: Copies):
        self._layout = layout
        self._tiers = tiers
        self._compute = compute
        self._copies = copies
        self._on_device = placement.optimizer_on_device
        self.in_place = placement.compute_shard_in_optimizer_memory
        self.scratch_pinned = placement.grads.pinned and not self.in_place
        """New compute shards that cross between memories are staged in host buffers pinned like the gradients."""
        self.writes_from_scratch = compute.tier == "nvme" and not self.in_place and not self._on_device
        """The new shards of a staged sub-group go to NVMe from the scratch passed to :meth:`out` (the set's)."""
        self._host_scratch: torch.Tensor | None = None
        self._device_scratch: torch.Tensor | None = None
        self._scratch_copy: dict[int, CopyDone] = {}  # scratch data_ptr -> the copy still reading it

    def out(self, group: SubGroup, scratch: "torch.Tensor | None") -> torch.Tensor:
        """Where the kernel writes the sub-group's new compute shards (``scratch``: a staging set's buffer)."""
        if self.in_place:
            return self._compute.sub_group_view(group)
        numel = self._layout.largest_sub_group_numel
        if self._on_device:
            if self._device_scratch is None:
                self._device_scratch = self._tiers.empty("device", numel, self._compute.dtype)
            out = self._device_scratch
        else:
            out = scratch if scratch is not None else self._host_scratch_buffer()
        self._wait_scratch_free(out)
        return out[:group.numel]

    def deliver(self, group: SubGroup, out: torch.Tensor) -> list[IOHandle]:
        """Take the new compute shards from ``out`` to their tier; returns the NVMe writes in flight."""
        if self.in_place:
            return []
        if self._compute.tier != "nvme":
            # across memories: a copy on the copy stream; the scratch is reused only once it has landed
            flat = self._compute.sub_group_view(group)
            cross = self._copies.to_host if self._on_device else self._copies.to_device
            self._scratch_copy[out.data_ptr()] = cross(out, flat)
            return []
        if self._on_device:
            out = self._down_for_nvme(group, out)
        writes = []
        for slot in group.slots:
            start = slot.offset - group.start
            handle = self._compute.write(slot, out[start:start + slot.shard_numel])
            if handle is not None:
                writes.append(handle)
        return writes

    def finish_copies(self) -> None:
        """End of a step: the next forward's gathers wait for the new compute shards' copies up, and host reads
        (the next step's copies up, checkpoints) for their copies down."""
        if not self._scratch_copy:
            return
        last = self._copies.last()
        if self._on_device:
            self._copies.host_waits(last)  # host compute shards are read by the host (checkpoints, NVMe writes)
            self._scratch_copy.clear()
        else:
            # device compute shards are gathered by the compute stream: a stream wait, the host goes on. The
            # entries stay, so the next step's kernel host-waits before it overwrites a scratch still copied up.
            self._copies.compute_waits(last)

    def _host_scratch_buffer(self) -> torch.Tensor:
        """One sub-group of host scratch for new compute shards, made on first use (states in memory have no
        staging set of their own to lend one)."""
        if self._host_scratch is None:
            self._host_scratch = self._tiers.empty("host", self._layout.largest_sub_group_numel, self._compute.dtype,
                                                   pinned=self.scratch_pinned)
        return self._host_scratch

    def _wait_scratch_free(self, scratch: torch.Tensor) -> None:
        done = self._scratch_copy.pop(scratch.data_ptr(), None)
        if done is None:
            return
        if self._on_device:
            self._copies.compute_waits(done)  # the kernel overwrites device scratch the copy stream still reads
        else:
            self._copies.host_waits(done)  # the CPU kernel overwrites host scratch the copy stream still reads

    def _down_for_nvme(self, group: SubGroup, out_device: torch.Tensor) -> torch.Tensor:
        """Device states, NVMe compute shards: the new shards come down to host scratch before their writes."""
        host = self._host_scratch_buffer()[:group.numel]
        self._copies.host_waits(self._copies.to_host(out_device, host))  # the NVMe writes read it next
        return host

    def close(self) -> None:
        if self._host_scratch is not None:
            self._tiers.free("host", self._host_scratch)
            self._host_scratch = None
        if self._device_scratch is not None:
            self._tiers.free("device", self._device_scratch)
            self._device_scratch = None
