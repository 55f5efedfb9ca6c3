"""The optimizer states of the sub-groups that rest on NVMe: the staging sets
they pass through in host memory, and the two sides of their swap keys.

A swapped sub-group's states are read into a staging set, updated there by the
kernel, and written back from it; the set is reused only once its writes have
completed. Every state has two keys, ``exp_avg.3`` and ``exp_avg.3.b``: a
speculative update (an overlapped step that may still clip or overflow)
writes the side not in use, so the states it may have to return to are never
overwritten, and a committed step publishes that side. Which side is in use is
this object's alone to say (:meth:`SwappedStates.key`).
"""

from __future__ import annotations

import errno
import logging
import shutil
from dataclasses import dataclass, field

import torch

from infinity import kernels
from infinity.grads.reducer import GradReducer
from infinity.placement.layout import SubGroup
from infinity.placement.tiers import Tiers
from infinity.storage import IOHandle
from infinity.storage.stats import format_nbytes

logger = logging.getLogger(__name__)


@dataclass
class StagingSet:
    """Host buffers for one swapped sub-group in flight: its states and its new compute shards (and its gradient
    slices, where they rest on NVMe)."""

    states: dict[str, torch.Tensor]
    compute: torch.Tensor
    writes: list[IOHandle]
    grads: torch.Tensor | None = None
    """A spilled sub-group's gradient slices, read beside its states (None: no slice rests on NVMe)."""
    grads_of: int | None = None
    """The sub-group whose slices ``grads`` holds or is reading (``grad_reads``), not yet used by an update."""
    grad_reads: list[IOHandle] = field(default_factory=list)

    def read_grads(self, group: SubGroup, reducer: GradReducer) -> None:
        """Start reading a spilled sub-group's gradient slices (all final) into ``grads``."""
        self.land_grad_reads()  # reads still landing in the buffer are over before new ones start
        self.grads_of = group.index
        self.grad_reads = reducer.read_spilled(group, self.grads)

    def take_grads(self, group: SubGroup, reducer: GradReducer, grad_coef: float) -> torch.Tensor:
        """A spilled sub-group's gradient slices (read now unless read ahead), scaled by ``grad_coef`` and the
        step's own coefficient: this copy is the update's (the slices on NVMe stay as they are, should it be
        undone), used once."""
        if self.grads_of != group.index:
            self.read_grads(group, reducer)
        self.grads_of = None  # scaled below: a second update must read them again
        self.land_grad_reads()  # the kernel reads them next
        grads = self.grads[:group.numel]
        coef = grad_coef * reducer.spill_coef
        if coef != 1.0:
            grads.mul_(coef)
        return grads

    def land_grad_reads(self) -> None:
        reads, self.grad_reads = self.grad_reads, []
        for handle in reads:
            handle.wait()

    def wait_writes(self) -> None:
        """Wait for every write; the list is emptied even when one failed (its error is raised once)."""
        writes, self.writes = self.writes, []
        error = None
        for handle in writes:
            try:
                handle.wait()
            except OSError as err:
                error = error or err
        if error is not None:
            raise error


