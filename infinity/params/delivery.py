"""New compute shards, from the optimizer's kernel to their tier: the one owner
of their way home. The optimizer hands each sub-group's new shards here and says
what it does to its buffers; this object steers the copies, the NVMe writes and
the staging sets' readable shards (:mod:`infinity.params.staging`) from that.

The kernel writes a sub-group's new low-precision compute shards in the same
pass as the update. Where they go first, and how they get home:

* into their flat buffer itself, when it rests in the memory the optimizer
  runs in (nothing more to do);
* else into a scratch buffer (the staging set's, or one of this object's in
  host or device memory), which crosses through :class:`~infinity.placement.copies.Copies`
  to the other memory, or is written to NVMe (coming down to host scratch
  first when the optimizer runs on the device);
* nowhere, when the sub-group's bf16 master on NVMe is its compute shards
  (``offload_param.compute_from_master``): the shards on NVMe are read from the
  master from then on, those in host memory are copied from it.

A scratch buffer is overwritten only once the copy reading it has landed.

With a split optimizer (:attr:`Placement.device_sub_groups`) each sub-group goes its own way: a device-stepped
sub-group's new shards are written in place when the shards rest on the device (no copy up), and come down
when they rest in host memory or on NVMe; a host-stepped one's as without a split.

While a swapped sub-group's states are written out of a staging set, the set
still holds its new shards (its compute buffer, or the master itself); the next
forward copies them from there instead of reading NVMe, until the optimizer says
the set is about to be overwritten (:meth:`ComputeDelivery.will_overwrite`). A
speculative update's shards are readable only once the step commits
(:meth:`~ComputeDelivery.committed`, :meth:`~ComputeDelivery.undone`).

The optimizer's verbs, in the order of a sub-group's update: :meth:`~ComputeDelivery.out`
(where the kernel writes), :meth:`~ComputeDelivery.updated` (the shards are
written: take them home), :meth:`~ComputeDelivery.written_from` (the states go
to NVMe out of a staging set), :meth:`~ComputeDelivery.finish_copies` (end of
a step).
"""

from __future__ import annotations

