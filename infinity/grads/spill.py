"""Gradient slices that rest on NVMe between backward and the step.

Where the host-memory budget cannot hold every gradient slice (a 6.7B model's bf16 slices are 13.4 GB), the
host-memory plan puts the slices of the last sub-groups on NVMe (:attr:`Placement.nvme_grads_from
<infinity.placement.placement.Placement.nvme_grads_from>`), sub-groups whose states rest there too. Their
gradients then never take host memory beyond a few buffers:

* the backward hook hands each reduced slice to :meth:`GradSpill.submit`, which copies it into one of a few
  buffers (down from the device where there is one) and queues it;
* a worker writes it under the slot's own key (``grad.<slot>``); a micro-batch after the step's first adds the
  partial sum read back from NVMe first; the step's last takes the slot's squared norm on the way (the global
  norm then costs no pass over the disk);
* the optimizer reads a sub-group's slots into its staging set beside its states (:meth:`GradSpill.read`),
  after the worker has written them all (:meth:`GradSpill.wait_group`).

Bytes per element a step: the slice written once per micro-batch and read once by the step (and read once more
per micro-batch after the first, to add to). The buffers count against the host budget; the keys are reserved on
NVMe at start, so a disk without room fails before any work.
"""

from __future__ import annotations

import logging
import queue
import threading

import torch

from infinity.grads.norm import sq_norm_fp64
from infinity.placement.copies import Copies, CopyDone
from infinity.placement.host_budget import GRAD_SPILL_SLICES
from infinity.placement.layout import ParamSlot, ShardLayout, SubGroup
from infinity.placement.placement import Placement
from infinity.placement.tiers import Tiers
from infinity.storage import IOHandle

logger = logging.getLogger(__name__)

