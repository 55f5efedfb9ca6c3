"""Parameter groups as ``torch.optim`` and DeepSpeed take them: ``[{"params": [...], "weight_decay": 0.0}, ...]``.

The engine's AdamW has one learning rate, one pair of betas and one eps (the config's ``optimizer.params``), so
a group may differ from the others only in ``weight_decay`` (the usual reason for groups: no decay for biases and
norms). A group's ``lr``, ``betas`` or ``eps`` equal to the config's says nothing new and is accepted; any other
value, or any other key, is refused by name, except a label (:func:`is_label`: a string, or strings, such as a
group's ``name`` or torch's ``param_names``), which says nothing to the optimizer and is kept out of its way, as
``torch.optim`` keeps it. A group without ``weight_decay`` takes the config's, as a ``torch.optim`` group takes the
optimizer's default.

The groups are read once, before the engine does any work, into each trainable parameter's decay by name
(:func:`weight_decay_by_name`); the layout then gives every sub-group one decay
(:class:`~infinity.placement.layout.ShardLayout`). Every trainable parameter must be in exactly one group (as
``torch.optim`` steps only the parameters it is given, a trainable one left out would be a mistake here); a
frozen one may be listed, and has no optimizer state.

:func:`decay_matrices_only` builds the usual two groups (nanoGPT's and Megatron's): the decay on tensors of 2 or
more dimensions, none on biases and norm weights; ``infinity train`` passes them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from infinity.config.sections import OptimizerConfig
from infinity.tiling.plan import TilingPlan

PARAMS = "params"
WEIGHT_DECAY = "weight_decay"
SHARED = ("lr", "betas", "eps")
"""Keys a group may hold only with the config's value: the engine's AdamW has one of each."""


def is_label(value) -> bool:
    """Whether a group's value names rather than tunes: a string, or a list or tuple of strings (a group's
    ``"name": "decay"``, torch's ``param_names``). No hyperparameter of Adam is one, so a label is never a setting
    the engine would drop silently."""
    if isinstance(value, str):
        return True
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(v, str) for v in value)


def weight_decay_by_name(model: torch.nn.Module, param_groups, optimizer: OptimizerConfig) -> dict[str, float]:
    """Each trainable parameter's weight decay by its name in ``model.named_parameters()``, from ``param_groups``
    (a list of dicts, as ``torch.optim`` takes them). Raises ``ValueError`` naming the group and key, or the
    parameter, for anything the engine cannot honour."""
    if isinstance(param_groups, (dict, torch.Tensor)) or not isinstance(param_groups, Iterable):
        raise ValueError(f"param_groups must be a list of dicts ({{'params': [...], 'weight_decay': 0.0}}, as "
                         f"torch.optim takes them), got {type(param_groups).__name__}")
    groups = list(param_groups)
    if not groups:
        raise ValueError("param_groups is empty: give at least one group, or leave param_groups out")
    name_of = {id(p): name for name, p in model.named_parameters()}
    group_of: dict[str, int] = {}
    decay: dict[str, float] = {}
    for i, group in enumerate(groups):
        where = f"param_groups[{i}]"
        weight_decay = _check_group(group, where, optimizer)
        for param in _params(group, where):
            name = name_of.get(id(param))
            if name is None:
                raise ValueError(f"{where}['params'] holds a tensor of shape {list(param.shape)} that is not a "
                                 f"parameter of the model")
            if name in group_of:
                raise ValueError(f"parameter {name!r} is in param_groups[{group_of[name]}] and in {where}: a "
                                 f"parameter belongs to one group")
            group_of[name] = i
            if param.requires_grad:
                decay[name] = weight_decay
    missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in group_of]
    if missing:
        raise ValueError(f"parameter {missing[0]!r} (and {len(missing) - 1} more) is trainable but in no param group: "
                         f"list every trainable parameter in a group, or freeze it (requires_grad=False)")
    return decay


def decay_matrices_only(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups of ``model``'s trainable parameters: ``weight_decay`` on the tensors of 2 or more dimensions
    (matmul weights, embeddings), none on the rest (biases, norm weights), as nanoGPT and Megatron decay. On the
    usual architectures (GPT-2, Llama) it decays what the Hugging Face Trainer's ``get_decay_parameter_names``
    names. A tensor tied to another is listed once (``model.parameters()`` yields it once)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{PARAMS: [p for p in trainable if decays_ndim(p.ndim)], WEIGHT_DECAY: weight_decay},
            {PARAMS: [p for p in trainable if not decays_ndim(p.ndim)], WEIGHT_DECAY: 0.0}]


def decays_ndim(ndim: int) -> bool:
    """:func:`decay_matrices_only`'s rule: a tensor of ``ndim`` dimensions is decayed (2 or more)."""
    return ndim >= 2


def decay_of_tiles(decay: dict[str, float], names: Iterable[str], plan: TilingPlan | None) -> dict[str, float]:
    """``decay`` by the names of the model as partitioned (``names``): the tiles of a parameter that
    ``tiling.max_tile_numel`` split take its decay."""
    if plan is None:
        return decay
    out = {}
    for name in names:
        dense = name if name in decay else plan.dense_name_of(name)
        if dense in decay:
            out[name] = decay[dense]
    return out


def _check_group(group, where: str, optimizer: OptimizerConfig) -> float:
    """The group's weight decay, once its keys are checked."""
    if not isinstance(group, dict):
        raise ValueError(f"{where} must be a dict with 'params' (and 'weight_decay'), got {type(group).__name__}")
    if PARAMS not in group:
        raise ValueError(f"{where} has no 'params'")
    for key, value in group.items():
        if key in (PARAMS, WEIGHT_DECAY) or (key not in SHARED and is_label(value)):
            continue
        if key not in SHARED:
            raise ValueError(f"{where} has key {key!r}, which the engine cannot honour per group: a group may set "
                             f"'params' and 'weight_decay' (and {', '.join(map(repr, SHARED))} equal to the config's, and "
                             f"labels: strings)")
        if not _same(value, getattr(optimizer, key)):
            raise ValueError(f"{where}['{key}'] is {value!r} but the config's optimizer.params.{key} is "
                             f"{getattr(optimizer, key)!r}: the engine's AdamW has one {key} for every parameter "
                             f"(only 'weight_decay' may differ between groups)")
    weight_decay = group.get(WEIGHT_DECAY, optimizer.weight_decay)
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or \
            not math.isfinite(weight_decay) or weight_decay < 0:
        raise ValueError(f"{where}['weight_decay'] must be a finite number >= 0, got {weight_decay!r}")
    return float(weight_decay)


def _params(group: dict, where: str) -> list[torch.Tensor]:
    params = group[PARAMS]
    params = [params] if isinstance(params, torch.Tensor) else params
    if isinstance(params, dict) or not isinstance(params, Iterable):
        raise ValueError(f"{where}['params'] must be a tensor or an iterable of tensors, got {type(params).__name__}")
    params = list(params)
    for param in params:
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"{where}['params'] holds a {type(param).__name__}, not a tensor")
    return params


def _same(value, configured) -> bool:
    if isinstance(configured, tuple):
        return isinstance(value, (list, tuple)) and len(value) == len(configured) and \
            all(map(_same, value, configured))
    try:
        return float(value) == float(configured)
    except (TypeError, ValueError):
        return False
