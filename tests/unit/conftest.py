"""Fixtures shared by the unit tests of `infinity train`."""

from __future__ import annotations

import tempfile

import pytest


@pytest.fixture
def fresh_cwd(tmp_path_factory, monkeypatch):
    """Runs write their metrics under ./runs: keep them out of the checkout."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture
def no_work(monkeypatch, tmp_path):
    """Fail the test if training would start: no model built, no swap folder made."""
    from infinity.commands import train

    def forbidden(*a, **k):
        raise AssertionError("work started before the bad input was reported")
    monkeypatch.setattr(train, "_build_model", forbidden)
    monkeypatch.setattr(tempfile, "mkdtemp", forbidden)
    return tmp_path
