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
