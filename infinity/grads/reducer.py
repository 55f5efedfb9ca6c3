"""Gradient reduction: a parameter's full gradient, once autograd has finished
accumulating it, is reduce-scattered on the device (mean over ranks) and this
rank's slice travels to the optimizer's buffer by the route the
:class:`~infinity.placement.placement.Placement` chose. The full gradient is freed at once.

The reducer owns every gradient buffer: the optimizer's slices (``slices``, in
the optimizer's memory), the fp32 device accumulator, and the pinned ring of
the host route. The optimizer reads a sub-group's slices through
:meth:`wait_sub_group`, which waits for that sub-group's crossings only.

Routes (nothing pageable and nothing synchronous inside the backward hook):

* ``IN_PLACE``: the slices are in the memory the gradient is reduced in; the
  hook copies or adds into them.
* ``DIRECT_TO_HOST`` (one micro-batch a step): each slice is copied down as
  soon as it is reduced.
* ``DEVICE_THEN_HOST``: micro-batches add into an fp32 device accumulator; the
  step's last micro-batch copies each finished slice down once.
* ``HOST_RING``: each micro-batch's slice is copied down into a pinned ring
  buffer and a worker adds it into the host accumulator, off the hook.

Slices the host-memory budget cannot hold (:attr:`Placement.nvme_grads_from`: the last sub-groups') rest on NVMe
between backward and the step, whatever the route: the hook hands them to :class:`~infinity.grads.spill.GradSpill`,
which writes them there (adding to the partial sum of the earlier micro-batches), and the optimizer reads them back
with its states (``slices`` then ends where they begin).

A split optimizer (:attr:`Placement.device_sub_groups`) steps its first sub-groups on the device: their
slices (``device_slices``, the trainable flat space up to :attr:`Placement.device_numel`) are reduced
``IN_PLACE`` in device memory and never cross; the route applies to the others (``slices`` then holds the
rest of the flat space, from ``device_numel`` on).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Protocol

import torch

from infinity.grads.norm import sq_norm_fp64
from infinity.grads.spill import GradSpill
from infinity.placement.copies import Copies, CopyDone
from infinity.placement.layout import ParamSlot, ShardLayout, SubGroup
from infinity.placement.placement import RING_SLICES, GradRoute, Placement
from infinity.placement.tiers import Tiers
from infinity.runtime.comm import Collectives
from infinity.runtime.host_cores import HostCores
from infinity.storage import HostBufferPool, IOHandle

logger = logging.getLogger(__name__)



class FinalGradSink(Protocol):
    """Told, during the step's last backward, of each slot whose gradient is final (the overlapped step)."""

    def slot_final(self, slot: ParamSlot) -> None: ...


