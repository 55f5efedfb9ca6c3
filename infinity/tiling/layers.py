"""The tiled layers: :class:`TiledLinear`, :class:`TiledEmbedding` and
:class:`TiledTiedHead`, containers of tile modules that own no parameters
themselves. Each converts from and to its dense layer (``from_dense``,
``to_dense``) and says how its dense tensors map to its tiles (``tensor_map``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from infinity.tiling.plan import TiledTensor, TileSlice, split_ranges
from infinity.tiling.tiles import EmbeddingTile, LinearTile, _DenseInit, _SliceInit


def _check_splits(arg: str, splits: object, dim_name: str, dim: int) -> int:
    """Validate a split count for a dimension of size ``dim``; return it."""
    if isinstance(splits, bool) or not isinstance(splits, int):
        raise ValueError(f"{arg} must be an int, got {splits!r}")
    if splits < 1:
        raise ValueError(f"{arg} must be >= 1, got {splits}")
    if splits > max(dim, 1):
        raise ValueError(f"{arg}={splits} is larger than {dim_name}={dim}: each tile needs at least one")
    return splits



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


def _unsupported_embedding_options(embedding: nn.Embedding) -> str:
    options = []
    if embedding.max_norm is not None:
        options.append(f"max_norm={embedding.max_norm}")
    if embedding.scale_grad_by_freq:
        options.append("scale_grad_by_freq=True")
    if embedding.sparse:
        options.append("sparse=True")
    return ", ".join(options)


# --------------------------------------------------------------------------- tiled layers


class _TiledModule(nn.Module):
    """A layer split into tiles: reading one of its split tensors (``split_tensors``) says why there is none."""

    split_tensors = ("weight", "bias")

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in self.split_tensors:
                raise _no_single_tensor(self, name) from None
            raise



class TiledLinear(_TiledModule):
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

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
            f"in_splits={self.in_splits}, out_splits={self.out_splits}"
        )


class TiledEmbedding(_TiledModule):
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

    split_tensors = ("weight",)

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

    def extra_repr(self) -> str:
        pad = "" if self.padding_idx is None else f", padding_idx={self.padding_idx}"
        return f"{self.num_embeddings}, {self.embedding_dim}, splits={self.splits}{pad}"


class TiledTiedHead(_TiledModule):
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
