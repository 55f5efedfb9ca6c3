"""Full fp32 parameter values: gathered over ranks (the full state dict under the original names), and written back
into every rank's shards."""

from __future__ import annotations

import torch

from infinity.checkpoint.shard_source import ParamShard, ShardRun, ShardSource, ShardSpan


def state_spans(source: ShardSource, state: str) -> dict[int, tuple[ShardRun, ShardSpan]]:
    """Where each trainable parameter's optimizer ``state`` (``master``, ``exp_avg``, ``exp_avg_sq``) rests: its
    sub-group's run and its span in it, by :attr:`ParamShard.index`."""
    return {span.param: (run, span) for run in source.state_runs if run.state == state for span in run.spans}


class FullParamGatherer:
    """Full fp32 values of one parameter at a time, gathered over ranks (a collective per parameter, so every
    rank asks for the same parameters in the same order): a trainable parameter's fp32 master (its sub-group's
    masters are read once, for all of its parameters in turn), a frozen one's compute shard. With another
    ``state``, that optimizer state of trainable parameters (a frozen one has none)."""

    def __init__(self, source: ShardSource, state: str = "master"):
        self._source = source
        self._state = state
        self._state_of = state_spans(source, state)
        self._compute_of = {span.param: (run, span) for run in source.compute_runs for span in run.spans}
        self._masters: torch.Tensor | None = None  # the masters of one sub-group, `_masters_run`
        self._masters_run: ShardRun | None = None

    def gather(self, param: ParamShard) -> torch.Tensor:
        """The parameter's full value: a view (of its shape) of a new fp32 host tensor."""
        if param.index in self._state_of:
            run, span = self._state_of[param.index]
            if self._masters_run is not run:
                if self._masters is None:
                    largest = max(r.numel for r, _ in self._state_of.values())
                    self._masters = torch.empty(largest, dtype=torch.float32)
                self._source.read(run, self._masters[:run.numel])
                self._masters_run = run
            shard = self._masters[span.start:span.start + span.numel]
        elif self._state != "master":
            raise ValueError(f"{param.name} is frozen: it has no optimizer state {self._state!r}")
        else:
            run, span = self._compute_of[param.index]
            values = torch.empty(run.numel, dtype=run.dtype)
            self._source.read(run, values)
            shard = values[span.start:span.start + span.numel].float()
        comm = self._source.comm
        full = torch.empty(param.shard_numel * comm.world_size, dtype=torch.float32)
        comm.all_gather_into(full, shard.contiguous())
        return full[:param.numel].view(param.shape)

    def close(self) -> None:
        self._masters = None
        self._masters_run = None


class FullParamWriter:
    """Full fp32 values written into this rank's shards, each rank its own slice of the same values: a trainable
    parameter's fp32 master (its sub-group's masters are read, changed and written once for all the parameters
    given) and its compute shard (the master in the compute precision); a frozen one's compute shard (and its
    fingerprint). Fetched full tensors are gathered afresh at their next use. With another ``state``, that
    optimizer state of trainable parameters alone."""

    def __init__(self, source: ShardSource, state: str = "master"):
        self._source = source
        self._state = state
        self._state_of = state_spans(source, state)
        self._compute_of = {span.param: run for run in source.compute_runs for span in run.spans}

    def write(self, values: dict[int, torch.Tensor]) -> None:
        """``values``: full value (any shape of the parameter's numel) by :attr:`ParamShard.index`."""
        source, rank = self._source, self._source.comm.rank
        shards: dict[int, torch.Tensor] = {}
        for index, full in values.items():
            param = source.params[index]
            flat = full.detach().reshape(-1).to(torch.float32)
            if flat.numel() != param.numel:
                raise ValueError(f"{param.name}: {flat.numel()} values given for a parameter of shape "
                                 f"{tuple(param.shape)}")
            shard = torch.zeros(param.shard_numel, dtype=torch.float32)  # the flat's padding stays zero
            mine = flat[rank * param.shard_numel:(rank + 1) * param.shard_numel]
            shard[:mine.numel()] = mine
            shards[index] = shard
        frozen = [source.params[i].name for i in shards if i not in self._state_of]
        if self._state != "master" and frozen:
            raise ValueError(f"{', '.join(frozen)}: frozen, with no optimizer state {self._state!r} to write")
        runs = {}
        for index in shards:
            if index in self._state_of:
                run, span = self._state_of[index]
                runs.setdefault(run.index, (run, []))[1].append(span)
        for run, spans in runs.values():
            masters = source.empty_host(run.numel, torch.float32)
            try:
                source.read(run, masters)
                for span in spans:
                    masters[span.start:span.start + span.numel] = shards[span.param]
                source.write(run, masters)
            finally:
                source.free_host(masters)
        if self._state != "master":
            return  # the model's values are the masters'
        for index, shard in shards.items():
            run = self._compute_of[index]
            values_host = shard.to(run.dtype)
            source.write(run, values_host)
            if not source.params[index].trainable:  # frozen values replaced: their fingerprint too
                source.frozen.add(index, values_host)
        source.compute_shards_changed()


def gather_full_state_dict(source: ShardSource) -> dict[str, torch.Tensor]:
    """fp32 masters (trainable) or compute shards (frozen), gathered over ranks, trimmed and reshaped; host tensors.

    Every name a parameter is registered under (tied parameters have several)
    gets an entry, and buffers are included, so ``load_state_dict`` of the
    plain model accepts the result. With tiling, names and shapes are the
    untiled ones.
    """
    gatherer = FullParamGatherer(source)
    try:
        by_index = {param.index: gatherer.gather(param).clone() for param in source.params}
    finally:
        gatherer.close()
    out: dict[str, torch.Tensor] = {}
    for name, index in source.param_names:
        out[name] = by_index[index]
    for buf in source.buffers():
        if not buf.persistent:
            continue  # like state_dict(): non-persistent buffers are not part of the state
        value = buf.tensor.detach().cpu()  # a state dict is host tensors, wherever the engine computes
        out[buf.name] = value.float().clone() if value.is_floating_point() else value.clone()
    plan = source.tiling_plan
    if plan is not None and not plan.is_empty:
        out = plan.untile_state_dict(out)
    return out
