"""The optimizer step overlapped with backward: a worker thread updates each
sub-group as soon as its gradients are final, in the order backward finishes
them, and reads the states of the next ones ahead.

Gradient clipping and fp16 loss scaling need every gradient (the global norm,
the overflow check) before any update. The step then *speculates*: it updates
with the gradient coefficient it would have if nothing clips or overflows
(:class:`StepCheck`), keeping what undoes it, and the engine *settles* it once
the norm is known (:meth:`OverlappedStep.settle`): commit,
or roll back and redo with the clipped gradients, or roll back and skip on an
fp16 overflow. How each tier undoes an update, and why it is cheap there:

* states on NVMe: the speculative update writes fresh extents (the other
  *side* of the sub-group's keys); commit switches sides, a rollback keeps the
  old ones, which were never overwritten;
* states in memory: the pre-update values are copied aside first (an undo
  buffer counted in the states' tier, :class:`InMemoryUndo`); without room for
  it the sub-group is not speculated.

Speculating costs a wasted update when the step then clips, so a step that
follows a clipped or overflowing one does not speculate (its updates are
*deferred* until the norm is known; their states are read ahead during
backward into every staging set, first those the next forward reads first, so
they update the moment it is, behind that forward: :mod:`infinity.optim.step_tail`), and a step
stops speculating as soon as the squared norm of the sub-groups seen so far
already exceeds the clipping threshold. Every sub-group's squared gradient norm is taken here, as it
becomes final, so the global norm costs no pass over the gradients after
backward; the non-overlapped step sums the same per-sub-group terms in the
same order, which keeps the two bitwise equal. A sub-group updated now by the fused CPU kernel has its
norm summed by that kernel as it reads the gradients (the same bits), so it costs no pass of its own
either: the update runs before its norm is known, and a step that clips undoes it with the others.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from infinity.grads.reducer import GradReducer
from infinity.optim.offload_optimizer import OffloadOptimizer
from infinity.optim.on_nvme import StagingSet
from infinity.optim.speculation import StepCheck, UpdateAt
from infinity.optim.step_tail import StepTail
from infinity.placement.layout import SubGroup
from infinity.storage import IOHandle

logger = logging.getLogger(__name__)


_SETS_READ = object()
"""Put on the worker's queue when a staging set's staged compute shards have all been read."""


class OverlappedStep:
    """A worker thread that updates sub-groups in the order their gradients become final.

    With the states on NVMe it also reads ahead: backward finishes sub-groups from the last layer to
    the first, so while one sub-group is updated, the states of the highest-numbered one still
    waiting are read into another buffer set (states do not depend on gradients). A guess that
    turns out wrong costs nothing but the read; the sub-group then reads on arrival.
    """

    def __init__(self, optimizer: "OffloadOptimizer", grads: "GradReducer", check: StepCheck, *,
                 after: "StepTail | None" = None):
        """``after``: the last step's tail, if it may still be running; the worker waits for it before it
        touches the staging sets."""
        self._optimizer = optimizer
        self.step = optimizer.step_count  # this step's number (the next step may begin while its tail runs)
        self._lr: float | None = None     # fixed by at()
        self._after = after
        self._grads = grads  # whose sub-groups' norms the step takes as backward finishes them
        self.check = check
        self._lock = threading.Lock()  # _waiting is changed by backward's thread, read by the worker
        self._waiting = {g.index: {s.index for s in g.slots} for g in optimizer.layout.sub_groups}
        self._ready: "queue.Queue[SubGroup | None]" = queue.Queue()
        self._error: BaseException | None = None
        self._read_ahead: dict[int, tuple["StagingSet", list[IOHandle]]] = {}  # worker only
        self._free_sets: list["StagingSet"] = list(optimizer.staging_sets)    # worker only
        # A free set may still hold the newest compute shards of a sub-group the forward has not read yet
        # (infinity.params.staging): reads ahead leave it alone until they are read, or backward begins.
        self._delivery = optimizer.delivery
        self._delivery.tell_when_read(self._staged_read)
        self._in_backward = False  # sub-groups are arriving: every free set serves them
        self.sq_norms: dict[int, float] = {}   # sub-group index -> its squared gradient norm (worker only)
        self.speculated: list[SubGroup] = []   # updated before the norm was known (worker only)
        self.deferred: list[SubGroup] = []     # left for settle (worker only)
        self._speculating = check.speculate
        self.remaining: list[SubGroup] = []        # updates left once settled, in the order they are made
        self._after_norm: list[SubGroup] = []      # update_remaining's queue (its thread only, the worker ended)
        self.started = False  # a sub-group's gradients were final: updates with this lr have begun
        self._worker = threading.Thread(target=self._run, name="infinity-optimizer", daemon=True)
        self._worker.start()

    def slot_final(self, slot) -> None:
        """The gradient reducer's word, during the step's last backward: ``slot``'s gradient is final."""
        group = self._optimizer.layout.group_of_slot[slot.index]
        with self._lock:
            waiting = self._waiting.get(group.index)
            if waiting is None:
                return
            waiting.discard(slot.index)
            if waiting:
                return
            del self._waiting[group.index]
        self.started = True
        self._ready.put(group)

    def finish(self, *, leave_the_rest: bool = False) -> int:
        """Hand over the sub-groups still waiting (parameters that got no gradient) and wait for the worker;
        returns how many sub-groups became final during backward and were updated without waiting for the
        norm.

        ``leave_the_rest``: the sub-groups the worker has not begun when backward is over are not updated now:
        the worker takes their norms and leaves them for :meth:`settle`, whose remaining updates run behind the
        next forward in the order it reads them (:mod:`infinity.optim.step_tail`). Backward finishes the first
        layers' sub-groups last, so without this the next forward, which needs them first, waited for every
        update the host was behind by (on a GPU with states in host memory, most of them)."""
        groups = self._optimizer.layout.sub_groups
        with self._lock:
            left, self._waiting = sorted(self._waiting), {}
        if leave_the_rest:
            # read by the worker before each sub-group it takes (a bool: the GIL makes the write whole); the one
            # it is updating finishes, every later one is deferred once its norm is taken
            self._speculating = False
        for index in left:
            self._ready.put(groups[index])
        self._ready.put(None)
        self._worker.join()
        if self._error is not None:
            raise self._error
        return sum(1 for group in self.speculated if group.index not in left)

    def cancel(self) -> None:
        """Take the step back before any sub-group was handed to the worker (its forward ran, its backward did
        not): stop the worker, let its reads ahead land."""
        if self.started:
            raise RuntimeError("internal error: an overlapped step whose updates began cannot be cancelled")
        self.stop()
        if self._error is not None:
            raise self._error
        self._optimizer.take_back_step()

    def stop(self) -> None:
        """Stop the worker without handing it the sub-groups still waiting (the backward raised: their
        gradients will not come); the updates it made stay. Let its reads ahead land."""
        self._ready.put(None)
        self._worker.join()
        self.release_read_ahead()

    def abandon(self, reason: str = "closing mid-step") -> None:
        """Stop the worker and undo what it updated (closing mid-step, or its backward raised)."""
        if not self.started:
            self.cancel()
            return
        self.finish()
        self.settle(0.0, skipped=True, undo_reason=reason)

    # -- settling, once the norm is known -----------------------------------------
    def settle(self, grad_coef: float, skipped: bool, *, undo_reason: str | None = None) -> str:
        """After finish(): end the step with the coefficient the gradients really get. Its speculative updates
        stand when it is the one they assumed, else they are undone and are to be redone with ``grad_coef`` (or,
        when the step is ``skipped``, undone only). Returns ``committed``, ``redone`` or ``skipped``; the updates
        still to make are :attr:`remaining`, for :meth:`update_remaining`."""
        optimizer = self._optimizer
        if not skipped and grad_coef == self.check.grad_coef:
            if self.check.needs_norm:  # its swapped sub-groups were written to their other side
                optimizer.publish_other_side(self.speculated)
            self._remain(self.deferred, grad_coef)
            return "committed"
        optimizer.undo_updates(self.speculated, undo_reason or ("fp16 overflow" if skipped else "gradients clipped"))
        if skipped:
            optimizer.take_back_step()
            self.release_read_ahead()  # restore_compute reads into a staging set
            for group in self.speculated:
                optimizer.restore_compute(group)
            optimizer.finish_compute_copies()
            return "skipped"
        self._remain(optimizer.layout.sub_groups, grad_coef)
        return "redone"

    def _remain(self, groups: list[SubGroup], grad_coef: float) -> None:
        """The settled step's remaining updates, in the order the next forward reads their compute shards (those
        whose states were read ahead first: they hold the staging sets). Nothing is undone any more, so the
        slices are scaled in place (as the step after backward scales them)."""
        # The next forward gathers the compute shards updated during backward without waiting for anything else.
        self._optimizer.finish_compute_copies()
        self._optimizer.scale_grads(grad_coef)
        self.check = StepCheck()  # nothing left to undo: current keys, no undo copy, the slices as they are
        self._in_backward = False  # what is left runs behind the next forward: reads ahead leave its shards alone
        self.at()  # the learning rate is the one the step settled with, whatever is set after it
        groups = sorted(groups, key=lambda g: g.index)
        self.remaining = ([g for g in groups if g.index in self._read_ahead]
                          + [g for g in groups if g.index not in self._read_ahead])

    def update_remaining(self, delivered: Callable[[SubGroup], None] = lambda group: None) -> None:
        """After settle(), on the caller's thread or a :class:`~infinity.optim.step_tail.StepTail`'s: update
        :attr:`remaining` in order, calling ``delivered(group)`` as each one's new compute shards are on their
        way. Those whose states were read ahead go first; the others are read into the sets as they free up,
        the next ones ahead of the one being updated."""
        self._after_norm = list(self.remaining)
        while self._after_norm:
            group = self._after_norm.pop(0)
            self._update(group)
            delivered(group)
        self.release_read_ahead()
        self._optimizer.finish_compute_copies()

    def at(self) -> "UpdateAt":
        """The step number and learning rate of this step's updates. The rate is the optimizer's when the first
        update ran (``engine.lr`` refuses changes from then on) or when the step settled, whichever came first."""
        if self._lr is None:
            self._lr = self._optimizer.lr
        return UpdateAt(step=self.step, lr=self._lr)

    def release_read_ahead(self) -> None:
        """Let the reads of states no update will use land (their sets are reused next step)."""
        reads_ahead, self._read_ahead = self._read_ahead, {}
        for _, reads in reads_ahead.values():
            for handle in reads:
                handle.wait()

    def sq_norm(self) -> float:
        """The squared gradient norm of this rank's sub-groups, summed in sub-group order (after finish)."""
        return sum(self.sq_norms[g.index] for g in self._optimizer.layout.sub_groups)

    # -- the worker -------------------------------------------------------------
    def _run(self) -> None:
        self._optimizer.host_cores.bind_this_thread()  # off the core that feeds the GPU, before the first update
        if self._after is not None:
            # The last step's tail still uses the staging sets. Its failure is the main thread's to raise (this
            # step's backward will not run): then nothing is read ahead, its states are not what a step reads.
            self._after.wait_ended()
        if self._after is None or self._after.failed is None:
            self._guarded(self._read_next_ahead)
        while (group := self._ready.get()) is not None:
            if self._error is not None:
                continue  # drain; finish() raises the first error
            if group is _SETS_READ:
                self._guarded(self._read_next_ahead)
                continue
            self._guarded(lambda: self._arrive(group))
        # States read ahead for deferred sub-groups stay staged for update_remaining (release_read_ahead
        # lets them land when the step is skipped).
        self._delivery.stop_telling(self._staged_read)

    def _staged_read(self, owner) -> None:
        """A staging set's last unread compute shard was read (any thread): reads ahead may use it now."""
        if not self._in_backward:
            self._ready.put(_SETS_READ)

    def _arrive(self, group: SubGroup) -> None:
        self._in_backward = True
        if (self._speculating and self._can_undo(group)
                and self._optimizer.takes_norm_in_update(group, self.check.grad_coef)):
            # the kernel sums the gradients' squares as it reads them for the update: the norm costs no pass of
            # its own (the same bits as the pass below). A step found to clip here undoes this update too.
            self._update(group, sq_norms=self.sq_norms)
            self.speculated.append(group)
            self._stop_speculating_if_rejected()
            return
        # the wait for the sub-group's last gradients to land, then a pass over them: the worker's, on the trace
        with self._optimizer.span(f"sub-group {group.index} norm"):
            self.sq_norms[group.index] = self._grads.sub_group_sq_norm(group)
        self._stop_speculating_if_rejected()
        if not self._speculating or not self._can_undo(group):
            self.deferred.append(group)
            return
        self._update(group)
        self.speculated.append(group)

    def _stop_speculating_if_rejected(self) -> None:
        """Stop speculating once the norm of the sub-groups seen so far says the step clips or overflows."""
        if self._speculating and self.check.needs_norm and self.check.surely_rejected(sum(self.sq_norms.values())):
            self._speculating = False  # the step will clip or overflow: updating more would only be undone
            logger.debug("overlapped step: the norm already exceeds the threshold after %d sub-groups; "
                         "the rest wait for it", len(self.sq_norms))
            self._read_next_ahead()  # no set is needed for updates now: fill them all

    def _can_undo(self, group: SubGroup) -> bool:
        """Whether ``group`` may be updated before the check's outcome is known."""
        if not self.check.needs_norm:
            return True  # nothing to undo
        return self._optimizer.can_undo(group)

    def _guarded(self, action) -> None:
        try:
            action()
        except BaseException as err:  # handed to the main thread by finish()
            self._error = self._error or err

    def _update(self, group: SubGroup, *, sq_norms: "dict[int, float] | None" = None) -> None:
        """Update ``group``; ``sq_norms`` as for :meth:`OffloadOptimizer.update_in_memory`."""
        optimizer = self._optimizer
        if optimizer.in_memory(group):
            optimizer.update_in_memory(group, self.check, self.at(), sq_norms=sq_norms)
            return
        entry = self._read_ahead.pop(group.index, None)
        if entry is None:
            if not self._free_sets:  # every set holds a wrong guess: give the oldest back
                _, (staging, reads) = self._read_ahead.popitem()
                for handle in reads:
                    handle.wait()
                self._free_sets.append(staging)
            staging = self._take_set()
            reads = optimizer.read_states(group, staging, step=self.step)
        else:
            staging, reads = entry
        for handle in reads:
            handle.wait()
        optimizer.update_staged(group, staging, self.check, self.at(), sq_norms=sq_norms)
        self._free_sets.append(staging)
        self._read_next_ahead()

    def _read_next_ahead(self) -> None:
        """Read ahead as far as the free sets allow: during backward the sub-groups still waiting, highest
        first (the order backward finishes them) while updates run during backward, lowest first (the order
        the next forward reads them, once the norm is known) in a step whose updates wait for it; after the
        norm, the queue. While updates run during backward one set stays free for a sub-group not guessed; a
        step whose updates wait for the norm fills them all.

        The reads are not urgent: they queue behind the parameter reads that compute waits for."""
        groups = self._optimizer.layout.sub_groups
        if self._after_norm:
            candidates = [g.index for g in self._after_norm]
        else:
            with self._lock:
                candidates = sorted(self._waiting, reverse=self._speculating)
        candidates = [i for i in candidates if i not in self._read_ahead and not self._optimizer.in_memory(groups[i])]
        keep_free = 1 if self._speculating and not self._after_norm else 0
        for index in candidates:
            if len(self._free_sets) <= keep_free:
                return
            staging = self._take_set(leave_unread=not self._in_backward)
            if staging is None:
                return  # the rest hold shards the forward reads first: on_read says when they are read
            group = self._optimizer.layout.sub_groups[index]
            # after the norm every gradient is final: spilled ones are read ahead with the states
            self._read_ahead[index] = (staging, self._optimizer.read_states(group, staging, urgent=False,
                                                                            step=self.step,
                                                                            with_grads=bool(self._after_norm)))

    def _take_set(self, *, leave_unread: bool = False) -> "StagingSet | None":
        """The first free set that holds no unread compute shards; else, unless ``leave_unread``, the first."""
        at = next((i for i, s in enumerate(self._free_sets) if not self._delivery.holds_unread(s)), None)
        if at is None:
            if leave_unread:
                return None
            at = 0
        staging = self._free_sets.pop(at)
        staging.wait_writes()  # its last sub-group's writes must land before its buffers are reused
        return staging
