"""``infinity.from_pretrained``: a local Hugging Face causal LM, built without memory, its weights streamed in.

The model is built on the meta device from the folder's ``config.json``
(shapes only; tied weights are tied by the constructor) and handed, as it is,
to :func:`infinity.initialize` with ``weights=folder``: each rank ``pread``s its
slice of every tensor straight into its shard's tier. The whole model is never
in host memory.

    engine = infinity.from_pretrained("my-llama/", {"zero_optimization": {...}})
    out = engine(input_ids=ids, attention_mask=mask, labels=ids)   # the model's own forward and ModelOutput
    engine.backward(out.loss); engine.step()
    engine.save_pretrained("my-llama-tuned/")    # loadable by AutoModelForCausalLM.from_pretrained
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import torch

from infinity.engine.engine import initialize
from infinity.hf.peft_models import wrap_with_peft

logger = logging.getLogger(__name__)


def require_transformers(what: str):
    """The ``transformers`` module, or an error saying how to get it."""
    try:
        import transformers  # optional extra
    except ImportError:
        raise ImportError(f"{what} needs the `transformers` package: pip install 'zero-infinity[hf]'") from None
    return transformers


def build_meta_causal_lm(path) -> torch.nn.Module:
    """The causal LM described by ``path/config.json``, on the meta device (its own class and forward).

    Buffers computed in ``__init__`` (e.g. rotary frequencies) are on the meta
    device too; the engine gives them values with the model's ``_init_weights``.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no Hugging Face model folder here", str(path))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(errno.ENOENT, "the model folder has no config.json", str(path / "config.json"))
    transformers = require_transformers("from_pretrained")
    config = transformers.AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def from_pretrained(path, config=None, *, process_group=None, lora=None):
    """An engine over the Hugging Face causal LM in the local folder ``path``, with its pretrained weights.

    ``config`` is as for :func:`infinity.initialize`. Missing or unexpected
    tensors, a shape or dtype that does not fit, and a missing or damaged file
    are errors naming them, raised before any state is written. ``lora``: a
    ``peft`` config (``LoraConfig(...)``): the model is wrapped by ``peft.get_peft_model``
    before the engine streams its base, so only the adapters train (``engine.module``
    is the peft model; ``engine.save_pretrained`` writes its adapters).
    """

    model = build_meta_causal_lm(path)
    if lora is not None:
        model = wrap_with_peft(model, lora, needed_for="from_pretrained(lora=...)")
    return initialize(model, config, process_group=process_group, weights=path)
