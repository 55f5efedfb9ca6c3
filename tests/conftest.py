import os
import sys

# tests/ holds shared helpers (tests/helpers.py) imported by unit and distributed tests.
sys.path.insert(0, os.path.dirname(__file__))
# Keep the two cores for the test itself; torch's default may oversubscribe in spawned ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402  (after the path and environment above, which the imports below need)

from infinity.placement import split_choice  # noqa: E402
from infinity.runtime import machine_figures  # noqa: E402
from infinity.placement.placement import distinct_device_requested  # noqa: E402

DEVICE_INDEPENDENT = "device_independent"
"""The marker of a test module whose assertions cannot depend on where device memory lives (the storage engine,
the kernels, file safety): ``make test``'s second pass, with device memory kept apart, leaves it out."""


def pytest_configure(config):
    config.addinivalue_line("markers", f"{DEVICE_INDEPENDENT}: the same in the distinct-device pass; run once")


def pytest_collection_modifyitems(config, items):
    if not distinct_device_requested():
        return
    same = [item for item in items if item.get_closest_marker(DEVICE_INDEPENDENT)]
    if same:
        config.hook.pytest_deselected(items=same)
        items[:] = [item for item in items if not item.get_closest_marker(DEVICE_INDEPENDENT)]


USER_CACHE_HOME = os.environ.get("XDG_CACHE_HOME")
"""The cache folder the session started with: a test that sets another tests the cache itself."""


@pytest.fixture(scope="session")
def _session_figures_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("machine-figures")


@pytest.fixture(autouse=True)
def _machine_figures_of_the_session(monkeypatch, _session_figures_dir):
    """The machine's figures a test reads, or measures and caches (``bench_gpu.py`` does where none are cached), are
    the session's, never the user's ``~/.cache``: a measurement under the suite's load, on one thread
    (``OMP_NUM_THREADS=1`` above), would otherwise become what ``infinity train`` and ``estimate`` predict with."""
    user_cache_path = machine_figures.cache_path

    def cache_path(host=None):
        if os.environ.get("XDG_CACHE_HOME") != USER_CACHE_HOME:
            return user_cache_path(host)  # the test's own cache folder
        return _session_figures_dir / user_cache_path(host).name

    monkeypatch.setattr(machine_figures, "cache_path", cache_path)


@pytest.fixture(autouse=True)
def _no_cached_machine_figures(monkeypatch):
    """``offload_optimizer.device: auto`` chooses its split with the figures ``infinity bench --machine`` cached on
    this machine, if any: the tests do not depend on them (a test of the choice gives its own)."""
    monkeypatch.setattr(split_choice, "split_figures", lambda: None)
