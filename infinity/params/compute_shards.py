"""This rank's compute shards (the parameters in compute precision) and where
they rest: device memory, host memory, or NVMe with an optional host cache
(``offload_param.max_in_cpu``).

Resident shards are views of one flat buffer laid out by :class:`ShardLayout`,
so the optimizer writes a whole sub-group's new compute shards in one pass.
That buffer lives in device memory (tier ``device``) or host memory (tier
``host``, or the host cache of tier ``nvme``); :meth:`write` and
:meth:`read_to_host` take and give host values whatever the memory, crossing
through :class:`~infinity.placement.copies.Copies`.

A shard on NVMe may have no file of its own: when the optimizer's master is
the compute shard itself (a bf16 master with bf16 compute, both on NVMe), the
optimizer's update writes only the master and its delivery hands the
sub-group's shards over (:meth:`ComputeShards.rest_in_master`); from then on
they are read from the master's swap file, until something writes them again.

On NVMe, a sub-group's newest shards may still be in a host buffer of the
optimizer's after its update; :attr:`ComputeShards.staged` serves reads from
there (:mod:`infinity.params.staging`), steered by the delivery
(:class:`~infinity.params.delivery.ComputeDelivery`) on the optimizer's word.

On NVMe, the shards of persistent parameters (at most
``param_persistence_threshold`` elements: biases, norms) rest in host memory
as well, packed in a buffer of their own. Their full tensors never leave
device memory, so only the new values cross after each step, and a small
NVMe read costs as much to issue and finish as a large one (two thirds of a
GPT layer's reads are such shards, for a thousandth of its bytes).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from infinity.config.tier_names import Tier
from infinity.params.staging import StagedShards
from infinity.placement.copies import Copies
from infinity.placement.layout import ParamSlot, ShardLayout, SubGroup, packed_offsets
from infinity.placement.placement import Memory, StatePlace
from infinity.placement.tiers import Tiers
from infinity.storage import IOHandle

logger = logging.getLogger(__name__)


class ComputeShards:
    def __init__(self, layout: ShardLayout, dtype: torch.dtype, place: StatePlace, tiers: Tiers, copies: Copies, *,
                 nvme_path: str | None = None, max_in_cpu: int = 0, persistent: frozenset[int] = frozenset()):
        """``persistent``: the slot indices of persistent parameters, whose shards rest in host memory on NVMe."""
        self.layout = layout
        self.dtype = dtype
        self.tier = place.tier
        self.place = place
        self.memory = place.memory
        """Where the resident flat buffer lives (host for the ``nvme`` tier's cache)."""
        self._tiers = tiers
        self._copies = copies
        self._store = tiers.swap_store(nvme_path) if self.tier == "nvme" else None
        self._resident: dict[int, torch.Tensor] = {}
        self._read_master: Callable[[SubGroup, int, torch.Tensor], IOHandle] | None = None
        self._in_master: dict[int, tuple[SubGroup, int]] = {}
        """NVMe shards read from their sub-group's master: slot index -> (sub-group, byte offset in it)."""
        self._own_files: set[int] = set()
        """NVMe shards that have a file of their own (written, and not deleted since)."""
        self.staged = StagedShards()
        """NVMe shards whose newest values are still in a staging set of the optimizer's, read from there."""
        self._flat: torch.Tensor | None = None
        self._flat_tier = self.tier
        self._persistent_flat: torch.Tensor | None = None
        """On NVMe: the persistent shards the host cache left out, packed (tier ``host``)."""
        if self.tier != Tier.NVME:  # device or host: the whole flat buffer is resident
            self._flat = tiers.empty(self.tier, layout.total_numel, dtype, owner="compute shards",
                                     pinned=place.pinned)
            for slot in layout.slots:
                self._resident[slot.index] = self._flat[slot.offset:slot.end]
        else:
            self._cache_in_host(max_in_cpu)
            self._keep_persistent_in_host(persistent)

    def _cache_in_host(self, max_in_cpu: int) -> None:
        """Keep the first shards, up to ``max_in_cpu`` elements, in host memory instead of on NVMe."""
        cached, total = [], 0
        for slot in self.layout.slots:
            if total + slot.shard_numel > max_in_cpu:
                break
            cached.append(slot)
            total += slot.shard_numel
        if not cached:
            return
        self._flat_tier = "host"
        end = cached[-1].offset + cached[-1].shard_numel
        self._flat = self._tiers.empty("host", end, self.dtype, owner="compute shards", pinned=self.place.pinned)
        for slot in cached:
            self._resident[slot.index] = self._flat[slot.offset:slot.end]
        logger.info("offload_param.max_in_cpu: %d of %d shards (%d elements) stay in host memory",
                    len(cached), len(self.layout.slots), total)

    def _keep_persistent_in_host(self, persistent: frozenset[int]) -> None:
        """The persistent shards not in the cache rest in one more host buffer, each at an aligned offset."""
        slots = [slot for slot in self.layout.slots if slot.index in persistent and slot.index not in self._resident]
        if not slots:
            return
        offsets, total = packed_offsets([slot.shard_numel for slot in slots])
        self._persistent_flat = self._tiers.empty("host", total, self.dtype, owner="compute shards",
                                                 pinned=self.place.pinned)
        for slot, at in zip(slots, offsets):
            self._resident[slot.index] = self._persistent_flat[at:at + slot.shard_numel]
        logger.info("%d persistent shards (%d elements) rest in host memory, not on NVMe", len(slots),
                    sum(slot.shard_numel for slot in slots))

    # -- reading ----------------------------------------------------------------
    def resident(self, slot: ParamSlot) -> torch.Tensor | None:
        """The shard itself when it rests in memory, else None (it is on NVMe)."""
        return self._resident.get(slot.index)

    def resident_in_device_memory(self, slot: ParamSlot) -> bool:
        return self.memory is Memory.DEVICE and slot.index in self._resident

    def read(self, slot: ParamSlot, out: torch.Tensor) -> IOHandle:
        """Swap in a shard that rests on NVMe (into host ``out``): from a staging set that still holds its newest
        values, else from its own file or from its sub-group's master."""
        in_master = self._in_master.get(slot.index)
        if in_master is not None and slot.index in self._own_files:
            # Its own copy is out of date since the update that handed it over: its bytes go back to the disk.
            # Here, on the thread that reads the shards, so no read of the copy can start after the delete.
            self._own_files.discard(slot.index)
            self._store.delete(self._key(slot))
        group = self.layout.group_of_slot.get(slot.index)  # (none for a frozen parameter: no optimizer state)
        if group is not None and self.staged.copy(group.index, slot.index, slot.offset - group.start, out):
            return IOHandle()  # copied: nothing in flight
        if in_master is None:
            return self._store.read(self._key(slot), out)
        group, at = in_master
        return self._read_master(group, at, out)

    def read_to_host(self, slot: ParamSlot, out_host: torch.Tensor) -> None:
        """Copy a shard's values into a host tensor, from whichever tier it rests in (blocking)."""
        resident = self._resident.get(slot.index)
        if resident is None:
            self.read(slot, out_host).wait()
        elif self.memory is Memory.DEVICE:
            self._copies.host_waits(self._copies.to_host(resident, out_host))  # the caller reads it next
        else:
            out_host.copy_(resident)

    # -- writing ----------------------------------------------------------------
    def write(self, slot: ParamSlot, values: torch.Tensor) -> IOHandle | None:
        """Replace a shard's values with host ``values``; returns a handle to wait on when the write goes to NVMe."""
        resident = self._resident.get(slot.index)
        if resident is not None:
            if resident.data_ptr() == values.data_ptr():
                return None
            if self.memory is Memory.DEVICE:
                # the caller may reuse `values` as soon as this returns (initialize, checkpoint load)
                self._copies.host_waits(self._copies.to_device(values, resident))
            else:
                resident.copy_(values)
            return None
        self._in_master.pop(slot.index, None)  # its values are these now, not the master's (loading, restoring)
        group = self.layout.group_of_slot.get(slot.index)
        if group is not None:
            self.staged.forget(group.index)  # nor those of a staging set
        self._own_files.add(slot.index)
        # urgent: the next forward reads it back first thing; the optimizer's state writes can wait
        return self._store.write(self._key(slot), values, urgent=True)

    # -- shards that are the optimizer's master ---------------------------------------
    def can_rest_in_master(self, group: SubGroup, master_dtype: torch.dtype) -> bool:
        """Whether ``group``'s shards on NVMe could be read from a master of ``master_dtype`` on NVMe: they are
        in that very dtype, and some rest on NVMe. Those in host memory are copied from the master by the update
        (:meth:`write_resident_from_master`)."""
        return (self.tier == Tier.NVME and master_dtype == self.dtype
                and any(slot.index not in self._resident for slot in group.slots))

    def resident_slots(self, group: SubGroup) -> list[ParamSlot]:
        """``group``'s shards that rest in memory."""
        return [slot for slot in group.slots if slot.index in self._resident]

    def write_resident_from_master(self, group: SubGroup, master: torch.Tensor) -> None:
        """The resident shards of a sub-group whose master holds the compute shards' bits (host ``master``, the
        whole sub-group's): copied from it. Those on NVMe are read from the master itself."""
        for slot in self.resident_slots(group):
            start = slot.offset - group.start
            self.write(slot, master[start:start + slot.shard_numel])

    def read_masters_with(self, read_master: Callable[[SubGroup, int, torch.Tensor], IOHandle]) -> None:
        """The optimizer's way to read part of a sub-group's master: ``read_master(group, at, out)`` reads
        ``out``'s bytes from byte ``at`` of it, ordered after the master's writes in flight."""
        self._read_master = read_master

    def rest_in_master(self, group: SubGroup) -> None:
        """``group``'s master now holds its compute shards' values (an update that wrote no copy of them):
        read them from it from now on. The delivery calls this before the shards are next fetched."""
        if self._read_master is None:
            raise RuntimeError("compute shards handed to a master nobody said how to read (read_masters_with)")
        element_size = torch.empty((), dtype=self.dtype).element_size()
        for slot in group.slots:
            if slot.index in self._resident:
                continue  # the update copied it from the master (write_resident_from_master)
            self._in_master[slot.index] = (group, (slot.offset - group.start) * element_size)

    def keep_staged(self, group: SubGroup, values: torch.Tensor, owner: object, *, speculative: bool = False) -> None:
        """``group``'s newest shards are ``values`` (host, its flat range), in a buffer of ``owner``'s: those on
        NVMe are copied from there until ``owner`` releases it (:class:`~infinity.params.staging.StagedShards`)."""
        on_nvme = [slot.index for slot in group.slots if slot.index not in self._resident]
        self.staged.keep(group.index, values, owner, on_nvme, speculative=speculative)

    def sub_group_view(self, group: SubGroup) -> torch.Tensor | None:
        """The resident flat range of a sub-group, when every shard of it rests in the flat buffer."""
        if self._flat is None or self.tier == "nvme":
            return None
        return self._flat[group.start:group.end]

    @staticmethod
    def _key(slot: ParamSlot) -> str:
        return f"param.{slot.index}"

    def nbytes_resident(self) -> int:
        return sum(flat.numel() * flat.element_size() for flat in (self._flat, self._persistent_flat)
                   if flat is not None)

    def close(self) -> None:
        if self._flat is not None:
            self._tiers.free(self._flat_tier, self._flat)
            self._flat = None
        if self._persistent_flat is not None:
            self._tiers.free("host", self._persistent_flat)
            self._persistent_flat = None
        self._resident.clear()
        self.staged.clear()
