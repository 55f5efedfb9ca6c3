"""The optimizer over this rank's shards: fp32 master and Adam moments in the
optimizer's tier, updated one sub-group at a time where they rest — by the
fused CPU kernel for host and NVMe states, by the device's Adam for device
states — which also writes the new compute shards in the same pass. The
gradient slices belong to the :class:`~infinity.grads.reducer.GradReducer`;
the optimizer waits for a sub-group's slices to land before updating it.

The new compute shards are handed to one owner, :class:`~infinity.params.delivery.ComputeDelivery`
(:attr:`OffloadOptimizer.delivery`): it says where the kernel writes them, takes
them to their tier (in place, across by copy, or to NVMe), and serves the next
forward from the staging sets they are still in. The optimizer tells it what it
does to those sets: about to overwrite one, an update committed or undone,
states replaced by a checkpoint.

Where each sub-group's states rest is decided and allocated once by
:class:`~infinity.optim.states.OptimizerStates` (:attr:`OffloadOptimizer.states`).
With the states on NVMe, the sub-groups that fit the host-memory budget rest in
host memory instead and only the others are swapped: they are pipelined through
sets of host buffers, sub-group i+1 read while sub-group i is updated, and
sub-group i written while i+1 is updated. A buffer set is reused only after its
writes have completed. The sets and the swap keys are
:class:`~infinity.optim.on_nvme.SwappedStates`'.

The step overlapped with backward (:mod:`infinity.optim.overlapped_step`) runs the
same updates from its worker, through the verbs of the section so named.

A bf16 master (``state_dtype`` bf16 or int8) with bf16 compute holds the
compute shards' very bits. With both on NVMe, a swapped sub-group's update then
writes the master alone, and its compute shards are read from the master's
swap file from then on (:meth:`ComputeDelivery.written_from`): 2 bytes an
element less written each step (``offload_param.compute_from_master``).

A split optimizer (:attr:`Placement.device_sub_groups`: ``offload_optimizer.device: auto``, or a ``ratio``
below 1) keeps its first sub-groups' states in device memory (a second
:class:`~infinity.optim.in_memory.MemoryStates`, ``device_states``) and steps them with the device's Adam; the
others rest and are stepped as ``offload_optimizer`` says for all of them.

The states rest in the form ``state_dtype`` says (``infinity.kernels.compact``)
in every tier: memory tensors, swap files and staging buffers hold 12 (fp32),
6 (bf16) or ~4.03 (int8) bytes an element, and the kernel reads and writes that
form in its one pass. :meth:`OffloadOptimizer.read_state` and
:meth:`~OffloadOptimizer.write_state` convert to and from fp32 for checkpoints
(:class:`~infinity.optim.state_io.RestingStates`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch

from infinity import kernels
from infinity.config.sections import OptimizerConfig, ZeroConfig
from infinity.optim.in_memory import MemoryStates
from infinity.optim.on_nvme import StagingSet, SwappedStates, group_states
from infinity.optim.speculation import InMemoryUndo, StepCheck, UpdateAt
from infinity.optim.states import OptimizerParts, OptimizerStates
from infinity.optim.step_tail import StepTail
from infinity.params.delivery import ComputeDelivery
from infinity.placement.layout import SubGroup
from infinity.storage import IOHandle

logger = logging.getLogger(__name__)

_nothing = contextlib.nullcontext


class OffloadOptimizer:
    def __init__(self, parts: OptimizerParts, config: OptimizerConfig, zero: ZeroConfig, *, staging_sets: int = 2,
                 reserve_nbytes: int = 0, step_undo: bool = False):
        """``zero`` gives the states' form and tier (``offload_optimizer``), whether compute shards are read from
        the master (``offload_param.compute_from_master``) and whether steps overlap backward (the sub-groups
        kept in host memory are then those backward finishes first); ``staging_sets`` host buffer sets pipeline
        the states on NVMe, ``reserve_nbytes`` of the host budget is left to others, and ``step_undo`` keeps
        what undoes a speculative update."""
        layout, placement, tiers = parts.layout, parts.placement, parts.tiers
        offload = zero.offload_optimizer
        state_dtype = offload.state_dtype
        self.layout = layout
        self.state_dtype = kernels.compact.check_state_dtype(state_dtype)
        self.config = config
        self.tier = placement.master.tier
        self.lr = config.lr
        self.step_count = 0
        self._tiers = tiers
        self._grads = parts.grads
        self._copies = parts.copies
        self._timeline = parts.timeline
        self._on_device = placement.optimizer_on_device
        self._placement = placement
        if state_dtype != "fp32" and (self._on_device or placement.split) and placement.device.type != "cpu":
            raise ValueError(
                f"zero_optimization.offload_optimizer.state_dtype is {state_dtype!r}, but optimizer states are "
                f"on {placement.device} (offload_optimizer.device {offload.device.value!r}), where torch's fused AdamW "
                f"keeps fp32 states: offload every sub-group ('cpu' or 'nvme' with ratio 1: the fused CPU kernel), "
                f"or set state_dtype 'fp32'")
        self._rank = parts.rank
        self._adam = kernels.adam_step
        """The fused CPU kernel: the step of the sub-groups not stepped on the device (:meth:`stepped_on_device`)."""
        self._device_adam = kernels.adam_step_on_device
        """The step of the sub-groups whose states rest on the device (all of them without offload; a split
        optimizer's first ones)."""
        self.host_cores = placement.host_cores
        """The fused CPU kernel's threads, and the cores the threads that call it bind to."""
        self.delivery = ComputeDelivery(layout, placement, tiers, parts.compute, parts.copies)
        """The new compute shards' one owner: where the kernel writes them, their way home, the staging sets'."""
        self.states = OptimizerStates(parts, zero, state_dtype=self.state_dtype, staging_sets=staging_sets,
                                      reserve_nbytes=reserve_nbytes, compute_pinned=self.delivery.scratch_pinned)
        """Where every sub-group's states rest."""
        self._memory = self.states.memory
        self._states = self._memory.tensors  # the same dict: its flat tensors, one per state tensor
        self.device_states: MemoryStates | None = self.states.device
        """A split optimizer's device sub-groups' states (None without a split)."""
        self.swapped: SwappedStates | None = self.states.swapped  # the staging sets and swap keys of NVMe's states
        self.swapped_groups = self.states.swapped_groups
        """Sub-groups whose states rest on NVMe (the others are in memory)."""
        self._written_groups: set[int] = set()
        self._grad_scratch: dict[str, torch.Tensor] = {}  # tier -> a sub-group of scaled gradients
        self.undo: InMemoryUndo | None = None  # the in-memory states before a speculative update
        self.device_undo: InMemoryUndo | None = None  # the same for a split optimizer's device states
        self.second_side_reserved = False     # room on NVMe for the speculative states of swapped sub-groups
        self.rollbacks = 0                    # overlapped steps whose speculative updates were undone
        self.tail: StepTail | None = None     # the last step's updates still running behind the next forward
        if zero.offload_param.compute_from_master:
            self._read_compute_from_masters()
        if step_undo:
            self._make_room_to_undo(reserve_nbytes)

    def _read_compute_from_masters(self) -> None:
        """The swapped sub-groups whose compute shards can be read from their master: a bf16 master, bf16 compute
        shards on NVMe (those resting in host memory are copied from the master after each update). The kernel
        writes them as ``master.to(bf16)``, the master's very bits, so a copy of their own would only cost its
        write. The delivery holds which they are (:attr:`ComputeDelivery.master_groups`)."""
        if self.states.store is None:
            return
        master_dtype = self._state_layout(1)[0].dtype
        groups = self.delivery.read_from_masters(self.swapped_groups, master_dtype, self.swapped.read_master_part)
        if groups:
            logger.info("compute shards of %d of %d sub-groups are read from their %s master on NVMe after its first "
                        "update (offload_param.compute_from_master): 2 B an element less written a step",
                        len(groups), len(self.layout.sub_groups), self.state_dtype)

    def _state_layout(self, numel: int):
        return kernels.state_layout(self.state_dtype, numel)

    @property
    def staging_sets(self) -> list[StagingSet]:
        """The host buffers swapped sub-groups are updated in (none unless the states are on NVMe)."""
        return self.states.staging_sets

    def _seed(self, group: SubGroup) -> int:
        """The stochastic-rounding seed of one sub-group: its own on every rank, the same in a resumed run."""
        return (self._rank << 32) | group.index

    def weight_decay_of(self, group: SubGroup) -> float:
        """``group``'s weight decay: its parameters' own (a param group's; the layout gives each sub-group one),
        else the config's ``weight_decay``."""
        return self.config.weight_decay if group.weight_decay is None else group.weight_decay

    def in_memory(self, group: SubGroup) -> bool:
        return self.states.in_memory(group)

    def memory_of(self, group: SubGroup) -> MemoryStates | None:
        """See :meth:`OptimizerStates.memory_of`."""
        return self.states.memory_of(group)

    def state_tier(self, group: SubGroup) -> str:
        """Where ``group``'s states rest: ``device``, ``host`` or ``nvme``."""
        return self.states.state_tier(group)

    def stepped_on_device(self, group: SubGroup) -> bool:
        """The device's Adam steps ``group`` (its states rest in device memory)."""
        return self._placement.stepped_on_device(group.index)

    def takes_norm_in_update(self, group: SubGroup, grad_coef: float) -> bool:
        """Whether ``group``'s update can also sum its gradients' squares, in the same pass: the fused CPU kernel
        reading the slices themselves. Not where the device steps it, where its gradients rest on NVMe (their
        norm is taken as they are written), or where the update reads a scaled copy (``grad_coef`` != 1: the
        norm is the slices')."""
        return (grad_coef == 1.0 and kernels.backend() == "cpp" and not self.stepped_on_device(group)
                and not self._grads.on_nvme(group) and kernels.norm.takes(self._grads.slices))

    @property
    def resident_numel(self) -> int:
        """Elements whose states rest in memory (all of them unless the tier is NVMe)."""
        return self.states.resident_numel

    @property
    def grads(self) -> torch.Tensor:
        """The gradient slices this optimizer reads (owned by the reducer)."""
        return self._grads.slices

    # -- initialization ----------------------------------------------------
    def init_master(self, values_by_slot: dict[int, torch.Tensor]) -> None:
        """Set the fp32 master of the sub-groups whose every slot is in ``values_by_slot``.

        Called as parameters are materialized; a sub-group is written to NVMe
        once complete, so host memory holds at most one sub-group of masters.
        """
        for group in self.layout.sub_groups:
            if group.index in self._written_groups or not all(s.index in values_by_slot for s in group.slots):
                continue
            if not self.in_memory(group):
                staging = self.swapped.sets[0]
                staging.wait_writes()
                self.delivery.will_overwrite(staging)  # overwritten next
                master = staging.states["master"][:group.numel]
                master.zero_()
                for slot in group.slots:
                    master[slot.offset - group.start:slot.offset - group.start + slot.shard_numel].copy_(values_by_slot[slot.index])
                self.swapped.write_master(group, master).wait()
            else:
                for slot in group.slots:
                    self.memory_of(group).write("master", group, values_by_slot[slot.index],
                                                at=slot.offset - group.start)
            self._written_groups.add(group.index)
            for slot in group.slots:
                values_by_slot.pop(slot.index, None)

    # -- the step ------------------------------------------------------------
    def step(self, grad_coef: float = 1.0) -> None:
        """One optimizer step over every sub-group; ``grad_coef`` scales the gradients (clipping, unscaling)."""
        self.step_count += 1
        self.scale_grads(grad_coef)
        at = UpdateAt(step=self.step_count, lr=self.lr)
        self._update_pipelined(self.swapped_groups, [g for g in self.layout.sub_groups if self.in_memory(g)], at)
        self.finish_compute_copies()

    def scale_grads(self, grad_coef: float) -> None:
        """Scale every gradient slice in place, once they have landed (a step nothing will undo any more)."""
        self._grads.scale(grad_coef)

    def _update(self, group: SubGroup, states: dict[str, torch.Tensor], scratch: "torch.Tensor | None",
                at: UpdateAt, *, grad_coef: float = 1.0, staging: StagingSet | None = None,
                sq_norms: "dict[int, float] | None" = None) -> list[IOHandle]:
        """Adam over one sub-group, once its gradient slices have landed (read from NVMe into ``staging`` where
        they rest there); the new compute shards go straight to their flat buffer when it is in the optimizer's
        memory, else through a scratch buffer to their tier. ``grad_coef`` scales the gradients on the way in
        (the slices themselves are left as they are). ``sq_norms``, where :meth:`takes_norm_in_update`: the
        kernel also sums the gradients' squares as it reads them, into ``sq_norms[group.index]``. Returns the NVMe
        writes still in flight."""
        cfg = self.config
        states = group_states(self.state_dtype, group, states)
        if staging is not None and self._grads.on_nvme(group):
            grads = staging.take_grads(group, self._grads, grad_coef)
        else:
            grads = self._grads.wait_sub_group(group)
            if grad_coef != 1.0:
                grads = self._scaled_grads(group, grads, grad_coef)
        out = self.delivery.out(group, scratch)  # None when the master is the compute shards
        hyper = dict(step=at.step, lr=at.lr, beta1=cfg.betas[0], beta2=cfg.betas[1], eps=cfg.eps,
                     weight_decay=self.weight_decay_of(group), adamw=cfg.adamw, bias_correction=cfg.bias_correction,
                     param_out=out)
        on_device = self.stepped_on_device(group)
        if not on_device:
            hyper["num_threads"] = self.host_cores.threads  # the fused CPU kernel's team
        if sq_norms is not None:
            hyper["grad_sq_norm"] = True
        adam = self._device_adam if on_device else self._adam
        with self.span(f"sub-group {group.index}"):
            if self.state_dtype == "fp32":
                sq_norm = adam(states["master"], grads, states["exp_avg"], states["exp_avg_sq"], **hyper)
            else:  # the compact form read, updated and written back in the kernel's one pass
                sq_norm = kernels.adam_step_compact(states["master"], grads, states["exp_avg"], states["exp_avg_sq"],
                                                    state_dtype=self.state_dtype, seed=self._seed(group),
                                                    exp_avg_scale=states.get("exp_avg_scale"),
                                                    exp_avg_sq_scale=states.get("exp_avg_sq_scale"), **hyper)
        if sq_norms is not None:
            if sq_norm is None:
                raise RuntimeError(f"internal error: sub-group {group.index}'s update took no gradient norm")
            sq_norms[group.index] = sq_norm
        return self.delivery.updated(group, out, states["master"])

    def span(self, name: str):
        """A span of the optimizer's work on the trace's optimizer track (nothing without a trace)."""
        return self._timeline.span("optimizer", name) if self._timeline else _nothing()

    def finish_compute_copies(self) -> None:
        """End of a step: see :meth:`ComputeDelivery.finish_copies`."""
        self.delivery.finish_copies()

    def _update_pipelined(self, groups: list[SubGroup], in_memory: list[SubGroup], at: UpdateAt) -> None:
        """Sub-group i+1 of the swapped ``groups`` is read while i is updated; a buffer set is reused once its
        writes are done. The ``in_memory`` sub-groups are updated while the first read is in flight."""
        sets = self.staging_sets
        reads: dict[int, list[IOHandle]] = {}
        if groups:
            # The last step's write-behind may still be reading this set (the set of its last sub-groups):
            # the first read must not land in it before those writes are done.
            sets[0].wait_writes()
            reads[0] = self.read_states(groups[0], sets[0], step=at.step, with_grads=True)
        for group in in_memory:
            self._update_in_memory(group, at)
        for i, group in enumerate(groups):
            staging = sets[i % len(sets)]
            for handle in reads.pop(i):
                handle.wait()
            following = sets[(i + 1) % len(sets)]
            if i + 1 < len(groups) and following is not staging:
                following.wait_writes()
                reads[i + 1] = self.read_states(groups[i + 1], following, step=at.step, with_grads=True)
            staging.writes.extend(self._update(group, staging.states, staging.compute, at, staging=staging))
            self._write_states(group, staging, other_side=False)
            if i + 1 < len(groups) and following is staging:  # one buffer set: no read-ahead
                staging.wait_writes()
                reads[i + 1] = self.read_states(groups[i + 1], staging, step=at.step, with_grads=True)
        # Write-behind: the last sub-groups' writes finish while the next forward runs. The store orders
        # operations on one key, so a later read of a state or compute shard sees its write; a staging
        # set is reused only after its writes are done; flush() waits for all of them.

    # -- the step overlapped with backward (infinity.optim.overlapped_step drives these) ------
    def begin_step(self) -> None:
        """An overlapped step begins: its updates count as the next step's (:meth:`take_back_step` undoes this)."""
        self.step_count += 1

    def finish_behind_forward(self, groups: list[SubGroup],
                              update_all: Callable[[Callable[[SubGroup], None]], None]) -> StepTail:
        """A settled overlapped step's remaining updates of ``groups`` (``update_all``, as ``StepTail`` takes it)
        run on a worker thread while the next forward begins (:mod:`infinity.optim.step_tail`); ``tail`` is
        theirs until it has landed."""
        def update_all_bound(delivered: Callable[[SubGroup], None]) -> None:
            self.host_cores.bind_this_thread()  # the tail's thread: off the core that feeds the GPU
            update_all(delivered)

        self.tail = StepTail(groups, update_all_bound, copies=self._copies, timeline=self._timeline)
        return self.tail

    def land_tail(self) -> None:
        """Wait for the last step's updates behind the forward, if any (their failure is raised here, once)."""
        tail, self.tail = self.tail, None
        if tail is not None:
            tail.land()

    def drop_tail(self) -> None:
        """Wait for the last step's updates behind the forward; a failure is logged, not raised (closing, or
        loading a checkpoint that replaces whatever they left)."""
        try:
            self.land_tail()
        except Exception as err:
            logger.warning("the last step's updates behind the forward failed; going on without them: %s", err)

    def take_back_step(self) -> None:
        """An overlapped step that updated nothing it keeps (cancelled, or skipped on an fp16 overflow)."""
        self.step_count -= 1

    def undo_updates(self, groups: list[SubGroup], reason: str) -> None:
        """Roll back speculative updates: in-memory sub-groups come back from the undo copy; a swapped one's
        new states were written to the other side of its keys and are simply never published."""
        for group in groups:
            if self.in_memory(group):
                self._undo_of(group).restore(group)
        self.delivery.undone(g.index for g in groups)
        if groups:
            self.rollbacks += 1
            logger.info("overlapped step %d: %d speculative sub-group updates undone (%s); rollbacks so far: %d",
                        self.step_count, len(groups), reason, self.rollbacks)

    def publish_other_side(self, groups) -> None:
        """Committed speculative updates of swapped sub-groups: their states now live under their other keys."""
        swapped = [g.index for g in groups if not self.in_memory(g)]
        if self.swapped is not None:
            self.swapped.publish_other_side(swapped)
        self.delivery.committed(swapped)  # masters still staged are the compute shards' newest now

    def _make_room_to_undo(self, reserve_nbytes: int) -> None:
        """Steps that may be undone (clipping, fp16) are overlapped: the second side of every swapped sub-group's
        keys is reserved on NVMe now, and an undo copy of the in-memory states is made where the budget has
        room for it beside the ``reserve_nbytes`` kept free for later buffers (else in-memory sub-groups wait for
        the norm). Made up front, so the tiers' peaks are what ``estimate`` says and a full disk fails here, not
        mid-run."""
        self.second_side_reserved = self.swapped is None or self.swapped.reserve_other_sides(self.swapped_groups)
        if self._states:
            self.undo = InMemoryUndo.make(self._states, self._memory.tier, self._tiers, self._memory.views,
                                          reserve_nbytes=reserve_nbytes)
        if self.device_states is not None:
            self.device_undo = InMemoryUndo.make(self.device_states.tensors, "device", self._tiers,
                                                 self.device_states.views, reserve_nbytes=reserve_nbytes)

    def _undo_of(self, group: SubGroup) -> InMemoryUndo | None:
        """What undoes a speculative update of the in-memory ``group`` (None: no room was found for it)."""
        return self.device_undo if self.memory_of(group) is self.device_states else self.undo

    def can_undo(self, group: SubGroup) -> bool:
        """A speculative update of ``group`` can be undone: its old states stay on NVMe while the new ones go
        to the other side (where the disk had room), or an undo copy of its states in memory was made."""
        if not self.in_memory(group):
            return self.second_side_reserved
        return self._undo_of(group) is not None

    def restore_compute(self, group: SubGroup) -> None:
        """After an undone update: the compute shards again from the master (the kernel writes them as its
        round-to-nearest cast, so this is the value they had)."""
        if not self.delivery.needs_restoring(group):
            return  # they are read from the master, which the undone update did not overwrite (other side)
        if self.in_memory(group):
            master, staging = self.memory_of(group).views(group)["master"], None
        else:
            staging = self.swapped.sets[0]
            staging.wait_writes()  # its buffers are about to be overwritten by the read
            self.delivery.will_overwrite(staging)
            master = staging.states["master"][:group.numel]
            self.swapped.read_master(group, master).wait()
        self.delivery.restore(group, master, staging.compute if staging is not None else None)

    def _scaled_grads(self, group: SubGroup, grads: torch.Tensor, grad_coef: float) -> torch.Tensor:
        """``grads * grad_coef`` in a buffer of the optimizer's (the slices must stay as they are while the step
        may be undone); the same rounding as scaling the slices in place."""
        tier = "device" if self._on_device or (self.stepped_on_device(group) and self._placement.distinct) else "host"
        if tier not in self._grad_scratch:
            self._grad_scratch[tier] = self._tiers.empty(tier, self.layout.largest_sub_group_numel, grads.dtype,
                                                         owner="gradient scratch")
        return torch.mul(grads, grad_coef, out=self._grad_scratch[tier][:grads.numel()])

    def update_in_memory(self, group: SubGroup, check: StepCheck, at: UpdateAt, *,
                         sq_norms: "dict[int, float] | None" = None) -> None:
        """The overlapped step's update of an in-memory sub-group, undoable when the step may not stand;
        ``sq_norms`` as for :meth:`_update`."""
        if check.needs_norm:
            self._undo_of(group).save(group)
        self._update_in_memory(group, at, grad_coef=check.grad_coef, sq_norms=sq_norms)

    def update_staged(self, group: SubGroup, staging: StagingSet, check: StepCheck, at: UpdateAt, *,
                      sq_norms: "dict[int, float] | None" = None) -> None:
        """The overlapped step's update of a swapped sub-group whose states are in ``staging``; when the step
        may not stand, the new states go to the other side of its keys. ``sq_norms`` as for :meth:`_update`."""
        staging.writes.extend(self._update(group, staging.states, staging.compute, at, grad_coef=check.grad_coef,
                                           staging=staging, sq_norms=sq_norms))
        self._write_states(group, staging, other_side=check.needs_norm)

    def _write_states(self, group: SubGroup, staging: StagingSet, *, other_side: bool) -> None:
        """Queue the writes of a swapped sub-group's updated states; a master that holds the compute shards goes
        ahead of the queue (the next forward reads it), and its shards are read from it from now on. Written to
        the other side, the master the shards are read from is the one on the current side until the step
        commits: the shards' old values, as long as the update may still be undone."""
        # the master's write is queued first: the shards' next reads from it are ordered after it
        self.swapped.write(group, staging, other_side=other_side, urgent_master=self.delivery.in_master(group))
        self.delivery.written_from(group, staging, master=staging.states["master"][:group.numel],
                                   compute=staging.compute[:group.numel], speculative=other_side)

    def _update_in_memory(self, group: SubGroup, at: UpdateAt, *, grad_coef: float = 1.0,
                          sq_norms: "dict[int, float] | None" = None) -> None:
        """One sub-group's update with the states in memory (compute shards may still go to NVMe)."""
        for handle in self._update(group, self.memory_of(group).views(group), None, at, grad_coef=grad_coef,
                                   sq_norms=sq_norms):
            handle.wait()

    def read_states(self, group: SubGroup, staging: StagingSet, *, step: int, urgent: bool = True,
                    with_grads: bool = False) -> list[IOHandle]:
        """Read a swapped sub-group's states for step ``step`` into ``staging``; returns the reads in flight.
        ``with_grads``: its gradients are final, and where they rest on NVMe they are read too (waited on by the
        update)."""
        self.delivery.will_overwrite(staging)  # the shards it held are read from NVMe from now on
        reads = self.swapped.read(group, staging, step=step, urgent=urgent)
        if with_grads and self._grads.on_nvme(group):
            staging.read_grads(group, self._grads)
        return reads

    # -- reading and writing states (full_state_dict, checkpoints) -----------
    def read_master(self, group: SubGroup, out: torch.Tensor) -> None:
        self.read_state("master", group, out)

    def read_state(self, name: str, group: SubGroup, out: torch.Tensor) -> None:
        """Copy one state (``master``, ``exp_avg``, ``exp_avg_sq``) of a sub-group into ``out``: see
        :meth:`RestingStates.read`."""
        self.land_tail()  # the last step's updates behind the forward may not have reached this sub-group yet
        self.states.resting.read(name, group, out, moments_written=self.step_count > 0)

    def write_state(self, name: str, group: SubGroup, values: torch.Tensor) -> None:
        """Replace one state of a sub-group with fp32 ``values`` (loading a checkpoint)."""
        self.land_tail()  # a tail still updating the sub-group would overwrite what is written here
        self.delivery.replaced(group)  # a staged master or set is no longer the newest
        self.states.resting.write(name, group, values)

    def state_dict(self) -> dict:
        """The optimizer's scalars (tensors are read per sub-group with :meth:`read_state`)."""
        return {"step": self.step_count, "lr": self.lr}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step"])
        self.lr = float(state["lr"])

    def flush(self) -> None:
        """Wait for every update and write of earlier steps (they finish behind the next forward otherwise)."""
        self.land_tail()
        if self.swapped is not None:
            self.swapped.wait_writes()

    def close(self) -> None:
        self.drop_tail()
        self.states.close()
        self.delivery.close()
        for tier, scratch in self._grad_scratch.items():
            self._tiers.free(tier, scratch)
        self._grad_scratch.clear()
        for undo in (self.undo, self.device_undo):
            if undo is not None:
                undo.close()
