"""Loading a checkpoint into a run: every shard file verified first (all ranks agree), then the rank's
states streamed in a run at a time, resharded from any saved world size and recast where the compute
precision changed, then the run's counters and scalars."""

from __future__ import annotations

import json
import logging
import time

import torch

from infinity.checkpoint import frozen, rng
from infinity.checkpoint.publish import resolve_checkpoint
from infinity.checkpoint.reader import Checkpoint
from infinity.runtime.comm import Collectives
from infinity.checkpoint.safetensors_io import _DTYPE_NAMES, CheckpointError
from infinity.checkpoint.shard_source import RunCounters, ShardSource, require_step_boundary, unique_buffers

logger = logging.getLogger(__name__)


def load_checkpoint(source: ShardSource, load_dir, *, tag: str | None = None, optimizer_states: bool = True,
                    counters: bool = True) -> dict:
    """Restore a checkpoint written by :func:`~infinity.checkpoint.save.save_checkpoint` into ``source``;
    every rank calls it.

    ``load_dir`` is the ``save_dir`` (then ``tag``, default the ``latest``
    one) or a checkpoint's own folder. A checkpoint of another world size is
    resharded. Returns the saved ``client_state``. Nothing is changed in the
    run until every shard file has been verified.

    ``optimizer_states=False``: the model's values (fp32 masters, compute shards, buffers) alone; the run keeps
    its moments, optimizer step count, learning rate and loss scale. ``counters=False``: the run keeps its step
    counters and RNG states too (the model's values are all that is loaded, with ``optimizer_states=False``).
    """
    require_step_boundary(source, "load_checkpoint")
    comm = source.comm
    path = resolve_checkpoint(load_dir, tag)
    ckpt = Checkpoint(path)
    started = time.perf_counter()
    try:
        mismatch = _first_mismatch(ckpt, source)
        if mismatch:
            raise CheckpointError(f"checkpoint {path} was saved from another model: {mismatch}")
        if ckpt.meta.get("frozen_excluded"):
            _check_frozen_kept(ckpt, source)
        _verify_collectively(ckpt, comm)
        error: BaseException | None = None
        try:
            _load_states(ckpt, source, optimizer_states=optimizer_states, rng_states=counters)
        except Exception as err:  # every rank must learn of it, or the others would go on alone
            error = err
        if _agree(comm, error is not None):
            if error is not None:
                raise error
            raise CheckpointError(f"loading {path} failed on another rank (see its error)")
    finally:
        ckpt.close()
    meta = ckpt.meta
    if optimizer_states:
        source.load_optimizer_state(meta["optimizer"])
        if meta.get("loss_scaler"):
            source.load_loss_scaler_state(meta["loss_scaler"])
    accum = source.config.gradient_accumulation_steps
    global_step = int(meta["global_step"])
    micro_step = int(meta["micro_step"])
    if counters:
        source.set_counters(RunCounters(global_step=global_step,
                                        micro_step=micro_step if micro_step % accum == 0 else global_step * accum))
    source.compute_shards_changed()
    logger.info("loaded checkpoint %s (saved by %d rank(s), step %d) in %.2f s", path, ckpt.world_size,
                global_step, time.perf_counter() - started)
    return json.loads(json.dumps(meta.get("client_state") or {}))


def _first_mismatch(ckpt: Checkpoint, source: ShardSource) -> str | None:
    """The first parameter or buffer that differs between the checkpoint and the run's model."""
    theirs = ckpt.params
    mine = {p.name for p in source.params}
    for param in source.params:
        p = theirs.get(param.name)
        if p is None:
            return f"parameter {param.name!r} (shape {list(param.shape)}) is in this model but not in the checkpoint"
        if list(p["shape"]) != list(param.shape):
            return (f"parameter {param.name!r} has shape {list(p['shape'])} in the checkpoint and "
                    f"{list(param.shape)} in this model")
    for p in ckpt.meta["params"]:
        if p["name"] not in mine:
            return f"parameter {p['name']!r} (shape {p['shape']}) is in the checkpoint but not in this model"
    saved = {b["name"]: b for b in ckpt.meta["buffers"]}
    for buf in unique_buffers(source):
        b = saved.get(buf.name)
        if b is None:
            return f"buffer {buf.name!r} is in this model but not in the checkpoint"
        if list(b["shape"]) != list(buf.tensor.shape):
            return (f"buffer {buf.name!r} has shape {b['shape']} in the checkpoint and {list(buf.tensor.shape)} "
                    f"in this model")
    return None


