"""The dynamic prefetcher: swap shards in ahead of need, in the order the
last pass used them.

A pass (one micro-batch's forward and backward) records every fetch request
in order. The next pass follows that trace: each time a request matches the
trace, the swap-ins of the parameters coming next are started, as far ahead as
``prefetch_bucket_size`` elements and as the live-parameter budget allow, so
the NVMe reads run while the current module computes. A released parameter
whose next use is within ``max_reuse_distance`` elements of fetches is kept
gathered (within the same budget) instead of being fetched again.

Between the micro-batches of one step nothing changes the shards, so a pass
that another of the same step follows looks past its own end: the next pass
follows the same plan, and what its forward fetches first (the first layers,
which the backward used last) is kept gathered across the two when its next
use is within ``max_reuse_distance``, as FSDP2's ``reshard_after_backward=False``
does for gradient accumulation. The step's updates make the shards new, and
every parameter kept so is released by the pass that ends the step. A forward
without grad changes no shard either: an evaluation's batches and generate's
tokens keep, from one forward to the next, what the live-parameter budget and
the memory's room allow, instead of fetching the model again for each.

A forward without grad (an evaluation, each forward of ``generate``) fetches
only a training pass's first part: it follows a plan of its own, the last
such pass's, so that training and evaluation taking turns leave each its plan.

When the order changes (a data-dependent branch, adapters switched on or off)
the pass stops prefetching, fetches on demand, and its trace becomes the plan
for the next pass of its kind: no error, no deadlock, one log line.

With several ranks, whether a parameter stays gathered decides whether a rank
joins its next all-gather, so every rank must decide alike. A prefetch only
reads locally and may differ between ranks (a read buffer not free yet, the
last step's update of a shard still running); a keep is decided from what is
the same on every rank: the elements gathered (all-gathered, not merely read
ahead), and, where device memory is host memory and so has a budget, the room
the ranks agreed on at the pass's start (the least of theirs; budgets are read
from each rank's free memory) less what has been gathered since. For room a
fetch on demand cannot find, only reads ahead are given back, never what is
gathered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from infinity.config.sections import ZeroConfig
from infinity.params.sharded_param import ParamState, ShardedParam
from infinity.storage import TierStats

logger = logging.getLogger(__name__)


class Prefetcher:
    def __init__(self, zero: ZeroConfig, *, itemsize: int, device_stats: TierStats, reserve_nbytes: int = 0,
                 least_over_ranks: Callable[[int], int] | None = None, cached_nbytes: Callable[[], int] = lambda: 0):
        """``zero`` gives how far ahead to fetch (``prefetch_bucket_size``), the live-parameter budget
        (``max_live_parameters``) and how close a next use keeps a parameter gathered (``max_reuse_distance``),
        all in elements. ``least_over_ranks``: with several ranks, the least of a value over them (a collective
        every rank calls at the same point); keeps are then decided alike on every rank. ``cached_nbytes``: the
        bytes of released full tensors kept for reuse (:class:`~infinity.params.gathered_blocks.ReusedBlocks`):
        the device tier counts them, but they are neither gathered parameters nor room taken (an allocation that
        needs them gets them back first)."""
        self._itemsize = itemsize             # bytes of a full tensor's element
        self._bucket_numel = zero.prefetch_bucket_size
        self._max_live_numel = zero.max_live_parameters
        self._max_reuse_distance = zero.max_reuse_distance
        self._device = device_stats
        self._reserve_nbytes = reserve_nbytes  # kept free in the memory budget for fetches on demand
        self._cached_nbytes = cached_nbytes
        # one plan per kind of pass: a forward without grad (evaluation, generation) fetches only the forward's
        # part, and following it must not cost the training passes after it their plan
        self._plans = {True: FetchPlan([]), False: FetchPlan([])}  # by "a backward follows" (grad enabled)
        self._training = True                 # the running pass's kind: it follows self._plans[self._training]
        self._next_pass_follows = False       # this pass's step goes on: the next pass follows the same plan
        self._trace: list[ShardedParam] = []  # this pass's requests so far
        self._last_request: dict[int, int] = {}  # id(param) -> its latest position in this pass
        self._on_plan = False
        self._issued_upto = 0                 # plan positions below this have had their prefetch considered
        # prefetched into host buffers, their reads not landed: each goes on to its copy up once its read is done
        self._reading: list[ShardedParam] = []
        # gathered by choice this pass (prefetched ahead of need, or kept for reuse): given back when a fetch on
        # demand finds no room (give_back_held)
        self._held: list[ShardedParam] = []
        self.prefetched = 0                   # swap-ins started ahead of need (metrics)
        self.order_changes = 0
        self._alike_on_ranks = least_over_ranks is not None  # keeps decided from what is the same on every rank
        # Where device memory has a budget (it is host memory) the ranks agree on its room at each pass; a GPU's
        # has none on any rank, so no collective is made there.
        self._least_over_ranks = least_over_ranks if device_stats.room_nbytes() is not None else None
        self._gathered_numel = 0              # elements of the full tensors all-gathered and not freed since
        self._pass_room_nbytes: int | None = None  # the budget's room the ranks agreed on at the pass's start
        self._gathered_at_pass_start = 0

    # -- a pass ------------------------------------------------------------------
    def begin_pass(self, kept: list[ShardedParam] = (), *, training: bool = True, step_goes_on: bool = False) -> None:
        """``kept``: what the last pass kept gathered for this one (:meth:`end_pass`); given back like anything
        else held by choice when a fetch on demand finds no room. ``training``: a backward follows the forward (grad
        is enabled); such a pass follows the plan of the last one like it, a forward alone that of the last forward
        alone. ``step_goes_on``: no update comes before the next pass (a forward alone, or one whose backward is not
        its step's last), so what the next pass uses early may stay gathered."""
        self._held = [p for p in kept if p.state is not ParamState.RELEASED]
        if self._least_over_ranks is not None:
            self._agree_on_room()
        self._trace = []
        self._last_request = {}
        self._training = training
        self._on_plan = bool(self._plan.params)
        self._issued_upto = 0
        self._next_pass_follows = step_goes_on

    def begin_backward(self, *, step_goes_on: bool) -> None:
        """The pass's backward begins: whether its step goes on after it, as known now (a boundary may have been
        forced since the forward began)."""
        self._next_pass_follows = step_goes_on

    def end_pass(self, *, completed: bool = True) -> list[ShardedParam]:
        """The pass is over: its trace becomes the plan where the order changed. Returns the parameters kept
        gathered for the next pass of the same step (released and kept for that pass's use, up to date); the
        caller frees every other. A pass that did not complete (it raised: an interrupted ``generate``) keeps
        nothing, and its partial trace is no plan."""
        kept = []
        if not completed:
            pass  # what it fetched is released; the plans stay as the last whole passes left them
        elif self._trace != self._plan.params:
            if self._plan.params:
                self.order_changes += 1
                logger.info("the order of parameter fetches changed (pass of %d requests, plan of %d): "
                            "fetching on demand this pass and following the new order from the next",
                            len(self._trace), len(self._plan.params))
            self._plans[self._training] = FetchPlan(self._trace)
        elif self._next_pass_follows:
            kept = [p for p in dict.fromkeys(self._held)  # once each (a parameter kept twice is listed twice)
                    if p.holders == 0 and p.state is ParamState.FETCHED and not p.stale
                    and not (p.persistent or p.aliased)]
        self._trace = []
        self._held = []
        self._on_plan = False
        self._next_pass_follows = False
        return kept

    @property
    def plan(self) -> list[ShardedParam]:
        """The requests of the last complete pass of the running (or last) pass's kind."""
        return self._plan.params

    @property
    def _plan(self) -> "FetchPlan":
        return self._plans[self._training]

    # -- what a ShardedParam tells and asks ----------------------------------------
    def fetch_requested(self, param: ShardedParam) -> None:
        """Every fetch request, in order: the pass's trace, and the point to issue the next prefetches."""
        position = len(self._trace)
        self._trace.append(param)
        self._last_request[id(param)] = position
        if not self._on_plan:
            return
        self._advance_reads()
        if position >= len(self._plan.params) or self._plan.params[position] is not param:
            self._on_plan = False  # off the plan: on demand until the pass ends
            return
        self._prefetch_after(position)

    def keeps_gathered(self, param: ShardedParam) -> bool:
        """Keep a released parameter gathered when the plan uses it again soon and the budget allows."""
        if not self._on_plan or self._max_reuse_distance == 0:
            return False
        position = len(self._trace) - 1
        last = self._last_request.get(id(param))
        if last is None or position >= len(self._plan.params):
            return False
        plan = self._plan
        nxt = plan.next_use[last]  # on the plan, the trace so far is the plan's prefix
        after_now = plan.numel_before[position] + plan.params[position].slot.numel  # elements up to this request
        if nxt < len(plan.params):
            distance = plan.numel_before[nxt] - after_now
        elif self._next_pass_follows:
            # no use left in this pass: the next pass (same plan, same shards) uses it after the rest of this one
            distance = plan.numel - after_now + plan.numel_before[plan.first_use[id(param)]]
        else:
            return False
        keep = distance <= self._max_reuse_distance and self._may_keep(param.full_nbytes)
        if keep:
            self._held.append(param)
        return keep

    def give_back_held(self) -> int:
        """A fetch on demand found no room in the memory budget: free what only this prefetcher holds gathered
        (prefetches nobody has asked for yet, parameters kept for a reuse), so that the fetch can proceed.
        Returns how many were freed; they are fetched again on demand when their turn comes. With several ranks
        only reads ahead are freed: a gathered parameter freed on one rank alone would be all-gathered by it
        alone."""
        freed, still_held = 0, []
        for p in self._held:
            if p.holders == 0 and not p.persistent and p.state is not ParamState.RELEASED:
                if self._alike_on_ranks and p.state is ParamState.FETCHED:
                    still_held.append(p)
                    continue
                p.force_release()  # a read in flight lands first
                freed += 1
        self._held = still_held
        if freed:
            logger.debug("a fetch on demand needed room: %d parameters prefetched or kept for reuse given back",
                         freed)
        return freed

    def gathered(self, param: ShardedParam) -> None:
        """``param``'s full tensor was all-gathered (it was not gathered before)."""
        self._gathered_numel += param.slot.padded_numel

    def freed(self, param: ShardedParam) -> None:
        """``param``'s gathered full tensor was freed."""
        self._gathered_numel -= param.slot.padded_numel

    def land_in_flight(self) -> None:
        """The read pool ran dry: complete every prefetch's read and issue its copy up, so its host buffer
        comes back once that copy has landed (GPU only)."""
        for p in self._reading:
            p.land_prefetch()
        self._reading = []

    # -- internals ----------------------------------------------------------------
    def _prefetch_after(self, position: int) -> None:
        start = max(position + 1, self._issued_upto)
        plan = self._plan
        ahead_numel = plan.numel_before[start] - plan.numel_before[position + 1] if start < len(plan.params) else 0
        i = start
        while i < len(plan.params):
            p = plan.params[i]
            numel = p.slot.numel
            if ahead_numel + numel > self._bucket_numel and i > position + 1:
                break
            if p.state is ParamState.RELEASED and (p.needs_swap_in or p.needs_copy_up):
                if not p.new_shard_delivered:
                    break  # the last step's tail is still updating it: ask again at the next request
                if self._live_numel() + p.slot.padded_numel > self._max_live_numel or not self._room_for(p.full_nbytes):
                    break
                if p.prefetch():
                    self.prefetched += 1
                    self._held.append(p)
                    if p.reading_into_buffer:
                        self._reading.append(p)
            ahead_numel += numel
            i += 1
        self._issued_upto = i

    def _advance_reads(self) -> None:
        """Prefetches whose NVMe reads have landed issue their copies up now, so those overlap compute too.
        Only reads into host buffers are looked at: a copy up from host memory, or a read straight into the
        full tensor, has no next stage to issue (looking at every prefetch in flight at every request took a
        small model's forward time quadratic in its parameter count)."""
        still = []
        for p in self._reading:
            p.advance()
            if p.reading_into_buffer:
                still.append(p)
        self._reading = still

    def _may_keep(self, nbytes: int) -> bool:
        """The live-parameter budget and the memory budget allow keeping ``nbytes`` more gathered."""
        if not self._alike_on_ranks:
            return self._live_numel() <= self._max_live_numel and self._room_for(nbytes)
        # alike on every rank (the module docstring): what is gathered, and the room agreed at the pass's start
        if self._gathered_numel > self._max_live_numel:
            return False
        if self._pass_room_nbytes is None:
            return True
        gathered_since = (self._gathered_numel - self._gathered_at_pass_start) * self._itemsize
        return self._pass_room_nbytes - gathered_since - nbytes >= self._reserve_nbytes

    def _agree_on_room(self) -> None:
        """The least room of the ranks' memory budgets, now (a collective: every rank begins each pass)."""
        self._gathered_at_pass_start = self._gathered_numel
        self._pass_room_nbytes = self._least_over_ranks(self._room_nbytes())

    def _room_for(self, nbytes: int) -> bool:
        """Keeping ``nbytes`` more gathered leaves the reserve free in the memory budget (where there is one)."""
        room = self._room_nbytes()
        return room is None or room - nbytes >= self._reserve_nbytes

    def _room_nbytes(self) -> int | None:
        """The memory budget's room for gathered parameters (None: no budget): blocks kept for reuse count as room."""
        room = self._device.room_nbytes()
        return None if room is None else room + self._cached_nbytes()

    def _live_numel(self) -> int:
        # device bytes are gathered parameters (and resident shards when params stay on the device), but for the
        # released blocks kept for reuse
        return (self._device.live_nbytes - self._cached_nbytes()) // self._itemsize


class FetchPlan:
    """One pass's fetch requests in order, and what following them asks of each position."""

    def __init__(self, trace: list[ShardedParam]):
        self.params = list(trace)
        self.numel_before: list[int] = []     # elements requested before each position
        total = 0
        for p in self.params:
            self.numel_before.append(total)
            total += p.slot.numel
        self.numel = total                    # elements requested in the whole plan
        self.next_use = [len(self.params)] * len(self.params)  # each position's parameter's next position
        last_seen: dict[int, int] = {}
        for i in range(len(self.params) - 1, -1, -1):
            key = id(self.params[i])
            self.next_use[i] = last_seen.get(key, len(self.params))
            last_seen[key] = i
        self.first_use = last_seen            # id(param) -> its first position (walked backwards)
