"""One tile: a module owning one tile's parameters (:class:`LinearTile`,
:class:`EmbeddingTile`), and how it initializes them as its slice of the dense
layer would have been (:class:`_DenseInit`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infinity.tiling.plan import Range


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