def group_states(state_dtype: str, group: SubGroup, states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``states`` cut to the sub-group's tensors (a staging set's are sized for the largest sub-group)."""
    return {spec.name: states[spec.name][:spec.numel] for spec in kernels.state_layout(state_dtype, group.numel)}


class SwappedStates:
    """The staging sets (host tier) and the swap keys of the sub-groups whose states rest on NVMe."""

    def __init__(self, store, tiers: Tiers, state_dtype: str, *, largest_numel: int, set_count: int,
                 compute_dtype: torch.dtype, compute_pinned: bool, grad_dtype: torch.dtype | None = None):
        """``grad_dtype``: each set also holds a sub-group of gradient slices read from NVMe (some rest there)."""
        self._store = store
        self._tiers = tiers
        self.state_dtype = state_dtype
        self._second_side: set[int] = set()  # sub-groups whose states live under their second keys
        self.sets: list[StagingSet] = []
        for _ in range(set_count):
            states = {t.name: tiers.empty("host", t.numel, t.dtype, owner="optimizer staging")
                      for t in kernels.state_layout(state_dtype, largest_numel)}
            compute = tiers.empty("host", largest_numel, compute_dtype, owner="optimizer staging",
                                  pinned=compute_pinned)
            grads = None if grad_dtype is None else tiers.empty("host", largest_numel, grad_dtype,
                                                                          owner="optimizer staging")
            self.sets.append(StagingSet(states, compute, [], grads))

    # -- keys ---------------------------------------------------------------
    def key(self, name: str, group: SubGroup, *, other_side: bool = False) -> str:
        """The swap key of a state: the side in use, or with ``other_side`` the one a speculative update writes."""
        second = (group.index in self._second_side) != other_side
        return f"{name}.{group.index}" + (".b" if second else "")

    def publish_other_side(self, indices) -> None:
        """Committed speculative updates: these sub-groups' states now live under their other keys."""
        self._second_side.symmetric_difference_update(indices)

    def reserve_other_sides(self, groups: list[SubGroup]) -> bool:
        """Reserve the second side of every state of ``groups`` on NVMe, where the disk has room for both sides
        (with a tenth to spare for what else goes there); False, reserving nothing, where it has not: better a
        step that overlaps less than a disk that fills up mid-run."""
        one_side = sum(spec.nbytes for group in groups for spec in kernels.state_layout(self.state_dtype, group.numel))
        free = shutil.disk_usage(self._store.directory).free
        if groups and free < 2.2 * one_side:
            logger.warning("overlapped step with clipping/fp16: %s free in %s, and undoing a speculative update on "
                           "NVMe needs the optimizer's %s of swapped states twice (%s); swapped sub-groups wait for "
                           "the global norm instead (the step is as exact, it overlaps less with backward)",
                           format_nbytes(free), self._store.directory, format_nbytes(one_side),
                           format_nbytes(2 * one_side))
            return False
        reserved = []
        try:
            for group in groups:
                for spec in kernels.state_layout(self.state_dtype, group.numel):
                    key = self.key(spec.name, group, other_side=True)
                    self._store.reserve(key, spec.nbytes)
                    reserved.append(key)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            for key in reserved:
                self._store.delete(key)
            logger.warning("overlapped step with clipping/fp16: the disk of %s filled up while the second side of the "
                           "swapped states was reserved (%s); swapped sub-groups wait for the global norm instead",
                           self._store.directory, err)
            return False
        return True

    def reserve_states(self, groups: list[SubGroup]) -> None:
        """Reserve every state of ``groups`` on the side in use now (the moments are first written at the end of
        the first step), so that a disk without room for them fails here, before any work, not mid-run."""
        for group in groups:
            for spec in kernels.state_layout(self.state_dtype, group.numel):
                self._store.reserve(self.key(spec.name, group), spec.nbytes)

    # -- moving states --------------------------------------------------------
    def read(self, group: SubGroup, staging: StagingSet, *, step: int, urgent: bool = True) -> list[IOHandle]:
        """Read the sub-group's states for step ``step`` into ``staging``; returns the reads in flight."""
        handles = []
        for name, buffer in group_states(self.state_dtype, group, staging.states).items():
            if name != "master" and step == 1:
                buffer.zero_()  # moments (codes and scales) start at zero: nothing on disk yet
                continue
            handles.append(self._store.read(self.key(name, group), buffer, urgent=urgent))
        return handles

    def write(self, group: SubGroup, staging: StagingSet, *, other_side: bool, urgent_master: bool) -> None:
        """Queue the writes of the sub-group's updated states from ``staging`` (on its set's list);
        ``urgent_master`` puts the master ahead of the queue (the next forward reads it)."""
        for name, tensor in group_states(self.state_dtype, group, staging.states).items():
            urgent = urgent_master and name == "master"
            staging.writes.append(self._store.write(self.key(name, group, other_side=other_side), tensor,
                                                    urgent=urgent))

    def write_master(self, group: SubGroup, values: torch.Tensor) -> IOHandle:
        """Write the sub-group's whole master (its first values) to the side in use."""
        return self._store.write(self.key("master", group), values)

    def read_master(self, group: SubGroup, out: torch.Tensor) -> IOHandle:
        """Read the sub-group's whole master, as the side in use holds it, into ``out``."""
        return self._store.read(self.key("master", group), out)

    def read_master_part(self, group: SubGroup, at: int, out: torch.Tensor) -> IOHandle:
        """``out``'s bytes of the sub-group's master from byte ``at`` (compute shards that rest in it)."""
        return self._store.read(self.key("master", group), out, at=at)

    def wait_writes(self) -> None:
        """Wait for every set's writes."""
        for staging in self.sets:
            staging.wait_writes()

    def close(self) -> None:
        """Wait for the writes still in flight (a failed one was raised by the step that issued it) and give the
        sets back to the host tier."""
        for staging in self.sets:
            try:
                staging.wait_writes()
            except OSError as err:
                logger.warning("closing after a failed write: %s", err)
            for tensor in staging.states.values():
                self._tiers.free("host", tensor)
            self._tiers.free("host", staging.compute)
            staging.land_grad_reads()
            if staging.grads is not None:
                self._tiers.free("host", staging.grads)
        self.sets.clear()


def kept_in_host(groups, room_nbytes: int, state_dtype: str, *, backward_order: bool,
                 max_in_cpu: int | None) -> list:
    """Of the offloaded sub-groups ``groups``, those whose states stay in host memory within ``room_nbytes``
    (and ``max_in_cpu`` elements). Every sub-group kept saves twice its state bytes (24 an element in fp32) of I/O
    per step; among those that fit, the ones the step reads first are kept (no I/O can hide their reads): the
    last sub-groups when the step runs during backward (which finishes them first), else the first ones."""
    kept, total, total_nbytes = [], 0, 0
    for group in sorted(groups, key=lambda g: -g.index if backward_order else g.index):
        nbytes = kernels.state_nbytes(state_dtype, group.numel)
        if total_nbytes + nbytes <= room_nbytes and (max_in_cpu is None or total + group.numel <= max_in_cpu):
            kept.append(group)
            total += group.numel
            total_nbytes += nbytes
    return kept
