"""``from_pretrained`` under a ZeRO-3 config, in a script run by ``infinity deepspeed`` or ``infinity accelerate
launch``: the model is built on the meta device and its weights are streamed into shards when the engine is made.

Under DeepSpeed, a Hugging Face model loaded while a ZeRO-3 config is registered (``HfDeepSpeedConfig`` kept alive
by the script, ``TrainingArguments(deepspeed=...)``, accelerate's ``zero3_init_flag``) is built inside
``zero.Init``: no process ever holds it whole. The same script here gets the same: ``from_pretrained`` builds the
model's modules on the meta device from the folder's config and marks the model with the folder
(:data:`~infinity.weights.pretrained.STREAMED_FROM`); ``deepspeed.initialize`` and the Trainer then read each
rank's slice of every tensor straight into its shard. A model folder without ``.safetensors`` files, and the
``from_pretrained`` arguments this cannot honour (quantization, a ``device_map``, a ``state_dict``, adapters
loaded with the model, ...), load the model whole as before, saying so.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import weakref
from pathlib import Path

import torch

from infinity.weights.adapters import DRAWN_VALUES
from infinity.weights.pretrained import INDEX_FILE, SINGLE_FILE, STREAMED_FROM, PretrainedWeights, WeightsError

logger = logging.getLogger(__name__)

_registered: weakref.ref | None = None
"""The ZeRO-3 config the script keeps alive (a weak reference, as transformers keeps its ``HfDeepSpeedConfig``)."""

HONOURED = {"config", "cache_dir", "force_download", "local_files_only", "token", "revision", "use_safetensors",
            "dtype", "torch_dtype", "attn_implementation", "trust_remote_code", "low_cpu_mem_usage", "device_map",
            "weights_only", "_from_auto", "_from_pipeline", "ignore_mismatched_sizes"}
"""``from_pretrained`` arguments the meta build honours (or that change nothing about it); any other argument that
is not a config attribute loads the model whole."""
ADAPTER_PATH = "_adapter_model_path"
"""Where an Auto class's ``adapter_kwargs`` name an adapter folder it is loading with its base (loaded whole)."""
HUB_ARGUMENTS = ("cache_dir", "force_download", "local_files_only", "token", "revision")


def register(reader) -> None:
    """``reader`` (a ``HfDeepSpeedConfig``) holds the run's config: while it lives and says ZeRO-3, models load on the
    meta device."""
    global _registered
    _registered = weakref.ref(reader) if reader.is_zero3() else None


@functools.cache
def config_reader():
    """accelerate's ``HfDeepSpeedConfig`` (it reads the config: ``config``, ``is_zero3()``, ``get_value(...)``),
    registering a ZeRO-3 config here where transformers' would register it for ``zero.Init``."""
    base = importlib.import_module("accelerate.utils.deepspeed").HfDeepSpeedConfig

    class HfDeepSpeedConfig(base):
        def __init__(self, config_file_or_dict):
            super().__init__(config_file_or_dict)
            register(self)

        def __reduce__(self):  # pickled (torch.save of the TrainingArguments holding it) as accelerate's reader
            return base, (self.config,)

    return HfDeepSpeedConfig


def zero3_load() -> bool:
    """Whether a ZeRO-3 config is registered and alive."""
    return _registered is not None and _registered() is not None


def streaming_from_pretrained(original):
    """``PreTrainedModel.from_pretrained`` (the bound classmethod's function, ``original(cls, path, ...)``) building
    on the meta device while :func:`zero3_load`."""

    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        if not zero3_load():
            return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        why_whole = _why_whole(cls, pretrained_model_name_or_path, model_args, kwargs)
        folder = None if why_whole else _local_folder(pretrained_model_name_or_path, kwargs)
        if folder is not None and not ((folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()):
            why_whole, folder = f"{folder} holds no {SINGLE_FILE} (nor {INDEX_FILE}) to stream", None
        model = None if folder is None else _meta_model(cls, folder, kwargs)
        if model is not None:
            why_whole = _why_not_streamed(model, folder)
        if model is None or why_whole:
            logger.warning("from_pretrained(%s) under a ZeRO-3 config loads the model whole: %s",
                           pretrained_model_name_or_path, why_whole or "no local folder")
            return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)
        return model

    return from_pretrained