class GradReducer:
    def __init__(self, layout: ShardLayout, placement: Placement, tiers: Tiers, copies: Copies, comm: Collectives,
                 slot_of_param: dict[int, int], *, compute_dtype: torch.dtype, spill: GradSpill | None = None):
        """Gradient slices keep ``compute_dtype`` where the placement says they are lossless, else they are fp32;
        ``spill`` holds those of the sub-groups from :attr:`Placement.nvme_grads_from` on (None: no slice is on
        NVMe)."""
        grad_dtype = compute_dtype if placement.grads_lossless else torch.float32
        self.layout = layout
        self.route = placement.grad_route
        self._tiers = tiers
        self._copies = copies
        self._comm = comm
        self._slot_of_param = slot_of_param
        self._slices_tier = "device" if placement.grads.tier == "device" else "host"
        self._split = placement.device_numel  # a split optimizer's device slices end here (0: no split)
        self._norm_threads = placement.host_cores.threads  # the norms are the host step's: its team
        self.spill = spill
        self._memory_end = (layout.trainable_numel if placement.nvme_grads_from is None
                            else layout.sub_groups[placement.nvme_grads_from].start)  # NVMe's slices begin here
        self.slices = tiers.empty(self._slices_tier, self._memory_end - self._split, grad_dtype,
                                  owner="gradient slices", pinned=placement.grads.pinned, optimizer_share=True)
        """The optimizer's gradient slices in memory, in the trainable flat space (from ``device_numel`` on when
        split, up to where those on NVMe begin)."""
        self._spill_coef = 1.0  # what the spilled slices are to be scaled by as the optimizer reads them (scale)
        self.slices.zero_()
        self.device_slices: torch.Tensor | None = None
        """A split optimizer's device sub-groups' slices, reduced in place (the flat space up to ``device_numel``)."""
        if self._split:
            self.device_slices = tiers.empty("device", self._split, grad_dtype, owner="gradient slices",
                                             optimizer_share=True)
            self.device_slices.zero_()
        self.received: set[int] = set()  # slots with a gradient this micro-batch
        # What the StepCycle said of the running backward (begin_backward): its gradients start the step's
        # accumulation (they overwrite) / are the step's last (final as they arrive), and who is told so.
        self._fresh = True
        self._boundary = True
        self._final_sink: "FinalGradSink | None" = None
        self._crossed: set[int] = set()           # slots copied down this step (DEVICE_THEN_HOST)
        self._landing: dict[int, object] = {}     # slot -> its latest crossing (CopyDone or _Added) this step
        self._device_acc: torch.Tensor | None = None
        self._ring: HostBufferPool | None = None
        self._adder: _HostAdder | None = None
        if self.route is GradRoute.DEVICE_THEN_HOST:
            self._device_acc = tiers.empty("device", layout.trainable_numel - self._split, torch.float32,
                                           owner="gradient accumulator")
            self._device_acc.zero_()
        elif self.route is GradRoute.HOST_RING and self._memory_end > self._split:
            slice_nbytes = layout.largest_shard_numel * torch.empty((), dtype=compute_dtype).element_size()
            self._ring = HostBufferPool(RING_SLICES * max(slice_nbytes, 4096), pin=placement.grads.pinned,
                                        stats=tiers.stats["host"], pinner=tiers.pinner, owner="gradient ring")
            self._adder = _HostAdder(copies, self._ring, placement.host_cores)
        logger.debug("gradient route: %s", self.route.value)

    # -- one micro-batch's backward (told by the StepCycle) --------------------------
    def begin_backward(self, *, fresh: bool, boundary: bool, final_sink: "FinalGradSink | None" = None) -> None:
        """Before a micro-batch's backward: whether its gradients start the step's accumulation (``fresh``: they
        overwrite the slices, else add) and whether they are the step's last (``boundary``); ``final_sink``
        (the overlapped step) is told of each slot whose gradient is then final."""
        self._fresh, self._boundary, self._final_sink = fresh, boundary, final_sink
        if fresh:
            # the last step's updates (those behind the forward too) have landed: its coefficient is spent
            self._spill_coef = 1.0

    def abort_backward(self) -> bool:
        """The backward raised: nothing more is final for anyone, and the next backward starts a fresh
        accumulation (it overwrites the slots it reaches and zeroes the others). Returns whether that loses
        nothing: true for a fresh backward, false for one that added into the step's accumulation (the
        earlier micro-batches' gradients are then dropped with its partial sums)."""
        self._final_sink = None
        exact = self._fresh or not self.received
        self.wait_all()  # its crossings land now, not into slices the next backward writes or zeroes
        self.zero()
        return exact

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: reduce this parameter's gradient and free it."""
        slot = self.layout.slots[self._slot_of_param[id(param)]]
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        shard = self._reduce(grad, slot)
        first = self._fresh and slot.index not in self.received
        if self.route is GradRoute.DEVICE_THEN_HOST and slot.offset >= self._split:
            acc = self._device_acc[slot.offset - self._split:slot.end - self._split]
            acc.copy_(shard) if first else acc.add_(shard)
            if self._boundary:
                self._cross_accumulated(slot)
        elif self._spilled(slot):
            self.spill.submit(slot, shard, add=not first, final=self._boundary)
        else:
            self._to_memory(slot, shard, first)
        self.received.add(slot.index)
        if self._final_sink is not None:
            self._final_sink.slot_final(slot)

    def _spilled(self, slot: ParamSlot) -> bool:
        """``slot``'s gradient slices rest on NVMe between backward and the step."""
        return slot.offset >= self._memory_end

    def _to_memory(self, slot: ParamSlot, shard: torch.Tensor, first: bool) -> None:
        """A slot whose slices are in memory: ``shard`` goes (or is added) into them by the route."""
        target = self._view(slot.offset, slot.end)
        if self._route_of(slot) is GradRoute.IN_PLACE:
            target.copy_(shard) if first else target.add_(shard)
        elif self.route is GradRoute.DIRECT_TO_HOST:
            self._copy_down(slot, shard, target, first)
        else:
            self._landing[slot.index] = self._adder.submit(shard, target, add=not first)

    def _route_of(self, slot: ParamSlot) -> GradRoute:
        """A split optimizer's device sub-groups are reduced in place; the others take the placement's route."""
        return GradRoute.IN_PLACE if slot.offset < self._split else self.route

    def _view(self, start: int, end: int) -> torch.Tensor:
        """The slices of ``[start, end)`` of the trainable flat space (one sub-group's or one slot's at most)."""
        if start < self._split:
            return self.device_slices[start:end]
        return self.slices[start - self._split:end - self._split]

    def _reduce(self, grad: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """This rank's slice of the mean gradient over ranks, on the device."""
        flat = grad.reshape(-1)
        if slot.padded_numel != slot.numel:
            padded = flat.new_zeros(slot.padded_numel)
            padded[:slot.numel].copy_(flat)
            flat = padded
        if self._comm.world_size == 1:
            return flat
        shard = flat.new_empty(slot.shard_numel)
        self._comm.reduce_scatter_mean(shard, flat)
        return shard

    def _cross_accumulated(self, slot: ParamSlot) -> None:
        """DEVICE_THEN_HOST: the slot's accumulated gradient goes down, once this step."""
        split = self._split
        accumulated = self._device_acc[slot.offset - split:slot.end - split]
        if self._spilled(slot):
            self.spill.submit(slot, accumulated, add=False, final=True)
        else:
            self._landing[slot.index] = self._copies.to_host(accumulated, self._view(slot.offset, slot.end))
        self._crossed.add(slot.index)

    def _copy_down(self, slot: ParamSlot, shard: torch.Tensor, target: torch.Tensor, first: bool) -> None:
        """DIRECT_TO_HOST: the reduced slice crosses as it is (converted on the device first if need be)."""
        if shard.dtype != target.dtype:
            shard = shard.to(target.dtype)
        if first:
            self._landing[slot.index] = self._copies.to_host(shard, target)
            return
        # A second gradient for the slot within one micro-batch (a parameter in two graphs): rare, so it is
        # added on the host here, after its first crossing has landed.
        self._copies.host_waits(self._landing.pop(slot.index))
        extra = torch.empty_like(target)
        self._copies.host_waits(self._copies.to_host(shard, extra))  # the add below reads it
        target.add_(extra)

    def end_backward(self) -> None:
        """Gradients of slots that got none this micro-batch are zero (on a fresh accumulation); at the step's
        boundary every slot not yet copied down goes down now."""
        self._final_sink = None
        if self._fresh:
            for slot in self.layout.slots:
                if slot.trainable and slot.index not in self.received:
                    self._zero_slot(slot)
        elif self._boundary and self.spill is not None and self.route is not GradRoute.DEVICE_THEN_HOST:
            for slot in self.layout.slots:  # their final gradient is the earlier micro-batches' sum, on NVMe
                if slot.trainable and slot.index not in self.received and self._spilled(slot):
                    self.spill.finalize(slot)
        if self._boundary and self.route is GradRoute.DEVICE_THEN_HOST:
            for slot in self.layout.slots:
                if slot.trainable and slot.index not in self._crossed and slot.offset >= self._split:
                    self._cross_accumulated(slot)
        self.received.clear()

    def _zero_slot(self, slot: ParamSlot) -> None:
        if self._route_of(slot) is GradRoute.DEVICE_THEN_HOST:
            self._device_acc[slot.offset - self._split:slot.end - self._split].zero_()
        elif self._spilled(slot):
            self.spill.submit(slot, None, add=False, final=self._boundary)
        else:
            # no crossing into this slot is pending: it received nothing since the last step
            self._view(slot.offset, slot.end).zero_()

    # -- the optimizer's side ---------------------------------------------------
    def on_nvme(self, group: SubGroup) -> bool:
        """``group``'s slices rest on NVMe: the optimizer reads them with :meth:`read_spilled`."""
        return group.start >= self._memory_end and group.numel > 0

    def read_spilled(self, group: SubGroup, out: torch.Tensor) -> list[IOHandle]:
        """Read a spilled sub-group's slices into ``out`` once written; returns the reads in flight. What they read
        is still to be scaled by :attr:`spill_coef` (see :meth:`scale`)."""
        return self.spill.read(group, out)

    @property
    def spill_coef(self) -> float:
        """The coefficient :meth:`scale` gave this step, still to be applied to the spilled slices as read."""
        return self._spill_coef

    def scale(self, coef: float) -> None:
        """A step nothing will undo any more scales its gradients by ``coef``: the slices in memory in place, once
        landed; those on NVMe as the optimizer reads them."""
        # Kept until the next step's first backward: the updates behind the next forward read the spilled slices.
        self._spill_coef = coef
        if coef == 1.0:
            return
        for slices in self.wait_all():
            slices.mul_(coef)

    def wait_sub_group(self, group: SubGroup) -> torch.Tensor:
        """The sub-group's slices, once every crossing into them has landed (any thread may call this); not for a
        spilled sub-group (:meth:`read_spilled`)."""
        if self.on_nvme(group):
            raise RuntimeError(f"internal error: sub-group {group.index}'s gradient slices rest on NVMe")
        for slot in group.slots:
            landing = self._landing.pop(slot.index, None)
            if isinstance(landing, CopyDone):
                self._copies.host_waits(landing)  # the optimizer reads these host slices next
            elif landing is not None:
                landing.wait()
        return self._view(group.start, group.end)

    def sub_group_sq_norm(self, group: SubGroup) -> float:
        """The squared norm of one sub-group's gradients, in fp64 (finite exactly when every gradient is)."""
        if self.on_nvme(group):
            return self.spill.sq_norm(group)  # taken as each slice was written
        return sq_norm_fp64(self.wait_sub_group(group), num_threads=self._norm_threads)

    def sq_norm(self) -> float:
        """This rank's squared gradient norm: the sub-groups' terms summed in their order (as
        :meth:`OverlappedStep.sq_norm` sums those it took as backward finished each), so both kinds of step
        agree to the bit."""
        return sum(self.sub_group_sq_norm(group) for group in self.layout.sub_groups)

    def wait_all(self) -> tuple[torch.Tensor, ...]:
        """Every slice, landed (before the global norm or the overflow check reads them all): the flat tensors
        that hold them (the device's and the host's with a split optimizer)."""
        for group in self.layout.sub_groups:
            if self.on_nvme(group):
                self.spill.wait_group(group)
            else:
                self.wait_sub_group(group)
        return (self.slices,) if self.device_slices is None else (self.device_slices, self.slices)

    def zero(self) -> None:
        """After a step: the next micro-batch starts a fresh accumulation. The slices are not cleared: a fresh
        backward overwrites every trainable slot it reaches and zeroes the others (end_backward), so a pass
        over every gradient each step (52 GB at 13B) would only be overwritten."""
        self.received.clear()
        self._crossed.clear()
        self._landing.clear()
        if self.spill is not None:
            self.spill.step_done()

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None
        if self._adder is not None:
            self._adder.close()
            self._adder = None
        if self._device_acc is not None:
            self._tiers.free("device", self._device_acc)
            self._device_acc = None
        if self.slices is not None:
            self._tiers.free(self._slices_tier, self.slices, optimizer_share=True)
            self.slices = None
        if self.device_slices is not None:
            self._tiers.free("device", self.device_slices, optimizer_share=True)
            self.device_slices = None


class _Added:
    """One slice's add on the host, done by the adder; waited on by the optimizer."""

    __slots__ = ("event", "error")

    def __init__(self):
        self.event = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        self.event.wait()
        if self.error is not None:
            raise self.error


class _HostAdder:
    """HOST_RING: copies a slice down into a ring buffer, then a worker adds it into the host accumulator."""

    def __init__(self, copies: Copies, ring: HostBufferPool, host_cores: HostCores):
        self._copies = copies
        self._ring = ring
        self._host_cores = host_cores  # its adds are the host's share of the step: off the core that feeds the GPU
        self._jobs: "queue.Queue[tuple | None]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="infinity-grad-adder", daemon=True)
        self._thread.start()

    def submit(self, shard: torch.Tensor, target: torch.Tensor, *, add: bool) -> _Added:
        nbytes = shard.numel() * shard.element_size()
        # blocks only when the adder is RING_SLICES slices behind: it gives buffers back as it adds
        buffer = self._ring.acquire(nbytes)
        staged = buffer[:nbytes].view(shard.dtype)
        done = self._copies.to_host(shard, staged)
        added = _Added()
        self._jobs.put((done, buffer, staged, target, add, added))
        return added

    def _run(self) -> None:
        self._host_cores.bind_this_thread()
        while (job := self._jobs.get()) is not None:
            done, buffer, staged, target, add, added = job
            try:
                self._copies.host_waits(done)  # the add reads the staged slice
                target.add_(staged) if add else target.copy_(staged)
            except BaseException as err:  # handed to the optimizer by _Added.wait
                added.error = err
            finally:
                self._ring.release(buffer)
                added.event.set()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
