"""Sharded checkpoints: save and resume without losing a bit, reshard to another
world size, consolidate into one state dict.

A checkpoint is a directory ``save_dir/<tag>/``::

    meta.json                           rank 0: everything that is not a tensor (see below)
    shard-00000-of-00002.safetensors    rank 0's shards, its RNG state, the module's buffers
    shard-00001-of-00002.safetensors    rank 1's shards, its RNG state
    save_dir/latest                     the tag of the newest complete checkpoint, written last

Each rank's file is a plain safetensors file holding, for every parameter,
1-D tensors of ``shard_numel`` elements (the rank's slice of the flattened,
zero-padded parameter):

* ``param/<name>``: the compute shard, in compute precision (every parameter);
* ``master/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``: fp32 (trainable ones);

plus ``buffer/<name>`` (rank 0 only, full shape) and ``rng/torch`` (uint8,
``rng/cuda`` where there is a GPU). Its header ``__metadata__`` holds the rank,
the world size and the numpy/python RNG states as JSON.

The file is written tensor by tensor (the header first, its offsets computed
from the layout), so a rank's state streams through two sub-group-sized host
buffers from whichever tier holds it; NVMe state is never staged whole in RAM.

``meta.json`` holds the format version, the world size, every parameter's
name, shape, numel, shard size, trainability and aliases (tied names), the
buffers, the tiling plan's dense names, the step counters, the optimizer's
step and lr, the loss scaler, the config, the caller's ``client_state``, the
size and sha256 of every shard file, and a sha256 of its own content.

Atomicity: all ranks write into ``save_dir/.tmp-<pid>-<nonce>-<tag>``, fsync
their file, and agree (one all-gather) that every file is complete; rank 0
then writes ``meta.json``, fsyncs it and the directory, renames the directory
to ``<tag>`` and finally replaces ``latest`` (temporary file, fsync, rename).
A crash at any moment leaves ``latest`` naming a complete checkpoint.
Every error is agreed on by all ranks, so a rank that fails never leaves the
others waiting in a collective. ``save_dir`` must be one filesystem shared by
all ranks.

Loading never unpickles: only JSON and safetensors are read, every shard file
is checked against its recorded size and sha256 before a byte of it is used,
and a checkpoint of another model is refused naming the first tensor that
differs. A checkpoint saved at another world size is resharded on load: each
rank reads its range of every parameter's padded flat from the ranks' files
that hold it.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from infinity.placement import Memory
from infinity.safetensors_io import (  # noqa: F401  (CheckpointError is part of this module's interface)
    _DTYPE_NAMES,
    CheckpointError,
    SafetensorsReader,
    SafetensorsWriter,
    file_sha256,
)

logger = logging.getLogger(__name__)

FORMAT = "infinity-checkpoint"
VERSION = 1
META_FILE = "meta.json"
LATEST_FILE = "latest"
STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")


# ---------------------------------------------------------------------------------------------- files

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, whatever happens: temporary file, fsync, rename, fsync."""
    tmp = path.with_name(f"{path.name}{_TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with open(tmp, "x") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _shard_file(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def _check_tag(tag: str) -> None:
    if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag) or tag == LATEST_FILE:
        raise ValueError(f"checkpoint tag {tag!r} is not usable as a folder name: use letters, digits and _.+=- "
                         f"(not starting with '.' or '-', and not {LATEST_FILE!r})")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_leftovers(save_dir: Path, keep: str) -> None:
    """Remove what interrupted saves left in ``save_dir``: temporary folders of dead processes, backups."""
    for entry in save_dir.iterdir():
        name = entry.name
        if name == keep:
            continue
        if name.startswith(_TMP_PREFIX) or name.startswith(f"{LATEST_FILE}{_TMP_PREFIX}"):
            pid_text = name.split(_TMP_PREFIX, 1)[1].split("-", 1)[0]
            if pid_text.isdigit() and int(pid_text) != os.getpid() and not _pid_alive(int(pid_text)):
                logger.info("removing %s, left by an interrupted save", entry)
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        elif name.startswith(_OLD_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def read_latest(save_dir: Path) -> str | None:
    try:
        text = (Path(save_dir) / LATEST_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return text or None


def resolve_checkpoint(load_dir, tag: str | None = None) -> Path:
    """The checkpoint folder: ``load_dir/tag``, ``load_dir/<latest>``, or ``load_dir`` itself if it is one."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise FileNotFoundError(errno.ENOENT, "checkpoint folder does not exist", str(load_dir))
    if tag is None:
        if (load_dir / META_FILE).is_file():
            return load_dir
        tag = read_latest(load_dir)
        if tag is None:
            raise FileNotFoundError(errno.ENOENT, f"no checkpoint here: no {LATEST_FILE!r} file (pass a tag, or the "
                                                  f"checkpoint's own folder)", str(load_dir))
    if "/" in tag or tag in ("", ".", ".."):
        raise ValueError(f"checkpoint tag {tag!r} is not a folder name")
    path = load_dir / tag
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(errno.ENOENT, f"checkpoint {tag!r} not found (no {META_FILE})", str(path))
    return path


# ---------------------------------------------------------------------------------------------- meta.json

def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _write_meta(path: Path, body: dict) -> None:
    meta = dict(body, checksum=hashlib.sha256(_canonical(body)).hexdigest())
    with open(path, "x") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_meta(checkpoint: Path) -> dict:
    """``meta.json`` of a checkpoint folder, checked against its own sha256 and our format version."""
    path = Path(checkpoint) / META_FILE
    try:
        meta = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint file {path} is damaged: not valid JSON ({err})") from None
    if not isinstance(meta, dict) or "checksum" not in meta:
        raise CheckpointError(f"checkpoint file {path} is damaged or not ours: no checksum")
    checksum = meta.pop("checksum")
    if hashlib.sha256(_canonical(meta)).hexdigest() != checksum:
        raise CheckpointError(f"checkpoint file {path} is damaged: its content does not match its checksum")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint file {path} is not an {FORMAT} (format {meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"checkpoint file {path} has format version {meta.get('version')!r}; this build "
                              f"reads version {VERSION}")
    return meta


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


def _model_meta(engine) -> dict:
    module = engine.module
    aliases: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    params = []
    for sharded in engine.params:
        slot = sharded.slot
        params.append({"name": slot.name, "shape": list(slot.shape), "numel": slot.numel,
                       "shard_numel": slot.shard_numel, "trainable": slot.trainable,
                       "names": aliases.get(id(sharded.param), [slot.name])})
    buffers = []
    for name, buf in module.named_buffers():
        owner, _, local = name.rpartition(".")
        persistent = local not in module.get_submodule(owner)._non_persistent_buffers_set
        buffers.append({"name": name, "shape": list(buf.shape), "dtype": str(buf.dtype).removeprefix("torch."),
                        "persistent": persistent})
    plan = getattr(engine, "tiling_plan", None)
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


# ---------------------------------------------------------------------------------------------- RNG

def _rng_capture() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss_next]}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return tensors, state


def _rng_restore(reader: SafetensorsReader) -> None:
    torch.set_rng_state(reader.read("rng/torch"))
    if "rng/cuda" in reader.tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(reader.read("rng/cuda"))
    try:
        state = json.loads(reader.metadata.get("rng", "{}"))
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
        if "numpy" in state:
            import numpy as np
            s = state["numpy"]
            np.random.set_state((s["kind"], np.array(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"],
                                 s["cached_gaussian"]))
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint file {reader.path}: bad RNG state ({err})") from None


# ---------------------------------------------------------------------------------------------- saving

def save_checkpoint(engine, save_dir, *, tag: str | None = None, client_state: dict | None = None) -> str:
    """Write this rank's shards and the run's state under ``save_dir/tag`` atomically; every rank calls it.

    Only at an optimizer-step boundary (gradients are not saved). ``client_state``
    (rank 0's) must be JSON-able; it comes back from :func:`load_checkpoint`.
    Returns the tag (default ``global_step<N>``).
    """
    _check_step_boundary(engine, "save_checkpoint")
    tag = f"global_step{engine.global_step}" if tag is None else tag
    _check_tag(tag)
    save_dir = Path(save_dir)
    comm = engine.comm
    rank, world_size = comm.rank, comm.world_size
    started = time.perf_counter()

    # 1. Rank 0 checks the client state and makes the temporary folder; everyone learns its name.
    token = torch.zeros(2, dtype=torch.int64)
    error: BaseException | None = None
    meta_body: dict | None = None
    if rank == 0:
        try:
            meta_body = _meta_body(engine, tag, _check_client_state(client_state))
            save_dir.mkdir(parents=True, exist_ok=True)
            nonce = int.from_bytes(os.urandom(6), "little")
            (save_dir / _tmp_dir_name(os.getpid(), nonce, tag)).mkdir()
            token[0], token[1] = os.getpid(), nonce
        except (ValueError, OSError) as err:
            error = err
            token[0] = -1
    comm.broadcast_from_first(token)
    if int(token[0]) < 0:
        if error is not None:
            raise error
        raise OSError(f"checkpoint not saved: rank 0 could not prepare {save_dir} (see rank 0's error)")
    tmp = save_dir / _tmp_dir_name(int(token[0]), int(token[1]), tag)

    # 2. Every rank streams its shards into its own file; all agree on the outcome.
    status = torch.zeros(6, dtype=torch.int64)
    try:
        digest, nbytes = _write_shard_file(engine, tmp / _shard_file(rank, world_size))
        status[0], status[1] = 1, nbytes
        status[2:] = torch.frombuffer(bytearray(digest), dtype=torch.int64)
    except Exception as err:  # any failure must reach the other ranks, or they would wait forever
        error = err
    gathered = torch.zeros(6 * world_size, dtype=torch.int64)
    comm.all_gather_into(gathered, status)
    per_rank = gathered.view(world_size, 6)
    failed = [r for r in range(world_size) if int(per_rank[r, 0]) != 1]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise OSError(f"checkpoint {tag!r} not saved: rank(s) {failed} could not write their shard files "
                      f"(see their errors); the previous checkpoint is intact")

    # 3. Rank 0 seals it: meta.json, fsync, rename, then `latest`.
    done = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        try:
            meta_body["files"] = {
                _shard_file(r, world_size): {"nbytes": int(per_rank[r, 1]),
                                             "sha256": per_rank[r, 2:].numpy().tobytes().hex()}
                for r in range(world_size)}
            _write_meta(tmp / META_FILE, meta_body)
            _fsync_dir(tmp)
            _publish(save_dir, tmp, tag)
            done[0] = 1
        except Exception as err:  # as above: the other ranks wait for this outcome
            error = err
            shutil.rmtree(tmp, ignore_errors=True)
    comm.broadcast_from_first(done)
    if int(done[0]) != 1:
        if error is not None:
            raise error
        raise OSError(f"checkpoint {tag!r} not saved: rank 0 could not complete it (see its error)")
    if rank == 0:
        _remove_leftovers(save_dir, keep=tag)
        logger.info("saved checkpoint %s (%d rank(s), %.2f s)", save_dir / tag, world_size,
                    time.perf_counter() - started)
    return tag


def _check_step_boundary(engine, what: str) -> None:
    """Gradients are in neither the checkpoint nor the engine's tiers at a step boundary: only there."""
    accum = engine.config.gradient_accumulation_steps
    if engine.micro_step % accum != 0:
        raise RuntimeError(f"{what}: {engine.micro_step % accum} of {accum} micro-batches of this step are "
                           f"accumulated; call it after engine.step() completes the step (gradients are not saved)")
    if engine.step_in_progress:
        raise RuntimeError(f"{what}: backward() ran but step() did not; call engine.step() first")


def _tmp_dir_name(pid: int, nonce: int, tag: str) -> str:
    return f"{_TMP_PREFIX}{pid}-{nonce:012x}-{tag}"


def _meta_body(engine, tag: str, client_state: dict) -> dict:
    config = engine.config
    return {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "world_size": engine.comm.world_size,
        "global_step": engine.global_step,
        "micro_step": engine.micro_step,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "precision": config.precision,
        "compute_dtype": _DTYPE_NAMES[engine.compute.dtype],
        "optimizer": engine.optimizer.state_dict(),
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "sub_groups": [[g.start, g.end, [s.index for s in g.slots]] for g in engine.layout.sub_groups],
        **_model_meta(engine),
        "config": _config_json(config),
        "client_state": client_state,
        "saved_at": time.time(),
    }


def _publish(save_dir: Path, tmp: Path, tag: str) -> None:
    """Rename the sealed ``tmp`` to ``tag`` and point ``latest`` at it; ``latest`` names a complete
    checkpoint at every moment, also when ``tag`` replaces the folder it names."""
    final = save_dir / tag
    backup = None
    if final.exists():
        if read_latest(save_dir) == tag:
            # `latest` names the folder being replaced: point it at a hard-linked copy while we swap.
            backup = save_dir / f"{_OLD_PREFIX}{os.getpid()}-{os.urandom(4).hex()}-{tag}"
            backup.mkdir()
            for entry in final.iterdir():
                try:
                    os.link(entry, backup / entry.name)
                except OSError:
                    shutil.copy2(entry, backup / entry.name)
            _fsync_dir(backup)
            _write_text_atomic(save_dir / LATEST_FILE, backup.name + "\n")
        shutil.rmtree(final)
        _fsync_dir(save_dir)
    os.rename(tmp, final)
    _fsync_dir(save_dir)
    _write_text_atomic(save_dir / LATEST_FILE, tag + "\n")
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def _write_shard_file(engine, path: Path) -> tuple[bytes, int]:
    """Stream this rank's shards into ``path``: one sub-group of one state at a time, double-buffered so
    that reading the next (from NVMe, say) overlaps writing this one."""
    layout, optimizer, compute, tiers = engine.layout, engine.optimizer, engine.compute, engine.tiers
    rank = engine.comm.rank
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for group in layout.sub_groups:
        for state in STATE_NAMES:
            entries += [(f"{state}/{s.name}", torch.float32, (s.shard_numel,)) for s in group.slots]
    entries += [(f"param/{s.name}", compute.dtype, (s.shard_numel,)) for s in layout.slots]
    buffers = [(name, buf) for name, buf in engine.module.named_buffers()] if rank == 0 else []
    entries += [(f"buffer/{name}", buf.dtype, tuple(buf.shape)) for name, buf in buffers]
    rng_tensors, rng_state = _rng_capture()
    entries += [(name, t.dtype, tuple(t.shape)) for name, t in rng_tensors.items()]
    metadata = {"format": FORMAT, "version": str(VERSION), "rank": str(rank),
                "world_size": str(engine.comm.world_size), "rng": json.dumps(rng_state)}

    state_numel = layout.largest_sub_group_numel
    shard_numel = layout.largest_shard_numel
    host: list[torch.Tensor] = []  # host buffers to give back to the tier

    def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
        tensor = tiers.empty("host", numel, dtype)
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

            def write_group(group, state: str, values: torch.Tensor) -> None:
                for s in group.slots:
                    start = s.offset - group.start
                    writer.write(f"{state}/{s.name}", values[start:start + s.shard_numel])

            states = [host_empty(state_numel, torch.float32) for _ in range(2)] if state_numel else []
            n = 0
            for group in layout.sub_groups:
                for state in STATE_NAMES:
                    i, n = n % 2, n + 1
                    take(i)
                    values = states[i][:group.numel]
                    optimizer.read_state(state, group, values)
                    in_buffer[i] = submit(write_group, group, state, values)
            shards = [host_empty(shard_numel, compute.dtype) for _ in range(2)] if shard_numel else []
            for slot in layout.slots:
                resident = compute.resident(slot)
                if resident is not None and compute.memory is Memory.HOST:
                    submit(writer.write, f"param/{slot.name}", resident)
                    continue
                i, n = n % 2, n + 1
                take(i)
                values = shards[i][:slot.shard_numel]
                compute.read_to_host(slot, values)
                in_buffer[i] = submit(writer.write, f"param/{slot.name}", values)
            for name, buf in buffers:
                submit(writer.write, f"buffer/{name}", buf.detach().cpu())
            for name, tensor in rng_tensors.items():
                submit(writer.write, name, tensor)
            for future in futures:
                future.result()  # the first error, in file order
            digest, nbytes = writer.close()
            logger.debug("wrote %s: %d bytes, sha256 %s", path, nbytes, digest.hex())
            return digest, nbytes
    finally:
        for tensor in host:
            tiers.free("host", tensor)


# ---------------------------------------------------------------------------------------------- reading

class Checkpoint:
    """A checkpoint folder opened for reading: its metadata and its shard files (opened on demand)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        self.world_size = int(self.meta["world_size"])
        self.params = {p["name"]: p for p in self.meta["params"]}
        self._readers: dict[int, SafetensorsReader] = {}

    def file_path(self, rank: int) -> Path:
        return self.path / _shard_file(rank, self.world_size)

    def reader(self, rank: int) -> SafetensorsReader:
        if rank not in self._readers:
            try:
                reader = SafetensorsReader(self.file_path(rank))
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint file {self.file_path(rank)} is missing") from None
            if reader.metadata.get("rank") != str(rank) or reader.metadata.get("world_size") != str(self.world_size):
                reader.close()
                raise CheckpointError(f"checkpoint file {reader.path} belongs to rank {reader.metadata.get('rank')} "
                                      f"of {reader.metadata.get('world_size')}, not {rank} of {self.world_size}")
            self._readers[rank] = reader
        return self._readers[rank]

    # -- integrity ------------------------------------------------------------------------
    def check_file(self, rank: int) -> tuple[int, int]:
        """(problem code, detail) of one shard file against meta.json: 0 fine, else see :meth:`problem`."""
        path = self.file_path(rank)
        recorded = self.meta["files"].get(path.name)
        if recorded is None:
            return 5, 0
        try:
            size = path.stat().st_size
            if size != recorded["nbytes"]:
                return 2, size
            digest, _ = file_sha256(path)
        except FileNotFoundError:
            return 1, 0
        except OSError as err:
            return 4, err.errno or 0
        return (0, 0) if digest == recorded["sha256"] else (3, 0)

    def problem(self, rank: int, code: int, detail: int) -> CheckpointError:
        path = self.file_path(rank)
        recorded = self.meta["files"].get(path.name, {})
        why = {
            1: "is missing",
            2: f"has {detail} bytes but {recorded.get('nbytes')} were written "
               f"({'truncated' if detail < recorded.get('nbytes', 0) else 'extended'})",
            3: f"is corrupt: its sha256 does not match the one recorded in {self.path / META_FILE}",
            4: f"could not be read ({os.strerror(detail) if detail else 'I/O error'})",
            5: f"is not listed in {self.path / META_FILE}",
        }[code]
        return CheckpointError(f"checkpoint file {path} {why}; resume from an earlier checkpoint")

    def verify(self) -> None:
        """Check every shard file (one process)."""
        for rank in range(self.world_size):
            code, detail = self.check_file(rank)
            if code:
                raise self.problem(rank, code, detail)
            logger.debug("%s: size and sha256 as recorded", self.file_path(rank))

    # -- values ---------------------------------------------------------------------------
    def read_range(self, kind: str, param: dict, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + len(out))`` of the padded flat ``kind`` (``param``, ``master``, ...) of
        ``param``, gathered from the ranks' files that hold them; elements past ``numel`` are zero."""
        shard, numel, name = param["shard_numel"], param["numel"], param["name"]
        count = out.numel()
        stop = min(start + count, numel)
        if stop < start + count:
            out[max(stop - start, 0):].zero_()
        pos = start
        while pos < stop:
            owner = pos // shard
            end = min((owner + 1) * shard, stop)
            self.reader(owner).read_into(f"{kind}/{name}", out[pos - start:end - start], pos - owner * shard)
            pos = end

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()


def _first_mismatch(ckpt: Checkpoint, engine) -> str | None:
    """The first parameter or buffer that differs between the checkpoint and the engine's model."""
    theirs = ckpt.params
    mine = {s.name for s in engine.layout.slots}
    for slot in engine.layout.slots:
        p = theirs.get(slot.name)
        if p is None:
            return f"parameter {slot.name!r} (shape {list(slot.shape)}) is in this model but not in the checkpoint"
        if list(p["shape"]) != list(slot.shape):
            return (f"parameter {slot.name!r} has shape {list(p['shape'])} in the checkpoint and "
                    f"{list(slot.shape)} in this model")
    for p in ckpt.meta["params"]:
        if p["name"] not in mine:
            return f"parameter {p['name']!r} (shape {p['shape']}) is in the checkpoint but not in this model"
    saved = {b["name"]: b for b in ckpt.meta["buffers"]}
    for name, buf in engine.module.named_buffers():
        b = saved.get(name)
        if b is None:
            return f"buffer {name!r} is in this model but not in the checkpoint"
        if list(b["shape"]) != list(buf.shape):
            return f"buffer {name!r} has shape {b['shape']} in the checkpoint and {list(buf.shape)} in this model"
    return None


def _agree(comm, failed: bool) -> bool:
    """True when any rank failed (a collective: every rank calls it)."""
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    comm.all_reduce_sum(flag)
    return int(flag) > 0


def load_checkpoint(engine, load_dir, *, tag: str | None = None) -> dict:
    """Restore a checkpoint written by :func:`save_checkpoint` into ``engine``; every rank calls it.

    ``load_dir`` is the ``save_dir`` (then ``tag``, default the ``latest``
    one) or a checkpoint's own folder. A checkpoint of another world size is
    resharded. Returns the saved ``client_state``. Nothing is changed in the
    engine until every shard file has been verified.
    """
    _check_step_boundary(engine, "load_checkpoint")
    comm = engine.comm
    path = resolve_checkpoint(load_dir, tag)
    ckpt = Checkpoint(path)
    started = time.perf_counter()
    try:
        mismatch = _first_mismatch(ckpt, engine)
        if mismatch:
            raise CheckpointError(f"checkpoint {path} was saved from another model: {mismatch}")
        _verify_collectively(ckpt, comm)
        error: BaseException | None = None
        try:
            _load_states(ckpt, engine)
        except Exception as err:  # every rank must learn of it, or the others would go on alone
            error = err
        if _agree(comm, error is not None):
            if error is not None:
                raise error
            raise CheckpointError(f"loading {path} failed on another rank (see its error)")
    finally:
        ckpt.close()
    meta = ckpt.meta
    engine.optimizer.load_state_dict(meta["optimizer"])
    if engine.loss_scaler is not None and meta.get("loss_scaler"):
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    accum = engine.config.gradient_accumulation_steps
    engine.global_step = int(meta["global_step"])
    micro_step = int(meta["micro_step"])
    engine.micro_step = micro_step if micro_step % accum == 0 else engine.global_step * accum
    for sharded in engine.params:
        sharded.mark_stale()
    logger.info("loaded checkpoint %s (saved by %d rank(s), step %d) in %.2f s", path, ckpt.world_size,
                engine.global_step, time.perf_counter() - started)
    return json.loads(json.dumps(meta.get("client_state") or {}))


def _verify_collectively(ckpt: Checkpoint, comm) -> None:
    """Each rank checks a share of the files; all ranks raise the same error for the first bad one."""
    codes = torch.zeros(2 * ckpt.world_size, dtype=torch.int64)
    for old_rank in range(comm.rank, ckpt.world_size, comm.world_size):
        codes[2 * old_rank], codes[2 * old_rank + 1] = ckpt.check_file(old_rank)
    comm.all_reduce_sum(codes)
    for old_rank in range(ckpt.world_size):
        if int(codes[2 * old_rank]):
            raise ckpt.problem(old_rank, int(codes[2 * old_rank]), int(codes[2 * old_rank + 1]))


def _load_states(ckpt: Checkpoint, engine) -> None:
    layout, optimizer, compute, tiers = engine.layout, engine.optimizer, engine.compute, engine.tiers
    rank, world_size = engine.comm.rank, engine.comm.world_size
    if ckpt.world_size != world_size:
        logger.info("checkpoint %s was saved by %d rank(s); resharding for %d", ckpt.path, ckpt.world_size,
                    world_size)
    same_dtype = ckpt.meta["compute_dtype"] == _DTYPE_NAMES[compute.dtype]
    host: list[torch.Tensor] = []
    try:
        if layout.largest_sub_group_numel:
            values = tiers.empty("host", layout.largest_sub_group_numel, torch.float32)
            host.append(values)
        for group in layout.sub_groups:
            flat = values[:group.numel]
            for state in STATE_NAMES:
                flat.zero_()
                for slot in group.slots:
                    p = ckpt.params[slot.name]
                    out = flat[slot.offset - group.start:slot.offset - group.start + slot.shard_numel]
                    if p["trainable"]:
                        ckpt.read_range(state, p, rank * slot.shard_numel, out)
                    elif state == "master":  # frozen when saved: its master is its compute shard
                        ckpt.read_range("param", p, rank * slot.shard_numel, out)
                optimizer.write_state(state, group, flat)
        if layout.largest_shard_numel:
            shard = tiers.empty("host", layout.largest_shard_numel, compute.dtype)
            host.append(shard)
        for slot in layout.slots:
            p = ckpt.params[slot.name]
            out = shard[:slot.shard_numel]
            # The compute shard as saved; in another precision, recast from the fp32 master.
            kind = "param" if same_dtype or not p["trainable"] else "master"
            ckpt.read_range(kind, p, rank * slot.shard_numel, out)
            handle = compute.write(slot, out)
            if handle is not None:
                handle.wait()
        for name, buf in engine.module.named_buffers():
            if buf.device.type == "cpu" and buf.is_contiguous():
                ckpt.reader(0).read_into(f"buffer/{name}", buf.data)
            else:
                host_value = torch.empty(buf.shape, dtype=buf.dtype)
                ckpt.reader(0).read_into(f"buffer/{name}", host_value)
                buf.data.copy_(host_value)
        if rank < ckpt.world_size:
            _rng_restore(ckpt.reader(rank))
        else:
            logger.warning("checkpoint %s has no RNG state for rank %d (saved by %d ranks); keeping this rank's",
                           ckpt.path, rank, ckpt.world_size)
    finally:
        for tensor in host:
            tiers.free("host", tensor)
