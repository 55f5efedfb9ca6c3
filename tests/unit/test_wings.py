"""The package's shape: ``infinity/`` is a tower of wings ordered by the life of a parameter. A module imports
only its own wing and the wings before it (``storage`` and ``kernels`` below them all), at the top of the file
and never hidden in a function or under ``TYPE_CHECKING``; the modules' imports form no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.device_independent  # the distinct-device pass leaves it out

REPO = Path(__file__).resolve().parents[2]

WINGS = ("runtime", "config", "models", "placement", "params", "tiling", "grads", "optim", "checkpoint", "weights",
         "engine", "hf", "deepspeed", "train", "commands")
"""The wings in order: each may import the ones before it, none after."""

BELOW_ALL = ("infinity.storage", "infinity.kernels")
"""Imported by any wing; they import no wing themselves."""

ENTRY_POINTS = ("infinity.cli",)
"""Top-level modules above every wing."""

NARROW_SEAMS = {"infinity.checkpoint": ("runtime", "config", "tiling", "checkpoint"),
                "infinity.weights.export": ("runtime", "config", "models", "tiling", "checkpoint", "weights")}
"""Modules that see a run only through a seam (checkpoints, state dicts and exports through ``ShardSource``),
and the only wings they may import."""


ROOTS = {"infinity": "infinity", "storage": "infinity.storage", "kernels": "infinity.kernels"}
"""Source folder -> import name (pyproject's package-dir)."""


def _module_name(path: Path) -> str:
    folder, *parts = path.relative_to(REPO).with_suffix("").parts
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([ROOTS[folder], *parts])


def _modules(*folders: str) -> dict[str, Path]:
    return {_module_name(path): path for folder in (folders or ("infinity",))
            for path in sorted((REPO / folder).rglob("*.py"))}


MODULES = set(_modules(*ROOTS))


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, at the top) for every import of an ``infinity`` module in the file; relative imports are
    resolved. "At the top" is a statement of the module itself, not inside a function, class or ``if``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = set(map(id, tree.body))
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from package import module` names the module; `from module import name` names the module
            targets = sorted({f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                              for alias in node.names})
        else:
            continue
        for target in targets:
            if target == "infinity" or target.startswith("infinity."):
                found.append((target, node.lineno, id(node) in top))
    return found


def _wing(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or module in ENTRY_POINTS:
        return None
    return parts[1] if parts[1] in WINGS else None


def test_every_module_of_the_package_is_in_a_wing_or_an_entry_point():
    loose = [name for name in _modules()
             if name not in ("infinity", *ENTRY_POINTS) and _wing(name) is None]
    assert not loose, f"modules in no wing (add them to one of {WINGS}): {loose}"


@pytest.mark.parametrize("wing", WINGS)
def test_a_wing_imports_only_the_wings_before_it(wing):
    allowed = set(WINGS[:WINGS.index(wing) + 1])
    late = []
    for name, path in _modules().items():
        if _wing(name) != wing:
            continue
        for target, line, _ in _imports(path):
            if target == "infinity" or target.startswith(BELOW_ALL):
                continue
            target_wing = _wing(target)
            if target_wing is not None and target_wing not in allowed:
                late.append(f"{path.relative_to(REPO)}:{line} imports {target} (wing {target_wing!r})")
    assert not late, "\n".join(late)


@pytest.mark.parametrize("prefix", sorted(NARROW_SEAMS))
def test_the_checkpoint_seam_imports_none_of_the_engines_parts(prefix):
    allowed = set(NARROW_SEAMS[prefix])
    modules = [(name, path) for name, path in _modules().items() if name == prefix or name.startswith(prefix + ".")]
    assert modules, prefix
    wide = [f"{path.relative_to(REPO)}:{line} imports {target}"
            for name, path in modules for target, line, _ in _imports(path)
            if _wing(target) is not None and _wing(target) not in allowed]
    assert not wide, "\n".join(wide)


def test_no_import_of_the_package_is_hidden_in_a_function_or_under_type_checking():
    # `infinity/__init__.py` resolves its public names lazily through importlib, so `import infinity` stays light.
    hidden = [f"{path.relative_to(REPO)}:{line} imports {target} below the top of the file"
              for name, path in _modules(*ROOTS).items() if name != "infinity"
              for target, line, at_top in _imports(path) if not at_top]
    assert not hidden, "\n".join(hidden)


def test_the_package_has_no_import_cycle():
    modules = _modules(*ROOTS)
    graph = {name: sorted({t for t, _, _ in _imports(path) if t in modules and t != name})
             for name, path in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in graph:
        if node not in state:
            cycle = visit(node)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("library", ["storage", "kernels"])
def test_storage_and_kernels_import_no_wing(library):
    wide = [f"{path.relative_to(REPO)}:{line} imports {target}"
            for path in _modules(library).values()
            for target, line, _ in _imports(path)
            if target.startswith("infinity.") and not target.startswith(f"infinity.{library}")]
    assert not wide, "\n".join(wide)
