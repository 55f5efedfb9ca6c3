"""Memory-centric tiling: split an oversized Linear or Embedding into tiles.

Stage 3 fetches a module's directly-owned parameters right before the module
runs and releases them right after, so the working memory is bounded by the
largest module. A layer larger than the live-parameter budget (a large
vocabulary's embedding and output head, a wide MLP) breaks that bound. Here
such a layer becomes a container of *tile modules*: each tile is its own
``nn.Module`` that owns one tile's parameters and computes its piece inside its
own ``forward``, so the engine's per-module hooks fetch, use and release one
tile at a time. The container owns no parameters itself.

Words used below:

* **tile**: one child module and its parameters (``tiles.j.i`` of a
  :class:`TiledLinear`, ``tiles.k`` of an embedding or head).
* **dense**: the untiled layer (``nn.Linear``, ``nn.Embedding``) and its
  tensors with their original names and full shapes.
* **rows / cols**: ranges ``[start, stop)`` of the dense weight's dimension 0
  (output features, vocabulary rows) and dimension 1 (input features, the
  embedding dimension).

The pieces:

* :class:`TiledLinear`: ``out_splits x in_splits`` tiles; tile ``(j, i)``
  computes ``x[..., cols_i] @ W[rows_j, cols_i]^T`` (plus ``bias[rows_j]`` in
  tile ``(j, 0)``); in-tiles are summed, out-tiles concatenated.
* :class:`TiledEmbedding`: tiles split by vocabulary rows; each tile looks up
  the ids in its row range and gives zeros for the others; the sum is the
  embedding. ``forward(h, unembed=True)`` is the tied head, tile by tile.
* :class:`TiledTiedHead`: an output head tied to a :class:`TiledEmbedding`; its
  tiles hold the *same* ``nn.Parameter`` objects as the embedding's tiles and
  compute the logits of their vocabulary rows, concatenated.
* :func:`tile_model`: replaces, in place, each oversized ``nn.Linear`` and
  ``nn.Embedding`` of a model with its tiled equivalent holding the same
  weights, and returns a :class:`TilingPlan` that maps state dicts between the
  tile names and the dense names and shapes (for checkpoints and
  ``full_state_dict``).

Each tile's ``reset_parameters()`` gives its parameters the init their slice
of the dense layer would have had (the dense class's own ``reset_parameters``),
so a model built on the meta device, tiled, then materialized module by module
gets the values the dense model would have had (in distribution).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

logger = logging.getLogger(__name__)

__all__ = [
    "EmbeddingTile",
    "LinearTile",
    "TileSlice",
    "TiledEmbedding",
    "TiledLinear",
    "TiledTensor",
    "TiledTiedHead",
    "TilingPlan",
    "split_ranges",
    "tile_model",
]

Range = tuple[int, int]


# --------------------------------------------------------------------------- splits


def _check_splits(arg: str, splits: object, dim_name: str, dim: int) -> int:
    """Validate a split count for a dimension of size ``dim``; return it."""
    if isinstance(splits, bool) or not isinstance(splits, int):
        raise ValueError(f"{arg} must be an int, got {splits!r}")
    if splits < 1:
        raise ValueError(f"{arg} must be >= 1, got {splits}")
    if splits > max(dim, 1):
        raise ValueError(f"{arg}={splits} is larger than {dim_name}={dim}: each tile needs at least one")
    return splits


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


def _linear_splits(out_features: int, in_features: int, max_tile_numel: int) -> tuple[int, int]:
    """``(out_splits, in_splits)`` so that every tile's weight has at most
    ``max_tile_numel`` elements: split the output rows first, the input columns
    only when one row alone is over the limit."""
    in_splits = max(1, math.ceil(in_features / max_tile_numel))
    cols = math.ceil(in_features / in_splits)  # the widest in-tile
    rows_per_tile = max_tile_numel // max(cols, 1)
    out_splits = max(1, math.ceil(out_features / rows_per_tile))
    return out_splits, in_splits


def _copy_param(source: Tensor, requires_grad: bool) -> nn.Parameter:
    """A new parameter holding a copy of ``source`` (never a view of it). On the
    meta device this copies nothing."""
    data = source.detach().clone(memory_format=torch.contiguous_format)
    return nn.Parameter(data, requires_grad=requires_grad)


def _no_single_tensor(module: nn.Module, name: str) -> AttributeError:
    return AttributeError(
        f"{type(module).__name__} has no '{name}': it is split into tiles ({module.extra_repr()}), "
        f"each fetched on its own. Call the module instead of reading its '{name}', "
        f"use to_dense() for a dense copy, or raise max_tile_numel so this layer is not tiled."
    )


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


# --------------------------------------------------------------------------- initialization


class _DenseInit:
    """How a dense layer initializes its parameters, kept so that each tile can
    initialize its slice: a tiled model built on the meta device gets its
    values from each tile's ``reset_parameters()``, one module at a time.

    It holds a shapes-only (meta) copy of the dense layer. The stock inits of
    ``nn.Linear`` and ``nn.Embedding`` are drawn tile by tile (same
    distribution, another random stream). A subclass's own
    ``reset_parameters()`` may depend on the full shape (fan-out, special
    rows), so it is run on full-size stand-ins and the tile's slice copied out:
    correct for any init, at the cost of one dense layer in host memory (never
    on the accelerator), per tile, while a tile initializes.
    """

    def __init__(self, dense: nn.Module):
        prototype = type(dense).__new__(type(dense))
        nn.Module.__init__(prototype)
        machinery = set(prototype.__dict__)
        prototype.__dict__.update({k: v for k, v in dense.__dict__.items() if k not in machinery})
        for name, param in dense._parameters.items():
            prototype._parameters[name] = (
                None if param is None else nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"))
            )
        self.prototype = prototype

    def fill(self, name: str, index: tuple[slice, ...], target: Tensor) -> None:
        """Write the init of ``dense.<name>[index]`` into ``target``."""
        proto = self.prototype
        reset = type(proto).reset_parameters
        if reset is nn.Linear.reset_parameters:
            # kaiming_uniform_(a=sqrt(5)) is uniform(+-1/sqrt(fan_in)); the bias uses the same bound.
            bound = 1.0 / math.sqrt(proto.in_features) if proto.in_features > 0 else 0.0
            target.uniform_(-bound, bound)
        elif reset is nn.Embedding.reset_parameters:
            target.normal_()
            if proto.padding_idx is not None and index[0].start <= proto.padding_idx < index[0].stop:
                target[proto.padding_idx - index[0].start].fill_(0)
        else:
            # Full-size stand-ins in host memory (meta for a meta target), never on the accelerator.
            device = target.device if target.is_meta else torch.device("cpu")
            stand_ins = {
                k: nn.Parameter(torch.empty(p.shape, dtype=target.dtype, device=device), requires_grad=False)
                for k, p in proto._parameters.items()
                if p is not None
            }
            metas = dict(proto._parameters)
            try:
                proto._parameters.update(stand_ins)
                proto.reset_parameters()
                target.copy_(stand_ins[name][index])
            finally:
                proto._parameters.update(metas)


@dataclass(frozen=True, slots=True)
class _SliceInit:
    """A tile parameter's init: the slice ``index`` of ``dense``'s parameter ``name``."""

    dense: _DenseInit
    name: str
    index: tuple[slice, ...]


class _Tile(nn.Module):
    """A module owning one tile's parameters; ``reset_parameters()`` gives each
    the init its slice of the dense layer would have had."""

    def __init__(self):
        super().__init__()
        self.inits: dict[str, _SliceInit] = {}  # local parameter name -> its init

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for name, param in self._parameters.items():
                if param is not None:
                    init = self.inits[name]
                    init.dense.fill(init.name, init.index, param)


# --------------------------------------------------------------------------- tile modules


class LinearTile(_Tile):
    """One tile of a linear layer: ``F.linear(x[..., in_range], weight, bias)``.

    It is given its parameters (so a tied head's tiles can hold the embedding's
    parameters). ``in_range`` ``None`` means the tile reads all input features.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, in_range: Range | None):
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)
        self.in_range = in_range

    def forward(self, input: Tensor) -> Tensor:
        if self.in_range is not None:
            input = input[..., self.in_range[0] : self.in_range[1]]
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        out_features, in_features = self.weight.shape
        cols = "" if self.in_range is None else f", in_range={self.in_range}"
        return f"in_features={in_features}, out_features={out_features}, bias={self.bias is not None}{cols}"