def _why_whole(cls, path, model_args, kwargs) -> str | None:
    """Why this call cannot build on the meta device (None: it can)."""
    if path is None or model_args:
        return "positional model arguments" if model_args else "no path"
    if kwargs.get("device_map") not in (None, "cpu"):
        return f"device_map={kwargs['device_map']!r}"
    if kwargs.get("use_safetensors") is False:
        return "use_safetensors=False"
    config = kwargs.get("config")
    given_config = config is not None and not isinstance(config, (str, os.PathLike))
    config_names = None  # the config class's attribute names, made once where an argument needs them
    for name, value in kwargs.items():
        if name in HONOURED or value is None or (isinstance(value, (dict, list, tuple)) and not value):
            continue  # honoured, or given as nothing
        if name == "adapter_kwargs" and ADAPTER_PATH not in value:
            continue  # Auto classes pass the Hub arguments for an adapter the folder does not hold
        if given_config:
            return f"the argument {name}= beside config="
        config_names = _config_attributes(cls) if config_names is None else config_names
        if name not in config_names:
            return f"the argument {name}="
    return None


def _why_not_streamed(model: torch.nn.Module, folder: Path) -> str | None:
    """Why ``folder``'s tensors cannot be streamed into ``model`` (built on meta) by its own names (None: they can),
    asked before the engine is made: transformers renames or merges some folders' tensors while loading (a Mixtral's
    experts fused, old names), which it then does to the model loaded whole."""
    try:
        with contextlib.closing(PretrainedWeights.open(folder)) as weights:
            weights.check_model(model)
    except (WeightsError, OSError) as err:
        return f"{err} (transformers converts such a folder's tensors while loading)"
    return None


def _config_attributes(cls) -> set[str]:
    """The names a config of ``cls`` takes as ``from_pretrained`` keyword arguments (its attributes)."""
    config_class = getattr(cls, "config_class", None)
    try:
        return set(vars(config_class())) if config_class is not None else set()
    except Exception:  # noqa: BLE001 - a config that cannot be made with its defaults: every argument loads whole
        return set()


def _local_folder(path, kwargs) -> Path | None:
    """The model's local folder: ``path`` itself, or the Hub's snapshot of its config and ``.safetensors`` files."""
    if os.path.isdir(path):
        return Path(path)
    hub = importlib.import_module("huggingface_hub")
    try:
        return Path(hub.snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"],
                                          **{name: kwargs[name] for name in HUB_ARGUMENTS if name in kwargs}))
    except Exception as err:  # noqa: BLE001 - from_pretrained then loads (or fails) as it would
        logger.debug("no Hub snapshot of %s: %s", path, err)
        return None


def _meta_model(cls, folder: Path, kwargs: dict) -> torch.nn.Module:
    """``cls`` built on the meta device from ``folder``'s config (with the call's config and arguments), marked to be
    streamed from ``folder``, in eval mode as ``from_pretrained`` returns it."""
    config = kwargs.get("config")
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    model_kwargs = {}
    if config is None or isinstance(config, (str, os.PathLike)):
        overrides = {name: value for name, value in kwargs.items()
                     if name not in HONOURED and name != "adapter_kwargs" and value is not None}
        config = cls.config_class.from_pretrained(str(config or folder), trust_remote_code=kwargs.get(
            "trust_remote_code"), **overrides)
    if "attn_implementation" in kwargs:
        model_kwargs["attn_implementation"] = kwargs["attn_implementation"]
    if dtype is not None and dtype != "auto":
        model_kwargs["dtype"] = dtype
    with torch.device("meta"):
        model = cls._from_config(config, **model_kwargs)
    model.config._name_or_path = str(folder)
    setattr(model, STREAMED_FROM, str(folder))
    generation = folder / "generation_config.json"
    if generation.is_file() and getattr(model, "generation_config", None) is not None:
        model.generation_config = type(model.generation_config).from_pretrained(str(folder))
    logger.info("from_pretrained(%s) under a ZeRO-3 config: built on the meta device, its weights streamed into "
                "shards when the engine is made", folder)
    return model.eval()


def adapter_values_recorded(original):
    """``BaseTunerLayer._move_adapter_to_device_of_base_layer`` recording a new adapter's values on the modules holding
    them (:data:`~infinity.weights.adapters.DRAWN_VALUES`) before they follow a base layer on the meta device: so
    ``get_peft_model`` over a model built on meta draws them from the script's random stream, as over a model loaded
    whole (as under DeepSpeed, whose ``zero.Init`` is over by then), and the engine starts from them."""

    @functools.wraps(original)
    def _move_adapter_to_device_of_base_layer(self, adapter_name, device=None):
        if any(p.is_meta for p in self.get_base_layer().parameters(recurse=False)):
            for part in self.adapter_layer_names:
                container = getattr(self, part, None)
                if isinstance(container, torch.nn.ModuleDict) and adapter_name in container:
                    for holder in container[adapter_name].modules():  # kept on the module: .to(meta) remakes params
                        drawn = {name: param.detach().float().clone()
                                 for name, param in holder.named_parameters(recurse=False) if not param.is_meta}
                        if drawn:
                            setattr(holder, DRAWN_VALUES, drawn)
        return original(self, adapter_name, device)

    return _move_adapter_to_device_of_base_layer
