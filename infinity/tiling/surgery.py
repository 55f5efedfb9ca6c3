"""Model surgery: :func:`tile_model` replaces, in place, each oversized
``nn.Linear`` and ``nn.Embedding`` of a model with its tiled equivalent and
returns the :class:`~infinity.tiling.plan.TilingPlan`."""

from __future__ import annotations

import logging
import math

from torch import nn

from infinity.tiling.layers import TiledEmbedding, TiledLinear, TiledTiedHead, _unsupported_embedding_options
from infinity.tiling.plan import TiledTensor, TilingPlan

logger = logging.getLogger(__name__)


def _linear_splits(out_features: int, in_features: int, max_tile_numel: int) -> tuple[int, int]:
    """``(out_splits, in_splits)`` so that every tile's weight has at most
    ``max_tile_numel`` elements: split the output rows first, the input columns
    only when one row alone is over the limit."""
    in_splits = max(1, math.ceil(in_features / max_tile_numel))
    cols = math.ceil(in_features / in_splits)  # the widest in-tile
    rows_per_tile = max_tile_numel // max(cols, 1)
    out_splits = max(1, math.ceil(out_features / rows_per_tile))
    return out_splits, in_splits


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
    _check_arguments(model, max_tile_numel)
    index = _ModuleIndex(model)
    # Decide first, then replace one module at a time.
    embeddings, tie_partners = _embeddings_to_tile(index, max_tile_numel)
    linears = _linears_to_tile(index, max_tile_numel, skip=tie_partners)
    # Hold no reference to the dense layers from here on, so each is freed once replaced.
    index.order.clear()
    created: dict[int, tuple[nn.Module, str | None]] = {}  # id(tiled module) -> (module, tied-to dense name)
    for emb_id, head_ids in embeddings.items():
        for tiled, tied_to in _tile_embedding(index, emb_id, head_ids, max_tile_numel):
            created[id(tiled)] = (tiled, tied_to)
    for lin_id in linears:
        tiled = _tile_linear(index, lin_id, max_tile_numel)
        created[id(tiled)] = (tiled, None)
    plan = _plan_of(model, created)
    if not plan.is_empty:
        logger.info("tiling: %d layers tiled (max_tile_numel=%d)", len(plan.modules), max_tile_numel)
    return plan


def _check_arguments(model: nn.Module, max_tile_numel: int) -> None:
    if isinstance(max_tile_numel, bool) or not isinstance(max_tile_numel, int) or max_tile_numel < 1:
        raise ValueError(f"max_tile_numel must be a positive int, got {max_tile_numel!r}")
    if isinstance(model, (nn.Linear, nn.Embedding)) and model.weight.numel() > max_tile_numel:
        raise ValueError(
            f"tile_model: the model itself is an {type(model).__name__} with {model.weight.numel()} > "
            f"max_tile_numel={max_tile_numel} elements and cannot be replaced in place; wrap it in a module "
            f"or build a TiledLinear/TiledEmbedding with from_dense()"
        )


class _ModuleIndex:
    """Where each submodule of a model sits (a module registered twice sits in
    two places) and under which name, and which modules own each parameter
    directly. Keyed by ``id``; ``order`` and ``by_id`` hold the modules."""

    def __init__(self, model: nn.Module):
        self.places: dict[int, list[tuple[nn.Module, str]]] = {}  # module id -> (parent, attribute) pairs
        self.names: dict[int, str] = {}  # module id -> its first qualified name
        self.order: list[nn.Module] = []  # the submodules, each once, in the model's order
        for parent_name, parent in model.named_modules(remove_duplicate=False):
            for attr, child in parent._modules.items():
                if child is None:
                    continue
                if id(child) not in self.places:
                    self.places[id(child)] = []
                    self.names[id(child)] = f"{parent_name}.{attr}" if parent_name else attr
                    self.order.append(child)
                if not any(p is parent and a == attr for p, a in self.places[id(child)]):
                    self.places[id(child)].append((parent, attr))
        self.owners: dict[int, list[int]] = {}  # parameter id -> ids of the modules owning it directly
        for module in [model, *self.order]:
            for param in module._parameters.values():
                if param is not None and id(module) not in self.owners.setdefault(id(param), []):
                    self.owners[id(param)].append(id(module))
        self.by_id: dict[int, nn.Module] = {id(m): m for m in self.order}

    def name(self, module_id: int) -> str:
        """The module's qualified name; ``<model>`` for the model itself."""
        return self.names.get(module_id, "<model>")

    def shared_with(self, module: nn.Module, allowed: set[int]) -> list[str]:
        """Names of the modules outside ``allowed`` that own one of ``module``'s parameters."""
        others = []
        for param in module._parameters.values():
            if param is not None:
                others += [self.name(o) for o in self.owners[id(param)] if o not in allowed]
        return others

    def put(self, old_id: int, new: nn.Module) -> None:
        """Register ``new`` everywhere the module ``old_id`` sits."""
        for parent, attr in self.places[old_id]:
            setattr(parent, attr, new)
        logger.debug("tiling: %s -> %r", self.names[old_id], new)


def _oversized(module: nn.Module, kind: type, max_tile_numel: int) -> bool:
    return isinstance(module, kind) and module.weight.numel() > max_tile_numel


