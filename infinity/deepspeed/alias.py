"""``import deepspeed`` answered by :mod:`infinity.deepspeed`: a finder placed first on ``sys.meta_path`` maps
``deepspeed`` and each ``deepspeed.X`` to ``infinity.deepspeed.X``, so a DeepSpeed script runs unchanged
(``infinity deepspeed script.py``). A ``deepspeed.X`` the door does not offer fails to import naming it."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import sys

ALIASED = "deepspeed"
TARGET = "infinity.deepspeed"
DOOR_VERSION = "0.14.0+infinity"
"""What ``importlib.metadata.version("deepspeed")`` answers under the alias: the DeepSpeed release whose API the door
follows, marked as ours. Libraries that gate a feature on a newer DeepSpeed (accelerate's tensor and sequence
parallelism, ``engine.compile``) refuse it by name rather than calling what the door lacks."""


class _DoorDistribution(importlib.metadata.Distribution):
    """The ``deepspeed`` distribution as ``importlib.metadata`` sees it under the alias: name and version only."""

    def read_text(self, filename):
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: {ALIASED}\nVersion: {DOOR_VERSION}\n"
                    f"Summary: DeepSpeed's API answered by {TARGET} (zero-infinity)\n")
        return None

    def locate_file(self, path):
        return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self._target = target

    def create_module(self, spec):
        return importlib.import_module(self._target)  # the module itself, under both names

    def exec_module(self, module) -> None:
        """Nothing to run: the target module ran when it was imported."""


class DeepSpeedAlias(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed[.X]`` as ``infinity.deepspeed[.X]``."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != ALIASED and not fullname.startswith(ALIASED + "."):
            return None
        aliased = TARGET + fullname[len(ALIASED):]
        if importlib.util.find_spec(aliased) is None:
            raise ModuleNotFoundError(f"No module named {fullname!r}: infinity's DeepSpeed door ({TARGET}) does not "
                                      f"offer it", name=fullname)
        return importlib.util.spec_from_loader(fullname, _AliasLoader(aliased))

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        """``importlib.metadata``'s ``deepspeed``: libraries that ask whether DeepSpeed is installed, and which
        version, before they ``import deepspeed`` (accelerate, transformers) get the door."""
        if context.name is None or context.name.replace("-", "_").lower() == ALIASED:
            return iter([_DoorDistribution()])
        return iter([])


def install() -> None:
    """From now on in this process, ``import deepspeed`` is :mod:`infinity.deepspeed` (idempotent)."""
    if not any(isinstance(finder, DeepSpeedAlias) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedAlias())
    for name in [n for n in sys.modules if n == ALIASED or n.startswith(ALIASED + ".")]:
        del sys.modules[name]  # a real DeepSpeed imported before: its modules are not the ones to use
