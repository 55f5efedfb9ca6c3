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

The pieces, each in its own module (:mod:`~infinity.tiling.tiles` the single
tile modules and their init, :mod:`~infinity.tiling.layers` the tiled layers,
:mod:`~infinity.tiling.plan` the plan, :mod:`~infinity.tiling.surgery`
:func:`tile_model`); import them from here:

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

from infinity.tiling.layers import TiledEmbedding, TiledLinear, TiledTiedHead
from infinity.tiling.plan import TiledTensor, TileSlice, TilingPlan, split_ranges
from infinity.tiling.surgery import tile_model
from infinity.tiling.tiles import EmbeddingTile, LinearTile

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
