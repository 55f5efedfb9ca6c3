"""The Hugging Face door: ``from_pretrained``, and ``Trainer``/``InfinityTrainerMixin`` (need ``transformers``).

``from infinity.hf import Trainer`` in place of ``from transformers import Trainer`` runs a Trainer
script's model under the engine (see :mod:`infinity.hf.trainer`).
"""

# The Trainer needs the optional `transformers` extra: its module is imported on first use.
_LAZY = {
    "Trainer": ("infinity.hf.trainer", "Trainer"),
    "InfinityTrainerMixin": ("infinity.hf.trainer", "InfinityTrainerMixin"),
    "from_pretrained": ("infinity.hf.pretrained", "from_pretrained"),
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'infinity.hf' has no attribute {name!r}")
