"""Compute shards whose newest values are still in a host buffer of the
optimizer's, read from there instead of NVMe.

An update of a sub-group whose states rest on NVMe leaves its new compute shards
in a staging set (the bf16 master itself when the shards are read from it, else
the set's compute buffer) while they are written out. The next forward reads
them back from the disk, first the sub-groups the update made last: backward
finishes the last layers first, so the sets still hold the first layers when
the forward begins. Until a set is reused, its bytes are the newest shards,
the same bits as the file, and a fetch copies them from memory: no NVMe read,
and no wait on the disk at the forward's start.

The optimizer's word, through the new shards' owner (:class:`~infinity.params.delivery.ComputeDelivery`),
says what a set holds (:meth:`StagedShards.keep`) and, before the optimizer
overwrites a set, that it is no longer readable (:meth:`StagedShards.release`).
A speculative update's master (the other side of its keys, see
:mod:`infinity.optim.overlapped_step`) is held back until the step commits
(:meth:`StagedShards.publish`). The next step reads states ahead into the same
sets from its forward on; it leaves a set alone while it holds shards nobody
has read yet (:meth:`StagedShards.holds_unread`), and is told when the last of
them has been read (``on_read``), so the forward reads them first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class _Entry:
    values: torch.Tensor
    owner: object
    unread: set[int] = field(default_factory=set)
    """Slot indices not read from it yet."""


class StagedShards:
    """Sub-group index -> the sub-group's newest compute shards (flat from its start) and the buffer owning them."""

    def __init__(self):
        # Fetches copy on the main and prefetch threads; the optimizer's worker reuses sets: a set is released
        # only once no copy out of it runs (the copy happens under the lock).
        self._lock = threading.Lock()
        self._readable: dict[int, _Entry] = {}
        self._held: dict[int, _Entry] = {}
        """Speculative values: readable once their step commits."""
        self.on_read: Callable[[object], None] | None = None
        """Told the owner whose last unread shard was just read (off the lock)."""
        self.hits = 0
        """Shards served from a staging set instead of NVMe (tests and metrics)."""
        self.hit_nbytes = 0

    def keep(self, group_index: int, values: torch.Tensor, owner: object, slots, *,
             speculative: bool = False) -> None:
        """``values`` (host, the sub-group's whole flat range) are its newest shards, in ``owner``'s buffers;
        ``slots``: the indices of those that are read from NVMe. ``speculative``: readable only once
        :meth:`publish` says the update stands."""
        entry = _Entry(values, owner, set(slots))
        with self._lock:
            if speculative:  # until then the newest are what was readable before (the disk's current side)
                self._held[group_index] = entry
            else:
                self._readable[group_index] = entry
                self._held.pop(group_index, None)

    def publish(self, group_indices) -> None:
        """The speculative updates of these sub-groups stand: their held values are the newest."""
        with self._lock:
            for index in group_indices:
                entry = self._held.pop(index, None)
                if entry is not None:
                    self._readable[index] = entry

    def discard_held(self, group_indices) -> None:
        """These sub-groups' speculative updates were undone: their held values are never read."""
        with self._lock:
            for index in group_indices:
                self._held.pop(index, None)

    def forget(self, group_index: int) -> None:
        """The sub-group's shards were written some other way (restored, loaded): read them from NVMe."""
        with self._lock:
            self._readable.pop(group_index, None)
            self._held.pop(group_index, None)

    def release(self, owner: object) -> None:
        """``owner``'s buffers are about to be overwritten: whatever they held is read from NVMe from now on."""
        with self._lock:
            for entries in (self._readable, self._held):
                for index in [i for i, e in entries.items() if e.owner is owner]:
                    del entries[index]

    def holds_unread(self, owner: object) -> bool:
        """Whether ``owner``'s buffers hold readable shards not read yet."""
        with self._lock:
            return any(e.owner is owner and e.unread for e in self._readable.values())

    def copy(self, group_index: int, slot_index: int, start: int, out: torch.Tensor) -> bool:
        """Copy ``out.numel()`` elements of the sub-group's staged shards from element ``start`` (slot
        ``slot_index``'s) into host ``out``; False when nothing readable is staged for it."""
        with self._lock:
            entry = self._readable.get(group_index)
            if entry is None:
                return False
            out.copy_(entry.values[start:start + out.numel()])
            self.hits += 1
            self.hit_nbytes += out.numel() * out.element_size()
            # the owner's last unread shard (a set holds one sub-group: it is released before it is reused)
            last = entry.unread == {slot_index}
            entry.unread.discard(slot_index)
        if last and self.on_read is not None:
            self.on_read(entry.owner)
        return True

    def clear(self) -> None:
        with self._lock:
            self._readable.clear()
            self._held.clear()
