"""Parameters whole outside a forward: read, written, or whole in their ``.data`` for a block, as DeepSpeed's
``zero.GatheredParameters`` and ``safe_get_full_fp32_param``-family make them.

A parameter's full value is gathered from every rank's fp32 master (a frozen one's from its compute shard); a full
value written is sliced by every rank into its master and compute shard. Inside :meth:`WholeParams.gathered` each
parameter's ``.data`` is its full value, in the precision and on the device the model computes in, and on exit it
is sharded again. With a ``modifier_rank``, that rank's values then become every rank's: an element the block
changed takes the new value, one it left as it found it keeps its fp32 master exactly (what the block saw was
rounded to the compute precision). The optimizer's moments are kept. Every verb is collective: each rank calls it
with the same parameters in the same order.

The live engines are registered here by their parameters' ids, so that a parameter leads to its engine
(:func:`engine_of`), and those still open when the interpreter exits are closed then.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import weakref
from typing import Iterator

import torch

from infinity.checkpoint.shard_source import ShardSource
from infinity.checkpoint.state_dict import FullParamGatherer, FullParamWriter
from infinity.params.sharded_param import ShardedParam

logger = logging.getLogger(__name__)

_LIVE: "weakref.WeakKeyDictionary[object, frozenset[int]]" = weakref.WeakKeyDictionary()
"""Each live engine -> the ids of the parameters it manages."""


def register(engine, params: list[ShardedParam]) -> None:
    """``engine`` manages ``params`` from now on (closed, it refuses to gather them; collected, it is forgotten)."""
    _LIVE[engine] = frozenset(id(sharded.param) for sharded in params)


def engine_of(param: torch.Tensor):
    """The live engine that manages ``param``, or None."""
    for engine, ids in list(_LIVE.items()):
        if id(param) in ids:
            return engine
    return None


@atexit.register
def _close_open_engines() -> None:
    """Close the engines a program left open, before the interpreter finalizes: their workers (the optimizer's,
    a step's tail, the copy stream's) are daemon threads, and one stopped inside a native kernel while the
    interpreter tears down aborts the process ("terminate called without an active exception"); closing also
    writes the trace and removes the swap files, as ``close()`` does."""
    for engine in list(_LIVE):
        try:
            engine.close()
        except Exception as err:  # the others are closed whatever one of them raised
            logger.warning("closing an engine left open at exit failed: %r", err)


class WholeParams:
    """One engine's parameters, whole: made afresh for each use (``Engine.whole_params()``)."""

    def __init__(self, source: ShardSource, by_param: dict[int, ShardedParam], device: torch.device):
        self._source = source
        self._by_param = by_param  # id(parameter) -> its ShardedParam
        self._device = device

    def _sharded(self, params) -> list[ShardedParam]:
        unknown = [tuple(param.shape) for param in params if id(param) not in self._by_param]
        if unknown:
            raise ValueError(f"parameter(s) of shape {unknown} are not this engine's")
        return [self._by_param[id(param)] for param in params]

    def shapes(self, named) -> dict[str, tuple[int, ...]]:
        """The full shape of each ``(name, parameter)`` in ``named``, by name: what a file of the whole model must
        give it (a parameter released between passes has an empty ``.data``)."""
        named = list(named)
        sharded = self._sharded([param for _, param in named])
        return {name: tuple(param.slot.shape) for (name, _), param in zip(named, sharded)}

    def read(self, param: torch.nn.Parameter, state: str = "master") -> torch.Tensor:
        """``param``'s full fp32 master (``state``: or that optimizer state), a new tensor on the compute device."""
        (sharded,) = self._sharded([param])
        gatherer = FullParamGatherer(self._source, state)
        try:
            return gatherer.gather(self._source.params[sharded.slot.index]).to(self._device, copy=True)
        finally:
            gatherer.close()

    def read_as_computed(self, param: torch.nn.Parameter) -> torch.Tensor:
        """``param``'s full value in the dtype the model computes in: what a state dict of the model holds."""
        return self.read(param).to(param.dtype)

    def write(self, param: torch.nn.Parameter, value: torch.Tensor, state: str = "master") -> None:
        """Make ``value`` (every rank's the same) ``param``'s full fp32 master and compute shard (``state``: that
        optimizer state alone, after the first step)."""
        (sharded,) = self._sharded([param])
        if state != "master" and self._source.optimizer_state()["step"] == 0:
            raise ValueError(f"{sharded.name}: no optimizer step has run, so there is no {state!r} to set yet")
        FullParamWriter(self._source, state).write({sharded.slot.index: value.detach().to("cpu")})

    def write_moments(self, moments: dict[str, dict[torch.nn.Parameter, torch.Tensor]], *, step: int) -> None:
        """Every trainable parameter's full Adam moments (``moments``: ``exp_avg`` and ``exp_avg_sq``, each with a
        value for every trainable parameter, every rank's the same) and the optimizer's step count, as a
        consolidated optimizer (torch's AdamW ``state_dict``) holds them: the next step is that run's ``step + 1``.
        All of them or none, since one step count stands for every parameter's moments. They are written before the
        count is set, as a checkpoint loads: before the first step a swapped sub-group's moments read as zeros
        (nothing is on disk yet), so its spans' padding is written as zeros, not as whatever the disk held."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"step={step!r}: the optimizer steps the moments were taken over, an int >= 1")
        if sorted(moments) != ["exp_avg", "exp_avg_sq"]:
            raise ValueError(f"moments: exp_avg and exp_avg_sq are written together, got {sorted(moments)}")
        source = self._source
        by_index: dict[str, dict[int, torch.Tensor]] = {}
        for state, values in moments.items():
            given = {sharded.slot.index: value for sharded, value in zip(self._sharded(list(values)), values.values())}
            missing = [p.name for p in source.params if p.trainable and p.index not in given]
            if missing:
                more = " and more" if len(missing) > 3 else ""
                raise ValueError(f"{state}: no value for {', '.join(missing[:3])}{more}: every trainable parameter's "
                                 f"moments are written with the step count")
            by_index[state] = {index: value.detach().to("cpu") for index, value in given.items()}
        for state, values in by_index.items():
            FullParamWriter(source, state).write(values)
        source.load_optimizer_state({**source.optimizer_state(), "step": step})

    @contextlib.contextmanager
    def gathered(self, params, modifier_rank: int | None = None) -> Iterator[None]:
        """Each of ``params`` whole in its ``.data`` for the duration; ``modifier_rank``'s values kept on exit."""
        source = self._source
        comm = source.comm
        sharded = self._sharded(params)
        if modifier_rank is not None and not (isinstance(modifier_rank, int)
                                              and 0 <= modifier_rank < comm.world_size):
            raise ValueError(f"modifier_rank={modifier_rank!r}: a rank of the engine's {comm.world_size} or None")
        gatherer = FullParamGatherer(source)
        try:  # fp32 host values, one parameter at a time, in the order given (a collective each)
            masters = [gatherer.gather(source.params[param.slot.index]).clone() for param in sharded]
        finally:
            gatherer.close()
        originals = [param.param.data for param in sharded]
        for param, full in zip(sharded, masters):
            param.param.data = full.to(device=self._device, dtype=param.param.dtype)
        try:
            yield
            left = [param.param.data for param in sharded]
        finally:
            for param, original in zip(sharded, originals):
                param.param.data = original  # as it was: empty while released, else the view fetches fill
        if modifier_rank is None:
            return
        # The modifier's values are checked on every rank's behalf before anyone waits in the broadcast.
        wrong = [param.name for param, value in zip(sharded, left) if value.numel() != param.slot.numel]
        refused = torch.tensor([float(bool(wrong)) if comm.rank == modifier_rank else 0.0])
        if comm.all_reduce_max(refused).item():
            raise ValueError(f"GatheredParameters(modifier_rank={modifier_rank}): rank {modifier_rank} left "
                             f"{', '.join(wrong) or 'a parameter'} with another number of elements than its "
                             "shape's; nothing was written")
        values: dict[int, torch.Tensor] = {}
        for param, master, value in zip(sharded, masters, left):
            if comm.rank == modifier_rank:
                value = value.detach().to("cpu").reshape(master.shape)
                seen = master.to(value.dtype)
                master = torch.where(value == seen, master, value.to(torch.float32))
            comm.broadcast_from(master, modifier_rank)  # every rank writes its slice of the same values
            values[param.slot.index] = master
        FullParamWriter(source).write(values)
