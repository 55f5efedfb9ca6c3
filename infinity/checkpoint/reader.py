"""A checkpoint folder opened for reading: its ``meta.json``, its shard files checked against it, and any
range of a parameter's padded flat gathered from the files that hold it (whatever world size saved it)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from infinity.checkpoint.files import META_FILE, read_meta, shard_file
from infinity.checkpoint.safetensors_io import CheckpointError, SafetensorsReader, file_sha256

logger = logging.getLogger(__name__)


class Checkpoint:
    """A checkpoint folder opened for reading: its metadata and its shard files (opened on demand)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.meta = read_meta(self.path)
        self.world_size = int(self.meta["world_size"])
        self.params = {p["name"]: p for p in self.meta["params"]}
        self._readers: dict[int, SafetensorsReader] = {}

    def file_path(self, rank: int) -> Path:
        return self.path / shard_file(rank, self.world_size)

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