class GradSpill:
    """The spilled sub-groups' gradient slices: their NVMe keys, the pool they pass through, their norms."""

    def __init__(self, store, layout: ShardLayout, placement: Placement, tiers: Tiers, copies: Copies, *,
                 grad_dtype: torch.dtype):
        """``store``: the optimizer's swap store. Slices that are not lossless (fp32: several micro-batches a step,
        or fp16) may be added to: a buffer for the partial sums read back is kept
        (:func:`~infinity.placement.host_budget.spill_pool_nbytes` counts the same)."""
        self._store = store
        self._copies = copies
        self._host_cores = placement.host_cores  # the worker's norms: the CPU Adam's team, on its cores
        self._tiers = tiers
        self.grad_dtype = grad_dtype
        self.first_group = placement.nvme_grads_from
        self.groups = layout.sub_groups[self.first_group:]
        self._group_of_slot = {s.index: g.index for g in self.groups for s in g.slots}
        itemsize = torch.empty((), dtype=grad_dtype).element_size()
        largest = max(s.shard_numel for g in self.groups for s in g.slots)
        # A few buffers of the largest slice, made once and counted in the host tier from the start.
        self._free: "queue.Queue[torch.Tensor]" = queue.Queue()
        for _ in range(GRAD_SPILL_SLICES):
            self._free.put(tiers.empty("host", largest, grad_dtype, owner="gradient spill buffers",
                                        pinned=placement.grads.pinned))
        self._partial = None if placement.grads_lossless else tiers.empty("host", largest, grad_dtype,
                                                                                 owner="gradient spill buffers")
        for group in self.groups:  # a disk without room for them fails here, before any work
            for slot in group.slots:
                store.reserve(self.key(slot), slot.shard_numel * itemsize)
        self._sq_norms: dict[int, float] = {}  # slot -> squared norm of its final gradient this step (worker's)
        self._cond = threading.Condition()      # guards _pending and _error
        self._pending: dict[int, int] = {}      # sub-group -> jobs queued or running
        self._error: BaseException | None = None
        self._jobs: "queue.Queue[tuple | None]" = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="infinity-grad-spill", daemon=True)
        self._worker.start()
        logger.info("gradient slices of %d sub-groups (%d elements) rest on NVMe between backward and the step",
                    len(self.groups), sum(g.numel for g in self.groups))

    @staticmethod
    def key(slot: ParamSlot) -> str:
        return f"grad.{slot.index}"

    def holds(self, slot: ParamSlot) -> bool:
        return slot.index in self._group_of_slot

    # -- backward's side --------------------------------------------------------
    def submit(self, slot: ParamSlot, shard: torch.Tensor | None, *, add: bool, final: bool) -> None:
        """Queue ``slot``'s reduced slice (``None``: zeros, a slot that got no gradient) to be written, added to
        the partial sum on NVMe when ``add``; ``final``: the step's last micro-batch (its norm is taken)."""
        # blocks only when the worker is GRAD_SPILL_SLICES slices behind: it gives buffers back as writes land
        buffer = self._free.get()
        staged = buffer[:slot.shard_numel]
        done = None
        if shard is None:
            staged.zero_()
        elif shard.device.type == "cpu" and not self._copies.distinct:
            staged.copy_(shard)  # the device is the host: converted (to fp32 when accumulating) as it is copied
        else:
            if shard.dtype != self.grad_dtype:
                shard = shard.to(self.grad_dtype)  # converted on the device: the crossing moves the slices' bytes
            done = self._copies.to_host(shard, staged)
        group = self._group_of_slot[slot.index]
        with self._cond:
            self._pending[group] = self._pending.get(group, 0) + 1
        self._jobs.put((slot, group, buffer, staged, done, add, final))

    def finalize(self, slot: ParamSlot) -> None:
        """The step's last micro-batch gave ``slot`` nothing: its norm is the partial sum's, read back."""
        group = self._group_of_slot[slot.index]
        with self._cond:
            self._pending[group] = self._pending.get(group, 0) + 1
        self._jobs.put((slot, group, None, None, None, False, True))

    # -- the worker ---------------------------------------------------------------
    def _run(self) -> None:
        self._host_cores.bind_this_thread()  # off the core that feeds the GPU, as the engine's other updaters
        while (job := self._jobs.get()) is not None:
            slot, group, buffer, staged, done, add, final = job
            try:
                if self._error is None:
                    self._spill(slot, staged, done, add, final)
            except BaseException as err:  # raised to the optimizer by wait_group
                with self._cond:
                    self._error = self._error or err
            finally:
                if buffer is not None:
                    self._free.put(buffer)
                with self._cond:
                    self._pending[group] -= 1
                    self._cond.notify_all()

    def _spill(self, slot: ParamSlot, staged: torch.Tensor | None, done: CopyDone | None, add: bool,
               final: bool) -> None:
        if staged is None:  # finalize: the norm of what is on NVMe
            partial = self._partial[:slot.shard_numel]
            self._store.read(self.key(slot), partial).wait()
            self._sq_norms[slot.index] = sq_norm_fp64(partial, num_threads=self._host_cores.threads)
            return
        if done is not None:
            self._copies.host_waits(done)  # the slice is read (added, normed, written) next
        if add:
            # A lossless slice is added to only for a parameter in two graphs of one backward: rare, so its partial
            # sum gets a buffer of its own for the moment.
            partial = (self._partial[:slot.shard_numel] if self._partial is not None
                       else self._tiers.empty("host", slot.shard_numel, self.grad_dtype,
                                                 owner="gradient spill buffers"))
            self._store.read(self.key(slot), partial).wait()  # the sum so far: added to before it is written
            staged.add_(partial)
            if self._partial is None:
                self._tiers.free("host", partial)
        if final:
            self._sq_norms[slot.index] = sq_norm_fp64(staged, num_threads=self._host_cores.threads)
        # The buffer goes back to the pool once its bytes are on disk.
        self._store.write(self.key(slot), staged).wait()

    # -- the optimizer's side -----------------------------------------------------
    def wait_group(self, group: SubGroup) -> None:
        """Until every slice of ``group`` queued so far is on NVMe (a failure is raised here)."""
        with self._cond:
            while self._pending.get(group.index, 0) and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error

    def wait_all(self) -> None:
        for group in self.groups:
            self.wait_group(group)

    def sq_norm(self, group: SubGroup) -> float:
        """The squared norm of ``group``'s final gradients: its slots' terms summed in slot order."""
        self.wait_group(group)
        return sum(self._sq_norms.get(slot.index, 0.0) for slot in group.slots)

    def read(self, group: SubGroup, out: torch.Tensor) -> list[IOHandle]:
        """Read ``group``'s slices into ``out`` (the sub-group's flat space; the padding between slots zeroed),
        once they are all written; returns the reads in flight."""
        self.wait_group(group)
        out = out[:group.numel]
        reads, at = [], group.start
        for slot in group.slots:
            if slot.offset > at:
                out[at - group.start:slot.offset - group.start].zero_()
            reads.append(self._store.read(self.key(slot), out[slot.offset - group.start:slot.end - group.start]))
            at = slot.end
        if group.end > at:
            out[at - group.start:].zero_()
        return reads

    def step_done(self) -> None:
        """A step took the gradients: the next backward's norms are its own."""
        self._sq_norms.clear()

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join()
        while not self._free.empty():
            self._tiers.free("host", self._free.get())
        if self._partial is not None:
            self._tiers.free("host", self._partial)
            self._partial = None
