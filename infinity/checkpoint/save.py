"""Saving a checkpoint: the body of ``meta.json``, and this rank's shard file streamed from whichever tier
holds each run of shards (the publish protocol of :mod:`.publish` makes the whole atomic)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from infinity.checkpoint import frozen, rng
from infinity.checkpoint.files import FORMAT, VERSION
from infinity.checkpoint.publish import check_tag, publish_collectively
from infinity.checkpoint.safetensors_io import _DTYPE_NAMES, SafetensorsWriter
from infinity.checkpoint.shard_source import ShardRun, ShardSource, require_step_boundary, unique_buffers

logger = logging.getLogger(__name__)


def save_checkpoint(source: ShardSource, save_dir, *, tag: str | None = None, client_state: dict | None = None,
                    exclude_frozen_parameters: bool = False) -> str:
    """Write this rank's shards and the run's state under ``save_dir/tag`` atomically; every rank calls it.

    Only at an optimizer-step boundary (gradients are not saved). ``client_state``
    (rank 0's) must be JSON-able; it comes back from
    :func:`~infinity.checkpoint.load.load_checkpoint`. Returns the tag (default ``global_step<N>``).
    ``exclude_frozen_parameters`` (DeepSpeed's name): the frozen parameters' compute shards are left out and
    each rank's file holds its fingerprint of them instead (:mod:`infinity.checkpoint.frozen`).
    """
    require_step_boundary(source, "save_checkpoint")
    tag = f"global_step{source.counters().global_step}" if tag is None else tag
    check_tag(tag)
    exclude = exclude_frozen_parameters and any(not p.trainable for p in source.params)
    return publish_collectively(source.comm, Path(save_dir), tag,
                                make_meta=lambda: _meta_body(source, tag, _check_client_state(client_state), exclude),
                                write_rank_file=lambda path: _write_shard_file(source, path, exclude))


# ---------------------------------------------------------------------------------------------- meta.json

def _json_problem(value, where: str) -> str | None:
    """Where ``value`` holds something JSON cannot carry, or None."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            problem = _json_problem(item, f"{where}[{i}]")
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has a key {key!r} of type {type(key).__name__} (keys must be str)"
            problem = _json_problem(item, f"{where}[{key!r}]")
            if problem:
                return problem
        return None
    return f"{where} is a {type(value).__name__}"


def _check_client_state(client_state) -> dict:
    if client_state is None:
        return {}
    if not isinstance(client_state, dict):
        raise ValueError(f"client_state must be a dict, got {type(client_state).__name__}")
    problem = _json_problem(client_state, "client_state")
    if problem:
        raise ValueError(f"client_state must hold only JSON values (dict, list, str, int, float, bool, None): "
                         f"{problem}")
    return client_state


def _meta_body(source: ShardSource, tag: str, client_state: dict, frozen_excluded: bool) -> dict:
    config = source.config
    counters = source.counters()
    return {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "world_size": source.comm.world_size,
        "global_step": counters.global_step,
        "micro_step": counters.micro_step,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "precision": config.precision,
        "compute_dtype": _DTYPE_NAMES[source.compute_dtype],
        "optimizer": source.optimizer_state(),
        "loss_scaler": source.loss_scaler_state(),
        "sub_groups": [[run.offset, run.offset + run.numel, [span.param for span in run.spans]]
                       for run in source.state_runs if run.state == "master"],
        **_model_meta(source),
        "frozen_excluded": frozen_excluded,
        "config": _config_json(config),
        "client_state": client_state,
        "saved_at": time.time(),
    }


def _model_meta(source: ShardSource) -> dict:
    names: dict[int, list[str]] = {}
    for name, index in source.param_names:
        names.setdefault(index, []).append(name)
    params = [{"name": p.name, "shape": list(p.shape), "numel": p.numel, "shard_numel": p.shard_numel,
               "trainable": p.trainable, "names": names.get(p.index, [p.name])}
              for p in source.params]
    buffers = [{"name": b.name, "shape": list(b.tensor.shape), "dtype": str(b.tensor.dtype).removeprefix("torch."),
                "persistent": b.persistent}
               for b in unique_buffers(source)]
    plan = source.tiling_plan
    tiling = None
    if plan is not None and not plan.is_empty:
        tiling = [{"name": t.name, "shape": list(t.shape), "tied_to": t.tied_to,
                   "tiles": [{"name": s.name, "rows": list(s.rows), "cols": None if s.cols is None else list(s.cols)}
                             for s in t.tiles]}
                  for t in plan.tensors.values()]
    return {"params": params, "buffers": buffers, "tiling": tiling}


def _config_json(config) -> dict:
    try:
        return json.loads(json.dumps(dataclasses.asdict(config), default=str))
    except TypeError:
        return {}


# ---------------------------------------------------------------------------------------------- the shard file

def _write_shard_file(source: ShardSource, path: Path, frozen_excluded: bool) -> tuple[bytes, int]:
    """Stream this rank's shards into ``path``: one run (a sub-group's state, a compute shard) at a time,
    double-buffered so that reading the next (from NVMe, say) overlaps writing this one. ``frozen_excluded``:
    no frozen parameter's compute shard (one run each), their fingerprint in the metadata instead."""
    rank = source.comm.rank
    compute_runs = tuple(run for run in source.compute_runs
                         if not (frozen_excluded and all(not source.params[s.param].trainable for s in run.spans)))
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for run in (*source.state_runs, *compute_runs):
        entries += [(span.key, run.dtype, (span.numel,)) for span in run.spans]
    buffers = unique_buffers(source) if rank == 0 else []
    entries += [(f"buffer/{b.name}", b.tensor.dtype, tuple(b.tensor.shape)) for b in buffers]
    rng_tensors, rng_state = rng.capture()
    entries += [(name, t.dtype, tuple(t.shape)) for name, t in rng_tensors.items()]
    metadata = {"format": FORMAT, "version": str(VERSION), "rank": str(rank),
                "world_size": str(source.comm.world_size), rng.METADATA_KEY: json.dumps(rng_state)}
    if frozen_excluded:
        metadata[frozen.METADATA_KEY] = source.frozen.hexdigest() or ""

    state_numel = max((run.numel for run in source.state_runs), default=0)
    shard_numel = max((run.numel for run in compute_runs), default=0)
    host: list[torch.Tensor] = []  # host buffers to give back

    def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = source.empty_host(numel, dtype)
        host.append(tensor)
        return tensor

    try:
        with SafetensorsWriter(path, entries, metadata) as writer, ThreadPoolExecutor(1, "ckpt-write") as pool:
            # Writes run in submission order on the one worker; a buffer is refilled only once its write is done.
            futures: list[Future] = []
            in_buffer: list[Future | None] = [None, None]

            def submit(job: Callable, *args) -> Future:
                futures.append(pool.submit(job, *args))
                return futures[-1]

            def take(i: int) -> None:
                if in_buffer[i] is not None:
                    in_buffer[i].result()  # raises the write's error, if any
                    in_buffer[i] = None

            def write_run(run: ShardRun, values: torch.Tensor) -> None:
                for span in run.spans:
                    writer.write(span.key, values[span.start:span.start + span.numel])

            n = 0

            def stream(runs: tuple[ShardRun, ...], buffers: list[torch.Tensor]) -> None:
                nonlocal n
                for run in runs:
                    resident = source.host_view(run)
                    if resident is not None:  # rests in host memory: written from where it is
                        submit(write_run, run, resident)
                        continue
                    i, n = n % 2, n + 1
                    take(i)
                    values = buffers[i].view(run.dtype)[:run.numel]
                    source.read(run, values)
                    in_buffer[i] = submit(write_run, run, values)

            # One pair of buffers for every state run, in the widest dtype they are saved in (a narrower run
            # reads into a view of it).
            widest = max((run.dtype for run in source.state_runs), key=lambda dtype: dtype.itemsize,
                         default=torch.float32)
            states = [host_empty(state_numel, widest) for _ in range(2)] if state_numel else []
            stream(source.state_runs, states)
            shards = [host_empty(shard_numel, source.compute_dtype) for _ in range(2)] if shard_numel else []
            stream(compute_runs, shards)
            for b in buffers:
                submit(writer.write, f"buffer/{b.name}", b.tensor.detach().cpu())
            for name, tensor in rng_tensors.items():
                submit(writer.write, name, tensor)
            for future in futures:
                future.result()  # the first error, in file order
            digest, nbytes = writer.close()
            logger.debug("wrote %s: %d bytes, sha256 %s", path, nbytes, digest.hex())
            return digest, nbytes
    finally:
        for tensor in host:
            source.free_host(tensor)