class EmbeddingTile(_Tile):
    """Rows ``[row_start, row_stop)`` of an embedding table. Looks up the ids in
    its range and gives zeros for the others; with ``unembed=True`` maps hidden
    states to the logits of its rows (the tied head)."""

    def __init__(self, weight: nn.Parameter, row_start: int, num_embeddings: int, padding_idx: int | None):
        super().__init__()
        self.weight = weight
        self.row_start = row_start
        self.row_stop = row_start + weight.shape[0]
        self.covers_all = row_start == 0 and self.row_stop == num_embeddings
        # padding_idx local to this tile, or None when it is in another tile
        self.padding_idx = (
            padding_idx - row_start if padding_idx is not None and row_start <= padding_idx < self.row_stop else None
        )

    def forward(self, input: Tensor, unembed: bool = False) -> Tensor:
        if unembed:
            return F.linear(input, self.weight)
        if self.covers_all:
            return F.embedding(input, self.weight, self.padding_idx)
        local = input - self.row_start
        in_range = (local >= 0) & (local < self.weight.shape[0])
        # Ids of other tiles look up row 0 and are zeroed; `where` (not a multiply)
        # so a non-finite row 0 cannot leak, and their gradient is exactly zero.
        rows = F.embedding(torch.where(in_range, local, 0), self.weight, self.padding_idx)
        return torch.where(in_range.unsqueeze(-1), rows, 0.0)

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"rows=[{self.row_start}, {self.row_stop}), embedding_dim={self.weight.shape[1]}{pad}"


