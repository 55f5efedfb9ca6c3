"""The end of a settled step, behind the next forward.

Some sub-groups are updated after backward: all of them when an overlapped
step's updates wait for the global norm (gradient clipping or fp16
configured, and the step clips, or the one before it did), and otherwise
those the optimizer's worker had not begun when backward ended (a host's
Adam behind a GPU's backward: most of them, and backward finishes the first
layers' sub-groups, which the next forward needs first, last). With their
states on NVMe, each of those updates first reads its states and then writes
them: seconds of I/O; in host memory, the CPU kernel's pass. The next forward
needs none of it but the new compute shards. So ``step()`` does not wait for
them: a :class:`StepTail` runs the remaining updates on a worker thread in the
order the next forward reads their compute shards (the layout's: from the
first parameters to the last), and a parameter's fetch waits only for its own
sub-group (:meth:`StepTail.wait_for`).

Whatever else reads or reuses what the tail works on waits for all of it
(:meth:`StepTail.land`): the next backward (it overwrites the gradient slices
the tail reads), the next overlapped step's worker (it reuses the staging
sets), checkpoints and state dicts, ``flush`` and ``close``.

The updates are the same ones in the same arithmetic, with the step number and
learning rate the step settled with, so results are bitwise those of a step
that updates everything before returning.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from infinity.placement.copies import Copies, CopyDone
from infinity.placement.layout import SubGroup
from infinity.runtime.trace import Timeline

logger = logging.getLogger(__name__)


class StepTail:
    """A worker thread that updates ``groups`` in order, and the events the next forward waits on."""

    def __init__(self, groups: list[SubGroup], update_all: Callable[[Callable[[SubGroup], None]], None], *,
                 copies: Copies, timeline: "Timeline | None" = None):
        """``update_all(delivered)`` updates ``groups`` in their order and calls ``delivered(group)`` as each
        one's new compute shards are on their way home (an NVMe write queued, a copy issued)."""
        self._copies = copies
        self._timeline = timeline
        self._group_of_slot = {slot.index: group.index for group in groups for slot in group.slots}
        self._delivered = {group.index: threading.Event() for group in groups}
        # For each delivered sub-group, the copy its new compute shards cross with (device memory): the compute
        # stream waits on it once, the first time a parameter of the sub-group is fetched.
        self._copy_of_group: dict[int, CopyDone] = {}
        self._error: BaseException | None = None
        self._raised = False
        self._update_all = update_all
        self._thread = threading.Thread(target=self._run, name="infinity-step-tail", daemon=True)
        self._thread.start()

    # -- the worker ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._update_all(self._mark_delivered)
        except BaseException as err:  # raised to the main thread by wait_for() or land()
            self._error = err
        finally:
            for event in self._delivered.values():
                event.set()  # a waiter wakes and finds the error (or the sub-groups no update reached)

    def _mark_delivered(self, group: SubGroup) -> None:
        self._copy_of_group[group.index] = self._copies.last()  # covers the copies this update issued
        self._delivered[group.index].set()

    # -- what the next forward and everything else wait for -----------------------
    def delivered(self, slot_index: int) -> bool:
        """The slot's new compute shard is on its way home (a fetch issued now reads it), or the tail has no
        update for it."""
        group = self._group_of_slot.get(slot_index)
        return group is None or self._delivered[group].is_set()

    def wait_for(self, slot_index: int) -> None:
        """Before a fetch of the slot's shard: its sub-group's update has delivered it (the NVMe store orders a
        read after the write queued for the same key; the compute stream waits for the copy down)."""
        group = self._group_of_slot.get(slot_index)
        if group is None:
            return
        event = self._delivered[group]
        if not event.is_set():
            start = time.perf_counter()
            event.wait()
            if self._timeline is not None:
                self._timeline.waited(start, time.perf_counter(), f"step tail: sub-group {group}")
        self._raise_error()
        done = self._copy_of_group.pop(group, None)
        if done is not None:
            self._copies.compute_waits(done)  # the gather reads the shard that copy writes

    def land(self) -> None:
        """Wait for every update of the tail (its writes may still be in flight, as any step's write-behind)."""
        if self._thread.is_alive():
            start = time.perf_counter()
            self._thread.join()
            if self._timeline is not None:
                self._timeline.waited(start, time.perf_counter(), "step tail")
        self._raise_error()

    def wait_ended(self) -> None:
        """Wait for the worker to end, without raising its failure (the main thread raises it, to the forward or
        backward that needs the step's results)."""
        self._thread.join()

    @property
    def failed(self) -> BaseException | None:
        return self._error

    def _raise_error(self) -> None:
        if self._error is None:
            return
        if not self._raised:
            self._raised = True
            raise self._error
        raise RuntimeError(f"the last optimizer step failed while its updates finished behind the forward "
                           f"({self._error!r}); its states are not all updated: load a checkpoint "
                           f"(engine.load_checkpoint) to go on") from self._error
