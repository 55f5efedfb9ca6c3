"""A Hugging Face script run by ``infinity deepspeed``: a ``Trainer`` with ``--deepspeed ds.json``, or its own loop.

A Hugging Face script launched as ``deepspeed train.py --deepspeed ds.json ...`` hands its DeepSpeed JSON to
``TrainingArguments(deepspeed=...)``, and the stock Trainer then trains through accelerate's DeepSpeed plugin,
which needs DeepSpeed installed. Under ``infinity deepspeed train.py --deepspeed ds.json ...`` the same script
runs unchanged under the engine instead:

* ``TrainingArguments`` (and its subclasses: ``Seq2SeqTrainingArguments``, TRL's configs) take the ``deepspeed``
  value as the engine's config: it is kept as ``args.infinity_config`` and ``args.deepspeed`` reads None, so
  neither transformers nor accelerate sets DeepSpeed up (without CUDA they take ``use_cpu``, so the processes
  are one distributed run, as under DeepSpeed's CPU accelerator). Without ``--deepspeed``, the config
  ``infinity accelerate launch`` passes in accelerate's variables (its yaml's DeepSpeed part) is taken so;
* ``transformers.Trainer`` is :class:`infinity.hf.Trainer`, which reads ``args.infinity_config`` when the script
  passes no ``infinity_config=``. A trainer class the script or a library derives from ``transformers.Trainer``
  after that (TRL's ``SFTTrainer``, ``Seq2SeqTrainer``, the script's own) derives from it too;
* ``HfDeepSpeedConfig(ds_config)``, which a script with its own loop makes before ``from_pretrained`` (and
  accelerate's ``zero3_init_flag``), reads the config and registers it with the engine's loader, not
  transformers' ``zero.Init``;
* while a ZeRO-3 config is registered (by ``HfDeepSpeedConfig``, or by ``TrainingArguments`` taking one),
  ``from_pretrained`` builds the model on the meta device and the engine streams its weights into shards, as
  DeepSpeed's ``zero.Init`` keeps any process from holding it whole; ``peft`` adapters made over it keep the values
  they were drawn with (:mod:`~infinity.deepspeed.hf_meta_load`).

Each is patched as its module finishes importing (:class:`AfterImport`), so a script that never imports them
pays nothing; nothing is patched outside ``infinity deepspeed`` and ``infinity accelerate launch``.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.abc
import logging
import os
import sys
from typing import Callable

import torch

import infinity.hf as hf
from infinity.deepspeed import hf_meta_load
from infinity.hf.trainer_config import ARGS_ATTRIBUTE

logger = logging.getLogger(__name__)

ACCELERATE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"
"""accelerate's variable saying the run is DeepSpeed's (``accelerate launch`` with a DeepSpeed config sets it)."""
OURS = "infinity.hf.trainer"
"""The engine's Trainer module, which derives from transformers' as it loads."""


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then ``patch(module)``."""

    def __init__(self, loader, patch: Callable):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._patch(module)


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` once the module ``name`` has been executed (found by the finders after this
    one, loaded by its own loader)."""

    def __init__(self, patches: dict[str, Callable]):
        self.patches = patches

    def find_spec(self, fullname: str, path=None, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def _take_deepspeed_argument(module) -> None:
    """``TrainingArguments.__post_init__`` keeps ``deepspeed`` as the engine's config and sets DeepSpeed up nowhere."""
    arguments = module.TrainingArguments
    original = arguments.__post_init__

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        given = self.deepspeed or _config_from_accelerate_launch()
        if given:
            setattr(self, ARGS_ATTRIBUTE, given)
            # kept with the arguments, as transformers keeps its config: a ZeRO-3 one makes from_pretrained stream
            self.infinity_config_reader = hf_meta_load.config_reader()(given)
            self.deepspeed = None  # transformers and accelerate: no DeepSpeed plugin, no HfDeepSpeedConfig
            if not torch.cuda.is_available():
                # DeepSpeed's CPU accelerator makes the Trainer's run distributed over the launcher's processes;
                # without the plugin transformers does so on a CPU only with use_cpu (else each process would
                # see a world of one: its own batch size for the whole run's, all the data its own)
                self.use_cpu = True
            logger.info("--deepspeed %s: the engine's config (infinity deepspeed); DeepSpeed itself is not used",
                        given if isinstance(given, str) else "(a dict)")
        original(self, *args, **kwargs)

    arguments.__post_init__ = __post_init__


def _config_from_accelerate_launch() -> dict | None:
    """The DeepSpeed config ``infinity accelerate launch`` hands the script in accelerate's variables
    (``ACCELERATE_USE_DEEPSPEED``, with a config file or the yaml's fields), as accelerate's ``DeepSpeedPlugin``
    reads them; None where there is none. Once read, ``ACCELERATE_USE_DEEPSPEED`` reads false in this process, so the
    Trainer's accelerator sets no DeepSpeed up: the engine, driven by the Trainer, is the run's DeepSpeed."""
    if os.environ.get(ACCELERATE_DEEPSPEED, "false").lower() != "true":
        return None
    plugin = importlib.import_module("accelerate.utils").DeepSpeedPlugin()
    os.environ[ACCELERATE_DEEPSPEED] = "false"
    return copy.deepcopy(plugin.deepspeed_config)


def _engine_trainer(module) -> None:
    """``transformers.trainer.Trainer`` (and so ``transformers.Trainer``) is the engine's."""
    ours_module = sys.modules.get(OURS)
    if ours_module is not None and not hasattr(ours_module, "Trainer"):
        return  # infinity.hf.trainer is importing this module to derive from it: patched once it is done
    stock = module.Trainer
    ours = hf.Trainer  # imports infinity.hf.trainer (deriving from the class just loaded) where not yet done
    if not issubclass(ours, stock):
        raise RuntimeError(f"infinity.hf.Trainer does not derive from this process's transformers.trainer.Trainer "
                           f"({stock!r})")
    _set_name(module, "transformers", "Trainer", ours)


def _config_without_deepspeed(module) -> None:
    """``HfDeepSpeedConfig(ds_config)`` (a script's own loop with a Hugging Face model) is accelerate's class of that
    name, which transformers' derives from where DeepSpeed is installed: it reads the config (``config``,
    ``is_zero3()``, ``get_value(...)``) and registers a ZeRO-3 one with the engine's loader
    (:func:`~infinity.deepspeed.hf_meta_load.config_reader`), not with transformers' ``zero.Init``."""
    _set_name(module, "transformers.integrations", "HfDeepSpeedConfig", hf_meta_load.config_reader())


def _streaming_from_pretrained(module) -> None:
    """``from_pretrained`` under a ZeRO-3 config builds on the meta device (:mod:`~infinity.deepspeed.hf_meta_load`)."""
    model_class = module.PreTrainedModel
    original = model_class.__dict__["from_pretrained"].__func__
    model_class.from_pretrained = classmethod(hf_meta_load.streaming_from_pretrained(original))


def _set_name(module, package: str, name: str, value) -> None:
    """``module.name`` is ``value``, and so is ``package.name`` where the package is loaded: it keeps the names it
    resolves lazily from its modules."""
    setattr(module, name, value)
    top = sys.modules.get(package)
    if top is not None:
        setattr(top, name, value)


def _after_ours(module) -> None:
    """infinity.hf.trainer is loaded: transformers' Trainer, which it imported, is patched now."""
    _engine_trainer(sys.modules["transformers.trainer"])


def _adapter_values_recorded(module) -> None:
    """peft's new adapters over a base layer on the meta device keep the values they were drawn with, for the engine
    (:mod:`~infinity.deepspeed.hf_meta_load`)."""
    layer = module.BaseTunerLayer
    layer._move_adapter_to_device_of_base_layer = hf_meta_load.adapter_values_recorded(
        layer._move_adapter_to_device_of_base_layer)


PATCHES = {"transformers.training_args": _take_deepspeed_argument, "transformers.trainer": _engine_trainer,
           "transformers.integrations.deepspeed": _config_without_deepspeed,
           "transformers.modeling_utils": _streaming_from_pretrained,
           "peft.tuners.tuners_utils": _adapter_values_recorded, OURS: _after_ours}


def install() -> None:
    """From now on in this process, a Trainer script's ``--deepspeed`` config and ``transformers.Trainer`` are the
    engine's (idempotent). Modules already imported are patched now."""
    if any(isinstance(finder, AfterImport) for finder in sys.meta_path):
        return
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, AfterImport(PATCHES))
