"""Gathering the full, fp32 state dict under the original names."""

from __future__ import annotations

import torch

from infinity.checkpoint.shard_source import ParamShard, ShardRun, ShardSource


class FullParamGatherer:
    """Full fp32 values of one parameter at a time, gathered over ranks (a collective per parameter, so every
    rank asks for the same parameters in the same order): a trainable parameter's fp32 master (its sub-group's
    masters are read once, for all of its parameters in turn), a frozen one's compute shard."""

    def __init__(self, source: ShardSource):
        self._source = source
        self._master_of = {span.param: (run, span) for run in source.state_runs if run.state == "master"
                           for span in run.spans}
        self._compute_of = {span.param: (run, span) for run in source.compute_runs for span in run.spans}
        self._masters: torch.Tensor | None = None  # the masters of one sub-group, `_masters_run`
        self._masters_run: ShardRun | None = None

    def gather(self, param: ParamShard) -> torch.Tensor:
        """The parameter's full value: a view (of its shape) of a new fp32 host tensor."""
        if param.index in self._master_of:
            run, span = self._master_of[param.index]
            if self._masters_run is not run:
                if self._masters is None:
                    largest = max(r.numel for r, _ in self._master_of.values())
                    self._masters = torch.empty(largest, dtype=torch.float32)
                self._source.read(run, self._masters[:run.numel])
                self._masters_run = run
            shard = self._masters[span.start:span.start + span.numel]
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
