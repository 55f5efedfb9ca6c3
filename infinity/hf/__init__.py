"""The Hugging Face door: ``from_pretrained``, and ``Trainer``/``InfinityTrainerMixin`` (need ``transformers``).

``from infinity.hf import Trainer`` in place of ``from transformers import Trainer`` runs a Trainer
script's model under the engine (see :mod:`infinity.hf.trainer`).
"""

from infinity.runtime.lazy import lazy_names

# The Trainer needs the optional `transformers` extra: its module is imported on first use.
_LAZY = {
    "Trainer": ("infinity.hf.trainer", "Trainer"),
    "InfinityTrainerMixin": ("infinity.hf.trainer", "InfinityTrainerMixin"),
    "from_pretrained": ("infinity.hf.pretrained", "from_pretrained"),
}

__all__ = list(_LAZY)


__getattr__ = lazy_names(__name__, _LAZY, globals())
