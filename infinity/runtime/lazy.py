"""Names a package resolves on first use (PEP 562), so that importing it stays light: ``import infinity`` does not
build the engine's modules, and ``infinity.hf`` needs ``transformers`` only when its Trainer is asked for."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_names(package: str, table: dict[str, tuple[str, str]], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``table`` maps each name to (module, attribute), imported on
    first use and kept in ``namespace`` (the package's globals) from then on."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = table[name]
        value = getattr(importlib.import_module(module), attr)
        namespace[name] = value
        return value

    return __getattr__
