"""The atomic publish protocol: a checkpoint appears whole under its tag, or not at all.

All ranks write into ``save_dir/.tmp-<pid>-<nonce>-<tag>``, fsync their file,
and agree (one all-gather) that every file is complete; rank 0 then writes
``meta.json``, fsyncs it and the folder, renames the folder to ``<tag>`` and
finally replaces ``latest`` (temporary file, fsync, rename). A crash at any
moment leaves ``latest`` naming a complete checkpoint. Every error is agreed on
by all ranks, so a rank that fails never leaves the others waiting in a
collective. What interrupted saves left (temporary folders of dead processes,
backups) is removed after the next successful one. Rank 0's first save into a
folder takes it for the process (:mod:`.save_dir_lock`): a second live run
saving there is refused, naming the first.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable

import psutil
import torch
from safetensors.torch import save_file

from infinity.checkpoint.files import META_FILE, shard_file, write_meta
from infinity.checkpoint.save_dir_lock import hold_save_dir
from infinity.runtime.comm import Collectives

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
TMP_PREFIX = ".tmp-"
"""Names of what is being written: a save's folder, ``latest`` being replaced (followed by the writer's pid)."""
_OLD_PREFIX = ".old-"
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")


# ---------------------------------------------------------------------------------------------- files

def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``path`` holds what ``write(tmp)`` writes into a new file beside it, or what it held before, whatever happens:
    temporary file, fsync, rename, fsync."""
    tmp = path.with_name(f"{path.name}{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # on disk before it takes the name
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, whatever happens."""
    write_file_atomic(path, lambda tmp: tmp.write_text(text))


def write_state_dict_atomic(path: Path, state: dict[str, torch.Tensor]) -> None:
    """``state`` as one file at ``path``, or what it held before: safetensors where the name ends in
    ``.safetensors`` (names tied to one tensor each written as its own, as safetensors requires), else
    ``torch.save``."""
    if path.suffix != ".safetensors":
        write_file_atomic(path, lambda tmp: torch.save(state, tmp))
        return
    unshared, seen = {}, set()
    for name, value in state.items():
        unshared[name] = value.contiguous().clone() if id(value) in seen else value.contiguous()
        seen.add(id(value))
    write_file_atomic(path, lambda tmp: save_file(unshared, str(tmp), metadata={"format": "pt"}))


def check_tag(tag: str) -> None:
    if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag) or tag == LATEST_FILE:
        raise ValueError(f"checkpoint tag {tag!r} is not usable as a folder name: use letters, digits and _.+=- "
                         f"(not starting with '.' or '-', and not {LATEST_FILE!r})")


def _tmp_dir_name(pid: int, nonce: int, tag: str) -> str:
    return f"{TMP_PREFIX}{pid}-{nonce:012x}-{tag}"


def remove_own_partial_save(save_dir, tag: str) -> list[Path]:
    """What this process' save of ``tag`` into ``save_dir`` has written and not published (its temporary folder,
    :func:`_tmp_dir_name`; a ``latest`` being replaced, :func:`write_file_atomic`'s), removed: a save this process
    stops part-way. Returns the paths removed."""
    save_dir, pid = Path(save_dir), os.getpid()
    partial = [*save_dir.glob(f"{TMP_PREFIX}{pid}-*-{tag}"), *save_dir.glob(f"{LATEST_FILE}{TMP_PREFIX}{pid}-*")]
    for path in partial:
        _remove(path)
    return partial


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _remove_leftovers(save_dir: Path, keep: str) -> None:
    """Remove what interrupted saves left in ``save_dir``: temporary folders of dead processes, backups."""
    for entry in save_dir.iterdir():
        name = entry.name
        if name == keep:
            continue
        if name.startswith(TMP_PREFIX) or name.startswith(f"{LATEST_FILE}{TMP_PREFIX}"):
            pid_text = name.split(TMP_PREFIX, 1)[1].split("-", 1)[0]
            if pid_text.isdigit() and int(pid_text) != os.getpid() and not psutil.pid_exists(int(pid_text)):
                logger.info("removing %s, left by an interrupted save", entry)
                _remove(entry)
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
    if load_dir.exists() and not load_dir.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "a file, not a checkpoint folder (or a save folder)", str(load_dir))
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


# ---------------------------------------------------------------------------------------------- the protocol

def publish_collectively(comm: Collectives, save_dir: Path, tag: str, *, make_meta: Callable[[], dict],
                         write_rank_file: Callable[[Path], tuple[bytes, int]]) -> str:
    """Publish a checkpoint under ``save_dir/tag``; every rank calls it.

    Rank 0 calls ``make_meta()`` for the body of ``meta.json`` (a ``ValueError``
    there stops the save before anything is written); every rank calls
    ``write_rank_file(path)`` to write and fsync its shard file, returning its
    sha256 and size, which rank 0 records in ``meta.json`` before sealing.
    """
    rank, world_size = comm.rank, comm.world_size
    started = time.perf_counter()

    # 1. Rank 0 builds the body of meta.json (checking what the caller gave) and makes the temporary folder;
    #    everyone learns its name.
    token = torch.zeros(2, dtype=torch.int64)
    error: BaseException | None = None
    meta_body: dict | None = None
    if rank == 0:
        try:
            meta_body = make_meta()
            save_dir.mkdir(parents=True, exist_ok=True)
            hold_save_dir(save_dir)  # one live run saves here (SaveDirInUse, an OSError, naming another)
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
        digest, nbytes = write_rank_file(tmp / shard_file(rank, world_size))
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
                shard_file(r, world_size): {"nbytes": int(per_rank[r, 1]),
                                            "sha256": per_rank[r, 2:].numpy().tobytes().hex()}
                for r in range(world_size)}
            write_meta(tmp / META_FILE, meta_body)
            fsync_dir(tmp)
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
            fsync_dir(backup)
            write_text_atomic(save_dir / LATEST_FILE, backup.name + "\n")
        shutil.rmtree(final)
        fsync_dir(save_dir)
    os.rename(tmp, final)
    fsync_dir(save_dir)
    write_text_atomic(save_dir / LATEST_FILE, tag + "\n")
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)