def _embeddings_to_tile(index: _ModuleIndex, max_tile_numel: int) -> tuple[dict[int, list[int]], set[int]]:
    """The oversized embeddings to tile, each with its tied heads' ids, and the
    ids of every oversized embedding's tie partners (tiled as its heads, or left
    untiled with it: either way not for the Linear pass). Warns for each
    embedding left untiled."""
    embeddings: dict[int, list[int]] = {}  # embedding id -> its tied heads' ids
    tie_partners: set[int] = set()
    for module in index.order:
        if not _oversized(module, nn.Embedding, max_tile_numel):
            continue
        name = index.names[id(module)]
        partners = [o for o in index.owners[id(module.weight)] if o != id(module)]
        tie_partners.update(partners)
        heads = [o for o in partners if isinstance(index.by_id.get(o), nn.Linear)]
        why_not = _why_not_tileable_with_heads(index, module, heads)
        if why_not is not None:
            tied = f" (nor its tied modules {', '.join(index.name(o) for o in partners)})" if partners else ""
            logger.warning("tiling: %s left untiled%s: %s", name, tied, why_not)
            continue
        if module.embedding_dim > max_tile_numel:
            raise ValueError(
                f"max_tile_numel={max_tile_numel} is smaller than one row of embedding {name!r} "
                f"(embedding_dim={module.embedding_dim}); embeddings are split by rows only"
            )
        embeddings[id(module)] = heads
    return embeddings, tie_partners


def _why_not_tileable_with_heads(index: _ModuleIndex, embedding: nn.Embedding, heads: list[int]) -> str | None:
    """``None`` if ``embedding`` and its tied heads may be tiled together, else why not."""
    why_not = _why_not_tileable(embedding)
    if why_not is not None:
        return why_not
    for head in heads:
        why_not = _why_not_tileable(index.by_id[head])
        if why_not is not None:
            return f"its tied head {index.names[head]} cannot be tiled: {why_not}"
    group = {id(embedding), *heads}
    others = index.shared_with(embedding, group) + [n for h in heads for n in index.shared_with(index.by_id[h], group)]
    if others:
        return f"its parameters are shared with {', '.join(sorted(set(others)))}"
    return None


def _linears_to_tile(index: _ModuleIndex, max_tile_numel: int, skip: set[int]) -> list[int]:
    """The ids of the oversized Linears to tile, other than those in ``skip``.
    Warns for each left untiled."""
    linears: list[int] = []
    for module in index.order:
        if not _oversized(module, nn.Linear, max_tile_numel) or id(module) in skip:
            continue
        why_not = _why_not_tileable(module)
        others = index.shared_with(module, {id(module)})
        if why_not is None and others:
            why_not = (
                f"its parameters are shared with {', '.join(sorted(set(others)))} "
                f"(only a head tied to an Embedding is tiled with its partner)"
            )
        if why_not is not None:
            logger.warning("tiling: %s left untiled: %s", index.names[id(module)], why_not)
            continue
        linears.append(id(module))
    return linears


def _tile_embedding(
    index: _ModuleIndex, emb_id: int, head_ids: list[int], max_tile_numel: int
) -> list[tuple[nn.Module, str | None]]:
    """Replace the embedding ``emb_id`` and its tied heads by their tiled forms;
    return them, each with the dense name its weight is tied to (``None`` for
    the embedding)."""
    embedding = index.by_id.pop(emb_id)
    rows_per_tile = max_tile_numel // embedding.embedding_dim
    tiled_emb = TiledEmbedding.from_dense(embedding, splits=math.ceil(embedding.num_embeddings / rows_per_tile))
    del embedding
    created: list[tuple[nn.Module, str | None]] = [(tiled_emb, None)]
    index.put(emb_id, tiled_emb)
    for head_id in head_ids:
        head = TiledTiedHead.from_dense(index.by_id[head_id], tiled_emb)
        created.append((head, f"{index.names[emb_id]}.weight"))
        index.put(head_id, head)
        del index.by_id[head_id], head
    return created


def _tile_linear(index: _ModuleIndex, lin_id: int, max_tile_numel: int) -> TiledLinear:
    """Replace the Linear ``lin_id`` by its tiled form; return that."""
    linear = index.by_id.pop(lin_id)
    out_splits, in_splits = _linear_splits(linear.out_features, linear.in_features, max_tile_numel)
    tiled = TiledLinear.from_dense(linear, in_splits=in_splits, out_splits=out_splits)
    del linear
    index.put(lin_id, tiled)
    return tiled


def _plan_of(model: nn.Module, created: dict[int, tuple[nn.Module, str | None]]) -> TilingPlan:
    """The plan of the tiled modules in ``created`` (id -> (module, tied-to
    dense name)), in the model's order, under every name each is registered."""
    tensors: list[TiledTensor] = []
    modules: dict[str, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) not in created:
            continue
        tied_to = created[id(module)][1]
        entries = module.tensor_map(name) if tied_to is None else module.tensor_map(name, tied_to)
        tensors += entries
        modules[name] = f"{type(module).__name__}({module.extra_repr()})"
    return TilingPlan(tensors, modules)
