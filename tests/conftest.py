import os
import sys

# tests/ holds shared helpers (tests/helpers.py) imported by unit and distributed tests.
sys.path.insert(0, os.path.dirname(__file__))
# Keep the two cores for the test itself; torch's default may oversubscribe in spawned ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402  (after the path and environment above, which the imports below need)

from infinity.placement import split_choice  # noqa: E402
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


@pytest.fixture(autouse=True)
def _no_cached_machine_figures(monkeypatch):
    """``offload_optimizer.device: auto`` chooses its split with the figures ``infinity bench --machine`` cached on
    this machine, if any: the tests do not depend on them (a test of the choice gives its own)."""
    monkeypatch.setattr(split_choice, "split_figures", lambda: None)
