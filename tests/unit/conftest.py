"""Fixtures shared by unit tests: the kernel's C++ backend, and runs of `infinity train`."""

from __future__ import annotations

import os
import shutil
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


@pytest.fixture(scope="module")
def cpp_ready():
    """The C++ kernel is built and chosen (skipped where the torch backend is forced or no compiler exists)."""
    import infinity.kernels as kernels
    from infinity.kernels import extension

    if os.environ.get(kernels.BACKEND_ENV, "").strip().lower() == "torch":
        pytest.skip(f"{kernels.BACKEND_ENV}=torch")
    if shutil.which(extension._compiler()) is None:
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    assert kernels.backend() == "cpp", f"the kernel did not build: {extension.KERNEL.error}"
