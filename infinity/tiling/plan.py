"""The tiling plan: where each tile tensor sits inside its dense tensor, and how
state dicts map between the tiled model's names and the dense names and shapes.

Checkpoints and ``full_state_dict`` untile a state dict with it; loading a dense
checkpoint into a tiled model tiles one. It knows names, ranges and shapes only,
never the modules (those are :mod:`infinity.tiling.layers`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

Range = tuple[int, int]


def split_ranges(size: int, splits: int) -> list[Range]:
    """``splits`` contiguous ranges covering ``[0, size)``, the first ``size % splits``
    one element longer (the same sizes as ``torch.tensor_split``)."""
    base, extra = divmod(size, splits)
    ranges, start = [], 0
    for k in range(splits):
        stop = start + base + (1 if k < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges



# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class TileSlice:
    """Where one tile tensor sits inside its dense tensor."""

    name: str
    """The tile tensor's name in the tiled model, e.g. ``lm_head.tiles.3.weight``."""
    rows: Range
    """Its rows ``[start, stop)`` of the dense tensor's dimension 0."""
    cols: Range | None
    """Its columns ``[start, stop)`` of dimension 1; ``None`` for a 1-D tensor (a bias)."""

    @property
    def shape(self) -> tuple[int, ...]:
        rows = self.rows[1] - self.rows[0]
        return (rows,) if self.cols is None else (rows, self.cols[1] - self.cols[0])

    def index(self) -> tuple[slice, ...]:
        rows = slice(*self.rows)
        return (rows,) if self.cols is None else (rows, slice(*self.cols))


@dataclass(frozen=True, slots=True)
class TiledTensor:
    """One dense tensor (its original name and shape) and the tiles that hold it."""

    name: str
    """The dense name, e.g. ``lm_head.weight``."""
    shape: tuple[int, ...]
    """The dense shape."""
    tiles: tuple[TileSlice, ...]
    """The tiles, row-major; together they cover the dense tensor exactly once."""
    tied_to: str | None = None
    """The dense name of the tensor this one is tied to (the same parameters),
    e.g. ``transformer.wte.weight`` for a tied head's weight; else ``None``."""

    def assemble(self, tiles: Mapping[str, Tensor]) -> Tensor:
        """The dense tensor: a new tensor built from the tile tensors in ``tiles``
        (keyed by tile name; other keys are ignored)."""
        missing = [t.name for t in self.tiles if t.name not in tiles]
        if missing:
            raise KeyError(f"{self.name}: tile tensors missing: {', '.join(missing)}")
        first = tiles[self.tiles[0].name]
        dense = torch.empty(self.shape, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for tile in self.tiles:
                value = tiles[tile.name]
                if tuple(value.shape) != tile.shape:
                    raise ValueError(
                        f"{self.name}: tile {tile.name} has shape {tuple(value.shape)}, expected {tile.shape}"
                    )
                dense[tile.index()].copy_(value)
        return dense

    def split(self, dense: Tensor) -> dict[str, Tensor]:
        """The tile tensors of ``dense``, keyed by tile name: contiguous copies,
        never views of ``dense``."""
        if tuple(dense.shape) != self.shape:
            raise ValueError(f"{self.name}: expected shape {self.shape}, got {tuple(dense.shape)}")
        with torch.no_grad():
            return {
                t.name: dense.detach()[t.index()].clone(memory_format=torch.contiguous_format) for t in self.tiles
            }


class TilingPlan:
    """What :func:`tile_model` replaced, and how state dicts map between the
    tiled model's names and the dense names and shapes.

    Both directions work one dense tensor at a time (:meth:`TiledTensor.assemble`,
    :meth:`TiledTensor.split`), so a caller can stream a large state dict. Keys
    the plan does not know pass through unchanged.
    """

    def __init__(self, tensors: Iterable[TiledTensor] = (), modules: Mapping[str, str] | None = None):
        self._tensors: dict[str, TiledTensor] = {}
        self._dense_name_of: dict[str, str] = {}  # tile name -> dense name
        for tensor in tensors:
            if tensor.name in self._tensors:
                raise ValueError(f"tiling plan: dense tensor {tensor.name} listed twice")
            self._tensors[tensor.name] = tensor
            for tile in tensor.tiles:
                if tile.name in self._dense_name_of:
                    raise ValueError(f"tiling plan: tile tensor {tile.name} listed twice")
                self._dense_name_of[tile.name] = tensor.name
        self._modules = dict(modules or {})

    @property
    def tensors(self) -> Mapping[str, TiledTensor]:
        """Dense name -> :class:`TiledTensor`, in the model's order."""
        return self._tensors

    @property
    def modules(self) -> Mapping[str, str]:
        """Replaced module's qualified name -> a description of its tiled replacement."""
        return self._modules

    @property
    def is_empty(self) -> bool:
        return not self._tensors

    def dense_name_of(self, tile_name: str) -> str | None:
        """The dense name a tile tensor belongs to, or ``None`` if it is not a tile."""
        return self._dense_name_of.get(tile_name)

    def untile_state_dict(self, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """A state dict with tile names -> one with the dense names and full shapes.

        Each dense tensor is emitted where its first tile was. A dense tensor
        none of whose tiles are present is left out (e.g. a dict built from
        ``named_parameters()``, which lists a tied tensor once); one with only
        some of its tiles present raises ``KeyError``.
        """
        out: dict[str, Tensor] = {}
        done: set[str] = set()
        for key, value in state_dict.items():
            dense_name = self._dense_name_of.get(key)
            if dense_name is None:
                out[key] = value
            elif dense_name not in done:
                done.add(dense_name)
                out[dense_name] = self._tensors[dense_name].assemble(state_dict)
        return out

    def tile_state_dict(self, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """A state dict with the dense names and shapes -> one with tile names
        (the inverse of :meth:`untile_state_dict`, to load a dense checkpoint
        into a tiled model)."""
        out: dict[str, Tensor] = {}
        for key, value in state_dict.items():
            tensor = self._tensors.get(key)
            if tensor is None:
                out[key] = value
            else:
                out.update(tensor.split(value))
        return out

    def __repr__(self) -> str:
        if self.is_empty:
            return "TilingPlan(empty)"
        lines = [f"  {name}: {desc}" for name, desc in self._modules.items()]
        return "TilingPlan(\n" + "\n".join(lines) + "\n)"