def _check_frozen_kept(ckpt: Checkpoint, source: ShardSource) -> None:
    """A checkpoint saved without its frozen parameters loads only where each rank holds the same frozen values
    it was saved beside (same base, same world size) and they are still frozen; every rank calls it."""
    comm = source.comm
    why = f"checkpoint {ckpt.path} was saved without its frozen parameters (exclude_frozen_parameters)"
    if ckpt.world_size != comm.world_size:
        raise CheckpointError(f"{why} by {ckpt.world_size} rank(s), so it loads at {ckpt.world_size} rank(s) only "
                              f"(this run has {comm.world_size}); resume there, or save with the frozen parameters "
                              f"to reshard")
    thawed = [p.name for p in source.params if p.trainable and not ckpt.params[p.name]["trainable"]]
    if thawed:
        raise CheckpointError(f"{why}, but parameter {thawed[0]!r} was frozen then and trains here: its values "
                              f"are not in the checkpoint")
    saved = ckpt.reader(comm.rank).metadata.get(frozen.METADATA_KEY) or None
    if _agree(comm, saved != source.frozen.hexdigest()):
        raise CheckpointError(f"{why}, and this run's frozen parameters are not the ones it was saved beside (their "
                              f"sha256 differs on at least one rank): build the run from the same base weights "
                              f"(initialize(..., weights=FOLDER), --hf-model FOLDER) as the run that saved it")


def _agree(comm: Collectives, failed: bool) -> bool:
    """True when any rank failed (a collective: every rank calls it)."""
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    comm.all_reduce_sum(flag)
    return int(flag) > 0


def _verify_collectively(ckpt: Checkpoint, comm: Collectives) -> None:
    """Each rank checks a share of the files; all ranks raise the same error for the first bad one."""
    codes = torch.zeros(2 * ckpt.world_size, dtype=torch.int64)
    for old_rank in range(comm.rank, ckpt.world_size, comm.world_size):
        codes[2 * old_rank], codes[2 * old_rank + 1] = ckpt.check_file(old_rank)
    comm.all_reduce_sum(codes)
    for old_rank in range(ckpt.world_size):
        if int(codes[2 * old_rank]):
            raise ckpt.problem(old_rank, int(codes[2 * old_rank]), int(codes[2 * old_rank + 1]))


def _load_states(ckpt: Checkpoint, source: ShardSource, *, optimizer_states: bool, rng_states: bool) -> None:
    rank, world_size = source.comm.rank, source.comm.world_size
    if ckpt.world_size != world_size:
        logger.info("checkpoint %s was saved by %d rank(s); resharding for %d", ckpt.path, ckpt.world_size,
                    world_size)
    same_dtype = ckpt.meta["compute_dtype"] == _DTYPE_NAMES[source.compute_dtype]
    params = source.params
    host: list[torch.Tensor] = []
    try:
        state_numel = max((run.numel for run in source.state_runs), default=0)
        if state_numel:
            values = source.empty_host(state_numel, torch.float32)
            host.append(values)
        for run in source.state_runs:
            if run.state != "master" and not optimizer_states:
                continue  # the run's own moments stay
            flat = values[:run.numel]
            flat.zero_()
            for span in run.spans:
                p = ckpt.params[params[span.param].name]
                out = flat[span.start:span.start + span.numel]
                if p["trainable"]:
                    ckpt.read_range(run.state, p, rank * span.numel, out)
                elif run.state == "master":  # frozen when saved: its master is its compute shard
                    ckpt.read_range("param", p, rank * span.numel, out)
            source.write(run, flat)
        shard_numel = max((run.numel for run in source.compute_runs), default=0)
        if shard_numel:
            shard = source.empty_host(shard_numel, source.compute_dtype)
            host.append(shard)
        excluded = bool(ckpt.meta.get("frozen_excluded"))
        for run in source.compute_runs:
            saved = [ckpt.params[params[span.param].name] for span in run.spans]
            if excluded and not any(p["trainable"] for p in saved):
                continue  # frozen, left out when saved: this run's own values are the ones it was saved beside
            for span, p in zip(run.spans, saved):
                # The compute shard as saved; in another precision, recast from the fp32 master.
                kind = "param" if same_dtype or not p["trainable"] else "master"
                ckpt.read_range(kind, p, rank * span.numel, shard[span.start:span.start + span.numel])
            source.write(run, shard[:run.numel])
            for span in run.spans:
                if not params[span.param].trainable:  # frozen values replaced: their fingerprint too
                    source.frozen.add(span.param, shard[span.start:span.start + span.numel].clone())
        for buf in unique_buffers(source):
            tensor = buf.tensor
            if tensor.device.type == "cpu" and tensor.is_contiguous():
                ckpt.reader(0).read_into(f"buffer/{buf.name}", tensor.data)
            else:
                host_value = torch.empty(tensor.shape, dtype=tensor.dtype)
                ckpt.reader(0).read_into(f"buffer/{buf.name}", host_value)
                tensor.data.copy_(host_value)
        if rng_states and rank < ckpt.world_size:
            rng.restore(ckpt.reader(rank))
        elif rng_states:
            logger.warning("checkpoint %s has no RNG state for rank %d (saved by %d ranks); keeping this rank's",
                           ckpt.path, rank, ckpt.world_size)
    finally:
        for tensor in host:
            source.free_host(tensor)