from typing import Callable

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
        self._placement = placement
        every_in_place = all(placement.compute_shard_in_memory_of(g.index) for g in layout.sub_groups)
        self.scratch_pinned = placement.grads.pinned and not every_in_place
        """New compute shards that cross between memories are staged in host buffers pinned like the gradients."""
        self.writes_from_scratch = compute.tier == "nvme" and not placement.optimizer_on_device
        """The new shards of a staged sub-group go to NVMe from the scratch passed to :meth:`out` (the set's)."""
        self.master_groups: frozenset[int] = frozenset()
        """Swapped sub-groups whose master on NVMe is their compute shards (their update writes no copy)."""
        self._host_scratch: torch.Tensor | None = None
        self._device_scratch: torch.Tensor | None = None
        self._scratch_copy: dict[int, CopyDone] = {}  # scratch data_ptr -> the copy still reading it
        self._copied_down = False  # this step copied new shards down (a device-stepped sub-group's)

    # -- sub-groups whose master is their compute shards ----------------------------
    def read_from_masters(self, groups: list[SubGroup], master_dtype: torch.dtype,
                          read_master: Callable[[SubGroup, int, torch.Tensor], IOHandle]) -> frozenset[int]:
        """Of the swapped sub-groups ``groups`` (their master of ``master_dtype`` on NVMe), those whose compute
        shards can be read from the master from their first update on; ``read_master(group, at, out)`` reads
        ``out``'s bytes from byte ``at`` of a master, ordered after its writes in flight. Returns their indices."""
        self.master_groups = frozenset(g.index for g in groups if self._compute.can_rest_in_master(g, master_dtype))
        if self.master_groups:
            self._compute.read_masters_with(read_master)
        return self.master_groups

    def in_master(self, group: SubGroup) -> bool:
        """Whether ``group``'s master is its compute shards (see :meth:`read_from_masters`)."""
        return group.index in self.master_groups

    def needs_restoring(self, group: SubGroup) -> bool:
        """After an undone update: whether some of ``group``'s compute shards hold its values. Not when every one
        is read from the master, which the undone update did not overwrite (it wrote the other side)."""
        return not self.in_master(group) or bool(self._compute.resident_slots(group))

    # -- a sub-group's update --------------------------------------------------------
    def out(self, group: SubGroup, scratch: "torch.Tensor | None") -> torch.Tensor | None:
        """Where the kernel writes the sub-group's new compute shards (``scratch``: a staging set's buffer); None
        when its master is its compute shards (the kernel writes no copy)."""
        if self.in_master(group):
            return None
        if self._in_place(group):
            return self._compute.sub_group_view(group)
        numel = self._layout.largest_sub_group_numel
        if self._on_device(group):
            if self._device_scratch is None:
                self._device_scratch = self._tiers.empty("device", numel, self._compute.dtype,
                                                             owner="compute shard scratch")
            out = self._device_scratch
        else:
            out = scratch if scratch is not None else self._host_scratch_buffer()
        self._wait_scratch_free(out)
        return out[:group.numel]

    def updated(self, group: SubGroup, out: "torch.Tensor | None", master: torch.Tensor) -> list[IOHandle]:
        """The kernel wrote ``group``'s new compute shards into ``out`` (from :meth:`out`), or its new ``master``
        (the whole sub-group's, in host memory) is them: take them to their tier. Returns the NVMe writes in
        flight."""
        if self.in_master(group):
            self._compute.write_resident_from_master(group, master)  # those on NVMe are read from the master
            return []
        return self._deliver(group, out)

    def restore(self, group: SubGroup, master: torch.Tensor, scratch: "torch.Tensor | None") -> None:
        """After an undone update: ``group``'s compute shards again from its ``master`` (the kernel writes them as
        its round-to-nearest cast, so this is the value they had); ``scratch``: a staging set's buffer. Blocks
        until they are home."""
        out = self.out(group, scratch)
        if out is not None:
            out.copy_(master)
        for handle in self.updated(group, out, master):
            handle.wait()

    def written_from(self, group: SubGroup, owner: object, *, master: torch.Tensor, compute: torch.Tensor,
                     speculative: bool) -> None:
        """``group``'s updated states are being written to NVMe out of ``owner``'s buffers (a staging set:
        ``master`` and ``compute``, the sub-group's flat ranges of its master and compute buffer), the master
        first when it is the compute shards. ``speculative``: to the other side of the keys, which stands only
        once the step commits; until then the shards read are their old values."""
        if self.in_master(group):
            self._compute.rest_in_master(group)  # its shards are read from the master from now on
            # the next forward copies the shards from the staged master while the set is not reused
            self._compute.keep_staged(group, master, owner, speculative=speculative)
        elif self.writes_from_scratch:
            # their files were written from the set's compute buffer (the speculative values too: an undo
            # writes them again, which forgets these)
            self._compute.keep_staged(group, compute, owner)

    def _on_device(self, group: SubGroup) -> bool:
        """The device optimizer steps ``group`` (its states rest in device memory)."""
        return self._placement.stepped_on_device(group.index)

    def _in_place(self, group: SubGroup) -> bool:
        """The kernel writes ``group``'s new compute shards into their flat buffer (same memory)."""
        return self._placement.compute_shard_in_memory_of(group.index)

    def _deliver(self, group: SubGroup, out: torch.Tensor) -> list[IOHandle]:
        """Take the new compute shards from ``out`` to their tier; returns the NVMe writes in flight."""
        if self._in_place(group):
            return []
        on_device = self._on_device(group)
        if self._compute.tier != "nvme":
            # across memories: a copy on the copy stream; the scratch is reused only once it has landed
            flat = self._compute.sub_group_view(group)
            cross = self._copies.to_host if on_device else self._copies.to_device
            self._scratch_copy[out.data_ptr()] = cross(out, flat)
            self._copied_down = self._copied_down or on_device
            return []
        if on_device:
            out = self._down_for_nvme(group, out)
        writes = []
        for slot in group.slots:
            start = slot.offset - group.start
            handle = self._compute.write(slot, out[start:start + slot.shard_numel])
            if handle is not None:
                writes.append(handle)
        return writes

    # -- the staging sets' shards, on the optimizer's word ------------------------------
    def will_overwrite(self, owner: object) -> None:
        """``owner``'s buffers (a staging set) are about to be overwritten: the shards they held are read from
        NVMe from now on."""
        self._compute.staged.release(owner)

    def committed(self, group_indices) -> None:
        """The speculative updates of these sub-groups stand: the masters still staged are their compute shards'
        newest values now."""
        self._compute.staged.publish(group_indices)

    def undone(self, group_indices) -> None:
        """These sub-groups' speculative updates were undone: their staged values are never read."""
        self._compute.staged.discard_held(group_indices)

    def replaced(self, group: SubGroup) -> None:
        """``group``'s states were replaced from outside the step (a checkpoint loaded): a staged master or set
        holds no newest shards of it any more."""
        self._compute.staged.forget(group.index)

    def holds_unread(self, owner: object) -> bool:
        """Whether ``owner``'s buffers hold new compute shards the forward has not read yet."""
        return self._compute.staged.holds_unread(owner)

    def tell_when_read(self, on_read: Callable[[object], None]) -> None:
        """``on_read(owner)`` is called (on any thread) once the last unread shard in ``owner``'s buffers has been
        read."""
        self._compute.staged.on_read = on_read

    def stop_telling(self, on_read: Callable[[object], None]) -> None:
        """No more calls of ``on_read``, unless someone else's has replaced it since."""
        if self._compute.staged.on_read == on_read:
            self._compute.staged.on_read = None

    # -- the end of a step ------------------------------------------------------------
    def finish_copies(self) -> None:
        """End of a step: the next forward's gathers wait for the new compute shards' copies up, and host reads
        (the next step's copies up, checkpoints) for their copies down."""
        if not self._scratch_copy:
            return
        last = self._copies.last()
        if self._copied_down:
            # host compute shards are read by the host (checkpoints, NVMe writes); the copies are in order on one
            # stream, so this also covers any copied up this step (a split optimizer's host-stepped sub-groups)
            self._copies.host_waits(last)
            self._scratch_copy.clear()
            self._copied_down = False
        else:
            # device compute shards are gathered by the compute stream: a stream wait, the host goes on. The
            # entries stay, so the next step's kernel host-waits before it overwrites a scratch still copied up.
            self._copies.compute_waits(last)

    def _host_scratch_buffer(self) -> torch.Tensor:
        """One sub-group of host scratch for new compute shards, made on first use (states in memory have no
        staging set of their own to lend one)."""
        if self._host_scratch is None:
            self._host_scratch = self._tiers.empty("host", self._layout.largest_sub_group_numel, self._compute.dtype,
                                                   owner="compute shard scratch", pinned=self.scratch_pinned)
        return self._host_scratch

    def _wait_scratch_free(self, scratch: torch.Tensor) -> None:
        done = self._scratch_copy.pop(scratch.data_ptr(), None)
        if done is None:
            return
        if scratch is self._device_scratch:
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