# --------------------------------------------------------------------------- tiled layers


class TiledLinear(nn.Module):
    """``nn.Linear(in_features, out_features, bias)`` split into
    ``out_splits x in_splits`` tiles, ``tiles[j][i]`` holding
    ``weight[rows_j, cols_i]`` (and ``bias[rows_j]`` when ``i == 0``).

    Equivalent to ``nn.Linear`` in forward and gradients: bitwise with one
    tile, otherwise up to rounding (the matmul kernel a BLAS picks may depend
    on the tile's shape, and with ``in_splits > 1`` the partial sums are added,
    in fp32 or the input's precision if higher, in a different order).
    Splits need not divide the features (sizes as in ``torch.tensor_split``).

    Constructed directly, the tiles are initialized with ``nn.Linear``'s
    distribution (but not its random stream); :meth:`from_dense` copies an
    existing layer and keeps its init for later ``reset_parameters()`` calls.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.in_splits = _check_splits("in_splits", in_splits, "in_features", in_features)
        self.out_splits = _check_splits("out_splits", out_splits, "out_features", out_features)
        self.in_ranges = split_ranges(in_features, in_splits)
        self.out_ranges = split_ranges(out_features, out_splits)
        self.has_bias = bias
        factory = {"device": device, "dtype": dtype}
        self.tiles = nn.ModuleList()
        for rows in self.out_ranges:
            row_tiles = nn.ModuleList()
            for i, cols in enumerate(self.in_ranges):
                weight = nn.Parameter(torch.empty(rows[1] - rows[0], cols[1] - cols[0], **factory))
                tile_bias = nn.Parameter(torch.empty(rows[1] - rows[0], **factory)) if bias and i == 0 else None
                row_tiles.append(LinearTile(weight, tile_bias, None if in_splits == 1 else cols))
            self.tiles.append(row_tiles)
        self._set_init(_DenseInit(nn.Linear(in_features, out_features, bias, device="meta", dtype=dtype)))
        self.reset_parameters()

    def _set_init(self, dense: _DenseInit) -> None:
        for j, rows in enumerate(self.out_ranges):
            for i, cols in enumerate(self.in_ranges):
                tile = self.tiles[j][i]
                tile.inits = {"weight": _SliceInit(dense, "weight", (slice(*rows), slice(*cols)))}
                if tile.bias is not None:
                    tile.inits["bias"] = _SliceInit(dense, "bias", (slice(*rows),))

    def reset_parameters(self) -> None:
        for tile in self.tile_modules():
            tile.reset_parameters()

    def tile_modules(self) -> list[LinearTile]:
        """The tiles, row-major."""
        return [tile for row in self.tiles for tile in row]

    def forward(self, input: Tensor) -> Tensor:
        outputs = []
        for row in self.tiles:
            acc = row[0](input)
            if self.in_splits > 1:
                out_dtype = acc.dtype
                acc = acc.to(torch.promote_types(out_dtype, torch.float32))
                for tile in row[1:]:
                    acc = acc + tile(input)
                acc = acc.to(out_dtype)
            outputs.append(acc)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    def tensor_map(self, prefix: str = "") -> list[TiledTensor]:
        """How this layer's dense ``weight`` (and ``bias``) map to its tile
        tensors, named under ``prefix`` (the layer's qualified name)."""
        p = f"{prefix}." if prefix else ""
        weight_tiles, bias_tiles = [], []
        for j, rows in enumerate(self.out_ranges):
            for i, cols in enumerate(self.in_ranges):
                weight_tiles.append(TileSlice(f"{p}tiles.{j}.{i}.weight", rows, cols))
            if self.has_bias:
                bias_tiles.append(TileSlice(f"{p}tiles.{j}.0.bias", rows, None))
        tensors = [TiledTensor(f"{p}weight", (self.out_features, self.in_features), tuple(weight_tiles))]
        if self.has_bias:
            tensors.append(TiledTensor(f"{p}bias", (self.out_features,), tuple(bias_tiles)))
        return tensors

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, in_splits: int = 1, out_splits: int = 1) -> TiledLinear:
        """A tiled copy of ``linear`` (same device, dtype, values and
        ``requires_grad``; the tiles never alias ``linear``'s storage). On the
        meta device nothing is copied. The tiles' ``reset_parameters()`` give
        ``linear``'s own init (its class's ``reset_parameters``)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"TiledLinear.from_dense expects an nn.Linear, got {type(linear).__name__}")
        weight, bias = linear.weight, linear.bias
        tiled = cls(
            linear.in_features, linear.out_features, bias is not None, in_splits, out_splits,
            device="meta", dtype=weight.dtype,
        )  # fmt: skip
        for j, rows in enumerate(tiled.out_ranges):
            for i, cols in enumerate(tiled.in_ranges):
                tile = tiled.tiles[j][i]
                tile.weight = _copy_param(weight[rows[0] : rows[1], cols[0] : cols[1]], weight.requires_grad)
                if tile.bias is not None:
                    tile.bias = _copy_param(bias[rows[0] : rows[1]], bias.requires_grad)
        tiled._set_init(_DenseInit(linear))
        tiled.train(linear.training)
        return tiled

    def to_dense(self) -> nn.Linear:
        """A dense ``nn.Linear`` holding a copy of the assembled weights."""
        return _dense_linear(self, self.tensor_map(), self.in_features, self.out_features)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("weight", "bias"):
                raise _no_single_tensor(self, name) from None
            raise

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
            f"in_splits={self.in_splits}, out_splits={self.out_splits}"
        )


class TiledEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim, padding_idx)`` split by
    vocabulary rows into ``splits`` tiles (sizes as in ``torch.tensor_split``).

    ``forward(ids)`` and its gradients equal ``nn.Embedding``'s. Each tile runs
    over all ids (ids of other tiles give zeros), so the compute grows with
    ``splits``; the working memory holds one tile. Ids outside
    ``[0, num_embeddings)`` raise ``IndexError`` for CPU inputs; on an
    accelerator they are not checked (that would synchronize every step) and
    give zero rows.

    ``forward(hidden, unembed=True)`` is the tied output head,
    ``F.linear(hidden, weight)``, computed tile by tile: the form of tying in
    which the model calls its embedding a second time (``infinity.models.gpt``).
    :meth:`as_head` gives the same head as a separate module.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        splits: int = 1,
        padding_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.splits = _check_splits("splits", splits, "num_embeddings", num_embeddings)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx={padding_idx} is outside num_embeddings={num_embeddings}")
            if padding_idx < 0:
                padding_idx += num_embeddings
        self.padding_idx = padding_idx
        self.row_ranges = split_ranges(num_embeddings, splits)
        factory = {"device": device, "dtype": dtype}
        self.tiles = nn.ModuleList(
            EmbeddingTile(
                nn.Parameter(torch.empty(stop - start, embedding_dim, **factory)), start, num_embeddings, padding_idx
            )
            for start, stop in self.row_ranges
        )
        dense = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device="meta", dtype=dtype)
        self._set_init(_DenseInit(dense))
        self.reset_parameters()

    def _set_init(self, dense: _DenseInit) -> None:
        for tile, rows in zip(self.tiles, self.row_ranges):
            tile.inits = {"weight": _SliceInit(dense, "weight", (slice(*rows), slice(0, self.embedding_dim)))}

    def reset_parameters(self) -> None:
        for tile in self.tiles:
            tile.reset_parameters()

    def forward(self, input: Tensor, unembed: bool = False) -> Tensor:
        if unembed:
            logits = [tile(input, unembed=True) for tile in self.tiles]
            return logits[0] if len(logits) == 1 else torch.cat(logits, dim=-1)
        if input.device.type == "cpu" and input.numel() > 0:
            low, high = int(input.min()), int(input.max())
            if low < 0 or high >= self.num_embeddings:
                bad = low if low < 0 else high
                raise IndexError(f"TiledEmbedding: id {bad} is out of range [0, {self.num_embeddings})")
        out = None
        for tile in self.tiles:
            rows = tile(input)
            out = rows if out is None else out + rows
        return out

    def as_head(self, bias: bool = False) -> TiledTiedHead:
        """An output head tied to this embedding (see :class:`TiledTiedHead`)."""
        return TiledTiedHead(self, bias=bias)

    def tensor_map(self, prefix: str = "") -> list[TiledTensor]:
        """How this layer's dense ``weight`` maps to its tile tensors."""
        p = f"{prefix}." if prefix else ""
        tiles = tuple(
            TileSlice(f"{p}tiles.{k}.weight", rows, (0, self.embedding_dim)) for k, rows in enumerate(self.row_ranges)
        )
        return [TiledTensor(f"{p}weight", (self.num_embeddings, self.embedding_dim), tiles)]

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, *, splits: int = 1) -> TiledEmbedding:
        """A tiled copy of ``embedding`` (same device, dtype, values and
        ``requires_grad``; the tiles never alias its storage). On the meta
        device nothing is copied. The tiles' ``reset_parameters()`` give
        ``embedding``'s own init."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"TiledEmbedding.from_dense expects an nn.Embedding, got {type(embedding).__name__}")
        unsupported = _unsupported_embedding_options(embedding)
        if unsupported:
            raise ValueError(f"TiledEmbedding does not support {unsupported}")
        weight = embedding.weight
        tiled = cls(
            embedding.num_embeddings, embedding.embedding_dim, splits, embedding.padding_idx,
            device="meta", dtype=weight.dtype,
        )  # fmt: skip
        for tile, (start, stop) in zip(tiled.tiles, tiled.row_ranges):
            tile.weight = _copy_param(weight[start:stop], weight.requires_grad)
        tiled._set_init(_DenseInit(embedding))
        tiled.train(embedding.training)
        return tiled

    def to_dense(self) -> nn.Embedding:
        """A dense ``nn.Embedding`` holding a copy of the assembled weight."""
        first = self.tiles[0].weight
        dense = nn.Embedding(
            self.num_embeddings, self.embedding_dim, self.padding_idx, device="meta", dtype=first.dtype
        )
        (tensor,) = self.tensor_map()
        dense.weight = nn.Parameter(tensor.assemble(self.state_dict()), requires_grad=first.requires_grad)
        return dense

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "weight":
                raise _no_single_tensor(self, name) from None
            raise

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}, splits={self.splits}{pad}"


class TiledTiedHead(nn.Module):
    """An output head whose weight is tied to a :class:`TiledEmbedding`:
    ``logits = x @ W^T (+ bias)`` with ``W`` the embedding's table.

    Its tiles hold the same ``nn.Parameter`` objects as the embedding's tiles
    (tying is kept tile by tile), each computing the logits of its vocabulary
    rows; the logits are concatenated along the last dimension. The head does
    not keep a reference to the embedding module. With ``bias``, each tile owns
    its slice of a new bias, initialized like ``nn.Linear``'s.

    A head tile's ``reset_parameters()`` initializes its bias and, with the
    embedding's init, the shared weight (whichever of the two modules is
    initialized first gives the right values); the head's own
    ``reset_parameters()`` resets only the bias.
    """

    def __init__(self, embedding: TiledEmbedding, bias: bool = False):
        super().__init__()
        if not isinstance(embedding, TiledEmbedding):
            raise TypeError(f"TiledTiedHead expects a TiledEmbedding, got {type(embedding).__name__}")
        self.in_features = embedding.embedding_dim
        self.out_features = embedding.num_embeddings
        self.splits = embedding.splits
        self.out_ranges = list(embedding.row_ranges)
        self.has_bias = bias
        self.tiles = nn.ModuleList()
        for emb_tile in embedding.tiles:
            w = emb_tile.weight
            tile_bias = nn.Parameter(torch.empty(w.shape[0], device=w.device, dtype=w.dtype)) if bias else None
            self.tiles.append(LinearTile(w, tile_bias, None))
        w = embedding.tiles[0].weight
        dense = nn.Linear(self.in_features, self.out_features, bias=True, device="meta", dtype=w.dtype)
        self._set_init(embedding, _DenseInit(dense))
        self.reset_parameters()

    def _set_init(self, embedding: TiledEmbedding, dense: _DenseInit) -> None:
        for tile, emb_tile, rows in zip(self.tiles, embedding.tiles, self.out_ranges):
            tile.inits = {"weight": emb_tile.inits["weight"]}
            if tile.bias is not None:
                tile.inits["bias"] = _SliceInit(dense, "bias", (slice(*rows),))

    def reset_parameters(self) -> None:
        """Initialize the bias like the dense head's (the weight is the embedding's)."""
        with torch.no_grad():
            for tile in self.tiles:
                if tile.bias is not None:
                    init = tile.inits["bias"]
                    init.dense.fill(init.name, init.index, tile.bias)

    def forward(self, input: Tensor) -> Tensor:
        logits = [tile(input) for tile in self.tiles]
        return logits[0] if len(logits) == 1 else torch.cat(logits, dim=-1)

    def tensor_map(self, prefix: str = "", tied_to: str | None = None) -> list[TiledTensor]:
        """How this head's dense ``weight`` (and ``bias``) map to its tile
        tensors; ``tied_to`` is recorded on the weight (the embedding's dense name)."""
        p = f"{prefix}." if prefix else ""
        weight_tiles = tuple(
            TileSlice(f"{p}tiles.{k}.weight", rows, (0, self.in_features)) for k, rows in enumerate(self.out_ranges)
        )
        tensors = [TiledTensor(f"{p}weight", (self.out_features, self.in_features), weight_tiles, tied_to)]
        if self.has_bias:
            bias_tiles = tuple(TileSlice(f"{p}tiles.{k}.bias", rows, None) for k, rows in enumerate(self.out_ranges))
            tensors.append(TiledTensor(f"{p}bias", (self.out_features,), bias_tiles))
        return tensors

    @classmethod
    def from_dense(cls, linear: nn.Linear, embedding: TiledEmbedding) -> TiledTiedHead:
        """The tiled form of ``linear``, a head tied to the embedding that
        ``embedding`` was made from: the weight is ``embedding``'s tiles, the
        bias (if any) a copy of ``linear``'s."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"TiledTiedHead.from_dense expects an nn.Linear, got {type(linear).__name__}")
        expected = (embedding.num_embeddings, embedding.embedding_dim)
        if tuple(linear.weight.shape) != expected:
            raise ValueError(
                f"TiledTiedHead.from_dense: linear weight shape {tuple(linear.weight.shape)} "
                f"is not the embedding's {expected}"
            )
        head = cls(embedding, bias=False)
        if linear.bias is not None:
            head.has_bias = True
            for tile, (start, stop) in zip(head.tiles, head.out_ranges):
                tile.bias = _copy_param(linear.bias[start:stop], linear.bias.requires_grad)
        head._set_init(embedding, _DenseInit(linear))
        head.train(linear.training)
        return head

    def to_dense(self) -> nn.Linear:
        """A dense, untied ``nn.Linear`` holding a copy of the assembled weights."""
        return _dense_linear(self, self.tensor_map(), self.in_features, self.out_features)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("weight", "bias"):
                raise _no_single_tensor(self, name) from None
            raise

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
            f"splits={self.splits}, tied"
        )


def _dense_linear(module: nn.Module, tensors: list[TiledTensor], in_features: int, out_features: int) -> nn.Linear:
    state = module.state_dict()
    first = next(iter(state.values()))
    dense = nn.Linear(in_features, out_features, bias=len(tensors) > 1, device="meta", dtype=first.dtype)
    requires_grad = {name: p.requires_grad for name, p in module.named_parameters(remove_duplicate=False)}
    for tensor in tensors:
        grad = requires_grad[tensor.tiles[0].name]
        setattr(dense, tensor.name, nn.Parameter(tensor.assemble(state), requires_grad=grad))
    return dense


# --------------------------------------------------------------------------- tile_model


def _unsupported_embedding_options(embedding: nn.Embedding) -> str:
    options = []
    if embedding.max_norm is not None:
        options.append(f"max_norm={embedding.max_norm}")
    if embedding.scale_grad_by_freq:
        options.append("scale_grad_by_freq=True")
    if embedding.sparse:
        options.append("sparse=True")
    return ", ".join(options)


def _why_not_tileable(module: nn.Module) -> str | None:
    """``None`` if ``tile_model`` may replace this Linear or Embedding, else why not."""
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "it is a MultiheadAttention projection, whose parent reads its weight directly"
    base = nn.Linear if isinstance(module, nn.Linear) else nn.Embedding
    if type(module).forward is not base.forward and not getattr(type(module), "tiling_compatible", False):
        return (
            f"its class {type(module).__qualname__} overrides forward (set `tiling_compatible = True` on the class "
            f"if that forward is {base.__name__}'s, plus `unembed=True` -> F.linear(x, weight) for an embedding)"
        )
    if isinstance(module, nn.Embedding):
        unsupported = _unsupported_embedding_options(module)
        if unsupported:
            return f"TiledEmbedding does not support {unsupported}"
    return None


def tile_model(model: nn.Module, max_tile_numel: int) -> TilingPlan:
    """Replace, in place, every ``nn.Linear`` and ``nn.Embedding`` of ``model``
    whose weight has more than ``max_tile_numel`` elements with a tiled
    equivalent holding the same weights; return the :class:`TilingPlan`.

    * Splits are chosen so every tile's weight has at most ``max_tile_numel``
      elements: output rows (vocabulary rows) first, input columns only when a
      single row is over the limit. An embedding is split by rows only, so
      ``max_tile_numel`` must be at least its ``embedding_dim``.
    * Subclasses are tiled when they change only the init (their
      ``reset_parameters()`` is kept for each tile) or when their class sets
      ``tiling_compatible = True``: a promise that its ``forward`` is the base
      class's, plus, for an embedding, ``forward(x, unembed=True)`` =
      ``F.linear(x, weight)`` (the tied head of ``infinity.models.gpt``).
      Other subclasses, ``MultiheadAttention``'s ``out_proj`` (read directly
      by its parent) and embeddings with ``max_norm``, ``scale_grad_by_freq``
      or ``sparse`` are left untiled, with a warning.
    * Weight tying: a Linear whose weight is the same parameter as an
      Embedding's (a tied output head) becomes a :class:`TiledTiedHead`
      sharing the :class:`TiledEmbedding`'s tile parameters. Any other sharing
      (a parameter shared with a module that is not such a pair, or a partner
      that cannot be tiled) leaves every module involved untiled, with a
      warning: tiling one side alone would silently break the tie.
    * The replacements keep their attribute names, so code that *calls* the
      layers works unchanged; code that reads a tiled layer's ``.weight``
      gets an ``AttributeError`` saying why. Hooks registered on a replaced
      module are not carried over.
    * On the meta device the tiles are created on meta and nothing is copied;
      each tile's ``reset_parameters()`` then gives its slice the dense
      layer's init. Otherwise each layer is copied into its tiles and released
      (when nothing else references it) before the next one, so the extra
      memory is one layer.
    """
    if isinstance(max_tile_numel, bool) or not isinstance(max_tile_numel, int) or max_tile_numel < 1:
        raise ValueError(f"max_tile_numel must be a positive int, got {max_tile_numel!r}")
    if isinstance(model, (nn.Linear, nn.Embedding)) and model.weight.numel() > max_tile_numel:
        raise ValueError(
            f"tile_model: the model itself is an {type(model).__name__} with {model.weight.numel()} > "
            f"max_tile_numel={max_tile_numel} elements and cannot be replaced in place; wrap it in a module "
            f"or build a TiledLinear/TiledEmbedding with from_dense()"
        )

    # Where each module sits (a module registered twice sits in two places),
    # and which modules own each parameter directly.
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    names: dict[int, str] = {}
    order: list[nn.Module] = []
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent._modules.items():
            if child is None:
                continue
            if id(child) not in places:
                places[id(child)] = []
                names[id(child)] = f"{parent_name}.{attr}" if parent_name else attr
                order.append(child)
            if not any(p is parent and a == attr for p, a in places[id(child)]):
                places[id(child)].append((parent, attr))
    owners: dict[int, list[int]] = {}
    for module in [model, *order]:
        for param in module._parameters.values():
            if param is not None and id(module) not in owners.setdefault(id(param), []):
                owners[id(param)].append(id(module))
    by_id = {id(m): m for m in order}

    def shared_with(module: nn.Module, allowed: set[int]) -> list[str]:
        """Names of the modules outside ``allowed`` that own one of ``module``'s parameters."""
        others = []
        for param in module._parameters.values():
            if param is not None:
                others += [names.get(o, "<model>") for o in owners[id(param)] if o not in allowed]
        return others

    def oversized(module: nn.Module, kind: type) -> bool:
        return isinstance(module, kind) and module.weight.numel() > max_tile_numel

    # Decide first, then replace one module at a time.
    embeddings: dict[int, list[int]] = {}  # embedding id -> its tied heads' ids
    linears: list[int] = []
    skipped: set[int] = set()  # decided: left untiled, or tiled as a tied head
    for module in order:
        if not oversized(module, nn.Embedding):
            continue
        name = names[id(module)]
        partners = [o for o in owners[id(module.weight)] if o != id(module)]
        skipped.update(partners)
        heads = [o for o in partners if isinstance(by_id.get(o), nn.Linear)]
        why_not = _why_not_tileable(module) or next(
            (f"its tied head {names[h]} cannot be tiled: {w}" for h in heads if (w := _why_not_tileable(by_id[h]))),
            None,
        )
        if why_not is None:
            others = shared_with(module, {id(module), *heads}) + [
                n for h in heads for n in shared_with(by_id[h], {id(module), *heads})
            ]
            if others:
                why_not = f"its parameters are shared with {', '.join(sorted(set(others)))}"
        if why_not is not None:
            tied = f" (nor its tied modules {', '.join(names.get(o, '<model>') for o in partners)})" if partners else ""
            logger.warning("tiling: %s left untiled%s: %s", name, tied, why_not)
            continue
        if module.embedding_dim > max_tile_numel:
            raise ValueError(
                f"max_tile_numel={max_tile_numel} is smaller than one row of embedding {name!r} "
                f"(embedding_dim={module.embedding_dim}); embeddings are split by rows only"
            )
        embeddings[id(module)] = heads
    for module in order:
        if not oversized(module, nn.Linear) or id(module) in skipped:
            continue
        why_not = _why_not_tileable(module)
        others = shared_with(module, {id(module)})
        if why_not is None and others:
            why_not = (
                f"its parameters are shared with {', '.join(sorted(set(others)))} "
                f"(only a head tied to an Embedding is tiled with its partner)"
            )
        if why_not is not None:
            logger.warning("tiling: %s left untiled: %s", names[id(module)], why_not)
            continue
        linears.append(id(module))

    # Hold no reference to the dense layers from here on, so each is freed once replaced.
    order.clear()
    module = None

    def put(old_id: int, new: nn.Module) -> None:
        for parent, attr in places[old_id]:
            setattr(parent, attr, new)
        logger.debug("tiling: %s -> %r", names[old_id], new)

    created: dict[int, tuple[nn.Module, str | None]] = {}  # id(tiled module) -> (module, tied-to dense name)
    for emb_id, head_ids in embeddings.items():
        embedding = by_id.pop(emb_id)
        rows_per_tile = max_tile_numel // embedding.embedding_dim
        tiled_emb = TiledEmbedding.from_dense(embedding, splits=math.ceil(embedding.num_embeddings / rows_per_tile))
        del embedding
        created[id(tiled_emb)] = (tiled_emb, None)
        put(emb_id, tiled_emb)
        for head_id in head_ids:
            head = TiledTiedHead.from_dense(by_id[head_id], tiled_emb)
            created[id(head)] = (head, f"{names[emb_id]}.weight")
            put(head_id, head)
            del by_id[head_id], head
    for lin_id in linears:
        linear = by_id.pop(lin_id)
        out_splits, in_splits = _linear_splits(linear.out_features, linear.in_features, max_tile_numel)
        tiled = TiledLinear.from_dense(linear, in_splits=in_splits, out_splits=out_splits)
        del linear
        created[id(tiled)] = (tiled, None)
        put(lin_id, tiled)

    tensors: list[TiledTensor] = []
    modules: dict[str, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) not in created:
            continue
        tied_to = created[id(module)][1]
        entries = module.tensor_map(name) if tied_to is None else module.tensor_map(name, tied_to)
        tensors += entries
        modules[name] = f"{type(module).__name__}({module.extra_repr()})"
    plan = TilingPlan(tensors, modules)
    if not plan.is_empty:
        logger.info("tiling: %d layers tiled (max_tile_numel=%d)", len(modules), max_tile_numel)
    return plan
