"""safetensors files streamed in and out, without pickle and without mmap.

The writer puts the header first, then streams tensors in order, hashing as it
goes (sha256), so a rank's state never has to be whole in memory; the reader
``pread``s straight into the destination tensor. Files are plain safetensors:
the official ``safetensors`` package loads them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from pathlib import Path
from typing import Any

import torch

_READ_CHUNK_NBYTES = 1 << 20  # hashing and casting go through buffers this large
_HEADER_MAX_NBYTES = 100 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, damaged, or of another model. The message names the file or tensor."""


_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _write_chunk(file, hasher, data: memoryview) -> None:
    """One write to a checkpoint file (a seam the fault tests slow down to widen the window of a kill)."""
    file.write(data)
    hasher.update(data)


class SafetensorsWriter:
    """Writes a safetensors file tensor by tensor, in the order given up front.

    The header (names, dtypes, shapes, offsets) is known before any data, so it
    is written first and the tensors follow without holding them all. The file
    is created exclusively, and :meth:`close` fsyncs it and returns its sha256
    and size, computed as the bytes are written.
    """

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        if sys.byteorder != "little":
            raise OSError("safetensors files are little-endian; this machine is big-endian")
        header: dict[str, Any] = {}
        offset = 0
        self._entries = []
        for name, dtype, shape in entries:
            if dtype not in _ST_DTYPES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
            if name in header or name == "__metadata__":
                raise ValueError(f"tensor {name!r} listed twice")
            nbytes = math.prod(shape) * _itemsize(dtype)
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._entries.append((name, dtype, nbytes))
            offset += nbytes
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned, as the reference writer does
        self.path = Path(path)
        self.nbytes = 8 + len(text) + offset
        self._next = 0
        self._hash = hashlib.sha256()
        self._file = open(self.path, "xb")
        try:
            self._emit(memoryview(struct.pack("<Q", len(text))))
            self._emit(memoryview(text))
        except BaseException:
            self.abort()
            raise

    def _emit(self, data: memoryview) -> None:
        try:
            _write_chunk(self._file, self._hash, data)
        except OSError as err:
            raise OSError(err.errno, f"writing checkpoint file: {err.strerror}", str(self.path)) from err

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor, which must be the next entry's name, dtype and byte count."""
        if self._next >= len(self._entries):
            raise RuntimeError(f"{self.path}: tensor {name!r} written after the last entry")
        want_name, want_dtype, want_nbytes = self._entries[self._next]
        nbytes = tensor.numel() * tensor.element_size()
        if name != want_name or tensor.dtype != want_dtype or nbytes != want_nbytes:
            raise RuntimeError(f"{self.path}: expected {want_name!r} ({want_dtype}, {want_nbytes} bytes) next, "
                               f"got {name!r} ({tensor.dtype}, {nbytes} bytes)")
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        self._emit(_byte_view(tensor.contiguous()))
        self._next += 1

    def close(self) -> tuple[bytes, int]:
        """Flush and fsync; the sha256 digest and size of the file."""
        if self._next != len(self._entries):
            missing = self._entries[self._next][0]
            self.abort()
            raise RuntimeError(f"{self.path}: closed before tensor {missing!r} was written")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as err:
            self.abort()
            raise OSError(err.errno, f"writing checkpoint file: {err.strerror}", str(self.path)) from err
        self._file.close()
        return self._hash.digest(), self.nbytes

    def abort(self) -> None:
        try:
            self._file.close()
        except OSError:  # the write already failed; the file is removed with its directory
            pass

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()


class SafetensorsReader:
    """Reads tensors, or ranges of their flattened elements, from a safetensors file with ``pread``.

    No mmap: what is read lands directly in the caller's tensor, so memory
    is only what the caller allocates. The header is validated (dtypes,
    shapes against byte ranges, ranges inside the file); problems raise
    :class:`CheckpointError` naming the file.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._parse_header()
        except BaseException:
            os.close(self._fd)
            self._fd = -1  # so __del__ does not close it again
            raise

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint file {self.path} is damaged or not a safetensors file: {why}")

    def _parse_header(self) -> None:
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise self._bad(f"it has {size} bytes")
        (n,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if n > min(size - 8, _HEADER_MAX_NBYTES):
            raise self._bad(f"its header claims {n} bytes but the file has {size}")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise self._bad(f"its header is not JSON ({err})") from None
        if not isinstance(header, dict):
            raise self._bad("its header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        for name, info in header.items():
            try:
                dtype = _TORCH_DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"tensor {name!r} has a bad header entry {info!r}") from None
            if any(d < 0 for d in shape) or end - begin != math.prod(shape) * _itemsize(dtype) or begin < 0:
                raise self._bad(f"tensor {name!r}: shape {list(shape)} of {info['dtype']} does not fit bytes "
                                f"[{begin}, {end})")
            if self._data_start + end > size:
                raise self._bad(f"tensor {name!r} ends at byte {self._data_start + end} but the file has {size} "
                                f"bytes (truncated)")
            self.tensors[name] = (dtype, shape, self._data_start + begin)

    def info(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        if name not in self.tensors:
            raise CheckpointError(f"checkpoint file {self.path} has no tensor {name!r}")
        dtype, shape, _ = self.tensors[name]
        return dtype, shape

    def read_into(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Elements ``[start, start + out.numel())`` of ``name`` flattened, into ``out`` (cast if its dtype differs)."""
        dtype, shape = self.info(name)
        numel = math.prod(shape)
        count = out.numel()
        if start < 0 or start + count > numel:
            raise CheckpointError(f"checkpoint file {self.path}: tensor {name!r} has {numel} elements; "
                                  f"elements [{start}, {start + count}) were asked for")
        itemsize = _itemsize(dtype)
        offset = self.tensors[name][2] + start * itemsize
        if out.dtype == dtype and out.is_contiguous():
            self._pread(_byte_view(out), offset)
            return
        flat = out.view(-1) if out.is_contiguous() else None
        step = max(1, _READ_CHUNK_NBYTES // itemsize)
        scratch = torch.empty(min(step, count), dtype=dtype)
        for i in range(0, count, step):
            n = min(step, count - i)
            self._pread(_byte_view(scratch[:n]), offset + i * itemsize)
            if flat is not None:
                flat[i:i + n].copy_(scratch[:n])
            else:
                out.view(-1)[i:i + n].copy_(scratch[:n])

    def read(self, name: str) -> torch.Tensor:
        dtype, shape = self.info(name)
        out = torch.empty(shape, dtype=dtype)
        self.read_into(name, out)
        return out

    def _pread(self, view: memoryview, offset: int) -> None:
        done, total = 0, len(view)
        while done < total:
            try:
                got = os.preadv(self._fd, [view[done:]], offset + done)
            except InterruptedError:
                continue
            except OSError as err:
                raise OSError(err.errno, f"reading checkpoint file: {err.strerror}", str(self.path)) from err
            if got == 0:
                raise CheckpointError(f"checkpoint file {self.path} is truncated: it ends at byte {offset + done}")
            done += got

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()


def file_sha256(path: Path) -> tuple[str, int]:
    """The sha256 (hex) and size of a file, read in chunks."""
    hasher = hashlib.sha256()
    buffer = bytearray(_READ_CHUNK_NBYTES)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            got = f.readinto(buffer)
            if not got:
                break
            hasher.update(view[:got])
            size += got
    return hasher.hexdigest(), size
