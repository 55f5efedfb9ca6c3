"""The training step's cycle: one enum says where the engine stands between
``forward``, ``backward`` and ``step``, and the verbs here are the only way it
changes (each change is a DEBUG line), the way :class:`~infinity.params.sharded_param.ParamState`
works for one parameter::

    IDLE ─backward()─► MICRO_BATCH ─step()─► ACCUMULATING ─backward()─► MICRO_BATCH ─► ...
     │                                            │
     └── backward() of the step's last micro-batch┴─► BOUNDARY_BACKWARD ─step()─► STEPPING ─► IDLE

``step()`` is called after every ``backward()``; between boundaries it only
moves MICRO_BATCH to ACCUMULATING. A ``backward()`` that raises is taken back
(:meth:`StepCycle.abort_backward`): the phase is again the one before it, or
IDLE when the step's gradients had to be dropped.

A gradient's route through one step, for reading: a parameter's
post-accumulate-grad hook (:class:`~infinity.params.hooks.ModuleHooks`) hands it to
:meth:`GradReducer.on_grad_ready <infinity.grads.reducer.GradReducer.on_grad_ready>`,
which reduce-scatters it into the optimizer's slices. During the step's last
backward, with ``overlap_step_with_backward``, the reducer was given the
:class:`~infinity.optim.overlapped_step.OverlappedStep` this cycle owns
(:meth:`StepCycle.begin_backward`) and tells it of each slot whose gradient is
final; its worker updates a sub-group once all its slots are. ``step()`` then
takes the norm and settles that step (the updates it still has to make run
behind the next forward: :mod:`infinity.optim.step_tail`), or runs the optimizer
over every sub-group.
"""

from __future__ import annotations

import enum
import logging
import math
import time

import torch

from infinity.config.schema import InfinityConfig
from infinity.grads.loss_scaler import LossScaler
from infinity.grads.norm import global_grad_norm
from infinity.grads.reducer import GradReducer
from infinity.optim.offload_optimizer import OffloadOptimizer
from infinity.optim.overlapped_step import OverlappedStep
from infinity.optim.speculation import StepCheck
from infinity.optim.step_tail import StepTail
from infinity.params.sharded_param import ShardedParam
from infinity.runtime.comm import Collectives

logger = logging.getLogger(__name__)


class StepPhase(enum.Enum):
    IDLE = "idle"                            # at a step boundary: no gradient held, nothing due
    MICRO_BATCH = "micro-batch"              # a backward before the step's last ran; step() is due (a no-op)
    ACCUMULATING = "accumulating"            # between micro-batches of a step: the next backward adds
    BOUNDARY_BACKWARD = "boundary backward"  # the step's last backward runs or ran; step() is due
    STEPPING = "stepping"                    # step() applies the optimizer


