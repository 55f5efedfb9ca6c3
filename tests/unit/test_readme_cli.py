"""The README's CLI synopsis names every flag of every command (so a new flag cannot be left out of it)."""

from pathlib import Path

import pytest

from infinity.cli import COMMANDS, build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def _synopsis() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("## The CLI")
    return text[start:text.index("\n## ", start + 1)]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_is_in_the_readme_synopsis(command):
    parser = build_parser([command])
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    flags = {opt for action in sub._actions for opt in action.option_strings if opt.startswith("--") and opt != "--help"}
    synopsis = _synopsis()
    assert f"infinity {command}" in synopsis
    missing = sorted(f for f in flags if f not in synopsis)
    assert not missing, f"README's CLI synopsis lacks {command} flag(s): {', '.join(missing)}"
