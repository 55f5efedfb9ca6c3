"""What ``pip install .`` installs: every package of the source tree (an editable install or a checkout on the path
finds a package that ``pyproject.toml`` leaves out; a wheel does not have it)."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_of_the_tree_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    in_tree = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            in_tree.add(".".join((name, *parts)))
    missing = sorted(in_tree - set(setuptools["packages"]))
    assert not missing, f"pyproject.toml's packages leave out {', '.join(missing)}: `pip install .` would not have them"