class StepCycle:
    """The step's phase, its micro-batch and step counters, and the overlapped step (from the forward of the
    step's last micro-batch until ``step()`` settles it); the verbs move them together."""

    def __init__(self, config: InfinityConfig, *, reducer: GradReducer, optimizer: OffloadOptimizer,
                 comm: Collectives, loss_scaler: LossScaler | None, params: list[ShardedParam]):
        """``config`` gives the micro-batches a step (``gradient_accumulation_steps``), the clipping threshold
        (``gradient_clipping``) and whether a settled step's remaining updates run behind the next forward
        (``zero_optimization.overlap_step_with_forward``)."""
        self._accumulation_steps = config.gradient_accumulation_steps
        self._reducer = reducer
        self._optimizer = optimizer
        self._comm = comm
        self._loss_scaler = loss_scaler
        self._gradient_clipping = config.gradient_clipping
        self._params = params
        # a settled step's remaining updates run behind the next forward (StepTail)
        self._finish_behind_forward = config.zero.overlap_step_with_forward
        self.phase = StepPhase.IDLE
        self._phase_before_backward = StepPhase.IDLE  # where a backward that raises goes back to
        self.micro_step = 0
        self.global_step = 0
        self.boundary_forced = False  # the coming micro-batch ends the step early (force_boundary)
        self.overlap: OverlappedStep | None = None
        self.last_step_rejected = False  # the last step clipped or overflowed
        self.global_grad_norm: float | None = None
        # Why training cannot go on (a backward raised after updates that cannot be taken back), until a
        # checkpoint is loaded; None when it can.
        self.broken: str | None = None

    def _enter(self, phase: StepPhase) -> None:
        logger.debug("step %d: %s -> %s", self.global_step, self.phase.name, phase.name)
        self.phase = phase

    # -- what the phase says ---------------------------------------------------------
    @property
    def next_is_boundary(self) -> bool:
        """The next backward is the step's last micro-batch's."""
        return self.boundary_forced or (self.micro_step + 1) % self._accumulation_steps == 0

    @property
    def at_boundary(self) -> bool:
        return self.micro_step % self._accumulation_steps == 0

    @property
    def backward_pending(self) -> bool:
        """A backward ran and its step() did not."""
        return self.phase in (StepPhase.MICRO_BATCH, StepPhase.BOUNDARY_BACKWARD)

    @property
    def in_progress(self) -> bool:
        """From the forward of a boundary micro-batch (or its backward) until ``step()``."""
        return self.backward_pending or self.overlap is not None

    @property
    def updates_started(self) -> bool:
        """An overlapped step has updated (or is updating) sub-groups: its lr can no longer change."""
        return self.overlap is not None and self.overlap.started

    # -- verbs ------------------------------------------------------------------------
    def begin_overlapped_step(self, check: StepCheck) -> None:
        """The coming step runs during its last backward (begun from that micro-batch's forward, so optimizer
        states can be read ahead); one already begun goes on."""
        if self.overlap is None:
            self._optimizer.begin_step()
            self.overlap = OverlappedStep(self._optimizer, self._reducer, check, after=self._optimizer.tail)
            logger.debug("step %d: overlapped step begun (%s)", self.global_step, check)

    def begin_backward(self) -> None:
        """A micro-batch's backward begins: the reducer learns whether its gradients start the step's
        accumulation and whether they are the step's last (then final as they arrive, for the overlapped step)."""
        self._refuse_if_broken()
        self.land_tail()
        if self.phase in (StepPhase.BOUNDARY_BACKWARD, StepPhase.STEPPING):
            raise RuntimeError(f"backward() called in step phase {self.phase.value!r}: the step's last "
                               f"micro-batch already ran backward; call engine.step() before the next backward()")
        boundary = self.next_is_boundary
        fresh = self.phase is StepPhase.IDLE
        self._phase_before_backward = self.phase
        self._enter(StepPhase.BOUNDARY_BACKWARD if boundary else StepPhase.MICRO_BATCH)
        self._reducer.begin_backward(fresh=fresh, boundary=boundary, final_sink=self.overlap if boundary else None)

    def force_boundary(self, forced: bool = True) -> None:
        """The coming micro-batch is the step's last, whatever the count says (an epoch that ends inside an
        accumulation): set before its forward, since a boundary's step may begin there. ``False`` leaves it to
        the count again."""
        if forced and self.phase in (StepPhase.BOUNDARY_BACKWARD, StepPhase.STEPPING):
            raise RuntimeError(f"an accumulation boundary cannot be forced in step phase {self.phase.value!r}: "
                               f"call engine.step() first")
        self.boundary_forced = forced

    def end_backward(self) -> None:
        self.micro_step += 1
        if self.boundary_forced:
            # The step ends here: the count moves on to the next step's start, so micro-batches keep counting
            # whole steps (checkpoints, and the next step's boundary).
            self.micro_step += -self.micro_step % self._accumulation_steps
            self.boundary_forced = False
        self._reducer.end_backward()

    def abort_backward(self, error: BaseException) -> None:
        """The backward raised (``error``): take it back, so that training can go on.

        A fresh backward's gradients are forgotten and the cycle is where it was before it. One that added into
        the step's accumulation left partial sums: the step's gradients are dropped (logged) and the step
        starts again from its first micro-batch. An overlapped step that updated nothing is taken back, and one
        whose updates can be undone (clipping or fp16 configured) is undone. One that updated sub-groups in
        place cannot be: training must go back to a checkpoint, and the next backward or step says so."""
        exact = self._reducer.abort_backward()
        if self.overlap is not None and self.phase is StepPhase.BOUNDARY_BACKWARD:
            self._take_back_overlap(error)
        if exact:
            self._enter(self._phase_before_backward)
            return
        dropped = self.micro_step % self._accumulation_steps
        logger.warning("backward() of micro-batch %d of step %d raised (%r) after adding part of its gradients to "
                       "the step's accumulation: the step's gradients are dropped (%d micro-batch(es)) and it "
                       "starts again from its first micro-batch", dropped + 1, self.global_step, error, dropped)
        self.micro_step -= dropped
        self._enter(StepPhase.IDLE)

    def _take_back_overlap(self, error: BaseException) -> None:
        overlap, self.overlap = self.overlap, None
        if not overlap.started:
            overlap.cancel()
        elif overlap.check.needs_norm:  # its updates were speculative: each has its undo
            overlap.abandon(reason=f"backward raised {error!r}")
        else:
            overlap.stop()
            self._optimizer.take_back_step()
            self._compute_shards_changed()  # those of the sub-groups it updated
            self.broken = (
                f"backward() raised ({error!r}) after the overlapped step had updated {len(overlap.speculated)} "
                f"sub-group(s) in place (with overlap_step_with_backward and no gradient_clipping or fp16, updates "
                f"made during backward keep no undo copy), so step {self.global_step} cannot be taken back; load a "
                f"checkpoint (engine.load_checkpoint) to go on, or turn overlap_step_with_backward off, with which "
                f"a backward that raises leaves the parameters as they were")
            logger.error("%s", self.broken)

    def _compute_shards_changed(self, tail: StepTail | None = None) -> None:
        """The optimizer wrote new compute shards (or, ``tail``, is writing them): gathered parameters must be
        gathered again, once their sub-group's update has delivered them."""
        for sharded in self._params:
            sharded.mark_stale(tail)

    def land_tail(self) -> None:
        """The last step's updates behind the forward read the gradient slices the coming backward writes: they
        must be done. One that failed leaves the states part-updated: training goes back to a checkpoint."""
        try:
            self._optimizer.land_tail()
        except Exception as err:
            self.broken = (f"optimizer step {self.global_step - 1} failed while its updates finished behind the "
                           f"forward ({err!r}), so its states are part-updated; load a checkpoint "
                           f"(engine.load_checkpoint) to go on, or set overlap_step_with_forward false")
            logger.error("%s", self.broken)
            raise

    def _refuse_if_broken(self) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)

    def loaded_checkpoint(self) -> None:
        """A checkpoint replaced every state: training can go on whatever happened before."""
        self.broken = None

    def step(self, metrics: dict) -> bool | None:
        """Apply the optimizer at a boundary (None between boundaries); True when the step was skipped (fp16
        overflow). Writes the step's figures into ``metrics``."""
        self._refuse_if_broken()
        if self.phase is StepPhase.MICRO_BATCH:
            self._enter(StepPhase.ACCUMULATING)
            return None
        if self.phase is not StepPhase.BOUNDARY_BACKWARD:
            raise RuntimeError(f"step() called before backward(): run engine.backward(loss) for this micro-batch "
                               f"first (step phase {self.phase.value!r})")
        self._enter(StepPhase.STEPPING)
        try:
            return self._apply(metrics)
        finally:
            self._enter(StepPhase.IDLE)

    def _apply(self, metrics: dict) -> bool:
        self.global_grad_norm = None
        start = time.perf_counter()
        overlap = self.overlap
        if overlap is not None:
            # what the host has not begun by now is left to run behind the next forward, when that is on
            metrics["sub_groups_during_backward"] = overlap.finish(leave_the_rest=self._finish_behind_forward)
        coef, skipped, clipped = self._gradient_coef(overlap, metrics)
        self.last_step_rejected = skipped or clipped
        tail = None
        if overlap is not None:
            self.overlap = None
            metrics["overlapped_step"] = overlap.settle(coef, skipped)
            metrics["rollbacks"] = self._optimizer.rollbacks
            tail = self._update_remaining(overlap)
            metrics["sub_groups_behind_forward"] = len(overlap.remaining) if tail is not None else 0
        elif not skipped:
            self._optimizer.step(coef)
        if skipped:
            logger.info("step %d skipped: fp16 gradients overflowed; loss scale now %g",
                        self.global_step, self._loss_scaler.scale)
        else:
            metrics["optimizer_s"] = time.perf_counter() - start
        if overlap is not None or not skipped:  # an undone update changed them back
            self._compute_shards_changed(tail)
        self._reducer.zero()
        self.global_step += 1
        return skipped

    def _update_remaining(self, overlap: OverlappedStep) -> StepTail | None:
        """The settled step's updates not yet made: behind the next forward (returns their tail), or now."""
        if not overlap.remaining:
            return None
        if self._finish_behind_forward:
            return self._optimizer.finish_behind_forward(overlap.remaining, overlap.update_remaining)
        overlap.update_remaining()
        return None

    def _gradient_coef(self, overlap: OverlappedStep | None, metrics: dict) -> tuple[float, bool, bool]:
        """The coefficient this step's gradients get (fp16 unscaling, then clipping), whether the step is
        skipped (fp16 overflow) and whether it clipped; the same for the overlapped step and the one after
        backward (the overlapped step took the sub-groups' norms as backward finished them)."""
        sq_norm = overlap.sq_norm() if overlap is not None else self._reducer.sq_norm()
        coef, skipped = 1.0, False
        if self._loss_scaler is not None:
            overflow = torch.tensor([0.0 if math.isfinite(sq_norm) else 1.0])
            self._comm.all_reduce_max(overflow)  # one rank's overflow skips the step on every rank
            skipped = not self._loss_scaler.update(overflow=bool(overflow.item()))
            coef = 1.0 / self._loss_scaler.applied_scale
        if skipped:
            return coef, True, False
        norm = global_grad_norm(sq_norm, self._comm) * coef
        self.global_grad_norm = norm
        metrics["grad_norm"] = norm
        clip = self._gradient_clipping / (norm + 1e-6) if self._gradient_clipping > 0 else 1.0
        return coef * min(clip, 1.0), False, clip < 1.0

    def cancel_unused_overlap(self) -> None:
        """A boundary forward began an overlapped step but its backward never ran (a non-finite loss the caller
        did not back-propagate, say): nothing was updated, so the step is taken back."""
        if self.overlap is not None and not self.backward_pending and not self.overlap.started:
            overlap, self.overlap = self.overlap, None
            overlap.cancel()
            logger.debug("step %d: unused overlapped step taken back", self.global_step)

    def abandon_overlap(self) -> None:
        """Closing mid-step: stop the overlapped step's worker and undo what it updated."""
        if self.overlap is not None:
            overlap, self.overlap = self.overlap, None
            overlap.abandon()
