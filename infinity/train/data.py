"""Byte-level text corpora for `infinity train`.

A corpus is a file, or a folder read recursively (text files only, sorted by
path so every rank and every run sees the same bytes). The default is the
Python standard library's own source (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, without ``site-packages``), so training
runs offline anywhere.

Sampling: the corpus is cut into non-overlapping windows of ``seq_len + 1``
bytes (input and next-byte target; consecutive windows share one byte). Each
epoch visits the windows in a permutation drawn from ``(seed, epoch)``. The
global sample stream is dealt out in micro-batches: sample ``i`` of a step goes
to rank ``i // micro_batch``, so the ranks of one step see disjoint windows and
together consume ``world_size * micro_batch`` samples per micro-step. The
position in that stream (``samples_seen``) is the whole sampling state.
"""

from __future__ import annotations

import logging
import sysconfig
from pathlib import Path

import torch

__all__ = ["ByteCorpus", "DEFAULT_MAX_BYTES", "default_corpus_path", "read_corpus_bytes"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8 * 2**20
"""Cap on the bytes read from a folder (the default corpus is ~100 MB of source; 8 MiB is plenty)."""

_SNIFF_BYTES = 8192
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


def default_corpus_path() -> Path:
    """The Python standard library's source folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_text(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError:
        return False
    return b"\0" not in head


def _folder_files(folder: Path, pattern: str) -> list[Path]:
    files = []
    for p in sorted(folder.rglob(pattern)):
        rel_parts = p.relative_to(folder).parts
        if any(part in _SKIP_DIRS or part.startswith(".") for part in rel_parts):
            continue
        if p.is_file() and not p.is_symlink():
            files.append(p)
    return files


def read_corpus_bytes(path: str | Path | None = None, *, max_bytes: int | None = DEFAULT_MAX_BYTES) -> tuple[bytes, str]:
    """The corpus' bytes and a one-line description.

    ``path=None`` reads the standard library's ``*.py`` files. A folder is read
    recursively (files whose first 8 KiB hold no NUL byte), in sorted order,
    until ``max_bytes`` (``None``: no cap). A single file is read whole up to
    ``max_bytes``. A corpus given by path that holds more than ``max_bytes``
    says so in the description, as a warning naming ``--max-bytes``. Raises
    ``FileNotFoundError`` for a missing path and ``ValueError`` for a corpus
    with no bytes, each naming the path.
    """
    if path is None:
        folder, pattern = default_corpus_path(), "*.py"
        name = f"Python standard library source ({folder})"
    else:
        folder, pattern = Path(path), "*"
        name = str(folder)
        if not folder.exists():
            raise FileNotFoundError(f"corpus path {str(folder)!r} does not exist")
    if folder.is_file():
        if not _is_text(folder):  # the same rule a folder's files are read by
            raise ValueError(f"corpus file {str(folder)!r} is not text: its first {_SNIFF_BYTES // 1024} KiB hold a "
                             f"NUL byte (a binary file?); give a text file or a folder of them")
        with folder.open("rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes)
        nfiles = 1
        held = folder.stat().st_size
    elif folder.is_dir():
        chunks, total, nfiles, held = [], 0, 0, 0
        for p in _folder_files(folder, pattern):
            if max_bytes is not None and total >= max_bytes:
                if path is None:
                    break
                held += p.stat().st_size if _is_text(p) else 0  # what the cut leaves out, said in the description
                continue
            if pattern == "*" and not _is_text(p):
                continue
            try:
                chunk = p.read_bytes()
            except OSError as err:  # an unreadable file in a big tree is skipped, not fatal
                log.warning("skipping %s: %s", p, err)
                continue
            held += len(chunk)
            if max_bytes is not None:
                chunk = chunk[: max_bytes - total]
            if chunk:
                chunks.append(chunk)
                total += len(chunk)
                nfiles += 1
        data = b"".join(chunks)
    else:
        raise ValueError(f"corpus path {str(folder)!r} is neither a file nor a folder")
    if not data:
        what = "file" if folder.is_file() else "folder (no non-empty text files)"
        raise ValueError(f"corpus {name!r} is empty: the {what} holds no bytes")
    description = f"{name}: {len(data):,} bytes from {nfiles} file{'s' if nfiles != 1 else ''}"
    if path is not None and held > len(data):  # (the default corpus is cut on purpose: 8 MiB of it is plenty)
        description += (f" (WARNING: cut to the first {len(data):,} of its {held:,} bytes by --max-bytes "
                        f"{max_bytes:,}; raise --max-bytes to read it all)")
    return data, description


class ByteCorpus:
    """Deterministic (input_ids, targets) micro-batches of bytes for one rank.

    ``next_batch()`` returns two int64 tensors of shape ``(micro_batch, seq_len)``;
    ``targets`` is ``input_ids`` shifted by one byte.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        seq_len: int,
        micro_batch: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        data: bytes | None = None,
    ):
        if seq_len <= 0 or micro_batch <= 0:
            raise ValueError(f"seq_len and micro_batch must be positive, got {seq_len} and {micro_batch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if data is None:
            data, self.description = read_corpus_bytes(path, max_bytes=max_bytes)
        else:
            if not data:
                raise ValueError("corpus is empty: no bytes given")
            self.description = f"{len(data):,} bytes given in memory"
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.bytes = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.num_windows = (len(data) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"corpus {path if path is not None else 'in memory'!s} holds {len(data)} bytes, "
                f"fewer than seq_len + 1 = {seq_len + 1}"
            )
        self.samples_seen = 0  # global samples consumed, over all ranks
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    @property
    def num_bytes(self) -> int:
        return self.bytes.numel()

    def _window(self, global_index: int) -> int:
        epoch, i = divmod(global_index, self.num_windows)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_windows, generator=g)
            self._perm_epoch = epoch
        return int(self._perm[i])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.samples_seen + self.rank * self.micro_batch
        starts = [self._window(first + j) * self.seq_len for j in range(self.micro_batch)]
        windows = torch.stack([self.bytes[s : s + self.seq_len + 1] for s in starts]).long()
        self.samples_seen += self.world_size * self.micro_batch
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def state_dict(self) -> dict:
        """The sampling position; enough to resume the same stream (with any world size)."""
        return {"seed": self.seed, "seq_len": self.seq_len, "num_bytes": self.num_bytes, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len", "num_bytes"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"corpus state does not match this corpus: {key}={state.get(key)!r} in the state, "
                    f"{getattr(self, key)!r} here"
                )
        samples_seen = state.get("samples_seen")
        if not isinstance(samples_seen, int) or samples_seen < 0:
            raise ValueError(f"corpus state: samples_seen must be a non-negative int, got {samples_seen!r}")
        self.samples_seen = samples_seen
